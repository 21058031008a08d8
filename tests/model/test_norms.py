"""The torch norms megatron-core's local spec gets from megatron-bitpipe: sequence-parallel
marks, and zero-centered gamma (``--apply-layernorm-1p``) computed as gamma = weight + 1."""

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from megatron_bitpipe.model.norms import SequenceParallelTorchNorm, ZeroCenteredLayerNorm, ZeroCenteredRMSNorm


def _config(**kwargs) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, **kwargs)


@pytest.mark.parametrize("normalization, plain", [("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm)])
def test_zero_centered_norm_is_the_plain_norm_with_gamma_one_plus_its_weight(normalization, plain):
    norm = SequenceParallelTorchNorm(_config(normalization=normalization, layernorm_zero_centered_gamma=True), 8, eps=1e-5)
    assert isinstance(norm, ZeroCenteredLayerNorm if normalization == "LayerNorm" else ZeroCenteredRMSNorm)
    assert torch.equal(norm.weight, torch.zeros(8))
    reference = plain(8, eps=1e-5)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(norm(x), reference(x))  # gamma 1 at the start
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
        reference.weight.copy_(norm.weight + 1)
        if normalization == "LayerNorm":
            norm.bias.fill_(0.25)
            reference.bias.fill_(0.25)
    torch.testing.assert_close(norm(x), reference(x), rtol=0, atol=1e-6)
    norm(x).sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(norm.weight.grad, reference.weight.grad, rtol=0, atol=1e-6)


def test_sequence_parallel_norm_marks_its_parameters_and_refuses_memory_efficient_norms():
    norm = SequenceParallelTorchNorm(_config(sequence_parallel=True, tensor_model_parallel_size=2), 8)
    assert type(norm) is torch.nn.LayerNorm and all(p.sequence_parallel for p in norm.parameters())
    with pytest.raises(ValueError, match="--memory-efficient-layer-norm needs apex or Transformer Engine"):
        SequenceParallelTorchNorm(_config(memory_efficient_layer_norm=True), 8)
