#!/usr/bin/env python
"""The one prepared check of megatron-bitpipe on a GPU machine (docs/gpu.md).

    python3 scripts/gpu_check.py --out OUT            # needs a CUDA GPU; about 8 minutes at most
    python3 scripts/gpu_check.py --out OUT --dry-run  # any machine: commands + CPU-runnable parts

Items, in the order they run (each under its own timeout; one that fails or hangs is
reported and the next one runs):

1. ``environment``: GPU, driver, torch, CUDA, NCCL, megatron-core, Transformer Engine, Python.
2. ``gpt-small-bf16``, ``gpt-0.5b-bf16``: ``scripts/pretrain_gpt.py --bf16`` on the GPU with
   mock data (4 layers h1024 s1024; 8 layers h2048 s2048, ~0.5B): tokens/s,
   TFLOP/s per GPU, peak memory and ms/iteration, read from its ``--log-json``.
   ``attention-sdpa`` (``scripts/bench_attention.py``) and ``hfta-bench``
   (``scripts/bench_hfta.py --size small``: HFTA's fused arrays of B = 1, 2, 4, 8 small GPTs
   against B runs one after another, fp32).
3. ``calibrate-fp32``, ``calibrate-bf16``, ``calibrate-bf16-sdpa``: ``scripts/calibrate_gpu.py``
   on BitPipe's GPT share (12 layers h3072 s1024 b1; the last with ``--attention-backend sdpa``,
   as users train); the cost files are written to ``--out``. ``split-bench``
   (``scripts/bench_split.py --device cuda``): the split backward's phases F, B, F_d, I, W on
   2 layers of that share in bf16 (SDPA, unfused attention, MoE): times, operators, bytes
   written, FLOPs and the ratios (I + W) / B and F_d / F (in ``gpu_check.json``).
4. Several ranks sharing the one GPU over NCCL (NCCL >= 2.30: ``NCCL_MULTI_RANK_GPU_ENABLE=1``;
   older: a distinct ``NCCL_HOSTID`` per rank, set by ``scripts/gpu_rank.py``, with
   ``NCCL_SOCKET_IFNAME=lo``), a tiny GPT (8 layers h256 s256): first the single-process
   references (``ref-*``), then megatron-core's 1F1B on 4 pipeline ranks as the control,
   BitPipe plain, Optimus 2D q=2, BitPipe ``--split-backward``, BitPipe PP2 x DP2 with the
   distributed optimizer, BERT with BitPipe PP4, BitPipe in bf16, and BitPipe
   ``--split-backward`` on Transformer Engine layers (``bitpipe-split-te-pp4``: TE's own
   ``delay_wgrad_compute`` / ``backward_dw``, against ``ref-gpt-te-fp32``, the same TE model in
   one process), then one item per family of the zero-bubble and DualPipe schedules: ZB-V and
   DualPipeV on 4 pipeline ranks (``zbv-pp4``, ``dualpipev-pp4``; the tiny model's 8
   micro-batches are the ``2 x 4`` DualPipeV needs), DualPipeV with an uneven
   ``--pipeline-model-parallel-layout`` whose embedding and loss stages on rank 0 hold no layer
   (``dualpipev-pp4-layout``), and a mixture-of-experts GPT under BitPipe
   PP 2 x EP 2 (``moe-bitpipe-pp2-ep2``: the experts split over the two data-parallel ranks of
   each pipeline rank, the alltoall dispatcher, against ``ref-moe-gpt-fp32``), and BitPipe PP 2 x
   CP 2 (``bitpipe-pp2-cp2``: context parallelism, keys and values all-gathered over NCCL, against
   ``ref-gpt-cp-fp32``, the tiny GPT with SDPA attention and no dropout; GPU-only, its CPU
   equivalence being the test suite's, and not yet run on a GPU). Each run's per-iteration losses must equal its reference's: rtol 1e-4 in
   fp32, 2e-2 in bf16. The two Transformer Engine items run only where ``transformer_engine``
   is importable; elsewhere they are ``skipped (Transformer Engine not importable)``.
5. ``fault-hang-pp4``, ``fault-crash-pp4``: BitPipe PP4 with ``--inject-fault hang`` (then
   ``crash``) on rank 1 at iteration 2 and ``--distributed-timeout-minutes 0.25``
   (docs/faults.md): ok when the job ends by itself, non-zero, with the watchdog's one line;
   the time to end is in the key numbers.

Runs that cannot hang come first; a run of several ranks that outlives its timeout has its
ranks' Python stacks dumped into the log (SIGUSR1, see gpu_rank.py) and its whole process
group killed, and is reported as ``hung (timeout N s)``. ``--budget-s`` bounds the whole check:
an item gets at most the time left, and one that would get less than ``MIN_ITEM_S`` is
``skipped (budget)``.

Output under ``--out`` (8 files): ``gpu_check.log`` (every item's command and output, each after
a header line), ``gpu_check.json`` (results, rewritten after every item), ``gpu_check.md`` (the
table), ``calibration_fp32.json``, ``calibration_bf16.json`` and ``calibration_bf16_sdpa.json`` (cost files), ``attention.json``
(``scripts/bench_attention.py``: unfused vs SDPA core attention) and ``hfta.json``
(``scripts/bench_hfta.py --size small``: B = 1, 2, 4, 8 fused models against B runs one after
another, item ``hfta-bench``); ``split-bench``'s results go into ``gpu_check.json`` only. The console gets a
line per item, an item's last log lines only when it fails, and the table last.

Without a CUDA GPU it prints one line and exits 2 before doing anything, unless ``--dry-run``:
then every item's command is printed, the environment item and the fp32 runs of several
ranks run on the CPU (gloo, a tiny model, 2 iterations; the GPU is hidden from them on a GPU
machine too), and the GPU-only items are ``skipped (needs a GPU)``. The exit status is 0 when
every item that ran is ``ok``, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"

NO_GPU = (
    "gpu_check.py: needs a CUDA GPU (torch.cuda.is_available() is False); nothing was run "
    "(--dry-run prints every command and runs the CPU-runnable parts)"
)
ENV_MARKER = "GPU_CHECK_ENVIRONMENT "

LOG_FILE, RESULTS_FILE, TABLE_FILE = "gpu_check.log", "gpu_check.json", "gpu_check.md"
ATTENTION_FILE = "attention.json"  # scripts/bench_attention.py's results
HFTA_FILE = "hfta.json"  # scripts/bench_hfta.py's results
SPLIT_FILE = "split.json"  # scripts/bench_split.py's results (in the work folder; the details go into gpu_check.json)
DEFAULT_BUDGET_S = 450.0
#: the dry run's budget: 2 busy CPU cores start 4 ranks of megatron-core slowly
DRY_RUN_BUDGET_S = 900.0
#: an item that would get fewer seconds than this (or than its own timeout) is skipped
MIN_ITEM_S = 20.0
#: lines of a failed item's output shown on the console
TAIL_LINES = 25
#: seconds between the stack-dump signal and the kill of a hung run
DUMP_GRACE_S = 3.0
#: iterations left out of the throughput medians (start-up, allocator, autotuning)
WARMUP_ITERATIONS = 3

RTOL = {"fp32": 1e-4, "bf16": 2e-2}
# The tiny model's 8 layers over DualPipeV PP 4's 8 stages (pipeline order; rank 0 holds stages 0
# and 7, so it holds the embedding and the loss and no transformer layer).
UNEVEN_LAYOUT = "E|tt|t|t|t|t|tt|L"
NCCL_MULTI_RANK_MIN = (2, 30, 0)

OK, MISMATCH = "ok", "mismatch"
NEEDS_GPU, OVER_BUDGET = "skipped (needs a GPU)", "skipped (budget)"
NEEDS_TE = "skipped (Transformer Engine not importable)"


# ----------------------------------------------------------------------------------------------
# pure logic (tests/scripts/test_gpu_check.py)


def parse_nccl_version(version) -> Optional[Tuple[int, int, int]]:
    """``torch.cuda.nccl.version()`` as ``(major, minor, patch)``: a tuple already, or an
    integer (``22703`` = 2.27.3 since NCCL 2.9, ``2708`` = 2.7.8 before); None if unknown."""
    if version is None:
        return None
    if isinstance(version, (tuple, list)):
        parts = [int(v) for v in version][:3]
        return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]
    code = int(version)
    if code >= 10000:
        return code // 10000, (code % 10000) // 100, code % 100
    return code // 1000, (code % 1000) // 100, code % 100


def nccl_sharing(version: Optional[Tuple[int, int, int]]) -> Tuple[str, Dict[str, str], List[str]]:
    """How several ranks share one GPU under ``version``: (description, environment of every
    rank, gpu_rank.py flags). NCCL >= 2.30: its multi-rank-per-GPU mode; older (or unknown):
    one NCCL host per rank (``NCCL_HOSTID`` set per rank by gpu_rank.py), sockets over loopback."""
    if version is not None and tuple(version) >= NCCL_MULTI_RANK_MIN:
        return "NCCL_MULTI_RANK_GPU_ENABLE=1", {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}, []
    env = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}
    return "NCCL_HOSTID per rank, NCCL_SOCKET_IFNAME=lo", env, ["--nccl-hostid-per-rank"]


def read_log_json(text: str) -> Dict[str, object]:
    """A ``--log-json`` file: ``{"startup": obj|None, "iterations": {i: obj}, "summary": obj|None}``
    (the last of each; a resumed run would repeat them). Lines that are not JSON are ignored."""
    out: Dict[str, object] = {"startup": None, "iterations": {}, "summary": None}
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        event = record.get("event")
        if event == "iteration" and isinstance(record.get("iteration"), int):
            out["iterations"][record["iteration"]] = record  # type: ignore[index]
        elif event in ("startup", "summary"):
            out[event] = record
    return out


def loss_keys(record: dict) -> List[str]:
    """The training losses of an iteration record (``lm_loss``, BERT's ``sop_loss``, a mixture of
    experts' ``load_balancing_loss`` and ``z_loss``)."""
    return sorted(k for k in record if k.endswith("_loss") and not k.startswith("validation_"))


@dataclass
class Comparison:
    """Per-iteration losses of a run against its reference."""

    ok: bool
    max_rel_diff: Optional[float]
    iterations: int
    message: str


def compare_losses(run: Dict[int, dict], reference: Dict[int, dict], rtol: float) -> Comparison:
    """Every training loss of every reference iteration, in the run, within ``rtol`` of the
    reference (relative to the reference value); NaN, a missing iteration or a missing loss
    fails. The message names the worst (or first failing) iteration."""
    if not reference:
        return Comparison(False, None, 0, "the reference logged no iteration")
    worst, where = 0.0, ""
    for it in sorted(reference):
        if it not in run:
            return Comparison(False, None, len(run), f"iteration {it} missing ({len(run)} of {len(reference)} logged)")
        keys = loss_keys(reference[it])
        if not keys:
            return Comparison(False, None, len(run), f"the reference's iteration {it} has no loss")
        for key in keys:
            want, got = reference[it][key], run[it].get(key)
            if got is None:
                return Comparison(False, None, len(run), f"iteration {it}: {key} missing")
            if not (isinstance(got, (int, float)) and math.isfinite(got) and math.isfinite(want)):
                return Comparison(False, None, len(run), f"iteration {it} {key}: {got} vs reference {want}")
            rel = abs(got - want) / abs(want) if want else abs(got - want)
            if rel > worst or not where:
                worst, where = max(rel, worst), f"iteration {it} {key}: {got:.7g} vs {want:.7g}"
            if rel > rtol:
                return Comparison(False, rel, len(run), f"iteration {it} {key}: {got:.7g} vs reference {want:.7g} (rel {rel:.1e} > {rtol:g})")
    return Comparison(True, worst, len(reference), f"{len(reference)} iterations within rtol {rtol:g} (max rel {worst:.1e})")


def _median(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def training_numbers(log: Dict[str, object], warmup: int = WARMUP_ITERATIONS) -> Dict[str, object]:
    """Throughput of a run from its ``--log-json``: medians over the iterations after the
    first ``warmup`` (all of them when there are no more) of ``tokens_per_second``,
    ``tflops_per_device`` and ``elapsed_ms``; the peak of ``max_memory_mib`` (iterations and
    summary). A field the log lacks (or logs as null) is listed in ``missing``, not invented."""
    iterations = [log["iterations"][i] for i in sorted(log["iterations"])]  # type: ignore[index]
    measured = iterations[warmup:] or iterations
    out: Dict[str, object] = {"iterations": len(iterations), "missing": []}
    for key, name in (("tokens_per_second", "tokens_per_s"), ("tflops_per_device", "tflops_per_gpu"), ("elapsed_ms", "ms_per_iteration")):
        values = [r[key] for r in measured if isinstance(r.get(key), (int, float))]
        out[name] = _median(values)
        if not values:
            out["missing"].append(key)  # type: ignore[union-attr]
    memory = [r["max_memory_mib"] for r in iterations if isinstance(r.get("max_memory_mib"), (int, float))]
    summary = log.get("summary") or {}
    if isinstance(summary.get("max_memory_mib"), (int, float)):  # type: ignore[union-attr]
        memory.append(summary["max_memory_mib"])  # type: ignore[index]
    out["peak_memory_mib"] = max(memory) if memory else None
    if not memory:
        out["missing"].append("max_memory_mib")  # type: ignore[union-attr]
    startup = log.get("startup") or {}
    out["model_flops_per_iteration"] = startup.get("model_flops_per_iteration")  # type: ignore[union-attr]
    return out


def _fmt(value: Optional[float], spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def summarize_training(numbers: Dict[str, object]) -> str:
    """``58.5k tok/s, 188.0 TFLOP/s, peak 18.6 GiB, 560 ms/it`` (missing fields named)."""
    tokens = numbers.get("tokens_per_s")
    parts = [
        f"{tokens / 1000:.1f}k tok/s" if tokens is not None else "tok/s missing",
        f"{numbers['tflops_per_gpu']:.1f} TFLOP/s" if numbers.get("tflops_per_gpu") is not None else "TFLOP/s missing",
        f"peak {numbers['peak_memory_mib'] / 1024:.1f} GiB" if numbers.get("peak_memory_mib") is not None else "memory missing",
        f"{numbers['ms_per_iteration']:.0f} ms/it" if numbers.get("ms_per_iteration") is not None else "ms/it missing",
    ]
    return ", ".join(parts)


def summarize_costs(costs: dict) -> str:
    """A cost file (CostModel's fields, ms) in one line: F, B, W, I and their ratios to F (I is the
    measured ``t_input`` where the file has it, else ``t_backward - t_weight``, as the simulator
    reads it)."""
    f, b, w, i, fd = (costs.get(k) for k in ("t_forward", "t_backward", "t_weight", "t_input", "t_forward_deferring"))
    if not isinstance(f, (int, float)) or not isinstance(b, (int, float)) or f <= 0:
        return f"no t_forward/t_backward in the cost file ({sorted(costs)})"
    text = f"F {f:.1f} ms, B {b:.1f} ms ({b / f:.2f} F)"
    if isinstance(w, (int, float)):
        i = i if isinstance(i, (int, float)) else b - w
        text += f", W {w:.1f} ms ({w / f:.2f} F), I {i:.1f} ms ({i / f:.2f} F), I + W = {(i + w) / b:.2f} B"
        if isinstance(fd, (int, float)):
            text += f", F_d {fd:.1f} ms ({fd / f:.2f} F)"
    else:
        text += ", t_weight missing"
    return text


def summarize_attention(rows: Sequence[dict]) -> str:
    """One phrase per sequence length of scripts/bench_attention.py's results."""
    return "; ".join(
        f"s {r['seq_length']}: unfused/SDPA {r['speedup']:.2f}x, SDPA {r['sdpa_tflops']:.0f} TFLOP/s" for r in rows
    )


def summarize_hfta(rows: Sequence[dict]) -> str:
    """scripts/bench_hfta.py's rows in one line: each B's speed-up of the fused array over B
    runs one after another, and the largest array's samples/s."""
    if not rows:
        return "no rows"
    last = rows[-1]
    speedups = ", ".join(f"B {r['models']}: {r['speedup']:.2f}x" for r in rows)
    return f"fused vs one after another: {speedups}; B {last['models']} {last['fused_samples_per_s']:.0f} samples/s"


def summarize_split(rows: Sequence[dict]) -> str:
    """scripts/bench_split.py's rows in one line: per row the time ratios (I + W) / B and
    F_d / F, and (I + W) / B in operators."""

    def ratio(phases, top, bottom, measure):
        return sum(phases[p][measure] for p in top) / max(phases[bottom][measure], 1e-12)

    return "; ".join(
        f"{r['row']}: (I + W)/B {ratio(r['phases'], ('I', 'W'), 'B', 'ms'):.3f} time, "
        f"{ratio(r['phases'], ('I', 'W'), 'B', 'operators'):.3f} operators, F_d/F {ratio(r['phases'], ('F_d',), 'F', 'ms'):.3f} time"
        for r in rows
    ) or "no rows"


#: a benchmark's results file: its top-level key -> the one-line summary of its value
BENCHMARK_SUMMARIES = {"attention": summarize_attention, "rows": summarize_hfta, "split": summarize_split}


def summarize_environment(env: dict) -> str:
    """The environment item's numbers in one line."""
    keys = (("gpu", "{}"), ("driver", "driver {}"), ("torch", "torch {}"), ("cuda", "CUDA {}"), ("nccl", "NCCL {}"),
            ("megatron_core", "megatron-core {}"), ("transformer_engine", "TE {}"), ("python", "Python {}"))
    return ", ".join(fmt.format(env[k]) for k, fmt in keys if env.get(k) not in (None, ""))


def format_table(rows: Sequence[dict]) -> str:
    """Markdown table of results (``item``, ``status``, ``numbers``, ``seconds``)."""
    lines = ["| item | status | key numbers | seconds |", "|---|---|---|---|"]
    for row in rows:
        seconds = row.get("seconds")
        cells = [row["item"], row["status"], row.get("numbers", ""), "" if seconds is None else f"{seconds:.1f}"]
        lines.append("| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)


def item_timeout(own: float, remaining: float, minimum: float = MIN_ITEM_S) -> Optional[float]:
    """The timeout an item runs under: its own, cut to the budget left; None (skip it) when
    that would be less than ``min(own, minimum)``."""
    timeout = min(own, remaining)
    return timeout if timeout >= min(own, minimum) else None


def exit_status(rows: Sequence[dict]) -> int:
    """0 when every item that ran is ok (skipped ones aside), else 1."""
    return 0 if all(r["status"] == OK or r["status"].startswith("skipped") for r in rows) else 1


# ----------------------------------------------------------------------------------------------
# the items


@dataclass
class Item:
    """One check: a command run from the repository root under ``timeout`` seconds."""

    name: str
    kind: str  # environment | train | benchmark | calibrate | reference | multirank
    command: List[str]
    timeout: float
    description: str
    needs_gpu: bool = False
    needs_te: bool = False  # runs only where transformer_engine is importable
    env: Dict[str, str] = field(default_factory=dict)
    log_json: Optional[str] = None
    output: Optional[str] = None  # calibration cost file
    reference: Optional[str] = None
    rtol: Optional[float] = None

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + " ".join(shlex.quote(c) for c in self.command)


@dataclass(frozen=True)
class Sizes:
    """The model and run lengths of one mode (GPU or dry run)."""

    tiny: List[str]
    tiny_iters: int
    small: List[str]
    large: List[str]
    train_iters: int
    calibrate: List[str]


GPU_SIZES = Sizes(
    tiny=["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
          "--micro-batch-size", "2", "--global-batch-size", "16", "--vocab-size", "1024"],
    tiny_iters=5,
    small=["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
           "--micro-batch-size", "2", "--global-batch-size", "16", "--vocab-size", "50304"],
    large=["--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
           "--micro-batch-size", "2", "--global-batch-size", "16", "--vocab-size", "50304"],
    train_iters=10,
    calibrate=["--num-layers", "12", "--hidden-size", "3072", "--num-attention-heads", "32", "--seq-length", "1024",
               "--micro-batch-size", "1"],
)  # fmt: skip
DRY_SIZES = Sizes(
    tiny=["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
          "--micro-batch-size", "2", "--global-batch-size", "16", "--vocab-size", "127"],
    tiny_iters=2,
    small=GPU_SIZES.small, large=GPU_SIZES.large, train_iters=GPU_SIZES.train_iters, calibrate=GPU_SIZES.calibrate,
)  # fmt: skip

#: every run's training flags besides the model (seed-only initial weights, no evaluation)
COMMON = ["--seed", "1234", "--lr", "1e-3", "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--adam-eps", "1e-4",
          "--eval-iters", "0", "--log-interval", "1"]  # fmt: skip

#: the mixture-of-experts GPT of the MoE items: 4 experts, top-2, load-balancing and z-losses
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3",
       "--disable-bias-linear"]  # fmt: skip

#: the context-parallel items' model: SDPA core attention (the one with context parallelism) and no
#: dropout (its masks under the sequence split are not the single process's)
CONTEXT_PARALLEL = ["--attention-backend", "sdpa", "--attention-dropout", "0", "--hidden-dropout", "0"]
#: items that need a GPU although they are fp32 (the context-parallel pair: its CPU equivalence is
#: tests/execution/test_context_parallel_equivalence.py's; here it is NCCL's on one shared GPU)
GPU_ONLY = ("ref-gpt-cp-fp32", "bitpipe-pp2-cp2")

#: the fault items' flags: rank 1 fails at the start of iteration 2's training step; the job
#: must end within the 15 s timeout plus the watchdog's bound (docs/faults.md)
FAULT_FLAGS = ["--inject-fault-rank", "1", "--inject-fault-iteration", "2", "--distributed-timeout-minutes", "0.25"]
#: how the one line that ends a faulted job begins (megatron_bitpipe/training/watchdog.py)
FAULT_LINE = "watchdog: job ended at iteration "

#: scripts/bench_split.py's rows the split-bench item measures (one GPU)
SPLIT_ROWS = ("dense bf16 sdpa", "dense bf16 unfused", "moe bf16 sdpa")
#: per-item timeouts (seconds) on the GPU
TIMEOUTS = {"environment": 60, "gpt-small-bf16": 90, "gpt-0.5b-bf16": 120, "gpt-0.5b-bf16-sdpa": 120, "attention-sdpa": 60,
            "hfta-bench": 300,
            "calibrate-fp32": 90, "calibrate-bf16": 90, "calibrate-bf16-sdpa": 90, "split-bench": 150,
            "reference": 60, "multirank": 50, "1f1b-control": 75, "fault": 120,
            "optimus2d-q2": 130}  # fmt: skip  (Optimus 2D: ~9.3 s/iteration over loopback sockets, 5 iterations)
#: the control run of several ranks; the later ones get at least CONTROL_FACTOR x its time
CONTROL, CONTROL_FACTOR = "1f1b-control", 2.0
#: per-item timeouts (seconds) of the dry run on a CPU
DRY_TIMEOUTS = {"environment": 90, "reference": 90, "multirank": 150, "fault": 150}


def build_items(out: Path, work: Path, dry_run: bool, nccl_version: Optional[Tuple[int, int, int]]) -> List[Item]:
    """Every item, in run order, with its command."""
    py = sys.executable
    sizes = DRY_SIZES if dry_run else GPU_SIZES
    gpt, bert = str(SCRIPTS / "pretrain_gpt.py"), str(SCRIPTS / "pretrain_bert.py")

    def timeout(name: str, kind: str) -> float:
        table = DRY_TIMEOUTS if dry_run else TIMEOUTS
        return float(table.get(name, table.get(kind, 60)))

    def log_json(name: str) -> List[str]:
        return ["--log-json", str(work / f"{name}.jsonl")]

    items = [
        Item("environment", "environment", [py, str(Path(__file__).resolve()), "--probe-environment"],
             timeout("environment", "environment"), "GPU, driver, torch, CUDA, NCCL, megatron-core, TE, Python"),
    ]  # fmt: skip
    for name, model, what in (
        ("gpt-small-bf16", sizes.small, "GPT 4 layers h1024 s1024, 1 GPU, bf16"),
        ("gpt-0.5b-bf16", sizes.large, "GPT 8 layers h2048 s2048 (~0.5B), 1 GPU, bf16"),
        ("gpt-0.5b-bf16-sdpa", [*sizes.large, "--attention-backend", "sdpa"], "the same, --attention-backend sdpa"),
    ):
        command = [py, gpt, *model, *COMMON, "--train-iters", str(sizes.train_iters), "--bf16", *log_json(name)]
        items.append(Item(name, "train", command, timeout(name, "train"), what, needs_gpu=True, log_json=str(work / f"{name}.jsonl")))
    attention = str(out / ATTENTION_FILE)
    items.append(Item("attention-sdpa", "benchmark", [py, str(SCRIPTS / "bench_attention.py"), "--device", "cuda", "--json", attention],
                      timeout("attention-sdpa", "benchmark"), "core attention fwd+bwd, unfused vs SDPA, bf16, s 2048 and 4096",
                      needs_gpu=True, output=attention))  # fmt: skip
    hfta = str(out / HFTA_FILE)
    items.append(Item("hfta-bench", "benchmark", [py, str(SCRIPTS / "bench_hfta.py"), "--size", "small", "--models", "1", "2", "4", "8",
                                                  "--warmup", "3", "--iters", "10", "--json", hfta],
                      timeout("hfta-bench", "benchmark"), "HFTA: B = 1, 2, 4, 8 small GPTs fused vs one after another, fp32",
                      needs_gpu=True, output=hfta))  # fmt: skip
    for precision, flags, what in (
        ("fp32", [], "fp32"),
        ("bf16", ["--bf16"], "bf16"),
        ("bf16-sdpa", ["--bf16", "--attention-backend", "sdpa"], "bf16, --attention-backend sdpa"),
    ):
        name, output = f"calibrate-{precision}", str(out / f"calibration_{precision.replace('-', '_')}.json")
        command = [py, str(SCRIPTS / "calibrate_gpu.py"), *sizes.calibrate, *flags, "--output", output]
        items.append(Item(name, "calibrate", command, timeout(name, "calibrate"),
                          f"calibrate_gpu.py, 12 layers h3072 s1024 b1, {what}", needs_gpu=True, output=output))  # fmt: skip
    split = str(work / SPLIT_FILE)
    share = [*sizes.calibrate[sizes.calibrate.index("--hidden-size"):], "--num-layers", "2"]
    items.append(Item("split-bench", "benchmark",
                      [py, str(SCRIPTS / "bench_split.py"), "--device", "cuda", "--rows", ",".join(SPLIT_ROWS), *share,
                       "--warmup", "3", "--iters", "10", "--json-out", split],
                      timeout("split-bench", "benchmark"), "bench_split.py: F, B, F_d, I, W of 2 layers h3072 s1024 b1, bf16",
                      needs_gpu=True, output=split))  # fmt: skip

    tiny = [*sizes.tiny, *COMMON, "--train-iters", str(sizes.tiny_iters)]
    te_layers = ["--transformer-impl", "transformer_engine"]
    references = {
        "ref-gpt-fp32": (gpt, [], "fp32"),
        "ref-gpt-bf16": (gpt, ["--bf16"], "bf16"),
        "ref-bert-fp32": (bert, [], "fp32"),
        "ref-gpt-te-fp32": (gpt, te_layers, "fp32"),
        "ref-moe-gpt-fp32": (gpt, MOE, "fp32"),
        "ref-gpt-cp-fp32": (gpt, CONTEXT_PARALLEL, "fp32"),
    }
    for name, (script, extra, precision) in references.items():
        model = ("BERT" if script == bert else "MoE GPT" if extra == MOE else "GPT")
        model += " with SDPA attention, no dropout" if extra == CONTEXT_PARALLEL else ""
        model += " on Transformer Engine layers" if extra == te_layers else ""
        items.append(Item(name, "reference", [py, script, *tiny, *extra, *log_json(name)], timeout(name, "reference"),
                          f"{model} tiny, one process, {precision} (the reference)",
                          needs_gpu=precision == "bf16" or extra == te_layers or name in GPU_ONLY, needs_te=extra == te_layers,
                          log_json=str(work / f"{name}.jsonl")))  # fmt: skip

    sharing, sharing_env, wrapper_flags = nccl_sharing(nccl_version)
    runs = [
        ("1f1b-control", gpt, ["--pipeline-model-parallel-size", "4"], "ref-gpt-fp32", "megatron-core 1F1B PP4 (control)"),
        ("bitpipe-pp4", gpt, ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4"], "ref-gpt-fp32", "BitPipe PP4"),
        ("optimus2d-q2", gpt, ["--tensor-parallel-mode", "optimus2d", "--tensor-model-parallel-size", "4"], "ref-gpt-fp32", "Optimus 2D q=2 (TP4)"),
        ("bitpipe-split-pp4", gpt, ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4", "--split-backward"],
         "ref-gpt-fp32", "BitPipe PP4 --split-backward"),
        ("bitpipe-pp2-dp2-distopt", gpt, ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
         "ref-gpt-fp32", "BitPipe PP2 x DP2, distributed optimizer"),
        ("bert-bitpipe-pp4", bert, ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4"], "ref-bert-fp32", "BERT, BitPipe PP4"),
        ("bitpipe-pp4-bf16", gpt, ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4", "--bf16"], "ref-gpt-bf16", "BitPipe PP4, bf16"),
        ("bitpipe-split-te-pp4", gpt, ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4", "--split-backward", *te_layers],
         "ref-gpt-te-fp32", "BitPipe PP4 --split-backward on Transformer Engine layers (TE's delay_wgrad_compute)"),
        ("zbv-pp4", gpt, ["--pipeline-schedule", "zbv", "--pipeline-model-parallel-size", "4"], "ref-gpt-fp32", "ZB-V PP4"),
        ("dualpipev-pp4", gpt, ["--pipeline-schedule", "dualpipev", "--pipeline-model-parallel-size", "4"], "ref-gpt-fp32",
         "DualPipeV PP4"),
        ("dualpipev-pp4-layout", gpt, ["--pipeline-schedule", "dualpipev", "--pipeline-model-parallel-size", "4",
                                       "--pipeline-model-parallel-layout", UNEVEN_LAYOUT], "ref-gpt-fp32",
         "DualPipeV PP4, uneven layout (rank 0: embedding and loss stages without layers)"),
        ("moe-bitpipe-pp2-ep2", gpt, [*MOE, "--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2",
                                      "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
         "ref-moe-gpt-fp32", "MoE GPT, BitPipe PP2 x EP2 (alltoall)"),
        ("bitpipe-pp2-cp2", gpt, [*CONTEXT_PARALLEL, "--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2",
                                  "--context-parallel-size", "2"], "ref-gpt-cp-fp32", "BitPipe PP2 x CP2 (keys and values all-gathered)"),
    ]  # fmt: skip
    launcher = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(SCRIPTS / "gpu_rank.py"), *wrapper_flags]
    for name, script, layout, reference, what in runs:
        precision = "bf16" if "--bf16" in layout else "fp32"
        te = "transformer_engine" in layout
        env = dict(sharing_env)  # NCCL's variables; gloo (the dry run) ignores them
        items.append(Item(name, "multirank", [*launcher, script, *tiny, *layout, *log_json(name)], timeout(name, "multirank"),
                          f"{what}, 4 ranks" + ("" if dry_run else f" on one GPU ({sharing})") + f", {precision} vs {reference}",
                          needs_gpu=precision == "bf16" or te or name in GPU_ONLY, needs_te=te, env=env, log_json=str(work / f"{name}.jsonl"),
                          reference=reference, rtol=RTOL[precision]))  # fmt: skip
    for fault in ("hang", "crash"):
        name = f"fault-{fault}-pp4"
        layout = ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4", "--inject-fault", fault, *FAULT_FLAGS]
        items.append(Item(name, "fault", [*launcher, gpt, *tiny, *layout], timeout(name, "fault"),
                          "BitPipe PP4, 4 ranks" + ("" if dry_run else f" on one GPU ({sharing})")
                          + f", --inject-fault {fault} on rank 1 at iteration 2: the job ends with the watchdog's line",
                          env=dict(sharing_env)))  # fmt: skip
    return items


# ----------------------------------------------------------------------------------------------
# running


def probe_environment() -> dict:
    """What the environment item reports (run in its own process: imports can hang or crash)."""
    import importlib.metadata
    import importlib.util

    env: dict = {"python": platform.python_version()}
    import torch

    env["torch"] = torch.__version__
    env["cuda"] = torch.version.cuda
    env["cuda_available"] = torch.cuda.is_available()
    if env["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["compute_capability"] = f"{props.major}.{props.minor}"
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError) as error:
            env["driver"] = f"unknown ({type(error).__name__})"
    else:
        env["gpu"] = "no CUDA GPU"
    try:
        version = parse_nccl_version(torch.cuda.nccl.version())
        env["nccl"] = ".".join(map(str, version)) if version else None
    except Exception as error:  # torch without NCCL (CPU builds)
        env["nccl"] = f"none ({type(error).__name__})"
    try:
        import megatron.core  # noqa: F401

        env["megatron_core"] = importlib.metadata.version("megatron-core")
    except Exception as error:
        env["megatron_core"] = f"not importable ({type(error).__name__}: {error})"
    if importlib.util.find_spec("transformer_engine") is None:
        env["transformer_engine"] = "no"
    else:
        try:
            import transformer_engine  # noqa: F401

            env["transformer_engine"] = getattr(transformer_engine, "__version__", "yes")
        except Exception as error:
            env["transformer_engine"] = f"present, import fails ({type(error).__name__})"
    env["megatron_bitpipe"] = str(REPO)
    return env


class Interrupted(Exception):
    pass


def _on_signal(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


#: environment variable that marks every process of an item (torchrun starts its ranks in
#: sessions of their own, so the launcher's process group does not hold them)
TAG_VARIABLE = "GPU_CHECK_ITEM"
#: gpu_rank.py's ``STACKS_VARIABLE``: the directory where each rank writes its SIGUSR1 stack dump
STACKS_VARIABLE = "GPU_RANK_STACKS_DIR"


def _tagged(tag: str) -> List[int]:
    """Processes whose environment holds ``TAG_VARIABLE=tag`` (Linux /proc; empty elsewhere)."""
    marker = f"{TAG_VARIABLE}={tag}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


def _is_rank(pid: int) -> bool:
    """Whether ``pid`` is a rank started through gpu_rank.py (not torchrun's launcher)."""
    try:
        argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    return "torch.distributed.run" not in argv and any(arg.endswith("gpu_rank.py") for arg in argv)


def _signal(pids: Sequence[int], signum: int) -> int:
    sent = 0
    for pid in pids:
        try:
            os.kill(pid, signum)
            sent += 1
        except OSError:
            continue
    return sent


def _kill_all(pgid: int, tag: str) -> None:
    """SIGKILL the item's process group and every process it tagged."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
    _signal(_tagged(tag), signal.SIGKILL)


@dataclass
class Ran:
    returncode: Optional[int]  # None after a timeout
    seconds: float
    timed_out: bool
    output: str  # what the item wrote to the log
    timeout: float = 0.0


class Runner:
    """Runs items into one log file, each in its own process group."""

    def __init__(self, log_path: Path, dry_run: bool):
        self.log_path = log_path
        self.dry_run = dry_run
        open(log_path, "wb").close()  # a fresh log; appended to by this process and the items'
        self.log = open(log_path, "ab")
        self.current: Optional[Tuple[subprocess.Popen, str]] = None

    def note(self, text: str) -> None:
        self.log.write((text + "\n").encode())
        self.log.flush()

    def run(self, item: Item, index: int, count: int, timeout: float) -> Ran:
        self.note(f"\n===== [{index}/{count}] {item.name} | timeout {timeout:.0f} s | {item.shell()}")
        start_offset = self.log.tell()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(item.env)
        if self.dry_run:
            env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU run, on any machine
        tag = f"{os.getpid()}-{index}"
        env[TAG_VARIABLE] = tag
        stacks = Path(tempfile.mkdtemp(prefix="gpu_check_stacks-"))
        env[STACKS_VARIABLE] = str(stacks)
        start = time.monotonic()
        timed_out = False
        proc = subprocess.Popen(item.command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=self.log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.current = (proc, tag)
        try:
            returncode: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            dumped = _signal([pid for pid in _tagged(tag) if _is_rank(pid)], signal.SIGUSR1)
            if dumped:
                self.note(f"----- {item.name}: timeout; SIGUSR1 (Python stacks of every thread) to {dumped} rank(s)")
                time.sleep(DUMP_GRACE_S)
            _kill_all(proc.pid, tag)
            returncode = proc.wait()
            self._copy_stacks(item.name, stacks)
        finally:
            _kill_all(proc.pid, tag)  # stragglers of a run that ended (e.g. ranks of a dead launcher)
            shutil.rmtree(stacks, ignore_errors=True)
            self.current = None
        seconds = time.monotonic() - start
        self.log.flush()
        with open(self.log_path, "rb") as handle:
            handle.seek(start_offset)
            output = handle.read().decode(errors="replace")
        return Ran(None if timed_out else returncode, seconds, timed_out, output, timeout)

    def _copy_stacks(self, name: str, stacks: Path) -> None:
        """Each rank's stack dump (``rank-<RANK>.txt`` under ``stacks``), one after another."""
        for path in sorted(stacks.glob("rank-*.txt"), key=lambda p: int(p.stem.split("-")[1])):
            text = path.read_text(errors="replace").rstrip()
            if text:
                self.note(f"----- {name}: {path.stem.replace('-', ' ')} stacks\n{text}")

    def stop(self) -> None:
        if self.current is not None:
            _kill_all(self.current[0].pid, self.current[1])

    def close(self) -> None:
        self.log.close()


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    kept = [line if len(line) <= 300 else line[:297] + "..." for line in text.splitlines() if line.strip()]
    return "\n".join("    " + line for line in kept[-lines:])


def evaluate_fault(ran: Ran, cut: bool) -> Tuple[str, str, dict]:
    """(status, key numbers, details) of an injected fault's run: ok when the job ended by
    itself, non-zero, with the watchdog's one line (``FAULT_LINE``)."""
    lines = [line[line.index(FAULT_LINE) :] for line in ran.output.splitlines() if FAULT_LINE in line]
    details = {"ended_after_s": None if ran.timed_out else round(ran.seconds, 1), "fault_line": lines[0] if lines else None}
    if ran.timed_out:
        status = f"timeout (budget, {ran.timeout:.0f} s)" if cut else f"not ended (timeout {ran.timeout:.0f} s)"
        return status, "the faulted job outlived its timeout", details
    if ran.returncode == 0:
        return "failed (exit 0: the fault did not end the job)", "", details
    if not lines:
        return f"failed (exit {ran.returncode}, no watchdog line)", f"ended after {ran.seconds:.1f} s", details
    line = lines[0] if len(lines[0]) <= 240 else lines[0][:237] + "..."
    return OK, f"exit {ran.returncode} after {ran.seconds:.1f} s: {line}", details


def evaluate(item: Item, ran: Ran, logs: Dict[str, dict], cut: bool = False) -> Tuple[str, str, dict]:
    """(status, key numbers, details) of an item that ran; ``cut``: its timeout was cut to
    the budget left (a timeout then says so, not "hung")."""
    if item.kind == "fault":
        return evaluate_fault(ran, cut)
    details: dict = {}
    if ran.timed_out and cut:
        status = f"timeout (budget, {ran.timeout:.0f} s)"
    elif ran.timed_out:
        status = f"hung (timeout {ran.timeout:.0f} s)" if item.kind == "multirank" else f"timeout ({ran.timeout:.0f} s)"
    elif ran.returncode != 0:
        status = f"failed (exit {ran.returncode})"
    else:
        status = OK
    numbers = ""
    if item.kind == "environment":
        for line in ran.output.splitlines():
            if line.startswith(ENV_MARKER):
                details["environment"] = json.loads(line[len(ENV_MARKER) :])
        if "environment" in details:
            numbers = summarize_environment(details["environment"])
        elif status == OK:
            status, numbers = "failed (no environment line)", ""
    if item.log_json:
        try:
            log = read_log_json(Path(item.log_json).read_text(encoding="utf-8"))
        except OSError:
            log = None
        if log is not None:
            if status == OK:
                logs[item.name] = log  # a reference that failed half-way is no reference
            details["losses"] = {i: {k: r[k] for k in loss_keys(r)} for i, r in log["iterations"].items()}
            details["training"] = training_numbers(log)
        if item.kind == "train" and log is not None:
            numbers = summarize_training(details["training"])
            if details["training"]["missing"]:
                numbers += f" (not in --log-json: {', '.join(details['training']['missing'])})"
        elif item.kind == "reference" and log is not None and log["iterations"]:
            last = log["iterations"][max(log["iterations"])]
            numbers = f"{len(log['iterations'])} it, last " + ", ".join(f"{k} {last[k]:.5f}" for k in loss_keys(last))
        elif item.kind == "multirank" and log is not None:
            reference = logs.get(item.reference or "")
            ms = details["training"].get("ms_per_iteration")
            timing = f"; {ms:.0f} ms/it" if ms is not None else ""
            if ran.timed_out:
                timing += f"; {len(log['iterations'])} iteration(s) logged before the timeout"
            if reference is None:
                numbers = f"no reference ({item.reference} did not run to the end){timing}"
                if status == OK:
                    status = "ran, no reference"
            else:
                comparison = compare_losses(log["iterations"], reference["iterations"], item.rtol or 0.0)
                details["comparison"] = asdict(comparison)
                numbers = f"vs {item.reference}: {comparison.message}{timing}"
                if status == OK and not comparison.ok:
                    status = MISMATCH
        elif log is None:
            numbers = "no --log-json written"
            if status == OK:
                status = "failed (no --log-json)"
    if item.kind == "benchmark" and status == OK:
        try:
            results = json.loads(Path(item.output).read_text(encoding="utf-8"))
            key = next(key for key in BENCHMARK_SUMMARIES if key in results)
        except (OSError, ValueError, StopIteration):
            status = "failed (no results file)"
        else:
            details[key] = results[key]
            numbers = BENCHMARK_SUMMARIES[key](results[key])
    if item.kind == "calibrate":
        try:
            costs = json.loads(Path(item.output).read_text(encoding="utf-8")) if status == OK else None
        except (OSError, ValueError):
            costs = None
            status = "failed (no cost file)"
        if costs is not None:
            details["costs"] = costs
            numbers = summarize_costs(costs)
    return status, numbers, details


def write_results(out: Path, meta: dict, rows: List[dict]) -> None:
    (out / RESULTS_FILE).write_text(json.dumps({**meta, "items": rows}, indent=1, default=str) + "\n", encoding="utf-8")
    header = [f"# gpu_check {meta['mode']} ({meta['started']})", ""]
    if meta.get("environment_line"):
        header += [meta["environment_line"], ""]
    header += [f"Several ranks on one GPU: {meta['sharing']}; budget {meta['budget_s']:.0f} s.", ""]
    (out / TABLE_FILE).write_text("\n".join(header) + "\n" + format_table(rows) + "\n", encoding="utf-8")


def have_transformer_engine() -> bool:
    """Whether ``transformer_engine`` is importable here (the TE items run only then)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def _cuda_available() -> Tuple[bool, Optional[Tuple[int, int, int]]]:
    try:
        import torch
    except ImportError:
        return False, None
    available = torch.cuda.is_available()
    try:
        version = parse_nccl_version(torch.cuda.nccl.version()) if available else None
    except Exception:
        version = None
    return available, version


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="directory for the log, results and cost files (created; at most 8 files)")
    parser.add_argument("--dry-run", action="store_true", help="no GPU needed: print every command, run the CPU-runnable parts")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"seconds for all items together (default {DEFAULT_BUDGET_S:.0f}; dry run {DRY_RUN_BUDGET_S:.0f})")
    parser.add_argument("--items", default=None, help="comma-separated item names to run (default: all; references are added as needed)")
    parser.add_argument("--list", action="store_true", help="list the items and exit")
    parser.add_argument("--probe-environment", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.probe_environment:
        print(ENV_MARKER + json.dumps(probe_environment()), flush=True)
        return 0
    if not args.list and not args.out:
        _parser().error("--out is required")
    if not args.dry_run and not args.list:
        available, nccl_version = _cuda_available()
        if not available:
            print(NO_GPU, file=sys.stderr, flush=True)
            return 2
    else:
        nccl_version = None
    if args.budget_s is None:
        args.budget_s = DRY_RUN_BUDGET_S if args.dry_run else DEFAULT_BUDGET_S
    out = Path(args.out or ".").resolve()
    work = Path(tempfile.gettempdir()) / "gpu_check_WORK" if args.list else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    items = build_items(out, work, args.dry_run, nccl_version)
    if args.items:
        wanted = {name.strip() for name in args.items.split(",") if name.strip()}
        unknown = wanted - {i.name for i in items}
        if unknown:
            shutil.rmtree(work, ignore_errors=True)
            _parser().error(f"--items: unknown {', '.join(sorted(unknown))} (known: {', '.join(i.name for i in items)})")
        wanted |= {i.reference for i in items if i.name in wanted and i.reference}
        items = [i for i in items if i.name in wanted]
    if args.list:
        for item in items:
            print(f"{item.name:26} {item.timeout:4.0f} s  {item.description}")
        return 0

    out.mkdir(parents=True, exist_ok=True)
    sharing = nccl_sharing(nccl_version)[0] if not args.dry_run else "gloo on the CPU (dry run)"
    meta = {"mode": "dry run (CPU)" if args.dry_run else "GPU", "started": datetime.now().isoformat(timespec="seconds"),
            "budget_s": args.budget_s, "sharing": sharing, "repository": str(REPO)}  # fmt: skip
    print(f"gpu_check: {len(items)} items, budget {args.budget_s:.0f} s, {meta['mode']}; several ranks on one GPU: {sharing}", flush=True)
    print(f"gpu_check: writing {out / LOG_FILE}, {out / RESULTS_FILE}, {out / TABLE_FILE}", flush=True)
    runner = Runner(out / LOG_FILE, args.dry_run)
    runner.note(f"gpu_check {meta['mode']} started {meta['started']}, budget {args.budget_s:.0f} s, sharing: {sharing}")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _on_signal)
    rows: List[dict] = []
    logs: Dict[str, dict] = {}
    have_te = have_transformer_engine()
    control_seconds: Optional[float] = None
    begin = time.monotonic()
    try:
        for index, item in enumerate(items, 1):
            row = {"item": item.name, "description": item.description, "command": item.shell(), "status": "", "numbers": "", "seconds": None}
            print(f"[{index}/{len(items)}] {item.name}: {item.description}", flush=True)
            if args.dry_run:
                print(f"    $ {item.shell()}", flush=True)
            remaining = args.budget_s - (time.monotonic() - begin)
            own = item.timeout
            if item.kind == "multirank" and control_seconds is not None:
                own = max(own, CONTROL_FACTOR * control_seconds)  # a slow but working set-up is no hang
            timeout = item_timeout(own, remaining)
            if args.dry_run and item.needs_gpu:
                row["status"] = NEEDS_GPU
                runner.note(f"\n===== [{index}/{len(items)}] {item.name} | {NEEDS_GPU} | {item.shell()}")
            elif item.needs_te and not have_te:
                row["status"] = NEEDS_TE
                runner.note(f"\n===== [{index}/{len(items)}] {item.name} | {NEEDS_TE} | {item.shell()}")
            elif timeout is None:
                row["status"] = OVER_BUDGET
                row["numbers"] = f"{max(remaining, 0):.0f} s left of {args.budget_s:.0f}"
                runner.note(f"\n===== [{index}/{len(items)}] {item.name} | {OVER_BUDGET} | {item.shell()}")
            else:
                row["timeout_s"] = timeout
                ran = runner.run(item, index, len(items), timeout)
                status, numbers, details = evaluate(item, ran, logs, cut=timeout < own)
                row.update(status=status, numbers=numbers, seconds=round(ran.seconds, 1), returncode=ran.returncode, **details)
                if status == OK or status.startswith("ran"):
                    pass
                elif status == MISMATCH:
                    print(f"    {numbers}", flush=True)
                else:
                    print(f"    last lines of its output:\n{_tail(ran.output)}", flush=True)
                runner.note(f"----- {item.name}: {status}; {numbers}; {ran.seconds:.1f} s")
                if item.name == CONTROL and status == OK:
                    control_seconds = ran.seconds
                if item.kind == "environment" and "environment" in details:
                    meta["environment"] = details["environment"]
                    meta["environment_line"] = numbers
            print(f"    -> {row['status']}" + (f" ({row['seconds']:.1f} s)" if row["seconds"] is not None else ""), flush=True)
            rows.append(row)
            write_results(out, {**meta, "elapsed_s": round(time.monotonic() - begin, 1)}, rows)
    except Interrupted as signal_name:
        runner.stop()
        runner.note(f"----- interrupted by {signal_name}")
        print(f"gpu_check: interrupted by {signal_name}; results so far in {out / RESULTS_FILE}", flush=True)
        write_results(out, {**meta, "interrupted": str(signal_name), "elapsed_s": round(time.monotonic() - begin, 1)}, rows)
        print(format_table(rows), flush=True)
        return 1
    finally:
        runner.close()
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.monotonic() - begin
    meta["elapsed_s"] = round(elapsed, 1)
    write_results(out, meta, rows)
    print(f"\ngpu_check: {elapsed:.0f} s; {meta.get('environment_line', 'environment unknown')}", flush=True)
    print(format_table(rows), flush=True)
    return exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
