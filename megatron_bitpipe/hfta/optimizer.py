"""The optimizer of a fused array: one megatron-core optimizer per model, over that model's
slices of the fused parameters.

For model ``k`` every fused parameter ``p`` (``[B, ...]``) contributes the view ``p[k]``, with
``main_grad`` the view ``p.main_grad[k]`` of megatron DDP's gradient buffer and the parameter's
attributes (replica ``shared`` marks, tensor-parallel attributes). megatron's own parameter
groups (``_get_param_groups``: no weight decay for biases and 1-D tensors, judged on the view,
so as in the unfused model) and optimizer (Adam: ``FP32Optimizer``, or with ``--bf16``
``Float16OptimizerWithFloat16Params``, which keeps an fp32 main copy of each view and copies it
back into the view after the step, writing through into the fused bf16 parameter) are built
over these views, with ``max_lr`` = model ``k``'s learning rate in each of its groups:
megatron's scheduler then gives model ``k`` the schedule ``--lr lr_k`` gives (warm-up, decay,
``--min-lr``). The update writes through the views into the fused parameters.

:class:`HftaOptimizer` steps the B optimizers as megatron's ``ChainedOptimizer`` does, except
that each model's gradient norm and clipping are its own (a norm over the whole array would
couple the models). ``step()`` returns ``(success, grad norm, None)`` with the norm of the whole
array (``sqrt(Σ_k norm_k²)``); ``model_grad_norms`` holds the B norms of the last step.

**Distributed optimizer** (``--use-distributed-optimizer``, ZeRO-1): megatron's
``DistributedOptimizer`` shards DDP's flat gradient buffer by ranges that cut across the models
and has one learning rate and one norm, so a fused array does not use it. Its DDP stays in
all-reduce mode (``use_distributed_optimizer=False``: every rank receives the whole averaged
gradient) and each model's optimizer holds only this rank's *share* of each view: the view
flattened, cut into equal shares of ``ceil(numel / n)`` elements over the ``n`` ranks of the
group the chunk's DDP reduces over (its grad-sync group: the stage's replicas x data
parallel), rank ``r`` holding elements ``[r·len, (r+1)·len)`` (the last shares shorter or
empty). The Adam moments, and under bf16 the fp32 main weights, therefore exist once in that
group. A model's gradient norm sums the squares of this rank's shares and all-reduces them over
every rank of the job (each element has one owner; BitPipe's replica marks do not apply to the
shares, megatron's tied-head mark does). After the step each chunk's updated shares of all
models are all-gathered over its group: one all-gather (``all_gather_into_tensor``) of one
packed buffer per chunk, in stage order.

The trade-off: the gradients are all-reduced, not reduce-scattered, so every rank keeps the
whole fp32 gradient buffer and the step moves about 1.5 times the bytes of plain data
parallelism or of megatron's distributed optimizer (an all-reduce costs a reduce-scatter plus an
all-gather, and the parameters' all-gather comes on top; it is half as large in bf16). What
it saves is optimizer memory: the Adam moments (and the bf16 main weights), 2 (3) fp32
copies of the parameters, divided by ``n``.

**Checkpoints** (``torch_dist``): the Adam moments are stored fused, like the weights:
``optimizer.state.exp_avg.<name>`` is the ``[B, ...]`` stack of the models' moments of fused
parameter ``<name>``, sharded as the parameter is; with bf16 the fp32 main weights likewise
(``optimizer.state.fp32_param.<name>``, megatron's name for them); the step (common to all
models) as ``common_step``; each model's parameter-group values as plain values. A sharded
optimizer gathers the full tensors before saving (collective) and keeps its shares when
loading, so the form is the same with and without ``--use-distributed-optimizer``, and a fused
checkpoint loads into any pipeline layout, data-parallel size and either optimizer form of the
same array.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, _get_megatron_optimizer_based_on_param_groups, _get_param_groups
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from .. import megatron_compat
from ..execution.replicas import stage_order
from ..optimus.collectives import all_gather_blocks
from .settings import HftaSettings

if TYPE_CHECKING:
    from ..model.build import PipelineModel

__all__ = ["HftaOptimizer", "build_hfta_optimizer", "model_views"]

#: parameter attributes a model's view keeps (grad-norm filters, tensor parallelism, tying)
_VIEW_ATTRIBUTES = ("shared", "tensor_model_parallel", "partition_dim", "partition_stride", "allreduce", "sequence_parallel")


class _ModelSlice:
    """Model ``k``'s slice of the chunks, as megatron's ``_get_param_groups`` reads a chunk."""

    def __init__(self, views: List[Tuple[str, torch.Tensor]]):
        self.views = views

    def named_parameters(self) -> Iterator[Tuple[str, torch.Tensor]]:
        return iter(self.views)


def _slice_of(param: torch.Tensor, k: int) -> torch.Tensor:
    """Model ``k``'s view of fused ``param`` as an optimizer parameter: ``main_grad`` the view of
    the parameter's, its attributes copied (``partition_dim`` one lower)."""
    view = param.detach()[k].requires_grad_(True)
    view.main_grad = param.main_grad[k]
    for attribute in _VIEW_ATTRIBUTES:
        if hasattr(param, attribute):
            setattr(view, attribute, getattr(param, attribute))
    if hasattr(param, "partition_dim"):
        view.partition_dim = param.partition_dim - 1
    return view


