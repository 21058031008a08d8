"""Checks that a plan is executable, with errors that name rank, action and dependency.

:func:`validate_plan` runs four checks:

1. structure — every rank runs ``F`` exactly once for each (chunk, micro-batch) its
   chunks own and, for training plans, a backward after it: one ``B``, or one ``I``
   and a later ``W``; each chunk issues one ``SYNC`` after its last ``B`` or ``W``;
   micro-batches only visit chunks of their pipeline; each chunk runs its ``W``'s in the
   micro-batch order of its ``I``'s (deferred weight-gradient work is a FIFO per module, as
   Transformer Engine's ``delay_wgrad_compute`` queue, whose ``backward_dw()`` runs the oldest);
   an overlapped pair ``OVERLAP_F_B`` counts as its forward and backward halves, both at the
   pair's position, so a half's own prerequisites (the backward half's forward) run earlier;
2. channels — on every channel (payload, pipeline, src rank, dst rank) the receiver
   consumes messages in the order the sender produces them;
3. progress — executing the plan with the simulator's dependency rules reaches the end
   (no rank waits forever);
4. NCCL — executing it under NCCL's rules, communication issued as the runtime issues it
   (:func:`~.nccl.check_nccl` with :data:`~.nccl.RUNTIME_RULES`: no send completes before its
   receive is posted, one communicator's operations in issue order), also reaches the end.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Tuple

from .actions import Action, ActionType, SchedulePlan
from .comm import Transfer, receive_action, received_by, send_action, sent_by, transfer_of
from .errors import PlanError
from .lower import lower
from .nccl import check_nccl
from .costs import CostModel
from .simulate import simulate


def is_training_plan(plan: SchedulePlan) -> bool:
    """True if the plan runs backwards (False for forward-only / evaluation plans)."""
    return any(a.type.computes_input_grad for _, a in plan)


def check_structure(plan: SchedulePlan) -> None:
    placement = plan.placement
    if len(plan.actions) != placement.num_ranks:
        raise PlanError(f"plan has {len(plan.actions)} action lists for {placement.num_ranks} ranks")
    if len(plan.microbatch_pipeline) != plan.num_microbatches:
        raise PlanError(
            f"microbatch_pipeline has {len(plan.microbatch_pipeline)} entries for {plan.num_microbatches} micro-batches"
        )
    for m, p in enumerate(plan.microbatch_pipeline):
        if not 0 <= p < placement.num_pipelines:
            raise PlanError(f"micro-batch {m} routed to pipeline {p}, placement has {placement.num_pipelines}")
    training = is_training_plan(plan)
    for rank, entries in enumerate(plan.actions):
        position: Dict[Action, int] = {}  # every action of the rank (pairs' halves), communication included
        actions = [(index, part) for index, entry in enumerate(entries) for part in entry.parts]
        for index, action in actions:
            where = f"rank {rank}, action {action} (position {index})"
            if not 0 <= action.chunk < placement.chunks_per_rank:
                raise PlanError(f"{where}: rank has chunks 0..{placement.chunks_per_rank - 1}")
            if action in position:
                raise PlanError(f"{where}: repeats position {position[action]}")
            position[action] = index
            if action.type is ActionType.SYNC:
                if not training:
                    raise PlanError(f"{where}: forward-only plan has a SYNC")
                continue
            if not 0 <= action.microbatch < plan.num_microbatches:
                raise PlanError(f"{where}: micro-batch outside [0, {plan.num_microbatches})")
            role = placement.role(rank, action.chunk)
            if plan.microbatch_pipeline[action.microbatch] != role.pipeline:
                raise PlanError(
                    f"{where}: chunk belongs to pipeline {role.pipeline} but micro-batch "
                    f"{action.microbatch} is routed to pipeline {plan.microbatch_pipeline[action.microbatch]}"
                )
        for chunk in range(placement.chunks_per_rank):
            pipeline = placement.role(rank, chunk).pipeline
            last_backward = -1
            for m in plan.microbatches_of_pipeline(pipeline):
                forward = Action(ActionType.FORWARD, chunk, m)
                if forward not in position:
                    raise PlanError(f"rank {rank}: missing {forward}")
                if not training:
                    continue
                last_backward = max(last_backward, _check_backward(rank, forward, position))
            if training:
                _check_weight_grad_order(rank, chunk, [a for _, a in actions])
                sync = Action(ActionType.SYNC, chunk)
                if sync not in position:
                    raise PlanError(f"rank {rank}: missing {sync} for chunk {chunk}")
                if position[sync] < last_backward:
                    raise PlanError(f"rank {rank}: {sync} issued before the chunk's last backward")


def _check_weight_grad_order(rank: int, chunk: int, actions) -> None:
    """``W``'s of a chunk in the micro-batch order of its ``I``'s: a FIFO per module runs them."""
    order = {kind: [a.microbatch for a in actions if a.chunk == chunk and a.type is kind]
             for kind in (ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT)}  # fmt: skip
    inputs, weights = order[ActionType.BACKWARD_INPUT], order[ActionType.BACKWARD_WEIGHT]
    if weights and weights != inputs[: len(weights)]:
        first = next(i for i, (a, b) in enumerate(zip(inputs, weights)) if a != b)
        raise PlanError(
            f"rank {rank}, chunk {chunk}: W's run in micro-batch order {weights} but the I's in {inputs}; "
            f"W number {first} must be W{chunk}.{inputs[first]} (weight-gradient work is a FIFO per module)"
        )


def _check_backward(rank: int, forward: Action, position: Dict[Action, int]) -> int:
    """Check the backward of ``forward``'s (chunk, micro-batch): ``B``, or ``I`` then ``W``,
    after the forward. Return the position of the action that completes it."""
    whole, input_grad, weight_grad = (
        Action(kind, forward.chunk, forward.microbatch)
        for kind in (ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT)
    )
    split = input_grad in position or weight_grad in position
    if whole in position and split:
        raise PlanError(f"rank {rank}: {whole} and a split backward ({input_grad}/{weight_grad}) of the same micro-batch")
    steps = (input_grad, weight_grad) if split else (whole,)
    previous = forward
    for step in steps:
        if step not in position:
            raise PlanError(f"rank {rank}: missing {step}")
        if position[step] < position[previous]:
            raise PlanError(f"rank {rank}: {step} at position {position[step]} runs before {previous}")
        if position[step] == position[previous]:
            raise PlanError(f"rank {rank}: {step} at position {position[step]} runs in one overlapped pair with {previous}")
        previous = step
    return position[previous]


def check_communication(plan: SchedulePlan) -> None:
    """Check the ``SEND`` and ``RECV`` actions of a lowered plan (see the module doc)."""
    placement = plan.placement
    sent: Dict[Tuple, List[Transfer]] = defaultdict(list)
    received: Dict[Tuple, List[Transfer]] = defaultdict(list)
    for rank, entries in enumerate(plan.actions):
        computed = {p.comm_key: i for i, a in enumerate(entries) if not a.type.is_communication for p in a.parts}
        posted = {a: i for i, a in enumerate(entries) if a.type.is_communication}
        actions = [part for entry in entries for part in entry.parts]
        for action, index in posted.items():
            where = f"rank {rank}, action {action} (position {index})"
            try:
                transfer = transfer_of(placement, rank, action)
            except ValueError as exc:
                raise PlanError(str(exc)) from None
            partner = action.compute_key
            if partner not in computed:
                raise PlanError(f"{where}: the rank runs no {partner}")
            if action.type.is_send and index < computed[partner]:
                raise PlanError(f"{where}: sends before {partner} at position {computed[partner]} produced the tensor")
            if action.type.is_receive and index > computed[partner]:
                raise PlanError(f"{where}: posted after its consumer {partner} at position {computed[partner]}")
            (sent if action.type.is_send else received)[transfer.channel].append(transfer)
        for action in actions:
            receive = receive_action(placement, rank, action)
            if receive is not None and receive not in posted:
                inp = received_by(placement, rank, action)
                raise PlanError(
                    f"rank {rank}: {action} needs the {inp.payload.value} of micro-batch {inp.microbatch} "
                    f"from rank {inp.src.rank}, but no {receive} is posted before it"
                )
            send = send_action(placement, rank, action)
            if send is not None and send not in posted:
                out = sent_by(placement, rank, action)
                raise PlanError(f"rank {rank}: {action} produces a message for rank {out.dst.rank} that no {send} sends")
    for channel in sorted(set(sent) | set(received), key=lambda c: (c[0].value, *c[1:])):
        _check_fifo(channel, sent[channel], received[channel])


def _check_fifo(channel: Tuple, sent: List[Transfer], received: List[Transfer]) -> None:
    """Messages of one channel are matched in posting order: the receiver must post for the
    same (micro-batch, source chunk, destination chunk) as the sender sends, one by one."""
    if sent == received:
        return
    payload, pipeline, src, dst = channel
    first = next((i for i, (a, b) in enumerate(zip(sent, received)) if a != b), min(len(sent), len(received)))
    raise PlanError(
        f"{payload.value} channel of pipeline {pipeline} from rank {src} to rank {dst}: "
        f"message {first} is {_message(sent, first, 'send')} at the sender but rank {dst} expects "
        f"{_message(received, first, 'receive')} (sent order {[t.microbatch for t in sent]}, "
        f"received order {[t.microbatch for t in received]})"
    )


def _message(transfers: List[Transfer], index: int, side: str) -> str:
    if index >= len(transfers):
        return "none"
    transfer = transfers[index]
    return f"micro-batch {transfer.microbatch} ({getattr(transfer, side)})"


def validate_plan(plan: SchedulePlan, nccl: bool = True) -> None:
    """Raise :class:`PlanError` unless ``plan`` is well-formed and runs to completion.

    A compute-only plan is checked as :func:`~.lower.lower` lowers it. ``nccl=False`` leaves
    out check 4, for a caller that runs :func:`~.nccl.check_nccl` itself to report its result.
    """
    check_structure(plan)
    lowered = plan if plan.has_communication else lower(plan)
    check_communication(lowered)
    simulate(lowered, CostModel())
    if nccl:
        report = check_nccl(lowered)
        if not report.ok:
            raise PlanError(report.message())
