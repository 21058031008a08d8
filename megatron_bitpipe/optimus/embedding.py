"""Vocabulary-parallel embedding and the (tied) LM head of Optimus 2D.

The vocabulary table ``E [v, h]`` is split as a q×q block matrix: the rank at ``(i, j)``
holds ``E[vocab block i, hidden block j]`` (layout ``VOCAB_TABLE``). The same block serves
both uses:

* **lookup** (:class:`OptimusVocabEmbedding`): every rank looks up the *whole* micro-batch
  in its vocabulary block (zero rows for tokens outside it) and the column group
  reduce-scatters the partial sums along the batch, leaving ``[b/q, s, h/q]``. The
  backward all-gathers the gradient blocks along the batch. Token ids are replicated over
  the TP group, as megatron-core's data loading provides them.
* **logits** (:class:`OptimusOutputLayer`): ``H·Eᵀ`` with :func:`summa_abt`, giving the rank
  at ``(i, j)`` the logits of batch block ``i`` over vocabulary block ``j``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from .collectives import (
    batch_block,
    column_replicated,
    reduce_scatter_batch,
)
from .layers import divide_by_side, parameter_device
from .layout import (
    LayoutKind,
    ParamLayout,
    init_local_block,
    set_param_layout,
)
from .mesh import OptimusMesh
from .summa import summa_abt

VOCAB_LAYOUT = ParamLayout(LayoutKind.VOCAB_TABLE)


def vocab_table_parameter(
    config, vocab_size: int, mesh: OptimusMesh, initialize: bool = True
) -> torch.nn.Parameter:
    """A ``[v/q, h/q]`` vocabulary block, initialised with ``config.init_method`` if
    ``initialize`` and ``config.perform_initialization``."""
    side = mesh.side
    weight = torch.nn.Parameter(
        torch.empty(
            divide_by_side(vocab_size, side, "padded vocabulary size"),
            divide_by_side(config.hidden_size, side, "--hidden-size"),
            dtype=config.params_dtype,
            device=parameter_device(config),
        )
    )
    set_param_layout(weight, VOCAB_LAYOUT, mesh)
    if initialize and config.perform_initialization:
        init_local_block(
            weight,
            (vocab_size, config.hidden_size),
            VOCAB_LAYOUT,
            mesh,
            config.init_method,
            config.use_cpu_initialization,
        )
    return weight


class OptimusVocabEmbedding(torch.nn.Module):
    """Token lookup in a 2-D split vocabulary table: ``[b, s]`` ids → ``[b/q, s, h/q]``."""

    def __init__(self, config, vocab_size: int, mesh: OptimusMesh, initialize: bool = True):
        super().__init__()
        self.mesh = mesh
        self.weight = vocab_table_parameter(config, vocab_size, mesh, initialize)
        rows = self.weight.shape[0]
        self.vocab_start, self.vocab_end = mesh.row * rows, (mesh.row + 1) * rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_batch(partial, 0, self.mesh)


class OptimusEmbedding(torch.nn.Module):
    """Word (+ learned absolute position) embedding and dropout; output ``[s, b/q, h/q]``.

    Mirrors megatron-core's ``LanguageModelEmbedding`` (same submodule and parameter names,
    so serial state dicts map onto it). ``position_embeddings.weight`` is
    ``[max_sequence_length, h/q]``, feature block ``j``, replicated over the column group.
    Dropout draws from megatron-core's model-parallel RNG stream, distinct per mesh position.
    ``initialize=False`` leaves the tables uninitialised (and draws no random numbers).
    """

    def __init__(
        self,
        config,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str,
        mesh: OptimusMesh,
        initialize: bool = True,
    ):
        super().__init__()
        if position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(
                f"Optimus 2D does not support {position_embedding_type} position embeddings"
            )
        self.config = config
        self.mesh = mesh
        self.word_embeddings = OptimusVocabEmbedding(config, vocab_size, mesh, initialize)
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        if self.add_position_embedding:
            table = torch.empty(
                max_sequence_length,
                self.word_embeddings.weight.shape[1],
                dtype=config.params_dtype,
                device=parameter_device(config),
            )
            # _weight: nn.Embedding would otherwise draw its own N(0, 1) values.
            self.position_embeddings = torch.nn.Embedding(*table.shape, _weight=table)
            layout = ParamLayout(LayoutKind.FEATURE_TABLE)
            set_param_layout(self.position_embeddings.weight, layout, mesh)
            if initialize and config.perform_initialization:
                init_local_block(
                    self.position_embeddings.weight,
                    (max_sequence_length, config.hidden_size),
                    layout,
                    mesh,
                    config.init_method,
                    config.use_cpu_initialization,
                )
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, tokentype_ids=None
    ) -> torch.Tensor:
        """``input_ids``/``position_ids``: ``[b, s]`` (the whole micro-batch; position ids
        may also be ``[1, s]``). Returns ``[s, b/q, h/q]``."""
        if tokentype_ids is not None:
            raise ValueError("Optimus 2D does not support token-type embeddings")
        embeddings = self.word_embeddings(input_ids)
        if self.add_position_embedding:
            if position_ids.shape[0] > 1:
                position_ids = batch_block(position_ids, 0, self.mesh)
            table = column_replicated(self.position_embeddings.weight, self.mesh)
            embeddings = embeddings + F.embedding(position_ids, table)
        embeddings = embeddings.transpose(0, 1).contiguous()
        if self.config.fp32_residual_connection:
            embeddings = embeddings.float()
        if self.training and self.embedding_dropout.p > 0:
            with get_cuda_rng_tracker().fork():
                embeddings = self.embedding_dropout(embeddings)
        return embeddings


class OptimusOutputLayer(torch.nn.Module):
    """LM head: logits ``[s, b/q, v/q]`` (vocabulary block ``j``) from ``[s, b/q, h/q]``.

    Called like megatron-core's output ``ColumnParallelLinear``: ``forward(hidden,
    weight=None, runtime_gather_output=None)`` returns ``(logits, None)``. With tied
    embeddings the caller passes the embedding table as ``weight`` and this layer owns no
    weight (``has_weight=False``); otherwise it owns a ``VOCAB_TABLE`` block, initialised
    if ``initialize``.
    """

    def __init__(
        self, config, vocab_size: int, mesh: OptimusMesh, has_weight: bool, initialize: bool = True
    ):
        super().__init__()
        self.mesh = mesh
        self.sequence_parallel = False
        if has_weight:
            self.weight = vocab_table_parameter(config, vocab_size, mesh, initialize)
        else:
            self.weight = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        weight: Optional[torch.Tensor] = None,
        runtime_gather_output: Optional[bool] = None,
    ) -> Tuple[torch.Tensor, None]:
        if runtime_gather_output:
            raise ValueError("Optimus 2D keeps logits partitioned (runtime_gather_output)")
        if weight is None:
            weight = self.weight
        return summa_abt(hidden_states, weight, self.mesh), None
