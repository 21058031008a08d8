"""The stable command line: ``python -m megatron_bitpipe.schedules simulate ...``."""

from __future__ import annotations

import json
import os
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
    assert f"wrote the Gantt chart to {plot}" in out.stderr and f"wrote the Chrome trace to {trace}" in out.stderr
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


@pytest.mark.multirank
def test_module_help_names_the_module():
    out = run("--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m megatron_bitpipe.schedules ")


def _help(capsys, *args) -> str:
    from megatron_bitpipe.schedules.cli import main

    with pytest.raises(SystemExit) as info:
        main([*args, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_console_script_help(capsys, monkeypatch):
    """``bitpipe-schedule --help`` names the command; no reStructuredText markup; every cost
    flag explains itself with its unit."""
    monkeypatch.setattr(sys, "argv", ["/venv/bin/bitpipe-schedule", "--help"])
    top, simulate_help, plan_help = _help(capsys), _help(capsys, "simulate"), _help(capsys, "plan")
    recommend_help = _help(capsys, "recommend")
    assert top.startswith("usage: bitpipe-schedule [-h] {list,simulate,plan,recommend,layout-search}")
    assert simulate_help.startswith("usage: bitpipe-schedule simulate ") and plan_help.startswith("usage: bitpipe-schedule plan ")
    assert recommend_help.startswith("usage: bitpipe-schedule recommend ")
    assert "``" not in top + simulate_help + plan_help + recommend_help
    assert "in Ma: one micro-batch's activations through L/D layers" in " ".join(recommend_help.split())
    flat = " ".join(simulate_help[simulate_help.index("\ncosts:") :].split())  # the cost flags' section
    order = ["--t-forward TIME", "--t-backward TIME", "--t-weight TIME", "--t-p2p TIME", "--p2p-bytes BYTES",
             "--p2p-bandwidth BYTES_PER_TIME", "--t-sync TIME"]  # fmt: skip
    starts = [flat.index(flag + " ") for flag in order] + [len(flat)]
    helps = {flag: flat[start + len(flag) : end] for flag, start, end in zip(order, starts, starts[1:])}
    for flag in ("--t-forward TIME", "--t-backward TIME", "--t-weight TIME", "--t-p2p TIME", "--t-sync TIME"):
        assert "in TIME units" in helps[flag], flag
    assert "bytes of one message" in helps["--p2p-bytes BYTES"] and "bytes per TIME unit" in helps["--p2p-bandwidth BYTES_PER_TIME"]
    assert "pip install 'megatron-bitpipe[plot]'" in " ".join(simulate_help.split())


def test_plot_without_matplotlib_names_the_extra(capsys, monkeypatch, tmp_path):
    from megatron_bitpipe.schedules.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    plot = tmp_path / "g.png"
    assert main(["simulate", "--schedule", "bitpipe", "-D", "4", "-N", "8", "--plot", str(plot)], prog="bitpipe-schedule") == 2
    err = capsys.readouterr().err
    assert err == (
        "bitpipe-schedule: error: --plot needs matplotlib, which is not installed: "
        "pip install 'megatron-bitpipe[plot]' (in a checkout: pip install -e '.[plot]')\n"
    )
    assert not plot.exists()


def test_misspelled_flag_names_the_closest(capsys):
    from megatron_bitpipe.schedules.cli import main

    assert main(["simulate", "--schedule", "bitpipe", "-D", "4", "-N", "8", "--t-forwad", "2"], prog="bitpipe-schedule") == 2
    assert capsys.readouterr().err == "bitpipe-schedule: error: unrecognized arguments: --t-forwad 2 (did you mean --t-forward?)\n"


def test_gantt_blocks_name_their_stage():
    """Each block says its micro-batch and the stage of its chunk: BitPipe's rank 0 holds
    stages 0, 3, 7 and 4 of D=4 (chunks 0-3), so the same micro-batch number appears with
    different stages."""
    from megatron_bitpipe.schedules import generate, simulate
    from megatron_bitpipe.schedules.render import block_label, chrome_trace

    result = simulate(generate("bitpipe", 4, 4))
    rank0 = {(e.action.chunk, block_label(result, e)) for e in result.events if e.rank == 0 and str(e.action.type) == "F"}
    assert {chunk: label.split("\n")[1] for chunk, label in rank0} == {0: "s0", 1: "s3", 2: "s7", 3: "s4"}
    assert all(label.split("\n")[0].isdigit() for _, label in rank0)
    stages = {e["args"]["stage"] for e in chrome_trace(result)["traceEvents"] if e.get("ph") == "X" and e["tid"] == 0}
    assert stages == {0, 3, 4, 7}


@pytest.mark.multirank
@pytest.mark.parametrize("command", [["simulate"], ["plan", "--communication"]])
def test_reader_that_stops_early(command):
    """``... | head -1``: the reader is gone before the first write; the command ends with
    status 0 and nothing on stderr (no BrokenPipeError traceback, no usage error)."""
    read, write = os.pipe()
    os.close(read)
    try:
        out = subprocess.run([sys.executable, "-m", "megatron_bitpipe.schedules", *command, "--schedule", "bitpipe",
                              "-D", "4", "-N", "8"], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert (out.returncode, out.stderr) == (0, "")


def test_registry_drives_the_choice_and_the_listing(capsys):
    """A registered generator is a schedule everywhere: ScheduleChoice plans it, the command
    line lists and accepts it; a name is registered once."""
    from dataclasses import replace

    from megatron_bitpipe.schedules import REGISTRY, ScheduleChoice, register
    from megatron_bitpipe.schedules.cli import main

    toy = replace(REGISTRY["1f1b"], name="toy-1f1b", summary="1F1B under another name", runner=None)
    register(toy)
    try:
        plan = ScheduleChoice("toy-1f1b").plan(2, 4)
        assert plan.compute_only().actions == ScheduleChoice("1f1b").plan(2, 4).compute_only().actions
        assert main(["list"]) == 0
        listing = capsys.readouterr().out.splitlines()
        assert [line.split()[0] for line in listing] == list(REGISTRY)
        assert "1F1B under another name" in listing[-1] and "peer (simulator, executor)" in listing[-1]
        assert main(["plan", "--schedule", "toy-1f1b", "-D", "2", "-N", "2"]) == 0
        with pytest.raises(ValueError, match="already registered"):
            register(toy)
    finally:
        del REGISTRY["toy-1f1b"]
    assert main(["plan", "--schedule", "toy-1f1b", "-D", "2", "-N", "2"]) == 2
    assert "invalid choice: 'toy-1f1b'" in capsys.readouterr().err
