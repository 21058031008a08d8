"""Command line: ``bitpipe-schedule {list,simulate,recommend,plan,layout-search} ...`` (or ``python -m megatron_bitpipe.schedules``).

``list`` prints every registered schedule (:mod:`.registry`) with what runs it in training
and whether its own order splits the backward.
``simulate`` validates and simulates one schedule and prints a summary (or one JSON
object with ``--json``); ``--plot`` writes a Gantt PNG, ``--trace`` a Chrome trace. With a
model's shape (Megatron-LM's flags, :mod:`.model_args`) it costs each stage from its layers,
the embedding and the head (uneven with Megatron-LM's five layout flags) and reports
``stage_layers`` and ``memory_bytes`` per rank (:mod:`.model_step`); with Megatron-LM's MoE flags also
``moe_layers`` per stage and one all-to-all's ``all_to_all_bytes`` and ``all_to_all_time``.
``layout-search`` finds the fastest split of a model's layers over a schedule's stages within
a memory budget per rank and prints the flags that select it (:mod:`.layout_search`).
``recommend`` simulates every training schedule for one ``D`` and ``N`` and prints them
ranked by step time with their peak activations, weight copies, whether they fit a memory
budget, and the training flags that select them (:mod:`.recommend`; ``--json``: one object).
``plan`` prints every rank's compute actions in order, or with ``--communication`` the
lowered plan with its ``SEND``/``RECV`` actions (``--receive-lookahead K`` posts each
receive ``K`` actions before its consumer, :func:`~.lower.lower`). Costs come from ``--costs FILE`` (a JSON
object with :class:`~.costs.CostModel` fields, e.g. written by
``scripts/calibrate_gpu.py``) and/or the ``--t-*`` flags, which take precedence.

Invalid arguments exit with status 2 and one line naming the flag (the closest flag for an
unknown one); ``--plot`` without matplotlib says which extra installs it. ``--plot`` and
``--trace`` name the file they wrote on stderr; a reader that stops early (``| head -1``) ends
the command quietly with status 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from ..usage import USAGE_EXIT_STATUS, FlagParser, UsageError, quiet_on_broken_pipe
from . import ScheduleChoice
from .costs import CostModel, read_cost_file
from .errors import MICROBATCH_FLAG, PlanError, ScheduleConfigError
from .layer_split import split_layers
from .layout_search import LayoutSearch, search_layouts
from .lower import lower
from .context_layouts import search_context_layouts, weigh_layouts
from .model_args import WEIGH_FLAG, add_hardware_arguments, add_model_arguments, hardware, layer_split_flags, model_shape, training_memory
from .model_step import ModelStep, simulate_model
from .nccl import check_nccl
from .recommend import Budget, Recommendation, format_recommendation, recommend, training_variants
from .registry import REGISTRY, schedule_names
from .simulate import simulate
from .validate import validate_plan

#: CostModel field -> (flag, help); times are in one unit of the caller's choice (TIME), the
#: forward's by default (t_forward = 1)
_COST_FLAGS = {
    "t_forward": ("--t-forward", "forward of one micro-batch through L/D layers, in TIME units (default 1)"),
    "t_backward": ("--t-backward", "full backward (input and weight gradients) of the same layers, in TIME units (default 2)"),
    "t_weight": ("--t-weight", "weight-gradient part of --t-backward, the W of --split-backward, in TIME units (default: the rest of --t-backward after --t-input, or half of it)"),
    "t_input": ("--t-input", "input-gradient pass I of --split-backward (weight gradients deferred), in TIME units, as scripts/calibrate_gpu.py measures it (default: --t-backward minus --t-weight)"),
    "t_forward_deferring": ("--t-forward-deferring", "forward of a split-backward plan (the linears deferring their weight gradients), in TIME units, as scripts/calibrate_gpu.py measures it (F_d; default --t-forward)"),
    "t_p2p": ("--t-p2p", "latency of one point-to-point message, in TIME units (default 0)"),
    "p2p_bytes": ("--p2p-bytes", "bytes of one message (an activation or gradient at a stage boundary; default 0)"),
    "p2p_bandwidth": ("--p2p-bandwidth", "bytes per TIME unit; with --p2p-bytes adds bytes/bandwidth to each message (default 0: none)"),
    "t_sync": ("--t-sync", "gradient all-reduce of L/D layers among replicas and data-parallel ranks, in TIME units (default 0)"),
    "grad_bytes": ("--grad-bytes", "bytes of the gradients of L/D layers that one all-reduce moves (default 0)"),
    "sync_bandwidth": ("--sync-bandwidth", "all-reduce bus bandwidth in bytes per TIME unit (as nccl-tests reports it); with --grad-bytes adds the ring's bandwidth term to --t-sync (default 0: none)"),
    "data_parallel_size": ("--data-parallel-size", "data-parallel ranks each stage's gradients are averaged over, besides BitPipe's two replicas (default 1)"),
    "t_a2a": ("--t-a2a", "latency of one all-to-all (dispatch or combine) of a mixture-of-experts layer among --expert-model-parallel-size ranks, in TIME units (default 0)"),
    "a2a_bandwidth": ("--a2a-bandwidth", "bytes per TIME unit one rank's all-to-all sends off the rank; adds bytes/bandwidth to each all-to-all of an MoE layer (default 0: none)"),
    "t_cp": ("--t-cp", "latency of one context-parallel collective (a layer's key/value all-gather in F, its gradients' reduce-scatter in B / I) among --context-parallel-size ranks, in TIME units (default 0)"),
    "cp_bandwidth": ("--cp-bandwidth", "all-gather / reduce-scatter bus bandwidth of the context-parallel group in bytes per TIME unit (as nccl-tests reports it); adds bytes/bandwidth to each (default 0: none)"),
}
_COST_METAVARS = {"p2p_bytes": "BYTES", "p2p_bandwidth": "BYTES_PER_TIME", "grad_bytes": "BYTES", "sync_bandwidth": "BYTES_PER_TIME",
                  "data_parallel_size": "N", "a2a_bandwidth": "BYTES_PER_TIME", "cp_bandwidth": "BYTES_PER_TIME"}  # fmt: skip
#: the command's one-line description (--help)
DESCRIPTION = "Plan, validate and simulate pipeline schedules: per-rank actions, makespan, bubble, peak activations."
#: bytes of a GiB, the unit of the memory the commands print and of --max-memory
GIB = 2**30
#: what installs --plot's library
PLOT_EXTRA = "pip install 'megatron-bitpipe[plot]' (in a checkout: pip install -e '.[plot]')"


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags choosing a plan: ``--schedule``, ``--pipeline-model-parallel-size``
    (``args.pp``), ``--num-microbatches`` (``args.num_microbatches``),
    ``--virtual-pipeline-model-parallel-size`` (``args.vp``) and ``--split-backward``,
    as :class:`~.choice.ScheduleChoice` and its ``plan`` take them."""
    parser.add_argument("--schedule", choices=schedule_names(), required=True)
    parser.add_argument("--pipeline-model-parallel-size", "-D", type=int, required=True, dest="pp", metavar="D", help="pipeline ranks")
    parser.add_argument("--num-microbatches", "-N", type=int, required=True, dest="num_microbatches", metavar="N",
                        help="micro-batches of one step (per data-parallel rank)")
    parser.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None, dest="vp",
                        help="chunks per rank (interleaved only; default 2)")
    parser.add_argument("--split-backward", action="store_true",
                        help="run each backward as input gradient (I) + deferred weight gradients (W)")


