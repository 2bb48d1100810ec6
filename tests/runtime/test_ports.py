"""The port handed to a process that binds it later lies outside the range outgoing connections take theirs
from, so no client connection can take it between the pick and the bind."""

from __future__ import annotations

import socket

from services.runtime import ports


def test_a_picked_port_is_below_the_ephemeral_range_and_binds() -> None:
    low = ports._ephemeral_low()
    picked = {ports.free_port() for _ in range(20)}
    assert all(ports.LOW <= p < low for p in picked)
    assert len(picked) > 1  # random, so two pickers at once rarely meet
    for p in picked:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_with_every_port_below_the_range_taken_it_falls_back_to_the_kernel(monkeypatch) -> None:
    monkeypatch.setattr(ports, "LOW", ports.HIGH)  # an empty range: nothing to pick from
    p = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))
    assert p >= ports._ephemeral_low()  # the kernel's own pick
