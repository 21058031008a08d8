"""The fastest split of a model's layers over a schedule's stages within a memory budget per rank.

:func:`search_layouts` simulates one plan (a schedule's, for ``D`` and ``N``) under every
candidate split (:func:`candidate_splits`) with :func:`~.model_step.simulate_model` and keeps
the fastest whose largest rank fits ``max_memory`` bytes (ties: less memory, then the order the
candidates come in). The candidates are

* the splits Megatron-LM's flags make: equal stages, the embedding and/or the loss counted as
  a layer (``--account-for-*-in-pipeline-split``), and every first / last stage count with
  equal middle stages (``--decoder-first/last-pipeline-num-layers``);
* for every first and last stage count from 0 to twice the equal share (plus one), the middle
  stages filled one layer at a time, each to the stage whose rank has the least compute so far
  (forward and backward of every stage it holds, the embedding and head included; ties: the
  stage with fewer layers, then the earlier one). The fill counts every layer at layer 0's
  time: an estimate where ``--moe-layer-freq`` mixes dense and mixture-of-experts layers (the
  simulation of each candidate costs every layer as it is).

Every split is printed as the Megatron-LM flags that select it (:func:`layout_flags`: none for
equal stages, the account-for or first/last flags where they make it, else
``--pipeline-model-parallel-layout``), checked by parsing them back
(:func:`~.layer_split.split_layers`). The plan is the same for every split (the one training
runs); only the stages' costs change. Pure Python, no torch.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

from .actions import SchedulePlan
from .costs import CostModel
from .errors import VP_FLAG
from .layer_split import (
    EMBEDDING_FLAG, FIRST_FLAG, LAST_FLAG, LAYOUT_FLAG, LOSS_FLAG, LayerSplitFlags, StageLayers, split_layers, split_problems,
)  # fmt: skip
from .memory import TrainingMemory
from .model_shape import ModelShape
from .model_step import ModelStep, simulate_model
from .placement import Placement
from .stage_costs import StageCosts

__all__ = ["LayoutCandidate", "LayoutSearch", "candidate_splits", "layout_flags", "search_layouts"]


@dataclass(frozen=True)
class LayoutCandidate:
    """A simulated split: its step, the flags that select it, whether it fits the budget."""

    step: ModelStep
    flags: Tuple[str, ...]
    fits: bool

    def summary(self) -> dict:
        """JSON-ready: step time, stage layers, memory per rank, flags, fits."""
        return {"makespan": self.step.makespan, **self.step.summary(), "peak_memory_bytes": self.step.peak_memory,
                "flags": list(self.flags), "fits": self.fits}  # fmt: skip

    @property
    def command_line(self) -> str:
        """The flags as one shell-quoted string (empty for equal stages)."""
        return " ".join(shlex.quote(flag) for flag in self.flags)


@dataclass(frozen=True)
class LayoutSearch:
    """What :func:`search_layouts` found.

    Attributes:
        even: the equal split, None where the layers do not fill equal stages.
        best: the fastest split within the budget, None if none fits.
        tried: splits simulated.
        max_memory: the budget per rank in bytes (None: no limit).
    """

    plan: SchedulePlan
    even: Optional[LayoutCandidate]
    best: Optional[LayoutCandidate]
    tried: int
    max_memory: Optional[float]

    def summary(self) -> dict:
        """JSON-ready (``layout-search --json``)."""
        return {
            "schedule": self.plan.name, "pp": self.plan.num_ranks, "num_microbatches": self.plan.num_microbatches,
            "max_memory_bytes": self.max_memory, "tried": self.tried,
            "even": self.even.summary() if self.even else None, "best": self.best.summary() if self.best else None,
        }  # fmt: skip


def _layout_string(counts: Tuple[int, ...]) -> str:
    def layers(n: int) -> str:
        return "" if n == 0 else "t" if n == 1 else f"t*{n}"

    stages = [layers(n) for n in counts]
    stages[0] = "E" + stages[0]
    stages[-1] += "L"
    return "|".join(stages)


def layout_flags(layers: StageLayers, placement: Placement, virtual_size_flag: str = VP_FLAG) -> Tuple[str, ...]:
    """The simplest Megatron-LM flags that split ``layers.num_layers`` layers over
    ``placement``'s stages as ``layers`` (module docstring); each choice is parsed back."""
    counts, total = layers.counts, layers.num_layers
    options: List[Tuple[Tuple[str, ...], LayerSplitFlags]] = [((), LayerSplitFlags())]
    for embedding, loss in ((True, False), (False, True), (True, True)):
        names = tuple(flag for flag, on in ((EMBEDDING_FLAG, embedding), (LOSS_FLAG, loss)) if on)
        options.append((names, LayerSplitFlags(embedding=embedding, loss=loss)))
    first, last = counts[0], counts[-1]
    options += [
        ((FIRST_FLAG, str(first)), LayerSplitFlags(first=first)),
        ((LAST_FLAG, str(last)), LayerSplitFlags(last=last)),
        ((FIRST_FLAG, str(first), LAST_FLAG, str(last)), LayerSplitFlags(first=first, last=last)),
    ]
    for flags, split in options:
        if not split_problems(split, placement, total, virtual_size_flag) and split_layers(split, placement, total, virtual_size_flag) == layers:
            return flags
    layout = _layout_string(counts)
    assert split_layers(LayerSplitFlags(layout=layout), placement, total, virtual_size_flag) == layers
    return (LAYOUT_FLAG, layout)


