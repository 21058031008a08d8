"""Name mapping between model chunks and the full GPT model (pure Python, no ranks)."""

import pytest
import torch

from megatron_bitpipe.model_partition import ChunkLayers, to_global_name, to_local_name
from megatron_bitpipe.testing.weights import chunk_state_dict, merge_full

LAYER_KEYS = ("input_layernorm.weight", "self_attention.linear_qkv.weight", "mlp.linear_fc2.bias")


def _full(num_layers: int, tied: bool) -> dict:
    names = ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"]
    names += [f"decoder.layers.{layer}.{key}" for layer in range(num_layers) for key in LAYER_KEYS]
    names += ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias"]
    if not tied:
        names.append("output_layer.weight")
    return {name: torch.tensor(float(i)) for i, name in enumerate(names)}


def _v_chunks(num_layers: int, stages: list, tied: bool) -> list:
    """Chunks holding the given stages (0-based) of ``len(all stages)`` equal stages."""
    per = num_layers // 8
    return [ChunkLayers(s * per, per, pre_process=(s == 0), post_process=(s == 7), tied=tied) for s in stages]


@pytest.mark.parametrize("tied", [False, True])
def test_chunks_partition_the_full_model(tied):
    """Any placement of the stages (here BitPipe's rank 0 of D=4: s1, s4, s8, s5) round-trips."""
    full = _full(16, tied)
    placements = [[0, 3, 7, 4], [1, 2, 6, 5]]  # two ranks' chunks, another two hold the rest
    chunks = [c for stages in placements + [[2, 5], [1, 6]] for c in _v_chunks(16, stages, tied)]
    parts = []
    for chunk in chunks:
        local = chunk_state_dict(full, chunk)
        assert all(to_local_name(to_global_name(name, chunk), chunk) == name for name in local)
        parts.append({to_global_name(name, chunk): value for name, value in local.items()})
    assert merge_full(parts) == full


def test_layer_numbering_is_local():
    chunk = ChunkLayers(first_layer=6, num_layers=2, pre_process=False, post_process=False)
    assert to_global_name("decoder.layers.1.mlp.fc2.bias", chunk) == "decoder.layers.7.mlp.fc2.bias"
    assert to_local_name("decoder.layers.6.mlp.fc2.bias", chunk) == "decoder.layers.0.mlp.fc2.bias"
    assert to_local_name("decoder.layers.8.input_layernorm.weight", chunk) is None
    assert to_local_name("embedding.word_embeddings.weight", chunk) is None
    with pytest.raises(KeyError):
        to_global_name("decoder.layers.2.input_layernorm.weight", chunk)


def test_tied_head_maps_to_word_embedding():
    head_only = ChunkLayers(4, 4, pre_process=False, post_process=True, tied=True)
    both = ChunkLayers(0, 8, pre_process=True, post_process=True, tied=True)
    untied = ChunkLayers(4, 4, pre_process=False, post_process=True, tied=False)
    assert to_global_name("output_layer.weight", head_only) == "embedding.word_embeddings.weight"
    assert to_local_name("embedding.word_embeddings.weight", head_only) == "output_layer.weight"
    assert to_local_name("embedding.position_embeddings.weight", head_only) is None
    assert to_local_name("embedding.word_embeddings.weight", both) == "embedding.word_embeddings.weight"
    assert to_global_name("output_layer.weight", untied) == "output_layer.weight"
    assert to_local_name("embedding.word_embeddings.weight", untied) is None


def test_merge_rejects_disagreeing_copies():
    with pytest.raises(ValueError, match="copies disagree"):
        merge_full([{"a": torch.zeros(2)}, {"a": torch.tensor([0.0, 1e-7])}])
    assert merge_full([{"a": torch.ones(1)}, {"a": torch.ones(1), "b": torch.zeros(1)}]).keys() == {"a", "b"}
