"""A TCP port to hand to a process that binds it later (etcd, a frontend started on a port chosen for it).

Asking the kernel for port 0 and closing the socket gives a port from the *ephemeral* range, the same range
the kernel draws the source port of every outgoing connection from; between the pick and the bind any gRPC or
etcd client on the machine may take it (EADDRINUSE at the bind, seen under CI's load). So the pick is made
below that range, where the kernel never assigns a port by itself, at random (two pickers at once rarely meet),
and checked free by binding it once. A process that can bind port 0 itself and report the port should do that
instead (the workers and the planner register the port they bound).
"""

from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
# below Linux's default ephemeral range (32768-60999) and above the well-known and most registered ports
LOW, HIGH = 20000, 32767


def _ephemeral_low() -> int:
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return HIGH + 1


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port free on `host` now, outside the range outgoing connections take theirs from (falls back to the
    kernel's own choice where no such port is free)."""
    top = min(HIGH, _ephemeral_low() - 1)
    rng = random.Random()
    for _ in range(tries if top > LOW else 0):
        port = rng.randint(LOW, top)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
