#!/usr/bin/env python
"""Optimizers side by side on a tiny GPT: bytes communicated per step and loss curves.

Trains the same tiny GPT (``scripts/pretrain_gpt.py``'s loop, CPU ranks with gloo, BitPipe
over 2 pipeline ranks x data parallelism 2 by default) with

* ``adamw_cosine`` — megatron's Adam(W) with cosine decay,
* ``adamw_rex`` — the same with ``--lr-decay-style rex``,
* ``schedulefree_adamw`` — Schedule-Free AdamW (constant schedule, its own warm-up),
* ``lamb`` — LAMB with cosine decay,
* ``onebit_lamb`` — 1-bit LAMB with cosine decay (``--onebit-freeze-iters``),

for several seeds, and records per iteration the training loss, the learning rate and the
bytes rank 0 receives through collectives (:class:`~megatron_bitpipe.benchmarking.meters.CollectiveMeter`:
bandwidth-optimal algorithms, ring all-reduce ``2(p-1)/p n``, all-gather and all-to-all
``(p-1)/p n``; pipeline sends and receives are not collectives and are not counted), plus
the validation loss at the end (Schedule-Free: of its averaged weights). Adam and LAMB
all-reduce fp32 gradients every step; 1-bit LAMB does so during its warm-up and then
exchanges 1-bit momenta (about 1/32 of the bytes).

The data are the built-in synthetic sequences by default; ``--data-args`` passes any data
flags of the pretrain script instead (e.g. ``"--data-path PREFIX --tokenizer-type
GPT2BPETokenizer --vocab-file ... --merge-file ..."`` for an indexed dataset of real text).

Prints a Markdown table; ``--json`` and ``--plot`` write the runs and the loss curves;
``--include`` adds the runs of earlier invocations (e.g. another ``--lamb-lr``, named with
``--label``) to the table and the plot.
Usage: ``python scripts/bench_optimizers.py --seeds 1 2 3 --train-iters 60 --plot docs/images/bench_optimizers.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CONFIGS: Dict[str, List[str]] = {
    "adamw_cosine": ["--optimizer", "adam", "--lr-decay-style", "cosine"],
    "adamw_rex": ["--optimizer", "adam", "--lr-decay-style", "rex"],
    "schedulefree_adamw": ["--optimizer", "schedulefree_adamw", "--lr-decay-style", "constant"],
    "lamb": ["--optimizer", "lamb", "--lr-decay-style", "cosine"],
    "onebit_lamb": ["--optimizer", "onebit_lamb", "--lr-decay-style", "cosine"],
}
LAMB_FAMILY = ("lamb", "onebit_lamb")


def _bench_rank(argv: List[str]) -> dict:
    """Rank body: train, metering each iteration's collectives; rank 0's records."""
    import torch.distributed as dist

    from megatron_bitpipe.benchmarking.meters import CollectiveMeter
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.training import distributed
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.data import build_tokenizer
    from megatron_bitpipe.training.gpt import GPTTask
    from megatron_bitpipe.training.loop import Trainer
    from megatron_bitpipe.run_config import RunConfig, TokenizerSettings

    task = GPTTask()
    args = parse_args(task, argv)
    tokenizer = build_tokenizer(TokenizerSettings.from_args(args))
    run = RunConfig.from_args(args, tokenizer.vocab_size, task)
    trainer = Trainer(task, args, run, tokenizer, distributed.initialize(run, enable_cpu_megatron))
    rows = []
    while trainer.state.iteration < args.train_iters:
        with CollectiveMeter() as meter:
            record = trainer.train_step()
        rows.append(
            dict(
                iteration=record.iteration,
                loss=record.losses["lm loss"],
                lr=record.lr,
                wire_bytes=meter.wire_bytes(),
                calls=dict(Counter(call.op for call in meter.calls)),
            )
        )
    validation = trainer.evaluate()["lm loss"] if trainer.valid_data is not None else None
    return dict(rows=rows, validation=validation) if dist.get_rank() == 0 else {}


def _argv(name: str, seed: int, options) -> List[str]:
    lr = options.lamb_lr if name in LAMB_FAMILY else options.lr
    argv = [
        "--num-layers", str(options.num_layers), "--hidden-size", str(options.hidden_size),
        "--num-attention-heads", "4", "--seq-length", str(options.seq_length),
        "--micro-batch-size", str(options.micro_batch_size), "--global-batch-size", str(options.global_batch_size),
        "--train-iters", str(options.train_iters), "--lr", str(lr), "--min-lr", str(lr / 10),
        "--lr-warmup-iters", str(options.warmup_iters), "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--seed", str(seed), "--log-interval", str(options.train_iters), "--eval-interval", str(options.train_iters),
        "--eval-iters", "4", *shlex.split(options.layout), *shlex.split(options.data_args), *CONFIGS[name],
    ]  # fmt: skip
    if name == "onebit_lamb":
        argv += ["--onebit-freeze-iters", str(options.freeze_iters)]
    return argv


def _compressed(row: dict) -> bool:
    """Whether the iteration exchanged compressed momenta (1-bit LAMB after its freeze)."""
    return "all_to_all_single" in row["calls"]


def _table(runs: Dict[str, Dict[int, dict]]) -> str:
    adam = statistics.mean(r["wire_bytes"] for run in runs["adamw_cosine"].values() for r in run["rows"]) if "adamw_cosine" in runs else None
    lines = [
        "| optimizer | bytes/step, full precision | bytes/step, compressed | vs Adam | final train loss | final validation loss |",
        "|---|---|---|---|---|---|",
    ]
    for name, by_seed in runs.items():
        rows = [r for run in by_seed.values() for r in run["rows"]]
        early = [r["wire_bytes"] for r in rows if not _compressed(r)]
        late = [r["wire_bytes"] for r in rows if _compressed(r)]
        final = [run["rows"][-1]["loss"] for run in by_seed.values()]
        valid = [run["validation"] for run in by_seed.values() if run["validation"] is not None]

        def spread(values):
            finite = [v for v in values if math.isfinite(v)]
            diverged = f" ({len(values) - len(finite)} of {len(values)} diverged)" if len(finite) < len(values) else ""
            if not finite:
                return "-" + diverged
            return f"{statistics.mean(finite):.4f} ± {statistics.stdev(finite) if len(finite) > 1 else 0.0:.4f}{diverged}"

        compressed = f"{statistics.mean(late):,.0f}" if late else "-"
        ratio = f"1/{adam / statistics.mean(late):.1f}" if late and adam else (f"{statistics.mean(early) / adam:.3f}" if adam else "-")
        lines.append(f"| {name} | {statistics.mean(early):,.0f} | {compressed} | {ratio} | {spread(final)} | {spread(valid)} |")
    return "\n".join(lines)


def _plot(runs: Dict[str, Dict[int, dict]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, by_seed in runs.items():
        every = [[r["loss"] for r in run["rows"]] for run in by_seed.values()]
        curves = [curve for curve in every if math.isfinite(curve[-1])]  # a diverged seed is left out
        if not curves:
            continue
        steps = [r["iteration"] for r in next(iter(by_seed.values()))["rows"]]
        mean = [statistics.mean(values) for values in zip(*curves)]
        left_out = len(every) - len(curves)
        ax.plot(steps, mean, label=name + (f" ({left_out} of {len(every)} seeds diverged, not shown)" if left_out else ""))
        ax.fill_between(steps, [min(v) for v in zip(*curves)], [max(v) for v in zip(*curves)], alpha=0.2)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (mean, min-max over seeds)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--optimizers", nargs="*", choices=tuple(CONFIGS), default=list(CONFIGS),
                        help="what to run (none: only the table and plot of --include)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--train-iters", type=int, default=60)
    parser.add_argument("--warmup-iters", type=int, default=6)
    parser.add_argument("--freeze-iters", type=int, default=None, help="1-bit LAMB warm-up (default: a fifth of --train-iters)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam and Schedule-Free")
    parser.add_argument("--lamb-lr", type=float, default=1e-2, help="LAMB and 1-bit LAMB (their trust ratio rescales each layer's step)")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--layout", default="--pipeline-schedule bitpipe --pipeline-model-parallel-size 2", help="parallel flags of the pretrain script")
    parser.add_argument("--data-args", default="--vocab-size 256", help="data flags of the pretrain script (default: synthetic data)")
    parser.add_argument("--label", default="", help="appended to the optimizer names of this invocation's runs")
    parser.add_argument("--include", nargs="*", default=[], help="runs of earlier invocations (their --json files) to show alongside")
    parser.add_argument("--json", default=None, help="write every run's records here")
    parser.add_argument("--plot", default=None, help="write the loss curves here (PNG)")
    options = parser.parse_args(argv)
    if options.freeze_iters is None:
        options.freeze_iters = max(1, options.train_iters // 5)

    from megatron_bitpipe.cpu.launcher import launch

    runs: Dict[str, Dict[int, dict]] = {}
    for path in options.include:
        runs.update(json.loads(Path(path).read_text())["runs"])
    mine: Dict[str, Dict[int, dict]] = {}
    for name in options.optimizers:
        for seed in options.seeds:
            result = launch(_bench_rank, options.nproc, _argv(name, seed, options), timeout=3600)[0]
            mine.setdefault(name + options.label, {})[seed] = result
            print(f"{name} seed {seed}: final loss {result['rows'][-1]['loss']:.4f}", file=sys.stderr, flush=True)
    if options.json and mine:
        Path(options.json).write_text(json.dumps({"options": vars(options), "runs": mine}, indent=1))
    runs.update(mine)
    print(_table(runs))
    if options.plot:
        data = "synthetic data" if "--data-path" not in options.data_args else "real text"
        _plot(runs, options.plot, f"tiny GPT, {data}, {options.nproc} CPU ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