def _parser(prog: Optional[str] = None) -> FlagParser:
    parser = FlagParser(prog=prog, description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=FlagParser)
    commands.add_parser("list", help="list the schedules (name, who runs it in training, summary)")
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
            add_cost_arguments(sub)
            sub.add_argument("--json", action="store_true", help="print one JSON object")
            sub.add_argument("--plot", metavar="FILE.png", help=f"write a Gantt chart; needs matplotlib: {PLOT_EXTRA}")
            sub.add_argument("--trace", metavar="FILE.json", help="write a Chrome trace")
            add_model_arguments(sub)
    _add_recommend_parser(commands)
    _add_layout_search_parser(commands)
    return parser


def add_cost_arguments(parser: argparse.ArgumentParser) -> None:
    """``--costs FILE`` and the ``--t-*`` flags (:data:`_COST_FLAGS`), read by :func:`cost_model`."""
    costs = parser.add_argument_group(
        "costs", "TIME is one unit of your choice (the forward's by default, or milliseconds); "
        "the flags override --costs"
    )
    costs.add_argument("--costs", metavar="FILE",
                       help="JSON cost file with these fields (t_forward, t_backward, ...), e.g. from scripts/calibrate_gpu.py")
    for field, (flag, help_text) in _COST_FLAGS.items():
        costs.add_argument(flag, type=int if field == "data_parallel_size" else float, default=None, dest=field,
                           metavar=_COST_METAVARS.get(field, "TIME"), help=help_text)


