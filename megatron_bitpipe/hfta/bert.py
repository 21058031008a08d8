"""The fused BERT of HFTA: a :class:`~megatron_bitpipe.model.bert_model.BertChunk` whose every
weight has a leading model dimension B (:mod:`.layers`). Its loss is
:func:`megatron_bitpipe.training.bert.hfta_bert_loss`, its loss reports :mod:`.reports`'s.

:func:`hfta_bert_layer_spec` is megatron-core's local BERT layer spec with the batched linears
and norms (the swap of :mod:`.model`); :class:`HftaBertChunk` builds a chunk from it with a
batched final norm, word / position / token-type embeddings (:class:`HftaBertEmbedding`),
masked-LM head (:class:`HftaBertLMHead`), output layer (tied to the word embeddings as the
unfused chunk's, its bias ``[B, vocab]``), pooler (:class:`HftaPooler`) and binary head
(:class:`HftaDense`, ``h -> 2``). Every parameter keeps the unfused chunk's name with one
leading dimension (slice ``k`` is model ``k``'s tensor) and carries ``model_seeds``.

Layout: activations ``[s, B*b, h]``, model-major batch (:mod:`.layers`). ``forward`` takes one
micro-batch ``[b, s]`` that every model sees (tokens, token types, padding mask, labels) and,
with labels, returns ``(per-token MLM loss [B*b, s], binary logits [B*b, 2] or None)``, model
``k``'s in rows ``k*b .. k*b + b - 1``. Pipeline stages pass ``[s, B*b, h]``
(:func:`~.model.hfta_p2p_tensor_shapes`). Tensor-parallel size 1 (megatron's BERT heads are
unsplit linears; :mod:`.settings` refuses more).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.bert import bert_layer_specs
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import get_pg_size

from ..model.bert_model import BertChunk
from ..model.sdpa_attention import with_core_attention
from .layers import HftaEmbedding, HftaLinear, HftaNorm, _Table
from .mlp import fuse_gated_mlps
from .model import _fused
from .settings import HftaSettings

__all__ = [
    "HftaBertChunk",
    "HftaBertEmbedding",
    "HftaBertLMHead",
    "HftaDense",
    "HftaPooler",
    "hfta_bert_layer_spec",
]


def hfta_bert_layer_spec(num_models: int, core_attention=None) -> ModuleSpec:
    """megatron-core's local BERT layer spec (padding mask) for B = ``num_models`` fused models;
    ``core_attention`` replaces megatron's ``DotProductAttention`` (e.g. SDPA)."""
    spec = _fused(bert_layer_specs.bert_layer_local_spec, num_models)
    return spec if core_attention is None else with_core_attention(spec, core_attention)


def _linear(input_size: int, output_size: int, config: TransformerConfig, num_models: int, tp_group, cls=HftaLinear, **kwargs) -> HftaLinear:
    """A batched linear ``input_size -> output_size`` (bias ``[B, out]``) built with the
    parameters the batched layer spec gives megatron's ``ColumnParallelLinear``."""
    params = _fused(ColumnParallelLinear, num_models).params
    return cls(input_size, output_size, config=config, init_method=config.init_method, bias=True, tp_group=tp_group, **params, **kwargs)


class HftaDense(HftaLinear):
    """A batched linear with ``torch.nn.Linear``'s interface (megatron's ``get_linear_layer``,
    the BERT heads' dense layers): ``[n, B*b, in]`` -> ``[n, B*b, out]`` or ``[B*b, in]`` ->
    ``[B*b, out]``, the output tensor alone (bias added)."""

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if input_.dim() == 2:
            return super().forward(input_[None])[0][0]
        return super().forward(input_)[0]


class HftaBertEmbedding(HftaEmbedding):
    """megatron's ``LanguageModelEmbedding`` with token types for B models: word ``[B, vocab,
    h]``, learned position ``[B, positions, h]`` and (``num_tokentypes > 0``) token-type
    embeddings ``[B, num_tokentypes, h]`` (``tokentype_embeddings`` None without).

    ``forward(input_ids [b, s], position_ids [b, s], tokentype_ids [b, s] or None)`` ->
    ``[s, B*b, h]``: (word + position) + token type, then dropout, as megatron sums them.
    Token types are needed exactly when the embedding has them (ValueError otherwise)."""

    def __init__(
        self, config: TransformerConfig, vocab_size: int, max_sequence_length: int, position_embedding_type: str, num_models: int,
        num_tokentypes: int, tp_group,
    ):  # fmt: skip
        super().__init__(config, vocab_size, max_sequence_length, position_embedding_type, num_models, tp_group=tp_group)
        if get_pg_size(self.tp_group) > 1:
            raise ValueError("HFTA's BERT embeddings support tensor-parallel size 1 only")
        self.tokentype_embeddings = _Table(num_models, num_tokentypes, config.hidden_size, config.params_dtype) if num_tokentypes > 0 else None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, tokentype_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if (tokentype_ids is None) != (self.tokentype_embeddings is None):
            raise ValueError("token-type ids are given exactly when the embedding has token types")
        embeddings = self.word_embeddings(input_ids)  # [B, b, s, h]
        if self.add_position_embedding:
            embeddings = embeddings + self.position_embeddings(position_ids)
        if tokentype_ids is not None:
            embeddings = embeddings + self.tokentype_embeddings(tokentype_ids)
        return self.embedding_dropout(self._fused(embeddings))


