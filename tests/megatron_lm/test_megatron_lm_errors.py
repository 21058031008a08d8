"""The Megatron-LM routes' errors and the loss hand-over, without a Megatron-LM checkout.

* checkout errors name the path, ``MEGATRON_LM_PATH`` and the tested tags core_v0.16.1 and
  core_v0.19.0 (function and ``python -m megatron_bitpipe.run`` exit status 2 with one
  ``error:`` line); a checkout of another version gets one ``warning:`` line and runs;
* incompatible Megatron-LM flags with ``--pipeline-schedule bitpipe`` are all reported at once,
  each by its flag;
* a model builder that ignores the chunk's process groups or config is refused, naming which;
  ``python -m megatron_bitpipe.run`` refuses Megatron-LM core_v0.16.1's pretrain_bert.py with
  bitpipe before loading it, saying why, and so it does the hybrid (Mamba) models' scripts
  (pretrain_mamba.py at both tags, pretrain_hybrid.py at core_v0.19.0), also when a patched
  script runs without it;
* the batch-size ramps (``--rampup-batch-size`` on megatron-core 0.16, ``--step-batch-size-schedule``
  on 0.19): every N the ramp reaches is checked against the schedule's rules, the first step
  breaking one named in one line with the flag (not the micro-batch rules of a
  --global-batch-size the user did not give); a ramp megatron-core lacks is Megatron-LM's own
  business (core_v0.19.0 trains ``--rampup-batch-size`` at --global-batch-size);
* the zero-bubble family's refusals on Megatron-LM's route, each naming its flag;
* the mixture-of-experts rules of the plan schedules, all named at once (torch_dist checkpoints pass);
* the loss reports of every rank holding a pipeline's last stage (BitPipe's two edge ranks,
  the V's rank 0, the looped pipeline's last rank) reach the last pipeline stage in micro-batch
  order, with their dtypes (2 gloo ranks).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys

import pytest
import torch
from megatron.core.transformer.transformer_block import TransformerBlock

from megatron_bitpipe.megatron_args import BitPipeConfigError
from megatron_bitpipe.megatron_compat import has_batch_ramp
from megatron_bitpipe.megatron_lm.args import SDPA_SPEC, add_megatron_lm_args, chain_args_provider, validate_megatron_lm_args
from megatron_bitpipe.cpu.launcher import launch
from megatron_bitpipe.megatron_lm.checkout import (
    MegatronLMCheckoutError,
    bitpipe_refusal,
    find_checkout,
    running_script_refusal,
    resolve_script,
    untested_warning,
)

from .megatron_lm_support import REPO, fake_checkout


def test_script_missing_without_env(tmp_path):
    with pytest.raises(MegatronLMCheckoutError, match=r"pretrain_gpt\.py: no such file, and MEGATRON_LM_PATH is not set.*core_v0\.16\.1 or core_v0\.19\.0"):
        resolve_script("pretrain_gpt.py", environ={})


def test_env_is_not_a_checkout(tmp_path):
    with pytest.raises(MegatronLMCheckoutError, match=rf"MEGATRON_LM_PATH={tmp_path} is not a Megatron-LM checkout.*core_v0\.16\.1 or core_v0\.19\.0"):
        resolve_script("pretrain_gpt.py", environ={"MEGATRON_LM_PATH": str(tmp_path)})


def test_tested_tags_are_known_by_their_version_file(tmp_path):
    # core_v0.19.0's package_info.py records 0.19.1
    for version, tag in (((0, 16, 1), "core_v0.16.1"), ((0, 19, 1), "core_v0.19.0")):
        checkout = find_checkout(fake_checkout(tmp_path / tag, version=version))
        assert checkout.tag == tag and untested_warning(checkout) is None


def test_other_version_is_used_with_a_warning(tmp_path):
    root = fake_checkout(tmp_path / "Megatron-LM", version=(0, 18, 2))
    script, checkout = resolve_script(str(root / "pretrain_gpt.py"), environ={})
    assert checkout.version == "0.18.2" and checkout.tag is None
    warning = untested_warning(checkout)
    assert f"{root.resolve()} is megatron-core 0.18.2" in warning
    assert "core_v0.16.1 (megatron-core 0.16.1), core_v0.19.0 (megatron-core 0.19.1); continuing" in warning
    assert resolve_script("pretrain_gpt.py", environ={"MEGATRON_LM_PATH": str(root)})[1] == checkout


def test_script_found_through_env(tmp_path):
    root = fake_checkout(tmp_path / "Megatron-LM")
    script, checkout = resolve_script("pretrain_gpt.py", environ={"MEGATRON_LM_PATH": str(root)})
    assert script == (root / "pretrain_gpt.py").resolve() and checkout.root == root.resolve()
    assert checkout.version == "0.16.1"
    assert find_checkout(root / "megatron" / "training").root == root.resolve()


@pytest.mark.multirank
def test_run_cli_reports_checkout_errors(tmp_path):
    """``python -m megatron_bitpipe.run``: exit 2 and one error line, before importing megatron;
    an untested version: one warning line, then the script's checkout is imported."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("MEGATRON_LM_PATH", None)
    result = subprocess.run(
        [sys.executable, "-m", "megatron_bitpipe.run", "pretrain_gpt.py", "--num-layers", "2"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("megatron_bitpipe.run: error: ") and "MEGATRON_LM_PATH is not set" in result.stderr
    assert "core_v0.16.1 or core_v0.19.0" in result.stderr
    for name, version in (("needs-a-module", (0, 16, 1)), ("untested", (0, 17, 0))):
        root = fake_checkout(tmp_path / name, version=version)
        (root / "megatron" / "training" / "__init__.py").write_text("import a_module_nobody_installed\n")
        result = subprocess.run(
            [sys.executable, "-m", "megatron_bitpipe.run", str(root / "pretrain_gpt.py")], env=env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 2 and "imports 'a_module_nobody_installed', which is not installed" in result.stderr, result.stderr
        warnings = [line for line in result.stderr.splitlines() if line.startswith("megatron_bitpipe.run: warning: ")]
        assert len(warnings) == (version != (0, 16, 1)), result.stderr
    usage = subprocess.run([sys.executable, "-m", "megatron_bitpipe.run"], env=env, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage: python -m megatron_bitpipe.run SCRIPT" in usage.stderr


BERT_REFUSAL = (
    "--pipeline-schedule {schedule} cannot run Megatron-LM core_v0.16.1's pretrain_bert.py: the script imports "
    "Transformer Engine's BERT layer spec when it loads (whatever --spec says, so it does not load without "
    "transformer-engine), and its model_provider builds BertModel without the pg_collection it is given, so {schedule} "
    "cannot build its chunks on their own process groups; BERT with {schedule} runs in megatron-bitpipe's "
    "scripts/pretrain_bert.py"
)


def test_bitpipe_refuses_megatron_lm_bert_script(tmp_path):
    for version, refused in (((0, 16, 1), True), ((0, 19, 1), False), ((0, 18, 2), False)):
        root = fake_checkout(tmp_path / ".".join(map(str, version)), version=version)
        (root / "pretrain_bert.py").write_text("")
        (root / "tools").mkdir()
        (root / "tools" / "pretrain_bert.py").write_text("")
        checkout = find_checkout(root)
        for schedule in ("bitpipe", "zbv"):
            refusal = bitpipe_refusal((root / "pretrain_bert.py").resolve(), checkout, schedule=schedule)
            assert refusal == (BERT_REFUSAL.format(schedule=schedule) if refused else None)
        assert bitpipe_refusal((root / "pretrain_gpt.py").resolve(), checkout, schedule="bitpipe") is None
        assert bitpipe_refusal((root / "tools" / "pretrain_bert.py").resolve(), checkout, schedule="bitpipe") is None


HYBRID_REFUSAL = (
    "--pipeline-schedule {schedule} cannot run Megatron-LM {tag}'s {script}: the script builds a hybrid (Mamba) "
    "model, {model}, whose layer pattern picks each pipeline stage's layers in megatron's looped order, so "
    "{schedule}'s chunks (explicit layer ranges on its own stages) cannot be built from it; {schedule} runs GPT "
    "models (pretrain_gpt.py)"
)
HYBRID_SCRIPTS = {
    ((0, 16, 1), "pretrain_mamba.py"): "MambaModel",
    ((0, 19, 1), "pretrain_mamba.py"): "HybridModel (through pretrain_hybrid.py)",
    ((0, 19, 1), "pretrain_hybrid.py"): "HybridModel",
}


def test_plan_schedules_refuse_megatron_lm_hybrid_model_scripts(tmp_path, monkeypatch):
    """The hybrid models' scripts of each tested tag, in one line naming the script, through
    ``python -m megatron_bitpipe.run`` (:func:`bitpipe_refusal`) and as a patched script runs
    (:func:`running_script_refusal` of ``sys.argv[0]``, in the patch's ``setup``)."""
    from megatron_bitpipe.megatron_lm.hooks import setup

    for (version, script), model in HYBRID_SCRIPTS.items():
        root = tmp_path / ".".join(map(str, version))
        if not root.exists():
            fake_checkout(root, version=version)
        (root / script).write_text("")
        checkout = find_checkout(root)
        for schedule in ("bitpipe", "dualpipev"):
            expected = HYBRID_REFUSAL.format(schedule=schedule, tag=checkout.tag, script=script, model=model)
            assert bitpipe_refusal((root / script).resolve(), checkout, schedule=schedule) == expected
            assert running_script_refusal(str(root / script), schedule=schedule) == expected
            monkeypatch.setattr(sys, "argv", [str(root / script)])
            with pytest.raises(BitPipeConfigError) as info:
                setup(megatron_lm_args("--pipeline-schedule", schedule))
            assert str(info.value) == expected
    assert running_script_refusal(str(tmp_path / "0.16.1" / "pretrain_gpt.py"), schedule="bitpipe") is None
    assert running_script_refusal(str(tmp_path / "no_such_script.py"), schedule="bitpipe") is None
    assert running_script_refusal(__file__, schedule="bitpipe") is None  # not inside a checkout
    assert bitpipe_refusal((tmp_path / "0.16.1" / "pretrain_hybrid.py").resolve(), find_checkout(tmp_path / "0.16.1"), schedule="bitpipe") is None


@pytest.mark.multirank
def test_run_cli_refuses_megatron_lm_bert_script_with_bitpipe_before_loading_it(tmp_path):
    """One error line and status 2, before the script loads (it would exit with status 3); other
    schedules get past the refusal (to the next step, which fails on this fake checkout)."""
    root = fake_checkout(tmp_path / "Megatron-LM")
    (root / "pretrain_bert.py").write_text("raise SystemExit(3)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for flags, refused in ((["--pipeline-schedule", "bitpipe"], True), (["--pipeline-schedule=bitpipe"], True),
                           (["--pipeline-schedule", "bitpipe", "--pipeline-schedule", "1f1b"], False), ([], False)):
        result = subprocess.run(
            [sys.executable, "-m", "megatron_bitpipe.run", str(root / "pretrain_bert.py"), "--num-layers", "8", *flags],
            env=env, capture_output=True, text=True, timeout=120,
        )
        assert result.returncode == 2, (flags, result.stderr)
        if refused:
            assert result.stderr == f"megatron_bitpipe.run: error: {BERT_REFUSAL.format(schedule='bitpipe')}\n"
        else:
            assert "cannot run" not in result.stderr and "imports 'megatron.training" in result.stderr, result.stderr


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
    validate_megatron_lm_args(megatron_lm_args("--pipeline-schedule", "bitpipe", load="/checkpoints", ckpt_format="torch_dist"))
    validate_megatron_lm_args(megatron_lm_args("--pipeline-schedule", "bitpipe", use_distributed_optimizer=True))
    validate_megatron_lm_args(megatron_lm_args(ckpt_format="torch", load="/checkpoints"))  # default schedule: megatron's business


def test_incompatible_megatron_lm_flags_are_named_at_once():
    args = megatron_lm_args(
        "--pipeline-schedule", "bitpipe",
        overlap_param_gather=True, use_torch_fsdp2=True,
        encoder_num_layers=4, decoder_num_layers=4, global_batch_size=5, use_legacy_models=True,
        save="/checkpoints", ckpt_format="torch",
    )
    with pytest.raises(BitPipeConfigError) as info:
        validate_megatron_lm_args(args)
    text = str(info.value)
    for expected in (
        "--use-torch-fsdp2 cannot be used",
        "--use-legacy-models cannot be used",
        "bitpipe does not support encoder-decoder models",
        "even number of micro-batches",
        "--ckpt-format torch cannot be used with --pipeline-schedule bitpipe: use --ckpt-format torch_dist",
    ):
        assert expected in text, text
    assert "--overlap-param-gather" not in text, "plan schedules overlap the parameter all-gather"


ZERO_BUBBLE_FAMILY = ("zb-h1", "zbv", "dualpipe", "dualpipev", "chimera")


@pytest.mark.parametrize("schedule", ZERO_BUBBLE_FAMILY)
def test_plan_schedules_refuse_what_they_cannot_run_on_megatron_lm(schedule):
    """Each refusal names its flag, before any communication; the schedule's own placement and
    backwards decide (tied embeddings where a pipeline ends apart from where it starts; the
    weight-gradient deferral flags that contradict split or whole backwards)."""
    from megatron_bitpipe.schedules import ScheduleChoice

    choice, untie = ScheduleChoice(schedule), dict(untie_embeddings_and_output_weights=True)
    flags = ("--pipeline-schedule", schedule)
    validate_megatron_lm_args(megatron_lm_args(*flags, **untie))
    if choice.placement(4).ties_embeddings:
        validate_megatron_lm_args(megatron_lm_args(*flags))
    else:
        with pytest.raises(BitPipeConfigError, match=f"--pipeline-schedule {schedule} puts a pipeline's embedding and output layer on different ranks .*: add --untie-embeddings-and-output-weights"):
            validate_megatron_lm_args(megatron_lm_args(*flags))
    refused = dict(gtp_weight_remat_size=2, use_tp_pp_dp_mapping=True)
    deferral = "defer_embedding_wgrad_compute" if choice.splits_backward else "delay_wgrad_compute"
    with pytest.raises(BitPipeConfigError) as info:
        validate_megatron_lm_args(megatron_lm_args(*flags, **untie, **refused, **{deferral: True}))
    for flag in ("--tensor-parallel-num-weight-shards", "--use-tp-pp-dp-mapping", "--" + deferral.replace("_", "-")):
        assert f"{flag} cannot be used with --pipeline-schedule {schedule}: " in str(info.value), str(info.value)
    other = "delay_wgrad_compute" if choice.splits_backward else "defer_embedding_wgrad_compute"
    validate_megatron_lm_args(megatron_lm_args(*flags, **untie, **{other: True}))  # Megatron-LM's own rules then apply
    if not choice.splits_backward:
        with pytest.raises(BitPipeConfigError, match=f"--defer-embedding-wgrad-compute cannot be used with --pipeline-schedule {schedule}: --split-backward defers"):
            validate_megatron_lm_args(megatron_lm_args(*flags, "--split-backward", **untie, defer_embedding_wgrad_compute=True))


def context_parallel_args(*argv, **fields) -> argparse.Namespace:
    """:func:`megatron_lm_args` at context parallel 2 x pipeline 2 (4 ranks) as Megatron-LM's
    ``validate_args`` leaves it, with the flags context parallelism needs: local layers, the SDPA
    layer spec, ``--cp-comm-type all_gather``, no attention dropout."""
    cp = dict(
        context_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=1, transformer_impl="local",
        spec=list(SDPA_SPEC), cp_comm_type=["all_gather"], attention_dropout=0.0,
    )
    return megatron_lm_args(*argv, **dict(cp, **fields))


@pytest.mark.parametrize("schedule", ["bitpipe", "zbv"])
def test_plan_schedules_state_the_context_parallel_rules(schedule):
    """--context-parallel-size runs with the SDPA spec and the all-gather or the ring exchange; every
    other combination is named by its flag, one line each, all at once; Megatron-LM's own schedule
    keeps Megatron-LM's rules."""
    flags = ("--pipeline-schedule", schedule)
    validate_megatron_lm_args(context_parallel_args(*flags))
    validate_megatron_lm_args(context_parallel_args(*flags, cp_comm_type=["all_gather", "p2p"]))  # one per layer
    refused = dict(
        spec=["local"], cp_comm_type=["allgather", "a2a+p2p", "allgather"], attention_dropout=0.1, hierarchical_context_parallel_sizes=[2, 1],
        hybrid_context_parallel=True, sft=True, save="/checkpoints", load="/checkpoints",
    )
    with pytest.raises(BitPipeConfigError) as info:
        validate_megatron_lm_args(context_parallel_args(*flags, **refused))
    text = str(info.value)
    with_cp = f"with --context-parallel-size 2 and --pipeline-schedule {schedule}"
    expected = [
        f"--context-parallel-size 2 with --pipeline-schedule {schedule} needs --spec megatron_bitpipe.model.sdpa_attention "
        "gpt_local_sdpa_layer_spec (or a layer spec of yours whose core attention is SdpaDotProductAttention), got --spec local",
        f"--cp-comm-type allgather cannot be used {with_cp}: the SDPA attention exchanges keys and values by all_gather or p2p only",
        f"--cp-comm-type a2a+p2p cannot be used {with_cp}",
        f"--attention-dropout 0.1 cannot be used {with_cp}",
        f"--hierarchical-context-parallel-sizes cannot be used {with_cp}",
        f"--hybrid-context-parallel cannot be used {with_cp}",
        f"--sft cannot be used {with_cp}",
        f"--save cannot be used {with_cp}",
        f"--load cannot be used {with_cp}",
    ]
    for line in expected:
        assert line in text, text
    assert text.count("\n") == len(expected), text  # one line per rule, after the heading
    moe = dict(num_experts=4, moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="alltoall", add_bias_linear=False)
    with pytest.raises(BitPipeConfigError, match=f"invalid arguments:\n  --num-experts cannot be used {with_cp}: mixture-of-experts layers with context parallelism are not supported$"):
        validate_megatron_lm_args(context_parallel_args(*flags, **moe))
    with pytest.raises(BitPipeConfigError, match=f"--transformer-impl transformer_engine cannot be used {with_cp}: Transformer Engine's "
                       "context-parallel attention is not wired"):
        validate_megatron_lm_args(context_parallel_args(*flags, transformer_impl="transformer_engine", spec=None))
    with pytest.raises(BitPipeConfigError, match="needs --spec .*, got no --spec"):
        validate_megatron_lm_args(context_parallel_args(*flags, spec=None))
    with pytest.raises(BitPipeConfigError, match="needs --spec .*, got --spec megatron.core.models.gpt.gpt_layer_specs get_gpt_layer_local_spec"):
        validate_megatron_lm_args(context_parallel_args(*flags, spec=["megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"]))
    validate_megatron_lm_args(context_parallel_args(**refused))  # Megatron-LM's own schedule: its own rules


def moe_args(*argv, **fields) -> argparse.Namespace:
    """:func:`megatron_lm_args` of a mixture-of-experts GPT as Megatron-LM's ``validate_args``
    leaves it: 4 experts, pipeline 2 x data parallel 2."""
    moe = dict(
        num_experts=4, expert_model_parallel_size=2, expert_tensor_parallel_size=1, moe_router_load_balancing_type="aux_loss",
        moe_token_dispatcher_type="alltoall", pipeline_model_parallel_size=2, data_parallel_size=2,
    )
    return megatron_lm_args(*argv, **dict(moe, **fields))


@pytest.mark.parametrize("schedule", ["bitpipe", "zbv", "dualpipev"])
def test_plan_schedules_state_the_mixture_of_experts_rules(schedule):
    """Expert parallelism within the data-parallel copies of a pipeline rank, expert tensor
    parallelism equal to tensor parallelism; what the plan executor's chunks cannot hold is named
    by its flag, all at once; Megatron-LM's own schedule keeps Megatron-LM's rules."""
    flags = ("--pipeline-schedule", schedule)
    validate_megatron_lm_args(moe_args(*flags))
    validate_megatron_lm_args(moe_args(*flags, moe_token_dispatcher_type="allgather", moe_router_load_balancing_type=["aux_loss"]))
    validate_megatron_lm_args(moe_args(*flags, use_distributed_optimizer=True))
    validate_megatron_lm_args(moe_args(*flags, save="/checkpoints", load="/checkpoints", pretrained_checkpoint="/pretrained"))
    two_pipelines = schedule == "bitpipe"
    refused = dict(
        expert_model_parallel_size=4, num_experts=8, expert_tensor_parallel_size=2, moe_router_load_balancing_type=["global_aux_loss"],
        moe_token_dispatcher_type="flex", moe_router_enable_expert_bias=True,
        overlap_moe_expert_parallel_comm=True, add_bias_linear=True,
    )
    with pytest.raises(BitPipeConfigError) as info:
        validate_megatron_lm_args(moe_args(*flags, **refused))
    text = str(info.value)
    expected = [
        "--num-experts needs --disable-bias-linear: megatron-core's local expert MLP adds its bias into its output in place",
        f"--expert-model-parallel-size 4 must divide the data-parallel size 2 with --pipeline-schedule {schedule}",
        f"--expert-tensor-parallel-size 2 must equal --tensor-model-parallel-size 1 with --pipeline-schedule {schedule}",
        f"--moe-router-load-balancing-type global_aux_loss cannot be used with --pipeline-schedule {schedule}",
        f"--moe-token-dispatcher-type flex cannot be used with --pipeline-schedule {schedule}",
        f"--overlap-moe-expert-parallel-comm cannot be used with --num-experts and --pipeline-schedule {schedule}",
    ]
    bias = f"--moe-router-enable-expert-bias cannot be used with --pipeline-schedule {schedule}: each layer has a copy in each of its 2 pipelines"
    for line in expected + ([bias] if two_pipelines else []):
        assert line in text, text
    assert two_pipelines or "--moe-router-enable-expert-bias" not in text
    assert text.count("\n") == len(expected) + two_pipelines  # one line per rule, after the heading
    validate_megatron_lm_args(moe_args(**refused))  # Megatron-LM's own schedule: its own rules


def test_bitpipe_recompute_layers_must_fit_its_chunks():
    """BitPipe's chunks hold --num-layers / (2 x pp) layers, half of megatron's layers per rank."""
    bitpipe = ("--pipeline-schedule", "bitpipe")
    fits = dict(world_size=2, pipeline_model_parallel_size=2, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    validate_megatron_lm_args(megatron_lm_args(*bitpipe, **fits))
    too_many = dict(fits, recompute_num_layers=4)
    with pytest.raises(BitPipeConfigError, match="--recompute-num-layers 4 must be between 1 and the 2 layers of a model chunk"):
        validate_megatron_lm_args(megatron_lm_args(*bitpipe, **too_many))
    validate_megatron_lm_args(megatron_lm_args(**too_many))  # default schedule: megatron's business
    selective = dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
    validate_megatron_lm_args(megatron_lm_args(*bitpipe, add_bias_linear=False, **selective))
    with pytest.raises(BitPipeConfigError, match="--recompute-modules mlp needs --disable-bias-linear"):
        validate_megatron_lm_args(megatron_lm_args(*bitpipe, add_bias_linear=True, **selective))


def test_optimus2d_is_not_wired_into_megatron_lm_scripts():
    with pytest.raises(BitPipeConfigError, match="--tensor-parallel-mode optimus2d is not available through Megatron-LM's scripts"):
        validate_megatron_lm_args(megatron_lm_args("--tensor-parallel-mode", "optimus2d", tensor_model_parallel_size=4, pipeline_model_parallel_size=1))


def test_optimizer_flags_on_megatron_lm():
    """The optimizers' flags exist on Megatron-LM's parser; 1-bit LAMB needs a plan schedule there."""
    args = megatron_lm_args("--onebit-freeze-iters", "2", "--rex-beta", "0.3", optimizer="onebit_lamb", pipeline_model_parallel_size=2, world_size=2)
    assert args.onebit_freeze_iters == 2 and args.rex_beta == 0.3 and args.lamb_max_coeff == 10.0
    with pytest.raises(BitPipeConfigError, match=r"--optimizer onebit_lamb runs in Megatron-LM's scripts with --pipeline-schedule (\S+ or )*bitpipe( or \S+)* only"):
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


class _Block(TransformerBlock):
    """A TransformerBlock holding just its layers' numbers (megatron's constructor not run)."""

    def __init__(self, first_layer: int):
        torch.nn.Module.__init__(self)
        self.layers = torch.nn.ModuleList([_Layer(first_layer + 1)])


class _HybridStack(torch.nn.Module):
    """Stands for a hybrid (Mamba) model's layer stack: not a TransformerBlock."""

    def __init__(self, first_layer: int):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(first_layer + 1)])


class _Chunk(torch.nn.Module):
    """Just what the check reads off a megatron-core language model."""

    def __init__(self, first_layer: int, pg_collection, block=_Block):
        super().__init__()
        self.pre_process, self.post_process, self.pg_collection = False, False, pg_collection
        self.decoder = block(first_layer)


def model_provider(pre_process=True, post_process=True, config=None, pg_collection=None):
    """Stands for a Megatron-LM script's model_provider (only its name and file are read)."""


def test_model_builder_must_honour_config_and_process_groups():
    """A model provider that ignores ``pg_collection`` (Megatron-LM core_v0.16.1's
    pretrain_bert.py) or ``config`` is refused naming what it ignored, the provider and its file."""
    from megatron_bitpipe.megatron_lm.model import _check_chunk, _provider_name
    from megatron_bitpipe.model_partition import ChunkSpec

    builder = _provider_name(functools.partial(model_provider, "a builder"))  # pretrain_gpt.py passes a partial
    assert builder == f"the model_provider of {__file__}"
    spec = ChunkSpec(first_layer=6, num_layers=2, pre_process=False, post_process=False, pipeline=1, stage=3)
    ours = object()
    _check_chunk(_Chunk(6, ours), spec, ours, builder, schedule="bitpipe")
    for first_layer in (6, 0):  # megatron's global groups, whatever the layers
        with pytest.raises(BitPipeConfigError) as info:
            _check_chunk(_Chunk(first_layer, object()), spec, ours, builder, schedule="bitpipe")
        message = str(info.value)
        assert message.startswith(f"--pipeline-schedule bitpipe: {builder} built _Chunk without the pg_collection it was given")
        assert "pretrain_bert.py does not" in message and "should start at layer" not in message
    with pytest.raises(BitPipeConfigError) as info:
        _check_chunk(_Chunk(0, ours), spec, ours, builder, schedule="bitpipe")  # megatron's looped layers
    assert str(info.value).startswith(f"--pipeline-schedule bitpipe: {builder} did not build the chunk from the config it was given")
    assert "stage 4 of pipeline B should start at layer 6, the model starts at 0" in str(info.value)
    assert "pg_collection" not in str(info.value)
    with pytest.raises(BitPipeConfigError, match="_Chunk is not built on a TransformerBlock .*GPTModel or BertModel"):
        _check_chunk(_Chunk(6, ours, block=_HybridStack), spec, ours, builder, schedule="bitpipe")


@pytest.mark.parametrize("schedule", ["bitpipe", "zbv"])
def test_batch_size_ramps_are_checked_at_every_number_of_micro_batches(schedule):
    """4 ranks at pipeline 2: data parallel 2. Megatron-LM sets --global-batch-size to
    --micro-batch-size x data-parallel size beside a step schedule (core_v0.19.0 refuses both
    flags together), so a ramp's steps, not that default, are checked; megatron's own schedules
    run any ramp."""
    flags = ("--pipeline-schedule", schedule)
    base = dict(pipeline_model_parallel_size=2, train_iters=10, seq_length=16)
    if has_batch_ramp("--rampup-batch-size"):
        good, bad = dict(rampup_batch_size=["4", "4", "16"], global_batch_size=12), dict(rampup_batch_size=["2", "2", "16"], global_batch_size=12)
        flag = "--rampup-batch-size 2 2 16"
    else:
        good = dict(step_batch_size_schedule="0:4 128:8 256:12", global_batch_size=2)
        bad = dict(step_batch_size_schedule="0:2 128:8", global_batch_size=2)
        flag = '--step-batch-size-schedule "0:2 128:8"'
    validate_megatron_lm_args(megatron_lm_args(*flags, **base, **good))
    with pytest.raises(BitPipeConfigError) as info:
        validate_megatron_lm_args(megatron_lm_args(*flags, **base, **bad))
    (line,) = str(info.value).splitlines()[1:]
    assert line.startswith(f"  {flag}: iteration 1 (0 samples consumed) has a global batch of 2, so N = global batch / (--micro-batch-size 1 x data-parallel size 2) = 1: ")
    assert ("needs an even number of micro-batches" if schedule == "bitpipe" else "zbv needs at least") in line
    validate_megatron_lm_args(megatron_lm_args(**base, **bad))  # megatron's 1F1B: its own rules
    with pytest.raises(BitPipeConfigError, match="micro-batches per data-parallel rank"):  # a fixed batch keeps its rules
        validate_megatron_lm_args(megatron_lm_args(*flags, **base, global_batch_size=2))


def test_a_ramp_megatron_core_does_not_implement_is_left_to_megatron_lm():
    """core_v0.19.0 parses --rampup-batch-size and trains at --global-batch-size; core_v0.16.1
    has no --step-batch-size-schedule. The plan schedule's rules then apply to --global-batch-size."""
    flags = ("--pipeline-schedule", "bitpipe")
    base = dict(pipeline_model_parallel_size=2, train_iters=10, seq_length=16)
    missing = dict(step_batch_size_schedule="0:2 128:8") if has_batch_ramp("--rampup-batch-size") else dict(rampup_batch_size=["2", "2", "16"])
    validate_megatron_lm_args(megatron_lm_args(*flags, **base, **missing, global_batch_size=8))
    with pytest.raises(BitPipeConfigError, match="micro-batches per data-parallel rank"):
        validate_megatron_lm_args(megatron_lm_args(*flags, **base, **missing, global_batch_size=2))


def test_hybrid_models_are_refused_before_communication():
    for flags in (dict(hybrid_layer_pattern="M*M*M*M*"), dict(hybrid_override_pattern="M*M*M*M*", hybrid_layer_pattern="M*M*M*M*")):
        with pytest.raises(BitPipeConfigError) as info:
            validate_megatron_lm_args(megatron_lm_args("--pipeline-schedule", "bitpipe", **flags))
        (problem,) = [line for line in str(info.value).splitlines() if "hybrid" in line]
        flag = "--hybrid-override-pattern" if "hybrid_override_pattern" in flags else "--hybrid-layer-pattern"
        assert problem.strip().startswith(f"{flag} cannot be used with --pipeline-schedule bitpipe: bitpipe builds GPTModel chunks")
    validate_megatron_lm_args(megatron_lm_args(hybrid_layer_pattern="M*M*M*M*"))  # default schedule: megatron's business


def test_virtual_pipeline_messages_name_megatron_lm_flags():
    """Megatron-LM (tags core_v0.16.1 through core_v0.19.0) sets the virtual pipeline size with
    --num-virtual-stages-per-pipeline-rank; megatron-bitpipe's own scripts with
    --virtual-pipeline-model-parallel-size."""
    for schedule, vp, expected in (
        ("bitpipe", 2, "--num-virtual-stages-per-pipeline-rank must not be set with bitpipe"),
        ("interleaved", None, "--pipeline-schedule interleaved needs --num-virtual-stages-per-pipeline-rank >= 2"),
        ("1f1b", 2, "unset --num-virtual-stages-per-pipeline-rank"),
    ):
        with pytest.raises(BitPipeConfigError, match=expected) as info:
            validate_megatron_lm_args(megatron_lm_args("--pipeline-schedule", schedule, virtual_pipeline_model_parallel_size=vp))
        assert "--virtual-pipeline-model-parallel-size" not in str(info.value)
    parser = chain_args_provider(None)(argparse.ArgumentParser())
    (schedule_help,) = [action.help for action in parser._actions if "--pipeline-schedule" in action.option_strings]
    assert "interleaved (needs --num-virtual-stages-per-pipeline-rank)" in schedule_help


def _relay(placement: str) -> dict:
    from megatron_bitpipe.megatron_lm.losses import gather_losses_on_last_stage, loss_ranks
    from megatron_bitpipe.execution.groups import ParallelGrid, PipelineGroups
    from megatron_bitpipe.schedules import placement as placements

    groups = PipelineGroups.build(ParallelGrid(pp=2), getattr(placements, placement)(2))
    # bidirectional V: micro-batches 0, 1 on pipeline rank 0 (pipeline A) and 2, 3 on rank 1
    # (pipeline B); V: all four on rank 0, where the V ends; looped: all four on rank 1.
    senders = loss_ranks(groups.placement)
    mine = [m for m in range(4) if senders[m * len(senders) // 4] == groups.pp_rank]
    token_reports = [{"lm loss": torch.tensor([10.0 * m + 0.5, 7 + m])} for m in mine]
    scalar_reports = [{"lm loss": torch.tensor(float(m)), "count": torch.tensor(m)} for m in mine]
    return {
        "token": gather_losses_on_last_stage(token_reports, mine, groups),
        "scalars": gather_losses_on_last_stage(scalar_reports, mine, groups),
    }


@pytest.mark.multirank
@pytest.mark.parametrize("placement", ["bidirectional_v", "v_shape", "looped"])
def test_losses_reach_the_last_pipeline_stage(placement):
    first, last = launch(_relay, 2, placement, timeout=120)
    assert first == {"token": [], "scalars": []}
    assert len(last["token"]) == len(last["scalars"]) == 4
    for m in range(4):
        torch.testing.assert_close(last["token"][m]["lm loss"], torch.tensor([10.0 * m + 0.5, 7 + m]))
        report = last["scalars"][m]
        assert report["lm loss"].shape == () and report["lm loss"].item() == m
        assert report["count"].dtype == torch.int64 and report["count"].item() == m


def test_the_evaluation_batch_keeps_the_schedule_rules():
    """core_v0.19.0 evaluates at --eval-global-batch-size / --eval-micro-batch-size (beside a step
    batch-size schedule: one micro-batch per rank): its N is checked with the schedule's rules
    before any communication, naming those flags; without evaluation, or where the namespace has no
    such flags (core_v0.16.1), nothing is asked."""
    flags = ("--pipeline-schedule", "bitpipe")
    evaluation = dict(pipeline_model_parallel_size=2, data_parallel_size=2, eval_micro_batch_size=1, eval_iters=1)
    validate_megatron_lm_args(megatron_lm_args(*flags, **evaluation, eval_global_batch_size=4))  # N = 2
    validate_megatron_lm_args(megatron_lm_args(*flags, **dict(evaluation, eval_iters=0), eval_global_batch_size=2))
    with pytest.raises(BitPipeConfigError) as info:
        validate_megatron_lm_args(megatron_lm_args(*flags, **evaluation, eval_global_batch_size=2))  # N = 1
    text = str(info.value)
    source = "evaluation micro-batches per data-parallel rank (--eval-global-batch-size 2 / (--eval-micro-batch-size 1 x data-parallel size 2)) = 1"
    lines = text.splitlines()[1:]
    assert lines and all(line.strip().startswith(source) for line in lines), text
