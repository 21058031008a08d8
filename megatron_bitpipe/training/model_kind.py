"""What a model kind is: one typed object the model-kind registry holds.

A :class:`ModelKind` bundles what differs between the models a task trains (GPT, a fused
array of GPTs, Optimus 2D GPT, BERT, a fused array of BERTs): the chunk builder, the layer
spec, the chunk builder's further keywords, megatron's ``forward_step_func``, the loss
reports and their log fields, the pipeline p2p shapes and whether attention is causal. It
also states which task offers it and when the run's decisions
(:class:`~megatron_bitpipe.run_config.RunConfig`) choose it; the choice is made once per run
(:func:`~.model_registry.model_kind_for`). The modules defining a task's kinds end with their
``KINDS``; :mod:`.model_registry` lists them.

Its callables take the run's decisions (the p2p shapes also the built model; the task's own
in :attr:`~megatron_bitpipe.run_config.RunConfig.task_settings`), so a kind is one value per
model family and variant, shared by all runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from ..hfta.model import hfta_p2p_tensor_shapes
from ..model.build import PipelineModel
from ..model.sdpa_attention import SdpaDotProductAttention, with_core_attention
from ..run_config import RunConfig
from .model import build_model

__all__ = [
    "ModelKind", "builder_layer_spec", "core_attention", "fused_p2p_shapes", "is_fused_array", "local_layer_spec",
    "no_p2p_adjustment", "own_iteration_losses",
]  # fmt: skip

#: megatron-core's ``forward_step_func``: ``(data_iterator, model) -> (output, loss_func)``
ForwardStep = Callable[..., Tuple[object, Callable]]


@dataclass(frozen=True)
class ModelKind:
    """One model kind.

    Attributes:
        name: the kind's name (registry key, e.g. ``hfta-gpt``).
        task: the :attr:`~.task.PretrainTask.name` of the task that offers it (``gpt``, ``bert``).
        chosen_when: ``chosen_when(run)`` — whether ``run``'s decisions ask for this kind;
            ``None`` for the task's plain kind, chosen when no other kind of the task is.
        chunk_builder: the chunk builder of :func:`~megatron_bitpipe.model.build.build_pipeline_model`.
        layer_spec: ``layer_spec(run, config)`` — the chunks' transformer layer spec;
            ``None``: the chunk builder's own default.
        chunk_kwargs: ``chunk_kwargs(run)`` — further keywords of the chunk builder
            (``rotary_base``, ``add_binary_head``, a fused array's ``model_class`` and ``hfta``).
        forward_step: ``forward_step(run)`` — megatron's ``forward_step_func``; its
            ``loss_func`` reports ``[loss sum, count]`` under each of :attr:`loss_names`.
        loss_names: ``loss_names(run)`` — the names of the loss reports, in log order.
        iteration_losses: ``iteration_losses(run, losses)`` — a training iteration's
            reduced losses -> (the losses it logs, further JSON/line fields of
            :attr:`~.logs.IterationRecord.extra`).
        p2p_shapes: ``p2p_shapes(run, model)`` — megatron's ``adjust_tensor_shapes_fn`` for
            the pipeline messages of ``model`` (``None``: megatron's ``[s, b, h]``).
        causal_attention: whether each token attends to the tokens before it only (GPT) or to
            the whole sequence (BERT); the logs' model FLOPs count the attention scores accordingly.
    """

    name: str
    task: str
    chosen_when: Optional[Callable[[RunConfig], bool]]
    chunk_builder: Callable[..., List[torch.nn.Module]]
    layer_spec: Callable[[RunConfig, TransformerConfig], Optional[ModuleSpec]]
    chunk_kwargs: Callable[[RunConfig], Dict[str, object]]
    forward_step: Callable[[RunConfig], ForwardStep]
    loss_names: Callable[[RunConfig], Tuple[str, ...]]
    iteration_losses: Callable[[RunConfig, Dict[str, float]], Tuple[Dict[str, float], Dict[str, object]]]
    p2p_shapes: Callable[[RunConfig, PipelineModel], Optional[Callable]]
    causal_attention: bool

    def build_model(self, run: RunConfig) -> PipelineModel:
        """This rank's chunks of ``run``'s placement, initialised from ``--seed`` alone, wrapped in
        megatron DDP (a collective call: it creates the process groups)."""
        return build_model(run, self.chunk_builder, self.layer_spec, **self.chunk_kwargs(run))


def core_attention(run: RunConfig) -> Optional[type]:
    """The core attention ``run``'s ``--attention-backend`` puts into local layer specs (``None``: the spec's own)."""
    return SdpaDotProductAttention if run.kernels.attention_backend == "sdpa" else None


def builder_layer_spec(run: RunConfig, config: TransformerConfig) -> None:
    """A :attr:`ModelKind.layer_spec` that leaves the layer spec to the chunk builder."""
    return None


def local_layer_spec(default: Callable[[TransformerConfig], ModuleSpec]):
    """A :attr:`ModelKind.layer_spec` for an unfused model: with ``--attention-backend sdpa``
    ``default`` of the config (the family's local spec) with
    :class:`~megatron_bitpipe.model.sdpa_attention.SdpaDotProductAttention` as core attention;
    otherwise the chunk builder's own default."""

    def layer_spec(run: RunConfig, config: TransformerConfig) -> Optional[ModuleSpec]:
        attention = core_attention(run)
        return None if attention is None else with_core_attention(default(config), attention)

    return layer_spec


def own_iteration_losses(run: RunConfig, losses: Dict[str, float]):
    """A :attr:`ModelKind.iteration_losses` that logs the reduced losses as they are."""
    return losses, {}


def no_p2p_adjustment(run: RunConfig, model: PipelineModel) -> None:
    """A :attr:`ModelKind.p2p_shapes` of megatron's own ``[s, b, h]`` messages."""
    return None


def is_fused_array(run: RunConfig) -> bool:
    """The :attr:`ModelKind.chosen_when` of a fused array's kinds: ``--hfta-models`` given."""
    return run.hfta is not None


def fused_p2p_shapes(run: RunConfig, model: PipelineModel) -> Callable:
    """The :attr:`ModelKind.p2p_shapes` of a fused array: ``[s, B*b, h]``."""
    return hfta_p2p_tensor_shapes(run.hfta.num_models)
