"""`python -m services.launcher.lifeline LAUNCHER_PID CMD...`: run CMD so that it is stopped when `rackserve up` dies.

`up` starts its children in sessions of their own (Ctrl-C reaches only the launcher, which stops them in order),
so a launcher killed outright (SIGKILL, the OOM killer) would leave every child running: a whole cluster nobody
owns, holding its ports. This shim asks the kernel to send the process SIGTERM when its parent dies
(PR_SET_PDEATHSIG, kept across exec), checks the launcher did not die before that took effect, and becomes CMD.
SIGTERM is what `up` itself sends: a worker drains, etcd stops. On systems without prctl (not Linux) it only
execs CMD.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    launcher, cmd = int(argv[0]), argv[1:]
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != launcher:  # it died before the request took effect: nobody would stop this one
            sys.exit(f"rackserve up (pid {launcher}) is gone; not starting {cmd[0]}")
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
