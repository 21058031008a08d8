"""Which of megatron-core's fused kernels a ``TransformerConfig`` turns on.

One statement for every config this package builds (the pretrain scripts' and the test
suite's reference models): without a GPU every fusion is off (the kernels are CUDA-only);
with one, bias-activation (where a bias or SwiGLU exists) and bias-dropout fusions are on and
gradient-accumulation fusion follows Transformer Engine. Always: weights created on the CPU
(:mod:`.init` draws each rank's shards), no masked-softmax, RoPE or persistent-layer-norm
kernels (apex/TE), unbatched p2p (batched p2p mixes up the two directions between one pair of
ranks: pipeline size 2 with the interleaved schedule), and pipeline outputs deallocated after
their send only on GPUs (on gloo an asynchronous send can read an output after it was freed).
"""

from __future__ import annotations

from typing import Dict

__all__ = ["kernel_fields"]


def kernel_fields(gpu: bool, *, transformer_engine: bool = False, bias_activation: bool = True) -> Dict[str, bool]:
    """``TransformerConfig`` fields choosing the kernels; ``bias_activation``: the layers have
    a bias or SwiGLU for the bias-activation fusion to fuse."""
    return dict(
        use_cpu_initialization=True,
        gradient_accumulation_fusion=gpu and transformer_engine,
        bias_activation_fusion=gpu and bias_activation,
        bias_dropout_fusion=gpu,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        batch_p2p_comm=False,
        deallocate_pipeline_outputs=gpu,
    )
