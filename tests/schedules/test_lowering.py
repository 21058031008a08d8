"""Communication in the plan: lowering, its validation and timing, and the executor running it.

``plan_fingerprints.json`` holds, for every schedule x D in {2, 4, 8, 16} x N in {D, 2D, 4D} x
{training, split backward (placed for the default costs, and up to D = 8 for 0.1 t_F per
message), forward only}, a hash of the generator's per-rank compute order and the simulated
makespan at free and at costly communication of the compute-only plan (communication implied
by the placement). Lowering must leave every compute order and makespan unchanged. After an
intended change of a generator, rewrite the file with ``python -m tests.schedules.test_lowering`` and
review the diff.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import subprocess
import sys
from typing import List

import pytest

from megatron_bitpipe.schedules import CostModel, PlanError, generate, lower, simulate, validate_plan
from megatron_bitpipe.schedules.actions import Action, ActionType, SchedulePlan
from megatron_bitpipe.schedules.comm import received_by, sent_by

from ..equivalence_support import Case, assert_equals_reference, pipeline, run_references  # noqa: F401 - run_references: conftest

FINGERPRINTS = pathlib.Path(__file__).with_name("plan_fingerprints.json")
COSTS = {"free": CostModel(), "p2p": CostModel(t_p2p=0.1, t_sync=0.5)}
MODES = ("train", "split", "split-p2p", "forward")
#: the schedules whose plans ``plan_fingerprints.json`` holds
FINGERPRINTED = ("1f1b", "interleaved", "chimera", "bitpipe")
F, B, SYNC = ActionType.FORWARD, ActionType.BACKWARD, ActionType.SYNC


def grid_plan(schedule: str, D: int, N: int, mode: str) -> SchedulePlan:
    return generate(schedule, D, N, forward_only=mode == "forward", split_backward=mode.startswith("split"),
                    costs=COSTS["p2p"] if mode == "split-p2p" else None)


def fingerprint(plan: SchedulePlan) -> list:
    """[hash of the per-rank compute order, makespan at free communication, makespan at 0.1 t_F per message]."""
    digest = hashlib.sha256(plan.compute_only().format().encode()).hexdigest()[:16]
    return [digest] + [simulate(plan, costs).makespan for costs in COSTS.values()]


def grid_keys(schedule: str, D: int):
    """(key, N, mode) of the grid's plans; the split backward placed for costly messages up to D = 8."""
    modes = [m for m in MODES if D <= 8 or m != "split-p2p"]
    return [(f"{schedule} D={D} N={N} {mode}", N, mode) for N in (D, 2 * D, 4 * D) for mode in modes]


@pytest.mark.parametrize("D", [2, 4, 8, 16])
@pytest.mark.parametrize("schedule", FINGERPRINTED)
def test_lowered_plans_keep_the_compute_order_and_makespans(schedule, D):
    reference = json.loads(FINGERPRINTS.read_text())
    for key, N, mode in grid_keys(schedule, D):
        plan = grid_plan(schedule, D, N, mode)
        assert plan.has_communication
        assert fingerprint(plan) == reference[key], key


# --- what lowering writes ---------------------------------------------------------------------------

@pytest.mark.parametrize("schedule,D,N", [("1f1b", 4, 8), ("interleaved", 4, 8), ("chimera", 4, 8), ("bitpipe", 4, 8),
                                          ("bitpipe", 2, 6)])
def test_every_message_is_sent_after_its_producer_and_received_before_its_consumer(schedule, D, N):
    for split in (False, True):
        plan = generate(schedule, D, N, split_backward=split)
        placement = plan.placement
        messages = 0
        for rank, actions in enumerate(plan.actions):
            compute = [a for a in actions if not a.type.is_communication]
            assert compute == list(plan.compute_only().actions[rank])
            for index, action in enumerate(actions):
                inp, out = received_by(placement, rank, action), sent_by(placement, rank, action)
                if inp is not None and not inp.is_local:
                    assert actions[index - 1] == inp.receive  # posted right before its consumer
                    assert actions.count(inp.receive) == 1
                    messages += 1
                if out is not None and not out.is_local:
                    assert actions[index + 1] == out.send  # sent right after its producer
                    assert actions.count(out.send) == 1
                if action.type.is_communication:
                    assert action.compute_key in {a.comm_key for a in compute}
        sends = sum(a.type.is_send for _, a in plan)
        assert sends == messages == sum(a.type.is_receive for _, a in plan) > 0


