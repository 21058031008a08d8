"""The pretrain scripts' front: flags, ``--help`` and user errors before the heavy imports.

:func:`run_script` parses and checks the flags with pure Python (:mod:`.arguments`; torch is
imported only to ask whether CUDA is available), so ``--help`` and every flag error come
before torch.distributed, megatron-core and the task's module are imported; then it loads the
task and trains (:func:`.loop.run_training`).

**User errors** — a command line argparse rejects, a broken rule, a ``--data-path`` without
its files (exit status 2), a checkpoint that does not fit (exit status 1) — are printed once
for the job, as ``PROG: error: ...`` on stderr, without argparse's usage block. The flags are
checked alike on every rank, so rank 0 prints (``--help`` too; the other ranks stay quiet).
Under torchrun (``TORCHELASTIC_RUN_ID`` set) the other ranks wait up to
:data:`PEER_REPORT_WAIT_S` seconds before exiting: torchrun ends them as soon as rank 0 has
exited, so its report names rank 0's exit as the first failure and no rank is stopped before
it has printed; a rank still running after the wait found an error rank 0 did not (a file
only it cannot read, say) and prints it itself, with its rank. The rank that prints also hands
the message to torchrun (its error file), so torchrun's failure report, which follows, ends
with it instead of a link to torch's documentation.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
import warnings
from typing import TYPE_CHECKING, Callable, Optional, Sequence

if TYPE_CHECKING:
    import torch

from ..megatron_args import BitPipeConfigError
from ..usage import USAGE_EXIT_STATUS, UsageError, hand_to_torchrun, quiet_on_broken_pipe, reader_gone
from .arguments import parse_args
from ..checkpoint_rules import CheckpointError
from .task import TaskArguments

__all__ = [
    "PEER_REPORT_WAIT_S", "exit_status", "ignore_dependency_warnings", "report_user_error", "run_script",
]  # fmt: skip

#: seconds a rank other than 0 waits under torchrun for the job to end before it prints a
#: user error itself (see the module docstring)
PEER_REPORT_WAIT_S = 30.0
#: exit status of a checkpoint that cannot be loaded into the run
CHECKPOINT_EXIT_STATUS = 1
#: megatron-core's import-time warnings about each optional kernel library it does not find
#: (apex, Transformer Engine), one per module and rank; the run's own log says what runs
MISSING_KERNEL_WARNING = r".*(Apex|Transformer Engine).* (is|are) not installed"


#: torch 2.13's deprecation of the tensor collectives megatron-core calls (its distributed
#: optimizer and gradient buffers), once per rank
DEPRECATED_COLLECTIVE_WARNING = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def ignore_dependency_warnings() -> None:
    """Drop, in this process, the warnings that concern megatron-core, not the user:
    :data:`MISSING_KERNEL_WARNING` (call before megatron-core is imported) and
    :data:`DEPRECATED_COLLECTIVE_WARNING`, each by message and category; every other warning
    still shows. (The CPU layer, which entry points opt into, drops the ones that only make
    sense on a GPU.)"""
    warnings.filterwarnings("ignore", message=MISSING_KERNEL_WARNING, category=UserWarning)
    warnings.filterwarnings("ignore", message=DEPRECATED_COLLECTIVE_WARNING, category=FutureWarning)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def report_user_error(prog: str, error: Exception) -> None:
    """Print ``error`` once for the job (see the module docstring)."""
    message = str(error) if isinstance(error, UsageError) else f"{prog}: error: {error}"
    rank = _rank()
    if rank != 0:
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            return
        time.sleep(PEER_REPORT_WAIT_S)  # torchrun ends this rank here when rank 0 reported
        message = f"[rank {rank}] {message}"
    print(message, file=sys.stderr, flush=True)
    hand_to_torchrun(message)


def run_script(
    arguments: TaskArguments,
    load_task: Callable[[], object],
    argv: Optional[Sequence[str]] = None,
    *,
    cpu_fallback: Optional[Callable[[], Optional[torch.device]]] = None,
    prog: Optional[str] = None,
) -> int:
    """The pretrain scripts' entry point: parse and check ``argv`` (default ``sys.argv[1:]``)
    with ``arguments``' flags, then train the task ``load_task()`` returns (a
    :class:`~.task.PretrainTask`, imported only now; for a task already loaded,
    ``run_script(task, lambda: task, ...)``). Returns the exit status: 0 done, 2 bad flags, 1 unusable checkpoint; other failures
    propagate, so torchrun reports the traceback and ends the job. ``prog`` names the script
    in messages (default: ``sys.argv[0]``'s file name)."""
    prog = prog or os.path.basename(sys.argv[0])

    def train() -> None:
        quiet = contextlib.redirect_stdout(io.StringIO()) if _rank() != 0 else contextlib.nullcontext()
        with quiet:  # --help: rank 0 prints it
            args = parse_args(arguments, argv, prog=prog)
        from .loop import run_training  # torch.distributed and megatron-core

        run_training(load_task(), args, cpu_fallback=cpu_fallback)

    return exit_status(prog, train)


@quiet_on_broken_pipe
def exit_status(prog: str, work: Callable[[], None]) -> int:
    """Run ``work`` and return the scripts' exit status: 0 done, 2 bad flags or input
    (UsageError, BitPipeConfigError), 1 a checkpoint that does not fit (CheckpointError), each
    reported as one line on stderr (:func:`report_user_error`, ``prog`` naming the script);
    other failures propagate, so torchrun reports the traceback and ends the job.

    A reader of the output that goes away (``| head -2``) ends the job quietly, with status 0
    on every rank: rank 0, the one that prints, at its next line
    (:func:`~megatron_bitpipe.usage.quiet_on_broken_pipe`), the other ranks at their next
    communication with a rank that has ended (:func:`_ended_with_the_reader`)."""
    try:
        work()
    except (UsageError, BitPipeConfigError) as error:
        report_user_error(prog, error)
        return USAGE_EXIT_STATUS
    except CheckpointError as error:
        report_user_error(prog, error)
        return CHECKPOINT_EXIT_STATUS
    except Exception as error:
        if not _ended_with_the_reader(error):
            raise
    return 0


def _ended_with_the_reader(error: Exception) -> bool:
    """Whether ``error`` ends this rank because the job's output reader has gone away: a
    RuntimeError (what torch.distributed raises when a peer has closed its connections) while
    standard output, which torchrun's ranks share, is a pipe with no reader — rank 0 has
    ended quietly, and the peers with it, not a failure to report."""
    return isinstance(error, RuntimeError) and reader_gone()

