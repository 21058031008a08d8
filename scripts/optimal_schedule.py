#!/usr/bin/env python
"""The shortest possible step on a schedule's placement, by exhaustive search (CP-SAT).

For the placement and micro-batch routing of ``generate(schedule, D, N)`` this finds, over
*every* per-rank order of the forward and backward actions, the shortest makespan — the bound
no schedule on that placement can beat — and sets the generator's simulated makespan beside
it. Model: every stage of a micro-batch runs its forward after the previous stage's forward
and its backward after the next stage's backward (the last stage's after its own forward),
``--t-p2p`` later when the neighbouring stage is on another rank; a rank runs one action at a
time; no gradient-sync cost; optionally at most ``--memory-cap`` Ma of activations in flight
per rank (an activation lives from its forward's start to its backward's end, the
simulator's convention). With ``--split-backward`` every backward is an input gradient
(``t_backward - t_weight``, on the chain) and a weight gradient (``t_weight``, any time
after it on the same rank; the activation lives until it ends). Micro-batches of one
pipeline enter in index order (renaming them shows this loses nothing).

Times are in the simulator's unit: ``--t-forward`` / ``--t-backward`` / ``--t-weight`` of one
micro-batch through one device's share of the model (L/D layers) and ``--t-p2p`` per message,
integers; a stage of a placement with S stages takes ``D/S`` of the compute. Needs
``ortools`` (``pip install ortools``). Usage::

    python scripts/optimal_schedule.py --schedule bitpipe --pipeline-model-parallel-size 8 \\
        --num-microbatches 8 --memory-cap 8
    # split backward, a message at 0.1 t_F:
    python scripts/optimal_schedule.py --schedule bitpipe -D 4 -N 4 --split-backward \\
        --t-forward 10 --t-backward 20 --t-weight 10 --t-p2p 1
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import List, Optional

from megatron_bitpipe.schedules import generate
from megatron_bitpipe.schedules.actions import SchedulePlan
from megatron_bitpipe.schedules.cli import add_plan_arguments
from megatron_bitpipe.schedules.costs import CostModel
from megatron_bitpipe.schedules.simulate import simulate


@dataclass(frozen=True)
class Optimum:
    """Result of one search. Times in the simulator's unit (see the module docstring)."""

    schedule: str
    pp: int
    num_microbatches: int
    memory_cap: Optional[float]
    status: str  # "OPTIMAL", or "FEASIBLE" when the time limit ended the search first
    optimal_makespan: float  # the best order found
    lower_bound: float  # no order on this placement is shorter
    generator_makespan: float  # simulate(generate(...)) with the same costs


