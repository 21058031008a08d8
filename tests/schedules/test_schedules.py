"""Schedules as data: closed forms, the published BitPipe ordering, validity of every plan."""

from __future__ import annotations

import pytest

from megatron_bitpipe.schedules import REGISTRY, CostModel, generate, schedule_names, simulate, validate_plan
from megatron_bitpipe.schedules.actions import Action, ActionType, SchedulePlan
from megatron_bitpipe.schedules.comm import Payload, received_by, sent_by
from megatron_bitpipe.schedules.compose import one_f_one_b, with_eager_syncs
from megatron_bitpipe.schedules.placement import bidirectional_v, looped

SCHEDULES = schedule_names()
#: the peers whose own order splits every backward
ALWAYS_SPLIT = tuple(s for s in SCHEDULES if REGISTRY[s].always_split)

F, B = ActionType.FORWARD, ActionType.BACKWARD


def bubble(schedule, D, N, costs=None, **kw):
    plan = generate(schedule, D, N, **kw)
    validate_plan(plan)
    return simulate(plan, costs).bubble_ratio


# --- closed forms -----------------------------------------------------------------------

@pytest.mark.parametrize("D,N", [(2, 2), (4, 4), (4, 9), (8, 8), (8, 32), (16, 20)])
def test_1f1b_bubble(D, N):
    assert bubble("1f1b", D, N) == pytest.approx((D - 1) / (N + D - 1))


@pytest.mark.parametrize("D,N,v", [(2, 4, 2), (4, 4, 2), (4, 16, 2), (8, 16, 2), (8, 32, 2), (4, 8, 3)])
def test_interleaved_bubble(D, N, v):
    assert bubble("interleaved", D, N, virtual_size=v) == pytest.approx((D - 1) / (v * N + D - 1))


@pytest.mark.parametrize("D,N", [(2, 2), (4, 4), (4, 6), (8, 8), (8, 10), (8, 32), (16, 16)])
def test_chimera_bubble(D, N):
    # Chimera's published formula holds for equal forward and backward times ...
    assert bubble("chimera", D, N, CostModel(t_forward=1, t_backward=1)) == pytest.approx((D - 2) / (2 * N + D - 2))
    # ... and at t_B = 2 t_F its absolute bubble is 2 (D - 2) t_F.
    assert bubble("chimera", D, N) == pytest.approx(2 * (D - 2) / (3 * N + 2 * (D - 2)))


@pytest.mark.parametrize("D", [2, 4, 6, 8, 16])
@pytest.mark.parametrize("units", [1, 2, 4])
def test_bitpipe_bubble_constant_absolute(D, units):
    """(D-2)/(3N+D-2): the published value at N = D, kept by the steady state at N = kD."""
    N = units * D
    assert bubble("bitpipe", D, N) == pytest.approx((D - 2) / (3 * N + D - 2))


def test_bitpipe_published_table():
    """The published bubbles (Wu et al., 2024): BitPipe 14.3% (D=4,N=4), 20.0% (D=8,N=8); ours 5.9% at D=8,N=32."""
    assert round(100 * bubble("bitpipe", 4, 4), 1) == 14.3
    assert round(100 * bubble("bitpipe", 8, 8), 1) == 20.0
    assert round(100 * bubble("bitpipe", 8, 32), 1) == 5.9


@pytest.mark.parametrize("D", [4, 8, 16])
@pytest.mark.parametrize("N_of", [lambda D: D, lambda D: 2 * D, lambda D: 4 * D, lambda D: D + 2, lambda D: 3 * D + 2])
def test_bitpipe_no_worse_than_any_peer(D, N_of):
    N = N_of(D)
    ours = bubble("bitpipe", D, N)
    peers = [bubble("1f1b", D, N), bubble("chimera", D, N)]
    if N % D == 0:
        peers.append(bubble("interleaved", D, N))
        assert all(ours < p for p in peers)
    assert all(ours <= p + 1e-12 for p in peers)


def test_peak_activations():
    """BitPipe at N = D: edge ranks 3D/4 + 1/2 Ma, middle ranks D Ma; never above 1F1B's D Ma."""
    for D in (4, 8, 16):
        peaks = simulate(generate("bitpipe", D, D)).peak_activations
        assert peaks[0] == peaks[-1] == pytest.approx(3 * D / 4 + 0.5)
        assert max(peaks) == pytest.approx(D)
        for N in (2 * D, 4 * D):
            assert max(simulate(generate("bitpipe", D, N)).peak_activations) <= D
        assert simulate(generate("1f1b", D, 4 * D)).peak_activations[0] == pytest.approx(D)


