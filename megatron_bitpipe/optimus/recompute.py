"""Cheap recomputation: keep fewer activations of the 2-D layer alive until backward.

A SUMMA product needs its activation operand ``a`` again in backward (for the weight
gradient). When ``a`` is the output of a cheap local function whose *inputs* autograd keeps
anyway — a mesh LayerNorm keeps its input and statistics, an MLP activation its
pre-activation — keeping ``a`` as well only costs memory. Such a producer attaches a
:class:`Recipe` to its output (:func:`attach_recipe`); the SUMMA product then keeps the
recipe's inputs (the same storages, nothing new) and recomputes ``a`` in its backward
(:mod:`megatron_bitpipe.optimus.summa`).

Invariants of a recipe ``(function, inputs)`` attached to tensor ``out``:

* ``function(*inputs)`` equals ``out`` bit for bit (same operations in the same order) and
  needs no communication;
* it is only used while ``out`` is unmodified: the recipe records ``out._version`` and
  :func:`recipe_of` ignores it after an in-place change (the consumer then keeps ``out``
  itself, as without recomputation). The inputs are saved through ``save_for_backward``,
  so autograd's own version check catches in-place changes to them.

A recipe is a plain attribute of the output tensor, so it reaches the consumer only when the
same tensor object is passed on (as megatron-core's layers do between a norm and the
following linear, and between the MLP activation and ``linear_fc2``); any other consumer
simply keeps the tensor as usual.

:func:`recomputed` is the producer side for a function that also has to be differentiated
(the MLP activation): it keeps only the function's input and recomputes the function in
backward to differentiate it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

_ATTRIBUTE = "optimus_recipe"


@dataclass(frozen=True)
class Recipe:
    """How to recompute a tensor: ``function(*inputs)``; ``version`` is the tensor's
    ``_version`` when the recipe was attached."""

    function: Callable[..., torch.Tensor]
    inputs: Tuple[Optional[torch.Tensor], ...]
    version: int


def attach_recipe(output: torch.Tensor, function: Callable[..., torch.Tensor], *inputs) -> torch.Tensor:
    """Mark ``output`` as ``function(*inputs)`` (see the module invariants); returns ``output``."""
    setattr(output, _ATTRIBUTE, Recipe(function, inputs, output._version))
    return output


def recipe_of(tensor: torch.Tensor) -> Optional[Recipe]:
    """The recipe attached to ``tensor``, or None (none attached, or ``tensor`` changed since)."""
    recipe = getattr(tensor, _ATTRIBUTE, None)
    if recipe is None or recipe.version != tensor._version:
        return None
    return recipe


class _Recomputed(torch.autograd.Function):
    """``function(x)`` keeping only ``x`` for backward, where ``function`` runs again."""

    @staticmethod
    def forward(ctx, x, function):
        ctx.save_for_backward(x)
        ctx.function = function
        return function(x)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            (grad_x,) = torch.autograd.grad(ctx.function(leaf), leaf, grad_output)
        return grad_x, None


def recomputed(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``function(x)`` that keeps only ``x`` alive for backward, with a recipe attached.

    For cheap local functions (activations): backward recomputes ``function(x)`` once to
    differentiate it, and a SUMMA consumer recomputes it once more for its weight gradient.
    """
    return attach_recipe(_Recomputed.apply(x, function), function, x)
