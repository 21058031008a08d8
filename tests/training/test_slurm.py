"""The sbatch templates on a real one-node SLURM cluster (``scripts/slurm/local_cluster.sh``).

The module's fixture brings the cluster up (root only; apt-get installs slurm-wlm and munge
when they are missing), submits five jobs from a directory outside the checkout, waits for
them and stops the daemons it started. The jobs run one at a time (the templates ask for
``--exclusive``); the first on a node with two GPUs backed by dummy devices, the others on the
node set up again without GPUs (an exclusive job gets all GPUs of its node):

* ``bert_bitpipe`` — the BERT template given the node's two GPUs (``--gpus-per-node=2``): it
  starts one process per granted GPU; ``PRECISION=fp32`` overrides the GPU default bf16, as
  these GPUs are not real (torch sees none and trains on the CPU); BitPipe on 2 ranks;
* ``bert_single`` — the same template with ``PP=1 SCHEDULE=default``: one process, the
  reference;
* ``gpt_bitpipe`` — the GPT template on the CPU as documented (``--gpus-per-node=0``,
  ``NPROC_PER_NODE=4``, fp32 by default): BitPipe on 4 ranks, a flag in ``EXTRA_ARGS`` and one
  after the script name;
* ``gpt_single`` — its one-process reference;
* ``gpt_requeue`` — ``gpt_bitpipe`` again, saving every 2 iterations, through two requeues.
  Its first attempt has rank 1 crash in iteration 3 (``--inject-fault crash``): the run fails,
  the job requeues itself (a failed run that saved a newer checkpoint) and resumes from
  iteration 2 without the fault (it fires on the job's first attempt only). Once that second
  attempt has logged an iteration it gets SLURM's warning signal (``scancel --batch
  --signal=USR1``: what ``#SBATCH --signal=B:USR1@600`` sends before the time limit): the
  training stops after that iteration, saves and exits 0, the job requeues itself again and
  resumes from that checkpoint. Its log must hold ``gpt_bitpipe``'s curve bit for bit, each
  iteration once.

(The test releases a requeued job after REQUEUE_RELEASE_S seconds; SLURM would hold it ~2
minutes.)

``BITPIPE_SLURM_TEST=skip`` skips these cluster tests (they install packages and start daemons);
``BITPIPE_SLURM_TEST=require`` (CI) makes a cluster that cannot be set up an error instead of a
skip. The tests at the end need no SLURM: the pure ones read the templates, the others run them
with a launcher that prints the flags it is given (the schedule by ``SCHEDULE``, extra flags
by ``EXTRA_ARGS`` and after the script name).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

from ..pretrain_support import CURVE_KEYS, REPO, assert_same_records, events, records

CLUSTER = REPO / "scripts" / "slurm" / "local_cluster.sh"
ITERS = 10
COMMON = dict(
    TRAIN_ITERS=ITERS, MBS=2, GBS=16, VOCAB=127, SEED=1234, WARMUP=1, LR="1e-3", MIN_LR="1e-4",
    LOG_INTERVAL=5, EVAL_INTERVAL=5, EVAL_ITERS=1, SAVE_INTERVAL=100,
    EXTRA_ARGS="--adam-eps 1e-4",  # bounds Adam's amplification of rounding noise in exactly-zero gradients
)  # fmt: skip
GPT = dict(COMMON, NUM_LAYERS=8, HIDDEN=32, HEADS=4, SEQ=16)
BERT = dict(COMMON, NUM_LAYERS=4, HIDDEN=32, HEADS=4, SEQ=32, GBS=8)
CPU = ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=4", "--time=30"]
PASSED_ON = ["--log-interval", "1"]  # after the script name: passed on to the pretrain script
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
BERT_KEYS = (*CURVE_KEYS, "sop_loss", "validation_sop_loss")
#: ``gpt_requeue``'s rank 1 crashes in this iteration on the first attempt, the first after a save
FAULT_ITERATION = 3
RESTARTS = {"gpt_requeue": 2}  # jobs that requeue themselves: how often

def cluster_test(test):
    """A test of the jobs on the cluster: multi-rank, 25 minutes at most."""
    return pytest.mark.multirank(pytest.mark.timeout(1500)(test))


def run(command: List[str], env: Dict[str, str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env, capture_output=True, text=True, **kwargs)


#: seconds a requeued job is held before the test releases it (SLURM itself holds it ~2 minutes)
REQUEUE_RELEASE_S = 10.0


def _cluster_or_skip(env: Dict[str, str], gpus: int) -> str:
    """Bring the cluster up and return its SLURM_CONF, or skip (fail with
    BITPIPE_SLURM_TEST=require) saying why not."""
    mode = os.environ.get("BITPIPE_SLURM_TEST", "")
    if mode == "skip":
        pytest.skip("BITPIPE_SLURM_TEST=skip")
    reason = None
    if os.geteuid() != 0:
        reason = "needs root: scripts/slurm/local_cluster.sh installs slurm-wlm and munge and starts SLURM's daemons"
    elif shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        reason = "SLURM is not installed and there is no apt-get to install it"
    else:
        try:
            result = run(["bash", str(CLUSTER), "up", "--gpus", str(gpus)], env, timeout=600)
        except subprocess.TimeoutExpired:
            reason = "scripts/slurm/local_cluster.sh up did not finish within 10 minutes"
        else:
            if result.returncode == 0:
                return result.stdout.strip().splitlines()[-1].split("SLURM_CONF=", 1)[1]
            reason = f"scripts/slurm/local_cluster.sh up failed: {(result.stderr or result.stdout).strip()[-1500:]}"
    if mode == "require":
        pytest.fail(f"BITPIPE_SLURM_TEST=require: {reason}")
    pytest.skip(reason)


def job_info(job: str, env: Dict[str, str]) -> Dict[str, str]:
    """``scontrol show job``'s fields (JobState, Reason, Restarts, ExitCode, ...)."""
    out = run(["scontrol", "-o", "show", "job", job], env, check=True).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


