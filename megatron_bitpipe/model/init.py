"""Layout-independent initial weights: a function of the seed and the parameter's full name,
drawn by each rank for its own shard only.

Every element of the *full* (tensor-parallel unsplit) model has a fixed random value: element
``(i0, i1, ...)`` of the full tensor of parameter ``name`` (row-major position ``p``) is drawn
from position ``p`` of the counter-based stream keyed by (``seed``, ``name``)
(:mod:`.seeded_random`). A rank computes, for its tensor-parallel block of the parameter, the
full-tensor positions of the block's elements (:func:`~.layout.tp_block` applied to index
grids, so 1-D row and column shards, megatron's strided ``[gate; up]`` shards and Optimus 2-D
blocks, transposed or not, all follow the same geometry as the weights) and draws exactly
those: memory and time follow the local shard, no rank ever holds a full tensor. Hence the
initial model depends only on the seed and the model config, never on tp / pp / dp sizes,
the tensor-parallel mode, the placement or the schedule: two replicas of a stage start
bit-identical without a broadcast, and any layout starts from the same model as a single
process does. Because positions are row-major, the rows of a table do not depend on how many
rows it has: the word-embedding rows of the real vocabulary are the same whatever the vocabulary
padding, and so are the first rows of a position table whatever its length.

Init rules follow megatron-core's conventions, using the config's own init callables
(:func:`init_method_for`): biases 0; norm weights 1 (0 with
``layernorm_zero_centered_gamma``); embeddings ``config.embedding_init_method``; the
attention output projection and second MLP linear (``linear_proj``, ``linear_fc2``)
``config.output_layer_init_method`` (by default N(0, std / sqrt(2 * num_layers))); every other
weight ``config.init_method`` (by default N(0, std)); the learnable softmax offset of
``softmax_type="learnable"`` (``core_attention.softmax_offset``, one value per attention head)
``config.init_method``, as megatron-core's ``DotProductAttention`` draws it (a tensor-parallel
rank holds its heads' values: the parameter is marked split along dim 0,
:func:`~megatron_bitpipe.model.chunks.mark_tensor_parallel_weights`); a mixture-of-experts layer's router like
any other weight, its routed and shared experts' linears like the MLP's. For BERT that covers, as in
megatron-core's BertModel: token-type embeddings (an embedding), the MLM head's dense layer
and norm (``lm_head.dense``, ``lm_head.layer_norm``), the output layer's weight and bias, the
pooler and the binary head (weights ``init_method``, biases 0).

The callables megatron-core and Megatron-LM use are drawn element by element:
``torch.nn.init.zeros_`` / ``ones_``, ``functools.partial(torch.nn.init.normal_, mean=...,
std=...)`` (``init_method_normal``, ``scaled_init_method_normal``) as
``float32(mean + std * z)``, and ``torch.nn.init.xavier_uniform_`` (optionally with ``gain``)
from the full tensor's fans. Any other callable is applied to the full tensor, generated on
the CPU from a torch generator seeded by (``seed``, ``name``), of which the rank keeps its block
— the only case that materialises a full tensor.

Megatron's own initialisation is redundant under this module: build the model with
``perform_initialization=False`` (:func:`~.build.build_pipeline_model` does), so every weight
is generated once.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import unwrap_model

from . import seeded_random
from ..model_partition import ChunkLayers, full_shape, holds_full_tensor, is_tensor_parallel, to_global_name, tp_block

__all__ = ["init_method_for", "initialize_from_seed", "initialize_parameter", "without_megatron_init"]

_OUTPUT_PROJECTIONS = ("linear_proj", "linear_fc2")
#: elements drawn per piece: the piece's scratch arrays (:class:`~.seeded_random.Workspace`,
#: about 40 bytes an element) are allocated once per parameter and stay in the cache
_PIECE = 1 << 16


def init_method_for(name: str, config: TransformerConfig) -> Callable[[torch.Tensor], None]:
    """The in-place init function megatron-core uses for full-model parameter ``name``.

    Raises KeyError for a parameter name these rules do not know.
    """
    module, _, leaf = name.rpartition(".")
    owner = module.rpartition(".")[2]
    if leaf == "bias" or leaf.endswith("_bias"):
        return torch.nn.init.zeros_
    if "norm" in owner or leaf.startswith("layer_norm"):
        return torch.nn.init.zeros_ if config.layernorm_zero_centered_gamma else torch.nn.init.ones_
    if leaf == "softmax_offset":
        return config.init_method
    if leaf != "weight":
        raise KeyError(f"{name}: no initialisation rule")
    if name.startswith("embedding."):
        return config.embedding_init_method
    if owner in _OUTPUT_PROJECTIONS:
        return config.output_layer_init_method
    return config.init_method


@dataclass(frozen=True)
class _Constant:
    value: float


@dataclass(frozen=True)
class _Normal:
    mean: float
    std: float


@dataclass(frozen=True)
class _Uniform:
    low: float
    high: float


_Distribution = Union[_Constant, _Normal, _Uniform]


def _distribution(init: Callable, shape: Tuple[int, ...]) -> Optional[_Distribution]:
    """What ``init`` draws for a full tensor of ``shape``, or None for a callable not known here."""
    func, args, kwargs = init, (), {}
    if isinstance(init, functools.partial):
        func, args, kwargs = init.func, init.args, dict(init.keywords)
    if args:
        return None
    if func is torch.nn.init.zeros_ and not kwargs:
        return _Constant(0.0)
    if func is torch.nn.init.ones_ and not kwargs:
        return _Constant(1.0)
    if func is torch.nn.init.normal_ and set(kwargs) <= {"mean", "std"}:
        return _Normal(float(kwargs.get("mean", 0.0)), float(kwargs.get("std", 1.0)))
    if func is torch.nn.init.xavier_uniform_ and set(kwargs) <= {"gain"} and len(shape) >= 2:
        receptive = math.prod(shape[2:])
        fan_in, fan_out = shape[1] * receptive, shape[0] * receptive
        bound = float(kwargs.get("gain", 1.0)) * math.sqrt(6.0 / (fan_in + fan_out))
        return _Uniform(-bound, bound)
    return None


def _position_grids(param: torch.Tensor, shape: Tuple[int, ...], tp_rank: int, tp_size: int) -> List[Tuple[torch.Tensor, int]]:
    """Per dimension ``d`` of the full tensor (of ``shape``): the ``d``-th index of each of
    ``param``'s elements (``param``'s shape) and the row-major stride of ``d``.

    Each is an index grid cut like the weights (:func:`~.layout.tp_block`): a stride-0 view
    of one ``arange``, so nothing of full size is allocated; a strided block (megatron's
    ``partition_stride`` > 1, Optimus' gated MLP) materialises the local block's int32 indices.
    """
    grids = []
    stride = 1
    for dim in reversed(range(len(shape))):
        grid_shape = [1] * len(shape)
        grid_shape[dim] = shape[dim]
        grid = torch.arange(shape[dim], dtype=torch.int32).view(grid_shape).expand(shape)
        local = tp_block(grid, param, tp_rank, tp_size)
        if local.shape != param.shape:
            raise ValueError(f"block of shape {tuple(local.shape)} for a parameter of shape {tuple(param.shape)}")
        grids.append((local, stride))
        stride *= shape[dim]
    return grids


def _draw(distribution: _Distribution, key: int, positions: np.ndarray, out: np.ndarray, workspace: seeded_random.Workspace) -> np.ndarray:
    """float32 values of ``distribution`` at the stream's ``positions``, into ``out``."""
    if isinstance(distribution, _Normal):
        values = seeded_random.standard_normal(key, positions, out, workspace)
        values *= np.float32(distribution.std)
        values += np.float32(distribution.mean)
        return values
    values = seeded_random.uniform(key, positions, out, workspace)
    values *= np.float32(distribution.high - distribution.low)
    values += np.float32(distribution.low)
    return values


def initialize_parameter(param: torch.Tensor, name: str, init: Callable, seed: int, tp_rank: int = 0, tp_size: int = 1) -> None:
    """Set ``param`` (tensor-parallel block ``tp_rank`` of ``tp_size`` of full-model parameter
    ``name``) to its seed-determined value under ``init``, in place (see the module docstring)."""
    shape = full_shape(param, tp_size)
    distribution = _distribution(init, shape)
    if isinstance(distribution, _Constant):
        param.fill_(distribution.value)
        return
    key = seeded_random.stream_key(seed, name)
    if distribution is None:  # an init callable of the user's: draw the full tensor, keep the block
        full = torch.empty(shape, dtype=torch.float32)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(key & (2**63 - 1))
            init(full)
        param.copy_(tp_block(full, param, tp_rank, tp_size))
        return
    whole = holds_full_tensor(param, tp_size)  # then its positions are 0, 1, 2, ...
    grids = None if whole else _position_grids(param, shape, tp_rank, tp_size)
    row = max(1, param[0].numel())
    rows = max(1, _PIECE // row)
    size = min(rows, param.shape[0]) * row
    workspace = seeded_random.Workspace(size)
    positions, values = torch.empty(size, dtype=torch.int64), np.empty(size, np.float32)
    counting = torch.arange(size, dtype=torch.int64) if whole else None
    for first in range(0, param.shape[0], rows):
        block = param[first : first + rows]
        n = block.numel()
        block_positions = positions[:n].view(block.shape)
        if whole:
            torch.add(counting[:n], first * row, out=positions[:n])
        else:
            for d, (grid, stride) in enumerate(grids):  # the row-major position, in int64
                if d == 0:
                    block_positions.copy_(grid[first : first + rows]).mul_(stride)
                else:
                    block_positions.add_(grid[first : first + rows], alpha=stride)
        drawn = _draw(distribution, key, block_positions.numpy(), values[:n], workspace)
        block.copy_(torch.from_numpy(drawn).view(block.shape))


def initialize_from_seed(
    chunks: Sequence[torch.nn.Module],
    layers: Sequence[ChunkLayers],
    seed: int,
    tp_group: dist.ProcessGroup | None = None,
) -> None:
    """Overwrite every registered parameter of ``chunks`` with its seed-determined value.

    ``layers[i]`` says which part of the full model ``chunks[i]`` holds (e.g. the
    :func:`~megatron_bitpipe.model_partition.chunk_specs`); chunks may be wrapped (DDP,
    Float16Module). Copies are in place, so views held by DDP buffers stay valid; call it
    before the optimizer copies fp32 main weights. Local, no communication: ``tp_group`` only
    gives the tp rank and size. A tied head built by
    :func:`~megatron_bitpipe.model.chunks.build_gpt_chunks` is the embedding's Parameter and
    changes with it. A parameter with ``model_seeds`` (a fused array's, :mod:`megatron_bitpipe.hfta`)
    has a leading model dimension: slice ``k`` gets the value its parameter has in the unfused
    model of seed ``model_seeds[k]``. A routed expert's parameter is named by its global expert
    index (:attr:`~megatron_bitpipe.model_partition.ChunkLayers.experts`), so expert ``k`` starts
    the same on whichever expert-parallel rank holds it.
    """
    if len(chunks) != len(layers):
        raise ValueError(f"{len(chunks)} chunks but {len(layers)} layer ranges")
    tp_rank, tp_size = (tp_group.rank(), tp_group.size()) if tp_group is not None else (0, 1)
    with torch.no_grad():
        for chunk, chunk_layers in zip(chunks, layers):
            model = unwrap_model(chunk)
            for local_name, param in model.named_parameters():
                name = to_global_name(local_name, chunk_layers)
                init = init_method_for(name, model.config)
                # A fused array's parameter (megatron_bitpipe.hfta): slice k is model k's tensor, from its seed.
                for tensor, tensor_seed in _model_slices(param, seed):
                    initialize_parameter(tensor, name, init, tensor_seed, tp_rank, tp_size)


def _model_slices(param: torch.Tensor, seed: int):
    """``[(param, seed)]``, or for a parameter with a leading model dimension (``model_seeds``)
    ``[(param[k], model_seeds[k]) ...]``: views carrying the parameter's tensor-parallel
    attributes with ``partition_dim`` one less (the unfused tensor's), so each is drawn as the
    tensor-parallel block of model ``k``'s full tensor."""
    seeds = getattr(param, "model_seeds", None)
    if seeds is None:
        return [(param, seed)]
    if len(seeds) != param.shape[0]:
        raise ValueError(f"{len(seeds)} model seeds for a parameter of {param.shape[0]} models")
    slices = param.unbind(0)
    if is_tensor_parallel(param):
        for tensor in slices:
            tensor.tensor_model_parallel = True
            tensor.partition_dim = param.partition_dim - 1
            tensor.partition_stride = getattr(param, "partition_stride", 1)
    return list(zip(slices, seeds))


def without_megatron_init(config: TransformerConfig) -> TransformerConfig:
    """A shallow copy of ``config`` with ``perform_initialization=False``: megatron only
    allocates the local weights, :func:`initialize_from_seed` draws each one once."""
    build_config = copy.copy(config)
    build_config.perform_initialization = False
    return build_config
