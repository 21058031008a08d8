"""Strict p2p mode: gloo point-to-point communication under NCCL's rules.

gloo lets a rank's sends and receives on one process group progress in any order: an
``isend`` issued before an ``irecv`` of the same rank and group never holds that receive
back. NCCL does: a communicator runs each rank's operations in the order that rank issued
them (one stream per communicator), and a send completes only when the peer's matching
receive is running. A schedule that passes on CPU ranks may therefore hang on GPUs (the
classic case: two ranks each send to the other, unbatched, then receive; or two ranks whose
first unbatched operations with each other are on different groups). With
``MEGATRON_BITPIPE_STRICT_P2P=1``, :func:`~megatron_bitpipe.cpu.compat.enable_cpu_megatron`
calls :func:`install`, and every point-to-point operation on a gloo group follows these
rules (the model of NCCL the project uses, see ``docs/execution.md``):

1. **One FIFO per group and rank.** A rank's operations on one process group complete in the
   order it issued them; an operation becomes *active* only when every earlier one of that
   rank on that group has completed. Operations issued in one ``batch_isend_irecv`` call (an
   NCCL group) become active together, and the batch completes when all of them complete.
   Groups are independent of each other. (Unbatched operations on a group of more than two
   ranks have FIFOs of their own, per pair: rule 3.)
2. **Sends are not buffered.** A send completes only once the peer's matching receive is
   active (posted and at the head of the peer's FIFO for that group); a receive completes
   once the matching send is active and the data has arrived.
3. **Pair communicators for unbatched operations.** torch's ProcessGroupNCCL runs an
   *unbatched* ``isend``/``irecv``/``send``/``recv`` on a group of more than two ranks on a
   2-rank communicator of the pair, which it creates on the first such operation between the
   two ranks on that group; creating it is a blocking rendezvous. So here too: on a gloo group
   of more than two ranks, the first unbatched operation between this rank and a peer blocks
   the calling thread until the peer's first unbatched operation with this rank on that group
   arrives (at most the bound below, then a RuntimeError naming the rank, the group, the peer
   and "creating the 2-rank communicator for unbatched p2p"), and from then on that pair's
   unbatched operations form a FIFO of their own (rules 1 and 2 apply to it), independent of
   the group's FIFO, which keeps the operations of ``batch_isend_irecv`` (an NCCL group call
   runs on the group's own communicator: batched operations never create a pair's). Two ranks
   whose first unbatched operations with each other are on different groups therefore wait
   for each other forever, as on GPUs (what hung BitPipe before its executor issued every
   operation as a one-op batch). On a group of exactly two ranks unbatched operations stay in
   the group's FIFO (torch uses the group's own communicator there).
4. **Bounded waits.** ``wait()`` on a returned handle (and the blocking ``send`` / ``recv``)
   waits at most ``MEGATRON_BITPIPE_STRICT_P2P_TIMEOUT`` seconds (default 120), then raises
   a RuntimeError naming the rank, the group (its global ranks; and torch's name of it,
   ``process group 5``, unless it is the default group) or the pair's communicator, the
   operation (send or recv, peer, dtype and shape) and what it is stuck on, e.g. "strict p2p:
   rank 1 waited 120 s for its send to rank 2 (float32 [4, 2, 16], tag 0) on group [0, 1, 2, 3]
   (process group 5): rank 2 never posted the matching receive (or it is queued there behind
   an earlier operation on this group)". ``is_completed()`` is True only once the operation
   (its batch) completed. Creating a pair's communicator waits as long at most.

How: :func:`install` replaces ``torch.distributed.isend``, ``irecv``, ``send``, ``recv`` and
``batch_isend_irecv`` (``P2POp`` accepts the replacements, and ``batch_isend_irecv`` the
originals), and wraps the collectives (:data:`COLLECTIVES`, in ``torch.distributed`` and in
``torch.distributed.distributed_c10d``, whose object collectives call them) with rule 5. On a group whose backend is not gloo (or of which this rank is not a member)
they call the originals. On a gloo group, the call only enqueues the operation on a
*channel*, a worker thread that runs this rank's operations one entry (a call) at a time, in
issue order: the group's channel, or for an unbatched operation on a group of more than two
ranks the pair's channel. A pair's channel is a 2-rank gloo process group of its own
(``ProcessGroupGloo`` over a prefix of the default store, so its messages never match the
group's), created after both ranks have set their key in the store under the group's name
and the pair (the rendezvous, waited for with the store's bounded ``wait`` on the calling
thread). Running an entry: every receive first posts its gloo ``irecv``, then sends a
one-byte *token* to its source on the channel's communicator with the reserved tag
:data:`TOKEN_TAG`; every send first receives the token from its destination, then issues its
gloo ``isend``. gloo matches messages by source and tag in posting order, so the k-th token a
rank gets from a peer on a communicator belongs to the k-th send it makes to that peer there,
and tokens never match data (nobody else uses that tag: neither this project nor
megatron-core passes tags). Sends of one batch to different peers wait for their tokens
concurrently (one helper thread per further peer), as NCCL runs the operations of one
``ncclGroupStart``/``End`` together. Receives from any source (``src=None``) are refused:
NCCL has none either. :func:`strict_groups` and :func:`pair_communicators` say which groups
and pairs ran strict operations.

5. **A group's communicator is created at its first use.** NCCL without eager
   initialisation creates a group's communicator lazily, at the first operation that runs on
   it — a collective, a ``batch_isend_irecv``, an unbatched operation on a 2-rank group — and
   creating it is a blocking rendezvous of all the group's members. So here: the first such
   operation of this rank on a gloo group blocks the calling thread until every member's first
   such operation on that group has arrived (the store's keys under the group's name). Ranks
   that reach two groups' first uses in different orders wait for each other forever on GPUs;
   here the rank that sees it (a missing member is itself creating another group's
   communicator, one that waits for this rank) raises at once a RuntimeError naming both
   groups, both operations and both ranks; a member that never arrives fails the wait after
   the bound. The runtime creates and warms up its groups at set-up, in one order on every
   rank (and with NCCL the scripts initialise eagerly, where creation happens in
   ``new_group``).

Not modelled: collectives are not ordered with the point-to-point operations of their
group (NCCL would queue them on the same stream); the pair communicators of rule 3 are
applied to every gloo group of more than two ranks (torch versions or settings that run
unbatched p2p on the group's own communicator are not distinguished); a collective that a
module imported by name before :func:`install` (``from torch.distributed import
all_reduce``) does not count as a first use; tags are still honoured (NCCL ignores them). A wait that times out leaves the
channel's worker blocked: the process is expected to fail.

The mode is process-wide and idempotent; it says so once, in one line on stderr, when it
is installed.
"""

