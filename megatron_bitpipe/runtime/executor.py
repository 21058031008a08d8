"""Running one rank's part of a plan on megatron-core model chunks.

:class:`PlanExecutor` walks this rank's action list of a
:class:`~megatron_bitpipe.schedules.actions.SchedulePlan` — the same object the simulator
times — and for every action does what megatron-core's own schedules do for a micro-batch:

* ``F(c, m)``: take the input (the data for a first stage, a received activation, or the
  local V-turn hand-over), run megatron's ``forward_step`` on chunk ``c`` (the loss stage
  computes and records the loss), then hand the output on: ``isend`` to the next stage's
  rank, or keep it for the next chunk of this rank;
* ``B(c, m)``: take the output gradient (none at the loss stage), run megatron's
  ``backward_step``, hand the input gradient on the same way;
* split backward (:mod:`.weight_grad`): the ``F`` of a micro-batch whose backward the plan
  splits runs inside :func:`~.weight_grad.deferring`, so deferrable linears leave their
  weight gradients out of the graph; ``I(c, m)`` is ``B`` with those weight gradients
  collected (by (chunk, micro-batch)) instead of computed, and ``W(c, m)`` runs them. After
  ``I`` the activation state is released as after ``B``, except what the deferred work holds
  (each linear's input and output gradient) until ``W``. Transfers are keyed by
  :attr:`~megatron_bitpipe.schedules.actions.Action.comm_key`, so ``I`` receives and sends
  what ``B`` would;
* ``SYNC(c)``: start chunk ``c``'s asynchronous gradient all-reduce (megatron DDP's
  ``start_grad_sync``) — every backward of the chunk is done by then, and no deferred
  weight gradient still due adds to one of its parameters (a tied LM head on another chunk
  adds to the embedding chunk's weight: its ``W`` must come first; RuntimeError otherwise).

At the end of the step nothing may be left: no unconsumed received or handed-over tensor,
no activation kept for a backward, no deferred weight-gradient work.

Communication follows the placement (:mod:`megatron_bitpipe.schedules.comm`), one process
group per channel (:meth:`~megatron_bitpipe.runtime.groups.PipelineGroups.channel_group`).
Receives are posted just before the action that needs them, or with
``config.overlap_p2p_comm`` as soon as the previous action has been issued (as megatron's
interleaved schedule does: on a GPU host the previous action's kernels are still running,
so the receive overlaps them); within a channel they are posted in plan order, which the
validator proved equal to the sender's order. Sends are never waited for on the critical
path: a sent activation is only deallocated (``config.deallocate_pipeline_outputs``) once
its send has completed, and all sends are waited for at the end of the step.

Micro-batch data come from :class:`MicrobatchSource`: the ``m``-th item of the data iterator
is micro-batch ``m`` on every chunk of every rank, so each pipeline sees its own half of the
global batch and every item is read once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.schedules import (
    backward_step,
    check_first_val_step,
    deallocate_output_tensor,
    forward_step,
)
from megatron.core.utils import get_model_type

from ..schedules.actions import Action, ActionType, SchedulePlan
from ..schedules.comm import Payload, Transfer, received_by, sent_by
from .groups import PipelineGroups
from .layout import ChunkSpec, chunk_specs
from .weight_grad import WeightGradWork, deferring

__all__ = ["MicrobatchSource", "PlanExecutor"]


class MicrobatchSource:
    """The micro-batches of one step, read once from the caller's iterator and served by index.

    Invariant: micro-batch ``m`` is the ``m``-th item the data iterator yields in this step,
    whichever chunk asks for it. ``data_iterator`` may be one iterator, a list of per-chunk
    iterators in megatron's virtual-pipeline style (the first one that is not None is read;
    they all yield the same stream), or None on ranks that need no data.
    """

    def __init__(self, data_iterator, num_microbatches: int):
        if isinstance(data_iterator, (list, tuple)):
            data_iterator = next((it for it in data_iterator if it is not None), None)
        self._iterator = data_iterator
        self._num_microbatches = num_microbatches
        self._items: List[object] = []

    def iterator_for(self, microbatch: int) -> Optional[Iterator]:
        """A one-item iterator over micro-batch ``microbatch`` (None without a data stream)."""
        if self._iterator is None:
            return None
        while len(self._items) <= microbatch:
            self._items.append(next(self._iterator))
        return iter((self._items[microbatch],))

    def finish(self) -> None:
        """Consume the rest of the step's items, so the next step starts at its first one."""
        if self._iterator is not None:
            while len(self._items) < self._num_microbatches:
                self._items.append(next(self._iterator))


@dataclass
class _PendingSend:
    work: object
    tensor: torch.Tensor
    deallocate: bool


@dataclass
class _Activations:
    """Forward state of one (chunk, micro-batch) kept for its backward."""

    input: Optional[torch.Tensor]
    output: torch.Tensor


