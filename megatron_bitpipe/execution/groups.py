"""Process groups for a placement: megatron-core's collections, p2p channels, grad sync.

Everything is built with ``torch.distributed.new_group`` on every rank in the same order; no
``initialize_model_parallel``. The world is a :class:`ParallelGrid` (tp x dp x pp in
megatron's default order, tp fastest); the ``pp`` coordinate of a rank is its *pipeline rank*,
the rank index a :class:`~megatron_bitpipe.schedules.placement.Placement` speaks of.

:class:`PipelineGroups` holds, for this rank:

* ``rank_pgs`` — a ``ProcessGroupCollection`` for what spans all chunks of the rank: the
  megatron optimizer (``mp`` is the grad-norm group of the non-distributed optimizer,
  ``intra_dist_opt`` — every rank of the job — the distributed optimizer's),
  ``finalize_model_grads``. ``dp``/``dp_cp`` are the plain data-parallel group.
* ``model_pgs[c]`` — the collection for local chunk ``c``: its GPTModel and its
  ``DistributedDataParallel``. Same as ``rank_pgs`` except ``dp = dp_cp = expt_dp`` is the
  chunk's grad-sync group (:meth:`PipelineGroups.grad_sync_group`).
  ``embd = pos_embd`` is this rank alone in both: tied embeddings live on one rank
  (:mod:`megatron_bitpipe.model.chunks`), so megatron's embedding all-reduces are skipped
  (a group of one, not None: ``finalize_model_grads`` looks a None embedding group up in the
  global parallel state, which Megatron-LM's training loop has initialised) — unless the
  placement ties embeddings megatron's way
  (:attr:`~megatron_bitpipe.schedules.placement.Placement.head_copies_embedding`: one pipeline whose first
  and last stage are on different ranks): then, on those two ranks, ``embd`` is megatron's
  embedding group, the first- and last-stage ranks of this (tp, dp) slice.
  ``pp`` is the pipeline ranks of this (tp, dp) slice in grid order, for every chunk; its
  rank is the pipeline rank, *not* a stage index.
* p2p channel groups, one per (payload, pipeline, direction, link parity) — see
  :meth:`channel_group`.
* grad-sync groups, one per stage — see :meth:`grad_sync_group`.
* on request, replica groups, one per stage and data-parallel rank — see
  :meth:`replica_group` (decentralized data parallelism).

Every channel and stage group's communicator is created and warmed up in :meth:`PipelineGroups.build`
(:func:`warm_up`), so no communicator is created inside a step (NCCL creates one on first use,
a rendezvous that blocks until every member arrives — ranks reaching different groups first
deadlock).
* ``mesh`` — with ``tensor_parallel_mode="optimus2d"``, the Optimus 2D mesh (row and column
  groups) laid over the tp group (:class:`~megatron_bitpipe.optimus.mesh.OptimusMesh`);
  ``None`` with megatron's 1-D tensor parallelism.

* expert parallelism (``grid.ep`` > 1: a mixture-of-experts model's experts split over ``ep``
  consecutive data-parallel ranks): ``ep`` is this rank's expert-parallel group, ``tp_ep`` its
  tensor x expert-parallel ranks, ``tp_ep_pp`` the ranks holding one copy of every expert (the
  expert optimizer's grad-norm group); in ``model_pgs[c]`` ``expt_dp`` is the chunk's
  *expert* grad-sync group (:meth:`PipelineGroups.expert_grad_sync_group`), in ``rank_pgs``
  the plain expert data-parallel group. The ranks of one expert-parallel group share the
  pipeline rank and run one plan, so they reach every MoE layer's collectives together.
  Expert tensor parallelism equals tensor parallelism (``expt_tp = tp``).

Context parallelism is off (``cp`` is this rank alone); with ``grid.ep == 1`` so is expert
parallelism (``ep`` this rank alone, ``expt_dp = dp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from ..optimus.args import TENSOR_PARALLEL_MODES
from ..optimus.mesh import OptimusMesh, build_optimus_mesh, mesh_side
from ..schedules.actions import Action, ActionType
from ..schedules.comm import ChannelGroupKey, Payload, Transfer, channel_group_key, sent_by
from ..schedules.placement import Placement

__all__ = ["ParallelGrid", "new_groups", "process_group_collection", "PipelineGroups"]


@dataclass(frozen=True)
class ParallelGrid:
    """A tp x dp x pp rank grid in megatron's default order, with ``ep`` expert-parallel ranks
    inside the data-parallel ones.

    Invariants: ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``, so a tensor-parallel group
    is a run of ``tp`` consecutive ranks and pipeline ranks are ``tp * dp`` apart; ``ep``
    divides ``dp``, and data-parallel rank ``d`` is expert-parallel rank ``d % ep`` of the
    expert-parallel group ``d // ep`` (megatron's expert order: ep faster than expert dp).
    """

    tp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self):
        if self.ep < 1 or self.dp % self.ep:
            raise ValueError(
                f"--expert-model-parallel-size {self.ep} must divide the data-parallel size {self.dp} "
                "(expert-parallel ranks are data-parallel copies of one pipeline rank)"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    def rank(self, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """``(tp_rank, dp_rank, pp_rank)`` of a global rank."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def tp_groups(self) -> List[List[int]]:
        return [[self.rank(t, d, p) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> List[List[int]]:
        return [[self.rank(t, d, p) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> List[List[int]]:
        return [[self.rank(t, d, p) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def mp_groups(self) -> List[List[int]]:
        """Model-parallel (tp x pp) groups: all ranks holding one data-parallel replica."""
        return [[self.rank(t, d, p) for p in range(self.pp) for t in range(self.tp)] for d in range(self.dp)]

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


def new_groups(rank_lists: Sequence[Sequence[int]], rank: int) -> Optional[dist.ProcessGroup]:
    """Create one group per list of ``rank_lists``; a collective call (same lists on every rank).

    Returns the group that contains ``rank``, None if none does.
    """
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = group
    return mine


def process_group_collection(
    *,
    tp: dist.ProcessGroup,
    pp: dist.ProcessGroup,
    dp: dist.ProcessGroup,
    mp: dist.ProcessGroup,
    solo: dist.ProcessGroup,
    world: dist.ProcessGroup,
    embd: Optional[dist.ProcessGroup] = None,
    pos_embd: Optional[dist.ProcessGroup] = None,
    ep: Optional[dist.ProcessGroup] = None,
    tp_ep: Optional[dist.ProcessGroup] = None,
    tp_ep_pp: Optional[dist.ProcessGroup] = None,
    expt_dp: Optional[dist.ProcessGroup] = None,
) -> ProcessGroupCollection:
    """Every group megatron-core's GPTModel, DDP, optimizer and ``finalize_model_grads`` read.

    Context parallelism is off: ``cp`` is ``solo`` (this rank alone), ``dp_cp = dp``,
    ``tp_cp = tp``. Expert parallelism: ``ep``, ``tp_ep``, ``tp_ep_pp``, ``expt_dp`` as given,
    each defaulting to expert parallelism off (``solo``, ``tp``, ``mp``, ``dp``); expert tensor
    parallelism is tensor parallelism (``expt_tp = tp``). ``tp_dp_cp`` is ``tp``: the MoE router
    reduces over it only for megatron's ``global_aux_loss`` (statistics across the data-parallel
    ranks and micro-batches of a step), which is refused
    (:func:`~megatron_bitpipe.model.experts.check_expert_layout`). One distributed-optimizer instance,
    whose gradient statistics (``intra_dist_opt``) span ``world``, every rank.
    ``embd``/``pos_embd`` None means "not in such a group" (megatron treats None as a group of
    one and skips the all-reduce).
    """
    return ProcessGroupCollection(
        tp=tp,
        pp=pp,
        dp=dp,
        dp_cp=dp,
        mp=mp,
        embd=embd,
        pos_embd=pos_embd,
        cp=solo,
        tp_cp=tp,
        ep=ep or solo,
        expt_tp=tp,
        tp_ep=tp_ep or tp,
        expt_dp=expt_dp or dp,
        tp_ep_pp=tp_ep_pp or mp,
        tp_dp_cp=tp,
        intra_dist_opt=world,
    )


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


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def warm_up(
    placement: Placement,
    pp_rank: int,
    global_rank: Callable[[int], int],
    channels: Dict[ChannelGroupKey, dist.ProcessGroup],
    stage_groups: Dict[int, dist.ProcessGroup],
) -> None:
    """Create every channel and stage group's communicator now, in one order on every rank.

    Per channel group, in key order: an all-reduce of one element over the group (every member
    takes part: on NCCL this creates the group's communicator, which a group's first batched
    p2p call may not do), then one ``batch_isend_irecv`` of one element over each of the
    group's links that this rank sends or receives on (NCCL connects a pair on its first
    exchange). Then an all-reduce over each of this rank's stage groups, in stage order.
    Every rank walks the same sequence, blocking at each item, so the earliest unfinished item
    always has all its members: no deadlock. ``global_rank`` maps a pipeline rank of this
    rank's (tp, dp) slice to its global rank.
    """
    device = _device()
    links = placement_links(placement)
    for key in sorted(channels, key=lambda k: (k[0].value, *k[1:])):
        group = channels[key]
        dist.all_reduce(torch.zeros(1, device=device), group=group)
        ops = []
        for src, dst in links.get(key, []):
            if pp_rank == src:
                ops.append(dist.P2POp(dist.isend, torch.zeros(1, device=device), global_rank(dst), group))
            elif pp_rank == dst:
                ops.append(dist.P2POp(dist.irecv, torch.zeros(1, device=device), global_rank(src), group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
    for stage in sorted(stage_groups):
        dist.all_reduce(torch.zeros(1, device=device), group=stage_groups[stage])


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's process groups for running ``placement`` on ``grid``; see the module doc.

    Build with :meth:`build`. ``rank`` is the global rank; ``pp_rank`` (pipeline rank),
    ``tp_rank`` and ``dp_rank`` its grid coordinates.
    """

    grid: ParallelGrid
    placement: Placement
    rank: int
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    rank_pgs: ProcessGroupCollection
    model_pgs: Tuple[ProcessGroupCollection, ...]
    channels: Dict[ChannelGroupKey, dist.ProcessGroup]
    stage_groups: Dict[int, dist.ProcessGroup]
    mesh: Optional[OptimusMesh] = None
    replica_groups: Optional[Dict[int, dist.ProcessGroup]] = None
    expert_stage_groups: Optional[Dict[int, dist.ProcessGroup]] = None

    @property
    def tp_rank(self) -> int:
        return self.grid.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.grid.coords(self.rank)[1]

    @property
    def pp_rank(self) -> int:
        return self.grid.coords(self.rank)[2]

    @property
    def ep_rank(self) -> int:
        """This rank's expert-parallel rank (:class:`ParallelGrid`: data-parallel rank mod ``ep``)."""
        return self.dp_rank % self.grid.ep

    def local_experts(self, num_experts: Optional[int]) -> Optional[range]:
        """The global indices of the routed experts this rank holds of each MoE layer's
        ``num_experts`` (a contiguous block per expert-parallel rank, as megatron's MoE layer
        assigns them); None without expert parallelism (every expert, or none)."""
        if num_experts is None or self.grid.ep == 1:
            return None
        per_rank = num_experts // self.grid.ep
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    def pp_global_rank(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this rank's (tp, dp) slice."""
        if not 0 <= pp_rank < self.grid.pp:
            raise ValueError(f"pipeline rank {pp_rank} outside [0, {self.grid.pp})")
        return self.grid.rank(self.tp_rank, self.dp_rank, pp_rank)

    def channel_group(self, transfer: Transfer) -> dist.ProcessGroup:
        """The group ``transfer``'s message travels on.

        One group per (payload, pipeline, direction, parity of the link's lower rank), each
        spanning the pipeline ranks of this (tp, dp) slice; address peers with
        :meth:`pp_global_rank` (torch's p2p calls take global ranks). Invariants:

        * one group carries one message stream between two ranks, so two streams between
          the same pair (e.g. activations to and from the other rank at D = 2, where the
          previous and next rank coincide) are never matched against each other — gloo and
          NCCL match messages by posting order within a group;
        * within one group a rank only sends (to one neighbour) or only receives (from one
          neighbour): links ``r -> r+1`` and ``r+1 -> r+2`` have different parities. NCCL
          serialises the operations of one group, so a receive posted early can never hold
          up a send of the same rank, and posting receives ahead of time is deadlock-free.

        Raises ValueError for a local (V-turn) hand-over, which sends nothing.
        """
        if transfer.is_local:
            raise ValueError(f"{transfer} is a local hand-over; it has no channel")
        return self.channels[channel_group_key(transfer)]

    def grad_sync_group(self, chunk: int) -> dist.ProcessGroup:
        """Group over which local chunk ``chunk``'s gradients are averaged.

        All ranks holding a replica of the chunk's stage (one per pipeline: the mirror pair
        for BitPipe) times data parallel, at this rank's tensor-parallel rank: size
        ``num_pipelines * dp``. There is one group per stage, so two stages held by the same
        ranks (BitPipe's mirror pair holds four) never share a group: their collectives may
        be issued in different orders on the two ranks when they are asynchronous.
        *Blocking* collectives over these groups must still be issued in the same order on
        every rank: by stage (:func:`megatron_bitpipe.execution.replicas.stage_order`).
        """
        return self.stage_groups[self.placement.role(self.pp_rank, chunk).stage]

    def expert_grad_sync_group(self, chunk: int) -> dist.ProcessGroup:
        """Group over which local chunk ``chunk``'s *expert* gradients are reduced: the ranks
        holding this rank's experts of the chunk's stage — every replica of the stage (both
        pipelines of BitPipe) x the data-parallel ranks of this expert-parallel rank, at this
        tensor-parallel rank: size ``num_pipelines * dp / ep``. The grad-sync group itself
        without expert parallelism."""
        stage = self.placement.role(self.pp_rank, chunk).stage
        return self.stage_groups[stage] if self.expert_stage_groups is None else self.expert_stage_groups[stage]

    def replica_group(self, chunk: int) -> dist.ProcessGroup:
        """Group over which local chunk ``chunk``'s gradients are averaged *within* this
        data-parallel replica: the ranks holding a replica of the chunk's stage (one per
        pipeline) at this rank's tensor- and data-parallel rank; this rank alone for a
        placement of one pipeline. Built only on request (``build(..., replica_groups=True)``:
        decentralized data parallelism, whose replicas keep weights of their own)."""
        if self.replica_groups is None:
            raise ValueError("the replica groups were not built: PipelineGroups.build(..., replica_groups=True)")
        return self.replica_groups[self.placement.role(self.pp_rank, chunk).stage]

    @classmethod
    def build(
        cls, grid: ParallelGrid, placement: Placement, tensor_parallel_mode: str = "1d", replica_groups: bool = False
    ) -> "PipelineGroups":
        """Create every group of ``grid`` x ``placement``; a collective call on the default group.

        ``tensor_parallel_mode`` is ``--tensor-parallel-mode``: ``"1d"`` (megatron's tensor
        parallelism) or ``"optimus2d"`` (also builds the Optimus mesh over the tp group, whose
        size must then be q*q). ``replica_groups``: also build (and warm up) the groups of
        :meth:`replica_group`. Bad arguments raise ValueError before any communication.
        """
        if tensor_parallel_mode not in TENSOR_PARALLEL_MODES:
            raise ValueError(f"--tensor-parallel-mode {tensor_parallel_mode!r} is not one of {TENSOR_PARALLEL_MODES}")
        if tensor_parallel_mode == "optimus2d":
            mesh_side(grid.tp)
        if dist.get_world_size() != grid.world_size:
            raise ValueError(f"{grid} needs {grid.world_size} ranks, the job has {dist.get_world_size()}")
        if placement.num_ranks != grid.pp:
            raise ValueError(
                f"the {placement.name} placement has {placement.num_ranks} pipeline ranks, "
                f"--pipeline-model-parallel-size is {grid.pp}"
            )
        rank = dist.get_rank()
        pp_rank = grid.coords(rank)[2]
        tp = new_groups(grid.tp_groups(), rank)
        dp = new_groups(grid.dp_groups(), rank)
        pp = new_groups(grid.pp_groups(), rank)
        mp = new_groups(grid.mp_groups(), rank)
        solo = new_groups([[r] for r in range(grid.world_size)], rank)
        world = new_groups([list(range(grid.world_size))], rank)

        channels = {}
        for payload in Payload:
            for pipeline in range(placement.num_pipelines):
                for direction in (+1, -1):
                    for parity in (0, 1):
                        channels[(payload, pipeline, direction, parity)] = new_groups(grid.pp_groups(), rank)

        stage_groups = {}
        for stage in range(placement.num_stages):
            holders = sorted({loc.rank for loc in placement.replicas(stage)})
            if len(holders) != placement.num_pipelines:
                # DDP averages over ranks; two copies on one rank would need a local sum.
                raise ValueError(f"the {placement.name} placement keeps two replicas of stage {stage} on one rank")
            lists = [sorted(grid.rank(t, d, p) for p in holders for d in range(grid.dp)) for t in range(grid.tp)]
            group = new_groups(lists, rank)
            if pp_rank in holders:
                stage_groups[stage] = group

        expert_stage_groups, expert_dp = None, None
        experts = {}
        if grid.ep > 1:
            expert_dp = new_groups(grid.expert_dp_groups(), rank)
            experts = dict(
                ep=new_groups(grid.ep_groups(), rank),
                tp_ep=new_groups(grid.tp_ep_groups(), rank),
                tp_ep_pp=new_groups(grid.tp_ep_pp_groups(), rank),
            )
            expert_stage_groups = {}
            blocks = range(grid.dp // grid.ep)
            for stage in range(placement.num_stages):
                holders = sorted({loc.rank for loc in placement.replicas(stage)})
                lists = [
                    sorted(grid.rank(t, b * grid.ep + e, p) for p in holders for b in blocks)
                    for e in range(grid.ep)
                    for t in range(grid.tp)
                ]
                group = new_groups(lists, rank)
                if pp_rank in holders:
                    expert_stage_groups[stage] = group

        replicas = None
        if replica_groups:
            replicas = {}
            for stage in range(placement.num_stages):
                holders = sorted({loc.rank for loc in placement.replicas(stage)})
                if len(holders) == 1:
                    group = solo
                else:
                    slices = [(t, d) for d in range(grid.dp) for t in range(grid.tp)]
                    group = new_groups([sorted(grid.rank(t, d, p) for p in holders) for t, d in slices], rank)
                if pp_rank in holders:
                    replicas[stage] = group

        warm_up(placement, pp_rank, lambda p: grid.rank(*grid.coords(rank)[:2], p), channels, stage_groups)
        if experts:  # the expert groups' communicators, in one order on every rank
            for name in ("ep", "tp_ep"):
                dist.all_reduce(torch.zeros(1, device=_device()), group=experts[name])
            for stage in sorted(expert_stage_groups):
                dist.all_reduce(torch.zeros(1, device=_device()), group=expert_stage_groups[stage])
        for stage in sorted(replicas or {}):  # a mirror pair holds the same stages: one order
            if placement.num_pipelines > 1:
                dist.all_reduce(torch.zeros(1, device=_device()), group=replicas[stage])
        mesh = build_optimus_mesh(tp) if tensor_parallel_mode == "optimus2d" else None
        embd = solo
        if placement.head_copies_embedding:
            ends = (placement.location(0, 0).rank, placement.location(0, placement.num_stages - 1).rank)
            slices = [(t, d) for d in range(grid.dp) for t in range(grid.tp)]
            embd = new_groups([sorted(grid.rank(t, d, p) for p in ends) for t, d in slices], rank) or solo
        common = dict(tp=tp, pp=pp, mp=mp, solo=solo, world=world, embd=embd, pos_embd=solo, **experts)
        model_pgs = tuple(
            process_group_collection(
                dp=stage_groups[stage],
                expt_dp=None if expert_stage_groups is None else expert_stage_groups[stage],
                **common,
            )
            for stage in (placement.role(pp_rank, c).stage for c in range(placement.chunks_per_rank))
        )
        return cls(
            grid=grid,
            placement=placement,
            rank=rank,
            tp=tp,
            pp=pp,
            rank_pgs=process_group_collection(dp=dp, expt_dp=expert_dp, **common),
            model_pgs=model_pgs,
            channels=channels,
            stage_groups=stage_groups,
            mesh=mesh,
            replica_groups=replicas,
            expert_stage_groups=expert_stage_groups,
        )
