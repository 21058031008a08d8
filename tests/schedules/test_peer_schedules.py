"""The zero-bubble and DualPipe peers as plans: makespans (ZB-H1's published ones; ZB-V's of the
latency-aware order and of the paper's order), validity, argument rules."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_bitpipe.schedules import REGISTRY, CostModel, ScheduleConfigError, generate, schedule_names, simulate, validate_plan
from megatron_bitpipe.schedules import zbv
from megatron_bitpipe.schedules.list_scheduling import latency_aware_split
from megatron_bitpipe.schedules.actions import ActionType, make_plan
from megatron_bitpipe.schedules.compose import with_eager_syncs

#: the peers whose own order splits every backward
ALWAYS_SPLIT = tuple(s for s in schedule_names() if REGISTRY[s].always_split)

SPLIT = CostModel(t_forward=1, t_backward=2, t_weight=1)  # I = W = 1 per device share
LATENCY = CostModel(t_forward=1, t_backward=2, t_weight=1, t_p2p=0.1)


@pytest.mark.parametrize("D,N,makespan", [(4, 4, 15.0), (8, 8, 31.0), (8, 16, 55.0)])
def test_free_messages_reproduce_the_published_zb_h1_makespans(D, N, makespan):
    plan = generate("zb-h1", D, N, costs=SPLIT)
    validate_plan(plan)
    assert simulate(plan, SPLIT).makespan == pytest.approx(makespan)


@pytest.mark.parametrize(
    "D,N,latency_aware,paper", [(4, 4, 13.5, 15.0), (8, 8, 27.5, 31.0), (8, 16, 51.5, 51.5), (16, 16, 55.5, 63.0)]
)
def test_free_messages_zbv_latency_aware_order_and_paper_order(D, N, latency_aware, paper):
    """ZB-V with free messages: the latency-aware list schedule of the V's lock-step order
    reaches the V's bound ``3N + (D-1)/2``; the paper's order (padded to ``2D-1``
    micro-batches below that) reaches it from ``N >= 2D-1`` on. The generator yields the
    faster of the two."""
    lockstep = latency_aware_split(zbv.lockstep_plan(D, N), SPLIT, D, (D // 2, D))
    paper_plan = zbv.paper_plan(D, N)
    for plan in (lockstep, paper_plan):
        validate_plan(plan)
    assert simulate(lockstep, SPLIT).makespan == pytest.approx(latency_aware) == pytest.approx(3 * N + (D - 1) / 2)
    assert simulate(paper_plan, SPLIT).makespan == pytest.approx(paper)
    assert simulate(generate("zbv", D, N, costs=SPLIT), SPLIT).makespan == pytest.approx(min(latency_aware, paper))


@pytest.mark.parametrize(
    "schedule,D,N,makespan",
    [
        ("zb-h1", 4, 4, 16.0), ("zb-h1", 8, 16, 57.8), ("zb-h1", 16, 16, 68.8),
        ("zbv", 4, 8, 26.8), ("zbv", 8, 16, 54.8), ("zbv", 16, 64, 206.8),
        ("dualpipev", 4, 8, 28.7), ("dualpipev", 8, 16, 59.9), ("dualpipev", 16, 64, 224.3),
        ("dualpipe", 4, 8, 26.9), ("dualpipe", 8, 16, 56.3), ("dualpipe", 16, 64, 214.1),
    ],
)
def test_message_time_matches_the_published_orders(schedule, D, N, makespan):
    """At t_p2p = 0.1 t_F the orders give the makespans of the published implementations
    (for ZB-V at N >= 2D-1 the paper's order is the faster candidate; DualPipe's overlapped
    pairs send both outputs at their end, as DeepSeek's code issues them)."""
    assert simulate(generate(schedule, D, N, costs=LATENCY), LATENCY).makespan == pytest.approx(makespan)


def test_zbv_below_2d_minus_1_beats_the_padded_paper_order():
    """The paper's order pads N up to 2D-1; the latency-aware V schedule does not."""
    ours = generate("zbv", 8, 8, costs=SPLIT)
    assert simulate(ours, SPLIT).makespan == pytest.approx(3 * 8 + 7 * 0.5)  # the V's bound
    padded = zbv.paper_plan(8, 8)
    validate_plan(padded)
    assert simulate(padded, SPLIT).makespan == pytest.approx(31.0)


@pytest.mark.parametrize(
    "schedule,peak", [("zb-h1", 8), ("zbv", 8), ("dualpipev", 8.5), ("dualpipe", 9)]
)
def test_peak_activations(schedule, peak):
    for costs in (SPLIT, LATENCY):
        assert max(simulate(generate(schedule, 8, 32, costs=costs), costs).peak_activations) == pytest.approx(peak)


def test_plans_are_valid_and_always_split():
    for schedule in ALWAYS_SPLIT:
        for D in (2, 4, 6, 8):
            low = 2 * D if schedule.startswith("dualpipe") else D
            for N in range(low, 3 * D + 3):
                if schedule == "dualpipe" and N % 2:
                    continue
                for forward_only in (False, True):
                    plan = generate(schedule, D, N, forward_only=forward_only, split_backward=False)
                    validate_plan(plan)
                    kinds = {a.type for _, a in plan.compute_only()}
                    if forward_only:
                        assert kinds == {ActionType.FORWARD}
                    else:
                        assert ActionType.BACKWARD_INPUT in kinds and ActionType.BACKWARD_WEIGHT in kinds
                        assert plan.split_backward


def test_dualpipe_overlapped_pairs_keep_whole_backwards():
    """DualPipe's overlapped forward/backward pairs run whole backwards (B), its drain splits."""
    plan = generate("dualpipe", 4, 8)
    kinds = {a.type for _, a in plan}
    assert ActionType.BACKWARD in kinds and ActionType.BACKWARD_INPUT in kinds
    pairs = [a for actions in plan.actions for a in actions if a.type is ActionType.OVERLAP_F_B]
    assert pairs and {a.backward.type for a in pairs} == {ActionType.BACKWARD}


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_overlapped_pairs_where_published(schedule):
    """Steps 4 and 5 overlap every forward with a backward, except the first pair of step 4 on
    the middle ranks (DualPipeV: the last rank): 2(n-D+h+1) + (u-h-1) pairs on half rank h,
    with u = D/2 and n = N/2 for DualPipe, u = D and n = N for DualPipeV (h = r)."""
    D, N = 8, 24
    plan = generate(schedule, D, N)
    u, n = (D // 2, N // 2) if schedule == "dualpipe" else (D, N)
    for rank, actions in enumerate(plan.actions):
        h = min(rank, D - 1 - rank) if schedule == "dualpipe" else rank
        pairs = sum(a.type is ActionType.OVERLAP_F_B for a in actions)
        assert pairs == 2 * (n - 2 * u + h + 1) + (u - h - 1) - (h == u - 1), rank


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
@pytest.mark.parametrize("D", [4, 8, 16])
def test_published_dualpipe_bubble(schedule, D):
    """DeepSeek's bubble (PP/2-1)(F&B + B - 3W) per rank, with F&B = F + B (one device computes
    both halves of a pair), holds exactly at F = I = W (t_B = 2 t_F): PP = D for DualPipe; for
    DualPipeV PP = 2D stages of half a device share each. With W < F (the H100's 0.85 t_F)
    the W's fill more and the bubble is smaller."""
    PP, share = (D, 1.0) if schedule == "dualpipe" else (2 * D, 0.5)
    F, B, W = share * SPLIT.t_forward, share * SPLIT.t_backward, share * SPLIT.weight_time
    for N in (2 * D, 3 * D):
        result = simulate(generate(schedule, D, N, costs=SPLIT), SPLIT)
        work = N * (SPLIT.t_forward + SPLIT.t_backward)
        assert result.makespan - work == pytest.approx((PP / 2 - 1) * ((F + B) + B - 3 * W))
        assert result.busy == pytest.approx([work] * D)  # every rank's bubble is the same
    h100 = CostModel(t_forward=1, t_backward=2.02, t_weight=0.85)
    bubble = simulate(generate(schedule, D, 2 * D, costs=h100), h100).makespan - 2 * D * 3.02
    F, B, W = share, share * 2.02, share * 0.85
    assert 0 < bubble < (PP / 2 - 1) * ((F + B) + B - 3 * W)


def test_overlapped_pair_timing():
    """A pair starts once both halves' inputs arrived, computes t_F + t_B, and sends both
    outputs at its end. 1F1B on two ranks with rank 0's F0.2 overlapped with B0.0, messages 0.5:
    B0.0's gradient reaches rank 0 at 5, the pair runs [5, 8], F0.2's output reaches rank 1 at
    8.5; one after the other, F0.2 would run [2, 3] and the step end at 13 instead of 14."""
    from megatron_bitpipe.schedules import lower
    from megatron_bitpipe.schedules.actions import Action, overlapped
    from megatron_bitpipe.schedules.nccl import check_nccl
    from megatron_bitpipe.schedules.placement import looped

    costs = CostModel(t_forward=1, t_backward=2, t_p2p=0.5)
    rank_1 = [Action.parse(t) for t in "F0.0 B0.0 F0.1 B0.1 F0.2 B0.2".split()]
    sequential = [Action.parse(t) for t in "F0.0 F0.1 F0.2 B0.0 B0.1 B0.2".split()]
    pair = overlapped(Action.parse("F0.2"), Action.parse("B0.0"))
    paired = sequential[:2] + [pair] + sequential[4:]
    assert Action.parse(str(pair)) == pair and str(pair) == "F0.2&B0.0"
    plans = {name: make_plan("1f1b", looped(2, 1), 3, [0] * 3, [with_eager_syncs(a), with_eager_syncs(rank_1)])
             for name, a in (("paired", paired), ("sequential", sequential))}
    lowered = lower(plans["paired"])
    texts = [str(a) for a in lowered.actions[0]]
    at = texts.index("F0.2&B0.0")
    assert texts[at - 1: at + 2] == ["RECV_B0.0", "F0.2&B0.0", "SEND_F0.2"]
    validate_plan(lowered)
    assert check_nccl(lowered).ok
    result = simulate(plans["paired"], costs)
    events = {(e.rank, str(e.action)): e for e in result.events}
    assert (events[0, "F0.2&B0.0"].start, events[0, "F0.2&B0.0"].end) == (5.0, 8.0)
    assert events[1, "F0.2"].ready == 8.5
    assert result.makespan == 14.0 and simulate(plans["sequential"], costs).makespan == 13.0


def test_overlapped_pair_rules():
    from megatron_bitpipe.schedules import PlanError
    from megatron_bitpipe.schedules.actions import Action, overlapped
    from megatron_bitpipe.schedules.placement import looped

    with pytest.raises(ValueError, match="needs its own forward"):
        overlapped(Action.parse("F0.1"), Action.parse("B0.1"))
    with pytest.raises(ValueError, match="must be B or I"):
        overlapped(Action.parse("F0.1"), Action.parse("W0.0"))
    early = [overlapped(Action.parse("F0.0"), Action.parse("B0.1")), Action.parse("F0.1"), Action.parse("B0.0")]
    plan = make_plan("1f1b", looped(1, 1), 2, [0, 0], [with_eager_syncs(early)])
    with pytest.raises(PlanError, match="B0.1 at position 0 runs before F0.1"):
        validate_plan(plan)


def test_a_pair_waits_for_both_inputs_before_either_half():
    """Rank 0 pairs F0.1 with B0.0, but rank 1 sends B0.0's gradient only after F0.1: run one
    after the other this would finish; as a pair it deadlocks in the simulator and under NCCL's
    rules as the executor issues it (the pair waits for RECV_B0.0 before sending F0.1)."""
    from megatron_bitpipe.schedules import PlanError, lower
    from megatron_bitpipe.schedules.actions import Action, overlapped
    from megatron_bitpipe.schedules.nccl import check_nccl
    from megatron_bitpipe.schedules.placement import looped

    rank_1 = with_eager_syncs([Action.parse(t) for t in "F0.0 F0.1 B0.0 B0.1".split()])
    pair = overlapped(Action.parse("F0.1"), Action.parse("B0.0"))
    for rank_0, ok in (([Action.parse("F0.0"), *pair.parts, Action.parse("B0.1")], True),
                       ([Action.parse("F0.0"), pair, Action.parse("B0.1")], False)):
        plan = make_plan("1f1b", looped(2, 1), 2, [0, 0], [with_eager_syncs(rank_0), rank_1])
        assert check_nccl(lower(plan)).ok == ok
        if ok:
            validate_plan(plan)
        else:
            with pytest.raises(PlanError, match="rank 0 at B0.0: waits for the gradient"):
                validate_plan(plan)


@pytest.mark.parametrize(
    "schedule,D,N,flag",
    [
        ("dualpipe", 3, 6, "--pipeline-model-parallel-size"),
        ("dualpipe", 4, 6, "--num-microbatches"),
        ("dualpipe", 4, 9, "--num-microbatches"),
        ("dualpipev", 4, 7, "--num-microbatches"),
        ("zbv", 4, 3, "--num-microbatches"),
        ("zb-h1", 4, 3, "--num-microbatches"),
        ("zb-h1", 0, 3, "--pipeline-model-parallel-size"),
    ],
)
def test_bad_arguments_name_the_flag(schedule, D, N, flag):
    with pytest.raises(ScheduleConfigError, match=flag):
        generate(schedule, D, N)


def test_virtual_size_is_rejected_for_peers():
    with pytest.raises(ScheduleConfigError, match="--virtual-pipeline-model-parallel-size"):
        generate("zbv", 4, 8, virtual_size=2)


@pytest.mark.multirank
@pytest.mark.parametrize("schedule", ALWAYS_SPLIT)
def test_command_line_simulates_and_draws_every_peer(schedule, tmp_path):
    plot = tmp_path / "g.png"
    out = subprocess.run(
        [sys.executable, "-m", "megatron_bitpipe.schedules", "simulate", "--schedule", schedule, "-D", "4", "-N", "8",
         "--t-p2p", "0.1", "--json", "--plot", str(plot)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["schedule"] == schedule and summary["valid"]
    assert summary["makespan"] == pytest.approx(simulate(generate(schedule, 4, 8, costs=LATENCY), LATENCY).makespan)
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_runtime_cases_split_and_order_for_the_message_time():
    """The runtime cases' plans split backwards; a message time changes ZB-V's order."""
    free = generate("zbv", 4, 4).compute_only()
    timed = generate("zbv", 4, 4, costs=CostModel(t_p2p=0.2)).compute_only()
    assert free.actions != timed.actions
    for schedule, D, N in (("zbv", 2, 4), ("dualpipev", 4, 8), ("zb-h1", 4, 4), ("dualpipe", 4, 8)):
        assert generate(schedule, D, N).split_backward
