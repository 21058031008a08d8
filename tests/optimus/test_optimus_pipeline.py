"""Optimus 2D inside the pipeline runtime, without processes: block geometry of the seed
initialisation and weight collection, the pipeline p2p shape, and argument checks that must
fail before any communication. (The BitPipe x Optimus equivalence run is in
``test_bitpipe_equivalence.py``.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_bitpipe.optimus.gpt_model import optimus_p2p_tensor_shapes
from megatron_bitpipe.optimus.layout import LayoutKind, ParamLayout
from megatron_bitpipe.execution.forward_backward import p2p_tensor_shape
from megatron_bitpipe.model_partition import full_shape, tp_block

# (layout, serial shape for mesh side q)
LAYOUTS = [
    (ParamLayout(LayoutKind.LINEAR_WEIGHT), lambda q: (3 * q, 2 * q)),
    (ParamLayout(LayoutKind.LINEAR_WEIGHT, stride=2), lambda q: (4 * q, 2 * q)),
    (ParamLayout(LayoutKind.VOCAB_TABLE), lambda q: (4 * q, 3 * q)),
    (ParamLayout(LayoutKind.FEATURE_VECTOR), lambda q: (4 * q,)),
    (ParamLayout(LayoutKind.FEATURE_VECTOR, stride=2), lambda q: (4 * q,)),
    (ParamLayout(LayoutKind.FEATURE_TABLE), lambda q: (5, 3 * q)),
]


def _param(block: torch.Tensor, layout: ParamLayout) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.empty_like(block))
    param.optimus_layout = layout
    return param


@pytest.mark.parametrize("layout, serial_shape", LAYOUTS, ids=[f"{l.kind.value}-{l.stride}" for l, _ in LAYOUTS])
@pytest.mark.parametrize("side", [2, 3])
def test_tp_blocks_reassemble_the_full_tensor(layout, serial_shape, side):
    shape = serial_shape(side)
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float).reshape(shape)
    tp = side * side
    blocks = [tp_block(full, _param(torch.empty(0), layout), rank, tp) for rank in range(tp)]
    assert len({b.shape for b in blocks}) == 1
    assert full_shape(_param(blocks[0], layout), tp) == tuple(shape)
    assert torch.equal(layout.from_tp_blocks([b.contiguous() for b in blocks]), full)
    # the blocks partition the full tensor (column-replicated kinds: once per mesh row)
    copies = 1 if not layout.column_replicated else side
    assert sum(b.numel() for b in blocks) == copies * full.numel()


def test_block_orientation_follows_the_mesh():
    """TP rank r sits at mesh (r // q, r % q): a linear weight's block (i, j) is input block
    i x output block j of the serial [out, in] weight, transposed."""
    serial = torch.arange(16.0).reshape(4, 4)  # [out, in]
    layout = ParamLayout(LayoutKind.LINEAR_WEIGHT)
    block = layout.tp_block(serial, tp_rank=1, tp_size=4)  # mesh (0, 1)
    assert torch.equal(block, serial[2:, :2].t())


def test_replicated_copies_must_agree():
    layout = ParamLayout(LayoutKind.FEATURE_VECTOR)
    blocks = [torch.zeros(2), torch.ones(2), torch.zeros(2), torch.ones(2) * 2]
    with pytest.raises(ValueError, match=r"mesh \(1, 1\)"):
        layout.from_tp_blocks(blocks)


def _groups(side):
    return SimpleNamespace(
        rank_pgs=SimpleNamespace(cp=SimpleNamespace(size=lambda: 1)),
        grid=SimpleNamespace(tp=side * side),
        mesh=SimpleNamespace(side=side) if side else None,
    )


def test_p2p_shape_is_the_mesh_block():
    config = SimpleNamespace(sequence_parallel=False, hidden_size=32)
    assert p2p_tensor_shape(config, 16, 4, _groups(0)) == [16, 4, 32]
    assert p2p_tensor_shape(config, 16, 4, _groups(2)) == [16, 2, 16]
    mesh = _groups(2).mesh
    # megatron's adjust_tensor_shapes_fn contract: redundant but consistent is fine
    assert p2p_tensor_shape(config, 16, 4, _groups(2), optimus_p2p_tensor_shapes(mesh)) == [16, 2, 16]
    with pytest.raises(ValueError, match="Optimus 2D pipeline stages exchange"):
        p2p_tensor_shape(config, 16, 4, _groups(2), lambda recv, send: (recv, send))
    with pytest.raises(ValueError, match="--micro-batch-size 3"):
        p2p_tensor_shape(config, 16, 3, _groups(2))


def test_bad_optimus_pipeline_fails_before_communication():
    """No process group exists here: each error must come from the argument checks."""
    from megatron_bitpipe.model.build import build_pipeline_model
    from megatron_bitpipe.execution.groups import ParallelGrid, PipelineGroups
    from megatron_bitpipe.schedules.placement import bidirectional_v
    from megatron_bitpipe.benchmarking.megatron_baseline import tiny_gpt_config

    config = tiny_gpt_config(
        num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=65,
        tensor_model_parallel_size=4, pipeline_model_parallel_size=2,
    )
    with pytest.raises(ValueError, match=r"--ffn-hidden-size \(65\).*padded vocabulary size \(130\)"):
        build_pipeline_model(
            config, ParallelGrid(tp=4, pp=2), bidirectional_v(2), vocab_size=130,
            max_sequence_length=8, seed=1, tensor_parallel_mode="optimus2d",
        )
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2 is not a square"):
        PipelineGroups.build(ParallelGrid(tp=2, pp=2), bidirectional_v(2), "optimus2d")
    with pytest.raises(ValueError, match="--tensor-parallel-mode '2d'"):
        PipelineGroups.build(ParallelGrid(tp=4, pp=2), bidirectional_v(2), "2d")
