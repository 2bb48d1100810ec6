"""`starts_processes`: marks a fixture that starts a process, so every test using it is a `cluster` test.

    @pytest.fixture(scope="module")
    @starts_processes
    def cluster(...): ...

tests/conftest.py gives the `cluster` mark to each test that depends on such a fixture (directly or through other
fixtures), so `make test-fast` leaves them out without a mark on every test.
"""

from __future__ import annotations

from typing import TypeVar

F = TypeVar("F")

ATTR = "_rackserve_starts_processes"


def starts_processes(fixture_fn: F) -> F:
    setattr(fixture_fn, ATTR, True)
    return fixture_fn
