"""Checks that a model fits Optimus 2D, reported with the megatron flag to change.

Everything here is pure Python and runs before any process group is touched, so a bad
configuration fails fast with one message listing every problem.
"""

from __future__ import annotations

from typing import Dict, Optional


def check_optimus_settings(
    tensor_parallel_size: int,
    divisible_by_side: Dict[str, Optional[int]],
    unsupported: Dict[str, bool],
    divisible_by_tp_size: Dict[str, Optional[int]] = None,
) -> int:
    """Validate a configuration for a q×q mesh; return q.

    Args:
        tensor_parallel_size: ``--tensor-model-parallel-size`` (must be q², q ≥ 2).
        divisible_by_side: flag → size that must be a multiple of q (``None`` = not set).
        unsupported: flag → whether that feature is switched on (it must not be).
        divisible_by_tp_size: flag → size that must be a multiple of q² (``None`` = not set).

    Raises:
        ValueError: naming every offending flag.
    """
    from .mesh import mesh_side  # mesh.py imports torch.distributed

    side = mesh_side(tensor_parallel_size)
    problems = [
        f"{flag} ({size}) must be divisible by q={side}"
        for flag, size in divisible_by_side.items()
        if size is not None and size % side
    ]
    problems += [
        f"{flag} ({size}) must be a multiple of the TP size q*q={side * side}"
        for flag, size in (divisible_by_tp_size or {}).items()
        if size is not None and size % (side * side)
    ]
    problems += [f"{flag} is not supported" for flag, enabled in unsupported.items() if enabled]
    if problems:
        raise ValueError(
            "--tensor-parallel-mode optimus2d with --tensor-model-parallel-size "
            f"{tensor_parallel_size}: " + "; ".join(problems)
        )
    return side


def check_optimus_model_config(
    config,
    tensor_parallel_size: int,
    vocab_size: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
) -> int:
    """Validate a megatron-core ``TransformerConfig`` (and sizes) for Optimus 2D; return q."""
    return check_optimus_settings(
        tensor_parallel_size,
        divisible_by_side={
            "--micro-batch-size": micro_batch_size,
            "--hidden-size": config.hidden_size,
            "--num-attention-heads": config.num_attention_heads,
            "--num-query-groups": config.num_query_groups,
            "--ffn-hidden-size": config.ffn_hidden_size,
        },
        divisible_by_tp_size={"padded vocabulary size": vocab_size},
        unsupported=unsupported_features(config),
    )


def unsupported_features(settings) -> Dict[str, bool]:
    """flag → enabled, for features Optimus 2D does not implement (args or config names)."""

    def on(name: str) -> bool:
        return bool(getattr(settings, name, None))

    return {
        "--sequence-parallel": on("sequence_parallel"),
        "--context-parallel-size > 1": (getattr(settings, "context_parallel_size", 1) or 1) > 1,
        "--num-experts": on("num_moe_experts") or on("num_experts"),
        "--qk-layernorm": on("qk_layernorm"),
        "--multi-latent-attention": on("multi_latent_attention"),
        "--mtp-num-layers": on("mtp_num_layers"),
        "--tp-comm-overlap": on("tp_comm_overlap"),
        "--fp8-format": on("fp8"),
        "--apply-layernorm-1p": on("layernorm_zero_centered_gamma") or on("apply_layernorm_1p"),
        "--attention-output-gate": on("attention_output_gate"),
    }
