"""Megatron-LM's own example scripts, as written, with megatron-bitpipe's schedules (needs
``MEGATRON_LM_PATH``; run once per checkout: core_v0.16.1 and core_v0.19.0).

Each example script is run by bash with its own arguments and its flags taken from the command
line it launches (:mod:`.example_scripts`); a 4-rank CPU run changes only what the module
:mod:`.example_scripts` lists: sizes shrunk, the GPU-only flags dropped (each named), the
user's tokenizer and corpus replaced by ``NullTokenizer`` and an indexed dataset, and the
example's own additions below, each with its reason. The control is Megatron-LM's own schedule
on the same flags with ``--layout-independent-init``; ``--pipeline-schedule bitpipe``, ``zbv``
and ``dualpipev`` must log its losses, grad norms, evaluation losses and (MoE) auxiliary losses:

* Llama-3 8B (examples/llama, both tags) at tensor 2 x pipeline 2 with its sequence
  parallelism, distributed optimizer with ``--overlap-param-gather``, zero-centered norms
  (``--apply-layernorm-1p``), GQA, RoPE, SwiGLU and per-token loss; in bf16 as written with
  ``--grad-reduce-in-bf16`` (rtol 2e-5: BitPipe's two pipelines hold a stage's gradients in two
  bf16 buffers and sum them, where the control accumulates in one; measured 3e-6; ZB-V and
  DualPipeV hold one and match to the printed digit), and in fp32 (rtol 1e-5);
* Mixtral 8x7B (examples/mixtral, core_v0.16.1) at pipeline 2 x data parallel 2 x expert
  parallel 2 with its alltoall dispatcher, load-balancing loss, RMSNorm, distributed optimizer
  with ``--overlap-param-gather``, its ``--save``/``--load`` (saving a mixture-of-experts
  checkpoint at the end);
* GPT-3 175B (examples/gpt3, both tags) at tensor 2 x pipeline 2 in fp16 with dynamic loss
  scaling and its batch-size ramp (``--rampup-batch-size``; core_v0.19.0:
  ``--step-batch-size-schedule``): the same loss scale and skipped iterations at every
  iteration and losses within 1e-4. Megatron-LM itself refuses that script as written (its ramp
  beside ``--train-iters``; at core_v0.19.0 its schedule beside ``--global-batch-size``):
  :func:`test_gpt3_script_as_written_is_refused_by_megatron_lm_itself` shows it, and the runs
  take the sample-based spelling Megatron-LM asks for.

The runs are under strict p2p (NCCL's rules on gloo).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, Tuple

import pytest

from megatron_bitpipe.megatron_lm.checkout import find_checkout

from .example_scripts import Adapted, Example, adapt, script_flags
from .megatron_lm_support import Run, checkout_or_skip, checkpoint_writer_problem, torchrun, write_indexed_dataset

pytestmark = [pytest.mark.timeout(1800), pytest.mark.multirank, pytest.mark.strict_p2p]
SCHEDULES = ("bitpipe", "zbv", "dualpipev")
TP2_PP2 = {"--tensor-model-parallel-size": ("2",), "--pipeline-model-parallel-size": ("2",)}
CORPUS = (("--data-path", "{data}"), "the user's corpus: a 200-document indexed dataset")
NULL_TOKENIZER = ("--tokenizer-type", "NullTokenizer", "--vocab-size", "500")
NO_DROPOUT = (("--hidden-dropout", "0", "--attention-dropout", "0"),
              "the script keeps Megatron-LM's dropout 0.1, whose masks follow each layout's RNG streams "
              "(docs/megatron_lm.md, Dropout)")  # fmt: skip
# From 2^20 the tiny model's first 3 iterations overflow and skip (measured); from Megatron-LM's
# default 2^32 (hysteresis 2: two overflows per halving) more than its 7 iterations would
LOSS_SCALE = (("--initial-loss-scale", "1048576"), "a start from which the tiny model's 7 iterations reach steps")
SAMPLE_BASED = {
    "--train-iters": (("--train-samples", "64"), "Megatron-LM's rule: a batch-size ramp needs sample-based training"),
    "--lr-decay-iters": (("--lr-decay-samples", "64"), "with --train-samples"),
}

LLAMA3 = Example(
    "examples/llama/train_llama3_8b_h100_fp8.sh", lambda run_dir: [str(run_dir / "checkpoint"), str(run_dir / "tensorboard")],
    "bf16", sizes=TP2_PP2,
)  # fmt: skip
EXAMPLES: Dict[str, Example] = {
    "llama3_8b": LLAMA3,
    "llama3_8b_fp32": dataclasses.replace(
        LLAMA3, precision="fp32", dropped={"--bf16": "the fp32 run", "--grad-reduce-in-bf16": "the fp32 run"}
    ),
    "mixtral_8x7b": Example(
        "examples/mixtral/train_mixtral_8x7b_distributed.sh",
        lambda run_dir: [str(run_dir / "checkpoint"), "tokenizer.model", "corpus"],
        "bf16",
        tag="core_v0.16.1",
        sizes={"--pipeline-model-parallel-size": ("2",), "--expert-model-parallel-size": ("2",), "--split": ("90,8,2",)},
        replaced={
            "--tokenizer-type": (NULL_TOKENIZER, "Llama2Tokenizer reads the user's sentencepiece model"),
            "--tokenizer-model": ((), "with --tokenizer-type"),
            "--data-path": CORPUS,
        },
    ),
    "gpt3_175b": Example(
        "examples/gpt3/train_gpt3_175b_distributed.sh",
        lambda run_dir: [str(run_dir / "checkpoint"), str(run_dir / "tensorboard"), "gpt2-vocab.json", "gpt2-merges.txt", "corpus"],
        "fp16",
        tag="core_v0.16.1",
        sizes={**TP2_PP2, "--rampup-batch-size": ("4", "4", "16"), "--global-batch-size": ("12",), "--split": ("90,8,2",)},
        replaced={
            "--vocab-file": (NULL_TOKENIZER, "GPT-2's BPE files are the user's"),
            "--merge-file": ((), "with --vocab-file"),
            "--data-path": CORPUS,
            **SAMPLE_BASED,
        },
        added=(NO_DROPOUT, LOSS_SCALE),
    ),
    "gpt3_175b_step_schedule": Example(
        "examples/gpt3/train_gpt3_175b_distributed.sh",
        lambda run_dir: [str(run_dir / "checkpoint"), str(run_dir / "tensorboard"), "gpt2-vocab.json", "gpt2-merges.txt", "corpus"],
        "fp16",
        tag="core_v0.19.0",
        # 32 tokens a sample: global batches 4, 4, 8, 12, 12, 12, 12 (as the core_v0.16.1 ramp)
        sizes={**TP2_PP2, "--step-batch-size-schedule": ("0:4 256:8 512:12",), "--split": ("90,8,2",)},
        replaced={
            "--vocab-file": (NULL_TOKENIZER, "GPT-2's BPE files are the user's"),
            "--merge-file": ((), "with --vocab-file"),
            "--data-path": CORPUS,
            "--global-batch-size": ((), "Megatron-LM's rule: no --global-batch-size beside --step-batch-size-schedule"),
            **SAMPLE_BASED,
        },
        added=(
            NO_DROPOUT, LOSS_SCALE,
            (("--eval-global-batch-size", "4"), "Megatron-LM's default beside a step schedule is one micro-batch, "
                                                "which the plan schedules refuse (they pipeline at least 2)"),
        ),
    ),  # fmt: skip
}
RTOL = {"fp32": 1e-5, "bf16": 2e-5, "fp16": 1e-4}


@pytest.fixture(scope="module")
def checkout():
    return find_checkout(checkout_or_skip())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    write_indexed_dataset(root / "corpus")
    return root


def _example(name: str, checkout) -> Example:
    example = EXAMPLES[name]
    if example.tag not in (None, checkout.tag) or not (checkout.root / example.path).exists():
        pytest.skip(f"{checkout.root} ({checkout.tag}) has no {example.path} of this form")
    return example


def _adapted(example: Example, checkout, run_dir: Path, data: Path) -> Adapted:
    return adapt(script_flags(checkout.root / example.path, example.arguments(run_dir), run_dir), example, data)


@pytest.fixture(scope="module")
def example_runs(checkout, workdir):
    """``run(name, schedule)``: the example ``name`` with ``schedule`` (``None``: the control),
    each in its own directory (its own checkpoint), once per module; with the flags it ran."""
    runs: Dict[tuple, Tuple[Run, Adapted]] = {}

    def run(name: str, schedule) -> Tuple[Run, Adapted]:
        if (name, schedule) not in runs:
            example = _example(name, checkout)
            problem = checkpoint_writer_problem(checkout.root)
            if problem:
                example = dataclasses.replace(example, dropped={**example.dropped, "--save": problem, "--load": problem})
            run_dir = workdir / f"{name}_{schedule or 'control'}"
            adapted = _adapted(example, checkout, run_dir, workdir / "corpus")
            extra = ["--pipeline-schedule", schedule] if schedule else ["--layout-independent-init"]
            done = torchrun(checkout.root / "pretrain_gpt.py", 4, [*adapted.flags, *extra], run_dir, timeout=1500)
            assert done.returncode == 0, done.output[-5000:]
            runs[(name, schedule)] = done, adapted
        return runs[(name, schedule)]

    return run


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_script_with_plan_schedule_equals_megatron_schedule(checkout, example_runs, name, schedule):
    example = _example(name, checkout)
    (control, _), (run, adapted) = example_runs(name, None), example_runs(name, schedule)
    rtol = RTOL[example.precision]
    assert len(control.losses) >= 3 and run.losses.keys() == control.losses.keys(), control.output[-3000:]
    for i, loss in control.losses.items():
        assert run.losses[i] == pytest.approx(loss, rel=rtol), f"iteration {i}"
        assert run.grad_norms[i] == pytest.approx(control.grad_norms[i], rel=1e-3), f"grad norm, iteration {i}"
        assert run.aux_losses[i] == pytest.approx(control.aux_losses[i], rel=rtol), f"auxiliary losses, iteration {i}"
    assert run.evals.keys() == control.evals.keys() and control.evals
    for key, loss in control.evals.items():
        assert run.evals[key] == pytest.approx(loss, rel=rtol), f"evaluation {key}"
    assert run.loss_scales == control.loss_scales
    if example.precision == "fp16":
        assert len({scale for scale, _ in control.loss_scales.values()}) >= 2  # the scaler moved
    if name.startswith("mixtral"):
        assert set(control.aux_losses[1]) == {"load_balancing_loss"}
    flags = adapted.flags
    if "--save" in flags:  # the script's --save: Megatron-LM saves at the end of training
        saved = Path(flags[flags.index("--save") + 1]) / "latest_checkpointed_iteration.txt"
        assert saved.read_text().strip() == str(max(run.loss_scales))


#: Megatron-LM's own refusal of examples/gpt3 as written, per tag
GPT3_AS_WRITTEN = {
    "core_v0.16.1": "expected no batch-size rampup for iteration-based training",
    "core_v0.19.0": "Cannot specify both --step-batch-size-schedule and --global-batch-size",
}


def test_gpt3_script_as_written_is_refused_by_megatron_lm_itself(checkout, workdir):
    """examples/gpt3 with only its sizes shrunk and data replaced, under Megatron-LM's own
    schedule: Megatron-LM's argument checks stop it (so the runs above take the spelling they ask for)."""
    name = "gpt3_175b" if checkout.tag == "core_v0.16.1" else "gpt3_175b_step_schedule"
    example = _example(name, checkout)
    kept = {flag: stand_in for flag, stand_in in example.replaced.items() if flag not in (*SAMPLE_BASED, "--global-batch-size")}
    as_written = dataclasses.replace(example, replaced=kept)
    run_dir = workdir / f"{name}_as_written"
    adapted = _adapted(as_written, checkout, run_dir, workdir / "corpus")
    run = torchrun(checkout.root / "pretrain_gpt.py", 4, [*adapted.flags, "--layout-independent-init"], run_dir, timeout=600)
    assert run.returncode != 0 and GPT3_AS_WRITTEN[checkout.tag] in run.output, run.output[-3000:]
