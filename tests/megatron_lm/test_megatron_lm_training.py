"""Megatron-LM's own pretrain_gpt.py with BitPipe, through both routes, on CPU ranks (gloo).

Needs a Megatron-LM checkout in ``MEGATRON_LM_PATH`` (a tested tag: core_v0.16.1 or
core_v0.19.0; run the file once per checkout); skipped otherwise. Every run trains the same
tiny GPT on mock data for 4 iterations (evaluation after 2 and 4) with ``torchrun -m
megatron_bitpipe.cpu.megatron_lm``, i.e. ``python -m megatron_bitpipe.run`` plus the
CPU layer. The reference is one process without pipelining (``--layout-independent-init``);
BitPipe must give the same training loss and grad norm at every iteration and the same
validation and test losses (rtol 1e-5 on the 7 digits Megatron-LM prints):

* runtime route and patch route (a copy of the checkout patched by
  ``scripts/apply_megatron_patch.py``), each with pipeline 4 and with tensor 2 x pipeline 2
  (4 ranks); the runtime route's tensor 2 x pipeline 2 run saves a checkpoint at iteration 2;
* resuming that checkpoint (``--load``, ``--ckpt-step 2``) continues the same loss curve;
* runtime route with ``--use-distributed-optimizer``, pipeline 2 x data parallel 2 (4 ranks,
  one distributed optimizer per chunk), with BitPipe (its parameter all-gather overlapped with
  the next forward: ``--overlap-param-gather``; Megatron-LM's evaluation and checkpoint save
  after it), ZB-V and DualPipeV, saving at iteration 2;
  BitPipe's checkpoint resumed with DualPipeV and ZB-V's with BitPipe, at tensor 2 x pipeline 2
  and the distributed optimizer, continue the curve;
* the other plan schedules on the runtime route: ZB-H1 (pipeline 4, tied embeddings: megatron's
  tying over its first and last rank), DualPipe (pipeline 4) and Chimera (tensor 2 x pipeline 2),
  both with ``--untie-embeddings-and-output-weights`` against the reference with it; ZB-H1 and
  DualPipe again at pipeline 2 x data parallel 2 and Chimera at tensor 2 x pipeline 2 with
  ``--use-distributed-optimizer`` (these and the distributed-optimizer runs under strict p2p);
* the patch route with ZB-V (pipeline 4), whose losses are computed on pipeline rank 0 only,
  with equal stages and with a layout;
* Megatron-LM's uneven-layout flags, split over the plan's own stages in pipeline order (under
  strict p2p): BitPipe (pipeline 2) with first and last stage counts, ZB-V (pipeline 2) with a
  ``--pipeline-model-parallel-layout`` holding a stage without layers (also on the patch route),
  and BitPipe with ``--split-backward`` and ``--account-for-embedding-in-pipeline-split`` on 7
  layers (a number Megatron-LM's equal-split check would refuse at pipeline 2), against the
  reference of 7 layers; the uneven BitPipe run's checkpoint, resumed by the even tensor 2 x
  pipeline 2 layout, continues the curve; a layout of the wrong number of stages is refused;
* activation recompute (Megatron-LM's flags) with BitPipe, pipeline 2: full recompute with
  the split backward, selective recompute without;
* Megatron-LM's interleaved schedule with its default overlapped p2p communication
  (``--num-layers-per-virtual-pipeline-stage``, pipeline 2): the CPU layer's private send copies
  keep gloo from sending freed outputs;
* ``--sequence-parallel`` (tensor 2) with megatron-core's local layer spec, which the CPU entry
  point gives norms that support it: the default schedule and BitPipe (pipeline 2) train like
  the reference, both with SGD at a learning rate where a norm gradient left unsummed over the
  tensor-parallel ranks shows in the validation loss and grad norm;
* invalid flags (among them dualpipe with tied embeddings) stop every rank with one error line
  before torch.distributed starts, and
  ``pretrain_bert.py`` (core_v0.16.1) with BitPipe is refused before it loads, saying why;
* ``--optimizer lamb --lr-decay-style rex`` and ``--optimizer schedulefree_adamw``: BitPipe
  (pipeline 4) trains like the reference with the same optimizer;
* a mixture-of-experts GPT at pipeline 2 x data parallel 2 x expert parallel 2 (strict p2p):
  BitPipe (± split backward), ZB-V and DualPipeV with the distributed optimizer on the runtime
  route, BitPipe and ZB-V on the patch route,
  both token dispatchers, and Megatron-LM's own 1F1B with ``--layout-independent-init``, equal
  to one process at expert parallelism 1; the logged auxiliary losses equal that 1F1B run's;
  BitPipe's checkpoint (runtime route) resumed by Megatron-LM's own schedule at data parallel 4 x
  expert parallel 4, ZB-V's (patch route) by BitPipe, on the curve; refused at expert
  parallelism 1 before Megatron-LM's loader fails;
* ``--softmax-type learnable`` (gpt-oss's per-head softmax offset): BitPipe at tensor 2 x
  pipeline 2 equal to one process (rtol 1e-6);
* context parallelism: BitPipe at context parallel 2 x pipeline 2 (the SDPA layer spec through
  ``--spec``, ``--cp-comm-type all_gather``, strict p2p) on both routes equal to one process at
  context parallel 1 with megatron-core's local attention;
* a batch-size ramp (``--rampup-batch-size`` at core_v0.16.1, ``--step-batch-size-schedule`` at
  core_v0.19.0, with ``--train-samples``): BitPipe at pipeline 2 x data parallel 2 (strict p2p),
  a plan per number of micro-batches, equal to one process through the ramp;
* a script that ends, or exits 0, leaving its process groups is followed by the route's clean-up
  (gloo's groups left to the interpreter's exit can abort a finished rank); one that fails keeps
  them.

(pretrain_bert.py at core_v0.16.1 imports Transformer Engine's BERT layer spec when it is
loaded, so it cannot run on a CPU machine at all; core_v0.19.0 has no pretrain_bert.py.)
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import shutil
import subprocess
import sys
from typing import Callable, Dict, Optional

import pytest

from megatron_bitpipe.megatron_lm.args import SDPA_SPEC
from megatron_bitpipe.megatron_lm.checkout import find_checkout

from .megatron_lm_support import REPO, TINY_GPT, Run, checkout_or_skip, checkpoint_writer_problem, torchrun

pytestmark = [pytest.mark.timeout(900), pytest.mark.multirank]
RTOL = 1e-5
BITPIPE = ["--pipeline-schedule", "bitpipe"]
UNTIE = "--untie-embeddings-and-output-weights"
LAYOUTS = {
    "pp4": ["--pipeline-model-parallel-size", "4"],
    "tp2_pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
}


@pytest.fixture(scope="module")
def checkout():
    root = checkout_or_skip()
    checkout = find_checkout(root)
    assert checkout.tag is not None, f"{root} is megatron-core {checkout.version}, not a tested Megatron-LM tag"
    return checkout.root


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("megatron_lm")


@pytest.fixture(scope="module")
def reference(checkout, workdir) -> Run:
    return _ok(torchrun(checkout / "pretrain_gpt.py", 1, [*TINY_GPT, "--layout-independent-init"], workdir))


@pytest.fixture(scope="module")
def untied_reference(checkout, workdir) -> Run:
    """The reference with its own output layer (dualpipe and chimera refuse tied embeddings)."""
    return _ok(torchrun(checkout / "pretrain_gpt.py", 1, [*TINY_GPT, UNTIE, "--layout-independent-init"], workdir))


#: the distributed-optimizer runs that overlap its parameter all-gather with the next forward
OVERLAP_PARAM_GATHER = {"bitpipe": ["--overlap-param-gather", "--overlap-grad-reduce"]}


@pytest.fixture(scope="module")
def distopt_runs(checkout, workdir) -> Callable[[str], Run]:
    """``run(schedule)``: the schedule at pipeline 2 x data parallel 2 with
    ``--use-distributed-optimizer`` (BitPipe's with ``--overlap-param-gather``), saving at
    iteration 2 into ``checkpoint_distopt_<schedule>`` where Megatron-LM's checkpoint writer
    runs (each schedule runs once per module)."""
    runs: Dict[str, Run] = {}

    def run(schedule: str) -> Run:
        if schedule not in runs:
            save = [] if checkpoint_writer_problem(checkout) else ["--save", str(workdir / f"checkpoint_distopt_{schedule}"), "--save-interval", "2"]
            flags = [*TINY_GPT, "--pipeline-schedule", schedule, "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", *save]
            flags += OVERLAP_PARAM_GATHER.get(schedule, [])
            runs[schedule] = _ok(torchrun(checkout / "pretrain_gpt.py", 4, flags, workdir))
        return runs[schedule]

    return run


@pytest.fixture(scope="module")
def patched_checkout(checkout, workdir):
    copy = workdir / "Megatron-LM"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git", "tests", "docs", "examples"))
    script = [sys.executable, str(REPO / "scripts" / "apply_megatron_patch.py"), str(copy)]
    applied = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert applied.returncode == 0 and "patch applied" in applied.stdout, applied.stderr
    return copy


@pytest.fixture(scope="module")
def runtime_runs(checkout, workdir) -> dict:
    """BitPipe through ``python -m megatron_bitpipe.run`` in both layouts; tensor 2 x pipeline 2
    saves a checkpoint at iteration 2."""
    save = [] if checkpoint_writer_problem(checkout) else ["--save", str(workdir / "checkpoint"), "--save-interval", "2"]
    return {
        name: _ok(torchrun(checkout / "pretrain_gpt.py", 4, [*TINY_GPT, *BITPIPE, *flags, *(save if name == "tp2_pp2" else [])], workdir))
        for name, flags in LAYOUTS.items()
    }


def _ok(run: Run) -> Run:
    assert run.returncode == 0, run.output[-5000:]
    return run


def _assert_same_curve(run: Run, reference: Run, iterations=range(1, 5), rtol: float = RTOL):
    assert sorted(reference.losses) == [1, 2, 3, 4]
    for i in iterations:
        assert run.losses[i] == pytest.approx(reference.losses[i], rel=rtol), f"iteration {i}"
        assert run.grad_norms[i] == pytest.approx(reference.grad_norms[i], rel=1e-3), f"grad norm, iteration {i}"
    assert run.evals.keys() == reference.evals.keys()
    for key, loss in reference.evals.items():
        assert run.evals[key] == pytest.approx(loss, rel=rtol), f"evaluation {key}"


def _assert_resumed_curve(resumed: Run, reference: Run) -> None:
    """A run resumed from iteration 2 continues ``reference``'s curve. Megatron-LM logs the
    first iteration after a resume without resetting its averages, so iteration 4's logged
    loss is the mean of 3 and 4; the evaluations pin the weights."""
    assert sorted(resumed.losses) == [3, 4]
    assert resumed.losses[3] == pytest.approx(reference.losses[3], rel=RTOL)
    assert resumed.losses[4] == pytest.approx((reference.losses[3] + reference.losses[4]) / 2, rel=RTOL)
    for key, loss in reference.evals.items():
        if key[0] == 4:
            assert resumed.evals[key] == pytest.approx(loss, rel=RTOL), f"evaluation {key}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_runtime_route_bitpipe_equals_one_process(runtime_runs, reference, layout, checkout):
    _assert_same_curve(runtime_runs[layout], reference)
    if layout == "tp2_pp2" and not checkpoint_writer_problem(checkout):
        assert "saving checkpoint at iteration       2" in runtime_runs[layout].output


def test_resume_from_bitpipe_checkpoint_continues_the_curve(runtime_runs, checkout, workdir, reference):
    if checkpoint_writer_problem(checkout):
        pytest.skip(checkpoint_writer_problem(checkout))
    flags = [*TINY_GPT, *BITPIPE, *LAYOUTS["tp2_pp2"], "--load", str(workdir / "checkpoint"), "--ckpt-step", "2"]
    _assert_resumed_curve(_ok(torchrun(checkout / "pretrain_gpt.py", 4, flags, workdir)), reference)


@pytest.mark.strict_p2p
@pytest.mark.parametrize("schedule", ["bitpipe", "zbv", "dualpipev"])
def test_runtime_route_distributed_optimizer_equals_one_process(distopt_runs, reference, schedule):
    run = distopt_runs(schedule)
    _assert_same_curve(run, reference)
    assert "saves its optimizer state fully reshardable" in run.output


# A distributed-optimizer checkpoint of one schedule at pipeline 2 x data parallel 2, resumed by
# another schedule at tensor 2 x pipeline 2 (both directions between BitPipe and a V schedule).
RESUMED_BY = {"bitpipe": "dualpipev", "zbv": "bitpipe"}


@pytest.mark.parametrize("saved_by", list(RESUMED_BY))
def test_distributed_optimizer_checkpoint_resumes_in_another_layout_and_schedule(distopt_runs, checkout, workdir, reference, saved_by):
    if checkpoint_writer_problem(checkout):
        pytest.skip(checkpoint_writer_problem(checkout))
    distopt_runs(saved_by)
    flags = [*TINY_GPT, "--pipeline-schedule", RESUMED_BY[saved_by], "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--use-distributed-optimizer", "--load", str(workdir / f"checkpoint_distopt_{saved_by}"), "--ckpt-step", "2"]
    _assert_resumed_curve(_ok(torchrun(checkout / "pretrain_gpt.py", 4, flags, workdir)), reference)


# The other plan schedules on the runtime route, each against the one-process reference of its
# embeddings (tied where the placement allows, else --untie-embeddings-and-output-weights).
DISTOPT_PP2 = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]  # x data parallel 2
PLAN_SCHEDULE_RUNS = {
    "zb-h1_pp4": ["--pipeline-schedule", "zb-h1", *LAYOUTS["pp4"]],
    "zb-h1_pp2_dp2_distopt": ["--pipeline-schedule", "zb-h1", *DISTOPT_PP2],
    "dualpipe_pp4": ["--pipeline-schedule", "dualpipe", *LAYOUTS["pp4"], UNTIE],
    "dualpipe_pp2_dp2_distopt": ["--pipeline-schedule", "dualpipe", *DISTOPT_PP2, UNTIE],
    "chimera_tp2_pp2_distopt": ["--pipeline-schedule", "chimera", *LAYOUTS["tp2_pp2"], UNTIE, "--use-distributed-optimizer"],
}


@pytest.mark.strict_p2p
@pytest.mark.parametrize("name", list(PLAN_SCHEDULE_RUNS))
def test_runtime_route_plan_schedules_equal_one_process(checkout, workdir, request, name):
    flags = PLAN_SCHEDULE_RUNS[name]
    expected = request.getfixturevalue("untied_reference" if UNTIE in flags else "reference")
    _assert_same_curve(_ok(torchrun(checkout / "pretrain_gpt.py", 4, [*TINY_GPT, *flags], workdir)), expected)


PATCH_ROUTE_RUNS = {
    "bitpipe_pp4": [*BITPIPE, *LAYOUTS["pp4"]],
    "bitpipe_tp2_pp2": [*BITPIPE, *LAYOUTS["tp2_pp2"]],
    "zbv_pp4": ["--pipeline-schedule", "zbv", *LAYOUTS["pp4"]],
    "zbv_pp4_layout": ["--pipeline-schedule", "zbv", *LAYOUTS["pp4"], "--pipeline-model-parallel-layout", "E|t*2|t|t|t|t*2||tL"],
}


@pytest.mark.parametrize("name", list(PATCH_ROUTE_RUNS))
def test_patch_route_equals_one_process(patched_checkout, workdir, reference, name):
    flags = [*TINY_GPT, *PATCH_ROUTE_RUNS[name]]
    _assert_same_curve(_ok(torchrun(patched_checkout / "pretrain_gpt.py", 4, flags, workdir)), reference)


# Uneven layouts on the plan's stages (pipeline 2: BitPipe and ZB-V run 4 stages per pipeline):
# name -> (flags, the reference's extra flags). The first one saves a checkpoint at iteration 2.
UNEVEN = {
    "bitpipe_first_last": (["--pipeline-schedule", "bitpipe", "--decoder-first-pipeline-num-layers", "1",
                            "--decoder-last-pipeline-num-layers", "1"], []),
    "zbv_layout_empty_stage": (["--pipeline-schedule", "zbv", "--pipeline-model-parallel-layout", "Ettt||tttt|tL"], []),
    "bitpipe_split_embedding_7_layers": (["--pipeline-schedule", "bitpipe", "--split-backward", "--num-layers", "7",
                                          "--account-for-embedding-in-pipeline-split"], ["--num-layers", "7"]),
}  # fmt: skip
UNEVEN_STAGES = {"bitpipe_first_last": "1,3,3,1", "zbv_layout_empty_stage": "3,0,4,1", "bitpipe_split_embedding_7_layers": "1,2,2,2"}


@pytest.fixture(scope="module")
def uneven_runs(checkout, workdir) -> Callable[[str], Run]:
    """``run(name)``: the :data:`UNEVEN` run ``name`` at pipeline 2 (once per module)."""
    runs: Dict[str, Run] = {}

    def run(name: str) -> Run:
        if name not in runs:
            save = [] if checkpoint_writer_problem(checkout) or name != "bitpipe_first_last" else [
                "--save", str(workdir / "checkpoint_uneven"), "--save-interval", "2"]
            flags = [*TINY_GPT, *UNEVEN[name][0], "--pipeline-model-parallel-size", "2", *save]
            runs[name] = _ok(torchrun(checkout / "pretrain_gpt.py", 2, flags, workdir))
        return runs[name]

    return run


@pytest.mark.strict_p2p
@pytest.mark.parametrize("name", list(UNEVEN))
def test_runtime_route_uneven_layouts_equal_one_process(uneven_runs, checkout, workdir, reference, name):
    run = uneven_runs(name)
    extra = UNEVEN[name][1]
    expected = _ok(torchrun(checkout / "pretrain_gpt.py", 1, [*TINY_GPT, *extra, "--layout-independent-init"], workdir)) if extra else reference
    assert f"transformer layers per pipeline stage (pipeline order): {UNEVEN_STAGES[name]}" in run.output
    _assert_same_curve(run, expected)


def test_uneven_checkpoint_resumes_in_the_even_layout(uneven_runs, checkout, workdir, reference):
    if checkpoint_writer_problem(checkout):
        pytest.skip(checkpoint_writer_problem(checkout))
    uneven_runs("bitpipe_first_last")
    flags = [*TINY_GPT, *BITPIPE, *LAYOUTS["tp2_pp2"], "--load", str(workdir / "checkpoint_uneven"), "--ckpt-step", "2"]
    _assert_resumed_curve(_ok(torchrun(checkout / "pretrain_gpt.py", 4, flags, workdir)), reference)


# Context parallelism 2 x pipeline 2 (4 ranks): local layers with the SDPA core attention, which
# all-gathers keys and values over the context-parallel group (megatron-core's all_gather exchange).
CONTEXT_PARALLEL = ["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--spec", *SDPA_SPEC,
                    "--pipeline-model-parallel-size", "2"]  # fmt: skip


@pytest.mark.strict_p2p
@pytest.mark.parametrize("route", ["runtime", "patch"])
def test_context_parallel_bitpipe_equals_one_process(request, checkout, workdir, reference, route):
    """BitPipe at context parallel 2 x pipeline 2 logs the losses of one process at context
    parallel 1 with megatron-core's own local attention (whose DotProductAttention asserts context
    parallel 1, so no Megatron-LM schedule runs this model at 2). Megatron-LM's get_batch cuts each
    sequence for this rank (get_batch_on_this_cp_rank) once; the edge ranks embed and compute the
    loss on their cut; Megatron-LM averages the loss over data x context parallelism."""
    root = checkout if route == "runtime" else request.getfixturevalue("patched_checkout")
    run = _ok(torchrun(root / "pretrain_gpt.py", 4, [*TINY_GPT, *BITPIPE, *CONTEXT_PARALLEL], workdir))
    assert "data-parallel size: 1, context-parallel size: 2" in run.output
    _assert_same_curve(run, reference)


# fp16 with dynamic loss scaling: a scale that overflows in the first iterations (skipped, the
# scale halved each time) and grows every 3 good ones, so the run both skips and grows again.
FP16 = ["--fp16", "--initial-loss-scale", "1048576", "--loss-scale-window", "3", "--train-iters", "12", "--eval-interval", "6"]


@pytest.mark.strict_p2p
@pytest.mark.parametrize("grads", ["fp16_grads", "fp32_grads"])
def test_fp16_loss_scaling_with_bitpipe_skips_and_scales_as_megatron(checkout, workdir, grads):
    """BitPipe at TP 2 x PP 2 in fp16 skips the iterations Megatron's own schedule skips, with
    the same loss scale after each, and logs its losses (rtol 1e-4: fp16 sums in another order;
    measured 1e-6 to 3e-6), with and without --accumulate-allreduce-grads-in-fp32."""
    flags = [*TINY_GPT, *LAYOUTS["tp2_pp2"], *FP16, *(["--accumulate-allreduce-grads-in-fp32"] if grads == "fp32_grads" else [])]
    control = _ok(torchrun(checkout / "pretrain_gpt.py", 4, [*flags, "--layout-independent-init"], workdir))
    run = _ok(torchrun(checkout / "pretrain_gpt.py", 4, [*flags, *BITPIPE], workdir))
    scales = control.loss_scales
    assert sorted(scales) == list(range(1, 13)), control.output[-3000:]
    assert any(skipped for _, skipped in scales.values()) and len({scale for scale, _ in scales.values()}) >= 2, scales
    assert run.loss_scales == scales
    assert run.losses.keys() == control.losses.keys() and len(control.losses) >= 6
    for i, loss in control.losses.items():
        assert run.losses[i] == pytest.approx(loss, rel=1e-4), f"iteration {i}"
    assert run.evals.keys() == control.evals.keys()
    for key, loss in control.evals.items():
        assert run.evals[key] == pytest.approx(loss, rel=1e-4), f"evaluation {key}"


LEARNABLE_SOFTMAX = ["--softmax-type", "learnable"]


@pytest.mark.strict_p2p
def test_learnable_softmax_offset_with_bitpipe_equals_one_process(checkout, workdir):
    """gpt-oss's learnable softmax offset (one value per attention head) starts from megatron's
    init rule, each tensor-parallel rank drawing its own heads' values, and trains like one
    process. rtol 1e-6 (the runs agree to the last printed digit): offsets drawn as if unsplit,
    every rank taking the first heads' values, moved the losses by 2e-6 to 8e-6 (measured)."""
    reference = _ok(torchrun(checkout / "pretrain_gpt.py", 1, [*TINY_GPT, *LEARNABLE_SOFTMAX, "--layout-independent-init"], workdir))
    run = _ok(torchrun(checkout / "pretrain_gpt.py", 4, [*TINY_GPT, *LEARNABLE_SOFTMAX, *BITPIPE, *LAYOUTS["tp2_pp2"]], workdir))
    _assert_same_curve(run, reference, rtol=1e-6)


