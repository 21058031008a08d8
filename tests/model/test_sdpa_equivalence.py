"""SDPA core attention (``--attention-backend sdpa``) trains like megatron-core's unfused
``DotProductAttention`` (CPU ranks, gloo, fp32, attention dropout 0).

* Plan executor layouts with SDPA layers equal single-process training of the stock model
  (unfused attention): every micro-batch's loss, every gradient, grad norm and weight after
  each step, evaluation losses (rtol 1e-5; :func:`equivalence_support.assert_equals_reference`):
  GPT BitPipe PP4, BitPipe PP4 with the split backward, TP2 with sequence parallelism (BitPipe
  PP2); BERT (padding mask) BitPipe PP2 and TP2 + SP.
* The scripts, single process: ``pretrain_gpt.py`` (plain and GQA) and ``pretrain_bert.py``
  log the same losses and grad norms with ``--attention-backend sdpa`` as with ``local``.
* Attention dropout 0.1 with SDPA: selective recompute of the core attention
  (``--recompute-granularity selective --recompute-modules core_attn``) replays the same
  dropout masks — bit for bit the same losses and grad norms as without recompute, same seed.
  (Which mask SDPA draws is its kernel's: on GPUs not the unfused path's; docs/running.md.)

One launch per world size serves the layout cases (``launched``, ``tests/conftest.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import pytest

from megatron_bitpipe.cpu.launcher import launch

from .bert_support import BertCase
from .bert_support import reference as bert_reference
from ..pretrain_support import assert_same_records, records, train_in_process
from ..equivalence_support import Case, assert_equals_reference, model_config, pipeline
from ..equivalence_support import reference as gpt_reference

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]
LAUNCH_TIMEOUT = 600


def _sdpa_spec(default_spec):
    from megatron_bitpipe.model.sdpa_attention import SdpaDotProductAttention, with_core_attention

    return with_core_attention(default_spec(model_config()), SdpaDotProductAttention)


@dataclass(frozen=True)
class SdpaCase(Case):
    def model_kwargs(self) -> dict:
        from megatron_bitpipe.model.chunks import default_gpt_layer_spec

        return dict(super().model_kwargs(), layer_spec=_sdpa_spec(default_gpt_layer_spec))


@dataclass(frozen=True)
class SdpaBertCase(BertCase):
    def model_kwargs(self) -> dict:
        from megatron_bitpipe.model.bert_model import default_bert_layer_spec

        return dict(super().model_kwargs(), layer_spec=_sdpa_spec(default_bert_layer_spec))


CASES = [
    SdpaCase("sdpa_bitpipe_pp4_n4", "bitpipe", pp=4, n=4),
    SdpaCase("sdpa_bitpipe_split_pp4_n4", "bitpipe", pp=4, n=4, split_backward=True),
    SdpaCase("sdpa_bitpipe_tp2_sp_pp2_n4", "bitpipe", pp=2, n=4, tp=2, sequence_parallel=True),
    SdpaBertCase("bert_sdpa_bitpipe_pp2_n4", "bitpipe", pp=2, n=4),
    SdpaBertCase("bert_sdpa_bitpipe_tp2_sp_pp2_n4", "bitpipe", pp=2, n=4, tp=2, sequence_parallel=True),
]


def _enable():
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.testing.fp32_cross_entropy import enable_fp32_cross_entropy_gradients

    enable_cpu_megatron()
    enable_fp32_cross_entropy_gradients()  # both sides: fp32 logit gradients (see test_bert_equivalence)


def run_cases(cases: List[Case]) -> dict:
    _enable()
    out = {}
    for case in cases:
        record = pipeline(case)
        record["core_attention"] = _core_attention_types(case)
        out[case.name] = record
    return out


def _core_attention_types(case) -> list:
    """The core attention class names the case's layer spec asks for (the pipeline records
    no modules)."""
    spec = case.model_kwargs()["layer_spec"]
    return [spec.submodules.self_attention.submodules.core_attention.__name__]


def run_references(keys) -> dict:
    """Stock models with megatron's unfused attention: GPT keys have 3 fields, BERT keys 4."""
    _enable()
    return {key: (gpt_reference(*key) if len(key) == 3 else bert_reference(*key)) for key in keys}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sdpa_layout_equals_unfused_single_process(case, references, launched):
    ranks = launched[case]
    assert ranks[0]["core_attention"] == ["SdpaDotProductAttention"]
    assert_equals_reference(case, ranks, references[case.reference_key])