class Jobs:
    """Submits the jobs, follows them to the end, keeps what they left."""

    def __init__(self, env: Dict[str, str], workdir: Path):
        self.env, self.workdir = env, workdir
        self.ids: Dict[str, str] = {}
        self.final: Dict[str, Dict[str, str]] = {}

    def output_dir(self, name: str) -> Path:
        return self.workdir / name

    def submit(self, name: str, template: str, options: List[str], variables: Dict[str, object]) -> None:
        exports = ",".join(["ALL", *(f"{k}={v}" for k, v in {**variables, "OUTPUT_DIR": self.output_dir(name)}.items())])
        command = ["sbatch", "--parsable", f"--job-name={name}", *options, f"--export={exports}", str(REPO / "scripts" / "slurm" / template), *PASSED_ON]
        result = run(command, self.env, cwd=self.workdir, check=False)
        assert result.returncode == 0, f"sbatch {name}: {result.stderr}"
        self.ids[name] = result.stdout.strip().split(";")[0]

    def log(self, name: str) -> Path:
        return self.output_dir(name) / "log.jsonl"

    def logged_from(self, name: str, iteration: int) -> bool:
        """Whether the job has logged ``iteration`` or a later one."""
        log = self.log(name)
        return log.exists() and any(r["iteration"] >= iteration for r in events(log, "iteration"))

    def slurm_output(self, name: str) -> str:
        return (self.workdir / f"{name}-{self.ids[name]}.out").read_text()

    def wait(self, timeout: float, signal_mid_run: str = "", signal_from: int = 1) -> None:
        """Until every job has ended; ``signal_mid_run`` gets the warning signal once it has
        logged iteration ``signal_from`` or a later one; a requeued job is released
        REQUEUE_RELEASE_S after its requeue."""
        deadline, signalled, held_since = time.monotonic() + timeout, False, {}
        while len(self.final) < len(self.ids):
            assert time.monotonic() < deadline, f"jobs still running after {timeout:.0f} s: {sorted(set(self.ids) - set(self.final))}"
            for name, job in self.ids.items():
                if name in self.final:
                    continue
                info = job_info(job, self.env)
                if info["JobState"] in TERMINAL:
                    self.final[name] = info
                elif name == signal_mid_run and not signalled and self.logged_from(name, signal_from):
                    run(["scancel", "--batch", "--signal=USR1", job], self.env, check=True)
                    signalled = True
                elif info["JobState"] == "PENDING" and info.get("Reason") == "BeginTime":
                    # Released a few seconds after the requeue, not at once: the node must first
                    # finish revoking the ended run's credential, or it kills the new start.
                    held_since.setdefault(name, time.monotonic())
                    if time.monotonic() - held_since[name] > REQUEUE_RELEASE_S:
                        run(["scontrol", "update", f"JobId={job}", "StartTime=now"], self.env, check=True)
                else:
                    held_since.pop(name, None)  # a later requeue is held anew
            time.sleep(0.2)


