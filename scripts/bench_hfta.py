#!/usr/bin/env python
"""HFTA throughput: B GPTs trained as one fused array vs the same B trained one after another.

For each B in ``--models`` the training loop of ``scripts/pretrain_gpt.py`` (one process each,
fp32, Adam; on the GPU when there is one, else on the CPU) runs ``--iters`` timed iterations
after ``--warmup`` untimed ones of

* the fused array ``--hfta-models B`` (every model sees the global batch), and
* one unfused model (B models one after another take B times its time),

and reports samples per second over all B models: fused ``B * batch / t_fused``, sequential
``batch / t_single`` (the same for every B), and the ratio. ``--size tiny`` (default) is a GPT
for a CPU with ``--threads`` torch threads (default 1), ``--size small`` one for a GPU
(``scripts/gpu_check.py``'s ``hfta-bench`` item).

Usage: ``python scripts/bench_hfta.py --models 1 2 4 8 --json docs/images/bench_hfta.json --plot docs/images/bench_hfta.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: the model sizes: ``tiny`` for a CPU, ``small`` for a GPU (scripts/gpu_check.py's ``hfta-bench``)
SIZES = {
    "tiny": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--micro-batch-size", "4", "--global-batch-size", "4", "--vocab-size", "512"],
    "small": ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
              "--micro-batch-size", "8", "--global-batch-size", "8", "--vocab-size", "8192"],
}  # fmt: skip
#: the training flags of every run besides the size
TRAINING = ["--lr", "1e-3", "--clip-grad", "1.0", "--train-iters", "1000", "--eval-iters", "0", "--log-interval", "1000"]
#: the line a timing process prints: its median seconds per iteration
SECONDS_MARKER = "BENCH_HFTA_SECONDS "


def time_steps(argv: List[str], warmup: int, iters: int) -> float:
    """Median seconds per training iteration of the loop with ``argv`` in this process (one
    rank; the GPU when there is one, else the CPU)."""
    import torch

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.run_config import RunConfig, TokenizerSettings
    from megatron_bitpipe.training import distributed
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.data import build_tokenizer
    from megatron_bitpipe.training.gpt import GPTTask
    from megatron_bitpipe.training.loop import Trainer

    task = GPTTask()
    args = parse_args(task, argv)
    tokenizer = build_tokenizer(TokenizerSettings.from_args(args))
    run = RunConfig.from_args(args, tokenizer.vocab_size, task)
    trainer = Trainer(task, args, run, tokenizer, distributed.initialize(run, enable_cpu_megatron))
    times = []
    for step in range(warmup + iters):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.train_step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _timed(argv: List[str], warmup: int, iters: int, threads: int) -> float:
    """:func:`time_steps` in a fresh process (each run has the process, the device and
    megatron's global state to itself)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--time-one", json.dumps(argv), "--warmup", str(warmup), "--iters", str(iters)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith(SECONDS_MARKER)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"timing {' '.join(argv)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return float(lines[-1][len(SECONDS_MARKER):])


def measure(models: List[int], warmup: int, iters: int, model_args: List[str], threads: int = 1) -> List[dict]:
    """One row per B: seconds per iteration fused and single, samples/s both ways, speed-up."""
    batch = int(model_args[model_args.index("--global-batch-size") + 1])
    single = _timed(model_args, warmup, iters, threads)
    print(f"one model: {1000 * single:.1f} ms/iteration", flush=True)
    rows = []
    for b in models:
        fused = _timed([*model_args, "--hfta-models", str(b)], warmup, iters, threads)
        print(f"fused array of {b}: {1000 * fused:.1f} ms/iteration", flush=True)
        rows.append(
            dict(
                models=b,
                fused_s_per_iter=fused,
                single_s_per_iter=single,
                fused_samples_per_s=b * batch / fused,
                sequential_samples_per_s=batch / single,
                speedup=b * single / fused,
            )
        )
    return rows


def table(rows: List[dict]) -> str:
    lines = [
        "| B | fused s/iter | one model s/iter | fused samples/s | one after another samples/s | speed-up |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['models']} | {r['fused_s_per_iter']:.4f} | {r['single_s_per_iter']:.4f} | "
            f"{r['fused_samples_per_s']:.1f} | {r['sequential_samples_per_s']:.1f} | {r['speedup']:.2f}x |"
        )
    return "\n".join(lines)


def plot(rows: List[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = [r["models"] for r in rows]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ax.plot(b, [r["fused_samples_per_s"] for r in rows], "o-", label="fused array (--hfta-models B)")
    ax.plot(b, [r["sequential_samples_per_s"] for r in rows], "s--", label="B models one after another")
    ax.set_xscale("log", base=2)
    ax.set_xticks(b, [str(x) for x in b])
    ax.set_xlabel("models B")
    ax.set_ylabel("samples/s (all models)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _device(threads: int) -> str:
    """What the timing processes ran on: the GPU's name, or the CPU and its thread count."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {threads} thread(s)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, nargs="+", default=[1, 2, 4, 8], help="array sizes B (default 1 2 4 8)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="the GPT's size: tiny (CPU, default) or small (GPU)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations (default 2)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations; the median counts (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (OMP_NUM_THREADS, default 1)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--plot", default=None, help="write the plot here (PNG)")
    parser.add_argument("--time-one", default=None, metavar="ARGV_JSON", help=argparse.SUPPRESS)  # one timing process
    args = parser.parse_args(argv)
    if args.time_one is not None:
        print(f"{SECONDS_MARKER}{time_steps(json.loads(args.time_one), args.warmup, args.iters)}", flush=True)
        return 0
    model = [*SIZES[args.size], *TRAINING]
    rows = measure(args.models, args.warmup, args.iters, model, args.threads)
    load = os.getloadavg()
    print(table(rows))
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows=rows, load_average=load, device=_device(args.threads), model=model), indent=1) + "\n")
    if args.plot:
        sizes = dict(zip(model[::2], model[1::2]))
        shape = f"{sizes['--num-layers']} layers, h {sizes['--hidden-size']}, s {sizes['--seq-length']}, batch {sizes['--global-batch-size']}"
        plot(rows, args.plot, f"HFTA, {args.size} GPT ({shape}), {_device(args.threads)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
