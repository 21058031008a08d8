"""The sbatch templates on real SLURM clusters on this machine (``scripts/slurm/local_cluster.sh``): one node, then two.

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

Then, on a two-node cluster beside it (``local_cluster.sh up --nodes 2``: a controller and
node1, node2 in network namespaces), 2 ranks per node: a probe job shows what the launcher hands
every rank on both nodes (the fabric variables, the warning signal); the GPT template with
BitPipe at PP 4 goes through a crashed rank on node2, node2's processes all killed and the
warning signal, and logs ``gpt_bitpipe``'s curve bit for bit; the BERT template with zbv at
PP 2 x DP 2 logs ``bert_single``'s curve; ``down --nodes 2`` leaves the machine as before
(the ``nodes`` fixture has the details).

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
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

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


def _cluster_or_skip(env: Dict[str, str], *options: str) -> Tuple[str, List[str]]:
    """Bring the cluster up (``local_cluster.sh up options``) and return its SLURM_CONF and
    the command prefix that reaches it, or skip (fail with BITPIPE_SLURM_TEST=require) saying
    why not."""
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
            result = run(["bash", str(CLUSTER), "up", *options], env, timeout=600)
        except subprocess.TimeoutExpired:
            reason = "scripts/slurm/local_cluster.sh up did not finish within 10 minutes"
        else:
            if result.returncode == 0:
                conf = result.stdout.strip().splitlines()[-1].split("SLURM_CONF=", 1)[1]
                netns = re.search(r"nsenter --net=(\S+)", result.stdout)
                return conf, ["nsenter", f"--net={netns.group(1)}"] if netns else []
            reason = f"scripts/slurm/local_cluster.sh up {' '.join(options)} failed: {(result.stderr or result.stdout).strip()[-1500:]}"
    if mode == "require":
        pytest.fail(f"BITPIPE_SLURM_TEST=require: {reason}")
    pytest.skip(reason)


def attempt_output(output: str, restart: int) -> str:
    """The part of a job's SLURM output written by its attempt ``restart`` (0: the first run,
    1 after the first requeue...): from that run's launcher line to the next run's ('' before
    it started)."""
    starts = {int(m.group(1)): m.start() for m in re.finditer(r"^\S+ \S+ job \d+ \(restart (\d+)\):", output, re.M)}
    if restart not in starts:
        return ""
    return output[starts[restart] : starts.get(restart + 1, len(output))]


def logged(iteration: int) -> Callable[[str], bool]:
    """An attempt's output has the log line of ``iteration`` (the jobs log every iteration)."""
    return lambda text: re.search(rf" iteration +{iteration}/ +\d+ \|", text) is not None


def printed(pattern: str, count: int = 1) -> Callable[[str], bool]:
    """An attempt's output holds ``count`` lines matching ``pattern``."""
    return lambda text: len(re.findall(pattern, text, re.M)) >= count


def warn(jobs: "Jobs", job: str) -> None:
    """SLURM's warning signal before the time limit (what ``#SBATCH --signal=B:USR1@600``
    sends): to the batch shell, which passes it on."""
    jobs.slurm(["scancel", "--batch", "--signal=USR1", job], check=True)


@dataclass
class Action:
    """``do(jobs, job id)`` once ``when`` holds for the output of ``job``'s attempt ``restart``
    (``do`` None: only note the time); :attr:`Jobs.seen` keeps when it happened, by ``label``."""

    job: str
    restart: int
    when: Callable[[str], bool]
    do: Optional[Callable[["Jobs", str], None]] = None
    label: str = ""


