#!/usr/bin/env python
"""CRAIG coresets against the full data and random subsets, at the same compute budget.

On the built-in real-text corpus (``stdlib-docs``, byte-level), a tiny GPT trains
``--train-iters`` iterations of ``--global-batch-size`` samples — the same tokens in every run —
on

* ``full`` — all n = iterations x batch training samples, each once;
* ``random f`` — a uniform random subset of f·n of them (``--coreset-method random``, γ = n / k:
  weight 1), cycled;
* ``craig f`` — the CRAIG coreset of f·n (``scripts/select_coreset.py``: the proxies of a
  model warmed up ``--warmup-iters`` iterations, facility location in shards), weighted, cycled;

for each fraction and seed (``--seed`` changes the sample order, the initial weights and the
random subset). Reported: the validation loss after training (mean ± standard deviation over
the seeds) and the selection time (warm-up, proxies, facility location). Everything runs in
this one process, one run after the other (the pretrain loop, one CPU rank).

    python scripts/bench_coreset.py --seeds 1 2 3 --json docs/coresets/bench.json \\
        --plot docs/images/bench_coreset.png --doc docs/coresets.md
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from megatron_bitpipe.training.script import ignore_dependency_warnings  # noqa: E402

ignore_dependency_warnings()


def model_flags(args: argparse.Namespace, data: str, seed: int) -> List[str]:
    """The pretrain flags every run and selection of ``seed`` shares."""
    return [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", str(args.seq_length),
        "--micro-batch-size", str(args.global_batch_size), "--global-batch-size", str(args.global_batch_size),
        "--train-iters", str(args.train_iters), "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "10", "--adam-beta2", "0.95", "--seed", str(seed),
        "--data-path", data, "--split", "90,10,0", "--tokenizer-type", "ByteLevelTokenizer", "--vocab-size", "256",
        "--eval-iters", str(args.eval_iters), "--eval-interval", str(args.train_iters), "--log-interval", str(args.train_iters),
    ]


def train(argv: List[str], log_json: str) -> float:
    """The validation loss after a run of the pretrain loop with ``argv``."""
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.gpt import GPTTask
    from megatron_bitpipe.training.loop import run_training

    task = GPTTask()
    with contextlib.redirect_stdout(io.StringIO()):
        run_training(task, parse_args(task, [*argv, "--log-json", log_json]), cpu_fallback=enable_cpu_megatron)
    summary = [json.loads(line) for line in Path(log_json).read_text().splitlines() if '"summary"' in line][-1]
    return float(summary["validation_lm_loss"])


def select(argv: List[str]) -> Dict[str, float]:
    """Write a coreset (``argv``: the selection's flags); its info (timings)."""
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.coreset.select import SelectionArguments, select as run_selection

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        coreset = run_selection(parse_args(SelectionArguments(), argv, world_size=1), enable_cpu_megatron)
    return coreset.info


def run(args: argparse.Namespace) -> dict:
    from megatron_bitpipe.training.preprocess import stdlib_docs_dataset

    with contextlib.redirect_stdout(io.StringIO()):
        data = stdlib_docs_dataset(args.data_dir)
    work = tempfile.mkdtemp(prefix="bench_coreset_")
    results: dict = {"runs": [], "settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot")}}
    started = time.perf_counter()
    for seed in args.seeds:
        flags = model_flags(args, data, seed)
        log = os.path.join(work, f"log_{seed}_full.jsonl")
        results["runs"].append({"seed": seed, "method": "full", "fraction": 1.0, "valid_loss": train(flags, log), "selection_s": 0.0})
        print(f"seed {seed} full: {results['runs'][-1]['valid_loss']:.4f} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
        for fraction in args.fractions:
            for method in ("random", "craig"):
                path = os.path.join(work, f"{method}_{seed}_{fraction}.npz")
                selection = ["--fraction", str(fraction), "--coreset-method", method, "--output", path]
                if method == "craig":
                    selection += ["--coreset-warmup-iters", str(args.warmup_iters)]
                info = select([*flags, *selection])
                seconds = sum(v for k, v in info.items() if k.endswith("_s") and k != "datasets_s")
                loss = train([*flags, "--coreset", path], os.path.join(work, f"log_{seed}_{method}_{fraction}.jsonl"))
                results["runs"].append({"seed": seed, "method": method, "fraction": fraction, "valid_loss": loss, "selection_s": seconds, "info": info})
                print(f"seed {seed} {method} {fraction}: {loss:.4f}, selection {seconds:.1f} s ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    results["wall_s"] = time.perf_counter() - started
    results["load_average"] = os.getloadavg()
    return results


def table(results: dict) -> str:
    """Markdown: per method and fraction, validation loss mean ± std over the seeds and the
    mean selection time."""
    groups: Dict[tuple, List[dict]] = {}
    for r in results["runs"]:
        groups.setdefault((r["method"], r["fraction"]), []).append(r)
    lines = ["| data | fraction | distinct samples | validation loss (mean ± std) | per seed | selection (s) |", "|---|---|---|---|---|---|"]
    n = results["settings"]["train_iters"] * results["settings"]["global_batch_size"]
    for (method, fraction), runs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0] != "random")):
        losses = [r["valid_loss"] for r in runs]
        spread = statistics.stdev(losses) if len(losses) > 1 else 0.0
        k = runs[0].get("info", {}).get("selected", n)
        per_seed = ", ".join(f"{v:.3f}" for v in losses)
        selection = statistics.mean(r["selection_s"] for r in runs)
        lines.append(f"| {method} | {fraction:g} | {k} | {statistics.mean(losses):.4f} ± {spread:.4f} | {per_seed} | {selection:.1f} |")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    full = [r["valid_loss"] for r in results["runs"] if r["method"] == "full"]
    ax.axhline(statistics.mean(full), color="black", linestyle="--", label="full data")
    for method, color in (("random", "tab:blue"), ("craig", "tab:red")):
        fractions = sorted({r["fraction"] for r in results["runs"] if r["method"] == method})
        values = [[r["valid_loss"] for r in results["runs"] if r["method"] == method and r["fraction"] == f] for f in fractions]
        means = [statistics.mean(v) for v in values]
        errors = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
        ax.errorbar(fractions, means, yerr=errors, marker="o", capsize=3, color=color, label=f"{method} subset")
    ax.set_xlabel("fraction of the training samples (same tokens trained)")
    ax.set_ylabel("validation loss (per byte)")
    ax.set_title("stdlib-docs, tiny GPT: full vs random vs CRAIG")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    parser.add_argument("--train-iters", type=int, default=150, help="default 150")
    parser.add_argument("--global-batch-size", type=int, default=16, help="default 16")
    parser.add_argument("--seq-length", type=int, default=64, help="default 64")
    parser.add_argument("--eval-iters", type=int, default=8, help="validation batches; default 8")
    parser.add_argument("--warmup-iters", type=int, default=20, help="CRAIG's proxy model warm-up; default 20")
    parser.add_argument("--data-dir", default=str(REPO / "data"), help="where the corpus is written once; default data/")
    parser.add_argument("--json", default=None, help="write the runs here")
    parser.add_argument("--plot", default=None, help="write the plot here (PNG)")
    parser.add_argument("--from-json", default=None, help="print and plot earlier results instead of running")
    parser.add_argument("--doc", default=None, help="rewrite the bench-coreset block of this Markdown file (docs/coresets.md)")
    args = parser.parse_args(argv)
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        results = run(args)
        results["command"] = "python scripts/bench_coreset.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    if args.json and not args.from_json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    timing = f"{results['wall_s']:.0f} s wall, load average {', '.join(f'{v:.1f}' for v in results['load_average'])} (1, 5, 15 min) at the end"
    print(table(results) + "\n\n" + timing)
    if args.plot:
        plot(results, args.plot)
    if args.doc:
        from doc_blocks import update_file

        command = results["command"]
        update_file(args.doc, {"bench-coreset": f"```bash\n{command}\n```\n\n{table(results)}\n\n{timing}\n"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
