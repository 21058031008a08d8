"""Mixture-of-experts GPT layers on megatron-core's local modules, for any placement.

:func:`moe_gpt_layer_specs` gives one layer spec per global layer of the full model:
megatron-core's local MoE layer (router, token dispatcher, ``SequentialMLP`` of the routed
experts, optional shared experts) where ``config.moe_layer_freq`` asks for one, its dense
local layer elsewhere (megatron's pattern: an integer ``N`` puts an MoE layer at every layer
index divisible by ``N``, a list gives 1/0 per layer). The chunk builder
(:func:`~.chunks.gpt_chunk_factory`) cuts each chunk's layers out of that sequence, so the
pattern follows the global layer numbers whatever the placement.

:func:`check_expert_layout` states the rules that hold between the model config and the process
grid before any group is made: expert parallelism (``grid.ep``, the config's
``expert_model_parallel_size``) needs experts, divides the experts, and expert tensor
parallelism equals tensor parallelism, and no ``global_aux_loss``. It also gives megatron-core's MoE utilities what they
read without Transformer Engine
(:func:`~megatron_bitpipe.megatron_compat.enable_moe_without_transformer_engine`).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from .. import megatron_compat
from ..execution.groups import ParallelGrid
from .norms import with_sequence_parallel_norms

__all__ = ["check_expert_layout", "moe_layer_pattern", "moe_gpt_layer_specs"]


def moe_layer_pattern(moe_layer_freq, num_layers: int) -> List[int]:
    """1 (MoE) or 0 (dense) per layer of the full model, as megatron-core reads ``moe_layer_freq``.

    ValueError for a list of another length or entries other than 0 and 1.
    """
    if isinstance(moe_layer_freq, int):
        if moe_layer_freq < 1:
            raise ValueError(f"--moe-layer-freq {moe_layer_freq} must be at least 1")
        return [1 if layer % moe_layer_freq == 0 else 0 for layer in range(num_layers)]
    pattern = list(moe_layer_freq)
    if len(pattern) != num_layers or set(pattern) - {0, 1}:
        raise ValueError(f"--moe-layer-freq {pattern} must give 1 (MoE) or 0 (dense) for each of the {num_layers} layers")
    return pattern


def moe_gpt_layer_specs(config: TransformerConfig) -> Tuple[ModuleSpec, ...]:
    """The layer spec of each layer of the full model (see the module docstring): megatron-core's
    local specs (no Transformer Engine, experts as a ``SequentialMLP``), with the norms of
    :func:`~.norms.with_sequence_parallel_norms`."""
    def local(num_experts):
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm, normalization=config.normalization
        )
        return with_sequence_parallel_norms(spec)

    moe, dense = local(config.num_moe_experts), local(None)
    return tuple(moe if is_moe else dense for is_moe in moe_layer_pattern(config.moe_layer_freq, config.num_layers))


def check_expert_layout(config: TransformerConfig, grid: ParallelGrid) -> None:
    """ValueError, naming the flag, unless ``config``'s experts fit ``grid`` (module docstring);
    then make megatron-core's MoE layers runnable without Transformer Engine. Local."""
    experts = config.num_moe_experts
    if config.expert_model_parallel_size != grid.ep:
        raise ValueError(
            f"config has expert_model_parallel_size {config.expert_model_parallel_size}, the process grid {grid.ep}"
        )
    if experts is None:
        if grid.ep > 1:
            raise ValueError(f"--expert-model-parallel-size {grid.ep} needs --num-experts")
        return
    if experts % grid.ep:
        raise ValueError(f"--num-experts {experts} must be a multiple of --expert-model-parallel-size {grid.ep}")
    expert_tp = config.expert_tensor_parallel_size
    if expert_tp not in (None, grid.tp):
        raise ValueError(
            f"--expert-tensor-parallel-size {expert_tp} must equal --tensor-model-parallel-size {grid.tp} "
            "(experts split like the dense layers)"
        )
    balancing = config.moe_router_load_balancing_type
    if "global_aux_loss" in ([balancing] if isinstance(balancing, str) else balancing):
        raise ValueError(
            "--moe-router-load-balancing-type global_aux_loss is not supported: its statistics span the data-parallel "
            "ranks and micro-batches of a step, which pipelines of several replicas run at different times"
        )
    megatron_compat.enable_moe_without_transformer_engine()


def layer_specs_of(specs: Sequence[ModuleSpec], first_layer: int, num_layers: int) -> List[ModuleSpec]:
    """The specs of global layers ``[first_layer, first_layer + num_layers)`` of ``specs``."""
    if first_layer + num_layers > len(specs):
        raise ValueError(f"layers {first_layer}..{first_layer + num_layers - 1} of a model with {len(specs)} layer specs")
    return list(specs[first_layer : first_layer + num_layers])