class Jobs:
    """Submits the jobs, follows them to the end, keeps what they left. ``client``: the
    command prefix that reaches the cluster (the two-node cluster's controller network)."""

    def __init__(self, env: Dict[str, str], workdir: Path, client: List[str]):
        self.env, self.workdir, self.client = env, workdir, client
        self.ids: Dict[str, str] = {}
        self.final: Dict[str, Dict[str, str]] = {}
        self.seen: Dict[str, float] = {}  # Action label -> time.monotonic() it happened
        self.notes: Dict[str, object] = {}  # what the fixture and the actions found

    def slurm(self, command: List[str], **kwargs) -> subprocess.CompletedProcess:
        return run([*self.client, *command], self.env, **kwargs)

    def job_infos(self) -> Dict[str, Dict[str, str]]:
        """Every job's ``scontrol show job`` fields (JobState, Reason, Restarts, ExitCode, ...)
        by job id, in one call."""
        out = self.slurm(["scontrol", "-o", "show", "job"], check=True).stdout
        infos = [dict(field.split("=", 1) for field in line.split() if "=" in field) for line in out.splitlines()]
        return {info["JobId"]: info for info in infos if "JobId" in info}

    def output_dir(self, name: str) -> Path:
        return self.workdir / name

    def submit(self, name: str, template: str, options: List[str], variables: Dict[str, object], args=PASSED_ON) -> None:
        """sbatch ``scripts/slurm/<template>`` (a template, or the launcher itself) as job
        ``name`` with ``variables`` exported and ``args`` after it."""
        exports = ",".join(["ALL", *(f"{k}={v}" for k, v in {**variables, "OUTPUT_DIR": self.output_dir(name)}.items())])
        script = REPO / "scripts" / "slurm" / template
        command = ["sbatch", "--parsable", f"--job-name={name}", f"--output={name}-%j.out", *options, f"--export={exports}", str(script), *args]
        result = self.slurm(command, cwd=self.workdir, check=False)
        assert result.returncode == 0, f"sbatch {name}: {result.stderr}"
        self.ids[name] = result.stdout.strip().split(";")[0]

    def log(self, name: str) -> Path:
        return self.output_dir(name) / "log.jsonl"

    def slurm_output(self, name: str) -> str:
        path = self.workdir / f"{name}-{self.ids[name]}.out"
        return path.read_text() if path.exists() else ""

    def wait(self, timeout: float, actions: Sequence[Action] = ()) -> None:
        """Until every job has ended, doing each of ``actions`` once its moment comes; a requeued
        job is released REQUEUE_RELEASE_S after its requeue."""
        deadline, pending, held_since = time.monotonic() + timeout, list(actions), {}
        while len(self.final) < len(self.ids):
            assert time.monotonic() < deadline, f"jobs still running after {timeout:.0f} s: {sorted(set(self.ids) - set(self.final))}"
            infos = self.job_infos()
            for name, job in self.ids.items():
                if name in self.final:
                    continue
                info = infos[job]
                if info["JobState"] in TERMINAL:
                    self.final[name] = info
                    continue
                output = self.slurm_output(name)
                for action in [a for a in pending if a.job == name and a.when(attempt_output(output, a.restart))]:
                    self.seen[action.label] = time.monotonic()
                    if action.do is not None:
                        action.do(self, job)
                    pending.remove(action)
                if info["JobState"] == "PENDING" and info.get("Reason") == "BeginTime":
                    # Released a few seconds after the requeue, not at once: the node must first
                    # finish revoking the ended run's credential, or it kills the new start.
                    held_since.setdefault(name, time.monotonic())
                    if time.monotonic() - held_since[name] > REQUEUE_RELEASE_S:
                        self.slurm(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
                else:
                    held_since.pop(name, None)  # a later requeue is held anew
            time.sleep(0.2)
        missed = [a.label for a in pending]
        outputs = "".join(f"\n--- {name} ({self.final[name].get('JobState')}), the end of its output:\n{self.slurm_output(name)[-2500:]}"
                          for name in sorted({a.job for a in pending}))  # fmt: skip
        assert not missed, f"the jobs ended before these happened: {missed}{outputs}"


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


@pytest.mark.multirank  # starts bash, no SLURM: seconds
def test_two_node_cluster_refuses_clearly_without_root_or_network_rights(tmp_path):
    env = {"PATH": os.environ["PATH"], "CLUSTER_DIR": str(tmp_path / "run"), "CLUSTER_STATE_DIR": str(tmp_path / "spool")}
    up = ["bash", str(CLUSTER), "up", "--nodes", "2"]
    cases = [([], "needs root")]
    if os.geteuid() == 0:  # root: drop what it needs
        cases = [(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"], "needs root"),
                 (["setpriv", "--bounding-set=-net_admin"], "--nodes 2 needs CAP_NET_ADMIN"),
                 (["setpriv", "--bounding-set=-sys_admin"], "--nodes 2 needs CAP_SYS_ADMIN")]  # fmt: skip
    for prefix, refusal in cases:
        result = run([*prefix, *up], env, timeout=60)
        assert result.returncode == 1 and f"local_cluster.sh: {refusal}" in result.stderr, (prefix, result.stdout, result.stderr)
    assert not (tmp_path / "run").exists() and not (tmp_path / "spool").exists()  # refused before making anything


def launch_with_fake_slurm(tmp_path: Path, saved_before: int, saved_after: int, status: int, restarts: int, *args: str) -> tuple:
    """``torchrun_job.sh train.py args`` with stand-ins for srun (the training: moves the
    checkpoint tracker from ``saved_before`` to ``saved_after``, exits ``status``; keeps its
    arguments in ``srun-args``) and scontrol; returns its exit status, its output and the
    requeues it asked for."""
    bin_dir, ckpt = tmp_path / "bin", tmp_path / "ckpt"
    bin_dir.mkdir()
    ckpt.mkdir()
    if saved_before:
        (ckpt / "latest_checkpointed_iteration.txt").write_text(f"{saved_before}\n")
    (bin_dir / "srun").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path / "srun-args"}\n'
                                  f'echo {saved_after} > "$CKPT_DIR/latest_checkpointed_iteration.txt"\nexit {status}\n')  # fmt: skip
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\n[[ $1 == requeue ]] && echo "$2" >> {tmp_path / "requeues"}\necho node0\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), "SLURM_JOB_NODELIST": "node0",
           "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": str(restarts), "CKPT_DIR": str(ckpt), "TRAIN_ITERS": "10"}  # fmt: skip
    result = run(["bash", str(REPO / "scripts" / "slurm" / "torchrun_job.sh"), "train.py", *args], env, timeout=60)
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


