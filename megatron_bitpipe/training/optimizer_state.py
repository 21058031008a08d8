"""Loading a checkpoint's optimizer state into this run's megatron-core optimizer, of either kind.

megatron-core's optimizers describe their state for distributed checkpoints themselves
(``optimizer.sharded_state_dict``): tensors keyed by the model's global tensor names
(``optimizer.state.exp_avg.<name>``...), plus plain values (parameter groups, step, loss
scale). A checkpoint written by the same kind of optimizer (both non-distributed, or both
distributed: :class:`~megatron_bitpipe.execution.distributed_optimizer.ChunkDistributedOptimizer`
writes one optimizer's form whatever the number of chunks) and the same chain of parts loads the
way Megatron-LM loads it.

The chain of parts depends on the layout: a mixture-of-experts model's optimizer is one part at
expert parallelism 1 and two at expert parallelism > 1 (the dense parameters', and the experts'
with ``is_expert_parallel`` parameter groups), and megatron matches each part's saved parameter
groups to its own. Another chain is read like another kind: in this run's form.

Across kinds the tensors are the same but named and grouped differently:

=====================  ======================================  =====================================
state                  non-distributed (fp32 / bf16, fp16)     distributed (``fully_reshardable``)
=====================  ======================================  =====================================
Adam moments           ``exp_avg.<name>``, ``exp_avg_sq.<name>``  the same
fp32 main weight       the fp32 weight ``<name>`` / ``fp32_param.<name>``  ``param.<name>``
Adam step              ``common_step`` in the state            ``step`` of every parameter group
=====================  ======================================  =====================================

:class:`OptimizerLoad` then asks for this run's own form (its parts and parameter groups)
under the names the checkpoint uses (the main weight from the fp32 weight when the checkpoint
has no separate one) and carries the step and the loss scale over to every part. Either way, the other plain values (Adam's betas and
epsilon, SGD's momentum, each parameter group's learning-rate bounds) are then set from this run's flags and
loaded schedule (:func:`use_run_hyperparameters`).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase, ShardedTensorFactory
from megatron.core.optimizer import DistributedOptimizer

from ..checkpoint_rules import CheckpointError

__all__ = ["OptimizerLoad", "is_distributed", "use_run_hyperparameters"]

_MAIN_WEIGHT = ("optimizer.state.param.", "optimizer.state.fp32_param.")
_REQUEST = "optimizer (this run's form)"


def is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` is (or chains) megatron's ``DistributedOptimizer``, whose state
    checkpoints in the ``fully_reshardable`` form (a fused array's sharded optimizer is not one:
    it saves the non-distributed form, :mod:`megatron_bitpipe.hfta.optimizer`)."""
    return any(isinstance(part, DistributedOptimizer) for part in getattr(optimizer, "chained_optimizers", [optimizer]))


def _saved_step(tree) -> Optional[int]:
    """Adam's step in a checkpoint's plain optimizer values (any kind), None if it has none."""
    if isinstance(tree, dict):
        if "common_step" in tree:
            return int(tree["common_step"])
        for key, value in tree.items():
            if key == "param_groups" and isinstance(value, list):
                steps = {int(group["step"]) for group in value if isinstance(group, dict) and "step" in group}
                if steps:
                    return steps.pop()
            found = _saved_step(value)
            if found is not None:
                return found
    elif isinstance(tree, list):
        for value in tree:
            found = _saved_step(value)
            if found is not None:
                return found
    return None


def _saved_entry(tree, key: str):
    """The first value stored under ``key`` anywhere in ``tree`` (None if none)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for value in tree:
            found = _saved_entry(value, key)
            if found is not None:
                return found
    return None


class _FromWeight:
    """A main-weight request the checkpoint answers with the loaded weight ``model_entry``
    describes (its ``data`` is the model parameter, loaded before the optimizer)."""

    def __init__(self, model_entry: ShardedBase):
        self.model_entry = model_entry


def _place(entry: ShardedBase) -> Tuple[str, Tuple[int, ...]]:
    """Global tensor name and this block's offset: what identifies an entry's block (layers of
    one block share a name and differ in the stacked-layer offset)."""
    tensor = entry
    if isinstance(entry, ShardedTensorFactory):
        built = entry.build()
        tensor = built[0] if isinstance(built, list) else built
    name = entry.key
    for prefix in _MAIN_WEIGHT:
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name, tuple(tensor.global_offset)


def _fill(request, loaded):
    """``request`` with every sharded or non-persistent leaf replaced by its loaded value and
    every :class:`_FromWeight` by an fp32 copy of its (loaded) model parameter."""
    if isinstance(request, _FromWeight):
        return request.model_entry.data.detach().clone().float()
    if isinstance(request, (ShardedBase, LocalNonpersistentObject)):
        return loaded
    if isinstance(request, dict):
        return {k: _fill(v, loaded.get(k) if isinstance(loaded, dict) else None) for k, v in request.items()}
    if isinstance(request, list):
        return [_fill(v, loaded[i] if isinstance(loaded, list) and i < len(loaded) else None) for i, v in enumerate(request)]
    return request


def _replace(tree, replacements: Dict[int, object]):
    """``tree`` with the leaves whose ``id`` is in ``replacements`` replaced (in place)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in list(items):
        if id(value) in replacements:
            tree[key] = replacements[id(value)]
        else:
            _replace(value, replacements)


