#!/usr/bin/env python
"""What the split backward runs, against the whole backward, on one device share.

The share is ``scripts/calibrate_gpu.py``'s: ``--num-layers`` megatron-core layers built and
run as a middle pipeline stage of training (the project's DDP, ``Float16Module`` in bf16, the
input in the pipeline dtype), with the project's weight-gradient deferral
(:mod:`megatron_bitpipe.execution.weight_grad`) as the plan executor runs it. Each phase of one
micro-batch:

* ``F``, ``B``: the forward and the whole backward;
* ``F_d``: the forward while the linears defer their weight gradients (every forward of a
  split-backward plan);
* ``I``: the backward with the weight gradients deferred; ``W``: the chunk's ``backward_dw``.

For each: the median time (ms, ``--iters`` after ``--warmup``; CUDA events on a GPU), and, in
one counted iteration after a warm-up one, what ran below autograd
(:class:`~megatron_bitpipe.benchmarking.meters.OperatorMeter`): operators dispatched (views
apart), matrix-multiply FLOPs and bytes the operators wrote. The ratios that decide whether a
split pays: ``(I + W) / B`` and ``F_d / F``, each in operators, bytes written, FLOPs and time.

Rows (``--rows``, default all): dense layers in fp32 and bf16, megatron's unfused attention
and SDPA (``--attention-backend sdpa``); a mixture-of-experts share (4 experts, top 2, no
biases as Megatron-LM's MoE examples, bf16, SDPA; every layer an MoE layer); one tensor-parallel rank of TP 2 with sequence parallelism (bf16, SDPA; two ranks, run
under ``torch.distributed.run``; on a GPU it needs two). Each row runs in its own processes.

    python scripts/bench_split.py                        # CPU: gloo and the CPU layer
    python scripts/bench_split.py --device cuda          # a GPU (the TP 2 row needs two)
    python scripts/bench_split.py --update-doc docs/performance.md

``--update-doc FILE`` replaces the block between ``<!-- begin:bench-split -->`` and
``<!-- end:bench-split -->`` in FILE with the tables, the command, the machine and its load
average. ``--json`` prints one object per row instead; ``--json-out FILE`` also writes
``{"split": [rows]}`` to FILE. Counts do not depend on the machine's
load; times on a shared CPU do (rerun when the load average was high).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

#: the phases of one micro-batch, in the order calibrate_gpu.measure_share times them
PHASES = ("F", "B", "F_d", "I", "W")
#: row name -> calibrate_gpu flags beside the share's sizes
ROWS: Dict[str, List[str]] = {
    "dense fp32 unfused": ["--attention-backend", "local"],
    "dense fp32 sdpa": ["--attention-backend", "sdpa"],
    "dense bf16 unfused": ["--bf16", "--attention-backend", "local"],
    "dense bf16 sdpa": ["--bf16", "--attention-backend", "sdpa"],
    "moe bf16 sdpa": ["--bf16", "--attention-backend", "sdpa", "--num-experts", "4", "--moe-router-topk", "2",
                      "--disable-bias-linear"],
    "tp2+sp bf16 sdpa": ["--bf16", "--attention-backend", "sdpa", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
}
#: what the ratios compare (keys of a phase's record)
MEASURES = ("operators", "views", "bytes_written", "flops", "ms")
DOC_BEGIN, DOC_END = "<!-- begin:bench-split -->", "<!-- end:bench-split -->"
#: seconds one row may take (its start-up, one counted and the timed iterations)
ROW_TIMEOUT = 600


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object per row")
    parser.add_argument("--json-out", metavar="FILE", help='also write {"split": [rows]} to FILE (scripts/gpu_check.py reads it)')
    parser.add_argument("--update-doc", metavar="FILE", help="write the tables into FILE's bench-split block")
    parser.add_argument("--measure", metavar="ROW", help=argparse.SUPPRESS)  # one row, in this process (internal)
    parser.add_argument("--result", metavar="FILE", help=argparse.SUPPRESS)  # where --measure writes (rank 0)
    return parser


def run_argv(args: argparse.Namespace) -> List[str]:
    """The flags shared by this run's rows: sizes, device, iterations."""
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(args.seq_length),
            "--micro-batch-size", str(args.micro_batch_size), "--device", args.device,
            "--warmup", str(args.warmup), "--iters", str(args.iters)]  # fmt: skip


def share_argv(args: argparse.Namespace, row: str) -> List[str]:
    """calibrate_gpu's flags for ``row`` of this run."""
    return [*run_argv(args), *ROWS[row]]


def row_ranks(row: str) -> int:
    flags = ROWS[row]
    return int(flags[flags.index("--tensor-model-parallel-size") + 1]) if "--tensor-model-parallel-size" in flags else 1


# -- one row, in its own processes ---------------------------------------------------------------


