"""SUMMA matrix products on the q×q mesh, with their backward passes.

Block notation: ``X_{ab}`` is block ``(a, b)`` of a matrix X split q×q, held by the rank at
mesh position ``(a, b)``. An activation's rows are its tokens (every leading dimension,
e.g. ``[s, b/q]``, with the batch block given by the mesh row) and its columns its
features; a weight is a plain 2-D block. On the rank at ``(i, j)``:

* :func:`summa_ab`  ``C = A·B``:   ``C_{ij} = Σ_k A_{ik} B_{kj}``. All-gather
  ``A_{i0..i(q−1)}`` along row ``i`` and ``B_{0j..(q−1)j}`` down column ``j``, then sum the
  q local products in ``k`` order.
* :func:`summa_abt` ``C = A·Bᵀ``:  ``C_{il} = Σ_j A_{ij} B_{lj}ᵀ``. All-gather
  ``B_{0j..(q−1)j}`` down column ``j``, form the q partials ``A_{ij} B_{lj}ᵀ`` (one per
  ``l``), reduce-scatter them along row ``i``: ``(i, l)`` keeps the sum of partial ``l``.
* :func:`summa_atb` ``C = Aᵀ·B``:  ``C_{kj} = Σ_i A_{ik}ᵀ B_{ij}``. All-gather
  ``A_{i0..i(q−1)}`` along row ``i``, form the q partials ``A_{ik}ᵀ B_{ij}`` (one per ``k``),
  reduce-scatter them down column ``j``: ``(k, j)`` keeps the sum of partial ``k``. The
  token dimensions are contracted, so C is a 2-D weight-shaped block.

The backward of each product is made of the other two (dA of A·B is dC·Bᵀ, dB is Aᵀ·dC,
and so on). Each operand crosses its group in exactly one collective per product (an
all-gather, or a reduce-scatter of the result): 2 collectives forward and 4 for the two
gradient products, 6 per product whatever q, where the classic per-``k`` form issues q
broadcasts or reduces per operand, 6q in all. The
bytes received are the same ((q−1) blocks per operand and rank); the cost is transient
memory: a gathered operand holds q blocks at once, and so does the stack of q partials
before its reduce-scatter (per-``k`` streaming held one received block or one partial at a
time). Nothing extra is kept for backward. Arithmetic: every local product is the same
matmul on the same blocks as per ``k``, and ``summa_ab`` adds them in ``k`` order as before;
the sums over ranks are gloo/NCCL reduce-scatters instead of reduces (bitwise the same for
q = 2, one commutative addition; for q > 2 the association order is the library's).

All members of the mesh must call these functions together with same-shaped blocks.
"""

from __future__ import annotations

import torch

from .collectives import all_gather_blocks, reduce_scatter_blocks
from .mesh import OptimusMesh
from .recompute import recipe_of


def _as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1, tensor.shape[-1])


def _ab(a: torch.Tensor, b: torch.Tensor, mesh: OptimusMesh) -> torch.Tensor:
    a_row = all_gather_blocks(a, mesh.row_group)  # [q, ..., k/q]: A_{i,k} at k
    b_column = all_gather_blocks(b, mesh.column_group)  # [q, k/q, n/q]: B_{k,j} at k
    out = torch.matmul(a_row[0], b_column[0])
    for k in range(1, mesh.side):
        out.add_(torch.matmul(a_row[k], b_column[k]))
    return out


def _abt(a: torch.Tensor, b: torch.Tensor, mesh: OptimusMesh) -> torch.Tensor:
    b_column = all_gather_blocks(b, mesh.column_group)  # [q, n/q, k/q]: B_{l,j} at l
    partials = torch.empty((mesh.side,) + a.shape[:-1] + b.shape[:1], dtype=a.dtype, device=a.device)
    for l in range(mesh.side):
        torch.matmul(a, b_column[l].t(), out=partials[l])
    return reduce_scatter_blocks(partials, mesh.row_group)


def _atb(a: torch.Tensor, b: torch.Tensor, mesh: OptimusMesh) -> torch.Tensor:
    a_row = all_gather_blocks(a, mesh.row_group)  # [q, ..., m/q]: A_{i,k} at k
    b_matrix = _as_matrix(b)
    partials = torch.empty((mesh.side, a.shape[-1], b.shape[-1]), dtype=a.dtype, device=a.device)
    for k in range(mesh.side):
        torch.matmul(_as_matrix(a_row[k]).t(), b_matrix, out=partials[k])
    return reduce_scatter_blocks(partials, mesh.column_group)


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
