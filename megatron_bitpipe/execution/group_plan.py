"""The process groups of a job as data: their names, rank lists and the order of creation.

``torch.distributed.new_group`` is collective over the whole job: every rank must create
every group, in the same order, and NCCL then warms each communicator up with its members. So
which groups a layout needs is decided here once, from the layout alone, as a
:class:`GroupPlan` — the same on every rank, without any communication — and
:meth:`~.groups.PipelineGroups.build` creates them by walking it with one loop
(:func:`~.groups.create_groups`) and warms them up by walking :attr:`GroupPlan.warm_ups`.

A plan is a tuple of :class:`GroupFamily`, in creation order; a family is one kind of group
(``tp``, ``stage/3``, ``channel/activation/0/+1/1``, ...) and holds the rank lists of all its
groups (global ranks, ascending). The families of a layout (:meth:`GroupPlan.for_layout`), in
order:

1. ``tp``, ``dp``, ``pp``, ``mp``, ``solo``, ``world`` — the grid's (:class:`ParallelGrid`,
   megatron's default order, tp fastest); ``solo`` is one group per rank, ``world`` every rank;
   with context parallelism (``grid.cp > 1``) then ``cp`` (the ranks sharing one sequence) and
   ``dp-cp`` (megatron's data-parallel group with context parallelism: dp x cp);
2. ``channel/<payload>/<pipeline>/<direction>/<parity>`` — one family per p2p channel group
   (:func:`~megatron_bitpipe.schedules.comm.channel_group_key`), each the grid's pipeline
   groups: a message of that channel travels on its sender's group of the family;
3. ``stage/<s>`` — per stage of the placement, its gradient-sync groups: the ranks holding a
   replica of the stage (one per pipeline) x the data-parallel ranks x the context-parallel
   ranks, one group per tensor-parallel rank;
4. with expert parallelism (``grid.ep > 1``): ``expert-dp``, ``ep``, ``tp-ep``, ``tp-ep-pp``,
   then ``expert-stage/<s>`` (a stage's replicas x the data-parallel ranks of one
   expert-parallel rank);
5. with ``replica_groups``: ``replica/<s>`` for each stage held by more than one pipeline (the
   stage's replicas within one data-parallel replica; a stage of one replica uses ``solo``);
6. with Optimus 2D: ``optimus-row`` and ``optimus-column`` (the rows and columns of every
   tensor-parallel group laid out as a ``q x q`` mesh);
7. when the placement ties embeddings megatron's way
   (:attr:`~megatron_bitpipe.schedules.placement.Placement.head_copies_embedding`):
   ``embedding``, the first- and last-stage ranks of each (tp, dp) slice.

Warm-ups (:attr:`GroupPlan.warm_ups`), in order: each channel family in key order (an
all-reduce over the rank's group, then one exchange over each of the family's links the rank
sends or receives on), ``cp`` and ``dp-cp`` (with context parallelism), each stage family in
stage order, ``ep`` and ``tp-ep`` and the expert stage families, the replica families. A rank takes part in a warm-up where it is a member;
every rank walks the same sequence, so the earliest unfinished warm-up always has all its
members.

Invariants (``tests/execution/test_group_plan.py``): names are unique; within a family the
rank lists are disjoint; the grid's and channel families partition the world; a bad layout is
refused here (ValueError naming the rule), before any group exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from ..optimus.args import TENSOR_PARALLEL_MODES
from ..optimus.mesh import mesh_columns, mesh_rows, mesh_side
from ..schedules.actions import Action, ActionType
from ..schedules.comm import ChannelGroupKey, Payload, channel_group_key, sent_by
from ..schedules.placement import Placement

__all__ = [
    "ParallelGrid",
    "GroupFamily",
    "WarmUp",
    "GroupPlan",
    "channel_family",
    "stage_family",
    "expert_stage_family",
    "replica_family",
    "placement_links",
    "stage_holders",
]

RankList = Tuple[int, ...]


@dataclass(frozen=True)
class ParallelGrid:
    """A tp x cp x dp x pp rank grid in megatron's default order, with ``ep`` expert-parallel
    ranks inside the data-parallel ones.

    Invariants: ``rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))``, so a
    tensor-parallel group is a run of ``tp`` consecutive ranks, the ``cp`` ranks sharing one
    sequence are ``tp`` apart and pipeline ranks are ``tp * cp * dp`` apart; ``ep`` divides
    ``dp``, and data-parallel rank ``d`` is expert-parallel rank ``d % ep`` of the
    expert-parallel group ``d // ep`` (megatron's expert order: ep faster than expert dp).
    ``dp`` counts data-parallel replicas (each its own micro-batches); the ``cp`` ranks of a
    replica split each of its sequences (:mod:`megatron_bitpipe.model.context_parallel`).
    Context parallelism with expert parallelism is refused (ValueError naming both flags).
    """

    tp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self):
        if self.ep < 1 or self.dp % self.ep:
            raise ValueError(
                f"--expert-model-parallel-size {self.ep} must divide the data-parallel size {self.dp} "
                "(expert-parallel ranks are data-parallel copies of one pipeline rank)"
            )
        if self.cp < 1:
            raise ValueError(f"--context-parallel-size {self.cp} must be at least 1")
        if self.cp > 1 and self.ep > 1:
            raise ValueError(
                f"--context-parallel-size {self.cp} with --expert-model-parallel-size {self.ep}: "
                "context parallelism with expert parallelism is not supported"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def rank(self, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0, cp_rank: int = 0) -> int:
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """``(tp_rank, dp_rank, pp_rank)`` of a global rank (its cp rank: :meth:`cp_rank`)."""
        tp_rank = rank % self.tp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        return tp_rank, dp_rank, rank // (self.tp * self.cp * self.dp)

    def cp_rank(self, rank: int) -> int:
        """The context-parallel rank of a global rank: which slice of each sequence it holds."""
        return (rank // self.tp) % self.cp

    def dp_cp_coords(self) -> List[Tuple[int, int]]:
        """Every ``(dp_rank, cp_rank)``, cp fastest."""
        return [(d, c) for d in range(self.dp) for c in range(self.cp)]

    def tp_groups(self) -> List[List[int]]:
        return [[self.rank(t, d, p, c) for t in range(self.tp)] for p in range(self.pp) for d, c in self.dp_cp_coords()]

    def dp_groups(self) -> List[List[int]]:
        """Data-parallel groups: the replicas of one (tp, cp, pp) position (megatron's dp group
        without context parallelism)."""
        return [
            [self.rank(t, d, p, c) for d in range(self.dp)] for p in range(self.pp) for c in range(self.cp) for t in range(self.tp)
        ]

    def cp_groups(self) -> List[List[int]]:
        """Context-parallel groups: the ``cp`` ranks splitting one replica's sequences."""
        return [[self.rank(t, d, p, c) for c in range(self.cp)] for p in range(self.pp) for d in range(self.dp) for t in range(self.tp)]

    def dp_cp_groups(self) -> List[List[int]]:
        """Data x context-parallel groups (megatron's ``with_context_parallel`` data-parallel group)."""
        return [[self.rank(t, d, p, c) for d, c in self.dp_cp_coords()] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> List[List[int]]:
        return [[self.rank(t, d, p, c) for p in range(self.pp)] for d, c in self.dp_cp_coords() for t in range(self.tp)]

    def mp_groups(self) -> List[List[int]]:
        """Model-parallel (tp x pp) groups: all ranks holding one copy of the weights at one
        (dp, cp) position."""
        return [[self.rank(t, d, p, c) for p in range(self.pp) for t in range(self.tp)] for d, c in self.dp_cp_coords()]

    def _expert(self, t: int, block: int, e: int, p: int) -> int:
        return self.rank(t, block * self.ep + e, p)

    def ep_groups(self) -> List[List[int]]:
        """Expert-parallel groups: ``ep`` consecutive data-parallel ranks."""
        blocks = range(self.dp // self.ep)
        return [[self._expert(t, b, e, p) for e in range(self.ep)] for p in range(self.pp) for b in blocks for t in range(self.tp)]

    def tp_ep_groups(self) -> List[List[int]]:
        """Tensor x expert-parallel groups (tp fastest)."""
        blocks = range(self.dp // self.ep)
        return [
            [self._expert(t, b, e, p) for e in range(self.ep) for t in range(self.tp)] for p in range(self.pp) for b in blocks
        ]

    def tp_ep_pp_groups(self) -> List[List[int]]:
        """The ranks holding one copy of every expert and of every stage: tp x ep x pp."""
        return [
            [self._expert(t, b, e, p) for p in range(self.pp) for e in range(self.ep) for t in range(self.tp)]
            for b in range(self.dp // self.ep)
        ]

    def expert_dp_groups(self) -> List[List[int]]:
        """Expert data-parallel groups: the data-parallel ranks of one expert-parallel rank."""
        blocks = range(self.dp // self.ep)
        return [[self._expert(t, b, e, p) for b in blocks] for p in range(self.pp) for e in range(self.ep) for t in range(self.tp)]

    def slices(self) -> List[Tuple[int, int, int]]:
        """Every ``(tp_rank, dp_rank, cp_rank)``: one pipeline's ranks each, dp outer, tp innermost."""
        return [(t, d, c) for d, c in self.dp_cp_coords() for t in range(self.tp)]


@dataclass(frozen=True)
class GroupFamily:
    """One kind of process group: ``name`` and the ascending rank list of each of its groups,
    in creation order (disjoint lists; a rank is in at most one group of a family)."""

    name: str
    rank_lists: Tuple[RankList, ...]

    def group_of(self, rank: int) -> Optional[RankList]:
        """The rank list of ``rank``'s group of this family; None when it is in none."""
        return next((ranks for ranks in self.rank_lists if rank in ranks), None)


@dataclass(frozen=True)
class WarmUp:
    """One warm-up step: an all-reduce over each member's group of ``family``, then one
    exchange over each ``(src, dst)`` pipeline-rank link of ``links`` (a channel's)."""

    family: str
    links: Tuple[Tuple[int, int], ...] = ()


def channel_family(key: ChannelGroupKey) -> str:
    """The family name of channel group ``key`` = (payload, pipeline, direction, parity)."""
    payload, pipeline, direction, parity = key
    return f"channel/{payload.value}/{pipeline}/{direction:+d}/{parity}"


def stage_family(stage: int) -> str:
    return f"stage/{stage}"


def expert_stage_family(stage: int) -> str:
    return f"expert-stage/{stage}"


def replica_family(stage: int) -> str:
    return f"replica/{stage}"


def channel_keys(placement: Placement) -> List[ChannelGroupKey]:
    """Every channel group key of ``placement``, in creation order (payload, pipeline,
    direction +1 then -1, parity)."""
    return [
        (payload, pipeline, direction, parity)
        for payload in Payload
        for pipeline in range(placement.num_pipelines)
        for direction in (+1, -1)
        for parity in (0, 1)
    ]


def placement_links(placement: Placement) -> Dict[ChannelGroupKey, List[Tuple[int, int]]]:
    """The (src, dst) pipeline-rank links each channel group carries, sorted."""
    links: Dict[ChannelGroupKey, set] = {}
    for rank in range(placement.num_ranks):
        for chunk in range(placement.chunks_per_rank):
            for kind in (ActionType.FORWARD, ActionType.BACKWARD):  # the activation and the gradient it sends
                transfer = sent_by(placement, rank, Action(kind, chunk, 0))
                if transfer is not None and not transfer.is_local:
                    links.setdefault(channel_group_key(transfer), set()).add((transfer.src.rank, transfer.dst.rank))
    return {key: sorted(pairs) for key, pairs in links.items()}


def stage_holders(placement: Placement, stage: int) -> List[int]:
    """The pipeline ranks holding a replica of ``stage``, ascending."""
    return sorted({location.rank for location in placement.replicas(stage)})


@dataclass(frozen=True)
class GroupPlan:
    """Every process group of a job, in creation order, and the order of their warm-ups.

    Build with :meth:`for_layout`; see the module docstring. ``grid`` and ``placement`` are the
    layout the plan is for; ``tensor_parallel_mode`` ``1d`` or ``optimus2d``.
    """

    grid: ParallelGrid
    placement: Placement
    tensor_parallel_mode: str
    families: Tuple[GroupFamily, ...]
    warm_ups: Tuple[WarmUp, ...]

    @classmethod
    def for_layout(
        cls, grid: ParallelGrid, placement: Placement, tensor_parallel_mode: str = "1d", replica_groups: bool = False
    ) -> "GroupPlan":
        """The plan of ``grid`` x ``placement`` (module docstring); ``replica_groups``: also the
        ``replica/<s>`` families (decentralized data parallelism). ValueError, naming the rule,
        for a mode that is not ``1d``/``optimus2d``, a non-square tensor-parallel size under
        Optimus 2D, context parallelism with Optimus 2D or with replica groups, a placement of another number of pipeline ranks than ``grid.pp``, or a
        placement holding two replicas of a stage on one rank."""
        if tensor_parallel_mode not in TENSOR_PARALLEL_MODES:
            raise ValueError(f"--tensor-parallel-mode {tensor_parallel_mode!r} is not one of {TENSOR_PARALLEL_MODES}")
        side = mesh_side(grid.tp) if tensor_parallel_mode == "optimus2d" else None
        if grid.cp > 1 and side is not None:
            raise ValueError(f"--context-parallel-size {grid.cp} with --tensor-parallel-mode optimus2d is not supported")
        if grid.cp > 1 and replica_groups:
            raise ValueError(
                f"--context-parallel-size {grid.cp} with decentralized data parallelism (replica groups) is not supported"
            )
        if placement.num_ranks != grid.pp:
            raise ValueError(
                f"the {placement.name} placement has {placement.num_ranks} pipeline ranks, "
                f"--pipeline-model-parallel-size is {grid.pp}"
            )
        stages = range(placement.num_stages)
        for stage in stages:
            if len(stage_holders(placement, stage)) != placement.num_pipelines:
                # DDP averages over ranks; two copies on one rank would need a local sum.
                raise ValueError(f"the {placement.name} placement keeps two replicas of stage {stage} on one rank")

        families: List[Tuple[str, Sequence[Sequence[int]]]] = [
            ("tp", grid.tp_groups()),
            ("dp", grid.dp_groups()),
            ("pp", grid.pp_groups()),
            ("mp", grid.mp_groups()),
            ("solo", [[r] for r in range(grid.world_size)]),
            ("world", [list(range(grid.world_size))]),
        ]
        if grid.cp > 1:
            families += [("cp", grid.cp_groups()), ("dp-cp", grid.dp_cp_groups())]
        keys = channel_keys(placement)
        families += [(channel_family(key), grid.pp_groups()) for key in keys]

        def across_holders(stage: int, slices: Sequence[Tuple[int, Sequence[Tuple[int, int]]]]) -> List[List[int]]:
            """One group per (tp rank, (dp, cp) ranks) of ``slices``: those ranks at every holder of the stage."""
            holders = stage_holders(placement, stage)
            return [sorted(grid.rank(t, d, p, c) for p in holders for d, c in dcs) for t, dcs in slices]

        every_dp_cp = grid.dp_cp_coords()
        families += [(stage_family(s), across_holders(s, [(t, every_dp_cp) for t in range(grid.tp)])) for s in stages]
        experts = grid.ep > 1
        if experts:
            families += [
                ("expert-dp", grid.expert_dp_groups()),
                ("ep", grid.ep_groups()),
                ("tp-ep", grid.tp_ep_groups()),
                ("tp-ep-pp", grid.tp_ep_pp_groups()),
            ]
            blocks = range(grid.dp // grid.ep)
            expert_slices = [(t, [(b * grid.ep + e, 0) for b in blocks]) for e in range(grid.ep) for t in range(grid.tp)]
            families += [(expert_stage_family(s), across_holders(s, expert_slices)) for s in stages]
        replicated = [s for s in stages if replica_groups and placement.num_pipelines > 1]
        families += [(replica_family(s), across_holders(s, [(t, [(d, c)]) for t, d, c in grid.slices()])) for s in replicated]
        if side is not None:
            tp_lists = sorted(tuple(ranks) for ranks in grid.tp_groups())
            families += [
                ("optimus-row", [row for ranks in tp_lists for row in mesh_rows(list(ranks), side)]),
                ("optimus-column", [column for ranks in tp_lists for column in mesh_columns(list(ranks), side)]),
            ]
        if placement.head_copies_embedding:
            ends = (placement.location(0, 0).rank, placement.location(0, placement.num_stages - 1).rank)
            families.append(("embedding", [sorted(grid.rank(t, d, p, c) for p in ends) for t, d, c in grid.slices()]))

        links = placement_links(placement)
        warm_ups = [WarmUp(channel_family(key), tuple(links.get(key, ()))) for key in sorted(keys, key=lambda k: (k[0].value, *k[1:]))]
        if grid.cp > 1:
            warm_ups += [WarmUp("cp"), WarmUp("dp-cp")]
        warm_ups += [WarmUp(stage_family(s)) for s in stages]
        if experts:
            warm_ups += [WarmUp("ep"), WarmUp("tp-ep")] + [WarmUp(expert_stage_family(s)) for s in stages]
        warm_ups += [WarmUp(replica_family(s)) for s in replicated]
        plan = cls(
            grid,
            placement,
            tensor_parallel_mode,
            tuple(GroupFamily(name, tuple(tuple(sorted(ranks)) for ranks in lists)) for name, lists in families),
            tuple(warm_ups),
        )
        plan._check()
        return plan

    def _check(self) -> None:
        names = [family.name for family in self.families]
        if len(set(names)) != len(names):
            raise AssertionError(f"group families named twice: {sorted({n for n in names if names.count(n) > 1})}")
        for family in self.families:
            members = [rank for ranks in family.rank_lists for rank in ranks]
            if len(set(members)) != len(members):
                raise AssertionError(f"group family {family.name} puts a rank in two groups")

    def __iter__(self) -> Iterator[GroupFamily]:
        return iter(self.families)

    def family(self, name: str) -> GroupFamily:
        """The family called ``name`` (KeyError naming the families otherwise)."""
        for family in self.families:
            if family.name == name:
                return family
        raise KeyError(f"no group family {name!r} in the plan; it has {', '.join(f.name for f in self.families)}")

    def __contains__(self, name: str) -> bool:
        return any(family.name == name for family in self.families)

    def groups_of(self, rank: int) -> Dict[str, RankList]:
        """``{family name: rank list}`` of every family that has a group holding ``rank``."""
        return {f.name: ranks for f in self.families if (ranks := f.group_of(rank)) is not None}
