"""A Megatron-Bridge ``ConfigContainer`` read as Megatron-LM's namespace, so the rules of the
Megatron-LM route apply to it unchanged.

The rules of a plan-executed schedule are written once, over Megatron-LM's flag names
(:func:`~megatron_bitpipe.megatron_lm.args.validate_megatron_lm_args`, and the decisions of
:meth:`~megatron_bitpipe.run_config.RunConfig.from_args`). Bridge keeps the same settings in its
container's sections: most of ``cfg.model`` (a ``TransformerConfig``) under Megatron-LM's own
names, the rest in ``cfg.train``, ``cfg.ddp``, ``cfg.dist``, ``cfg.checkpoint``, ...
:data:`FIELDS` is the one table between the two: each row names Megatron-LM's namespace
attribute, its flag and the Bridge field it is read from. :func:`megatron_lm_namespace` builds
the namespace from it, and :func:`bridge_problems` runs the Megatron-LM route's checks on it and
writes each problem with the Bridge fields in place of the flags (``model.pipeline_schedule
bitpipe`` for ``--pipeline-schedule bitpipe``), one line each.

Invariant: every flag a message may name for a field of the table is translated; a row's
attribute is read nowhere else on this route. Pure Python, no communication.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from ..megatron_lm.args import VIRTUAL_SIZE_FLAG, add_megatron_lm_args, context_parallel_problems, validate_megatron_lm_args
from ..megatron_args import BitPipeConfigError, resolved_schedule
from ..schedules import ScheduleChoice

__all__ = ["FIELDS", "Field", "bridge_problems", "checked_namespace", "in_bridge_terms", "megatron_lm_namespace"]


@dataclass(frozen=True)
class Field:
    """One Megatron-LM namespace attribute (``dest``, set by ``flag``) and the Bridge field it is
    read from (``path``, dotted from the container; ``read`` when it is not read as it is)."""

    dest: str
    flag: str
    path: str
    read: Optional[Callable[[Any], Any]] = None

    def value(self, cfg) -> Any:
        if self.read is not None:
            return self.read(cfg)
        section, _, name = self.path.partition(".")
        return getattr(getattr(cfg, section), name, None)


def _model(name: str, dest: Optional[str] = None, flag: Optional[str] = None) -> Field:
    dest = dest or name
    return Field(dest, flag or "--" + dest.replace("_", "-"), "model." + name)


def _precision(cfg, name: str) -> bool:
    """``bf16`` / ``fp16`` of the model once Bridge's ``mixed_precision`` recipe is applied
    (``pretrain`` applies it after this check runs)."""
    mixed = cfg.mixed_precision
    if isinstance(mixed, str):
        from megatron.bridge.training.mixed_precision import get_mixed_precision_config

        mixed = get_mixed_precision_config(mixed)
    value = getattr(mixed, name, None) if mixed is not None else None
    return bool(getattr(cfg.model, name) if value is None else value)


def _data_parallel_size(cfg) -> int:
    """``cfg.data_parallel_size`` as ``pretrain`` sets it, from the launch's ``WORLD_SIZE``."""
    return cfg.get_data_parallel_size(int(os.environ.get("WORLD_SIZE", "1")))


def _distributed_optimizer(cfg) -> bool:
    return bool(cfg.ddp.use_distributed_optimizer or cfg.optimizer.use_distributed_optimizer)


def _overlap_param_gather(cfg) -> bool:
    return bool(cfg.ddp.overlap_param_gather or cfg.optimizer.overlap_param_gather)


