"""The simulator's memory per rank against what a CPU run measures (tests/schedules/memory_support.py):
a small GPT (h 64, 4 heads, s 32, micro-batch 2, vocabulary 256, fp32, Adam, dropout 0,
megatron-core's local layers: unfused attention) trained one step on 2 gloo ranks.

Parameters, gradients and optimizer state per rank equal the model's exactly (with the
distributed optimizer, sharded over BitPipe's two replicas, the optimizer state within 1%:
megatron pads its shards); the peak of the
saved activations is within :data:`ACTIVATION_RATIO` of the simulated peak
(``memory_bytes[rank]["activations"]``) — the measured ratios are printed (``pytest -s``) and
stated in docs/balanced_stages.md.
"""

from __future__ import annotations

import pytest

from megatron_bitpipe.cpu.launcher import launch
from megatron_bitpipe.schedules import CostModel, ScheduleChoice
from megatron_bitpipe.schedules.layer_split import StageLayers
from megatron_bitpipe.schedules.memory import TrainingMemory
from megatron_bitpipe.schedules.model_shape import ModelShape
from megatron_bitpipe.schedules.model_step import simulate_model

from .memory_support import HEADS, HIDDEN, MICRO_BATCH, SEQ, VOCAB, measure_step

#: measured / simulated peak activations must lie in this range
ACTIVATION_RATIO = (0.95, 1.05)
N = 4
#: (schedule, split backward, layers per stage, tied embeddings, distributed optimizer)
RUNS = {
    "bitpipe_split_uneven_tied": ("bitpipe", True, (3, 1, 1, 1), True, False),
    "zbv_layout_untied": ("zbv", False, (0, 2, 3, 1), False, False),
    "bitpipe_distributed_optimizer": ("bitpipe", False, (1, 2, 2, 1), False, True),
}

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(600)]


@pytest.mark.parametrize("name", RUNS)
def test_memory_per_rank_matches_a_cpu_run(name):
    schedule, split, counts, tied, distributed = RUNS[name]
    runs = launch(measure_step, 2, schedule, split, 2, counts, N, tied, distributed, timeout=300)
    measured = sorted(runs, key=lambda r: r["pp_rank"])
    model = ModelShape(num_layers=sum(counts), hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
                       vocab_size=VOCAB, micro_batch_size=MICRO_BATCH, untie_embeddings_and_output_weights=not tied,
                       attention_backend="local", hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    plan = ScheduleChoice(schedule, split).plan(2, N)
    training = TrainingMemory(distributed_optimizer=distributed)
    predicted = simulate_model(plan, CostModel(), model, training, StageLayers(counts)).memory
    for rank, (got, want) in enumerate(zip(measured, predicted)):
        assert (got["parameters"], got["gradients"]) == (want.parameters, want.gradients), rank
        if distributed:  # each shard of the two replicas' gradient-sync group, megatron's padding aside
            assert got["optimizer_state"] == pytest.approx(want.optimizer_state, rel=0.01), rank
        else:
            assert got["optimizer_state"] == want.optimizer_state, rank
        ratio = got["activations"] / want.activations
        print(f"{name} rank {rank}: optimizer state measured {got['optimizer_state']} B, simulated {want.optimizer_state:.0f} B; "
              f"activations measured {got['activations']} B, simulated {want.activations:.0f} B, ratio {ratio:.3f}")
        assert ACTIVATION_RATIO[0] <= ratio <= ACTIVATION_RATIO[1], (rank, ratio)