class OptimizerLoad:
    """How this run's ``optimizer`` reads a checkpoint's optimizer state; see the module docstring.

    ``model_request`` is the model part of the load request (``model``/``model0``... ->
    sharded state dicts), ``common`` the checkpoint's plain values, ``saved_metadata`` its
    content metadata, ``own_metadata`` this run's (``dp_cp_group`` included), ``saved`` its
    tensor index (``load_sharded_metadata``). :attr:`request` goes into the load request;
    :meth:`apply` loads the result into the optimizer. CheckpointError (raised identically on
    every rank) for a distributed-optimizer checkpoint in a form tied to its saving layout.
    """

    def __init__(self, optimizer, model_request: Dict, common: Dict, saved_metadata: Dict, own_metadata: Dict, saved: Dict):
        self.optimizer = optimizer
        self.common = common
        saved_sharding = saved_metadata.get("distrib_optim_sharding_type")
        if saved_sharding not in (None, "fully_reshardable"):
            raise CheckpointError(
                f"its distributed-optimizer state is in the {saved_sharding!r} form, which only the saving layout reads "
                "(save with --dist-ckpt-optim-fully-reshardable, or load the weights with --no-load-optim)"
            )
        same_kind = (saved_sharding is not None) == is_distributed(optimizer)
        metadata = {**saved_metadata, "dp_cp_group": own_metadata["dp_cp_group"]} if same_kind else own_metadata
        state = optimizer.sharded_state_dict(model_request, is_loading=True, metadata=metadata)
        #: whether the checkpoint holds this run's form (kind and parts): megatron loads it
        self.same_form = same_kind and _part_count(common.get("optimizer")) == _part_count(state)
        if not self.same_form:
            self._rename_main_weights(state, saved, model_request)
        self.key = "optimizer" if self.same_form else _REQUEST
        self.request = {self.key: state}

    def _rename_main_weights(self, state: Dict, saved: Dict, model_request: Dict) -> None:
        """Ask for fp32 main weights under the checkpoint's name, or from its fp32 weights
        when it has no separate ones (filled in :meth:`apply`)."""
        model_entries = {
            _place(entry): entry for chunk in model_request.values() for entry in chunk.values() if isinstance(entry, ShardedBase)
        }
        from_weights = {}
        for entry in list(nested_values(state)):
            if not isinstance(entry, ShardedBase) or not entry.key.startswith(_MAIN_WEIGHT) or entry.key in saved:
                continue
            name = _place(entry)[0]
            other = next((prefix + name for prefix in _MAIN_WEIGHT if prefix + name in saved), None)
            if other is not None:
                entry.key = other
            else:
                from_weights[id(entry)] = _FromWeight(model_entries[_place(entry)])
        _replace(state, from_weights)

    def apply(self, loaded: Dict) -> None:
        """Load the optimizer from ``loaded`` (the result of ``dist_checkpointing.load``),
        after the model's weights."""
        if self.same_form:
            self.optimizer.load_state_dict(loaded["optimizer"])
            return
        state = _fill(self.request[self.key], loaded.get(self.key))
        saved = self.common.get("optimizer")
        step, scaler = _saved_step(saved), _saved_entry(saved, "grad_scaler")
        count = _part_count(state)
        parts = zip(_parts(self.optimizer), (state[i] for i in range(count))) if count > 1 else [(self.optimizer, state)]
        for part, part_state in parts:
            _set_step(part, part_state, step)
            if scaler is not None:
                part_state["grad_scaler"] = scaler
        self.optimizer.load_state_dict(state)


def _parts(optimizer) -> list:
    """The optimizers ``optimizer`` chains (itself if it chains none)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _part_count(state) -> int:
    """How many parts an optimizer state (sharded, or a checkpoint's plain values) holds: a
    chain of several saves one state per part under the keys 0, 1...; one optimizer (or a
    :class:`~megatron_bitpipe.execution.distributed_optimizer.ChunkDistributedOptimizer`,
    whatever its chunks) one state."""
    if isinstance(state, dict) and state and all(isinstance(key, int) for key in state):
        return len(state)
    return 1


def use_run_hyperparameters(optimizer, scheduler) -> None:
    """After loading: Adam's betas and epsilon (SGD's momentum) from this run's flags, and every parameter
    group's learning-rate bounds from the loaded schedule (``scheduler``, which follows
    ``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler``), then the
    current learning rate and weight decay recomputed from it. (A loaded megatron optimizer
    keeps the saving run's values, and its scheduler reads each group's own bounds.)"""
    max_lr_of = getattr(optimizer, "max_lr_of", lambda part: scheduler.max_lr)  # a fused array's: each model's own
    for part in _parts(optimizer):
        config = part.config
        max_lr = max_lr_of(part)
        for group in part.optimizer.param_groups:
            if "betas" in group:
                group["betas"] = (config.adam_beta1, config.adam_beta2)
            if "eps" in group:
                group["eps"] = config.adam_eps
            if "momentum" in group:
                group["momentum"] = config.sgd_momentum
            group["max_lr"], group["min_lr"] = max_lr, scheduler.min_lr
    scheduler.step(increment=0)


def _set_step(optimizer, state, step: Optional[int]) -> None:
    """Put Adam's ``step`` where this run's kind of optimizer state keeps it (``optimizer``
    one part of a chain, ``state`` its state)."""
    if step is None:
        return
    for group in _param_groups(state):
        if is_distributed(optimizer) or "step" in group:
            group["step"] = step
    if not is_distributed(optimizer):
        inner = state["optimizer"] if "optimizer" in state and isinstance(state["optimizer"], dict) and "state" in state["optimizer"] else state
        inner["state"]["common_step"] = torch.tensor(float(step))


def _param_groups(state):
    found = _saved_entry(state, "param_groups")
    return found if isinstance(found, list) else []
