"""Strict p2p mode (``MEGATRON_BITPIPE_STRICT_P2P=1``): gloo point-to-point under NCCL's rules.

On gloo ranks, with and without the mode, so that each rule is shown to change what a CPU run
lets through (:mod:`megatron_bitpipe.cpu.strict_p2p`):

* a send completes only once its receive is *active* — posted and at the head of the peer's
  operations on that group (plain gloo completes it as soon as the receive is posted);
* a group runs a rank's operations in issue order, groups are independent (both shown with
  one-op ``batch_isend_irecv`` calls on 3-rank groups: batched operations run on the group's
  own communicator, as the runtime issues them);
* the classic NCCL deadlock (two ranks send to each other, unbatched, then receive) fails after
  the bound, naming rank, group and operation, while the same exchange in one
  ``batch_isend_irecv`` completes (plain gloo completes both);
* on a group of more than two ranks an unbatched operation runs on the pair's own 2-rank
  communicator, whose creation on first use is a rendezvous of the two ranks: two ranks whose
  first unbatched operations with each other are on different groups deadlock (the old
  executor's pattern hung BitPipe on a GPU this way), the batched runtime does not;
* a group's communicator is created at its first collective, a rendezvous of all its
  members: two ranks that start two groups' first collectives in opposite orders fail at once
  naming both groups (plain gloo runs them; NCCL hangs), in one order they complete;
* megatron-core's own schedules (1F1B batched and unbatched, interleaved with overlapped p2p)
  still equal single-process training under the mode.
"""

from __future__ import annotations

import io
import re
import sys
import time

import pytest
import torch

from megatron_bitpipe.cpu.launcher import RankFailure, launch
from megatron_bitpipe.schedules.choice import ScheduleChoice
from megatron_bitpipe.schedules.nccl import LAZY_UNBATCHED_RULES, check_nccl

from .test_cpu_compat import Case, _merged, _run_cases

pytestmark = pytest.mark.multirank

STRICT = {"MEGATRON_BITPIPE_STRICT_P2P": "1"}
PLAIN = {"MEGATRON_BITPIPE_STRICT_P2P": "0"}
#: how long a rank watches an operation that must not complete yet
WATCH_S = 1.0


def _enable() -> str:
    """On a rank: enable the CPU layer (twice); return what it wrote to stderr."""
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    saved, sys.stderr = sys.stderr, io.StringIO()
    try:
        enable_cpu_megatron()
        enable_cpu_megatron()
        return sys.stderr.getvalue()
    finally:
        sys.stderr = saved


class _Waiter:
    """``work.wait()`` on a thread of its own, so that a rank can watch whether it returns.

    (gloo's ``is_completed()`` of a send or receive stays False until ``wait()`` is called, so
    only a wait tells what plain gloo would let through.)"""

    def __init__(self, work):
        import threading

        self.error = None
        self._thread = threading.Thread(target=self._wait, args=(work,), daemon=True)
        self._thread.start()

    def _wait(self, work) -> None:
        try:
            work.wait()
        except BaseException as error:  # noqa: BLE001 - re-raised by join()
            self.error = error

    def returns_within(self, seconds: float) -> bool:
        self._thread.join(seconds)
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise self.error


def _warm_up(*groups) -> None:
    """Create the default group's and ``groups``' communicators, in this order on every rank (as
    the runtime does at set-up): under NCCL without eager initialisation a group's first
    collective or batched p2p creates them, a rendezvous of all its members."""
    import torch.distributed as dist

    dist.barrier()
    for group in groups:
        dist.barrier(group=group)


def _batched(kind: str, tensor, peer: int, group):
    """One operation issued as a ``batch_isend_irecv`` of its own (on the group's communicator,
    as the runtime's executor issues them); returns its work."""
    import torch.distributed as dist

    op = dist.isend if kind == "send" else dist.irecv
    return dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group)])[0]