def optimal_makespan(
    plan: SchedulePlan,
    t_forward: int,
    t_backward: int,
    memory_cap: Optional[float] = None,
    time_limit: float = 60.0,
    t_weight: Optional[int] = None,
    t_p2p: int = 0,
) -> Optimum:
    """Search every order of ``plan``'s actions on its placement; see the module docstring.

    ``t_weight`` (not None) splits every backward; ``t_p2p`` is the time of a message.
    """
    from ortools.sat.python import cp_model

    placement = plan.placement
    stages = placement.num_stages
    # Integer stage costs: a stage takes t_forward / t_backward units of 1/scale, with scale
    # the stages per device share (S / D).
    scale = stages // placement.num_ranks
    if scale * placement.num_ranks != stages:
        raise ValueError(f"{stages} stages do not split evenly over {placement.num_ranks} ranks")
    t_input = t_backward if t_weight is None else t_backward - t_weight
    hop = t_p2p * scale  # model units are 1/scale of the simulator's
    horizon = plan.num_microbatches * stages * (t_forward + t_backward) + 4 * stages * hop
    model = cp_model.CpModel()
    busy = {rank: [] for rank in range(placement.num_ranks)}
    alive = {rank: [] for rank in range(placement.num_ranks)}
    forward, backward, done = {}, {}, {}

    def message(pipeline: int, stage: int, other: int) -> int:
        return 0 if placement.location(pipeline, stage).rank == placement.location(pipeline, other).rank else hop

    for microbatch, pipeline in enumerate(plan.microbatch_pipeline):
        for stage in range(stages):
            rank = placement.location(pipeline, stage).rank
            f = forward[microbatch, stage] = model.NewIntVar(0, horizon, "")
            b = backward[microbatch, stage] = model.NewIntVar(0, horizon, "")
            busy[rank].append(model.NewFixedSizeIntervalVar(f, t_forward, ""))
            busy[rank].append(model.NewFixedSizeIntervalVar(b, t_input, ""))
            end = done[microbatch, stage] = b + t_input
            if t_weight is not None:
                w = model.NewIntVar(0, horizon, "")
                model.Add(w >= b + t_input)
                busy[rank].append(model.NewFixedSizeIntervalVar(w, t_weight, ""))
                end = done[microbatch, stage] = w + t_weight
            lifetime = model.NewIntVar(0, horizon, "")
            alive[rank].append(model.NewIntervalVar(f, lifetime, end, ""))
            if stage:
                model.Add(f >= forward[microbatch, stage - 1] + t_forward + message(pipeline, stage, stage - 1))
        model.Add(backward[microbatch, stages - 1] >= forward[microbatch, stages - 1] + t_forward)
        for stage in range(stages - 1):
            model.Add(backward[microbatch, stage] >= backward[microbatch, stage + 1] + t_input
                      + message(pipeline, stage, stage + 1))
    for pipeline in range(placement.num_pipelines):
        order = plan.microbatches_of_pipeline(pipeline)
        for earlier, later in zip(order, order[1:]):
            model.Add(forward[later, 0] >= forward[earlier, 0] + t_forward)
    makespan = model.NewIntVar(0, horizon, "")
    for (microbatch, stage), end in done.items():
        model.Add(makespan >= end)
    for rank in busy:
        model.AddNoOverlap(busy[rank])
        if memory_cap is not None:
            # one stage's activations are D/S Ma
            model.AddCumulative(alive[rank], [1] * len(alive[rank]), int(memory_cap * scale))
    model.Minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = 1
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(f"no schedule found within {time_limit} s ({solver.StatusName(status)})")
    generated = simulate(plan, CostModel(t_forward=t_forward, t_backward=t_backward, t_weight=t_weight,
                                         t_p2p=t_p2p)).makespan
    return Optimum(
        schedule=plan.name,
        pp=placement.num_ranks,
        num_microbatches=plan.num_microbatches,
        memory_cap=memory_cap,
        status=solver.StatusName(status),
        optimal_makespan=solver.Value(makespan) / scale,
        lower_bound=solver.BestObjectiveBound() / scale,
        generator_makespan=generated,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_plan_arguments(parser)
    parser.add_argument("--t-forward", type=int, default=1, help="integer, per device share")
    parser.add_argument("--t-backward", type=int, default=2, help="integer, per device share")
    parser.add_argument("--t-weight", type=int, default=None,
                        help="integer, the weight-gradient part of --t-backward (default half; with --split-backward)")
    parser.add_argument("--t-p2p", type=int, default=0, help="integer, per message")
    parser.add_argument("--memory-cap", type=float, default=None, help="Ma in flight per rank (default: none)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds of search")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.t_forward < 1 or args.t_backward < 1:
        parser.error("--t-forward and --t-backward must be positive integers")
    if args.t_p2p < 0:
        parser.error("--t-p2p must be a non-negative integer")
    t_weight = None
    if args.split_backward:
        t_weight = args.t_backward // 2 if args.t_weight is None else args.t_weight
        if not 0 <= t_weight < args.t_backward or (args.t_weight is None and args.t_backward % 2):
            parser.error("--t-weight must be an integer part of --t-backward, below it")
    try:
        import ortools  # noqa: F401
    except ImportError:
        parser.error("needs ortools: pip install ortools")
    costs = CostModel(t_forward=args.t_forward, t_backward=args.t_backward, t_weight=t_weight, t_p2p=args.t_p2p)
    try:
        plan = generate(args.schedule, args.pp, args.num_microbatches, args.vp, split_backward=args.split_backward,
                        costs=costs)
    except ValueError as error:
        parser.error(str(error))
    result = optimal_makespan(plan, args.t_forward, args.t_backward, args.memory_cap, args.time_limit, t_weight,
                              args.t_p2p)
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
