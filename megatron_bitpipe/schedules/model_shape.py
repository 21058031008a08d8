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

Mixture-of-experts layers (``moe``, :class:`~.moe_shape.MoEShape`; the methods' ``moe=True``)
replace the MLP by a router, ``E / EP`` experts per expert-parallel rank and an optional shared
expert. With ``K`` the top-k, ``c`` the kept fraction of an expert's tokens
(:attr:`~.moe_shape.MoEShape.kept_fraction`), ``m`` the expert's hidden size and ``r`` the
shared expert's (0 without one), ``R = s b K c`` expert inputs per rank and micro-batch:

* parameters per rank: the attention and norms as above, the router ``E h``, ``E / EP``
  experts of ``h m k + m h`` (plus ``m k + h`` biases) and the shared expert ``h r k + r h``
  (plus biases); the experts alone: :meth:`ModelShape.expert_parameters`;
* forward FLOPs: the attention as above, the router ``2 s b h E``, the experts
  ``2 R h m (k + 1)``, the shared expert ``2 s b h r (k + 1)``;
* saved activations: the attention's as above, the router's input (``s b h``) and fp32
  probabilities (``4 s b E`` bytes), every expert input, its first linear's output and its
  second linear's input (``R (h + (k + 1) m)``: top-k times an MLP's), the shared expert's
  ``s b (k + 1) r``; an ``I`` keeps the linears' inputs and output gradients, router
  included (``s b (h + E) + R (h + (k + 1) m) + s b (k + 1) r`` besides the attention's);
* all-to-all: the dispatch sends the ``R`` expert inputs (``R h`` elements) to the experts'
  ranks and the combine sends their outputs back, each moving the part that leaves the rank,
  ``(EP - 1) / EP`` of it (:meth:`ModelShape.all_to_all_bytes`); a backward runs both again.

Context parallelism (``context_parallel_size``, ``CP``; ``--context-parallel-size``,
:mod:`megatron_bitpipe.model.context_parallel`) cuts every sequence into ``2 CP`` chunks of
``c = s / (2 CP)`` tokens, rank ``r`` holding chunks ``r`` and ``2 CP - 1 - r``. Every count above
is then one context-parallel rank's: ``s b`` becomes the rank's ``s b / CP`` tokens (linear FLOPs,
saved activations, the embedding's and the head's, pipeline messages ``[s / CP, b, h]``), except

* attention: the rank's queries read the keys up to their own chunk's end, each diagonal block
  computed whole and masked: ``(2 CP + 1) c^2`` (query, key) pairs per sequence
  (:attr:`ModelShape.attention_pairs`; the whole ``s^2`` at ``CP = 1``), so the scores and context
  cost ``4 b h`` FLOPs per pair and materialised scores ``a b`` elements per pair;
* the gathered keys and values the attention keeps for its backward: ``2 s b g d`` elements
  per layer instead of the rank's own ``2 s b g d / CP``;
* the key/value exchange (:meth:`ModelShape.context_exchange_bytes`): per layer and
  micro-batch, ``F``'s all-gather brings ``2 (CP - 1) / CP x s b g d`` elements onto the rank,
  and the backward's reduce-scatter of their gradients (in ``B``, or a split backward's ``I``;
  none in ``W``) sends as many off it.

Context parallelism with MoE layers is not modelled (training refuses it too).

Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from .moe_shape import MoEShape

__all__ = ["ATTENTION_BACKENDS", "NORMALIZATIONS", "POSITION_EMBEDDINGS", "ModelShape", "shape_problems"]

#: Megatron-LM's ``--attention-backend`` values and this package's ``sdpa`` (torch's fused attention in
#: local layers); those in :data:`_MATERIALISED_SCORES` keep the s x s scores
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local", "sdpa")
_MATERIALISED_SCORES = ("unfused", "local")
#: ``--normalization`` values: parameters per hidden channel
NORMALIZATIONS = {"LayerNorm": 2, "RMSNorm": 1}
#: the simulator's ``--position-embedding-type`` values (only ``learned_absolute`` has parameters;
#: training takes Megatron-LM's other names too, costed as parameter-free)
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
_INDEX_BYTES = 8  # int64 token and position indices
_FP32_BYTES = 4