def _send_behind_a_blocked_receive() -> dict:
    """3 ranks, one group, one-op batches. Rank 1 posts a receive from rank 2 (which sends only
    later), then the receive from rank 0; rank 0 sends to rank 1. Returns whether rank 0's send
    completed while rank 1's receive for it was posted but not at the head of its operations."""
    import torch.distributed as dist

    log = _enable()
    rank = dist.get_rank()
    group = dist.new_group([0, 1, 2])
    _warm_up(group)
    facts = {"log": log}
    if rank == 0:
        send = _batched("send", torch.arange(4.0), 1, group)
        facts["is_completed_at_once"] = send.is_completed()
        waiter = _Waiter(send)
        dist.barrier()  # rank 1 has posted both receives
        facts["completed_early"] = waiter.returns_within(WATCH_S)
        dist.barrier()  # rank 2 sends
        waiter.join()
        facts["completed"] = send.is_completed()
    elif rank == 1:
        first, second = torch.zeros(2), torch.zeros(4)
        works = [_batched("recv", first, 2, group), _batched("recv", second, 0, group)]
        dist.barrier()
        dist.barrier()
        for work in works:
            work.wait()
        facts["received"] = (first.tolist(), second.tolist())
    else:
        dist.barrier()
        dist.barrier()
        _batched("send", torch.ones(2), 1, group).wait()
    return facts


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "plain_gloo"])
def test_a_send_completes_only_when_its_receive_is_active(strict):
    facts = launch(_send_behind_a_blocked_receive, 3, timeout=120, env=STRICT if strict else PLAIN)
    # strict: the receive is posted but queued behind the one from rank 2, so the send waits;
    # plain gloo lets it through — the check that fails without the mode.
    assert facts[0]["completed_early"] is (not strict)
    assert not facts[0]["is_completed_at_once"]
    if strict:  # gloo's own handles say False until waited for
        assert facts[0]["completed"]
    assert facts[1]["received"] == ([1.0, 1.0], [0.0, 1.0, 2.0, 3.0])
    for rank_facts in facts:
        lines = rank_facts["log"].splitlines()
        if strict:
            assert len(lines) == 1 and "strict p2p mode" in lines[0], rank_facts["log"]
        else:
            assert not any("strict p2p" in line for line in lines)


def _fifo_per_group() -> dict:
    """3 ranks, groups ``g`` and ``h``, one-op batches. Rank 1 posts a receive from rank 2 on
    ``g`` (rank 2 sends later), then a send to rank 0 on ``g``, then one on ``h``. Returns which
    sends and receives completed before rank 2 sent."""
    import torch.distributed as dist

    _enable()
    rank = dist.get_rank()
    g = dist.new_group([0, 1, 2])
    h = dist.new_group([0, 1, 2])
    _warm_up(g, h)
    facts: dict = {}
    if rank == 0:
        on_g, on_h = torch.zeros(3), torch.zeros(3)
        recv_g, recv_h = _batched("recv", on_g, 1, g), _batched("recv", on_h, 1, h)
        dist.barrier()
        recv_h.wait()  # the other group progresses
        waiter = _Waiter(recv_g)
        facts["g_completed_early"] = waiter.returns_within(WATCH_S)
        dist.barrier()
        waiter.join()
        facts["received"] = (on_g.tolist(), on_h.tolist())
    elif rank == 1:
        blocked = _batched("recv", torch.zeros(1), 2, g)
        send_g = _batched("send", torch.full((3,), 7.0), 0, g)
        send_h = _batched("send", torch.full((3,), 8.0), 0, h)
        dist.barrier()
        send_h.wait()
        waiter = _Waiter(send_g)
        facts["g_completed_early"] = waiter.returns_within(WATCH_S)
        dist.barrier()
        blocked.wait()
        waiter.join()
    else:
        dist.barrier()
        dist.barrier()
        _batched("send", torch.zeros(1), 1, g).wait()
    return facts


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "plain_gloo"])
def test_a_group_runs_a_ranks_operations_in_issue_order_and_groups_are_independent(strict):
    facts = launch(_fifo_per_group, 3, timeout=120, env=STRICT if strict else PLAIN)
    # strict: rank 1's send on g waits behind its receive on g; its send on h goes.
    assert facts[1]["g_completed_early"] is (not strict)
    assert facts[0]["g_completed_early"] is (not strict)
    assert facts[0]["received"] == ([7.0] * 3, [8.0] * 3)


