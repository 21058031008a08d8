"""Strict p2p mode (``MEGATRON_BITPIPE_STRICT_P2P=1``): gloo point-to-point under NCCL's rules.

On gloo ranks, with and without the mode, so that each rule is shown to change what a CPU run
lets through (:mod:`megatron_bitpipe.cpu.strict_p2p`):

* a send completes only once its receive is *active* — posted and at the head of the peer's
  operations on that group (plain gloo completes it as soon as the receive is posted);
* a group runs a rank's operations in issue order, groups are independent;
* the classic NCCL deadlock (two ranks send to each other, unbatched, then receive) fails after
  the bound, naming rank, group and operation, while the same exchange in one
  ``batch_isend_irecv`` completes (plain gloo completes both);
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


def _send_behind_a_blocked_receive() -> dict:
    """3 ranks, one group. Rank 1 posts a receive from rank 2 (which sends only later), then
    the receive from rank 0; rank 0 sends to rank 1. Returns whether rank 0's send completed
    while rank 1's receive for it was posted but not at the head of its operations."""
    import torch.distributed as dist

    log = _enable()
    rank = dist.get_rank()
    group = dist.new_group([0, 1, 2])
    facts = {"log": log}
    if rank == 0:
        send = dist.isend(torch.arange(4.0), 1, group=group)
        facts["is_completed_at_once"] = send.is_completed()
        waiter = _Waiter(send)
        dist.barrier()  # rank 1 has posted both receives
        facts["completed_early"] = waiter.returns_within(WATCH_S)
        dist.barrier()  # rank 2 sends
        waiter.join()
        facts["completed"] = send.is_completed()
    elif rank == 1:
        first, second = torch.zeros(2), torch.zeros(4)
        works = [dist.irecv(first, 2, group=group), dist.irecv(second, 0, group=group)]
        dist.barrier()
        dist.barrier()
        for work in works:
            work.wait()
        facts["received"] = (first.tolist(), second.tolist())
    else:
        dist.barrier()
        dist.barrier()
        dist.send(torch.ones(2), 1, group=group)
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
    """3 ranks, groups ``g`` and ``h``. Rank 1 posts a receive from rank 2 on ``g`` (rank 2
    sends later), then a send to rank 0 on ``g``, then one on ``h``. Returns which sends and
    receives completed before rank 2 sent."""
    import torch.distributed as dist

    _enable()
    rank = dist.get_rank()
    g = dist.new_group([0, 1, 2])
    h = dist.new_group([0, 1, 2])
    facts: dict = {}
    if rank == 0:
        on_g, on_h = torch.zeros(3), torch.zeros(3)
        recv_g, recv_h = dist.irecv(on_g, 1, group=g), dist.irecv(on_h, 1, group=h)
        dist.barrier()
        recv_h.wait()  # the other group progresses
        waiter = _Waiter(recv_g)
        facts["g_completed_early"] = waiter.returns_within(WATCH_S)
        dist.barrier()
        waiter.join()
        facts["received"] = (on_g.tolist(), on_h.tolist())
    elif rank == 1:
        blocked = dist.irecv(torch.zeros(1), 2, group=g)
        send_g = dist.isend(torch.full((3,), 7.0), 0, group=g)
        send_h = dist.isend(torch.full((3,), 8.0), 0, group=h)
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
        dist.send(torch.zeros(1), 1, group=g)
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
    return {"records": records, "installed": strict_p2p.is_installed(), "strict_groups": strict_p2p.strict_groups()}


def test_megatron_schedules_run_and_equal_single_process_training_under_strict_mode():
    reference_case = MEGATRON_CASES[0].reference
    assert all(case.reference == reference_case and case.exact for case in MEGATRON_CASES)
    reference = launch(_run_cases, 1, [reference_case], {}, timeout=120)[0][0]
    per_rank = launch(
        _strict_cases, 4, MEGATRON_CASES, {reference_case: reference["initial"]}, timeout=300, env=STRICT
    )
    assert all(r["installed"] for r in per_rank)
    assert all(r["strict_groups"] for r in per_rank), "no point-to-point ran in strict mode"
    for i, case in enumerate(MEGATRON_CASES):
        records = [r["records"][i] for r in per_rank]
        for step in range(len(reference["losses"])):
            losses = [loss for r in records for loss in r["losses"][step]]
            assert losses == reference["losses"][step], (case.name, step)
            actual = _merged(records, "weights", step)
            assert actual.keys() == reference["weights"][step].keys()
            for name, expected in reference["weights"][step].items():
                assert torch.equal(actual[name], expected), (case.name, step, name)