def test_v_turns_and_single_rank_plans_have_no_communication():
    plan = generate("bitpipe", 4, 4)
    # rank 3 turns pipeline A (chunk 0 -> chunk 2), rank 0 pipeline B (chunk 1 -> chunk 3)
    assert Action(ActionType.SEND_ACTIVATION, 0, 0) not in plan.actions[3]
    assert Action(ActionType.RECV_ACTIVATION, 2, 0) not in plan.actions[3]
    assert Action(ActionType.SEND_GRADIENT, 3, 2) not in plan.actions[0]
    hops = 2 * (2 * 4 - 2) * 4  # per micro-batch 2D - 2 cross-rank hops, forward and backward
    assert sum(a.type.is_send for _, a in plan) == hops
    assert not generate("1f1b", 1, 3).has_communication
    assert lower(plan) == plan and lower(plan.compute_only()) == plan


@pytest.mark.parametrize("lookahead", [1, 2, 5])
def test_receive_lookahead_posts_earlier_and_changes_no_timing(lookahead):
    for schedule, D, N in [("1f1b", 4, 8), ("interleaved", 2, 4), ("bitpipe", 4, 8), ("bitpipe", 2, 2)]:
        plan = generate(schedule, D, N, split_backward=True)
        early = lower(plan, receive_lookahead=lookahead)
        validate_plan(early)
        assert early.compute_only() == plan.compute_only()
        for costs in COSTS.values():
            assert simulate(early, costs).makespan == simulate(plan, costs).makespan
        for actions in early.actions:
            compute = [a for a in actions if not a.type.is_communication]
            for index, action in enumerate(actions):
                if action.type.is_receive:
                    consumer = next(i for i, a in enumerate(compute) if a.comm_key == action.compute_key)
                    before = sum(not a.type.is_communication for a in actions[:index])
                    assert before == max(0, consumer - lookahead)
    with pytest.raises(ValueError, match="--receive-lookahead"):
        lower(plan, receive_lookahead=-1)


def test_simulating_a_compute_only_plan_lowers_it():
    plan = generate("bitpipe", 4, 8, split_backward=True)
    for costs in COSTS.values():
        lowered, compute_only = simulate(plan, costs), simulate(plan.compute_only(), costs)
        assert lowered.events == compute_only.events and lowered.makespan == compute_only.makespan
        assert compute_only.plan == plan
    assert all(not e.action.type.is_communication for e in lowered.events)  # no zero-length blocks to draw


def test_a_send_is_timed_where_the_plan_issues_it():
    """Moving rank 0's SEND_F0.1 past its B0.0 delays micro-batch 1 on rank 1 by the B's time."""
    plan = generate("1f1b", 2, 2)
    actions = list(plan.actions[0])
    assert [str(a) for a in actions] == ["F0.0", "SEND_F0.0", "F0.1", "SEND_F0.1", "RECV_B0.0", "B0.0", "RECV_B0.1", "B0.1", "S0"]
    actions.insert(actions.index(Action(B, 0, 0)) + 1, actions.pop(actions.index(Action(ActionType.SEND_ACTIVATION, 0, 1))))
    late = replace_rank(plan, 0, actions)
    validate_plan(late)
    costs = CostModel(t_p2p=0.5)
    events = {(e.rank, str(e.action)): e for e in simulate(late, costs).events}
    assert events[(1, "F0.1")].ready == events[(0, "B0.0")].end + 0.5
    assert simulate(late, costs).makespan > simulate(plan, costs).makespan


# --- the validator catches broken communication ------------------------------------------------------

def replace_rank(plan: SchedulePlan, rank: int, actions) -> SchedulePlan:
    lists = list(plan.actions)
    lists[rank] = tuple(actions)
    return dataclasses.replace(plan, actions=tuple(lists))


