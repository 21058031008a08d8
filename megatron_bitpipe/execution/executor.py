"""Running one rank's part of a plan on megatron-core model chunks.

:class:`PlanExecutor` walks this rank's action list of a
:class:`~megatron_bitpipe.schedules.actions.SchedulePlan` — the same object the simulator
times — and for every action does what megatron-core's own schedules do for a micro-batch:

* ``RECV_F(c, m)`` / ``RECV_B(c, m)``: post the ``irecv`` of the input of ``F(c, m)`` /
  the output gradient of ``B(c, m)`` (or ``I(c, m)``) on the channel's group, into a new
  buffer; the consuming action waits for it;
* ``F(c, m)``: take the input (the data for a first stage, the received activation, or the
  local V-turn hand-over), run megatron's ``forward_step`` on chunk ``c`` (the loss stage
  computes and records the loss), then hand the output on: keep it for its ``SEND_F``, or
  for the next chunk of this rank at the turn of a V;
* ``B(c, m)``: take the output gradient (none at the loss stage), run megatron's
  ``backward_step``, hand the input gradient on the same way;
* ``SEND_F(c, m)`` / ``SEND_B(c, m)``: ``isend`` the kept output of ``F(c, m)`` / input
  gradient of ``B(c, m)`` (or ``I(c, m)``) to the next / previous stage's rank;
* ``OVERLAP_F_B`` (an ``F`` and a ``B`` or ``I`` of other micro-batches, DualPipe's overlapped
  pair): wait for the forward half's input, then the backward half's, then run the forward
  and the backward; the plan's sends of both outputs follow it, as DualPipe's
  ``_forward_backward_chunk`` issues them. The halves run one after the other (DualPipe's
  ``overlapped_forward_backward`` module hook, which interleaves the two halves' kernels, has no
  counterpart here), so a pair costs ``F + B``;
* split backward (:mod:`.weight_grad`, megatron-core's ``delay_wgrad_compute`` contract):
  on a chunk whose linears defer, every backward queues its weight-gradient work in each
  linear's FIFO. ``I(c, m)`` is that backward; ``W(c, m)`` is chunk ``c``'s
  :meth:`~.weight_grad.ChunkWeightGrad.backward_dw`, which runs the oldest queued
  micro-batch — ``m``, since each chunk's ``W``'s follow its ``I``'s order (the validator
  proves it; RuntimeError here otherwise). A whole ``B`` on such a chunk runs its
  ``backward_dw`` at once. After ``I`` the activation state is released as after ``B``,
  except what the queued work holds (each linear's input and output gradient) until ``W``.
  ``I`` receives and sends what ``B`` would (``RECV_B`` / ``SEND_B``);
* ``SYNC(c)``: start chunk ``c``'s asynchronous gradient all-reduce (megatron DDP's
  ``start_grad_sync``) — every backward of the chunk is done by then, and no deferred
  weight gradient still due adds to one of its parameters (a tied LM head on another chunk
  adds to the embedding chunk's weight: its ``W`` must come first; RuntimeError otherwise).

At the end of the step nothing may be left: no unconsumed received or handed-over tensor,
no unsent output, no activation kept for a backward, no ``W`` still due and no weight work
in any module's FIFO (the step would drop those gradients).

The executor decides nothing about communication: it runs the plan's ``SEND`` and ``RECV``
actions where the plan puts them (:mod:`megatron_bitpipe.schedules.lower` places them; the
validator proved that every message is sent after its producer and received before its
consumer, and that each channel's receives are posted in its sends' order). The placement
only says which chunks of this rank hand over locally. Sends are never waited for on the
critical path: a sent activation is only deallocated (``config.deallocate_pipeline_outputs``)
once its send has completed, and all sends are waited for at the end of the step.

**Communication rules (NCCL-safe by construction).** NCCL does not buffer: a send completes
only once its receive is posted, one communicator runs a rank's operations in issue order,
and creating a communicator blocks until every member arrives. So:

1. each message travels on its channel's process group
   (:meth:`~megatron_bitpipe.execution.groups.PipelineGroups.channel_group`, keyed by
   :func:`~megatron_bitpipe.schedules.comm.channel_group_key`): in one group a rank only sends
   to one neighbour or only receives from one, and messages are matched in plan order, which
   the validator checks per channel;
2. every operation is issued as a ``batch_isend_irecv`` of its own, so NCCL runs it on the
   group's communicator — never on a two-rank communicator torch would create for an
   unbatched send or receive on first use, inside the step, as a blocking rendezvous;
3. every communicator a step uses (channel groups and stage groups) is created and warmed up
   at set-up, in one global order, by :meth:`~.groups.PipelineGroups.build`; with NCCL the
   scripts also pass ``device_id`` for eager initialisation;
4. ranks wait only where the plan's data flow makes them: a compute action for the receive of
   its input (an overlapped pair for both halves' before computing either), a backward for the
   send of its forward's output, the end of the step for all sends.

:func:`megatron_bitpipe.schedules.nccl.check_nccl` executes a lowered plan under exactly these
rules (its :data:`~megatron_bitpipe.schedules.nccl.RUNTIME_RULES`) and proves each generator's
plans deadlock-free; the unbatched, lazily created pattern this replaces deadlocks BitPipe
there (and did on a GPU). ``MEGATRON_BITPIPE_STRICT_P2P=1`` makes gloo follow NCCL's rules in
CPU runs.

Micro-batch data come from :class:`MicrobatchSource`: the ``m``-th item of the data iterator
is micro-batch ``m`` on every chunk of every rank, so each pipeline sees its own half of the
global batch and every item is read once.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.schedules import check_first_val_step, deallocate_output_tensor, forward_step

from ..megatron_compat import backward_step
from ..schedules.actions import Action, ActionType, SchedulePlan
from ..schedules.comm import Payload, transfer_of
from .groups import PipelineGroups
from .weight_grad import ChunkWeightGrad

__all__ = ["MicrobatchSource", "PlanExecutor"]


class MicrobatchSource:
    """The micro-batches of one step, read once from the caller's iterator and served by index.

    Invariant: micro-batch ``m`` is the ``m``-th item the data iterator yields in this step,
    whichever chunk asks for it. ``data_iterator`` may be one iterator, a list of per-chunk
    iterators in megatron's virtual-pipeline style (the first one that is not None is read;
    they all yield the same stream), or None on ranks that need no data.

    A micro-batch that is a dict is served as a new dict each time (the same tensors): a
    forward step may replace its entries, as megatron-core 0.19's ``get_batch_on_this_cp_rank``
    does with this rank's cut of each tensor, and a rank that embeds a micro-batch and computes
    its loss (BitPipe's edge ranks) reads it twice.
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
        item = self._items[microbatch]
        return iter((dict(item) if isinstance(item, dict) else item,))

    def finish(self) -> None:
        """Consume the rest of the step's items, so the next step starts at its first one."""
        if self._iterator is not None:
            while len(self._items) < self._num_microbatches:
                self._items.append(next(self._iterator))


@dataclass
class _Outgoing:
    """A tensor produced for another rank, kept until its ``SEND`` and, once sent, until the
    send completed (``work``). ``deallocate``: free its storage then (a forward's output)."""

    tensor: torch.Tensor
    deallocate: bool
    work: object = None


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
        num_tokens: tokens counted by the loss function (for per-token loss), on the
            executor's device (where megatron's ``forward_step`` counts them).
        trace: the actions executed, in order (``"RECV_F0.3"``, ``"F0.3"``, ``"S2"``, ...).
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
        loss_divisor: what each micro-batch loss is divided by — the step's micro-batches, as in
            megatron's schedules (:mod:`.replicas` sums the replicas' gradients).
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
        placement = plan.placement
        roles = [placement.role(self.rank, c) for c in range(placement.chunks_per_rank)]
        # Whether each local chunk is its pipeline's first stage (embedding) / last stage (loss).
        self._first_stage = [role.stage == 0 for role in roles]
        self._last_stage = [role.stage == placement.num_stages - 1 for role in roles]
        actions = [part for action in plan.actions[self.rank] for part in action.parts]
        self.forward_only = not any(a.type.computes_input_grad for a in actions)
        self.cp_size = groups.rank_pgs.cp.size()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self._links = [plan.placement.links(self.rank, c) for c in range(plan.placement.chunks_per_rank)]
        self._received: Dict[Action, Tuple[object, torch.Tensor]] = {}  # consumer's comm_key -> irecv
        self._handed_over: Dict[Action, torch.Tensor] = {}
        self._unsent: Dict[Action, _Outgoing] = {}  # producer's comm_key -> output waiting for its SEND
        self._sends: Dict[Action, _Outgoing] = {}  # SEND action -> send in flight
        self._activations: Dict[Tuple[int, int], _Activations] = {}
        self._forwarded_chunks: set = set()
        self._weight_grads = [ChunkWeightGrad(chunk) for chunk in self.chunks]
        self._weight_due: Dict[int, Deque[int]] = defaultdict(deque)  # chunk -> micro-batches of its I's, W not run

    # -- the step ---------------------------------------------------------------------------

    def run(self) -> StepResult:
        """Execute every action of this rank; return its losses, token count and trace."""
        result = StepResult(num_tokens=torch.zeros((), dtype=torch.int, device=self.device))
        for action in self.plan.actions[self.rank]:
            if action.type is ActionType.FORWARD:
                self._forward(action, self._take_input(action), result)
            elif action.type.computes_input_grad:
                self._backward(action, self._take_input(action))
            elif action.type is ActionType.OVERLAP_F_B:
                self._overlapped(action, result)
            elif action.type is ActionType.BACKWARD_WEIGHT:
                self._weight_grad(action)
            elif action.type is ActionType.SYNC:
                self._sync(action)
            elif action.type.is_receive:
                self._post_receive(action)
            else:
                self._send(action)
            result.trace.append(str(action))
            self._reap_sends(wait=False)
        self._reap_sends(wait=True)
        due = {c: list(mbs) for c, mbs in self._weight_due.items() if mbs}
        queued = {c: w.pending() for c, w in enumerate(self._weight_grads) if w.pending()}
        leftover = self._received or self._handed_over or self._unsent or due or queued
        if leftover or (self._activations and not self.forward_only):
            raise RuntimeError(
                f"rank {self.rank}: plan left unconsumed tensors: received {sorted(map(str, self._received))}, "
                f"handed over {sorted(map(str, self._handed_over))}, unsent {sorted(map(str, self._unsent))}, "
                f"activations {sorted(self._activations)}, W due by chunk {due}, "
                f"weight-gradient work queued by chunk {queued}"
            )
        self.source.finish()
        return result

    # -- actions ----------------------------------------------------------------------------

    def _forward(self, action: Action, input_tensor: Optional[torch.Tensor], result: StepResult) -> None:
        chunk, microbatch = action.chunk, action.microbatch
        last_stage = self._last_stage[chunk]
        first_of_chunk = chunk not in self._forwarded_chunks
        self._forwarded_chunks.add(chunk)
        store: List[object] = []
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
            is_last_stage=last_stage,
        )
        if last_stage:
            result.num_tokens += num_tokens
            if store:
                result.losses[microbatch] = store[0]
        else:
            self._hand_on(action, output, output_of_forward=True)
        if not self.forward_only:
            self._activations[(chunk, microbatch)] = _Activations(input_tensor, output)

    def _backward(self, action: Action, output_grad: Optional[torch.Tensor]) -> None:
        chunk, microbatch = action.chunk, action.microbatch
        saved = self._activations.pop((chunk, microbatch))
        forward = Action(ActionType.FORWARD, chunk, microbatch)
        if forward in self._unsent:
            raise RuntimeError(f"rank {self.rank}: plan runs {action} before sending the output of {forward}")
        pending = self._sends.pop(Action(ActionType.SEND_ACTIVATION, chunk, microbatch), None)
        if pending is not None:  # the output must be sent (and deallocated) before its backward
            pending.work.wait()
            self._finish_send(pending)
        input_grad = backward_step(saved.input, saved.output, output_grad, self.config)
        if action.type is ActionType.BACKWARD_INPUT:
            self._weight_due[chunk].append(microbatch)
        elif self._weight_grads[chunk].defers:  # a whole B: its weight gradients now
            self._weight_grads[chunk].backward_dw()
        if not self._first_stage[chunk]:
            self._hand_on(action, input_grad, output_of_forward=False)

    def _weight_grad(self, action: Action) -> None:
        """``W(c, m)``: chunk ``c``'s ``backward_dw()``, which runs its oldest queued micro-batch."""
        due = self._weight_due[action.chunk]
        if not due or due[0] != action.microbatch:
            raise RuntimeError(
                f"rank {self.rank}: plan runs {action} but chunk {action.chunk}'s weight-gradient FIFO holds "
                f"micro-batches {list(due)} (W's must follow the I's order)"
            )
        due.popleft()
        self._weight_grads[action.chunk].backward_dw()

    def _overlapped(self, action: Action, result: StepResult) -> None:
        """``OVERLAP_F_B``: both halves' inputs (the forward's, then the backward's), then both halves."""
        forward, backward = action.parts
        inputs = [self._take_input(forward), self._take_input(backward)]
        self._forward(forward, inputs[0], result)
        self._backward(backward, inputs[1])

    def _sync(self, action: Action) -> None:
        own = {id(p) for p in self.chunks[action.chunk].parameters()}
        for chunk, due in self._weight_due.items():
            if due and any(id(p) in own for p in self._weight_grads[chunk].pending_parameters()):
                raise RuntimeError(
                    f"rank {self.rank}: plan runs {action} before W{chunk}.{due[0]}, whose deferred weight "
                    f"gradients add to chunk {action.chunk}'s parameters (its own, or tied weights)"
                )
        if self.eager_sync:
            self.chunks[action.chunk].start_grad_sync()

    # -- tensors in and out -----------------------------------------------------------------

    def _post_receive(self, action: Action) -> None:
        """``RECV_F`` / ``RECV_B``: irecv the consumer's input into a new buffer."""
        transfer = transfer_of(self.plan.placement, self.rank, action)
        if transfer.consumer in self._received:
            raise RuntimeError(f"rank {self.rank}: plan posts {action} twice")
        activation = transfer.payload is Payload.ACTIVATION
        buffer = torch.empty(
            self.tensor_shape, dtype=self.config.pipeline_dtype, device=self.device, requires_grad=activation
        )
        work = _issue(dist.irecv, buffer, self.groups.pp_global_rank(transfer.src.rank), self.groups.channel_group(transfer))
        self._received[transfer.consumer] = (work, buffer)

    def _send(self, action: Action) -> None:
        """``SEND_F`` / ``SEND_B``: isend the producer's kept tensor; it is released when the send completed."""
        transfer = transfer_of(self.plan.placement, self.rank, action)
        outgoing = self._unsent.pop(action.compute_key, None)
        if outgoing is None:
            raise RuntimeError(f"rank {self.rank}: plan runs {action} before {transfer.producer} produced the tensor")
        outgoing.work = _issue(
            dist.isend, outgoing.tensor, self.groups.pp_global_rank(transfer.dst.rank), self.groups.channel_group(transfer)
        )
        self._sends[action] = outgoing

    def _take_input(self, action: Action) -> Optional[torch.Tensor]:
        """The input of an ``F`` (activation) or ``B`` / ``I`` (output gradient): None at a
        pipeline's end, the local hand-over at a V's turn, else the posted receive, waited for."""
        links = self._links[action.chunk]
        source = links.previous if action.type is ActionType.FORWARD else links.next
        if source is None:
            return None
        if source.rank == self.rank:
            return self._handed_over.pop(action.comm_key)
        posted = self._received.pop(action.comm_key, None)
        if posted is None:
            raise RuntimeError(
                f"rank {self.rank}: plan runs {action} without posting the receive of its input first "
                "(a compute-only plan? run plans of megatron_bitpipe.schedules.generate or lower())"
            )
        work, buffer = posted
        work.wait()
        return buffer

    def _hand_on(self, action: Action, tensor: torch.Tensor, output_of_forward: bool) -> None:
        """Keep ``tensor`` for the ``SEND`` of ``action``, or hand it over to the next chunk of
        this rank (the turn of a V)."""
        links = self._links[action.chunk]
        target = links.next if output_of_forward else links.previous
        deallocate = output_of_forward and self.config.deallocate_pipeline_outputs and not self.forward_only
        if target.rank != self.rank:
            self._unsent[action.comm_key] = _Outgoing(tensor, deallocate)
            return
        handed = tensor.detach()
        if output_of_forward:
            handed.requires_grad_()
        consumer = Action(ActionType.FORWARD if output_of_forward else ActionType.BACKWARD, target.chunk, action.microbatch)
        self._handed_over[consumer] = handed
        if deallocate:
            deallocate_output_tensor(tensor, True)

    def _reap_sends(self, wait: bool) -> None:
        for key in list(self._sends):
            pending = self._sends[key]
            if wait:
                pending.work.wait()
            elif not pending.work.is_completed():
                continue
            self._finish_send(self._sends.pop(key))

    @staticmethod
    def _finish_send(pending: _Outgoing) -> None:
        # Only now may the sent activation's storage go: gloo may still read it before completion.
        if pending.deallocate:
            deallocate_output_tensor(pending.tensor, True)


def _issue(op: Callable, tensor: torch.Tensor, peer: int, group: dist.ProcessGroup):
    """Issue one p2p operation as a ``batch_isend_irecv`` of its own: on NCCL a batched
    operation runs on the group's own communicator (created and warmed up at set-up by
    :meth:`~.groups.PipelineGroups.build`), never on a pair communicator created on first use
    inside the step; on gloo it is the plain operation. Returns its work handle."""
    return dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group)])[0]


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
