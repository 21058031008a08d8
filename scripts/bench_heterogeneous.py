"""Data parallelism on a heterogeneous cluster: synchronous DP, synchronous DP with static
speed-proportional batches, and ABS-SGD, raced to a target validation loss.

Four data-parallel replicas (launched CPU ranks joined by gloo) train a tiny GPT with the
pretraining loop of ``scripts/pretrain_gpt.py`` (:class:`megatron_bitpipe.training.loop.Trainer`).
Its transformer layers are emulated device time (sleep-based layers of
:mod:`megatron_bitpipe.benchmarking.emulation`: ``y = x + x * w`` with a per-channel weight,
a forward and a backward of set durations), its embedding, LM head, loss, optimizer and
all-reduces are real: the model learns (per-channel scales between the embedding and a
tied head) while four ranks on two cores behave like four devices. The replicas are slowed
by ``--emulate-replica-slowdown`` (heterogeneous: 1,1,2,4; homogeneous control: 1,1,1,1).

Methods (the same model, seed, data, learning-rate schedule in samples, and nominal
``--global-batch-size``):

* ``sync`` — ``--data-parallel-mode sync``: every replica runs the same number of
  micro-batches, every iteration waits for the slowest;
* ``static`` — ``--data-parallel-mode abs-sgd --abs-gradient-delay 0 --abs-trigger fixed``
  with per-replica counts proportional to the known speeds (``1 / slowdown``, summing to the
  synchronous global batch): synchronous data parallelism with static speed-proportional
  batches, exactly normalised (the homogeneous control skips it: with equal speeds it is
  ``sync``, bit for bit);
* ``abs-sgd`` — ``--data-parallel-mode abs-sgd`` with the time trigger and
  ``--abs-step-seconds`` the emulated compute of a synchronous iteration on an unslowed
  replica: one-iteration-stale gradients, each replica computing for that long and until
  the previous all-reduce has completed (so on the homogeneous cluster its batches are the
  synchronous ones; on the heterogeneous one the slow replicas do fewer micro-batches).

Measured per run, from the ``--log-json`` records of rank 0: the training time (the sum of
the iterations' wall-clock times, evaluations excluded) at each evaluation; the time to
reach ``--target-*`` validation loss (linear interpolation between the two evaluations that
bracket it); and the applied samples per second of training time. Datasets: the built-in
synthetic sequences (mock data) and real text, the Python standard library's documentation
(``scripts/preprocess_data.py --input stdlib-docs``, byte-level tokens). Runs are launched one
after the other; the machine's load average before and after each is recorded.

    python scripts/bench_heterogeneous.py                       # 3 seeds, both datasets
    python scripts/bench_heterogeneous.py --seeds 1 --iters 12  # a quick look
    python scripts/bench_heterogeneous.py --json results.json --plot docs/images/heterogeneous.png \\
        --update-doc docs/heterogeneous.md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

from megatron_bitpipe.benchmarking.tables import mean_and_range

DATASETS = ("synthetic", "stdlib-docs")
METHODS = ("sync", "static", "abs-sgd")
CLUSTERS = {"heterogeneous": (1.0, 1.0, 2.0, 4.0), "homogeneous": (1.0, 1.0, 1.0, 1.0)}
REPLICAS = 4
DOC_BLOCKS = ("heterogeneous-command", "heterogeneous-table", "heterogeneous-ratios")


@dataclass(frozen=True)
class Settings:
    """One benchmark's fixed settings (picklable). Times in milliseconds per emulated layer
    and micro-batch."""

    iters: int = 40
    eval_interval: int = 4
    layers: int = 4
    t_forward: float = 10.0
    t_backward: float = 20.0
    hidden_size: int = 64
    seq_length: int = 64
    micro_batch_size: int = 4
    microbatches_per_replica: int = 4
    lr: float = 1e-2
    warmup_iters: int = 4
    targets: tuple = (("synthetic", 3.0), ("stdlib-docs", 2.75))

    @property
    def global_batch_size(self) -> int:
        return REPLICAS * self.microbatches_per_replica * self.micro_batch_size

    def target(self, dataset: str) -> float:
        return dict(self.targets)[dataset]


def static_counts(slowdown: Sequence[float], total: int) -> List[int]:
    """``total`` micro-batches shared in proportion to the speeds ``1 / slowdown`` (largest
    remainders), at least one each."""
    speeds = [1.0 / f for f in slowdown]
    ideal = [total * s / sum(speeds) for s in speeds]
    counts = [max(1, int(x)) for x in ideal]
    for r in sorted(range(len(ideal)), key=lambda r: (counts[r] - ideal[r], r)):
        if sum(counts) >= total:
            break
        counts[r] += 1
    return counts


def method_flags(method: str, slowdown: Sequence[float], settings: Settings) -> List[str]:
    """The pretrain flags of ``method`` on a cluster with ``slowdown``."""
    if method == "sync":
        return []
    if method == "static":
        counts = static_counts(slowdown, REPLICAS * settings.microbatches_per_replica)
        return ["--data-parallel-mode", "abs-sgd", "--abs-gradient-delay", "0", "--abs-trigger", "fixed",
                "--abs-replica-microbatches", ",".join(map(str, counts))]  # fmt: skip
    step_seconds = settings.microbatches_per_replica * settings.layers * (settings.t_forward + settings.t_backward) / 1000.0
    return ["--data-parallel-mode", "abs-sgd", "--abs-step-seconds", f"{step_seconds:g}"]


def pretrain_flags(settings: Settings, dataset: str, data_path: Optional[str], seed: int, slowdown: Sequence[float], method: str) -> List[str]:
    """Every flag of one run (without ``--log-json``)."""
    flags = [
        "--num-layers", str(settings.layers), "--hidden-size", str(settings.hidden_size), "--num-attention-heads", "4",
        "--seq-length", str(settings.seq_length), "--micro-batch-size", str(settings.micro_batch_size),
        "--global-batch-size", str(settings.global_batch_size), "--train-iters", str(settings.iters), "--seed", str(seed),
        "--lr", str(settings.lr), "--lr-decay-style", "constant",
        "--lr-warmup-iters", str(min(settings.warmup_iters, settings.iters - 1)),  # megatron's scheduler: warm-up < decay
        "--adam-beta2", "0.95", "--clip-grad", "1.0", "--log-interval", str(settings.iters),
        "--eval-interval", str(settings.eval_interval), "--eval-iters", "1",
        "--emulate-replica-slowdown", ",".join(f"{f:g}" for f in slowdown),
    ]  # fmt: skip
    if dataset == "synthetic":
        flags += ["--vocab-size", "256"]
    else:
        flags += ["--data-path", data_path, "--split", "90,10,0", "--tokenizer-type", "ByteLevelTokenizer", "--vocab-size", "256"]
    return flags + method_flags(method, slowdown, settings)


def _emulated_task(settings: Settings):
    """The GPT task whose transformer layers are emulated device time: its one model kind is
    GPT's with the emulated layer spec (registered once per rank process)."""
    from dataclasses import replace

    from megatron_bitpipe.benchmarking.emulation import emulated_layer_spec
    from megatron_bitpipe.training.gpt import GPT, GPTTask
    from megatron_bitpipe.training.model_registry import register

    spec = emulated_layer_spec(settings.t_forward / 1000.0, settings.t_backward / 1000.0)
    register(replace(GPT, name="emulated-gpt", task="emulated-gpt", layer_spec=lambda run, config: spec))

    class EmulatedGPTTask(GPTTask):
        """GPT whose transformer layers are emulated device time."""

        name = "emulated-gpt"

    return EmulatedGPTTask()