@dataclass(frozen=True)
class ModelShape:
    """A megatron-core GPT's sizes (attribute names are Megatron-LM's flags without ``--``).

    Invariants (checked, :func:`shape_problems` — the one statement of these rules, which
    training's flag check uses too): every size ``>= 1``; ``num_attention_heads`` divides
    ``hidden_size`` and ``num_query_groups`` divides ``num_attention_heads``; with learned
    absolute positions ``max_position_embeddings >= seq_length``; dropouts in ``[0, 1)``.
    ``ffn_hidden_size`` defaults to ``4h``, ``num_query_groups`` to the heads,
    ``max_position_embeddings`` to ``seq_length``, ``kv_channels`` to ``h / a``;
    ``context_parallel_size >= 1``, and above 1 it divides ``seq_length`` in ``2 CP`` equal chunks
    and the layers are dense. ``vocab_size``
    is the tokenizer's (None where the shape is made before the tokenizer, as on Megatron-LM's
    route: :attr:`padded_vocab_size` then raises). ``norm_epsilon``, ``init_method_std`` and
    ``rotary_base`` (RoPE's base) change no count here; they are what the model is built with. ``moe`` (None: every layer dense) makes
    the layers its frequency selects mixture-of-experts layers; a list frequency holds one
    entry per layer.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: Optional[int] = None
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
    kv_channels: Optional[int] = None
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    rotary_base: int = 10000
    moe: Optional[MoEShape] = None
    context_parallel_size: int = 1

    def __post_init__(self) -> None:
        problems = shape_problems(
            self.num_layers, self.hidden_size, self.num_attention_heads, self.seq_length,
            micro_batch_size=self.micro_batch_size, ffn_hidden_size=self.ffn_hidden_size,
            num_query_groups=self.num_query_groups, kv_channels=self.kv_channels,
            position_embedding_type=self.position_embedding_type, max_position_embeddings=self.max_position_embeddings,
            make_vocab_size_divisible_by=self.make_vocab_size_divisible_by, vocab_size=self.vocab_size,
            hidden_dropout=self.hidden_dropout, attention_dropout=self.attention_dropout,
            context_parallel_size=self.context_parallel_size,
        )  # fmt: skip
        if self.normalization not in NORMALIZATIONS:
            problems.append(f"--normalization: choose from {', '.join(NORMALIZATIONS)} (got {self.normalization!r})")
        if self.attention_backend not in ATTENTION_BACKENDS:
            problems.append(f"--attention-backend: choose from {', '.join(ATTENTION_BACKENDS)} (got {self.attention_backend!r})")
        if self.moe and self.context_parallel_size > 1:
            problems.append(f"--context-parallel-size {self.context_parallel_size} with --num-experts is not modelled")
        if problems:
            raise ValueError(problems[0])
        if self.moe:
            self.moe.layer_count(self.num_layers)  # a list frequency holds one entry per layer

    # sizes
    @property
    def head_channels(self) -> int:
        """``d``: channels per attention head (``--kv-channels``, default ``h / a``)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

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
        return self.query_groups * self.head_channels

    @property
    def padded_vocab_size(self) -> int:
        """``V``: the vocabulary rounded up to a multiple of ``--make-vocab-size-divisible-by``."""
        if self.vocab_size is None:
            raise ValueError("the model's vocabulary size is not known (--vocab-size, or the tokenizer's)")
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple

    @property
    def _gate(self) -> int:
        return 2 if self.swiglu else 1

    @property
    def _tokens(self) -> int:
        """``s b / CP``: one context-parallel rank's tokens of a micro-batch."""
        return self.seq_length * self.micro_batch_size // self.context_parallel_size

    @property
    def attention_pairs(self) -> int:
        """(query, key) pairs one rank's attention computes per sequence: ``s^2`` at ``CP = 1``,
        else ``(2 CP + 1) c^2`` with ``c = s / (2 CP)`` (module docstring)."""
        cp, s = self.context_parallel_size, self.seq_length
        if cp == 1:
            return s * s
        chunk = s // (2 * cp)
        return (2 * cp + 1) * chunk * chunk

    def context_exchange_bytes(self, element_bytes: int) -> float:
        """Bytes of one layer's key/value exchange for one micro-batch: what ``F``'s all-gather
        brings onto a rank, and what the backward's reduce-scatter (``B`` or ``I``) sends off it,
        ``2 (CP - 1) / CP x s b g d e``; 0 at ``CP = 1``."""
        cp = self.context_parallel_size
        return 2 * (cp - 1) / cp * self.seq_length * self.micro_batch_size * self.kv_size * element_bytes

    # mixture of experts
    def is_moe_layer(self, layer: int) -> bool:
        """Whether global (0-based) layer ``layer`` is a mixture-of-experts layer."""
        return self.moe is not None and self.moe.is_moe_layer(layer)

    def moe_layer_count(self, first: int, count: int) -> int:
        """MoE layers among the global layers ``[first, first + count)``."""
        return sum(self.is_moe_layer(layer) for layer in range(first, first + count))

    @property
    def _expert_ffn(self) -> int:
        return self.moe.moe_ffn_hidden_size or self.ffn

    @property
    def _shared_ffn(self) -> int:
        return self.moe.moe_shared_expert_intermediate_size or 0

    @property
    def _routed_tokens(self) -> float:
        """``R = s b K c``: expert inputs per rank and micro-batch."""
        return self._tokens * self.moe.moe_router_topk * self.moe.kept_fraction

    def _mlp_parameters(self, ffn: int) -> int:
        h = self.hidden_size
        return h * ffn * self._gate + ffn * h + ((ffn * self._gate + h) if self.add_bias_linear else 0)

    def all_to_all_bytes(self, element_bytes: int) -> float:
        """Bytes one all-to-all (dispatch or combine) of one MoE layer sends off each rank for
        one micro-batch: ``(EP - 1) / EP x R h e`` (0 without MoE layers)."""
        return self.moe.all_to_all_bytes(self._tokens, self.hidden_size, element_bytes) if self.moe else 0.0

    def expert_parameters(self) -> int:
        """The experts of one MoE layer on one expert-parallel rank (``E / EP`` MLPs); 0
        without MoE layers."""
        return self.moe.experts_per_rank * self._mlp_parameters(self._expert_ffn) if self.moe else 0

    # parameters (counts)
    def norm_parameters(self) -> int:
        """One layer norm (``2h``) or RMS norm (``h``)."""
        return NORMALIZATIONS[self.normalization] * self.hidden_size

    def layer_parameters(self, moe: bool = False) -> int:
        """One transformer layer: QKV, output projection, the MLP's two linears (biases unless
        ``--disable-bias-linear``) and two norms; ``moe``: an MoE layer's on one
        expert-parallel rank, the router, its experts and the shared expert instead of the MLP."""
        h, qkv = self.hidden_size, self.hidden_size + 2 * self.kv_size
        attention = h * qkv + h * h + ((qkv + h) if self.add_bias_linear else 0) + 2 * self.norm_parameters()
        if not moe:
            return attention + self._mlp_parameters(self.ffn)
        shared = self._mlp_parameters(self._shared_ffn) if self._shared_ffn else 0
        return attention + self.moe.num_experts * h + self.expert_parameters() + shared

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
    def layer_forward_flops(self, moe: bool = False) -> float:
        """Matrix-multiply FLOPs of one layer's forward: QKV ``2 s b h (h + 2gd)``, scores and
        context ``4 b s^2 h`` (``4 b h`` per pair of :attr:`attention_pairs`), projection ``2 s b h^2``, MLP ``2 s b h f (k + 1)``; ``moe``: an
        MoE layer's on one rank, router, experts and shared expert instead of the MLP (module
        docstring)."""
        t, h = self._tokens, self.hidden_size
        scores = 4 * self.micro_batch_size * self.attention_pairs * h
        attention = 2 * t * h * (h + 2 * self.kv_size) + scores + 2 * t * h * h
        if not moe:
            return attention + 2 * t * h * self.ffn * (self._gate + 1)
        experts = 2 * self._routed_tokens * h * self._expert_ffn * (self._gate + 1)
        return attention + 2 * t * h * self.moe.num_experts + experts + 2 * t * h * self._shared_ffn * (self._gate + 1)

    def message_bytes(self, element_bytes: int) -> int:
        """One pipeline message (an activation or its gradient between stages): ``[s, b, h]``."""
        return self._tokens * self.hidden_size * element_bytes

    def head_forward_flops(self) -> int:
        """The output layer's forward, ``2 s b h V`` (the loss's elementwise work left out)."""
        return 2 * self._tokens * self.hidden_size * self.padded_vocab_size

    # activations (bytes of one micro-batch)
    def _linear_activation_elements(self, moe: bool = False) -> float:
        """Every linear's input and output kept for the backward (the MLP's first input, ``h``,
        being the router's and the shared expert's too), router output included for ``moe``."""
        t, h = self._tokens, self.hidden_size
        attention = t * (6 * h + 2 * self.kv_size)
        if not moe:
            return attention + t * (self._gate + 1) * self.ffn
        experts = self._routed_tokens * (h + (self._gate + 1) * self._expert_ffn)
        return attention + t * self.moe.num_experts + experts + t * (self._gate + 1) * self._shared_ffn

    def layer_activation_bytes(self, element_bytes: int, moe: bool = False) -> float:
        """What one layer's forward saves for its backward (module docstring); ``moe``: an MoE
        layer's, whose router probabilities are fp32; under context parallelism with the
        gathered keys and values."""
        t, a = self._tokens, self.num_attention_heads
        router = t * self.moe.num_experts if moe else 0  # fp32 probabilities
        total = element_bytes * (self._linear_activation_elements(moe) - router) + _FP32_BYTES * router
        # the gathered keys and values: the whole sequence's instead of the rank's own
        others = self.seq_length * self.micro_batch_size - t  # the other context-parallel ranks' tokens
        total += element_bytes * 2 * self.kv_size * others
        if self.attention_backend in _MATERIALISED_SCORES:
            scores = a * self.micro_batch_size * self.attention_pairs
            total += element_bytes * scores
            if self.attention_dropout > 0:
                total += (element_bytes + 1) * scores
        else:
            total += _FP32_BYTES * a * t
        if self.hidden_dropout > 0:
            total += 2 * t * self.hidden_size
        return total

    def layer_weight_grad_bytes(self, element_bytes: int, moe: bool = False) -> float:
        """What a split backward's ``I`` of one layer (``moe``: an MoE layer) keeps for its
        ``W``: every linear's input and output gradient."""
        return element_bytes * self._linear_activation_elements(moe)

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


