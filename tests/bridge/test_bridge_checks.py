"""A Bridge container checked by the Megatron-LM route's rules, each problem in Bridge's field
names; the provider; both of Bridge's call sites of ``get_forward_backward_func`` patched
whichever is imported first. Pure Python (no process group)."""

from __future__ import annotations

import importlib

import pytest

from megatron_bitpipe.megatron_args import BitPipeConfigError

from .bridge_support import recipe


@pytest.fixture(autouse=True)
def _world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    yield
    from megatron_bitpipe.plugin import unregister

    unregister()


def _install(cfg):
    from megatron_bitpipe.bridge import install

    return install(cfg)


def test_a_valid_container_installs_bitpipe():
    config = _install(recipe(schedule="bitpipe", pp=2, num_layers=4))
    assert config.schedule_name == "bitpipe" and config.layout.pipeline == 2 and config.layout.data == 2
    assert config.batches.num_microbatches == 2


@pytest.mark.parametrize(
    "change,line",
    [
        (lambda cfg: setattr(cfg.dist, "use_torch_fsdp2", True),
         "dist.use_torch_fsdp2 cannot be used with model.pipeline_schedule bitpipe: bitpipe wraps each chunk in megatron DDP"),
        (lambda cfg: setattr(cfg.dist, "use_megatron_fsdp", True),
         "dist.use_megatron_fsdp cannot be used with model.pipeline_schedule bitpipe: bitpipe wraps each chunk in megatron DDP"),
        (lambda cfg: setattr(cfg.model, "context_parallel_size", 2),
         "model.context_parallel_size cannot be used with model.pipeline_schedule bitpipe: context parallelism is not supported"),
        (lambda cfg: setattr(cfg.model, "virtual_pipeline_model_parallel_size", 2),
         "model.virtual_pipeline_model_parallel_size"),
        (lambda cfg: setattr(cfg.ddp, "overlap_param_gather", True),
         "ddp.overlap_param_gather cannot be used with model.pipeline_schedule bitpipe without ddp.use_distributed_optimizer"),
        (lambda cfg: setattr(cfg.ddp, "num_distributed_optimizer_instances", 2),
         "ddp.num_distributed_optimizer_instances cannot be used with model.pipeline_schedule bitpipe"),
        (lambda cfg: setattr(cfg.model, "moe_token_dispatcher_type", "flex") or setattr(cfg.model, "num_moe_experts", 4),
         "model.moe_token_dispatcher_type flex cannot be used with model.pipeline_schedule bitpipe"),
        (lambda cfg: setattr(cfg.model, "expert_model_parallel_size", 4) or setattr(cfg.model, "num_moe_experts", 4),
         "model.expert_model_parallel_size 4 must divide the data-parallel size 2"),
        (lambda cfg: setattr(cfg.train, "global_batch_size", 6), "train.global_batch_size"),
        (lambda cfg: setattr(cfg.model, "delay_wgrad_compute", True), "model.delay_wgrad_compute cannot be used"),
    ],
    ids=["fsdp2", "megatron-fsdp", "cp", "vp", "param-gather-alone", "optimizer-instances", "moe-flex", "moe-ep",
         "microbatches", "delay-wgrad"],
)
def test_refused_fields_are_named(change, line):
    cfg = recipe(schedule="bitpipe", pp=2, num_layers=4)
    change(cfg)
    with pytest.raises(BitPipeConfigError, match="invalid Megatron-Bridge configuration") as error:
        _install(cfg)
    assert line in str(error.value)
    assert "--" not in str(error.value), "a flag name was left untranslated"


def test_the_distributed_optimizer_saves_fully_reshardable(capsys):
    cfg = recipe(schedule="bitpipe", pp=2, num_layers=4, distributed_optimizer=True, overlap_param_gather=True)
    config = _install(cfg)
    assert config.distributed_optimizer and config.overlap_param_gather
    assert cfg.checkpoint.dist_ckpt_optim_fully_reshardable
    assert "checkpoint.dist_ckpt_optim_fully_reshardable" in capsys.readouterr().out


def test_bridges_optimizer_and_param_gathers_are_routed():
    import megatron.bridge.training.optim as bridge_optim
    import megatron.bridge.training.train as bridge_train

    from megatron_bitpipe.bridge import optimizer

    _install(recipe(schedule="bitpipe", pp=2, num_layers=4))
    _install(recipe(schedule="bitpipe", pp=2, num_layers=4))  # idempotent: wrapped once
    assert bridge_optim.get_megatron_optimizer.func is optimizer.get_megatron_optimizer
    assert not hasattr(bridge_optim.get_megatron_optimizer.args[0], "megatron_bitpipe_original")
    for name in optimizer.PARAM_SYNC_FUNCTIONS:
        assert getattr(bridge_train, name).func is optimizer.in_stage_order


def test_recompute_counts_a_chunks_layers():
    cfg = recipe(schedule="bitpipe", pp=2, num_layers=4, recompute_granularity="full", recompute_method="block",
                 recompute_num_layers=2)
    with pytest.raises(BitPipeConfigError, match="model.recompute_num_layers"):
        _install(cfg)


def test_odd_pipeline_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(BitPipeConfigError, match="model.pipeline_model_parallel_size must be even"):
        _install(recipe(schedule="bitpipe", pp=3, num_layers=6, global_batch=6))


def test_the_model_config_route_installs():
    from megatron.training.models.gpt import GPTModelConfig

    from megatron_bitpipe.bridge import BitPipeGPTModelConfig

    cfg = recipe(schedule="zbv", pp=2, num_layers=4, builder=True)
    assert isinstance(cfg.model, BitPipeGPTModelConfig) and cfg.model.hidden_size == 32  # on its TransformerConfig
    config = _install(cfg)
    assert config.schedule_name == "zbv" and config.layout.data == 2
    stock = GPTModelConfig(transformer=cfg.model.transformer, vocab_size=cfg.model.vocab_size)
    assert BitPipeGPTModelConfig.from_config(stock, pipeline_schedule="bitpipe").transformer is cfg.model.transformer
    cfg.model = stock
    with pytest.raises(TypeError, match=r"BitPipeGPTModelConfig.from_config\(cfg.model"):
        _install(cfg)


def test_stock_provider_names_ours():
    with pytest.raises(TypeError, match="BitPipeGPTModelProvider.from_provider"):
        _install(recipe(schedule="bitpipe", pp=2, stock=True))


def test_from_provider_keeps_the_recipes_fields():
    from megatron_bitpipe.bridge import BitPipeGPTModelProvider

    stock = recipe(schedule="default", pp=2, stock=True).model
    ours = BitPipeGPTModelProvider.from_provider(stock, pipeline_schedule="zbv")
    assert ours.pipeline_schedule == "zbv" and ours.hidden_size == stock.hidden_size and ours.normalization == "RMSNorm"


@pytest.mark.parametrize("bridge_first", [True, False], ids=["bridge-imported-first", "installed-first"])
def test_both_call_sites_patched(bridge_first):
    import megatron.bridge.training.eval as bridge_eval
    import megatron.bridge.training.train as bridge_train

    from megatron_bitpipe.plugin import InstalledSchedule

    _install(recipe(schedule="bitpipe", pp=2, num_layers=4))
    if not bridge_first:  # Bridge's modules imported after the schedule was installed
        importlib.reload(bridge_train)
        importlib.reload(bridge_eval)
    for module in (bridge_train, bridge_eval):
        assert isinstance(module.get_forward_backward_func, InstalledSchedule)
        assert module.get_forward_backward_func(pp_size=2, vp_size=None).__name__ == "forward_backward_bitpipe_for_megatron_lm"
