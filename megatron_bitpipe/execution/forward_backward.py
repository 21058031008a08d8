"""megatron-core ``forward_backward_func`` implementations that execute plans.

:func:`make_step_func` runs one step of a :class:`~megatron_bitpipe.schedules.ScheduleChoice`
and returns what it produced (:class:`~.executor.StepResult`). The functions with
megatron-core's keyword signature and return value — :func:`make_forward_backward_func`,
:func:`forward_backward_bitpipe` — are thin wrappers over it (the loss reports of the
micro-batches whose loss this rank computes, in micro-batch order; ``[]`` elsewhere), so
Megatron-LM's training loop and evaluation call them like megatron's own schedules. The model chunks must come from
:func:`megatron_bitpipe.model.chunks.build_chunks` (GPT or BERT), which records their
:class:`~megatron_bitpipe.execution.groups.PipelineGroups` (``chunk.pipeline_groups``):
placement, p2p channels and gradient-sync groups.

One step:

1. the plan for ``(D, num_microbatches)`` is generated, with its sends and receives as
   actions (pure Python, identical on every rank), and validated, once per N (the step
   function's :class:`PlanCache`: a batch-size ramp's steps run different N) — bad arguments raise
   :class:`~megatron_bitpipe.schedules.ScheduleConfigError` naming the flag before any
   communication; with ``overlap_param_gather`` every chunk whose parameter all-gather its
   optimizer step did not start gets it started, in stage order (:func:`start_param_gathers`);
2. with every chunk's DDP in ``no_sync``, :class:`~.executor.PlanExecutor` runs the
   plan; each chunk's gradient all-reduce (over its replicas x data parallel) starts
   asynchronously at its ``SYNC``, as soon as its last backward is done;
3. the gradients are finalised: megatron's ``finalize_model_grads`` (or
   ``config.finalize_model_grads_func``) waits for the all-reduces, chunks in stage order,
   and handles sequence-parallel norms (with Optimus 2D it then sums the column-replicated
   gradients over the mesh column, :mod:`megatron_bitpipe.optimus.grads`); with
   ``calculate_per_token_loss`` the token count is summed over every loss rank and
   data-parallel rank and the gradients divided by it.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from .. import schedules
from ..optimus.grads import finalize_model_grads_func
from ..schedules.actions import SchedulePlan
from .executor import MicrobatchSource, PlanExecutor, StepResult, no_sync_all
from .groups import PipelineGroups
from .replicas import ChunkDistributedDataParallel, microbatches_per_replica, stage_order
from .weight_grad import enable_split_backward

__all__ = [
    "forward_backward_bitpipe",
    "make_forward_backward_func",
    "make_step_func",
    "PlanCache",
    "pipeline_groups_of",
    "finish_param_gathers",
    "plan_forward_backward_func",
    "start_param_gathers",
]


class PlanCache:
    """The plans of one schedule choice, each generated and validated once: one per (ranks,
    micro-batches per data-parallel rank N, forward-only), so a batch-size ramp, whose steps run
    different N, and evaluation (forward-only) each get their own. Owned by the step function
    that runs them (:func:`make_step_func`); pure Python, identical on every rank."""

    def __init__(self, choice: schedules.ScheduleChoice):
        self.choice = choice
        self._plans: Dict[Tuple[int, int, bool], SchedulePlan] = {}

    def plan(self, num_ranks: int, num_microbatches: int, forward_only: bool) -> SchedulePlan:
        """The validated plan (:class:`~megatron_bitpipe.schedules.ScheduleConfigError` naming
        the rule N breaks, before any communication)."""
        key = (num_ranks, num_microbatches, forward_only)
        if key not in self._plans:
            plan = self.choice.plan(num_ranks, num_microbatches, forward_only)
            schedules.validate_plan(plan)
            self._plans[key] = plan
        return self._plans[key]

    def __len__(self) -> int:
        return len(self._plans)


def pipeline_groups_of(model: List[torch.nn.Module]) -> PipelineGroups:
    """The PipelineGroups recorded on chunks built by ``build_chunks`` (through wrappers).

    ValueError naming ``build_chunks`` for chunks without them: megatron's
    ``get_attr_wrapped_model`` raises a RuntimeError when no wrapper level has the attribute
    (its ``allow_none`` only admits an attribute set to ``None``), which is translated here.
    """
    try:
        groups = get_attr_wrapped_model(model[0], "pipeline_groups")
    except RuntimeError:
        groups = None
    if groups is None:
        raise ValueError(
            "model chunks carry no pipeline_groups: build them with megatron_bitpipe.model.chunks.build_chunks "
            "(build_gpt_chunks, build_bert_chunks)"
        )
    return groups


def make_step_func(choice: schedules.ScheduleChoice) -> Callable[..., StepResult]:
    """One training (or forward-only) step of ``choice``'s plans on the chunks: takes
    megatron-core's forward_backward keyword arguments and returns the
    :class:`~.executor.StepResult` (loss reports by micro-batch, token count, trace).

    With ``choice.split_backward`` every backward runs as ``I`` (input gradient) and, later,
    ``W`` (weight gradients), the plan placing the ``W``'s into bubbles for ``choice.costs``;
    the chunks' linears are put under megatron-core's ``delay_wgrad_compute`` contract on the first call
    with each chunk (:func:`~.weight_grad.enable_split_backward`, which raises for TE layers built without it and
    Optimus 2D layers). Same gradients as without. The schedules that always split their
    backwards (the generators with ``always_split``: ZB-H1, ZB-V, DualPipe,
    DualPipeV) do so too (``choice.splits_backward``).

    Communication uses the chunks' own :class:`~.groups.PipelineGroups` (channel groups created
    and warmed up with the model, see :mod:`.executor`'s rules): megatron's
    ``p2p_communicator`` (one ring of one group, fixed neighbours) cannot carry two pipelines
    and a V, so it and ``pg_collection`` are accepted for the signature and not used.
    """
    split_enabled: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
    plans = PlanCache(choice)

    def step(
        *,
        forward_step_func,
        data_iterator: Union[Iterator, List[Iterator], None],
        model: Union[torch.nn.Module, List[torch.nn.Module]],
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: Optional[int] = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: Optional[bool] = None,
        adjust_tensor_shapes_fn: Optional[Callable] = None,
        p2p_communicator=None,
        pg_collection=None,
        force_all_reduce: bool = False,
    ) -> StepResult:
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        groups = pipeline_groups_of(chunks)
        config = get_model_config(chunks[0])
        placement = groups.placement
        _check_supported(choice.schedule, chunks, placement, config, seq_length, decoder_seq_length)
        if choice.splits_backward and not all(c in split_enabled for c in chunks):
            enable_split_backward(chunks)
            split_enabled.update(chunks)
        plan = plans.plan(placement.num_ranks, num_microbatches, forward_only)
        if plan.placement != placement:
            raise ValueError(f"{choice.schedule} plans use the {plan.placement.name} placement; the chunks were built for {placement.name}")
        start_param_gathers(chunks, groups)
        microbatches_per_replica(num_microbatches, placement)  # an even split, or ValueError
        eager = all(getattr(getattr(c, "ddp_config", None), "overlap_grad_reduce", False) for c in chunks)
        executor = PlanExecutor(
            plan,
            chunks,
            groups,
            config,
            p2p_tensor_shape(config, seq_length, micro_batch_size, groups, adjust_tensor_shapes_fn),
            forward_step_func=forward_step_func,
            source=MicrobatchSource(data_iterator, num_microbatches),
            loss_divisor=num_microbatches,
            eager_sync=eager and not forward_only,
            collect_non_loss_data=collect_non_loss_data,
            first_val_step=first_val_step,
        )
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        if forward_only:
            result = executor.run()
        else:
            with no_sync_all(chunks):
                result = executor.run()
            finalize_grads(chunks, groups, config, result.num_tokens, force_all_reduce)
        if config.timers is not None:
            config.timers("forward-backward").stop()
        return result

    step.plans = plans
    return step


def make_forward_backward_func(choice: schedules.ScheduleChoice) -> Callable:
    """A megatron-core forward_backward_func executing ``choice``'s plans: a thin wrapper over
    :func:`make_step_func` returning the loss reports of this rank's loss chunks in
    micro-batch order (``[]`` on ranks without a loss chunk), as megatron's schedules do."""
    step = make_step_func(choice)

    def forward_backward(**kwargs) -> list:
        return step(**kwargs).loss_reports()

    forward_backward.__name__ = "forward_backward_" + choice.label.replace("+", "_").replace("-", "_")
    forward_backward.__qualname__ = forward_backward.__name__
    forward_backward.__doc__ = f"megatron-core forward_backward_func running the {choice.label} schedule."
    return forward_backward


