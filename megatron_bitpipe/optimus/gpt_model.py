"""megatron-core's ``GPTModel`` in Optimus 2D mode.

:class:`OptimusGPTModel` is ``GPTModel`` with

* the decoder built from :func:`~megatron_bitpipe.optimus.spec.get_optimus_gpt_block_spec`;
* the embedding and output layer converted to 2-D blocks right after megatron-core built its
  1-D ones (so initial values, and the random numbers drawn, are megatron-core's: with
  ``use_cpu_initialization`` and the same seed the model starts from exactly the weights
  of its single-process twin);
* the loss from :func:`~megatron_bitpipe.optimus.cross_entropy.optimus_cross_entropy`.

Inputs are the usual ``[b, s]`` token ids, position ids, labels and loss masks of the whole
micro-batch (replicated over the TP group, as megatron-core's data loading gives them). The
loss is returned as ``[b, s]`` per-token losses of the whole micro-batch on every rank, so
``loss_func`` is unchanged. Between pipeline stages the hidden states are
``[s, b/q, h/q]`` blocks (see :func:`optimus_p2p_tensor_shapes`).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection

from .checkpoint import optimus_sharded_entry
from .collectives import all_gather_along
from .cross_entropy import optimus_cross_entropy
from .embedding import OptimusEmbedding, OptimusOutputLayer
from .mesh import OptimusMesh
from .mlp import optimus_mlp_known
from .spec import get_optimus_gpt_block_spec
from .validation import check_optimus_model_config


def vocab_block_from_1d_partition(partition: torch.Tensor, mesh: OptimusMesh) -> torch.Tensor:
    """This rank's ``[v/q, h/q]`` block from megatron-core 1-D vocabulary partitions.

    Over a TP group of q² ranks, megatron's TP rank ``r`` holds vocabulary rows block ``r``
    of q² (``[v/q², h]``). The ranks of mesh row ``i`` hold blocks ``i·q … i·q+q−1``, i.e.
    vocabulary block ``i`` of q: gather them along the row and keep hidden block ``j``.
    The block stays on ``partition``'s device; the gather runs on the current GPU when there is
    one (weights are built on the CPU, ``use_cpu_initialization``, and NCCL only moves GPU
    tensors).
    """
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else partition.device
    rows = all_gather_along(partition.detach().to(device), 0, mesh.row_group)
    return rows.chunk(mesh.side, dim=1)[mesh.column].to(partition.device).contiguous()


class OptimusGPTModel(GPTModel):
    """GPT in Optimus 2D mode over ``mesh`` (whose TP group must be ``pg_collection.tp``).

    Takes ``GPTModel``'s arguments; ``transformer_layer_spec`` defaults to this stage's
    Optimus block spec. Multi-token prediction, sequence/context parallelism and MoE are
    not supported (rejected by :func:`check_optimus_model_config`).
    """

    def __init__(
        self,
        config,
        vocab_size: int,
        max_sequence_length: int,
        *,
        mesh: OptimusMesh,
        pg_collection: ProcessGroupCollection,
        transformer_layer_spec=None,
        vp_stage: Optional[int] = None,
        **gpt_kwargs,
    ):
        check_optimus_model_config(config, mesh.side**2, vocab_size)
        if pg_collection.tp is not mesh.tp_group:
            raise ValueError("the mesh must be built over pg_collection.tp")
        if gpt_kwargs.get("mtp_block_spec") is not None:
            raise ValueError("Optimus 2D does not support multi-token prediction")
        if transformer_layer_spec is None:
            transformer_layer_spec = get_optimus_gpt_block_spec(
                config, mesh, vp_stage=vp_stage, pp_rank=pg_collection.pp.rank()
            )
        # A plain attribute may be set before nn.Module.__init__; GPTModel.__init__ calls
        # setup_embeddings_and_output_layer, which needs the mesh.
        self.mesh = mesh
        with optimus_mlp_known():
            super().__init__(
                config,
                transformer_layer_spec,
                vocab_size,
                max_sequence_length,
                pg_collection=pg_collection,
                vp_stage=vp_stage,
                **gpt_kwargs,
            )

    def setup_embeddings_and_output_layer(self) -> None:
        """Convert megatron's 1-D embedding and output layer to 2-D, then tie as megatron does."""
        mesh = self.mesh
        if self.pre_process:
            megatron_embedding = self.embedding
            self.embedding = OptimusEmbedding(
                self.config,
                self.vocab_size,
                self.max_sequence_length,
                self.position_embedding_type,
                mesh,
                initialize=False,
            )
            with torch.no_grad():
                self.embedding.word_embeddings.weight.copy_(
                    vocab_block_from_1d_partition(megatron_embedding.word_embeddings.weight, mesh)
                )
                if self.embedding.add_position_embedding:
                    positions = megatron_embedding.position_embeddings.weight
                    self.embedding.position_embeddings.weight.copy_(
                        positions.chunk(mesh.side, dim=1)[mesh.column]
                    )
        if self.post_process:
            megatron_weight = self.output_layer.weight
            self.output_layer = OptimusOutputLayer(
                self.config,
                self.vocab_size,
                mesh,
                has_weight=megatron_weight is not None,
                initialize=False,
            )
            if megatron_weight is not None:
                with torch.no_grad():
                    self.output_layer.weight.copy_(
                        vocab_block_from_1d_partition(megatron_weight, mesh)
                    )
        super().setup_embeddings_and_output_layer()

    def compute_language_model_loss(
        self, labels: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor:
        """Per-token losses ``[b, s]`` of the whole micro-batch from ``[s, b/q, v/q]`` logits."""
        return optimus_cross_entropy(logits, labels, self.mesh)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """megatron's distributed-checkpoint entries, each Optimus parameter described as the
        2-D block of the serial tensor it holds (:mod:`megatron_bitpipe.optimus.checkpoint`),
        so checkpoints load into 1-D tensor parallelism, a single process or another mesh."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for name, entry in state.items():
            param = getattr(entry, "data", None)
            if getattr(param, "optimus_layout", None) is not None:
                state[name] = optimus_sharded_entry(entry, param, self.mesh)
        return state


def optimus_p2p_tensor_shapes(mesh: OptimusMesh) -> Callable:
    """``adjust_tensor_shapes_fn`` for megatron-core's 1F1B schedule: ``[s, b, h]`` →
    ``[s, b/q, h/q]``, the hidden-state block that pipeline stages exchange."""

    def to_blocks(shapes: List[Tuple[int, ...]]) -> List[Tuple[int, ...]]:
        return [(s, b // mesh.side, h // mesh.side) for s, b, h in shapes]

    def adjust(recv_shapes, send_shapes):
        return to_blocks(recv_shapes), to_blocks(send_shapes)

    return adjust
