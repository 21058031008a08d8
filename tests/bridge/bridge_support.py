"""A tiny Llama-style Megatron-Bridge recipe on CPU ranks, trained through Bridge's ``pretrain``.

:func:`recipe` is the container (mock data, NullTokenizer, local layers, fp32, no dropout);
:func:`train` runs on every rank of a launch (or in one process) and returns the rank's record:
the training loss and grad norm of every iteration and the validation and test losses Bridge
averaged (present on the last pipeline rank, where Bridge reads losses), whether every chunk's
model config holds what Bridge set on ``cfg.model`` after the build, the optimizer's class and
the class of what each chunk's DDP wraps; :func:`train_all` runs several cases in one launch.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from .cpu_shims import enable_bridge_on_cpu, start_bridge_on_cpu

SEQ_LENGTH = 32
VOCAB_SIZE = 128


def recipe(*, schedule: str, pp: int, tp: int = 1, num_layers: int = 4, iters: int = 3, decay_iters: Optional[int] = None,
           micro_batch: int = 2, global_batch: int = 8, save: Optional[str] = None, load: Optional[str] = None,
           stock: bool = False, distributed_optimizer: bool = False, overlap_param_gather: bool = False,
           mixed_precision: Optional[str] = None, builder: bool = False, **model):
    """The container of the tiny recipe (``iters`` iterations of a learning-rate schedule of
    ``decay_iters``, default ``iters``; a checkpoint at the end under ``save``; resumed from
    ``load`` without its RNG state, which the recipe without dropout does not use, and with the
    scheduler settings of the container, not of the checkpoint: megatron's scheduler refuses a
    saved weight-decay step count of another ``iters``, constant here); ``stock``:
    Bridge's own GPTModelProvider (no schedule); ``distributed_optimizer``, ``overlap_param_gather``:
    ``ddp.use_distributed_optimizer`` and ``ddp.overlap_param_gather`` (with
    ``ddp.overlap_grad_reduce``, as megatron requires); ``mixed_precision``: a Bridge recipe
    name (``"bf16_mixed"``); ``builder``: Bridge's model-config route (a ``BitPipeGPTModelConfig``
    holding a ``TransformerConfig``) instead of a provider; ``model``: more ``cfg.model`` fields
    (the mixture-of-experts ones)."""
    enable_bridge_on_cpu()
    import torch.nn.functional as F
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        DistributedDataParallelConfig,
        DistributedInitConfig,
        GPTDatasetConfig,
        LoggerConfig,
        OptimizerConfig,
        RNGConfig,
        SchedulerConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from megatron.bridge.training.tokenizers.config import TokenizerConfig

    from megatron_bitpipe.bridge import BitPipeGPTModelProvider

    fields = dict(
        num_layers=num_layers, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, seq_length=SEQ_LENGTH,
        vocab_size=VOCAB_SIZE, make_vocab_size_divisible_by=64, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, position_embedding_type="rope", add_bias_linear=False,
        share_embeddings_and_output_weights=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=False,
        transformer_layer_spec=local_layer_spec, use_cpu_initialization=True, gradient_accumulation_fusion=False,
        persist_layer_norm=False, masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, cross_entropy_loss_fusion=False, bf16=False, fp16=False, params_dtype=None,
    )
    fields.update(model)
    import torch

    fields["params_dtype"] = torch.float32
    if builder:
        provider = _model_config(schedule, fields)
    elif stock:
        provider = GPTModelProvider(**fields)
    else:
        provider = BitPipeGPTModelProvider(pipeline_schedule=schedule, **fields)
    return ConfigContainer(
        model=provider,
        train=TrainingConfig(train_iters=iters, global_batch_size=global_batch, micro_batch_size=micro_batch),
        validation=ValidationConfig(eval_interval=iters, eval_iters=1),
        optimizer=OptimizerConfig(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.01, clip_grad=1.0,
                                  bf16=False, fp16=False, use_distributed_optimizer=distributed_optimizer,
                                  overlap_param_gather=overlap_param_gather),
        scheduler=SchedulerConfig(lr_decay_style="cosine", lr_warmup_iters=1, lr_decay_iters=decay_iters or iters, start_weight_decay=0.01,
                                  end_weight_decay=0.01, weight_decay_incr_style="constant",
                                  override_opt_param_scheduler=load is not None),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer, overlap_param_gather=overlap_param_gather,
                                          overlap_grad_reduce=overlap_param_gather),
        dataset=GPTDatasetConfig(random_seed=1234, reset_attention_mask=False, reset_position_ids=False,
                                 eod_mask_loss=False, seq_length=SEQ_LENGTH, num_dataset_builder_threads=1, blend=None,
                                 blend_per_split=None, split="1,1,1", dataloader_type="single", num_workers=0,
                                 pin_memory=False, skip_getting_attention_mask_from_dataset=True),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=VOCAB_SIZE),
        checkpoint=CheckpointConfig(save=save, load=load, save_interval=iters if save else None, ckpt_format="torch_dist",
                                    load_rng=False),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(distributed_backend="gloo"),
        mixed_precision=mixed_precision,
    )


def _model_config(schedule: str, fields: Dict):
    """The recipe's model on Bridge's model-config route: the GPT fields on the config, the
    others on its ``TransformerConfig``."""
    import dataclasses

    from megatron.bridge.models.transformer_config import TransformerConfig

    from megatron_bitpipe.bridge import BitPipeGPTModelConfig

    own = {f.name for f in dataclasses.fields(BitPipeGPTModelConfig)}
    transformer = TransformerConfig(**{name: value for name, value in fields.items() if name not in own})
    return BitPipeGPTModelConfig(transformer=transformer, pipeline_schedule=schedule,
                                 **{name: value for name, value in fields.items() if name in own})


def train_all(cases: List[Dict]) -> List[Dict]:
    """:func:`train` of each case in turn, in one launch (Bridge's ``pretrain`` tears megatron's
    groups down after each run; the launch's process group stays)."""
    return [train(case) for case in cases]


def train(case: Dict) -> Dict:
    """Train ``recipe(**case)`` through Bridge's ``pretrain``; this rank's record (module docstring)."""
    enable_bridge_on_cpu()
    start_bridge_on_cpu()
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.gpt_step import forward_step as bridge_forward_step
    from megatron.bridge.training.pretrain import pretrain

    from megatron_bitpipe.bridge import forward_step, install

    record: Dict = {"loss": [], "grad_norm": [], "valid": [], "test": [], "pp": case["pp"], "tp": case.get("tp", 1)}

    class Recorder(Callback):
        def on_train_step_end(self, context):
            if context.loss_dict:
                record["loss"].append(float(context.loss_dict["lm loss"]))
            record["grad_norm"].append(None if context.grad_norm is None else float(context.grad_norm))
            if "hooks" not in record:
                record["hooks"] = _hooks_on_every_chunk(context)
                record["optimizer"] = type(context.optimizer).__name__
                record["chunks"] = sorted({type(chunk.module).__name__ for chunk in context.model})

        def on_eval_end(self, context):
            if context.total_loss_dict:
                record["valid"].append(float(context.total_loss_dict["lm loss"]))

        def on_test_end(self, context):
            if context.total_loss_dict:
                record["test"].append(float(context.total_loss_dict["lm loss"]))

    cfg = recipe(**case)
    if not case.get("stock"):
        install(cfg)
    pretrain(cfg, bridge_forward_step if case.get("stock") else forward_step, callbacks=[Recorder()])
    return record


def _hooks_on_every_chunk(context) -> bool:
    """Whether every chunk's model config holds what Bridge set on ``cfg.model`` after the build."""
    from megatron.core.utils import get_model_config

    provider = context.state.cfg.model
    names = ("grad_scale_func", "finalize_model_grads_func", "timers")
    return all(
        getattr(get_model_config(chunk), name) is getattr(provider, name) is not None for chunk in context.model for name in names
    )
