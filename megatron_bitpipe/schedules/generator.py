"""What a schedule generator is: one typed object the registry holds.

A :class:`ScheduleGenerator` bundles what a generator module states once — where the stages
live (``place``), the rules of the pipeline size and the number of micro-batches
(``problems``), the smallest number of micro-batches (``smallest_num_microbatches``) and the
compute-only plan (``generate``) — with the facts the rest of the package reads instead of
testing the schedule's name: whether the generator takes the interleaved schedule's chunks per rank
(``takes_virtual_size``) or the cost model its order is planned for (``takes_costs``), whether
its own order already splits every backward (``always_split``), how ``--split-backward`` splits
the others (``split_backward``) and who runs it in training (``runner``).

Each generator module ends with its ``GENERATOR``; :mod:`.registry` lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

from .actions import SchedulePlan
from .placement import Placement
from .split_backward import split_backward as place_weight_gradients

__all__ = ["MEGATRON_RUNNER", "PLAN_RUNNER", "ScheduleGenerator"]

#: ``runner`` of the schedules training runs with megatron-core's own forward_backward functions
MEGATRON_RUNNER = "megatron-core"
#: ``runner`` of the schedules training runs with this package's plan executor
PLAN_RUNNER = "plan-executor"


@dataclass(frozen=True)
class ScheduleGenerator:
    """One pipeline schedule's generator.

    Attributes:
        name: the schedule's name (``--schedule`` of the schedule command line; for the
            schedules training runs, a ``--pipeline-schedule`` value).
        summary: one line for listings (the CLI's ``list``, the docs).
        place: ``place(D)`` — or ``place(D, v)`` when ``takes_virtual_size`` — the placement
            of the stages on ``D`` pipeline ranks (the same for every N).
        problems: ``problems(D, N, source)`` — every rule ``D`` and ``N`` (per data-parallel
            rank; ``None``: the rules of ``D`` alone) break, ``source`` naming where N comes
            from in the messages.
        smallest_num_microbatches: ``smallest_num_microbatches(D)``.
        generate: ``generate(D, N, [v,] forward_only[, costs])`` — the compute-only plan of
            arguments that satisfy ``problems``.
        takes_virtual_size: ``place`` and ``generate`` take the chunks per rank ``v``.
        takes_costs: ``generate`` takes the cost model its order is planned for.
        always_split: its own order runs every backward as ``I`` and ``W``.
        split_backward: ``split_backward(plan, costs)`` — the plan with every backward split,
            for ``--split-backward`` (default: :func:`~.split_backward.split_backward`).
        runner: who runs it in training: :data:`MEGATRON_RUNNER`, :data:`PLAN_RUNNER`, or
            ``None`` (a peer the simulator, the benchmarks and the executor's tests run, not a
            ``--pipeline-schedule`` value).
    """

    name: str
    summary: str
    place: Callable[..., Placement]
    problems: Callable[[int, Optional[int], str], List[str]]
    smallest_num_microbatches: Callable[[int], int]
    generate: Callable[..., SchedulePlan]
    takes_virtual_size: bool = False
    takes_costs: bool = False
    always_split: bool = False
    split_backward: Callable[..., SchedulePlan] = place_weight_gradients
    runner: Optional[str] = None

    def placement(self, num_ranks: int, virtual_size: int) -> Placement:
        """The placement on ``num_ranks`` ranks (``virtual_size``: chunks per rank, used by
        generators that take it)."""
        return self.place(num_ranks, virtual_size) if self.takes_virtual_size else self.place(num_ranks)

    def compute_plan(self, num_ranks: int, num_microbatches: int, virtual_size: int, forward_only: bool, costs) -> SchedulePlan:
        """The generator's compute-only plan (the arguments satisfy :attr:`problems`)."""
        arguments = [num_ranks, num_microbatches] + ([virtual_size] if self.takes_virtual_size else []) + [forward_only]
        return self.generate(*arguments, costs) if self.takes_costs else self.generate(*arguments)
