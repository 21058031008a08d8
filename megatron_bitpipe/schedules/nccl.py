"""A model of NCCL's rules, applied to a lowered plan as the runtime issues it.

gloo buffers a send until its receive comes, so a CPU run cannot show an order that hangs on
GPUs. This module executes a lowered plan symbolically under NCCL's rules instead:

1. **Communicators.** Every message travels on the communicator :class:`IssueRules` assigns
   it (the runtime's: :func:`~.comm.channel_group_key`, one process group per payload,
   pipeline, direction and link parity); a ``SYNC`` is a collective over the stage's
   replicas, on that stage's communicator.
2. **Issue order.** A rank issues its operations in plan order without waiting (NCCL
   operations are asynchronous); they are *active* once every operation issued earlier on the
   same communicator by that rank has completed — NCCL runs one communicator's operations
   in issue order. Communicators progress independently of one another (NCCL's own streams),
   except where a rank's waits order its issues: an operation issued after a wait is issued
   only once the wait is over.
3. **Rendezvous.** A send and its receive complete together, once both are active (NCCL
   does not buffer); the ``k``-th send from rank ``a`` to rank ``b`` on a communicator is
   matched with the ``k``-th receive ``b`` posts from ``a`` there — if those are not the same
   message, the data would be wrong (reported as a mismatch). A collective completes once
   every member's operation is active.
4. **Waiting.** A compute action waits for the receive of its input (``work.wait()``); a
   backward also waits for the send of its forward's output (the executor frees that output
   only after its send); an overlapped pair ``OVERLAP_F_B`` waits for what both its halves
   wait for before either computes, and its sends (lowered after it) are issued after both;
   the step ends when all of the rank's operations completed.
5. **Creation.** Communicators created at set-up (the runtime's) cost nothing here: they are
   created in one global order before the step. With ``lazy_communicators`` an operation on
   a communicator the rank has not used yet first *creates* it — torch's unbatched p2p on a
   group larger than two creates a communicator for the pair on first use, and a group's
   first collective creates the group's — which blocks the rank until every member arrives.

:func:`check_nccl` returns an :class:`NcclReport`: whether the step completes, and otherwise
the first cycle of ranks waiting on one another, each link named (rank, action, operation,
communicator, peer).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Optional, Tuple

from .actions import Action, ActionType, SchedulePlan
from .comm import Transfer, channel_group_key, transfer_of
from .lower import lower

__all__ = ["IssueRules", "NcclReport", "RUNTIME_RULES", "LAZY_UNBATCHED_RULES", "check_nccl"]


@dataclass(frozen=True)
class IssueRules:
    """How a runtime issues a plan's communication.

    Attributes:
        name: what the rules describe, for messages.
        communicator: the communicator a message travels on (any hashable key).
        lazy_communicators: communicators are created inside the step, on first use (see the
            module doc, rule 5); False: all were created at set-up.
        pair_communicators: a p2p operation runs on a communicator of its two ranks only
            (torch's unbatched send/recv on a larger group), keyed by (communicator, pair).
    """

    name: str
    communicator: Callable[[Transfer], Hashable]
    lazy_communicators: bool = False
    pair_communicators: bool = False


#: The runtime (:mod:`megatron_bitpipe.execution.executor`): every p2p operation in a
#: ``batch_isend_irecv`` of its own on its channel's process group, whose communicator (and
#: every stage group's) was created and warmed up at set-up.
RUNTIME_RULES = IssueRules("runtime: per-channel groups, batched, created at set-up", channel_group_key)
#: The alternative the rules reject: unbatched ``isend``/``irecv`` on the same groups, each
#: pair's communicator created lazily inside the step, stage groups on their first all-reduce.
LAZY_UNBATCHED_RULES = IssueRules(
    "unbatched isend/irecv, communicators created on first use",
    channel_group_key,
    lazy_communicators=True,
    pair_communicators=True,
)


@dataclass
class _Op:
    """One NCCL operation of one rank."""

    rank: int
    kind: str  # "send", "recv" or "all-reduce"
    communicator: Hashable
    action: Action  # the plan action that issued it
    peers: Tuple[int, ...]  # the other rank of a p2p; every member of a collective
    transfer: Optional[Transfer] = None
    partners: List[Optional["_Op"]] = field(default_factory=list)  # None: never matched
    issued: bool = False
    active: bool = False
    done: bool = False

    def describe(self) -> str:
        if self.kind == "all-reduce":
            return f"the all-reduce of {self.action} over ranks {list(self.peers)} (communicator {_name(self.communicator)})"
        direction = "to" if self.kind == "send" else "from"
        return f"{self.action} {direction} rank {self.peers[0]} (communicator {_name(self.communicator)})"


@dataclass
class NcclReport:
    """What :func:`check_nccl` found.

    Attributes:
        deadlock_free: every rank finishes the step.
        rules: the :class:`IssueRules` name.
        cycle: on a deadlock, the first cycle of waits, one line per link.
        mismatches: messages matched with another message's receive (wrong data on NCCL).
    """

    deadlock_free: bool
    rules: str
    cycle: List[str] = field(default_factory=list)
    mismatches: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.deadlock_free and not self.mismatches

    def message(self) -> str:
        if self.ok:
            return f"NCCL deadlock-free ({self.rules})"
        lines = []
        if self.mismatches:
            lines.append(f"NCCL would match messages wrongly ({self.rules}):")
            lines += [f"  {m}" for m in self.mismatches]
        if not self.deadlock_free:
            lines.append(f"NCCL deadlock ({self.rules}); blocked cycle:")
            lines += [f"  {link}" for link in self.cycle]
        return "\n".join(lines)


def _name(key: Hashable) -> str:
    if isinstance(key, tuple):
        return "(" + ", ".join(getattr(k, "value", str(k)) for k in key) + ")"
    return str(key)


def _stage_communicator(plan: SchedulePlan, rank: int, chunk: int) -> Tuple[Hashable, Tuple[int, ...]]:
    stage = plan.placement.role(rank, chunk).stage
    members = tuple(sorted({loc.rank for loc in plan.placement.replicas(stage)}))
    return ("stage", stage), members


def check_nccl(plan: SchedulePlan, rules: IssueRules = RUNTIME_RULES) -> NcclReport:
    """Run one step of ``plan`` (lowered first if compute-only) under NCCL's rules as issued
    by ``rules``; see the module doc. Pure: no torch."""
    if not plan.has_communication:
        plan = lower(plan)
    num_ranks = plan.num_ranks
    program, mismatches = _issue(plan, rules)

    cursor = [0] * num_ranks
    queues: Dict[Tuple[int, Hashable], deque] = defaultdict(deque)
    arrived: Dict[Hashable, set] = defaultdict(set)  # lazy creation: ranks that reached it
    created: set = set()
    blocked_on: Dict[int, object] = {}

    def queue_key(op: _Op) -> Tuple[int, Hashable]:
        return (op.rank, op.communicator)

    progressed = True
    while progressed:
        progressed = False
        for rank in range(num_ranks):  # each rank's CPU issues as far as it can
            steps = program[rank]
            while cursor[rank] < len(steps):
                kind, payload = steps[cursor[rank]]
                if kind == "create":
                    communicator, members = payload
                    arrived[communicator].add(rank)
                    if arrived[communicator] >= set(members):
                        created.add(communicator)
                    if communicator not in created:
                        blocked_on[rank] = ("create", communicator, members)
                        break
                elif kind == "issue":
                    payload.issued = True
                    queues[queue_key(payload)].append(payload)
                else:  # "wait": a compute action or the end of the step
                    pending = [op for op in payload[1] if not op.done]
                    if pending:
                        blocked_on[rank] = ("wait", payload[0], pending[0])
                        break
                blocked_on.pop(rank, None)
                cursor[rank] += 1
                progressed = True
        for queue in queues.values():  # the head of every queue is active
            if queue:
                queue[0].active = True
        for op in [q[0] for q in queues.values() if q]:  # rendezvous of active operations
            if op.done:
                continue
            if all(p is not None and p.active for p in op.partners):
                for done in [op, *op.partners]:
                    done.done = True
                progressed = True
        for queue in queues.values():
            while queue and queue[0].done:
                queue.popleft()
                progressed = True

    if all(cursor[r] == len(program[r]) for r in range(num_ranks)):
        return NcclReport(True, rules.name, mismatches=mismatches)
    cycle = _first_cycle(blocked_on, queues, queue_key)
    return NcclReport(False, rules.name, cycle=cycle, mismatches=mismatches)


def _issue(plan: SchedulePlan, rules: IssueRules):
    """Each rank's program — ("create", (communicator, members)), ("issue", op) and
    ("wait", (action, ops)) steps in the order the runtime runs them — with every operation's
    partners linked, and the mismatched messages."""
    placement = plan.placement
    program: List[List[Tuple[str, object]]] = []
    sends: Dict[Tuple, List[_Op]] = defaultdict(list)  # (communicator, src, dst) -> in issue order
    receives: Dict[Tuple, List[_Op]] = defaultdict(list)
    collectives: Dict[Tuple[Hashable, int], List[_Op]] = defaultdict(list)  # (communicator, k)
    for rank, actions in enumerate(plan.actions):
        steps: List[Tuple[str, object]] = []
        used: set = set()
        receive_of: Dict[Action, _Op] = {}
        send_of: Dict[Action, _Op] = {}
        own: List[_Op] = []
        collective_count: Dict[Hashable, int] = defaultdict(int)

        def issue(op: _Op, members: Tuple[int, ...]) -> None:
            if rules.lazy_communicators and op.communicator not in used:
                steps.append(("create", (op.communicator, members)))
            used.add(op.communicator)
            steps.append(("issue", op))
            own.append(op)

        for action in actions:
            if action.type.is_communication:
                transfer = transfer_of(placement, rank, action)
                sending = action.type.is_send
                peer = transfer.dst.rank if sending else transfer.src.rank
                communicator = rules.communicator(transfer)
                if rules.pair_communicators:
                    communicator = (*communicator, f"pair {min(rank, peer)}-{max(rank, peer)}")
                op = _Op(rank, "send" if sending else "recv", communicator, action, (peer,), transfer)
                key = (communicator, transfer.src.rank, transfer.dst.rank)
                (sends if sending else receives)[key].append(op)
                (send_of if sending else receive_of)[action.compute_key] = op
                issue(op, tuple(sorted((rank, peer))))
            elif action.type is ActionType.SYNC:
                communicator, members = _stage_communicator(plan, rank, action.chunk)
                op = _Op(rank, "all-reduce", communicator, action, members)
                collectives[(communicator, collective_count[communicator])].append(op)
                collective_count[communicator] += 1
                issue(op, members)
            else:  # an overlapped pair waits for both halves' inputs before computing either
                waits = []
                for part in action.parts:
                    waits.append(receive_of.get(part.comm_key))
                    if part.type.computes_input_grad:  # the forward's output is freed after its send
                        waits.append(send_of.get(Action(ActionType.FORWARD, part.chunk, part.microbatch)))
                steps.append(("wait", (action, [w for w in waits if w is not None])))
        steps.append(("wait", ("the end of the step", own)))
        program.append(steps)

    mismatches: List[str] = []
    for key in set(sends) | set(receives):
        sent, received = sends.get(key, []), receives.get(key, [])
        for index, (send, receive) in enumerate(zip(sent, received)):
            send.partners, receive.partners = [receive], [send]
            if send.transfer != receive.transfer:
                communicator, src, dst = key
                mismatches.append(
                    f"message {index} from rank {src} to rank {dst} on communicator {_name(communicator)}: "
                    f"rank {src} sends it for {send.action}, rank {dst} receives it as {receive.action}"
                )
        for op in sent[len(received):] + received[len(sent):]:
            op.partners = [None]  # never matched: waits forever
    for ops in collectives.values():
        for op in ops:
            op.partners = [other for other in ops if other is not op]
            if len(ops) < len(op.peers):
                op.partners.append(None)
    return program, sorted(mismatches)


def _first_cycle(blocked_on, queues, queue_key) -> List[str]:
    """Follow the waits from the lowest blocked rank — a rank's CPU waits for an operation or
    a communicator's creation, a queued operation for its queue's head, an active operation for
    its partner — until a node repeats; return that cycle's links, one line each."""

    def step(node) -> Tuple[str, Optional[tuple]]:
        kind, item = node
        if kind == "rank":
            state = blocked_on[item]
            if state[0] == "create":
                _, communicator, members = state
                absent = [m for m in members if m != item and _creating(blocked_on.get(m)) != communicator]
                peer = absent[0] if absent else members[0]
                return (
                    f"rank {item} creates communicator {_name(communicator)} (ranks {list(members)}) and "
                    f"waits for rank {peer}, which is elsewhere", ("rank", peer)
                )
            _, action, op = state
            return f"rank {item} at {action} waits for {op.describe()}", ("op", op)
        op = item
        if not op.active:
            head = queues[queue_key(op)][0]
            return f"rank {op.rank}'s {op.action} is queued behind {head.describe()}", ("op", head)
        partner = next((p for p in op.partners if p is None or not p.active), None)
        if partner is None:
            return f"rank {op.rank}'s {op.action} is never matched by any rank", None
        if not partner.issued:
            return f"rank {op.rank}'s {op.action} needs rank {partner.rank}'s {partner.action}, not issued yet", (
                "rank",
                partner.rank,
            )
        return f"rank {op.rank}'s {op.action} needs rank {partner.rank}'s {partner.action}", ("op", partner)

    node: Optional[tuple] = ("rank", min(blocked_on))
    seen: List[tuple] = []
    links: List[str] = []
    while node is not None and not any(_same(node, other) for other in seen):
        seen.append(node)
        text, node = step(node)
        links.append(text)
    if node is not None:
        start = next(i for i, other in enumerate(seen) if _same(node, other))
        links = links[start:]
    return links


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and (a[1] is b[1] if a[0] == "op" else a[1] == b[1])


def _creating(state) -> Optional[Hashable]:
    return state[1] if state and state[0] == "create" else None