def model_views(chunks: Sequence[torch.nn.Module], k: int) -> List[Tuple[str, torch.Tensor]]:
    """``(name, view)`` of model ``k``'s slice of every trainable parameter of ``chunks``
    (DDP-wrapped: each view's ``main_grad`` is the slice of the parameter's)."""
    return [(name, _slice_of(param, k)) for chunk in chunks for name, param in chunk.named_parameters() if param.requires_grad]


@dataclass(frozen=True)
class _Share:
    """This rank's share of one model's flattened view (``numel`` elements) of a fused
    parameter: elements ``[start, stop)``; every rank's share is padded to ``length`` elements.
    Not sharded: the whole view (``length == stop == numel``, ``start == 0``)."""

    numel: int
    length: int
    start: int
    stop: int

    @classmethod
    def of(cls, numel: int, rank: int, ranks: int) -> "_Share":
        """Rank ``rank``'s share of ``ranks`` equal ones."""
        length = -(-numel // ranks)
        start = min(rank * length, numel)
        return cls(numel, length, start, min(start + length, numel))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This share of ``full`` (a model's whole tensor, any shape), flat."""
        return full.reshape(-1)[self.start : self.stop]


def _share_of(view: torch.Tensor, share: _Share, shared: bool) -> torch.Tensor:
    """The optimizer parameter of ``share`` of ``view`` (a model's slice, :func:`_slice_of`):
    a flat view of the fused parameter and its ``main_grad`` (``view`` never copies: the update
    writes through); ``shared`` its grad-norm mark."""
    piece = view.detach().view(-1)[share.start : share.stop].requires_grad_(True)
    piece.main_grad = view.main_grad.view(-1)[share.start : share.stop]
    for attribute in _VIEW_ATTRIBUTES:
        if hasattr(view, attribute):
            setattr(piece, attribute, getattr(view, attribute))
    piece.shared = shared
    return piece


def _all_gather(pieces: Sequence[Tuple[_Share, torch.Tensor]], group: dist.ProcessGroup) -> List[torch.Tensor]:
    """The whole flat tensors whose shares ``pieces`` are (each ``(share, this rank's part)``,
    one dtype), gathered over ``group`` with one all-gather of one packed buffer (each part
    padded to its share's length). Collective over ``group``."""
    total = sum(share.length for share, _ in pieces)
    packed = torch.zeros(total, dtype=pieces[0][1].dtype, device=pieces[0][1].device)
    offset = 0
    for share, part in pieces:
        packed[offset : offset + part.numel()].copy_(part.reshape(-1))
        offset += share.length
    rows, offset, out = all_gather_blocks(packed, group), 0, []
    for share, _ in pieces:
        out.append(rows[:, offset : offset + share.length].reshape(-1)[: share.numel])
        offset += share.length
    return out


@dataclass
class _Fused:
    """One fused parameter ``param`` (``[B, ...]``): ``views[k]`` is model ``k``'s optimizer
    parameter over it (the slice ``param[k]``, or this rank's ``share`` of it flattened)."""

    param: torch.nn.Parameter
    views: List[torch.Tensor]
    share: _Share


_MOMENTS = ("exp_avg", "exp_avg_sq")
#: megatron's key of the fp32 main weights of a bf16 parameter
_MAIN = "fp32_param"


class HftaOptimizer(ChainedOptimizer):
    """B megatron optimizers, model ``k``'s at index ``k``, over the views ``fused[i].views[k]``
    of the fused parameters ``fused[i].param``; see the module docstring.

    ``sync_groups`` (sharded state only, else empty): ``(group, indices into fused)`` per chunk
    in stage order, the shares of ``fused[i]`` for ``i`` in ``indices`` being split over ``group``.
    """

    def __init__(self, parts, fused: List[_Fused], lrs: Sequence[float], sync_groups: Sequence[Tuple[dist.ProcessGroup, List[int]]] = ()):
        super().__init__(parts)
        self.fused, self.lrs, self.sync_groups = fused, tuple(lrs), list(sync_groups)
        self.model_grad_norms: List[float] = []

    @property
    def sharded(self) -> bool:
        """Whether each rank holds only its shares of the state (``--use-distributed-optimizer``)."""
        return bool(self.sync_groups)

    def max_lr_of(self, part) -> float:
        """This run's peak learning rate of the model whose optimizer is ``part`` (``--hfta-lr``)."""
        return self.lrs[self.chained_optimizers.index(part)]

    def _optimized(self, k: int, fused: _Fused) -> torch.Tensor:
        """The tensor model ``k``'s optimizer updates for ``fused``: the view, or its fp32 main copy."""
        view = fused.views[k]
        return getattr(view, "main_param", view)

    def _state_keys(self) -> Tuple[str, ...]:
        """What a checkpoint holds per fused parameter: the moments, and in bf16 the main weights."""
        return _MOMENTS + ((_MAIN,) if self.config.bf16 else ())

    def _local(self, key: str, k: int, fused: _Fused) -> torch.Tensor:
        """Model ``k``'s state ``key`` of ``fused`` on this rank (its share when sharded)."""
        tensor = self._optimized(k, fused)
        return tensor if key == _MAIN else self.chained_optimizers[k].optimizer.state[tensor][key]

    def _whole_states(self, keys: Sequence[str]) -> Dict[str, Dict[int, torch.Tensor]]:
        """``key -> fused index -> [B, ...]`` stack of the models' whole state tensors; gathered
        over each chunk's group when sharded (collective)."""
        out: Dict[str, Dict[int, torch.Tensor]] = {key: {} for key in keys}
        b = len(self.chained_optimizers)
        if not self.sharded:
            for i, fused in enumerate(self.fused):
                for key in keys:
                    out[key][i] = torch.stack([self._local(key, k, fused) for k in range(b)])
            return out
        for group, indices in self.sync_groups:
            entries = [(key, i, k) for key in keys for i in indices for k in range(b)]
            whole = _all_gather([(self.fused[i].share, self._local(key, k, self.fused[i])) for key, i, k in entries], group)
            for (key, i, k), flat in zip(entries, whole):
                out[key].setdefault(i, [None] * b)[k] = flat.view(self.fused[i].param.shape[1:])
        return {key: {i: torch.stack(models) for i, models in stacks.items()} for key, stacks in out.items()}

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        if is_loading:
            for part in self.chained_optimizers:
                part.init_state_fn(part.optimizer, part.config)
        index = {id(fused.param): i for i, fused in enumerate(self.fused)}
        model_entries = {}
        for entry in nested_values(model_sharded_state_dict):
            if isinstance(entry, ShardedBase) and id(getattr(entry, "data", None)) in index:
                model_entries.setdefault(index[id(entry.data)], entry)
        keys = self._state_keys()
        if is_loading:  # to be filled by the load: whole tensors, whatever this rank holds
            b = len(self.chained_optimizers)
            whole = {key: {i: torch.empty((b, *self.fused[i].param.shape[1:]), dtype=torch.float32) for i in model_entries} for key in keys}
        else:
            whole = self._whole_states(keys)
        state = {key: {} for key in keys}
        for i, entry in model_entries.items():
            for key in keys:
                state[key][i] = make_sharded_optimizer_tensor(entry, whole[key][i], prefix=f"optimizer.state.{key}")
        first = self.chained_optimizers[0].optimizer
        step = first.state[self._optimized(0, self.fused[0])].get("step") if self.fused else None
        if step is not None:
            state["common_step"] = torch.as_tensor(step).clone()
        groups = [
            [{**group, "params": LocalNonpersistentObject(group["params"])} for group in part.optimizer.state_dict()["param_groups"]]
            for part in self.chained_optimizers
        ]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        state = state_dict["state"]
        step = state.get("common_step")
        for i, fused in enumerate(self.fused):
            for k, part in enumerate(self.chained_optimizers):
                slot = part.optimizer.state[self._optimized(k, fused)]
                for key in self._state_keys():
                    if i in state[key]:
                        self._local(key, k, fused).view(-1).copy_(fused.share.take(state[key][i][k]))
                if step is not None:
                    slot["step"] = torch.as_tensor(step, dtype=torch.float32).clone()
        for part, groups in zip(self.chained_optimizers, state_dict["param_groups"]):
            for group, saved in zip(part.optimizer.param_groups, groups):
                group.update({key: value for key, value in saved.items() if key != "params"})

    @torch.no_grad()
    def _gather_params(self) -> None:
        """Every model's updated shares of every chunk, all-gathered over the chunk's group into
        the fused parameters (one packed all-gather per chunk, in stage order; collective)."""
        b = len(self.chained_optimizers)
        for group, indices in self.sync_groups:
            entries = [(i, k) for i in indices for k in range(b)]
            whole = _all_gather([(self.fused[i].share, self.fused[i].views[k]) for i, k in entries], group)
            for (i, k), flat in zip(entries, whole):
                self.fused[i].param.data[k].view(-1).copy_(flat)

    @torch.no_grad()
    def step(self):
        if self.prepare_grads():
            return False, None, None
        norms = []
        for part in self.chained_optimizers:
            norm = part.get_grad_norm()
            if part.config.clip_grad > 0.0:
                clip_grad_by_total_norm_fp32(part.get_parameters(), max_norm=part.config.clip_grad, total_norm=norm)
            norms.append(float(norm))
        self.model_grad_norms = norms
        success = self.step_with_ready_grads()
        self._gather_params()
        return success, math.sqrt(sum(norm * norm for norm in norms)), None


def build_hfta_optimizer(config: OptimizerConfig, model: "PipelineModel", hfta: HftaSettings) -> HftaOptimizer:
    """The :class:`HftaOptimizer` of a fused array's DDP-wrapped chunks ``model.chunks``:
    megatron's Adam per model, in fp32 or with bf16 parameters (fp32 main weights); with
    ``config.use_distributed_optimizer`` each holds only this rank's shares (module docstring).
    The chunks' DDP must all-reduce (``use_distributed_optimizer=False``). ValueError for
    another optimizer, fp16 or a reduce-scattering DDP. Collective, as megatron's parameter
    grouping is."""
    if config.optimizer != "adam" or config.fp16:
        raise ValueError("a fused array trains with megatron's Adam in fp32 or bf16 (not fp16, not other optimizers)")
    chunks, groups = model.chunks, model.groups
    if any(chunk.ddp_config.use_distributed_optimizer for chunk in chunks):
        raise ValueError("a fused array's DDP all-reduces the gradients; its optimizer shards the state itself (module docstring)")
    sharded = config.use_distributed_optimizer
    part_config = copy.copy(config)  # one config for all parts (ChainedOptimizer's rule): megatron's non-distributed optimizers
    part_config.use_distributed_optimizer = False
    stats_group = groups.rank_pgs.intra_dist_opt if sharded else groups.rank_pgs.mp

    fused: List[_Fused] = []
    chunk_indices: Dict[int, List[int]] = {}
    for c, chunk in enumerate(chunks):
        group: Optional[dist.ProcessGroup] = groups.grad_sync_group(c) if sharded else None
        for param in (param for param in chunk.parameters() if param.requires_grad):
            numel = param[0].numel()
            share = _Share.of(numel, group.rank(), group.size()) if sharded else _Share(numel, numel, 0, numel)
            chunk_indices.setdefault(c, []).append(len(fused))
            fused.append(_Fused(param, [], share))

    # execution.replicas.mark_replica_parameters marks the chunks of pipelines other than 0 as
    # shared; a share has one owner in its group, so only other marks (megatron's tied head
    # copy, on one-pipeline placements) keep a share out of the norm
    pipeline_of = {id(param): spec.pipeline for chunk, spec in zip(chunks, model.specs) for param in chunk.parameters()}
    parts = []
    for k, lr in enumerate(hfta.lrs):
        views = model_views(chunks, k)  # the grouping judges the whole views (1-D tensors, biases)
        groups_k = _get_param_groups([_ModelSlice(views)], part_config, megatron_compat.standard_param_group_overrides(part_config))
        for (_, view), entry in zip(views, fused):
            if sharded:
                shared = bool(getattr(entry.param, "shared", False)) and pipeline_of[id(entry.param)] == 0
                entry.views.append(_share_of(view, entry.share, shared))
            else:
                entry.views.append(view)
        optimized = {id(view): entry.views[k] for (_, view), entry in zip(views, fused)}
        for group in groups_k:
            group["params"] = [optimized[id(view)] for view in group["params"]]
            group["max_lr"] = lr
        parts.append(
            _get_megatron_optimizer_based_on_param_groups(
                part_config, model_chunks=list(chunks), param_groups=groups_k, model_parallel_group=stats_group, pg_collection=groups.rank_pgs
            )
        )
    sync_groups = [(groups.grad_sync_group(c), chunk_indices[c]) for c in stage_order(groups) if c in chunk_indices] if sharded else []
    return HftaOptimizer(parts, fused, hfta.lrs, sync_groups)