def _without(flags, *names):
    """``flags`` less each of ``names`` and its value."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in names:
            skip = True
        else:
            out.append(flag)
    return out


# A batch-size ramp through Megatron-LM's sample-based training (--train-samples 40): global
# batches 4, 4, 8, 12, 12, i.e. N = 2, 2, 4, 6, 6 micro-batches per data-parallel rank at data
# parallel 2 (BitPipe's rule: an even N). core_v0.16.1 ramps up (--rampup-batch-size); at
# core_v0.19.0 megatron-core ignores that flag and steps by consumed tokens (16 per sample).
RAMPS = {
    "core_v0.16.1": ["--rampup-batch-size", "4", "4", "16", "--global-batch-size", "12"],
    # evaluation batches of 4 (N = 2 at data parallel 2): beside a step schedule Megatron-LM's default is
    # --micro-batch-size x data parallel, one micro-batch, which BitPipe refuses
    "core_v0.19.0": ["--step-batch-size-schedule", "0:4 128:8 256:12", "--eval-global-batch-size", "4"],
}
RAMP_GLOBAL_BATCHES = [4, 4, 8, 12, 12]


@pytest.mark.strict_p2p
@pytest.mark.timeout(1800)
def test_batch_size_ramp_with_bitpipe_equals_one_process(checkout, workdir):
    """BitPipe at pipeline 2 x data parallel 2 through the ramp trains like one process through
    it: the same loss and grad norm at each of the 5 iterations, the same validation losses
    (after iterations 2 and 4, and the final ones after the ramp: the weights), and both consume
    the ramp's samples per iteration (Megatron-LM's data order: its sampler's consecutive
    micro-batches)."""
    tag = find_checkout(checkout).tag
    flags = [*_without(TINY_GPT, "--global-batch-size", "--train-iters"), "--train-samples", "40", *RAMPS[tag]]
    reference = _ok(torchrun(checkout / "pretrain_gpt.py", 1, [*flags, "--layout-independent-init"], workdir, timeout=1500))
    run = _ok(torchrun(checkout / "pretrain_gpt.py", 4, [*flags, *BITPIPE, "--pipeline-model-parallel-size", "2"], workdir, timeout=1500))
    assert sorted(run.losses) == sorted(reference.losses) == [1, 2, 3, 4, 5]
    for i in reference.losses:
        assert run.losses[i] == pytest.approx(reference.losses[i], rel=RTOL), f"iteration {i}"
        assert run.grad_norms[i] == pytest.approx(reference.grad_norms[i], rel=1e-3), f"grad norm, iteration {i}"
    assert run.evals.keys() == reference.evals.keys() and (5, "validation") in run.evals
    for key, loss in reference.evals.items():
        assert run.evals[key] == pytest.approx(loss, rel=RTOL), f"evaluation {key}"
    for output in (run.output, reference.output):
        batches = [int(b) for b in re.findall(r"\| global batch size: +(\d+) \|", output)]
        consumed = [int(c) for c in re.findall(r"\| consumed samples: +(\d+) \|", output)]
        assert batches == RAMP_GLOBAL_BATCHES and consumed == list(itertools.accumulate(RAMP_GLOBAL_BATCHES))


RECOMPUTE = {
    "split_full_uniform": ["--split-backward", "--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "2"],
    "selective": ["--recompute-activations", "--recompute-modules", "core_attn"],
}  # fmt: skip


@pytest.mark.multirank
@pytest.mark.parametrize("name", sorted(RECOMPUTE))
def test_recompute_with_bitpipe_equals_one_process(name, checkout, workdir, reference):
    flags = [*TINY_GPT, *BITPIPE, "--pipeline-model-parallel-size", "2", *RECOMPUTE[name]]
    _assert_same_curve(_ok(torchrun(checkout / "pretrain_gpt.py", 2, flags, workdir)), reference)


def test_interleaved_schedule_with_overlapped_p2p_equals_one_process(checkout, workdir, reference):
    flags = [*TINY_GPT, "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
             "--layout-independent-init"]
    run = _ok(torchrun(checkout / "pretrain_gpt.py", 2, flags, workdir))
    assert "overlap_p2p_comm ................................ True" in run.output
    _assert_same_curve(run, reference)


SGD = ["--optimizer", "sgd", "--lr", "0.2"]
SEQUENCE_PARALLEL = {
    "default_tp2": (2, ["--tensor-model-parallel-size", "2", "--layout-independent-init"]),
    "bitpipe_tp2_pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", *BITPIPE]),
}


@pytest.fixture(scope="module")
def sgd_reference(checkout, workdir) -> Run:
    return _ok(torchrun(checkout / "pretrain_gpt.py", 1, [*TINY_GPT, *SGD, "--layout-independent-init"], workdir))


@pytest.mark.parametrize("layout", list(SEQUENCE_PARALLEL))
def test_sequence_parallel_equals_one_process(checkout, workdir, sgd_reference, layout):
    nproc, flags = SEQUENCE_PARALLEL[layout]
    run = _ok(torchrun(checkout / "pretrain_gpt.py", nproc, [*TINY_GPT, *SGD, *flags, "--sequence-parallel"], workdir))
    assert "sequence_parallel ............................... True" in run.output
    _assert_same_curve(run, sgd_reference)


# Refused starts: every rank checks the flags and prints the same one line, but torchrun stops the
# other ranks as soon as the first one exits, so under load a slower rank may be stopped before it prints.
def test_bert_script_with_bitpipe_is_refused_before_it_loads(checkout, workdir):
    script = checkout / "pretrain_bert.py"
    if not script.exists():
        pytest.skip(f"{checkout} has no pretrain_bert.py (core_v0.19.0)")
    run = torchrun(script, 2, ["--spec", "local", *TINY_GPT, *BITPIPE, *LAYOUTS["tp2_pp2"][2:]], workdir, timeout=300)
    errors = [line for line in run.output.splitlines() if line.startswith("megatron_bitpipe.run: error: ")]
    assert run.returncode != 0 and 1 <= len(errors) <= 2 and len(set(errors)) == 1, run.output[-3000:]  # one per rank that printed it
    assert errors[0].endswith(
        "cannot run Megatron-LM core_v0.16.1's pretrain_bert.py: the script imports Transformer Engine's BERT layer "
        "spec when it loads (whatever --spec says, so it does not load without transformer-engine), and its "
        "model_provider builds BertModel without the pg_collection it is given, so bitpipe cannot build its chunks "
        "on their own process groups; BERT with bitpipe runs in megatron-bitpipe's scripts/pretrain_bert.py"
    )
    assert "Transformer Engine is not installed" not in run.output  # refused before the script's imports


INVALID = {
    "bitpipe_tp_pp_dp_mapping": (["--pipeline-schedule", "bitpipe", "--use-tp-pp-dp-mapping"],
                                 "--use-tp-pp-dp-mapping cannot be used with --pipeline-schedule bitpipe"),
    "dualpipe_tied": (["--pipeline-schedule", "dualpipe"],
                      "--pipeline-schedule dualpipe puts a pipeline's embedding and output layer on different ranks of its "
                      "bidirectional placement: add --untie-embeddings-and-output-weights"),
    "bitpipe_layout_stages": (["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-layout", "Etttt|ttttL"],
                              "--pipeline-model-parallel-layout has 2 stages, but the bidirectional-v placement runs 2 x "
                              "--pipeline-model-parallel-size = 4 stages per pipeline"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_flags_stop_every_rank_before_communication(checkout, workdir, name):
    extra, message = INVALID[name]
    flags = [*TINY_GPT, *extra, "--pipeline-model-parallel-size", "2"]
    run = torchrun(checkout / "pretrain_gpt.py", 2, flags, workdir, timeout=300)
    assert run.returncode != 0
    errors = [line for line in run.output.splitlines() if line.startswith("megatron_bitpipe.run: error: ")]
    assert 1 <= len(errors) <= 2 and len(set(errors)) == 1, run.output[-3000:]  # one per rank that printed it
    assert message in run.output
    assert "initializing torch distributed" not in run.output


@pytest.mark.multirank
@pytest.mark.parametrize(
    "optimizer",
    [
        pytest.param(["--optimizer", "lamb", "--lr-decay-style", "rex"], id="lamb_rex"),
        pytest.param(
            ["--optimizer", "schedulefree_adamw", "--lr-decay-style", "constant", "--lr-warmup-iters", "2"],
            id="schedulefree_adamw",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("schedulefree") is None,
                reason="--optimizer schedulefree_adamw needs the schedulefree package: pip install -e '.[schedulefree]'",
            ),
        ),
    ],
)
def test_runtime_route_optimizers_bitpipe_equals_default_schedule(checkout, workdir, optimizer):
    """LAMB with REX decay and Schedule-Free AdamW (validation on its averaged weights) inside
    Megatron-LM's loop: BitPipe over 4 pipeline ranks trains like the default schedule."""
    default = _ok(torchrun(checkout / "pretrain_gpt.py", 2, [*TINY_GPT, *optimizer, "--pipeline-model-parallel-size", "2", "--layout-independent-init"], workdir))
    bitpipe = _ok(torchrun(checkout / "pretrain_gpt.py", 4, [*TINY_GPT, *optimizer, *BITPIPE, "--pipeline-model-parallel-size", "4"], workdir))
    _assert_same_curve(bitpipe, default)



