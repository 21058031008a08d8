"""HFTA (``--hfta-models``): a fused array of B GPTs trains each model exactly as its own run.

* Flags: the rules refuse what does not compose yet, naming the flags, before any process
  group exists (pure Python).
* Single process, fp32, B=3 with three learning rates and three seeds, Adam with weight decay
  and active clipping (``--clip-grad 0.5``, every model's norm is above it): model ``k``'s
  logged loss, gradients (as clipped) and weights after each of 3 steps, its grad norm and
  its validation loss equal the unfused run with ``--lr`` its rate starting from its seed's
  weights, on the same batches (rtol 1e-5).
* BitPipe over 4 pipeline ranks, with and without the split backward (the batched linears'
  weight gradients deferred to ``W``), and BitPipe over 2
  pipeline ranks x data parallelism 2 with full activation recompute, and tensor parallelism:
  TP2, TP2 with sequence parallelism (one launch of 2 ranks) and BitPipe TP2 x PP2 with the
  split backward: the fused array's losses, gradients, weights (tensor-parallel blocks
  gathered) and validation losses equal the single-process fused run.
* Checkpoints (``torch_dist``): a fused array resumed from its iteration-2 checkpoint logs
  iteration 3 bit for bit as the uninterrupted run (weights and per-model Adam state restored);
  model 1 extracted from the iteration-3 checkpoint (``scripts/hfta_extract.py``) and loaded by
  the training loop as an ordinary GPT has the fused array's model-1 validation loss. Across
  tensor-parallel sizes: the TP2 run's iteration-2 checkpoint resumed at TP1 (x DP2) trains
  iteration 3 as the single process does, and model 1 extracted from its iteration-3
  checkpoint has the array's model-1 validation loss.
* Logs: iteration events carry ``lm_losses`` (one per model), ``lm_loss`` (their mean),
  ``best_lm_loss`` and ``best_model``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch

from megatron_bitpipe.megatron_args import BitPipeConfigError
from megatron_bitpipe.training.arguments import parse_args

from .hfta_support import LRS, MODEL, checkpoint_records, extracted_validation, hfta_flags, reference_records, shared_directory, train_records

STEPS = 3
SWIGLU = ("--swiglu",)
RESUME_AT = 2
RTOL, ATOL = 1e-5, 1e-6
LAUNCH_TIMEOUT = 600


@dataclass(frozen=True)
class HftaCase:
    """``save_after``: iterations after which the case saves a checkpoint; ``load``: the case
    resumes from ``load``'s iteration-:data:`RESUME_AT` checkpoint (same launch) and trains the
    remaining steps."""

    name: str
    flags: tuple
    world_size: int = 4
    reference_key: str = "single"
    save_after: tuple = ()
    load: Optional[str] = None


CASES = [
    HftaCase("bitpipe_pp4", ("--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4")),
    HftaCase("bitpipe_split_pp4", ("--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4", "--split-backward")),
    HftaCase(
        "bitpipe_pp2_dp2_recompute",
        ("--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
         "--recompute-method", "uniform", "--recompute-num-layers", "1"),
    ),  # fmt: skip
    HftaCase("tp2", ("--tensor-model-parallel-size", "2"), world_size=2, save_after=(RESUME_AT, STEPS)),
    HftaCase("tp2_sp", ("--tensor-model-parallel-size", "2", "--sequence-parallel"), world_size=2),
    HftaCase("tp1_dp2_from_tp2", (), world_size=2, load="tp2"),
    HftaCase(
        "bitpipe_tp2_pp2_split",
        ("--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--split-backward"),
    ),
    # a gated MLP: linear_fc1's [gate; up] blocks per tensor-parallel rank (hfta/mlp.py)
    HftaCase("tp2_swiglu", ("--tensor-model-parallel-size", "2", *SWIGLU), world_size=2, reference_key="swiglu", save_after=(RESUME_AT, STEPS)),
    HftaCase("tp1_dp2_from_tp2_swiglu", SWIGLU, world_size=2, reference_key="swiglu", load="tp2_swiglu"),
]
TRAINED = [case for case in CASES if case.load is None]


def run_cases(cases: List[HftaCase]) -> dict:
    """Each case's records, with ``deferred``: how many batched GEMMs ran with their weight
    gradient deferred to ``W`` (the split backward)."""
    from megatron_bitpipe.hfta import layers

    deferred, apply = [0], layers._DeferredWeightGradBmm.apply

    def counted(*args):
        deferred[0] += 1
        return apply(*args)

    layers._DeferredWeightGradBmm.apply = counted
    out = {}
    with shared_directory() as root:
        for case in cases:
            before = deferred[0]
            argv = [*MODEL, *hfta_flags(), *case.flags]
            if case.save_after:
                argv += ["--save", f"{root}/{case.name}"]
            if case.load:
                argv += ["--load", f"{root}/{case.load}", "--ckpt-step", str(RESUME_AT)]
            out[case.name] = train_records(argv, STEPS - (RESUME_AT if case.load else 0), len(LRS), save_after=case.save_after)
            out[case.name]["deferred"] = deferred[0] - before
            if case.load:  # model 1 of the loaded run's final checkpoint, as an ordinary GPT
                out[case.name]["model1"] = extracted_validation(f"{root}/{case.load}", 1, f"{root}/{case.name}_model1", [*MODEL, *case.flags])
    return out


def run_references(keys) -> dict:
    """``single``: the fused array and each model's unfused run in one process, and the
    checkpoint records; ``swiglu``: the fused array with a gated MLP in one process."""
    import tempfile

    out = {}
    if "single" in keys:
        with tempfile.TemporaryDirectory() as root:
            checkpoints = checkpoint_records(root)
        out["single"] = dict(reference_records(STEPS), checkpoints=checkpoints)
    if "swiglu" in keys:
        out["swiglu"] = dict(fused=train_records([*MODEL, *hfta_flags(), *SWIGLU], STEPS, len(LRS)))
    return out


def _close(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {name}: {m}")


# ------------------------------------------------------------------------------ flags


def _problems(argv) -> str:
    with pytest.raises(BitPipeConfigError) as error:
        parse_args(None, [*MODEL, *argv], world_size=4, cuda_available=False)
    return str(error.value)


def test_flags_parse_into_settings():
    from megatron_bitpipe.hfta import hfta_settings

    args = parse_args(None, [*MODEL, "--lr", "1e-3", "--hfta-models", "2", "--hfta-lr", "1e-3,2e-4"], world_size=1, cuda_available=False)
    settings = hfta_settings(args)
    assert (settings.num_models, settings.lrs, settings.seeds) == (2, (1e-3, 2e-4), (1234, 1234))
    assert hfta_settings(parse_args(None, [*MODEL, "--lr", "1e-3"], world_size=1, cuda_available=False)) is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hfta-lr", "1e-3"], "--hfta-lr needs --hfta-models B"),
        (["--hfta-models", "3", "--hfta-lr", "1e-3,2e-3"], "--hfta-lr gives 2 values for --hfta-models 3"),
        (["--hfta-models", "2", "--hfta-seeds", "1"], "--hfta-seeds gives 1 values for --hfta-models 2"),
        (["--hfta-models", "2", "--hfta-lr", "1e-3,1e-6"], "--hfta-lr 1e-06 is below --min-lr 1e-05"),
        (["--hfta-models", "0"], "--hfta-models must be >= 1"),
        (
            ["--hfta-models", "2", "--tensor-model-parallel-size", "2", "--swiglu", "--use-distributed-optimizer"],
            "--hfta-models does not compose yet with: --use-distributed-optimizer",
        ),
        (
            ["--hfta-models", "2", "--tensor-model-parallel-size", "4", "--tensor-parallel-mode", "optimus2d"],
            "--hfta-models does not compose yet with: --tensor-parallel-mode optimus2d",
        ),
        (["--hfta-models", "2", "--optimizer", "lamb"], "--hfta-models does not compose yet with: --optimizer other than adam"),
    ],
)
def test_flags_refuse_with_one_clear_error(argv, message):
    assert message in _problems(["--lr", "1e-3", *argv])


# ------------------------------------------------------------------------------ equivalence


@pytest.mark.multirank
@pytest.mark.timeout(900)
@pytest.mark.parametrize("k", range(len(LRS)))
def test_model_k_equals_its_unfused_run(references, k):
    fused, unfused = references["single"]["fused"], references["single"]["unfused"][k]
    for step, (f, u) in enumerate(zip(fused["steps"], unfused["steps"])):
        assert f["extra"]["lm_losses"][k] == pytest.approx(u["losses"]["lm loss"], rel=RTOL), step
        assert u["grad_norm"] > 0.5, "clipping must be active"
        _close(f["models"][k]["grads"], u["models"][0]["grads"], f"step {step} grad")
        _close(f["models"][k]["weights"], u["models"][0]["weights"], f"step {step} weight")
    assert fused["validation"][f"lm loss {k}"] == pytest.approx(unfused["validation"]["lm loss"], rel=RTOL)


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_logs_carry_every_models_loss(references):
    fused = references["single"]["fused"]
    for step in fused["steps"]:
        losses, extra = step["losses"], step["extra"]
        assert len(extra["lm_losses"]) == len(LRS)
        assert losses["lm loss"] == pytest.approx(sum(extra["lm_losses"]) / len(LRS), rel=1e-6)  # the mean in fp32
        assert losses["best lm loss"] == min(extra["lm_losses"]) == extra["lm_losses"][extra["best_model"]]
    assert len({tuple(step["extra"]["lm_losses"]) for step in fused["steps"]}) == STEPS  # the models train


def _merged(ranks: List[dict], step: int, what: str) -> dict:
    out = {}
    for rank in ranks:
        for k, model in enumerate(rank["steps"][step]["models"]):
            for name, tensor in model[what].items():
                out.setdefault(k, {})[name] = tensor
    return out


def _equal_steps(ranks: List[dict], single: dict, first: int, what_case: str) -> None:
    """The ranks' steps ``0, 1, ..`` equal the single-process steps ``first, first + 1, ..``:
    every model's loss, gradients and weights; then the validation losses."""
    for step, expected in enumerate(single["steps"][first:]):
        assert ranks[0]["steps"][step]["extra"]["lm_losses"] == pytest.approx(expected["extra"]["lm_losses"], rel=RTOL)
        for what in ("grads", "weights"):
            merged = _merged(ranks, step, what)
            for k in range(len(LRS)):
                _close(merged[k], expected["models"][k][what], f"{what_case} step {first + step} model {k} {what}")
    for k in range(len(LRS)):
        assert ranks[0]["validation"][f"lm loss {k}"] == pytest.approx(single["validation"][f"lm loss {k}"], rel=RTOL)


