"""SDPA core attention (``--attention-backend sdpa``,
:class:`megatron_bitpipe.model.sdpa_attention.SdpaDotProductAttention`) against megatron-core's
unfused ``DotProductAttention``.

* The flag: its values, refused with Transformer Engine layers and Optimus 2D, one error naming
  the flag before any process group exists (pure Python).
* The module on one rank (fp32, dropout 0): same output and input gradients as
  ``DotProductAttention`` for GPT's causal layers, BERT's padding mask (on the rows that reach a
  loss), GQA (with and without a mask), an explicit ``softmax_scale`` and
  ``apply_query_key_layer_scaling``; a context-parallel size whose group the layer was not given
  refused (context parallelism itself: ``tests/execution/test_context_parallel_equivalence.py``).
* A whole GPT on one rank: same loss and every parameter gradient with either core attention
  (plain and GQA).
* Attention dropout > 0: training outputs differ from evaluation, evaluation equals dropout 0
  and repeats itself, and the same RNG state replays the same mask (selective recompute's
  premise); the random stream is not the unfused path's (documented, not tested).
"""

from __future__ import annotations

import pytest
import torch

from megatron_bitpipe.cpu.launcher import launch
from megatron_bitpipe.megatron_args import BitPipeConfigError
from megatron_bitpipe.run_config import RunConfig
from megatron_bitpipe.training.arguments import parse_args
from megatron_bitpipe.training.gpt import GPTTask
from megatron_bitpipe.usage import UsageError

BASE = [
    "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "4", "--lr", "1e-3",
    "--vocab-size", "127",
]  # fmt: skip
SEED = 1234
TOL = dict(rtol=1e-5, atol=1e-6)


def parse(*extra, world_size=1):
    return parse_args(GPTTask(), [*BASE, *extra], world_size=world_size, cuda_available=False)


# ---------------------------------------------------------------- the flag (pure Python)


def test_attention_backend_flag_values():
    assert parse().attention_backend == "auto"
    assert parse("--attention-backend", "sdpa").attention_backend == "sdpa"
    assert parse("--attention-backend", "local").attention_backend == "local"


def test_attention_backend_bad_value_names_the_flag():
    with pytest.raises(UsageError, match="--attention-backend: invalid choice: 'flash'"):
        parse("--attention-backend", "flash")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--transformer-impl", "transformer_engine"], "--attention-backend sdpa is a core attention of megatron-core's local layers"),
        (["--tensor-parallel-mode", "optimus2d", "--tensor-model-parallel-size", "4"], "--attention-backend sdpa needs --tensor-parallel-mode 1d"),
    ],
)
def test_attention_backend_sdpa_refusals(extra, message):
    world = 4 if "optimus2d" in extra else 1
    with pytest.raises(BitPipeConfigError, match=message):
        parse("--attention-backend", "sdpa", *extra, world_size=world)


def test_attention_backend_selects_local_layers(monkeypatch):
    """Without --transformer-impl, local and sdpa choose megatron-core's local layers even
    where Transformer Engine would be the default (a GPU with TE)."""
    from megatron_bitpipe.training import config

    monkeypatch.setattr(config, "_have_transformer_engine", lambda: True)
    monkeypatch.setattr(config.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(config.parallel_state, "_TENSOR_MODEL_PARALLEL_GROUP", None, raising=False)
    for backend, impl in (("sdpa", "local"), ("local", "local"), ("auto", "transformer_engine")):
        args = parse("--attention-backend", backend)
        try:
            assert config.transformer_config(RunConfig.from_args(args)).transformer_impl == impl, backend
        except AssertionError:
            raise
        except Exception as error:  # a config check needing a real GPU; the choice is made before it
            pytest.skip(f"TransformerConfig with a faked GPU: {error}")


# ---------------------------------------------------------------- the module (one launched rank)


class _OneRank:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _config(**overrides):
    from megatron_bitpipe.benchmarking.megatron_baseline import tiny_gpt_config

    fields = dict(num_layers=4, hidden_size=32, num_attention_heads=4)
    fields.update(overrides)
    return tiny_gpt_config(**fields)


def _pair(config, mask_type, layer_number=1, softmax_scale=None, attention_dropout=None):
    from types import SimpleNamespace

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_bitpipe.model.sdpa_attention import SdpaDotProductAttention

    pgs = SimpleNamespace(tp=_OneRank())
    kwargs = dict(softmax_scale=softmax_scale, attention_dropout=attention_dropout, pg_collection=pgs)
    return (
        DotProductAttention(config, layer_number, mask_type, "self", **kwargs),
        SdpaDotProductAttention(config, layer_number, mask_type, "self", **kwargs),
    )


def _qkv(s, b, heads, groups, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, b, n, d, generator=g).requires_grad_() for n in (heads, groups, groups)]


