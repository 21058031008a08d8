"""Mixture-of-experts flags (Megatron-LM's names and defaults) and the decisions made from them.

:func:`add_moe_args` adds ``--num-experts``, ``--moe-router-topk``, ``--moe-ffn-hidden-size``,
``--moe-layer-freq``, ``--moe-token-dispatcher-type``, ``--moe-router-load-balancing-type``,
``--moe-aux-loss-coeff``, ``--moe-z-loss-coeff``, ``--moe-shared-expert-intermediate-size``,
``--moe-expert-capacity-factor`` (None: dropless), ``--expert-model-parallel-size`` and
``--expert-tensor-parallel-size``; :func:`moe_problems` states their rules (one line each,
naming the flag); :class:`MoESettings` holds a checked run's choice, made once
(:attr:`megatron_bitpipe.run_config.RunConfig.moe`), and gives megatron-core's
``TransformerConfig`` fields (:meth:`MoESettings.transformer_fields`).

Where experts live: ``--expert-model-parallel-size`` E splits each MoE layer's routed experts
over E consecutive data-parallel ranks of one pipeline rank. Those ranks run one plan and so
one layer at a time, which the tokens' all-to-all (or all-gather) needs; E must divide the
data-parallel size. Expert tensor parallelism equals tensor parallelism.

Pure Python, no torch: checked before any process group exists.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

__all__ = ["MoESettings", "add_moe_args", "expert_bias_problems", "moe_problems", "moe_settings", "parse_moe_layer_freq"]

DISPATCHERS = ("allgather", "alltoall", "flex")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
#: the log name of each load-balancing loss (Megatron-LM's)
LOAD_BALANCING_LOSSES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}
_PATTERN = re.compile(r"^[\[\]\(\)\d\s,*+]+$")


def parse_moe_layer_freq(text: str) -> Union[int, List[int]]:
    """``--moe-layer-freq``: an integer N (an MoE layer every N layers) or a list expression of
    0/1 per layer such as ``"([1]*3+[0]*1)*2"`` (Megatron-LM's forms); evaluated with
    brackets, digits, commas, ``*`` and ``+`` only."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    if not _PATTERN.match(text):
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor a list expression of 0s and 1s")
    try:
        value = eval(text, {"__builtins__": {}}, {})  # noqa: S307 - characters restricted above
    except Exception as error:  # a malformed expression
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    if not isinstance(value, list) or not all(v in (0, 1) for v in value):
        raise argparse.ArgumentTypeError(f"{text!r} must give a list of 0s and 1s")
    return value


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    """The mixture-of-experts flags, Megatron-LM's names and defaults."""
    group = parser.add_argument_group(title="mixture of experts")
    group.add_argument("--num-experts", type=int, default=None, help="routed experts per MoE layer (None: a dense model)")
    group.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    group.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="an expert's hidden size (default --ffn-hidden-size)")
    group.add_argument(
        "--moe-layer-freq",
        type=parse_moe_layer_freq,
        default=1,
        help="an MoE layer every N layers (N), or 1/0 per layer as a list expression, e.g. '([1]*3+[0]*1)*2'",
    )
    group.add_argument("--moe-token-dispatcher-type", choices=DISPATCHERS, default="allgather")
    group.add_argument("--moe-router-load-balancing-type", nargs="+", choices=LOAD_BALANCING_TYPES, default="aux_loss")
    group.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0)
    group.add_argument("--moe-z-loss-coeff", type=float, default=None)
    group.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    group.add_argument(
        "--moe-expert-capacity-factor",
        type=float,
        default=None,
        help="tokens an expert takes per micro-batch, as a multiple of an even share (default: dropless, every token)",
    )
    group.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="ranks each MoE layer's experts are split over: consecutive data-parallel ranks of one pipeline rank",
    )
    group.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="default --tensor-model-parallel-size")