@pytest.mark.multirank  # starts bash, no SLURM: seconds
@pytest.mark.parametrize("args, wait", [((), 660), (("--distributed-timeout-minutes", "0.5"), 90), (("--distributed-timeout-minutes=2",), 180)])
def test_launcher_gives_the_other_nodes_the_watchdogs_time_to_end_on_their_own(tmp_path, args, wait):
    code, output, _ = launch_with_fake_slurm(tmp_path, 0, 0, 0, 0, *args)
    assert code == 0, output
    srun = (tmp_path / "srun-args").read_text().splitlines()
    assert srun[:4] == ["--nodes=1", "--ntasks-per-node=1", "--kill-on-bad-exit=0", f"--wait={wait}"], srun


@pytest.mark.parametrize("task", sorted(TEMPLATES))
def test_template_names_every_schedule_and_passes_extra_flags_last(task):
    from megatron_bitpipe.megatron_args import PIPELINE_SCHEDULES

    lines = (REPO / "scripts" / "slurm" / TEMPLATES[task]).read_text().splitlines()
    line = next(line for line in lines if line.startswith("SCHEDULE="))
    assert line.split("# --pipeline-schedule: ", 1)[1].split(", ") == list(PIPELINE_SCHEDULES)
    arguments = [line.strip() for line in lines[lines.index("ARGS=(") + 1 : lines.index(")")]]
    assert arguments[0] == '--pipeline-schedule "$SCHEDULE"' and arguments[-2:] == ["$EXTRA_ARGS", '"$@"']


# --------------------------------------------------------------------------- on the cluster


def job_env() -> Dict[str, str]:
    """The environment jobs are submitted with (sbatch --export=ALL): this torchrun, this checkout."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Jobs:
    workdir, env = tmp_path_factory.mktemp("slurm"), job_env()
    env["SLURM_CONF"], client = _cluster_or_skip(env, "--gpus", "2")
    try:
        jobs = Jobs(env, workdir, client)
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
        jobs.wait(timeout=1200, actions=[Action("gpt_requeue", 1, logged(FAULT_ITERATION), warn, "warning signal")])
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


# --------------------------------------------------------------------------- on two nodes
# (after the one-node cluster tests, whose references these compare with; that cluster stays up
# beside this one until the module ends)

#: 2 nodes, 2 ranks each, gloo on the namespaces' interface as on a real fabric
NODES = ["--nodes=2", "--gpus-per-node=0", "--cpus-per-task=2", "--time=30"]
ACROSS = dict(TP=1, NPROC_PER_NODE=2, GLOO_SOCKET_IFNAME="eth0")
#: the watchdog's timeout in the faulted job: the job must end within it after a fault
WATCHDOG_MIN = 0.5
#: the faulted job's rank that crashes itself on its first attempt (on node2), in FAULT_ITERATION
NODE_FAULT_RANK = 3
#: its second attempt has node2's processes killed once it logged this iteration (the save of 4 done)
KILL_AFTER = 5
FAULT_ENDED = r"^\S+ \S+ training processes exited with status (\d+); latest checkpoint: iteration (\d+)$"


def node_processes(job: str, node: str) -> List[int]:
    """The processes of SLURM job ``job`` on ``node`` (its environment says so): torchrun, its
    ranks and what they started."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            environ = set((entry / "environ").read_bytes().split(b"\0"))
        except (OSError, ValueError):  # not a process, or gone
            continue
        if f"SLURM_JOB_ID={job}".encode() in environ and f"SLURMD_NODENAME={node}".encode() in environ:
            pids.append(int(entry.name))
    return pids


