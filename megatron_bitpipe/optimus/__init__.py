"""Optimus 2D (SUMMA) tensor parallelism for megatron-core: ``--tensor-parallel-mode optimus2d``.

The TP group of q² ranks becomes a q×q mesh; weights *and* activations are split in 2-D
blocks. See ``docs/optimus.md``. Main entry points:

* :func:`build_optimus_mesh` — row/column groups and mesh coordinates from the TP group;
* :class:`OptimusGPTModel` — megatron-core's ``GPTModel`` in 2-D mode;
* :func:`get_optimus_gpt_layer_spec` / :func:`get_optimus_gpt_block_spec` — the ModuleSpecs;
* :class:`OptimusDotProductAttention` — the default core attention (dropout recomputed);
* :func:`optimus_p2p_tensor_shapes` — pipeline p2p shapes ``[s, b/q, h/q]`` for megatron-core's 1F1B;
* :func:`add_optimus_args` / :func:`validate_optimus_args` — the flag and its checks;
* :func:`load_serial_state_dict` — load single-process weights into a 2-D model.

Pipelines built by this package (BitPipe and every other plan) take Optimus through
``megatron_bitpipe.runtime.build.build_pipeline_model(..., tensor_parallel_mode="optimus2d")``.
"""

from megatron_bitpipe.optimus.args import add_optimus_args, validate_optimus_args
from megatron_bitpipe.optimus.attention import OptimusDotProductAttention
from megatron_bitpipe.optimus.gpt_model import OptimusGPTModel, optimus_p2p_tensor_shapes
from megatron_bitpipe.optimus.layout import load_serial_state_dict
from megatron_bitpipe.optimus.mesh import OptimusMesh, build_optimus_mesh
from megatron_bitpipe.optimus.spec import get_optimus_gpt_block_spec, get_optimus_gpt_layer_spec

__all__ = [
    "OptimusDotProductAttention",
    "OptimusGPTModel",
    "OptimusMesh",
    "add_optimus_args",
    "build_optimus_mesh",
    "get_optimus_gpt_block_spec",
    "get_optimus_gpt_layer_spec",
    "load_serial_state_dict",
    "optimus_p2p_tensor_shapes",
    "validate_optimus_args",
]
