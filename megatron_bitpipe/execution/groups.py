"""Process groups for a placement: megatron-core's collections, p2p channels, grad sync.

Which groups exist, with which ranks and in which order, is decided once, without
communication, by a :class:`~.group_plan.GroupPlan` (:mod:`.group_plan`); :func:`create_groups`
creates them with ``torch.distributed.new_group`` in one loop over the plan, the same on every
rank, and :func:`warm_up` walks its warm-ups; no ``initialize_model_parallel``. The world is a
:class:`~.group_plan.ParallelGrid` (tp x dp x pp in megatron's default order, tp fastest); the
``pp`` coordinate of a rank is its *pipeline rank*, the rank index a
:class:`~megatron_bitpipe.schedules.placement.Placement` speaks of.

:class:`PipelineGroups` holds, for this rank:

* ``rank_pgs`` — a ``ProcessGroupCollection`` for what spans all chunks of the rank: the
  megatron optimizer (``mp`` is the grad-norm group of the non-distributed optimizer,
  ``intra_dist_opt`` — every rank of the job — the distributed optimizer's),
  ``finalize_model_grads``. ``dp`` is the plain data-parallel group, ``dp_cp`` the data x
  context-parallel one (the same group without context parallelism), ``cp`` this rank's
  context-parallel group (the ranks splitting its sequences; this rank alone at ``grid.cp = 1``).
* ``model_pgs[c]`` — the collection for local chunk ``c``: its GPTModel and its
  ``DistributedDataParallel``. Same as ``rank_pgs`` except ``dp = dp_cp = expt_dp`` is the
  chunk's grad-sync group (:meth:`PipelineGroups.grad_sync_group`: its stage's replicas x data
  x context parallel).
  ``embd = pos_embd`` is this rank alone in both: tied embeddings live on one rank
  (:mod:`megatron_bitpipe.model.chunks`), so megatron's embedding all-reduces are skipped
  (a group of one, not None: ``finalize_model_grads`` looks a None embedding group up in the
  global parallel state, which Megatron-LM's training loop has initialised) — unless the
  placement ties embeddings megatron's way
  (:attr:`~megatron_bitpipe.schedules.placement.Placement.head_copies_embedding`: one pipeline whose first
  and last stage are on different ranks): then, on those two ranks, ``embd`` is megatron's
  embedding group, the first- and last-stage ranks of this (tp, dp) slice.
  ``pp`` is the pipeline ranks of this (tp, cp, dp) slice in grid order, for every chunk; its
  rank is the pipeline rank, *not* a stage index.
* p2p channel groups, one per (payload, pipeline, direction, link parity) — see
  :meth:`channel_group`.
* grad-sync groups, one per stage — see :meth:`grad_sync_group`.
* on request, replica groups, one per stage and data-parallel rank — see
  :meth:`replica_group` (decentralized data parallelism).

Every channel, stage, expert and replica group's communicator is created and warmed up in
:meth:`PipelineGroups.build` (:func:`warm_up`), so no communicator is created inside a step (NCCL creates one on first use,
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

Context parallelism (``grid.cp`` > 1): ``cp`` is this rank's context-parallel group in every
collection (the core attention all-gathers keys and values over it, megatron's schedules scale
two-value losses by its size, RoPE takes this rank's positions from it), ``dp_cp`` of
``rank_pgs`` the data x context-parallel group, and the grad-sync groups span the
context-parallel ranks too: gradients are averaged over dp x cp, as megatron's DDP does over
``with_context_parallel`` groups. With ``grid.ep == 1`` expert parallelism is off (``ep`` this
rank alone, ``expt_dp = dp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection

from ..optimus.mesh import OptimusMesh, optimus_mesh
from ..schedules.comm import ChannelGroupKey, Transfer, channel_group_key
from ..schedules.placement import Placement
from .group_plan import (
    GroupPlan,
    ParallelGrid,
    channel_family,
    channel_keys,
    expert_stage_family,
    replica_family,
    stage_family,
    stage_holders,
)

__all__ = ["ParallelGrid", "new_groups", "create_groups", "process_group_collection", "PipelineGroups"]


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
    cp: Optional[dist.ProcessGroup] = None,
    dp_cp: Optional[dist.ProcessGroup] = None,
    embd: Optional[dist.ProcessGroup] = None,
    pos_embd: Optional[dist.ProcessGroup] = None,
    ep: Optional[dist.ProcessGroup] = None,
    tp_ep: Optional[dist.ProcessGroup] = None,
    tp_ep_pp: Optional[dist.ProcessGroup] = None,
    expt_dp: Optional[dist.ProcessGroup] = None,
) -> ProcessGroupCollection:
    """Every group megatron-core's GPTModel, DDP, optimizer and ``finalize_model_grads`` read.

    Context parallelism: ``cp`` as given (default ``solo``, this rank alone: off), ``dp_cp`` as
    given (default ``dp``); ``tp_cp = tp`` (megatron's MoE router alone reads it, and context
    parallelism with experts is refused). Expert parallelism: ``ep``, ``tp_ep``, ``tp_ep_pp``, ``expt_dp`` as given,
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
        dp_cp=dp_cp or dp,
        mp=mp,
        embd=embd,
        pos_embd=pos_embd,
        cp=cp or solo,
        tp_cp=tp,
        ep=ep or solo,
        expt_tp=tp,
        tp_ep=tp_ep or tp,
        expt_dp=expt_dp or dp,
        tp_ep_pp=tp_ep_pp or mp,
        tp_dp_cp=tp,
        intra_dist_opt=world,
    )


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def create_groups(plan: GroupPlan, rank: int) -> Dict[str, dist.ProcessGroup]:
    """Create every group of ``plan``, family by family in its order; a collective call (every
    rank walks the same plan). Returns ``{family name: rank's group}`` for the families
    holding ``rank``."""
    return {family.name: group for family in plan if (group := new_groups(family.rank_lists, rank)) is not None}