def kill_node2(jobs: Jobs, job: str) -> None:
    """Every process of the job on node2 killed at once (SIGKILL), as when the node dies."""
    pids = node_processes(job, "node2")
    assert len(pids) >= 3, f"node2 runs {pids} of job {job}: expected torchrun and its 2 ranks"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    jobs.notes["node2 processes killed"] = len(pids)


def netns_pids(name: str) -> List[int]:
    result = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, check=True)
    return sorted(int(pid) for pid in result.stdout.split())


def host_state() -> Dict[str, List[str]]:
    """What `local_cluster.sh up --nodes 2` adds to the machine and `down` must remove."""
    def listed(command: List[str]) -> List[str]:
        return sorted(subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines())

    links = [line.split(":")[1].strip().split("@")[0] for line in listed(["ip", "-o", "link", "show"])]
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    daemons = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _comm(p).startswith("bitpipe-")]
    return {"namespaces": listed(["ip", "netns", "list"]), "links": sorted(links), "mounts": sorted(mounts), "daemons": daemons}


def _comm(process: Path) -> str:
    try:
        return (process / "comm").read_text().strip()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def nodes(jobs, tmp_path_factory) -> Jobs:
    """The two-node cluster's jobs, one at a time (the templates ask for --exclusive); submitted
    GPT job first, the others run while it is held for a requeue:

    * ``nodes_probe`` — torchrun_job.sh on a probe script (no training) with NCCL_SOCKET_IFNAME
      and GLOO_SOCKET_IFNAME set: each rank prints its host and them, then waits for the warning
      signal, which the test sends once all four have printed;
    * ``nodes_gpt`` — the GPT template, BitPipe at PP 4, through three requeues: rank 3 (node2)
      crashes in iteration FAULT_ITERATION of the first attempt; the second has every process of
      the job on node2 killed once it has logged iteration KILL_AFTER; the third gets the warning
      signal after its first iteration; the fourth finishes;
    * ``nodes_bert`` — the BERT template with zbv (a zero-bubble schedule) at PP 2 x DP 2.
    """
    workdir, env = tmp_path_factory.mktemp("slurm-nodes"), job_env()
    before = host_state()
    env["SLURM_CONF"], client = _cluster_or_skip(env, "--nodes", "2")
    try:
        nodes = Jobs(env, workdir, client)
        nodes.notes["before up"] = before
        faults = (f"{GPT['EXTRA_ARGS']} --distributed-timeout-minutes {WATCHDOG_MIN} --inject-fault crash "
                  f"--inject-fault-rank {NODE_FAULT_RANK} --inject-fault-iteration {FAULT_ITERATION}")  # fmt: skip
        nodes.submit("nodes_gpt", "pretrain_gpt_bitpipe.sbatch", NODES, dict(GPT, **ACROSS, PP=4, SAVE_INTERVAL=FAULT_ITERATION - 1, EXTRA_ARGS=faults))
        probe = dict(NPROC_PER_NODE=2, NCCL_SOCKET_IFNAME="eth0", GLOO_SOCKET_IFNAME="eth0")
        nodes.submit("nodes_probe", "torchrun_job.sh", NODES, probe, args=[str(REPO / "tests" / "training" / "slurm_rank_probe.py")])
        nodes.submit("nodes_bert", "pretrain_bert_bitpipe.sbatch", NODES, dict(BERT, **ACROSS, PP=2, SCHEDULE="zbv"))
        ended = printed(FAULT_ENDED)
        nodes.wait(timeout=1200, actions=[
            Action("nodes_probe", 0, printed(r"^probe: rank \d of 4 on node\d:", 4), warn, "probe warned"),
            Action("nodes_gpt", 0, printed(rf"^\[rank {NODE_FAULT_RANK}\] --inject-fault crash"), None, "rank crashed"),
            Action("nodes_gpt", 0, ended, None, "crash ended"),
            Action("nodes_gpt", 1, logged(KILL_AFTER), kill_node2, "node2 killed"),
            Action("nodes_gpt", 1, ended, None, "kill ended"),
            Action("nodes_gpt", 2, printed(r" iteration +\d+/ +\d+ \|"), warn, "warning signal"),
        ])  # fmt: skip
        yield nodes
    finally:
        run(["bash", str(CLUSTER), "down", "--nodes", "2"], env, timeout=120)


