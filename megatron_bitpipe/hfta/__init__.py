"""HFTA: a horizontally fused array of B GPT (or BERT) models trained in one job (``--hfta-models``).

Every weight carries a leading model dimension, linears are batched GEMMs, and one step trains
all B models on the same batches, each with its own learning rate, initial weights, gradient
norm and clipping; the loss is the sum of the models' losses, so each model's gradient is its
own. docs/hfta.md describes it.

* :mod:`.settings` — the flags and their rules (pure Python), :class:`HftaSettings`;
* :mod:`.layers` — the batched linear, norm and embedding, and the fused activation layout;
* :mod:`.model` — :class:`~.model.HftaGPTModel`, the layer spec, the loss;
* :mod:`.bert` — :class:`~.bert.HftaBertChunk` (BERT) and its layer spec;
* :mod:`.reports` — the per-model loss reports and log fields of models with several losses;
* :mod:`.optimizer` — one megatron optimizer per model over its slices (with
  ``--use-distributed-optimizer``: over this rank's shares of them);
* :mod:`.extract` — model ``k`` of a fused checkpoint as an ordinary one.

Only :mod:`.settings` is imported here (the scripts check flags before importing torch).
"""

from .settings import HftaSettings, add_hfta_args, hfta_problems, hfta_settings

__all__ = ["HftaSettings", "add_hfta_args", "hfta_problems", "hfta_settings"]
