"""Decentralized data parallelism on real text: synchronous momentum SGD, DecentLaM (ring and
exponential graph), DmSGD (the same graphs) and LSGD, validation loss against iterations and
against the bytes each replica sends.

Four data-parallel replicas (launched CPU ranks joined by gloo) train a tiny GPT with the
pretraining loop of ``scripts/pretrain_gpt.py`` (:class:`megatron_bitpipe.training.loop.Trainer`)
on the Python standard library's documentation (``scripts/preprocess_data.py --input
stdlib-docs``, byte-level tokens, split 90/10), with ``--optimizer sgd`` and the same model,
seed, data, learning-rate schedule and global batch for every method:

* ``sync`` — ``--data-parallel-mode sync``: the gradient all-reduce (megatron's, fp32);
* ``decentlam-ring``, ``decentlam-exponential`` — ``--data-parallel-mode decentlam
  --gossip-topology ring | exponential`` (2 and 3 neighbours for 4 replicas);
* ``dmsgd-ring``, ``dmsgd-exponential`` — ``--data-parallel-mode dmsgd``, plain decentralized
  momentum SGD, DecentLaM's baseline;
* ``lsgd`` — ``--data-parallel-mode lsgd --lsgd-group-size 2 --lsgd-period 4`` (2 local
  groups, λ 0.1 both, leaders elected every 4 iterations).

Two global batches (``--batches``: large, 32 sequences, and small, 8, each with its learning
rate: :class:`Settings`), several seeds (the seed draws the initial weights and megatron's
shuffle of the documents and samples). Measured per run from rank 0's ``--log-json`` records: the
validation loss of the evaluated weights (the replicas' average for the gossip modes, the
global leader for LSGD, the one model for sync) every ``--eval-interval`` iterations, the
bytes each replica sent for the data-parallel update so far (the decentralized modes log
theirs; synchronous data parallelism is counted as a ring all-reduce of the fp32 gradients,
``2 (n - 1) / n`` times their bytes per iteration, what NCCL's ring sends) and the consensus
distance at the end. All runs of one (batch, seed) share one launch; the load average before
and after each is recorded.

    python scripts/bench_decentralized.py                     # 3 seeds, both batches
    python scripts/bench_decentralized.py --seeds 1 --iters 8 # a quick look
    python scripts/bench_decentralized.py --json results.json --plot docs/images/decentralized.png \\
        --update-doc docs/decentralized.md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence

from megatron_bitpipe.benchmarking.tables import mean_and_range

REPLICAS = 4
METHODS = {
    "sync": [],
    "decentlam-ring": ["--data-parallel-mode", "decentlam", "--gossip-topology", "ring"],
    "decentlam-exponential": ["--data-parallel-mode", "decentlam", "--gossip-topology", "exponential"],
    "dmsgd-ring": ["--data-parallel-mode", "dmsgd", "--gossip-topology", "ring"],
    "dmsgd-exponential": ["--data-parallel-mode", "dmsgd", "--gossip-topology", "exponential"],
    "lsgd": ["--data-parallel-mode", "lsgd", "--lsgd-group-size", "2", "--lsgd-period", "4"],
}
DOC_BLOCKS = ("decentralized-command", "decentralized-table")


@dataclass(frozen=True)
class Settings:
    """One benchmark's fixed settings (picklable). ``batches``: name -> (global batch size,
    learning rate); the validation set is ``validation_samples`` sequences whatever the batch."""

    iters: int = 40
    eval_interval: int = 8
    layers: int = 2
    hidden_size: int = 64
    seq_length: int = 64
    micro_batch_size: int = 2
    momentum: float = 0.9
    warmup_iters: int = 4
    validation_samples: int = 64
    batches: tuple = (("large", 32, 0.3), ("small", 8, 0.15))

    def batch(self, name: str) -> tuple:
        return next((size, lr) for n, size, lr in self.batches if n == name)


def pretrain_flags(settings: Settings, data_path: str, seed: int, batch: str, method: str) -> List[str]:
    """Every flag of one run (without ``--log-json``)."""
    size, lr = settings.batch(batch)
    return [
        "--num-layers", str(settings.layers), "--hidden-size", str(settings.hidden_size), "--num-attention-heads", "4",
        "--seq-length", str(settings.seq_length), "--micro-batch-size", str(settings.micro_batch_size),
        "--global-batch-size", str(size), "--train-iters", str(settings.iters), "--seed", str(seed),
        "--optimizer", "sgd", "--sgd-momentum", str(settings.momentum), "--lr", str(lr), "--min-lr", str(lr / 10),
        "--lr-decay-style", "cosine", "--lr-warmup-iters", str(settings.warmup_iters), "--clip-grad", "1.0",
        "--weight-decay", "0.01", "--log-interval", str(settings.eval_interval), "--eval-interval", str(settings.eval_interval),
        "--eval-iters", str(max(1, settings.validation_samples // size)),
        "--data-path", data_path, "--split", "90,10,0", "--tokenizer-type", "ByteLevelTokenizer", "--vocab-size", "256",
        *METHODS[method],
    ]  # fmt: skip


def _run_rank(runs: List[tuple], log_dir: str) -> Optional[List[dict]]:
    """Launched on every rank: train each ``(name, flags)`` of ``runs`` in turn; rank 0
    returns, per run, its startup and iteration records and the load average around it."""
    import torch.distributed as dist

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.training import distributed
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.data import build_tokenizer
    from megatron_bitpipe.training.exit_conditions import ExitConditions
    from megatron_bitpipe.training.gpt import GPTTask
    from megatron_bitpipe.run_config import RunConfig, TokenizerSettings
    from megatron_bitpipe.training.loop import Trainer

    out = []
    for name, flags in runs:
        log_json = os.path.join(log_dir, f"{name}.jsonl")
        task = GPTTask()
        args = parse_args(task, [*flags, "--log-json", log_json])
        tokenizer = build_tokenizer(TokenizerSettings.from_args(args))
        run = RunConfig.from_args(args, tokenizer.vocab_size, task)
        env = distributed.initialize(run, enable_cpu_megatron)
        load_before, started = os.getloadavg()[0], time.perf_counter()
        with ExitConditions(run.exits, time.time()) as exits:
            Trainer(task, args, run, tokenizer, env).train(exits)
        dist.barrier()
        if env.rank == 0:
            with open(log_json, encoding="utf-8") as f:
                rows = [json.loads(line) for line in f]
            out.append(dict(
                name=name,
                startup=next(r for r in rows if r["event"] == "startup"),
                records=[r for r in rows if r["event"] == "iteration"],
                wall_seconds=time.perf_counter() - started,
                load_average=(load_before, os.getloadavg()[0]),
            ))  # fmt: skip
    return out if dist.get_rank() == 0 else None


def replica_parameters(startup: dict) -> int:
    """Parameters of one data-parallel replica, from the startup record's ranks."""
    return sum(rank["parameters"] for rank in startup["ranks"] if rank["dp_rank"] == 0)


