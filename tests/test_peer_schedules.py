"""The zero-bubble and DualPipe peers as plans: published makespans, validity, argument rules."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_bitpipe.schedules import REGISTRY, CostModel, ScheduleConfigError, generate, schedule_names, simulate, validate_plan
from megatron_bitpipe.schedules import zbv
from megatron_bitpipe.schedules.actions import ActionType, make_plan
from megatron_bitpipe.schedules.compose import with_eager_syncs
from megatron_bitpipe.schedules.placement import v_shape

#: the peers whose own order splits every backward
ALWAYS_SPLIT = tuple(s for s in schedule_names() if REGISTRY[s].always_split)

SPLIT = CostModel(t_forward=1, t_backward=2, t_weight=1)  # I = W = 1 per device share
LATENCY = CostModel(t_forward=1, t_backward=2, t_weight=1, t_p2p=0.1)


@pytest.mark.parametrize(
    "schedule,D,N,makespan",
    [
        ("zb-h1", 4, 4, 15.0), ("zb-h1", 8, 8, 31.0), ("zb-h1", 8, 16, 55.0),
        ("zbv", 4, 4, 13.5), ("zbv", 8, 8, 27.5), ("zbv", 8, 16, 51.5),
        ("dualpipev", 8, 16, 51.5), ("dualpipe", 8, 16, 51.0),
    ],
)
def test_free_messages_reproduce_the_published_makespans(schedule, D, N, makespan):
    plan = generate(schedule, D, N, costs=SPLIT)
    validate_plan(plan)
    assert simulate(plan, SPLIT).makespan == pytest.approx(makespan)


@pytest.mark.parametrize(
    "schedule,D,N,makespan",
    [
        ("zb-h1", 4, 4, 16.0), ("zb-h1", 8, 16, 57.8), ("zb-h1", 16, 16, 68.8),
        ("zbv", 4, 8, 26.8), ("zbv", 8, 16, 54.8), ("zbv", 16, 64, 206.8),
        ("dualpipev", 4, 8, 26.8), ("dualpipev", 8, 16, 55.2), ("dualpipev", 16, 64, 208.0),
        ("dualpipe", 4, 8, 25.7), ("dualpipe", 8, 16, 52.7), ("dualpipe", 16, 64, 202.7),
    ],
)
def test_message_time_matches_the_published_orders(schedule, D, N, makespan):
    """At t_p2p = 0.1 t_F the orders give the makespans of the published implementations
    (for ZB-V at N >= 2D-1 the paper's order is the faster candidate)."""
    assert simulate(generate(schedule, D, N, costs=LATENCY), LATENCY).makespan == pytest.approx(makespan)


def test_zbv_below_2d_minus_1_beats_the_padded_paper_order():
    """The paper's order pads N up to 2D-1; the latency-aware V schedule does not."""
    ours = generate("zbv", 8, 8, costs=SPLIT)
    assert simulate(ours, SPLIT).makespan == pytest.approx(3 * 8 + 7 * 0.5)  # the V's bound
    padded = make_plan("zbv", v_shape(8), 8, [0] * 8, [with_eager_syncs(zbv.paper_rank_order(r, 8, 8)) for r in range(8)])
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
    kinds = {a.type for _, a in generate("dualpipe", 4, 8)}
    assert ActionType.BACKWARD in kinds and ActionType.BACKWARD_INPUT in kinds


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
