"""Run an unmodified Megatron-LM training script with the plugin installed (the runtime route).

    python -m megatron_bitpipe.run <Megatron-LM>/pretrain_gpt.py [Megatron-LM flags] --pipeline-schedule bitpipe
    torchrun --nproc-per-node 8 -m megatron_bitpipe.run <Megatron-LM>/pretrain_gpt.py [...]

The script is found as given or, if that path does not exist, under ``$MEGATRON_LM_PATH``. Its
checkout should be a tested tag, core_v0.16.1 or core_v0.19.0
(:mod:`megatron_bitpipe.megatron_lm.checkout`); another version gets one warning line (from
the rank-0 process) and runs. Then, as
``python <script>`` would, the script's directory goes first on ``sys.path`` (plus the
checkout root, if different), so ``megatron.training`` and ``megatron.core`` come from the
checkout; :func:`megatron_bitpipe.megatron_lm.hooks.install` wires the plugin into
Megatron-LM's training code, and the script runs as ``__main__`` with ``sys.argv`` =
``[script, flags...]``.

Errors that are the user's to fix print one ``megatron_bitpipe.run: error: ...`` line on
stderr and exit with status 2, on every rank, before any communication: a missing checkout,
a schedule this package's plan executor runs (``--pipeline-schedule bitpipe``) with a script that cannot run it
(:func:`~megatron_bitpipe.megatron_lm.checkout.bitpipe_refusal`, before the script loads), a
Python package Megatron-LM's training code imports but is not installed, and invalid flag
combinations (:class:`~megatron_bitpipe.megatron_args.BitPipeConfigError`).
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Callable, List, Optional

from .megatron_lm.checkout import (
    ENV_VAR,
    MegatronLMCheckoutError,
    bitpipe_refusal,
    resolve_script,
    tested_tags_text,
    untested_warning,
)
from .schedules.registry import plan_executed_schedules

__all__ = ["main"]

USAGE = (
    "usage: python -m megatron_bitpipe.run SCRIPT [Megatron-LM flags] [--pipeline-schedule bitpipe]\n"
    f"SCRIPT is a Megatron-LM training script (tag {tested_tags_text()}), e.g. /path/to/Megatron-LM/pretrain_gpt.py,\n"
    f"or a path relative to ${ENV_VAR}."
)


def _error(message: str) -> int:
    print(f"megatron_bitpipe.run: error: {message}", file=sys.stderr, flush=True)
    return 2


def _pipeline_schedule(flags: List[str]) -> Optional[str]:
    """The value of the last ``--pipeline-schedule`` in ``flags`` (argparse's choice), if any."""
    value = None
    for i, flag in enumerate(flags):
        if flag == "--pipeline-schedule" and i + 1 < len(flags):
            value = flags[i + 1]
        elif flag.startswith("--pipeline-schedule="):
            value = flag.split("=", 1)[1]
    return value


def main(argv: Optional[List[str]] = None, *, prepare: Optional[Callable[[], None]] = None) -> int:
    """Run ``argv[0]`` (the script) with flags ``argv[1:]``; returns the exit status.

    ``prepare`` is called once the checkout is on ``sys.path`` and before the plugin's hooks
    are installed (the CPU test entry point applies its patches there).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    try:
        script, checkout = resolve_script(argv[0])
    except MegatronLMCheckoutError as error:
        return _error(str(error))
    warning = untested_warning(checkout)
    if warning is not None and os.environ.get("RANK", "0") == "0":
        print(f"megatron_bitpipe.run: warning: {warning}", file=sys.stderr, flush=True)
    schedule = _pipeline_schedule(argv[1:])
    refusal = bitpipe_refusal(script, checkout, schedule=schedule) if schedule in plan_executed_schedules() else None
    if refusal is not None:
        return _error(refusal)
    for path in dict.fromkeys([str(checkout.root), str(script.parent)]):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        if prepare is not None:
            prepare()
        # Imported only now: megatron.core must come from the checkout, as for `python <script>`.
        from .megatron_args import BitPipeConfigError
        from .megatron_lm.hooks import install

        install()
    except ModuleNotFoundError as error:
        return _error(
            f"Megatron-LM's training code in {checkout.root} imports {error.name!r}, which is not installed "
            "(it needs the pip packages six, regex, pyyaml, pydantic, einops and triton)"
        )
    sys.argv = [str(script), *argv[1:]]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except BitPipeConfigError as error:
        return _error(str(error))
    except SystemExit as exit_:
        if exit_.code in (None, 0):  # Megatron-LM's exit conditions (signal, duration, interval)
            _destroy_process_groups()
        raise
    _destroy_process_groups()
    return 0


def _destroy_process_groups() -> None:
    """After a script that finished: destroy the process groups it left (Megatron-LM's scripts
    end without doing so). Left to the interpreter's exit, torch's gloo groups can abort the
    finished rank (``terminate called without an active exception``, status -6), failing a
    run that had trained and saved; NCCL's print a warning on every rank. Not after a failure:
    destroying groups other ranks still wait on could block."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
