"""Building GPT models for the training loop.

:func:`build_gpt_model` gives this rank's megatron-core ``GPTModel`` chunks of any placement
(``OptimusGPTModel`` chunks with ``--tensor-parallel-mode optimus2d``) through the common
:func:`megatron_bitpipe.training.model.build_model`.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from ..optimus.gpt_model import optimus_p2p_tensor_shapes
from ..runtime.build import PipelineModel
from ..schedules.placement import Placement
from .model import build_model

__all__ = ["build_gpt_model", "optimus_shapes_fn"]


def build_gpt_model(args: argparse.Namespace, placement: Placement) -> PipelineModel:
    """This rank's GPT chunks of ``placement``, seed-initialised and DDP-wrapped (collective)."""
    return build_model(args, placement, rotary_base=args.rotary_base)


def optimus_shapes_fn(model: PipelineModel) -> Optional[Callable]:
    """megatron's ``adjust_tensor_shapes_fn`` for an Optimus model ([s, b/q, h/q]), else None."""
    mesh = model.groups.mesh
    return optimus_p2p_tensor_shapes(mesh) if mesh is not None else None