def _add_recommend_parser(commands) -> None:
    sub = commands.add_parser("recommend", help="rank every training schedule for D and N by simulated step time")
    sub.add_argument("--pipeline-model-parallel-size", "-D", type=int, required=True, dest="pp", metavar="D", help="pipeline ranks")
    batch = sub.add_mutually_exclusive_group(required=True)
    batch.add_argument("--num-microbatches", "-N", type=int, dest="num_microbatches", metavar="N",
                       help="micro-batches of one step per data-parallel rank")
    batch.add_argument("--global-batch-size", type=int, metavar="G",
                       help="instead of -N: N = G / (--micro-batch-size x --data-parallel-size)")
    sub.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None, dest="vp",
                     help="interleaved's chunks per rank (default 2)")
    add_cost_arguments(sub)
    budget = sub.add_argument_group("memory budget", "per pipeline rank; a schedule fits when it stays within both")
    budget.add_argument("--max-activations", type=float, default=None, metavar="MA",
                        help="peak in-flight activations of the busiest rank, in Ma: one micro-batch's activations "
                        "through L/D layers (default: no limit)")
    budget.add_argument("--max-weight-copies", type=int, default=None, choices=(1, 2), metavar="{1,2}",
                        help="copies of the model's weights (with their gradients and optimizer state) a rank may hold: "
                        "BitPipe, Chimera and DualPipe hold 2 (default: no limit)")
    budget.add_argument("--max-memory", type=float, default=None, metavar="GIB",
                        help=f"with {WEIGH_FLAG}: memory of every rank in GiB (default: no limit)")
    add_model_arguments(sub, layout_flags=False)  # --num-layers alone: check that the layers fill each schedule's stages
    add_hardware_arguments(sub)
    sub.add_argument("--json", action="store_true", help="print one JSON object")


def _add_layout_search_parser(commands) -> None:
    sub = commands.add_parser(
        "layout-search", help="the fastest split of a model's layers over a schedule's stages within a memory budget per rank"
    )
    add_plan_arguments(sub)
    add_cost_arguments(sub)
    add_model_arguments(sub, layout_flags=False)
    sub.add_argument("--max-memory", type=float, default=None, metavar="GIB",
                     help="memory budget of every pipeline rank in GiB (2^30 bytes; default: no limit)")
    add_hardware_arguments(sub)
    sub.add_argument("--json", action="store_true", help="print one JSON object")


