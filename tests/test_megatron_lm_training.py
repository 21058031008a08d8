"""Megatron-LM's own pretrain_gpt.py with BitPipe, through both routes, on CPU ranks (gloo).

Needs a Megatron-LM checkout (tag core_v0.16.1) in ``MEGATRON_LM_PATH``; skipped otherwise.
Every run trains the same tiny GPT on mock data for 4 iterations (evaluation after 2 and 4)
with ``torchrun -m megatron_bitpipe.cpu.megatron_lm``, i.e. ``python -m
megatron_bitpipe.run`` plus the CPU layer. The reference is Megatron-LM's default schedule
(1F1B, pipeline 2) with ``--layout-independent-init``; BitPipe must give the same training
loss and grad norm at every iteration and the same validation and test losses (rtol 1e-5 on
the 7 digits Megatron-LM prints):

* runtime route, tensor 2 x pipeline 2 (4 ranks), saving a checkpoint at iteration 2;
* resuming that checkpoint (``--load``, ``--ckpt-step 2``) continues the same loss curve;
* patch route: a copy of the checkout patched by ``scripts/apply_megatron_patch.py``,
  pipeline 4 (4 ranks);
* invalid flags stop every rank with one error line before torch.distributed starts;
* ``--optimizer lamb --lr-decay-style rex`` and ``--optimizer schedulefree_adamw``: BitPipe
  (pipeline 4) trains like the default schedule (pipeline 2) with the same optimizer.

(pretrain_bert.py at core_v0.16.1 imports Transformer Engine's BERT layer spec when it is
loaded, so it cannot run on a CPU machine at all.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from megatron_bitpipe.megatron_lm.checkout import find_checkout

from .megatron_lm_support import REPO, TINY_GPT, Run, checkout_or_skip, torchrun

pytestmark = pytest.mark.timeout(900)
RTOL = 1e-5
BITPIPE = ["--pipeline-schedule", "bitpipe"]


@pytest.fixture(scope="module")
def checkout():
    root = checkout_or_skip()
    return find_checkout(root).root  # a wrong checkout fails here, naming the path and the tag


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("megatron_lm")


@pytest.fixture(scope="module")
def reference(checkout, workdir) -> Run:
    flags = [*TINY_GPT, "--pipeline-model-parallel-size", "2", "--layout-independent-init"]
    return _ok(torchrun(checkout / "pretrain_gpt.py", 2, flags, workdir))


@pytest.fixture(scope="module")
def bitpipe_runtime(checkout, workdir) -> Run:
    flags = [*TINY_GPT, *BITPIPE, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--save", str(workdir / "checkpoint"), "--save-interval", "2", "--ckpt-format", "torch"]
    return _ok(torchrun(checkout / "pretrain_gpt.py", 4, flags, workdir))


@pytest.fixture(scope="module")
def patched_checkout(checkout, workdir):
    copy = workdir / "Megatron-LM"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git", "tests", "docs", "examples"))
    script = [sys.executable, str(REPO / "scripts" / "apply_megatron_patch.py"), str(copy)]
    applied = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert applied.returncode == 0 and "patch applied" in applied.stdout, applied.stderr
    return copy


def _ok(run: Run) -> Run:
    assert run.returncode == 0, run.output[-5000:]
    return run


def _assert_same_curve(run: Run, reference: Run, iterations=range(1, 5)):
    assert sorted(reference.losses) == [1, 2, 3, 4]
    for i in iterations:
        assert run.losses[i] == pytest.approx(reference.losses[i], rel=RTOL), f"iteration {i}"
        assert run.grad_norms[i] == pytest.approx(reference.grad_norms[i], rel=1e-3), f"grad norm, iteration {i}"
    assert run.evals.keys() == reference.evals.keys()
    for key, loss in reference.evals.items():
        assert run.evals[key] == pytest.approx(loss, rel=RTOL), f"evaluation {key}"


@pytest.mark.multirank
def test_runtime_route_bitpipe_equals_default_schedule(bitpipe_runtime, reference):
    _assert_same_curve(bitpipe_runtime, reference)
    assert "saving checkpoint at iteration       2" in bitpipe_runtime.output


@pytest.mark.multirank
def test_resume_from_bitpipe_checkpoint_continues_the_curve(bitpipe_runtime, checkout, workdir, reference):
    flags = [*TINY_GPT, *BITPIPE, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
             "--load", str(workdir / "checkpoint"), "--ckpt-step", "2", "--ckpt-format", "torch"]
    resumed = _ok(torchrun(checkout / "pretrain_gpt.py", 4, flags, workdir))
    assert sorted(resumed.losses) == [3, 4]
    # Megatron-LM logs the first iteration after a resume without resetting its averages, so
    # iteration 4's logged loss is the mean of 3 and 4; the evaluations pin the weights.
    assert resumed.losses[3] == pytest.approx(reference.losses[3], rel=RTOL)
    assert resumed.losses[4] == pytest.approx((reference.losses[3] + reference.losses[4]) / 2, rel=RTOL)
    for key, loss in reference.evals.items():
        if key[0] == 4:
            assert resumed.evals[key] == pytest.approx(loss, rel=RTOL), f"evaluation {key}"


@pytest.mark.multirank
def test_patch_route_bitpipe_equals_default_schedule(patched_checkout, workdir, reference):
    flags = [*TINY_GPT, *BITPIPE, "--pipeline-model-parallel-size", "4"]
    _assert_same_curve(_ok(torchrun(patched_checkout / "pretrain_gpt.py", 4, flags, workdir)), reference)


@pytest.mark.multirank
def test_invalid_flags_stop_every_rank_before_communication(checkout, workdir):
    flags = [*TINY_GPT, *BITPIPE, "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]
    run = torchrun(checkout / "pretrain_gpt.py", 2, flags, workdir, timeout=300)
    assert run.returncode != 0
    errors = [line for line in run.output.splitlines() if line.startswith("megatron_bitpipe.run: error: ")]
    assert len(errors) == 2, run.output[-3000:]  # one per rank
    assert "--use-distributed-optimizer cannot be used with --pipeline-schedule bitpipe" in run.output
    assert "initializing torch distributed" not in run.output



@pytest.mark.multirank
@pytest.mark.parametrize(
    "optimizer",
    [
        ["--optimizer", "lamb", "--lr-decay-style", "rex"],
        ["--optimizer", "schedulefree_adamw", "--lr-decay-style", "constant", "--lr-warmup-iters", "2"],
    ],
    ids=["lamb_rex", "schedulefree_adamw"],
)
def test_runtime_route_optimizers_bitpipe_equals_default_schedule(checkout, workdir, optimizer):
    """LAMB with REX decay and Schedule-Free AdamW (validation on its averaged weights) inside
    Megatron-LM's loop: BitPipe over 4 pipeline ranks trains like the default schedule."""
    default = _ok(torchrun(checkout / "pretrain_gpt.py", 2, [*TINY_GPT, *optimizer, "--pipeline-model-parallel-size", "2", "--layout-independent-init"], workdir))
    bitpipe = _ok(torchrun(checkout / "pretrain_gpt.py", 4, [*TINY_GPT, *optimizer, *BITPIPE, "--pipeline-model-parallel-size", "4"], workdir))
    _assert_same_curve(bitpipe, default)