def _single(value):
    """Megatron-LM's rule: a one-element list of ``nargs='+'`` is its element."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _listed(value) -> Tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


@dataclass(frozen=True)
class MoESettings:
    """A mixture-of-experts model's choice (the flags of the module docstring, checked).

    ``ffn_hidden_size`` is resolved (``--ffn-hidden-size`` by default); ``layer_freq``,
    ``load_balancing_type`` and ``aux_loss_coeff`` are a value or a tuple (Megatron-LM's
    forms); ``capacity_factor`` None means dropless; ``expert_parallel`` is the experts'
    split, ``expert_tensor_parallel`` the tensor-parallel size.
    """

    num_experts: int
    router_topk: int
    ffn_hidden_size: int
    layer_freq: Union[int, Tuple[int, ...]]
    dispatcher: str
    load_balancing_type: Union[str, Tuple[str, ...]]
    aux_loss_coeff: Union[float, Tuple[float, ...]]
    z_loss_coeff: Optional[float]
    shared_expert_intermediate_size: Optional[int]
    capacity_factor: Optional[float]
    expert_parallel: int
    expert_tensor_parallel: int

    @property
    def dropless(self) -> bool:
        """Every token reaches its experts (no capacity factor)."""
        return self.capacity_factor is None

    def num_moe_layers(self, num_layers: int) -> int:
        """MoE layers among ``num_layers`` (megatron's reading of ``--moe-layer-freq``)."""
        if isinstance(self.layer_freq, int):
            return len(range(0, num_layers, self.layer_freq))
        return sum(self.layer_freq)

    @property
    def logged_losses(self) -> Tuple[str, ...]:
        """The auxiliary losses the logs report, Megatron-LM's names."""
        names = tuple(LOAD_BALANCING_LOSSES[t] for t in _listed(self.load_balancing_type) if t in LOAD_BALANCING_LOSSES)
        return names + (("z_loss",) if self.z_loss_coeff is not None else ())

    def transformer_fields(self) -> dict:
        """megatron-core ``TransformerConfig`` fields of this choice."""
        return dict(
            num_moe_experts=self.num_experts,
            moe_router_topk=self.router_topk,
            moe_ffn_hidden_size=self.ffn_hidden_size,
            moe_layer_freq=list(self.layer_freq) if isinstance(self.layer_freq, tuple) else self.layer_freq,
            moe_token_dispatcher_type=self.dispatcher,
            moe_router_load_balancing_type=_as_config(self.load_balancing_type),
            moe_aux_loss_coeff=_as_config(self.aux_loss_coeff),
            moe_z_loss_coeff=self.z_loss_coeff,
            moe_shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            moe_expert_capacity_factor=self.capacity_factor,
            expert_model_parallel_size=self.expert_parallel,
            expert_tensor_parallel_size=self.expert_tensor_parallel,
        )


def _as_config(value):
    return list(value) if isinstance(value, tuple) else value


def moe_settings(args: argparse.Namespace) -> Optional[MoESettings]:
    """The checked flags' :class:`MoESettings`; None for a dense model (no ``--num-experts``,
    or a namespace without the flags)."""
    if getattr(args, "num_experts", None) in (None, 0):
        return None
    freq = args.moe_layer_freq
    return MoESettings(
        num_experts=args.num_experts,
        router_topk=args.moe_router_topk,
        ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
        layer_freq=tuple(freq) if isinstance(freq, list) else freq,
        dispatcher=args.moe_token_dispatcher_type,
        load_balancing_type=_tuple_or_value(_single(args.moe_router_load_balancing_type)),
        aux_loss_coeff=_tuple_or_value(_single(args.moe_aux_loss_coeff)),
        z_loss_coeff=args.moe_z_loss_coeff,
        shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        capacity_factor=args.moe_expert_capacity_factor,
        expert_parallel=args.expert_model_parallel_size,
        expert_tensor_parallel=args.expert_tensor_parallel_size or args.tensor_model_parallel_size,
    )


def _tuple_or_value(value):
    return tuple(value) if isinstance(value, list) else value


def expert_bias_problems(args: argparse.Namespace) -> List[str]:
    """Linear biases in megatron-core's local experts: their MLP adds the bias into its output in
    place (``output += output_bias * per_token_scale``, 0.16.1 to 0.19.2), which autograd refuses
    in the first forward; one line, or none (``--disable-bias-linear``, or no ``--num-experts``)."""
    sequential = not getattr(args, "moe_grouped_gemm", False)  # megatron-core's SequentialMLP of MLP experts
    if getattr(args, "num_experts", None) and getattr(args, "add_bias_linear", False) and sequential:
        return ["--num-experts needs --disable-bias-linear: megatron-core's local expert MLP adds its bias into its "
                "output in place, which autograd refuses in the first forward (Megatron-LM's MoE examples set it)"]  # fmt: skip
    return []


def moe_problems(args: argparse.Namespace) -> List[str]:
    """The mixture-of-experts flags' rules on a parsed namespace with its derived sizes
    (``data_parallel_size``); one line per broken rule, naming the flag."""
    experts = getattr(args, "num_experts", None)
    ep = getattr(args, "expert_model_parallel_size", 1)
    if not experts:
        if ep != 1:
            return [f"--expert-model-parallel-size {ep} needs --num-experts"]
        return []
    problems = []
    if experts < 1:
        problems.append(f"--num-experts must be positive (got {experts})")
    if ep < 1 or experts % ep:
        problems.append(f"--num-experts {experts} must be a multiple of --expert-model-parallel-size {ep}")
    elif args.data_parallel_size % ep:
        problems.append(
            f"--expert-model-parallel-size {ep} must divide the data-parallel size {args.data_parallel_size}: the experts "
            "are split over data-parallel copies of one pipeline rank, which run each layer at the same time"
        )
    expert_tp = args.expert_tensor_parallel_size
    if expert_tp not in (None, args.tensor_model_parallel_size):
        problems.append(
            f"--expert-tensor-parallel-size {expert_tp} must equal --tensor-model-parallel-size "
            f"{args.tensor_model_parallel_size} (experts are split like the dense layers)"
        )
    if not 1 <= args.moe_router_topk <= experts:
        problems.append(f"--moe-router-topk {args.moe_router_topk} must be between 1 and --num-experts {experts}")
    if args.moe_token_dispatcher_type == "flex":
        problems.append("--moe-token-dispatcher-type flex needs DeepEP / HybridEP; use allgather or alltoall")
    balancing = _listed(_single(args.moe_router_load_balancing_type))
    coeffs = _listed(_single(args.moe_aux_loss_coeff))
    if "global_aux_loss" in balancing:
        problems.append(
            "--moe-router-load-balancing-type global_aux_loss is not supported: its statistics span the data-parallel "
            "ranks and micro-batches of a step, which pipelines of several replicas run at different times"
        )
    if len(balancing) > 1 and len(coeffs) != len(balancing):
        problems.append(
            f"--moe-aux-loss-coeff needs one value per --moe-router-load-balancing-type ({len(balancing)}), got {len(coeffs)}"
        )
    factor = args.moe_expert_capacity_factor
    if factor is not None and set(balancing) - {"aux_loss", "seq_aux_loss", "none"}:
        problems.append("--moe-expert-capacity-factor works with --moe-router-load-balancing-type aux_loss, seq_aux_loss or none")
    problems += expert_bias_problems(args)
    if getattr(args, "tensor_parallel_mode", "1d") != "1d":
        problems.append("--num-experts needs --tensor-parallel-mode 1d (Optimus 2D layers have no experts)")
    if getattr(args, "hfta_models", None):
        problems.append("--num-experts cannot be combined with --hfta-models (a fused array has no MoE layers)")
    if getattr(args, "transformer_impl", None) == "transformer_engine":
        problems.append("--num-experts builds megatron-core's local MoE layers: drop --transformer-impl transformer_engine")
    if getattr(args, "data_parallel_mode", "sync") != "sync":
        problems.append(f"--num-experts trains with --data-parallel-mode sync, not {args.data_parallel_mode}")
    return problems