def layout_search(args: argparse.Namespace) -> LayoutSearch:
    """What ``layout-search`` prints for its parsed flags; ScheduleConfigError naming the flag."""
    costs = cost_model(args)
    model = model_shape(args)
    if model is None:
        raise ScheduleConfigError("layout-search needs the model: --num-layers, --hidden-size, --num-attention-heads, --seq-length, --vocab-size")
    if args.max_memory is not None and args.max_memory <= 0:
        raise ScheduleConfigError(f"--max-memory must be > 0 GiB (got {args.max_memory:g})")
    plan = ScheduleChoice(args.schedule, args.split_backward, costs, args.vp).plan(args.pp, args.num_microbatches)
    budget = None if args.max_memory is None else args.max_memory * GIB
    try:
        return search_layouts(plan, costs, model, training_memory(args, costs.data_parallel_size), budget)
    except ValueError as error:
        raise ScheduleConfigError(str(error)) from None


def _weighed_model(args: argparse.Namespace, command: str):
    """The model, hardware, training memory and ranks of ``--weigh-context-parallel``."""
    model = model_shape(args)
    if model is None:
        raise ScheduleConfigError(f"{command} {WEIGH_FLAG} needs the model: --num-layers, --hidden-size, "
                                  "--num-attention-heads, --seq-length, --vocab-size")  # fmt: skip
    if args.max_memory is not None and args.max_memory <= 0:
        raise ScheduleConfigError(f"--max-memory must be > 0 GiB (got {args.max_memory:g})")
    budget = None if args.max_memory is None else args.max_memory * GIB
    dp = cost_model(args).data_parallel_size
    return model, hardware(args), training_memory(args, dp), args.pp * args.context_parallel_size, budget


def weighed_layout_search(args: argparse.Namespace):
    """``layout-search --weigh-context-parallel``: every PP x CP layout's search."""
    model, hw, training, ranks, budget = _weighed_model(args, "layout-search")
    choice = ScheduleChoice(args.schedule, args.split_backward, None, args.vp)
    try:
        return search_context_layouts(choice, model, hw, ranks, args.num_microbatches, training, budget)
    except ValueError as error:
        raise ScheduleConfigError(str(error)) from None


def format_weighed_layout_search(found) -> str:
    """One block per layout: its flags and its search, or the rules it breaks."""
    lines = []
    for layout, search, problems in found:
        lines.append(f"PP {layout.pipeline} x CP {layout.context} ({' '.join(layout.flags)}), world {layout.world}:")
        lines += ["  " + line for line in (format_layout_search(search).splitlines() if search else ["refused: " + "; ".join(problems)])]
    return "\n".join(lines)


def weighed_recommendation(args: argparse.Namespace):
    """``recommend --weigh-context-parallel``: every training variant on every PP x CP layout."""
    model, hw, training, ranks, budget = _weighed_model(args, "recommend")
    microbatches = args.num_microbatches
    if microbatches is None:
        per_step = args.micro_batch_size * training.data_parallel_size
        if args.global_batch_size < 1 or args.global_batch_size % per_step:
            raise ScheduleConfigError(f"--global-batch-size {args.global_batch_size} must be a positive multiple of "
                                      f"--micro-batch-size x --data-parallel-size = {per_step}")  # fmt: skip
        microbatches = args.global_batch_size // per_step
    if microbatches < 1:
        raise ScheduleConfigError(f"--num-microbatches must be >= 1 (got {microbatches})")
    try:
        return weigh_layouts(model, hw, ranks, microbatches, training, training_variants(args.vp), budget), microbatches, budget
    except ValueError as error:
        raise ScheduleConfigError(str(error)) from None


