"""A GPT's sizes as Megatron-LM's flags give them, and what follows from them: parameters,
matrix-multiply FLOPs and the activation bytes one micro-batch leaves saved for its backward.

:class:`ModelShape` describes megatron-core's ``GPTModel`` without tensor or sequence
parallelism (one tensor-parallel rank) and without activation recomputation: an embedding
(word embeddings, plus learned absolute position embeddings), ``num_layers`` transformer layers
(pre-norm attention and MLP) and a head (final norm, output layer, cross-entropy loss).

Units: parameters and elements are counts, FLOPs are floating-point operations of one
micro-batch (a multiply-add is 2), bytes are bytes. ``s`` is the sequence length, ``b`` the
micro-batch size, ``h`` the hidden size, ``a`` the attention heads, ``g`` the query groups,
``d = h / a`` the channels per head, ``f`` the MLP's hidden size, ``k`` 2 for a gated MLP
(``--swiglu``) else 1, ``V`` the padded vocabulary and ``e`` the activation element's bytes
(2 with ``--bf16``, else 4).

Saved activations of one transformer layer (:meth:`ModelShape.layer_activation_bytes`), what
the forward leaves for the backward, in elements of ``e`` bytes:

* ``s b (6h + 2gd + (k + 1) f)``: the two norms' inputs (``2 s b h``), the QKV input, query,
  key and value (``s b h + s b h + 2 s b g d``), the output projection's input (``s b h``),
  the first MLP linear's input (``s b h``), its output (the activation's input, ``k s b f``)
  and the second linear's input (``s b f``) — for ``g = a``, ``f = 4h``: ``16 s b h``;
* attention with the ``s x s`` scores materialised (``--attention-backend unfused`` or
  ``local``): the softmax output ``a b s^2``, and with ``--attention-dropout`` its dropout
  output ``a b s^2`` and mask (``a b s^2`` bytes); a fused or flash attention
  (``auto``, ``flash``, ``fused``) keeps the softmax's log-sum-exp instead (``a b s`` fp32);
* with ``--hidden-dropout``: the two dropout masks (``2 s b h`` bytes).

With ``e = 2``, unfused attention and both dropouts that is Korthikanti et al.'s
``s b h (34 + 5 a s / h)`` bytes. The embedding saves its token (and position) indices (int64)
and its dropout mask; the head saves the final norm's and the output layer's inputs
(``2 s b h`` elements) and the cross entropy's softmax in fp32 (``4 s b V`` bytes).

A split backward's input-gradient step (``I``) frees all of that and keeps, for its deferred
weight gradients (``W``), every linear's input and output gradient
(:meth:`ModelShape.layer_weight_grad_bytes`: ``s b (6h + 2gd + (k + 1) f)`` elements per
layer; the head: ``s b (h + V)``).

Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["ATTENTION_BACKENDS", "NORMALIZATIONS", "POSITION_EMBEDDINGS", "ModelShape"]

#: Megatron-LM's ``--attention-backend`` values; those in :data:`_MATERIALISED_SCORES` keep the s x s scores
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
_MATERIALISED_SCORES = ("unfused", "local")
#: ``--normalization`` values: parameters per hidden channel
NORMALIZATIONS = {"LayerNorm": 2, "RMSNorm": 1}
#: ``--position-embedding-type`` values (only ``learned_absolute`` has parameters)
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
_INDEX_BYTES = 8  # int64 token and position indices
_FP32_BYTES = 4


@dataclass(frozen=True)
class ModelShape:
    """A megatron-core GPT's sizes (attribute names are Megatron-LM's flags without ``--``).

    Invariants (checked): every size ``>= 1``; ``num_attention_heads`` divides ``hidden_size``
    and ``num_query_groups`` divides ``num_attention_heads``; dropouts in ``[0, 1)``.
    ``ffn_hidden_size`` defaults to ``4h``, ``num_query_groups`` to the heads,
    ``max_position_embeddings`` to ``seq_length``.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    micro_batch_size: int = 1
    ffn_hidden_size: Optional[int] = None
    num_query_groups: Optional[int] = None
    swiglu: bool = False
    add_bias_linear: bool = True
    normalization: str = "LayerNorm"
    position_embedding_type: str = "learned_absolute"
    max_position_embeddings: Optional[int] = None
    untie_embeddings_and_output_weights: bool = False
    make_vocab_size_divisible_by: int = 128
    attention_backend: str = "auto"
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size", "micro_batch_size",
                     "make_vocab_size_divisible_by"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        for name in ("ffn_hidden_size", "num_query_groups", "max_position_embeddings"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {value})")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--num-attention-heads {self.num_attention_heads} must divide --hidden-size {self.hidden_size}")
        if self.num_attention_heads % self.query_groups:
            raise ValueError(f"--num-query-groups {self.query_groups} must divide --num-attention-heads {self.num_attention_heads}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"--normalization: choose from {', '.join(NORMALIZATIONS)} (got {self.normalization!r})")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ValueError(f"--position-embedding-type: choose from {', '.join(POSITION_EMBEDDINGS)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend: choose from {', '.join(ATTENTION_BACKENDS)}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1) (got {getattr(self, name)})")

    # sizes
    @property
    def ffn(self) -> int:
        """The MLP's hidden size ``f``."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        """``g``: key/value heads (the attention heads without grouped-query attention)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_size(self) -> int:
        """``g d``: the key's (and the value's) channels per token."""
        return self.query_groups * (self.hidden_size // self.num_attention_heads)

    @property
    def padded_vocab_size(self) -> int:
        """``V``: the vocabulary rounded up to a multiple of ``--make-vocab-size-divisible-by``."""
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple

    @property
    def _gate(self) -> int:
        return 2 if self.swiglu else 1

    @property
    def _tokens(self) -> int:
        return self.seq_length * self.micro_batch_size

    # parameters (counts)
    def norm_parameters(self) -> int:
        """One layer norm (``2h``) or RMS norm (``h``)."""
        return NORMALIZATIONS[self.normalization] * self.hidden_size

    def layer_parameters(self) -> int:
        """One transformer layer: QKV, output projection, the MLP's two linears (biases unless
        ``--disable-bias-linear``) and two norms."""
        h, f, qkv = self.hidden_size, self.ffn, self.hidden_size + 2 * self.kv_size
        weights = h * qkv + h * h + h * f * self._gate + f * h
        biases = (qkv + h + f * self._gate + h) if self.add_bias_linear else 0
        return weights + biases + 2 * self.norm_parameters()

    def embedding_parameters(self) -> int:
        """Word embeddings ``V h`` plus learned absolute position embeddings."""
        positions = self.max_position_embeddings or self.seq_length
        absolute = self.position_embedding_type == "learned_absolute"
        return self.padded_vocab_size * self.hidden_size + (positions * self.hidden_size if absolute else 0)

    def output_layer_parameters(self) -> int:
        """The output layer's weight ``V h`` (no bias): its own with
        ``--untie-embeddings-and-output-weights``, else the word embeddings' (or their copy)."""
        return self.padded_vocab_size * self.hidden_size

    # FLOPs (one micro-batch)
    def layer_forward_flops(self) -> int:
        """Matrix-multiply FLOPs of one layer's forward: QKV ``2 s b h (h + 2gd)``, scores and
        context ``4 b s^2 h``, projection ``2 s b h^2``, MLP ``2 s b h f (k + 1)``."""
        t, s, h, f = self._tokens, self.seq_length, self.hidden_size, self.ffn
        return 2 * t * h * (h + 2 * self.kv_size) + 4 * t * s * h + 2 * t * h * h + 2 * t * h * f * (self._gate + 1)

    def head_forward_flops(self) -> int:
        """The output layer's forward, ``2 s b h V`` (the loss's elementwise work left out)."""
        return 2 * self._tokens * self.hidden_size * self.padded_vocab_size

    # activations (bytes of one micro-batch)
    def _linear_activation_elements(self) -> int:
        h, f = self.hidden_size, self.ffn
        return self._tokens * (6 * h + 2 * self.kv_size + (self._gate + 1) * f)

    def layer_activation_bytes(self, element_bytes: int) -> int:
        """What one layer's forward saves for its backward (module docstring)."""
        t, s, a = self._tokens, self.seq_length, self.num_attention_heads
        total = element_bytes * self._linear_activation_elements()
        if self.attention_backend in _MATERIALISED_SCORES:
            scores = a * t * s
            total += element_bytes * scores
            if self.attention_dropout > 0:
                total += (element_bytes + 1) * scores
        else:
            total += _FP32_BYTES * a * t
        if self.hidden_dropout > 0:
            total += 2 * t * self.hidden_size
        return total

    def layer_weight_grad_bytes(self, element_bytes: int) -> int:
        """What a split backward's ``I`` of one layer keeps for its ``W``: every linear's input
        and output gradient."""
        return element_bytes * self._linear_activation_elements()

    def embedding_activation_bytes(self) -> int:
        """The embedding's saved indices (token, and position with learned absolute positions)
        and its dropout mask."""
        indices = 2 if self.position_embedding_type == "learned_absolute" else 1
        mask = self._tokens * self.hidden_size if self.hidden_dropout > 0 else 0
        return _INDEX_BYTES * indices * self._tokens + mask

    def head_activation_bytes(self, element_bytes: int) -> int:
        """The final norm's and output layer's inputs and the loss's fp32 softmax."""
        t = self._tokens
        return element_bytes * 2 * t * self.hidden_size + _FP32_BYTES * t * self.padded_vocab_size

    def head_weight_grad_bytes(self, element_bytes: int) -> int:
        """What the output layer's ``I`` keeps for its ``W``: its input and output gradient."""
        return element_bytes * self._tokens * (self.hidden_size + self.padded_vocab_size)
