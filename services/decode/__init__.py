"""The decode service: see server.py."""
