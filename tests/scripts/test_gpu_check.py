"""scripts/gpu_check.py, the prepared GPU check (docs/gpu.md), without a GPU.

* pure: NCCL's version and how several ranks share a GPU under it, the ``--log-json`` reading
  (throughput, TFLOP/s, memory; a missing field is named, not invented), the loss comparison
  against the single process, the budget, the table, and every command's flags accepted by the
  script that will parse them (pretrain_gpt/bert for their world size, calibrate_gpu);
* no GPU: one line and exit 2 before anything is written (in process and as a command);
* multirank: a run of several ranks that hangs is killed whole at its timeout, with every
  rank's Python stacks in the log; the dry run end to end on CPU ranks (a subset of items:
  the environment, the control and BitPipe on 4 gloo ranks against the single process, and
  two GPU-only items that are skipped), within ~2-3 minutes on 2 busy cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from ..script_support import REPO, load_script

gpu_check = load_script("gpu_check")
gpu_rank = load_script("gpu_rank")


def _iteration(i, loss, **fields):
    record = {"event": "iteration", "iteration": i, "lm_loss": loss, "tokens_per_second": 1000.0 * i,
              "tflops_per_device": 100.0 + i, "elapsed_ms": 500.0 / i, "max_memory_mib": 1000.0 + i}  # fmt: skip
    record.update(fields)
    return record


def _records(losses, **fields):
    return {i: _iteration(i, loss, **fields) for i, loss in enumerate(losses, 1)}


# ----------------------------------------------------------------------------------------------
# pure


def test_nccl_version_forms():
    assert gpu_check.parse_nccl_version((2, 27, 3)) == (2, 27, 3)
    assert gpu_check.parse_nccl_version([2, 30]) == (2, 30, 0)
    assert gpu_check.parse_nccl_version(22703) == (2, 27, 3)
    assert gpu_check.parse_nccl_version(23001) == (2, 30, 1)
    assert gpu_check.parse_nccl_version(2708) == (2, 7, 8)
    assert gpu_check.parse_nccl_version(None) is None


def test_sharing_one_gpu_depends_on_nccl():
    text, env, flags = gpu_check.nccl_sharing((2, 30, 0))
    assert env == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"} and flags == [] and "MULTI_RANK" in text
    for old in ((2, 27, 7), None):
        text, env, flags = gpu_check.nccl_sharing(old)
        assert env["NCCL_SOCKET_IFNAME"] == "lo" and "NCCL_MULTI_RANK_GPU_ENABLE" not in env
        assert flags == [gpu_rank.HOSTID_FLAG]
    assert len({gpu_rank.nccl_hostid(r) for r in range(8)}) == 8


def test_training_numbers_from_log_json():
    lines = [json.dumps({"event": "startup", "model_flops_per_iteration": 1e15}), "not json"]
    lines += [json.dumps(r) for r in _records([5.0, 4.9, 4.8, 4.7, 4.6]).values()]
    lines.append(json.dumps({"event": "summary", "max_memory_mib": 2048.0}))
    log = gpu_check.read_log_json("\n".join(lines))
    numbers = gpu_check.training_numbers(log, warmup=3)
    assert numbers["iterations"] == 5 and numbers["missing"] == []
    assert numbers["tokens_per_s"] == 4500.0  # median of iterations 4 and 5
    assert numbers["tflops_per_gpu"] == 104.5 and numbers["ms_per_iteration"] == pytest.approx((125 + 100) / 2)
    assert numbers["peak_memory_mib"] == 2048.0 and numbers["model_flops_per_iteration"] == 1e15
    text = gpu_check.summarize_training(numbers)
    assert text == "4.5k tok/s, 104.5 TFLOP/s, peak 2.0 GiB, 112 ms/it"


def test_missing_fields_are_named_not_invented():
    log = {"startup": None, "summary": None, "iterations": _records([5.0, 4.9], tflops_per_device=None, max_memory_mib=None)}
    numbers = gpu_check.training_numbers(log, warmup=3)  # fewer iterations than the warm-up: all of them
    assert numbers["missing"] == ["tflops_per_device", "max_memory_mib"]
    assert numbers["tflops_per_gpu"] is None and numbers["peak_memory_mib"] is None and numbers["tokens_per_s"] == 1500.0
    assert "TFLOP/s missing" in gpu_check.summarize_training(numbers) and "memory missing" in gpu_check.summarize_training(numbers)


def test_compare_losses():
    reference = _records([5.0, 4.0, 3.0])
    same = gpu_check.compare_losses(_records([5.0, 4.0, 3.0]), reference, 1e-4)
    assert same.ok and same.max_rel_diff == 0.0 and same.iterations == 3
    close = gpu_check.compare_losses(_records([5.0, 4.0002, 3.0]), reference, 1e-4)
    assert close.ok and close.max_rel_diff == pytest.approx(5e-5)
    off = gpu_check.compare_losses(_records([5.0, 4.001, 3.0]), reference, 1e-4)
    assert not off.ok and "iteration 2 lm_loss" in off.message and off.max_rel_diff == pytest.approx(2.5e-4)
    assert gpu_check.compare_losses(_records([5.0, 4.001, 3.0]), reference, 2e-2).ok  # bf16's tolerance
    short = gpu_check.compare_losses(_records([5.0, 4.0]), reference, 1e-4)
    assert not short.ok and "iteration 3 missing" in short.message
    nan = gpu_check.compare_losses(_records([5.0, float("nan"), 3.0]), reference, 1e-4)
    assert not nan.ok and "iteration 2" in nan.message
    assert not gpu_check.compare_losses(_records([5.0]), {}, 1e-4).ok


def test_compare_every_loss_of_bert():
    reference = {1: {"lm_loss": 7.0, "sop_loss": 0.7, "validation_lm_loss": 1.0}}
    assert gpu_check.loss_keys(reference[1]) == ["lm_loss", "sop_loss"]
    assert gpu_check.compare_losses({1: {"lm_loss": 7.0, "sop_loss": 0.7, "validation_lm_loss": 9.0}}, reference, 1e-4).ok
    wrong = gpu_check.compare_losses({1: {"lm_loss": 7.0, "sop_loss": 0.8}}, reference, 1e-4)
    assert not wrong.ok and "sop_loss" in wrong.message
    assert "sop_loss missing" in gpu_check.compare_losses({1: {"lm_loss": 7.0}}, reference, 1e-4).message


def test_budget_table_and_exit_status():
    assert gpu_check.item_timeout(60, 400) == 60
    assert gpu_check.item_timeout(60, 30) == 30  # cut to what is left
    assert gpu_check.item_timeout(60, 10) is None  # too little left: skipped
    assert gpu_check.item_timeout(15, 15) == 15
    rows = [
        {"item": "environment", "status": "ok", "numbers": "H100 | x", "seconds": 3.21},
        {"item": "bitpipe-pp4", "status": "hung (timeout 50 s)", "numbers": "", "seconds": 53.0},
        {"item": "gpt-small-bf16", "status": gpu_check.NEEDS_GPU, "numbers": "", "seconds": None},
    ]
    table = gpu_check.format_table(rows).splitlines()
    assert table[0] == "| item | status | key numbers | seconds |" and len(table) == 5
    assert table[2] == "| environment | ok | H100 / x | 3.2 |"
    assert table[4] == "| gpt-small-bf16 | skipped (needs a GPU) |  |  |"
    assert gpu_check.exit_status(rows) == 1
    assert gpu_check.exit_status([rows[0], rows[2]]) == 0


def test_summaries():
    assert gpu_check.summarize_costs({"t_forward": 70.0, "t_backward": 140.0, "t_weight": 56.0}) == (
        "F 70.0 ms, B 140.0 ms (2.00 F), W 56.0 ms (0.80 F), I 84.0 ms (1.20 F), I + W = 1.00 B"
    )
    assert gpu_check.summarize_costs({"t_forward": 70.0, "t_backward": 140.0, "t_weight": 56.0, "t_input": 91.0,
                                      "t_forward_deferring": 77.0}) == (
        "F 70.0 ms, B 140.0 ms (2.00 F), W 56.0 ms (0.80 F), I 91.0 ms (1.30 F), I + W = 1.05 B, F_d 77.0 ms (1.10 F)"
    )
    assert gpu_check.summarize_costs({"t_forward": 70.0, "t_backward": 140.0}).endswith("t_weight missing")
    rows = [dict(models=1, speedup=0.98, fused_samples_per_s=100.0), dict(models=8, speedup=6.5, fused_samples_per_s=650.0)]
    assert gpu_check.summarize_hfta(rows) == "fused vs one after another: B 1: 0.98x, B 8: 6.50x; B 8 650 samples/s"
    phases = {p: {"ms": ms, "operators": ops} for p, ms, ops in
              (("F", 10.0, 40), ("B", 20.0, 80), ("F_d", 10.5, 40), ("I", 12.0, 50), ("W", 9.0, 30))}  # fmt: skip
    assert gpu_check.summarize_split([{"row": "dense bf16 sdpa", "phases": phases}]) == (
        "dense bf16 sdpa: (I + W)/B 1.050 time, 1.000 operators, F_d/F 1.050 time")
    line = gpu_check.summarize_environment({"gpu": "NVIDIA H100", "torch": "2.11", "nccl": "2.27.7", "transformer_engine": "no"})
    assert line == "NVIDIA H100, torch 2.11, NCCL 2.27.7, TE no"


def _script_args(command, script):
    return command[command.index(str(REPO / "scripts" / script)) + 1 :]


def test_items_and_their_flags(tmp_path, monkeypatch):
    """Every command is one its script accepts, for its world size, with a GPU (and, for the
    Transformer Engine items, with TE importable)."""
    from megatron_bitpipe.training import arguments
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.bert import BertTask
    from megatron_bitpipe.training.gpt import GPTTask

    calibrate = load_script("calibrate_gpu")
    bench_split = load_script("bench_split")
    real_find_spec = importlib.util.find_spec
    items = gpu_check.build_items(tmp_path / "out", tmp_path / "work", dry_run=False, nccl_version=(2, 27, 7))
    names = [i.name for i in items]
    assert names[0] == "environment" and len(names) == len(set(names)) == 31
    multirank = [i for i in items if i.kind == "multirank"]
    assert multirank[0].name == gpu_check.CONTROL and "--pipeline-schedule" not in multirank[0].command
    assert {i.reference for i in multirank} <= {i.name for i in items if i.kind == "reference"}
    assert all(names.index(i.reference) < names.index(i.name) for i in multirank)
    outputs = {gpu_check.LOG_FILE, gpu_check.RESULTS_FILE, gpu_check.TABLE_FILE}
    outputs |= {Path(i.output).name for i in items if i.output and Path(i.output).parent == tmp_path / "out"}
    assert all(Path(i.output).parent == tmp_path / "out" for i in items if i.output and i.name != "split-bench")
    assert len(outputs) <= 8  # split-bench's results: in the work folder, their details in gpu_check.json
    assert all(not i.log_json or Path(i.log_json).parent == tmp_path / "work" for i in items)
    for item in items:
        if item.kind == "multirank":
            assert item.command[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
            assert item.command[6].endswith("gpu_rank.py") and item.command[7] == gpu_rank.HOSTID_FLAG
            assert item.env["NCCL_SOCKET_IFNAME"] == "lo"
            assert item.rtol == (2e-2 if "--bf16" in item.command else 1e-4)
        assert item.needs_te == ("transformer_engine" in item.command) and (item.needs_gpu or not item.needs_te)
        monkeypatch.setattr(arguments.importlib.util, "find_spec", lambda name, *a, te=item.needs_te: (
            object() if te and name == "transformer_engine" else real_find_spec(name, *a)))
        if item.kind in ("train", "reference", "multirank", "fault"):
            bert = "pretrain_bert.py" in " ".join(item.command)
            args = _script_args(item.command, "pretrain_bert.py" if bert else "pretrain_gpt.py")
            world = 1 if item.kind in ("train", "reference") else 4
            parsed = parse_args(BertTask() if bert else GPTTask(), args, world_size=world, cuda_available=True)
            assert parsed.log_json == item.log_json and parsed.eval_iters == 0
        if item.kind == "fault":
            assert parsed.inject_fault in ("hang", "crash") and parsed.inject_fault_iteration <= parsed.train_iters
        if item.name == "split-bench":
            split = bench_split._parser().parse_args(_script_args(item.command, "bench_split.py"))
            assert split.device == "cuda" and split.json_out == item.output and Path(item.output).parent == tmp_path / "work"
            assert set(split.rows.split(",")) <= set(bench_split.ROWS)
            calibrate.check_args(calibrate._parser().parse_args(bench_split.share_argv(split, "dense bf16 sdpa")))
        if item.kind == "calibrate":
            parsed = calibrate._parser().parse_args(_script_args(item.command, "calibrate_gpu.py"))
            calibrate.check_args(parsed)
            assert parsed.output == item.output and parsed.bf16 == ("bf16" in item.name)
            assert parsed.attention_backend == ("sdpa" if item.name.endswith("sdpa") else None)
    for name, schedule in (("zbv-pp4", "zbv"), ("dualpipev-pp4", "dualpipev")):  # one item per family, checked above
        item = next(i for i in items if i.name == name)
        assert item.reference == "ref-gpt-fp32" and " ".join(item.command).count(
            f"--pipeline-schedule {schedule} --pipeline-model-parallel-size 4") == 1
    layout = next(i for i in items if i.name == "dualpipev-pp4-layout")
    assert layout.reference == "ref-gpt-fp32" and f"--pipeline-model-parallel-layout {gpu_check.UNEVEN_LAYOUT}" in " ".join(layout.command)
    moe = next(i for i in items if i.name == "moe-bitpipe-pp2-ep2")
    assert moe.reference == "ref-moe-gpt-fp32" and " ".join(moe.command).count("--expert-model-parallel-size 2") == 1
    cp = next(i for i in items if i.name == "bitpipe-pp2-cp2")
    assert cp.reference == "ref-gpt-cp-fp32" and cp.needs_gpu and next(i for i in items if i.name == cp.reference).needs_gpu
    cp_args = _script_args(cp.command, "pretrain_gpt.py")
    parsed = parse_args(GPTTask(), cp_args, world_size=4, cuda_available=True)
    assert (parsed.context_parallel_size, parsed.pipeline_model_parallel_size, parsed.attention_backend) == (2, 2, "sdpa")
    reference = parse_args(GPTTask(), _script_args(next(i for i in items if i.name == cp.reference).command, "pretrain_gpt.py"),
                           world_size=1, cuda_available=True)  # fmt: skip
    assert (reference.attention_dropout, reference.hidden_dropout, reference.attention_backend) == (0.0, 0.0, "sdpa")
    gpt = next(i for i in items if i.name == "gpt-0.5b-bf16").command
    assert " ".join(gpt).count("--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048") == 1
    new = gpu_check.build_items(tmp_path / "out", tmp_path / "work", dry_run=False, nccl_version=(2, 30, 1))
    assert all(i.env == {"NCCL_MULTI_RANK_GPU_ENABLE": "1"} and gpu_rank.HOSTID_FLAG not in i.command for i in new if i.kind == "multirank")


def test_transformer_engine_items_are_skipped_without_it(tmp_path, monkeypatch, capsys):
    """On a GPU without Transformer Engine the TE items are skipped with one clear status,
    nothing is run, and the check still passes."""
    monkeypatch.setattr(gpu_check, "_cuda_available", lambda: (True, (2, 27, 7)))
    monkeypatch.setattr(gpu_check, "have_transformer_engine", lambda: False)
    monkeypatch.setattr(gpu_check.Runner, "run", lambda *a: pytest.fail("a skipped item was run"))
    assert gpu_check.main(["--out", str(tmp_path), "--items", "bitpipe-split-te-pp4"]) == 0
    rows = json.loads((tmp_path / gpu_check.RESULTS_FILE).read_text())["items"]
    assert [(r["item"], r["status"]) for r in rows] == [
        ("ref-gpt-te-fp32", gpu_check.NEEDS_TE), ("bitpipe-split-te-pp4", gpu_check.NEEDS_TE)]
    assert "| bitpipe-split-te-pp4 | skipped (Transformer Engine not importable) |" in capsys.readouterr().out


def test_a_fault_item_is_ok_only_when_the_job_ended_itself_with_the_watchdogs_line():
    line = "watchdog: job ended at iteration 2: rank 1 hung at iteration 2 (training step): 15.0 s outside any communication"
    ended = gpu_check.Ran(1, 29.9, False, f"noise\n[rank0]: {line}\nmore\n", 120.0)
    status, numbers, details = gpu_check.evaluate_fault(ended, cut=False)
    assert status == gpu_check.OK and numbers == f"exit 1 after 29.9 s: {line}" and details == {"ended_after_s": 29.9, "fault_line": line}
    hung = gpu_check.Ran(None, 120.0, True, "iteration 1\n", 120.0)
    assert gpu_check.evaluate_fault(hung, cut=False)[0] == "not ended (timeout 120 s)"
    assert gpu_check.evaluate_fault(hung, cut=True)[0] == "timeout (budget, 120 s)"
    assert gpu_check.evaluate_fault(gpu_check.Ran(0, 9.0, False, line, 120.0), cut=False)[0].startswith("failed (exit 0")
    assert gpu_check.evaluate_fault(gpu_check.Ran(1, 9.0, False, "Traceback", 120.0), cut=False)[0] == "failed (exit 1, no watchdog line)"


def test_dry_run_items_fit_a_cpu(tmp_path):
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.bert import BertTask
    from megatron_bitpipe.training.gpt import GPTTask

    items = gpu_check.build_items(tmp_path, tmp_path, dry_run=True, nccl_version=None)
    runnable = [i for i in items if not i.needs_gpu]
    assert {i.kind for i in runnable} == {"environment", "reference", "multirank", "fault"}
    assert all(i.kind in ("train", "benchmark", "calibrate") or "--bf16" in i.command or i.needs_te or i.name in gpu_check.GPU_ONLY
               for i in items if i.needs_gpu)  # fmt: skip
    for item in runnable[1:]:
        bert = "pretrain_bert.py" in " ".join(item.command)
        args = _script_args(item.command, "pretrain_bert.py" if bert else "pretrain_gpt.py")
        parsed = parse_args(BertTask() if bert else GPTTask(), args, world_size=1 if item.kind == "reference" else 4, cuda_available=False)
        assert parsed.hidden_size == 32 and parsed.train_iters == 2


def test_the_documented_dry_run_is_this_versions(tmp_path):
    """docs/gpu.md's dry-run table (``python scripts/doc_samples.py gpu-dry-run``) has a row for
    every item the dry run has, in its order, each GPU-only item ``skipped (needs a GPU)`` and
    every other one run."""
    sys.path.insert(0, str(REPO / "scripts"))
    import doc_samples

    items = gpu_check.build_items(tmp_path, tmp_path, dry_run=True, nccl_version=None)
    block = doc_samples.documented_block("docs/gpu.md", "gpu-dry-run")
    rows = [line.split(" | ") for line in block.splitlines() if line.startswith("| ") and not line.startswith("| item")]
    assert [row[0].lstrip("| ") for row in rows] == [item.name for item in items]
    for item, row in zip(items, rows):
        assert (row[1] == gpu_check.NEEDS_GPU) == item.needs_gpu, row
    assert doc_samples.GPU_DRY_RUN.one_line() in (REPO / "docs" / "gpu.md").read_text()


def test_no_gpu_refuses_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "_cuda_available", lambda: (False, None))
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == gpu_check.NO_GPU + "\n"
    assert not (tmp_path / "out").exists()


def test_gpu_rank_needs_a_target():
    with pytest.raises(SystemExit, match="no target script"):
        gpu_rank.main([gpu_rank.HOSTID_FLAG])


# ----------------------------------------------------------------------------------------------
# processes


@pytest.mark.multirank
def test_no_gpu_command_exits_2(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120, env=env, cwd=REPO)  # fmt: skip
    assert result.returncode == 2
    assert (result.stdout + result.stderr).splitlines() == [gpu_check.NO_GPU]
    assert not (tmp_path / "out").exists()


#: seconds the hung item runs: ample for torchrun and 2 ranks to start and print on busy cores
HANG_TIMEOUT_S = 30


@pytest.mark.multirank
def test_a_hung_run_is_killed_whole_with_its_stacks(tmp_path):
    """torchrun starts its ranks in sessions of their own: the whole tree must go, and every
    rank's Python stack must reach the log first."""
    target = tmp_path / "wait_forever.py"
    target.write_text(textwrap.dedent("""
        import os, sys, time
        def wait_for_peer():
            print(f"rank {os.environ['LOCAL_RANK']} hostid {os.environ.get('NCCL_HOSTID')}", flush=True)
            time.sleep(600)
        wait_for_peer()
    """))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(REPO / "scripts" / "gpu_rank.py"), gpu_rank.HOSTID_FLAG, str(target)]  # fmt: skip
    item = gpu_check.Item("hang", "multirank", command, HANG_TIMEOUT_S, "a rank that never returns", log_json=str(tmp_path / "never.jsonl"),
                          reference="none", rtol=1e-4)  # fmt: skip
    runner = gpu_check.Runner(tmp_path / "log", dry_run=True)
    stack_dirs_before = set(Path(tempfile.gettempdir()).glob("gpu_check_stacks-*"))
    try:
        ran = runner.run(item, 1, 1, timeout=HANG_TIMEOUT_S)
    finally:
        runner.close()
    assert ran.timed_out and ran.returncode is None and ran.seconds < HANG_TIMEOUT_S + gpu_check.DUMP_GRACE_S + 10
    assert "rank 0 hostid gpu-check-rank-0" in ran.output and "rank 1 hostid gpu-check-rank-1" in ran.output
    # faulthandler's dump of each rank, whole, one after another (not interleaved in the shared log)
    blocks = ran.output.split("----- hang: ")[1:]
    assert [b.splitlines()[0] for b in blocks] == ["timeout; SIGUSR1 (Python stacks of every thread) to 2 rank(s)",
                                                  "rank 0 stacks", "rank 1 stacks"]  # fmt: skip
    for block in blocks[1:]:
        frames = [line.strip() for line in block.splitlines()[1:] if line.strip().startswith("File ")]
        assert "wait_forever.py\", line 5 in wait_for_peer" in frames[0] and frames[-1].endswith("in <module>"), block
    assert set(Path(tempfile.gettempdir()).glob("gpu_check_stacks-*")) == stack_dirs_before  # removed
    assert gpu_check.STACKS_VARIABLE == gpu_rank.STACKS_VARIABLE
    assert gpu_check._tagged(f"{os.getpid()}-1") == []  # nothing of the run survives
    status, numbers, _ = gpu_check.evaluate(item, ran, {})
    assert status == f"hung (timeout {HANG_TIMEOUT_S} s)" and numbers == "no --log-json written"
    log = (tmp_path / "log").read_text()
    assert log.startswith(f"\n===== [1/1] hang | timeout {HANG_TIMEOUT_S} s | ") and "SIGUSR1" in log