def edited(plan: SchedulePlan, rank: int, edit) -> SchedulePlan:
    actions = list(plan.actions[rank])
    edit(actions)
    return replace_rank(plan, rank, actions)


def move(actions: List[Action], text: str, before: str) -> None:
    """Move action ``text`` to just before action ``before`` (or to the end for ``before=""``)."""
    item = actions.pop(actions.index(Action.parse(text)))
    actions.insert(actions.index(Action.parse(before)) if before else len(actions), item)


@pytest.mark.parametrize(
    "rank,edit,message",
    [
        (1, lambda a: a.remove(Action.parse("RECV_F0.1")), r"rank 1: F0\.1 needs the activation of micro-batch 1 from rank 0, but no RECV_F0\.1"),
        (0, lambda a: a.remove(Action.parse("SEND_F0.1")), r"rank 0: F0\.1 produces a message for rank 1 that no SEND_F0\.1 sends"),
        (1, lambda a: move(a, "SEND_B0.0", "B0.0"), r"rank 1, action SEND_B0\.0 \(position \d+\): sends before B0\.0"),
        (0, lambda a: move(a, "RECV_B0.1", "S0"), r"rank 0, action RECV_B0\.1 \(position \d+\): posted after its consumer B0\.1"),
        (0, lambda a: a.insert(0, Action.parse("RECV_F0.0")), r"rank 0: RECV_F0\.0 has no message to move \(it is a pipeline's end\)"),
        (0, lambda a: a.append(Action.parse("SEND_F0.1")), r"rank 0, action SEND_F0\.1 \(position 9\): repeats position 3"),
        (1, lambda a: a.insert(0, Action.parse("RECV_F0.2")), r"micro-batch outside"),
    ],
)
def test_validator_catches_missing_and_misplaced_communication(rank, edit, message):
    plan = generate("1f1b", 2, 2)
    with pytest.raises(PlanError, match=message):
        validate_plan(edited(plan, rank, edit))


def test_validator_catches_receives_posted_out_of_channel_order():
    """Rank 1 posts micro-batch 1's receive before micro-batch 0's: its consumers keep their
    order, but gloo and NCCL would match the first message (micro-batch 0) with it."""
    plan = generate("1f1b", 2, 2)
    swapped = edited(plan, 1, lambda a: move(a, "RECV_F0.1", "RECV_F0.0"))
    with pytest.raises(PlanError, match=r"activation channel of pipeline 0 from rank 0 to rank 1: message 0 is "
                                        r"micro-batch 0 \(SEND_F0\.0\) at the sender but rank 1 expects micro-batch 1 \(RECV_F0\.1\)"):
        validate_plan(swapped)
    simulate(swapped)  # the timing model alone would not notice


def test_validator_tells_apart_two_stages_on_one_channel():
    """Interleaved at D = 2: rank 0 sends stage 0's and stage 2's outputs of micro-batch 0 to
    rank 1 on one channel; posting chunk 1's receive first would swap the two tensors."""
    plan = generate("interleaved", 2, 2)
    assert Action.parse("RECV_F1.0") in plan.actions[1]
    swapped = edited(plan, 1, lambda a: move(a, "RECV_F1.0", "RECV_F0.0"))
    with pytest.raises(PlanError, match=r"message 0 is micro-batch 0 \(SEND_F0\.0\) at the sender but rank 1 "
                                        r"expects micro-batch 0 \(RECV_F1\.0\)"):
        validate_plan(swapped)


def test_deadlock_on_a_send_issued_too_late():
    """Rank 0 sends both activations only after its first backward, which waits for them."""

    def late_sends(actions):
        move(actions, "SEND_F0.0", "RECV_B0.1")
        move(actions, "SEND_F0.1", "RECV_B0.1")

    plan = edited(generate("1f1b", 2, 2), 0, late_sends)
    with pytest.raises(PlanError) as info:
        validate_plan(plan)
    text = str(info.value)
    assert "deadlock" in text
    assert "rank 1 at F0.0: waits for the activation of micro-batch 0 from rank 0 (F0.0), run but SEND_F0.0 not yet issued" in text
    assert "rank 0 at B0.0: waits for the gradient of micro-batch 0 from rank 1 (B0.0), not yet run" in text


