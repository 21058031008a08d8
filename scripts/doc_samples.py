#!/usr/bin/env python
"""Regenerate the sample outputs and measured numbers that README.md and docs/ quote.

    python scripts/doc_samples.py                       # list the samples
    python scripts/doc_samples.py quick-start real-text # rerun these, rewrite their blocks
    python scripts/doc_samples.py --all                 # every sample (the slow ones take minutes)
    python scripts/doc_samples.py --check [NAME ...]    # rerun the fast ones (or these) and compare

Each sample runs the very commands its block shows — in a scratch directory whose
``scripts/`` is this checkout's, so nothing is written into the checkout — and rewrites its
``<!-- begin:NAME -->`` blocks (:mod:`doc_blocks`): the commands, the lines of output they
quote and the numbers taken from them, and a stamp line naming this command, the commit, the
seconds and the load average. ``--check`` compares instead of writing: text must be equal and
numbers equal to 1e-4 (relative, or one unit of the last printed digit), except what differs
from run to run (times, throughput, memory, timestamps). ``tests/scripts/test_doc_samples.py`` runs
``--check`` on the fast samples; the slow ones (``fast=False``: minutes on 2 cores) are rerun
by hand before a release, and their stamp says at which commit they were made. The schedule
tables and pictures of docs/schedules.md are one of the slow ones (``scripts/schedule_tables.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_blocks import replace_block  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
THIS = "python scripts/doc_samples.py"
#: lines of a block that say how it was made; never compared
STAMP_PREFIX = f"(`{THIS}"


# --------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class Command:
    """A shell command as a document shows it: ``lines`` joined by `` \\`` continuations."""

    lines: Tuple[str, ...]

    def one_line(self) -> str:
        return " ".join(self.lines)

    def multi_line(self) -> str:
        return " \\\n    ".join(self.lines)


@dataclass
class Run:
    """What one command printed, how long it took and the 1-minute load average meanwhile."""

    command: Command
    stdout: str
    seconds: float
    load: Tuple[float, float]

    @property
    def lines(self) -> List[str]:
        return self.stdout.splitlines()


class _LoadSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.samples = [os.getloadavg()[0]]
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(2.0):
            self.samples.append(os.getloadavg()[0])


def run_command(command: Command, cwd: Path, extra: str = "", timeout: float = 1800) -> Run:
    """Run ``command`` (plus ``extra`` flags) with bash in ``cwd``; raise on a failure."""
    sampler = _LoadSampler()
    sampler.start()
    start = time.monotonic()
    text = command.one_line() + (" " + extra if extra else "")
    result = subprocess.run(["bash", "-c", text], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, timeout=timeout)
    seconds = time.monotonic() - start
    sampler.done.set()
    sampler.join()
    if result.returncode != 0:
        raise RuntimeError(f"`{text}` exited with status {result.returncode}:\n{result.stderr[-4000:]}")
    return Run(command, result.stdout, seconds, (min(sampler.samples), max(sampler.samples)))


def scratch_directory() -> tempfile.TemporaryDirectory:
    """A directory whose ``scripts`` is this checkout's: the documents' relative paths work."""
    scratch = tempfile.TemporaryDirectory(prefix="doc-samples-")
    os.symlink(ROOT / "scripts", Path(scratch.name) / "scripts")
    return scratch


def commit() -> str:
    """The checkout's commit, ``+ local changes`` when the code differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "megatron_bitpipe", "scripts", "setup.py")
    return head + (" + local changes" if dirty else "")


def load_text(runs: Sequence[Run]) -> str:
    low, high = min(r.load[0] for r in runs), max(r.load[1] for r in runs)
    return f"{low:.1f}" if round(low, 1) == round(high, 1) else f"{low:.1f}-{high:.1f}"


def stamp(name: str, runs: Sequence[Run]) -> str:
    seconds = ", ".join(f"{r.seconds:.0f} s" for r in runs)
    return (f"{STAMP_PREFIX} {name}`, commit {commit()}, {time.strftime('%Y-%m-%d')}: {seconds} on "
            f"{os.cpu_count()} CPU cores at a load average of {load_text(runs)})")


