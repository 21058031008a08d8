#!/usr/bin/env python
"""Context parallelism's memory: peak activation bytes per rank and step time against the sequence
length, for CP 1, 2 and 4 on 4 CPU ranks, next to the simulator's prediction.

Each layout is one launch of 4 gloo ranks (``megatron_bitpipe.cpu``): CP 1 x PP 4, CP 2 x PP 2 and
CP 4 x PP 1, all under BitPipe where the pipeline has two stages or more (1F1B on the one stage of
CP 4), a small GPT on megatron-core's local layers with SDPA core attention (fp32, no dropout, the
context-parallel layer of :mod:`megatron_bitpipe.model.sdpa_attention`). For every ``--seq-lengths``
value a model is built, ``--warmup`` steps run, then ``--steps`` steps are timed (one
``forward_backward_func`` call each, gradient finalisation included, the optimizer step left out),
while a :class:`~megatron_bitpipe.benchmarking.meters.LiveActivationMeter` tracks every tensor
autograd saves for backward (parameters excluded) from its save to its release: its peak over the
step is the rank's peak activation memory. Reported per (layout, S): the largest rank's measured
peak and the prediction of :func:`~megatron_bitpipe.schedules.model_step.simulate_model`
(:class:`~megatron_bitpipe.schedules.model_shape.ModelShape` with ``context_parallel_size``, the
same schedule, ``N`` and sizes; ``attention_backend sdpa``: a log-sum-exp per query instead of the
scores), and the median step time (the CPU's; wall clock of 4 processes sharing the cores).

Usage::

    python scripts/bench_context_parallel_memory.py                 # S 64, 128, 256; 3 launches of 4 ranks, minutes
    python scripts/bench_context_parallel_memory.py --json          # one JSON list
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RANKS = 4
LAYOUTS = ((1, 4, "bitpipe"), (2, 2, "bitpipe"), (4, 1, "1f1b"))  # (CP, PP, schedule)
VOCAB, SEED = 256, 1234


def _rank(cp: int, pp: int, schedule: str, seqs: List[int], args: dict) -> List[dict]:
    """On every rank: each sequence length's peak saved bytes and step times."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_bitpipe import schedules
    from megatron_bitpipe.benchmarking.megatron_baseline import (
        context_parallel_forward_step, mean_loss_forward_step, synthetic_microbatches, tiny_gpt_config,
    )  # fmt: skip
    from megatron_bitpipe.benchmarking.meters import LiveActivationMeter
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.execution.forward_backward import make_step_func
    from megatron_bitpipe.execution.groups import ParallelGrid
    from megatron_bitpipe.model.build import build_pipeline_model
    from megatron_bitpipe.model.chunks import default_gpt_layer_spec
    from megatron_bitpipe.model.sdpa_attention import SdpaDotProductAttention, with_core_attention

    enable_cpu_megatron()
    choice = schedules.ScheduleChoice(schedule)
    out = []
    for seq in seqs:
        config = tiny_gpt_config(num_layers=args["layers"], hidden_size=args["hidden"], num_attention_heads=args["heads"],
                                 pipeline_model_parallel_size=pp, context_parallel_size=cp,
                                 hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
        model = build_pipeline_model(
            config, ParallelGrid(tp=1, dp=1, pp=pp, cp=cp), choice.placement(pp), vocab_size=VOCAB, max_sequence_length=seq,
            seed=SEED, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
            layer_spec=with_core_attention(default_gpt_layer_spec(config), SdpaDotProductAttention),
        )  # fmt: skip
        forward_step = context_parallel_forward_step(model.groups.rank_pgs.cp) if cp > 1 else mean_loss_forward_step
        step_func = make_step_func(choice)
        meter = LiveActivationMeter([p for c in model.chunks for p in c.parameters()])
        batches = synthetic_microbatches(SEED, args["n"], args["micro_batch"], seq, VOCAB)
        times, peaks = [], []
        for step in range(args["warmup"] + args["steps"]):
            for chunk in model.chunks:
                chunk.zero_grad_buffer()
            dist.barrier()
            meter.reset_peaks()
            start = time.perf_counter()
            with meter:
                step_func(forward_step_func=forward_step, data_iterator=iter(batches), model=model.chunks,
                          num_microbatches=args["n"], seq_length=seq, micro_batch_size=args["micro_batch"])  # fmt: skip
            dist.barrier()
            if step >= args["warmup"]:
                times.append((time.perf_counter() - start) * 1e3)
                peaks.append(meter.peak_bytes)
        out.append({"seq_length": seq, "peak_saved_bytes": max(peaks), "step_ms": statistics.median(times)})
    return out


def predicted_peak(cp: int, pp: int, schedule: str, seq: int, args: dict) -> float:
    """The simulator's largest rank's peak activation bytes for the same run."""
    from megatron_bitpipe.schedules import CostModel, ScheduleChoice
    from megatron_bitpipe.schedules.layer_split import StageLayers
    from megatron_bitpipe.schedules.memory import TrainingMemory
    from megatron_bitpipe.schedules.model_shape import ModelShape
    from megatron_bitpipe.schedules.model_step import simulate_model

    shape = ModelShape(num_layers=args["layers"], hidden_size=args["hidden"], num_attention_heads=args["heads"], seq_length=seq,
                       vocab_size=VOCAB, micro_batch_size=args["micro_batch"], make_vocab_size_divisible_by=128,
                       attention_backend="sdpa", hidden_dropout=0.0, attention_dropout=0.0, context_parallel_size=cp)  # fmt: skip
    plan = ScheduleChoice(schedule).plan(pp, args["n"])
    layers = StageLayers.even(args["layers"], plan.placement.num_stages)
    step = simulate_model(plan, CostModel(), shape, TrainingMemory(), layers)
    return max(m.activations for m in step.memory)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--layers", type=int, default=8, help="transformer layers (BitPipe PP 4: a multiple of 8)")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("-N", "--num-microbatches", type=int, default=4, dest="n")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch")
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args(argv)
    bad = [s for s in ns.seq_lengths if s % 8]
    if bad:
        parser.error(f"--seq-lengths {bad[0]}: every length must be a multiple of 2 x CP = 8")
    args = {k: getattr(ns, k) for k in ("layers", "hidden", "heads", "micro_batch", "n", "warmup", "steps")}
    from megatron_bitpipe.cpu.launcher import launch

    rows = []
    for cp, pp, schedule in LAYOUTS:
        per_rank = launch(_rank, RANKS, cp, pp, schedule, ns.seq_lengths, args, timeout=ns.timeout)
        for i, seq in enumerate(ns.seq_lengths):
            peak = max(r[i]["peak_saved_bytes"] for r in per_rank)
            rows.append({"cp": cp, "pp": pp, "schedule": schedule, "seq_length": seq, "measured_peak_bytes": peak,
                         "predicted_peak_bytes": predicted_peak(cp, pp, schedule, seq, args),
                         "step_ms": max(r[i]["step_ms"] for r in per_rank)})  # fmt: skip
    if ns.json:
        print(json.dumps(rows))
        return 0
    print("| CP x PP | schedule | S | peak activations per rank, measured (MiB) | predicted (MiB) | measured / predicted | step (ms, CPU) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cp']} x {r['pp']} | {r['schedule']} | {r['seq_length']} | {r['measured_peak_bytes'] / 2**20:.2f} | "
              f"{r['predicted_peak_bytes'] / 2**20:.2f} | {r['measured_peak_bytes'] / r['predicted_peak_bytes']:.2f} | {r['step_ms']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
