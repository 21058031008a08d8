"""Which schedule? Every training schedule simulated for one pipeline size and number of
micro-batches, ranked by step time, with its memory and the training flags that select it.

:func:`recommend` takes the pipeline size ``D``, the micro-batches ``N`` of one step per
data-parallel rank, the cost model the step is simulated under and a :class:`Budget`, and
returns a :class:`Recommendation`: every variant of :func:`training_variants` whose rules
(:meth:`~.choice.ScheduleChoice.problems`) accept ``D``, ``N`` (and the layers, when given) as
a :class:`Candidate`, fastest first, and the others as :class:`Refusal` with the rules' messages.

Memory is stated in the simulator's units, not bytes: the largest rank's peak of in-flight
activations in ``Ma`` (one micro-batch's activations through ``L / D`` layers, a split
backward's counted until its ``W``: :mod:`.simulate`) and the copies of the model's weights
the placement holds (each copy brings its gradients and optimizer state along).

The plans are the ones training runs with the printed flags: a schedule whose plan depends on
costs (:attr:`~.choice.ScheduleChoice.uses_costs`) is planned for the cost file that
``--schedule-costs`` passes (``planning_costs``; ``None``: the default costs training plans
for without the flag) and simulated, like every other, under ``costs``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

from .choice import ScheduleChoice
from .costs import CostModel
from .errors import MICROBATCH_FLAG
from .registry import REGISTRY, training_schedules
from .simulate import simulate

__all__ = ["Budget", "Candidate", "Recommendation", "Refusal", "recommend", "training_flags", "training_variants"]


@dataclass(frozen=True)
class Budget:
    """What one pipeline rank may hold; ``None``: no limit.

    Attributes:
        max_activations: the largest rank's peak of in-flight activations, in ``Ma``.
        max_weight_copies: copies of the model's weights (1: one replica; the bidirectional
            placements hold 2).
    """

    max_activations: Optional[float] = None
    max_weight_copies: Optional[int] = None

    def admits(self, peak_activations: float, weight_copies: int) -> bool:
        """Whether a schedule with these peaks fits."""
        return (self.max_activations is None or peak_activations <= self.max_activations) and (
            self.max_weight_copies is None or weight_copies <= self.max_weight_copies
        )


@dataclass(frozen=True)
class Candidate:
    """A variant whose rules accept ``D`` and ``N``, simulated.

    Attributes:
        choice: the variant (its ``label`` names it: ``bitpipe+split-backward``).
        makespan: simulated step time, in the cost model's time unit.
        bubble_ratio: mean over ranks of the idle share of the step.
        peak_activations: the largest rank's peak of in-flight activations, in ``Ma``.
        weight_copies: copies of the model's weights (:meth:`~.choice.ScheduleChoice.weight_replicas`).
        fits: whether the budget admits both peaks.
        flags: the training flags that select it (:func:`training_flags`).
    """

    choice: ScheduleChoice
    makespan: float
    bubble_ratio: float
    peak_activations: float
    weight_copies: int
    fits: bool
    flags: Tuple[str, ...]

    def summary(self) -> dict:
        """JSON-ready record (the ``recommend --json`` rows)."""
        return {
            "label": self.choice.label, "schedule": self.choice.schedule, "split_backward": self.choice.split_backward,
            "makespan": self.makespan, "bubble_ratio": self.bubble_ratio, "peak_activations": self.peak_activations,
            "weight_copies": self.weight_copies, "fits": self.fits, "flags": list(self.flags),
        }  # fmt: skip


@dataclass(frozen=True)
class Refusal:
    """A variant whose rules refuse ``D``, ``N`` or the layers: one message per broken rule."""

    label: str
    problems: Tuple[str, ...]


@dataclass(frozen=True)
class Recommendation:
    """Every training variant for one ``D`` and ``N``: ``candidates`` fastest first (ties:
    fewer activations, fewer weight copies, then registry order), ``refused`` in registry order."""

    num_ranks: int
    num_microbatches: int
    costs: CostModel
    budget: Budget
    candidates: Tuple[Candidate, ...]
    refused: Tuple[Refusal, ...]

    @property
    def best(self) -> Optional[Candidate]:
        """The fastest candidate within the budget, or None."""
        return next((c for c in self.candidates if c.fits), None)

    def summary(self) -> dict:
        """JSON-ready object (``recommend --json``)."""
        best = self.best
        return {
            "pp": self.num_ranks, "num_microbatches": self.num_microbatches, "costs": asdict(self.costs),
            "budget": asdict(self.budget), "schedules": [c.summary() for c in self.candidates],
            "refused": [{"label": r.label, "problems": list(r.problems)} for r in self.refused],
            "best": best.choice.label if best else None,
        }  # fmt: skip


def training_variants(virtual_size: Optional[int] = None, planning_costs: Optional[CostModel] = None) -> List[ScheduleChoice]:
    """Every schedule training runs (:func:`~.registry.training_schedules`, registry order),
    each followed by its ``--split-backward`` variant where the split is optional (the plan
    executor's schedules whose own order does not split). ``virtual_size``: interleaved's
    chunks per rank (``None``: its default); ``planning_costs``: what the cost-planned
    variants are planned for."""
    variants = []
    for name in training_schedules():
        schedule = REGISTRY[name]
        vp = virtual_size if schedule.takes_virtual_size else None
        variants.append(ScheduleChoice(name, False, None, vp))
        if variants[-1].plan_executed and not schedule.always_split:
            variants.append(ScheduleChoice(name, True, None, vp))
    return [ScheduleChoice(c.schedule, c.split_backward, planning_costs if c.uses_costs else None, c.virtual_size) for c in variants]


def training_flags(choice: ScheduleChoice, num_ranks: int, cost_file: Optional[str] = None) -> Tuple[str, ...]:
    """The flags of the training scripts (and of Megatron-LM's with the plugin) that select
    ``choice`` on ``num_ranks`` pipeline ranks: ``--pipeline-schedule``, interleaved's virtual
    size, ``--split-backward``, ``--untie-embeddings-and-output-weights`` where the placement
    cannot tie the embeddings (:attr:`~.placement.Placement.ties_embeddings`) and
    ``--schedule-costs cost_file`` where costs shape the plan and a file is given."""
    flags = ["--pipeline-schedule", choice.schedule]
    if REGISTRY[choice.schedule].takes_virtual_size:
        flags += ["--virtual-pipeline-model-parallel-size", str(choice.virtual_chunks)]
    if choice.split_backward:
        flags.append("--split-backward")
    if choice.plan_executed and not choice.placement(num_ranks).ties_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    if cost_file is not None and choice.uses_costs:
        flags += ["--schedule-costs", cost_file]
    return tuple(flags)


def recommend(
    num_ranks: int,
    num_microbatches: int,
    costs: Optional[CostModel] = None,
    budget: Budget = Budget(),
    *,
    num_layers: Optional[int] = None,
    virtual_size: Optional[int] = None,
    cost_file: Optional[str] = None,
    planning_costs: Optional[CostModel] = None,
    microbatches: str = MICROBATCH_FLAG,
) -> Recommendation:
    """Every training variant on ``num_ranks`` ranks and ``num_microbatches`` micro-batches
    per data-parallel rank, simulated under ``costs`` (``None``: the default cost model).

    ``cost_file`` is named by the ``--schedule-costs`` flag of the cost-planned variants, whose
    plans are made for ``planning_costs`` (the file's costs; ``None``: the default costs);
    ``num_layers`` adds the layer rule; ``microbatches`` names where N comes from in the
    refusals. Pure: no torch, no communication.
    """
    costs = costs or CostModel()
    candidates, refused = [], []
    for order, choice in enumerate(training_variants(virtual_size, planning_costs)):
        problems = choice.problems(num_ranks, num_microbatches, num_layers, microbatches=microbatches)
        if problems:
            refused.append(Refusal(choice.label, tuple(problems)))
            continue
        result = simulate(choice.plan(num_ranks, num_microbatches), costs)
        peak, copies = max(result.peak_activations), choice.weight_replicas(num_ranks)
        candidate = Candidate(choice, result.makespan, result.bubble_ratio, peak, copies, budget.admits(peak, copies),
                              training_flags(choice, num_ranks, cost_file))
        candidates.append((candidate.makespan, peak, copies, order, candidate))
    ranked = tuple(entry[-1] for entry in sorted(candidates, key=lambda entry: entry[:-1]))
    return Recommendation(num_ranks, num_microbatches, costs, budget, ranked, tuple(refused))


def format_recommendation(recommendation: Recommendation) -> str:
    """The table ``recommend`` prints: one row per candidate, the refusals, the fastest within
    the budget."""
    r = recommendation
    header = ("rank", "schedule", "step time", "bubble", "peak act. (Ma)", "weight copies", "fits", "flags")
    rows = [header] + [
        (str(i), c.choice.label, f"{c.makespan:g}", f"{100 * c.bubble_ratio:.1f}%", f"{c.peak_activations:g}",
         str(c.weight_copies), "yes" if c.fits else "no", " ".join(c.flags))
        for i, c in enumerate(r.candidates, 1)
    ]  # fmt: skip
    widths = [max(len(row[k]) for row in rows) for k in range(len(header) - 1)]
    lines = [f"D={r.num_ranks} N={r.num_microbatches}: {_costs_text(r.costs)}; budget: {_budget_text(r.budget)}"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    if r.refused:
        lines.append("refused:")
        lines += [f"  {refusal.label}: {'; '.join(refusal.problems)}" for refusal in r.refused]
    best = r.best
    lines.append(f"fastest within the budget: {best.choice.label}" if best else "no schedule fits the budget")
    lines.append(
        "step time in the costs' time unit; peak act.: the busiest rank's in-flight activations in Ma (one "
        "micro-batch's activations through L/D layers); weight copies: replicas of the weights, gradients and optimizer state"
    )
    return "\n".join(line.rstrip() for line in lines)


def _costs_text(costs: CostModel) -> str:
    deferring = "" if costs.t_forward_deferring is None else f" F_d={costs.t_forward_deferring:.4g}"
    return (
        f"t_F={costs.t_forward:.4g} t_B={costs.t_backward:.4g} (I={costs.input_time:.4g} W={costs.weight_time:.4g}{deferring}), "
        f"message {costs.message_time:.4g}, gradient all-reduce of L/D layers {costs.sync_time(1.0, 1):.4g} / "
        f"{costs.sync_time(1.0, 2):.4g} (1 / 2 weight copies), data-parallel size {costs.data_parallel_size}"
    )


def _budget_text(budget: Budget) -> str:
    parts = [
        f"peak activations <= {budget.max_activations:g} Ma" if budget.max_activations is not None else None,
        f"weight copies <= {budget.max_weight_copies}" if budget.max_weight_copies is not None else None,
    ]
    return ", ".join(p for p in parts if p) or "none"