from __future__ import annotations

import collections
import copy
import functools
import inspect
import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import device_audit

__all__ = ["COLLECTIVES", "ENV", "TIMEOUT_ENV", "TOKEN_TAG", "DEFAULT_TIMEOUT_S", "created_communicators", "install",
           "install_from_env", "is_installed", "requested", "strict_groups", "pair_communicators"]

#: turns the mode on (``1``; ``0`` or empty: off)
ENV = "MEGATRON_BITPIPE_STRICT_P2P"
#: seconds a wait may take before it fails
TIMEOUT_ENV = "MEGATRON_BITPIPE_STRICT_P2P_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0
#: gloo tag of the "receive is active" tokens; data messages use the caller's tag (0 everywhere)
TOKEN_TAG = 0x5B17_7E4B

_lock = threading.Lock()
_installed = False
_timeout_s = DEFAULT_TIMEOUT_S
_originals: Dict[str, Any] = {}
_channels: Dict[Any, "_Channel"] = {}  # gloo group -> its channel (None: not a strict group)
_pairs: Dict[Any, "_PairChannel"] = {}  # (gloo group, peer) -> the pair's unbatched channel
_pair_locks: Dict[Any, threading.Lock] = {}  # held while that pair's communicator is created
_communicators: Dict[str, List[int]] = {}  # group name -> its global ranks, once its communicator was created here
_communicator_locks: Dict[str, threading.Lock] = {}  # held while that group's communicator is created
#: torch.distributed's collectives: each runs on its group's communicator (rule 5)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single", "barrier",
               "broadcast", "gather", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
               "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
#: seconds between looks at the store while a communicator is created
_CREATION_POLL_S = 0.02


