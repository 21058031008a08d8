"""Activation and collective meters used by scripts/bench_optimus.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_bitpipe.cpu.launcher import launch
from megatron_bitpipe.benchmarking.meters import CollectiveMeter, SavedActivationMeter

pytestmark = pytest.mark.timeout(60)


def test_saved_activation_meter_counts_distinct_non_parameter_storages():
    weight = torch.nn.Parameter(torch.randn(4, 8))
    x = torch.randn(3, 4, requires_grad=True)
    with SavedActivationMeter([weight]) as meter:
        hidden = x @ weight  # saves x (48 B) and weight (excluded)
        out = torch.tanh(hidden)  # saves tanh output (96 B)
        (out * out).sum()  # saves out twice: counted once
    assert meter.bytes == 3 * 4 * 4 + 3 * 8 * 4
    assert meter.storages == [(3 * 4 * 4, torch.float32), (3 * 8 * 4, torch.float32)]


def _collectives():
    pair = dist.new_group([0, 1])
    with CollectiveMeter() as meter:
        dist.all_reduce(torch.ones(10), group=pair)  # 40 B, p=2: 2·½·40 = 40
        dist.broadcast(torch.ones(10), group=pair, group_src=0)  # ½·40 = 20
        dist.all_gather_into_tensor(torch.empty(20), torch.ones(10), group=pair)  # ½·80 = 40
        dist.reduce_scatter_tensor(torch.empty(10), torch.ones(20), group=pair)  # ½·80 = 40
        if hasattr(dist, "all_gather_single"):  # torch 2.13's names for the two (Optimus calls them)
            dist.all_gather_single(torch.empty(20), torch.ones(10), group=pair)  # 40
            dist.reduce_scatter_single(torch.empty(10), torch.ones(20), group=pair)  # 40
    after = len(meter.calls)
    dist.all_reduce(torch.ones(1), group=pair)  # not recorded: meter closed
    return (
        [c.op for c in meter.calls],
        meter.wire_bytes(),
        meter.payload_bytes(),
        after == len(meter.calls),
    )


@pytest.mark.multirank
def test_collective_meter_records_ops_and_bytes():
    ops, wire, payload, closed = launch(_collectives, 2)[0]
    single = ["all_gather", "reduce_scatter"] if hasattr(dist, "all_gather_single") else []
    assert ops == ["all_reduce", "broadcast", "all_gather", "reduce_scatter", *single]
    assert wire == 140 + 40 * len(single) and payload == 240 + 80 * len(single) and closed
