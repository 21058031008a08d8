"""BERT on BitPipe equals single-process training of megatron-core's stock BertModel.

Mock MLM + next-sentence micro-batches with padding (variable lengths, a different number of
masked tokens in every micro-batch). For every case: the MLM and next-sentence loss of every
micro-batch, every gradient, the grad norm and every weight after each of STEPS optimizer
steps equal one process training the stock ``BertModel`` from the same seed on the same global
batches (fp32, rtol 1e-5); the replicas stay bit-identical; the evaluation (forward-only)
losses are equal. The stock model's loss is written out in the test, so the package's BERT
loss and its averaging over micro-batches (per micro-batch mean over its masked tokens, then
mean over the global batch) are checked too. The seed initialisation follows megatron's BERT
initialisation (same constants, same spread per parameter).

Both sides take fp32 logits gradients from megatron's fused cross entropy
(:mod:`megatron_bitpipe.testing.fp32_cross_entropy`): its bfloat16 gradient turns last-bit
differences of the weights into relative gradient jumps of up to 2^-8.

One launch per world size serves all of its cases (``launched``, ``tests/conftest.py``); the data
and loss checks run in-process.
"""

from __future__ import annotations

from typing import List

import pytest
import torch


from .bert_support import BertCase, batches, reference
from ..equivalence_support import assert_equals_reference, bf16_losses, pipeline

TRAINED = [
    BertCase("bert_bitpipe_pp2_n4", "bitpipe", pp=2, n=4),
    BertCase("bert_bitpipe_pp4_n4_clip", "bitpipe", pp=4, n=4, clip_grad=0.5),
    BertCase("bert_bitpipe_pp4_n8_untied_no_binary_head", "bitpipe", pp=4, n=8, tied=False, binary_head=False),
    BertCase("bert_bitpipe_tp2_pp2_n4", "bitpipe", pp=2, n=4, tp=2),
    BertCase("bert_bitpipe_tp2_sp_pp2_n4", "bitpipe", pp=2, n=4, tp=2, sequence_parallel=True),
    BertCase("bert_bitpipe_dp2_pp2_n2", "bitpipe", pp=2, n=2, dp=2),
]
BF16 = BertCase("bert_bitpipe_pp2_n4_bf16", "bitpipe", pp=2, n=4)  # bf16 smoke run (bf16_losses)
CASES = TRAINED + [BF16]


def _enable():
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.testing.fp32_cross_entropy import enable_fp32_cross_entropy_gradients

    enable_cpu_megatron()
    enable_fp32_cross_entropy_gradients()


def run_cases(cases: List[BertCase]) -> dict:
    _enable()
    return {case.name: bf16_losses(case) if case == BF16 else pipeline(case) for case in cases}


def run_references(keys) -> dict:
    _enable()
    return {key: reference(*key) for key in keys}


@pytest.mark.multirank
@pytest.mark.parametrize("case", TRAINED, ids=lambda c: c.name)
def test_equals_stock_bert_training(case, references, launched):
    assert_equals_reference(case, launched[case], references[case.reference_key])


@pytest.mark.multirank
def test_bf16_losses_are_fp32_on_every_loss_rank(references, launched):
    """bf16 smoke test: both edge ranks report fp32 MLM and next-sentence losses close to fp32 training."""
    ranks = launched[BF16]
    ref = references[BF16.reference_key]
    assert [r["dtypes"] for r in ranks] == [{"torch.float32"}] * 2
    for step in range(2):
        losses = ranks[0]["losses"][step] + ranks[1]["losses"][step]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["steps"][step]["losses"]), rtol=3e-2, atol=0)


@pytest.mark.multirank
def test_seed_init_follows_megatron_bert_init(references):
    """Every stock BertModel parameter gets megatron's constant (biases 0, norms 1) or a
    spread like megatron's (embeddings, lm_head, pooler, binary head, output layer...)."""
    for record in references.values():
        native, seeded = record["native_stats"], record["seed_stats"]
        assert native.keys() == seeded.keys()
        for name, (constant, std) in native.items():
            assert seeded[name][0] == constant, name
            if constant is None:
                assert 0.7 < seeded[name][1] / std < 1.4, (name, seeded[name][1], std)


# ---------------------------------------------------------------------------- in-process


def test_mock_samples_are_consistent_and_deterministic():
    from megatron_bitpipe.training.bert import MockBERTDataset

    dataset = MockBERTDataset(50, 16, 64, seed=3)
    for index in range(len(dataset)):
        sample = dataset[index]
        length = int(sample["padding_mask"].sum())
        assert sample["padding_mask"][:length].all() and not sample["padding_mask"][length:].any()
        assert (sample["text"][length:] == 0).all() and (sample["types"][length:] == 0).all()
        masked = sample["loss_mask"].bool()
        assert masked.any() and not masked[length:].any()
        assert (sample["labels"][masked] >= 4).all() and (sample["labels"][~masked] == -1).all()
        assert (sample["text"][masked] == 3).all()
        assert sample["text"][0] == 1 and sample["text"][length - 1] == 2
        assert set(sample["types"][:length].tolist()) == {0, 1}
        assert sample["is_random"].item() in (0, 1)
    again = MockBERTDataset(50, 16, 64, seed=3)[7]
    assert all(torch.equal(again[k], v) for k, v in dataset[7].items())
    assert not torch.equal(MockBERTDataset(50, 16, 64, seed=4)[7]["text"], again["text"])


def test_mock_data_rejects_bad_sizes():
    from megatron_bitpipe.training.bert import MockBERTDataset

    with pytest.raises(ValueError, match="--vocab-size"):
        MockBERTDataset(1, 16, 4, seed=0)
    with pytest.raises(ValueError, match="--seq-length"):
        MockBERTDataset(1, 4, 64, seed=0)


def test_loss_is_per_microbatch_mean_over_masked_tokens():
    """Megatron-LM's convention: a micro-batch's MLM loss is the mean over *its* masked
    tokens, whatever their number; the next-sentence loss the mean over its sequences. In
    megatron-core's three-value form: (count x loss, count, {name: [sum, count]})."""
    from megatron_bitpipe.training.bert import bert_loss

    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    loss_mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    is_random = torch.tensor([0, -1])  # the second sequence's label is ignored
    sop = torch.log1p(torch.exp(torch.tensor(-2.0))).item()
    loss_sum, count, report = bert_loss(loss_mask, is_random, (per_token, logits))
    assert count.item() == 3 and not count.is_floating_point()
    assert (loss_sum / count).item() == pytest.approx(10.0 / 3 + sop)
    assert report["lm loss"].tolist() == pytest.approx([10.0, 3.0])
    assert report["sop loss"].tolist() == pytest.approx([sop, 1.0])
    loss_sum, count, report = bert_loss(loss_mask, is_random, (per_token, None))
    assert (loss_sum / count).item() == pytest.approx(10.0 / 3) and list(report) == ["lm loss"]


def test_forward_step_rejects_per_token_loss():
    from types import SimpleNamespace

    from megatron_bitpipe.training.bert import bert_forward_step

    model = torch.nn.Module()
    model.config = SimpleNamespace(calculate_per_token_loss=True)
    with pytest.raises(ValueError, match="--calculate-per-token-loss"):
        bert_forward_step(iter(batches(0, 1)), model)


def test_bert_parameter_names_map_between_chunk_and_full_model():
    from megatron_bitpipe.model_partition import ChunkLayers, to_global_name, to_local_name

    head = ChunkLayers(first_layer=6, num_layers=2, pre_process=False, post_process=True, tied=True)
    middle = ChunkLayers(first_layer=2, num_layers=2, pre_process=False, post_process=False)
    assert to_global_name("encoder.layers.1.mlp.linear_fc1.weight", head) == "encoder.layers.7.mlp.linear_fc1.weight"
    assert to_local_name("encoder.layers.3.self_attention.bias", middle) == "encoder.layers.1.self_attention.bias"
    assert to_local_name("encoder.layers.7.mlp.linear_fc1.weight", middle) is None
    post_process = ("encoder.final_layernorm.weight", "lm_head.dense.weight", "pooler.dense.bias", "binary_head.weight")
    for name in post_process + ("output_layer.bias",):
        assert to_local_name(name, head) == name and to_global_name(name, head) == name
        assert to_local_name(name, middle) is None
    assert to_global_name("output_layer.weight", head) == "embedding.word_embeddings.weight"
    assert to_local_name("embedding.tokentype_embeddings.weight", head) is None