def bytes_per_iteration(method: str, record: dict, parameters: int) -> float:
    """Bytes one replica sent for the data-parallel update in ``record``'s iteration."""
    if method == "sync":
        return 2.0 * (REPLICAS - 1) / REPLICAS * 4 * parameters  # ring all-reduce of fp32 gradients
    return float(record["comm_bytes_per_replica"])


def summarize(method: str, startup: dict, records: List[dict]) -> dict:
    """Validation curve ``[(iteration, bytes sent per replica so far, loss)]``, final values."""
    parameters = replica_parameters(startup)
    sent, curve = 0.0, []
    for record in records:
        sent += bytes_per_iteration(method, record, parameters)
        if "validation_lm_loss" in record:
            curve.append((record["iteration"], sent, record["validation_lm_loss"]))
    distances = [r.get("consensus_distance") for r in records if r.get("consensus_distance") is not None]
    return dict(
        parameters=parameters,
        curve=curve,
        final_validation_loss=curve[-1][2] if curve else None,
        megabytes_per_replica=sent / 1e6,
        final_consensus_distance=distances[-1] if distances else (0.0 if method == "sync" else None),
        final_training_loss=records[-1]["lm_loss"],
    )


def run_all(settings: Settings, batches: Sequence[str], seeds: Sequence[int], methods: Sequence[str], data_dir: str, timeout: float) -> List[dict]:
    """Every (batch, seed) launch with every method; one row per run."""
    from megatron_bitpipe.cpu.launcher import launch
    from megatron_bitpipe.training.preprocess import stdlib_docs_dataset

    data_path = stdlib_docs_dataset(data_dir)
    rows = []
    for batch in batches:
        for seed in seeds:
            runs = [(method, pretrain_flags(settings, data_path, seed, batch, method)) for method in methods]
            with tempfile.TemporaryDirectory() as logs:
                results = launch(_run_rank, REPLICAS, runs, logs, timeout=timeout)[0]
            for result in results:
                row = dict(batch=batch, global_batch_size=settings.batch(batch)[0], seed=seed, method=result["name"])
                row.update(summarize(result["name"], result["startup"], result["records"]))
                row.update(records=result["records"], wall_seconds=result["wall_seconds"], load_average=result["load_average"])
                print(
                    f"{batch:5s} seed {seed} {row['method']:22s} validation {row['final_validation_loss']:.4f}, "
                    f"{row['megabytes_per_replica']:.1f} MB per replica, consensus {row['final_consensus_distance']}, "
                    f"{row['wall_seconds']:.0f} s, load {row['load_average'][0]:.0f}->{row['load_average'][1]:.0f}",
                    file=sys.stderr,
                    flush=True,
                )
                rows.append(row)
    return rows