@cluster_test
def test_every_two_node_job_completes(nodes):
    for name, info in nodes.final.items():
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), f"{name}: {info}\n{nodes.slurm_output(name)[-3000:]}"
        assert info["Restarts"] == str(3 if name == "nodes_gpt" else 0), name
        assert info["NodeList"] == "node[1-2]", info


@cluster_test
def test_launcher_hands_every_rank_on_both_nodes_the_fabric_settings_and_the_warning_signal(nodes):
    output = nodes.slurm_output("nodes_probe")
    assert "torchrun on 2 node(s) x 2 process(es), 1 thread(s) each, rendezvous node1:" in output
    assert re.search(r"^fabric settings passed on to every rank: .*GLOO_SOCKET_IFNAME=eth0 .*NCCL_SOCKET_IFNAME=eth0", output, re.M), output
    ranks = dict(re.findall(r"^probe: rank (\d) of 4 on (node\d): NCCL_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0$", output, re.M))
    assert ranks == {"0": "node1", "1": "node1", "2": "node2", "3": "node2"}, output
    received = dict(re.findall(r"^probe: rank (\d) on (node\d): received SIGUSR1$", output, re.M))
    assert received == ranks, output


def fault_report(attempt: str) -> set:
    """The ranks the attempt's one watchdog line names as not answering."""
    lines = re.findall(r"^watchdog: job ended at iteration \d+: (.*)$", attempt, re.M)
    assert len(lines) == 1, attempt[-4000:]
    silent = re.search(r"ranks? ([\d, and]+) did not answer", lines[0])
    assert silent, lines[0]
    return {int(rank) for rank in re.findall(r"\d+", silent.group(1))}


def assert_resumed(output: str, restart: int) -> int:
    """The attempt ``restart - 1`` failed with a checkpoint newer than it started from, requeued
    the job, and attempt ``restart`` resumed from that checkpoint; returns its iteration."""
    failed = re.search(FAULT_ENDED, attempt_output(output, restart - 1), re.M)
    assert failed and failed.group(1) != "0", attempt_output(output, restart - 1)[-3000:]
    saved = int(failed.group(2))
    assert f"training failed (status {failed.group(1)}) after saving iteration {saved} of {ITERS} (restart {restart - 1} of the job, MAX_REQUEUES=3): requeueing job" in output
    resumed = re.search(rf"\(restart {restart}\):.*latest checkpoint: iteration (\d+)", output)
    assert resumed and int(resumed.group(1)) == saved, output[-3000:]
    return saved


@cluster_test
def test_a_crashed_rank_on_the_second_node_ends_the_job_on_both_nodes_in_time_and_it_resumes(nodes):
    output = nodes.slurm_output("nodes_gpt")
    first = attempt_output(output, 0)
    assert f"[rank {NODE_FAULT_RANK}] --inject-fault crash at the start of iteration {FAULT_ITERATION}" in first
    silent = fault_report(first)
    assert NODE_FAULT_RANK in silent and silent <= {2, 3}, silent  # node2's torchrun may stop its other rank first
    seconds = nodes.seen["crash ended"] - nodes.seen["rank crashed"]
    print(f"\nrank {NODE_FAULT_RANK} crashed on node2: the job ended on both nodes {seconds:.1f} s later (watchdog {60 * WATCHDOG_MIN:g} s)")
    assert seconds <= 60 * WATCHDOG_MIN
    assert assert_resumed(output, 1) == FAULT_ITERATION - 1
    assert "--inject-fault crash skipped: the job was restarted (SLURM_RESTART_COUNT=1)" in attempt_output(output, 1)


