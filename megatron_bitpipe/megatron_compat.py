"""The megatron-core API differences between the supported releases, 0.16 through 0.19.

Every place where megatron-bitpipe calls a megatron-core function whose signature or location
changed between 0.16.1 and 0.19.x goes through this module; the rest of the package is
written against one API. Each difference is detected from the installed megatron-core itself
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
"""

from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace
from typing import Optional

import torch
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import schedules as _schedules

__all__ = ["backward_step", "build_tokenizer", "linear_weight_shards", "linear_call_is_plain"]

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