@functools.lru_cache(maxsize=None)
def plan_forward_backward_func(schedule: str) -> Callable:
    """The forward_backward_func of a plan-executed ``schedule`` (its plain variant: no
    split backward), one per schedule name."""
    return make_forward_backward_func(schedules.ScheduleChoice(schedule))


forward_backward_bitpipe = plan_forward_backward_func("bitpipe")


def start_param_gathers(chunks, groups: PipelineGroups) -> None:
    """Start, in stage order, the overlapped parameter all-gather of every chunk whose
    optimizer step has not (the first iteration, a skipped step; see
    :attr:`~.replicas.ChunkDistributedDataParallel.overlaps_param_gather`), so no forward
    pre-hook ever starts one. Where the steps started them, nothing happens."""
    for c in stage_order(groups):
        if isinstance(chunks[c], ChunkDistributedDataParallel):
            chunks[c].dispatch_param_gather()


def finish_param_gathers(chunks) -> None:
    """Wait for every overlapped parameter all-gather of ``chunks`` still in flight, so their
    weights can be read outside a forward (a checkpoint); no communication of its own."""
    for chunk in chunks:
        if isinstance(chunk, ChunkDistributedDataParallel):
            chunk.finish_param_gather()


def _check_supported(schedule, chunks, placement, config, seq_length, decoder_seq_length) -> None:
    for chunk in chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if getattr(ddp_config, "overlap_param_gather", False) and not isinstance(chunk, ChunkDistributedDataParallel):
            raise ValueError(
                f"{schedule}: overlap_param_gather needs each chunk wrapped by megatron_bitpipe's wrap_ddp "
                f"(ChunkDistributedDataParallel), not {type(chunk).__name__}: megatron's DDP would start the gathers "
                "from forward pre-hooks, in plan order, which differs between the ranks of a grad-sync group"
            )
    if len(chunks) != placement.chunks_per_rank:
        raise ValueError(f"{schedule} runs {placement.chunks_per_rank} model chunks per rank, got {len(chunks)}")
    if decoder_seq_length is not None and decoder_seq_length != seq_length:
        raise ValueError(f"{schedule} does not support a decoder sequence length different from --seq-length")
    if getattr(config, "variable_seq_lengths", False):
        raise ValueError(f"{schedule} needs fixed sequence lengths (variable_seq_lengths is set)")