# ---------------------------------------------------------------- the scripts, single process

GPT = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "127", "--seed", "1234",
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--train-iters", "3", "--adam-eps", "1e-4",
    "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1",
]  # fmt: skip
BERT = [*GPT[:7], "32", *GPT[8:]]  # longer sequences: room for padding
SCRIPT_RUNS = {
    "gpt_local": ("gpt", [*GPT, "--attention-backend", "local"]),
    "gpt_sdpa": ("gpt", [*GPT, "--attention-backend", "sdpa"]),
    "gqa_local": ("gpt", [*GPT, "--group-query-attention", "--num-query-groups", "2", "--attention-backend", "local"]),
    "gqa_sdpa": ("gpt", [*GPT, "--group-query-attention", "--num-query-groups", "2", "--attention-backend", "sdpa"]),
    "bert_local": ("bert", [*BERT, "--attention-backend", "local"]),
    "bert_sdpa": ("bert", [*BERT, "--attention-backend", "sdpa"]),
    "dropout_sdpa": ("gpt", [*GPT, "--attention-dropout", "0.1", "--attention-backend", "sdpa"]),
    "dropout_sdpa_recompute": (
        "gpt",
        [*GPT, "--attention-dropout", "0.1", "--attention-backend", "sdpa", "--recompute-granularity", "selective", "--recompute-modules", "core_attn"],
    ),
    "dropout_local": ("gpt", [*GPT, "--attention-dropout", "0.1", "--attention-backend", "local"]),
}


@pytest.fixture(scope="module")
def script_records(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sdpa_scripts")
    for name, (task, argv) in SCRIPT_RUNS.items():  # one launch per run: a fresh process, as the script
        launch(train_in_process, 1, task, [*argv, "--log-json", str(out / f"{name}.jsonl")], timeout=300)
    return {name: records(out / f"{name}.jsonl") for name in SCRIPT_RUNS}


KEYS = {"gpt": ("lm_loss", "grad_norm", "validation_lm_loss"), "bert": ("lm_loss", "sop_loss", "grad_norm")}


@pytest.mark.parametrize("pair", [("gpt_local", "gpt_sdpa", "gpt"), ("gqa_local", "gqa_sdpa", "gpt"), ("bert_local", "bert_sdpa", "bert")], ids=lambda p: p[0])
def test_script_sdpa_logs_like_local(script_records, pair):
    local, sdpa, task = pair
    assert sorted(script_records[sdpa]) == [1, 2, 3]
    assert_same_records(script_records[sdpa], script_records[local], range(1, 4), KEYS[task])


def test_dropout_recompute_replays_the_mask(script_records):
    plain, recompute = script_records["dropout_sdpa"], script_records["dropout_sdpa_recompute"]
    assert_same_records(recompute, plain, range(1, 4), ("lm_loss", "grad_norm", "validation_lm_loss"), exact=True)
    assert plain[1]["lm_loss"] != script_records["gpt_sdpa"][1]["lm_loss"], "dropout 0.1 must change the loss"
    # Which mask SDPA draws is its kernel's business: torch's CPU math kernel happens to draw
    # the unfused path's [b, heads, s, s] mask from the same generator (dropout_local logs the
    # same here), GPU kernels draw their own; nothing is asserted about it (docs/running.md).