@dataclass
class StepResult:
    """What one executed step produced on this rank.

    Attributes:
        losses: the loss reports of this rank's loss chunks, by micro-batch (megatron's
            ``forward_data_store`` entries).
        num_tokens: tokens counted by the loss function (for per-token loss).
        trace: the actions executed, in order (``"F0.3"``, ``"S2"``, ...).
    """

    losses: Dict[int, object] = field(default_factory=dict)
    num_tokens: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int))
    trace: List[str] = field(default_factory=list)

    @property
    def loss_microbatches(self) -> List[int]:
        """The micro-batches whose loss this rank computed, ascending."""
        return sorted(self.losses)

    def loss_reports(self) -> List[object]:
        """The loss reports in micro-batch order: what megatron's schedules return."""
        return [self.losses[m] for m in self.loss_microbatches]


class PlanExecutor:
    """Runs this rank's actions of ``plan`` on ``chunks`` (index = local chunk id).

    Args:
        plan: the step's plan; its placement must be ``groups.placement``.
        chunks: this rank's model chunks (megatron DDP-wrapped for training).
        groups: process groups of the placement.
        config: the model config (``get_model_config`` of the chunks).
        tensor_shape: shape of every activation and gradient crossing ranks.
        forward_step_func: megatron-style ``forward_step_func(data_iterator, model)``.
        source: the step's micro-batches.
        loss_divisor: what each micro-batch loss is divided by — micro-batches per replica.
        eager_sync: start each chunk's gradient all-reduce at its ``SYNC``.
    """

    def __init__(
        self,
        plan: SchedulePlan,
        chunks: Sequence[torch.nn.Module],
        groups: PipelineGroups,
        config,
        tensor_shape: Sequence[int],
        *,
        forward_step_func: Callable,
        source: MicrobatchSource,
        loss_divisor: int,
        eager_sync: bool,
        collect_non_loss_data: bool = False,
        first_val_step: Optional[bool] = None,
    ):
        self.plan = plan
        self.chunks = list(chunks)
        self.groups = groups
        self.config = config
        self.tensor_shape = tuple(tensor_shape)
        self.forward_step_func = forward_step_func
        self.source = source
        self.loss_divisor = loss_divisor
        self.eager_sync = eager_sync
        self.collect_non_loss_data = collect_non_loss_data
        self.first_val_step = first_val_step
        self.rank = groups.pp_rank
        self.specs: List[ChunkSpec] = chunk_specs(plan.placement, config.num_layers, self.rank)
        actions = plan.actions[self.rank]
        self.forward_only = not any(a.type.computes_input_grad for a in actions)
        self._split = {(a.chunk, a.microbatch) for a in actions if a.type is ActionType.BACKWARD_INPUT}
        self.model_type = get_model_type(self.chunks[0])
        self.cp_size = groups.rank_pgs.cp.size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self._received: Dict[Action, Tuple[object, torch.Tensor]] = {}
        self._handed_over: Dict[Action, torch.Tensor] = {}
        self._sends: Dict[Tuple[ActionType, int, int], _PendingSend] = {}
        self._activations: Dict[Tuple[int, int], _Activations] = {}
        self._forwarded_chunks: set = set()
        self._deferred: Dict[Tuple[int, int], WeightGradWork] = {}

    # -- the step ---------------------------------------------------------------------------

    def run(self) -> StepResult:
        """Execute every action of this rank; return its losses, token count and trace."""
        result = StepResult()
        actions = self.plan.actions[self.rank]
        for index, action in enumerate(actions):
            self._post_receive(action)
            if action.type is ActionType.FORWARD:
                self._forward(action, result)
            elif action.type.computes_input_grad:
                self._backward(action)
            elif action.type is ActionType.BACKWARD_WEIGHT:
                self._deferred.pop((action.chunk, action.microbatch)).run()
            else:
                self._sync(action)
            if self.config.overlap_p2p_comm and index + 1 < len(actions):
                self._post_receive(actions[index + 1])
            result.trace.append(str(action))
            self._reap_sends(wait=False)
        self._reap_sends(wait=True)
        if self._received or self._handed_over or self._deferred or (self._activations and not self.forward_only):
            raise RuntimeError(
                f"rank {self.rank}: plan left unconsumed tensors: received {sorted(map(str, self._received))}, "
                f"handed over {sorted(map(str, self._handed_over))}, activations {sorted(self._activations)}, "
                f"deferred weight gradients {sorted(self._deferred)}"
            )
        self.source.finish()
        return result

    # -- actions ----------------------------------------------------------------------------

    def _forward(self, action: Action, result: StepResult) -> None:
        chunk, microbatch = action.chunk, action.microbatch
        spec = self.specs[chunk]
        input_tensor = self._take_input(action)
        first_of_chunk = chunk not in self._forwarded_chunks
        self._forwarded_chunks.add(chunk)
        store: List[object] = []
        with self._deferral(chunk, microbatch):
            output, num_tokens = forward_step(
                self.forward_step_func,
                self.source.iterator_for(microbatch),
                self.chunks[chunk],
                self.loss_divisor,
                input_tensor,
                store,
                self.config,
                self.cp_size,
                self.collect_non_loss_data,
                is_first_microbatch=check_first_val_step(self.first_val_step, self.forward_only, first_of_chunk),
                current_microbatch=microbatch,
                is_last_stage=spec.post_process,
            )
        if spec.post_process:
            result.num_tokens += num_tokens
            if store:
                result.losses[microbatch] = store[0]
        else:
            self._hand_on(action, output, output_of_forward=True)
        if not self.forward_only:
            self._activations[(chunk, microbatch)] = _Activations(input_tensor, output)

    def _backward(self, action: Action) -> None:
        chunk, microbatch = action.chunk, action.microbatch
        saved = self._activations.pop((chunk, microbatch))
        output_grad = self._take_input(action)
        pending = self._sends.pop((ActionType.FORWARD, chunk, microbatch), None)
        if pending is not None:  # the output must be sent (and deallocated) before its backward
            pending.work.wait()
            self._finish_send(pending)
        with self._deferral(chunk, microbatch):  # in I, recomputed forwards defer too
            input_grad = backward_step(saved.input, saved.output, output_grad, self.model_type, self.config)
        if not self.specs[chunk].pre_process:
            self._hand_on(action, input_grad, output_of_forward=False)

    def _deferral(self, chunk: int, microbatch: int):
        """The context of an ``F`` or ``I`` of (chunk, micro-batch): :func:`~.weight_grad.deferring`
        into the work its ``W`` will run if the plan splits its backward, else nothing."""
        if (chunk, microbatch) not in self._split:
            return contextlib.nullcontext()
        return deferring(self._deferred.setdefault((chunk, microbatch), WeightGradWork()))

    def _sync(self, action: Action) -> None:
        own = {id(p) for p in self.chunks[action.chunk].parameters()}
        for key, work in self._deferred.items():
            if any(id(w) in own for w in work.weights()):
                raise RuntimeError(
                    f"rank {self.rank}: plan runs {action} before W{key[0]}.{key[1]}, whose deferred weight "
                    f"gradients add to chunk {action.chunk}'s parameters (tied weights)"
                )
        if self.eager_sync:
            self.chunks[action.chunk].start_grad_sync()

    # -- tensors in and out -----------------------------------------------------------------

    def _post_receive(self, action: Action) -> None:
        """irecv the action's input if it comes from another rank and is not posted yet."""
        transfer = received_by(self.plan.placement, self.rank, action)
        if transfer is None or transfer.is_local or action in self._received:
            return
        activation = transfer.payload is Payload.ACTIVATION
        buffer = torch.empty(
            self.tensor_shape, dtype=self.config.pipeline_dtype, device=self.device, requires_grad=activation
        )
        work = dist.irecv(buffer, src=self.groups.pp_global_rank(transfer.src.rank), group=self.groups.channel_group(transfer))
        self._received[action] = (work, buffer)

    def _take_input(self, action: Action) -> Optional[torch.Tensor]:
        transfer = received_by(self.plan.placement, self.rank, action)
        if transfer is None:
            return None
        if transfer.is_local:
            return self._handed_over.pop(action.comm_key)
        work, buffer = self._received.pop(action)
        work.wait()
        return buffer

    def _hand_on(self, action: Action, tensor: torch.Tensor, output_of_forward: bool) -> None:
        """Send ``tensor`` to the consumer of ``action``'s output, or hand it over locally."""
        transfer: Transfer = sent_by(self.plan.placement, self.rank, action)
        deallocate = output_of_forward and self.config.deallocate_pipeline_outputs and not self.forward_only
        if transfer.is_local:
            handed = tensor.detach()
            if output_of_forward:
                handed.requires_grad_()
            self._handed_over[transfer.consumer] = handed
            if deallocate:
                deallocate_output_tensor(tensor, True)
            return
        work = dist.isend(tensor, dst=self.groups.pp_global_rank(transfer.dst.rank), group=self.groups.channel_group(transfer))
        self._sends[(action.type, action.chunk, action.microbatch)] = _PendingSend(work, tensor, deallocate)

    def _reap_sends(self, wait: bool) -> None:
        for key in list(self._sends):
            pending = self._sends[key]
            if wait:
                pending.work.wait()
            elif not pending.work.is_completed():
                continue
            self._finish_send(self._sends.pop(key))

    @staticmethod
    def _finish_send(pending: _PendingSend) -> None:
        # Only now may the sent activation's storage go: gloo may still read it before completion.
        if pending.deallocate:
            deallocate_output_tensor(pending.tensor, True)


def no_sync_all(chunks: Sequence[torch.nn.Module]):
    """Context keeping every chunk's DDP from reducing on its own while backwards run.

    Chunks' backwards interleave, so lifting ``no_sync`` for one chunk would let another
    chunk's buckets fire early; reductions are started explicitly at ``SYNC`` instead.
    """
    stack = contextlib.ExitStack()
    for chunk in chunks:
        if hasattr(chunk, "no_sync"):
            stack.enter_context(chunk.no_sync())
    return stack
