"""The fused GPT of HFTA: megatron-core's ``GPTModel`` whose every weight has a leading model
dimension B (:mod:`.layers`), and its loss.

:func:`hfta_gpt_layer_spec` is megatron-core's local GPT layer spec with the batched linears
and norms; :class:`HftaGPTModel` is ``GPTModel`` built from it, with a batched final norm,
word/position embeddings and output layer. Attention, rotary embeddings, dropout, residuals and
the cross entropy are megatron's own, run on the fused ``[s, B*b, h]`` activations (model-major
batch; :mod:`.layers`). ``forward(tokens, position_ids, mask, labels=labels)`` takes one
micro-batch ``[b, s]`` that every model sees and returns the per-token losses ``[B*b, s]``
(model ``k``'s in rows ``k*b ..``) or, without labels, the logits ``[B*b, s, vocab]``
(``vocab/tp`` under tensor parallelism with ``parallel_output``).

Pipeline stages pass ``[s, B*b, h]`` tensors (:func:`hfta_p2p_tensor_shapes`; ``[s/tp, B*b,
h]`` with sequence parallelism, megatron's own shape rule along ``s``).

**Tensor parallelism** (``tp`` ranks, megatron's layout with the model dimension in front;
:mod:`.layers`): the attention's ``linear_qkv`` and the MLP's ``linear_fc1`` are
column-parallel (weights ``[B, out/tp, h]``), ``linear_proj`` and ``linear_fc2`` row-parallel
(``[B, h, in/tp]``), the word embeddings vocabulary-parallel ``[B, vocab/tp, h]`` and the
output layer (tied to them or not) column-parallel ``[B, vocab/tp, h]``: its logits ``[s,
B*b, vocab/tp]`` go to megatron's vocabulary-parallel cross entropy (``parallel_output``).
Norms and position embeddings are whole on every rank.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from .layers import HftaEmbedding, HftaLinear, HftaNorm
from .mlp import fuse_gated_mlps
from .reports import model_loss
from .settings import HftaSettings

__all__ = [
    "HftaGPTModel",
    "hfta_gpt_layer_spec",
    "hfta_loss",
    "hfta_p2p_tensor_shapes",
]

def _fused(spec, num_models: int):
    """``spec`` with megatron's linears and torch norms swapped for the batched ones."""
    swaps = {
        ColumnParallelLinear: ModuleSpec(module=HftaLinear, params={"num_models": num_models, "parallel_mode": "column"}),
        RowParallelLinear: ModuleSpec(module=HftaLinear, params={"num_models": num_models, "parallel_mode": "row"}),
        WrappedTorchNorm: ModuleSpec(module=HftaNorm, params={"num_models": num_models}),
    }
    if isinstance(spec, type):
        return swaps.get(spec, spec)
    if isinstance(spec, functools.partial) and dataclasses.is_dataclass(spec.keywords.get("submodules")):
        # megatron-core 0.19: a module factory with its submodules (MLP.as_mlp_submodule)
        return functools.partial(spec.func, *spec.args, **dict(spec.keywords, submodules=_fused_submodules(spec.keywords["submodules"], num_models)))
    if not isinstance(spec, ModuleSpec) or not dataclasses.is_dataclass(spec.submodules):
        return spec
    return dataclasses.replace(spec, submodules=_fused_submodules(spec.submodules, num_models))


def _fused_submodules(submodules, num_models: int):
    """A submodules dataclass with every field :func:`_fused`."""
    updates = {f.name: _fused(getattr(submodules, f.name), num_models) for f in dataclasses.fields(submodules)}
    return dataclasses.replace(submodules, **updates)


def hfta_gpt_layer_spec(num_models: int, normalization: str = "LayerNorm", core_attention=None) -> ModuleSpec:
    """megatron-core's local GPT layer spec (no QK norm) for B = ``num_models`` fused models;
    ``core_attention`` replaces megatron's ``DotProductAttention`` (e.g. SDPA)."""
    spec = _fused(get_gpt_layer_local_spec(normalization=normalization), num_models)
    if core_attention is not None:
        from ..model.sdpa_attention import with_core_attention

        spec = with_core_attention(spec, core_attention)
    return spec


