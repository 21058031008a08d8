"""megatron-core ModuleSpecs that build GPT transformer layers in Optimus 2D mode.

Only the leaves change: megatron-core's ``TransformerLayer`` runs unchanged on
``[s, b/q, h/q]`` blocks, with SUMMA linears, mesh LayerNorms, :class:`OptimusSelfAttention`,
:class:`OptimusDotProductAttention`, :class:`OptimusMLP` (megatron-core's attention and MLP
storing less for backward) and per-position residual dropout. Every Optimus leaf receives
the mesh through its spec ``params``.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from .attention import (
    OptimusDotProductAttention,
    OptimusSelfAttention,
    get_optimus_bias_dropout_add,
)
from .layers import OptimusLayerNorm, OptimusLinear
from .mesh import OptimusMesh
from .mlp import OptimusMLP


def get_optimus_norm_spec(mesh: OptimusMesh) -> ModuleSpec:
    """LayerNorm/RMSNorm (per ``config.normalization``) over the mesh."""
    return ModuleSpec(module=OptimusLayerNorm, params={"mesh": mesh})


def get_optimus_gpt_layer_spec(
    mesh: OptimusMesh, core_attention=OptimusDotProductAttention
) -> ModuleSpec:
    """A GPT decoder layer (causal self-attention + MLP) on the mesh.

    ``core_attention`` is any megatron-core core-attention class (scores, softmax, dropout
    and weighted sum on ``[s, b/q, heads/q, head_dim]``); it is built with the mesh row
    group as its tensor-parallel group. By default megatron-core's unfused attention with
    the dropout recomputed in backward (:class:`OptimusDotProductAttention`). The norms'
    outputs and the MLP activation are recomputed in backward too
    (:mod:`megatron_bitpipe.optimus.recompute`).
    """
    linear = ModuleSpec(module=OptimusLinear, params={"mesh": mesh})
    norm = get_optimus_norm_spec(mesh)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=OptimusSelfAttention,
                params={"attn_mask_type": AttnMaskType.causal, "mesh": mesh},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=linear,
                    core_attention=core_attention,
                    linear_proj=linear,
                ),
            ),
            self_attn_bda=get_optimus_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(
                module=OptimusMLP,
                # megatron's MLP takes its TP group as an argument (the linears ignore it)
                params={"tp_group": mesh.tp_group},
                submodules=MLPSubmodules(linear_fc1=linear, linear_fc2=linear),
            ),
            mlp_bda=get_optimus_bias_dropout_add,
            # checkpoint names of megatron-core's local spec, so both load each other's
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def get_optimus_gpt_block_spec(
    config,
    mesh: OptimusMesh,
    num_layers: Optional[int] = None,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
    layer_spec: Optional[ModuleSpec] = None,
) -> TransformerBlockSubmodules:
    """Decoder block spec: this stage's layers plus the final norm on the mesh.

    ``num_layers`` defaults to megatron-core's ``get_num_layers_to_build`` for the stage
    (which follows ``config.pipeline_model_parallel_layout`` when set, e.g. a chunk's
    explicit layer range); ``layer_spec`` to :func:`get_optimus_gpt_layer_spec`\\ ``(mesh)``.
    """
    if num_layers is None:
        num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec or get_optimus_gpt_layer_spec(mesh)] * num_layers,
        layer_norm=get_optimus_norm_spec(mesh),
    )