def _run_rank(settings: Settings, flags: List[str], log_json: str) -> Optional[dict]:
    """Launched on every rank: train; rank 0 returns its ``--log-json`` records."""
    import torch.distributed as dist

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.training import distributed
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.data import build_tokenizer
    from megatron_bitpipe.training.exit_conditions import ExitConditions
    from megatron_bitpipe.training.loop import Trainer
    from megatron_bitpipe.run_config import RunConfig, TokenizerSettings

    task = _emulated_task(settings)
    args = parse_args(task, [*flags, "--log-json", log_json])
    tokenizer = build_tokenizer(TokenizerSettings.from_args(args))
    run = RunConfig.from_args(args, tokenizer.vocab_size, task)
    env = distributed.initialize(run, enable_cpu_megatron)
    with ExitConditions(run.exits, time.time()) as exits:
        Trainer(task, args, run, tokenizer, env).train(exits)
    dist.barrier()
    if env.rank != 0:
        return None
    with open(log_json, encoding="utf-8") as f:
        return [row for row in map(json.loads, f) if row["event"] == "iteration"]


def time_to_target(curve: Sequence[tuple], target: float) -> Optional[float]:
    """First training time (s) at which the validation ``curve`` ``[(time, loss), ...]``
    reaches ``target``, interpolated linearly between evaluations; None if it never does."""
    previous = (0.0, None)
    for t, loss in curve:
        if loss <= target:
            t0, l0 = previous
            if l0 is None or l0 == loss:
                return t
            return t0 + (t - t0) * (l0 - target) / (l0 - loss)
        previous = (t, loss)
    return None


