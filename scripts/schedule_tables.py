#!/usr/bin/env python
"""Regenerate the tables and pictures of docs/schedules.md.

    python scripts/schedule_tables.py            # rewrites its blocks of docs/schedules.md and docs/images/*.png

Everything comes from the schedule generators and the simulator at ``t_B = 2 t_F`` (half
of it weight gradients for a split backward), with free communication unless a table says
otherwise; the message-cost tables use ``t_p2p`` = 0, 0.05, 0.1 and 0.2 ``t_F``; the
gradient-sync and memory tables use the BitPipe paper's GPT and BERT sizes with the
hardware figures assumed in :data:`LINKS` (stated in the document). Nothing is typed in
by hand. The prose around the ``<!-- begin:NAME -->`` blocks is left alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_bitpipe.schedules import SPLIT_BACKWARD_SUFFIX, CostModel, generate, simulate, validate_plan
from megatron_bitpipe.schedules import zbv
from megatron_bitpipe.schedules.costs import Hardware, analytic_costs
from megatron_bitpipe.schedules.model_shape import ModelShape
from megatron_bitpipe.schedules.render import plot_gantt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_blocks import update_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = (("1f1b", "1F1B"), ("interleaved", "interleaved v=2"), ("chimera", "Chimera"), ("bitpipe", "BitPipe"))
PICTURES = ((4, 4, False), (4, 8, False), (4, 4, True), (4, 8, True))
PICTURED = ("interleaved", "chimera", "bitpipe")
GRID = [(D, k * D) for D in (4, 8, 16) for k in (1, 2, 4)]
P2P = (0.0, 0.05, 0.1, 0.2)
#: (name, label, split_backward) of the peers in the message-cost tables
PEERS = (("zb-h1", "ZB-H1", False), ("zbv", "ZB-V", False), ("dualpipev", "DualPipeV", False),
         ("dualpipe", "DualPipe", False), ("interleaved", f"interleaved{SPLIT_BACKWARD_SUFFIX}", True),
         ("chimera", f"Chimera{SPLIT_BACKWARD_SUFFIX}", True))
#: the latency tables' column of ZB-V's paper order (the "ZB-V" column is the generator's order)
ZBV_PAPER = "ZB-V paper's order"
#: schedules of the gradient-sync and memory tables: (name, label, split_backward)
RACE = (("1f1b", "1F1B", False), ("zb-h1", "ZB-H1", False), ("interleaved", f"interleaved{SPLIT_BACKWARD_SUFFIX}", True),
        ("zbv", "ZB-V", False), ("dualpipev", "DualPipeV", False), ("dualpipe", "DualPipe", False),
        ("chimera", f"Chimera{SPLIT_BACKWARD_SUFFIX}", True), ("bitpipe", f"BitPipe{SPLIT_BACKWARD_SUFFIX}", True))
#: the BitPipe paper's configurations (8 pipeline ranks; N = global batch / micro-batch)
MODELS = {"GPT": (ModelShape(96, 3072, 32, 1024, micro_batch_size=1), 16), "BERT": (ModelShape(64, 2560, 64, 512, micro_batch_size=4), 8)}
PIPELINE = 8
#: assumed links, all-reduce bus bandwidths as nccl-tests reports them; A100-class compute
LINKS = {
    "NVLink (one node)": Hardware(achieved_tflops=140.0, p2p_latency_ms=0.02, p2p_bandwidth_gbs=150.0,
                                  allreduce_bandwidth_gbs=200.0),
    "InfiniBand (HDR 200 Gb/s per GPU)": Hardware(achieved_tflops=140.0, p2p_latency_ms=0.03,
                                                  p2p_bandwidth_gbs=25.0, allreduce_bandwidth_gbs=23.0),
}
DATA_PARALLEL = (1, 8)
PEER_PICTURE = (4, 8, 0.1)  # D, N, t_p2p of the peers' timelines


def simulated(name: str, D: int, N: int, split: bool = False, costs: CostModel = CostModel()):
    plan = generate(name, D, N, split_backward=split, costs=costs)
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


def placement_bound(D: int, N: int, p2p: float) -> float:
    """BitPipe's placement with free memory: every rank works 3N after its first input."""
    return 3 * N + (D // 2 - 1) * (0.5 + p2p)


def memory_bound(D: int, N: int, p2p: float) -> float:
    """BitPipe's placement at D Ma per rank: before its first input gradient a rank runs at
    most 2D forwards (D time units), and that gradient needs the first micro-batch's whole
    forward chain (2D - 2 messages) and the hops back to the rank."""
    return placement_bound(D, N, p2p) + (2 * D - 2) * p2p


def latency_tables() -> str:
    """Makespans of every peer and of BitPipe with a split backward at each message cost."""
    blocks = []
    columns = [label for _, label, _ in PEERS]
    columns.insert(columns.index("ZB-V") + 1, ZBV_PAPER)
    labels = " | ".join(columns)
    for p2p in P2P:
        costs = CostModel(t_p2p=p2p)
        lines = [
            f"**t_p2p = {p2p:g} t_F**\n",
            f"| D | N | {labels} | BitPipe | BitPipe{SPLIT_BACKWARD_SUFFIX} | peak | bound | over bound | memory bound "
            "| over memory bound |",
            "|---|---|" + "---|" * len(columns) + "---|---|---|---|---|---|---|",
        ]
        for D, N in GRID:
            peers = []
            for name, _, split in PEERS:
                if name.startswith("dualpipe") and N < 2 * D:
                    peers.append(None)
                    continue
                peers.append(simulated(name, D, N, split, costs).makespan)
                if name == "zbv":
                    paper = zbv.paper_plan(D, N)
                    validate_plan(paper)
                    peers.append(simulate(paper, costs).makespan)
            ours = simulated("bitpipe", D, N, True, costs)
            best = min(p for p in peers if p is not None)
            cells = ["–" if p is None else (f"**{p:.2f}**" if p < ours.makespan - 1e-9 else f"{p:.2f}") for p in peers]
            mark = "**" if ours.makespan <= best + 1e-9 else ""
            bound, tight = placement_bound(D, N, p2p), memory_bound(D, N, p2p)
            lines.append(
                f"| {D} | {N} | " + " | ".join(cells)
                + f" | {simulated('bitpipe', D, N, False, costs).makespan:.2f} | {mark}{ours.makespan:.2f}{mark}"
                + f" | {max(ours.peak_activations):g} | {bound:.2f} | {100 * (ours.makespan / bound - 1):.1f}%"
                + f" | {tight:.2f} | {100 * (ours.makespan / tight - 1):.1f}% |"
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def paper_costs(model: str, link: str, data_parallel: int) -> CostModel:
    shape, _ = MODELS[model]
    return analytic_costs(shape, PIPELINE, LINKS[link], data_parallel)


def sync_table() -> str:
    """The gradient all-reduce of the paper's GPT per device share, and simulated steps."""
    shape, N = MODELS["GPT"]
    lines = [
        "| link | DP | t_F (ms) | message (ms) | all-reduce of a device share: 1 replica (ms) | 2 replicas (ms) "
        "| " + " | ".join(label for _, label, _ in RACE) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(RACE),
    ]
    for link in LINKS:
        for dp in DATA_PARALLEL:
            costs = paper_costs("GPT", link, dp)
            steps = [simulated(name, PIPELINE, N, split, costs).makespan for name, _, split in RACE]
            best = min(steps)
            cells = [f"**{t:.0f}**" if t == best else f"{t:.0f}" for t in steps]
            lines.append(
                f"| {link} | {dp} | {costs.t_forward:.1f} | {costs.message_time:.3f} | {costs.sync_time(1.0, 1):.1f} "
                f"| {costs.sync_time(1.0, 2):.1f} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


#: bytes per parameter with megatron's bf16 mixed precision: weights, fp32 gradients, and
#: the optimizer's fp32 master weights with Adam's two moments
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 4, 12


def activation_bytes_per_layer(shape: ModelShape) -> float:
    """One micro-batch's activations kept for the backward of one transformer layer: 34 sbh
    + 5 a s^2 b bytes (16-bit activations, no recomputation, no tensor or sequence
    parallelism; Korthikanti et al., 2022)."""
    s, b, h, a = shape.seq_length, shape.micro_batch_size, shape.hidden_size, shape.num_attention_heads
    return 34 * s * b * h + 5 * a * s * s * b


def memory_table() -> str:
    """Per-rank memory of the transformer layers of the paper's GPT and BERT, 8 ranks."""
    gb = 1e9
    lines = [
        "| model | N | schedule | replicas | weights (GB) | gradients (GB) | optimizer (GB) | optimizer, distributed, "
        "DP 8 (GB) | peak act. (Ma) | activations (GB) | total (GB) | total, distributed optimizer (GB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, (shape, N) in MODELS.items():
        layers = shape.num_layers // PIPELINE
        share = layers * shape.layer_parameters()
        per_ma = layers * activation_bytes_per_layer(shape)
        for name, label, split in RACE:
            if name.startswith("dualpipe") and N < 2 * PIPELINE:
                continue
            result = simulated(name, PIPELINE, N, split)
            replicas = result.plan.placement.num_pipelines
            params = replicas * share
            weights, grads, optimizer = (params * k / gb for k in (WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES))
            peak = max(result.peak_activations)
            activations = peak * per_ma / gb
            lines.append(
                f"| {model} | {N} | {label} | {replicas} | {weights:.1f} | {grads:.1f} | {optimizer:.1f} "
                f"| {optimizer / 8:.1f} | {peak:g} | {activations:.1f} | {weights + grads + optimizer + activations:.1f} "
                f"| {weights + grads + optimizer / 8 + activations:.1f} |"
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
    D, N, p2p = PEER_PICTURE
    costs = CostModel(t_p2p=p2p)
    for name, label, split in PEERS[:4] + (("bitpipe", f"BitPipe{SPLIT_BACKWARD_SUFFIX}", True),):
        filename = f"images/{name}_p2p_d{D}_n{N}.png"
        plot_gantt(simulated(name, D, N, split, costs), str(out / filename))
        blocks.append(f"**{label}, D={D}, N={N}, t_p2p = {p2p:g} t_F**\n\n![{label} D={D} N={N}]({filename})\n")
    return "\n".join(blocks)


#: docs/schedules.md's table blocks and what makes each (scripts/doc_samples.py checks them)
TABLES = {
    "bubble-table": bubble_table,
    "split-table": split_table,
    "latency-tables": latency_tables,
    "sync-table": sync_table,
    "memory-table": memory_table,
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs"), help="docs directory holding schedules.md")
    args = parser.parse_args(argv)
    out = Path(args.out)
    doc = out / "schedules.md"
    blocks = {name: make() for name, make in TABLES.items()}
    blocks["timelines"] = pictures(out)
    update_file(str(doc), blocks)
    print(f"updated {doc} and its pictures under {out / 'images'}")


if __name__ == "__main__":
    main()
