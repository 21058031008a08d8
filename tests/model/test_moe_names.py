"""A routed expert's parameters are named by its global index whichever expert-parallel rank
holds it (pure Python): the names initial weights are drawn under and gradients compared by."""

from __future__ import annotations

from megatron_bitpipe.model_partition import ChunkLayers, to_global_name, to_local_name

FC1 = "decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc1.weight"


def test_local_experts_map_to_their_global_index_and_back():
    chunk = ChunkLayers(first_layer=2, num_layers=2, pre_process=False, post_process=False, experts=range(2, 4))
    assert to_global_name(FC1.format(1, 0), chunk) == FC1.format(3, 2)
    assert to_global_name(FC1.format(0, 1), chunk) == FC1.format(2, 3)
    assert to_local_name(FC1.format(3, 3), chunk) == FC1.format(1, 1)
    assert to_local_name(FC1.format(3, 1), chunk) is None  # held by the other expert-parallel rank
    router = "decoder.layers.0.mlp.router.weight"
    assert to_global_name(router, chunk) == "decoder.layers.2.mlp.router.weight"


def test_without_expert_parallelism_names_are_unchanged():
    chunk = ChunkLayers(first_layer=0, num_layers=2, pre_process=True, post_process=False)
    assert to_global_name(FC1.format(1, 3), chunk) == FC1.format(1, 3)
    assert to_local_name(FC1.format(1, 3), chunk) == FC1.format(1, 3)