def summarize(records: List[dict], target: float) -> dict:
    """Validation curve over training time, time to target, applied samples per second."""
    elapsed, curve = 0.0, []
    for record in records:
        elapsed += record["elapsed_ms"] / 1000.0
        if "validation_lm_loss" in record:
            curve.append((elapsed, record["validation_lm_loss"]))
    samples = records[-1]["consumed_samples"]
    return dict(
        train_seconds=elapsed,
        samples=samples,
        samples_per_second=samples / elapsed,
        curve=curve,
        final_validation_loss=curve[-1][1] if curve else None,
        time_to_target=time_to_target(curve, target),
    )


def run_all(
    settings: Settings, datasets: Sequence[str], seeds: Sequence[int], clusters: Sequence[str], methods: Sequence[str], data_dir: str, timeout: float
) -> List[dict]:
    """Every (dataset, seed, cluster, method) run, one launch each; one row per run (with
    rank 0's ``--log-json`` records)."""
    from megatron_bitpipe.cpu.launcher import launch
    from megatron_bitpipe.training.preprocess import stdlib_docs_dataset

    data_path = stdlib_docs_dataset(data_dir) if "stdlib-docs" in datasets else None
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for dataset in datasets:
            for seed in seeds:
                for cluster in clusters:
                    slowdown = CLUSTERS[cluster]
                    for method in methods:
                        if cluster == "homogeneous" and method == "static":
                            continue  # equal speeds: it is sync, bit for bit
                        flags = pretrain_flags(settings, dataset, data_path, seed, slowdown, method)
                        load_before = os.getloadavg()[0]
                        started = time.perf_counter()
                        records = launch(_run_rank, REPLICAS, settings, flags, f"{logs}/run.jsonl", timeout=timeout)[0]
                        row = dict(dataset=dataset, seed=seed, cluster=cluster, method=method, slowdown=list(slowdown))
                        row.update(summarize(records, settings.target(dataset)), records=records)
                        row.update(wall_seconds=time.perf_counter() - started, load_average=(load_before, os.getloadavg()[0]))
                        print(
                            f"{dataset:12s} seed {seed} {cluster:13s} {method:8s} {row['samples_per_second']:7.1f} samples/s, "
                            f"final validation {row['final_validation_loss']:.3f}, time to target {row['time_to_target']}, "
                            f"load {row['load_average'][0]:.0f}->{row['load_average'][1]:.0f}",
                            file=sys.stderr,
                            flush=True,
                        )
                        rows.append(row)
    return rows


def _stats(values: Sequence[Optional[float]], digits: int = 1) -> str:
    return mean_and_range(values, digits, absent="not reached", count_absent="not reached")


def markdown_table(rows: List[dict], targets: Dict[str, float]) -> str:
    """Mean (min–max over seeds) time to target and samples per second per configuration."""
    lines = [
        "| dataset (target) | cluster | method | time to target (s) | samples/s | final validation loss |",
        "|---|---|---|---|---|---|",
    ]
    keys = []
    for row in rows:
        key = (row["dataset"], row["cluster"], row["method"])
        if key not in keys:
            keys.append(key)
    for dataset, cluster, method in keys:
        group = [r for r in rows if (r["dataset"], r["cluster"], r["method"]) == (dataset, cluster, method)]
        lines.append(
            f"| {dataset} ({targets[dataset]:g}) | {cluster} | {method} | {_stats([r['time_to_target'] for r in group])} | "
            f"{_stats([r['samples_per_second'] for r in group])} | {_stats([r['final_validation_loss'] for r in group], 3)} |"
        )
    return "\n".join(lines)


def speedups(rows: List[dict]) -> Dict[tuple, List[float]]:
    """``(dataset, cluster, baseline) -> [time to target of baseline / of abs-sgd, per seed]``."""
    out: Dict[tuple, List[float]] = {}
    for row in rows:
        if row["method"] == "abs-sgd" or row["time_to_target"] is None:
            continue
        key = (row["dataset"], row["cluster"], row["seed"])
        mine = next((r for r in rows if r["method"] == "abs-sgd" and (r["dataset"], r["cluster"], r["seed"]) == key), None)
        if mine is not None and mine["time_to_target"]:
            out.setdefault((row["dataset"], row["cluster"], row["method"]), []).append(row["time_to_target"] / mine["time_to_target"])
    return out