def excerpt(lines: Sequence[str], keep: Sequence[str]) -> str:
    """The lines matching one of the ``keep`` patterns, ``...`` where others were left out
    (the rules of dashes around a validation loss and the per-rank forward times after a
    progress line are dropped silently)."""
    out: List[str] = []
    gap = False
    for line in lines:
        if any(re.search(p, line) for p in keep):
            if gap and out:
                out.append("...")
            out.append(line)
            gap = False
        elif not (re.fullmatch(r"-+", line.strip()) or line.startswith(" forward time per rank (ms")):
            gap = True
    return "\n".join(out)


def fenced(text: str, language: str = "") -> str:
    return f"```{language}\n{text}\n```"


# --------------------------------------------------------------------------- samples


@dataclass
class Sample:
    """``commands`` run in order in one scratch directory; ``render(runs, scratch)`` returns
    ``{(document, block): text}``."""

    name: str
    fast: bool
    summary: str
    commands: Tuple[Command, ...] = ()
    render: Optional[Callable[[List[Run], Path], Dict[Tuple[str, str], str]]] = None
    #: a sample made by another script instead: ``produce(check) -> blocks`` (``check``:
    #: leave the files alone)
    produce: Optional[Callable[[bool], Dict[Tuple[str, str], str]]] = None
    extra: Dict[int, str] = field(default_factory=dict)  # command index -> flags added to it (not shown)

    def blocks(self, check: bool = False) -> Dict[Tuple[str, str], str]:
        if self.produce is not None:
            return self.produce(check)
        with scratch_directory() as scratch:
            runs = []
            for index, command in enumerate(self.commands):
                runs.append(run_command(command, Path(scratch), self.extra.get(index, "")))
                print(f"  {command.lines[0][:60]}...: {runs[-1].seconds:.0f} s", file=sys.stderr)
            return self.render(runs, Path(scratch))


QUICK_START = Command((
    "torchrun --nproc-per-node 4 scripts/pretrain_gpt.py",
    "--pipeline-schedule bitpipe --pipeline-model-parallel-size 4",
    "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64",
    "--micro-batch-size 2 --global-batch-size 16 --vocab-size 256",
    "--train-iters 20 --lr 3e-3 --lr-warmup-iters 2 --log-interval 2 --eval-interval 10 --eval-iters 2",
))
BERT = Command((
    "torchrun --nproc-per-node 4 scripts/pretrain_bert.py",
    "--pipeline-schedule bitpipe --pipeline-model-parallel-size 4",
    "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64",
    "--micro-batch-size 2 --global-batch-size 16 --vocab-size 1000",
    "--train-iters 20 --lr 1e-3 --lr-warmup-iters 2 --log-interval 5 --eval-interval 10 --eval-iters 2",
))
PREPROCESS = Command((
    "python scripts/preprocess_data.py --input stdlib-docs --output-prefix data/stdlib_docs",
    "--tokenizer-type ByteLevelTokenizer --append-eod",
))
_REAL_TEXT_FLAGS = (
    "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 128",
    "--micro-batch-size 4 --global-batch-size 16 --train-iters 200",
    "--lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 20 --adam-beta2 0.95",
    "--data-path data/stdlib_docs_text_document --split 90,10,0",
    "--tokenizer-type ByteLevelTokenizer --vocab-size 256",
    "--log-interval 20 --eval-interval 50 --eval-iters 4",
)
REAL_TEXT = Command(("torchrun --nproc-per-node 4 scripts/pretrain_gpt.py",
                     "--pipeline-schedule bitpipe --pipeline-model-parallel-size 4") + _REAL_TEXT_FLAGS)
REAL_TEXT_SINGLE = Command(("python scripts/pretrain_gpt.py",) + _REAL_TEXT_FLAGS)

_HEAD = (r"^no CUDA GPU", r"^(gpt|bert): ")
_SUMMARY = r"training summary \|"


