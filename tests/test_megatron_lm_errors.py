"""The Megatron-LM routes' errors and the loss hand-over, without a Megatron-LM checkout.

* checkout errors name the path, ``MEGATRON_LM_PATH`` and the tag core_v0.16.1 (function and
  ``python -m megatron_bitpipe.run`` exit status 2 with one ``error:`` line);
* incompatible Megatron-LM flags with ``--pipeline-schedule bitpipe`` are all reported at once,
  each by its flag;
* a model builder that ignores the chunk's config or process groups is refused;
* the loss reports of BitPipe's two edge ranks reach the last pipeline stage in micro-batch
  order, with their dtypes (2 gloo ranks).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

from megatron_bitpipe.megatron_args import BitPipeConfigError
from megatron_bitpipe.megatron_lm.args import add_megatron_lm_args, chain_args_provider, validate_megatron_lm_args
from megatron_bitpipe.megatron_lm.checkout import MegatronLMCheckoutError, find_checkout, resolve_script
from megatron_bitpipe.cpu.launcher import launch

from .megatron_lm_support import REPO, fake_checkout


def test_script_missing_without_env(tmp_path):
    with pytest.raises(MegatronLMCheckoutError, match=r"pretrain_gpt\.py: no such file, and MEGATRON_LM_PATH is not set.*core_v0\.16\.1"):
        resolve_script("pretrain_gpt.py", environ={})


def test_env_is_not_a_checkout(tmp_path):
    with pytest.raises(MegatronLMCheckoutError, match=rf"MEGATRON_LM_PATH={tmp_path} is not a Megatron-LM checkout.*core_v0\.16\.1"):
        resolve_script("pretrain_gpt.py", environ={"MEGATRON_LM_PATH": str(tmp_path)})


def test_wrong_version_names_path_version_and_tag(tmp_path):
    root = fake_checkout(tmp_path / "Megatron-LM", version=(0, 15, 0))
    with pytest.raises(MegatronLMCheckoutError, match=rf"{root} is megatron-core 0\.15\.0.*tag core_v0\.16\.1"):
        resolve_script(str(root / "pretrain_gpt.py"), environ={})
    with pytest.raises(MegatronLMCheckoutError, match="megatron-core 0.15.0"):
        resolve_script("pretrain_gpt.py", environ={"MEGATRON_LM_PATH": str(root)})


def test_script_found_through_env(tmp_path):
    root = fake_checkout(tmp_path / "Megatron-LM")
    script, checkout = resolve_script("pretrain_gpt.py", environ={"MEGATRON_LM_PATH": str(root)})
    assert script == (root / "pretrain_gpt.py").resolve() and checkout.root == root.resolve()
    assert checkout.version == "0.16.1"
    assert find_checkout(root / "megatron" / "training").root == root.resolve()


@pytest.mark.multirank
def test_run_cli_reports_checkout_errors(tmp_path):
    """``python -m megatron_bitpipe.run``: exit 2 and one error line, before importing megatron."""
    root = fake_checkout(tmp_path / "Megatron-LM", version=(0, 17, 0))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("MEGATRON_LM_PATH", None)
    for argv, expected in (
        ([str(root / "pretrain_gpt.py")], "is megatron-core 0.17.0"),
        (["pretrain_gpt.py", "--num-layers", "2"], "MEGATRON_LM_PATH is not set"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "megatron_bitpipe.run", *argv], env=env, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("megatron_bitpipe.run: error: ") and expected in result.stderr
        assert "core_v0.16.1" in result.stderr
    good = fake_checkout(tmp_path / "needs-a-module")
    (good / "megatron" / "training" / "initialize.py").write_text("import a_module_nobody_installed\n")
    result = subprocess.run(
        [sys.executable, "-m", "megatron_bitpipe.run", str(good / "pretrain_gpt.py")], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "imports 'a_module_nobody_installed', which is not installed" in result.stderr, result.stderr
    usage = subprocess.run([sys.executable, "-m", "megatron_bitpipe.run"], env=env, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage: python -m megatron_bitpipe.run SCRIPT" in usage.stderr


def megatron_lm_args(*argv, **fields) -> argparse.Namespace:
    """Parsed plugin flags plus the Megatron-LM fields the checks read (4 ranks, pp 4)."""
    parser = chain_args_provider(None)(argparse.ArgumentParser())
    args = parser.parse_args(list(argv))
    defaults = dict(
        world_size=4, tensor_model_parallel_size=1, pipeline_model_parallel_size=4, num_layers=8,
        micro_batch_size=1, global_batch_size=8, virtual_pipeline_model_parallel_size=None,
        hidden_size=32, num_attention_heads=4, context_parallel_size=1, expert_model_parallel_size=1,
    )
    defaults.update(fields)
    for key, value in defaults.items():
        setattr(args, key, value)
    return args


def test_flags_on_megatron_lm_parser():
    args = add_megatron_lm_args(argparse.ArgumentParser()).parse_args(["--pipeline-schedule", "bitpipe", "--layout-independent-init"])
    assert args.pipeline_schedule == "bitpipe" and args.layout_independent_init and args.tensor_parallel_mode == "1d"
    validate_megatron_lm_args(megatron_lm_args("--pipeline-schedule", "bitpipe"))
    validate_megatron_lm_args(megatron_lm_args("--pipeline-schedule", "bitpipe", load="/checkpoints", ckpt_format="torch"))
    validate_megatron_lm_args(megatron_lm_args(use_distributed_optimizer=True))  # default schedule: megatron's business


def test_incompatible_megatron_lm_flags_are_named_at_once():
    args = megatron_lm_args(
        "--pipeline-schedule", "bitpipe",
        use_distributed_optimizer=True, context_parallel_size=2, world_size=8, num_experts=4,
        encoder_num_layers=4, decoder_num_layers=4, global_batch_size=6, use_legacy_models=True,
        save="/checkpoints", ckpt_format="torch_dist",
    )
    with pytest.raises(BitPipeConfigError) as info:
        validate_megatron_lm_args(args)
    text = str(info.value)
    for expected in (
        "--use-distributed-optimizer cannot be used with --pipeline-schedule bitpipe",
        "--context-parallel-size cannot be used",
        "--num-experts cannot be used",
        "--use-legacy-models cannot be used",
        "bitpipe does not support encoder-decoder models",
        "even number of micro-batches",
        "--ckpt-format torch_dist cannot be used with --pipeline-schedule bitpipe: use --ckpt-format torch",
    ):
        assert expected in text, text


def test_optimus2d_is_not_wired_into_megatron_lm_scripts():
    with pytest.raises(BitPipeConfigError, match="--tensor-parallel-mode optimus2d is not available through Megatron-LM's scripts"):
        validate_megatron_lm_args(megatron_lm_args("--tensor-parallel-mode", "optimus2d", tensor_model_parallel_size=4, pipeline_model_parallel_size=1))


def test_optimizer_flags_on_megatron_lm():
    """The optimizers' flags exist on Megatron-LM's parser; 1-bit LAMB needs bitpipe there."""
    args = megatron_lm_args("--onebit-freeze-iters", "2", "--rex-beta", "0.3", optimizer="onebit_lamb", pipeline_model_parallel_size=2, world_size=2)
    assert args.onebit_freeze_iters == 2 and args.rex_beta == 0.3 and args.lamb_max_coeff == 10.0
    with pytest.raises(BitPipeConfigError, match="--optimizer onebit_lamb runs in Megatron-LM's scripts with --pipeline-schedule bitpipe only"):
        validate_megatron_lm_args(args)
    args.pipeline_schedule = "bitpipe"
    validate_megatron_lm_args(args)
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", choices=["adam", "sgd"])
    parser.add_argument("--lr-decay-style", choices=["linear", "cosine"])
    parsed = add_megatron_lm_args(parser).parse_args(["--optimizer", "lamb", "--lr-decay-style", "rex"])
    assert parsed.optimizer == "lamb" and parsed.lr_decay_style == "rex"


class _Layer(torch.nn.Module):
    def __init__(self, layer_number: int):
        super().__init__()
        self.layer_number = layer_number


class _Chunk(torch.nn.Module):
    """Just what the check reads off a megatron-core language model."""

    def __init__(self, first_layer: int, pg_collection):
        super().__init__()
        self.pre_process, self.post_process, self.pg_collection = False, False, pg_collection
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([_Layer(first_layer + 1)])


def test_model_builder_must_honour_config_and_process_groups():
    from megatron_bitpipe.megatron_lm.model import _check_chunk
    from megatron_bitpipe.runtime.layout import ChunkSpec

    spec = ChunkSpec(first_layer=6, num_layers=2, pre_process=False, post_process=False, pipeline=1, stage=3)
    ours = object()
    _check_chunk(_Chunk(6, ours), spec, ours)
    for chunk in (_Chunk(6, object()), _Chunk(0, ours)):  # megatron's global groups / looped layers
        with pytest.raises(BitPipeConfigError, match="model_provider did not build the chunk from the config and pg_collection"):
            _check_chunk(chunk, spec, ours)


def _relay() -> dict:
    from megatron_bitpipe.megatron_lm.losses import gather_losses_on_last_stage
    from megatron_bitpipe.runtime.groups import ParallelGrid, PipelineGroups
    from megatron_bitpipe.schedules.placement import bidirectional_v

    groups = PipelineGroups.build(ParallelGrid(pp=2), bidirectional_v(2))
    # Micro-batches 0, 1 on pipeline rank 0 (pipeline A) and 2, 3 on rank 1 (pipeline B).
    mine = [0, 1] if groups.pp_rank == 0 else [2, 3]
    token_reports = [{"lm loss": torch.tensor([10.0 * m + 0.5, 7 + m])} for m in mine]
    scalar_reports = [{"lm loss": torch.tensor(float(m)), "count": torch.tensor(m)} for m in mine]
    return {
        "token": gather_losses_on_last_stage(token_reports, mine, groups),
        "scalars": gather_losses_on_last_stage(scalar_reports, mine, groups),
    }


@pytest.mark.multirank
def test_losses_reach_the_last_pipeline_stage():
    first, last = launch(_relay, 2, timeout=120)
    assert first == {"token": [], "scalars": []}
    assert len(last["token"]) == len(last["scalars"]) == 4
    for m in range(4):
        torch.testing.assert_close(last["token"][m]["lm loss"], torch.tensor([10.0 * m + 0.5, 7 + m]))
        report = last["scalars"][m]
        assert report["lm loss"].shape == () and report["lm loss"].item() == m
        assert report["count"].dtype == torch.int64 and report["count"].item() == m
