"""Keeping the weight replicas of a multi-pipeline placement one logical model.

Chimera and BitPipe hold one copy of every stage per pipeline. The copies must start equal
(:func:`megatron_bitpipe.model.init.initialize_from_seed`; and
:func:`max_replica_difference` for checks), receive the same averaged gradient, and be counted
once in the gradient norm.

**Gradient averaging.** Each chunk gets its own megatron ``DistributedDataParallel`` whose
data-parallel group is the chunk's grad-sync group (all replicas of the stage x data
parallel, ``R * DP`` ranks for ``R`` pipelines; :func:`wrap_ddp`). With ``N`` micro-batches on
a data-parallel rank, ``N / R`` of them per pipeline (:func:`microbatches_per_replica` checks
the split), each micro-batch's loss is divided by ``N``, as megatron's own schedules divide it
(the ``num_microbatches`` megatron's ``forward_step`` divides by), so every backward sees the
same scaled loss as in one pipeline — with ``--fp16`` the same loss scale over the same
number, hence the same fp16 overflows. Every replica's local gradient is then ``1 / N`` times
the sum of its micro-batches' gradients, and DDP *sums* the replicas: :func:`wrap_ddp`
multiplies megatron's pre-reduction scaling (``1 / (R * DP)``, or an average in the collective)
by ``R`` (:attr:`ChunkDistributedDataParallel.replica_gradient_factor`), giving
``1 / (N * DP) * sum over the global batch`` — the gradient of one model trained on the
whole global batch of ``N * DP`` micro-batches. (With ``calculate_per_token_loss`` megatron
does not divide the loss, DDP sums and megatron's ``finalize_model_grads`` divides by a token
count it broadcasts from the last pipeline rank, which in a V placement is not where the
losses are: :func:`~.forward_backward.finalize_grads` sums the count over the loss ranks.)

**Grad norm.** megatron's non-distributed optimizer sums squared gradients over parameters
for which ``megatron.core.transformer.module.param_is_not_shared(p)`` is true (i.e. no
``p.shared = True``) and that are not tensor-parallel duplicates, over its ``mp`` group
(tp x pp: one data-parallel replica). :func:`mark_replica_parameters` sets ``shared = True``
on every parameter of the chunks of pipelines other than 0, so each logical parameter is
counted once, on pipeline 0's copy (which holds every stage exactly once). Clipping still
scales all parameters; count-zeros counts each once. The distributed optimizer needs no
marks: each chunk's optimizer state, and so its gradient shard, is split over the stage's
replicas and data-parallel copies, so every element has exactly one owner in the job, and
megatron sums the owners' squares over all ranks.
"""

from __future__ import annotations

import copy
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig

from .. import megatron_compat
from ..schedules.placement import Placement
from .groups import PipelineGroups
from ..model_partition import ChunkSpec
from megatron.core.utils import unwrap_model

__all__ = [
    "GRADIENT_REDUCTIONS",
    "microbatches_per_replica",
    "ChunkDistributedDataParallel",
    "wrap_ddp",
    "stage_order",
    "mark_replica_parameters",
    "max_replica_difference",
]


#: what :func:`wrap_ddp`'s DDP reduces the gradients over
GRADIENT_REDUCTIONS = ("data-parallel", "replicas", "none")


def microbatches_per_replica(num_microbatches: int, placement: Placement) -> int:
    """Micro-batches each pipeline runs out of ``num_microbatches`` (one data-parallel rank's).

    ValueError, naming ``--global-batch-size``, unless every pipeline gets the same number (at
    least one). (Each micro-batch loss is still divided by ``num_microbatches``: module
    docstring.)
    """
    pipelines = placement.num_pipelines
    if num_microbatches < pipelines or num_microbatches % pipelines:
        raise ValueError(
            f"{num_microbatches} micro-batches per data-parallel rank cannot be split evenly over the "
            f"{pipelines} pipelines of the {placement.name} placement; choose --global-batch-size as a "
            f"multiple of {pipelines} x --micro-batch-size x data-parallel size"
        )
    return num_microbatches // pipelines