def _exchange(batched: bool, wait_first: str) -> list:
    """2 ranks swap a tensor on the default group: unbatched send then receive on both, or one
    ``batch_isend_irecv`` of both. Rank 0 waits at most 60 s, rank 1 at most the environment's
    bound, so rank 1 is the one that reports a deadlock; it waits for ``wait_first`` first."""
    import torch.distributed as dist

    from megatron_bitpipe.cpu import strict_p2p

    rank = dist.get_rank()
    if rank == 0 and strict_p2p.requested():
        strict_p2p.install(timeout_s=60)
    _enable()
    peer = 1 - rank
    mine, theirs = torch.full((3,), float(rank)), torch.zeros(3)
    if batched:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)])
    else:
        works = [dist.isend(mine, peer), dist.irecv(theirs, peer)]
    for work in works if wait_first == "send" else works[::-1]:
        work.wait()
    return theirs.tolist()


@pytest.mark.parametrize(
    "wait_first, expected",
    [
        (
            "send",
            r"strict p2p: rank 1 waited 3 s for its send to rank 0 \(float32 \[3\], tag 0\) on group \[0, 1\]: "
            r"rank 0 never posted the matching receive",
        ),
        (
            "recv",
            r"strict p2p: rank 1 waited 3 s for its recv from rank 0 \(float32 \[3\], tag 0\) on group \[0, 1\]: "
            r"it is queued behind this rank's send to rank 0 \(float32 \[3\], tag 0\) on that group .*"
            r"and rank 0 never posted the matching receive",
        ),
    ],
)
def test_unbatched_send_send_recv_recv_deadlocks_naming_rank_group_and_operation(wait_first, expected):
    started = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        launch(_exchange, 2, False, wait_first, timeout=60, env={**STRICT, "MEGATRON_BITPIPE_STRICT_P2P_TIMEOUT": "3"})
    assert failure.value.rank == 1
    assert re.search(expected, str(failure.value)), str(failure.value)
    assert time.monotonic() - started < 40


@pytest.mark.parametrize(
    "batched, env",
    [(True, STRICT), (False, PLAIN), (True, PLAIN)],
    ids=["batched_strict", "unbatched_plain_gloo", "batched_plain_gloo"],
)
def test_the_exchange_completes_batched_or_without_the_mode(batched, env):
    received = launch(_exchange, 2, batched, "send", timeout=60, env={**env, "MEGATRON_BITPIPE_STRICT_P2P_TIMEOUT": "3"})
    assert received == [[1.0] * 3, [0.0] * 3]


# ------------------------------------------------------------------ pair communicators

CREATION = "creating the 2-rank communicator for unbatched p2p"


def _crossing_first_use(batched: bool) -> dict:
    """3 ranks, groups ``g1`` and ``g2`` of all three. Rank 1 receives from rank 2 on ``g1``,
    then on ``g2``; rank 2 sends to rank 1 on ``g2``, then on ``g1``. Each group's messages are
    in a consistent order, so gloo — and the per-group FIFOs alone — run it; unbatched, the
    first operation of rank 1 with rank 2 creates the pair's communicator on ``g1`` and rank
    2's first creates the one on ``g2``: each waits for the other (NCCL hangs)."""
    import torch.distributed as dist

    from megatron_bitpipe.cpu import strict_p2p

    _enable()
    rank = dist.get_rank()
    g1, g2 = dist.new_group([0, 1, 2]), dist.new_group([0, 1, 2])
    _warm_up(g1, g2)

    def issue(kind, tensor, group):
        if batched:
            return _batched(kind, tensor, 3 - rank, group)
        return (dist.isend if kind == "send" else dist.irecv)(tensor, 3 - rank, group=group)

    facts: dict = {}
    if rank == 1:
        on_g1, on_g2 = torch.zeros(2), torch.zeros(2)
        for work in [issue("recv", on_g1, g1), issue("recv", on_g2, g2)]:
            work.wait()
        facts["received"] = (on_g1.tolist(), on_g2.tolist())
    elif rank == 2:
        for work in [issue("send", torch.full((2,), 2.0), g2), issue("send", torch.full((2,), 1.0), g1)]:
            work.wait()
    facts["pairs"] = strict_p2p.pair_communicators()
    return facts


