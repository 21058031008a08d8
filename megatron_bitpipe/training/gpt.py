"""GPT pretraining on megatron-core: :class:`GPTTask` for the training loop.

* **Model.** Four kinds (:class:`~.model_kind.ModelKind`): megatron-core ``GPTModel`` chunks
  of the schedule's placement (:data:`GPT`), a mixture-of-experts ``GPTModel`` with
  ``--num-experts`` (:data:`MOE_GPT`), ``OptimusGPTModel`` with
  ``--tensor-parallel-mode optimus2d`` (:data:`OPTIMUS_GPT`), a fused array of GPTs with
  ``--hfta-models`` (:data:`HFTA_GPT`). Initial weights come from ``--seed`` alone, so every
  layout and schedule starts from the single-process model.
* **Data.** :class:`MockGPTDataset` by default; Megatron indexed datasets
  (``--data-path``) through megatron-core's ``GPTDataset`` and
  ``BlendedMegatronDatasetBuilder`` otherwise.
* **Loss.** Megatron-LM's: the masked sum of per-token cross entropy and the token count;
  with ``--coreset`` each sample's losses weighted (:mod:`.coreset.training`).
* **Context parallelism** (``--context-parallel-size``): every rank of a context-parallel group
  reads the same samples and runs its part of each sequence; their sums and counts add up to
  the whole sequence's in the reported loss.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from functools import partial
from typing import Dict, Optional

import numpy as np
import torch

from megatron.core.utils import get_attr_wrapped_model

from ..hfta.model import HftaGPTModel, hfta_gpt_layer_spec, hfta_loss
from ..hfta.reports import hfta_iteration_losses, hfta_loss_names
from ..model.chunks import build_gpt_chunks, default_gpt_layer_spec
from ..model.context_parallel import context_parallel_batch
from ..optimus.gpt_model import optimus_p2p_tensor_shapes
from ..run_config import RunConfig
from .data import indexed_datasets
from .distributed import log
from .coreset.identity import CoresetSettings
from .coreset.training import CoresetDataset, weighted_gpt_loss
from .gpt_args import GPTArguments
from .moe import moe_iteration_losses, moe_layer_specs
from .model_kind import (
    ModelKind, builder_layer_spec, core_attention, fused_p2p_shapes, is_fused_array, local_layer_spec, no_p2p_adjustment,
    own_iteration_losses,
)  # fmt: skip
from .task import PretrainTask

__all__ = [
    "GPT", "GPTTask", "GPT_LOSSES", "HFTA_GPT", "KINDS", "MOE_GPT", "MockGPTDataset", "OPTIMUS_GPT", "gpt_forward_step",
    "gpt_loss",
    "hfta_forward_step",
]  # fmt: skip


class MockGPTDataset:
    """Deterministic synthetic GPT samples: a function of (``seed``, split, sample index).

    A sample is ``seq_length + 1`` tokens made of runs of arithmetic progressions
    ``a, a + d, a + 2d, ... (mod vocab)`` with random start ``a``, step ``d`` in 1..3 and
    run lengths averaging 16 tokens: random enough that the loss starts near ln(vocab), and
    learnable, so it falls. ``tokens``/``labels`` are the sequence without its last/first
    token; the loss mask is all ones. Indexing is random access (any non-negative index).
    """

    SPLITS = ("train", "valid")

    def __init__(self, seed: int, split: str, seq_length: int, vocab_size: int):
        self.seed, self.split_id = seed, self.SPLITS.index(split)
        self.seq_length, self.vocab_size = seq_length, vocab_size
        self.position_ids = torch.arange(seq_length)
        self.loss_mask = torch.ones(seq_length)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.split_id, index])
        length = self.seq_length + 1
        run = np.cumsum(rng.random(length) < 1 / 16)
        run[0] = 0
        starts = rng.integers(0, self.vocab_size, size=run[-1] + 1)
        steps = rng.integers(1, 4, size=run[-1] + 1)
        first = np.searchsorted(run, run)  # position where each token's run begins
        sequence = torch.from_numpy((starts[run] + steps[run] * (np.arange(length) - first)) % self.vocab_size)
        return {
            "tokens": sequence[:-1].clone(),
            "labels": sequence[1:].clone(),
            "loss_mask": self.loss_mask,
            "position_ids": self.position_ids,
        }


def gpt_loss(loss_mask: torch.Tensor, output: torch.Tensor):
    """Megatron-LM's GPT loss: masked sum of per-token losses, token count, ``lm loss`` report."""
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


#: the per-token entries of a GPT micro-batch: what a context-parallel rank keeps its part of
PER_TOKEN_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def _gpt_output(data_iterator, model):
    """The model's output on the next micro-batch (a dict from the dataset) and the micro-batch
    — with context parallelism this rank's part of it (:data:`PER_TOKEN_KEYS` cut to its
    positions in the model's context-parallel group,
    :func:`~megatron_bitpipe.model.context_parallel.context_parallel_batch`)."""
    batch = next(data_iterator)
    if torch.cuda.is_available():
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    cp_group = get_attr_wrapped_model(model, "cp_group")
    if cp_group is not None and cp_group.size() > 1:
        # a new dict: every chunk of this rank is handed the same micro-batch object
        batch = {**batch, **context_parallel_batch({k: batch[k] for k in PER_TOKEN_KEYS}, cp_group)}
    return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]), batch


