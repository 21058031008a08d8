#!/usr/bin/env python
"""Predicted training throughput of every schedule for the BitPipe paper's configurations.

The configurations are those of the BitPipe repository's README (8 GPUs, pipeline size 8,
no data or tensor parallelism, fp16):

* GPT: 96 layers, hidden 3072, 32 heads, sequence 1024, micro-batch 1, global batch 16;
* BERT: 64 layers, hidden 2560, 64 heads, sequence 512, micro-batch 4, global batch 32.

For each, the simulator times one step of every schedule (1F1B, interleaved v=2, Chimera,
BitPipe, and BitPipe with a split backward, its ``W``'s placed for the same costs) under a
cost model and reports samples/s = N x micro-batch / step time (the
optimizer step is not included), for the README's number of micro-batches N and for 4D.

Costs come from ``--costs FILE`` (written by ``scripts/calibrate_gpu.py`` for that model's
sizes with ``--num-layers`` = layers per device share; pass ``--model``), or, without a
file, from FLOP counts at an *assumed* achieved GPU throughput (``--achieved-tflops``,
default 140 TFLOP/s, about 45% of an A100's 312 TFLOP/s fp16 peak) and assumed link
bandwidths (:mod:`megatron_bitpipe.schedules.costs`). The output says which.

Gradient sync: each chunk's gradients are all-reduced among its replicas (two for
Chimera, BitPipe and DualPipe) and the ``--data-parallel-size`` ranks, timed from the
device share's gradient bytes and the all-reduce bus bandwidth (``grad_bytes``,
``sync_bandwidth``); schedules with one replica and no data parallelism have nothing to
all-reduce.

Usage::

    python scripts/predict_throughput.py                        # FLOP-based, GPT and BERT
    python scripts/predict_throughput.py --costs gpt.json --model gpt
    python scripts/predict_throughput.py --json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict
from typing import Dict, List, Optional, Sequence

from megatron_bitpipe import schedules
from megatron_bitpipe.schedules.costs import Hardware, analytic_costs
from megatron_bitpipe.schedules.model_shape import ModelShape

PIPELINE_SIZE = 8
MODELS: Dict[str, dict] = {
    "gpt": dict(shape=ModelShape(96, 3072, 32, 1024, micro_batch_size=1), global_batch_size=16),
    "bert": dict(shape=ModelShape(64, 2560, 64, 512, micro_batch_size=4), global_batch_size=32),
}
SCHEDULES = ("1f1b", "interleaved", "chimera", "bitpipe", "bitpipe+split-backward")  # ScheduleChoice labels
BASELINE = "interleaved"


def predict(model: str, costs: schedules.CostModel, microbatch_counts: Sequence[int], source: str) -> List[dict]:
    """One row per (N, schedule) for ``model`` under ``costs``."""
    shape = MODELS[model]["shape"]
    rows = []
    for num_microbatches in microbatch_counts:
        for schedule in SCHEDULES:
            plan = schedules.ScheduleChoice.from_label(schedule, costs).plan(PIPELINE_SIZE, num_microbatches)
            schedules.validate_plan(plan)
            result = schedules.simulate(plan, costs)
            rows.append(
                dict(
                    model=model,
                    schedule=schedule,
                    pp=PIPELINE_SIZE,
                    num_microbatches=num_microbatches,
                    micro_batch_size=shape.micro_batch_size,
                    step_time=result.makespan,
                    samples_per_second=1e3 * num_microbatches * shape.micro_batch_size / result.makespan,
                    bubble_ratio=result.bubble_ratio,
                    peak_activations=max(result.peak_activations),
                    costs=asdict(costs),
                    cost_source=source,
                )
            )
    baseline = {r["num_microbatches"]: r["step_time"] for r in rows if r["schedule"] == BASELINE}
    for row in rows:
        row["speedup_vs_interleaved"] = baseline[row["num_microbatches"]] / row["step_time"]
    return rows


def markdown(rows: List[dict]) -> str:
    lines = [
        "| model | N | schedule | step (ms) | samples/s | speedup vs interleaved | bubble | peak act. (Ma) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model'].upper()} | {r['num_microbatches']} | {r['schedule']} | {r['step_time']:.0f} "
            f"| {r['samples_per_second']:.2f} | {r['speedup_vs_interleaved']:.3f} | {100 * r['bubble_ratio']:.1f}% "
            f"| {r['peak_activations']:g} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), help="only this configuration (required with --costs)")
    parser.add_argument("--costs", metavar="FILE", help="cost file from scripts/calibrate_gpu.py (ms)")
    parser.add_argument("--num-microbatches", type=int, nargs="+", help="N values (default: the README's and 4D)")
    parser.add_argument("--achieved-tflops", type=float, default=140.0, help="assumed sustained TFLOP/s per GPU")
    parser.add_argument("--p2p-latency-ms", type=float, default=Hardware.p2p_latency_ms)
    parser.add_argument("--p2p-bandwidth-gbs", type=float, default=Hardware.p2p_bandwidth_gbs)
    parser.add_argument("--allreduce-bandwidth-gbs", type=float, default=Hardware.allreduce_bandwidth_gbs,
                        help="all-reduce bus bandwidth between replicas")
    parser.add_argument("--json", action="store_true", help="print one JSON list")
    parser.add_argument("--update-doc", metavar="FILE.md", help="rewrite the predicted-throughput block of FILE.md")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.costs and not args.model:
        parser.error("--model: say which configuration --costs was calibrated for")
    try:
        hardware = Hardware(
            achieved_tflops=args.achieved_tflops,
            p2p_latency_ms=args.p2p_latency_ms,
            p2p_bandwidth_gbs=args.p2p_bandwidth_gbs,
            allreduce_bandwidth_gbs=args.allreduce_bandwidth_gbs,
        )
    except ValueError as error:
        parser.error(f"--achieved-tflops/--p2p-*/--allreduce-*: {error}")
    rows = []
    notes = []
    for model in [args.model] if args.model else sorted(MODELS, reverse=True):
        shape = MODELS[model]["shape"]
        counts = args.num_microbatches or (MODELS[model]["global_batch_size"] // shape.micro_batch_size, 4 * PIPELINE_SIZE)
        if args.costs:
            from megatron_bitpipe.schedules.costs import read_cost_file

            try:
                base = schedules.CostModel(**read_cost_file(args.costs))
            except (OSError, ValueError) as error:
                parser.error(f"--costs: {error}")
            source = f"calibrated ({args.costs})"
        else:
            base = analytic_costs(shape, PIPELINE_SIZE, hardware)
            source = (
                f"FLOP-based, assumed {hardware.achieved_tflops:g} TFLOP/s per GPU, p2p {hardware.p2p_bandwidth_gbs:g} GB/s "
                f"+ {hardware.p2p_latency_ms:g} ms, all-reduce {hardware.allreduce_bandwidth_gbs:g} GB/s"
            )
        try:
            rows += predict(model, base, sorted(set(counts)), source)
        except schedules.ScheduleConfigError as error:
            parser.error(str(error))
        split = "" if base.t_weight is None and base.t_input is None else (
            f" (split backward: t_I = {base.input_time:.1f} ms, t_W = {base.weight_time:.1f} ms)"
        )
        notes.append(
            f"{model.upper()} costs: {source}. Per device share ({shape.num_layers // PIPELINE_SIZE} layers, one "
            f"micro-batch): t_F = {base.t_forward:.1f} ms, t_B = {base.t_backward:.1f} ms{split}, p2p {base.message_time:.3f} ms "
            f"per message, gradient all-reduce of a device share over a replica pair {base.sync_time(1.0, 2):.1f} ms."
        )
    if args.json:
        print(json.dumps(rows))
    else:
        print(markdown(rows))
        print("\n" + "\n".join(notes))
    if args.update_doc:
        from doc_blocks import update_file

        command = " ".join(["python", "scripts/predict_throughput.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])])
        block = f"```bash\n{command}\n```\n\n{markdown(rows)}\n\n" + "\n\n".join(notes)
        try:
            update_file(args.update_doc, {"predicted-throughput": block})
        except (ValueError, OSError) as error:
            parser.error(f"--update-doc: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