class HftaBertLMHead(MegatronModule):
    """megatron's ``BertLMHead`` for B models: ``dense`` (``[B, h, h]``, bias ``[B, h]``), GeLU,
    ``layer_norm`` (``[B, h]``); ``[s, B*b, h]`` -> ``[s, B*b, h]``."""

    def __init__(self, config: TransformerConfig, num_models: int, tp_group):
        super().__init__(config=config)
        self.dense = _linear(config.hidden_size, config.hidden_size, config, num_models, tp_group, cls=HftaDense)
        self.layer_norm = HftaNorm(config, config.hidden_size, eps=config.layernorm_epsilon, num_models=num_models)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(F.gelu(self.dense(hidden_states)))


class HftaPooler(MegatronModule):
    """megatron's ``Pooler`` for B models: ``dense`` (``[B, h, h]``, bias ``[B, h]``) and tanh
    of token ``sequence_index``: ``[s, B*b, h]`` -> ``[B*b, h]``."""

    def __init__(self, config: TransformerConfig, num_models: int, tp_group):
        super().__init__(config=config)
        self.dense = _linear(config.hidden_size, config.hidden_size, config, num_models, tp_group, cls=HftaDense)

    def forward(self, hidden_states: torch.Tensor, sequence_index: int = 0) -> torch.Tensor:
        return torch.tanh(self.dense(hidden_states[sequence_index]))


class HftaBertChunk(BertChunk):
    """A :class:`~megatron_bitpipe.model.bert_model.BertChunk` of B fused models (see the
    module docstring); arguments are BertChunk's plus ``hfta`` (B, learning rates, seeds:
    slice ``k`` of every parameter is drawn from ``hfta.seeds[k]`` by
    :func:`megatron_bitpipe.model.init.initialize_from_seed`). ``transformer_layer_spec`` is a
    :func:`hfta_bert_layer_spec`; the encoder's final norm becomes batched."""

    def __init__(self, *args, hfta: HftaSettings, **kwargs):
        self.hfta = hfta  # first: BertChunk's constructor calls the builders below
        super().__init__(*args, **kwargs)
        fuse_gated_mlps(self)
        for param in self.parameters():
            param.model_seeds = hfta.seeds

    def _build_embedding(self) -> HftaBertEmbedding:
        return HftaBertEmbedding(
            self.config, self.vocab_size, self.max_sequence_length, self.position_embedding_type, self.hfta.num_models, self.num_tokentypes,
            self.tp_group,
        )  # fmt: skip

    def _encoder_spec(self) -> ModuleSpec:
        spec = super()._encoder_spec()
        norm = ModuleSpec(module=HftaNorm, params={"num_models": self.hfta.num_models})
        return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, layer_norm=norm))

    def _build_heads(self) -> None:
        config, b, group = self.config, self.hfta.num_models, self.tp_group
        self.lm_head = HftaBertLMHead(config, b, group)
        self.output_layer = _linear(
            config.hidden_size, self.vocab_size, config, b, group, gather_output=not self.parallel_output,
            skip_weight_param_allocation=self.pre_process and self.share_embeddings_and_output_weights,
        )  # fmt: skip
        self.binary_head = None
        if self.add_binary_head:
            self.binary_head = _linear(config.hidden_size, 2, config, b, group, cls=HftaDense)
            self.pooler = HftaPooler(config, b, group)

    def forward(self, input_ids, attention_mask, tokentype_ids=None, lm_labels=None, inference_context=None, *, inference_params=None):
        """BertChunk's ``forward`` on one micro-batch ``[b, s]`` for every model: the padding
        mask and labels repeat per model (``[B*b, s]``), the embeddings widen the tokens."""
        b = self.hfta.num_models
        if lm_labels is not None:
            lm_labels = lm_labels.repeat(b, 1)
        return super().forward(
            input_ids, attention_mask.repeat(b, 1), tokentype_ids, lm_labels, inference_context, inference_params=inference_params
        )