def gpt_forward_step(data_iterator, model):
    """megatron-core ``forward_step_func``: one micro-batch (a dict from the dataset)."""
    output, batch = _gpt_output(data_iterator, model)
    if "loss_weight" in batch:  # a coreset's samples: each loss times its weight
        return output, partial(weighted_gpt_loss, batch["loss_mask"], sample_weights=batch["loss_weight"])
    return output, partial(gpt_loss, batch["loss_mask"])


def hfta_forward_step(num_models: int, data_iterator, model):
    """:func:`gpt_forward_step` of a fused array of ``num_models`` GPTs (the same micro-batch
    for every model; :func:`megatron_bitpipe.hfta.model.hfta_loss`)."""
    output, batch = _gpt_output(data_iterator, model)
    return output, partial(hfta_loss, num_models, batch["loss_mask"])


class GPTTask(GPTArguments, PretrainTask):
    """GPT with megatron-core; see the module docstring. Its kinds: :data:`GPT`, :data:`MOE_GPT`
    (``--num-experts``), :data:`HFTA_GPT` (``--hfta-models``), :data:`OPTIMUS_GPT`
    (``--tensor-parallel-mode optimus2d``)."""

    name = "gpt"

    def task_settings(self, args: argparse.Namespace) -> Optional[CoresetSettings]:
        """GPT's own decision: the ``--coreset`` training set (None: the whole one)."""
        return CoresetSettings.from_args(args)

    def build_datasets(self, run: RunConfig, tokenizer):
        train, valid, test = self._datasets(run, tokenizer)
        coreset = run.task_settings
        if coreset is None:
            return train, valid, test
        log(coreset.summary())
        return CoresetDataset(train, coreset.coreset), valid, test

    def _datasets(self, run: RunConfig, tokenizer):
        if run.data.mock:
            vocab = tokenizer.vocab_size
            seq_length = run.batches.seq_length
            valid = MockGPTDataset(run.seed, "valid", seq_length, vocab) if run.data.eval_iters > 0 else None
            return MockGPTDataset(run.seed, "train", seq_length, vocab), valid, None
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        return indexed_datasets(
            run,
            tokenizer,
            GPTDataset,
            GPTDatasetConfig,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=run.data.eod_mask_loss,
            create_attention_mask=False,
        )


#: the loss a GPT reports
GPT_LOSSES = ("lm loss",)


def _rotary_base(run: RunConfig) -> dict:
    return dict(rotary_base=run.model.rotary_base)


#: megatron-core ``GPTModel`` chunks (the local layer spec, with SDPA's core attention under
#: ``--attention-backend sdpa``), Megatron-LM's loss (:func:`gpt_forward_step`)
GPT = ModelKind(
    name="gpt",
    task=GPTTask.name,
    chosen_when=None,
    chunk_builder=build_gpt_chunks,
    layer_spec=local_layer_spec(default_gpt_layer_spec),
    chunk_kwargs=_rotary_base,
    forward_step=lambda run: gpt_forward_step,
    loss_names=lambda run: GPT_LOSSES,
    iteration_losses=own_iteration_losses,
    p2p_shapes=no_p2p_adjustment,
    causal_attention=True,
)

#: GPT with ``--tensor-parallel-mode optimus2d``: ``OptimusGPTModel`` chunks (the builder's
#: choice on groups with a mesh) with their own layer spec, pipeline messages ``[s, b/q, h/q]``
OPTIMUS_GPT = replace(
    GPT,
    name="optimus-gpt",
    chosen_when=lambda run: run.layout.tensor_parallel_mode == "optimus2d",
    layer_spec=builder_layer_spec,
    p2p_shapes=lambda run, model: optimus_p2p_tensor_shapes(model.groups.mesh),
)

#: a fused array of ``--hfta-models`` GPTs (:mod:`megatron_bitpipe.hfta.model`): the loss
#: reports ``lm loss`` (the models' mean) and ``lm loss k`` per model
HFTA_GPT = replace(
    GPT,
    name="hfta-gpt",
    chosen_when=is_fused_array,
    layer_spec=lambda run, config: hfta_gpt_layer_spec(run.hfta.num_models, run.model.normalization, core_attention(run)),
    chunk_kwargs=lambda run: dict(_rotary_base(run), model_class=HftaGPTModel, hfta=run.hfta),
    forward_step=lambda run: partial(hfta_forward_step, run.hfta.num_models),
    loss_names=lambda run: hfta_loss_names(GPT_LOSSES, run.hfta.num_models),
    iteration_losses=lambda run, losses: hfta_iteration_losses(losses, GPT_LOSSES, run.hfta.num_models),
    p2p_shapes=fused_p2p_shapes,
)

#: a mixture-of-experts GPT (``--num-experts``, :mod:`.moe`): megatron-core ``GPTModel`` chunks of
#: megatron-core's local MoE layers (experts split over ``--expert-model-parallel-size``
#: data-parallel ranks), the auxiliary losses logged as Megatron-LM logs them
MOE_GPT = replace(
    GPT,
    name="moe-gpt",
    chosen_when=lambda run: run.moe is not None,
    layer_spec=moe_layer_specs,
    iteration_losses=moe_iteration_losses,
)

#: the GPT task's kinds, for :mod:`.model_registry`
KINDS = (GPT, MOE_GPT, HFTA_GPT, OPTIMUS_GPT)