def p2p_tensor_shape(config, seq_length, micro_batch_size, groups: PipelineGroups, adjust_tensor_shapes_fn=None):
    """Shape of every activation and gradient crossing pipeline ranks.

    megatron-core's ``[s / cp (/ tp with sequence parallelism), micro-batch, hidden]``; with an
    Optimus mesh (``groups.mesh``) the ``[s, b/q, h/q]`` block every mesh position holds.
    ``adjust_tensor_shapes_fn`` follows megatron's contract: it receives megatron's shape and
    its answer is used. In Optimus mode that answer must be the block shape (e.g. from
    :func:`megatron_bitpipe.optimus.optimus_p2p_tensor_shapes`, which is then redundant).
    ValueError naming ``--micro-batch-size`` if the mesh side does not divide it.
    """
    seq = seq_length // groups.rank_pgs.cp.size()
    if config.sequence_parallel:
        seq //= groups.grid.tp
    shape = [seq, micro_batch_size, config.hidden_size]
    derived = shape
    if groups.mesh is not None:
        side = groups.mesh.side
        if micro_batch_size % side:
            raise ValueError(
                f"--micro-batch-size {micro_batch_size} must be divisible by the Optimus mesh side q={side}"
            )
        derived = [seq, micro_batch_size // side, config.hidden_size // side]
    if adjust_tensor_shapes_fn is None:
        return derived
    recv, send = adjust_tensor_shapes_fn([shape], [shape])
    if recv != send or len(recv) != 1:
        raise ValueError("adjust_tensor_shapes_fn must give one shape, equal for sends and receives")
    adjusted = list(recv[0])
    if groups.mesh is not None and adjusted != derived:
        raise ValueError(f"adjust_tensor_shapes_fn gives {adjusted}; Optimus 2D pipeline stages exchange {derived}")
    return adjusted


def finalize_grads(chunks, groups: PipelineGroups, config, num_tokens: torch.Tensor, force_all_reduce: bool = False) -> None:
    """Wait for (or run) every chunk's gradient all-reduce and finish the gradients.

    Chunks go to the finaliser in stage order: blocking reductions (DDP without
    ``overlap_grad_reduce``) over the per-stage groups are then issued in the same order on
    every rank. Per-token loss: the token count of every loss rank and data- and
    context-parallel rank is summed (the loss ranks of a V placement are not megatron's last pipeline stage) and every
    gradient divided by it.
    """
    ordered = [chunks[c] for c in stage_order(groups)]
    finalize = config.finalize_model_grads_func or finalize_model_grads_func(groups.mesh)
    finalize(ordered, None, pg_collection=groups.rank_pgs, force_all_reduce=force_all_reduce)
    if config.calculate_per_token_loss:
        total = num_tokens.to(dtype=torch.float64)
        dist.all_reduce(total, group=groups.pp)
        dist.all_reduce(total, group=groups.rank_pgs.dp_cp)
        scale = 1.0 / max(total.item(), 1.0)
        for chunk in chunks:
            chunk.scale_gradients(scale)
