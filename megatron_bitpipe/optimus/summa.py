"""SUMMA matrix products on the q×q mesh, with their backward passes.

Block notation: ``X_{ab}`` is block ``(a, b)`` of a matrix X split q×q, held by the rank at
mesh position ``(a, b)``. An activation's rows are its tokens (every leading dimension,
e.g. ``[s, b/q]``, with the batch block given by the mesh row) and its columns its
features; a weight is a plain 2-D block. On the rank at ``(i, j)``:

* :func:`summa_ab`  ``C = A·B``:   ``C_{ij} = Σ_k A_{ik} B_{kj}``. Per ``k``: broadcast
  ``A_{ik}`` along row ``i``, ``B_{kj}`` down column ``j``, multiply locally.
* :func:`summa_abt` ``C = A·Bᵀ``:  ``C_{il} = Σ_j A_{ij} B_{lj}ᵀ``. Per ``l``: broadcast
  ``B_{lj}`` down column ``j``, multiply locally, reduce along row ``i`` onto ``(i, l)``.
* :func:`summa_atb` ``C = Aᵀ·B``:  ``C_{kj} = Σ_i A_{ik}ᵀ B_{ij}``. Per ``k``: broadcast
  ``A_{ik}`` along row ``i``, multiply locally, reduce down column ``j`` onto ``(k, j)``;
  the token dimensions are contracted, so C is a 2-D weight-shaped block.

The backward of each product is made of the other two (dA of A·B is dC·Bᵀ, dB is Aᵀ·dC,
and so on), so every pass moves q blocks per operand through broadcasts or reduces over
groups of q ranks. All members of the mesh must call these functions together with
same-shaped blocks.
"""

from __future__ import annotations

import torch

from megatron_bitpipe.optimus.collectives import broadcast_block, reduce_block
from megatron_bitpipe.optimus.mesh import OptimusMesh
from megatron_bitpipe.optimus.recompute import recipe_of


def _as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1, tensor.shape[-1])


def _ab(a: torch.Tensor, b: torch.Tensor, mesh: OptimusMesh) -> torch.Tensor:
    out = None
    for k in range(mesh.side):
        a_k = broadcast_block(a, k, mesh.row_group)
        b_k = broadcast_block(b, k, mesh.column_group)
        product = torch.matmul(a_k, b_k)
        out = product if out is None else out.add_(product)
    return out


def _abt(a: torch.Tensor, b: torch.Tensor, mesh: OptimusMesh) -> torch.Tensor:
    out = None
    for l in range(mesh.side):
        b_l = broadcast_block(b, l, mesh.column_group)
        reduced = reduce_block(torch.matmul(a, b_l.t()), l, mesh.row_group)
        if reduced is not None:
            out = reduced
    return out


def _atb(a: torch.Tensor, b: torch.Tensor, mesh: OptimusMesh) -> torch.Tensor:
    out = None
    b_matrix = _as_matrix(b)
    for k in range(mesh.side):
        a_k = broadcast_block(a, k, mesh.row_group)
        reduced = reduce_block(_as_matrix(a_k).t().matmul(b_matrix), k, mesh.column_group)
        if reduced is not None:
            out = reduced
    return out


# product -> (forward, dA from (a, b, dC), dB from (a, b, dC)), all in SUMMA products
_PRODUCTS = {
    "ab": (_ab, lambda a, b, g, mesh: _abt(g, b, mesh), lambda a, b, g, mesh: _atb(a, g, mesh)),
    "abt": (_abt, lambda a, b, g, mesh: _ab(g, b, mesh), lambda a, b, g, mesh: _atb(g, a, mesh)),
    "atb": (_atb, lambda a, b, g, mesh: _abt(b, g, mesh), lambda a, b, g, mesh: _ab(a, g, mesh)),
}


class _Summa(torch.autograd.Function):
    """One of the three products (``product`` key of ``_PRODUCTS``) with its backward.

    With a recipe for ``a`` (``recompute(*recipe_inputs)``, see
    :mod:`megatron_bitpipe.optimus.recompute`) the recipe's inputs are kept instead of ``a``,
    and ``a`` is recomputed for the gradient of ``b`` — the only gradient that needs it.
    """

    @staticmethod
    def forward(ctx, a, b, mesh, product, recompute, *recipe_inputs):
        if recompute is None:
            ctx.save_for_backward(a, b)
        else:
            ctx.save_for_backward(b, *recipe_inputs)
        ctx.mesh, ctx.product, ctx.recompute = mesh, product, recompute
        return _PRODUCTS[product][0](a, b, mesh)

    @staticmethod
    def backward(ctx, grad_c):
        if ctx.recompute is None:
            a, b = ctx.saved_tensors
            recipe_grads = ()
        else:
            b, *inputs = ctx.saved_tensors
            recipe_grads = (None,) * len(inputs)
            a = None
            if ctx.needs_input_grad[1]:
                with torch.no_grad():
                    a = ctx.recompute(*inputs)
        _, grad_of_a, grad_of_b = _PRODUCTS[ctx.product]
        grad_c = grad_c.contiguous()
        grad_a = grad_of_a(a, b, grad_c, ctx.mesh) if ctx.needs_input_grad[0] else None
        grad_b = grad_of_b(a, b, grad_c, ctx.mesh) if ctx.needs_input_grad[1] else None
        return (grad_a, grad_b, None, None, None) + recipe_grads


def _apply(a: torch.Tensor, b: torch.Tensor, mesh: OptimusMesh, product: str) -> torch.Tensor:
    recipe = recipe_of(a)
    if recipe is None:
        return _Summa.apply(a, b, mesh, product, None)
    return _Summa.apply(a, b, mesh, product, recipe.function, *recipe.inputs)


def summa_ab(a: torch.Tensor, b: torch.Tensor, mesh: OptimusMesh) -> torch.Tensor:
    """Block of ``A·B``: ``a`` is ``[..., k/q]`` (tokens × features), ``b`` is ``[k/q, n/q]``.

    Returns ``[..., n/q]``, the same token block as ``a``.
    """
    return _apply(a, b, mesh, "ab")


def summa_abt(a: torch.Tensor, b: torch.Tensor, mesh: OptimusMesh) -> torch.Tensor:
    """Block of ``A·Bᵀ``: ``a`` is ``[..., k/q]``, ``b`` is ``[n/q, k/q]``.

    Returns ``[..., n/q]``, the same token block as ``a``.
    """
    return _apply(a, b, mesh, "abt")


def summa_atb(a: torch.Tensor, b: torch.Tensor, mesh: OptimusMesh) -> torch.Tensor:
    """Block of ``Aᵀ·B`` over all token dimensions: ``a`` is ``[..., m/q]``, ``b`` is
    ``[..., n/q]`` (same token shape); returns ``[m/q, n/q]``."""
    return _apply(a, b, mesh, "atb")
