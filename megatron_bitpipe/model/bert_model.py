"""megatron-core BERT chunks for any placement (BitPipe's bidirectional V included).

megatron-core 0.16's ``BertModel`` cannot be a chunk of a V placement as it is: its
constructor builds the ``TransformerBlock`` (and the embedding and output layer) without its
``pg_collection``, so they fall back to megatron's global parallel state, and its ``forward``
decides whether to embed the tokens with the global ``parallel_state.is_pipeline_first_stage()``
(looped pipeline rank 0) instead of the chunk's own ``pre_process`` — wrong for pipeline B,
whose first stage is on the last pipeline rank. :class:`BertChunk` is a ``BertModel`` built
and run from its ``pg_collection`` and its ``pre_process``/``post_process`` only; module
structure, parameter names, initialisers and math are BertModel's, so state dicts and
megatron's checkpoint code see a BertModel.

A chunk holds (:class:`~megatron_bitpipe.model_partition.ChunkSpec`):

* ``pre_process``: word, position and (``num_tokentypes > 0``) token-type embeddings;
* its encoder layers, numbered globally (:func:`~megatron_bitpipe.model.chunks.chunk_config`);
* ``post_process``: the encoder's final norm, the masked-LM head (``lm_head``: dense, GeLU,
  norm), the output layer (vocab logits, bias; its weight is the word embeddings with tied
  embeddings, see :mod:`megatron_bitpipe.model.chunks`), the pooler and binary (next-sentence)
  head (``add_binary_head``) and the per-token MLM loss.

Every chunk needs the attention (padding) mask of the micro-batch, not only the first and last.

**Sequence parallelism.** The pooler's input is gathered over the chunk's tp group (megatron's
pooler would use the global group); without apex, the layers', final and MLM-head norms are
:class:`~megatron_bitpipe.model.norms.SequenceParallelTorchNorm` (as for GPT chunks).
"""

from __future__ import annotations

import copy
from typing import List, Optional

import torch
from megatron.core.models.bert import bert_layer_specs, bert_lm_head
from megatron.core.models.bert.bert_lm_head import BertLMHead
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.models.bert.pooler import Pooler
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, gather_from_sequence_parallel_region
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlock, get_num_layers_to_build
from megatron.core.transformer.utils import get_linear_layer
from megatron.core.utils import deprecate_inference_params

from ..execution.groups import PipelineGroups
from ..model_partition import ChunkSpec
from ..schedules.layer_split import StageLayers
from .chunks import build_chunks, chunk_block_spec, is_layer_spec, with_sequence_parallel_norms
from .norms import SequenceParallelTorchNorm
from .sdpa_attention import SdpaDotProductAttention, uses_core_attention

__all__ = ["BertChunk", "default_bert_layer_spec", "build_bert_chunks"]


def default_bert_layer_spec(config: TransformerConfig) -> ModuleSpec:
    """megatron-core's Transformer Engine BERT layer spec if TE is importable and
    ``config.transformer_impl`` asks for it (megatron's default), else its local spec — with
    norms that support sequence parallelism where megatron would use ``WrappedTorchNorm``
    (no apex; :class:`~megatron_bitpipe.model.norms.SequenceParallelTorchNorm`)."""
    if bert_layer_specs.HAVE_TE and config.transformer_impl == "transformer_engine":
        return bert_layer_specs.get_bert_layer_with_transformer_engine_spec()
    return with_sequence_parallel_norms(bert_layer_specs.bert_layer_local_spec)


def _lm_head(config: TransformerConfig) -> BertLMHead:
    """megatron's masked-LM head; with sequence parallelism and no apex its norm is a
    :class:`~megatron_bitpipe.model.norms.SequenceParallelTorchNorm` (``WrappedTorchNorm``
    refuses sequence parallelism)."""
    if not (config.sequence_parallel and bert_lm_head.LNImpl is WrappedTorchNorm):
        return BertLMHead(config.hidden_size, config)
    plain = copy.copy(config)
    plain.sequence_parallel = False
    head = BertLMHead(config.hidden_size, plain)
    head.config = config
    head.layer_norm = SequenceParallelTorchNorm(config, config.hidden_size, eps=config.layernorm_epsilon)
    for param in head.dense.parameters():
        param.sequence_parallel = True
    return head


