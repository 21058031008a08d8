"""megatron-core configuration objects from the parsed flags (any model task).

* :func:`transformer_config` — the ``TransformerConfig`` of the model;
* :func:`placement_for` — which pipeline placement the chosen schedule runs;
* :func:`ddp_config`, :func:`optimizer_config`, :func:`optimizer_choice`,
  :func:`lr_scheduler` — DDP, the optimizer (``--optimizer``: megatron's Adam or SGD, or one
  of :mod:`megatron_bitpipe.optimizers`) and Megatron's learning-rate / weight-decay schedule
  (counted in samples, like Megatron-LM; ``--lr-decay-style rex`` too).

Kernel choices: without a GPU every fused kernel is off (they are CUDA-only); with one, the
bias-activation and bias-dropout fusions are on and gradient-accumulation fusion follows
Transformer Engine's presence. The cross entropy is megatron-core's unfused, exact one unless
``--cross-entropy-loss-fusion`` (whose 'native' kernel rounds the logits' gradient to bf16);
the unfused one reads megatron's global TP group, which :func:`use_global_tp_group` sets.
``batch_p2p_comm`` is off: batched p2p mixes up the two directions between the same pair of
ranks (pipeline size 2 with the interleaved schedule).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import TransformerConfig

from ..megatron_args import schedule_choice
from ..optimizers import MEGATRON_OPTIMIZERS, OptimizerChoice, ParamScheduler
from ..schedules.placement import Placement
from .decentralized.args import DECENTRALIZED_MODES

__all__ = [
    "transformer_config",
    "use_global_tp_group",
    "placement_for",
    "ddp_config",
    "optimizer_config",
    "optimizer_choice",
    "lr_scheduler",
    "params_dtype",
]


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def _have_transformer_engine() -> bool:
    from megatron.core.models.gpt import gpt_layer_specs

    return bool(gpt_layer_specs.HAVE_TE)


def transformer_config(args: argparse.Namespace, **overrides) -> TransformerConfig:
    """The model config from the flags; ``overrides`` replace fields (task specifics)."""
    gpu = torch.cuda.is_available()
    dtype = params_dtype(args)
    # the split defers local layers' W; --attention-backend local/sdpa replace local layers' core attention
    local_only = args.split_backward or getattr(args, "attention_backend", "auto") != "auto"
    te_default = gpu and _have_transformer_engine() and not local_only
    impl = args.transformer_impl or ("transformer_engine" if te_default else "local")
    vp = args.virtual_pipeline_model_parallel_size if args.schedule == "interleaved" else None
    fields = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vp,
        sequence_parallel=args.sequence_parallel,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        recompute_modules=args.recompute_modules,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        transformer_impl=impl,
        use_cpu_initialization=True,  # local weights only: runtime.init draws each rank's shards
        gradient_accumulation_fusion=gpu and impl == "transformer_engine",
        bias_activation_fusion=gpu and (args.swiglu or args.add_bias_linear),
        bias_dropout_fusion=gpu,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=args.cross_entropy_fusion_impl,
        overlap_p2p_comm=args.overlap_p2p_comm and args.schedule in ("bitpipe", "interleaved"),
        batch_p2p_comm=False,
        deallocate_pipeline_outputs=gpu,
        cuda_graph_scope=[],  # the whole layer; megatron's default spelling "full" is deprecated
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def use_global_tp_group(tp_group) -> None:
    """Make ``tp_group`` (this rank's only TP group, in every layout) megatron's global one,
    which its unfused vocab-parallel cross entropy reads. Everything else gets explicit groups."""
    parallel_state._TENSOR_MODEL_PARALLEL_GROUP = tp_group


def placement_for(args: argparse.Namespace) -> Placement:
    """The selected schedule's placement: BitPipe's bidirectional V, or megatron's looped
    placement (``v`` chunks per rank)."""
    return schedule_choice(args).placement(args.pipeline_model_parallel_size)


def ddp_config(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """Gradients reduced in fp32; overlapped with BitPipe (its eager per-chunk sync) or with
    ``--overlap-grad-reduce``."""
    return DistributedDataParallelConfig(
        overlap_grad_reduce=args.schedule == "bitpipe" or args.overlap_grad_reduce,
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    """megatron's optimizer config from Megatron's flags (fp32 main weights for bf16/fp16;
    sharded with ``--use-distributed-optimizer``); ``--optimizer`` other than adam reads its
    hyper-parameters from it (:func:`optimizer_choice`)."""
    return OptimizerConfig(
        optimizer=args.optimizer if args.optimizer in MEGATRON_OPTIMIZERS else "adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype(args),
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )


def optimizer_choice(args: argparse.Namespace) -> OptimizerChoice:
    """``--optimizer`` and the flags of :mod:`megatron_bitpipe.optimizers` (decentralized
    with ``--data-parallel-mode decentlam | dmsgd | lsgd``)."""
    return dataclasses.replace(OptimizerChoice.from_args(args), decentralized=args.data_parallel_mode in DECENTRALIZED_MODES)


def lr_scheduler(args: argparse.Namespace, optimizer) -> ParamScheduler:
    """Megatron-LM's scheduler over samples: warm-up and decay lengths are iterations x
    ``--global-batch-size``; step it by the global batch size after each successful update.
    megatron's class with ``rex`` added (:class:`~megatron_bitpipe.optimizers.ParamScheduler`).
    With ``--optimizer schedulefree_adamw`` the optimizer warms up itself, so the scheduler
    has no warm-up (its decay style is ``constant``)."""
    samples = args.global_batch_size
    warmup = 0 if args.optimizer == "schedulefree_adamw" else args.lr_warmup_iters
    return ParamScheduler(
        optimizer,
        rex_beta=args.rex_beta,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup * samples,
        lr_decay_steps=args.lr_decay_iters * samples,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * samples,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )
