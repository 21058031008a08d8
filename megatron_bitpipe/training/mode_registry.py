"""The data-parallel strategies by mode name: what the training loop builds for the run's
``--data-parallel-mode``, and the one resume of a mode's saved state.

:data:`STRATEGIES` maps each registered mode's name
(:data:`megatron_bitpipe.data_parallel_modes.REGISTRY`) to the
:class:`~.mode.DataParallelStrategy` class that implements it; :func:`register` adds a class
under each of its :attr:`~.mode.DataParallelStrategy.modes` (a name may be registered once);
:func:`build_strategy` builds the run's, with a message listing the names for a mode without
one. :func:`resume_mode` restores the running strategy's state after a checkpoint is loaded,
and refuses a checkpoint that holds another mode's.
"""

from __future__ import annotations

from typing import Dict, Optional, Type

from ..checkpoint_rules import CheckpointError
from ..data_parallel_modes import DataParallelMode
from .abs_sgd.step import AbsSgdStrategy
from .decentralized.step import DecentralizedStrategy
from .mode import DataParallelStrategy, TrainingParts
from .sync import SyncStrategy

__all__ = ["STRATEGIES", "build_strategy", "register", "resume_mode", "saved_mode_state"]

#: mode name -> the strategy class implementing it
STRATEGIES: Dict[str, Type[DataParallelStrategy]] = {}


def register(strategy: Type[DataParallelStrategy]) -> Type[DataParallelStrategy]:
    """Add ``strategy`` under each of its modes' names; :class:`ValueError` if one is taken."""
    for mode in strategy.modes:
        if mode.name in STRATEGIES:
            raise ValueError(f"data-parallel mode {mode.name!r} already has a strategy ({STRATEGIES[mode.name].__name__})")
        STRATEGIES[mode.name] = strategy
    return strategy


def build_strategy(mode: DataParallelMode, parts: TrainingParts) -> DataParallelStrategy:
    """The strategy of ``mode`` over ``parts`` (collective where its construction is);
    :class:`ValueError` naming the modes that have one."""
    try:
        strategy = STRATEGIES[mode.name]
    except KeyError:
        raise ValueError(f"--data-parallel-mode {mode.name} has no training strategy; choose from {', '.join(STRATEGIES)}") from None
    return strategy(mode, parts)


def saved_mode_state(directory: str, strategy: Type[DataParallelStrategy]) -> Optional[dict]:
    """The JSON state ``strategy``'s mode saved next to checkpoint ``directory`` (None if it
    saved none there); :class:`CheckpointError` naming the flag when ``directory`` holds
    another mode's state (which this run cannot continue)."""
    own = strategy.state_files
    for other in dict.fromkeys(STRATEGIES.values()):  # each class once, in registration order
        files = other.state_files
        if files is None or files == own:
            continue
        common = files.read_common(directory)
        if common is not None:
            raise CheckpointError(other.refusal(directory, common))
    return None if own is None else own.read_common(directory)


def resume_mode(directory: str, strategy: DataParallelStrategy) -> None:
    """After loading checkpoint ``directory``: restore ``strategy``'s saved state (or start
    it without), refusing another mode's (:func:`saved_mode_state`)."""
    strategy.resume(directory, saved_mode_state(directory, type(strategy)))


for _strategy in (SyncStrategy, AbsSgdStrategy, DecentralizedStrategy):
    register(_strategy)