FIELDS = (
    _model("pipeline_schedule"),
    _model("split_backward"),
    _model("schedule_costs"),
    _model("tensor_model_parallel_size"),
    _model("pipeline_model_parallel_size"),
    _model("virtual_pipeline_model_parallel_size", flag=VIRTUAL_SIZE_FLAG),
    _model("context_parallel_size"),
    _model("expert_model_parallel_size"),
    _model("expert_tensor_parallel_size"),
    _model("sequence_parallel"),
    _model("num_layers"),
    _model("hidden_size"),
    _model("ffn_hidden_size"),
    _model("num_attention_heads"),
    _model("seq_length"),
    _model("make_vocab_size_divisible_by"),
    _model("recompute_granularity"),
    _model("recompute_method"),
    _model("recompute_num_layers"),
    _model("recompute_modules"),
    _model("num_layers_in_first_pipeline_stage", "decoder_first_pipeline_num_layers"),
    _model("num_layers_in_last_pipeline_stage", "decoder_last_pipeline_num_layers"),
    _model("account_for_embedding_in_pipeline_split"),
    _model("account_for_loss_in_pipeline_split"),
    _model("pipeline_model_parallel_layout"),
    _model("mtp_num_layers"),
    _model("num_moe_experts", "num_experts"),
    _model("moe_router_topk"),
    _model("moe_router_load_balancing_type"),
    _model("moe_token_dispatcher_type"),
    _model("moe_router_enable_expert_bias"),
    _model("moe_grouped_gemm"),
    _model("moe_aux_loss_coeff"),
    _model("moe_z_loss_coeff"),
    _model("moe_expert_capacity_factor"),
    _model("moe_ffn_hidden_size"),
    _model("moe_shared_expert_intermediate_size"),
    _model("moe_layer_freq"),
    _model("overlap_moe_expert_parallel_comm"),
    _model("delay_wgrad_compute"),
    _model("defer_embedding_wgrad_compute"),
    _model("init_model_with_meta_device"),
    _model("calculate_per_token_loss"),
    _model("add_bias_linear"),
    Field("disable_bias_linear", "--disable-bias-linear", "model.add_bias_linear", lambda cfg: not cfg.model.add_bias_linear),
    Field(
        "untie_embeddings_and_output_weights",
        "--untie-embeddings-and-output-weights",
        "model.share_embeddings_and_output_weights",
        lambda cfg: not cfg.model.share_embeddings_and_output_weights,
    ),
    Field("bf16", "--bf16", "mixed_precision", lambda cfg: _precision(cfg, "bf16")),
    Field("fp16", "--fp16", "mixed_precision", lambda cfg: _precision(cfg, "fp16")),
    Field("micro_batch_size", "--micro-batch-size", "train.micro_batch_size"),
    Field("global_batch_size", "--global-batch-size", "train.global_batch_size"),
    Field("rampup_batch_size", "--rampup-batch-size", "train.rampup_batch_size"),
    Field("data_parallel_size", "--data-parallel-size", "data_parallel_size", _data_parallel_size),
    Field("world_size", "--world-size", "WORLD_SIZE", lambda cfg: int(os.environ.get("WORLD_SIZE", "1"))),
    Field("use_distributed_optimizer", "--use-distributed-optimizer", "ddp.use_distributed_optimizer", _distributed_optimizer),
    Field("overlap_param_gather", "--overlap-param-gather", "ddp.overlap_param_gather", _overlap_param_gather),
    Field("num_distributed_optimizer_instances", "--num-distributed-optimizer-instances", "ddp.num_distributed_optimizer_instances"),
    Field("accumulate_allreduce_grads_in_fp32", "--accumulate-allreduce-grads-in-fp32", "ddp.grad_reduce_in_fp32"),
    Field("check_for_nan_in_loss_and_grad", "--check-for-nan-in-loss-and-grad", "ddp.check_for_nan_in_grad"),
    Field("check_for_large_grads", "--check-for-large-grads", "ddp.check_for_large_grads"),
    Field("ddp_average_in_collective", "--ddp-average-in-collective", "ddp.average_in_collective"),
    Field("use_megatron_fsdp", "--use-megatron-fsdp", "dist.use_megatron_fsdp", lambda cfg: cfg.dist.use_megatron_fsdp or cfg.ddp.use_megatron_fsdp),
    Field("use_torch_fsdp2", "--use-torch-fsdp2", "dist.use_torch_fsdp2"),
    Field("use_tp_pp_dp_mapping", "--use-tp-pp-dp-mapping", "dist.use_tp_pp_dp_mapping"),
    Field("distributed_backend", "--distributed-backend", "dist.distributed_backend"),
    Field("optimizer", "--optimizer", "optimizer.optimizer"),
    Field("lr", "--lr", "optimizer.lr"),
    Field("min_lr", "--min-lr", "optimizer.min_lr"),
    Field("sgd_momentum", "--sgd-momentum", "optimizer.sgd_momentum"),
    Field("lr_decay_style", "--lr-decay-style", "scheduler.lr_decay_style"),
    Field("lr_warmup_iters", "--lr-warmup-iters", "scheduler.lr_warmup_iters"),
    Field("lr_warmup_init", "--lr-warmup-init", "scheduler.lr_warmup_init"),
    Field("save", "--save", "checkpoint.save"),
    Field("save_interval", "--save-interval", "checkpoint.save_interval"),
    Field("load", "--load", "checkpoint.load"),
    Field("pretrained_checkpoint", "--pretrained-checkpoint", "checkpoint.pretrained_checkpoint"),
    Field("ckpt_format", "--ckpt-format", "checkpoint.ckpt_format"),
    Field("finetune", "--finetune", "checkpoint.finetune"),
    Field("no_load_optim", "--no-load-optim", "checkpoint.load_optim", lambda cfg: not cfg.checkpoint.load_optim),
    Field("dist_ckpt_optim_fully_reshardable", "--dist-ckpt-optim-fully-reshardable", "checkpoint.dist_ckpt_optim_fully_reshardable"),
    Field("seed", "--seed", "rng.seed"),
    Field("log_interval", "--log-interval", "logger.log_interval"),
    Field("tensorboard_dir", "--tensorboard-dir", "logger.tensorboard_dir"),
)