# A mixture-of-experts GPT: every layer an MoE layer of 4 routed experts, top-2, dropless (no
# capacity factor), no linear biases (megatron's MoE experts), with a load-balancing loss and a
# z-loss whose coefficients are large enough that a mis-scaled auxiliary gradient shows in the
# curve. The runs are pipeline 2 x data parallel 2 with each MoE layer's experts split over the
# two data-parallel ranks (EP 2), under strict p2p. Their curve must equal one process's (expert
# parallelism 1: expert k starts from the same weights on whichever rank holds it), and the
# auxiliary losses Megatron-LM logs must equal those of its own 1F1B run in the same layout
# (Megatron-LM averages the load-balancing loss over data parallelism, but logs the z-loss of the
# logging rank's data-parallel share only).
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1", "--moe-z-loss-coeff", "0.1",
       "--disable-bias-linear"]  # fmt: skip
MOE_PP2_EP2 = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]  # x data parallel 2
ALLGATHER = ["--moe-token-dispatcher-type", "allgather"]
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
# (route, flags): the runtime route (python -m megatron_bitpipe.run) or the patch route
MOE_RUNS = {
    "runtime_bitpipe_allgather": ("runtime", [*BITPIPE, *ALLGATHER]),
    "runtime_bitpipe_split_alltoall": ("runtime", [*BITPIPE, "--split-backward", *ALLTOALL]),
    "runtime_zbv_alltoall": ("runtime", ["--pipeline-schedule", "zbv", *ALLTOALL]),
    "runtime_dualpipev_distopt_allgather": ("runtime", ["--pipeline-schedule", "dualpipev", "--use-distributed-optimizer", *ALLGATHER]),
    "patch_bitpipe_alltoall": ("patch", [*BITPIPE, *ALLTOALL]),
    "patch_zbv_allgather": ("patch", ["--pipeline-schedule", "zbv", *ALLGATHER]),
}