# --- the published ordering at N = D ------------------------------------------------------

def published_bitpipe_order(D):
    """The BitPipe paper's per-rank order for one basic unit (N = D), built from its rules.

    Rank r runs W = 3D/2 + min(r, D-1-r) warm-up forwards, then one-forward-one-backward
    pairs, then the cool-down backwards. With u = D/2 and k = u - r (top half) or
    r - u + 1 (bottom half), the forward order walks the chunk that is fed first (k
    micro-batches), alternates with the other entry chunk, turns each arrival of the
    other pipeline at its V bottom, and ends with the returning chunk; the backward
    order mirrors it.
    """
    u = D // 2
    orders = []
    for r in range(D):
        top = r < u
        k = u - r if top else r - u + 1
        first_early, first_late = (0, 1) if top else (1, 0)
        second_early, second_late = (3, 2) if top else (2, 3)
        fwd = [(first_early, i) for i in range(k)]
        for i in range(u - k):
            fwd += [(first_late, i), (first_early, i + k)]
        for i in range(k):
            fwd += [(first_late, i + u - k), (second_early, i)]
        for i in range(u - k):
            fwd += [(second_late, i), (second_early, i + k)]
        fwd += [(second_late, i + u - k) for i in range(k)]
        bwd = [(second_late, i) for i in range(k)]
        for i in range(u - k):
            bwd += [(second_early, i), (second_late, i + k)]
        for i in range(k):
            bwd += [(second_early, i + u - k), (first_late, i)]
        for i in range(u - k):
            bwd += [(first_early, i), (first_late, i + k)]
        bwd += [(first_early, i + u - k) for i in range(k)]
        placement = bidirectional_v(D)

        def global_mb(chunk, i):
            return i if placement.role(r, chunk).pipeline == 0 else u + i

        fwd = [(c, global_mb(c, i)) for c, i in fwd]
        bwd = [(c, global_mb(c, i)) for c, i in bwd]
        orders.append(with_eager_syncs(one_f_one_b(fwd, bwd, 3 * D // 2 + min(r, D - 1 - r))))
    return orders


@pytest.mark.parametrize("D", [2, 4, 6, 8, 16])
def test_bitpipe_reproduces_published_ordering(D):
    plan = generate("bitpipe", D, D).compute_only()
    assert [list(a) for a in plan.actions] == published_bitpipe_order(D)


def test_bitpipe_d4_n4_timeline():
    """The paper's figure: 28 time units of a chunk forward, 24 of them busy on every rank."""
    result = simulate(generate("bitpipe", 4, 4), CostModel(t_forward=2, t_backward=4))
    assert result.makespan == 28
    assert result.busy == [24] * 4


# --- validity of every plan ----------------------------------------------------------------

def all_configs():
    for D in (1, 2, 3, 4, 6, 8):
        for N in range(D, 4 * D + 3):
            for schedule in SCHEDULES:
                if schedule in ALWAYS_SPLIT:  # the peers: tests/schedules/test_peer_schedules.py
                    continue
                if schedule in ("bitpipe", "chimera") and (D % 2 or N % 2):
                    continue
                if schedule == "interleaved":
                    if N % D == 0:
                        for v in (1, 2, 3):
                            yield schedule, D, N, v
                    continue
                yield schedule, D, N, None


def test_every_generated_plan_is_valid():
    count = 0
    for schedule, D, N, v in all_configs():
        for forward_only in (False, True):
            plan = generate(schedule, D, N, virtual_size=v, forward_only=forward_only)
            validate_plan(plan)
            count += 1
    assert count > 300


def test_microbatches_split_between_replicas():
    plan = generate("bitpipe", 4, 8)
    assert plan.microbatches_of_pipeline(0) == (0, 1, 2, 3)
    assert plan.microbatches_of_pipeline(1) == (4, 5, 6, 7)
    for rank, action in plan:
        if action.type is not ActionType.SYNC:
            assert plan.placement.role(rank, action.chunk).pipeline == plan.microbatch_pipeline[action.microbatch]


@pytest.mark.parametrize(
    "schedule,D,N,flag",
    [
        ("bitpipe", 3, 4, "--pipeline-model-parallel-size"),
        ("bitpipe", 4, 5, "--num-microbatches"),
        ("bitpipe", 4, 2, "--num-microbatches"),
        ("chimera", 4, 6 - 3, "--num-microbatches"),
        ("interleaved", 4, 6, "--num-microbatches"),
        ("1f1b", 4, 0, "--num-microbatches"),
        ("1f1b", 0, 3, "--pipeline-model-parallel-size"),
    ],
)
def test_bad_arguments_name_the_flag(schedule, D, N, flag):
    from megatron_bitpipe.schedules import ScheduleConfigError

    with pytest.raises(ScheduleConfigError, match=flag):
        generate(schedule, D, N)


# --- the validator catches planted errors -----------------------------------------------------

def replace_rank(plan: SchedulePlan, rank, actions) -> SchedulePlan:
    lists = list(plan.actions)
    lists[rank] = tuple(actions)
    return SchedulePlan(plan.name, plan.placement, plan.num_microbatches, plan.microbatch_pipeline, tuple(lists))


def planted(plan, rank, edit):
    actions = list(plan.actions[rank])
    edit(actions)
    return replace_rank(plan, rank, actions)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda a: a.remove(Action(F, 0, 1)), r"rank 1: missing F0\.1"),
        (lambda a: a.append(Action(F, 0, 1)), r"rank 1, action F0\.1 .*repeats"),
        (lambda a: a.insert(0, a.pop(a.index(Action(B, 0, 0)))), r"rank 1: B0\.0 at position 0 runs before F0\.0"),
        (lambda a: a.insert(0, a.pop(a.index(Action(ActionType.SYNC, 0)))), r"S0 issued before the chunk's last backward"),
        (lambda a: a.__setitem__(0, Action(F, 0, 9)), r"micro-batch outside"),
        (lambda a: a.__setitem__(0, Action(F, 3, 0)), r"rank has chunks 0\.\.0"),
    ],
)
def test_validator_structure_errors(edit, message):
    from megatron_bitpipe.schedules import PlanError

    with pytest.raises(PlanError, match=message):
        validate_plan(planted(generate("1f1b", 4, 4), 1, edit))