# --------------------------------------------------------------------------- without SLURM
# (before the cluster tests: the cluster is stopped at the module's last test, which must be one of
# those, marked multirank)

TEMPLATES = {"gpt": "pretrain_gpt_bitpipe.sbatch", "bert": "pretrain_bert_bitpipe.sbatch"}


def template_flags(task: str, tmp_path: Path, variables: Dict[str, str], *passed_on: str) -> List[str]:
    """The flags the template hands its launcher (a stand-in ``torchrun_job.sh`` printing them)."""
    fake = tmp_path / "repo"
    (fake / "scripts" / "slurm").mkdir(parents=True)
    (fake / "scripts" / f"pretrain_{task}.py").write_text("")
    (fake / "scripts" / "slurm" / "torchrun_job.sh").write_text('printf "%s\\n" "$@"\n')
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "REPO": str(fake), "OUTPUT_DIR": str(tmp_path / "out"), **variables}
    result = run(["bash", str(REPO / "scripts" / "slurm" / TEMPLATES[task]), *passed_on], env, timeout=60)
    assert result.returncode == 0, result.stderr
    script, *flags = result.stdout.splitlines()
    assert script == str(fake / "scripts" / f"pretrain_{task}.py")
    return flags


def flag_value(flags: List[str], flag: str) -> str:
    assert flags.count(flag) == 1, (flag, flags)
    return flags[flags.index(flag) + 1]


@pytest.mark.multirank  # starts bash, no SLURM: seconds
@pytest.mark.parametrize("task", sorted(TEMPLATES))
def test_template_takes_the_schedule_by_name(task, tmp_path):
    assert flag_value(template_flags(task, tmp_path / "default", {}), "--pipeline-schedule") == "bitpipe"
    flags = template_flags(task, tmp_path / "zbv", {"SCHEDULE": "zbv", "PP": "2"})
    assert flag_value(flags, "--pipeline-schedule") == "zbv" and flag_value(flags, "--pipeline-model-parallel-size") == "2"


@pytest.mark.multirank  # starts bash, no SLURM: seconds
@pytest.mark.parametrize("task", sorted(TEMPLATES))
def test_untied_embeddings_pass_through_extra_args(task, tmp_path):
    variables = {"SCHEDULE": "dualpipe", "EXTRA_ARGS": "--untie-embeddings-and-output-weights --seed 7"}
    flags = template_flags(task, tmp_path, variables, "--schedule-costs", "costs.json")
    assert flag_value(flags, "--pipeline-schedule") == "dualpipe"
    assert flags[-5:] == ["--untie-embeddings-and-output-weights", "--seed", "7", "--schedule-costs", "costs.json"]


def launch_with_fake_slurm(tmp_path: Path, saved_before: int, saved_after: int, status: int, restarts: int) -> tuple:
    """``torchrun_job.sh`` with stand-ins for srun (the training: moves the checkpoint tracker
    from ``saved_before`` to ``saved_after``, exits ``status``) and scontrol; returns its exit
    status, its output and the requeues it asked for."""
    bin_dir, ckpt = tmp_path / "bin", tmp_path / "ckpt"
    bin_dir.mkdir()
    ckpt.mkdir()
    if saved_before:
        (ckpt / "latest_checkpointed_iteration.txt").write_text(f"{saved_before}\n")
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho {saved_after} > "$CKPT_DIR/latest_checkpointed_iteration.txt"\nexit {status}\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\n[[ $1 == requeue ]] && echo "$2" >> {tmp_path / "requeues"}\necho node0\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), "SLURM_JOB_NODELIST": "node0",
           "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": str(restarts), "CKPT_DIR": str(ckpt), "TRAIN_ITERS": "10"}  # fmt: skip
    result = run(["bash", str(REPO / "scripts" / "slurm" / "torchrun_job.sh"), "train.py"], env, timeout=60)
    requeues = (tmp_path / "requeues").read_text().split() if (tmp_path / "requeues").exists() else []
    return result.returncode, result.stdout + result.stderr, requeues


