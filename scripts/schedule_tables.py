#!/usr/bin/env python
"""Regenerate the tables and pictures of docs/schedules.md.

    python scripts/schedule_tables.py            # rewrites its blocks of docs/schedules.md and docs/images/*.png

Everything comes from the schedule generators and the simulator at ``t_B = 2 t_F`` (half
of it weight gradients for a split backward) with free communication; nothing is typed in
by hand. The prose around the ``<!-- begin:NAME -->`` blocks is left alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_bitpipe.schedules import SPLIT_BACKWARD_SUFFIX, CostModel, generate, simulate, validate_plan
from megatron_bitpipe.schedules.render import plot_gantt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_blocks import update_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = (("1f1b", "1F1B"), ("interleaved", "interleaved v=2"), ("chimera", "Chimera"), ("bitpipe", "BitPipe"))
PICTURES = ((4, 4, False), (4, 8, False), (4, 4, True), (4, 8, True))
PICTURED = ("interleaved", "chimera", "bitpipe")
GRID = [(D, k * D) for D in (4, 8, 16) for k in (1, 2, 4)]


def simulated(name: str, D: int, N: int, split: bool = False, costs: CostModel = CostModel()):
    plan = generate(name, D, N, split_backward=split)
    validate_plan(plan)
    return simulate(plan, costs)


def _percent(value: float, best: float) -> str:
    text = f"{100 * value:.1f}%"
    return f"**{text}**" if abs(value - best) < 1e-12 else text


def bubble_table() -> str:
    """Bubble and peak of every schedule (whole backward) over :data:`GRID`."""
    head = " | ".join(f"{label} bubble | {label} peak" for _, label in SCHEDULES)
    lines = [f"| D | N | {head} |", "|---|---|" + "---|---|" * len(SCHEDULES)]
    for D, N in GRID:
        results = [simulated(name, D, N) for name, _ in SCHEDULES]
        best = min(r.bubble_ratio for r in results)
        cells = [f"{_percent(r.bubble_ratio, best)} | {max(r.peak_activations):g}" for r in results]
        lines.append(f"| {D} | {N} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def split_table() -> str:
    """Bubble of every schedule with a split backward, BitPipe's peak, and speed-ups
    over megatron's interleaved schedule (whole backward) with and without the split."""
    labels = " | ".join(f"{label}{SPLIT_BACKWARD_SUFFIX}" for _, label in SCHEDULES)
    split_bitpipe = f"BitPipe{SPLIT_BACKWARD_SUFFIX}"
    lines = [
        f"| D | N | {labels} | {split_bitpipe} peak | BitPipe vs interleaved | {split_bitpipe} vs interleaved |",
        "|---|---|" + "---|" * len(SCHEDULES) + "---|---|---|",
    ]
    for D, N in GRID:
        results = [simulated(name, D, N, split=True) for name, _ in SCHEDULES]
        best = min(r.bubble_ratio for r in results)
        interleaved = simulated("interleaved", D, N).makespan
        bitpipe = simulated("bitpipe", D, N).makespan
        cells = [_percent(r.bubble_ratio, best) for r in results]
        lines.append(
            f"| {D} | {N} | " + " | ".join(cells)
            + f" | {max(results[-1].peak_activations):g} | {interleaved / bitpipe:.3f} | {interleaved / results[-1].makespan:.3f} |"
        )
    return "\n".join(lines)


def pictures(out: Path) -> str:
    """Gantt charts of :data:`PICTURES` under ``out/images``; their Markdown."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    blocks = []
    for D, N, split in PICTURES:
        for name, label in SCHEDULES:
            if name not in PICTURED or (split and name != "bitpipe"):
                continue
            suffix, title = ("_split", f"{label} with split backward") if split else ("", label)
            filename = f"images/{name}{suffix}_d{D}_n{N}.png"
            plot_gantt(simulated(name, D, N, split, CostModel(t_sync=0.5)), str(out / filename))
            blocks.append(f"**{title}, D={D}, N={N}**\n\n![{title} D={D} N={N}]({filename})\n")
    return "\n".join(blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs"), help="docs directory holding schedules.md")
    args = parser.parse_args()
    out = Path(args.out)
    doc = out / "schedules.md"
    update_file(str(doc), {"bubble-table": bubble_table(), "split-table": split_table(), "timelines": pictures(out)})
    print(f"updated {doc} and its pictures under {out / 'images'}")


if __name__ == "__main__":
    main()