def _stats(values: Sequence[Optional[float]], digits: int = 3) -> str:
    return mean_and_range(values, digits)


def markdown_table(rows: List[dict]) -> str:
    """Per batch and method: final validation loss, its gap to sync (mean, min–max over
    seeds), bytes per replica, final consensus distance."""
    lines = [
        "| global batch | method | final validation loss | vs sync (same seed) | MB sent per replica | consensus distance at the end |",
        "|---|---|---|---|---|---|",
    ]
    keys = list(dict.fromkeys((r["batch"], r["global_batch_size"], r["method"]) for r in rows))
    for batch, size, method in keys:
        group = [r for r in rows if (r["batch"], r["method"]) == (batch, method)]
        gaps = []
        for row in group:
            sync = next((r for r in rows if (r["batch"], r["seed"], r["method"]) == (batch, row["seed"], "sync")), None)
            gaps.append(None if sync is None else row["final_validation_loss"] - sync["final_validation_loss"])
        lines.append(
            f"| {batch} ({size}) | {method} | {_stats([r['final_validation_loss'] for r in group])} | "
            f"{'—' if method == 'sync' else _stats(gaps, 4)} | {_stats([r['megabytes_per_replica'] for r in group], 1)} | "
            f"{_stats([r['final_consensus_distance'] for r in group], 4)} |"
        )
    return "\n".join(lines)


def conditions(rows: List[dict], settings: dict, elapsed: float, cores: int) -> str:
    loads = [v for r in rows for v in r["load_average"]]
    seeds = sorted({r["seed"] for r in rows})
    return (
        f"{len(rows)} runs ({len(seeds)} seed{'s' if len(seeds) > 1 else ''}: {', '.join(map(str, seeds))}) in "
        f"{elapsed / 60:.1f} min on {cores} cores, 1-minute load average {min(loads):.1f}–{max(loads):.1f}. "
        f"Settings: {settings}."
    )


