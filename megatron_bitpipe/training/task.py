"""What a model brings to the training loop: :class:`PretrainTask`.

The loop (:func:`megatron_bitpipe.training.loop.pretrain`) is model-agnostic; a task
supplies the model provider, the ``forward_step_func`` megatron's schedules call and the
datasets: :class:`megatron_bitpipe.training.gpt.GPTTask`,
:class:`megatron_bitpipe.training.bert.BertTask`.

Contract of the loss: ``forward_step(data_iterator, model)`` returns ``(output,
loss_func)`` like Megatron-LM's, and ``loss_func(output)`` returns ``(loss_sum, num_tokens,
{name: tensor([loss_sum, num_tokens]) for name in task.loss_names})``: megatron-core divides
the loss by the token count (and by the micro-batches), the loop reports ``sum / count`` of
each name over the global batch.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

from ..checkpoint_rules import MODEL_SHAPE_FLAGS

if TYPE_CHECKING:  # the flags are parsed before torch and megatron-core are imported
    from ..model.build import PipelineModel
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


class PretrainTask(TaskArguments):
    """A model family for :func:`~megatron_bitpipe.training.loop.pretrain`; override the
    methods that raise ``NotImplementedError``."""

    #: short name, used in logs and checkpoints
    name: str = "model"
    #: keys of the loss reports, e.g. ``("lm loss",)``
    loss_names: Tuple[str, ...] = ("lm loss",)
    #: whether each token attends to the tokens before it only (GPT) or to the whole
    #: sequence (BERT); the model FLOPs of the logs count the attention scores accordingly
    causal_attention: bool = True

    def model_flags(self) -> Dict[str, Callable[[argparse.Namespace], object]]:
        """flag -> its value in a run's (or checkpoint's) arguments, for everything that fixes
        the parameters' names and shapes; a checkpoint loads only into a model with the same
        values (:data:`~megatron_bitpipe.checkpoint_rules.MODEL_SHAPE_FLAGS` and the task's own)."""
        return dict(MODEL_SHAPE_FLAGS)

    def build_model(self, args: argparse.Namespace, run: RunConfig) -> PipelineModel:
        """This rank's chunks of ``run``'s placement, initialised from ``--seed`` alone, wrapped in
        megatron DDP (a collective call: it creates the process groups)."""
        raise NotImplementedError

    def forward_step(self, data_iterator, model):
        """megatron-core's ``forward_step_func``; see the module docstring for the loss."""
        raise NotImplementedError

    def build_datasets(self, args: argparse.Namespace, tokenizer) -> Tuple[object, Optional[object], Optional[object]]:
        """``(train, valid, test)`` random-access datasets of samples; valid None without
        evaluation, test None where there is no test split (evaluated once, after training)."""
        raise NotImplementedError

    def iteration_losses(self, losses: Dict[str, float]) -> Tuple[Dict[str, float], Dict[str, object]]:
        """A training iteration's reduced losses -> (the losses it logs, further JSON/line
        fields for :attr:`~.logs.IterationRecord.extra`)."""
        return losses, {}

    def adjust_tensor_shapes_fn(self, model: PipelineModel) -> Optional[Callable]:
        """megatron's ``adjust_tensor_shapes_fn`` for the pipeline p2p shapes (None: [s, b, h])."""
        return None