class ChunkDistributedDataParallel(DistributedDataParallel):
    """megatron DDP whose gradient synchronisation an optimizer may take over.

    ``gradient_exchange`` is None (megatron's all-reduce over the grad-sync group) or an object
    with ``start()`` and ``finish()`` that replaces it: ``start_grad_sync`` (BitPipe's eager
    ``SYNC``) calls ``start()``, ``finish_grad_sync`` (megatron's ``finalize_model_grads``)
    calls ``finish()``, which must also work without a preceding ``start()``. 1-bit LAMB's
    compression stage installs its momentum exchange here
    (:class:`megatron_bitpipe.optimizers.onebit_lamb.ChunkMomentum`).
    """

    gradient_exchange = None
    #: what the reduction multiplies a local gradient by beyond megatron's own average over
    #: the DDP's group: ``R`` (the placement's pipelines) where the replicas' gradients are
    #: summed (module docstring), 1 otherwise. An exchange that replaces the reduction scales
    #: the local gradients by it too.
    replica_gradient_factor = 1

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # megatron's switch for gathers started outside the forward: its pre-hooks then only
        # wait, and never start the next bucket group's gather (see overlaps_param_gather).
        self.overlap_param_gather_with_optimizer_step = self.overlaps_param_gather

    @property
    def overlaps_param_gather(self) -> bool:
        """The distributed optimizer's parameter all-gather is overlapped with the next forward
        (``overlap_param_gather`` with ``use_distributed_optimizer``).

        Invariant: the gather is always *started* in stage order
        (:func:`stage_order`), the same order on every rank of every grad-sync group — by the
        chunk's optimizer right after its step
        (:class:`~megatron_bitpipe.execution.distributed_optimizer.ChunkDistributedOptimizer`),
        or, where no step started it (the first iteration, a skipped step), by
        :meth:`dispatch_param_gather` before the plan's first action — and only *waited for* in
        the forward, by megatron's forward pre-hooks, module by module. A forward pre-hook never
        starts one: a chunk's first forward comes in plan order, which differs between the ranks
        of a grad-sync group.
        """
        return self.ddp_config.use_distributed_optimizer and self.ddp_config.overlap_param_gather

    def dispatch_param_gather(self) -> None:
        """Start this chunk's parameter all-gather (asynchronously) unless it was started since
        the last gradient sync or no forward pre-hook would wait for it (Megatron-LM removes
        them for its first iteration and its evaluations). Callers walk the chunks in stage
        order."""
        if not self.overlaps_param_gather:
            return
        state = megatron_compat.param_gather_state(self)
        if not state.dispatched and state.hooks_enabled:
            self.start_param_sync(force_dispatch=True)

    def finish_param_gather(self) -> None:
        """Wait for this chunk's parameter all-gather if one is in flight (before reading the
        weights outside a forward: a checkpoint, a comparison); no communication of its own."""
        if self.overlaps_param_gather:
            megatron_compat.finish_param_gathers(self)

    def start_grad_sync(self, *unused):
        if self.gradient_exchange is None:
            return super().start_grad_sync(*unused)
        self.gradient_exchange.start()

    def finish_grad_sync(self, force_all_reduce: bool = False):
        if self.gradient_exchange is None:
            return super().finish_grad_sync(force_all_reduce=force_all_reduce)
        self.gradient_exchange.finish()


def wrap_ddp(
    chunks: Sequence[torch.nn.Module],
    groups: PipelineGroups,
    config: TransformerConfig,
    ddp_config: DistributedDataParallelConfig,
    gradient_reduction: str = "data-parallel",
) -> List[ChunkDistributedDataParallel]:
    """One megatron DDP (:class:`ChunkDistributedDataParallel`) per chunk, reducing over the
    group :data:`GRADIENT_REDUCTIONS` names:

    * ``"data-parallel"``: the chunk's grad-sync group (its stage's replicas x data parallel;
      synchronous data parallelism);
    * ``"replicas"``: :meth:`~.groups.PipelineGroups.replica_group`, the stage's replicas
      within this data-parallel replica (BitPipe's mirror pair; this rank alone for one
      pipeline): each data-parallel replica's gradient is its own batch's, and the replica
      copies of a stage stay equal (decentralized data parallelism,
      :mod:`megatron_bitpipe.training.decentralized`; ``groups`` built with replica groups);
    * ``"none"``: this rank alone, so the gradient buffers keep this rank's own gradients
      after a step and the caller reduces them over
      :meth:`~.groups.PipelineGroups.grad_sync_group` itself (ABS-SGD's delayed all-reduce,
      :mod:`megatron_bitpipe.training.abs_sgd`).

    With ``"data-parallel"`` and ``"replicas"`` (and no ``calculate_per_token_loss``) megatron's
    average over the group becomes a sum over the stage's ``R`` replicas and an average over
    the rest (:attr:`ChunkDistributedDataParallel.replica_gradient_factor` = ``R``; module
    docstring); with ``"none"`` the caller's reduction owns that factor.

    ``config`` is the caller's (shared) config: ``get_model_config`` of every wrapped chunk
    returns it. Every chunk is a single bucket: megatron turns bucketing off on pipeline
    ranks > 0, and a stage's replicas sit on different pipeline ranks, so only uniform
    single buckets give every replica the same sequence of collectives. With
    ``ddp_config.use_distributed_optimizer`` the gradients are reduce-scattered over the
    grad-sync group and the parameters all-gathered over it after the step: each chunk
    then needs its own distributed optimizer over that group
    (:func:`megatron_bitpipe.training.optimizer.build_optimizer`).
    """
    if gradient_reduction == "data-parallel":
        collections = list(groups.model_pgs)
    elif gradient_reduction == "replicas":
        collections = [_with_data_parallel(pgs, groups.replica_group(c)) for c, pgs in enumerate(groups.model_pgs)]
    elif gradient_reduction == "none":
        collections = [_with_data_parallel(pgs, pgs.cp) for pgs in groups.model_pgs]
    else:
        raise ValueError(f"gradient_reduction {gradient_reduction!r} is not one of {GRADIENT_REDUCTIONS}")
    wrapped = [
        ChunkDistributedDataParallel(config, ddp_config, chunk, disable_bucketing=True, pg_collection=pgs)
        for chunk, pgs in zip(chunks, collections)
    ]
    replicas = groups.placement.num_pipelines
    if gradient_reduction != "none" and not config.calculate_per_token_loss and replicas > 1:
        for ddp in wrapped:
            megatron_compat.scale_gradient_reduction(ddp, replicas)
            ddp.replica_gradient_factor = replicas
    return wrapped


