"""Optimus mesh, SUMMA products, Linear and LayerNorm against serial torch on 4 gloo ranks (q=2)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from megatron_bitpipe.benchmarking.meters import CollectiveMeter
from megatron_bitpipe.optimus.collectives import DEFERRED, column_replicated, column_replicated_all
from megatron_bitpipe.optimus.layers import OptimusLayerNorm, OptimusLinear
from megatron_bitpipe.optimus.layout import shard_serial_tensor
from megatron_bitpipe.optimus.mesh import build_optimus_mesh, mesh_side
from megatron_bitpipe.optimus.summa import summa_ab, summa_abt, summa_atb
from megatron_bitpipe.cpu.launcher import launch
from .optimus_support import block, check, random, tiny_config, transposed, world_mesh

pytestmark = pytest.mark.timeout(120)

# Token dims [s, b] = [3, 4]: the batch (dim 1) is split by mesh row.
S, B = 3, 4


def test_mesh_side_rejects_non_squares():
    assert mesh_side(4) == 2 and mesh_side(9) == 3
    for bad in (1, 2, 6, 8):
        with pytest.raises(ValueError, match="--tensor-model-parallel-size"):
            mesh_side(bad)


def test_deferred_column_sums_pass_parameters_through_and_refuse_a_mix():
    """Parameters marked by ``defer_column_sums`` are used as they are (their column sum is
    the finaliser's, once per iteration); a norm whose weight is marked and bias is not would
    sum one of them twice or never: refused (no communication: no mesh is needed)."""
    weight, bias = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.zeros(2))
    setattr(weight, DEFERRED, True)
    assert column_replicated(weight, mesh=None) is weight
    with pytest.raises(ValueError, match="some of the parameters used together defer"):
        column_replicated_all((weight, bias), mesh=None)
    setattr(bias, DEFERRED, True)
    assert column_replicated_all((weight, None, bias), mesh=None) == (weight, None, bias)


def _mesh_coordinates():
    # Two TP groups with interleaved ranks, as megatron's order "dp-tp" would build them.
    groups = [dist.new_group([0, 2, 4, 6]), dist.new_group([1, 3, 5, 7])]
    tp_group = groups[dist.get_rank() % 2]
    mesh = build_optimus_mesh(tp_group)
    return (
        mesh.row,
        mesh.column,
        dist.get_process_group_ranks(mesh.row_group),
        dist.get_process_group_ranks(mesh.column_group),
    )


@pytest.mark.multirank
def test_mesh_follows_tp_rank_list_not_global_ranks():
    result = launch(_mesh_coordinates, 8)
    # rank 2 is TP rank 1 of group [0, 2, 4, 6]: mesh (0, 1), row [0, 2], column [2, 6]
    assert result[2] == (0, 1, [0, 2], [2, 6])
    assert result[4] == (1, 0, [4, 6], [0, 4])
    assert result[7] == (1, 1, [5, 7], [3, 7])
    assert result[1] == (0, 0, [1, 3], [1, 5])


def _products(compute_mesh, reference_mesh):
    """(name, 2-D result, expected block) for the three products and their input grads.

    Inputs are cut where ``compute_mesh`` places this rank; expected blocks are cut where
    ``reference_mesh`` does. Data differ in every block, so any row/column mix-up shows.
    """
    tokens, weight = {1: "row", 2: "column"}, {0: "row", 1: "column"}
    a_full = random(S, B, 6, seed=1).requires_grad_()
    w_full = random(6, 10, seed=2).requires_grad_()  # [k, n]
    wt_full = random(10, 6, seed=3).requires_grad_()  # [n, k]
    c_full = random(S, B, 10, seed=4).requires_grad_()  # [tokens, n]
    out_grads = [random(S, B, 10, seed=5), random(S, B, 10, seed=6), random(6, 10, seed=7)]

    def local(full, dims):
        return block(full.detach(), dims, compute_mesh).clone().requires_grad_()

    a, w, wt, c = (
        local(a_full, tokens),
        local(w_full, weight),
        local(wt_full, weight),
        local(c_full, tokens),
    )
    serial = [
        a_full @ w_full,
        a_full @ wt_full.t(),
        a_full.reshape(-1, 6).t() @ c_full.reshape(-1, 10),
    ]
    parallel = [
        summa_ab(a, w, compute_mesh),
        summa_abt(a, wt, compute_mesh),
        summa_atb(a, c, compute_mesh),
    ]
    torch.autograd.backward(serial, out_grads)
    out_layouts = [tokens, tokens, weight]
    torch.autograd.backward(
        parallel, [block(g, d, compute_mesh) for g, d in zip(out_grads, out_layouts)]
    )
    expected = lambda full, dims: block(full.detach(), dims, reference_mesh)  # noqa: E731
    return [
        ("A·B", parallel[0], expected(serial[0], tokens)),
        ("A·Bᵀ", parallel[1], expected(serial[1], tokens)),
        ("Aᵀ·B", parallel[2], expected(serial[2], weight)),
        ("dA", a.grad, expected(a_full.grad, tokens)),
        ("dB", w.grad, expected(w_full.grad, weight)),
        ("dBᵀ", wt.grad, expected(wt_full.grad, weight)),
        ("dC", c.grad, expected(c_full.grad, tokens)),
    ]


def _collectives(meter: CollectiveMeter) -> dict:
    return dict(Counter(call.op for call in meter.calls))


def _check_products():
    mesh = world_mesh()
    with CollectiveMeter() as meter:
        results = _products(mesh, mesh)
    for name, actual, expected in results:
        check(name, actual, expected)
    # each operand crosses its group once per product: 3 products forward (2 + 2 + 2) and
    # their 6 backward products, 6 collectives per product whatever q
    assert _collectives(meter) == {"all_gather": 12, "reduce_scatter": 6}


def _count_mismatches_of_transposed_mesh():
    mesh = world_mesh()
    results = _products(transposed(mesh), mesh)
    return sum(not torch.allclose(actual, expected) for _, actual, expected in results)


@pytest.mark.multirank
def test_summa_products_and_grads_equal_serial():
    launch(_check_products, 4)


@pytest.mark.multirank
def test_transposed_mesh_is_caught():
    # Swapping rows and columns is self-consistent, so only the off-diagonal ranks (1 and 2)
    # can tell: every one of their 7 results must differ from the true block.
    assert launch(_count_mismatches_of_transposed_mesh, 4) == [0, 7, 7, 0]


def _linear(skip_bias_add: bool):
    mesh = world_mesh()
    config = tiny_config()
    layer = OptimusLinear(
        6,
        10,
        config=config,
        init_method=config.init_method,
        bias=True,
        skip_bias_add=skip_bias_add,
        mesh=mesh,
    )
    serial = torch.nn.Linear(6, 10)
    with torch.no_grad():
        serial.weight.copy_(random(10, 6, seed=11))
        serial.bias.copy_(random(10, seed=12))
        layer.weight.copy_(shard_serial_tensor(serial.weight, layer.weight.optimus_layout, mesh))
        layer.bias.copy_(shard_serial_tensor(serial.bias, layer.bias.optimus_layout, mesh))
    tokens = {1: "row", 2: "column"}
    x_full = random(S, B, 6, seed=13).requires_grad_()
    x = block(x_full.detach(), tokens, mesh).clone().requires_grad_()
    grad_full = random(S, B, 10, seed=14)

    y_full = serial(x_full)
    y_full.backward(grad_full)
    y, bias = layer(x)
    if skip_bias_add:
        y = y + bias
    y.backward(block(grad_full, tokens, mesh))
    check("y", y, block(y_full.detach(), tokens, mesh))
    check("dx", x.grad, block(x_full.grad, tokens, mesh))
    check(
        "dW",
        layer.weight.grad,
        shard_serial_tensor(serial.weight.grad, layer.weight.optimus_layout, mesh),
    )
    check(
        "db",
        layer.bias.grad,
        shard_serial_tensor(serial.bias.grad, layer.bias.optimus_layout, mesh),
    )
    # megatron counts a column-replicated bias once per column: on mesh row 0 only
    assert layer.weight.tensor_model_parallel
    assert layer.bias.tensor_model_parallel == (mesh.row == 0)


@pytest.mark.multirank
@pytest.mark.parametrize("skip_bias_add", [False, True])
def test_linear_equals_serial(skip_bias_add):
    launch(_linear, 4, skip_bias_add)


def _norm(normalization: str):
    mesh = world_mesh()
    config = tiny_config(normalization=normalization)
    layer = OptimusLayerNorm(config, 8, eps=1e-5, mesh=mesh)
    if normalization == "LayerNorm":
        serial = torch.nn.LayerNorm(8, eps=1e-5)
    else:
        serial = torch.nn.RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        serial.weight.copy_(random(8, seed=21))
        layer.weight.copy_(block(serial.weight, {0: "column"}, mesh))
        if getattr(serial, "bias", None) is not None:
            serial.bias.copy_(random(8, seed=22))
            layer.bias.copy_(block(serial.bias, {0: "column"}, mesh))
    tokens = {1: "row", 2: "column"}
    # an offset mean checks the two-pass variance
    x_full = (random(S, B, 8, seed=23) * 3 + 5).requires_grad_()
    x = block(x_full.detach(), tokens, mesh).clone().requires_grad_()
    grad_full = random(S, B, 8, seed=24)
    y_full = serial(x_full)
    y_full.backward(grad_full)
    with CollectiveMeter() as meter:
        y = layer(x)
        y.backward(block(grad_full, tokens, mesh))
    # forward: statistics (LayerNorm: one all-gather of block means and M2; RMSNorm: Σx²);
    # backward: (Σg, Σg·x̂) and the weight (+ bias) gradients summed over the column
    statistics = {"all_gather": 1} if normalization == "LayerNorm" else {"all_reduce": 1}
    assert Counter(_collectives(meter)) == Counter(statistics) + Counter({"all_reduce": 2})
    check("y", y, block(y_full.detach(), tokens, mesh))
    check("dx", x.grad, block(x_full.grad, tokens, mesh))
    check("dγ", layer.weight.grad, block(serial.weight.grad, {0: "column"}, mesh))
    if getattr(serial, "bias", None) is not None:
        check("dβ", layer.bias.grad, block(serial.bias.grad, {0: "column"}, mesh))


@pytest.mark.multirank
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_equals_serial(normalization):
    launch(_norm, 4, normalization)
