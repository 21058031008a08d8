"""The emulated cluster: its building blocks, and a smoke run of scripts/bench_emulated.py.

* The emulated layer computes ``x + x * w`` with the right gradients, and the live-activation
  meter sees its saved input from forward to backward (one launched rank).
* The emulated device: launches do not block the CPU; a send leaves only when the device has
  produced its data; exiting synchronizes; the blocking mode sleeps (two launched ranks,
  lower bounds only, so a loaded machine cannot fail them).
* The benchmark script end to end on two ranks with millisecond layers: one JSON list with
  the documented fields, predictions equal to the simulator's, step times no shorter than
  the emulated compute, measured peak activations equal to the simulator's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_bitpipe.cpu.launcher import launch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_emulated.py"
FIELDS = {
    "schedule",
    "runtime",
    "pp",
    "num_microbatches",
    "step_time",
    "step_times",
    "best_step_time",
    "predicted_step_time",
    "speedup_vs_interleaved",
    "predicted_speedup_vs_interleaved",
    "peak_activations",
    "predicted_peak_activations",
    "peak_saved_bytes",
    "costs",
    "load_average",
}


def _layer_and_meter() -> dict:
    import torch
    from megatron.core.transformer.spec_utils import build_module

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.benchmarking.emulation import emulated_layer_spec
    from megatron_bitpipe.benchmarking.megatron_baseline import tiny_gpt_config
    from megatron_bitpipe.benchmarking.meters import LiveActivationMeter

    enable_cpu_megatron()
    config = tiny_gpt_config(num_layers=2, hidden_size=8, num_attention_heads=2)
    layers = [build_module(emulated_layer_spec(0.0, 0.0), config=config, layer_number=i + 1) for i in range(2)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.uniform_(-1, 1)
    x = torch.randn(4, 3, 8, requires_grad=True)
    parameters = [p for layer in layers for p in layer.parameters()]
    meter = LiveActivationMeter(parameters)
    with meter:
        hidden = x
        for layer in layers:
            hidden, context = layer(hidden_states=hidden, attention_mask=None, context=None)
        loss = (hidden * hidden).sum()  # saves `hidden` (not a layer activation)
    peaks = (meter.peak_layer_bytes, meter.peak_bytes)
    loss.backward()
    reference_x = x.detach().clone().requires_grad_()
    reference_weights = [p.detach().clone().requires_grad_() for p in parameters]
    hidden = reference_x
    for weight in reference_weights:
        hidden = hidden + hidden * weight
    (hidden * hidden).sum().backward()
    return {
        "numbers": [layer.layer_number for layer in layers],
        "context": context,
        "peaks": peaks,
        "live_after": (meter.live_bytes, meter.live_layer_bytes),
        "x_bytes": x.numel() * 4,
        "grads_equal": torch.allclose(x.grad, reference_x.grad)
        and all(torch.allclose(p.grad, r.grad) for p, r in zip(parameters, reference_weights)),
    }


def _device_facts() -> dict:
    """What the emulated device waits for, recorded instead of timed: every ``sleep_until``
    deadline with the thread that slept, and the compute it was given."""
    import threading

    import torch
    import torch.distributed as dist
    from megatron.core.transformer.spec_utils import build_module

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.benchmarking import emulation
    from megatron_bitpipe.benchmarking.megatron_baseline import tiny_gpt_config

    enable_cpu_megatron()
    sleeps = []
    real_sleep = emulation.sleep_until

    def recorded_sleep(deadline: float) -> None:
        sleeps.append((threading.current_thread().name, deadline))
        real_sleep(deadline)

    emulation.sleep_until = recorded_sleep
    rank = dist.get_rank()
    config = tiny_gpt_config(num_layers=1, hidden_size=8, num_attention_heads=2)
    slow = build_module(emulation.emulated_layer_spec(0.5, 0.0), config=config, layer_number=1)
    facts = {}
    dist.barrier()
    with emulation.EmulatedDevice(asynchronous=True) as device:
        out, _ = slow(hidden_states=torch.ones(2, 1, 8))
        facts["sleeps_after_launch"] = list(sleeps)
        facts["launched"] = device.launched_seconds
        facts["device_done"] = device.free_at
        if rank == 0:
            work = dist.isend(out.detach(), 1)
            facts["main_sleeps_after_isend"] = [s for s in sleeps if s[0] == "MainThread"]
            work.wait()
        else:
            received = torch.empty(2, 1, 8)
            dist.recv(received, 0)
            facts["received"] = received.shape
    facts["async_sleeps"] = list(sleeps)
    sleeps.clear()
    with emulation.EmulatedDevice(asynchronous=False) as blocking:
        build_module(emulation.emulated_layer_spec(0.05, 0.0), config=config, layer_number=1)(hidden_states=torch.ones(1))
        facts["blocking_sleeps"] = [name for name, _ in sleeps]
        facts["blocking_launched"] = blocking.launched_seconds
    emulation.sleep_until = real_sleep
    return facts


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_emulated_layer_gradients_and_activation_meter():
    facts = launch(_layer_and_meter, 1, timeout=100)[0]
    assert facts["numbers"] == [1, 2]
    assert facts["context"] is None
    assert facts["grads_equal"]
    # Both layers' inputs live at once before backward; plus the loss's saved output.
    assert facts["peaks"] == (2 * facts["x_bytes"], 3 * facts["x_bytes"])
    assert facts["live_after"] == (0, 0)


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_emulated_device_runs_ahead_and_sends_when_data_is_ready():
    facts = launch(_device_facts, 2, timeout=100)
    for rank_facts in facts:
        assert rank_facts["sleeps_after_launch"] == [], "an asynchronous launch must not block the CPU"
        assert rank_facts["launched"] == pytest.approx(0.5)
        done = rank_facts["device_done"]
        assert ("MainThread", done) in rank_facts["async_sleeps"], "leaving the device waits for its queued compute"
        assert rank_facts["blocking_sleeps"] == ["MainThread"] and rank_facts["blocking_launched"] == pytest.approx(0.05)
    assert facts[0]["main_sleeps_after_isend"] == [], "isend is deferred, not waited for"
    assert ("emulated-device-sends", facts[0]["device_done"]) in facts[0]["async_sleeps"], (
        "a send leaves once the producing compute is done"
    )
    assert facts[1]["received"] == (2, 1, 8)


def _run_script(*flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_benchmark_smoke_json():
    from megatron_bitpipe.schedules import CostModel, generate, simulate

    t_forward, t_backward = 4.0, 8.0
    done = _run_script(
        "--grid", "2:2,4", "--t-forward", str(t_forward), "--t-backward", str(t_backward),
        "--repeats", "1", "--warmup", "0", "--json",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)
    schedules = ["1f1b", "interleaved", "chimera", "bitpipe", "bitpipe+split-backward", "zbv", "dualpipev"]
    assert [(r["schedule"], r["num_microbatches"]) for r in rows] == [
        (s, n) for s in schedules for n in (2, 4) if (s, n) != ("dualpipev", 2)  # DualPipeV: N >= 2D
    ]
    assert [r["runtime"] for r in rows] == ["megatron-core"] * 4 + ["megatron_bitpipe"] * 9
    for row in rows:
        assert FIELDS <= row.keys()
        assert row["pp"] == 2
        costs = CostModel(**row["costs"])
        assert (costs.t_forward, costs.t_backward) == (t_forward, t_backward)
        assert costs.t_p2p > 0, "the p2p latency is measured"
        name, split = row["schedule"].removesuffix("+split-backward"), row["schedule"].endswith("+split-backward")
        ordered = split or name in ("zbv", "dualpipev")
        plan = generate(name, 2, row["num_microbatches"], split_backward=split,
                        costs=CostModel(t_forward, t_backward) if ordered else None)
        assert row["predicted_step_time"] == pytest.approx(simulate(plan, costs).makespan)
        # Every rank computes N x (t_F + t_B) of emulated time: no step can be shorter.
        assert row["step_time"] >= 0.99 * row["num_microbatches"] * (t_forward + t_backward)
        assert row["speedup_vs_interleaved"] > 0
        assert row["peak_activations"] == row["predicted_peak_activations"]  # split: held until W
        assert all(b > 0 for b in row["peak_saved_bytes"])
    assert rows[2]["speedup_vs_interleaved"] == rows[3]["speedup_vs_interleaved"] == 1.0


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_benchmark_moe_smoke_json():
    """MoE layers: every layer waits its all-to-alls; the predictions are the simulator's for the
    same costs and the step times no shorter than the emulated compute and all-to-alls."""
    from megatron_bitpipe.schedules import CostModel, ScheduleChoice, simulate

    t_forward, t_backward, bandwidth = 4.0, 8.0, 2048.0
    done = _run_script(
        "--grid", "2:4", "--t-forward", str(t_forward), "--t-backward", str(t_backward), "--moe-a2a-bandwidth", str(bandwidth),
        "--schedules", "bitpipe,dualpipe,dualpipev", "--repeats", "1", "--warmup", "0", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)
    assert [r["schedule"] for r in rows] == ["bitpipe", "dualpipe", "dualpipev"]
    t_a2a = 16 * 2 * 2 * 32 * 4 / 2 / bandwidth
    exchange = 2 * 2 * t_a2a  # two layers per rank, dispatch and combine each
    for row in rows:
        assert row["t_a2a"] == pytest.approx(t_a2a)
        costs = CostModel(**row["costs"])
        assert (costs.t_forward, costs.t_backward) == pytest.approx((t_forward + exchange, t_backward + exchange))
        choice = ScheduleChoice.from_label(row["schedule"])
        if choice.splits_backward:
            choice = replace(choice, costs=CostModel(**{**row["costs"], "t_p2p": 0.0}))  # ordered for the compute
        assert row["predicted_step_time"] == pytest.approx(simulate(choice.plan(2, 4), costs).makespan)
        assert row["step_time"] >= 0.99 * 4 * (t_forward + t_backward + 2 * exchange)


@pytest.mark.multirank
@pytest.mark.parametrize(
    "flags, flag",
    [(("--grid", "3:3"), "--grid"), (("--layers-per-rank", "3"), "--layers-per-rank"), (("--schedules", "gpipe"), "--schedules")],
)
def test_bad_flags_are_named(flags, flag):
    done = _run_script(*flags, timeout=60)
    assert done.returncode == 2
    assert flag in done.stderr.strip().splitlines()[-1]
