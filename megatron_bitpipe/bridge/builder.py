"""Megatron-Bridge's model-config route (``cfg.model`` a ``GPTModelConfig``) with a plan schedule.

Bridge 0.6 builds a ``ModelConfig`` (megatron-core's ``GPTModelConfig``: a ``TransformerConfig``
in ``transformer`` plus the GPT fields, the transformer's fields readable and settable on the
config itself) with the builder class its ``builder`` names:
``builder(cfg.model).build_distributed_models(pg_collection, ddp_config, ...)``.
:class:`BitPipeGPTModelConfig` is ``GPTModelConfig`` with ``pipeline_schedule``,
``split_backward`` and ``schedule_costs``, built by :class:`BitPipeGPTModelBuilder`: with a
plan schedule, this rank's chunks of its placement by the Megatron-LM route's chunk flow
(:func:`~megatron_bitpipe.megatron_lm.model.build_plan_chunks`, each chunk made by
megatron-core's own ``GPTModelBuilder.build_model`` from a copy of the config holding the
chunk's transformer config); other schedules build as megatron-core builds, then their weights
are drawn again from ``rng.seed`` (layout-independent).

Invariant: every chunk's model config as megatron finds it is ``cfg.model.transformer``, where
Bridge sets ``grad_scale_func``, ``timers`` and ``finalize_model_grads_func`` after the build.
:func:`megatron_bitpipe.bridge.install` must have run on the container first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, List, Optional

from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size
from megatron.core.enums import ModelType
from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig

from ..megatron_lm.model import build_plan_chunks, builder_chunk_maker, initialize_chunks_from_seed
from .provider import installed_run

__all__ = ["BitPipeGPTModelBuilder", "BitPipeGPTModelConfig"]


@dataclass
class BitPipeGPTModelConfig(GPTModelConfig):
    """megatron-core's ``GPTModelConfig`` with the pipeline schedule (module docstring).

    Attributes:
        pipeline_schedule: the ``--pipeline-schedule`` value.
        split_backward: ``--split-backward``.
        schedule_costs: ``--schedule-costs``, a cost file the split plans are made for, or None.
    """

    builder: ClassVar[str] = "megatron_bitpipe.bridge.builder.BitPipeGPTModelBuilder"
    pipeline_schedule: str = "bitpipe"
    split_backward: bool = False
    schedule_costs: Optional[str] = None

    @classmethod
    def from_config(cls, config: GPTModelConfig, **schedule) -> "BitPipeGPTModelConfig":
        """``config`` (a recipe's ``GPTModelConfig``) with its field values, plus the ``schedule``
        fields. ValueError for a config whose builder is not megatron-core's ``GPTModelBuilder``."""
        if not isinstance(config, GPTModelConfig) or config.get_builder_cls() is not GPTModelBuilder:
            raise ValueError(f"{type(config).__name__} is built by its own builder; BitPipeGPTModelConfig builds GPTModelBuilder's model only")
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}, **schedule)


class BitPipeGPTModelBuilder(GPTModelBuilder):
    """megatron-core's ``GPTModelBuilder`` that builds a plan schedule's chunks (module docstring)."""

    def build_distributed_models(self, pg_collection, ddp_config=None, *options, wrap_with_ddp: bool = True,
                                 model_type=ModelType.encoder_or_decoder, **kwargs) -> List:
        """megatron-core's ``build_distributed_models``; with a plan schedule, this rank's chunks
        of its placement. Collective (process groups)."""
        model_config = self._model_config
        run_config, namespace = installed_run(model_config)
        if not run_config.executes_plan:
            model = super().build_distributed_models(pg_collection, ddp_config, *options, wrap_with_ddp=wrap_with_ddp,
                                                     model_type=model_type, **kwargs)
            initialize_chunks_from_seed(model, namespace.seed, pg_collection.tp)
            return model
        hooks = [name for name in ("pre_wrap_hooks", "post_wrap_hooks") if getattr(model_config, name)]
        if hooks:
            raise ValueError(f"pipeline_schedule {model_config.pipeline_schedule!r} builds its own chunks and runs no {', '.join(hooks)}")
        if (model_config.bf16, model_config.fp16) != (run_config.precision.bf16, run_config.precision.fp16):
            raise RuntimeError("cfg.model's precision changed after megatron_bitpipe.bridge.install(cfg)")
        padded = calculate_padded_vocab_size(model_config.vocab_size, model_config.make_vocab_size_divisible_by,
                                             model_config.transformer.tensor_model_parallel_size)
        namespace.padded_vocab_size = padded if model_config.should_pad_vocab else model_config.vocab_size
        return build_plan_chunks(namespace, run_config, builder_chunk_maker(self), type(self).__name__,
                                 model_config.transformer, model_type, wrap_with_ddp)
