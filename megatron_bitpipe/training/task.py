"""What a model family brings to the training loop: :class:`PretrainTask`.

The loop (:func:`megatron_bitpipe.training.loop.run_training`) is model-agnostic; a task
supplies its flags, the datasets and what a checkpoint must match
(:class:`megatron_bitpipe.training.gpt.GPTTask`, :class:`megatron_bitpipe.training.bert.BertTask`).
The model itself — chunks, forward step, loss reports, pipeline p2p shapes — comes from the
task's model kinds (:class:`~.model_kind.ModelKind`, registered under the task's
:attr:`~PretrainTask.name` in :mod:`.model_registry`), one of which the run's decisions choose.

Contract of the loss: a kind's forward step ``forward_step(data_iterator, model)`` returns
``(output, loss_func)`` like Megatron-LM's, and ``loss_func(output)`` returns ``(loss_sum,
num_tokens, {name: tensor([loss_sum, num_tokens]) for name in the kind's loss names})``:
megatron-core divides the loss by the token count (and by the micro-batches), the loop
reports ``sum / count`` of each name over the global batch.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

from ..checkpoint_rules import MODEL_SHAPE_FLAGS

if TYPE_CHECKING:
    from ..run_config import RunConfig

__all__ = ["PretrainTask", "TaskArguments"]

class TaskArguments:
    """A task's own flags and their checks. Pure Python, importable without torch or
    megatron-core: the scripts parse and check the flags before they import the task
    (:func:`~megatron_bitpipe.training.script.run_script`)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the task's own flags (the common ones exist already)."""

    def validate(self, args: argparse.Namespace) -> List[str]:
        """Problems with the parsed flags, each naming its flag (no communication)."""
        return []

    def task_settings(self, args: argparse.Namespace) -> object:
        """The task's own decisions of checked flags, typed (None: it has none):
        :attr:`~megatron_bitpipe.run_config.RunConfig.task_settings`, which its datasets and
        model kinds read."""
        return None


class PretrainTask(TaskArguments):
    """A model family for :func:`~megatron_bitpipe.training.loop.run_training`; override the
    methods that raise ``NotImplementedError`` and register the family's model kinds under
    :attr:`name`."""

    #: short name, used in logs and checkpoints, and the task of its model kinds
    name: str = "model"

    def model_flags(self) -> Dict[str, Callable[[argparse.Namespace], object]]:
        """flag -> its value in a run's (or checkpoint's) arguments, for everything that fixes
        the parameters' names and shapes; a checkpoint loads only into a model with the same
        values (:data:`~megatron_bitpipe.checkpoint_rules.MODEL_SHAPE_FLAGS` and the task's own)."""
        return dict(MODEL_SHAPE_FLAGS)

    def build_datasets(self, run: RunConfig, tokenizer) -> Tuple[object, Optional[object], Optional[object]]:
        """``(train, valid, test)`` random-access datasets of samples (as many as ``run``'s global
        batches read: ``run.data``, with the task's ``run.task_settings``); valid None without
        evaluation, test None where there is no test split (evaluated once, after training)."""
        raise NotImplementedError