DRY_ITEMS = "environment,gpt-small-bf16,calibrate-bf16,bitpipe-pp4"


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_dry_run_end_to_end(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--dry-run", "--out", str(out), "--items", DRY_ITEMS],
                            capture_output=True, text=True, timeout=540, cwd=REPO)  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = result.stdout.splitlines()
    table = lines[lines.index("| item | status | key numbers | seconds |") :]
    assert len(table) == 2 + 5 and table == lines[-7:]  # the table is printed last
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1] for line in table[2:]}
    assert rows == {
        "environment": "ok", "gpt-small-bf16": gpu_check.NEEDS_GPU, "calibrate-bf16": gpu_check.NEEDS_GPU,
        "ref-gpt-fp32": "ok", "bitpipe-pp4": "ok",
    }  # fmt: skip
    for name in ("pretrain_gpt.py", "calibrate_gpu.py", "torch.distributed.run"):  # every command printed
        assert any(line.startswith("    $ ") and name in line for line in lines), name
    assert sorted(p.name for p in out.iterdir()) == sorted([gpu_check.LOG_FILE, gpu_check.RESULTS_FILE, gpu_check.TABLE_FILE])
    results = json.loads((out / gpu_check.RESULTS_FILE).read_text())
    items = {r["item"]: r for r in results["items"]}
    assert results["mode"] == "dry run (CPU)" and items["environment"]["environment"]["gpu"] == "no CUDA GPU"
    pipelined = items["bitpipe-pp4"]
    assert pipelined["comparison"]["ok"] and pipelined["comparison"]["iterations"] == 2
    assert pipelined["training"]["missing"] == ["tflops_per_device"]  # no GPU, no TFLOP/s
    log = (out / gpu_check.LOG_FILE).read_text()
    assert log.count("\n===== [") == 5 and "no CUDA GPU: training on the CPU with gloo" in log