def _run(module, qkv, mask, grad_out):
    for t in qkv:
        t.grad = None
    out = module(*qkv, mask)
    out.backward(grad_out)
    return out.detach().clone(), [t.grad.clone() for t in qkv]


def _max_differences(pair, qkv, mask=None, rows=None):
    """Max |unfused - sdpa| of the output and of the q, k, v gradients; ``rows`` ([b, s] bool):
    the query rows compared and given an upstream gradient (the others reach no loss)."""
    s, b = qkv[0].shape[:2]
    grad_out = torch.randn(s, b, qkv[0].shape[2] * qkv[0].shape[3], generator=torch.Generator().manual_seed(9))
    keep = None
    if rows is not None:
        keep = rows.t().unsqueeze(-1).float()  # [s, b, 1]
        grad_out = grad_out * keep
    (out_a, grads_a), (out_b, grads_b) = (_run(m, qkv, mask, grad_out) for m in pair)
    if keep is not None:
        out_a, out_b = out_a * keep, out_b * keep
    return [float((x - y).abs().max()) for x, y in zip([out_a, *grads_a], [out_b, *grads_b])]


def _padding_mask(b, s):
    """BERT's [b, 1, s, s] mask (megatron's convention: True = masked out), sample i padded
    after s - 3 i tokens; and the [b, s] real-token rows."""
    lengths = torch.tensor([s - 3 * i for i in range(b)])
    real = torch.arange(s).unsqueeze(0) < lengths.unsqueeze(1)  # [b, s]
    pairs = real.unsqueeze(1) & real.unsqueeze(2)
    return (~pairs).unsqueeze(1), real


def _module_checks() -> dict:
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_bitpipe.benchmarking import megatron_baseline as baseline
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.model.build import init_megatron_state
    from megatron_bitpipe.execution.groups import ParallelGrid

    enable_cpu_megatron()
    pg = baseline.build_looped_process_groups(ParallelGrid())
    init_megatron_state(pg, SEED)
    causal, padding = AttnMaskType.causal, AttnMaskType.padding
    out = {}
    s, b, d = 16, 3, 8
    mask, rows = _padding_mask(b, s)
    out["causal"] = _max_differences(_pair(_config(), causal), _qkv(s, b, 4, 4, d))
    out["padding"] = _max_differences(_pair(_config(), padding), _qkv(s, b, 4, 4, d), mask, rows)
    key_mask = (~rows)[:, None, None, :]  # megatron's [b, 1, 1, s] variant: padded keys only
    out["padding_key_only"] = _max_differences(_pair(_config(), padding), _qkv(s, b, 4, 4, d), key_mask, rows)
    gqa = _config(num_query_groups=2)
    out["gqa_causal"] = _max_differences(_pair(gqa, causal), _qkv(s, b, 4, 2, d))
    out["gqa_padding"] = _max_differences(_pair(gqa, padding), _qkv(s, b, 4, 2, d), mask, rows)
    out["softmax_scale"] = _max_differences(_pair(_config(), causal, softmax_scale=0.05), _qkv(s, b, 4, 4, d))
    scaled = _config(apply_query_key_layer_scaling=True)
    out["layer_scaling"] = _max_differences(_pair(scaled, causal, layer_number=3), _qkv(s, b, 4, 4, d))
    try:
        _pair(_config(context_parallel_size=2), causal)
        out["cp_refused"] = None
    except ValueError as error:
        out["cp_refused"] = str(error)
    except Exception as error:  # megatron's own config check came first
        out["cp_refused"] = f"{type(error).__name__}: {error}"
    out["dropout"] = _dropout_checks()
    out["gpt_model"] = {name: _gpt_model_difference(pg, **kw) for name, kw in (("plain", {}), ("gqa", dict(num_query_groups=2)))}
    return out


