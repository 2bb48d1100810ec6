"""Where the repository is, for tests that run its scripts or read its deploy files (one home for the path)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