def requested() -> bool:
    """Whether the environment asks for strict mode."""
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def is_installed() -> bool:
    return _installed


def strict_groups() -> List[List[int]]:
    """The groups (their global ranks) on which this process ran strict operations so far."""
    with _lock:
        return [channel.ranks for channel in _channels.values() if channel is not None]


def pair_communicators() -> List[List[List[int]]]:
    """The 2-rank communicators for unbatched p2p this process created so far, each as
    ``[group's global ranks, [lower rank, higher rank]]``."""
    with _lock:
        return [[pair.ranks, sorted((pair.rank, pair.peer))] for pair in _pairs.values()]


def created_communicators() -> List[List[int]]:
    """The groups (their global ranks) whose communicator this process created so far (rule 5)."""
    with _lock:
        return list(_communicators.values())


def install_from_env() -> bool:
    """:func:`install` if ``MEGATRON_BITPIPE_STRICT_P2P`` asks for it; returns whether strict mode is on."""
    if requested():
        install()
    return _installed


def install(timeout_s: Optional[float] = None) -> None:
    """Make gloo point-to-point communication follow NCCL's rules in this process (idempotent).

    ``timeout_s``: the bound on a wait; default ``MEGATRON_BITPIPE_STRICT_P2P_TIMEOUT`` or 120 s.
    """
    global _installed, _timeout_s
    with _lock:
        if _installed:
            return
        if timeout_s is None:
            timeout_s = float(os.environ.get(TIMEOUT_ENV, "") or DEFAULT_TIMEOUT_S)
        if timeout_s <= 0:
            raise ValueError(f"{TIMEOUT_ENV} must be positive, not {timeout_s}")
        _timeout_s = timeout_s
        for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv", "destroy_process_group"):
            _originals[name] = getattr(dist, name)
        _originals["_check_op"] = c10d._check_op
        dist.isend, dist.irecv = _strict_isend, _strict_irecv
        dist.send, dist.recv = _strict_send, _strict_recv
        dist.batch_isend_irecv = _strict_batch_isend_irecv
        dist.destroy_process_group = _strict_destroy_process_group
        c10d._check_op = _check_op  # P2POp(...) validates its op function with it
        for name in COLLECTIVES:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapped = _creating_on_first_use(name, original)
            setattr(c10d, name, wrapped)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapped)
        _installed = True
    # One write, so that the lines of several ranks sharing a terminal do not interleave.
    sys.stderr.write(
        f"megatron_bitpipe: strict p2p mode ({ENV}=1): gloo point-to-point follows NCCL's rules "
        f"(per-group issue order, a send completes only when its receive is active, unbatched p2p on a group of more "
        f"than two ranks on the pair's communicator, created on first use by both, a group's communicator created at its "
        f"first collective or batched p2p by all its members), waits bounded at {_timeout_s:g} s\n"
    )
    sys.stderr.flush()


# --------------------------------------------------------------------------- the public calls


def _check_op(op) -> None:
    if op not in (_strict_isend, _strict_irecv, _originals["isend"], _originals["irecv"]):
        _originals["_check_op"](op)


def _is_send(op) -> bool:
    return op is _strict_isend or op is _originals["isend"]


def _strict_isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    channel = _channel(group)
    if channel is None:
        return _originals["isend"](tensor, dst, group, tag, group_dst)
    return _unbatched(channel, channel.op("send", tensor, dst, group_dst, tag))


def _strict_irecv(tensor, src=None, group=None, tag=0, group_src=None):
    channel = _channel(group)
    if channel is None:
        return _originals["irecv"](tensor, src, group, tag, group_src)
    return _unbatched(channel, channel.op("recv", tensor, src, group_src, tag))


def _strict_send(tensor, dst=None, group=None, tag=0, group_dst=None):
    channel = _channel(group)
    if channel is None:
        return _originals["send"](tensor, dst, group, tag, group_dst)
    _unbatched(channel, channel.op("send", tensor, dst, group_dst, tag)).wait()


def _strict_recv(tensor, src=None, group=None, tag=0, group_src=None):
    channel = _channel(group)
    if channel is None:
        return _originals["recv"](tensor, src, group, tag, group_src)
    op = channel.op("recv", tensor, src, group_src, tag)
    _unbatched(channel, op).wait()
    return op.peer if group_src is None else op.group_peer