@cluster_test
def test_the_second_node_killed_ends_the_job_on_both_nodes_in_time_and_it_resumes(nodes):
    output = nodes.slurm_output("nodes_gpt")
    assert fault_report(attempt_output(output, 1)) == {2, 3}
    seconds = nodes.seen["kill ended"] - nodes.seen["node2 killed"]
    print(f"\nnode2's {nodes.notes['node2 processes killed']} processes killed: the job ended on node1 {seconds:.1f} s later (watchdog {60 * WATCHDOG_MIN:g} s)")
    assert seconds <= 60 * WATCHDOG_MIN
    assert assert_resumed(output, 2) >= KILL_AFTER - 1


@cluster_test
def test_warning_signal_stops_both_nodes_after_the_same_iteration_with_one_checkpoint(nodes):
    output = nodes.slurm_output("nodes_gpt")
    third = attempt_output(output, 2)
    stop = re.search(rf"stopping after iteration (\d+) of {ITERS}: received SIGUSR1", third)
    assert stop, f"the training did not stop on the warning signal:\n{third[-3000:]}"
    stopped_at = int(stop.group(1))
    assert stopped_at < ITERS
    # one save, by all four ranks (node2's too), then every rank exited 0
    assert re.findall(r"^saved checkpoint .*/iter_(\d+) at iteration", third, re.M) == [f"{stopped_at:07d}"], third[-3000:]
    shards = (nodes.output_dir("nodes_gpt") / "checkpoints" / f"iter_{stopped_at:07d}").glob("__*_*.distcp")
    assert {int(shard.name.split("_")[2]) for shard in shards} == {0, 1, 2, 3}
    assert f"training processes exited with status 0; latest checkpoint: iteration {stopped_at}" in third
    assert f"training stopped at iteration {stopped_at} of {ITERS}: requeueing job" in third
    assert re.search(rf"\(restart 3\):.*latest checkpoint: iteration {stopped_at}$", output, re.M), output[-3000:]


@cluster_test
def test_gpt_bitpipe_across_two_nodes_logs_the_one_node_curve_through_faults_and_requeues(nodes, jobs):
    output = nodes.slurm_output("nodes_gpt")
    assert output.count("torchrun on 2 node(s) x 2 process(es)") == 4
    assert output.count("bitpipe schedule, TP 1 (1d) x PP 4 x DP 1") == 4
    logged_events = events(nodes.log("nodes_gpt"), "iteration")  # an iteration run again after the kill is logged twice
    assert {r["iteration"] for r in logged_events} == set(range(1, ITERS + 1))
    one_node, single = records(jobs.log("gpt_bitpipe")), records(jobs.log("gpt_single"))
    for record in logged_events:
        it = record["iteration"]
        assert_same_records({it: record}, one_node, [it], CURVE_KEYS, exact=True)  # the same ranks' arithmetic, bit for bit
        assert_same_records({it: record}, single, [it], CURVE_KEYS)


@cluster_test
def test_bert_template_across_two_nodes_with_zero_bubble_at_pp2_dp2_logs_the_single_process_curve(nodes, jobs):
    output = nodes.slurm_output("nodes_bert")
    assert "torchrun on 2 node(s) x 2 process(es)" in output
    assert "zbv schedule, TP 1 (1d) x PP 2 x DP 2" in output
    across, single = records(nodes.log("nodes_bert")), records(jobs.log("bert_single"))
    assert sorted(across) == list(range(1, ITERS + 1))
    assert_same_records(across, single, range(1, ITERS + 1), BERT_KEYS)


@cluster_test
def test_down_removes_every_namespace_link_mount_and_daemon_of_the_two_node_cluster(nodes, jobs):
    # no process of a job outlived it on any node: each namespace holds only its daemons
    assert [_comm(Path(f"/proc/{pid}")) for pid in netns_pids("bitpipe-node1")] == ["bitpipe-slurmd"]
    assert [_comm(Path(f"/proc/{pid}")) for pid in netns_pids("bitpipe-node2")] == ["bitpipe-slurmd"]
    result = run(["bash", str(CLUSTER), "down", "--nodes", "2"], nodes.env, timeout=120)
    assert result.returncode == 0 and "killing what still runs" not in result.stdout, result.stdout + result.stderr
    assert host_state() == nodes.notes["before up"]
    # the one-node cluster beside it is untouched
    assert jobs.slurm(["sinfo", "-h", "-o", "%T"], check=True).stdout.split() == ["idle"]