class HftaGPTModel(GPTModel):
    """``GPTModel`` of B fused models (see the module docstring); ``hfta`` gives B, the
    learning rates and seeds (every parameter carries ``model_seeds``: slice ``k`` is drawn
    from ``hfta.seeds[k]`` by :func:`megatron_bitpipe.model.init.initialize_from_seed`).
    ``transformer_layer_spec`` is a block spec of :func:`hfta_gpt_layer_spec` layers; its final
    norm becomes batched."""

    def __init__(self, config, transformer_layer_spec: ModuleSpec, vocab_size: int, max_sequence_length: int, *, hfta: HftaSettings, **kwargs):
        b = hfta.num_models
        block = dataclasses.replace(
            transformer_layer_spec,
            submodules=dataclasses.replace(
                transformer_layer_spec.submodules, layer_norm=ModuleSpec(module=HftaNorm, params={"num_models": b})
            ),
        )
        super().__init__(config, block, vocab_size, max_sequence_length, **kwargs)
        self.hfta = hfta
        if kwargs.get("position_embedding_type", "learned_absolute") not in ("learned_absolute", "rope"):
            raise ValueError("HFTA supports learned absolute and rotary position embeddings")
        tp_group = self.pg_collection.tp
        if self.pre_process:
            self.embedding = HftaEmbedding(
                config, vocab_size, max_sequence_length, self.position_embedding_type, b, tp_group=tp_group,
                scatter_to_sequence_parallel=kwargs.get("scatter_embedding_sequence_parallel", True),
            )  # fmt: skip
        if self.post_process:
            tied_here = self.pre_process and self.share_embeddings_and_output_weights
            self.output_layer = HftaLinear(
                config.hidden_size, vocab_size, config=config, init_method=config.init_method, bias=False,
                skip_weight_param_allocation=tied_here, num_models=b, parallel_mode="column",
                gather_output=not self.parallel_output, tp_group=tp_group,
            )  # fmt: skip
        if self.pre_process or self.post_process:
            self.setup_embeddings_and_output_layer()
        fuse_gated_mlps(self)
        for param in self.parameters():
            param.model_seeds = hfta.seeds

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, **kwargs):
        if labels is not None:
            labels = labels.repeat(self.hfta.num_models, 1)  # every model predicts the same tokens
        return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels, **kwargs)


def hfta_loss(num_models: int, loss_mask: torch.Tensor, output: torch.Tensor):
    """Megatron-LM's GPT loss for a fused array: ``(Σ_k masked loss sum of model k, one model's
    token count, reports)``. megatron divides by the token count, so each model's gradient is
    the one its own unfused run gets. Reports: ``lm loss`` the mean over the models, and
    ``lm loss k`` each model's (``[loss sum, tokens]`` each)."""
    mask = loss_mask.reshape(1, -1).float()
    per_model = torch.sum(output.float().reshape(num_models, -1) * mask, dim=1)
    loss = per_model.sum()
    num_tokens = mask.sum().clone().detach().to(torch.int)
    count = num_tokens.view(1).float()
    detached = per_model.clone().detach()
    reports = {"lm loss": torch.cat([(detached.sum() / num_models).view(1), count])}
    for k in range(num_models):
        reports[model_loss("lm loss", k)] = torch.cat([detached[k].view(1), count])
    return loss, num_tokens, reports


def hfta_p2p_tensor_shapes(num_models: int):
    """megatron's ``adjust_tensor_shapes_fn``: pipeline stages exchange ``[s, B*b, h]``."""

    def adjust(recv_shapes, send_shapes):
        widen = lambda shapes: [(s, b * num_models, *rest) for s, b, *rest in shapes]  # noqa: E731
        return widen(recv_shapes), widen(send_shapes)

    return adjust