def test_crossing_first_unbatched_use_of_two_pair_communicators_deadlocks():
    started = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        launch(_crossing_first_use, 3, False, timeout=60, env={**STRICT, "MEGATRON_BITPIPE_STRICT_P2P_TIMEOUT": "3"})
    text = str(failure.value)
    assert failure.value.rank in (1, 2), text
    me, peer = failure.value.rank, 3 - failure.value.rank
    assert re.search(
        rf"strict p2p: rank {me} waited 3 s {CREATION} with rank {peer} on group \[0, 1, 2\] \(process group \d+\), "
        rf"for its first unbatched (recv from|send to) rank {peer} \(float32 \[2\], tag 0\) there: rank {peer} has "
        rf"not reached its first unbatched send or receive with rank {me} on that group",
        text,
    ), text
    assert time.monotonic() - started < 40


@pytest.mark.parametrize(
    "batched, env",
    [(True, STRICT), (False, PLAIN)],
    ids=["batched_strict", "unbatched_plain_gloo"],
)
def test_crossing_first_use_completes_batched_or_without_the_mode(batched, env):
    facts = launch(_crossing_first_use, 3, batched, timeout=60, env={**env, "MEGATRON_BITPIPE_STRICT_P2P_TIMEOUT": "3"})
    assert facts[1]["received"] == ([1.0, 1.0], [2.0, 2.0])
    assert all(f["pairs"] == [] for f in facts)  # batched operations never create one


def _pair_fifo_is_its_own() -> dict:
    """3 ranks, one group. Rank 1 posts a batched receive from rank 2 (which sends later), then
    an unbatched send to rank 0, which rank 0 receives unbatched: the send runs on the pair's
    communicator, not behind the batched receive in the group's FIFO."""
    import torch.distributed as dist

    from megatron_bitpipe.cpu import strict_p2p

    _enable()
    rank = dist.get_rank()
    group = dist.new_group([0, 1, 2])
    _warm_up(group)
    facts: dict = {}
    if rank == 0:
        received = torch.zeros(3)
        dist.recv(received, 1, group=group)
        facts["received"] = received.tolist()
        dist.barrier()
    elif rank == 1:
        blocked = _batched("recv", torch.zeros(1), 2, group)
        send = dist.isend(torch.full((3,), 5.0), 0, group=group)
        facts["send_completed_first"] = _Waiter(send).returns_within(30)
        dist.barrier()
        blocked.wait()
    else:
        dist.barrier()
        _batched("send", torch.zeros(1), 1, group).wait()
    facts["pairs"] = strict_p2p.pair_communicators()
    return facts


def test_unbatched_operations_of_a_pair_run_on_their_own_communicator():
    facts = launch(_pair_fifo_is_its_own, 3, timeout=120, env=STRICT)
    assert facts[1]["send_completed_first"]
    assert facts[0]["received"] == [5.0] * 3
    assert facts[0]["pairs"] == facts[1]["pairs"] == [[[0, 1, 2], [0, 1]]]
    assert facts[2]["pairs"] == []


def _replay_bitpipe(batched: bool, patient_ends: bool = False) -> dict:
    """The communication of BitPipe's lowered plan (D = 4, N = 4) on the runtime's channel
    groups (built and warmed up by :meth:`PipelineGroups.build`), issued as the executor issues
    it — in plan order; a compute action waits for the receive of its input, a backward for
    the send of its forward's output, the end for every send — with one-element messages.
    ``batched``: each operation a ``batch_isend_irecv`` of its own (as the executor issues it);
    otherwise unbatched ``isend``/``irecv`` (an order that hangs on a GPU). In strict mode
    with ``patient_ends``, ranks 0 and 3 wait up to 60 s, so that ranks 1 and 2 report first."""
    import torch.distributed as dist

    from megatron_bitpipe.cpu import strict_p2p
    from megatron_bitpipe.execution.groups import ParallelGrid, PipelineGroups
    from megatron_bitpipe.schedules.actions import Action, ActionType
    from megatron_bitpipe.schedules.comm import Payload, transfer_of

    if patient_ends and dist.get_rank() in (0, 3) and strict_p2p.requested():
        strict_p2p.install(timeout_s=60)
    _enable()
    plan = ScheduleChoice("bitpipe").plan(4, 4)
    groups = PipelineGroups.build(ParallelGrid(pp=4), plan.placement)
    rank = groups.pp_rank
    pairs_after_set_up = strict_p2p.pair_communicators()

    def code(transfer) -> float:  # what the message carries: which message it is
        return float(transfer.microbatch * 1000 + transfer.src.rank * 100 + transfer.src.chunk * 10 + transfer.pipeline) + (
            0.5 if transfer.payload is Payload.GRADIENT else 0.0
        )

    def issue(kind, tensor, peer, group):
        if batched:
            return _batched(kind, tensor, peer, group)
        return (dist.isend if kind == "send" else dist.irecv)(tensor, peer, group=group)

    received, sends, wrong = {}, {}, []
    for action in plan.actions[rank]:
        if action.type.is_communication:
            transfer = transfer_of(plan.placement, rank, action)
            group = groups.channel_group(transfer)
            if action.type.is_send:
                message = torch.full((1,), code(transfer))
                sends[action.compute_key] = issue("send", message, groups.pp_global_rank(transfer.dst.rank), group)
            else:
                buffer = torch.zeros(1)
                work = issue("recv", buffer, groups.pp_global_rank(transfer.src.rank), group)
                received[transfer.consumer] = (work, buffer, code(transfer))
        elif action.type is not ActionType.SYNC:
            posted = received.pop(action.comm_key, None)
            if posted is not None:
                work, buffer, expected = posted
                work.wait()
                if buffer.item() != expected:
                    wrong.append(f"{action}: {buffer.item()} != {expected}")
            if action.type.computes_input_grad:
                send = sends.pop(Action(ActionType.FORWARD, action.chunk, action.microbatch), None)
                if send is not None:  # (a gloo send's work must be waited for once only)
                    send.wait()
    for work in sends.values():
        work.wait()
    return {
        "pairs_after_set_up": pairs_after_set_up,
        "pairs": strict_p2p.pair_communicators(),
        "wrong": wrong,
        "left": sorted(map(str, received)),
    }


