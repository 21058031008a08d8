"""What a checkpoint must match to be loaded into a run, in pure Python (both routes).

:data:`MODEL_SHAPE_FLAGS` names every setting that changes the parameters' names or shapes;
:class:`CheckpointError` is what a checkpoint that does not fit raises (the scripts exit 1 with
its message). :mod:`megatron_bitpipe.checkpoint_checks` holds the checks themselves. Importable
before torch: the scripts parse their flags first.
"""

from __future__ import annotations

import argparse
from typing import Callable, Dict

__all__ = ["CheckpointError", "MODEL_SHAPE_FLAGS"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run; the message says why (flag, parameter)."""


#: flag -> its value in a run's arguments (or a checkpoint's saved ones), for every setting that
#: changes the parameters' names or shapes. The attributes are Megatron-LM's argument names, so
#: a checkpoint of Megatron-LM's scripts is read the same way; one its arguments lack counts as
#: Megatron-LM's default.
MODEL_SHAPE_FLAGS: Dict[str, Callable[[argparse.Namespace], object]] = {
    "--num-layers": lambda a: a.num_layers,
    "--hidden-size": lambda a: a.hidden_size,
    "--ffn-hidden-size": lambda a: a.ffn_hidden_size,
    "--num-attention-heads": lambda a: a.num_attention_heads,
    "--num-query-groups": lambda a: a.num_query_groups if getattr(a, "group_query_attention", False) else a.num_attention_heads,
    "--kv-channels": lambda a: a.kv_channels,
    "padded vocabulary (--vocab-size, --tokenizer-type, --make-vocab-size-divisible-by)": lambda a: a.padded_vocab_size,
    "--max-position-embeddings": lambda a: a.max_position_embeddings,
    "--position-embedding-type": lambda a: getattr(a, "position_embedding_type", "learned_absolute"),
    "--normalization": lambda a: getattr(a, "normalization", "LayerNorm"),
    "--swiglu": lambda a: bool(getattr(a, "swiglu", False)),
    "--disable-bias-linear": lambda a: not getattr(a, "add_bias_linear", True),
    "--untie-embeddings-and-output-weights": lambda a: bool(getattr(a, "untie_embeddings_and_output_weights", False)),
}
