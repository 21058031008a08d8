"""Decentralized data parallelism (``--data-parallel-mode decentlam | dmsgd | lsgd``) and
``--optimizer sgd`` end to end on 4 CPU ranks (gloo, NCCL's p2p rules: strict mode).

* **SGD.** Synchronous ``--optimizer sgd --sgd-momentum 0.9`` on data parallelism 4 ends
  with the weights of ``torch.optim.SGD`` trained single-process on the global batches (fp64).
* **DecentLaM on the complete graph is synchronous momentum SGD** (weights and losses, rtol
  1e-5).
* **Exact replays.** A single fp64 process holding 4 replicas, fed the samples each replica
  read, applies the method's formulas and reproduces every rank's weights: DecentLaM on the
  ring and the exponential graph (warm-up from learning rate 0 included), DmSGD on the ring,
  LSGD with 2 local groups (elections every 2 iterations; the logged leaders are the
  replay's) and LSGD under BitPipe (pipeline 2 x data parallel 2: both weight replicas of a
  stage follow their data-parallel replica). The replicas really differ (consensus distance >
  0), the two graphs give different weights, and the logged bytes are what the ranks sent.
* **Evaluation** of the average (DecentLaM) and of the global leader (LSGD) gives the
  replay's validation loss of those weights, and the training weights are unchanged by it.
* **Checkpoints.** LSGD saved at iteration 3 (between elections, with leader targets and a
  period's losses pending) resumes bit for bit like the uninterrupted run (a synchronous run
  refuses such a checkpoint, naming the flag). Synchronous SGD resumes bit for bit too (its
  momentum is in megatron's checkpoint).

One launch of 4 ranks (every run) and one single-process launch (every replay).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import pytest
import torch

from megatron_bitpipe.cpu.launcher import launch

from .abs_sgd_support import train_case
from .decentralized_support import replay, replica_streams

pytestmark = [pytest.mark.multirank, pytest.mark.strict_p2p, pytest.mark.timeout(1800)]

MBS, GBS = 2, 16
MODEL = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS), "--vocab-size", "127", "--seed", "1234",
    "--optimizer", "sgd", "--sgd-momentum", "0.9", "--lr", "0.05", "--lr-warmup-iters", "1", "--weight-decay", "0.1",
    "--log-interval", "1", "--eval-iters", "0",
]  # fmt: skip
BITPIPE = ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2"]
DECENTLAM = ["--data-parallel-mode", "decentlam"]
LSGD = ["--data-parallel-mode", "lsgd", "--lsgd-group-size", "2", "--lsgd-pull-local", "1.0", "--lsgd-pull-global", "0.5", "--lsgd-period", "2"]
SAVED_AT = 3


@dataclass(frozen=True)
class Case:
    name: str
    iterations: int
    argv: tuple
    replay: dict  # what the replay needs besides the argv and the batches (None: no replay)


def _case(name: str, iterations: int, argv, **replay) -> Case:
    return Case(name, iterations, (*MODEL, "--train-iters", str(iterations), *argv), replay)


CASES = [
    _case("sync", 4, ["--clip-grad", "0"], mode="sync"),
    _case("decentlam_complete", 4, ["--clip-grad", "0", *DECENTLAM, "--gossip-topology", "complete"]),
    _case("decentlam_ring", 4, [*DECENTLAM, "--gossip-topology", "ring", "--eval-interval", "4", "--eval-iters", "1"],
          mode="decentlam", topology="ring", validate=True),
    _case("decentlam_exponential", 4, DECENTLAM, mode="decentlam", topology="exponential"),  # the default graph
    _case("dmsgd_ring", 4, ["--data-parallel-mode", "dmsgd", "--gossip-topology", "ring"], mode="dmsgd", topology="ring"),
    _case("lsgd", 5, [*LSGD, "--eval-interval", "5", "--eval-iters", "1"],
          mode="lsgd", group_size=2, pull_local=1.0, pull_global=0.5, period=2, validate=True),
    _case("lsgd_bitpipe", 4, [*BITPIPE, *LSGD[:2], "--lsgd-pull-global", "0.5", "--lsgd-period", "1"],
          mode="lsgd", group_size=2, pull_local=0.1, pull_global=0.5, period=1),
]  # fmt: skip


def _bytes_sent(trainer) -> dict:
    links = getattr(trainer.data_parallel, "links", None)  # the decentralized modes' exchanges
    return {"bytes_sent": None if links is None else links.bytes_sent}


def run_all(root: str) -> dict:
    """Rank body: every case in one launch; ``lsgd`` also saves at iteration 3 and the end,
    which the last two runs load."""
    out = {}
    ckpt = f"{root}/ckpt"
    for case in CASES:
        argv = list(case.argv)
        if case.name in ("lsgd", "sync"):
            argv += ["--save", f"{ckpt}_{case.name}", "--save-interval", str(SAVED_AT)]
        out[case.name] = train_case(argv, f"{root}/{case.name}.jsonl", _bytes_sent)
    sync = _named("sync")
    out["sync_resumed"] = train_case([*sync.argv, "--load", f"{ckpt}_sync", "--ckpt-step", str(SAVED_AT)], f"{root}/sync_resumed.jsonl")
    lsgd = _named("lsgd")
    resume = ["--load", f"{ckpt}_lsgd", "--ckpt-step", str(SAVED_AT)]
    out["lsgd_resumed"] = train_case([*lsgd.argv, *resume], f"{root}/lsgd_resumed.jsonl", _bytes_sent)
    return out


def _named(name: str) -> Case:
    return next(c for c in CASES if c.name == name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("decentralized")
    ranks = launch(run_all, 4, str(root), timeout=1500)
    return {name: [rank[name] for rank in ranks] for name in ranks[0]}


#: the same batches without what the method adds: the replays must tell them apart
WITHOUT = {"lsgd": dict(pull_local=0.0, pull_global=0.0), "decentlam_ring": dict(mode="dmsgd")}


@pytest.fixture(scope="module")
def replays(runs) -> dict:
    cases = {}
    for case in CASES:
        if not case.replay:
            continue
        per_rank = runs[case.name]
        dp = 1 + max(rank["dp_rank"] for rank in per_rank)
        batches = replica_streams(per_rank, case.iterations, GBS // (MBS * dp), MBS)
        cases[case.name] = {"argv": [*MODEL, "--train-iters", str(case.iterations), *_model_flags(case)], "batches": batches, **case.replay}
        if case.name in WITHOUT:
            cases[f"{case.name}_without"] = {**cases[case.name], **WITHOUT[case.name], "validate": False}
    return launch(replay, 1, cases, timeout=900)[0]


def _model_flags(case: Case) -> List[str]:
    """The case's flags the single process keeps: clipping and evaluation (not the parallel layout)."""
    argv, kept = list(case.argv), []
    for flag in ("--clip-grad", "--eval-interval", "--eval-iters"):
        if flag in argv:
            kept += [flag, argv[len(argv) - 1 - argv[::-1].index(flag) + 1]]
    return kept