def test_validator_wrong_pipeline():
    from megatron_bitpipe.schedules import PlanError

    plan = generate("bitpipe", 4, 4)
    bad = planted(plan, 0, lambda a: a.__setitem__(a.index(Action(F, 0, 0)), Action(F, 0, 2)))
    with pytest.raises(PlanError, match=r"routed to pipeline 1"):
        validate_plan(bad)


def test_validator_channel_order():
    """Receiver consumes micro-batches 1, 0 while the sender sends 0, 1."""
    from megatron_bitpipe.schedules import PlanError

    plan = generate("1f1b", 2, 2).compute_only()
    swapped = [Action(F, 0, 1), Action(F, 0, 0), Action(B, 0, 0), Action(B, 0, 1), Action(ActionType.SYNC, 0)]
    with pytest.raises(PlanError, match=r"activation channel of pipeline 0 from rank 0 to rank 1: message 0 is micro-batch 0"):
        validate_plan(replace_rank(plan, 1, swapped))


def test_validator_deadlock_names_ranks_and_dependencies():
    from megatron_bitpipe.schedules import PlanError

    plan = generate("1f1b", 2, 2)
    plan = replace_rank(plan, 0, [Action(F, 0, 0), Action(B, 0, 0), Action(F, 0, 1), Action(B, 0, 1), Action(ActionType.SYNC, 0)])
    plan = replace_rank(plan, 1, [Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 0), Action(B, 0, 1), Action(ActionType.SYNC, 0)])
    with pytest.raises(PlanError) as info:
        validate_plan(plan)
    text = str(info.value)
    assert "deadlock" in text
    assert "rank 0 at B0.0: waits for the gradient of micro-batch 0 from rank 1 (B0.0)" in text
    assert "rank 1 at F0.1: waits for the activation of micro-batch 1 from rank 0 (F0.1)" in text


# --- communication and costs --------------------------------------------------------------------

def test_v_turn_is_local_and_d2_channels_are_distinct():
    placement = bidirectional_v(2)
    turn = sent_by(placement, 1, Action(F, 0, 0))  # stage 1 -> stage 2, both on rank 1
    assert turn.is_local and turn.dst.chunk == 2
    a_act = sent_by(placement, 0, Action(F, 0, 0))
    b_grad = sent_by(placement, 0, Action(B, 1, 1))
    assert a_act.channel != b_grad.channel and (a_act.src.rank, a_act.dst.rank) == (b_grad.src.rank, b_grad.dst.rank)
    assert received_by(placement, 0, Action(F, 0, 0)) is None  # first stage reads data
    assert received_by(placement, 0, Action(B, 2, 0)) is None  # loss stage
    assert received_by(placement, 0, Action(B, 0, 0)).payload is Payload.GRADIENT


