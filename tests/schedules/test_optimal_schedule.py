"""BitPipe's and Chimera's generated orders are the shortest possible on their placements at
N = D (exhaustive CP-SAT search over every order, scripts/optimal_schedule.py)."""

import os
import sys

import pytest

pytest.importorskip("ortools")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

from optimal_schedule import main, optimal_makespan  # noqa: E402

from megatron_bitpipe.schedules import CostModel, generate  # noqa: E402


@pytest.mark.parametrize("schedule", ["bitpipe", "chimera"])
def test_generated_order_is_optimal_at_n_equal_d(schedule):
    result = optimal_makespan(generate(schedule, 4, 4), t_forward=1, t_backward=2, memory_cap=4)
    assert result.status == "OPTIMAL"
    assert result.generator_makespan == result.optimal_makespan == result.lower_bound


def test_memory_cap_constrains_the_search():
    # one Ma in flight per rank forbids overlapping micro-batches: longer than the optimum
    # without a cap
    capped = optimal_makespan(generate("bitpipe", 4, 4), t_forward=1, t_backward=2, memory_cap=1)
    assert capped.optimal_makespan > 14


def test_cli_rejects_bad_input():
    with pytest.raises(SystemExit) as exit_info:
        main(["--schedule", "bitpipe", "--pipeline-model-parallel-size", "3", "--num-microbatches", "4"])
    assert exit_info.value.code == 2


def test_cli_prints_json(capsys):
    assert main(["--schedule", "bitpipe", "--pipeline-model-parallel-size", "4", "--num-microbatches", "4"]) == 0
    assert '"optimal_makespan": 14.0' in capsys.readouterr().out


def test_message_costs_make_the_memory_bound_the_optimum():
    """Split backward, a message at 0.1 t_F: no order on BitPipe's placement beats
    3N + (D/2-1)(t_F/2 + t_p2p) + (2D-2) t_p2p = 13.2 t_F at D = N = 4 (docs/schedules.md)."""
    plan = generate("bitpipe", 4, 4, split_backward=True,
                    costs=CostModel(t_forward=10, t_backward=20, t_weight=10, t_p2p=1))
    result = optimal_makespan(plan, t_forward=10, t_backward=20, t_weight=10, t_p2p=1)
    assert result.status == "OPTIMAL"
    assert result.optimal_makespan == result.lower_bound == 132
    assert 132 <= result.generator_makespan <= 137
