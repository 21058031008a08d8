"""Vocabulary-parallel cross entropy of Optimus 2D, averaged correctly over the batch blocks.

On the rank at ``(i, j)`` the logits are batch block ``i`` × vocabulary block ``j``. Within
a mesh row the vocabulary is split exactly as in megatron-core's 1-D vocab-parallel cross
entropy, so the row group reduces the max, the target logit and Σexp (megatron-core's own
``VocabParallelCrossEntropy`` steps are reused). That yields the per-token losses of batch
block ``i``.

:func:`optimus_cross_entropy` then all-gathers the per-token losses over the column group,
so every rank returns the ``[b, s]`` losses of the whole micro-batch — exactly what the
serial model returns. Any loss function that averages them (megatron's ``loss_func``)
therefore averages over all batch blocks: the gradient reaching each block is ``1/q`` of
what a per-block average would give. (Averaging per block and summing over the column
group makes gradients q times too large.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

from .collectives import all_reduce_sum, batch_block, gather_batch
from .mesh import OptimusMesh


class _RowVocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of logits split over ``group`` along the vocabulary.

    The member with group rank ``k`` holds vocabulary block ``k``. Overwrites the logits
    (in fp32 they are used as the softmax buffer), like megatron-core's version.
    """

    @staticmethod
    def forward(ctx, logits, target, group):
        steps = VocabParallelCrossEntropy
        logits, logits_max = steps.calculate_logits_max(logits)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        block = logits.shape[-1]
        start = group.rank() * block
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = (
            steps.calculate_predicted_logits(logits, target, logits_max, start, start + block)
        )
        predicted_and_sum = all_reduce_sum(torch.stack([predicted, sum_exp]), group)
        softmax, loss = steps.calculate_cross_entropy_loss(
            exp_logits, predicted_and_sum[0], predicted_and_sum[1]
        )
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        steps = VocabParallelCrossEntropy
        grad_2d, arange_1d, softmax_update, grad_input = (
            steps.prepare_gradient_calculation_operands(softmax, target_mask)
        )
        grad_input = steps.calculate_gradients(
            grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, grad_loss
        )
        return grad_input, None, None


def optimus_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, mesh: OptimusMesh
) -> torch.Tensor:
    """Per-token losses ``[b, s]`` of the whole micro-batch, on every rank of the mesh.

    Args:
        logits: ``[s, b/q, v/q]`` — batch block ``i``, vocabulary block ``j``; overwritten.
        labels: ``[b, s]`` token ids of the whole micro-batch (replicated over the TP group).
    """
    local_labels = batch_block(labels, 0, mesh).transpose(0, 1).contiguous()
    losses = _RowVocabParallelCrossEntropy.apply(logits, local_labels, mesh.row_group)
    return gather_batch(losses.transpose(0, 1), 0, mesh)