@pytest.mark.multirank  # starts bash, no SLURM: seconds
@pytest.mark.parametrize(
    "saved_before, saved_after, status, restarts, requeued, line",
    [
        (2, 5, 0, 0, True, "training stopped at iteration 5 of 10: requeueing job 7 to resume from it"),
        (0, 5, 1, 0, True, "training failed (status 1) after saving iteration 5 of 10 (restart 0 of the job, MAX_REQUEUES=3): requeueing job 7"),
        (5, 8, 1, 2, True, "training failed (status 1) after saving iteration 8 of 10 (restart 2 of the job, MAX_REQUEUES=3): requeueing job 7"),
        (5, 8, 1, 3, False, "training failed (status 1) after saving iteration 8 of 10; not requeued: the job has been requeued 3 time(s), MAX_REQUEUES=3"),
        (5, 5, 1, 0, False, "training failed (status 1) with no checkpoint newer than iteration 5 (the one it started from); not requeued"),
        (5, 5, 0, 0, False, "training processes exited with status 0; latest checkpoint: iteration 5"),
        (5, 10, 1, 0, False, "training processes exited with status 1; latest checkpoint: iteration 10"),
    ],
)  # fmt: skip
def test_launcher_requeues_a_run_that_saved_progress_and_not_one_that_did_not(tmp_path, saved_before, saved_after, status, restarts, requeued, line):
    code, output, requeues = launch_with_fake_slurm(tmp_path, saved_before, saved_after, status, restarts)
    assert code == status, output
    assert requeues == (["7"] if requeued else []), output
    assert line in output, output


@pytest.mark.parametrize("task", sorted(TEMPLATES))
def test_template_names_every_schedule_and_passes_extra_flags_last(task):
    from megatron_bitpipe.megatron_args import PIPELINE_SCHEDULES

    lines = (REPO / "scripts" / "slurm" / TEMPLATES[task]).read_text().splitlines()
    line = next(line for line in lines if line.startswith("SCHEDULE="))
    assert line.split("# --pipeline-schedule: ", 1)[1].split(", ") == list(PIPELINE_SCHEDULES)
    arguments = [line.strip() for line in lines[lines.index("ARGS=(") + 1 : lines.index(")")]]
    assert arguments[0] == '--pipeline-schedule "$SCHEDULE"' and arguments[-2:] == ["$EXTRA_ARGS", '"$@"']


# --------------------------------------------------------------------------- on the cluster


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Jobs:
    workdir = tmp_path_factory.mktemp("slurm")
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # this torchrun
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])  # this checkout
    env["SLURM_CONF"] = _cluster_or_skip(env, gpus=2)
    try:
        jobs = Jobs(env, workdir)
        # An exclusive job gets all GPUs of its node, whatever it asks: the GPU job runs alone
        # first, then the cluster is set up again without GPUs for the CPU jobs.
        gpus = ["--nodes=1", "--gpus-per-node=2", "--cpus-per-task=4", "--time=30"]
        jobs.submit("bert_bitpipe", "pretrain_bert_bitpipe.sbatch", gpus, dict(BERT, TP=1, PP=2, PRECISION="fp32"))
        jobs.wait(timeout=600)
        run(["bash", str(CLUSTER), "down"], env, check=True, timeout=120)
        run(["bash", str(CLUSTER), "up"], env, check=True, timeout=120)
        single = {"PP": 1, "SCHEDULE": "default", "NPROC_PER_NODE": 1}
        jobs.submit("bert_single", "pretrain_bert_bitpipe.sbatch", CPU, dict(BERT, TP=1, **single))
        jobs.submit("gpt_bitpipe", "pretrain_gpt_bitpipe.sbatch", CPU, dict(GPT, TP=1, PP=4, NPROC_PER_NODE=4))
        jobs.submit("gpt_single", "pretrain_gpt_bitpipe.sbatch", CPU, dict(GPT, TP=1, **single))
        crash = f"{GPT['EXTRA_ARGS']} --inject-fault crash --inject-fault-rank 1 --inject-fault-iteration {FAULT_ITERATION}"
        recover = dict(GPT, TP=1, PP=4, NPROC_PER_NODE=4, SAVE_INTERVAL=FAULT_ITERATION - 1, EXTRA_ARGS=crash)
        jobs.submit("gpt_requeue", "pretrain_gpt_bitpipe.sbatch", CPU, recover)
        jobs.wait(signal_mid_run="gpt_requeue", signal_from=FAULT_ITERATION, timeout=1200)
        yield jobs
    finally:
        run(["bash", str(CLUSTER), "down"], env, timeout=120)


