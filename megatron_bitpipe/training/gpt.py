"""GPT pretraining on megatron-core: :class:`GPTTask` for the training loop.

* **Model.** megatron-core ``GPTModel`` chunks of the schedule's placement, or
  ``OptimusGPTModel`` with ``--tensor-parallel-mode optimus2d``
  (:func:`build_gpt_model`). Initial weights come from ``--seed`` alone,
  so every layout and schedule starts from the single-process model.
* **Data.** :class:`MockGPTDataset` by default; Megatron indexed datasets
  (``--data-path``) through megatron-core's ``GPTDataset`` and
  ``BlendedMegatronDatasetBuilder`` otherwise.
* **Loss.** Megatron-LM's: the masked sum of per-token cross entropy and the token count;
  with ``--coreset`` each sample's losses weighted (:mod:`.coreset.training`).
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Callable, Dict, Optional

import numpy as np
import torch

from ..hfta.model import HftaGPTModel, hfta_gpt_layer_spec, hfta_loss, hfta_p2p_tensor_shapes
from ..hfta.reports import hfta_iteration_losses, hfta_loss_names
from ..hfta.settings import HftaSettings
from ..optimus.gpt_model import optimus_p2p_tensor_shapes
from ..model.build import PipelineModel
from ..model.sdpa_attention import SdpaDotProductAttention
from ..run_config import RunConfig
from .data import indexed_datasets
from .distributed import log
from .coreset.identity import CoresetSettings
from .coreset.training import CoresetDataset, weighted_gpt_loss
from .gpt_args import GPTArguments
from .model import build_model
from .task import PretrainTask

__all__ = ["GPTTask", "MockGPTDataset", "build_gpt_model", "gpt_forward_step", "gpt_loss", "hfta_forward_step", "optimus_shapes_fn"]


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


def _gpt_output(data_iterator, model):
    """The model's output on the next micro-batch (a dict from the dataset) and the micro-batch."""
    batch = next(data_iterator)
    if torch.cuda.is_available():
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
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


def hfta_model_kwargs(args: argparse.Namespace, hfta: Optional[HftaSettings]) -> dict:
    """``build_model`` keywords of a fused array (none without one): the batched layer spec
    (with ``--attention-backend sdpa``'s core attention), :class:`~megatron_bitpipe.hfta.model.HftaGPTModel`."""
    if hfta is None:
        return {}
    core_attention = SdpaDotProductAttention if args.attention_backend == "sdpa" else None
    layer_spec = hfta_gpt_layer_spec(hfta.num_models, args.normalization, core_attention)
    return dict(layer_spec=layer_spec, model_class=HftaGPTModel, hfta=hfta)


def build_gpt_model(args: argparse.Namespace, run: RunConfig, hfta: Optional[HftaSettings] = None) -> PipelineModel:
    """This rank's GPTModel chunks of ``run``'s placement (``OptimusGPTModel`` with
    ``--tensor-parallel-mode optimus2d``; the fused array of ``hfta``'s models with
    ``--hfta-models``), seed-initialised and DDP-wrapped (collective)."""
    return build_model(args, run, rotary_base=args.rotary_base, **hfta_model_kwargs(args, hfta))


def optimus_shapes_fn(model: PipelineModel) -> Optional[Callable]:
    """megatron's ``adjust_tensor_shapes_fn`` for an Optimus model ([s, b/q, h/q]), else None."""
    mesh = model.groups.mesh
    return optimus_p2p_tensor_shapes(mesh) if mesh is not None else None


class GPTTask(GPTArguments, PretrainTask):
    """GPT with megatron-core; see the module docstring. With ``--hfta-models B`` the model is
    a fused array of B GPTs (:mod:`megatron_bitpipe.hfta`): :meth:`build_model` fixes the
    task's :class:`~megatron_bitpipe.hfta.HftaSettings`, its loss names (``lm loss``, the mean,
    and ``lm loss k`` per model) and its loss."""

    name = "gpt"
    loss_names = ("lm loss",)
    hfta: Optional[HftaSettings] = None

    def build_model(self, args: argparse.Namespace, run: RunConfig):
        self.hfta = run.hfta
        if self.hfta is not None:
            self.loss_names = hfta_loss_names(("lm loss",), self.hfta.num_models)
        return build_gpt_model(args, run, self.hfta)

    def forward_step(self, data_iterator, model):
        if self.hfta is not None:
            return hfta_forward_step(self.hfta.num_models, data_iterator, model)
        return gpt_forward_step(data_iterator, model)

    def iteration_losses(self, losses):
        if self.hfta is None:
            return losses, {}
        return hfta_iteration_losses(losses, ("lm loss",), self.hfta.num_models)

    def build_datasets(self, args: argparse.Namespace, tokenizer):
        train, valid, test = self._datasets(args, tokenizer)
        coreset = CoresetSettings.from_args(args)
        if coreset is None:
            return train, valid, test
        log(coreset.summary())
        return CoresetDataset(train, coreset.coreset), valid, test

    def _datasets(self, args: argparse.Namespace, tokenizer):
        if args.use_mock_data:
            vocab = tokenizer.vocab_size
            valid = MockGPTDataset(args.seed, "valid", args.seq_length, vocab) if args.eval_iters > 0 else None
            return MockGPTDataset(args.seed, "train", args.seq_length, vocab), valid, None
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        return indexed_datasets(
            args,
            tokenizer,
            GPTDataset,
            GPTDatasetConfig,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=args.eod_mask_loss,
            create_attention_mask=False,
        )

    def adjust_tensor_shapes_fn(self, model):
        if self.hfta is not None:
            return hfta_p2p_tensor_shapes(self.hfta.num_models)
        return optimus_shapes_fn(model)