_BY_FLAG = {field.flag: field for field in FIELDS}
_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")


def megatron_lm_namespace(cfg) -> argparse.Namespace:
    """Megatron-LM's namespace of the container ``cfg``: the defaults of the flags this package
    adds to Megatron-LM's parser, then :data:`FIELDS`; ``--layout-independent-init`` is on (every
    chunk is drawn from the seed) and ``--transformer-impl`` follows the model's layer spec."""
    args = add_megatron_lm_args(argparse.ArgumentParser()).parse_args([])
    for field in FIELDS:
        setattr(args, field.dest, field.value(cfg))
    args.rank = int(os.environ.get("RANK", "0"))
    args.layout_independent_init = True
    args.transformer_impl = "transformer_engine" if _uses_transformer_engine(cfg.model) else "local"
    args.padded_vocab_size = None
    return args


def _uses_transformer_engine(model) -> bool:
    spec = getattr(model, "transformer_layer_spec", None)
    return getattr(spec, "__name__", "") != "local_layer_spec"


def in_bridge_terms(message: str) -> str:
    """``message`` with every flag of :data:`FIELDS` replaced by its Bridge field."""
    return _FLAG.sub(lambda match: _BY_FLAG[match.group()].path if match.group() in _BY_FLAG else match.group(), message)


def bridge_problems(cfg) -> List[str]:
    """Every rule of the Megatron-LM route that the container ``cfg`` breaks, one line each in
    Bridge's field names, then the Bridge route's own. Local."""
    args = megatron_lm_namespace(cfg)
    schedule = args.pipeline_schedule
    context_parallel = (args.context_parallel_size or 1) > 1
    # Megatron-LM's context-parallel rules (its --spec, --cp-comm-type) do not apply: Bridge refuses it below
    megatron_lm_only = set(context_parallel_problems(args, schedule)) if context_parallel else set()
    try:
        validate_megatron_lm_args(args)
        problems = []
    except BitPipeConfigError as error:
        lines = [line.strip() for line in str(error).splitlines()[1:]]
        problems = [in_bridge_terms(line) for line in lines if line not in megatron_lm_only]
    if context_parallel and ScheduleChoice(resolved_schedule(args)).plan_executed:
        problems.append(
            f"model.context_parallel_size cannot be used with model.pipeline_schedule {schedule}: context parallelism is "
            "not supported through Megatron-Bridge yet (Megatron-LM's pretrain_gpt.py runs it: docs/megatron_lm.md)"
        )
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        problems.append(
            f"ddp.overlap_param_gather cannot be used with model.pipeline_schedule {schedule} without "
            "ddp.use_distributed_optimizer: only the distributed optimizer all-gathers parameters after its step"
        )
    if cfg.peft is not None:
        problems.append(f"peft cannot be used with model.pipeline_schedule {schedule}: adapters are added before "
                        "megatron's wrapping, which the schedule's chunk builder replaces")
    return problems


def checked_namespace(cfg) -> argparse.Namespace:
    """The namespace of ``cfg`` after the checks (:class:`BitPipeConfigError` listing every
    problem in Bridge's names)."""
    problems = bridge_problems(cfg)
    if problems:
        raise BitPipeConfigError("invalid Megatron-Bridge configuration:\n  " + "\n  ".join(problems))
    return megatron_lm_namespace(cfg)
