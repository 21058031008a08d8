"""A Megatron-Bridge GPT provider that names the pipeline schedule and builds its chunks.

:class:`BitPipeGPTModelProvider` is Bridge's ``GPTModelProvider`` with three more fields —
``pipeline_schedule`` (a ``--pipeline-schedule`` value: ``bitpipe``, ``zbv``, ``dualpipev``,
...; ``default`` keeps megatron's), ``split_backward`` and ``schedule_costs`` (a cost file) —
so a recipe selects the schedule where it sets the model. For a schedule this package's plan
executor runs, :meth:`~BitPipeGPTModelProvider.provide_distributed_model` builds this rank's
chunks of the schedule's placement with the Megatron-LM route's chunk flow
(:mod:`megatron_bitpipe.megatron_lm.model`: explicit layer ranges, the placement's process
groups, seed-only weights, per-chunk DDP over each chunk's grad-sync group), each chunk made by
Bridge's own ``provide`` on a copy of the provider that holds the chunk's config. Other
schedules build as Bridge builds, and their weights are then drawn again from ``rng.seed`` and
each weight's full-model name (the Megatron-LM route's ``--layout-independent-init``), so every
schedule and layout starts from the same model.

Invariant: every chunk's model config as megatron finds it (``get_model_config``, through the
DDP wrapper) is the provider object itself, so what Bridge sets on ``cfg.model`` after the
build (``grad_scale_func``, ``timers``, ``finalize_model_grads_func``, the sync functions)
reaches every chunk.

:func:`megatron_bitpipe.bridge.install` must have run on the container first: it checks the
container and installs the schedule, and keeps the Megatron-LM namespace of the container that
the build reads (``_bitpipe_args``).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Tuple

from megatron.bridge.models import GPTModelProvider
from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size
from megatron.core.enums import ModelType

from ..megatron_lm.model import build_plan_chunks, initialize_chunks_from_seed
from ..plugin import installed_schedule
from ..run_config import RunConfig

__all__ = ["BitPipeGPTModelProvider", "installed_run"]


@dataclass
class BitPipeGPTModelProvider(GPTModelProvider):
    """Bridge's GPT provider with the pipeline schedule (module docstring).

    Attributes:
        pipeline_schedule: the ``--pipeline-schedule`` value.
        split_backward: ``--split-backward`` (BitPipe, Chimera; the zero-bubble and DualPipe
            schedules always split).
        schedule_costs: ``--schedule-costs``, a cost file the split plans are made for, or None.
    """

    pipeline_schedule: str = "bitpipe"
    split_backward: bool = False
    schedule_costs: Optional[str] = None

    @classmethod
    def from_provider(cls, provider: GPTModelProvider, **schedule) -> "BitPipeGPTModelProvider":
        """``provider`` (a recipe's ``cfg.model``: ``LlamaModelProvider``, ...) with its field
        values, plus the ``schedule`` fields. ValueError for a provider class that builds its
        model its own way (overrides ``provide``), which the copy would lose."""
        if not isinstance(provider, GPTModelProvider) or type(provider).provide is not GPTModelProvider.provide:
            raise ValueError(
                f"{type(provider).__name__} builds its model with its own provide(); BitPipeGPTModelProvider builds "
                "GPTModelProvider's model only"
            )
        values = {f.name: getattr(provider, f.name) for f in dataclasses.fields(provider) if f.init}
        return cls(**values, **schedule)

    def provide_distributed_model(self, ddp_config=None, model_type=ModelType.encoder_or_decoder, **kwargs) -> List:
        """Bridge's ``provide_distributed_model``; with a plan-executed schedule, this rank's
        chunks of its placement (module docstring). Collective (process groups)."""
        run_config, args = installed_run(self)
        if not run_config.executes_plan:
            model = super().provide_distributed_model(ddp_config=ddp_config, model_type=model_type, **kwargs)
            initialize_chunks_from_seed(model, args.seed, self._pg_collection.tp)
            return model
        hooks = [name for name in ("pre_wrap_hook", "post_wrap_hook") if kwargs.get(name) or getattr(self, name, None)]
        if hooks:
            raise ValueError(f"pipeline_schedule {self.pipeline_schedule!r} builds its own chunks and runs no {', '.join(hooks)}")
        if (self.bf16, self.fp16) != (run_config.precision.bf16, run_config.precision.fp16):
            raise RuntimeError("cfg.model's precision changed after megatron_bitpipe.bridge.install(cfg)")
        padded = calculate_padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, self.tensor_model_parallel_size)
        args.padded_vocab_size = padded if self.should_pad_vocab else self.vocab_size
        return build_plan_chunks(
            args, run_config, _chunk_maker, type(self).__name__, self, model_type, kwargs.get("wrap_with_ddp", True)
        )


def installed_run(model_config) -> Tuple[RunConfig, argparse.Namespace]:
    """The run's decisions and the container's Megatron-LM namespace, kept by
    :func:`megatron_bitpipe.bridge.install` for ``model_config`` (``cfg.model``); RuntimeError
    when it has not run."""
    installed = installed_schedule()
    namespace = getattr(model_config, "_bitpipe_args", None)
    if installed is None or installed.run_config is None or namespace is None:
        raise RuntimeError(
            f"pipeline_schedule {model_config.pipeline_schedule!r}: call megatron_bitpipe.bridge.install(cfg) before "
            "Megatron-Bridge's pretrain(cfg, ...)"
        )
    return installed.run_config, namespace


def _chunk_maker(*, pre_process: bool, post_process: bool, config, pg_collection, share_embeddings_and_output_weights: bool):
    """One chunk from Bridge's ``provide``: ``config`` is a copy of the provider holding the chunk's
    layer range (the chunk flow's per-chunk config); the model is built on ``pg_collection``."""
    chunk = dataclasses.replace(config, share_embeddings_and_output_weights=share_embeddings_and_output_weights)
    chunk._pg_collection = pg_collection
    return chunk.provide(pre_process=pre_process, post_process=post_process)