def measure(argv: Sequence[str]) -> Dict[str, object]:
    """Build the share of calibrate_gpu flags ``argv`` on this rank and measure every phase:
    ``{"phases": {phase: {ms, operators, views, flops, bytes_written, operator_names}}, ...}``."""
    import torch
    import torch.distributed as dist

    import calibrate_gpu as calibrate
    from megatron_bitpipe.benchmarking.meters import OperatorMeter

    args = calibrate._parser().parse_args(list(argv))
    calibrate.check_args(args)
    train_args = calibrate.training_args(args)
    device = torch.device(args.device)
    started = calibrate._start_distributed(train_args, device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    model, config = calibrate.build_share(train_args, device)
    shape = calibrate.share_shape(args)
    meters: List[OperatorMeter] = []

    def counted(fn) -> float:
        meter = OperatorMeter()
        with meter:
            fn()
        meters.append(meter)
        return float(len(meters))

    counts = calibrate.measure_share(model, config, shape, counted, 1, 1, device)  # the second iteration is kept
    if counts["split_note"] is not None:
        raise RuntimeError(counts["split_note"])
    timer = calibrate._cuda_timer if device.type == "cuda" else calibrate._cpu_timer
    times = calibrate.measure_share(model, config, shape, timer, args.warmup, args.iters, device)
    keys = {"F": "t_forward", "B": "t_backward", "F_d": "t_forward_deferring", "I": "t_input", "W": "t_weight"}
    phases = {
        phase: {
            "ms": times[keys[phase]],
            "operators": meter.operator_count,
            "views": meter.view_count,
            "flops": meter.flops,
            "bytes_written": meter.bytes_written,
            "operator_names": dict(meter.operators),
        }
        for phase, meter in zip(PHASES, meters[-len(PHASES):])
    }
    result = {
        "phases": phases,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "layer_impl": times["layer_impl"],
        "dtype": times["dtype"],
        "parameters": times["parameters"],
        "shape": list(shape),
    }
    if started:
        dist.destroy_process_group()
    return result


def run_row(args: argparse.Namespace, row: str) -> Dict[str, object]:
    """``row`` measured in new processes (torch.distributed.run for more than one rank)."""
    with tempfile.TemporaryDirectory(prefix="bench-split-") as tmp:
        result_file = os.path.join(tmp, "row.json")
        ranks = row_ranks(row)
        launcher = [sys.executable] if ranks == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        command = [*launcher, str(Path(__file__).resolve()), "--measure", row, "--result", result_file, *run_argv(args)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=ROW_TIMEOUT)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
            raise RuntimeError(f"row {row!r} failed (exit {done.returncode}): {shlex.join(command)}\n{tail}")
        with open(result_file, encoding="utf-8") as handle:
            return dict(json.load(handle), row=row, ranks=ranks)


# -- tables --------------------------------------------------------------------------------------


def ratios(phases: Dict[str, Dict[str, float]]) -> Dict[str, Dict[str, float]]:
    """``{"(I + W) / B": {measure: ratio}, "F_d / F": {...}}`` for operators, views, bytes
    written, FLOPs and time (equal values give 1, zeros included)."""

    def ratio(top: float, bottom: float) -> float:
        return 1.0 if top == bottom else (top / bottom if bottom else float("inf"))

    measures = MEASURES
    return {
        "(I + W) / B": {m: ratio(phases["I"][m] + phases["W"][m], phases["B"][m]) for m in measures},
        "F_d / F": {m: ratio(phases["F_d"][m], phases["F"][m]) for m in measures},
    }


def markdown(results: Sequence[Dict[str, object]]) -> str:
    """The ratio table, then the per-phase table."""
    names = "operators | views | bytes written | FLOPs | time"
    lines = [f"| row | (I + W) / B: {names} | F_d / F: {names} |", "|---|" + "---|" * 2 * len(MEASURES)]
    for result in results:
        r = ratios(result["phases"])
        cells = [f"{r[k][m]:.3f}" for k in ("(I + W) / B", "F_d / F") for m in MEASURES]
        lines.append(f"| {result['row']} | " + " | ".join(cells) + " |")
    lines += ["", "| row | phase | time (ms) | operators | views | MFLOP | MB written |", "|---|---|---|---|---|---|---|"]
    for result in results:
        for phase in PHASES:
            p = result["phases"][phase]
            lines.append(f"| {result['row']} | {phase} | {p['ms']:.2f} | {p['operators']} | {p['views']} | "
                         f"{p['flops'] / 1e6:.1f} | {p['bytes_written'] / 1e6:.2f} |")  # fmt: skip
    return "\n".join(lines)


def update_doc(path: str, text: str) -> None:
    """Replace the bench-split block of ``path`` with ``text`` (ValueError without the markers)."""
    doc = Path(path).read_text(encoding="utf-8")
    if DOC_BEGIN not in doc or DOC_END not in doc:
        raise ValueError(f"{path} has no {DOC_BEGIN} ... {DOC_END} block")
    head, rest = doc.split(DOC_BEGIN, 1)
    _, tail = rest.split(DOC_END, 1)
    Path(path).write_text(f"{head}{DOC_BEGIN}\n{text}\n{DOC_END}{tail}", encoding="utf-8")


def _commit() -> str:
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.measure is not None:  # one row, in this process (a rank of it)
        result = measure(share_argv(args, args.measure))
        if int(os.environ.get("RANK", "0")) == 0:
            with open(args.result, "w", encoding="utf-8") as handle:
                json.dump(result, handle)
        return 0
    rows = [row.strip() for row in args.rows.split(",") if row.strip()]
    unknown = [row for row in rows if row not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(ROWS)}")
    results = []
    for row in rows:
        print(f"measuring {row} ...", file=sys.stderr, flush=True)
        results.append(run_row(args, row))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"split": results}) + "\n", encoding="utf-8")
    if args.json:
        for result in results:
            print(json.dumps(result))
        return 0
    load = os.getloadavg()
    shown = list(argv if argv is not None else sys.argv[1:])
    if args.update_doc:
        shown = [a for a in shown if a not in ("--update-doc", args.update_doc) and not a.startswith("--update-doc=")]
    text = "\n".join([
        "```bash",
        shlex.join(["python", "scripts/bench_split.py", *shown]),
        "```",
        "",
        markdown(results),
        "",
        f"({results[0]['device']}, {args.num_layers} layers, "
        f"h {args.hidden_size}, {args.num_attention_heads} heads, s {args.seq_length}, b {args.micro_batch_size}; "
        f"times: median of {args.iters} after {args.warmup}; counts: one iteration after one; commit {_commit()}, "
        f"{platform.machine()}, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f})",
    ])
    print(text)
    if args.update_doc:
        update_doc(args.update_doc, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
