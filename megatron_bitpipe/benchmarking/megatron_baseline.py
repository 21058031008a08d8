"""megatron-core's stock GPTModel on megatron's looped placement, wired as Megatron-LM wires it.

The baseline of the benchmarks (megatron's own 1F1B and interleaved schedules) and the
reference of the equivalence tests: nothing here goes through this package's chunk builder,
initialisation or executor, so a test comparing the two compares independent code. Plain
megatron-core usage with no CPU-specific code (models move to the current CUDA device when
there is one); on a CPU-only torch call :func:`megatron_bitpipe.cpu.enable_cpu_megatron` first.

* :func:`build_looped_process_groups` — for a :class:`~megatron_bitpipe.execution.groups.ParallelGrid`,
  a ``ProcessGroupCollection`` holding every group that megatron-core's GPTModel, DDP,
  optimizer, ``finalize_model_grads`` and megatron's looped pipeline schedules read, built
  with ``torch.distributed.new_group`` and no ``initialize_model_parallel``.
* :func:`tiny_gpt_config` — an fp32 ``TransformerConfig`` without fused kernels.
* :func:`build_looped_chunks` / :func:`build_megatron_gpt_model` — stock GPTModel chunks of
  the looped placement (chunk ``v`` of pipeline rank ``r`` is stage ``v * pp + r``) with
  megatron's own initialisation, local layer spec.
* :func:`wrap_looped_ddp`, :func:`build_baseline_optimizer` — megatron DDP (bucketing on the
  first chunk only, as Megatron-LM) and megatron's optimizer over the chunks.
* :func:`synthetic_microbatches`, :func:`mean_loss_forward_step` — deterministic
  ``(tokens, labels)`` data and a ``forward_step_func`` returning the mean token loss (the
  training scripts' :func:`megatron_bitpipe.training.gpt.gpt_forward_step` takes dict samples
  and returns Megatron-LM's sum and token count instead);
  :func:`context_parallel_forward_step` — the same data under context parallelism: each rank
  runs its part of every sequence and reports the mean over the whole sequence.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from ..execution.groups import ParallelGrid, new_groups, process_group_collection
from ..model.kernels import kernel_fields

__all__ = [
    "build_looped_process_groups",
    "tiny_gpt_config",
    "build_megatron_gpt_model",
    "build_looped_chunks",
    "wrap_looped_ddp",
    "build_baseline_optimizer",
    "synthetic_microbatches",
    "mean_loss_forward_step",
]


def build_looped_process_groups(grid: ParallelGrid) -> ProcessGroupCollection:
    """Build this rank's groups for ``grid``; a collective call on the default group.

    The collection holds ``tp, pp, dp, dp_cp, mp, embd, pos_embd, cp, tp_cp, ep, expt_tp,
    tp_ep, expt_dp, tp_ep_pp, intra_dist_opt``, i.e. what GPTModel, DDP, the megatron optimizer,
    ``finalize_model_grads`` and the pipeline schedules read. Context, expert and expert-tensor
    parallel sizes are 1. ``embd`` (first and last pipeline stage) and ``pos_embd`` (first
    stage) are None on ranks outside them: megatron tests membership with ``get_pg_size``,
    which treats None as a group of one. ``embd`` is None too when ``pp == 1``.
    """
    if dist.get_world_size() != grid.world_size:
        raise ValueError(f"{grid} needs {grid.world_size} ranks, the job has {dist.get_world_size()}")
    rank = dist.get_rank()
    pp_lists = grid.pp_groups()
    embd_lists = [sorted({ranks[0], ranks[-1]}) for ranks in pp_lists] if grid.pp > 1 else []
    return process_group_collection(
        tp=new_groups(grid.tp_groups(), rank),
        dp=new_groups(grid.dp_groups(), rank),
        pp=new_groups(pp_lists, rank),
        mp=new_groups(grid.mp_groups(), rank),
        solo=new_groups([[r] for r in range(grid.world_size)], rank),
        world=new_groups([list(range(grid.world_size))], rank),
        embd=new_groups(embd_lists, rank),
        pos_embd=new_groups([[ranks[0]] for ranks in pp_lists], rank),
    )


def tiny_gpt_config(
    *,
    num_layers: int = 4,
    hidden_size: int = 32,
    num_attention_heads: int = 4,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    **overrides,
) -> TransformerConfig:
    """An fp32 GPT ``TransformerConfig`` that runs anywhere megatron-core runs.

    Choices (each avoids a CUDA-only path or a source of run-to-run differences): the kernels
    of a run without a GPU (:func:`~megatron_bitpipe.model.kernels.kernel_fields`: no
    fusions, weights created on the CPU, unbatched p2p, outputs kept after their send);
    dropout 0 (deterministic comparisons); ``cross_entropy_loss_fusion=True,
    cross_entropy_fusion_impl='native'`` (the unfused cross entropy reads the *global* TP
    group, the fused one takes the model's group). ``overrides`` replace any field.
    """
    fields = dict(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        ffn_hidden_size=4 * hidden_size,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        cross_entropy_loss_fusion=True,
        cross_entropy_fusion_impl="native",
        **kernel_fields(gpu=False),
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_megatron_gpt_model(
    config: TransformerConfig,
    pg_collection: ProcessGroupCollection,
    *,
    vocab_size: int,
    max_sequence_length: int,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    share_embeddings_and_output_weights: bool = False,
    position_embedding_type: str = "learned_absolute",
    layer_spec: Optional[ModuleSpec] = None,
) -> GPTModel:
    """One GPTModel chunk on ``layer_spec`` (default: megatron-core's local layer spec).

    Which layers it holds is megatron's looped placement for (``pg_collection.pp`` rank,
    ``vp_stage``). ``vocab_size`` must be divisible by the tp size (no padding is added).
    With tied embeddings and more than one stage, construction all-reduces the head weight
    over ``pg_collection.embd``, so the first and last stage must build together.
    Weights are initialised on the CPU (``use_cpu_initialization``) and moved to the current
    CUDA device if there is one.
    """
    if vocab_size % pg_collection.tp.size():
        raise ValueError(f"vocab_size {vocab_size} is not divisible by tp size {pg_collection.tp.size()}")
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec or get_gpt_layer_local_spec(),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=position_embedding_type,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def build_looped_chunks(
    config: TransformerConfig, pg_collection: ProcessGroupCollection, **kwargs
) -> List[GPTModel]:
    """This pipeline rank's chunks of the looped placement, in virtual-stage order.

    Chunk ``v`` is pipeline stage ``v * pp + pp_rank``; it has the embedding iff it is stage 0
    and the final norm, output layer and loss iff it is the last stage. ``kwargs`` go to
    :func:`build_megatron_gpt_model`.
    """
    pp_size, pp_rank = pg_collection.pp.size(), pg_collection.pp.rank()
    vp_size = config.virtual_pipeline_model_parallel_size or 1
    if config.pipeline_model_parallel_size != pp_size:
        raise ValueError(f"config has pipeline size {config.pipeline_model_parallel_size}, group {pp_size}")
    chunks = []
    for v in range(vp_size):
        chunks.append(
            build_megatron_gpt_model(
                config,
                pg_collection,
                pre_process=(v == 0 and pp_rank == 0),
                post_process=(v == vp_size - 1 and pp_rank == pp_size - 1),
                vp_stage=v if config.virtual_pipeline_model_parallel_size is not None else None,
                **kwargs,
            )
        )
    return chunks


def wrap_looped_ddp(
    chunks: Sequence[torch.nn.Module],
    config: TransformerConfig,
    pg_collection: ProcessGroupCollection,
    ddp_config: Optional[DistributedDataParallelConfig] = None,
) -> List[DistributedDataParallel]:
    """Wrap each chunk in megatron DDP (fp32 grad buffers, synchronous reduce by default).

    Like Megatron-LM, only the first chunk uses bucketing. Installs megatron's
    ``finalize_model_grads`` as ``config.finalize_model_grads_func`` (the schedules call it to
    finish the DP reduce and all-reduce tied embedding grads) and, with
    ``overlap_grad_reduce``, the chunks' ``no_sync`` contexts as ``config.no_sync_func``.
    """
    ddp_config = ddp_config or DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    wrapped = [
        DistributedDataParallel(
            config, ddp_config, chunk, disable_bucketing=(i > 0), pg_collection=pg_collection
        )
        for i, chunk in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    if ddp_config.overlap_grad_reduce:
        no_sync = [m.no_sync for m in wrapped]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    return wrapped


def build_baseline_optimizer(
    ddp_chunks: Sequence[DistributedDataParallel],
    pg_collection: ProcessGroupCollection,
    **optimizer_config,
):
    """megatron's optimizer over ``ddp_chunks`` (Adam, fp32, no clipping unless asked).

    ``optimizer_config`` are ``OptimizerConfig`` fields (``lr``, ``weight_decay``,
    ``clip_grad``...). Weight decay skips biases and norms, as in megatron.
    """
    fields = dict(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=0.0, bf16=False, fp16=False)
    fields.update(optimizer_config)
    return get_megatron_optimizer(
        OptimizerConfig(**fields),
        list(ddp_chunks),
        use_gloo_process_groups=False,
        pg_collection=pg_collection,
    )


def synthetic_microbatches(
    seed: int, num_microbatches: int, micro_batch_size: int, seq_length: int, vocab_size: int
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic ``(tokens, labels)`` micro-batches, each ``[micro_batch_size, seq_length]``.

    The same arguments give the same tensors on every rank and every run; labels are the tokens
    shifted by one (next-token prediction).
    """
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length + 1), generator=generator)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches


def _mean_loss(per_token_loss: torch.Tensor):
    loss = per_token_loss.float().mean()
    return loss, {"lm loss": loss.detach().clone()}


def mean_loss_forward_step(data_iterator: Iterator, model: torch.nn.Module):
    """``forward_step_func`` for megatron's schedules on :func:`synthetic_microbatches` data.

    Every chunk takes the next micro-batch from its own iterator (so each chunk's iterator must
    yield the micro-batches in schedule order: all chunks get the same list). Intermediate
    stages ignore the tokens, non-last stages the labels. The loss of a micro-batch is the mean
    per-token cross entropy; megatron's schedule divides it by the number of micro-batches.
    """
    tokens, labels = next(data_iterator)
    if torch.cuda.is_available():
        tokens, labels = tokens.cuda(), labels.cuda()
    position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    output = model(tokens, position_ids, None, labels=labels)
    return output, _mean_loss


def context_parallel_forward_step(cp_group: dist.ProcessGroup):
    """A ``forward_step_func`` like :func:`mean_loss_forward_step` for a model whose sequences
    are split over ``cp_group`` (:mod:`megatron_bitpipe.model.context_parallel`).

    Each rank runs its part of the micro-batch (tokens, labels and position ids cut to its
    positions, :func:`~megatron_bitpipe.model.context_parallel.context_parallel_batch`). The
    loss function returns megatron's three values — the sum of this rank's token losses and
    their count, which megatron's schedule divides by, and the report — so each rank's loss is
    its own mean and DDP's average over data x context parallel makes the gradient that of the
    whole sequence's mean (equal counts per rank: the split is even). The report ``lm loss`` is
    the whole sequence's mean token loss, the same on every rank of ``cp_group`` (one
    all-reduce of the detached sum and count).
    """
    from ..model.context_parallel import context_parallel_batch

    def loss_func(per_token_loss: torch.Tensor):
        loss = per_token_loss.float().sum()
        count = torch.tensor(per_token_loss.numel(), dtype=torch.int, device=loss.device)
        total = torch.stack((loss.detach(), count.float()))
        dist.all_reduce(total, group=cp_group)
        return loss, count, {"lm loss": total[0] / total[1]}

    def forward_step(data_iterator: Iterator, model: torch.nn.Module):
        tokens, labels = next(data_iterator)
        if torch.cuda.is_available():
            tokens, labels = tokens.cuda(), labels.cuda()
        position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        part = context_parallel_batch(dict(tokens=tokens, labels=labels, position_ids=position_ids), cp_group)
        output = model(part["tokens"], part["position_ids"], None, labels=part["labels"])
        return output, loss_func

    return forward_step
