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
``megatron_bitpipe.model.build.build_pipeline_model(..., tensor_parallel_mode="optimus2d")``.
"""

import importlib

#: public name -> the submodule defining it; imported on first use, so that the flag checks
#: (:mod:`.args`) load without torch or megatron-core
_SUBMODULE = {
    "add_optimus_args": "args",
    "validate_optimus_args": "args",
    "OptimusDotProductAttention": "attention",
    "OptimusGPTModel": "gpt_model",
    "optimus_p2p_tensor_shapes": "gpt_model",
    "load_serial_state_dict": "layout",
    "OptimusMesh": "mesh",
    "build_optimus_mesh": "mesh",
    "get_optimus_gpt_block_spec": "spec",
    "get_optimus_gpt_layer_spec": "spec",
}


def __getattr__(name: str):
    if name not in _SUBMODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_SUBMODULE[name]}"), name)


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