def ratios_text(rows: List[dict]) -> str:
    lines = ["Time to target of each baseline divided by ABS-SGD's (mean, min–max over seeds; above 1: ABS-SGD is faster):", ""]
    for (dataset, cluster, method), values in speedups(rows).items():
        lines.append(f"* {dataset}, {cluster}, vs {method}: {_stats(values, 2)}×")
    return "\n".join(lines)


def conditions(rows: List[dict], settings: dict, elapsed: float, cores: int) -> str:
    loads = [v for r in rows for v in r["load_average"]]
    return (
        f"{len(rows)} runs in {elapsed / 60:.0f} min on {cores} cores, 1-minute load average "
        f"{min(loads):.0f}–{max(loads):.0f} (other jobs shared the machine). Settings: {settings}."
    )


def plot(rows: List[dict], path: str) -> None:
    """Validation loss over training time, first seed, one panel per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    seed = rows[0]["seed"]
    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        for row in rows:
            if row["dataset"] != dataset or row["seed"] != seed:
                continue
            times, losses = zip(*row["curve"])
            style = "-" if row["cluster"] == "heterogeneous" else ":"
            ax.plot(times, losses, style, marker="o", markersize=3, label=f"{row['method']} ({row['cluster']})")
        ax.set_title(f"{dataset}, seed {seed}")
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _parser() -> argparse.ArgumentParser:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    parser.add_argument("--clusters", nargs="+", choices=tuple(CLUSTERS), default=list(CLUSTERS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--iters", type=int, default=defaults.iters, help="training iterations of every run")
    parser.add_argument("--eval-interval", type=int, default=defaults.eval_interval)
    parser.add_argument("--lr", type=float, default=defaults.lr, help="Adam learning rate (constant after the warm-up)")
    parser.add_argument("--t-forward", type=float, default=defaults.t_forward, help="ms per emulated layer and micro-batch")
    parser.add_argument("--t-backward", type=float, default=defaults.t_backward, help="ms per emulated layer and micro-batch")
    parser.add_argument("--target-synthetic", type=float, default=defaults.target("synthetic"), help="validation loss target")
    parser.add_argument("--target-stdlib-docs", type=float, default=defaults.target("stdlib-docs"), help="validation loss target")
    parser.add_argument("--data-dir", default="data", help="where the stdlib-docs dataset is written (once)")
    parser.add_argument("--json", metavar="FILE", help="write the command, conditions and every row (with its log records) as JSON")
    parser.add_argument("--from-json", metavar="FILE", help="run nothing: report (table, plot, --update-doc) the results --json wrote")
    parser.add_argument("--plot", metavar="PNG", help="validation loss over training time")
    parser.add_argument("--update-doc", metavar="FILE.md", help="rewrite the heterogeneous-{command,table,ratios} blocks of FILE.md")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launched run")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.iters < 1 or args.eval_interval < 1 or args.eval_interval > args.iters:
        parser.error("--iters and --eval-interval must be positive, --eval-interval at most --iters")
    if args.t_forward < 0 or args.t_backward < 0 or args.lr <= 0:
        parser.error("--t-forward/--t-backward must be >= 0, --lr positive")
    settings = Settings(
        iters=args.iters,
        eval_interval=args.eval_interval,
        lr=args.lr,
        t_forward=args.t_forward,
        t_backward=args.t_backward,
        targets=(("synthetic", args.target_synthetic), ("stdlib-docs", args.target_stdlib_docs)),
    )
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
        rows = run_all(settings, args.datasets, args.seeds, args.clusters, args.methods, args.data_dir, args.timeout)
        results = dict(
            command=" ".join(["python", "scripts/bench_heterogeneous.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]),
            elapsed_seconds=time.perf_counter() - started,
            cores=os.cpu_count(),
            settings=asdict(settings),
            rows=rows,
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    rows, targets = results["rows"], dict(results["settings"]["targets"])
    table = markdown_table(rows, targets)
    ratios = ratios_text(rows)
    measured = conditions(rows, results["settings"], results["elapsed_seconds"], results["cores"])
    print(f"{table}\n\n{ratios}\n\n{measured}")
    if args.plot:
        plot(rows, args.plot)
    if args.update_doc:
        from doc_blocks import update_file

        update_file(args.update_doc, dict(zip(DOC_BLOCKS, (f"```bash\n{results['command']}\n```\n\n{measured}", table, ratios))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
