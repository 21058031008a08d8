"""A torch_dist checkpoint saved through Megatron-Bridge under BitPipe (pipeline 2, strict p2p)
is resumed on the uninterrupted curve — the resumed iterations' losses and grad norms equal
those of one 6-iteration run — by stock one-process Bridge (its own GPTModelProvider and
forward step) and by ZB-V at pipeline 2 through Bridge (another schedule's placement: other
chunks on other ranks)."""

from __future__ import annotations

import pytest

from megatron_bitpipe.cpu.launcher import launch

from .bridge_support import train

pytestmark = [pytest.mark.multirank, pytest.mark.strict_p2p]


def test_a_bitpipe_checkpoint_resumes_under_stock_bridge_and_zbv(tmp_path):
    uninterrupted = launch(train, 1, dict(schedule="default", pp=1, iters=6), timeout=600)[0]
    save = str(tmp_path / "ckpt")
    launch(train, 2, dict(schedule="bitpipe", pp=2, iters=3, decay_iters=6, save=save), timeout=600)
    stock = launch(train, 1, dict(schedule="default", pp=1, iters=6, load=save, stock=True), timeout=600)[0]
    zbv = launch(train, 2, dict(schedule="zbv", pp=2, iters=6, load=save), timeout=600)[-1]
    for resumed in (stock, zbv):
        assert resumed["loss"] == pytest.approx(uninterrupted["loss"][3:], rel=1e-5)
        assert resumed["grad_norm"] == pytest.approx(uninterrupted["grad_norm"][3:], rel=1e-5)
