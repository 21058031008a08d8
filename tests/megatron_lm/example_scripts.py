"""Megatron-LM's own example scripts as the tests run them: the flags each script builds, read
from the script itself, and the few changes a 4-rank CPU run needs, each with its reason.

:func:`script_flags` runs an example script (``bash``, its own positional arguments) in a
directory holding an empty ``pretrain_gpt.py`` (the scripts check for it), with ``torchrun``
and ``python -m torch.distributed.run`` on ``PATH`` answered by a shim that records the
command line instead of training: what follows ``pretrain_gpt.py`` is the script's flag list,
word-split as bash splits it (so ``"--split '99,1,0'"`` arrives with its quotes, as Megatron-LM
gets it from the script).

:func:`adapt` turns that list into the run's flags and says what it changed, in four kinds:

* ``shrunk``: a size the script gives (layers, widths, sequence, batch, samples, iterations,
  vocabulary, experts, parallel sizes for 4 ranks, evaluation and logging intervals) set to a
  CPU size (:data:`SIZES`, and the example's own ``sizes``);
* ``dropped``: a flag that needs a GPU or Transformer Engine (:data:`GPU_ONLY`, each with why);
* ``replaced``: the example's data and tokenizer flags where the script needs files a user
  brings (a tokenizer model, a corpus): a Megatron indexed dataset and ``NullTokenizer``;
* ``added``: what the example must add, with why (dropout 0 where the script keeps
  Megatron-LM's 0.1: the equal-loss comparison needs it).

Every other flag is passed as written.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

Flag = Tuple[str, Tuple[str, ...]]  # a flag and its values

#: CPU sizes for the size flags the examples set (each applied where a script has the flag).
SIZES: Dict[str, Tuple[str, ...]] = {
    "--num-layers": ("8",),
    "--hidden-size": ("64",),
    "--ffn-hidden-size": ("128",),
    "--moe-ffn-hidden-size": ("64",),
    "--num-attention-heads": ("8",),
    "--num-query-groups": ("4",),
    "--kv-channels": ("8",),
    "--seq-length": ("32",),
    "--max-position-embeddings": ("32",),
    "--global-batch-size": ("8",),
    "--micro-batch-size": ("1",),
    "--vocab-size": ("500",),
    "--num-experts": ("4",),
    "--train-iters": ("4",),
    "--lr-decay-iters": ("4",),
    "--lr-warmup-iters": ("1",),
    "--train-samples": ("32",),
    "--lr-decay-samples": ("32",),
    "--lr-warmup-samples": ("8",),
    "--eval-iters": ("1",),
    "--eval-interval": ("2",),
    "--log-interval": ("1",),
    "--num-workers": ("0",),
}

#: Flags only a GPU (or Transformer Engine, or a CUDA-only package) runs, with why.
GPU_ONLY: Dict[str, str] = {
    "--fp8-format": "fp8 needs Transformer Engine and a Hopper GPU",
    "--fp8-amax-history-len": "fp8 needs Transformer Engine and a Hopper GPU",
    "--fp8-amax-compute-algo": "fp8 needs Transformer Engine and a Hopper GPU",
    "--fp8-param-gather": "fp8 needs Transformer Engine and a Hopper GPU",
    "--transformer-impl": "transformer_engine needs Transformer Engine (the CPU entry point asks for local)",
    "--use-flash-attn": "flash-attn is a CUDA package",
    "--moe-grouped-gemm": "the grouped GEMM is Transformer Engine's or the grouped_gemm CUDA package's",
    "--moe-permute-fusion": "Transformer Engine's fused permutation",
    "--profile": "--profile drives the CUDA profiler (nsys)",
    "--profile-step-start": "with --profile",
    "--profile-step-end": "with --profile",
}


@dataclass(frozen=True)
class Example:
    """One example script and what a 4-rank CPU run of it changes.

    ``path`` is relative to the checkout of ``tag`` (None: every tested tag that has it);
    ``arguments(run_dir)`` its positional arguments; ``precision`` the run's (``bf16``,
    ``fp16``, ``fp32``); ``sizes`` sizes beyond :data:`SIZES` (the 4-rank layout among them,
    replacing the script's parallel sizes); ``replaced`` maps a script flag to the flags that
    stand for it (``{data}`` for the indexed dataset's prefix) and why; ``dropped`` flags beyond
    :data:`GPU_ONLY` and why; ``added`` flags and why.
    """

    path: str
    arguments: Callable[[Path], List[str]]
    precision: str
    tag: Optional[str] = None
    sizes: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    replaced: Dict[str, Tuple[Tuple[str, ...], str]] = field(default_factory=dict)
    dropped: Dict[str, str] = field(default_factory=dict)
    added: Tuple[Tuple[Tuple[str, ...], str], ...] = ()


@dataclass
class Adapted:
    """The run's flags and every change from the script's, by kind: ``{kind: [(flag, why)]}``."""

    flags: List[str]
    changes: Dict[str, List[Tuple[str, str]]]
    script_flags: List[str]


def script_flags(script: Path, arguments: Sequence[str], run_dir: Path) -> List[str]:
    """The flag list ``script`` hands ``pretrain_gpt.py`` (see the module docstring)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    shims = run_dir / ".shims"
    shims.mkdir(exist_ok=True)
    argv = shims / "argv"
    record = f'for a in "$@"; do printf "%s\\0" "$a"; done > "{argv}"'
    (shims / "torchrun").write_text(f"#!/bin/sh\n{record}\n")
    (shims / "python").write_text(
        f'#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "torch.distributed.run" ]; then shift 2; {record}; '
        f'else exec "{sys.executable}" "$@"; fi\n'
    )
    for shim in ("torchrun", "python"):
        (shims / shim).chmod(0o755)
    (run_dir / "pretrain_gpt.py").write_text("")
    env = dict(os.environ, PATH=f"{shims}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", str(script), *arguments], cwd=run_dir, env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0 or not argv.exists():
        raise AssertionError(f"{script} did not reach its launch (exit {done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")
    words = argv.read_bytes().decode().split("\0")[:-1]
    return words[words.index("pretrain_gpt.py") + 1 :]


def parse(flags: Sequence[str]) -> List[Flag]:
    """``flags`` as (flag, values) pairs in order: a value is every word up to the next ``--``."""
    parsed: List[Flag] = []
    for word in flags:
        if word.startswith("--"):
            parsed.append((word, ()))
        else:
            name, values = parsed[-1]
            parsed[-1] = (name, (*values, word))
    return parsed


def adapt(flags: Sequence[str], example: Example, data_prefix: Path) -> Adapted:
    """The run's flags from the script's ``flags`` (see the module docstring)."""
    sizes = {**SIZES, **example.sizes}
    out: List[str] = []
    changes: Dict[str, List[Tuple[str, str]]] = {"shrunk": [], "dropped": [], "replaced": [], "added": []}
    for name, values in parse(flags):
        if name in example.replaced:
            stand_in, why = example.replaced[name]
            out += [word.format(data=data_prefix) for word in stand_in]
            changes["replaced"].append((name, why))
        elif name in example.dropped or name in GPU_ONLY:
            changes["dropped"].append((name, example.dropped.get(name) or GPU_ONLY[name]))
        elif name in sizes:
            if sizes[name] != values:
                changes["shrunk"].append((name, f"{' '.join(values)} -> {' '.join(sizes[name])}"))
            out += [name, *sizes[name]]
        else:
            out += [name, *values]
    seen = {name for name, _ in parse(out)}
    for name in example.sizes:  # the layout's sizes a script leaves at their defaults
        if name not in seen:
            out += [name, *example.sizes[name]]
            changes["shrunk"].append((name, f"(default) -> {' '.join(example.sizes[name])}"))
    for words, why in example.added:
        out += list(words)
        changes["added"].append((words[0], why))
    return Adapted(out, changes, list(flags))