def _unbatched(channel: "_Channel", op: "_Op") -> "StrictWork":
    """Submit an unbatched operation: on its group's channel for a group of two ranks, else on
    the channel of the pair's 2-rank communicator (created on first use, a rendezvous)."""
    if len(channel.ranks) > 2 and op.peer != channel.rank:
        channel = _pair_channel(channel, op)
    else:
        _create_communicator(channel.group, f"unbatched {op.describe()}")
    return channel.submit([op])[0]


def _strict_batch_isend_irecv(p2p_op_list):
    c10d._check_p2p_op_list(p2p_op_list)
    channel = _channel(p2p_op_list[0].group)
    if channel is None:
        # The original tells sends by ``op.op is isend`` (the original isend).
        plain = []
        for p2p in p2p_op_list:
            p2p = copy.copy(p2p)
            p2p.op = _originals["isend"] if _is_send(p2p.op) else _originals["irecv"]
            plain.append(p2p)
        return _originals["batch_isend_irecv"](plain)
    ops = [
        channel.op("send" if _is_send(p.op) else "recv", p.tensor, None, p.group_peer, p.tag) for p in p2p_op_list
    ]
    _create_communicator(channel.group, f"batch_isend_irecv ({', '.join(op.describe() for op in ops)})")
    return channel.submit(ops)


def _strict_destroy_process_group(group=None) -> None:
    """torch's ``destroy_process_group``, after ending the strict channels of ``group`` (its own
    and its pairs' 2-rank communicators; every group's with ``None``, the default group): their
    worker threads stop and the pair communicators shut down, and nothing here holds the group,
    so its gloo threads end with its last reference."""
    with _lock:
        every = group is None
        ended = [_channels.pop(g) for g in list(_channels) if every or g is group]
        for key in [k for k in _pairs if every or k[0] is group]:
            ended.append(_pairs.pop(key))
        for key in [k for k in _pair_locks if every or k[0] is group]:
            del _pair_locks[key]
    for channel in ended:
        if channel is not None:
            channel.close()
    _originals["destroy_process_group"](group)


def _channel(group) -> Optional["_Channel"]:
    """The strict channel of ``group``, or None where the originals apply."""
    group = group if group is not None else c10d._get_default_group()
    try:
        return _channels[group]
    except KeyError:
        pass
    with _lock:
        if group not in _channels:
            strict = not c10d._rank_not_in_group(group) and dist.get_backend(group) == "gloo"
            _channels[group] = _Channel(group) if strict else None
        return _channels[group]


def _pair_channel(channel: "_Channel", op: "_Op") -> "_PairChannel":
    """The channel of the 2-rank communicator of (this rank, ``op.peer``) on ``channel``'s group
    for unbatched operations; the first call creates it, blocking until the peer's first
    unbatched operation with this rank on that group creates it there too (bounded wait)."""
    key = (channel.group, op.peer)
    pair = _pairs.get(key)
    if pair is not None:
        return pair
    with _lock:
        creating = _pair_locks.setdefault(key, threading.Lock())
    with creating:
        pair = _pairs.get(key)
        if pair is None:
            pair = _PairChannel(channel, op)
            with _lock:
                _pairs[key] = pair
    return pair


# --------------------------------------------------------------------------- group communicators (rule 5)


def _creating_on_first_use(name: str, collective):
    """``collective`` (torch's ``name``), creating its group's communicator on first use."""
    parameters = list(inspect.signature(collective).parameters)
    position = parameters.index("group") if "group" in parameters else None

    @functools.wraps(collective)
    def first_use_creates(*args, **kwargs):
        group = kwargs.get("group")
        if group is None and position is not None and len(args) > position:
            group = args[position]
        _create_communicator(group, name)
        return collective(*args, **kwargs)

    return first_use_creates


def _communicator_store():
    return dist.PrefixStore("megatron_bitpipe.strict_p2p/communicators/", c10d._get_default_store())