# MOE_RUNS that save a checkpoint at iteration 2 (where Megatron-LM's checkpoint writer runs), into
# workdir / f"checkpoint_{name}"
MOE_SAVES = ("runtime_bitpipe_allgather", "patch_zbv_allgather")


def _moe_run(root, workdir, flags, layout=MOE_PP2_EP2, check=True) -> Run:
    """The MoE GPT at pipeline 2 x data parallel 2 x EP 2 (or ``layout``) with ``flags``, under strict p2p."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEGATRON_BITPIPE_STRICT_P2P", "1")
        run = torchrun(root / "pretrain_gpt.py", 4, [*TINY_GPT, *MOE, *layout, *flags], workdir)
    return _ok(run) if check else run


@pytest.fixture(scope="module")
def moe_runs(request, checkout, workdir) -> Callable[[str], Run]:
    """``run(name)``: the :data:`MOE_RUNS` run ``name`` (once per module); those of :data:`MOE_SAVES`
    save at iteration 2."""
    runs: Dict[str, Run] = {}

    def run(name: str) -> Run:
        if name not in runs:
            route, flags = MOE_RUNS[name]
            root = checkout if route == "runtime" else request.getfixturevalue("patched_checkout")
            save = [] if checkpoint_writer_problem(checkout) or name not in MOE_SAVES else [
                "--save", str(workdir / f"checkpoint_{name}"), "--save-interval", "2"]
            runs[name] = _moe_run(root, workdir, [*flags, *save])
        return runs[name]

    return run


@pytest.fixture(scope="module")
def moe_reference(checkout, workdir) -> Run:
    run = _ok(torchrun(checkout / "pretrain_gpt.py", 1, [*TINY_GPT, *MOE, "--layout-independent-init"], workdir))
    assert sorted(run.aux_losses[1]) == ["load_balancing_loss", "z_loss"]
    return run


@pytest.fixture(scope="module")
def moe_megatron_1f1b(checkout, workdir) -> Run:
    """Megatron-LM's own 1F1B on the MoE GPT in the runs' layout, re-initialised from the seed."""
    return _moe_run(checkout, workdir, ["--layout-independent-init", *ALLTOALL])


def _assert_moe_curve(run: Run, one_process: Run, megatron_1f1b: Optional[Run] = None) -> None:
    """``run``'s curve and load-balancing losses are ``one_process``'s; with ``megatron_1f1b``
    its logged auxiliary losses are that run's."""
    _assert_same_curve(run, one_process)
    for i, losses in one_process.aux_losses.items():
        balancing = run.aux_losses[i]["load_balancing_loss"]
        assert balancing == pytest.approx(losses["load_balancing_loss"], rel=RTOL), f"load-balancing loss, iteration {i}"
        if megatron_1f1b is not None:
            assert run.aux_losses[i] == pytest.approx(megatron_1f1b.aux_losses[i], rel=RTOL), f"auxiliary losses, iteration {i}"


