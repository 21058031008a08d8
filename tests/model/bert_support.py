"""Rank-side code of the BERT equivalence tests.

:class:`BertCase` runs BERT chunks (:func:`megatron_bitpipe.model.bert_model.build_bert_chunks`)
through :func:`equivalence_support.pipeline` with :func:`megatron_bitpipe.training.bert.bert_forward_step`
on mock MLM + next-sentence micro-batches with padding. :func:`reference` trains megatron-core's
stock ``BertModel`` (built from megatron's global parallel state) in one process, with the loss
written out here independently of the package's loss function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..equivalence_support import MICRO_BATCH, NUM_LAYERS, SEED, SEQ, VOCAB, Case, model_config, train_single_process

EVAL_SAMPLE = 1_000_000  # evaluation samples start here, far from the training samples


def batches(step: Optional[int], count: int) -> list:
    """The ``count`` micro-batches of training step ``step`` (None: the evaluation batch)."""
    from megatron_bitpipe.training.bert import MockBERTDataset, bert_microbatches

    dataset = MockBERTDataset(EVAL_SAMPLE + 10_000, SEQ, VOCAB, SEED)
    first = EVAL_SAMPLE if step is None else step * count * MICRO_BATCH
    return bert_microbatches(dataset, first, count, MICRO_BATCH)


@dataclass(frozen=True)
class BertCase(Case):
    """A :class:`equivalence_support.Case` training BERT; ``binary_head``: with the
    next-sentence head and token types (Megatron-LM's ``--bert-binary-head``)."""

    binary_head: bool = True

    @property
    def reference_key(self):
        return (self.tied, self.binary_head, self.global_microbatches, self.clip_grad)

    def model_kwargs(self) -> dict:
        from megatron_bitpipe.model.bert_model import build_bert_chunks

        return dict(
            chunk_builder=build_bert_chunks,
            share_embeddings_and_output_weights=self.tied,
            add_binary_head=self.binary_head,
        )

    def forward_step(self, data_iterator, model):
        from megatron_bitpipe.training.bert import bert_forward_step

        return bert_forward_step(data_iterator, model)

    def batches(self, step: Optional[int], count: int) -> list:
        return batches(step, count)

    def recorded_loss(self, report: dict):
        keys = ("lm loss", "sop loss") if self.binary_head else ("lm loss",)
        return tuple((report[k][0] / report[k][1]).item() for k in keys)


def _loss(output, batch):
    """Megatron-LM's BERT loss of one micro-batch and its (lm, sop) values, written out."""
    import torch.nn.functional as F

    per_token, binary_logits = output
    mask = batch["loss_mask"].float()
    lm = (per_token.float() * mask).sum() / mask.sum()
    if binary_logits is None:
        return lm, (lm.item(),)
    sop = F.cross_entropy(binary_logits.float(), batch["is_random"])
    return lm + sop, (lm.item(), sop.item())


def _init_stats(model) -> dict:
    """Per parameter: its value if constant (else None) and its standard deviation."""
    stats = {}
    for name, param in model.named_parameters():
        flat = param.detach().flatten()
        constant = flat[0].item() if bool((flat == flat[0]).all()) else None
        stats[name] = (constant, flat.std().item() if flat.numel() > 1 else 0.0)
    return stats


def reference(tied: bool, binary_head: bool, global_microbatches: int, clip_grad: float) -> dict:
    """Single-process training of megatron-core's stock BertModel, as :func:`equivalence_support.reference`.

    Also the parameter statistics of megatron's own initialisation and of the seed's
    (``native_stats``, ``seed_stats``).
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_bitpipe.model.build import init_megatron_state
    from megatron_bitpipe.model.init import initialize_from_seed
    from megatron_bitpipe.model_partition import ChunkLayers

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    pg = ProcessGroupCollection.use_mpu_process_groups()
    init_megatron_state(pg, SEED)
    config = model_config()
    model = BertModel(
        config=config,
        num_tokentypes=2 if binary_head else 0,
        transformer_layer_spec=bert_layer_local_spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=tied,
        add_binary_head=binary_head,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    device = next(model.parameters()).device
    native_stats = _init_stats(model)
    initialize_from_seed([model], [ChunkLayers(0, NUM_LAYERS, True, True, tied)], SEED)
    record = {"native_stats": native_stats, "seed_stats": _init_stats(model)}

    def run(ddp, batch):
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        types = batch["types"] if binary_head else None
        return _loss(ddp(batch["text"], batch["padding_mask"], tokentype_ids=types, lm_labels=batch["labels"]), batch)

    record.update(train_single_process(model, config, pg, clip_grad, run, batches, global_microbatches))
    return record
