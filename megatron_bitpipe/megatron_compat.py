"""The API differences between the supported megatron-core releases, 0.16 through 0.19, and
between Megatron-LM's training code at tags core_v0.16.1 through core_v0.19.0.

Every place where megatron-bitpipe calls a function whose signature or location changed goes
through this module; the rest of the package is written against one API. Each difference is detected from the installed megatron-core itself
(a parameter or a module that exists or not), never from its version string, so an untested
patch release in the range behaves like its neighbours:

* :func:`backward_step` — megatron-core's ``schedules.backward_step``; 0.16 takes a
  ``model_type`` argument it does not use, 0.17 dropped it.
* :func:`build_tokenizer` — megatron-core's tokenizer factory moved from
  ``megatron.core.tokenizers.text.utils.build_tokenizer`` (0.16) to
  ``megatron.core.tokenizers.utils.build_tokenizer`` (0.17) and renamed the settings it reads
  (``tokenizer_special_tokens`` -> ``special_tokens``, ``tokenizer_hf_use_fast`` ->
  ``not tokenizer_hf_no_use_fast``, ...); the settings given here carry both spellings.
* :func:`linear_weight_shards`, :func:`linear_call_is_plain` — 0.19's tensor-parallel linears
  can shard their weight over a rematerialisation group (``gtp_remat_size``, passed to the
  linear's ``_forward_impl``); before 0.19 there is no such sharding.
* :func:`enable_delay_wgrad_compute` — the weight-gradient deferral contract megatron-core
  uses for Transformer Engine: ``delay_wgrad_compute`` in ``ModelParallelConfig`` (0.16.1 and
  0.19.2 have it; ``DistributedDataParallelConfig`` has its own in both, set directly). ``TransformerConfig.__post_init__`` of 0.16-0.19 admits the flag only together
  with ``overlap_moe_expert_parallel_comm`` (its MoE overlap schedule), so the flag is set on
  the constructed config; where a release has no such field it becomes a plain attribute,
  read by this package's deferrable local linears only (megatron's TE linears of such a
  release would not defer, and :func:`~megatron_bitpipe.execution.weight_grad.enable_split_backward`
  refuses them).
* :func:`ddp_gradient_hooks` — megatron DDP's per-parameter gradient hook (what its
  gradient accumulators run: ``main_grad += grad``, ``grad`` cleared, the bucket told), made by
  ``DistributedDataParallel._make_backward_post_hook(param)`` for the parameters of
  ``param_to_bucket_group``; the same in 0.16.1 and 0.19.2, private, so found by its name (a
  wrapper without it gets none).
* :func:`reads_common_state_in_index` — megatron-core 0.19 saves a distributed checkpoint's
  plain values as an object of its index instead of ``common.pt``; its reader reads both,
  0.16's only ``common.pt``.
* core attention — ``DotProductAttention``'s constructor and forward are the same in 0.16.1
  and 0.19.2 (``SelfAttention`` passes ``config, layer_number, attn_mask_type,
  attention_type, cp_comm_type, softmax_scale, pg_collection``); 0.19's selective recompute
  passes extra keyword arguments to the core attention (``_run_core_attention(...,
  **extra_kwargs)``, empty for self-attention), which
  :class:`~megatron_bitpipe.model.sdpa_attention.SdpaDotProductAttention` accepts and
  refuses when not empty. Nothing to adapt here.
* :func:`scale_gradient_reduction` — the factor megatron DDP multiplies a bucket's gradients
  by before their reduction (``gradient_scaling_factor`` of every bucket of ``buffers`` and
  ``expert_parallel_buffers``, kept by the buffer for the buckets it builds; set once in the
  DDP's constructor from its group size and ``average_in_collective``); the same in 0.16.1 and
  0.19.2, found by its name.
* :func:`param_gather_state`, :func:`finish_param_gathers` — megatron DDP's overlapped
  parameter all-gather (``overlap_param_gather``) per bucket group: ``param_gather_dispatched``
  (set when the gather is started, cleared by ``finish_grad_sync``), ``param_gather_handle``
  (the gather in flight) and ``finish_param_sync`` (what the forward pre-hooks call: wait, and
  without ``skip_next_bucket_dispatch`` start the next bucket group's gather), over
  ``bucket_groups + expert_parallel_bucket_groups``; whether the hooks are registered:
  ``remove_forward_pre_hook_handles`` not empty (Megatron-LM's own test). The same in 0.16.1
  and 0.19.2, private, so found by their names.
* :func:`enable_moe_without_transformer_engine` — megatron-core 0.16's ``moe_utils`` imports
  ``te_general_gemm`` only with Transformer Engine but its router GEMM reads the name in any
  case (NameError without TE); defining it as None, as later releases do, selects the router's
  plain-torch GEMM.
* :func:`sharded_save_request` — 0.19's save takes ``async_strategy`` (its default needs
  nvidia-resiliency-ext); the synchronous save hands its file writer's results over in the
  rank's own process (``filesystem_async._results_queue`` in 0.16-0.19), not through the
  helper process megatron-core spawns for them.
* :func:`batch_size_calculator`, :data:`BATCH_RAMPS` — megatron-core's number-of-micro-batches
  calculators (``megatron.core.num_microbatches_calculator``), built as objects (not its
  module-global one): 0.16 ramps the global batch up linearly (``--rampup-batch-size START
  INCR SAMPLES``, ``RampupBatchsizeNumMicroBatchesCalculator``); 0.19 removed that calculator
  (its ``rampup_batch_size`` argument is accepted and ignored) and steps the global batch by
  consumed samples (``--step-batch-size-schedule "THRESHOLD:BS ..."``,
  ``StepBatchsizeNumMicroBatchesCalculator``, thresholds in tokens given a sequence length).
  Which ramps exist is read from the module's classes.
* :func:`megatron_lm_functions` — where Megatron-LM's training code looks up what the runtime
  route wraps (argument parsing, batch broadcast, model builders), and :func:`with_keyword`
  for calls whose arguments moved between positions and keywords.
"""