def _records(per_rank: List[dict]) -> Dict[int, dict]:
    return per_rank[0]["records"]


#: fp32 ranks vs the fp64 replay: the largest difference measured was 4.5e-7
REPLAY_ATOL = 1e-6


def _difference(per_rank: List[dict], expected: List[Dict[str, torch.Tensor]]) -> float:
    return max((v.double() - expected[rank["dp_rank"]][name]).abs().max().item() for rank in per_rank for name, v in rank["params"].items())


def test_sgd_equals_torch_sgd_single_process(runs, replays):
    assert _difference(runs["sync"], replays["sync"]["params"]) <= REPLAY_ATOL


def test_decentlam_on_the_complete_graph_is_synchronous_momentum_sgd(runs):
    sync, complete = runs["sync"], runs["decentlam_complete"]
    for a, b in zip(sync, complete):
        for name, value in a["params"].items():
            torch.testing.assert_close(b["params"][name], value, rtol=1e-5, atol=1e-7, msg=name)
    for it, record in _records(sync).items():
        got = _records(complete)[it]
        assert got["lm_loss"] == pytest.approx(record["lm_loss"], rel=1e-5) and got["lr"] == record["lr"]
        assert got["consensus_distance"] < 1e-6  # every replica computes the same average


@pytest.mark.parametrize("name", ["decentlam_ring", "decentlam_exponential", "dmsgd_ring", "lsgd", "lsgd_bitpipe"])
def test_every_replica_replays_exactly(runs, replays, name):
    per_rank, expected = runs[name], replays[name]["params"]
    assert _difference(per_rank, expected) <= REPLAY_ATOL
    records = _records(per_rank)
    assert all(r["consensus_distance"] > 1e-4 for it, r in records.items() if it > 1), "the replicas should differ"
    # the logged bytes are what the ranks sent: each replica's ranks, summed over the run
    dp = 1 + max(rank["dp_rank"] for rank in per_rank)
    assert sum(rank["bytes_sent"] for rank in per_rank) == pytest.approx(dp * sum(r["comm_bytes_per_replica"] for r in records.values()))


