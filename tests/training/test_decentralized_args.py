"""The decentralized modes' and ``--optimizer sgd``'s flags, rules and gossip graphs (pure Python, no ranks)."""

from __future__ import annotations

import pytest

from megatron_bitpipe.megatron_args import BitPipeConfigError
from megatron_bitpipe.training.arguments import parse_args
from megatron_bitpipe.training.decentralized import DecentralizedSettings, topology
from megatron_bitpipe.training.gpt import GPTTask

BASE = [
    "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "4", "--lr", "1e-3",
    "--vocab-size", "127",
]  # fmt: skip
SGD = ["--optimizer", "sgd"]


def parse(*extra, world_size=4, cuda=False):
    return parse_args(GPTTask(), [*BASE, *extra], world_size=world_size, cuda_available=cuda)


BAD = [
    (["--data-parallel-mode", "decentlam"], "--data-parallel-mode decentlam needs --optimizer sgd (got adam)"),
    (["--data-parallel-mode", "lsgd", "--optimizer", "lamb"], "--data-parallel-mode lsgd needs --optimizer sgd (got lamb)"),
    (["--data-parallel-mode", "dmsgd", *SGD, "--use-distributed-optimizer"], "drop --use-distributed-optimizer"),
    (["--gossip-topology", "ring"], "--gossip-topology needs --data-parallel-mode decentlam or dmsgd (got sync)"),
    (["--data-parallel-mode", "lsgd", *SGD, "--gossip-topology", "ring"], "--gossip-topology needs --data-parallel-mode"),
    (["--lsgd-period", "2", "--lsgd-pull-local", "0.5"], "--lsgd-pull-local, --lsgd-period need --data-parallel-mode lsgd (got sync)"),
    (["--data-parallel-mode", "decentlam", *SGD, "--lsgd-group-size", "2"], "--lsgd-group-size need --data-parallel-mode lsgd"),
    (["--data-parallel-mode", "lsgd", *SGD, "--lsgd-group-size", "3"], "--lsgd-group-size 3 must be >= 1 and divide the data-parallel size 4"),
    (["--data-parallel-mode", "lsgd", *SGD, "--lsgd-group-size", "0"], "--lsgd-group-size 0 must be >= 1"),
    (["--data-parallel-mode", "lsgd", *SGD, "--lsgd-pull-global", "-1"], "--lsgd-pull-global must be >= 0"),
    (["--data-parallel-mode", "lsgd", *SGD, "--lsgd-period", "0"], "--lsgd-period must be >= 1"),
    ([*SGD, "--sgd-momentum", "1.0"], "--sgd-momentum must lie in [0, 1)"),
    ([*SGD, "--use-distributed-optimizer"], "--optimizer sgd cannot be combined with --use-distributed-optimizer"),
    (["--data-parallel-mode", "abs-sgd", "--gossip-topology", "ring"], "--gossip-topology needs --data-parallel-mode"),
]  # fmt: skip


