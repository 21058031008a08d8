"""scripts/bench_heterogeneous.py: its arithmetic (pure) and a short end-to-end run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_heterogeneous as bench  # noqa: E402


def test_static_counts_follow_the_speeds():
    assert bench.static_counts((1, 1, 2, 4), 16) == [6, 6, 3, 1]
    assert bench.static_counts((1, 1, 1, 1), 16) == [4, 4, 4, 4]
    assert bench.static_counts((1, 8), 4) == [3, 1]  # at least one each


def test_time_to_target_interpolates_between_evaluations():
    curve = [(1.0, 5.0), (2.0, 4.0), (3.0, 3.0)]
    assert bench.time_to_target(curve, 3.5) == pytest.approx(2.5)
    assert bench.time_to_target(curve, 5.5) == 1.0
    assert bench.time_to_target(curve, 2.0) is None


def test_every_method_parses():
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.gpt import GPTTask

    settings = bench.Settings()
    for method in bench.METHODS:
        flags = bench.pretrain_flags(settings, "synthetic", None, 1, bench.CLUSTERS["heterogeneous"], method)
        args = parse_args(GPTTask(), flags, world_size=bench.REPLICAS)
        assert args.data_parallel_mode == ("sync" if method == "sync" else "abs-sgd")


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_short_run_writes_rows_table_and_plot(tmp_path):
    out, png = tmp_path / "rows.json", tmp_path / "plot.png"
    argv = ["--datasets", "synthetic", "--seeds", "1", "--clusters", "heterogeneous", "--methods", "sync", "abs-sgd",
            "--iters", "3", "--eval-interval", "1", "--t-forward", "1", "--t-backward", "2", "--target-synthetic", "9",
            "--json", str(out), "--plot", str(png)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    script = str(ROOT / "scripts" / "bench_heterogeneous.py")
    result = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, timeout=800, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["command"].startswith("python scripts/bench_heterogeneous.py") and results["cores"] > 0
    rows = results["rows"]
    assert [r["method"] for r in rows] == ["sync", "abs-sgd"]
    for row in rows:
        assert len(row["curve"]) == 3 and row["samples_per_second"] > 0 and row["time_to_target"] is not None
        assert len(row["load_average"]) == 2
    assert rows[1]["records"][1]["abs_staleness"] == 1
    assert "| synthetic (9) | heterogeneous | abs-sgd |" in result.stdout and png.stat().st_size > 0
    again = subprocess.run([sys.executable, script, "--from-json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert again.returncode == 0 and "| synthetic (9) | heterogeneous | abs-sgd |" in again.stdout