@pytest.mark.multirank
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", TRAINED, ids=lambda c: c.name)
def test_bitpipe_pipeline_equals_single_process(case, references, launched):
    single, ranks = references[case.reference_key]["fused"], launched[case]
    if "--split-backward" in case.flags:
        assert all(rank["deferred"] > 0 for rank in ranks), "the batched linears must defer their weight gradients"
    else:
        assert all(rank["deferred"] == 0 for rank in ranks)
    _equal_steps(ranks, single, 0, case.name)


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_tp2_checkpoint_resumes_at_tp1_and_model_extracts(references, launched):
    """The TP2 array's iteration-2 checkpoint resumed at TP1 (x DP2) trains iteration 3 as the
    single process does (weights and Adam moments resharded); model 1 extracted from its
    iteration-3 checkpoint has the array's model-1 validation loss."""
    _resumed_at_tp1_equals_single_process("tp1_dp2_from_tp2", references, launched)


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_swiglu_checkpoint_moves_between_tensor_parallel_sizes(references, launched):
    """The gated MLP's fused linear_fc1 is stored as every model's unfused [gate; up] weight:
    the TP2 checkpoint resumes at TP1 and its model 1 loads as an ordinary SwiGLU GPT."""
    _resumed_at_tp1_equals_single_process("tp1_dp2_from_tp2_swiglu", references, launched)


def _resumed_at_tp1_equals_single_process(name: str, references: dict, launched) -> None:
    (case,) = [c for c in CASES if c.name == name]
    single, ranks = references[case.reference_key]["fused"], launched[case]
    assert len(ranks[0]["steps"]) == STEPS - RESUME_AT
    _equal_steps(ranks, single, RESUME_AT, case.name)
    for rank in ranks:
        assert rank["model1"]["lm loss"] == pytest.approx(single["validation"]["lm loss 1"], rel=RTOL)


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_checkpoint_resumes_exactly_and_model_extracts(references):
    checkpoints = references["single"]["checkpoints"]
    full, resumed = checkpoints["logs"]["full"], checkpoints["logs"]["resumed"]
    assert sorted(resumed) == [3]
    for key in ("lm_losses", "lm_loss", "best_model", "grad_norm", "lr"):
        assert resumed[3][key] == full[3][key], key
    assert checkpoints["model1"]["lm loss"] == pytest.approx(checkpoints["array"]["lm loss 1"], rel=1e-6)
    assert checkpoints["array"]["lm loss 1"] != checkpoints["array"]["lm loss 0"]