@pytest.mark.parametrize("extra,message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_flags_name_the_flag(extra, message):
    with pytest.raises(BitPipeConfigError) as error:
        parse(*extra)
    assert message in str(error.value)


def test_fp16_is_refused():
    with pytest.raises(BitPipeConfigError) as error:
        parse("--data-parallel-mode", "decentlam", *SGD, "--fp16", cuda=True)
    assert "--data-parallel-mode decentlam does not support --fp16" in str(error.value)


def test_defaults_and_composition():
    args = parse("--data-parallel-mode", "lsgd", *SGD)
    assert DecentralizedSettings.from_args(args) == DecentralizedSettings("lsgd", "exponential", 4, 0.1, 0.1, 1, 0.9)
    assert args.sgd_momentum == 0.9  # Megatron-LM's default
    gossip = DecentralizedSettings.from_args(parse("--data-parallel-mode", "decentlam", *SGD, "--sgd-momentum", "0.5"))
    assert (gossip.topology, gossip.momentum) == ("exponential", 0.5)
    # with BitPipe and tensor parallelism, and bf16
    parse("--data-parallel-mode", "decentlam", *SGD, "--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2",
          "--tensor-model-parallel-size", "2", "--global-batch-size", "8", world_size=8)  # fmt: skip
    parse("--data-parallel-mode", "dmsgd", *SGD, "--bf16", cuda=True)
    parse(*SGD)  # synchronous SGD


@pytest.mark.parametrize(
    "name,size,offsets",
    [
        ("ring", 2, (1,)), ("ring", 4, (1, 3)), ("ring", 8, (1, 7)),
        ("exponential", 2, (1,)), ("exponential", 4, (1, 2, 3)), ("exponential", 5, (1, 2, 3, 4)), ("exponential", 8, (1, 2, 4, 6, 7)),
        ("complete", 4, (1, 2, 3)), ("complete", 1, ()),
    ],
)  # fmt: skip
def test_graphs_are_doubly_stochastic(name, size, offsets):
    graph = topology(name, size)
    assert graph.offsets == offsets
    W = graph.matrix()
    assert all(sum(row) == pytest.approx(1.0) for row in W)
    assert all(W[i][j] == W[j][i] for i in range(size) for j in range(size))  # symmetric: DecentLaM needs it
    for i in range(size):
        # i receives from each source exactly what that source sends to i
        assert all(i in graph.destinations(j) for j in graph.sources(i))
        assert sorted(graph.sources(i)) == sorted(j for j in range(size) if j != i and W[i][j] > 0)


def test_exponential_graph_by_hand():
    """(E + Eᵀ) / 2 of the directed exponential graph E (weights 1 / (L + 1), L powers of two below n)."""
    third, sixth = 1 / 3, 1 / 6
    assert topology("exponential", 4).matrix()[0] == [third, sixth, third, sixth]
    assert topology("exponential", 8).matrix()[0] == [0.25, 0.125, 0.125, 0, 0.25, 0, 0.125, 0.125]
    assert topology("ring", 2).matrix() == [[0.5, 0.5], [0.5, 0.5]]
    with pytest.raises(ValueError, match="unknown gossip topology"):
        topology("star", 4)


def test_elect_takes_the_lowest_mean_and_the_lower_index_on_ties():
    import torch

    from megatron_bitpipe.training.decentralized.methods import elect

    totals = torch.tensor([[8.0, 2.0], [6.0, 2.0], [3.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    assert elect(totals, 2) == (1, [1, 2], [4.0, 3.0, 3.0, float("inf")])


def _decentlam_consensus_radius(W, beta: float) -> float:
    """Largest root modulus of DecentLaM's consensus recursion without gradients: per
    eigenvalue λ of W, d' = β d + (1 - λ) x, x' = x - d' (d = γ m) gives t² - (λ + β) t + β = 0."""
    import numpy as np

    return max(abs(t) for lam in np.linalg.eigvals(np.array(W)) for t in np.roots([1.0, -(lam + beta), beta]) if abs(lam - 1) > 1e-9)


@pytest.mark.parametrize("size", [4, 8, 16])
def test_decentlam_needs_the_symmetric_graphs(size):
    """The directed exponential graph (one peer per power of two) makes DecentLaM's consensus
    recursion grow (a root outside the unit circle at β = 0.9); the graphs here keep it inside."""
    L = size.bit_length() - 1
    directed = [[1 / (L + 1) if (j - i) % size in {0, *(2**k for k in range(L))} else 0.0 for j in range(size)] for i in range(size)]
    assert _decentlam_consensus_radius(directed, 0.9) > 1.0
    for name in ("ring", "exponential", "complete"):
        assert _decentlam_consensus_radius(topology(name, size).matrix(), 0.9) < 1.0, name


def test_other_modes_refuse_a_decentralized_checkpoint(tmp_path):
    """What the loop calls after loading a checkpoint (here on the file a decentralized run
    writes; no ranks): a run of another mode refuses it, naming the flag."""
    from megatron_bitpipe.training.abs_sgd.step import AbsSgdStrategy
    from megatron_bitpipe.training.decentralized.step import COMMON_FILE
    from megatron_bitpipe.training.mode_registry import saved_mode_state
    from megatron_bitpipe.training.sync import SyncStrategy
    from megatron_bitpipe.checkpoint_rules import CheckpointError

    (tmp_path / COMMON_FILE).write_text('{"version": 1, "mode": "lsgd"}')
    for other in (SyncStrategy, AbsSgdStrategy):
        with pytest.raises(CheckpointError, match="resume it with --data-parallel-mode lsgd"):
            saved_mode_state(str(tmp_path), other)
    assert saved_mode_state(str(tmp_path.parent), SyncStrategy) is None  # no decentralized state: nothing to say
