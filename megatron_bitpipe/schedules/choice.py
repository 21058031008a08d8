"""The pipeline schedule a job runs: one frozen object and one rule check.

A :class:`ScheduleChoice` is what the flags select — the schedule, whether its backwards are
split (``--split-backward``), the costs the split places its weight-gradient actions for
(``--schedule-costs``) and the chunks per rank of the interleaved schedule
(``--virtual-pipeline-model-parallel-size``). Everything that needs a plan or checks the
flags goes through it: :meth:`ScheduleChoice.problems` is the only statement of each
schedule's rules (the schedule command line, the pretraining scripts, the Megatron-LM
argument hook and :meth:`ScheduleChoice.plan` all call it), and :attr:`ScheduleChoice.label`
is the only spelling of a variant (``bitpipe+split-backward``) in plan names, benchmark
labels and tables.

Each schedule's own rules, placement and plan come from its generator in
:mod:`.registry` (:class:`~.generator.ScheduleGenerator`; ``problems(num_ranks,
num_microbatches, source)`` with ``num_microbatches=None`` gives the pipeline size's rules
alone); the rules common to every schedule — the layers must fill the placement's stages, the
virtual size belongs to the interleaved schedule alone — are stated here and in
:meth:`~.placement.Placement.layer_problem`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from .actions import SchedulePlan
from .errors import MICROBATCH_FLAG, PP_FLAG, VP_FLAG, ScheduleConfigError
from .lower import lower
from .generator import PLAN_RUNNER
from .placement import Placement
from .registry import REGISTRY, generator
from .costs import CostModel
from .split_backward import SPLIT_BACKWARD_SUFFIX

__all__ = ["SPLIT_BACKWARD_SUFFIX", "ScheduleChoice"]
#: the interleaved schedule's chunks per rank when no virtual size is given
DEFAULT_VIRTUAL_SIZE = 2


@dataclass(frozen=True)
class ScheduleChoice:
    """A pipeline schedule as the flags select it.

    Attributes:
        schedule: a registered generator's name (:data:`~.registry.REGISTRY`).
        split_backward: every backward runs as an input-gradient ``I`` and, later in a
            bubble, a weight-gradient ``W`` (:mod:`.split_backward`; BitPipe's order is then
            planned for ``costs``, :mod:`.list_scheduling`). Generators whose own order splits
            (``always_split``: the zero-bubble and DualPipe peers) split either way.
        costs: the costs the ``W``'s are placed (and BitPipe's and ZB-V's orders planned)
            for (only their ratios matter); ``None`` is :class:`~.costs.CostModel`'s
            default (``t_B = 2 t_F``, half of it ``W``). Unused by plans without a split
            backward.
        virtual_size: chunks per rank of ``interleaved`` (``None``: 2); other schedules
            have a fixed number and take ``None`` (or 1).

    Invariant: every method but :meth:`problems` assumes ``schedule`` is registered.
    """

    schedule: str
    split_backward: bool = False
    costs: Optional[CostModel] = None
    virtual_size: Optional[int] = None

    @property
    def splits_backward(self) -> bool:
        """Whether the plans run split backwards (``I`` and ``W``)."""
        return self.split_backward or REGISTRY[self.schedule].always_split

    @property
    def uses_costs(self) -> bool:
        """Whether :attr:`costs` shape the plan: they place the ``W``'s of ``--split-backward``
        and plan the orders of the generators that take costs (``takes_costs``: ZB-V)."""
        schedule = REGISTRY[self.schedule]
        return schedule.takes_costs or (self.split_backward and not schedule.always_split)

    @property
    def plan_executed(self) -> bool:
        """Whether training runs it with this package's plan executor (its generator's
        ``runner`` is :data:`~.generator.PLAN_RUNNER`), else with megatron-core's own functions."""
        return REGISTRY[self.schedule].runner == PLAN_RUNNER

    def weight_replicas(self, num_ranks: int) -> int:
        """Copies of the model's weights its placement holds on ``num_ranks`` pipeline ranks
        (one per pipeline: 2 for the bidirectional placements, 1 for the looped ones)."""
        return self.placement(num_ranks).num_pipelines

    @property
    def label(self) -> str:
        """``bitpipe`` or ``bitpipe+split-backward`` (``zbv``: its backwards are always split):
        the plan's name and the variant's name in benchmark labels and tables."""
        suffix = self.split_backward and not REGISTRY[self.schedule].always_split
        return self.schedule + (SPLIT_BACKWARD_SUFFIX if suffix else "")

    @classmethod
    def from_label(cls, label: str, costs: Optional[CostModel] = None, virtual_size: Optional[int] = None) -> "ScheduleChoice":
        """Inverse of :attr:`label`."""
        split = label.endswith(SPLIT_BACKWARD_SUFFIX)
        return cls(label.removesuffix(SPLIT_BACKWARD_SUFFIX), split, costs, virtual_size)

    @property
    def virtual_chunks(self) -> int:
        """The interleaved schedule's chunks per rank (its default when unset)."""
        return DEFAULT_VIRTUAL_SIZE if self.virtual_size is None else self.virtual_size

    def placement(self, num_ranks: int) -> Placement:
        """Where the stages live on ``num_ranks`` pipeline ranks (the same for every N)."""
        return REGISTRY[self.schedule].placement(num_ranks, self.virtual_chunks)

    def problems(
        self,
        num_ranks: int,
        num_microbatches: Optional[int] = None,
        num_layers: Optional[int] = None,
        *,
        microbatches: str = MICROBATCH_FLAG,
        virtual_size_flag: str = VP_FLAG,
    ) -> List[str]:
        """Every rule the arguments break, one message per rule naming the flag; ``[]`` if none.

        ``num_microbatches`` (N, per data-parallel rank) and ``num_layers`` are checked when
        given. ``microbatches`` names where N comes from in the messages (the schedule command
        line's ``--num-microbatches``; the training scripts derive it from the batch sizes),
        ``virtual_size_flag`` the flag that sets the virtual pipeline size (Megatron-LM's
        parser calls it ``--num-virtual-stages-per-pipeline-rank``).
        Pure: no communication, no torch.
        """
        if self.schedule not in REGISTRY:
            return [f"--schedule: unknown schedule {self.schedule!r}; choose from {', '.join(REGISTRY)}"]
        problems: List[str] = []
        if num_ranks < 1:
            return [f"{PP_FLAG} must be >= 1 (got {num_ranks})"]
        schedule = REGISTRY[self.schedule]
        if schedule.takes_virtual_size:
            if self.virtual_chunks < 1:
                return [f"{virtual_size_flag} must be >= 1 (got {self.virtual_size})"]
        elif self.virtual_size not in (None, 1):
            problems.append(f"{virtual_size_flag} must not be set with {self.schedule} (its chunks per rank are fixed)")
        problems += schedule.problems(num_ranks, num_microbatches, microbatches)
        pipeline_size_ok = not schedule.problems(num_ranks, None, microbatches)  # N=None: D's rules only
        if num_layers is not None and pipeline_size_ok:
            layer_problem = self.placement(num_ranks).layer_problem(num_layers, virtual_size_flag)
            if layer_problem:
                problems.append(layer_problem)
        return problems

    def smallest_num_microbatches(self, num_ranks: int) -> int:
        """The smallest N (per data-parallel rank) the schedule accepts on ``num_ranks`` ranks."""
        return generator(self.schedule).smallest_num_microbatches(num_ranks)

    def plan(self, num_ranks: int, num_microbatches: int, forward_only: bool = False) -> SchedulePlan:
        """The lowered plan of one step (:func:`~.lower.lower`: explicit ``SEND`` / ``RECV``
        actions, each receive posted right before its consumer; ``plan.compute_only()`` is the
        generator's order); :class:`~.errors.ScheduleConfigError` listing every broken rule.

        A forward-only plan has no backward to split.
        """
        problems = self.problems(num_ranks, num_microbatches)
        if problems:
            raise ScheduleConfigError("; ".join(problems))
        schedule = REGISTRY[self.schedule]
        plan = schedule.compute_plan(num_ranks, num_microbatches, self.virtual_chunks, forward_only, self.costs)
        if self.split_backward and not forward_only and not schedule.always_split:
            plan = schedule.split_backward(plan, self.costs)
        return lower(plan)