@cluster_test
def test_every_job_completes(jobs):
    for name, info in jobs.final.items():
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), f"{name}: {info}\n{jobs.slurm_output(name)[-3000:]}"
        assert info["Restarts"] == str(RESTARTS.get(name, 0)), name


@cluster_test
def test_launcher_follows_the_allocation(jobs):
    gpt, bert = jobs.slurm_output("gpt_bitpipe"), jobs.slurm_output("bert_bitpipe")
    assert "torchrun on 1 node(s) x 4 process(es), 1 thread(s) each" in gpt
    assert "bitpipe schedule, TP 1 (1d) x PP 4 x DP 1" in gpt
    assert "torchrun on 1 node(s) x 2 process(es)" in bert  # one per granted GPU
    assert "bitpipe schedule, TP 1 (1d) x PP 2 x DP 1" in bert
    assert "no_pipelining schedule" in jobs.slurm_output("gpt_single")
    assert " iteration        2/      10 |" in gpt  # --log-interval 1 after the script name beats LOG_INTERVAL=5 (iteration 1 is always logged)
    command = next(line for line in gpt.splitlines() if line.startswith("+ "))
    assert command.endswith("--exit-signal-handler --exit-signal SIGUSR1 --adam-eps 1e-4 --log-interval 1"), command
    assert str(jobs.workdir) in command and str(REPO) not in command.split("--", 1)[1]  # outputs outside the checkout


@cluster_test
@pytest.mark.parametrize("task", ["gpt", "bert"])
def test_template_with_bitpipe_logs_the_single_process_curve(jobs, task):
    bitpipe, single = records(jobs.log(f"{task}_bitpipe")), records(jobs.log(f"{task}_single"))
    assert sorted(bitpipe) == sorted(single) == list(range(1, ITERS + 1))
    assert_same_records(bitpipe, single, range(1, ITERS + 1), CURVE_KEYS if task == "gpt" else BERT_KEYS)


@cluster_test
def test_a_crash_after_a_save_requeues_and_the_job_resumes_without_the_fault(jobs):
    output, saved = jobs.slurm_output("gpt_requeue"), FAULT_ITERATION - 1
    assert f"--inject-fault crash at the start of iteration {FAULT_ITERATION}: this rank is killed with SIGKILL" in output
    failed = re.search(r"(\S+ \S+) training processes exited with status ([1-9]\d*); latest checkpoint: iteration (\d+)", output)
    assert failed and int(failed.group(3)) == saved, output[-3000:]
    assert f"training failed (status {failed.group(2)}) after saving iteration {saved} of {ITERS} (restart 0 of the job, MAX_REQUEUES=3): requeueing job" in output
    resumed = re.search(r"(\S+ \S+) job \d+ \(restart 1\):.*latest checkpoint: iteration (\d+)", output)
    assert resumed and int(resumed.group(2)) == saved, output[-3000:]
    assert "--inject-fault crash skipped: the job was restarted (SLURM_RESTART_COUNT=1)" in output
    assert "--inject-fault crash skipped: the job was restarted (SLURM_RESTART_COUNT=2)" in output
    assert f"iter_{saved:07d}: weights; iteration {saved}," in output
    assert output.count("--inject-fault crash at the start") == 1


@cluster_test
def test_warning_signal_requeues_again_and_the_job_continues_the_curve(jobs):
    output = jobs.slurm_output("gpt_requeue")
    stop = re.search(rf"stopping after iteration (\d+) of {ITERS}: received SIGUSR1", output)
    assert stop, f"the training did not stop on the warning signal (machine too slow to deliver it mid-run?):\n{output[-3000:]}"
    stopped_at = int(stop.group(1))
    assert FAULT_ITERATION <= stopped_at < ITERS
    assert f"training stopped at iteration {stopped_at} of {ITERS}: requeueing job" in output
    resumed = re.search(r"(\S+ \S+) job \d+ \(restart 2\):.*latest checkpoint: iteration (\d+)", output)
    assert resumed and int(resumed.group(2)) == stopped_at, output[-3000:]
    assert f"iter_{stopped_at:07d}: weights; iteration {stopped_at}," in output
    requeued, uninterrupted = records(jobs.log("gpt_requeue")), records(jobs.log("gpt_bitpipe"))
    assert len(events(jobs.log("gpt_requeue"), "iteration")) == ITERS and sorted(requeued) == list(range(1, ITERS + 1))  # each once
    assert_same_records(requeued, uninterrupted, range(1, ITERS + 1), CURVE_KEYS, exact=True)