def test_bitpipes_old_unbatched_pattern_hangs_in_pair_communicator_creation():
    """Unbatched ``isend``/``irecv`` on the channel groups — what hung BitPipe on a GPU, and
    what :data:`~megatron_bitpipe.schedules.nccl.LAZY_UNBATCHED_RULES` models — fails in strict
    mode, in the creation of a pair's communicator: ranks 1 and 2, each creating the pair's
    communicator of a different channel group, wait for each other — the model's cycle."""
    cycle = check_nccl(ScheduleChoice("bitpipe").plan(4, 4), LAZY_UNBATCHED_RULES).cycle
    assert [link.split(" creates ")[0] for link in cycle] == ["rank 1", "rank 2"]
    assert all("pair 1-2" in link for link in cycle)
    started = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        launch(_replay_bitpipe, 4, False, True, timeout=150, env={**STRICT, "MEGATRON_BITPIPE_STRICT_P2P_TIMEOUT": "5"})
    text = str(failure.value)
    assert failure.value.rank in (1, 2), text
    me, peer = failure.value.rank, 3 - failure.value.rank
    assert re.search(
        rf"strict p2p: rank {me} waited 5 s {CREATION} with rank {peer} on group \[0, 1, 2, 3\] \(process group \d+\), "
        rf"for its first unbatched (send to|recv from) rank {peer} .* rank {peer} has not reached its first unbatched",
        text,
    ), text
    assert time.monotonic() - started < 120


@pytest.mark.parametrize("batched, env", [(True, STRICT), (False, PLAIN)], ids=["batched_strict", "unbatched_plain_gloo"])
def test_bitpipes_runtime_pattern_batched_after_warm_up_completes(batched, env):
    """The executor's pattern (one-op ``batch_isend_irecv`` on groups warmed up at set-up)
    completes in strict mode, with every message where it belongs; plain gloo also runs the
    unbatched one (the hang needs the mode to show)."""
    facts = launch(_replay_bitpipe, 4, batched, timeout=180, env=env)
    for rank_facts in facts:
        assert rank_facts["wrong"] == [] and rank_facts["left"] == []
        assert rank_facts["pairs_after_set_up"] == []  # the warm-up is batched
        assert rank_facts["pairs"] == []


# ------------------------------------------------------------------ a group's communicator at its first use

FIRST_USE = "the two ranks reach these groups' first collectives in different orders"