from __future__ import annotations

import importlib
import inspect
import queue
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Callable, Dict, Optional, Tuple

import torch
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import schedules as _schedules

__all__ = [
    "backward_step",
    "build_tokenizer",
    "linear_weight_shards",
    "linear_call_is_plain",
    "reads_common_state_in_index",
    "enable_delay_wgrad_compute",
    "ddp_gradient_hooks",
    "scale_gradient_reduction",
    "ParamGatherState",
    "param_gather_state",
    "finish_param_gathers",
    "enable_moe_without_transformer_engine",
    "MegatronLMFunctions",
    "megatron_lm_functions",
    "builder_model_config",
    "with_keyword",
    "BATCH_RAMPS",
    "BatchRampUnsupported",
    "batch_size_calculator",
    "has_batch_ramp",
    "ramp_end_samples",
]

_BACKWARD_STEP_TAKES_MODEL_TYPE = "model_type" in inspect.signature(_schedules.backward_step).parameters


def backward_step(input_tensor, output_tensor, output_tensor_grad, config) -> Optional[torch.Tensor]:
    """megatron-core's ``backward_step``: backpropagate ``output_tensor_grad`` (or the loss) and
    return the gradient of ``input_tensor`` (None where the chunk has no input tensor)."""
    if _BACKWARD_STEP_TAKES_MODEL_TYPE:
        return _schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, ModelType.encoder_or_decoder, config)
    return _schedules.backward_step(input_tensor, output_tensor, output_tensor_grad, config)


def build_tokenizer(
    tokenizer_type: str,
    *,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
):
    """megatron-core's tokenizer of ``tokenizer_type`` with megatron-core's defaults for the
    settings not given (no special tokens, fast Hugging Face tokenizers, no remote code, no
    vocabulary padding: the caller pads)."""
    try:
        module = importlib.import_module("megatron.core.tokenizers.utils.build_tokenizer")
    except ModuleNotFoundError:
        module = importlib.import_module("megatron.core.tokenizers.text.utils.build_tokenizer")
    settings = SimpleNamespace(
        tokenizer_type=tokenizer_type,
        vocab_file=vocab_file,
        merge_file=merge_file,
        tokenizer_model=tokenizer_model,
        vocab_size=vocab_size,
        trust_remote_code=False,
        tokenizer_sentencepiece_legacy=False,
        tiktoken_pattern=None,
        tiktoken_num_special_tokens=1000,
        # 0.16 spellings
        tokenizer_metadata=None,
        tokenizer_special_tokens=None,
        tokenizer_hf_use_fast=True,
        tokenizer_hf_include_special_tokens=False,
        # 0.17+ spellings
        metadata_path=None,
        special_tokens=None,
        tokenizer_hf_no_use_fast=False,
        tokenizer_hf_no_include_special_tokens=True,
        tokenizer_sentencepiece_ignore_extra_whitespaces=False,
        chat_template=None,
        # 0.18+ pad only when asked; 0.17 always pads into padded_vocab_size (of this
        # throw-away namespace: the caller pads for its own tensor-parallel size)
        pad_vocab_size=False,
        padded_vocab_size=None,
        make_vocab_size_divisible_by=1,
        tensor_model_parallel_size=1,
        rank=None,
    )
    return module.build_tokenizer(settings)


