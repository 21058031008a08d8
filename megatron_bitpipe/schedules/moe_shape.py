"""The mixture-of-experts layers of a GPT as Megatron-LM's MoE flags give them, and how their
experts spread over expert-parallel ranks.

:class:`MoEShape` holds the flags (attribute names are Megatron-LM's without ``--``);
:class:`~.model_shape.ModelShape` counts an MoE layer's parameters, FLOPs, activations and
all-to-all bytes from them. An MoE layer is a transformer layer whose MLP is replaced by a
router (``E x h`` weights), ``E`` experts (MLPs of ``--moe-ffn-hidden-size``) of which each
token goes to ``--moe-router-topk``, and an optional shared expert every token goes through.

Tokens per expert are the balanced expectation: the ``s b`` tokens of a micro-batch on each of
the ``EP`` expert-parallel ranks make ``s b k`` expert inputs per rank (``k`` the top-k); with
``--moe-expert-capacity-factor c < 1`` an expert keeps ``c`` of its expected tokens and drops
the rest, with ``c >= 1`` or dropless (no factor, the default) it keeps all of them. Routing
imbalance is left out. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

__all__ = ["MoEShape"]


@dataclass(frozen=True)
class MoEShape:
    """Megatron-LM's MoE flags.

    Attributes:
        num_experts: ``E``, experts of every MoE layer.
        moe_router_topk: ``k``, experts each token goes to (Megatron-LM's default 2).
        moe_ffn_hidden_size: an expert's hidden size (default: the model's ``--ffn-hidden-size``).
        moe_layer_freq: every ``N``-th layer is an MoE layer (an int), or one 0/1 per layer.
        moe_shared_expert_intermediate_size: the shared expert's hidden size (None: none).
        moe_expert_capacity_factor: tokens an expert keeps, as a fraction of its expected tokens
            (None: dropless, every token kept).
        expert_model_parallel_size: ``EP``, ranks the experts of a layer are spread over
            (``E / EP`` each); the ranks of one group are data-parallel copies of one stage.

    Invariants (checked): ``E >= 1``, ``1 <= k <= E``, ``EP`` divides ``E``, sizes ``>= 1``,
    the capacity factor ``> 0``, an int frequency ``>= 1`` and a list of 0/1 only (its length
    is checked against ``--num-layers`` by :class:`~.model_shape.ModelShape`).
    """

    num_experts: int
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_layer_freq: Union[int, Tuple[int, ...]] = 1
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_expert_capacity_factor: Optional[float] = None
    expert_model_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"--num-experts must be >= 1 (got {self.num_experts})")
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(f"--moe-router-topk must be in [1, --num-experts {self.num_experts}] (got {self.moe_router_topk})")
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {value})")
        if self.expert_model_parallel_size < 1 or self.num_experts % self.expert_model_parallel_size:
            raise ValueError(
                f"--expert-model-parallel-size {self.expert_model_parallel_size} must be >= 1 and divide --num-experts {self.num_experts}"
            )
        if self.moe_expert_capacity_factor is not None and self.moe_expert_capacity_factor <= 0:
            raise ValueError(f"--moe-expert-capacity-factor must be > 0 (got {self.moe_expert_capacity_factor:g})")
        freq = self.moe_layer_freq
        if isinstance(freq, int) and freq < 1:
            raise ValueError(f"--moe-layer-freq must be >= 1 (got {freq})")
        if not isinstance(freq, int) and any(v not in (0, 1) for v in freq):
            raise ValueError(f"--moe-layer-freq: a list holds one 0 or 1 per layer (got {list(freq)})")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global (0-based) layer ``layer`` is an MoE layer (Megatron-LM's pattern:
        ``layer % N == 0`` for an int ``N``)."""
        freq = self.moe_layer_freq
        return layer % freq == 0 if isinstance(freq, int) else bool(freq[layer])

    @property
    def experts_per_rank(self) -> int:
        """``E / EP``."""
        return self.num_experts // self.expert_model_parallel_size

    @property
    def kept_fraction(self) -> float:
        """Of an expert's expected tokens, those it computes: ``min(1, c)``, 1 when dropless."""
        factor = self.moe_expert_capacity_factor
        return 1.0 if factor is None else min(1.0, factor)

    @property
    def sent_fraction(self) -> float:
        """Of the tokens dispatched, those that go to another expert-parallel rank: ``(EP - 1) / EP``."""
        return (self.expert_model_parallel_size - 1) / self.expert_model_parallel_size

    def all_to_all_bytes(self, tokens: int, hidden_size: int, element_bytes: int) -> float:
        """Bytes one all-to-all (dispatch or combine) of one MoE layer sends off each rank for a
        micro-batch of ``tokens`` tokens (``s b``) of ``hidden_size`` elements of
        ``element_bytes``: ``(EP - 1) / EP x s b K c' h e``."""
        return self.sent_fraction * tokens * self.moe_router_topk * self.kept_fraction * hidden_size * element_bytes

    def layer_count(self, num_layers: int) -> int:
        """MoE layers among ``num_layers`` layers; ValueError for a list frequency of another
        length."""
        if not isinstance(self.moe_layer_freq, int) and len(self.moe_layer_freq) != num_layers:
            raise ValueError(
                f"--moe-layer-freq: the list holds {len(self.moe_layer_freq)} entries, one per layer of --num-layers {num_layers}"
            )
        return sum(self.is_moe_layer(layer) for layer in range(num_layers))