def warm_up(plan: GroupPlan, groups: Dict[str, dist.ProcessGroup], pp_rank: int, global_rank: Callable[[int], int]) -> None:
    """Create every communicator of ``plan.warm_ups`` now, in that order on every rank.

    Per warm-up, where this rank is a member of the family: an all-reduce of one element over
    its group (on NCCL this creates the group's communicator, which a group's first batched
    p2p call may not do), then one ``batch_isend_irecv`` of one element over each of the
    warm-up's links that this rank sends or receives on (NCCL connects a pair on its first
    exchange). Every rank walks the same sequence, blocking at each item, so the earliest
    unfinished item always has all its members: no deadlock. ``global_rank`` maps a pipeline
    rank of this rank's (tp, dp) slice to its global rank.
    """
    device = _device()
    for step in plan.warm_ups:
        group = groups.get(step.family)
        if group is None:
            continue
        dist.all_reduce(torch.zeros(1, device=device), group=group)
        ops = []
        for src, dst in step.links:
            if pp_rank == src:
                ops.append(dist.P2POp(dist.isend, torch.zeros(1, device=device), global_rank(dst), group))
            elif pp_rank == dst:
                ops.append(dist.P2POp(dist.irecv, torch.zeros(1, device=device), global_rank(src), group))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's process groups for running ``placement`` on ``grid``; see the module doc.

    Build with :meth:`build`. ``rank`` is the global rank; ``pp_rank`` (pipeline rank),
    ``tp_rank`` and ``dp_rank`` its grid coordinates; ``created``: every group :meth:`build`
    made that holds this rank (:meth:`destroy` ends them).
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
    created: Tuple[dist.ProcessGroup, ...] = ()

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
    def cp_rank(self) -> int:
        """This rank's context-parallel rank: which slices of each sequence it holds."""
        return self.grid.cp_rank(self.rank)

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
        """Global rank of pipeline rank ``pp_rank`` in this rank's (tp, cp, dp) slice."""
        if not 0 <= pp_rank < self.grid.pp:
            raise ValueError(f"pipeline rank {pp_rank} outside [0, {self.grid.pp})")
        return self.grid.rank(self.tp_rank, self.dp_rank, pp_rank, self.cp_rank)

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
        for BitPipe) times data parallel times context parallel, at this rank's
        tensor-parallel rank: size ``num_pipelines * dp * cp``. There is one group per stage, so two stages held by the same
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
        plan = GroupPlan.for_layout(grid, placement, tensor_parallel_mode, replica_groups)
        if dist.get_world_size() != grid.world_size:
            raise ValueError(f"{grid} needs {grid.world_size} ranks, the job has {dist.get_world_size()}")
        rank = dist.get_rank()
        pp_rank = grid.coords(rank)[2]
        groups = create_groups(plan, rank)
        tp_rank, dp_rank, _ = grid.coords(rank)
        warm_up(plan, groups, pp_rank, lambda p: grid.rank(tp_rank, dp_rank, p, grid.cp_rank(rank)))
        stages = [s for s in range(placement.num_stages) if pp_rank in stage_holders(placement, s)]
        stage_groups = {s: groups[stage_family(s)] for s in stages}
        expert_stage_groups = {s: groups[expert_stage_family(s)] for s in stages} if grid.ep > 1 else None
        experts = dict(ep=groups["ep"], tp_ep=groups["tp-ep"], tp_ep_pp=groups["tp-ep-pp"]) if grid.ep > 1 else {}
        replicas = None
        if replica_groups:
            replicas = {s: groups.get(replica_family(s), groups["solo"]) for s in stages}  # one replica: this rank alone
        mesh = None
        if tensor_parallel_mode == "optimus2d":
            mesh = optimus_mesh(groups["tp"], groups["optimus-row"], groups["optimus-column"])
        tp, pp, solo = groups["tp"], groups["pp"], groups["solo"]
        channels = {key: groups[channel_family(key)] for key in channel_keys(placement)}
        common = dict(tp=tp, pp=pp, mp=groups["mp"], solo=solo, world=groups["world"], embd=groups.get("embedding", solo),
                      pos_embd=solo, cp=groups.get("cp"), **experts)  # fmt: skip
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
            rank_pgs=process_group_collection(dp=groups["dp"], dp_cp=groups.get("dp-cp"), expt_dp=groups.get("expert-dp"), **common),
            model_pgs=model_pgs,
            channels=channels,
            stage_groups=stage_groups,
            mesh=mesh,
            replica_groups=replicas,
            expert_stage_groups=expert_stage_groups,
            created=tuple(dict.fromkeys(groups.values())),
        )

    def destroy(self) -> None:
        """Destroy every group :meth:`build` created that holds this rank (local, no
        communication; the groups, and a model built on them, are unusable afterwards).

        Each gloo group keeps threads polling its sockets (some tenths of a CPU-second per second
        for a hundred idle groups) until its last reference goes: a process that builds model
        after model on fresh groups (the equivalence launches run many cases in one process)
        destroys each model's groups when done with it.
        """
        for group in self.created:
            dist.destroy_process_group(group)