def linear_weight_shards(linear: torch.nn.Module) -> int:
    """How many ranks hold a shard of a megatron tensor-parallel linear's weight beyond tensor
    parallelism (0.19's GTP rematerialisation group); 1 when the weight is whole."""
    return getattr(linear, "gtp_remat_size", 1)


def linear_call_is_plain(newer_keywords: dict) -> bool:
    """Whether the keywords a megatron linear passes its ``_forward_impl`` beyond 0.16's
    (``gtp_remat_size`` since 0.19) ask for nothing beyond 0.16's behaviour."""
    return all(name == "gtp_remat_size" and value == 1 for name, value in newer_keywords.items())


def enable_delay_wgrad_compute(config) -> None:
    """Set ``config.delay_wgrad_compute`` on a constructed model config (before building the
    model: megatron's TE linears read it in their constructor), bypassing
    ``TransformerConfig.__post_init__``'s MoE-overlap-only check (see the module docstring)."""
    config.delay_wgrad_compute = True


def ddp_gradient_hooks(module: torch.nn.Module) -> Dict[torch.nn.Parameter, Callable[[], None]]:
    """``{parameter: hook}`` for a megatron ``DistributedDataParallel``'s parameters: the hook
    its gradient accumulator runs after autograd set ``parameter.grad`` (see the module
    docstring); ``{}`` for a module that is not such a DDP."""
    make_hook = getattr(module, "_make_backward_post_hook", None)
    buckets = getattr(module, "param_to_bucket_group", None)
    if not callable(make_hook) or not isinstance(buckets, dict):
        return {}
    return {param: make_hook(param) for param in buckets}


def scale_gradient_reduction(ddp, factor: float) -> None:
    """Multiply by ``factor`` the pre-reduction scaling of every gradient bucket of megatron DDP
    ``ddp`` (dense and expert-parallel): after it, each reduction (all-reduce or
    reduce-scatter) yields ``factor`` times what it did. Call once, right after construction."""
    for buffer in list(ddp.buffers) + list(ddp.expert_parallel_buffers):
        buffer.gradient_scaling_factor *= factor
        for bucket in buffer.buckets:
            bucket.gradient_scaling_factor *= factor


@dataclass(frozen=True)
class ParamGatherState:
    """Where a megatron DDP's overlapped parameter all-gathers stand (see the module docstring)."""

    #: every bucket group's gather was started since the group's last gradient sync
    dispatched: bool
    #: bucket groups whose gather is started and not yet waited for
    in_flight: int
    #: the forward pre-hooks that wait for the gathers are registered
    hooks_enabled: bool


def _bucket_groups(ddp) -> list:
    return list(ddp.bucket_groups) + list(ddp.expert_parallel_bucket_groups)


def param_gather_state(ddp) -> ParamGatherState:
    """The :class:`ParamGatherState` of megatron DDP ``ddp``."""
    groups = _bucket_groups(ddp)
    return ParamGatherState(
        dispatched=all(group.param_gather_dispatched for group in groups),
        in_flight=sum(group.param_gather_handle is not None for group in groups),
        hooks_enabled=len(ddp.remove_forward_pre_hook_handles) > 0,
    )


def finish_param_gathers(ddp) -> None:
    """Wait for every parameter all-gather of megatron DDP ``ddp`` that is in flight, as its
    forward pre-hooks do, without starting any (no communication of its own)."""
    for group in _bucket_groups(ddp):
        if group.param_gather_handle is not None:
            group.finish_param_sync(skip_next_bucket_dispatch=True)


