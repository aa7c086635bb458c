"""Linux's parent-death signal: a child asks the kernel (prctl PR_SET_PDEATHSIG) for a signal when the thread
that started it exits, so that a process killed outright does not leave the processes below it running. Asked
for by every child process of the pipeline (child_process.py).
"""

from __future__ import annotations

import ctypes

PR_SET_PDEATHSIG = 1


def signal_on_parent_death(sig: int) -> bool:
    """Ask for `sig` when the parent dies; False where there is no prctl (not Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig) == 0
    except (OSError, AttributeError):  # no C library to load, or one without prctl
        return False