def test_moe_megatron_1f1b_with_expert_parallelism_equals_one_process(moe_megatron_1f1b, moe_reference):
    """``--layout-independent-init`` gives Megatron-LM's own chunks each expert by its global index."""
    _assert_moe_curve(moe_megatron_1f1b, moe_reference)


@pytest.mark.strict_p2p
@pytest.mark.parametrize("name", list(MOE_RUNS))
def test_moe_plan_schedules_equal_one_process(moe_runs, moe_reference, moe_megatron_1f1b, name):
    """Training and validation losses and grad norms equal one process's; the auxiliary losses
    Megatron-LM logs (``load_balancing_loss``, ``z_loss``) equal its own 1F1B run's."""
    _assert_moe_curve(moe_runs(name), moe_reference, moe_megatron_1f1b)


# MoE torch_dist checkpoints through Megatron-LM's own save and load: saved by (MOE_SAVES), resumed
# by (route, flags, layout). BitPipe's (runtime route) by Megatron-LM's own schedule without
# pipelining at data parallel 4 x expert parallelism 4; ZB-V's (patch route) by BitPipe.
MOE_RESUMES = {
    "runtime_bitpipe_allgather": ("runtime", ALLTOALL, ["--expert-model-parallel-size", "4"]),
    "patch_zbv_allgather": ("patch", [*BITPIPE, *ALLTOALL], MOE_PP2_EP2),
}


