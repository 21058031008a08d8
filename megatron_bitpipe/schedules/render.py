"""Pictures of a simulated step: a Gantt chart (PNG) and a Chrome trace (JSON).

Colours encode the pipeline (direction) of each micro-batch; forwards are light,
backwards (``B``, or the input-gradient part ``I`` of a split backward) dark and
weight-gradient actions (``W``) mid-tone and hatched; an overlapped pair (``OVERLAP_F_B``) is one
block, its forward half's colour above its backward half's, labelled ``f/b`` (the two
micro-batches); gradient all-reduces (``SYNC``) are drawn on a thin lane under each rank. Each block is labelled with its micro-batch and, under it, the
stage its chunk holds (:func:`block_label`: ``s0`` is a pipeline's first stage), so the chunks
of a rank (two to four with interleaving, Chimera and BitPipe) tell apart. Chrome traces (``chrome://tracing`` / Perfetto) use one simulator time unit per
millisecond, so costs given in milliseconds read naturally.
"""

from __future__ import annotations

import json
from typing import Dict, List

from .actions import Action, ActionType
from .simulate import Event, SimulationResult

#: (forward, backward or input gradient, weight gradient) colours per pipeline: blue for the
#: down / only pipeline, orange for up.
PIPELINE_COLOURS = (("#9ecae1", "#2171b5", "#4292c6"), ("#fdae6b", "#d94801", "#f16913"))
_SHADE = {ActionType.FORWARD: 0, ActionType.BACKWARD: 1, ActionType.BACKWARD_INPUT: 1, ActionType.BACKWARD_WEIGHT: 2}
_HATCH = {ActionType.BACKWARD_WEIGHT: "///"}
SYNC_COLOUR = "#41ab5d"


def block_label(result: SimulationResult, event: Event) -> str:
    """The Gantt label of ``event``: its micro-batch, and under it the stage its chunk holds
    (``f/b`` and ``sF/sB`` for the forward and backward halves of an overlapped pair)."""
    parts = event.action.parts
    stages = [result.plan.placement.role(event.rank, part.chunk).stage for part in parts]
    return "/".join(str(p.microbatch) for p in parts) + "\n" + "/".join(f"s{stage}" for stage in stages)


def _trace_args(result: SimulationResult, action: Action, rank: int) -> Dict:
    """Chrome-trace ``args`` of a block: pipeline, micro-batch, chunk and stage (an overlapped
    pair's forward half's, its backward half's under ``"backward"``)."""
    role = result.plan.placement.role(rank, action.chunk)
    args = {"pipeline": role.pipeline, "microbatch": action.microbatch, "chunk": action.chunk, "stage": role.stage}
    if action.backward is not None:
        args["backward"] = _trace_args(result, action.backward, rank)
    return args


def chrome_trace(result: SimulationResult) -> Dict:
    """The simulated step as a Chrome trace object (``{"traceEvents": [...]}``)."""
    events: List[Dict] = []
    for rank in range(result.plan.num_ranks):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": 2 * rank, "args": {"name": f"rank {rank} compute"}})
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": 2 * rank + 1, "args": {"name": f"rank {rank} grad sync"}})
    for event, lane in [(e, 0) for e in result.events] + [(e, 1) for e in result.sync_events]:
        events.append(
            {
                "name": str(event.action),
                "cat": event.action.type.name.lower(),
                "ph": "X",
                "pid": 0,
                "tid": 2 * event.rank + lane,
                "ts": event.start * 1000.0,
                "dur": (event.end - event.start) * 1000.0,
                "args": _trace_args(result, event.action, event.rank),
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": result.summary()}


def write_chrome_trace(result: SimulationResult, path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(chrome_trace(result), handle)


def plot_gantt(result: SimulationResult, path: str, title: str | None = None) -> None:
    """Write a Gantt chart of ``result`` to ``path`` (PNG). Needs matplotlib (``[plot]`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    plan = result.plan
    num_ranks = plan.num_ranks
    width = min(24.0, max(8.0, result.makespan * 0.35))
    fig, ax = plt.subplots(figsize=(width, 0.55 * num_ranks + 1.4))
    row_height, sync_height = 0.62, 0.16
    placement = plan.placement
    for event in result.events:
        forward = event.action.type is ActionType.FORWARD
        parts = event.action.parts
        y = num_ranks - 1 - event.rank
        height = row_height / len(parts)  # an overlapped pair: forward half above, backward half below
        for i, part in enumerate(parts):
            colour = PIPELINE_COLOURS[placement.role(event.rank, part.chunk).pipeline % 2][_SHADE[part.type]]
            ax.barh(y + row_height / 2 - height * (i + 0.5), event.end - event.start, left=event.start, height=height,
                    color=colour, edgecolor="white", linewidth=0.6, hatch=_HATCH.get(part.type))
        if event.end - event.start >= 0.4:  # on a hatched W or a pair: a box in its (last half's) colour
            ax.text(
                (event.start + event.end) / 2, y, block_label(result, event),
                ha="center", va="center", fontsize=6, linespacing=1.0, color="black" if forward else "white",
                bbox=dict(facecolor=colour, edgecolor="none", pad=0.3) if len(parts) > 1 or parts[0].type in _HATCH else None,
            )
    for event in result.sync_events:
        y = num_ranks - 1 - event.rank - row_height / 2 - sync_height / 2 - 0.02
        ax.barh(y, max(event.end - event.start, 0.05), left=event.start, height=sync_height, color=SYNC_COLOUR)
    ax.set_yticks(range(num_ranks))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(num_ranks))])
    ax.set_xlim(0, result.makespan)
    unit = " (units of t_F = forward of L/D layers)" if result.costs.t_forward == 1 else ""
    ax.set_xlabel(f"time{unit}; a block: micro-batch over stage (s0 = first stage)")
    heading = title or (
        f"{plan.name}: D={num_ranks}, N={plan.num_microbatches}, "
        f"bubble {100 * result.bubble_ratio:.1f}%, makespan {result.makespan:g}"
    )
    ax.set_title(heading)
    kinds = sorted({p.type for e in result.events for p in e.action.parts}, key=lambda t: "FBIW".index(t.value))
    legend = [Patch(facecolor=PIPELINE_COLOURS[p][_SHADE[kind]], edgecolor="white",
                    hatch=_HATCH.get(kind), label=f"{kind.value} {name}")
              for p, name in enumerate(["down / pipeline 0", "up / pipeline 1"][: plan.placement.num_pipelines])
              for kind in kinds]
    if result.sync_events:
        legend.append(Patch(color=SYNC_COLOUR, label="gradient all-reduce (SYNC)"))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=min(len(legend), 4), fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