def _megatron_splits(placement: Placement, num_layers: int) -> Iterator[StageLayers]:
    """The splits Megatron-LM's flags make (equal, account-for, first / last with equal middles)."""
    flags = [LayerSplitFlags(), LayerSplitFlags(embedding=True), LayerSplitFlags(loss=True), LayerSplitFlags(embedding=True, loss=True)]
    flags += [LayerSplitFlags(first=f, last=l) for f in range(1, num_layers) for l in range(1, num_layers - f + 1)]
    flags += [LayerSplitFlags(first=f) for f in range(1, num_layers + 1)] + [LayerSplitFlags(last=l) for l in range(1, num_layers + 1)]
    for split in flags:
        if not split_problems(split, placement, num_layers):
            yield split_layers(split, placement, num_layers)


def _balanced_splits(model: ModelShape, placement: Placement, costs: CostModel, element_bytes: int) -> Iterator[StageLayers]:
    """First and last stage counts from 0 to twice the equal share plus one, the middle filled
    greedily by rank compute (module docstring)."""
    stages, total = placement.num_stages, model.num_layers
    if stages < 3:
        return
    probe = StageCosts.for_model(model, StageLayers((1,) * stages), costs, placement.num_ranks, element_bytes).stages
    layer_time = probe[0].forward + probe[0].backward  # stage 0: one layer, the embedding costs no time
    head_time = probe[-1].forward + probe[-1].backward - layer_time
    holders: Dict[int, List[int]] = {}  # stage -> the ranks holding it (once per chunk)
    for rank in range(placement.num_ranks):
        for chunk in range(placement.chunks_per_rank):
            holders.setdefault(placement.role(rank, chunk).stage, []).append(rank)
    bound = min(total, 2 * -(-total // stages) + 1)
    for first in range(bound + 1):
        for last in range(min(bound, total - first) + 1):
            counts = [0] * stages
            counts[0], counts[-1] = first, last
            load = [0.0] * placement.num_ranks
            for stage, n in ((0, first), (stages - 1, last)):
                for rank in holders[stage]:
                    load[rank] += n * layer_time + (head_time if stage == stages - 1 else 0.0)
            for _ in range(total - first - last):
                stage = min(range(1, stages - 1), key=lambda s: (max(load[r] for r in holders[s]), counts[s], s))
                counts[stage] += 1
                for rank in holders[stage]:
                    load[rank] += layer_time
            yield StageLayers(tuple(counts))


def candidate_splits(model: ModelShape, placement: Placement, costs: CostModel, element_bytes: int) -> List[StageLayers]:
    """Every split :func:`search_layouts` tries, without repeats, Megatron-LM's first."""
    seen: Dict[Tuple[int, ...], StageLayers] = {}
    for layers in (*_megatron_splits(placement, model.num_layers), *_balanced_splits(model, placement, costs, element_bytes)):
        seen.setdefault(layers.counts, layers)
    return list(seen.values())


#: step times closer than this (relative) tie, and the one with less memory wins
_TIE = 1e-9


def _faster(step: ModelStep, than: ModelStep) -> bool:
    if abs(step.makespan - than.makespan) <= _TIE * than.makespan:
        return step.peak_memory < than.peak_memory
    return step.makespan < than.makespan


def search_layouts(
    plan: SchedulePlan, costs: CostModel, model: ModelShape, training: TrainingMemory, max_memory: Optional[float] = None
) -> LayoutSearch:
    """The fastest split of ``model``'s layers over ``plan``'s stages whose every rank holds at
    most ``max_memory`` bytes (None: no limit), and the equal split for comparison."""
    placement = plan.placement
    even_counts = None if placement.layer_problem(model.num_layers) else StageLayers.even(model.num_layers, placement.num_stages)
    even, best, tried = None, None, 0
    for layers in candidate_splits(model, placement, costs, training.element_bytes):
        step = simulate_model(plan, costs, model, training, layers)
        tried += 1
        fits = max_memory is None or step.peak_memory <= max_memory
        candidate = LayoutCandidate(step, layout_flags(layers, placement), fits)
        if layers == even_counts:
            even = candidate
        if fits and (best is None or _faster(step, best.step)):
            best = candidate
    return LayoutSearch(plan, even, best, tried, max_memory)
