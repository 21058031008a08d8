"""Training on a coreset: the sample stream and the weighted GPT loss.

**Stream.** :class:`CoresetDataset` is the run's training set restricted to the coreset:
position p holds training sample ``indices[p mod k]`` (ascending, so the selected samples come
in the order the run without a coreset would have met them, cycled every k positions), with
its loss weight w_j = γ_j · k / n as the sample's ``loss_weight`` (a 0-d float32 tensor). The
loop reads positions exactly as it reads the full training set (consumed samples, micro-batch
and data-parallel order), so any layout and any resume sees the same stream.

**Loss.** :func:`weighted_gpt_loss`: Megatron-LM's GPT loss with each sample's token losses
multiplied by its weight; the token count (megatron-core's divisor) is not weighted. The
loss of a micro-batch is therefore Σ_b w_b Σ_t m_bt l_bt / Σ_bt m_bt, and the logged ``lm loss``
the same over the global batch: the weighted estimate of the full data's loss. Since the
weights average 1 over the cycle, the expected gradient is the coreset's estimate of the full
data's mean gradient (:meth:`~.identity.CoresetFile.loss_weights`); with every sample and γ = 1
the weights are exactly 1.0 and the loss is bit for bit Megatron-LM's.
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import torch

from .identity import CoresetFile

__all__ = ["CoresetDataset", "weighted_gpt_loss"]


class CoresetDataset:
    """Random-access stream of the coreset's samples of ``dataset`` (see the module docstring)."""

    def __init__(self, dataset, coreset: CoresetFile):
        self.dataset = dataset
        self.indices = coreset.indices
        self.weights = torch.from_numpy(coreset.loss_weights().astype(np.float32))

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int) -> Dict[str, torch.Tensor]:
        j = position % len(self.indices)
        sample = dict(self.dataset[int(self.indices[j])])
        sample["loss_weight"] = self.weights[j]
        return sample


def weighted_gpt_loss(loss_mask: torch.Tensor, output: torch.Tensor, sample_weights: Optional[torch.Tensor] = None):
    """Megatron-LM's GPT loss (``loss_mask`` [b, s], per-token losses ``output`` [b, s]) with
    each sample's losses times ``sample_weights`` [b] (None: unweighted): (Σ w·m·l, Σ m,
    ``{"lm loss": [Σ w·m·l, Σ m]}``)."""
    losses = output.float().view(-1)
    mask = loss_mask.float()
    count = mask.sum().clone().detach().to(torch.int)
    if sample_weights is not None:
        mask = mask * sample_weights.float().view(-1, *([1] * (mask.dim() - 1)))
    loss = torch.sum(losses * mask.view(-1))
    report = torch.cat([loss.clone().detach().view(1), count.view(1).float()])
    return loss, count, {"lm loss": report}
