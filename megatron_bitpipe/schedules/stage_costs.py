"""What one micro-batch costs on each stage of a pipeline: the simulator's per-stage times and
activations.

Without a model every stage costs the same: :meth:`StageCosts.uniform` scales the
:class:`~.costs.CostModel`'s times (one device share, ``L / D`` layers) by the placement's
``stage_weight``. :meth:`StageCosts.for_model` costs each stage of a
:class:`~.model_shape.ModelShape` from its own transformer layers plus the embedding (stage 0)
and the head and loss (the last stage):

* a layer's times are the cost model's per device share divided by its ``L / D`` layers (the
  cost file of ``scripts/calibrate_gpu.py``, or the default ``t_F = 1``);
* the head's forward costs a layer's forward times the FLOP ratio ``2 s b h V`` / a layer's
  forward FLOPs (:meth:`~.model_shape.ModelShape.head_forward_flops`); its backward twice
  that, half input gradient (``I``) and half weight gradient (``W``); the embedding's lookup
  and the loss's elementwise work count no time;
* a mixture-of-experts layer (:mod:`.moe_shape`) costs a dense layer's times the FLOP ratio
  of the two (:meth:`~.model_shape.ModelShape.layer_forward_flops`), plus its all-to-alls
  (:meth:`~.costs.CostModel.all_to_all_time` of
  :meth:`~.model_shape.ModelShape.all_to_all_bytes`): the dispatch and the combine in ``F``,
  both again in ``B`` and in a split backward's ``I`` (the input gradients travel back), none
  in ``W``;
* under context parallelism (the model's ``context_parallel_size``) every layer adds its
  key/value exchange (:meth:`~.costs.CostModel.context_exchange_time` of
  :meth:`~.model_shape.ModelShape.context_exchange_bytes`): the all-gather in ``F``, the
  gradients' reduce-scatter in ``B`` and in a split backward's ``I``, none in ``W``; the
  gradient all-reduce's group is ``CP`` times larger (:attr:`StageCosts.context_parallel_size`);
* a stage's gradient all-reduce scales with its parameters (in device shares: ``L / D``
  dense layers' parameters = 1; an MoE layer counts its experts on one expert-parallel rank,
  all timed over the stage's group).

Activations are counted twice: in ``Ma`` (one micro-batch through ``L / D`` layers: a stage
of ``n`` layers holds ``n / (L / D)`` Ma from its forward until its backward ends, a split
backward's until its ``W``), and, for a model, in bytes
(:mod:`.model_shape`: a forward's saved tensors until its ``B`` or ``I``, an ``I``'s kept
inputs and output gradients until its ``W``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from .actions import Action, ActionType
from .costs import CostModel
from .layer_split import StageLayers
from .model_shape import ModelShape
from .placement import Placement

__all__ = ["StageCost", "StageCosts"]


#: the :class:`StageCost` field that holds each compute action type's time
_TIME_FIELDS = {
    ActionType.FORWARD: "forward",
    ActionType.BACKWARD: "backward",
    ActionType.BACKWARD_INPUT: "input",
    ActionType.BACKWARD_WEIGHT: "weight",
}


@dataclass(frozen=True)
class StageCost:
    """One micro-batch on one stage, in the cost model's time unit and in bytes.

    Attributes:
        forward, backward, input, weight: times of ``F``, ``B``, ``I``, ``W``.
        sync_weight: the stage's gradients in device shares (what
            :meth:`~.costs.CostModel.sync_time` scales).
        activation_shares: Ma held from ``F`` until the backward ends (``B`` or ``W``).
        activation_bytes: bytes ``F`` saves, held until ``B`` or ``I``.
        weight_grad_bytes: bytes an ``I`` keeps for its ``W``, held until the ``W``.
    """

    forward: float
    backward: float
    input: float
    weight: float
    sync_weight: float
    activation_shares: float
    activation_bytes: float = 0.0
    weight_grad_bytes: float = 0.0

    def time(self, kind: ActionType) -> float:
        """The time of a compute action of type ``kind`` (0 for ``SYNC``)."""
        field_name = _TIME_FIELDS.get(kind)
        return 0.0 if field_name is None else getattr(self, field_name)


@dataclass(frozen=True)
class StageCosts:
    """The :class:`StageCost` of every stage of one pipeline, in pipeline order (every pipeline
    of a placement holds the same split); ``context_parallel_size``: the context-parallel ranks
    every slot's gradient all-reduce spans besides the replicas and data-parallel ranks."""

    stages: Tuple[StageCost, ...]
    context_parallel_size: int = 1

    @classmethod
    def uniform(cls, costs: CostModel, placement: Placement) -> "StageCosts":
        """Equal stages of ``placement.stage_weight`` device shares; no bytes."""
        weight = placement.stage_weight
        times = [costs.compute_time(Action(kind, 0, 0), weight) for kind in
                 (ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT)]  # fmt: skip
        return cls((StageCost(*times, sync_weight=weight, activation_shares=weight),) * placement.num_stages)

    @classmethod
    def for_model(
        cls, model: ModelShape, layers: StageLayers, costs: CostModel, num_ranks: int, element_bytes: int
    ) -> "StageCosts":
        """Each stage of ``layers`` (pipeline order) for ``model`` on ``num_ranks`` pipeline
        ranks (module docstring); ``element_bytes`` is the activations' element size."""
        moe_ratio = model.layer_forward_flops(moe=True) / model.layer_forward_flops() if model.moe else 0.0
        all_to_all = costs.all_to_all_time(model.all_to_all_bytes(element_bytes))  # one dispatch or combine
        kv_exchange = costs.context_exchange_time(model.context_exchange_bytes(element_bytes))  # one layer's, one way
        share = model.num_layers / num_ranks  # layers of one device share
        per_layer = {kind: costs.compute_time(Action(kind, 0, 0), 1.0 / share) for kind in
                     (ActionType.FORWARD, ActionType.BACKWARD, ActionType.BACKWARD_INPUT, ActionType.BACKWARD_WEIGHT)}  # fmt: skip
        head = per_layer[ActionType.FORWARD] * model.head_forward_flops() / model.layer_forward_flops()
        share_parameters = share * model.layer_parameters()
        last = layers.num_stages - 1
        stages = []
        for stage, count in enumerate(layers.counts):
            has_head = stage == last
            moe = model.moe_layer_count(layers.first_layer(stage), count)
            dense = count - moe
            computed = dense + moe * moe_ratio  # the stage's layers in dense layers' compute
            exchange = 2 * moe * all_to_all + count * kv_exchange  # MoE dispatch and combine; keys and values
            parameters = dense * model.layer_parameters() + (moe * model.layer_parameters(moe=True) if moe else 0)
            if stage == 0:
                parameters += model.embedding_parameters()
            if has_head:
                parameters += model.norm_parameters() + (
                    model.output_layer_parameters() if model.untie_embeddings_and_output_weights else 0
                )
            activation = dense * model.layer_activation_bytes(element_bytes)
            weight_grad = dense * model.layer_weight_grad_bytes(element_bytes)
            if moe:
                activation += moe * model.layer_activation_bytes(element_bytes, moe=True)
                weight_grad += moe * model.layer_weight_grad_bytes(element_bytes, moe=True)
            if stage == 0:
                activation += model.embedding_activation_bytes()
            stages.append(StageCost(
                forward=computed * per_layer[ActionType.FORWARD] + exchange + (head if has_head else 0.0),
                backward=computed * per_layer[ActionType.BACKWARD] + exchange + (2 * head if has_head else 0.0),
                input=computed * per_layer[ActionType.BACKWARD_INPUT] + exchange + (head if has_head else 0.0),
                weight=computed * per_layer[ActionType.BACKWARD_WEIGHT] + (head if has_head else 0.0),
                sync_weight=parameters / share_parameters,
                activation_shares=count / share,
                activation_bytes=activation + (model.head_activation_bytes(element_bytes) if has_head else 0),
                weight_grad_bytes=weight_grad + (model.head_weight_grad_bytes(element_bytes) if has_head else 0),
            ))  # fmt: skip
        return cls(tuple(stages), model.context_parallel_size)
