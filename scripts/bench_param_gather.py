#!/usr/bin/env python
"""Emulated benchmark: is the distributed optimizer's parameter all-gather hidden behind the forward?

Four real ranks (gloo), a plan schedule at pipeline 2 x data parallel 2 with megatron-core's
distributed optimizer (one per chunk, :mod:`megatron_bitpipe.execution.distributed_optimizer`),
real megatron-core chunks, DDP and Adam; every transformer layer's compute is emulated device
time (:mod:`megatron_bitpipe.benchmarking.emulation`, the blocking device: the layer sleeps
``t_F`` / ``t_B`` per rank's share), and every chunk's parameter all-gather is made to take
``--t-gather`` ms on an emulated link: the real gloo gather runs, and its result counts as
arrived ``t_gather`` after the link is free (one link per rank, gathers in the order they
start). The code under test decides when gathers start and when the forward waits; the
emulation only gives the link its time.

Two runs of the same model, steps round-robin: the gather after the step, blocking (each
chunk's gather in stage order, ``chunks x t_gather`` per step), and ``overlap_param_gather``
(``--overlap-param-gather``: every chunk's gather started after the step, waited for by its
first forward). Per run: the mean step time (``forward_backward_func`` and ``optimizer.step``,
from one barrier to the next over ``--steps`` steps), and the gather time the ranks spent
waiting (``exposed``, the slowest rank's mean per step). Prints one JSON object.

Usage::

    python scripts/bench_param_gather.py                     # bitpipe, t_F 40 ms, gather 15 ms
    python scripts/bench_param_gather.py --schedule zbv --t-gather 30
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

SEED = 1234
MODES = ("blocking", "overlapped")


@dataclass(frozen=True)
class Settings:
    schedule: str = "bitpipe"
    num_microbatches: int = 4  # per data-parallel rank
    t_forward: float = 40.0  # ms, one micro-batch through one rank's share of the layers
    t_backward: float = 80.0
    t_gather: float = 15.0  # ms, one chunk's parameter all-gather on the emulated link
    layers_per_rank: int = 4
    steps: int = 4
    warmup: int = 1
    hidden_size: int = 32
    seq_length: int = 16
    micro_batch_size: int = 2
    vocab_size: int = 128


class _Link:
    """One rank's emulated link: a gather started at ``t`` has arrived at
    ``max(t, link free) + t_gather``; ``exposed`` sums the time spent waiting for arrivals."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.free = 0.0
        self.exposed = 0.0

    def start(self) -> float:
        self.free = max(time.perf_counter(), self.free) + self.seconds
        return self.free

    def wait(self, arrival: float) -> None:
        from megatron_bitpipe.benchmarking.emulation import sleep_until

        before = time.perf_counter()
        sleep_until(arrival)
        self.exposed += time.perf_counter() - before


def _on_link(bucket_group, link: _Link) -> None:
    """Give ``bucket_group``'s parameter all-gather the link's time: a blocking gather returns
    when its data has arrived, an asynchronous one is waited for (megatron's
    ``finish_param_sync``, or ``start_param_sync(force_sync=True)``) until then."""
    start, finish = bucket_group.start_param_sync, bucket_group.finish_param_sync
    arrival = {"at": None}

    def start_param_sync(force_sync: bool = False):
        in_flight = bucket_group.param_gather_handle is not None
        if force_sync and in_flight:
            link.wait(arrival["at"])
            return start(force_sync=True)
        start(force_sync=force_sync)
        arrival["at"] = link.start()
        if bucket_group.param_gather_handle is None:
            link.wait(arrival["at"])

    def finish_param_sync(skip_next_bucket_dispatch: bool = False):
        if bucket_group.param_gather_handle is not None:
            link.wait(arrival["at"])
        return finish(skip_next_bucket_dispatch=skip_next_bucket_dispatch)

    bucket_group.start_param_sync = start_param_sync
    bucket_group.finish_param_sync = finish_param_sync


