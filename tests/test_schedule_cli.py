"""The stable command line: ``python -m megatron_bitpipe.schedules simulate ...``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "megatron_bitpipe.schedules", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.multirank
def test_json_summary(tmp_path):
    plot, trace = tmp_path / "g.png", tmp_path / "t.json"
    out = run("simulate", "--schedule", "bitpipe", "--pipeline-model-parallel-size", "4", "--num-microbatches", "8",
              "--t-forward", "1", "--t-backward", "2", "--t-p2p", "0", "--t-sync", "0",
              "--json", "--plot", str(plot), "--trace", str(trace))
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["schedule"] == "bitpipe" and summary["pp"] == 4 and summary["num_microbatches"] == 8
    assert summary["valid"] is True
    assert summary["bubble_ratio"] == pytest.approx(2 / 26)
    assert summary["makespan"] == pytest.approx(26)
    assert summary["peak_activations"] == [4.0] * 4
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("ph") == "X" and e["cat"] == "forward" for e in events) == 4 * 4 * 4


@pytest.mark.multirank
def test_cost_file_and_override(tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"t_forward": 3.0, "t_backward": 6.0, "unrelated": 1}))
    out = run("simulate", "--schedule", "1f1b", "-D", "2", "-N", "2", "--costs", str(costs), "--t-backward", "3", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["costs"]["t_forward"] == 3.0
    assert json.loads(out.stdout)["costs"]["t_backward"] == 3.0


@pytest.mark.multirank
@pytest.mark.parametrize(
    "args,flag",
    [
        (["--schedule", "bitpipe", "-D", "3", "-N", "6"], "--pipeline-model-parallel-size"),
        (["--schedule", "bitpipe", "-D", "4", "-N", "2"], "--num-microbatches"),
        (["--schedule", "bitpipe", "-D", "4", "-N", "7"], "--num-microbatches"),
        (["--schedule", "interleaved", "-D", "4", "-N", "8", "--virtual-pipeline-model-parallel-size", "0"],
         "--virtual-pipeline-model-parallel-size"),
        (["--schedule", "1f1b", "-D", "4", "-N", "8", "--t-forward", "-1"], "--t-forward"),
        (["--schedule", "chimera", "-D", "4", "-N", "8", "--t-sync", "-0.5"], "--t-sync"),
        (["--schedule", "gpipe", "-D", "4", "-N", "8"], "--schedule"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, flag):
    out = run("simulate", *args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], out.stderr


@pytest.mark.multirank
def test_plan_listing():
    out = run("plan", "--schedule", "bitpipe", "-D", "2", "-N", "2")
    assert out.returncode == 0
    assert out.stdout.splitlines()[0].startswith("rank 0: F0.0 F1.1")