def enable_moe_without_transformer_engine() -> None:
    """Give megatron-core's ``moe_utils`` the ``te_general_gemm = None`` it reads when
    Transformer Engine is absent (see the module docstring); idempotent, and nothing changes
    where the name exists (TE installed, or a release that defines it)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# Megatron-LM's training code (a checkout's ``megatron.training``) -------------------------


@dataclass(frozen=True)
class MegatronLMFunctions:
    """Where a Megatron-LM checkout's training code looks up the functions the plugin wraps.

    * ``argument_modules``: the modules through whose ``parse_args`` / ``validate_args``
      Megatron-LM's start-up parses the command line — ``initialize`` (imported there by name;
      ``initialize_megatron`` parses, core_v0.16/0.17) and ``arguments`` (its own
      ``parse_and_validate_args``, called by the scripts since core_v0.18);
    * ``batch_modules``: the modules holding ``get_batch_on_this_tp_rank`` as a module
      attribute — ``megatron.training.utils`` up to core_v0.17, ``megatron.core.utils`` since
      core_v0.18, plus ``training`` where it imports it by name (its dummy step, core_v0.19);
    * ``model_builders``: the model-builder classes of Megatron-LM's config container
      (core_v0.19 ``pretrain_gpt.py`` builds through ``GPTModelBuilder``, the hybrid scripts
      through ``HybridModelBuilder``; before, every script goes through ``training.get_model``)
      and ``gpt_builder``, the one that builds ``GPTModel`` (None before core_v0.19).
    """

    argument_modules: Tuple[ModuleType, ...]
    training: ModuleType
    batch_modules: Tuple[ModuleType, ...]
    model_builders: Tuple[type, ...]
    gpt_builder: Optional[type]


def megatron_lm_functions() -> MegatronLMFunctions:
    """The :class:`MegatronLMFunctions` of the checkout on ``sys.path`` (imports its training code)."""
    import megatron.core.utils as core_utils
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    import megatron.training.training as training
    import megatron.training.utils as training_utils

    argument_modules = tuple(module for module in (arguments, initialize) if hasattr(module, "parse_args"))
    home = training_utils if "get_batch_on_this_tp_rank" in vars(training_utils) else core_utils
    get_batch = home.get_batch_on_this_tp_rank
    batch_modules = tuple(
        module for module in (home, training) if getattr(module, "get_batch_on_this_tp_rank", None) is get_batch
    )
    try:
        models = importlib.import_module("megatron.training.models")
    except ModuleNotFoundError:
        builders, gpt_builder = (), None
    else:
        builders, gpt_builder = (models.GPTModelBuilder, models.HybridModelBuilder), models.GPTModelBuilder
    return MegatronLMFunctions(argument_modules, training, batch_modules, builders, gpt_builder)


def standard_param_group_overrides(config):
    """The ``config_overrides`` megatron-core's ``get_megatron_optimizer`` uses when none are
    given (0.19: ``get_standard_config_overrides(config)``, the rule "no weight decay for biases
    and 1-D tensors"; 0.16 applies that rule itself for ``None``), for callers of
    ``_get_param_groups`` that must group parameters as it does."""
    from megatron.core import optimizer

    standard = getattr(optimizer, "get_standard_config_overrides", None)
    return None if standard is None else standard(config)


def sharded_save_request(state_dict, directory, **kwargs):
    """megatron-core's ``dist_checkpointing.save(..., async_sharded_save=True)``: the save as a
    request, to be run synchronously in this process (``execute_sync``). Since 0.19 its
    default async strategy is NVIDIA Resiliency Extension's (``nvrx``), an optional package;
    megatron-core's own (``mcore``) is asked for where the function takes ``async_strategy``
    (0.16.1 has only its own)."""
    from megatron.core import dist_checkpointing

    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        kwargs["async_strategy"] = "mcore"
    _write_results_in_this_process()
    return dist_checkpointing.save(state_dict, directory, async_sharded_save=True, **kwargs)


def _write_results_in_this_process() -> None:
    """megatron-core's file writer (0.16-0.19) hands its results to the save's finalisation
    through ``filesystem_async._results_queue``, by default a queue served by a manager process
    it spawns on a rank's first save: for a save run in a background process. Run
    synchronously, both ends are this process, and an in-process queue serves: no helper
    process, which would import torch again (about a second on each rank's first save) and
    outlive a rank killed without clean-up, holding the job's output open. A release without
    that attribute is left as it is."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


def reads_common_state_in_index() -> bool:
    """Whether megatron-core's ``load_common_state_dict`` reads plain values stored in the
    checkpoint's index (0.19's layout) besides a ``common.pt``."""
    from megatron.core.dist_checkpointing import serialization

    return hasattr(serialization, "_legacy_common_state_exists")


def builder_model_config(builder):
    """The ``ModelConfig`` a Megatron-LM model builder (core_v0.19) was created with; the
    builders keep it as ``_model_config`` and offer no accessor."""
    return builder._model_config


def with_keyword(function, name: str, args: tuple, kwargs: dict, change) -> Tuple[tuple, dict]:
    """``(args, kwargs)`` of a call of ``function`` with argument ``name`` (given by position or
    keyword, or at its default) replaced by ``change(value)``: Megatron-LM's releases pass
    ``get_batch_on_this_tp_rank``'s ``mtp_on_this_rank`` either way."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    bound.arguments[name] = change(bound.arguments[name])
    return bound.args, bound.kwargs


# megatron-core's number-of-micro-batches calculators ---------------------------------------

#: the batch-size ramps by Megatron-LM's flag -> the calculator class megatron-core implements
#: it with (0.16: the linear ramp-up; 0.19: the step schedule)
_RAMP_CALCULATORS = {
    "--rampup-batch-size": "RampupBatchsizeNumMicroBatchesCalculator",
    "--step-batch-size-schedule": "StepBatchsizeNumMicroBatchesCalculator",
}
BATCH_RAMPS = tuple(_RAMP_CALCULATORS)


class BatchRampUnsupported(ValueError):
    """The installed megatron-core has no calculator for the ramp a flag asks for."""


def _calculators():
    from megatron.core import num_microbatches_calculator

    return num_microbatches_calculator


def has_batch_ramp(flag: str) -> bool:
    """Whether the installed megatron-core's calculators implement ``flag``'s ramp."""
    return hasattr(_calculators(), _RAMP_CALCULATORS[flag])


def batch_size_calculator(
    *,
    global_batch_size: Optional[int],
    micro_batch_size: int,
    data_parallel_size: int,
    rampup_batch_size=None,
    step_batch_size_schedule: Optional[str] = None,
    seq_length: Optional[int] = None,
):
    """A new megatron-core number-of-micro-batches calculator (its module-global one is left
    alone): ``update(consumed_samples, consistency_check)``, then ``get()`` (micro-batches per
    data-parallel rank) and ``get_current_global_batch_size()``. The ramp up
    (``rampup_batch_size``: start, increment, samples, up to ``global_batch_size``) or the step
    schedule (``step_batch_size_schedule``; its thresholds are tokens with ``seq_length``, as
    Megatron-LM passes it), else the constant ``global_batch_size``. Built quiet (as a rank > 0).
    :class:`BatchRampUnsupported` naming the flag where megatron-core lacks that ramp; megatron's
    own assertions (a malformed ramp) come through as ValueError."""
    module = _calculators()
    quiet_rank = 1
    try:
        if rampup_batch_size is not None:
            cls = _ramp_class(module, "--rampup-batch-size")
            start, increment, samples = (int(v) for v in rampup_batch_size)
            return cls(global_batch_size, micro_batch_size, data_parallel_size, False, quiet_rank, start, increment, samples)
        if step_batch_size_schedule is not None:
            cls = _ramp_class(module, "--step-batch-size-schedule")
            return cls(micro_batch_size, data_parallel_size, False, quiet_rank, step_batch_size_schedule, seq_length)
        return module.ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size, False, quiet_rank)
    except (AssertionError, ZeroDivisionError) as error:
        raise ValueError(str(error) or type(error).__name__) from None


def _ramp_class(module, flag: str):
    cls = getattr(module, _RAMP_CALCULATORS[flag], None)
    if cls is None:
        other = next(f for f in BATCH_RAMPS if f != flag and hasattr(module, _RAMP_CALCULATORS[f]))
        raise BatchRampUnsupported(
            f"{flag}: the installed megatron-core has no such batch-size ramp (megatron-core 0.16 ramps up with "
            f"--rampup-batch-size, 0.19 replaced it by --step-batch-size-schedule); use {other}"
        )
    return cls


def ramp_end_samples(calculator) -> int:
    """The consumed samples from which ``calculator``'s global batch no longer changes: the
    ramp-up's SAMPLES (its ``ramup_samples``: from above it, ``--global-batch-size``), the step
    schedule's last threshold (its parsed ``schedule``, in samples), 0 for a constant one."""
    if hasattr(calculator, "ramup_samples"):
        return int(calculator.ramup_samples) + 1
    schedule = getattr(calculator, "schedule", None)
    return int(schedule[-1][0]) if schedule else 0
