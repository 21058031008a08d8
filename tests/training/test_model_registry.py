"""The model-kind registry: which kind a run trains, what each kind states, the lookup's
message and the registration rules (no ranks)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_bitpipe.run_config import RunConfig
from megatron_bitpipe.training.arguments import parse_args
from megatron_bitpipe.training.bert import BertTask
from megatron_bitpipe.training.gpt import GPTTask
from megatron_bitpipe.training.model_registry import REGISTRY, model_kind, model_kind_for, register, task_kinds

MODEL = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--lr", "1e-3", "--vocab-size", "127",
]  # fmt: skip
HFTA = ["--hfta-models", "3", "--hfta-lr", "1e-3,2e-3,3e-3"]
OPTIMUS = ["--tensor-model-parallel-size", "4", "--tensor-parallel-mode", "optimus2d"]


def chosen(task, *flags, world_size=1):
    """The kind ``task`` trains with ``flags`` and the flags' RunConfig."""
    args = parse_args(task, [*MODEL, *flags], world_size=world_size, cuda_available=False)
    run = RunConfig.from_args(args, task=task)
    return model_kind_for(task.name, run), run


def test_every_kind_is_registered_under_its_task_in_listing_order():
    assert list(REGISTRY) == ["gpt", "moe-gpt", "hfta-gpt", "optimus-gpt", "bert", "hfta-bert"]
    assert [kind.name for kind in task_kinds("gpt")] == ["gpt", "moe-gpt", "hfta-gpt", "optimus-gpt"]
    assert [kind.name for kind in task_kinds("bert")] == ["bert", "hfta-bert"]


def test_the_flags_choose_the_kind_and_the_kind_states_losses_and_attention():
    gpt, run = chosen(GPTTask())
    assert gpt.name == "gpt" and gpt.loss_names(run) == ("lm loss",) and gpt.causal_attention
    assert gpt.iteration_losses(run, {"lm loss": 2.0}) == ({"lm loss": 2.0}, {})
    fused, run = chosen(GPTTask(), *HFTA)
    assert fused.name == "hfta-gpt" and fused.loss_names(run) == ("lm loss", "lm loss 0", "lm loss 1", "lm loss 2")
    shapes = fused.p2p_shapes(run, None)
    assert shapes([(16, 2, 32)], [(16, 2, 32)]) == ([(16, 6, 32)], [(16, 6, 32)])
    assert chosen(GPTTask(), *OPTIMUS, world_size=4)[0].name == "optimus-gpt"
    moe, run = chosen(GPTTask(), "--num-experts", "4", "--moe-z-loss-coeff", "1e-3", "--disable-bias-linear")
    assert moe.name == "moe-gpt" and moe.loss_names(run) == ("lm loss",) and moe.causal_attention
    bert, run = chosen(BertTask())
    assert bert.name == "bert" and bert.loss_names(run) == ("lm loss", "sop loss") and not bert.causal_attention
    bert, run = chosen(BertTask(), "--bert-no-binary-head")
    assert bert.loss_names(run) == ("lm loss",) and bert.chunk_kwargs(run) == {"add_binary_head": False}
    fused, run = chosen(BertTask(), "--bert-no-binary-head", *HFTA)
    assert fused.name == "hfta-bert" and fused.loss_names(run) == ("lm loss", "lm loss 0", "lm loss 1", "lm loss 2")


def test_a_run_asking_for_two_kinds_is_refused():
    _, run = chosen(GPTTask(), *HFTA)
    both = dataclasses.replace(run, layout=dataclasses.replace(run.layout, tensor_parallel_mode="optimus2d"))
    with pytest.raises(ValueError, match="asks for the gpt model kinds hfta-gpt and optimus-gpt"):
        model_kind_for("gpt", both)
    with pytest.raises(ValueError, match="no model kind is registered for the task 'vit'; tasks with kinds: bert, gpt"):
        model_kind_for("vit", run)


def test_lookup_names_the_kinds_and_registration_refuses_clashes():
    assert model_kind("hfta-bert") is REGISTRY["hfta-bert"]
    with pytest.raises(ValueError, match="unknown model kind 'vit'; choose from gpt, moe-gpt, hfta-gpt, optimus-gpt, bert, hfta-bert"):
        model_kind("vit")
    with pytest.raises(ValueError, match="already registered"):
        register(REGISTRY["gpt"])
    with pytest.raises(ValueError, match="has a plain model kind already"):
        register(dataclasses.replace(REGISTRY["gpt"], name="another-gpt"))
    assert "another-gpt" not in REGISTRY


def test_the_registry_shape_keeps_names_once_and_lists_them_on_a_miss():
    """The one :class:`~megatron_bitpipe.registry.Registry` the schedules, modes and kinds use."""
    from megatron_bitpipe.registry import Registry

    registry = Registry("a toy", lambda name, names: KeyError(f"no toy {name!r}; choose from {names}"))
    first = registry.add(dataclasses.replace(REGISTRY["gpt"], name="one"))
    registry.add(dataclasses.replace(REGISTRY["bert"], name="two"))
    assert registry.lookup("one") is first and registry.names() == ("one", "two")
    with pytest.raises(ValueError, match="a toy named 'one' is already registered"):
        registry.add(dataclasses.replace(REGISTRY["bert"], name="one"))
    assert registry["one"] is first
    with pytest.raises(KeyError, match="no toy 'three'; choose from one, two"):
        registry.lookup("three")
