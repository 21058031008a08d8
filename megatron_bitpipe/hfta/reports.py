"""The loss reports of a fused array of models that each report several losses (BERT: ``lm
loss`` and ``sop loss``; GPT: ``lm loss``): names and the training logs' fields.

Model ``k``'s report of loss ``name`` is ``"<name> k"`` (:func:`model_loss`).
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

__all__ = ["hfta_iteration_losses", "hfta_loss_names", "model_loss"]


def model_loss(name: str, k: int) -> str:
    """The report of model ``k``'s loss ``name``: ``"lm loss 3"``."""
    return f"{name} {k}"


def hfta_loss_names(names: Sequence[str], num_models: int) -> Tuple[str, ...]:
    """The loss reports of a fused array of models reporting ``names``: each name (the models'
    mean), then ``"<name> k"`` per model ``k``, model-major (``lm loss 0``, ``sop loss 0``, ...)."""
    return tuple(names) + tuple(model_loss(name, k) for k in range(num_models) for name in names)


def hfta_iteration_losses(losses: Dict[str, float], names: Sequence[str], num_models: int) -> Tuple[Dict[str, float], Dict[str, object]]:
    """A training iteration's reduced losses of a fused array for the logs: each name's mean
    and ``best <name>``, the best model's, and the JSON/line fields ``<name>_losses`` with
    ``_`` for spaces (``lm_losses``, ``sop_losses``: model k's at index k) and ``best_model``,
    the model whose summed losses (its training loss) are lowest (GPT: ``names = ("lm loss",)``)."""
    per_model = {name: [losses[model_loss(name, k)] for k in range(num_models)] for name in names}
    best = min(range(num_models), key=lambda k: sum(per_model[name][k] for name in names))
    logged = {name: losses[name] for name in names}
    logged.update({f"best {name}": per_model[name][best] for name in names})
    extra: Dict[str, object] = {f"{name.replace(' ', '_')}es": values for name, values in per_model.items()}
    extra["best_model"] = best
    return logged, extra
