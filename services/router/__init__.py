"""The router service: see server.py."""
