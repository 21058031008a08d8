"""Linear and normalisation layers of Optimus 2D tensor parallelism.

Activations are megatron-core's ``[s, b, h]`` split over the mesh: the rank at ``(i, j)``
holds ``[s, b/q, h/q]`` — batch block ``i``, feature block ``j`` (see
:mod:`megatron_bitpipe.optimus.mesh`). Both layers take and return that layout, and accept
the constructor arguments megatron-core's specs pass to their 1-D counterparts, so they
drop into a ``ModuleSpec``.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .checkpoint import optimus_module_sharded_state_dict
from .collectives import (
    all_gather_blocks,
    all_reduce_sum,
    column_replicated,
    column_replicated_all,
)
from .layout import (
    LayoutKind,
    ParamLayout,
    init_local_block,
    set_param_layout,
)
from .mesh import OptimusMesh
from .recompute import attach_recipe
from .summa import summa_ab


def divide_by_side(size: int, side: int, what: str) -> int:
    """``size // side``; ValueError naming ``what`` when it does not divide."""
    if size % side:
        raise ValueError(f"{what} ({size}) must be divisible by the Optimus mesh side q={side}")
    return size // side


def parameter_device(config) -> torch.device:
    """Where megatron-core allocates parameters for ``config``."""
    if config.use_cpu_initialization:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class OptimusLinear(torch.nn.Module):
    """``y = x·W + b`` with SUMMA; a drop-in for megatron-core's column/row-parallel linears.

    Parameters on the rank at ``(i, j)``:
        ``weight``: ``[in/q, out/q]`` = block ``(i, j)`` of ``W = Wₛᵀ`` where ``Wₛ`` is the
        serial megatron ``[out, in]`` weight (layout ``LINEAR_WEIGHT``).
        ``bias``: ``[out/q]`` = output block ``j``, replicated over the column group.

    Forward takes ``[..., in/q]`` and returns ``(output [..., out/q], bias or None)`` like
    megatron-core: with ``skip_bias_add`` the bias is returned for the caller to add.

    Megatron arguments with no 2-D meaning (``gather_output``, ``input_is_parallel``,
    ``tp_group``, ``tp_comm_buffer_name``, and ``name``, the module path megatron-core 0.18+
    passes) are accepted and ignored; the mesh replaces the TP group. Expert (MoE) linears and gathered outputs are not supported.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable,
        bias: bool,
        skip_bias_add: bool,
        mesh: OptimusMesh,
        stride: int = 1,
        is_expert: bool = False,
        gather_output: bool = False,
        input_is_parallel: bool = True,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group=None,
        name: Optional[str] = None,
    ):
        super().__init__()
        if is_expert:
            raise ValueError("Optimus 2D does not support expert (MoE) linear layers")
        if gather_output:
            raise ValueError("Optimus 2D linear layers keep their output partitioned")
        del input_is_parallel, tp_comm_buffer_name, tp_group, name  # no 2-D meaning, see docstring
        side = mesh.side
        self.mesh = mesh
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = skip_bias_add
        device = parameter_device(config)

        weight_layout = ParamLayout(LayoutKind.LINEAR_WEIGHT, stride)
        self.weight = torch.nn.Parameter(
            torch.empty(
                divide_by_side(input_size, side, "linear input size"),
                divide_by_side(output_size, side * stride, "linear output size / stride") * stride,
                dtype=config.params_dtype,
                device=device,
            )
        )
        set_param_layout(self.weight, weight_layout, mesh)
        if config.perform_initialization:
            init_local_block(
                self.weight,
                (output_size, input_size),
                weight_layout,
                mesh,
                init_method,
                config.use_cpu_initialization,
            )
        if bias:
            self.bias = torch.nn.Parameter(
                torch.zeros(self.weight.shape[1], dtype=config.params_dtype, device=device)
            )
            set_param_layout(self.bias, ParamLayout(LayoutKind.FEATURE_VECTOR, stride), mesh)
        else:
            self.register_parameter("bias", None)

    def get_extra_state(self) -> None:
        """No extra state; the (empty) entry makes checkpoints list the same objects as
        megatron-core's linears, so they load into each other."""
        return None

    def set_extra_state(self, state) -> None:
        """Nothing to restore (:meth:`get_extra_state`)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """Distributed-checkpoint entries: the weight and bias as blocks of the serial tensors."""
        return optimus_module_sharded_state_dict(self, self.mesh, prefix, sharded_offsets, metadata)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        output = summa_ab(x, self.weight, self.mesh)
        bias = None if self.bias is None else column_replicated(self.bias, self.mesh)
        if self.skip_bias_add or bias is None:
            return output, bias
        return output + bias, None


def _normalize(x, mean, inv_std, weight, bias):
    """``(x − mean)·inv_std·weight + bias`` in fp32, cast to ``x``'s dtype (``mean`` None:
    RMSNorm; ``bias`` None: no bias). Local, no communication."""
    x32 = x.float()
    normed = (x32 if mean is None else x32 - mean) * inv_std
    out = normed * weight.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def _layer_norm_statistics(x32: torch.Tensor, group) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(mean, variance)`` of fp32 ``x32`` ``[..., h/q]`` over the hidden size split
    across ``group`` (each member one equal block), both ``[..., 1]``, in one all-gather.

    Each member sends its block mean ``m_k`` and ``M_k = Σ(x − m_k)²`` over its block (n
    elements); every member merges them the same way (Chan, Golub and LeVeque's pairwise
    update for equal counts): ``mean = Σ_k m_k / q`` and
    ``variance = (Σ_k M_k + n·Σ_k (m_k − mean)²) / (q·n)``. No large sums of squares are
    subtracted, so it is as exact as the two-pass form (an all-reduce of Σx followed by one of
    Σ(x − mean)²), with one collective instead of two: same values up to rounding.
    """
    block = x32.shape[-1]
    block_mean = x32.mean(-1, keepdim=True)
    block_m2 = (x32 - block_mean).square().sum(-1, keepdim=True)
    gathered = all_gather_blocks(torch.cat([block_mean, block_m2], dim=-1), group)
    means, m2s = gathered[..., :1], gathered[..., 1:]
    mean = means.mean(0)
    m2 = m2s.sum(0) + block * (means - mean).square().sum(0)
    return mean, m2 / (block * gathered.shape[0])


