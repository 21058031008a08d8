"""Helper processes that end with the process that started them.

A process killed without clean-up (SIGKILL: an OOM kill, a crash) leaves the processes it
started running, re-parented to init, still holding its standard output and error; under SLURM
the job step then waits for that output to close (slurmstepd gives up after 60 s) and the
processes stay behind on the node. On Linux a child asks the kernel to kill it when the thread
that started it ends (``PR_SET_PDEATHSIG``); elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.managers
import os
import signal
import sys

__all__ = ["end_with_parent", "queue_ending_with_this_process"]

#: prctl's option: the signal this process gets when the thread that started it ends
PR_SET_PDEATHSIG = 1


def end_with_parent(parent: int) -> None:
    """In a child process: be killed with SIGKILL when the thread that started it ends, and exit
    at once when ``parent`` (its pid) has already ended. Linux only; a no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)


def queue_ending_with_this_process():
    """A multiprocessing queue (a manager's proxy, usable from processes this one starts)
    served by a spawned manager process that ends with this process's current thread."""
    manager = multiprocessing.managers.SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(end_with_parent, (os.getpid(),))
    return manager.Queue()  # the proxy keeps the manager, and so its process, for this process's life