def test_action_text_of_communication():
    for text in ("SEND_F0.3", "RECV_F2.11", "SEND_B1.0", "RECV_B3.7"):
        action = Action.parse(text)
        assert str(action) == text and action.type.is_communication
        assert action.compute_key.type in (F, B) and action.compute_key.microbatch == action.microbatch
    with pytest.raises(ValueError):
        Action.parse("SEND0.1")
    with pytest.raises(ValueError):
        Action.parse("RECV_F0")


@pytest.mark.multirank
def test_cli_prints_the_compute_order_or_the_lowered_plan():
    run = [sys.executable, "-m", "megatron_bitpipe.schedules", "plan", "--schedule", "1f1b", "-D", "2", "-N", "2"]
    compute = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    assert compute.splitlines()[1] == "rank 1: F0.0 B0.0 F0.1 B0.1 S0"
    lowered = subprocess.run(run + ["--communication"], capture_output=True, text=True, check=True).stdout
    assert lowered.splitlines()[1] == "rank 1: RECV_F0.0 F0.0 B0.0 SEND_B0.0 RECV_F0.1 F0.1 B0.1 SEND_B0.1 S0"
    early = subprocess.run(run + ["--communication", "--receive-lookahead", "2"], capture_output=True, text=True, check=True)
    assert early.stdout.splitlines()[1] == "rank 1: RECV_F0.0 RECV_F0.1 F0.0 B0.0 SEND_B0.0 F0.1 B0.1 SEND_B0.1 S0"
    bad = subprocess.run(run + ["--communication", "--receive-lookahead", "-1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--receive-lookahead" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


# --- the executor runs what the plan says -------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EarlyCase(Case):
    """A runtime case whose plans post every receive ``receive_lookahead`` actions early."""

    receive_lookahead: int = 1


CASES_2 = [
    EarlyCase("early2_bitpipe_pp2_n6_deallocate", "bitpipe", pp=2, n=6, deallocate_pipeline_outputs=True, receive_lookahead=2),
    EarlyCase("early3_split_bitpipe_pp2_n4", "bitpipe", pp=2, n=4, split_backward=True, receive_lookahead=3),
]
CASES_4 = [EarlyCase("early1_bitpipe_pp4_n8", "bitpipe", pp=4, n=8, receive_lookahead=1)]
CASES = CASES_2 + CASES_4


def run_cases(cases: List[EarlyCase]) -> dict:
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.execution import forward_backward

    enable_cpu_megatron()
    generated = forward_backward.PlanCache.plan  # a step function's validated plan of its choice
    out = {}
    for case in cases:
        served: List[SchedulePlan] = []

        def early(*args, case=case, served=served):
            plan = lower(generated(*args), receive_lookahead=case.receive_lookahead)
            validate_plan(plan)
            served.append(plan)
            return plan

        forward_backward.PlanCache.plan = early
        try:
            record = pipeline(case)
        finally:
            forward_backward.PlanCache.plan = generated
        record["ran_the_plan"] = record["eval_trace"] == [str(a) for a in served[-1].actions[record["pp_rank"]]]
        out[case.name] = record
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_receives_posted_early_train_like_one_process(case, references, launched):
    records = launched[case]
    assert all(r["ran_the_plan"] for r in records)
    assert_equals_reference(case, records, references[case.reference_key])


if __name__ == "__main__":
    entries = {
        key: fingerprint(grid_plan(schedule, D, N, mode))
        for schedule in FINGERPRINTED
        for D in (2, 4, 8, 16)
        for key, N, mode in grid_keys(schedule, D)
    }
    lines = [f"{json.dumps(key)}: {json.dumps(value)}" for key, value in sorted(entries.items())]
    FINGERPRINTS.write_text("{\n" + ",\n".join(lines) + "\n}\n")