class _MeshNorm(torch.autograd.Function):
    """LayerNorm / RMSNorm over a hidden dimension split across the row group.

    Statistics are computed in fp32 with one row-group collective: RMSNorm all-reduces Σx²;
    LayerNorm all-gathers each block's mean and Σ(x − block mean)² and merges them
    (:func:`_layer_norm_statistics`, as exact as a two-pass local norm); the backward needs
    one more all-reduce of the per-token sums Σg and Σg·x̂ (g = dy·γ). Saves the input, mean
    and 1/σ (not x̂). Returns the output and the (non-differentiable) statistics ``mean``
    (None for RMSNorm) and ``inv_std``, so the output can be recomputed from saved tensors
    alone (:func:`_normalize`).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps, hidden_size, group, rms):
        x32 = x.float()
        if rms:
            mean = None
            variance = all_reduce_sum(x32.square().sum(-1, keepdim=True), group) / hidden_size
        else:
            mean, variance = _layer_norm_statistics(x32, group)
        inv_std = torch.rsqrt(variance + eps)
        ctx.save_for_backward(x, mean, inv_std, weight)
        ctx.hidden_size, ctx.group, ctx.has_bias = hidden_size, group, bias is not None
        ctx.mark_non_differentiable(*(t for t in (mean, inv_std) if t is not None))
        return _normalize(x, mean, inv_std, weight, bias), mean, inv_std

    @staticmethod
    def backward(ctx, grad_out, _grad_mean, _grad_inv_std):
        x, mean, inv_std, weight = ctx.saved_tensors
        x32 = x.float()
        normed = (x32 if mean is None else x32 - mean) * inv_std
        grad32 = grad_out.float()
        token_dims = tuple(range(grad32.dim() - 1))
        grad_weight = (grad32 * normed).sum(token_dims).to(weight.dtype)
        grad_bias = grad32.sum(token_dims).to(weight.dtype) if ctx.has_bias else None

        g = grad32 * weight.float()
        sums = (
            all_reduce_sum(
                torch.cat([g.sum(-1, keepdim=True), (g * normed).sum(-1, keepdim=True)], dim=-1),
                ctx.group,
            )
            / ctx.hidden_size
        )
        mean_g, mean_g_normed = sums[..., :1], sums[..., 1:]
        if mean is None:
            grad_x = inv_std * (g - normed * mean_g_normed)
        else:
            grad_x = inv_std * (g - mean_g - normed * mean_g_normed)
        return grad_x.to(x.dtype), grad_weight, grad_bias, None, None, None, None


class OptimusLayerNorm(torch.nn.Module):
    """LayerNorm (or RMSNorm, per ``config.normalization``) of ``[..., h/q]`` blocks.

    ``weight``/``bias``: ``[h/q]`` = feature block ``j``, replicated over the column group
    (their gradients are summed over it). Signature matches megatron-core's norm builders.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, *, mesh: OptimusMesh):
        super().__init__()
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(
                f"Optimus 2D supports LayerNorm and RMSNorm, not {config.normalization}"
            )
        if config.layernorm_zero_centered_gamma:
            raise ValueError("Optimus 2D does not support --apply-layernorm-1p")
        self.mesh = mesh
        self.hidden_size = hidden_size
        self.eps = eps
        self.rms = config.normalization == "RMSNorm"
        local = divide_by_side(hidden_size, mesh.side, "--hidden-size")
        device = parameter_device(config)
        layout = ParamLayout(LayoutKind.FEATURE_VECTOR)
        self.weight = torch.nn.Parameter(
            torch.ones(local, dtype=config.params_dtype, device=device)
        )
        set_param_layout(self.weight, layout, mesh)
        if self.rms:
            self.register_parameter("bias", None)
        else:
            self.bias = torch.nn.Parameter(
                torch.zeros(local, dtype=config.params_dtype, device=device)
            )
            set_param_layout(self.bias, layout, mesh)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """Distributed-checkpoint entries: the weight and bias as feature blocks of the serial tensors."""
        return optimus_module_sharded_state_dict(self, self.mesh, prefix, sharded_offsets, metadata)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised ``x``, carrying a recipe (:mod:`~megatron_bitpipe.optimus.recompute`):
        a SUMMA linear consuming it recomputes it from the norm's saved input and statistics
        instead of keeping it."""
        weight, bias = column_replicated_all((self.weight, self.bias), self.mesh)
        out, mean, inv_std = _MeshNorm.apply(
            x, weight, bias, self.eps, self.hidden_size, self.mesh.row_group, self.rms
        )
        return attach_recipe(out, _normalize, x, mean, inv_std, weight, bias)