class BertChunk(BertModel):
    """A ``BertModel`` holding one pipeline chunk, built with explicit process groups.

    Arguments are ``BertModel``'s, with ``pg_collection`` required; ``return_embeddings`` and
    ``vp_stage`` do not exist (inference-only, and the looped virtual stage). ``config``
    should be the chunk's own (:func:`~megatron_bitpipe.model.chunks.chunk_config`) so its
    layers carry global numbers. ``BertModel.__init__`` is not called (it builds from the
    global parallel state); this constructor builds the same modules, each with the chunk's
    tensor-parallel group, and the block with the whole ``pg_collection``. It builds them
    through :meth:`_build_embedding`, :meth:`_encoder_spec` and :meth:`_build_heads`, which a
    subclass may replace (:class:`~megatron_bitpipe.hfta.bert.HftaBertChunk`, a fused array).

    ``forward`` is ``BertModel.forward`` with the chunk's ``pre_process`` deciding whether
    ``input_ids`` are embedded; returns the hidden states ``[s, b, h]`` unless
    ``post_process``, then ``(per-token MLM loss [b, s], binary logits [b, 2] or None)`` with
    ``lm_labels``, ``(logits [b, s, v / tp], binary logits)`` without.
    """

    def __init__(
        self,
        config: TransformerConfig,
        num_tokentypes: int,
        transformer_layer_spec: ModuleSpec,
        vocab_size: int,
        max_sequence_length: int,
        *,
        pg_collection: ProcessGroupCollection,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "learned_absolute",
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: Optional[float] = None,
        add_binary_head: bool = True,
    ):
        LanguageModule.__init__(self, config=config, pg_collection=pg_collection)
        self.transformer_layer_spec = transformer_layer_spec
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.num_tokentypes = num_tokentypes
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.add_binary_head = add_binary_head
        self.return_embeddings = False
        self.model_type = ModelType.encoder_or_decoder
        self.attn_mask_dimensions = self._sanity_check_attention_and_get_attn_mask_dimension()

        if pre_process:
            self.embedding = self._build_embedding()
        if position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                kv_channels=config.kv_channels,
                rotary_percent=rotary_percent,
                rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor,
                use_cpu_initialization=config.use_cpu_initialization,
            )
        self.encoder = TransformerBlock(
            config=config,
            spec=self._encoder_spec(),
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=pg_collection,
        )
        if post_process:
            self._build_heads()
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    def _build_embedding(self) -> torch.nn.Module:
        """The word, position and (``num_tokentypes > 0``) token-type embeddings of a
        ``pre_process`` chunk: megatron's ``LanguageModelEmbedding``."""
        return LanguageModelEmbedding(
            config=self.config,
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            position_embedding_type=self.position_embedding_type,
            num_tokentypes=self.num_tokentypes,
            tp_group=self.tp_group,
        )

    def _encoder_spec(self) -> ModuleSpec:
        """The encoder's block spec: a block spec as given; a layer spec as this chunk's layers
        with a final norm like the layers' (sequence parallelism)."""
        spec = self.transformer_layer_spec
        if not is_layer_spec(spec):
            return spec
        return chunk_block_spec(spec, get_num_layers_to_build(self.config, pp_rank=self.pg_collection.pp.rank()))

    def _build_heads(self) -> None:
        """The ``post_process`` modules: ``lm_head``, ``output_layer`` (weight-less when tied
        within the chunk) and, with ``add_binary_head``, ``pooler`` and ``binary_head``
        (``binary_head`` None without)."""
        config = self.config
        self.lm_head = _lm_head(config)
        self.output_layer = ColumnParallelLinear(
            config.hidden_size,
            self.vocab_size,
            config=config,
            init_method=config.init_method,
            bias=True,
            skip_bias_add=False,
            gather_output=not self.parallel_output,
            skip_weight_param_allocation=self.pre_process and self.share_embeddings_and_output_weights,
            tp_group=self.tp_group,
        )
        self.binary_head = None
        if self.add_binary_head:
            self.binary_head = get_linear_layer(config.hidden_size, 2, config.init_method, config.perform_initialization)
            # Sequence-parallel input is gathered in forward, over this chunk's tp group.
            self.pooler = Pooler(config.hidden_size, config.init_method, config, sequence_parallel=False)

    def _sanity_check_attention_and_get_attn_mask_dimension(self) -> str:
        """megatron's choice of the mask's shape; with SDPA core attention ``b11s`` (padded keys
        only: megatron's rule would ask Transformer Engine's version, and SDPA then sees no
        fully masked rows and a mask s times smaller)."""
        if uses_core_attention(self.transformer_layer_spec, SdpaDotProductAttention):
            return "b11s"
        return super()._sanity_check_attention_and_get_attn_mask_dimension()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        tokentype_ids: Optional[torch.Tensor] = None,
        lm_labels: Optional[torch.Tensor] = None,
        inference_context=None,
        *,
        inference_params=None,
    ):
        """``input_ids``, ``tokentype_ids``, ``lm_labels``: ``[b, s]``; ``attention_mask``:
        ``[b, s]``, 1 for tokens to attend to, 0 for padding. Chunks without ``pre_process``
        ignore ``input_ids``/``tokentype_ids`` (their input is ``set_input_tensor``'s)."""
        inference_context = deprecate_inference_params(inference_context, inference_params)
        extended_attention_mask = self.bert_extended_attention_mask(attention_mask)
        hidden_states = None
        if self.pre_process:
            hidden_states = self.embedding(
                input_ids=input_ids, position_ids=self.bert_position_ids(input_ids), tokentype_ids=tokentype_ids
            )
        rotary_pos_emb = None
        if self.position_embedding_type == "rope":
            rotary_pos_emb = self.rotary_pos_emb(
                self.rotary_pos_emb.get_rotary_seq_len(inference_context, self.encoder, hidden_states, self.config)
            )
        hidden_states = self.encoder(
            hidden_states=hidden_states,
            attention_mask=extended_attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
        )
        if not self.post_process:
            return hidden_states
        return self._heads(hidden_states, lm_labels)

    def _heads(self, hidden_states: torch.Tensor, lm_labels: Optional[torch.Tensor]):
        binary_logits = None
        if self.binary_head is not None:
            pooler_input = hidden_states
            if self.config.sequence_parallel:
                pooler_input = gather_from_sequence_parallel_region(
                    hidden_states, tensor_parallel_output_grad=False, group=self.tp_group
                )
            binary_logits = self.binary_head(self.pooler(pooler_input, 0))
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(self.lm_head(hidden_states=hidden_states), weight=output_weight)
        if lm_labels is None:
            return logits.transpose(0, 1).contiguous(), binary_logits
        return self.compute_language_model_loss(lm_labels, logits), binary_logits


