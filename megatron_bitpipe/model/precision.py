"""Half-precision (bf16 / fp16) wrapping of model chunks whose stage is not their rank's.

megatron-core's ``Float16Module`` casts inputs on the first *pipeline rank* and upcasts
outputs to fp32 on the last one. In a V placement the loss chunk of pipeline A lives on
rank 0 and the embedding chunk of pipeline B on rank ``D-1``, so those decisions must
follow the chunk's stage instead: :class:`ChunkFloat16Module` casts float inputs of a
chunk holding stage 0 (``pre_process``) and upcasts the outputs (the loss) of a chunk
holding the last stage (``post_process``).
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module, float16_to_fp32, fp32_to_float16

__all__ = ["ChunkFloat16Module"]


class ChunkFloat16Module(Float16Module):
    """``Float16Module`` whose casts follow the wrapped chunk's pre/post-process flags."""

    def __init__(self, config: TransformerConfig, module: torch.nn.Module):
        super().__init__(config, module)
        self.pre_process = bool(getattr(module, "pre_process", False))
        self.post_process = bool(getattr(module, "post_process", False))

    def forward(self, *inputs, fp32_output: bool = True, **kwargs):
        if self.pre_process:
            inputs = fp32_to_float16(inputs, self.float16_convertor)
        outputs = self.module(*inputs, **kwargs)
        if self.post_process and fp32_output:
            outputs = float16_to_fp32(outputs)
        return outputs
