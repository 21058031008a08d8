"""Loss reports where Megatron-LM's training loop reads them: on the last pipeline stage.

Megatron-LM's ``train_step`` and ``evaluate`` average the list returned by the
``forward_backward_func`` on ``is_pipeline_last_stage()`` ranks only, and expect it to hold one
report per micro-batch of the step. A plan-executed schedule computes each micro-batch's loss
where its pipeline's last stage lives (:func:`loss_ranks`): BitPipe on pipeline ranks 0
(pipeline A, whose V turns back there) and D-1 (pipeline B), DualPipe and Chimera on D-1
(pipeline A) and 0 (pipeline B), ZB-V and DualPipeV on rank 0 (where their V ends), ZB-H1 on
rank D-1.
:func:`make_megatron_lm_forward_backward_func` runs a step
(:func:`~megatron_bitpipe.execution.forward_backward.make_step_func`) and then sends every other
loss rank's reports to pipeline rank D-1 of the same (tensor, data) slice, which returns all of
them in micro-batch order; every other rank returns ``[]``, as with megatron's own schedules.

A report is a dict of tensors (Megatron-LM's ``{'lm loss': tensor([sum, tokens])}`` or scalar
losses); all reports of a step must have the same keys and shapes. They travel as one float64
tensor (exact for token counts below 2**53) after a small description of their keys, shapes
and dtypes, and come back with their own dtypes.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..execution.forward_backward import make_step_func, pipeline_groups_of
from ..execution.groups import PipelineGroups
from ..schedules import ScheduleChoice
from ..schedules.placement import Placement

__all__ = ["gather_losses_on_last_stage", "loss_ranks", "make_megatron_lm_forward_backward_func"]

Report = Dict[str, torch.Tensor]
Layout = Tuple[Tuple[str, Tuple[int, ...], torch.dtype], ...]
"""A report's keys (sorted), with each value's shape and dtype."""


def loss_ranks(placement: Placement) -> List[int]:
    """The pipeline ranks that compute losses: where some pipeline's last stage lives (sorted)."""
    return sorted({placement.location(p, placement.num_stages - 1).rank for p in range(placement.num_pipelines)})


def _layout(report: Report) -> Layout:
    if not isinstance(report, dict):
        raise TypeError(f"loss reports must be dicts of tensors to reach the last pipeline stage, got {type(report).__name__}")
    return tuple((key, tuple(torch.as_tensor(report[key]).shape), torch.as_tensor(report[key]).dtype) for key in sorted(report))


def _flatten(microbatch: int, report: Report) -> torch.Tensor:
    values = [torch.as_tensor(report[key]).detach().reshape(-1).to(torch.float64) for key in sorted(report)]
    return torch.cat([torch.tensor([float(microbatch)], dtype=torch.float64, device=values[0].device), *values])


def _unflatten(row: torch.Tensor, layout: Layout) -> Report:
    report, offset = {}, 1
    for key, shape, dtype in layout:
        numel = int(torch.Size(shape).numel())
        report[key] = row[offset : offset + numel].reshape(shape).to(dtype)
        offset += numel
    return report


def gather_losses_on_last_stage(reports: List[Report], microbatches: List[int], groups: PipelineGroups) -> List[Report]:
    """All loss reports of the step on pipeline rank D-1, in micro-batch order; ``[]`` elsewhere.

    ``reports[i]`` is micro-batch ``microbatches[i]``'s report on this rank. Collective between
    the :func:`loss_ranks` of the placement and pipeline rank D-1 of this (tensor, data) slice
    (each other loss rank sends its reports' layout, then their rows); other ranks return at once.
    """
    last = groups.grid.pp - 1
    senders = [rank for rank in loss_ranks(groups.placement) if rank != last]
    layouts = {_layout(report) for report in reports}
    if len(layouts) > 1:
        raise ValueError(f"loss reports of one step differ in keys or shapes on pipeline rank {groups.pp_rank}")
    rows = torch.stack([_flatten(m, r) for m, r in zip(microbatches, reports)]) if reports else None
    if groups.pp_rank in senders:
        layout: Optional[Layout] = next(iter(layouts), None)
        dist.send_object_list([layout, 0 if rows is None else rows.shape[0]], groups.pp_global_rank(last), group=groups.pp)
        if rows is not None:
            dist.send(rows, groups.pp_global_rank(last), group=groups.pp)
        return []
    if groups.pp_rank != last:
        return []
    layout = next(iter(layouts), None)
    gathered = [] if rows is None else [rows]
    for sender in senders:
        received: list = [None, None]
        dist.recv_object_list(received, groups.pp_global_rank(sender), group=groups.pp)
        theirs, count = received
        if count == 0:
            continue
        if layout is not None and theirs != layout:
            raise ValueError(f"loss reports differ between pipeline ranks {sender} and {last}: {theirs} vs {layout}")
        layout = theirs
        width = 1 + sum(int(torch.Size(shape).numel()) for _, shape, _ in layout)
        device = rows.device if rows is not None else _receive_device()
        incoming = torch.empty((count, width), dtype=torch.float64, device=device)
        dist.recv(incoming, groups.pp_global_rank(sender), group=groups.pp)
        gathered.append(incoming)
    if not gathered:
        return []
    ordered = torch.cat(gathered)
    ordered = ordered[ordered[:, 0].argsort()]
    return [_unflatten(row, layout) for row in ordered]


def _receive_device() -> torch.device:
    """Where received loss rows land on a last stage without losses of its own (the p2p device)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


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
