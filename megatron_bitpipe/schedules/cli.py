"""Command line: ``python -m megatron_bitpipe.schedules {simulate,plan} ...``.

``simulate`` validates and simulates one schedule and prints a summary (or one JSON
object with ``--json``); ``--plot`` writes a Gantt PNG, ``--trace`` a Chrome trace.
``plan`` prints every rank's compute actions in order, or with ``--communication`` the
lowered plan with its ``SEND``/``RECV`` actions (``--receive-lookahead K`` posts each
receive ``K`` actions before its consumer, :func:`~.lower.lower`). Costs come from ``--costs FILE`` (a JSON
object with :class:`~.simulate.CostModel` fields, e.g. written by
``scripts/calibrate_gpu.py``) and/or the ``--t-*`` flags, which take precedence.

Invalid arguments exit with status 2 and one line naming the flag.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from . import SCHEDULES, ScheduleChoice
from .errors import PlanError, ScheduleConfigError
from .lower import lower
from .simulate import CostModel, read_cost_file, simulate
from .validate import validate_plan

_COST_FLAGS = {
    "t_forward": "--t-forward",
    "t_backward": "--t-backward",
    "t_weight": "--t-weight",
    "t_p2p": "--t-p2p",
    "p2p_bytes": "--p2p-bytes",
    "p2p_bandwidth": "--p2p-bandwidth",
    "t_sync": "--t-sync",
    "grad_bytes": "--grad-bytes",
    "sync_bandwidth": "--sync-bandwidth",
    "data_parallel_size": "--data-parallel-size",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit status 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags choosing a plan: ``--schedule``, ``--pipeline-model-parallel-size``
    (``args.pp``), ``--num-microbatches`` (``args.num_microbatches``),
    ``--virtual-pipeline-model-parallel-size`` (``args.vp``) and ``--split-backward``,
    as :class:`~.choice.ScheduleChoice` and its ``plan`` take them."""
    parser.add_argument("--schedule", choices=SCHEDULES, required=True)
    parser.add_argument("--pipeline-model-parallel-size", "-D", type=int, required=True, dest="pp")
    parser.add_argument("--num-microbatches", "-N", type=int, required=True, dest="num_microbatches")
    parser.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None, dest="vp",
                        help="chunks per rank (interleaved only; default 2)")
    parser.add_argument("--split-backward", action="store_true",
                        help="run each backward as input gradient (I) + deferred weight gradients (W)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m megatron_bitpipe.schedules", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, help_text in (("simulate", "validate and simulate a schedule"), ("plan", "print per-rank actions")):
        sub = commands.add_parser(name, help=help_text)
        add_plan_arguments(sub)
        sub.add_argument("--forward-only", action="store_true", help="evaluation plan (forwards only)")
        if name == "plan":
            sub.add_argument("--communication", action="store_true",
                             help="also print the send and receive actions (SEND_F, RECV_F, SEND_B, RECV_B)")
            sub.add_argument("--receive-lookahead", type=_non_negative_int, default=0, metavar="K",
                             help="with --communication: post each receive K actions before its consumer (default 0)")
        if name == "simulate":
            sub.add_argument("--costs", metavar="FILE", help="JSON cost file (CostModel fields)")
            for field, flag in _COST_FLAGS.items():
                sub.add_argument(flag, type=int if field == "data_parallel_size" else float, default=None, dest=field)
            sub.add_argument("--json", action="store_true", help="print one JSON object")
            sub.add_argument("--plot", metavar="FILE.png", help="write a Gantt chart")
            sub.add_argument("--trace", metavar="FILE.json", help="write a Chrome trace")
    return parser


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (got {text!r})")
    return value


def cost_model(args: argparse.Namespace) -> CostModel:
    """CostModel from ``--costs FILE`` overridden by explicit ``--t-*`` flags."""
    values = read_cost_file(args.costs) if args.costs else {}
    values.update({k: getattr(args, k) for k in _COST_FLAGS if getattr(args, k) is not None})
    for key, value in values.items():
        if value < 0:
            raise ScheduleConfigError(f"{_COST_FLAGS[key]}: costs must be >= 0 (got {value:g})")
    if values.get("data_parallel_size", 1) < 1:
        raise ScheduleConfigError(f"--data-parallel-size: must be >= 1 (got {values['data_parallel_size']})")
    try:
        return CostModel(**values)
    except ValueError as exc:
        raise ScheduleConfigError(f"--t-forward/--t-backward/--t-weight: {exc}") from None


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        costs = cost_model(args) if args.command == "simulate" else None
        choice = ScheduleChoice(args.schedule, args.split_backward, costs, args.vp)
        plan = choice.plan(args.pp, args.num_microbatches, args.forward_only)
        if args.command == "plan":
            print(lower(plan, args.receive_lookahead).format() if args.communication else plan.compute_only().format())
            return 0
        validate_plan(plan)
        result = simulate(plan, costs)
    except (ScheduleConfigError, OSError, json.JSONDecodeError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    except PlanError as exc:  # a generator produced an invalid plan: report, not a usage error
        print(f"invalid plan: {exc}", file=sys.stderr)
        return 1
    if args.plot:
        from .render import plot_gantt

        plot_gantt(result, args.plot)
    if args.trace:
        from .render import write_chrome_trace

        write_chrome_trace(result, args.trace)
    summary = result.summary()
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"{plan.name}: D={plan.num_ranks} N={plan.num_microbatches} "
            f"makespan={result.makespan:g} bubble={100 * result.bubble_ratio:.2f}%"
        )
        print("peak activations (Ma) per rank: " + " ".join(f"{p:g}" for p in result.peak_activations))
    return 0
