"""The optimizer of a pipeline model (:class:`~megatron_bitpipe.model.build.PipelineModel`):
megatron-core's, one of :mod:`megatron_bitpipe.optimizers`, megatron's distributed optimizer per
chunk, or a fused array's (:mod:`megatron_bitpipe.hfta.optimizer`).

Above both :mod:`megatron_bitpipe.model` and :mod:`megatron_bitpipe.hfta`, which builds its
arrays from the model's pieces.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.optimizer import OptimizerConfig

from ..execution.distributed_optimizer import build_distributed_optimizer
from ..hfta.optimizer import build_hfta_optimizer
from ..hfta.settings import HftaSettings
from ..model.build import PipelineModel
from ..optimizers import OptimizerChoice, build_megatron_optimizer

__all__ = ["build_optimizer"]


def build_optimizer(
    model: PipelineModel,
    optimizer_config: OptimizerConfig,
    choice: OptimizerChoice = OptimizerChoice(),
    hfta: Optional[HftaSettings] = None,
):
    """megatron-core's optimizer for ``model``'s chunks (``choice``: Adam, or one of
    :mod:`megatron_bitpipe.optimizers`; ``hfta``: the fused array ``model`` holds, None for
    other models — the run's ``RunConfig.hfta``).

    Non-distributed (``optimizer_config.use_distributed_optimizer`` false): one optimizer over
    all chunks, grad norm over the model-parallel group; the second replica's parameters are
    marked ``shared`` (:mod:`megatron_bitpipe.execution.replicas`), so the norm and clipping count every logical
    parameter once.

    Distributed: one megatron ``DistributedOptimizer`` per chunk, each sharding its chunk's
    state over the chunk's grad-sync group (the replicas of its stage x data parallel: the
    group its gradients are reduce-scattered over), so every element has one owner in the
    job; the grad norm sums every rank's shards once (``intra_dist_opt``, all ranks); see
    :mod:`megatron_bitpipe.execution.distributed_optimizer`. ValueError if the model's DDP and ``optimizer_config``
    disagree about the distributed optimizer.

    A fused array (:mod:`megatron_bitpipe.hfta`): one Adam per model over its slices, each with
    its own learning rate, grad norm and clipping (:mod:`megatron_bitpipe.hfta.optimizer`); its
    DDP all-reduces, and with ``optimizer_config.use_distributed_optimizer`` each model's
    optimizer holds this rank's shares of its state.
    """
    if hfta is not None:
        return build_hfta_optimizer(optimizer_config, model, hfta)
    distributed = optimizer_config.use_distributed_optimizer
    if distributed != model.chunks[0].ddp_config.use_distributed_optimizer:
        raise ValueError(
            "the optimizer and the model's DDP must agree on use_distributed_optimizer "
            f"(optimizer {distributed}, DDP {not distributed})"
        )
    if not distributed:
        return build_megatron_optimizer(
            optimizer_config, choice, list(model.chunks), use_gloo_process_groups=False, pg_collection=model.groups.rank_pgs
        )
    if choice.name != "adam":
        raise ValueError(f"the distributed optimizer is megatron's Adam, not {choice.name}")
    return build_distributed_optimizer(model.chunks, model.groups, optimizer_config)
