"""One training step of a model on a schedule: each stage costed from its layers
(:meth:`~.stage_costs.StageCosts.for_model`), simulated, and the memory per rank
(:mod:`.memory`) beside the step time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

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
    """

    stage_layers: StageLayers
    result: SimulationResult
    memory: List[RankMemory]

    @property
    def makespan(self) -> float:
        return self.result.makespan

    @property
    def peak_memory(self) -> float:
        """The largest rank's total bytes."""
        return max(m.total for m in self.memory)

    def summary(self) -> dict:
        """JSON-ready: ``stage_layers`` and ``memory_bytes`` (one object per rank)."""
        return {"stage_layers": list(self.stage_layers.counts), "memory_bytes": [m.summary() for m in self.memory]}


def simulate_model(
    plan: SchedulePlan, costs: CostModel, model: ModelShape, training: TrainingMemory, layers: StageLayers
) -> ModelStep:
    """Simulate ``plan`` with ``model``'s stages split as ``layers``; ValueError for a split of
    another number of stages or layers, or tied embeddings a placement cannot tie."""
    placement = plan.placement
    if layers.num_stages != placement.num_stages or layers.num_layers != model.num_layers:
        raise ValueError(f"stage layers {layers} do not split --num-layers {model.num_layers} into the {placement.num_stages} stages of the {placement.name} placement")
    stage_costs = StageCosts.for_model(model, layers, costs, plan.num_ranks, training.element_bytes)
    result = simulate(plan, costs, stage_costs)
    return ModelStep(layers, result, rank_memory(model, placement, layers, training, result.peak_activation_bytes))
