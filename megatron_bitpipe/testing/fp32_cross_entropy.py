"""fp32 gradients from megatron-core's native fused cross entropy (tests only).

megatron-core 0.16's ``fused_vocab_parallel_cross_entropy`` (``cross_entropy_loss_fusion=True,
cross_entropy_fusion_impl='native'``, the only cross entropy that takes the model's tp group
instead of the global one) returns the logits' gradient cast to bfloat16, whatever the
model's dtype: 8 significant bits. Two fp32 runs whose logits differ in the last bit (a
pipeline and a single process summing in another order) can then round a gradient element
to neighbouring bf16 values, a relative jump of up to 2^-8 — far above the tolerance of an
fp32 equivalence test, and visible as soon as few tokens carry the loss (BERT's masked
tokens). :func:`enable_fp32_cross_entropy_gradients` makes that backward return the fp32
gradient it computes (autograd casts it to the logits' dtype); apply it to *both* sides of a
comparison. The forward is unchanged.

Idempotent, process-wide; production code never imports this module.
"""

from __future__ import annotations

import torch
from megatron.core.fusions import fused_cross_entropy

__all__ = ["enable_fp32_cross_entropy_gradients"]


def _gradients(
    softmax: torch.Tensor, grad_output: torch.Tensor, target_mask: torch.Tensor, masked_target_1d: torch.Tensor
) -> torch.Tensor:
    """d loss / d logits = (softmax - one_hot(target on this tp rank)) * grad_output, in fp32.

    ``softmax``: ``[s, b, v / tp]`` fp32; ``target_mask``: true where the target is on another
    tp rank; ``masked_target_1d``: the local target index (0 where masked).
    """
    grad = softmax.clone()
    rows = grad.view(-1, grad.size(-1))
    on_rank = (~target_mask.view(-1)).to(grad.dtype)
    rows[torch.arange(rows.size(0), device=rows.device), masked_target_1d] -= on_rank
    return grad * grad_output.unsqueeze(-1)


def enable_fp32_cross_entropy_gradients() -> None:
    """Replace the fused cross entropy's gradient function by :func:`_gradients`."""
    fused_cross_entropy.calculate_gradients = _gradients