def build_bert_chunks(
    config: TransformerConfig,
    groups: PipelineGroups,
    *,
    vocab_size: int,
    max_sequence_length: int,
    share_embeddings_and_output_weights: bool = True,
    add_binary_head: bool = True,
    num_tokentypes: Optional[int] = None,
    layer_spec: Optional[ModuleSpec] = None,
    model_class: type = BertChunk,
    stage_layers: Optional[StageLayers] = None,
    **bert_kwargs,
) -> List[BertChunk]:
    """This rank's :class:`BertChunk` s of ``groups.placement``, indexed by local chunk id.

    Same contract as :func:`~megatron_bitpipe.model.chunks.build_gpt_chunks` (layers, ``stage_layers``,
    process groups, tied embeddings on one rank, megatron's own initialisation). Megatron-LM's
    BERT defaults: tied embeddings, the binary (next-sentence) head, and two token types with
    it (``num_tokentypes`` defaults to 2 with ``add_binary_head``, else 0). ``bert_kwargs``
    go to the chunks' class, ``model_class`` (default :class:`BertChunk`; a subclass such as
    :class:`~megatron_bitpipe.hfta.bert.HftaBertChunk`), e.g. ``position_embedding_type``,
    ``parallel_output``.
    ValueError naming ``--tensor-parallel-mode`` if the groups carry an Optimus 2D mesh.
    """
    if groups.mesh is not None:
        raise ValueError("--tensor-parallel-mode optimus2d supports GPT models only; use 1d for BERT")
    spec = layer_spec or default_bert_layer_spec(config)
    if num_tokentypes is None:
        num_tokentypes = 2 if add_binary_head else 0

    def make_chunk(chunk_config: TransformerConfig, chunk: ChunkSpec, pgs: ProcessGroupCollection, tie: bool):
        return model_class(
            chunk_config,
            num_tokentypes,
            spec,
            vocab_size,
            max_sequence_length,
            pg_collection=pgs,
            pre_process=chunk.pre_process,
            post_process=chunk.post_process,
            share_embeddings_and_output_weights=tie,
            add_binary_head=add_binary_head,
            **bert_kwargs,
        )

    return build_chunks(
        config,
        groups,
        make_chunk,
        vocab_size=vocab_size,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        stage_layers=stage_layers,
    )
