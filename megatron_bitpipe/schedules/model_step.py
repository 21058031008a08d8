"""One training step of a model on a schedule: each stage costed from its layers
(:meth:`~.stage_costs.StageCosts.for_model`), simulated, and the memory per rank
(:mod:`.memory`) beside the step time; for a mixture-of-experts model, its MoE layers per
stage and what one all-to-all moves and takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from .actions import SchedulePlan
from .costs import CostModel
from .layer_split import StageLayers
from .memory import RankMemory, TrainingMemory, rank_memory
from .model_shape import ModelShape
from .simulate import SimulationResult, simulate
from .stage_costs import StageCosts

__all__ = ["ModelStep", "simulate_model"]


@dataclass(frozen=True)
class ModelStep:
    """A simulated step of a model.

    Attributes:
        stage_layers: transformer layers per stage of one pipeline, in pipeline order.
        result: the simulation (step time in the cost model's unit).
        memory: every pipeline rank's memory, in bytes.
        moe_layers: MoE layers per stage, in pipeline order (None: a dense model).
        all_to_all_bytes: bytes one all-to-all (an MoE layer's dispatch or combine) sends off
            a rank for one micro-batch.
        all_to_all_time: its time in the cost model's unit (four per MoE layer and micro-batch:
            two in the forward, two in the backward).
    """

    stage_layers: StageLayers
    result: SimulationResult
    memory: List[RankMemory]
    moe_layers: Optional[Tuple[int, ...]] = None
    all_to_all_bytes: float = 0.0
    all_to_all_time: float = 0.0

    @property
    def makespan(self) -> float:
        return self.result.makespan

    @property
    def peak_memory(self) -> float:
        """The largest rank's total bytes."""
        return max(m.total for m in self.memory)

    def summary(self) -> dict:
        """JSON-ready: ``stage_layers`` and ``memory_bytes`` (one object per rank); for an MoE
        model also ``moe_layers``, ``all_to_all_bytes`` and ``all_to_all_time``."""
        out = {"stage_layers": list(self.stage_layers.counts), "memory_bytes": [m.summary() for m in self.memory]}
        if self.moe_layers is not None:
            out.update(moe_layers=list(self.moe_layers), all_to_all_bytes=self.all_to_all_bytes, all_to_all_time=self.all_to_all_time)
        return out


def simulate_model(
    plan: SchedulePlan, costs: CostModel, model: ModelShape, training: TrainingMemory, layers: StageLayers
) -> ModelStep:
    """Simulate ``plan`` with ``model``'s stages split as ``layers``; ValueError for a split of
    another number of stages or layers, or tied embeddings a placement cannot tie."""
    placement = plan.placement
    if layers.num_stages != placement.num_stages or layers.num_layers != model.num_layers:
        raise ValueError(f"stage layers {layers} do not split --num-layers {model.num_layers} into the {placement.num_stages} stages of the {placement.name} placement")
    compute = costs.as_split() if plan.split_backward else costs
    stage_costs = StageCosts.for_model(model, layers, compute, plan.num_ranks, training.element_bytes)
    result = simulate(plan, costs, stage_costs)
    memory = rank_memory(model, placement, layers, training, result.peak_activation_bytes)
    if model.moe is None:
        return ModelStep(layers, result, memory)
    moe_layers = tuple(model.moe_layer_count(layers.first_layer(s), n) for s, n in enumerate(layers.counts))
    sent = model.all_to_all_bytes(training.element_bytes)
    return ModelStep(layers, result, memory, moe_layers, sent, costs.all_to_all_time(sent))