def _build(settings: Settings, overlap: bool, link: _Link):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_bitpipe.benchmarking.emulation import emulated_layer_spec
    from megatron_bitpipe.benchmarking.megatron_baseline import tiny_gpt_config
    from megatron_bitpipe.execution.groups import ParallelGrid
    from megatron_bitpipe.model.build import build_pipeline_model
    from megatron_bitpipe.schedules import CostModel, ScheduleChoice
    from megatron_bitpipe.training.optimizer import build_optimizer

    per_layer = 1e-3 / settings.layers_per_rank
    choice = ScheduleChoice(settings.schedule)
    if choice.splits_backward:
        choice = ScheduleChoice(settings.schedule, costs=CostModel(t_forward=settings.t_forward, t_backward=settings.t_backward))
    config = tiny_gpt_config(
        num_layers=settings.layers_per_rank * 2, hidden_size=settings.hidden_size, num_attention_heads=4,
        pipeline_model_parallel_size=2,
    )
    model = build_pipeline_model(
        config,
        ParallelGrid(pp=2, dp=2),
        choice.placement(2),
        vocab_size=settings.vocab_size,
        max_sequence_length=settings.seq_length,
        seed=SEED,
        share_embeddings_and_output_weights=False,
        layer_spec=emulated_layer_spec(settings.t_forward * per_layer, settings.t_backward * per_layer),
        ddp_config=DistributedDataParallelConfig(
            overlap_grad_reduce=True, grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_param_gather=overlap
        ),
    )
    for chunk in model.chunks:
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            _on_link(group, link)
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3, use_distributed_optimizer=True, clip_grad=0.0))
    return choice, model, optimizer


def _run_rank(settings: Settings) -> dict:
    import torch.distributed as dist

    from megatron_bitpipe.benchmarking.megatron_baseline import mean_loss_forward_step, synthetic_microbatches
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.execution.forward_backward import make_forward_backward_func

    enable_cpu_megatron()
    links = {mode: _Link(1e-3 * settings.t_gather) for mode in MODES}
    runs = {mode: _build(settings, mode == "overlapped", links[mode]) for mode in MODES}
    functions = {mode: make_forward_backward_func(runs[mode][0]) for mode in MODES}
    rank_in_dp = runs["blocking"][1].groups.dp_rank
    batches = synthetic_microbatches(SEED, 2 * settings.num_microbatches, settings.micro_batch_size, settings.seq_length, settings.vocab_size)
    mine = batches[rank_in_dp * settings.num_microbatches : (rank_in_dp + 1) * settings.num_microbatches]
    times = {mode: [] for mode in MODES}
    exposed = {mode: [] for mode in MODES}
    for repeat in range(settings.warmup + 1):
        for mode in MODES:
            _, model, optimizer = runs[mode]
            dist.barrier()
            start, links[mode].exposed = time.perf_counter(), 0.0
            for _ in range(settings.steps):
                for chunk in model.chunks:
                    chunk.zero_grad_buffer()
                optimizer.zero_grad()
                functions[mode](
                    forward_step_func=mean_loss_forward_step, data_iterator=iter(mine), model=model.chunks,
                    num_microbatches=settings.num_microbatches, seq_length=settings.seq_length,
                    micro_batch_size=settings.micro_batch_size,
                )
                optimizer.step()
            dist.barrier()
            if repeat >= settings.warmup:
                times[mode].append((time.perf_counter() - start) / settings.steps)
                exposed[mode].append(links[mode].exposed / settings.steps)
    return {"times": times, "exposed": exposed, "chunks": len(runs["blocking"][1].chunks)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Settings()
    parser.add_argument("--schedule", default=defaults.schedule, help="a plan schedule that runs at pipeline 2 (bitpipe, zbv, dualpipev, ...)")
    parser.add_argument("--num-microbatches", type=int, default=defaults.num_microbatches, help="per data-parallel rank")
    parser.add_argument("--t-forward", type=float, default=defaults.t_forward, help="ms per micro-batch and rank")
    parser.add_argument("--t-backward", type=float, default=defaults.t_backward, help="ms per micro-batch and rank")
    parser.add_argument("--t-gather", type=float, default=defaults.t_gather, help="ms of one chunk's parameter all-gather")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="timed steps per run")
    args = parser.parse_args(argv)
    settings = Settings(
        schedule=args.schedule, num_microbatches=args.num_microbatches, t_forward=args.t_forward,
        t_backward=args.t_backward, t_gather=args.t_gather, steps=args.steps,
    )
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron_bitpipe.cpu.launcher import launch

    load_before = os.getloadavg()
    ranks = launch(_run_rank, 4, settings, timeout=900)
    step = {mode: 1e3 * max(r["times"][mode][0] for r in ranks) for mode in MODES}
    exposed = {mode: 1e3 * max(r["exposed"][mode][0] for r in ranks) for mode in MODES}
    gather = ranks[0]["chunks"] * settings.t_gather
    print(json.dumps({
        "settings": asdict(settings),
        "chunks_per_rank": ranks[0]["chunks"],
        "gather_ms_per_step": gather,
        "step_ms": step,
        "exposed_gather_ms": exposed,
        "hidden_fraction": 1.0 - exposed["overlapped"] / gather,
        "step_ratio_overlapped_to_blocking": step["overlapped"] / step["blocking"],
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