def _reordered_first_collectives(reordered: bool) -> dict:
    """2 ranks, groups ``a`` and ``b`` of both. Rank 0 starts an all-reduce on ``a``, then one
    on ``b``; rank 1 on ``b`` first when ``reordered``. Each group's collectives match, so gloo
    runs both orders; NCCL creates each group's communicator at its first collective, a
    rendezvous of both ranks, so the reordered one hangs there."""
    import torch.distributed as dist

    from megatron_bitpipe.cpu import strict_p2p

    _enable()
    rank = dist.get_rank()
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    order = [("a", a), ("b", b)] if rank == 0 or not reordered else [("b", b), ("a", a)]
    tensors = {name: torch.full((2,), float(rank + 1)) for name, _ in order}
    for work in [dist.all_reduce(tensors[name], group=group, async_op=True) for name, group in order]:
        work.wait()
    return {"sums": {name: t.tolist() for name, t in tensors.items()}, "created": strict_p2p.created_communicators()}


def test_groups_first_collectives_in_different_orders_fail_at_once_naming_both_groups():
    started = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        launch(_reordered_first_collectives, 2, True, timeout=60, env={**STRICT, "MEGATRON_BITPIPE_STRICT_P2P_TIMEOUT": "30"})
    text = str(failure.value)
    assert re.search(
        r"strict p2p: rank (\d) creates the communicator of group \[0, 1\] \(process group \d+\) for its first all_reduce "
        r"there, while rank (\d) creates the one of group \[0, 1\] \(process group \d+\) for its first all_reduce there, "
        r"which waits for rank \1: " + re.escape(FIRST_USE),
        text,
    ), text
    assert time.monotonic() - started < 25  # at once, not after the 30 s bound


@pytest.mark.parametrize("reordered, env", [(False, STRICT), (True, PLAIN)], ids=["one_order_strict", "reordered_plain_gloo"])
def test_groups_first_collectives_in_one_order_or_without_the_mode_complete(reordered, env):
    facts = launch(_reordered_first_collectives, 2, reordered, timeout=60, env=env)
    assert all(f["sums"] == {"a": [3.0, 3.0], "b": [3.0, 3.0]} for f in facts)
    if env is STRICT:
        assert all([0, 1] in f["created"] for f in facts)


# ------------------------------------------------------------------ megatron-core's schedules

MEGATRON_CASES = [
    Case("1f1b_pp4_batch_p2p", pp=4, batch_p2p=True),
    Case("1f1b_pp4_unbatched_p2p", pp=4),
    Case("interleaved_pp4_vp2_overlap_p2p", pp=4, vp=2, overlap_p2p=True),
]


def _strict_cases(cases, initial) -> dict:
    """On a rank: ``test_cpu_compat``'s training of ``cases``; and which groups ran strict."""
    from megatron_bitpipe.cpu import strict_p2p

    records = _run_cases(cases, initial)
    return {
        "records": records,
        "installed": strict_p2p.is_installed(),
        "strict_groups": strict_p2p.strict_groups(),
        "pairs": strict_p2p.pair_communicators(),
    }


def test_megatron_schedules_run_and_equal_single_process_training_under_strict_mode():
    reference_case = MEGATRON_CASES[0].reference
    assert all(case.reference == reference_case and case.exact for case in MEGATRON_CASES)
    reference = launch(_run_cases, 1, [reference_case], {}, timeout=120)[0][0]
    per_rank = launch(
        _strict_cases, 4, MEGATRON_CASES, {reference_case: reference["initial"]}, timeout=300, env=STRICT
    )
    assert all(r["installed"] for r in per_rank)
    assert all(r["strict_groups"] for r in per_rank), "no point-to-point ran in strict mode"
    # unbatched p2p on the 4-rank pipeline groups ran on the neighbours' pair communicators
    # (the interleaved schedule's last stage of a chunk hands over to rank 0: a ring)
    for rank, r in enumerate(per_rank):
        expected = {tuple(sorted((rank, (rank + step) % 4))) for step in (-1, 1)}
        assert {tuple(pair) for ranks, pair in r["pairs"] if ranks == [0, 1, 2, 3]} == expected, r["pairs"]
    for i, case in enumerate(MEGATRON_CASES):
        records = [r["records"][i] for r in per_rank]
        for step in range(len(reference["losses"])):
            losses = [loss for r in records for loss in r["losses"][step]]
            assert losses == reference["losses"][step], (case.name, step)
            actual = _merged(records, "weights", step)
            assert actual.keys() == reference["weights"][step].keys()
            for name, expected in reference["weights"][step].items():
                assert torch.equal(actual[name], expected), (case.name, step, name)
