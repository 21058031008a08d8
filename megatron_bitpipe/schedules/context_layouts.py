"""Pipeline against context parallelism: the ways to split a replica's ranks into ``PP`` pipeline
stages of ``CP`` context-parallel ranks each, and every one simulated for a model.

A :class:`ContextLayout` is one such split (Megatron-LM's ``--pipeline-model-parallel-size`` and
``--context-parallel-size``; tensor parallelism 1, so world = TP x CP x PP x DP with TP = 1).
:meth:`ContextLayout.problems` is the one statement of its rules: ``PP >= 1``, ``CP >= 1``,
the model's sequence rule at that ``CP`` (:func:`~.model_shape.shape_problems`: ``2 CP`` equal
chunks) and, above ``CP = 1``, a plan-executed schedule at ``PP >= 2`` (what training runs context
parallelism with). :func:`context_layouts` lists every split of ``ranks`` (``CP`` ascending).

Each layout is costed from the model's FLOPs and the hardware's figures
(:func:`~.costs.analytic_costs` of the model at that ``CP``: one context-parallel rank's tokens,
its attention pairs, its key/value exchange and its messages of ``s / CP`` tokens) and simulated
with its layers in equal stages (:func:`~.model_step.simulate_model`): :func:`weigh_layouts`
ranks every (layout, schedule) pair, fastest first within a memory budget per rank in bytes.
:func:`search_context_layouts` runs ``layout-search``'s layer split search on every layout. The
cost model of a layout is the hardware's, so step times are milliseconds.
Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

from .choice import ScheduleChoice
from .costs import CostModel, Hardware, analytic_costs
from .layer_split import StageLayers
from .layout_search import LayoutSearch, search_layouts
from .memory import TrainingMemory
from .model_shape import ModelShape, shape_problems
from .model_step import ModelStep, simulate_model
from .recommend import training_flags

__all__ = ["CP_FLAG", "ContextLayout", "LayoutStep", "context_layouts", "search_context_layouts", "weigh_layouts"]

CP_FLAG = "--context-parallel-size"


@dataclass(frozen=True)
class ContextLayout:
    """``pipeline`` stages of ``context`` context-parallel ranks (one data-parallel replica's
    ``pipeline x context`` ranks; ``data`` replicas)."""

    pipeline: int
    context: int
    data: int = 1

    @property
    def world(self) -> int:
        """TP x CP x PP x DP ranks (TP = 1)."""
        return self.context * self.pipeline * self.data

    @property
    def flags(self) -> Tuple[str, ...]:
        """The training flags that select it."""
        return ("--pipeline-model-parallel-size", str(self.pipeline), CP_FLAG, str(self.context))

    def model(self, model: ModelShape) -> ModelShape:
        """``model`` on one of this layout's context-parallel ranks."""
        return replace(model, context_parallel_size=self.context)

    def problems(self, model: ModelShape, choice: Optional[ScheduleChoice] = None) -> List[str]:
        """The rules ``model`` (and ``choice``) break on this layout; ``[]`` if none."""
        if self.pipeline < 1 or self.context < 1:
            return [f"--pipeline-model-parallel-size {self.pipeline} and {CP_FLAG} {self.context} must be >= 1"]
        problems = [p for p in shape_problems(model.num_layers, model.hidden_size, model.num_attention_heads,
                                              model.seq_length, context_parallel_size=self.context) if CP_FLAG in p]  # fmt: skip
        if self.context > 1 and model.moe is not None:
            problems.append(f"{CP_FLAG} {self.context} with --num-experts is not modelled")
        if self.context > 1 and choice is not None and (not choice.plan_executed or self.pipeline < 2):
            problems.append(f"{CP_FLAG} {self.context} runs with the plan-executed schedules at --pipeline-model-parallel-size >= 2")
        return problems


def context_layouts(ranks: int, data: int = 1) -> List[ContextLayout]:
    """Every ``PP x CP = ranks`` split, ``CP`` ascending."""
    return [ContextLayout(ranks // cp, cp, data) for cp in range(1, ranks + 1) if ranks % cp == 0]


@dataclass(frozen=True)
class LayoutStep:
    """One schedule on one layout, simulated (milliseconds, bytes)."""

    layout: ContextLayout
    choice: ScheduleChoice
    costs: CostModel
    step: ModelStep
    fits: bool

    @property
    def flags(self) -> Tuple[str, ...]:
        """The training flags that select the layout and the schedule."""
        return self.layout.flags + training_flags(self.choice, self.layout.pipeline)

    def summary(self) -> dict:
        """JSON-ready row."""
        return {
            "pp": self.layout.pipeline, "cp": self.layout.context, "world": self.layout.world, "label": self.choice.label,
            "makespan_ms": self.step.makespan, "peak_memory_bytes": self.step.peak_memory,
            "peak_activation_bytes": max(m.activations for m in self.step.memory), "fits": self.fits,
            "flags": list(self.flags),
        }  # fmt: skip


def weigh_layouts(
    model: ModelShape,
    hardware: Hardware,
    ranks: int,
    num_microbatches: int,
    training: TrainingMemory,
    choices: Sequence[ScheduleChoice],
    max_memory: Optional[float] = None,
) -> Tuple[List[LayoutStep], List[Tuple[ContextLayout, ScheduleChoice, List[str]]]]:
    """Every ``choice`` on every layout of :func:`context_layouts` (``ranks``), simulated:
    (steps, fastest first, those within ``max_memory`` bytes per rank before the rest; refusals
    with their rules' messages)."""
    steps, refused = [], []
    for layout in context_layouts(ranks, training.data_parallel_size):
        shape = layout.model(model) if not layout.problems(model) else None
        for choice in choices:
            problems = layout.problems(model, choice) or choice.problems(layout.pipeline, num_microbatches, model.num_layers)
            if problems:
                refused.append((layout, choice, problems))
                continue
            costs = analytic_costs(shape, layout.pipeline, hardware, training.data_parallel_size)
            plan = choice.plan(layout.pipeline, num_microbatches)
            layers = StageLayers.even(model.num_layers, plan.placement.num_stages)
            try:
                step = simulate_model(plan, costs, shape, training, layers)
            except ValueError as error:  # tied embeddings the placement cannot tie
                refused.append((layout, choice, [str(error)]))
                continue
            steps.append(LayoutStep(layout, choice, costs, step, max_memory is None or step.peak_memory <= max_memory))
    steps.sort(key=lambda s: (not s.fits, s.step.makespan, s.step.peak_memory))
    return steps, refused


def search_context_layouts(
    choice: ScheduleChoice,
    model: ModelShape,
    hardware: Hardware,
    ranks: int,
    num_microbatches: int,
    training: TrainingMemory,
    max_memory: Optional[float] = None,
) -> List[Tuple[ContextLayout, Optional[LayoutSearch], List[str]]]:
    """``layout-search`` on every layout of :func:`context_layouts` (``ranks``): for each, the
    layer split search (:func:`~.layout_search.search_layouts`) under the layout's costs, or the
    rules it breaks."""
    out = []
    for layout in context_layouts(ranks, training.data_parallel_size):
        problems = layout.problems(model, choice) or choice.problems(layout.pipeline, num_microbatches)
        if problems:
            out.append((layout, None, problems))
            continue
        shape = layout.model(model)
        costs = analytic_costs(shape, layout.pipeline, hardware, training.data_parallel_size)
        plan = replace(choice, costs=costs if choice.uses_costs else None).plan(layout.pipeline, num_microbatches)
        out.append((layout, search_layouts(plan, costs, shape, training, max_memory), []))
    return out
