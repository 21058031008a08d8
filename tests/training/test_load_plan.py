"""The load plan (:mod:`megatron_bitpipe.training.load_plan`): what ``--load`` takes from a
checkpoint and what it refuses, decided from the checkpoint's common state and this run's flags
alone — pure, no files, no process group.

* what is loaded: the weights always; progress unless fine-tuning (``--finetune`` or a release
  checkpoint); the optimizer state and schedule unless fine-tuning or ``--no-load-optim``; the
  random generators unless fine-tuning or ``--no-load-rng``, only at the saving run's tensor
  and pipeline sizes and where it saved them;
* what is refused, in order and under its heading: another task's model, a different model,
  an optimizer asked of a checkpoint without one, another optimizer's state (1-bit LAMB's:
  also another layout), another learning-rate schedule — the schedule asked only when the
  optimizer is loaded;
* the plan's inputs come from the saved flags (``SavedCheckpoint.from_common``) and this run's
  (``LoadFlags.from_run``).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from megatron_bitpipe.training.load_plan import (
    ANOTHER_MODEL,
    ANOTHER_OPTIMIZER,
    ANOTHER_SCHEDULE,
    ANOTHER_TASK,
    HEADINGS,
    LAYOUT_FLAGS,
    NO_OPTIMIZER,
    LoadFlags,
    SavedCheckpoint,
    plan_load,
)

SAVED = SavedCheckpoint(task="gpt", tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
FLAGS = LoadFlags(tensor_model_parallel_size=2, pipeline_model_parallel_size=4)


def _refused(plan):
    return {r.heading: list(r.problems) for r in plan.refusals if r.problems}


@pytest.mark.parametrize(
    "saved,flags,progress,optimizer,rng",
    [
        (SAVED, FLAGS, True, True, True),  # a resume: everything
        (SAVED, replace(FLAGS, finetune=True), False, False, False),
        (replace(SAVED, release=True), FLAGS, False, False, False),  # a release checkpoint is a fine-tune
        (SAVED, replace(FLAGS, no_load_optim=True), True, False, True),
        (SAVED, replace(FLAGS, no_load_rng=True), True, True, False),
        (SAVED, replace(FLAGS, tensor_model_parallel_size=1), True, True, False),  # ranks do not correspond
        (SAVED, replace(FLAGS, pipeline_model_parallel_size=2), True, True, False),
        (replace(SAVED, has_rng=False), FLAGS, True, True, False),  # saved with --no-save-rng
        (replace(SAVED, tensor_model_parallel_size=None), FLAGS, True, True, False),  # sizes unknown: no generators
    ],
)
def test_what_is_loaded(saved, flags, progress, optimizer, rng):
    plan = plan_load(saved, flags, "gpt")
    assert (plan.progress, plan.optimizer, plan.rng, plan.finetune) == (progress, optimizer, rng, not progress)
    assert not plan.refused and [r.heading for r in plan.refusals] == list(HEADINGS)


def test_refusals_in_order_under_their_headings():
    assert _refused(plan_load(replace(SAVED, task="bert"), FLAGS, "gpt")) == {
        ANOTHER_TASK: ["it holds a bert model, this run trains gpt"]}
    assert _refused(plan_load(SAVED, FLAGS, "gpt", ["--hidden-size is 64 there, 32 here"])) == {
        ANOTHER_MODEL: ["--hidden-size is 64 there, 32 here"]}
    no_optimizer = plan_load(replace(SAVED, has_optimizer=False), FLAGS, "gpt", schedule_problems=lambda: ["unused"])
    assert list(_refused(no_optimizer)) == [NO_OPTIMIZER]
    assert "pass --no-load-optim or --finetune" in _refused(no_optimizer)[NO_OPTIMIZER][0]
    for weights_only in (replace(FLAGS, no_load_optim=True), replace(FLAGS, finetune=True)):
        assert not plan_load(replace(SAVED, has_optimizer=False), weights_only, "gpt").refused
    sgd = plan_load(replace(SAVED, optimizer="sgd"), FLAGS, "gpt")
    assert _refused(sgd) == {ANOTHER_OPTIMIZER: [
        "it holds the state of --optimizer sgd, this run uses --optimizer adam (--no-load-optim loads the weights only)"]}
    assert not plan_load(replace(SAVED, optimizer="sgd"), replace(FLAGS, no_load_optim=True), "gpt").refused
    both = plan_load(replace(SAVED, task="bert", optimizer="sgd"), FLAGS, "gpt", ["x"])
    assert list(_refused(both)) == [ANOTHER_TASK, ANOTHER_MODEL, ANOTHER_OPTIMIZER]  # the first heading is raised first


def test_one_bit_lamb_state_resumes_only_in_its_layout():
    layout = (8, 2, 4, None, "bitpipe", "1d")
    saved = replace(SAVED, optimizer="onebit_lamb", layout=layout)
    flags = replace(FLAGS, optimizer="onebit_lamb", layout=layout)
    assert not plan_load(saved, flags, "gpt").refused
    moved = plan_load(saved, replace(flags, layout=(8, 2, 4, None, "zbv", "1d")), "gpt")
    (problem,) = _refused(moved)[ANOTHER_OPTIMIZER]
    assert "per rank and were saved in another layout" in problem and "schedule bitpipe" in problem


def test_the_schedule_is_compared_only_when_the_optimizer_is_loaded():
    asked = []

    def schedule():
        asked.append(True)
        return ["--lr is 0.001 there, 0.002 here"]

    assert _refused(plan_load(SAVED, FLAGS, "gpt", schedule_problems=schedule)) == {ANOTHER_SCHEDULE: ["--lr is 0.001 there, 0.002 here"]}
    assert asked == [True]
    for weights_only in (replace(FLAGS, no_load_optim=True), replace(FLAGS, finetune=True)):
        assert not plan_load(SAVED, weights_only, "gpt", schedule_problems=schedule).refused
    assert not plan_load(replace(SAVED, has_optimizer=False), FLAGS, "gpt", schedule_problems=schedule).refusals[4].problems
    assert asked == [True]


def test_inputs_from_the_saved_and_the_run_flags():
    saved_args = argparse.Namespace(task="bert", tensor_model_parallel_size=2, pipeline_model_parallel_size=4,
                                    no_save_rng=True, optimizer="lamb", world_size=8, schedule="bitpipe")  # fmt: skip
    common = {"args": saved_args, "optimizer": {}, "iteration": 10}
    saved = SavedCheckpoint.from_common(common, False, "gpt")
    assert (saved.task, saved.has_optimizer, saved.has_rng, saved.optimizer) == ("bert", True, False, "lamb")
    assert saved.layout == (8, 2, 4, None, "bitpipe", None) and len(saved.layout) == len(LAYOUT_FLAGS)
    megatron_lm = SavedCheckpoint.from_common({"args": argparse.Namespace(), "iteration": 3}, True, "gpt")
    assert (megatron_lm.task, megatron_lm.release, megatron_lm.has_optimizer, megatron_lm.optimizer) == ("gpt", True, False, "adam")

    from megatron_bitpipe.run_config import Checkpointing, ParallelLayout

    class Run:  # the parts of a RunConfig LoadFlags reads
        checkpointing = Checkpointing(load="ckpt", finetune=False, no_load_optim=True, no_load_rng=True)
        layout = ParallelLayout(tensor=2, pipeline=4, data=1, virtual=None, sequence_parallel=False, tensor_parallel_mode="1d")

    args = argparse.Namespace(optimizer="sgd", world_size=8, tensor_model_parallel_size=2,
                              pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=None,
                              schedule="zbv", tensor_parallel_mode="1d")  # fmt: skip
    flags = LoadFlags.from_run(Run, args)
    assert flags == LoadFlags(finetune=False, no_load_optim=True, no_load_rng=True, tensor_model_parallel_size=2,
                              pipeline_model_parallel_size=4, optimizer="sgd", layout=(8, 2, 4, None, "zbv", "1d"))  # fmt: skip