def test_the_replays_discriminate(runs, replays):
    """The ring and the exponential graph end in different weights, and so do the batches
    without LSGD's pulls or with DmSGD's update instead of DecentLaM's (measured: 1e-3)."""
    ring, exponential = replays["decentlam_ring"]["params"], replays["decentlam_exponential"]["params"]
    assert max((ring[0][n] - exponential[0][n]).abs().max().item() for n in ring[0]) > 100 * REPLAY_ATOL
    for name in WITHOUT:
        assert _difference(runs[name], replays[f"{name}_without"]["params"]) > 100 * REPLAY_ATOL, name


def test_lsgd_leaders_are_the_replays(runs, replays):
    records = _records(runs["lsgd"])
    elected = [(it, r["lsgd_global_leader"], r["lsgd_local_leaders"]) for it, r in sorted(records.items()) if r["lsgd_elected"]]
    assert elected == [(k, g, list(loc)) for k, g, loc in replays["lsgd"]["elections"]]
    assert [it for it, *_ in elected] == [2, 4]
    assert all(r["comm_bytes_per_replica"] == 0 for r in records.values() if not r["lsgd_elected"])


@pytest.mark.parametrize("name,label", [("decentlam_ring", "the average of the 4 replicas' weights"), ("lsgd", "the global leader's weights")])
def test_evaluation_uses_the_average_or_the_leader(runs, replays, name, label):
    last = _records(runs[name])[_named(name).iterations]
    assert last["evaluated_weights"].startswith(label)
    assert last["validation_lm_loss"] == pytest.approx(replays[name]["validation"], rel=1e-5)


@pytest.mark.parametrize("name", ["lsgd", "sync"])
def test_resume_continues_every_replica_bit_for_bit(runs, name):
    """LSGD: weights, momentum, leaders' parameters and the period's losses of every replica;
    synchronous SGD: megatron's checkpoint with the momentum (megatron-core's SGD has no state
    initialiser, so a load would not ask for it)."""
    uninterrupted, resumed = _records(runs[name]), _records(runs[f"{name}_resumed"])
    assert sorted(resumed) == list(range(SAVED_AT + 1, _named(name).iterations + 1))
    keys = ("lm_loss", "grad_norm", "lr") + (("lsgd_global_leader", "lsgd_local_leaders", "consensus_distance") if name == "lsgd" else ())
    for it in resumed:
        for key in keys:
            assert resumed[it][key] == uninterrupted[it][key], (it, key)
    for a, b in zip(runs[name], runs[f"{name}_resumed"]):
        for param, value in a["params"].items():
            assert torch.equal(b["params"][param], value), param
