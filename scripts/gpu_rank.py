#!/usr/bin/env python
"""Per-rank wrapper of ``scripts/gpu_check.py``'s runs of several ranks on one GPU.

    python -m torch.distributed.run --standalone --nproc-per-node 4 scripts/gpu_rank.py \\
        [--nccl-hostid-per-rank] scripts/pretrain_gpt.py --pipeline-model-parallel-size 4 ...

Runs the target script as ``__main__`` (``runpy``) in this process, with ``sys.argv`` set to
the target and its arguments, after two things that must happen before torch or NCCL start:

* ``--nccl-hostid-per-rank``: sets ``NCCL_HOSTID`` to ``gpu-check-rank-<LOCAL_RANK>``, so that
  NCCL takes every rank for a host of its own (NCCL refuses two ranks of one host on one GPU;
  between "hosts" it uses its NET transport, over loopback with ``NCCL_SOCKET_IFNAME=lo``).
  NCCL >= 2.30 does not need it: ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (set by gpu_check.py for all
  ranks) lets several ranks of one host share a GPU.
* registers :mod:`faulthandler` on ``SIGUSR1``: gpu_check.py sends it to every rank of a run
  that ran past its timeout, so the log shows where each rank waited, before it kills them.
  With ``GPU_RANK_STACKS_DIR`` set, each rank writes its stacks to ``rank-<RANK>.txt`` there
  (gpu_check.py copies them into its log one rank after another; ranks that wrote to one shared
  stream would interleave their lines); otherwise to standard error.

The target's exit status is this process's exit status.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys
from typing import List

HOSTID_FLAG = "--nccl-hostid-per-rank"
#: environment variable: the directory for each rank's SIGUSR1 stack dump (``rank-<RANK>.txt``)
STACKS_VARIABLE = "GPU_RANK_STACKS_DIR"
USAGE = f"usage: gpu_rank.py [{HOSTID_FLAG}] SCRIPT [ARGS ...]"


def nccl_hostid(local_rank: int) -> str:
    """The ``NCCL_HOSTID`` of a local rank: distinct per rank."""
    return f"gpu-check-rank-{local_rank}"


def stacks_file(directory: str, rank: int) -> str:
    """Where rank ``rank`` dumps its stacks under ``directory``."""
    return os.path.join(directory, f"rank-{rank}.txt")


def main(argv: List[str]) -> None:
    hostid = bool(argv) and argv[0] == HOSTID_FLAG
    if hostid:
        argv = argv[1:]
    if not argv or argv[0].startswith("-"):
        sys.exit(f"gpu_rank.py: error: no target script\n{USAGE}")
    if hostid:
        os.environ["NCCL_HOSTID"] = nccl_hostid(int(os.environ.get("LOCAL_RANK", "0")))
    stacks = sys.stderr
    if os.environ.get(STACKS_VARIABLE):
        # kept open (referenced here) for as long as the target runs: faulthandler writes to its fd
        stacks = open(stacks_file(os.environ[STACKS_VARIABLE], int(os.environ.get("RANK", "0"))), "w")
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    target = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
