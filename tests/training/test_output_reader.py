"""A reader of the output that goes away (``... | head -2``) ends a run quietly: no
``BrokenPipeError`` traceback, no peer rank's communication failure, exit status 0 — as the
schedule command line does (:func:`megatron_bitpipe.usage.quiet_on_broken_pipe`, the one
mechanism both use)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from megatron_bitpipe.training.script import exit_status
from megatron_bitpipe.usage import reader_gone

from ..pretrain_support import REPO

#: torchrun's own log lines (its agent's, not a rank's)
TORCHRUN_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d")
#: a run far longer than the test, one line per iteration: only the reader can end it in time
ENDLESS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
           "--micro-batch-size", "2", "--global-batch-size", "4", "--vocab-size", "256", "--train-iters", "100000",
           "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0"]  # fmt: skip


@pytest.fixture
def pipe():
    """``(reader, writer)``: the two ends of a pipe as text files."""
    read, write = os.pipe()
    reader, writer = os.fdopen(read, "r"), os.fdopen(write, "w")
    yield reader, writer
    for end in (reader, writer):
        if not end.closed:
            end.close()


def test_reader_gone_only_for_a_pipe_nobody_reads(pipe, tmp_path):
    reader, writer = pipe
    assert not reader_gone(writer)
    reader.close()
    assert reader_gone(writer)
    with open(tmp_path / "log.txt", "w") as file:
        assert not reader_gone(file)


def _communication_failure():
    raise RuntimeError("Connection closed by peer")  # what gloo raises when a peer has ended


def test_a_peer_rank_ends_quietly_only_once_the_reader_is_gone(pipe, monkeypatch):
    """A rank other than 0 prints nothing; its communication failure after rank 0 ended
    because the reader left is no failure (status 0); the same failure with the reader still
    there propagates, as does any other error."""
    reader, writer = pipe
    monkeypatch.setattr(sys, "stdout", writer)
    with pytest.raises(RuntimeError, match="closed by peer"):
        exit_status("pretrain_gpt.py", _communication_failure)
    reader.close()
    assert exit_status("pretrain_gpt.py", _communication_failure) == 0
    with pytest.raises(KeyError):
        exit_status("pretrain_gpt.py", lambda: {}["missing"])


@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_run_read_by_head_ends_quietly_with_status_0(nproc):
    """``pretrain_gpt.py ... | head -2``, one process and torchrun with BitPipe on 2 ranks: the
    run ends with status 0 when its reader has gone, with nothing on stderr but torchrun's own
    log lines."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc-per-node={nproc}"]  # fmt: skip
    layout = [] if nproc == 1 else ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", str(nproc)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")  # else torchrun notes that it sets it
    run = subprocess.Popen([*launcher, "scripts/pretrain_gpt.py", *ENDLESS, *layout], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        head = [run.stdout.readline() for _ in range(2)]
        run.stdout.close()  # head -2 exits
        stderr = run.stderr.read()
        status = run.wait(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert head[0].startswith("no CUDA GPU: training on the CPU"), head
    assert status == 0, stderr[-4000:]
    assert [line for line in stderr.splitlines() if not TORCHRUN_LOG.match(line)] == [], stderr[-4000:]
