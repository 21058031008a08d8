"""The mixture-of-experts GPT's pieces for its model kind (:data:`~.gpt.MOE_GPT`).

* **Layers.** :func:`moe_layer_specs`: megatron-core's local layer specs of every layer of the
  full model (:func:`~megatron_bitpipe.model.experts.moe_gpt_layer_specs`: MoE layers where
  ``--moe-layer-freq`` puts them), with SDPA's core attention under ``--attention-backend sdpa``.
* **Auxiliary losses.** megatron's router adds the load-balancing and z-losses to the
  gradients (``MoEAuxLossAutoScaler``, whose scale megatron's ``forward_step`` sets per
  micro-batch: one over the micro-batches a replica runs, as for the language-model loss) and
  records each layer's value in megatron's MoE logging tracker.
  :func:`moe_iteration_losses` reports them as Megatron-LM does: each tracked loss summed over
  the job's ranks, divided by the data-parallel size and the micro-batches per data-parallel rank
  (the mean over the global batch's micro-batches), averaged over the MoE layers
  (``load_balancing_loss``, ``seq_load_balancing_loss``, ``z_loss``); the tracker is then
  cleared. A collective over all ranks, called by every rank after each training iteration.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker
from megatron.core.transformer.spec_utils import ModuleSpec

from ..model.experts import moe_gpt_layer_specs
from ..model.sdpa_attention import with_core_attention
from ..run_config import RunConfig
from .model_kind import core_attention

__all__ = ["moe_iteration_losses", "moe_layer_specs"]


def moe_layer_specs(run: RunConfig, config: TransformerConfig) -> Tuple[ModuleSpec, ...]:
    """The :attr:`~.model_kind.ModelKind.layer_spec` of the MoE GPT: one spec per layer of the full model."""
    specs = moe_gpt_layer_specs(config)
    attention = core_attention(run)
    return specs if attention is None else tuple(with_core_attention(spec, attention) for spec in specs)


def tracked_losses(names: Sequence[str], device: torch.device) -> torch.Tensor:
    """This rank's sum over its layers and micro-batches of each tracked loss (0 for one it has not seen)."""
    tracker = get_moe_layer_wise_logging_tracker()
    values = [tracker[name]["values"].detach().float().sum().to(device) if name in tracker else torch.zeros((), device=device)
              for name in names]
    return torch.stack(values) if values else torch.zeros(0, device=device)


def moe_iteration_losses(run: RunConfig, losses: Dict[str, float]):
    """The :attr:`~.model_kind.ModelKind.iteration_losses` of the MoE GPT (module docstring):
    ``losses`` and the auxiliary losses of the iteration."""
    names = run.moe.logged_losses
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    totals = tracked_losses(names, device)
    if dist.is_initialized():
        dist.all_reduce(totals)
    clear_aux_losses_tracker()
    divisor = run.layout.data * run.batches.num_microbatches * run.moe.num_moe_layers(run.model.num_layers)
    logged = dict(losses)
    logged.update({name: float(total) / divisor for name, total in zip(names, totals.tolist())})
    return logged, {}
