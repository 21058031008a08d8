#!/usr/bin/env python
"""Emulated cluster: megatron-core's pipeline schedules against BitPipe on the same model.

Real ranks (one process each, gloo point-to-point), real megatron-core model plumbing
(GPTModel chunks with embedding, final norm, LM head and loss, megatron DDP with overlapped
gradient reduction), but every transformer layer's compute is emulated device time inside an
autograd Function (:mod:`megatron_bitpipe.benchmarking.emulation`): a layer's forward takes
``t_F / layers-per-rank`` and its backward ``t_B / layers-per-rank``, with real tensors and a
real autograd graph. Waiting ranks leave the CPU free, so 8-16 ranks run on two cores. The
default ``--device async`` queues layer time on an emulated CUDA stream that the CPU runs
ahead of (sends leave when their data is computed); ``--device blocking`` sleeps in place.

In one invocation, for every pipeline size D of the grid (one launch of D ranks), every
schedule runs on the same emulated model, built the way each runtime builds it:

* ``1f1b``, ``interleaved`` (v=2) — megatron-core's own
  ``forward_backward_pipelining_without_interleaving`` / ``_with_interleaving`` on
  megatron's looped chunks (Megatron-LM's p2p defaults: batched p2p for 1F1B, overlapped p2p
  for interleaved);
* ``bitpipe``, ``chimera`` — this package's ``make_forward_backward_func`` on
  ``build_pipeline_model`` chunks (overlapped p2p, eager per-chunk gradient sync);
* ``bitpipe+split-backward`` — BitPipe with a split backward (``--split-backward``): each emulated
  layer's backward time is ``t_I`` (``--t-input``, default ``t_B - t_W``) in ``I`` and ``t_W``
  (``--t-weight``, default the rest of ``t_B``, or half of it) in the deferred ``W``; its
  order is planned for ``CostModel(t_F, t_B, t_W, t_I)``;
* ``zbv``, ``dualpipev`` — the zero-bubble V and DeepSeek's DualPipeV (one replica on a V,
  split backwards of their own, ordered for the same costs) on the same executor;
  DualPipeV runs only where ``N >= 2D``;
* optionally ``dualpipe`` (DeepSeek's two-pipeline DualPipe, ``N`` even and ``>= 2D``), and
  ``plan-1f1b``, ``plan-interleaved`` — megatron's schedules as plans on this package's
  executor (separates the schedule from the runtime executing it).

Mixture of experts (``--moe-a2a-bandwidth``): every emulated layer is an MoE layer whose
forward and backward (a split backward's ``I``) also wait for its dispatch and combine
all-to-alls, ``--moe-a2a-bytes / --moe-a2a-bandwidth`` ms each, on the emulated device (as a
p2p message's time is its bytes over the link); the simulator's costs get the same
``2 x layers-per-rank`` all-to-alls in ``t_F``, ``t_B`` and ``t_I`` (what
``StageCosts.for_model`` adds per MoE layer), and the split schedules are ordered for them.
The default schedules are then megatron-core's interleaved, BitPipe (whole and split
backward), DualPipe, DualPipeV and ZB-V, and the closing note adds every schedule's speedup
over BitPipe.

Per (schedule, D, N) it reports the median (and best) step time of ``--repeats`` steps (one
``forward_backward_func`` call including gradient finalisation; the optimizer step is not
timed; repeats go round-robin over the schedules, after ``--warmup`` discarded rounds), the
simulator's prediction for the same costs — ``simulate(generate(schedule, D, N),
CostModel(t_F, t_B, t_p2p))`` with the one-way p2p time measured on these ranks before the
race — and the speedup over megatron-core's interleaved schedule. Memory: the peak of the
activations saved for backward by the emulated layers on each rank, in Ma (one micro-batch
through L/D layers, the simulator's unit), next to the simulator's peak in-flight count, and
the peak bytes of all saved tensors.

Times are milliseconds. Usage::

    python scripts/bench_emulated.py --quick            # D in {4, 8}, N in {D, 4D}: < 5 min
    python scripts/bench_emulated.py --json             # one JSON list on stdout
    python scripts/bench_emulated.py --costs costs.json # t_forward / t_backward from a cost file
    python scripts/bench_emulated.py --grid 4:8 --moe-a2a-bandwidth 1024 # MoE layers, 4 ms all-to-alls
    python scripts/bench_emulated.py --quick --plot docs/images/bench_emulated.png \\
        --update-doc docs/performance.md                # regenerate the documentation
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Sequence

PLAN_SCHEDULES = ("bitpipe", "bitpipe+split-backward", "chimera", "zbv", "dualpipev", "dualpipe", "plan-1f1b", "plan-interleaved")
MEGATRON_SCHEDULES = ("1f1b", "interleaved")
SCHEDULES = MEGATRON_SCHEDULES + PLAN_SCHEDULES
DEFAULT_SCHEDULES = ("1f1b", "interleaved", "chimera", "bitpipe", "bitpipe+split-backward", "zbv", "dualpipev")
MOE_SCHEDULES = ("interleaved", "bitpipe", "bitpipe+split-backward", "dualpipe", "dualpipev", "zbv")
BASELINE = "interleaved"
#: the schedule the MoE closing note compares the others with
MOE_REFERENCE = "bitpipe"
SEED = 1234


@dataclass(frozen=True)
class Settings:
    """What every rank needs to know (picklable). Times in milliseconds.

    ``t_forward`` / ``t_backward``: one micro-batch through one device's share of the model
    (``layers_per_rank`` layers), the simulator's cost unit; ``t_weight``: the part of
    ``t_backward`` a split backward defers to ``W``; ``t_input``: its ``I`` (None: as
    :class:`~megatron_bitpipe.schedules.CostModel`'s defaults). ``a2a_bytes`` /
    ``a2a_bandwidth`` (bytes, bytes per ms): one all-to-all of an emulated MoE layer
    (:attr:`t_a2a`); a bandwidth of 0 makes the layers dense.
    """

    t_forward: float = 30.0
    t_backward: float = 60.0
    t_weight: Optional[float] = None
    t_input: Optional[float] = None
    layers_per_rank: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 4
    seq_length: int = 16
    micro_batch_size: int = 2
    vocab_size: int = 128
    asynchronous: bool = True
    repeats: int = 3
    warmup: int = 1
    calibration_rounds: int = 20
    a2a_bytes: float = 0.0
    a2a_bandwidth: float = 0.0

    @property
    def t_a2a(self) -> float:
        """ms of one all-to-all (dispatch or combine) of one MoE layer; 0: dense layers."""
        return self.a2a_bytes / self.a2a_bandwidth if self.a2a_bandwidth > 0 else 0.0

    def num_layers(self, pipeline_size: int) -> int:
        return self.layers_per_rank * pipeline_size

    def compute_costs(self, **communication):
        """CostModel of the emulated compute (and ``communication`` fields, e.g. t_p2p); with
        MoE layers every forward, backward and ``I`` of a device share also waits its layers'
        two all-to-alls each."""
        from megatron_bitpipe.schedules import CostModel

        costs = CostModel(
            t_forward=self.t_forward, t_backward=self.t_backward, t_weight=self.t_weight, t_input=self.t_input,
            a2a_bandwidth=self.a2a_bandwidth, **communication,
        )
        return costs.with_all_to_alls(self.layers_per_rank, self.a2a_bytes)

    @property
    def message_bytes(self) -> int:
        """One activation (or gradient) crossing ranks: [s, b, h] fp32."""
        return 4 * self.seq_length * self.micro_batch_size * self.hidden_size


def plan_choice(schedule: str, settings: Settings):
    """The :class:`~megatron_bitpipe.schedules.ScheduleChoice` of a plan-executed ``schedule``
    label (``plan-1f1b``: our executor running 1F1B's plan); a ``+split-backward`` variant, and
    the schedules that always split (``zbv``, ``dualpipev``), are ordered for the emulated
    compute costs."""
    from megatron_bitpipe.schedules import ScheduleChoice

    choice = ScheduleChoice.from_label(schedule.removeprefix("plan-"))
    return replace(choice, costs=settings.compute_costs()) if choice.splits_backward else choice


def plan_of(schedule: str, settings: Settings, pipeline_size: int, num_microbatches: int):
    """The plan a plan-executed ``schedule`` runs; raises ScheduleConfigError for an unsupported N."""
    return plan_choice(schedule, settings).plan(pipeline_size, num_microbatches)


# ----------------------------------------------------------------------------- rank side


def _layer_spec(settings: Settings):
    from megatron_bitpipe.benchmarking.emulation import emulated_layer_spec

    per_layer = 1e-3 / settings.layers_per_rank
    weight = None if settings.t_weight is None else settings.t_weight * per_layer
    input_ = None if settings.t_input is None else settings.t_input * per_layer
    return emulated_layer_spec(
        settings.t_forward * per_layer, settings.t_backward * per_layer, weight, input_, all_to_all_seconds=1e-3 * settings.t_a2a
    )


def _config(settings: Settings, pipeline_size: int, **overrides):
    from megatron_bitpipe.benchmarking.megatron_baseline import tiny_gpt_config

    return tiny_gpt_config(
        num_layers=settings.num_layers(pipeline_size),
        hidden_size=settings.hidden_size,
        num_attention_heads=settings.num_attention_heads,
        pipeline_model_parallel_size=pipeline_size,
        **overrides,
    )


class _Runner:
    """One schedule on this rank's chunks: ``step(batches)`` runs one forward_backward_func."""

    def __init__(self, chunks, step):
        self.chunks = chunks
        self._step = step

    def parameters(self):
        return [p for chunk in self.chunks for p in chunk.parameters()]

    def step(self, batches, num_microbatches: int) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self._step(batches, num_microbatches)


def _megatron_runner(schedule: str, settings: Settings, pipeline_size: int) -> _Runner:
    """megatron-core's own schedule on megatron's looped chunks, as Megatron-LM wires it."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_with_interleaving,
        forward_backward_pipelining_without_interleaving,
    )

    from megatron_bitpipe.benchmarking import megatron_baseline as baseline
    from megatron_bitpipe.execution.groups import ParallelGrid
    from megatron_bitpipe.model.build import init_megatron_state

    interleaved = schedule == "interleaved"
    # Megatron-LM's defaults: overlapped p2p with interleaving, batched p2p without.
    config = _config(
        settings,
        pipeline_size,
        virtual_pipeline_model_parallel_size=2 if interleaved else None,
        overlap_p2p_comm=interleaved,
        batch_p2p_comm=not interleaved,
    )
    pg = baseline.build_looped_process_groups(ParallelGrid(pp=pipeline_size))
    init_megatron_state(pg, SEED)
    chunks = baseline.build_looped_chunks(
        config, pg, vocab_size=settings.vocab_size, max_sequence_length=settings.seq_length, layer_spec=_layer_spec(settings)
    )
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True)
    model = baseline.wrap_looped_ddp(chunks, config, pg, ddp_config)
    sync = [chunk.start_grad_sync for chunk in model]
    config.grad_sync_func = sync if interleaved else sync[0]
    schedule_func = (
        forward_backward_pipelining_with_interleaving if interleaved else forward_backward_pipelining_without_interleaving
    )
    communicator = P2PCommunicator(pg.pp, config)

    def step(batches, num_microbatches):
        schedule_func(
            forward_step_func=baseline.mean_loss_forward_step,
            data_iterator=[iter(batches) for _ in model],
            model=model,
            num_microbatches=num_microbatches,
            seq_length=settings.seq_length,
            micro_batch_size=settings.micro_batch_size,
            p2p_communicator=communicator,
            pg_collection=pg,
        )

    return _Runner(model, step)


def _plan_runner(schedule: str, settings: Settings, pipeline_size: int) -> _Runner:
    """A plan on this package's executor and chunks (build_pipeline_model)."""
    from megatron_bitpipe.model.build import build_pipeline_model
    from megatron_bitpipe.execution.forward_backward import make_forward_backward_func
    from megatron_bitpipe.execution.groups import ParallelGrid
    from megatron_bitpipe.benchmarking.megatron_baseline import mean_loss_forward_step

    choice = plan_choice(schedule, settings)
    config = _config(settings, pipeline_size, overlap_p2p_comm=True)
    model = build_pipeline_model(
        config,
        ParallelGrid(pp=pipeline_size),
        choice.placement(pipeline_size),
        vocab_size=settings.vocab_size,
        max_sequence_length=settings.seq_length,
        seed=SEED,
        share_embeddings_and_output_weights=False,
        layer_spec=_layer_spec(settings),
    )
    forward_backward = make_forward_backward_func(choice)

    def step(batches, num_microbatches):
        forward_backward(
            forward_step_func=mean_loss_forward_step,
            data_iterator=iter(batches),
            model=model.chunks,
            num_microbatches=num_microbatches,
            seq_length=settings.seq_length,
            micro_batch_size=settings.micro_batch_size,
        )

    return _Runner(model.chunks, step)


def _measure_p2p(settings: Settings, pipeline_size: int) -> float:
    """One-way time (ms) of one [s, b, h] message between neighbouring ranks, all pairs
    (0, 1), (2, 3), ... exchanging at once: the median over ``calibration_rounds`` of a
    ping-pong burst's time / (2 x messages), the largest over pairs. Same value on every rank."""
    import torch
    import torch.distributed as dist

    rank, burst = dist.get_rank(), 10
    peer = rank ^ 1
    message = torch.zeros(settings.message_bytes // 4)
    one_way = []
    for _ in range(settings.calibration_rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(burst):
            if rank % 2 == 0:
                dist.send(message, peer)
                dist.recv(message, peer)
            else:
                dist.recv(message, peer)
                dist.send(message, peer)
        one_way.append((time.perf_counter() - start) / (2 * burst))
    local = torch.tensor([statistics.median(one_way)], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return 1e3 * local.item()


def _run_rank(settings: Settings, pipeline_size: int, microbatches: Sequence[int], schedule_names: Sequence[str]) -> dict:
    """Launched on every rank: calibrate p2p, build every schedule's model, then run the steps.

    Steps go round-robin — each repeat runs one step of every (schedule, N) in turn — so that
    a disturbance from other processes on the machine spreads over all schedules instead of
    falling on one. Each step starts after a barrier; its start and end times are recorded
    (``time.perf_counter``, one clock for every process of the machine) and its end is when
    the emulated device and every send are done.
    """
    import torch.distributed as dist

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.benchmarking.emulation import EmulatedDevice
    from megatron_bitpipe.benchmarking.megatron_baseline import synthetic_microbatches
    from megatron_bitpipe.benchmarking.meters import LiveActivationMeter

    enable_cpu_megatron()
    calibration = {"t_p2p": _measure_p2p(settings, pipeline_size)}
    runners = {}
    for schedule in schedule_names:
        build = _megatron_runner if schedule in MEGATRON_SCHEDULES else _plan_runner
        runners[schedule] = build(schedule, settings, pipeline_size)
    runs = [
        dict(schedule=schedule, num_microbatches=n, starts=[], ends=[], meter=LiveActivationMeter(runner.parameters()))
        for schedule, runner in runners.items()
        for n in microbatches
        if valid_microbatches(schedule, pipeline_size, n)
    ]
    batches = {
        n: synthetic_microbatches(SEED, n, settings.micro_batch_size, settings.seq_length, settings.vocab_size)
        for n in microbatches
    }
    for repeat in range(settings.warmup + settings.repeats):
        for run in runs:
            n = run["num_microbatches"]
            dist.barrier()
            start = time.perf_counter()
            with EmulatedDevice(settings.asynchronous), run["meter"]:
                runners[run["schedule"]].step(batches[n], n)
            if repeat >= settings.warmup:
                run["starts"].append(start)
                run["ends"].append(time.perf_counter())
    for run in runs:
        meter = run.pop("meter")
        run.update(peak_layer_bytes=meter.peak_layer_bytes, peak_saved_bytes=meter.peak_bytes)
    return {"calibration": calibration, "runs": runs}


# ----------------------------------------------------------------------------- driver side


def valid_microbatches(schedule: str, pipeline_size: int, num_microbatches: int) -> bool:
    """Whether ``schedule`` runs ``num_microbatches`` on ``pipeline_size`` ranks (same rules as
    the plan generators; megatron-core's interleaved schedule needs a multiple of D too)."""
    choice = plan_choice(schedule, Settings())
    return not choice.problems(pipeline_size, num_microbatches)


def predict(schedule: str, settings: Settings, pipeline_size: int, num_microbatches: int, costs):
    """The simulator's :class:`~megatron_bitpipe.schedules.SimulationResult` for the plan
    that ``schedule`` runs, under ``costs`` (a CostModel)."""
    from megatron_bitpipe import schedules

    plan = plan_of(schedule, settings, pipeline_size, num_microbatches)
    schedules.validate_plan(plan)
    return schedules.simulate(plan, costs)


def summarize(settings: Settings, pipeline_size: int, per_rank: List[dict]) -> List[dict]:
    """Rows for one pipeline size from every rank's records (see the module docstring)."""
    calibration = per_rank[0]["calibration"]
    costs = settings.compute_costs(**calibration)
    activation_unit = settings.layers_per_rank * settings.message_bytes  # bytes of one Ma
    rows = []
    for index, run in enumerate(per_rank[0]["runs"]):
        records = [rank["runs"][index] for rank in per_rank]
        steps = [
            1e3 * (max(r["ends"][k] for r in records) - min(r["starts"][k] for r in records))
            for k in range(settings.repeats)
        ]
        schedule, num_microbatches = run["schedule"], run["num_microbatches"]
        simulated = predict(schedule, settings, pipeline_size, num_microbatches, costs)
        step_time = statistics.median(steps)
        rows.append(
            dict(
                schedule=schedule.removeprefix("plan-"),
                runtime="megatron-core" if schedule in MEGATRON_SCHEDULES else "megatron_bitpipe",
                pp=pipeline_size,
                num_microbatches=num_microbatches,
                step_time=step_time,
                best_step_time=min(steps),
                step_times=steps,
                predicted_step_time=simulated.makespan,
                error=step_time / simulated.makespan - 1.0,
                predicted_bubble_ratio=simulated.bubble_ratio,
                peak_activations=[r["peak_layer_bytes"] / activation_unit for r in records],
                predicted_peak_activations=simulated.peak_activations,
                peak_saved_bytes=[r["peak_saved_bytes"] for r in records],
                costs=asdict(costs),
                t_a2a=settings.t_a2a,
                device="async" if settings.asynchronous else "blocking",
            )
        )
    return rows


def add_speedups(rows: List[dict]) -> None:
    """``speedup_vs_interleaved``: megatron-core interleaved's step time / this row's, same
    (D, N); measured and predicted. None where the baseline did not run."""
    baseline = {
        (r["pp"], r["num_microbatches"]): r for r in rows if r["schedule"] == BASELINE and r["runtime"] == "megatron-core"
    }
    for row in rows:
        base = baseline.get((row["pp"], row["num_microbatches"]))
        row["speedup_vs_interleaved"] = base["step_time"] / row["step_time"] if base else None
        row["predicted_speedup_vs_interleaved"] = (
            base["predicted_step_time"] / row["predicted_step_time"] if base else None
        )


def run_grid(settings: Settings, grid: Dict[int, Sequence[int]], schedule_names: Sequence[str], timeout: float) -> List[dict]:
    """Launch one job of D ranks per pipeline size; return the rows of every run.

    Each row records ``load_average``: the machine's 1-minute load average before and after
    its job (other processes competing for the cores make the emulation less exact).
    """
    from megatron_bitpipe.cpu.launcher import launch

    rows = []
    for pipeline_size, microbatches in grid.items():
        runnable = [n for n in microbatches if any(valid_microbatches(s, pipeline_size, n) for s in schedule_names)]
        if not runnable:
            continue
        load_before = os.getloadavg()[0]
        per_rank = launch(_run_rank, pipeline_size, settings, pipeline_size, runnable, schedule_names, timeout=timeout)
        load = (load_before, os.getloadavg()[0])
        rows += [dict(row, load_average=load) for row in summarize(settings, pipeline_size, per_rank)]
    add_speedups(rows)
    return rows


def _label(row: dict) -> str:
    return row["schedule"] if row["runtime"] == "megatron-core" else f"{row['schedule']} (ours)"


def markdown_table(rows: List[dict]) -> str:
    """Step times (median and best of the repeats), predictions, speedups (of the medians) and
    peak activations, one line per run."""
    lines = [
        "| D | N | schedule | step (ms) | best (ms) | predicted (ms) | error | speedup vs interleaved "
        "| predicted speedup | peak act. (Ma, max rank) | predicted peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        speedup = "—" if r["speedup_vs_interleaved"] is None else f"{r['speedup_vs_interleaved']:.3f}"
        predicted_speedup = (
            "—" if r["predicted_speedup_vs_interleaved"] is None else f"{r['predicted_speedup_vs_interleaved']:.3f}"
        )
        lines.append(
            f"| {r['pp']} | {r['num_microbatches']} | {_label(r)} | {r['step_time']:.0f} | {r['best_step_time']:.0f} "
            f"| {r['predicted_step_time']:.0f} "
            f"| {100 * r['error']:+.1f}% | {speedup} | {predicted_speedup} "
            f"| {max(r['peak_activations']):g} | {max(r['predicted_peak_activations']):g} |"
        )
    return "\n".join(lines)


def run_conditions(rows: List[dict], elapsed: float) -> str:
    """One paragraph: costs, repeats, device model, machine load, wall time."""
    from megatron_bitpipe.schedules import CostModel

    costs = rows[0]["costs"]
    loads = [x for r in rows for x in r["load_average"]]
    p2p = {r["pp"]: r["costs"]["t_p2p"] for r in rows}
    p2p_text = ", ".join(f"{t:.2f} ms (D={d})" for d, t in sorted(p2p.items()))
    moe = ""
    if rows[0].get("t_a2a"):
        moe = (f"Every layer an MoE layer: each forward, backward and I of a layer waits two all-to-alls of "
               f"{rows[0]['t_a2a']:g} ms, included in the costs below. ")  # fmt: skip
    return (
        f"{moe}Costs per device share: t_F = {costs['t_forward']:g} ms, t_B = {costs['t_backward']:g} ms "
        f"(split backward: t_I = {CostModel(**costs).input_time:g} ms, t_W = {CostModel(**costs).weight_time:g} ms); measured p2p "
        f"one-way time {p2p_text}. "
        f"Median of {len(rows[0]['step_times'])} steps per run, {rows[0]['device']} emulated device, "
        f"{os.cpu_count()} CPU cores with a 1-minute load average of {min(loads):.1f}-{max(loads):.1f} "
        f"(other jobs included) during the runs; {elapsed / 60:.1f} minutes in all."
    )


def closing_note(rows: List[dict]) -> str:
    """Measured ratios: speedups over megatron-core interleaved, emulation errors, memory."""
    lines = []
    for pipeline_size, num_microbatches in sorted({(r["pp"], r["num_microbatches"]) for r in rows}):
        case = [r for r in rows if (r["pp"], r["num_microbatches"]) == (pipeline_size, num_microbatches)]
        speedups = ", ".join(
            f"{_label(r)} {r['speedup_vs_interleaved']:.3f}x (simulator {r['predicted_speedup_vs_interleaved']:.3f}x)"
            for r in case
            if r["speedup_vs_interleaved"] is not None and not (r["schedule"] == BASELINE and r["runtime"] == "megatron-core")
        )
        lines.append(f"- D={pipeline_size}, N={num_microbatches}, vs megatron-core interleaved: {speedups}.")
        reference = next((r for r in case if r["schedule"] == MOE_REFERENCE and r["runtime"] != "megatron-core"), None)
        if reference is not None and reference.get("t_a2a"):
            ratios = ", ".join(
                f"{_label(r)} {reference['step_time'] / r['step_time']:.3f}x "
                f"(best steps {reference['best_step_time'] / r['best_step_time']:.3f}x, "
                f"simulator {reference['predicted_step_time'] / r['predicted_step_time']:.3f}x)"
                for r in case if r is not reference
            )  # fmt: skip
            lines.append(f"- D={pipeline_size}, N={num_microbatches}, speedup over {_label(reference)} (medians): {ratios}.")
    for label in dict.fromkeys(_label(r) for r in rows):
        errors = [100 * r["error"] for r in rows if _label(r) == label]
        peaks: Dict[int, float] = {}
        for r in rows:
            if _label(r) == label:  # largest over ranks and over N, per pipeline size
                peaks[r["pp"]] = max(peaks.get(r["pp"], 0.0), *r["peak_activations"])
        lines.append(
            f"- {label}: step time vs simulator {min(errors):+.1f}% to {max(errors):+.1f}%; "
            "peak activations (max over ranks, Ma) " + ", ".join(f"D={d}: {p:g}" for d, p in sorted(peaks.items())) + "."
        )
    return "\n".join(lines)


def plot(rows: List[dict], path: str) -> None:
    """Bars: measured (median) step time of every schedule for each (D, N); black ticks: the
    simulator's prediction. Both divided by megatron-core interleaved's prediction for that
    (D, N), so lower is faster and 1 is the interleaved schedule's simulated step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["pp"], r["num_microbatches"]) for r in rows})
    labels = list(dict.fromkeys(_label(r) for r in rows))
    colours = dict(zip(labels, plt.get_cmap("tab10").colors))
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.7 * len(cases)), 3.8))
    for j, case in enumerate(cases):
        in_case = {_label(r): r for r in rows if (r["pp"], r["num_microbatches"]) == case}
        reference = in_case.get(BASELINE, next(iter(in_case.values())))["predicted_step_time"]
        for i, label in enumerate(labels):
            if label not in in_case:
                continue
            row, x = in_case[label], j + (i - (len(labels) - 1) / 2) * width
            ax.bar(x, row["step_time"] / reference, width, color=colours[label], label=label if j == 0 else None)
            ax.plot([x - width / 2, x + width / 2], [row["predicted_step_time"] / reference] * 2, "k-", linewidth=2)
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xticks(range(len(cases)), [f"D={d}, N={n}" for d, n in cases])
    ax.set_ylabel("step time / interleaved (simulated)")
    ax.set_title("Emulated cluster: measured step time (bars) and simulator prediction (black)", fontsize="medium")
    ax.legend(fontsize="small", ncol=len(labels), loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


QUICK_GRID = {4: (4, 16), 8: (8, 32)}
FULL_GRID = {4: (4, 8, 16), 8: (8, 16, 32)}


def _parse_grid(text: str) -> Dict[int, Sequence[int]]:
    """``"4:4,16;8:8,32"`` -> {4: (4, 16), 8: (8, 32)}."""
    grid = {}
    for part in text.split(";"):
        pipeline_size, _, microbatches = part.partition(":")
        grid[int(pipeline_size)] = tuple(int(n) for n in microbatches.split(","))
    return grid


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"grid {QUICK_GRID} (default: {FULL_GRID})")
    parser.add_argument("--grid", type=_parse_grid, help='pipeline sizes and micro-batch counts, e.g. "4:4,16;8:8,32"')
    parser.add_argument("--schedules", default=None,
                        help=f"comma list from {', '.join(SCHEDULES)} (default {','.join(DEFAULT_SCHEDULES)}; "
                        f"with --moe-a2a-bandwidth {','.join(MOE_SCHEDULES)})")
    parser.add_argument("--costs", metavar="FILE", help="JSON cost file: t_forward / t_backward (ms) are emulated")
    parser.add_argument("--t-forward", type=float, help=f"ms per micro-batch and device share (default {Settings.t_forward})")
    parser.add_argument("--t-backward", type=float, help=f"ms (default {Settings.t_backward})")
    parser.add_argument("--t-weight", type=float, help="ms of --t-backward that bitpipe+split-backward defers to W (default half)")
    parser.add_argument("--t-input", type=float,
                        help="ms of the input-gradient pass I of a split backward (default --t-backward minus --t-weight)")
    parser.add_argument("--moe-a2a-bandwidth", type=float, default=0.0, metavar="BYTES_PER_MS",
                        help="make every layer an MoE layer whose forward and backward each wait two all-to-alls of "
                        "--moe-a2a-bytes at this bandwidth (default 0: dense layers)")
    parser.add_argument("--moe-a2a-bytes", type=float, default=None, metavar="BYTES",
                        help="bytes one all-to-all sends off a rank (default: the emulated model's top-2 dispatch over "
                        "2 expert-parallel ranks, s*b*2*h*4/2)")
    parser.add_argument("--layers-per-rank", type=int, default=Settings.layers_per_rank, help="even; L = this x D")
    parser.add_argument("--device", choices=("async", "blocking"), default="async",
                        help="emulated device: CUDA-stream semantics (default) or a blocking sleep per layer")
    parser.add_argument("--repeats", type=int, help="measured steps per run (default 3 with --quick, else 5)")
    parser.add_argument("--warmup", type=int, default=Settings.warmup, help="discarded steps per run")
    parser.add_argument("--json", action="store_true", help="print one JSON list instead of the table")
    parser.add_argument("--plot", metavar="FILE.png", help="write a bar chart")
    parser.add_argument("--update-doc", metavar="FILE.md",
                        help="rewrite the emulated-DEVICE-{command,table,ratios} blocks of FILE.md (docs/performance.md)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launched job")
    return parser


def doc_blocks(device: str, moe: bool = False) -> tuple:
    """Names of the blocks ``--update-doc`` rewrites: command and conditions, table, ratios
    (``emulated-moe-DEVICE-*`` for MoE layers)."""
    return tuple(f"emulated-{'moe-' if moe else ''}{device}-{part}" for part in ("command", "table", "ratios"))


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings for the flags; raises ValueError naming the flag."""
    from megatron_bitpipe.schedules.costs import read_cost_file

    costs = read_cost_file(args.costs) if args.costs else {}
    t_forward = args.t_forward if args.t_forward is not None else costs.get("t_forward", Settings.t_forward)
    t_backward = args.t_backward if args.t_backward is not None else costs.get("t_backward", Settings.t_backward)
    if t_forward < 0 or t_backward < 0 or t_forward + t_backward <= 0:
        raise ValueError("--t-forward/--t-backward: must be >= 0 with a positive sum")
    t_weight = args.t_weight if args.t_weight is not None else costs.get("t_weight")
    if t_weight is not None and not 0 <= t_weight <= t_backward:
        raise ValueError(f"--t-weight: must be between 0 and --t-backward ({t_backward:g})")
    t_input = args.t_input if args.t_input is not None else costs.get("t_input")
    if t_input is not None and (t_input < 0 or (t_weight is None and t_input > t_backward)):
        raise ValueError(f"--t-input: must be >= 0, and at most --t-backward ({t_backward:g}) without --t-weight")
    if args.layers_per_rank < 2 or args.layers_per_rank % 2:
        raise ValueError("--layers-per-rank: must be even and >= 2 (interleaved and BitPipe chunks hold half a rank's layers)")
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)
    if repeats < 1 or args.warmup < 0:
        raise ValueError("--repeats/--warmup: need repeats >= 1 and warmup >= 0")
    a2a_bytes = args.moe_a2a_bytes
    if a2a_bytes is None:
        a2a_bytes = Settings.seq_length * Settings.micro_batch_size * 2 * Settings.hidden_size * 4 / 2
    if args.moe_a2a_bandwidth < 0 or a2a_bytes < 0:
        raise ValueError("--moe-a2a-bandwidth/--moe-a2a-bytes: must be >= 0")
    return replace(
        Settings(),
        t_forward=t_forward,
        t_backward=t_backward,
        t_weight=t_weight,
        t_input=t_input,
        layers_per_rank=args.layers_per_rank,
        asynchronous=args.device == "async",
        repeats=repeats,
        warmup=args.warmup,
        a2a_bytes=a2a_bytes if args.moe_a2a_bandwidth > 0 else 0.0,
        a2a_bandwidth=args.moe_a2a_bandwidth,
    )


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    default = MOE_SCHEDULES if args.moe_a2a_bandwidth > 0 else DEFAULT_SCHEDULES
    schedule_names = tuple(s for s in args.schedules.split(",") if s) if args.schedules else default
    unknown = [s for s in schedule_names if s not in SCHEDULES]
    if unknown:
        parser.error(f"--schedules: unknown {', '.join(unknown)}; choose from {', '.join(SCHEDULES)}")
    grid = args.grid or (QUICK_GRID if args.quick else FULL_GRID)
    bad = [d for d in grid if d < 2 or d % 2]
    if bad:
        parser.error(f"--grid: pipeline sizes must be even and >= 2 (got {bad})")
    try:
        settings = settings_from_args(args)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    if args.update_doc:
        from doc_blocks import check_file

        try:
            check_file(args.update_doc, doc_blocks(args.device, settings.t_a2a > 0))
        except (ValueError, OSError) as error:
            parser.error(f"--update-doc: {error}")
    started = time.perf_counter()
    rows = run_grid(settings, grid, schedule_names, args.timeout)
    elapsed = time.perf_counter() - started
    table = markdown_table(rows)
    if args.json:
        print(json.dumps(rows))
    else:
        print(table)
        print(f"\n{len(rows)} runs in {elapsed:.0f} s; costs (ms): {rows[0]['costs'] if rows else {}}")
    if args.update_doc:
        from doc_blocks import update_file

        command = " ".join(["python", "scripts/bench_emulated.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])])
        update_file(
            args.update_doc,
            dict(
                zip(
                    doc_blocks(args.device, settings.t_a2a > 0),
                    (f"```bash\n{command}\n```\n\n{run_conditions(rows, elapsed)}", table, closing_note(rows)),
                )
            ),
        )
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
