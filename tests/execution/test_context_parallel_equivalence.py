"""Context parallelism (each sequence split over ``cp`` ranks, SDPA core attention with the keys
and values all-gathered) under the plan executor equals single-process training at the full
sequence length (CPU ranks, gloo, fp32, strict p2p).

For every case: every micro-batch's loss (the report is the whole sequence's mean, the same on
every context-parallel rank), every gradient, the grad norm and every weight after each of STEPS
optimizer steps, and the evaluation losses, equal the stock single-process model (unfused
attention, the whole sequence on one rank; rtol 1e-5, :func:`equivalence_support.assert_equals_reference`):
CP 2 with BitPipe (plain and with the split backward), ZB-V, DualPipeV, 1F1B, ZB-H1, DualPipe,
Chimera and interleaved 1F1B (the plan, 2 chunks per rank) at PP 2; CP 2 x TP 2 with sequence
parallelism; CP 2 x DP 2 with the distributed optimizer; CP 4 at PP 1; GQA + RoPE + SwiGLU at
CP 2 x PP 2; activation recompute (full, uniform and block; selective, the core attention) at
CP 2 x PP 2 and CP 2 x TP 2 with sequence parallelism; uneven stages (a stage without
transformer layers included) at CP 2 x PP 2.
Each case also shows it ran as asked: checkpoints recomputed exactly where recompute is on,
every chunk holding its stage's layers. Every case runs on 4 ranks: one launch serves them all
(``launched``, ``tests/conftest.py``). The pure-Python checks of the split and the mask are in
``tests/model/test_context_parallel.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import pytest

from ..equivalence_support import NUM_LAYERS, Case, assert_equals_reference, model_config, pipeline

pytestmark = [pytest.mark.multirank, pytest.mark.strict_p2p]
LAUNCH_TIMEOUT = 900


@dataclass(frozen=True)
class CpCase(Case):
    """A GPT case on SDPA layers; ``gqa_rope``: 2 query groups of the 4 heads, RoPE, SwiGLU;
    ``ring``: the keys and values pass around the ring (``cp_comm_type="p2p"``) instead of the
    all-gather."""

    gqa_rope: bool = False
    recompute: Tuple[Tuple[str, object], ...] = ()  # TransformerConfig fields of activation recompute
    stage_layers: Tuple[int, ...] = ()  # transformer layers per stage in pipeline order (default: even)
    ring: bool = False

    @property
    def reference_key(self):
        return (self.tied, self.global_microbatches, self.clip_grad, self.gqa_rope)

    def config_overrides(self) -> dict:
        gqa = dict(num_query_groups=2) if self.gqa_rope else {}
        ring = dict(cp_comm_type="p2p") if self.ring else {}
        return dict(super().config_overrides(), **gqa, **ring, **dict(self.recompute))

    def model_kwargs(self) -> dict:
        from megatron_bitpipe.model.chunks import default_gpt_layer_spec
        from megatron_bitpipe.model.sdpa_attention import SdpaDotProductAttention, with_core_attention

        spec = with_core_attention(default_gpt_layer_spec(model_config()), SdpaDotProductAttention)
        from megatron_bitpipe.schedules.layer_split import StageLayers

        rope = dict(position_embedding_type="rope") if self.gqa_rope else {}
        uneven = dict(stage_layers=StageLayers(self.stage_layers)) if self.stage_layers else {}
        return dict(super().model_kwargs(), layer_spec=spec, **rope, **uneven)


def full(method: str, layers: int):
    return (("recompute_granularity", "full"), ("recompute_method", method), ("recompute_num_layers", layers))


def selective(*modules: str):
    return (("recompute_granularity", "selective"), ("recompute_modules", list(modules)))


CASES = [
    CpCase("cp2_bitpipe_pp2_n4", "bitpipe", pp=2, n=4, cp=2),
    CpCase("cp2_bitpipe_split_pp2_n4", "bitpipe", pp=2, n=4, cp=2, split_backward=True),
    CpCase("cp2_zbv_pp2_n4_untied", "zbv", pp=2, n=4, cp=2, tied=False),
    CpCase("cp2_dualpipev_pp2_n4", "dualpipev", pp=2, n=4, cp=2),
    CpCase("cp2_1f1b_pp2_n4_untied", "1f1b", pp=2, n=4, cp=2, tied=False),
    CpCase("cp2_tp2_sp_1f1b_pp1_n2", "1f1b", pp=1, n=2, cp=2, tp=2, sequence_parallel=True),
    CpCase("cp2_dp2_distopt_1f1b_pp1_n2", "1f1b", pp=1, n=2, cp=2, dp=2, distributed_optimizer=True),
    CpCase("cp4_1f1b_pp1_n4", "1f1b", pp=1, n=4, cp=4),
    CpCase("cp2_gqa_rope_swiglu_bitpipe_pp2_n4", "bitpipe", pp=2, n=4, cp=2, swiglu=True, gqa_rope=True),
    # the other plan schedules
    CpCase("cp2_zbh1_pp2_n4", "zb-h1", pp=2, n=4, cp=2),
    CpCase("cp2_dualpipe_pp2_n4_untied", "dualpipe", pp=2, n=4, cp=2, tied=False),
    CpCase("cp2_chimera_pp2_n4_untied", "chimera", pp=2, n=4, cp=2, tied=False),
    CpCase("cp2_interleaved_v2_pp2_n4", "interleaved", pp=2, n=4, cp=2),
    # activation recompute (full: uniform and block; selective: the core attention) and uneven stages
    CpCase("cp2_bitpipe_split_pp2_n4_full_uniform1", "bitpipe", pp=2, n=4, cp=2, split_backward=True, recompute=full("uniform", 1)),
    CpCase("cp2_zbv_pp2_n4_full_block1", "zbv", pp=2, n=4, cp=2, recompute=full("block", 1)),
    CpCase("cp2_1f1b_pp2_n4_selective", "1f1b", pp=2, n=4, cp=2, recompute=selective("core_attn")),
    CpCase("cp2_tp2_sp_1f1b_pp1_n2_full_uniform2", "1f1b", pp=1, n=2, cp=2, tp=2, sequence_parallel=True, recompute=full("uniform", 2)),
    CpCase("cp2_bitpipe_pp2_n4_uneven_3122", "bitpipe", pp=2, n=4, cp=2, stage_layers=(3, 1, 2, 2)),
    CpCase("cp2_zbv_pp2_n4_uneven_0332", "zbv", pp=2, n=4, cp=2, stage_layers=(0, 3, 3, 2)),
    CpCase("cp2_1f1b_pp2_n4_uneven_53_selective", "1f1b", pp=2, n=4, cp=2, stage_layers=(5, 3), recompute=selective("core_attn")),
]

# ---------------------------------------------------------------- the ring (--cp-comm-type p2p)
CASES += [
    CpCase("cp2_ring_bitpipe_pp2_n4", "bitpipe", pp=2, n=4, cp=2, ring=True),
    CpCase("cp4_ring_1f1b_pp1_n4", "1f1b", pp=1, n=4, cp=4, ring=True),
    CpCase("cp2_ring_gqa_rope_swiglu_dualpipev_pp2_n4", "dualpipev", pp=2, n=4, cp=2, swiglu=True, gqa_rope=True, ring=True),
]


def run_cases(cases: List[Case]) -> dict:
    """Each case's :func:`pipeline` record plus what shows its recompute and its stages ran as
    asked: ``recomputed`` (checkpoint recomputations in backward) and ``stage_layers``
    (``(pipeline, stage) -> transformer layers`` of every chunk this rank built)."""
    from megatron.core.tensor_parallel.random import CheckpointFunction
    from megatron.core.utils import unwrap_model

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.model import build

    enable_cpu_megatron()
    built, recomputed = [], []
    original_build, original_backward = build.build_pipeline_model, CheckpointFunction.backward

    def recorded_build(*args, **kwargs):
        built.append(original_build(*args, **kwargs))
        return built[-1]

    def counted_backward(ctx, *grads):
        recomputed.append(1)
        return original_backward(ctx, *grads)

    build.build_pipeline_model, CheckpointFunction.backward = recorded_build, staticmethod(counted_backward)
    out = {}
    try:
        for case in cases:
            built.clear()
            recomputed.clear()
            out[case.name] = pipeline(case)
            [model] = built
            out[case.name]["recomputed"] = len(recomputed)
            out[case.name]["stage_layers"] = {
                (spec.pipeline, spec.stage): len(unwrap_model(chunk).decoder.layers) for chunk, spec in zip(model.chunks, model.specs)
            }
    finally:
        build.build_pipeline_model, CheckpointFunction.backward = original_build, staticmethod(original_backward)
    return out


def run_references(keys) -> dict:
    """The stock model at the full sequence on one rank (megatron's unfused attention)."""
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.training.config import mlp_fields

    from ..equivalence_support import reference_training

    enable_cpu_megatron()
    out = {}
    for tied, microbatches, clip, gqa_rope in keys:
        extra = dict(num_query_groups=2, **mlp_fields(True)) if gqa_rope else {}
        rope = "rope" if gqa_rope else "learned_absolute"
        out[(tied, microbatches, clip, gqa_rope)] = reference_training(
            tied, microbatches, clip, model_config(**extra), position_embedding_type=rope
        )
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_context_parallel_equals_single_process_training(case, references, launched):
    assert_equals_reference(case, launched[case], references[case.reference_key])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_recompute_and_stages_ran_as_asked(case, launched):
    """Checkpoints were recomputed exactly in the recompute cases, and every chunk holds its
    stage's layers (the uneven counts where given), on every rank."""
    expected = case.stage_layers or (NUM_LAYERS // len(choice_placement(case).stages[0]),) * len(choice_placement(case).stages[0])
    for record in launched[case]:
        assert (record["recomputed"] > 0) == bool(case.recompute), record["recomputed"]
        assert record["stage_layers"] and all(expected[stage] == n for (_, stage), n in record["stage_layers"].items())
    held = set().union(*(record["stage_layers"] for record in launched[case]))
    assert {stage for _, stage in held} == set(range(len(expected))), held


def choice_placement(case: Case):
    from megatron_bitpipe import schedules

    return schedules.ScheduleChoice(case.schedule, case.split_backward).placement(case.pp)


# ---------------------------------------------------------------- the GPT script

SCRIPT = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "127", "--seed", "1234",
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--train-iters", "3", "--adam-eps", "1e-4", "--clip-grad", "1.0",
    "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1", "--attention-backend", "sdpa",
]  # fmt: skip


def test_script_bitpipe_cp2_pp2_logs_the_single_process_curve(tmp_path):
    """``pretrain_gpt.py --context-parallel-size 2 --pipeline-schedule bitpipe`` on 4 ranks (PP 2 x
    CP 2) logs the single process's losses, grad norms and validation loss (rtol 1e-5)."""
    from megatron_bitpipe.cpu.launcher import launch

    from ..pretrain_support import assert_same_records, records, train_in_process

    single, cp = tmp_path / "single.jsonl", tmp_path / "cp.jsonl"
    launch(train_in_process, 1, "gpt", [*SCRIPT, "--log-json", str(single)], timeout=300)
    parallel = ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"]
    launch(train_in_process, 4, "gpt", [*SCRIPT, *parallel, "--log-json", str(cp)], timeout=300)
    got, want = records(cp), records(single)
    assert sorted(got) == sorted(want) == [1, 2, 3]
    assert_same_records(got, want, range(1, 4), ("lm_loss", "grad_norm", "validation_lm_loss", "consumed_samples"))
