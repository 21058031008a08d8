#!/usr/bin/env python
"""The message-cost race of docs/schedules.md with a cost file's compute ratios.

    python scripts/measured_split_race.py --costs docs/costs/h100_gpt_share_fp32.json \\
        --update-doc docs/performance.md

The same schedules, generators and simulator as ``scripts/schedule_tables.py``'s
latency tables (its ``PEERS`` and ``simulated``), with the compute of ``--costs`` in units
of its forward (``t_F = 1``: ``t_backward``, ``t_weight``, ``t_input`` divided by
``t_forward``; its communication and sync fields left out) and ``t_p2p`` = each ``--p2p``
value in ``t_F``. The split plans are ordered for the same costs. The bound columns of
docs/schedules.md assume ``t_B = 2``, ``I = W = 1`` and are not shown. ``--update-doc``
rewrites the ``measured-split-race`` block of the file (command, costs, tables).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path
from typing import List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_blocks import update_file  # noqa: E402
from schedule_tables import GRID, PEERS, simulated  # noqa: E402

from megatron_bitpipe.schedules import SPLIT_BACKWARD_SUFFIX, CostModel  # noqa: E402
from megatron_bitpipe.schedules.costs import read_cost_file  # noqa: E402

P2P = (0.0, 0.05, 0.1, 0.15, 0.2)


def compute_ratios(costs: CostModel) -> CostModel:
    """``costs``' compute in units of its forward (t_F = 1); communication and sync left out."""
    unit = costs.t_forward
    return CostModel(
        t_forward=1.0,
        t_backward=costs.t_backward / unit,
        t_weight=None if costs.t_weight is None else costs.t_weight / unit,
        t_input=None if costs.t_input is None else costs.t_input / unit,
    )


def race(base: CostModel, p2ps: Sequence[float], grid=GRID) -> str:
    """Makespans (t_F) of every peer and of BitPipe (whole and split backward) per message cost;
    a peer faster than BitPipe+split-backward in bold, BitPipe+split-backward in bold where fastest."""
    labels = " | ".join(label for _, label, _ in PEERS)
    blocks = []
    for p2p in p2ps:
        costs = dataclasses.replace(base, t_p2p=p2p)
        lines = [
            f"**t_p2p = {p2p:g} t_F**\n",
            f"| D | N | {labels} | BitPipe | BitPipe{SPLIT_BACKWARD_SUFFIX} | peak | BitPipe{SPLIT_BACKWARD_SUFFIX} vs best peer |",
            "|---|---|" + "---|" * len(PEERS) + "---|---|---|---|",
        ]
        for D, N in grid:
            peers: List[Optional[float]] = [
                None if name.startswith("dualpipe") and N < 2 * D else simulated(name, D, N, split, costs).makespan
                for name, _, split in PEERS
            ]
            ours = simulated("bitpipe", D, N, True, costs)
            best = min(p for p in peers if p is not None)
            cells = ["–" if p is None else (f"**{p:.2f}**" if p < ours.makespan - 1e-9 else f"{p:.2f}") for p in peers]
            mark = "**" if ours.makespan <= best + 1e-9 else ""
            lines.append(
                f"| {D} | {N} | " + " | ".join(cells)
                + f" | {simulated('bitpipe', D, N, False, costs).makespan:.2f} | {mark}{ours.makespan:.2f}{mark}"
                + f" | {max(ours.peak_activations):g} | {best / ours.makespan:.3f} |"
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--costs", metavar="FILE", required=True, help="cost file (scripts/calibrate_gpu.py's format)")
    parser.add_argument("--p2p", type=float, nargs="+", default=list(P2P), help="t_p2p values in t_F (default %(default)s)")
    parser.add_argument("--update-doc", metavar="FILE.md", help="rewrite FILE.md's measured-split-race block")
    args = parser.parse_args(argv)
    try:
        ratios = compute_ratios(CostModel(**read_cost_file(args.costs)))
    except (OSError, ValueError, TypeError) as error:
        parser.error(f"--costs: {error}")
    command = " ".join(["python", "scripts/measured_split_race.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])])
    block = (
        f"```bash\n{command}\n```\n\nCompute per device share in t_F (from `{args.costs}`): F = 1, "
        f"B = {ratios.t_backward:.3g}, I = {ratios.input_time:.3g}, W = {ratios.weight_time:.3g}.\n\n"
        + race(ratios, args.p2p)
    )
    if args.update_doc:
        update_file(args.update_doc, {"measured-split-race": block})
        print(f"updated {args.update_doc}")
    else:
        print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