def format_weighed_recommendation(weighed, microbatches: int, budget: Optional[float]) -> str:
    """The (layout, schedule) rows fastest first within the budget, then the refusals."""
    (steps, refused) = weighed
    limit = "no memory limit" if budget is None else f"at most {budget / GIB:g} GiB per rank"
    header = ("rank", "PP", "CP", "schedule", "step time (ms)", "peak memory (GiB)", "activations (GiB)", "fits", "flags")
    rows = [header] + [
        (str(i), str(r.layout.pipeline), str(r.layout.context), r.choice.label, f"{r.step.makespan:.1f}",
         f"{r.step.peak_memory / GIB:.2f}", f"{max(m.activations for m in r.step.memory) / GIB:.2f}",
         "yes" if r.fits else "no", " ".join(r.flags))
        for i, r in enumerate(steps, 1)
    ]  # fmt: skip
    widths = [max(len(row[k]) for row in rows) for k in range(len(header) - 1)]
    lines = [f"N={microbatches}, {limit}; every PP x CP layout costed from the model's FLOPs and the hardware figures"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    if refused:
        lines.append("refused:")
        lines += [f"  PP {layout.pipeline} x CP {layout.context} {choice.label}: {'; '.join(problems)}" for layout, choice, problems in refused]
    best = next((r for r in steps if r.fits), None)
    lines.append(f"fastest within the budget: PP {best.layout.pipeline} x CP {best.layout.context} {best.choice.label}"
                 if best else "no layout fits the budget")  # fmt: skip
    return "\n".join(line.rstrip() for line in lines)


def format_layout_search(search: LayoutSearch) -> str:
    """The equal split and the fastest within the budget: step time, memory, flags."""
    plan = search.plan
    budget = "no memory limit" if search.max_memory is None else f"at most {search.max_memory / GIB:g} GiB per rank"
    lines = [f"{plan.name}: D={plan.num_ranks} N={plan.num_microbatches}, {search.tried} splits simulated, {budget}"]

    def describe(what: str, candidate) -> None:
        step = candidate.step
        rank = max(range(len(step.memory)), key=lambda r: step.memory[r].total)
        lines.append(f"{what}: layers per stage {step.stage_layers}; step time {step.makespan:g}; "
                     f"largest rank {rank}: {step.peak_memory / GIB:.2f} GiB{'' if candidate.fits else ' (over the budget)'}")
        lines.append(f"  flags: {candidate.command_line or '(none: equal stages)'}")

    if search.even:
        describe("equal stages", search.even)
    if search.best:
        describe("fastest within the budget", search.best)
        if search.even:
            lines.append(f"  step time {100 * (search.best.step.makespan / search.even.step.makespan - 1):+.1f}% vs equal stages")
    else:
        lines.append("no split fits the budget")
    return "\n".join(lines)


def schedule_listing() -> str:
    """One line per registered schedule: its name, who runs it in training (``--pipeline-schedule``)
    or ``peer`` for the schedules the simulator and the executor run but training does not select, ``always split`` where its own order splits the backward,
    and its summary."""
    runs = {name: (s.runner or "peer (simulator, executor)") + (", always split" if s.always_split else "") for name, s in REGISTRY.items()}
    name_width, runs_width = max(map(len, runs)), max(map(len, runs.values()))
    return "\n".join(f"{name:<{name_width}}  {runs[name]:<{runs_width}}  {s.summary}" for name, s in REGISTRY.items())


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
            raise ScheduleConfigError(f"{_COST_FLAGS[key][0]}: costs must be >= 0 (got {value:g})")
    if values.get("data_parallel_size", 1) < 1:
        raise ScheduleConfigError(f"--data-parallel-size: must be >= 1 (got {values['data_parallel_size']})")
    try:
        return CostModel(**values)
    except ValueError as exc:
        raise ScheduleConfigError(f"--t-forward/--t-backward/--t-weight/--t-input: {exc}") from None


#: where ``recommend`` takes N from with ``--global-batch-size`` (named in the refusals)
GLOBAL_BATCH_SOURCE = "micro-batches per data-parallel rank (--global-batch-size / (--micro-batch-size x --data-parallel-size))"


def recommendation(args: argparse.Namespace) -> Recommendation:
    """What ``recommend`` prints for its parsed flags; :class:`~.errors.ScheduleConfigError`
    naming the flag for a bad value."""
    costs = cost_model(args)
    if args.pp < 1:
        raise ScheduleConfigError(f"--pipeline-model-parallel-size must be >= 1 (got {args.pp})")
    source = MICROBATCH_FLAG
    if args.num_microbatches is None:
        per_step = args.micro_batch_size * costs.data_parallel_size
        if args.micro_batch_size < 1 or args.global_batch_size < 1 or args.global_batch_size % per_step:
            raise ScheduleConfigError(
                f"--global-batch-size {args.global_batch_size} must be a positive multiple of --micro-batch-size "
                f"{args.micro_batch_size} x --data-parallel-size {costs.data_parallel_size}"
            )
        args.num_microbatches, source = args.global_batch_size // per_step, GLOBAL_BATCH_SOURCE
    if args.num_microbatches < 1:
        raise ScheduleConfigError(f"--num-microbatches must be >= 1 (got {args.num_microbatches})")
    if args.vp is not None and args.vp < 1:
        raise ScheduleConfigError(f"--virtual-pipeline-model-parallel-size must be >= 1 (got {args.vp})")
    if args.max_activations is not None and args.max_activations < 0:
        raise ScheduleConfigError(f"--max-activations must be >= 0 (got {args.max_activations:g})")
    planning = CostModel(**read_cost_file(args.costs)) if args.costs else None
    return recommend(
        args.pp, args.num_microbatches, costs, Budget(args.max_activations, args.max_weight_copies),
        num_layers=args.num_layers, virtual_size=args.vp, cost_file=args.costs, planning_costs=planning,
        microbatches=source,
    )


def _recommend(prog: str, args: argparse.Namespace) -> int:
    if args.weigh_context_parallel:
        try:
            weighed, microbatches, budget = weighed_recommendation(args)
        except (ScheduleConfigError, OSError, json.JSONDecodeError, ValueError) as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return USAGE_EXIT_STATUS
        steps, refused = weighed
        if args.json:
            print(json.dumps({"num_microbatches": microbatches, "max_memory_bytes": budget, "layouts": [r.summary() for r in steps],
                              "refused": [{"pp": l.pipeline, "cp": l.context, "label": c.label, "problems": p} for l, c, p in refused]}))  # fmt: skip
        else:
            print(format_weighed_recommendation(weighed, microbatches, budget))
        return 0
    if args.max_memory is not None:
        print(f"{prog}: error: --max-memory needs {WEIGH_FLAG} (without it the budget is --max-activations, in Ma)", file=sys.stderr)
        return USAGE_EXIT_STATUS
    try:
        result = recommendation(args)
    except (ScheduleConfigError, OSError, json.JSONDecodeError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return USAGE_EXIT_STATUS
    print(json.dumps(result.summary()) if args.json else format_recommendation(result))
    return 0


def _model_step(args: argparse.Namespace, plan, costs: CostModel) -> Optional[ModelStep]:
    """The model's step when the flags give a model (None without ``--num-layers``)."""
    model = model_shape(args)
    if model is None:
        return None
    if args.forward_only:
        raise ScheduleConfigError("--forward-only: the model's flags cost a training step (memory included); drop one of them")
    try:
        layers = split_layers(layer_split_flags(args), plan.placement, model.num_layers)
        return simulate_model(plan, costs, model, training_memory(args, costs.data_parallel_size), layers)
    except ValueError as error:
        raise ScheduleConfigError(str(error)) from None


def format_model_step(step: ModelStep) -> str:
    """The stage layers and one line of memory (GiB) per rank."""
    lines = [f"layers per stage (pipeline order): {step.stage_layers}"]
    if step.moe_layers is not None:
        lines.append(f"MoE layers per stage: {','.join(map(str, step.moe_layers))}; one all-to-all (dispatch or combine) sends "
                     f"{step.all_to_all_bytes:g} bytes off a rank in {step.all_to_all_time:g} TIME")
    lines.append("memory per rank (GiB): parameters + gradients + optimizer state + peak activations = total")
    lines += [
        f"  rank {r}: {m.parameters / GIB:.2f} + {m.gradients / GIB:.2f} + {m.optimizer_state / GIB:.2f} + "
        f"{m.activations / GIB:.2f} = {m.total / GIB:.2f}"
        for r, m in enumerate(step.memory)
    ]
    return "\n".join(lines)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ScheduleConfigError(f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA}") from None


@quiet_on_broken_pipe
def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> int:
    """The command line; returns the exit status (2: bad arguments, one line on stderr).
    ``prog`` names the command in messages (default: ``sys.argv[0]``'s file name, e.g.
    ``bitpipe-schedule``)."""
    parser = _parser(prog)
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return USAGE_EXIT_STATUS
    if args.command == "list":
        print(schedule_listing())
        return 0
    if args.command == "recommend":
        return _recommend(parser.prog, args)
    if args.command == "layout-search" and args.weigh_context_parallel:
        try:
            found = weighed_layout_search(args)
        except (ScheduleConfigError, OSError, json.JSONDecodeError) as exc:
            print(f"{parser.prog}: error: {exc}", file=sys.stderr)
            return USAGE_EXIT_STATUS
        print(json.dumps([{"pp": l.pipeline, "cp": l.context, "flags": list(l.flags), "search": s.summary() if s else None,
                           "problems": p} for l, s, p in found]) if args.json else format_weighed_layout_search(found))  # fmt: skip
        return 0 if any(s and s.best for _, s, _ in found) else 1
    if args.command == "layout-search":
        try:
            search = layout_search(args)
        except (ScheduleConfigError, OSError, json.JSONDecodeError) as exc:
            print(f"{parser.prog}: error: {exc}", file=sys.stderr)
            return USAGE_EXIT_STATUS
        print(json.dumps(search.summary()) if args.json else format_layout_search(search))
        return 0 if search.best else 1
    try:
        if args.command == "simulate" and args.plot:
            _require_matplotlib()
        costs = cost_model(args) if args.command == "simulate" else None
        choice = ScheduleChoice(args.schedule, args.split_backward, costs, args.vp)
        plan = choice.plan(args.pp, args.num_microbatches, args.forward_only)
        if args.command == "plan":
            print(lower(plan, args.receive_lookahead).format() if args.communication else plan.compute_only().format())
            return 0
        validate_plan(plan, nccl=False)  # reported below, as nccl_deadlock_free
        step = _model_step(args, plan, costs)
        result = step.result if step else simulate(plan, costs)
    except BrokenPipeError:  # the reader went away (plan | head): not a usage error
        raise
    except (ScheduleConfigError, OSError, json.JSONDecodeError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return USAGE_EXIT_STATUS
    except PlanError as exc:  # a generator produced an invalid plan: report, not a usage error
        print(f"invalid plan: {exc}", file=sys.stderr)
        return 1
    if args.plot:
        from .render import plot_gantt

        plot_gantt(result, args.plot)
        print(f"{parser.prog}: wrote the Gantt chart to {args.plot}", file=sys.stderr)
    if args.trace:
        from .render import write_chrome_trace

        write_chrome_trace(result, args.trace)
        print(f"{parser.prog}: wrote the Chrome trace to {args.trace}", file=sys.stderr)
    nccl = check_nccl(plan)
    summary = {**result.summary(), **(step.summary() if step else {}), "nccl_deadlock_free": nccl.ok}
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"{plan.name}: D={plan.num_ranks} N={plan.num_microbatches} "
            f"makespan={result.makespan:g} bubble={100 * result.bubble_ratio:.2f}%"
        )
        print("peak activations (Ma) per rank: " + " ".join(f"{p:g}" for p in result.peak_activations))
        if step:
            print(format_model_step(step))
        print(nccl.message())
    return 0 if nccl.ok else 1