def _iteration(i: int) -> str:
    return rf"\] iteration +{i}/"


def _validation(i: int) -> str:
    return rf"validation loss at iteration {i} \|"


def render_quick_start(runs: List[Run], scratch: Path) -> Dict[Tuple[str, str], str]:
    (run,) = runs
    keep = _HEAD + (_iteration(1), _iteration(2), _validation(10), _iteration(20), _validation(20), _SUMMARY)
    return {("docs/running.md", "quick-start-output"): fenced(excerpt(run.lines, keep)) + "\n\n" + stamp("quick-start", runs)}


def render_bert(runs: List[Run], scratch: Path) -> Dict[Tuple[str, str], str]:
    (run,) = runs
    keep = _HEAD + (_iteration(5), _validation(20), _SUMMARY)
    return {("docs/running.md", "bert-output"): fenced(excerpt(run.lines, keep)) + "\n\n" + stamp("bert", runs)}


def _records(path: Path) -> List[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def _largest(pipelined: List[dict], single: List[dict], key: str) -> float:
    pairs = [(p[key], s[key]) for p, s in zip(pipelined, single) if p.get(key) is not None and s.get(key) is not None]
    if len(pairs) == 0:
        raise RuntimeError(f"no {key} in the logs")
    return max(_relative(a, b) for a, b in pairs)


def _e(value: float) -> str:
    """1.2e-05 -> '1.2e-5'; 0 -> '0'."""
    return "0" if value == 0 else re.sub(r"e([+-])0*(\d)", lambda m: "e" + ("-" if m.group(1) == "-" else "") + m.group(2), f"{value:.1e}")


def render_real_text(runs: List[Run], scratch: Path) -> Dict[Tuple[str, str], str]:
    prep, pipelined_run, single_run = runs
    pipelined = [r for r in _records(scratch / "data/bitpipe.jsonl") if r["event"] == "iteration"]
    single = [r for r in _records(scratch / "data/single.jsonl") if r["event"] == "iteration"]
    if [r["iteration"] for r in pipelined] != [r["iteration"] for r in single]:
        raise RuntimeError("the two runs logged different iterations")
    validation = [(r["iteration"], r["validation_lm_loss"]) for r in pipelined if r.get("validation_lm_loss") is not None]
    start = pipelined[0]["lm_loss"]
    falls = ", ".join(f"{v:.3f}" for _, v in validation)
    at = ", ".join(str(i) for i, _ in validation)
    loss, val, norm = (_largest(pipelined, single, k) for k in ("lm_loss", "validation_lm_loss", "grad_norm"))
    lr_same = all(p["lr"] == s["lr"] for p, s in zip(pipelined, single))
    load = load_text(runs)
    cores = os.cpu_count()
    made = stamp("real-text", runs)
    readme = (
        fenced(f"{PREPROCESS.one_line()}\n{REAL_TEXT.one_line()}", "bash") + "\n\n"
        f"The first iteration logs a loss per byte of {start:.2f} (ln 256 = 5.55: untrained), and the validation loss falls\n"
        f"{falls} at iterations {at}. It took {pipelined_run.seconds:.0f} s on {cores} CPU cores\n"
        f"(load average {load}), plus {prep.seconds:.0f} s of preprocessing. As a single process\n"
        f"(`python scripts/pretrain_gpt.py` without the two pipeline flags; {single_run.seconds:.0f} s) it logs the same\n"
        f"losses: the largest relative difference over the {len(pipelined)} iterations was {_e(loss)}.\n"
        + made
    )
    keep = _HEAD + (_iteration(1), _iteration(20), _validation(50), _iteration(100), _validation(100), _validation(150),
                    _iteration(200), _validation(200), _SUMMARY)
    output = (
        fenced(f"{PREPROCESS.multi_line()}\n{REAL_TEXT.multi_line()}", "bash") + "\n\n"
        + fenced(excerpt(pipelined_run.lines, keep)) + "\n\n"
        f"({pipelined_run.seconds:.0f} s for the training run on {cores} CPU cores at a load average of {load}; the\n"
        f"preprocessing took {prep.seconds:.0f} s, nearly all of it Python and megatron-core start-up.)\n"
        f"Per byte, the loss is {start:.2f} at the first iteration (ln 256 = 5.55: untrained), and the validation loss falls\n"
        f"{falls} at iterations {at}.\n" + made
    )
    same = (
        "* **Same math**: the single process (`python scripts/pretrain_gpt.py` with the same flags\n"
        f"  minus the two pipeline flags) logs the same curve: over the {len(pipelined)} iterations the largest\n"
        f"  relative difference was {_e(loss)} in the loss, {_e(val)} in the validation loss and {_e(norm)} in the\n"
        "  grad norm (float rounding in another order of summation), the learning rates "
        + ("identical" if lr_same else "not identical") + f";\n  it took {single_run.seconds:.0f} s"
        f" (`{THIS} real-text`, which adds `--log-json` to both runs to compare every iteration)."
    )
    return {("README.md", "real-text"): readme, ("docs/running.md", "real-text-output"): output,
            ("docs/running.md", "real-text-same-math"): same}


GPU_DRY_RUN = Command(("python scripts/gpu_check.py --out gpu_check_dry --dry-run",))


def render_gpu_dry_run(runs: List[Run], scratch: Path) -> Dict[Tuple[str, str], str]:
    """docs/gpu.md's dry-run table: the table ``gpu_check.py`` prints last (every item, in order)."""
    (run,) = runs
    lines = run.lines
    start = max(i for i, line in enumerate(lines) if line.startswith("| item |"))
    table = [line for line in lines[start:] if line.startswith("|")]
    return {("docs/gpu.md", "gpu-dry-run"): fenced("\n".join(table)) + "\n\n" + stamp("gpu-dry-run", runs)}


def produce_schedule_tables(check: bool) -> Dict[Tuple[str, str], str]:
    """docs/schedules.md's tables and pictures (scripts/schedule_tables.py, minutes)."""
    import schedule_tables

    if check:  # the tables only: comparing pictures would test matplotlib's version
        return {("docs/schedules.md", name): make() for name, make in schedule_tables.TABLES.items()}
    schedule_tables.main([])
    return {}


#: README's rows of the bubble and message-cost tables (docs/schedules.md has the grids)
README_BUBBLE_ROWS = ((4, 4), (8, 8), (8, 32))
README_P2P_ROWS, README_P2P = ((8, 8), (8, 16), (16, 64)), 0.1
_README_BUBBLE_SCHEDULES = ("1f1b", "interleaved", "chimera", "bitpipe")
_README_PEERS = (("zb-h1", False), ("zbv", False), ("dualpipev", False), ("dualpipe", False), ("chimera", True))


def _pure_stamp(name: str) -> str:
    return f"{STAMP_PREFIX} {name}`: simulated, the same on every machine)"


def produce_readme_results(check: bool) -> Dict[Tuple[str, str], str]:
    """README's bubble and message-cost rows, simulated as scripts/schedule_tables.py does (seconds)."""
    from schedule_tables import simulated

    from megatron_bitpipe.schedules import CostModel

    rows, split_bubbles = [], []
    for D, N in README_BUBBLE_ROWS:
        results = [simulated(name, D, N) for name in _README_BUBBLE_SCHEDULES]
        split = simulated("bitpipe", D, N, True)
        if max(split.peak_activations) != max(results[-1].peak_activations):
            raise RuntimeError(f"D={D} N={N}: the split backward's peak differs; the README's sentence says the same")
        cells = [f"{100 * r.bubble_ratio:.1f}%" for r in results]
        peaks = " / ".join(f"{max(r.peak_activations):g}" for r in (results[0], results[1], results[3]))
        rows.append(f"| {D} | {N} | " + " | ".join(cells[:3]) + f" | **{cells[3]}** | {peaks} |")
        split_bubbles.append(f"{100 * split.bubble_ratio:.1f}%")
    bubble = "\n".join([
        "| D | N | 1F1B | interleaved (v=2) | Chimera | **BitPipe** | peak act.: 1F1B / interleaved / BitPipe |",
        "|---|---|---|---|---|---|---|", *rows]) + (
        "\n\nBitPipe's bubble is (D−2)/(3N+D−2) for every N that is a multiple of D — the published\n"
        "value at N = D, and below the reference implementation's 13.5% at D = 8, N = 32 because\n"
        "micro-batch groups keep entering in a steady state instead of draining per group. With\n"
        "`--split-backward` (weight gradients deferred into the bubbles, half of t_B) BitPipe's bubble\n"
        f"drops to {', '.join(split_bubbles[:-1])} and {split_bubbles[-1]} in these three rows, at the same peak.\n"
        + _pure_stamp("readme-results"))
    costs = CostModel(t_p2p=README_P2P)
    rows = []
    for D, N in README_P2P_ROWS:
        peers = [None if name.startswith("dualpipe") and N < 2 * D else simulated(name, D, N, split, costs)
                 for name, split in _README_PEERS]
        ours = simulated("bitpipe", D, N, True, costs)
        cells = ["–" if p is None else f"{p.makespan:.1f}" for p in peers]
        dualpipe = "–" if peers[3] is None else f"{max(peers[3].peak_activations):g}"
        rows.append(f"| {D} | {N} | " + " | ".join(cells) + f" | **{ours.makespan:.1f}** | {max(ours.peak_activations):g} / {dualpipe} |")
    p2p = "\n".join([
        "| D | N | ZB-H1 | ZB-V | DualPipeV | DualPipe | Chimera+split-backward | **BitPipe+split-backward** | peak act.: BitPipe / DualPipe |",
        "|---|---|---|---|---|---|---|---|---|", *rows, "", _pure_stamp("readme-results")])
    return {("README.md", "results-bubble"): bubble, ("README.md", "results-message-costs"): p2p}


def produce_schedule_list(check: bool) -> Dict[Tuple[str, str], str]:
    """docs/schedules.md's listing of the registered schedules (the schedule command's ``list``)."""
    from megatron_bitpipe.schedules.cli import schedule_listing

    command = "python -m megatron_bitpipe.schedules list"
    text = fenced(f"$ {command}\n{schedule_listing()}", "console") + "\n" + _pure_stamp("schedule-list").replace("simulated", "pure Python")
    return {("docs/schedules.md", "schedule-list"): text}


#: the ``recommend`` commands README.md and docs/schedules.md show (run from the checkout's root)
RECOMMEND_README = ("recommend", "-D", "8", "-N", "12", "--costs", "docs/costs/h100_gpt_share_fp32.json",
                    "--max-activations", "8", "--max-weight-copies", "1")
RECOMMEND_SCHEDULES = ("recommend", "-D", "4", "-N", "8")


def _recommend_block(argv: Sequence[str]) -> str:
    """The command and what it prints, as a console block with its stamp."""
    from megatron_bitpipe.schedules.cli import main as schedule_command

    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.chdir(ROOT):
        status = schedule_command(list(argv), prog="python -m megatron_bitpipe.schedules")
    if status != 0:
        raise RuntimeError(f"recommend {' '.join(argv)} exited with {status}")
    command = "python -m megatron_bitpipe.schedules " + " ".join(argv)
    return fenced(f"$ {command}\n{output.getvalue().rstrip()}", "console") + "\n" + _pure_stamp("schedule-recommend")


def produce_schedule_recommend(check: bool) -> Dict[Tuple[str, str], str]:
    """README's worked example of ``recommend`` and docs/schedules.md's ranking at D=4, N=8 (pure Python)."""
    return {("README.md", "recommend-example"): _recommend_block(RECOMMEND_README),
            ("docs/schedules.md", "recommend-d4-n8"): _recommend_block(RECOMMEND_SCHEDULES)}


#: docs/balanced_stages.md's worked example: a GPT with a 128k vocabulary at D = 8
BALANCED_MODEL = ("--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "4096",
                  "--vocab-size", "131072", "--untie-embeddings-and-output-weights", "--bf16", "--use-distributed-optimizer")
BALANCED_SCHEDULES = ("bitpipe", "zbv")
BALANCED_SEARCH = ("-D", "8", "-N", "32", *BALANCED_MODEL, "--max-memory", "45")
GIB = 2**30


def _schedule_json(argv: Sequence[str]) -> dict:
    """What ``python -m megatron_bitpipe.schedules ARGV --json`` prints, parsed."""
    from megatron_bitpipe.schedules.cli import main as schedule_command

    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.chdir(ROOT):
        status = schedule_command([*argv, "--json"], prog="python -m megatron_bitpipe.schedules")
    if status != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {status}")
    return json.loads(output.getvalue())


def produce_balanced_stages(check: bool) -> Dict[Tuple[str, str], str]:
    """docs/balanced_stages.md's worked example: equal stages and the layout search's split of a
    128k-vocabulary GPT under BitPipe and ZB-V at D = 8 (pure Python; seconds)."""
    commands = [("layout-search", "--schedule", name, *BALANCED_SEARCH) for name in BALANCED_SCHEDULES]
    rows = []
    for argv in commands:
        found = _schedule_json(argv)
        for what, split in (("equal stages", found["even"]), ("layout search", found["best"])):
            memory = ", ".join(f"{rank['total'] / GIB:.1f}" for rank in split["memory_bytes"])
            flags = " ".join(split["flags"]).replace("|", "\\|") or "(none)"  # a table cell's pipes escaped
            rows.append(f"| {found['schedule']} | {what} | {','.join(map(str, split['stage_layers']))} | "
                        f"{split['makespan']:.1f} | {memory} | {'yes' if split['fits'] else 'no'} | `{flags}` |")
    console = "\n".join(f"$ python -m megatron_bitpipe.schedules {' '.join(argv)} --json" for argv in commands)
    table = "\n".join([
        "| schedule | split | layers per stage (pipeline order) | step time (t_F) | memory per rank 0..7 (GiB) | within 45 GiB | flags |",
        "|---|---|---|---|---|---|---|", *rows])
    return {("docs/balanced_stages.md", "worked-example"): fenced(console, "console") + "\n\n" + table + "\n\n" + _pure_stamp("balanced-stages")}


SAMPLES: Dict[str, Sample] = {s.name: s for s in (
    Sample("quick-start", True, "docs/running.md's laptop run (4 ranks, 20 iterations)",
           (QUICK_START,), render_quick_start),
    Sample("readme-results", True, "README's bubble and message-cost rows (simulated; seconds)",
           produce=produce_readme_results),
    Sample("schedule-list", True, "docs/schedules.md's list of the registered schedules (pure Python; instant)",
           produce=produce_schedule_list),
    Sample("schedule-recommend", True, "README's and docs/schedules.md's `recommend` outputs (simulated; a second)",
           produce=produce_schedule_recommend),
    Sample("balanced-stages", True, "docs/balanced_stages.md's worked example: equal stages and the layout search's "
           "split of a 128k-vocabulary GPT at D = 8 (simulated; seconds)", produce=produce_balanced_stages),
    Sample("bert", False, "docs/running.md's BERT run (4 ranks, 20 iterations)", (BERT,), render_bert),
    Sample("real-text", False, "README's and docs/running.md's real-text run: preprocessing, 4 ranks and a single "
           "process, 200 iterations each (minutes)", (PREPROCESS, REAL_TEXT, REAL_TEXT_SINGLE), render_real_text,
           extra={1: "--log-json data/bitpipe.jsonl", 2: "--log-json data/single.jsonl"}),
    Sample("gpu-dry-run", False, "docs/gpu.md's dry run of the GPU check (CPU parts on 4 gloo ranks; minutes)",
           (GPU_DRY_RUN,), render_gpu_dry_run),
    Sample("schedule-tables", False, "docs/schedules.md's tables and docs/images/ (scripts/schedule_tables.py; "
           "minutes)", produce=produce_schedule_tables),
)}


# --------------------------------------------------------------------------- checking

#: what differs from run to run: masked before comparing
VOLATILE = (
    r"\[\d{4}-\d\d-\d\d [\d:.]+\]",
    r"datetime: .*",
    r"(elapsed time per iteration \(ms\)|tokens per second|max memory \(MiB\)|total time \(s\)|training time \(s\)): [\d.]+",
    r"max [\d.]+ \(rank \d+\), min [\d.]+ \(rank \d+\)",
    r"final evaluation: .*",
)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _mask(text: str) -> str:
    for pattern in VOLATILE:
        text = re.sub(pattern, lambda m: re.sub(r"[\d.]+", "#", m.group(0)), text)
    return text


def _close(a: str, b: str) -> bool:
    x, y = float(a), float(b)
    decimals = len(a.split("e")[0].split("E")[0].partition(".")[2])
    unit = 10.0 ** -decimals * (10.0 ** int(a.lower().split("e")[1]) if "e" in a.lower() else 1.0)
    return abs(x - y) <= max(1e-4 * max(abs(x), abs(y)), 1.01 * unit)


def differences(documented: str, fresh: str) -> List[str]:
    """Lines where ``fresh`` departs from ``documented`` beyond run-to-run noise."""
    def lines(text: str) -> List[str]:
        return [_mask(line) for line in text.splitlines() if not line.startswith(STAMP_PREFIX)]

    old, new = lines(documented), lines(fresh)
    out = []
    if len(old) != len(new):
        out.append(f"{len(old)} lines documented, {len(new)} now")
    for a, b in zip(old, new):
        if _NUMBER.sub("#", a) != _NUMBER.sub("#", b) or not all(
                _close(x, y) for x, y in zip(_NUMBER.findall(a), _NUMBER.findall(b))):
            out.append(f"- {a}\n+ {b}")
    return out


def documented_block(path: str, name: str) -> str:
    text = (ROOT / path).read_text(encoding="utf-8")
    match = re.search(rf"<!-- begin:{re.escape(name)} -->\n(.*?)<!-- end:{re.escape(name)} -->", text, re.S)
    if match is None:
        raise ValueError(f"{path} has no '<!-- begin:{name} -->' block")
    return match.group(1).rstrip("\n")


def check(names: Sequence[str]) -> int:
    failed = 0
    for name in names:
        for (path, block), fresh in SAMPLES[name].blocks(check=True).items():
            diff = differences(documented_block(path, block), fresh)
            if diff:
                failed += 1
                print(f"{path} block {block!r} no longer matches `{THIS} {name}`:\n" + "\n".join(diff[:20]))
            else:
                print(f"{path} block {block!r}: matches")
    if failed:
        print(f"regenerate with: {THIS} {' '.join(names)}")
    return 1 if failed else 0


def regenerate(names: Sequence[str]) -> None:
    for name in names:
        print(f"{name}: running", file=sys.stderr)
        written: Dict[str, str] = {}
        for (path, block), content in SAMPLES[name].blocks().items():
            text = written.get(path) or (ROOT / path).read_text(encoding="utf-8")
            written[path] = replace_block(text, block, content)
        for path, text in written.items():
            (ROOT / path).write_text(text, encoding="utf-8")
            print(f"{name}: updated {path}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(f"  {s.name:16} {'fast' if s.fast else 'slow'}  {s.summary}" for s in SAMPLES.values()))
    parser.add_argument("names", nargs="*", metavar="NAME", help="samples to rerun (see below)")
    parser.add_argument("--all", action="store_true", help="every sample")
    parser.add_argument("--check", action="store_true", help="compare instead of writing (default: the fast samples)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in SAMPLES]
    if unknown:
        parser.error(f"unknown sample(s) {', '.join(unknown)}; choose from {', '.join(SAMPLES)}")
    names = list(SAMPLES) if args.all else args.names
    if args.check:
        return check(names or [s.name for s in SAMPLES.values() if s.fast])
    if not names:
        parser.print_help()
        return 0
    regenerate(names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
