"""``scripts/bench_split.py``: what the split backward runs against the whole backward.

* the split runs the plain phases' operators exactly: on a device share built as training
  builds it (dense fp32 with megatron's unfused attention, dense bf16 with SDPA, a
  mixture-of-experts share, one rank of TP 2 with sequence parallelism), ``I`` and ``W``
  together dispatch the whole backward's operators (the same multiset, the same bytes written
  and FLOPs) and the forward while deferring the plain forward's;
* the ratio and phase tables, and the doc block they are written into.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from ..script_support import REPO, load_script

bench = load_script("bench_split", "script_bench_split")

COUNTED_ROWS = ("dense fp32 unfused", "dense bf16 sdpa", "moe bf16 sdpa", "tp2+sp bf16 sdpa")
TINY = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--warmup", "0", "--iters", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def counted_rows():
    command = [sys.executable, str(REPO / "scripts" / "bench_split.py"), "--json", "--rows", ",".join(COUNTED_ROWS), *TINY]
    # a benchmark, not training: it counts operators, which the device audit's own dispatch mode would see relabelled
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_BITPIPE_DEVICE_AUDIT"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return {row["row"]: row for row in map(json.loads, done.stdout.splitlines())}


@pytest.mark.multirank
@pytest.mark.parametrize("row", COUNTED_ROWS)
def test_split_runs_the_plain_operators(counted_rows, row):
    phases = counted_rows[row]["phases"]
    names = {phase: Counter(record["operator_names"]) for phase, record in phases.items()}
    assert names["I"] + names["W"] == names["B"], "I + W must dispatch exactly the whole backward's operators"
    assert names["F_d"] == names["F"], "the forward while deferring must dispatch the plain forward's operators"
    for measure in ("bytes_written", "flops"):
        assert phases["I"][measure] + phases["W"][measure] == phases["B"][measure], measure
        assert phases["F_d"][measure] == phases["F"][measure], measure
    assert phases["F_d"]["views"] == phases["F"]["views"], "no detach or other alias per linear while deferring"
    assert phases["W"]["flops"] > 0 and "aten::mm" in names["W"]
    assert counted_rows[row]["ranks"] == (2 if row.startswith("tp2") else 1)


def _phase(ms, operators, views=0, bytes_written=0, flops=0):
    return {"ms": ms, "operators": operators, "views": views, "bytes_written": bytes_written, "flops": flops}


def test_ratios_and_tables():
    phases = {"F": _phase(10, 40, 5, 100, 8), "B": _phase(20, 80, 10, 300, 16), "F_d": _phase(11, 44, 5, 100, 8),
              "I": _phase(12, 50, 6, 120, 8), "W": _phase(10, 40, 4, 200, 8)}  # fmt: skip
    r = bench.ratios(phases)
    assert r["(I + W) / B"] == {"operators": 90 / 80, "views": 1.0, "bytes_written": 320 / 300, "flops": 1.0, "ms": 1.1}
    assert r["F_d / F"] == {"operators": 1.1, "views": 1.0, "bytes_written": 1.0, "flops": 1.0, "ms": 1.1}
    zero = dict(phases, W=_phase(0, 0), B=_phase(12, 50, 6, 120, 8))
    assert bench.ratios(zero)["(I + W) / B"]["operators"] == 1.0
    text = bench.markdown([{"row": "dense bf16 sdpa", "phases": phases}])
    assert "| dense bf16 sdpa | 1.125 | 1.000 | 1.067 | 1.000 | 1.100 | 1.100 | 1.000 | 1.000 | 1.000 | 1.100 |" in text
    assert "| dense bf16 sdpa | W | 10.00 | 40 | 4 | 0.0 | 0.00 |" in text


def test_update_doc_replaces_only_its_block(tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text(f"before\n{bench.DOC_BEGIN}\nold\n{bench.DOC_END}\nafter\n")
    bench.update_doc(str(doc), "new table")
    assert doc.read_text() == f"before\n{bench.DOC_BEGIN}\nnew table\n{bench.DOC_END}\nafter\n"
    (tmp_path / "plain.md").write_text("no block\n")
    with pytest.raises(ValueError, match="bench-split"):
        bench.update_doc(str(tmp_path / "plain.md"), "x")


def test_unknown_row_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--rows", "dense fp8"])
    assert "--rows: unknown 'dense fp8'" in capsys.readouterr().err