@pytest.mark.strict_p2p
@pytest.mark.parametrize("saved_by", list(MOE_RESUMES))
def test_moe_checkpoint_resumes_in_another_schedule_on_the_curve(request, moe_runs, checkout, workdir, moe_reference, saved_by):
    """Each routed expert is written once under its global index, so another schedule, layout
    and expert-parallel size (above 1: megatron-core keeps an expert optimizer only there) loads
    the weights and Adam's state and continues one process's curve."""
    if checkpoint_writer_problem(checkout):
        pytest.skip(checkpoint_writer_problem(checkout))
    assert "saving checkpoint at iteration       2" in moe_runs(saved_by).output
    route, flags, layout = MOE_RESUMES[saved_by]
    root = checkout if route == "runtime" else request.getfixturevalue("patched_checkout")
    load = ["--load", str(workdir / f"checkpoint_{saved_by}"), "--ckpt-step", "2"]
    resumed = _moe_run(root, workdir, [*flags, *load], layout=layout)
    _assert_resumed_curve(resumed, moe_reference)
    assert resumed.aux_losses[3]["load_balancing_loss"] == pytest.approx(moe_reference.aux_losses[3]["load_balancing_loss"], rel=RTOL)


def test_moe_checkpoint_at_expert_parallelism_2_is_refused_at_1(moe_runs, checkout, workdir):
    """Expert parallelism 1 keeps the experts in the dense optimizer, and Megatron-LM core_v0.16.1
    shards the random generators per data-parallel rank only above 1: Megatron-LM's loader would
    fail on both, so every rank stops first with one line naming them."""
    if checkpoint_writer_problem(checkout):
        pytest.skip(checkpoint_writer_problem(checkout))
    moe_runs("runtime_bitpipe_allgather")
    load = ["--load", str(workdir / "checkpoint_runtime_bitpipe_allgather"), "--ckpt-step", "2"]
    run = _moe_run(checkout, workdir, [*ALLTOALL, *load], layout=["--pipeline-model-parallel-size", "2"], check=False)
    assert run.returncode == 1, run.output[-3000:]
    (line,) = [line for line in run.output.splitlines() if line.startswith("megatron_bitpipe: error:")]
    assert "its optimizer state was saved at expert parallelism 2 and this run has 1" in line
    assert "--no-load-optim" in line and ("resume with --no-load-rng" in line) == (find_checkout(checkout).tag == "core_v0.16.1")