def plot(rows: List[dict], path: str) -> None:
    """Validation loss (mean over seeds) against iterations and against MB sent per replica,
    one row of panels per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(dict.fromkeys(r["batch"] for r in rows))
    fig, axes = plt.subplots(len(batches), 2, figsize=(12, 4 * len(batches)), squeeze=False)
    for (ax_steps, ax_bytes), batch in zip(axes, batches):
        for method in dict.fromkeys(r["method"] for r in rows):
            group = [r["curve"] for r in rows if (r["batch"], r["method"]) == (batch, method)]
            if not group:
                continue
            points = list(zip(*group))  # per evaluation: one (iteration, bytes, loss) per seed
            iterations = [p[0][0] for p in points]
            megabytes = [p[0][1] / 1e6 for p in points]
            losses = [statistics.mean(seed[2] for seed in p) for p in points]
            ax_steps.plot(iterations, losses, marker="o", markersize=3, label=method)
            ax_bytes.plot(megabytes, losses, marker="o", markersize=3, label=method)
        size = next(r["global_batch_size"] for r in rows if r["batch"] == batch)
        ax_steps.set_title(f"{batch} batch ({size}): validation loss vs iterations")
        ax_bytes.set_title(f"{batch} batch ({size}): validation loss vs MB sent per replica")
        ax_steps.set_xlabel("iteration")
        ax_bytes.set_xlabel("MB sent per replica")
        for ax in (ax_steps, ax_bytes):
            ax.set_ylabel("validation loss (mean over seeds)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _parser() -> argparse.ArgumentParser:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", nargs="+", choices=[b[0] for b in defaults.batches], default=[b[0] for b in defaults.batches])
    parser.add_argument("--methods", nargs="+", choices=tuple(METHODS), default=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--iters", type=int, default=defaults.iters, help="training iterations of every run")
    parser.add_argument("--eval-interval", type=int, default=defaults.eval_interval)
    parser.add_argument("--data-dir", default="data", help="where the stdlib-docs dataset is written (once)")
    parser.add_argument("--json", metavar="FILE", help="write the command, conditions and every row (with its log records) as JSON")
    parser.add_argument("--from-json", metavar="FILE", help="run nothing: report (table, plot, --update-doc) the results --json wrote")
    parser.add_argument("--plot", metavar="PNG", help="validation loss against iterations and against bytes")
    parser.add_argument("--update-doc", metavar="FILE.md", help="rewrite the decentralized-{command,table} blocks of FILE.md")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch (every method of one batch and seed)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.iters < 1 or not 1 <= args.eval_interval <= args.iters:
        parser.error("--iters and --eval-interval must be positive, --eval-interval at most --iters")
    settings = Settings(iters=args.iters, eval_interval=args.eval_interval, warmup_iters=min(Settings.warmup_iters, args.iters - 1))
    if args.update_doc:
        from doc_blocks import check_file

        try:
            check_file(args.update_doc, DOC_BLOCKS)
        except (ValueError, OSError) as error:
            parser.error(f"--update-doc: {error}")
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            results = json.load(f)
    else:
        started = time.perf_counter()
        rows = run_all(settings, args.batches, args.seeds, args.methods, args.data_dir, args.timeout)
        results = dict(
            command=" ".join(["python", "scripts/bench_decentralized.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]),
            elapsed_seconds=time.perf_counter() - started,
            cores=os.cpu_count(),
            settings=asdict(settings),
            rows=rows,
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    rows = results["rows"]
    table = markdown_table(rows)
    measured = conditions(rows, results["settings"], results["elapsed_seconds"], results["cores"])
    print(f"{table}\n\n{measured}")
    if args.plot:
        plot(rows, args.plot)
    if args.update_doc:
        from doc_blocks import update_file

        update_file(args.update_doc, dict(zip(DOC_BLOCKS, (f"```bash\n{results['command']}\n```\n\n{measured}", table))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
