"""The prefill service: see server.py."""
