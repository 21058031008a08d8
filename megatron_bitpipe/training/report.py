"""What the logs report besides the losses: parameters, memory and model FLOPs.

* **Parameters** per rank: the elements of every parameter of this rank's chunks (BitPipe's
  ranks hold chunks of both weight replicas; a tied embedding held twice on one rank counts
  once), as Megatron-LM's start-up line counts them.
* **Memory** of a rank (:func:`peak_memory_mib`), in MiB: with a GPU the maximum memory
  allocated by torch on it (since the last :func:`reset_peak_memory`, i.e. per iteration), on
  the CPU the peak resident set size of the process (since it started).
* **Model FLOPs** (:func:`model_flops_per_sample`): the multiply-adds of the matrix products
  of the transformer layers and of the output layer, 2 FLOPs each, forward plus backward (3x
  the forward), per sequence of ``--seq-length`` tokens. Attention scores count half with a
  causal mask (GPT), in full otherwise (BERT). Recomputation, BitPipe's second weight replica
  and the small heads (BERT's pooler and binary head) are not counted: it is the model's work,
  so TFLOP/s per device = model FLOPs of the global batch / (seconds x world size x 10^12)
  compares layouts and schedules. An HFTA array of B models does B models' work
  (:func:`model_flops_per_iteration`).
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist

from ..run_config import RunConfig
from ..schedules.model_shape import ModelShape

__all__ = [
    "RankReport",
    "gather_rank_reports",
    "job_peak_memory_mib",
    "memory_kind",
    "model_flops_per_iteration",
    "model_flops_per_sample",
    "parameter_count",
    "peak_memory_mib",
    "reset_peak_memory",
]

MIB = 1024.0 * 1024.0


def model_flops_per_sample(model: ModelShape, padded_vocab_size: int, causal: bool) -> float:
    """Model FLOPs (forward and backward) of one sequence of ``model`` with logits over
    ``padded_vocab_size`` entries; see the module docstring."""
    hidden, seq = model.hidden_size, model.seq_length
    query = model.head_channels * model.num_attention_heads  # width of all query heads
    key_value = model.head_channels * model.query_groups  # width of the keys (and of the values)
    # per token: multiply-adds of one layer
    projections = hidden * (query + 2 * key_value) + query * hidden  # QKV in, attention out
    scores = 2 * query * seq * (0.5 if causal else 1.0)  # Q K^T and softmax(.) V over the attended keys
    mlp = hidden * model.ffn * (3 if model.swiglu else 2)  # SwiGLU has a gate matrix
    per_token = model.num_layers * (projections + scores + mlp) + hidden * padded_vocab_size
    forward_and_backward = 3 * 2  # the backward is twice the forward; 2 FLOPs per multiply-add
    return forward_and_backward * per_token * seq


def model_flops_per_iteration(run: RunConfig, causal: bool, models: int = 1) -> float:
    """Model FLOPs of one iteration: ``run``'s global batch of sequences through each of
    ``models`` models (an HFTA array's B, every model on every sequence; 1 otherwise)."""
    return models * run.batches.global_batch_size * model_flops_per_sample(run.model, run.padded_vocab_size, causal)


def parameter_count(chunks) -> int:
    """Elements of the distinct parameters of ``chunks`` (this rank's model chunks)."""
    seen = {}
    for chunk in chunks:
        for parameter in chunk.parameters():
            seen[id(parameter)] = parameter.numel()
    return sum(seen.values())


def memory_kind(device: torch.device) -> str:
    """What :func:`peak_memory_mib` measures on ``device``, for the logs."""
    return "max allocated on the GPU" if device.type == "cuda" else "peak resident set size of the process"


def reset_peak_memory(device: torch.device) -> None:
    """Start a new GPU peak (per iteration); the CPU's peak resident set size cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> float:
    """This rank's memory in MiB (see the module docstring)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MIB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / MIB if sys.platform == "darwin" else peak / 1024.0


def job_peak_memory_mib(device: torch.device) -> float:
    """The largest :func:`peak_memory_mib` of the job's ranks (a collective)."""
    value = torch.tensor([peak_memory_mib(device)], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


@dataclass(frozen=True)
class RankReport:
    """One rank's line of the start-up report; ``layers`` counts the transformer layers of the
    rank's chunks (both weight replicas' on BitPipe's and Chimera's ranks)."""

    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    parameters: int
    memory_mib: float
    layers: int = 0


def gather_rank_reports(model, device: torch.device) -> List[RankReport]:
    """Every rank's :class:`RankReport`, by rank (a collective; all ranks get the list)."""
    groups = model.groups
    mine = torch.tensor(
        [
            groups.rank, groups.tp_rank, groups.pp_rank, groups.dp_rank, parameter_count(model.chunks),
            peak_memory_mib(device), sum(spec.num_layers for spec in model.specs),
        ],  # fmt: skip
        dtype=torch.float64,
        device=device,
    )
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [
        RankReport(int(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4]), float(r[5]), int(r[6]))
        for r in (t.tolist() for t in everyone)
    ]
