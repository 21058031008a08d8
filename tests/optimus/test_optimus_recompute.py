"""Optimus 2D keeps fewer activations for backward: recipes, recomputed activation, dropout.

Exact equivalence of the whole model with recomputation is ``test_optimus_gpt.py`` (dropout
0); here: the building blocks against plain autograd (including dropout, with the mask
replayed from the same seed), and that a real 2-D transformer layer on 4 ranks keeps
neither the norm outputs nor the MLP activation nor the dropped-out attention probabilities.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_bitpipe.optimus.attention import dropout_matmul
from megatron_bitpipe.optimus.recompute import attach_recipe, recipe_of, recomputed
from megatron_bitpipe.cpu.launcher import launch

pytestmark = pytest.mark.timeout(120)


def _saved_storages(fn):
    """Run ``fn``; return ``{data_ptr: (elements, dtype)}`` of the storages autograd saved
    while it ran, and ``fn``'s result."""
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = (storage.nbytes() // tensor.element_size(), tensor.dtype)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return saved, result


def test_recipe_is_dropped_after_an_in_place_change():
    x = torch.randn(3)
    out = attach_recipe(x * 2, lambda v: v * 2, x)
    assert recipe_of(out).function(*recipe_of(out).inputs).equal(out)
    out.add_(1)
    assert recipe_of(out) is None
    assert recipe_of(torch.randn(3)) is None


@pytest.mark.parametrize("gated", [False, True])
def test_recomputed_activation_keeps_only_its_input(gated):
    def activation(z):
        if not gated:
            return F.gelu(z)
        gate, linear = z.chunk(2, dim=-1)
        return F.silu(gate) * linear

    z = torch.randn(5, 8, requires_grad=True)
    grad = torch.randn(5, 4 if gated else 8)
    saved, out = _saved_storages(lambda: recomputed(activation, z))
    assert saved.keys() == {z.untyped_storage().data_ptr()}
    assert recipe_of(out).function(*recipe_of(out).inputs).equal(out)
    (grad_z,) = torch.autograd.grad(out, z, grad)
    expected = activation(z)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(grad_z, torch.autograd.grad(expected, z, grad)[0], rtol=0, atol=0)


def test_dropout_matmul_equals_dropout_then_matmul():
    p = 0.3
    probs = torch.softmax(torch.randn(6, 5, 5), dim=-1).requires_grad_()
    value = torch.randn(6, 5, 4, requires_grad=True)
    grad = torch.randn(6, 5, 4)
    torch.manual_seed(7)
    saved, out = _saved_storages(lambda: dropout_matmul(probs, value, p))
    torch.manual_seed(7)  # the same mask: drawn the same way from the same generator state
    keep = torch.rand(probs.shape) >= p
    assert 0 < keep.sum() < keep.numel()
    expected = torch.matmul(probs * keep / (1 - p), value)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)
    actual_grads = torch.autograd.grad(out, (probs, value), grad)
    expected_grads = torch.autograd.grad(expected, (probs, value), grad)
    for actual, wanted in zip(actual_grads, expected_grads):
        torch.testing.assert_close(actual, wanted, rtol=1e-6, atol=1e-7)
    # probs and value themselves, plus one bool mask; no dropped-out copy of probs
    dtypes = sorted(str(dtype) for _, dtype in saved.values())
    assert dtypes == ["torch.bool", "torch.float32", "torch.float32"]
    assert {probs.untyped_storage().data_ptr(), value.untyped_storage().data_ptr()} < saved.keys()


def _layer_keeps():
    """Storages a 2-D transformer layer saves, and the tensors recomputation should drop."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_bitpipe.optimus.spec import get_optimus_gpt_layer_spec
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from .optimus_support import tiny_config, world_mesh

    enable_cpu_megatron()
    mesh = world_mesh()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(
        0, tp_rank=mesh.tp_rank, ep_rank=0, etp_rank=0, force_reset_rng=True
    )
    parallel_state._set_global_memory_buffer()
    solo = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    config = tiny_config(
        hidden_size=16,
        num_attention_heads=4,
        tensor_model_parallel_size=4,
        hidden_dropout=0.1,
        attention_dropout=0.1,
    )
    pgs = ProcessGroupCollection(tp=mesh.tp_group, cp=solo, pp=solo)
    spec = get_optimus_gpt_layer_spec(mesh)
    layer = build_module(spec, config=config, layer_number=1, pg_collection=pgs).train()
    recomputable = {}  # tensors a SUMMA linear would otherwise keep
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        getattr(layer, name).register_forward_hook(
            lambda module, args, output, name=name: recomputable.update({name: output})
        )
    layer.mlp.linear_fc2.register_forward_pre_hook(
        lambda module, args: recomputable.update(activation=args[0])
    )
    seq, batch, heads = 8, 4, 4
    hidden = torch.randn(seq, batch // 2, 8, requires_grad=True)
    saved, (output, _) = _saved_storages(lambda: layer(hidden, attention_mask=None))
    output.sum().backward()  # the recomputations run
    kept = {name: t.untyped_storage().data_ptr() in saved for name, t in recomputable.items()}
    # attention: [b/q · heads/q, s, s] probabilities (float) and dropout mask (bool), once each
    scores = (batch // 2) * (heads // 2) * seq * seq
    weights = {param.untyped_storage().data_ptr() for param in layer.parameters()}
    kept["attention"] = sorted(
        str(dtype)
        for ptr, (elements, dtype) in saved.items()
        if elements == scores and ptr not in weights
    )
    return kept


@pytest.mark.multirank
def test_transformer_layer_keeps_no_recomputable_tensor():
    for kept in launch(_layer_keeps, 4):
        assert kept == {
            "input_layernorm": False,
            "pre_mlp_layernorm": False,
            "activation": False,
            "attention": ["torch.bool", "torch.float32"],
        }
