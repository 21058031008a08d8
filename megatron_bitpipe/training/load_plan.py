"""What ``--load`` takes from a checkpoint and what it refuses: a pure plan, decided before any
tensor is read.

:func:`~.checkpoint.load_checkpoint` reads the checkpoint's common state (the saving run's
flags, which top-level entries it holds), describes it as a :class:`SavedCheckpoint`, and asks
:func:`plan_load` what to do with this run's :class:`LoadFlags`:

* the weights, always;
* the progress counters (iteration, consumed samples) unless fine-tuning: ``--finetune``, or a
  release checkpoint (Megatron-LM's ``release`` directory);
* the optimizer state and the learning-rate schedule unless fine-tuning or
  ``--no-load-optim``;
* the random generators unless fine-tuning or ``--no-load-rng``, only where the tensor- and
  pipeline-parallel sizes are the saving run's (the ranks correspond, as Megatron-LM requires)
  and the saving run kept them (not ``--no-save-rng``).

Refused, in this order, each under its heading (:class:`Refusal`): a checkpoint of another task's
model; one of a different model (the caller's model-flag comparison); loading an optimizer
from a checkpoint saved without one (``--no-save-optim``; the hint names ``--no-load-optim``
and ``--finetune``) or with another optimizer's state (1-bit LAMB's per-rank state also from
another layout); and a learning-rate schedule that differs from this run's flags (the caller's
comparison), when the optimizer is loaded.

Invariant: the plan depends only on what it is given, the same on every rank, so every rank
raises the same refusals (``tests/training/test_load_plan.py``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

from ..run_config import RunConfig

__all__ = ["LAYOUT_FLAGS", "LoadFlags", "SavedCheckpoint", "Refusal", "LoadPlan", "plan_load"]

#: what fixes which rank holds which parameters (1-bit LAMB's per-rank state follows it)
LAYOUT_FLAGS = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                "virtual_pipeline_model_parallel_size", "schedule", "tensor_parallel_mode")  # fmt: skip


@dataclass(frozen=True)
class LoadFlags:
    """This run's choices that decide what a ``--load`` takes.

    Attributes:
        finetune: ``--finetune`` (the weights only, from iteration 0).
        no_load_optim: ``--no-load-optim``.
        no_load_rng: ``--no-load-rng``.
        tensor_model_parallel_size, pipeline_model_parallel_size: this run's sizes.
        optimizer: ``--optimizer``.
        layout: this run's values of :data:`LAYOUT_FLAGS`.
    """

    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    optimizer: str = "adam"
    layout: Tuple[object, ...] = ()

    @classmethod
    def from_run(cls, run: RunConfig, args: argparse.Namespace) -> "LoadFlags":
        """The flags of a run of the pretrain scripts (``args``: the flags the run config
        does not hold: ``--optimizer`` and the layout flags' spellings, as checkpoint metadata
        records them)."""
        return cls(
            finetune=run.checkpointing.finetune,
            no_load_optim=run.checkpointing.no_load_optim,
            no_load_rng=run.checkpointing.no_load_rng,
            tensor_model_parallel_size=run.layout.tensor,
            pipeline_model_parallel_size=run.layout.pipeline,
            optimizer=getattr(args, "optimizer", "adam"),
            layout=tuple(getattr(args, flag, None) for flag in LAYOUT_FLAGS),
        )


@dataclass(frozen=True)
class SavedCheckpoint:
    """What a checkpoint's common state says about the run that saved it.

    Attributes:
        task: the saving run's task (``gpt``, ``bert``; Megatron-LM's checkpoints name none:
            the loading task's).
        release: a release checkpoint (weights to start from).
        has_optimizer: it holds an optimizer state (not saved with ``--no-save-optim``).
        has_rng: the saving run kept its random generators (not ``--no-save-rng``).
        tensor_model_parallel_size, pipeline_model_parallel_size: the saving run's sizes
            (None where its flags do not say).
        optimizer: the saving run's ``--optimizer``.
        layout: the saving run's values of :data:`LAYOUT_FLAGS`.
    """

    task: str
    release: bool = False
    has_optimizer: bool = True
    has_rng: bool = True
    tensor_model_parallel_size: Optional[int] = None
    pipeline_model_parallel_size: Optional[int] = None
    optimizer: str = "adam"
    layout: Tuple[object, ...] = ()

    @classmethod
    def from_common(cls, common: dict, release: bool, loading_task: str) -> "SavedCheckpoint":
        """From ``dist_checkpointing.load_common_state_dict`` of the checkpoint."""
        saved = common.get("args")
        return cls(
            task=getattr(saved, "task", loading_task),
            release=release,
            has_optimizer="optimizer" in common,
            has_rng=not getattr(saved, "no_save_rng", False),
            tensor_model_parallel_size=getattr(saved, "tensor_model_parallel_size", None),
            pipeline_model_parallel_size=getattr(saved, "pipeline_model_parallel_size", None),
            optimizer=getattr(saved, "optimizer", "adam"),
            layout=tuple(getattr(saved, flag, None) for flag in LAYOUT_FLAGS),
        )


@dataclass(frozen=True)
class Refusal:
    """Why a checkpoint cannot be loaded: ``heading`` (what it does not do, after the
    checkpoint's directory) and ``problems``."""

    heading: str
    problems: Tuple[str, ...]


#: the refusals' headings, in the order they are checked
ANOTHER_TASK = "holds another model"
ANOTHER_MODEL = "holds a different model"
NO_OPTIMIZER = "cannot be resumed"
ANOTHER_OPTIMIZER = "cannot resume this run's optimizer"
ANOTHER_SCHEDULE = ("has another learning-rate schedule (keep it with --use-checkpoint-opt_param-scheduler, or take this "
                    "run's with --override-opt_param-scheduler)")  # fmt: skip
HEADINGS = (ANOTHER_TASK, ANOTHER_MODEL, NO_OPTIMIZER, ANOTHER_OPTIMIZER, ANOTHER_SCHEDULE)


@dataclass(frozen=True)
class LoadPlan:
    """What to load (the weights always) and the refusals, one per heading of :data:`HEADINGS`
    in that order (empty problems where there is nothing to refuse).

    Attributes:
        progress: the iteration and consumed samples (False: start at iteration 0).
        optimizer: the optimizer state and the learning-rate schedule.
        rng: the random generators.
        refusals: one :class:`Refusal` per heading.
    """

    progress: bool
    optimizer: bool
    rng: bool
    refusals: Tuple[Refusal, ...]

    @property
    def finetune(self) -> bool:
        """The weights only, counters from 0 (``--finetune`` or a release checkpoint)."""
        return not self.progress

    @property
    def refused(self) -> bool:
        return any(r.problems for r in self.refusals)


def plan_load(
    saved: SavedCheckpoint,
    flags: LoadFlags,
    task: str,
    model_problems: Sequence[str] = (),
    schedule_problems: Callable[[], Sequence[str]] = tuple,
) -> LoadPlan:
    """The :class:`LoadPlan` of loading ``saved`` into a run of ``task`` with ``flags`` (module
    docstring). ``model_problems``: how the saving run's model flags differ from this run's;
    ``schedule_problems()``: how its learning-rate schedule differs, asked only when the
    optimizer state (and so the schedule) is loaded and the checkpoint has one."""
    finetune = flags.finetune or saved.release
    optimizer = not (finetune or flags.no_load_optim)
    same_ranks = (saved.tensor_model_parallel_size, saved.pipeline_model_parallel_size) == (
        flags.tensor_model_parallel_size, flags.pipeline_model_parallel_size)  # fmt: skip
    rng = not (finetune or flags.no_load_rng) and same_ranks and saved.has_rng
    another_task = [f"it holds a {saved.task} model, this run trains {task}"] if saved.task != task else []
    missing = optimizer and not saved.has_optimizer
    no_optimizer = (
        ["it has no optimizer state (saved with --no-save-optim): pass --no-load-optim or --finetune to load its weights"]
        if missing else []
    )  # fmt: skip
    another_optimizer = _optimizer_problems(saved, flags) if optimizer and not missing else []
    schedule = list(schedule_problems()) if optimizer and not missing else []
    problems = (another_task, list(model_problems), no_optimizer, another_optimizer, schedule)
    return LoadPlan(
        progress=not finetune,
        optimizer=optimizer,
        rng=rng,
        refusals=tuple(Refusal(heading, tuple(p)) for heading, p in zip(HEADINGS, problems)),
    )


def _optimizer_problems(saved: SavedCheckpoint, flags: LoadFlags) -> list:
    """Whether this run's optimizer can take the checkpoint's optimizer state."""
    if saved.optimizer != flags.optimizer:
        return [f"it holds the state of --optimizer {saved.optimizer}, this run uses --optimizer {flags.optimizer} "
                "(--no-load-optim loads the weights only)"]  # fmt: skip
    if flags.optimizer == "onebit_lamb" and saved.layout != flags.layout:
        return [
            f"1-bit LAMB's coefficients and error feedback are per rank and were saved in another layout "
            f"({', '.join(f'{f} {t}' for f, t in zip(LAYOUT_FLAGS, saved.layout))}): resume it in that layout, or "
            "take the weights with --no-load-optim"
        ]
    return []