def _dropout_checks() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.enums import AttnMaskType

    _, sdpa = _pair(_config(attention_dropout=0.25), AttnMaskType.causal)
    _, no_dropout = _pair(_config(), AttnMaskType.causal)
    qkv = _qkv(16, 2, 4, 4, 8)
    tracker = get_cuda_rng_tracker()
    states = tracker.get_states()
    cpu_state = torch.get_rng_state()
    first = sdpa.train()(*qkv, None).detach()
    second = sdpa(*qkv, None).detach()
    tracker.set_states(states)  # what megatron's checkpoint restores before recomputing
    torch.set_rng_state(cpu_state)
    replay = sdpa(*qkv, None).detach()
    evaluation = [sdpa.eval()(*qkv, None).detach() for _ in range(2)]
    reference = no_dropout.eval()(*qkv, None).detach()
    return dict(
        train_vs_eval=float((first - evaluation[0]).abs().max()),
        two_draws=float((first - second).abs().max()),
        replay=float((first - replay).abs().max()),
        eval_repeat=float((evaluation[0] - evaluation[1]).abs().max()),
        eval_vs_no_dropout=float((evaluation[0] - reference).abs().max()),
    )


def _gpt_model_difference(pg, **overrides) -> dict:
    """One GPT (4 layers) built with each core attention from the same weights: the loss and
    the largest gradient difference over all parameters."""
    from megatron_bitpipe.benchmarking import megatron_baseline as baseline
    from megatron_bitpipe.model.chunks import default_gpt_layer_spec
    from megatron_bitpipe.model.sdpa_attention import SdpaDotProductAttention, with_core_attention

    config = _config(**overrides)
    spec = default_gpt_layer_spec(config)
    models = [
        baseline.build_megatron_gpt_model(config, pg, vocab_size=128, max_sequence_length=16, layer_spec=layer_spec)
        for layer_spec in (spec, with_core_attention(spec, SdpaDotProductAttention))
    ]
    models[1].load_state_dict(models[0].state_dict())
    assert type(models[1].decoder.layers[0].self_attention.core_attention) is SdpaDotProductAttention
    tokens, labels = baseline.synthetic_microbatches(SEED, 1, 2, 16, 128)[0]
    position_ids = torch.arange(16).expand_as(tokens)
    losses = []
    for model in models:
        loss = model(tokens, position_ids, None, labels=labels).float().mean()
        loss.backward()
        losses.append(loss.item())
    grads = [dict((n, p.grad) for n, p in m.named_parameters()) for m in models]
    assert grads[0].keys() == grads[1].keys()
    worst = max(float((grads[0][n] - grads[1][n]).abs().max() / (grads[0][n].abs().max() + 1e-12)) for n in grads[0])
    return dict(losses=losses, max_relative_grad_difference=worst, parameters=len(grads[0]))


@pytest.fixture(scope="module")
def module_checks() -> dict:
    return launch(_module_checks, 1, timeout=300)[0]


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["causal", "padding", "padding_key_only", "gqa_causal", "gqa_padding", "softmax_scale", "layer_scaling"])
def test_module_equals_dot_product_attention(module_checks, name):
    output, *grads = module_checks[name]
    assert output < 1e-5, f"{name}: output differs by {output}"
    for what, diff in zip("qkv", grads):
        assert diff < 1e-5, f"{name}: gradient of {what} differs by {diff}"


@pytest.mark.multirank
def test_context_parallel_size_without_its_group_is_refused(module_checks):
    assert module_checks["cp_refused"] is not None and "context" in module_checks["cp_refused"].lower()


@pytest.mark.multirank
@pytest.mark.parametrize("variant", ["plain", "gqa"])
def test_gpt_model_same_loss_and_gradients(module_checks, variant):
    result = module_checks["gpt_model"][variant]
    assert result["losses"][0] == pytest.approx(result["losses"][1], rel=1e-6)
    assert result["max_relative_grad_difference"] < 1e-4, result


@pytest.mark.multirank
def test_dropout_train_eval_and_replay(module_checks):
    d = module_checks["dropout"]
    assert d["train_vs_eval"] > 1e-3, "training must drop attention probabilities"
    assert d["two_draws"] > 1e-3, "two training calls draw two masks"
    assert d["replay"] == 0.0, "the same RNG state must replay the same mask"
    assert d["eval_repeat"] == 0.0 and d["eval_vs_no_dropout"] < 1e-6, "evaluation: no dropout"


def test_megatron_lm_spec_object():
    """``--spec megatron_bitpipe.model.sdpa_attention gpt_local_sdpa_layer_spec`` (Megatron-LM)
    imports a GPT layer spec with SDPA core attention."""
    import importlib

    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    from megatron_bitpipe.model.sdpa_attention import SdpaDotProductAttention, uses_core_attention

    spec = import_module(["megatron_bitpipe.model.sdpa_attention", "gpt_local_sdpa_layer_spec"])
    assert isinstance(spec, ModuleSpec) and uses_core_attention(spec, SdpaDotProductAttention)
    assert importlib.import_module("megatron_bitpipe.model.sdpa_attention").gpt_local_sdpa_layer_spec is spec
