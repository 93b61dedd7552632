"""A child of `tandem up` dies with it: `tandem up` (services.up.processes) names itself in
the child's environment, and the child asks the kernel to SIGKILL it when that process dies
(PR_SET_PDEATHSIG), at its own start rather than between fork and exec: Python code there (a
preexec_fn) can crash the child of a threaded parent. A SIGKILLed supervisor so leaves no
orphans. Standard library only: the Redis child imports it too."""

from __future__ import annotations

import os
import signal
import sys

SUPERVISOR_ENV = "TANDEM_SUPERVISOR_PID"  # the supervisor's pid, set for its children
_PR_SET_PDEATHSIG = 1


def die_with_supervisor() -> None:
    """With SUPERVISOR_ENV set, be SIGKILLed when that process dies; if it died already (before
    this call), exit now. Nothing elsewhere, or off Linux."""
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if not supervisor or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(supervisor):
        os._exit(1)