def shape_problems(
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    seq_length: int,
    *,
    micro_batch_size: int = 1,
    ffn_hidden_size: Optional[int] = None,
    num_query_groups: Optional[int] = None,
    kv_channels: Optional[int] = None,
    position_embedding_type: str = "learned_absolute",
    max_position_embeddings: Optional[int] = None,
    make_vocab_size_divisible_by: int = 128,
    vocab_size: Optional[int] = None,
    hidden_dropout: float = 0.0,
    attention_dropout: float = 0.0,
    context_parallel_size: int = 1,
) -> List[str]:
    """Every rule a GPT's sizes break, one message per rule naming the flag (Megatron-LM's
    names); ``[]`` if none. Optional sizes are checked when given. Pure."""
    sizes = dict(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                 seq_length=seq_length, micro_batch_size=micro_batch_size, ffn_hidden_size=ffn_hidden_size,
                 num_query_groups=num_query_groups, kv_channels=kv_channels,
                 max_position_embeddings=max_position_embeddings,
                 make_vocab_size_divisible_by=make_vocab_size_divisible_by, vocab_size=vocab_size,
                 context_parallel_size=context_parallel_size)  # fmt: skip
    problems = [f"{_flag(name)} must be >= 1 (got {value})" for name, value in sizes.items() if value is not None and value < 1]
    if problems:
        return problems
    if hidden_size % num_attention_heads:
        problems.append(f"--num-attention-heads {num_attention_heads} must divide --hidden-size {hidden_size}")
    if num_query_groups is not None and num_attention_heads % num_query_groups:
        problems.append(f"--num-query-groups {num_query_groups} must divide --num-attention-heads {num_attention_heads}")
    if position_embedding_type == "learned_absolute" and (max_position_embeddings or seq_length) < seq_length:
        problems.append(f"--max-position-embeddings {max_position_embeddings} must be >= --seq-length {seq_length}")
    if context_parallel_size > 1 and seq_length % (2 * context_parallel_size):
        problems.append(
            f"--context-parallel-size {context_parallel_size} needs --seq-length {seq_length} divisible by "
            f"2 x {context_parallel_size} (two equal chunks per rank)"
        )
    for name, value in (("hidden_dropout", hidden_dropout), ("attention_dropout", attention_dropout)):
        if not 0.0 <= value < 1.0:
            problems.append(f"{_flag(name)} must be in [0, 1) (got {value})")
    return problems


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")