def _with_data_parallel(pgs, group):
    """``pgs`` with its data-parallel groups replaced by ``group`` (``pgs.cp`` is this rank
    alone: context parallelism needs the data-parallel reduction,
    :func:`~megatron_bitpipe.model.build.check_context_parallel_model`)."""
    local = copy.copy(pgs)
    local.dp = local.dp_cp = local.expt_dp = group
    return local


def mark_replica_parameters(chunks: Sequence[torch.nn.Module], specs: Sequence[ChunkSpec]) -> None:
    """Set ``param.shared = True`` on the parameters of chunks not in pipeline 0.

    Call once after building (before or after DDP wrapping). Only for megatron's
    non-distributed optimizer, whose grad norm runs over the model-parallel group (the
    distributed optimizer's shards already count every element once).
    """
    for chunk, spec in zip(chunks, specs):
        if spec.pipeline != 0:
            for param in unwrap_model(chunk).parameters():
                param.shared = True


def stage_order(groups: PipelineGroups) -> List[int]:
    """This rank's local chunk ids by increasing stage.

    Blocking collectives over grad-sync groups must follow this order on every rank: at
    D = 2, rank 0 holds stages (0, 1, 3, 2) and rank 1 stages (1, 0, 2, 3) as chunks 0..3, so
    walking the chunks by local id deadlocks. In particular megatron's
    ``finalize_model_grads`` with synchronous DDP (``overlap_grad_reduce=False``) reduces the
    chunks in list order: pass it ``[model[c] for c in stage_order(groups)]``.
    """
    placement = groups.placement
    return sorted(range(placement.chunks_per_rank), key=lambda c: placement.role(groups.pp_rank, c).stage)


def _flat(chunk: torch.nn.Module, experts: Optional[bool] = None) -> torch.Tensor:
    """The chunk's parameters in one flat tensor: all, or only the dense ones (``experts``
    False) or the expert-parallel ones (True); a zero when there are none."""
    params = [p for p in unwrap_model(chunk).parameters() if experts is None or getattr(p, "allreduce", True) != experts]
    return torch.cat([p.detach().reshape(-1).float() for p in params]) if params else torch.zeros(1)


def max_replica_difference(chunks: Sequence[torch.nn.Module], groups: PipelineGroups) -> float:
    """Largest ``|difference|`` between any parameter and its copy on the lowest rank of its
    grad-sync group (other replicas and data-parallel copies; an expert-parallel parameter: of
    its expert grad-sync group), over this rank's chunks.

    Collective over all ranks; 0.0 means every replica on this rank is bit-identical to its
    reference copy.
    """
    worst = 0.0
    if groups.expert_stage_groups is None:
        kinds = [(None, groups.grad_sync_group)]
    else:
        kinds = [(False, groups.grad_sync_group), (True, groups.expert_grad_sync_group)]
    for c in stage_order(groups):
        for experts, group_of in kinds:
            group = group_of(c)
            mine = _flat(chunks[c], experts)
            reference = mine.clone()
            dist.broadcast(reference, src=dist.get_global_rank(group, 0), group=group)
            diff = (mine - reference).abs().max()
            dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
            worst = max(worst, diff.item())
    return worst
