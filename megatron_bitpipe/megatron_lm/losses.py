"""Loss reports where Megatron-LM's training loop reads them: on the last pipeline stage.

Megatron-LM's ``train_step`` and ``evaluate`` average the list returned by the
``forward_backward_func`` on ``is_pipeline_last_stage()`` ranks only, and expect it to hold one
report per micro-batch of the step. BitPipe computes the losses on both edge ranks: pipeline
rank 0 those of pipeline A (its micro-batches), pipeline rank D-1 those of pipeline B.
:func:`make_megatron_lm_forward_backward_func` runs a step
(:func:`~megatron_bitpipe.execution.forward_backward.make_step_func`) and then sends pipeline
rank 0's reports to pipeline rank D-1 of the same (tensor, data) slice, which returns all of
them in micro-batch order; every other rank returns ``[]``, as with megatron's own schedules.

A report is a dict of tensors (Megatron-LM's ``{'lm loss': tensor([sum, tokens])}`` or scalar
losses); all reports of a step must have the same keys and shapes. They travel as one float64
tensor (exact for token counts below 2**53) and come back with their own dtypes.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from ..execution.forward_backward import make_step_func, pipeline_groups_of
from ..execution.groups import PipelineGroups
from ..schedules import ScheduleChoice

__all__ = ["gather_losses_on_last_stage", "make_megatron_lm_forward_backward_func"]

Report = Dict[str, torch.Tensor]


def _flatten(microbatch: int, report: Report) -> torch.Tensor:
    if not isinstance(report, dict):
        raise TypeError(f"loss reports must be dicts of tensors to reach the last pipeline stage, got {type(report).__name__}")
    values = [torch.as_tensor(report[key]).detach().reshape(-1).to(torch.float64) for key in sorted(report)]
    return torch.cat([torch.tensor([float(microbatch)], dtype=torch.float64, device=values[0].device), *values])


def _unflatten(row: torch.Tensor, template: Report) -> Report:
    report, offset = {}, 1
    for key in sorted(template):
        like = torch.as_tensor(template[key])
        report[key] = row[offset : offset + like.numel()].reshape(like.shape).to(like.dtype)
        offset += like.numel()
    return report


def gather_losses_on_last_stage(reports: List[Report], microbatches: List[int], groups: PipelineGroups) -> List[Report]:
    """All loss reports of the step on pipeline rank D-1, in micro-batch order; ``[]`` elsewhere.

    ``reports[i]`` is micro-batch ``microbatches[i]``'s report on this rank. Collective between
    pipeline ranks 0 and D-1 of this (tensor, data) slice; other ranks return at once.
    """
    first, last = 0, groups.grid.pp - 1
    if groups.pp_rank == first:
        rows = torch.stack([_flatten(m, r) for m, r in zip(microbatches, reports)])
        shape = torch.tensor(rows.shape, dtype=torch.int64, device=rows.device)
        dist.send(shape, groups.pp_global_rank(last), group=groups.pp)
        dist.send(rows, groups.pp_global_rank(last), group=groups.pp)
        return []
    if groups.pp_rank != last:
        return []
    mine = torch.stack([_flatten(m, r) for m, r in zip(microbatches, reports)])
    shape = torch.empty(2, dtype=torch.int64, device=mine.device)
    dist.recv(shape, groups.pp_global_rank(first), group=groups.pp)
    if shape[1].item() != mine.shape[1]:
        raise ValueError(
            f"loss reports differ between pipeline ranks {first} and {last}: {shape[1].item() - 1} vs "
            f"{mine.shape[1] - 1} values per micro-batch"
        )
    theirs = torch.empty(tuple(shape.tolist()), dtype=torch.float64, device=mine.device)
    dist.recv(theirs, groups.pp_global_rank(first), group=groups.pp)
    rows = torch.cat([theirs, mine])
    rows = rows[rows[:, 0].argsort()]
    return [_unflatten(row, reports[0]) for row in rows]


def make_megatron_lm_forward_backward_func(choice: ScheduleChoice) -> Callable:
    """A forward_backward_func (megatron's keyword arguments) running ``choice``'s step, whose
    loss reports end up on the last pipeline stage (module docstring).

    With ``collect_non_loss_data`` the reports are returned where they were computed.
    """
    step = make_step_func(choice)

    def forward_backward(**kwargs) -> list:
        result = step(**kwargs)
        if kwargs.get("collect_non_loss_data"):
            return result.loss_reports()
        model = kwargs["model"]
        groups = pipeline_groups_of(list(model) if isinstance(model, (list, tuple)) else [model])
        return gather_losses_on_last_stage(result.loss_reports(), result.loss_microbatches, groups)

    forward_backward.__name__ = f"forward_backward_{choice.schedule}_for_megatron_lm"
    return forward_backward