def test_costs_p2p_and_sync():
    plan = generate("1f1b", 4, 4)
    base = simulate(plan).makespan
    # Every hop of the first micro-batch's forward and backward chain pays the latency.
    assert simulate(plan, CostModel(t_p2p=0.5)).makespan >= base + 2 * 3 * 0.5
    assert CostModel(t_p2p=0.1, p2p_bytes=100, p2p_bandwidth=1000).message_time == pytest.approx(0.2)
    # 1F1B: the only all-reduce starts after the last backward of rank 0 and is not hidden.
    assert simulate(plan, CostModel(t_sync=1.5)).makespan == pytest.approx(base + 1.5)
    # BitPipe: edge ranks finish chunks early, their all-reduces overlap the remaining compute.
    bp = generate("bitpipe", 4, 8)
    assert simulate(bp, CostModel(t_sync=1.0)).makespan < simulate(bp).makespan + 4 * 0.5
    with pytest.raises(ValueError, match="t_p2p"):
        CostModel(t_p2p=-1)


def test_action_text_roundtrip():
    for text in ("F0.3", "B2.11", "S1"):
        assert str(Action.parse(text)) == text
    with pytest.raises(ValueError):
        Action(ActionType.SYNC, 0, 3)


def test_looped_placement_matches_megatron_order():
    placement = looped(4, 2)
    assert [(loc.rank, loc.chunk) for loc in placement.stages[0]] == [(s % 4, s // 4) for s in range(8)]
    assert placement.stage_weight == 0.5


# --- the schedule choice ---------------------------------------------------------------------

def test_schedule_choice_label_is_the_one_spelling_of_a_variant():
    from megatron_bitpipe.schedules import ScheduleChoice

    split = ScheduleChoice("bitpipe", split_backward=True)
    assert split.label == "bitpipe+split-backward" == split.plan(4, 4).name
    assert ScheduleChoice.from_label(split.label) == split
    assert ScheduleChoice.from_label("chimera") == ScheduleChoice("chimera")
    assert generate("bitpipe", 4, 4, split_backward=True) == split.plan(4, 4)


def test_schedule_choice_reports_every_broken_rule_at_once():
    from megatron_bitpipe.schedules import ScheduleChoice, ScheduleConfigError

    problems = ScheduleChoice("bitpipe", virtual_size=2).problems(4, 5, 12)
    assert len(problems) == 3
    assert problems[0].startswith("--virtual-pipeline-model-parallel-size must not be set with bitpipe")
    assert "--num-microbatches = 5" in problems[1] and "even number" in problems[1]
    assert problems[2].startswith("--num-layers 12 must be divisible by 2 x --pipeline-model-parallel-size = 8")
    assert ScheduleChoice("bitpipe").problems(4, 8, 16) == []
    assert ScheduleChoice("bitpipe").problems(3, None, 12) == ["--pipeline-model-parallel-size must be even and >= 2 for bitpipe (got 3)"]
    source = "micro-batches per data-parallel rank"
    assert ScheduleChoice("interleaved").problems(4, 6, microbatches=source)[0].startswith(f"{source} = 6:")
    with pytest.raises(ScheduleConfigError, match="; "):
        ScheduleChoice("chimera").plan(4, 3)
    [unknown] = ScheduleChoice("gpipe").problems(4, 4)
    assert unknown.startswith("--schedule: unknown schedule 'gpipe'; choose from 1f1b, interleaved, chimera, bitpipe")


@pytest.mark.parametrize("schedule,D,smallest", [("bitpipe", 4, 4), ("bitpipe", 8, 8), ("chimera", 2, 2), ("interleaved", 4, 4), ("1f1b", 4, 1)])
def test_smallest_number_of_microbatches_is_valid(schedule, D, smallest):
    from megatron_bitpipe.schedules import ScheduleChoice

    choice = ScheduleChoice(schedule)
    assert choice.smallest_num_microbatches(D) == smallest
    assert choice.problems(D, smallest) == []
    assert smallest == 1 or choice.problems(D, smallest - 1)
