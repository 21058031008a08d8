"""Layout-independent initial weights: a function of the seed and the parameter's full name.

Every parameter is re-initialised from its own generator, seeded by (``seed``, full-model
parameter name): the *full* (tensor-parallel unsplit) tensor is generated on the CPU in fp32
and this rank's tensor-parallel block is copied in. Hence the initial model depends only on
the seed and the model config, never on tp / pp / dp sizes, the tensor-parallel mode (1-D
or Optimus 2-D blocks, :func:`~.layout.tp_block`), the placement or the schedule:
two replicas of a stage start bit-identical without a broadcast, and any layout starts from
the same model as a single process does.

Init rules follow megatron-core's conventions, using the config's own init callables
(:func:`init_method_for`): biases 0; norm weights 1 (0 with
``layernorm_zero_centered_gamma``); embeddings ``config.embedding_init_method``; the
attention output projection and second MLP linear (``linear_proj``, ``linear_fc2``)
``config.output_layer_init_method`` (by default N(0, std / sqrt(2 * num_layers))); every other
weight ``config.init_method`` (by default N(0, std)). For BERT that covers, as in
megatron-core's BertModel: token-type embeddings (an embedding), the MLM head's dense layer
and norm (``lm_head.dense``, ``lm_head.layer_norm``), the output layer's weight and bias, the
pooler and the binary head (weights ``init_method``, biases 0).
"""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from megatron.core.transformer import TransformerConfig

from .layout import ChunkLayers, full_shape, to_global_name, tp_block
from megatron.core.utils import unwrap_model

__all__ = ["init_method_for", "initialize_from_seed"]

_OUTPUT_PROJECTIONS = ("linear_proj", "linear_fc2")


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
    if leaf != "weight":
        raise KeyError(f"{name}: no initialisation rule")
    if name.startswith("embedding."):
        return config.embedding_init_method
    if owner in _OUTPUT_PROJECTIONS:
        return config.output_layer_init_method
    return config.init_method


def _seed_of(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _full_value(name: str, param: torch.Tensor, config: TransformerConfig, seed: int, tp_size: int) -> torch.Tensor:
    full = torch.empty(full_shape(param, tp_size), dtype=torch.float32)
    init = init_method_for(name, config)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(_seed_of(seed, name))
        init(full)
    return full


def initialize_from_seed(
    chunks: Sequence[torch.nn.Module],
    layers: Sequence[ChunkLayers],
    seed: int,
    tp_group: dist.ProcessGroup | None = None,
) -> None:
    """Overwrite every registered parameter of ``chunks`` with its seed-determined value.

    ``layers[i]`` says which part of the full model ``chunks[i]`` holds (e.g. the
    :func:`~megatron_bitpipe.runtime.layout.chunk_specs`); chunks may be wrapped (DDP,
    Float16Module). Copies are in place, so views held by DDP buffers stay valid; call it
    before the optimizer copies fp32 main weights. Local, no communication: ``tp_group`` only
    gives the tp rank and size. A tied head built by
    :func:`~megatron_bitpipe.runtime.model.build_gpt_chunks` is the embedding's Parameter and
    changes with it. Expert-parallel parameters are not supported (NotImplementedError).
    """
    if len(chunks) != len(layers):
        raise ValueError(f"{len(chunks)} chunks but {len(layers)} layer ranges")
    tp_rank, tp_size = (tp_group.rank(), tp_group.size()) if tp_group is not None else (0, 1)
    with torch.no_grad():
        for chunk, chunk_layers in zip(chunks, layers):
            model = unwrap_model(chunk)
            for local_name, param in model.named_parameters():
                if not getattr(param, "allreduce", True):
                    raise NotImplementedError(f"{local_name}: expert-parallel parameters are not supported")
                name = to_global_name(local_name, chunk_layers)
                full = _full_value(name, param, model.config, seed, tp_size)
                param.copy_(tp_block(full, param, tp_rank, tp_size))