def _create_communicator(group, what: str) -> None:
    """Rule 5: before this rank's first operation ``what`` on ``group``'s own communicator,
    wait until every member has reached its first one there (bounded); raise at once when a
    missing member is creating another group's communicator that waits for this rank."""
    group = group if group is not None else c10d._get_default_group()
    name = group.group_name
    if name in _communicators:
        return
    if c10d._rank_not_in_group(group) or dist.get_backend(group) != "gloo":
        return
    with _lock:
        creating = _communicator_locks.setdefault(name, threading.Lock())
    with creating:
        if name in _communicators:
            return
        ranks = dist.get_process_group_ranks(group)
        rank = dist.get_rank()
        label = _label(group, ranks)
        store = _communicator_store()
        store.set(f"rank {rank} creates", json.dumps({"group": name, "ranks": ranks, "label": label, "what": what}))
        store.set(f"group {name}/rank {rank}", "1")
        deadline = time.monotonic() + _timeout_s
        while True:
            missing = [r for r in ranks if r != rank and not store.check([f"group {name}/rank {r}"])]
            if not missing:
                break
            crossing = _crossing(store, missing, rank, name)
            if crossing is not None:
                member, theirs = crossing
                raise RuntimeError(
                    f"strict p2p: rank {rank} creates the communicator of {label} for its first {what} there, while rank "
                    f"{member} creates the one of {theirs['label']} for its first {theirs['what']} there, which waits for "
                    f"rank {rank}: the two ranks reach these groups' first collectives in different orders (NCCL creates a "
                    "group's communicator lazily at its first collective or batched p2p, a blocking rendezvous of all its "
                    "members: this deadlocks on GPUs; create or warm up the groups in one order on every rank)"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"strict p2p: rank {rank} waited {_timeout_s:g} s creating the communicator of {label} for its first "
                    f"{what} there: rank(s) {missing} have not reached their first collective or batched p2p on that "
                    "group (NCCL creates a group's communicator lazily at its first use, blocking until every member arrives)"
                )
            time.sleep(_CREATION_POLL_S)
        store.set(f"rank {rank} creates", "")
        with _lock:
            _communicators[name] = ranks


def _crossing(store, missing: List[int], rank: int, name: str):
    """``(member, what it creates)`` for a missing member creating another group's
    communicator (not group ``name``'s) that this rank has not created and belongs to (a
    certain deadlock), else None."""
    for member in missing:
        key = f"rank {member} creates"
        if not store.check([key]):
            continue
        text = store.get(key).decode()
        if not text:
            continue
        theirs = json.loads(text)
        if theirs["group"] != name and rank in theirs["ranks"] and theirs["group"] not in _communicators:
            return member, theirs
    return None


# --------------------------------------------------------------------------- channels


class _Op:
    """One send or receive; ``state`` says what it waits for (read by the timeout message)."""

    def __init__(self, kind: str, tensor: torch.Tensor, peer: int, group_peer: int, tag: int):
        self.kind, self.tensor, self.peer, self.group_peer, self.tag = kind, tensor, peer, group_peer, tag
        self.state = "queued"
        self.work = None  # the gloo data work
        self.token = None  # token tensor, and its gloo work
        self.token_work = None

    def describe(self) -> str:
        where = f"to rank {self.peer}" if self.kind == "send" else f"from rank {self.peer}"
        dtype = str(self.tensor.dtype).replace("torch.", "")
        return f"{self.kind} {where} ({dtype} {list(self.tensor.shape)}, tag {self.tag})"


class _Entry:
    """The operations of one call, active together; ``done`` once all completed."""

    def __init__(self, ops: List[_Op]):
        self.ops = ops
        self.done = threading.Event()
        self.error: Optional[BaseException] = None


