"""What a data-parallel mode does inside the training loop: :class:`DataParallelStrategy`, and
what it works with: :class:`TrainingParts`.

The :class:`~megatron_bitpipe.training.loop.Trainer` has no per-mode code: it builds the
strategy registered for the run's mode (:mod:`.mode_registry`) and calls it for

* **the train step** (:meth:`~DataParallelStrategy.train_step`): one iteration, the mode's
  way — the optimizer and learning-rate steps, the progress counters advanced, the
  iteration's record with the mode's **log fields** in ``IterationRecord.extra``;
* **gradient reduction**: what the chunks' DDP reduces over is the mode's
  :attr:`~megatron_bitpipe.data_parallel_modes.DataParallelMode.gradient_reduction`, fixed
  when the model is built (before the strategy exists); any other exchange is the step's;
* **save / resume of its state** (:meth:`~DataParallelStrategy.save`,
  :meth:`~DataParallelStrategy.resume`): what megatron's checkpoint does not hold, in the
  mode's :attr:`~DataParallelStrategy.state_files` next to it;
  :func:`.mode_registry.resume_mode` is the one place that restores it and refuses another
  mode's state;
* **the weights evaluation uses** (:meth:`~DataParallelStrategy.evaluated_weights`, a
  context manager, and :meth:`~DataParallelStrategy.evaluation_fields`, the fields an
  evaluated iteration's record adds);
* **finish** (:meth:`~DataParallelStrategy.finish`): after the last iteration and save.

Invariants: every method is called on every rank, in the same order, so a method may be
collective; a strategy changes the training state only through :class:`TrainingParts` (it
steps the optimizer and the scheduler, advances ``state`` by exactly one iteration per
:meth:`~DataParallelStrategy.train_step`) and holds no reference to the Trainer.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..data_parallel_modes import DataParallelMode
from .rank_state import RankStateFiles

if TYPE_CHECKING:
    from ..model.build import PipelineModel
    from ..run_config import RunConfig
    from .checkpoint import TrainingState
    from .distributed import Distributed
    from .logs import IterationRecord
    from .schedule import Schedule
    from .model_kind import ModelKind

__all__ = ["DataParallelStrategy", "TrainingParts", "reduce_losses"]


@dataclass(frozen=True)
class TrainingParts:
    """The parts of one training job a data-parallel strategy works with (built once by the
    Trainer, after any checkpoint is loaded).

    Attributes:
        args: the checked flags (the model's and the mode's own hyper-parameters).
        run: the run's decisions.
        env: this rank's place in the job (rank, world size, device).
        kind: the run's model kind (forward step, loss names, per-iteration losses and log fields).
        model: this rank's chunks and their process groups.
        optimizer: megatron's optimizer over the chunks (stepped by the strategy).
        scheduler: the learning-rate schedule (stepped by the strategy, in samples).
        schedule: the pipeline schedule that runs micro-batches forward and backward.
        train_data: the training dataset (sample index -> sample).
        state: the progress counters the strategy advances (iterations, samples applied).
        flops_per_iteration: model FLOPs of one global batch (the logs' TFLOP/s).
        wrap_forward_step: applied to the model kind's forward step for training (timing,
            an injected slow rank); the identity by default.
    """

    args: argparse.Namespace
    run: "RunConfig"
    env: "Distributed"
    kind: "ModelKind"
    model: "PipelineModel"
    optimizer: Any
    scheduler: Any
    schedule: "Schedule"
    train_data: Any
    state: "TrainingState"
    flops_per_iteration: float
    wrap_forward_step: Callable[[Callable], Callable] = lambda forward_step: forward_step

    @property
    def forward_step(self) -> Callable:
        """megatron's ``forward_step_func`` of the run's model kind, for training (wrapped by
        :attr:`wrap_forward_step`)."""
        return self.wrap_forward_step(self.kind.forward_step(self.run))

    @property
    def loss_names(self) -> Tuple[str, ...]:
        """The keys of the model kind's loss reports."""
        return self.kind.loss_names(self.run)

    def synchronize(self) -> None:
        """Wait for this rank's device work (timings measure it)."""
        if self.env.device.type == "cuda":
            torch.cuda.synchronize()


def reduce_losses(reports: Sequence[Dict[str, torch.Tensor]], loss_names: Sequence[str], tp_rank: int, device) -> Dict[str, float]:
    """``sum / count`` of each loss over the global batch (a collective over the job).

    ``reports``: this rank's ``{name: [sum, count]}`` per micro-batch. Each loss rank adds
    its reports; only TP rank 0 of a stage contributes, as every TP rank of a loss stage
    holds the same reports.
    """
    totals = torch.zeros(len(loss_names), 2, dtype=torch.float64, device=device)
    if tp_rank == 0:
        for report in reports:
            for i, name in enumerate(loss_names):
                totals[i] += report[name].detach().to(totals)
    dist.all_reduce(totals)
    return {name: (totals[i, 0] / totals[i, 1].clamp(min=1)).item() for i, name in enumerate(loss_names)}


class DataParallelStrategy(abc.ABC):
    """A data-parallel mode inside the training loop (see the module docstring).

    Construction may be collective. Subclasses set :attr:`modes`; the defaults here are a
    mode with no state of its own and megatron's weights for evaluation.
    """

    #: the registered modes this class implements
    modes: ClassVar[Tuple[DataParallelMode, ...]] = ()
    #: the files of the mode's state next to a checkpoint (None: megatron's checkpoint holds it all)
    state_files: ClassVar[Optional[RankStateFiles]] = None

    def __init__(self, mode: DataParallelMode, parts: TrainingParts):
        self.mode, self.parts = mode, parts

    @abc.abstractmethod
    def train_step(self) -> "IterationRecord":
        """One iteration (collective): compute, reduce, step; ``parts.state`` advanced by one
        iteration and by the samples whose gradients were applied."""

    def evaluated_weights(self) -> ContextManager[None]:
        """Inside: the model holds the weights evaluation uses; afterwards the training
        weights, bit for bit (collective)."""
        return contextlib.nullcontext()

    def evaluation_fields(self) -> Dict[str, object]:
        """The fields the record of an iteration with an evaluation adds."""
        return {}

    def save(self, directory: str) -> None:
        """Write the mode's state into checkpoint ``directory`` (before megatron's checkpoint,
        which makes it the latest)."""

    def resume(self, directory: str, common: Optional[dict]) -> None:
        """After megatron's checkpoint ``directory`` is loaded: restore the state :meth:`save`
        wrote (``common``: its JSON file), or, ``common`` None, start from a checkpoint
        without it. CheckpointError naming the flags when this run cannot continue it."""

    @classmethod
    def refusal(cls, directory: str, common: dict) -> str:
        """Why a run of another mode cannot load ``directory``, whose :attr:`state_files`
        hold this mode's state (``common``), naming the flag to resume it with."""
        raise NotImplementedError(f"{cls.__name__} saves no state of its own")

    def finish(self) -> None:
        """After the last iteration (and its checkpoint): say what is left undone."""
