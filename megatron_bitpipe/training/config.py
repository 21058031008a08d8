"""megatron-core configuration objects from the parsed flags and the run's decisions (any model task).

Each function takes the :class:`~megatron_bitpipe.run_config.RunConfig` alone (the model's
sizes, the schedule, layout, precision, optimizer and its settings, the learning-rate schedule):

* :func:`transformer_config` — the ``TransformerConfig`` of the model (a mixture of experts'
  fields from :attr:`~megatron_bitpipe.run_config.RunConfig.moe`);
* :func:`ddp_config`, :func:`optimizer_config`, :func:`lr_scheduler` — DDP, the optimizer
  (``--optimizer``: megatron's Adam or SGD, or one of :mod:`megatron_bitpipe.optimizers`) and Megatron's
  learning-rate / weight-decay schedule (counted in samples, like Megatron-LM; ``--lr-decay-style
  rex`` too).

Kernel choices: :func:`~megatron_bitpipe.model.kernels.kernel_fields` (without a GPU every
fused kernel is off; with one, the bias-activation and bias-dropout fusions are on and
gradient-accumulation fusion follows Transformer Engine; p2p is never batched). The cross
entropy is megatron-core's unfused, exact one unless
``--cross-entropy-loss-fusion`` (whose 'native' kernel rounds the logits' gradient to bf16);
the unfused one reads megatron's global TP group, which :func:`use_global_tp_group` sets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import TransformerConfig

from .. import megatron_compat
from ..model.kernels import kernel_fields
from ..optimizers import MEGATRON_OPTIMIZERS, ParamScheduler
from ..run_config import RunConfig

__all__ = [
    "transformer_config",
    "mlp_fields",
    "use_global_tp_group",
    "ddp_config",
    "optimizer_config",
    "lr_scheduler",
]


def mlp_fields(swiglu: bool) -> dict:
    """The ``TransformerConfig`` fields of the MLP's activation: ``--swiglu`` gives a gated
    linear unit with SiLU (megatron's ``linear_fc1`` then holds ``[gate; up]``), else GeLU."""
    return dict(gated_linear_unit=swiglu, activation_func=F.silu if swiglu else F.gelu)


def _have_transformer_engine() -> bool:
    from megatron.core.models.gpt import gpt_layer_specs

    return bool(gpt_layer_specs.HAVE_TE)


def transformer_config(run: RunConfig, **overrides) -> TransformerConfig:
    """The model config of the run's decisions (:attr:`RunConfig.model` gives the sizes; it must
    be set); ``overrides`` replace fields (task specifics)."""
    model = run.model
    if model is None:
        raise ValueError("transformer_config needs the run's model (RunConfig.from_args of flags with --num-layers)")
    gpu = torch.cuda.is_available()
    dtype = run.precision.dtype
    # the split defers local layers' W; --attention-backend local/sdpa replace local layers' core attention
    # megatron-core's local MoE layers (experts as a SequentialMLP) too
    local_only = run.schedule.splits_backward or run.kernels.attention_backend != "auto" or run.moe is not None
    te_default = gpu and _have_transformer_engine() and not local_only
    impl = run.kernels.transformer_impl or ("transformer_engine" if te_default else "local")
    recompute = run.recompute
    fields = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn,
        num_attention_heads=model.num_attention_heads,
        kv_channels=model.head_channels,
        num_query_groups=model.query_groups,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        **mlp_fields(model.swiglu),
        add_bias_linear=model.add_bias_linear,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=run.layout.tensor,
        pipeline_model_parallel_size=run.layout.pipeline,
        context_parallel_size=run.layout.context,
        cp_comm_type=run.layout.context_comm if run.layout.context > 1 else None,
        virtual_pipeline_model_parallel_size=run.layout.virtual,
        sequence_parallel=run.layout.sequence_parallel,
        recompute_granularity=recompute.granularity,
        recompute_method=recompute.method,
        recompute_num_layers=recompute.num_layers,
        recompute_modules=None if recompute.modules is None else list(recompute.modules),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=run.precision.bf16,
        fp16=run.precision.fp16,
        transformer_impl=impl,
        cross_entropy_loss_fusion=run.kernels.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=run.kernels.cross_entropy_fusion_impl,
        overlap_p2p_comm=run.overlap_p2p_comm,
        cuda_graph_scope=[],  # the whole layer; megatron's default spelling "full" is deprecated
        **kernel_fields(gpu, transformer_engine=impl == "transformer_engine", bias_activation=model.swiglu or model.add_bias_linear),
    )
    if run.moe is not None:
        fields.update(run.moe.transformer_fields())
    fields.update(overrides)
    config = TransformerConfig(**fields)
    if run.schedule.splits_backward:  # the weight-gradient deferral contract, before the model is built
        megatron_compat.enable_delay_wgrad_compute(config)
    return config


