#!/usr/bin/env python
"""Start-up cost of one rank: building and initialising its model chunks, on the CPU.

For a GPT (default: 7B-shaped — 32 layers, hidden 4096, 32 heads, SwiGLU FFN 11008, vocabulary
32000, RMSNorm, rotary positions, untied head) and each layout ``TPxPP`` (default ``8x4`` and
``1x4``) with ``--pipeline-schedule bitpipe``, one child process per (code, layout) builds the
chunks of one pipeline rank (``--pipeline-rank``, default 0: an edge rank, which holds an
embedding and a head besides its four stages) exactly as the pretrain scripts do —
``training.config.transformer_config`` from the scripts' flags, then
``model.build.build_pipeline_model`` (groups, megatron-core chunks, seed initialisation,
replica marking), without the DDP wrapper — and reports:

* **build s**: wall time of ``build_pipeline_model`` (megatron's construction, including its
  own initialisation where it runs, plus the seed initialisation);
* **seed init s**: the part spent in ``model.init.initialize_from_seed``;
* **peak RSS GiB**: the child's peak resident memory (``ru_maxrss``) at the end, and
  **weights GiB** the bytes of the rank's own parameters, for scale.

No process group of ``TP x PP`` ranks is needed: the child joins torch's in-process ``fake``
backend as global rank ``pipeline_rank x TP`` (tensor-parallel rank 0) of a world of
``TP x PP``, so every group is built and every collective is a no-op.

``--code LABEL=PATH`` (repeatable) races checkouts side by side in one run: the child imports
``megatron_bitpipe`` from ``PATH`` (e.g. an older commit unpacked with ``git archive``);
default ``current=`` this checkout. A layout whose estimated peak (weights x 1.25 + 1 GiB)
exceeds the machine's available memory is skipped and reported so (``--force`` runs it anyway).
Prints a Markdown table and the load average before and after.

Usage: ``python scripts/bench_startup.py [--layouts 8x4 1x4] [--code before=/tmp/old --code after=.]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPT_7B = (
    "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 --vocab-size 32000 "
    "--seq-length 4096 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights"
)


def _child(options: argparse.Namespace) -> dict:
    """Build one rank's chunks and measure (runs in the child, importing the chosen code)."""
    import resource

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.model import build
    from megatron_bitpipe.execution.groups import ParallelGrid
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.run_config import RunConfig
    from megatron_bitpipe.training.config import transformer_config
    from megatron_bitpipe.training.gpt import GPTTask

    tp, pp = options.tp, options.pp
    world = tp * pp
    argv = shlex.split(options.model) + [
        "--pipeline-schedule", "bitpipe", "--tensor-model-parallel-size", str(tp),
        "--pipeline-model-parallel-size", str(pp), "--micro-batch-size", "1", "--global-batch-size", str(pp),
        "--train-iters", "1", "--lr", "1e-4", "--seed", "1234",
    ]  # fmt: skip
    args = parse_args(GPTTask(), argv, world_size=world, cuda_available=False)
    enable_cpu_megatron()
    dist.init_process_group("fake", store=FakeStore(), rank=options.pipeline_rank * tp, world_size=world)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[options.params_dtype]
    run = RunConfig.from_args(args, args.vocab_size)
    config = transformer_config(run, params_dtype=dtype, pipeline_dtype=dtype)

    seed_seconds = []
    initialize = build.initialize_from_seed

    def timed_initialize(*a, **k):
        start = time.perf_counter()
        initialize(*a, **k)
        seed_seconds.append(time.perf_counter() - start)

    build.initialize_from_seed = timed_initialize
    build.wrap_ddp = lambda chunks, *a, **k: list(chunks)  # start-up of the weights only
    start = time.perf_counter()
    model = build.build_pipeline_model(
        config,
        ParallelGrid(tp, 1, pp),
        run.placement,
        vocab_size=run.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        seed=args.seed,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
    )
    build_seconds = time.perf_counter() - start
    weights = sum(p.numel() * p.element_size() for c in model.chunks for p in c.parameters())
    return dict(
        build_s=build_seconds,
        seed_init_s=sum(seed_seconds),
        peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        weights_gib=weights / 2**30,
    )


def _estimated_weights_gib(model: str, tp: int, pp: int, params_dtype: str) -> float:
    """Bytes of an edge rank's parameters (BitPipe: 2 x layers / pp layers, embedding and head)."""
    flags = shlex.split(model)
    value = lambda name: int(flags[flags.index(name) + 1])  # noqa: E731
    h, ffn, layers, vocab = value("--hidden-size"), value("--ffn-hidden-size"), value("--num-layers"), value("--vocab-size")
    gate = 3 if "--swiglu" in flags else 2
    per_layer = 4 * h * h + gate * h * ffn
    params = (2 * layers // pp) * per_layer / tp + 2 * vocab * h / tp
    return params * (4 if params_dtype == "fp32" else 2) / 2**30


def _available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def _run_child(path: Path, options: argparse.Namespace, tp: int, pp: int) -> dict:
    command = [
        sys.executable, str(Path(__file__).resolve()), "--child", "--tp", str(tp), "--pp", str(pp),
        "--pipeline-rank", str(options.pipeline_rank), "--params-dtype", options.params_dtype, "--model", options.model,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=path)
    if result.returncode != 0:
        return dict(error=f"exit {result.returncode}: {result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ''}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--layouts", nargs="+", default=["8x4", "1x4"], metavar="TPxPP")
    parser.add_argument("--code", action="append", default=None, metavar="LABEL=PATH", help="checkout to measure (repeatable)")
    parser.add_argument("--pipeline-rank", type=int, default=0)
    parser.add_argument("--params-dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--model", default=GPT_7B, help="model flags of scripts/pretrain_gpt.py (default: 7B-shaped)")
    parser.add_argument("--force", action="store_true", help="run layouts that may not fit in the available memory")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--pp", type=int, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        print(json.dumps(_child(options)))
        return 0
    codes = [entry.partition("=") for entry in options.code or [f"current={REPO}"]]
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    rows = []
    for layout in options.layouts:
        tp, pp = (int(x) for x in layout.lower().split("x"))
        estimate = _estimated_weights_gib(options.model, tp, pp, options.params_dtype)
        for label, _, path in codes:
            if not options.force and estimate * 1.25 + 1 > _available_gib():
                result = dict(error=f"skipped: needs about {estimate * 1.25 + 1:.1f} GiB, {_available_gib():.1f} GiB available")
            else:
                result = _run_child(Path(path).resolve(), options, tp, pp)
            rows.append((f"TP {tp} x PP {pp}", label, result))
            print(f"  {layout} {label}: {result}", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print(f"pipeline rank {options.pipeline_rank}, parameters in {options.params_dtype}\n")
    print("| layout | code | build s | seed init s | peak RSS GiB | weights GiB |")
    print("|---|---|---:|---:|---:|---:|")
    for layout, label, r in rows:
        if "error" in r:
            print(f"| {layout} | {label} | {r['error']} | | | |")
        else:
            print(f"| {layout} | {label} | {r['build_s']:.1f} | {r['seed_init_s']:.1f} | {r['peak_rss_gib']:.2f} | {r['weights_gib']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