#: a stand-in training script: one gloo collective, then an end, ``sys.exit(0)`` or a failure
#: chosen by its flags; at the interpreter's exit each rank says whether its groups were left
ENDING_SCRIPT = """
import atexit, sys
import torch, torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
dist.all_reduce(torch.ones(4))
atexit.register(lambda: print(f"rank {rank}: process groups {'left' if dist.is_initialized() else 'destroyed'} at exit", flush=True))
if "--end-with-exit" in sys.argv:
    sys.exit(0)
if "--end-with-failure" in sys.argv:
    raise RuntimeError("the script failed")
"""


@pytest.mark.parametrize("ending, status, groups", [("", 0, "destroyed"), ("--end-with-exit", 0, "destroyed"), ("--end-with-failure", 1, "left")])
def test_the_route_destroys_the_process_groups_a_finished_script_left(checkout, tmp_path, ending, status, groups):
    scripts = tmp_path / "scripts"  # a script beside the checkout's megatron package, as in a checkout
    scripts.mkdir()
    (scripts / "megatron").symlink_to(checkout / "megatron", target_is_directory=True)
    (scripts / "ending.py").write_text(ENDING_SCRIPT)
    run = torchrun(scripts / "ending.py", 2, [ending] if ending else [], tmp_path, timeout=300)
    assert (run.returncode != 0) == (status != 0), run.output[-3000:]
    for rank in range(2):
        assert f"rank {rank}: process groups {groups} at exit" in run.output, run.output[-3000:]
