"""Plan schedules in a Megatron-Bridge recipe, trained through Bridge's own ``pretrain`` on CPU
ranks (strict p2p: NCCL's point-to-point rules on gloo), equal one-process Bridge: every
iteration's loss and grad norm, the validation and the test loss (fp32). BitPipe at pipeline 2
and 4 and with split backwards, ZB-V and DualPipeV at pipeline 2."""

from __future__ import annotations

import pytest

from megatron_bitpipe.cpu.launcher import launch

from .bridge_support import train

pytestmark = [pytest.mark.multirank, pytest.mark.strict_p2p]

TIMEOUT = 600


@pytest.fixture(scope="module")
def one_process():
    return launch(train, 1, dict(schedule="default", pp=1), timeout=TIMEOUT)[0]


def _assert_equal(record, reference):
    assert record["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert record["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    assert record["valid"] == pytest.approx(reference["valid"], rel=1e-5)
    assert record["test"] == pytest.approx(reference["test"], rel=1e-5)
    assert len(record["loss"]) == 3 and record["valid"] and record["test"]


@pytest.mark.parametrize(
    "schedule,pp,model",
    [("bitpipe", 2, {}), ("bitpipe", 4, {}), ("bitpipe", 2, {"split_backward": True}), ("zbv", 2, {}), ("dualpipev", 2, {})],
    ids=["bitpipe-pp2", "bitpipe-pp4", "bitpipe-split-pp2", "zbv-pp2", "dualpipev-pp2"],
)
def test_plan_schedule_equals_one_process(one_process, schedule, pp, model):
    ranks = launch(train, pp, dict(schedule=schedule, pp=pp, num_layers=2 * pp, **model), timeout=TIMEOUT)
    reference = one_process if pp == 2 else launch(train, 1, dict(schedule="default", pp=1, num_layers=8), timeout=TIMEOUT)[0]
    _assert_equal(ranks[-1], reference)  # Bridge logs the losses of the last pipeline rank
    assert all(rank["grad_norm"] == ranks[-1]["grad_norm"] for rank in ranks)
    assert all(rank["hooks"] for rank in ranks), "grad_scale_func, finalize_model_grads_func or timers missed a chunk"