def use_global_tp_group(tp_group) -> None:
    """Make ``tp_group`` (this rank's only TP group, in every layout) megatron's global one,
    which its unfused vocab-parallel cross entropy reads. Everything else gets explicit groups."""
    parallel_state._TENSOR_MODEL_PARALLEL_GROUP = tp_group


def ddp_config(run: RunConfig) -> DistributedDataParallelConfig:
    """Gradients reduced in fp32; overlapped with the plan executor's schedules (BitPipe's eager
    per-chunk sync) or with ``--overlap-grad-reduce``. Reduce-scattered for megatron's
    distributed optimizer (``--use-distributed-optimizer``), except for a fused array
    (``run.hfta``), whose DDP all-reduces while its optimizer shards the state itself
    (:mod:`megatron_bitpipe.hfta.optimizer`). With ``--overlap-param-gather`` the distributed
    optimizer's parameter all-gather is overlapped with the next forward."""
    return DistributedDataParallelConfig(
        overlap_grad_reduce=run.overlap_grad_reduce,
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=run.distributed_optimizer and run.hfta is None,
        overlap_param_gather=run.overlap_param_gather and run.hfta is None,
        delay_wgrad_compute=run.schedule.splits_backward,  # TE's deferred weights: DDP's hook after backward_dw
    )


def optimizer_config(run: RunConfig) -> OptimizerConfig:
    """megatron's optimizer config of the run's optimizer settings (fp32 main weights for
    bf16/fp16; sharded with ``--use-distributed-optimizer``); ``--optimizer`` other than adam
    reads its hyper-parameters from it (``run.optimizer``)."""
    settings = run.optimizer_settings
    return OptimizerConfig(
        optimizer=run.optimizer.name if run.optimizer.name in MEGATRON_OPTIMIZERS else "adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        sgd_momentum=settings.sgd_momentum,
        clip_grad=settings.clip_grad,
        bf16=run.precision.bf16,
        fp16=run.precision.fp16,
        params_dtype=run.precision.dtype,
        loss_scale=settings.loss_scale,
        initial_loss_scale=settings.initial_loss_scale,
        use_distributed_optimizer=run.distributed_optimizer,
    )


def lr_scheduler(run: RunConfig, optimizer) -> ParamScheduler:
    """Megatron-LM's scheduler over samples: warm-up and decay lengths are iterations x
    ``--global-batch-size``; step it by the global batch size after each successful update.
    megatron's class with ``rex`` added (:class:`~megatron_bitpipe.optimizers.ParamScheduler`).
    With ``--optimizer schedulefree_adamw`` the optimizer warms up itself, so the scheduler
    has no warm-up (its decay style is ``constant``)."""
    samples = run.batches.global_batch_size
    schedule, settings = run.lr_schedule, run.optimizer_settings
    warmup = 0 if run.optimizer.name == "schedulefree_adamw" else schedule.warmup_iters
    return ParamScheduler(
        optimizer,
        rex_beta=schedule.rex_beta,
        init_lr=schedule.warmup_init,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=warmup * samples,
        lr_decay_steps=schedule.decay_iters * samples,
        lr_decay_style=schedule.decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=schedule.train_iters * samples,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=schedule.use_checkpoint,
        override_opt_param_scheduler=schedule.override,
    )
