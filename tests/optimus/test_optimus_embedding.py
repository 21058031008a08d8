"""Optimus embedding, LM head and cross entropy against serial torch on 4 gloo ranks (q=2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_bitpipe.optimus.cross_entropy import optimus_cross_entropy
from megatron_bitpipe.optimus.embedding import OptimusEmbedding, OptimusOutputLayer
from megatron_bitpipe.optimus.layout import shard_serial_tensor
from megatron_bitpipe.optimus.summa import summa_ab
from megatron_bitpipe.cpu.launcher import launch
from .optimus_support import block, check, random, tiny_config, world_mesh

pytestmark = pytest.mark.timeout(120)

VOCAB, HIDDEN, MAX_POSITIONS, B, S = 16, 8, 5, 4, 3


def _embedding_head_loss(tied: bool):
    mesh = world_mesh()
    config = tiny_config(hidden_size=HIDDEN)
    ids_gen = torch.Generator().manual_seed(31)
    input_ids = torch.randint(0, VOCAB, (B, S), generator=ids_gen)
    labels = torch.randint(0, VOCAB, (B, S), generator=ids_gen)
    position_ids = torch.arange(S).repeat(B, 1)
    loss_mask = (torch.rand(B, S, generator=ids_gen) > 0.3).float()

    table = random(VOCAB, HIDDEN, seed=32).requires_grad_()
    positions = random(MAX_POSITIONS, HIDDEN, seed=33).requires_grad_()
    head = table if tied else random(VOCAB, HIDDEN, seed=34).requires_grad_()
    mix = random(HIDDEN, HIDDEN, seed=35)  # stands in for the transformer, mixes hidden blocks

    # serial: [b, s, h] -> [s, b, h] -> logits -> per-token loss [b, s]
    hidden = (F.embedding(input_ids, table) + F.embedding(position_ids, positions)).transpose(0, 1)
    logits = (hidden @ mix) @ head.t()
    serial_losses = F.cross_entropy(
        logits.transpose(0, 1).reshape(-1, VOCAB), labels.reshape(-1), reduction="none"
    ).view(B, S)
    serial_loss = (serial_losses * loss_mask).sum() / loss_mask.sum()
    serial_loss.backward()

    embedding = OptimusEmbedding(config, VOCAB, MAX_POSITIONS, "learned_absolute", mesh)
    output_layer = OptimusOutputLayer(config, VOCAB, mesh, has_weight=not tied)
    layout = embedding.word_embeddings.weight.optimus_layout
    with torch.no_grad():
        embedding.word_embeddings.weight.copy_(shard_serial_tensor(table, layout, mesh))
        embedding.position_embeddings.weight.copy_(block(positions, {1: "column"}, mesh))
        if not tied:
            output_layer.weight.copy_(shard_serial_tensor(head, layout, mesh))
    mix_local = block(mix, {0: "row", 1: "column"}, mesh).contiguous()
    hidden_2d = summa_ab(embedding(input_ids, position_ids), mix_local, mesh)
    logits_2d, _ = output_layer(
        hidden_2d, weight=embedding.word_embeddings.weight if tied else None
    )
    check("logits", logits_2d, block(logits.detach(), {1: "row", 2: "column"}, mesh))
    losses = optimus_cross_entropy(logits_2d, labels, mesh)
    loss = (losses * loss_mask).sum() / loss_mask.sum()
    loss.backward()

    check("per-token losses", losses, serial_losses.detach())
    check("loss", loss, serial_loss.detach())
    check(
        "dE", embedding.word_embeddings.weight.grad, shard_serial_tensor(table.grad, layout, mesh)
    )
    check(
        "dP", embedding.position_embeddings.weight.grad, block(positions.grad, {1: "column"}, mesh)
    )
    if not tied:
        check("dHead", output_layer.weight.grad, shard_serial_tensor(head.grad, layout, mesh))


@pytest.mark.multirank
@pytest.mark.parametrize("tied", [True, False])
def test_embedding_head_and_loss_equal_serial(tied):
    launch(_embedding_head_loss, 4, tied)
