"""The data-parallel modes' registry, their strategies' registry and the run configuration's
mode (pure Python and class look-ups, no ranks)."""

from __future__ import annotations

import argparse

import pytest

from megatron_bitpipe import data_parallel_modes as modes
from megatron_bitpipe.run_config import RunConfig
from megatron_bitpipe.training.arguments import parse_args
from megatron_bitpipe.training.gpt import GPTTask

BASE = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "4", "--lr", "1e-3",
    "--vocab-size", "127",
]  # fmt: skip


def test_every_mode_has_one_strategy_and_every_strategy_a_registered_mode():
    from megatron_bitpipe.training.abs_sgd.step import AbsSgdStrategy
    from megatron_bitpipe.training.decentralized.step import DecentralizedStrategy
    from megatron_bitpipe.training.mode_registry import STRATEGIES
    from megatron_bitpipe.training.sync import SyncStrategy

    assert list(STRATEGIES) == list(modes.REGISTRY)
    expected = {"sync": SyncStrategy, "abs-sgd": AbsSgdStrategy, "decentlam": DecentralizedStrategy, "dmsgd": DecentralizedStrategy, "lsgd": DecentralizedStrategy}
    assert STRATEGIES == expected
    for name, strategy in STRATEGIES.items():
        assert modes.data_parallel_mode(name) in strategy.modes


def test_modes_decide_gradient_reduction_and_decentralized_updates():
    table = {m.name: (m.gradient_reduction, m.decentralized) for m in modes.REGISTRY.values()}
    assert table == {
        "sync": ("data-parallel", False),
        "abs-sgd": ("none", False),
        "decentlam": ("replicas", True),
        "dmsgd": ("replicas", True),
        "lsgd": ("replicas", True),
    }
    assert modes.decentralized_modes() == (modes.DECENTLAM, modes.DMSGD, modes.LSGD)


def test_lookup_names_the_choices_and_a_name_registers_once():
    with pytest.raises(ValueError, match="unknown mode 'gossip'; choose from sync, abs-sgd, decentlam, dmsgd, lsgd"):
        modes.data_parallel_mode("gossip")
    with pytest.raises(ValueError, match="already registered"):
        modes.register(modes.DataParallelMode("sync", "data-parallel", False, "again"))
    with pytest.raises(ValueError, match="gradient_reduction"):
        modes.DataParallelMode("other", "everything", False, "")
    assert modes.selected_mode(argparse.Namespace()) is modes.SYNC  # Megatron-LM's parser has no such flag


def test_the_flag_lists_the_modes_and_groups_those_of_one_help():
    parser = argparse.ArgumentParser()
    modes.add_data_parallel_mode_arg(parser)
    assert parser.parse_args([]).data_parallel_mode == "sync"
    (action,) = [a for a in parser._actions if a.dest == "data_parallel_mode"]
    assert tuple(action.choices) == modes.mode_names()
    assert action.help.startswith("sync: every iteration all-reduces")
    assert "decentlam, dmsgd, lsgd: decentralized, the replicas' weights differ" in action.help


@pytest.mark.parametrize(
    "argv, mode, decentralized",
    [
        ([], modes.SYNC, False),
        (["--data-parallel-mode", "abs-sgd"], modes.ABS_SGD, False),
        (["--data-parallel-mode", "lsgd", "--optimizer", "sgd"], modes.LSGD, True),
    ],
)
def test_run_config_holds_the_registered_mode(argv, mode, decentralized):
    run = RunConfig.from_args(parse_args(GPTTask(), [*BASE, *argv], world_size=2, cuda_available=False))
    assert run.data_parallel_mode is mode
    assert run.optimizer.decentralized is decentralized