class _Channel:
    """This rank's FIFO of operations on one gloo group, run by a worker thread."""

    #: what messages call the communicator
    noun = "group"

    def __init__(self, group):
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank()
        self.where = _label(group, self.ranks)
        self._start()

    def _start(self) -> None:
        self._queue: "collections.deque[_Entry]" = collections.deque()
        self._ready = threading.Condition()
        self._closed = False
        self.head: Optional[_Entry] = None
        self.broken: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=f"strict-p2p {self.where}", daemon=True)
        self._thread.start()

    def op(self, kind: str, tensor, peer, group_peer, tag) -> _Op:
        if peer is None and group_peer is None:
            raise ValueError(f"strict p2p: a {kind} needs its peer (NCCL has no receive from any source)")
        if group_peer is None:
            group_peer = dist.get_group_rank(self.group, peer)
        else:
            peer = dist.get_global_rank(self.group, group_peer)
        if tag == TOKEN_TAG:
            raise ValueError(f"strict p2p: tag {TOKEN_TAG} is reserved for its tokens")
        c10d._check_single_tensor(tensor, "tensor")
        device_audit.check_communication(f"strict p2p {kind}", [tensor], self.group)  # the worker thread is not audited
        return _Op(kind, tensor, peer, group_peer, tag)

    def submit(self, ops: List[_Op]) -> List["StrictWork"]:
        entry = _Entry(ops)
        with self._ready:
            self._queue.append(entry)
            self._ready.notify()
        return [StrictWork(self, entry, op) for op in ops]

    # -- gloo, on this channel's communicator (``op.group_peer`` is the peer's rank in the group)

    def _isend(self, tensor: torch.Tensor, op: "_Op", tag: int):
        return _originals["isend"](tensor, group=self.group, tag=tag, group_dst=op.group_peer)

    def _irecv(self, tensor: torch.Tensor, op: "_Op", tag: int):
        return _originals["irecv"](tensor, group=self.group, tag=tag, group_src=op.group_peer)

    # -- the worker

    def close(self) -> None:
        """End the worker once its queue is empty (the group is being destroyed)."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if not self._queue:
                    return
                entry = self._queue[0]
            self.head = entry
            if self.broken is None:
                try:
                    self._execute(entry)
                except BaseException as error:  # noqa: BLE001 - reported to whoever waits
                    self.broken = error
            entry.error = self.broken
            with self._ready:
                self._queue.popleft()
            self.head = None
            entry.done.set()

    def _execute(self, entry: _Entry) -> None:
        for op in entry.ops:
            if op.kind == "recv":
                op.work = self._irecv(op.tensor, op, op.tag)
                op.token = torch.ones(1, dtype=torch.uint8)
                op.token_work = self._isend(op.token, op, TOKEN_TAG)
                op.state = "data"
            else:
                op.token = torch.empty(1, dtype=torch.uint8)
                op.token_work = self._irecv(op.token, op, TOKEN_TAG)
                op.state = "token"
        by_peer: Dict[int, List[_Op]] = {}
        for op in entry.ops:
            if op.kind == "send":
                by_peer.setdefault(op.group_peer, []).append(op)
        lines = list(by_peer.values())
        errors: List[BaseException] = []
        helpers = [threading.Thread(target=self._send_in_order, args=(line, errors), daemon=True) for line in lines[1:]]
        for helper in helpers:
            helper.start()
        if lines:
            self._send_in_order(lines[0], errors)
        for helper in helpers:
            helper.join()
        if errors:
            raise errors[0]
        for op in entry.ops:
            op.work.wait()
            if op.kind == "recv":
                op.token_work.wait()
            op.state = "done"

    def _send_in_order(self, sends: List[_Op], errors: List[BaseException]) -> None:
        """Sends to one peer: each waits for its token, then goes (gloo matches in order)."""
        try:
            for op in sends:
                op.token_work.wait()
                op.work = self._isend(op.tensor, op, op.tag)
                op.state = "data"
        except BaseException as error:  # noqa: BLE001 - raised by _execute
            errors.append(error)

    # -- the timeout message

    def stall(self, entry: _Entry, op: _Op, waited_s: float) -> str:
        head = self.head
        why: str
        if entry.done.is_set():
            why = "it completed just now"
        elif head is not entry:
            blocking = head.ops if head is not None else []
            pending = next((o for o in blocking if o.state != "done"), None)
            why = "it is queued behind earlier operations of this rank on that group"
            if pending is not None:
                why = (
                    f"it is queued behind this rank's {pending.describe()} on that {self.noun} "
                    f"(NCCL runs a {self.noun}'s operations in issue order), and {_reason(pending, self.noun)}"
                )
        elif op.state != "done":
            why = _reason(op, self.noun)
        else:
            pending = next((o for o in entry.ops if o.state != "done"), None)
            why = "its batch has not completed"
            if pending is not None:
                why = f"its batch has not completed: its {pending.describe()} waits, {_reason(pending, self.noun)}"
        return f"strict p2p: rank {self.rank} waited {waited_s:g} s for its {op.describe()} on {self.where}: {why}"


class _PairChannel(_Channel):
    """This rank's FIFO of unbatched operations with one peer on a group of more than two
    ranks: NCCL's 2-rank communicator of the pair, here a 2-rank gloo process group of its own
    (so its messages never match the group's). Creating it is a rendezvous of the two ranks
    through the default store, bounded by the timeout."""

    noun = "communicator"

    def __init__(self, parent: _Channel, op: _Op):
        self.group, self.ranks, self.rank, self.peer = parent.group, parent.ranks, parent.rank, op.peer
        low, high = sorted((self.rank, self.peer))
        group = _label(self.group, self.ranks)
        self.where = f"the 2-rank communicator of ranks {low} and {high} for unbatched p2p on {group}"
        self._index = 0 if self.rank == low else 1
        store = dist.PrefixStore(
            f"megatron_bitpipe.strict_p2p/group {self.group.group_name}/pair {low}-{high}/", c10d._get_default_store()
        )
        store.set(f"rank {self.rank} arrived", "1")
        try:
            store.wait([f"rank {self.peer} arrived"], timedelta(seconds=_timeout_s))
        except RuntimeError as error:
            raise RuntimeError(
                f"strict p2p: rank {self.rank} waited {_timeout_s:g} s creating the 2-rank communicator for unbatched "
                f"p2p with rank {self.peer} on {group}, for its first unbatched {op.describe()} there: "
                f"rank {self.peer} has not reached its first unbatched send or receive with rank {self.rank} on "
                "that group (NCCL creates a pair's communicator on first use, blocking both ranks until both "
                "arrive; batch_isend_irecv runs on the group's own communicator instead)"
            ) from error
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), self._index, 2, _gloo_timeout(self.group))
        self._start()

    def _isend(self, tensor: torch.Tensor, op: _Op, tag: int):
        return self.pg.send([tensor], 1 - self._index, tag)

    def _irecv(self, tensor: torch.Tensor, op: _Op, tag: int):
        return self.pg.recv([tensor], 1 - self._index, tag)


def _label(group, ranks: List[int]) -> str:
    """``group [0, 1, 2]`` for the default group, ``group [0, 1, 2] (process group 5)`` for
    others (several groups may have the same ranks)."""
    if group is c10d._get_default_group():
        return f"group {ranks}"
    return f"group {ranks} (process group {group.group_name})"


def _gloo_timeout(group) -> timedelta:
    """The gloo operation timeout of ``group`` (30 minutes where torch does not tell)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return timedelta(minutes=30)


def _reason(op: _Op, noun: str = "group") -> str:
    if op.state == "token":
        return (
            f"rank {op.peer} never posted the matching receive "
            f"(or it is queued there behind an earlier operation on this {noun})"
        )
    if op.state == "data" and op.kind == "recv":
        return (
            f"rank {op.peer} never issued the matching send "
            f"(or it is queued there behind an earlier operation on this {noun})"
        )
    if op.state == "data":
        return f"the data has not reached rank {op.peer}"
    return f"it is {op.state}"


class StrictWork(dist.Work):
    """The handle of a strict operation: completed when its whole entry (call) completed."""

    def __init__(self, channel: _Channel, entry: _Entry, op: _Op):
        super().__init__()
        self._channel, self._entry, self._op = channel, entry, op

    def is_completed(self) -> bool:
        return self._entry.done.is_set()

    def is_success(self) -> bool:
        return self._entry.done.is_set() and self._entry.error is None

    def exception(self):
        return self._entry.error

    def wait(self, timeout: Any = None) -> bool:
        bound = _timeout_s
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            bound = min(bound, timeout.total_seconds())
        if not self._entry.done.wait(bound):
            raise RuntimeError(self._channel.stall(self._entry, self._op, bound))
        if self._entry.error is not None:
            raise RuntimeError(
                f"strict p2p: rank {self._channel.rank}'s {self._op.describe()} on {self._channel.where} failed"
            ) from self._entry.error
        return True
