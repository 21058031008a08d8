"""Per-sample gradient proxies: the gradient at the output layer (CRAIG's last-layer proxy).

For sample i with logits z_t (over the padded vocabulary V, position t), labels y_t and loss
mask m_t, the sample's loss is the mean token cross entropy
L_i = Σ_t m_t CE(z_t, y_t) / Σ_t m_t. Its gradient with respect to a logit vector is
softmax(z_t) − onehot(y_t) (times m_t / Σ m), and the proxy is its sum over positions:

    g_i = Σ_t m_t (softmax(z_t) − onehot(y_t)) / Σ_t m_t        ∈ R^V  (dimension: padded vocab)

— the gradient of L_i with respect to a bias added to every position's logits, i.e. the output
layer's gradient summed over the sequence. It is computed in closed form from one forward
pass (no backward), in float32, with the model in evaluation mode.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import numpy as np
import torch

__all__ = ["logit_gradient_proxies", "proxies_for"]


def logit_gradient_proxies(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """g [b, V] from ``logits`` [b, s, V], ``labels`` [b, s] and ``loss_mask`` [b, s] (see the
    module docstring); a sample without loss tokens gets 0."""
    grad = torch.softmax(logits.float(), dim=-1)
    grad.scatter_add_(-1, labels.long().unsqueeze(-1), -torch.ones_like(grad[..., :1]))
    mask = loss_mask.float()
    return torch.einsum("bsv,bs->bv", grad, mask) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)


@torch.no_grad()
def proxies_for(
    model: torch.nn.Module,
    samples: Callable[[int], Dict[str, torch.Tensor]],
    positions: Sequence[int],
    batch_size: int,
    collate: Callable,
    device: torch.device,
    progress: Optional[Callable[[int], None]] = None,
) -> np.ndarray:
    """Proxies [len(positions), V] (float32) of the samples ``samples(p)`` for ``positions``,
    ``batch_size`` at a time through ``model`` (one chunk holding the whole GPT model: it
    returns logits [b, s, V] without labels)."""
    was_training = model.training
    model.eval()
    rows = []
    for start in range(0, len(positions), batch_size):
        batch = collate([samples(p) for p in positions[start : start + batch_size]])
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(batch["tokens"], batch["position_ids"], None)
        rows.append(logit_gradient_proxies(logits, batch["labels"], batch["loss_mask"]).cpu())
        if progress is not None:
            progress(len(rows[-1]))
    model.train(was_training)
    return torch.cat(rows).numpy()
