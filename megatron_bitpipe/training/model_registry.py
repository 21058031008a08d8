"""The model kinds by name: the one list the training loop chooses a run's model from.

:data:`REGISTRY` (a :class:`~megatron_bitpipe.registry.Registry`) maps each name to its
:class:`~.model_kind.ModelKind` (each task module's ``KINDS``), in the order listings show them; :func:`register` adds one (a name may be
registered once); :func:`model_kind` looks one up with a message listing the names;
:func:`model_kind_for` chooses a run's kind among its task's, once per run, from the run's
decisions.

The choice: the task's kind whose :attr:`~.model_kind.ModelKind.chosen_when` holds for the
run, else its plain kind (``chosen_when`` None). A run whose decisions ask for two kinds of
its task is refused (the flags' checks refuse such combinations first, naming the flags).
"""

from __future__ import annotations

from typing import Tuple

from ..registry import Registry
from ..run_config import RunConfig
from . import bert, gpt
from .model_kind import ModelKind

__all__ = ["REGISTRY", "model_kind", "model_kind_for", "register", "task_kinds"]

#: model kind name -> kind, in listing order
REGISTRY: Registry[ModelKind] = Registry(
    "a model kind", lambda name, names: ValueError(f"unknown model kind {name!r}; choose from {names}")
)


def register(kind: ModelKind) -> ModelKind:
    """Add ``kind`` under its name; :class:`ValueError` if the name is taken or ``kind`` would be
    a second plain kind of its task."""
    second_plain = kind.chosen_when is None and any(other.chosen_when is None for other in task_kinds(kind.task))
    if second_plain and kind.name not in REGISTRY:
        raise ValueError(f"the {kind.task} task has a plain model kind already; {kind.name!r} needs a chosen_when")
    return REGISTRY.add(kind)


#: ``model_kind(name)``: the kind called ``name`` (:class:`ValueError` naming the choices)
model_kind = REGISTRY.lookup


def task_kinds(task: str) -> Tuple[ModelKind, ...]:
    """The kinds the task named ``task`` offers, in listing order."""
    return tuple(kind for kind in REGISTRY.values() if kind.task == task)


def model_kind_for(task: str, run: RunConfig) -> ModelKind:
    """The kind of the task named ``task`` that ``run`` trains (see the module docstring);
    :class:`ValueError` for a task without kinds or a run asking for two."""
    kinds = task_kinds(task)
    if not kinds:
        offering = sorted({kind.task for kind in REGISTRY.values()})
        raise ValueError(f"no model kind is registered for the task {task!r}; tasks with kinds: {', '.join(offering)}")
    chosen = [kind.name for kind in kinds if kind.chosen_when is not None and kind.chosen_when(run)]
    if len(chosen) > 1:
        raise ValueError(f"the run asks for the {task} model kinds {' and '.join(chosen)}; a model is of one kind")
    if chosen:
        return REGISTRY[chosen[0]]
    plain = [kind for kind in kinds if kind.chosen_when is None]
    if not plain:
        raise ValueError(f"the run asks for none of the {task} model kinds {', '.join(k.name for k in kinds)}")
    return plain[0]


for _kind in (*gpt.KINDS, *bert.KINDS):
    register(_kind)
