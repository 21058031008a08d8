"""Seed-only initial weights drawn per shard (no processes).

* the counter-based stream is SplitMix64 at any position, and its normal values are N(0, 1)
  (Box-Muller equal to the libm formula to float32 accuracy, Kolmogorov-Smirnov distance);
* every tensor-parallel block — 1-D row and column shards, megatron's strided ``[gate; up]``
  shards, Optimus 2-D blocks (transposed linear weights, vocabulary tables, feature vectors
  and tables) — equals the same block of the full tensor drawn on one rank, bit for bit;
* table rows do not depend on the number of rows (vocabulary padding);
* megatron's init callables are recognised (normal std, xavier bounds, constants); another
  callable still gives the block of its full tensor;
* a block is drawn without the full tensor: peak memory follows the block (in a subprocess);
* the learnable softmax offset (one value per attention head) is drawn as megatron draws it and
  marked split over the tensor-parallel ranks, as its heads are.
"""

from __future__ import annotations

import functools
import hashlib
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_bitpipe.optimus.layout import LayoutKind, ParamLayout
from megatron_bitpipe.model import seeded_random
from megatron_bitpipe.model.init import initialize_parameter
from megatron_bitpipe.model_partition import tp_block

REPO = Path(__file__).resolve().parents[2]
NORMAL = functools.partial(torch.nn.init.normal_, mean=0.0, std=0.02)
_M = 2**64


def _splitmix64(key: int, position: int) -> int:
    """SplitMix64's output ``position`` from state ``key``, in Python integers."""
    z = (key + (position + 1) * 0x9E3779B97F4A7C15) % _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % _M
    return z ^ (z >> 31)


def test_stream_is_splitmix64_at_any_position():
    # SplitMix64's published first outputs for seed 1234567
    assert seeded_random.bits(1234567, np.arange(5)).tolist() == [
        6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431, 16408922859458223821,
    ]  # fmt: skip
    key = seeded_random.stream_key(7, "decoder.layers.3.mlp.linear_fc1.weight")
    positions = np.array([0, 1, 2**20 + 5, 2**40 + 3, 2**62], dtype=np.uint64)
    assert seeded_random.bits(key, positions).tolist() == [_splitmix64(key, int(p)) for p in positions]


def test_standard_normal_is_box_muller_and_normal():
    key = seeded_random.stream_key(1234, "x")
    values = seeded_random.standard_normal(key, np.arange(1 << 18))
    assert values.dtype == np.float32
    z = seeded_random.bits(key, np.arange(1 << 18))
    u1 = ((z >> np.uint64(40)).astype(np.float64) + 1) / 2**24
    turn = (z & np.uint64(0x7FFFFF)).astype(np.float64) / 2**23
    sign = np.where((z >> np.uint64(23)) & np.uint64(1), -1.0, 1.0)
    libm = sign * np.sqrt(-2 * np.log(u1)) * np.cos(math.pi / 2 * turn)
    np.testing.assert_allclose(values, libm, rtol=0, atol=4e-6)
    sample = torch.from_numpy(np.sort(values.astype(np.float64)))
    cdf = torch.special.ndtr(sample)
    n = sample.numel()
    ks = max((torch.arange(1, n + 1) / n - cdf).max().item(), (cdf - torch.arange(n) / n).max().item())
    assert ks < 1.63 / math.sqrt(n)  # 1% critical value
    assert abs(values.mean()) < 0.01 and abs(values.std() - 1) < 0.01
    uniform = seeded_random.uniform(key, np.arange(1 << 16))
    assert uniform.min() >= 0 and uniform.max() < 1 and abs(uniform.mean() - 0.5) < 0.01


def test_the_drawn_bits_never_change():
    """The initial weights of a seed are fixed for good: the digests of values this stream
    has always drawn (contiguous and scattered positions), whole and piece by piece through
    one reused workspace and output array."""
    key = seeded_random.stream_key(1234, "decoder.layers.0.mlp.linear_fc1.weight")
    scattered = (np.arange(4096, dtype=np.uint64) * np.uint64(2**40 + 12345)) % np.uint64(2**62)
    positions = np.concatenate([np.arange(1 << 16, dtype=np.uint64), scattered])
    digests = {"normal": "c7015c4289b8260c1e1ad21ac2aa1b57", "uniform": "f4758ced926dbfec36f7ebd11847beea"}
    workspace, out = seeded_random.Workspace(5000), np.empty(5000, np.float32)
    for name, draw in (("normal", seeded_random.standard_normal), ("uniform", seeded_random.uniform)):
        whole = draw(key, positions)
        pieces = np.concatenate([draw(key, positions[i : i + 5000], out[: len(positions[i : i + 5000])], workspace).copy() for i in range(0, len(positions), 5000)])
        assert hashlib.sha256(whole.tobytes()).hexdigest()[:32] == digests[name], name
        assert np.array_equal(pieces.view(np.uint32), whole.view(np.uint32)), name


def _tp_param(local_shape, partition_dim=None, stride=1, layout=None) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.empty(local_shape), requires_grad=False)
    if partition_dim is not None:
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, partition_dim, stride
    if layout is not None:
        param.optimus_layout = layout
    return param


def _full(shape, name="w", init=NORMAL) -> torch.Tensor:
    full = _tp_param(shape)
    initialize_parameter(full, name, init, seed=1234)
    return full.detach()


# (description, full shape, make the local parameter for tp size t)
ONE_D = [
    ("column-parallel weight", (12, 10), lambda t: _tp_param((12 // t, 10), partition_dim=0)),
    ("row-parallel weight", (12, 10), lambda t: _tp_param((12, 10 // t), partition_dim=1)),
    ("gated [gate; up] weight", (24, 10), lambda t: _tp_param((24 // t, 10), partition_dim=0, stride=2)),
    ("gated bias", (24,), lambda t: _tp_param((24 // t,), partition_dim=0, stride=2)),
    ("vocabulary table", (16, 10), lambda t: _tp_param((16 // t, 10), partition_dim=0)),
    ("per-head vector (learnable softmax offset)", (12,), lambda t: _tp_param((12 // t,), partition_dim=0)),
]
OPTIMUS = [
    (ParamLayout(LayoutKind.LINEAR_WEIGHT), lambda q: (3 * q, 2 * q)),
    (ParamLayout(LayoutKind.LINEAR_WEIGHT, stride=2), lambda q: (4 * q, 2 * q)),
    (ParamLayout(LayoutKind.VOCAB_TABLE), lambda q: (4 * q, 3 * q)),
    (ParamLayout(LayoutKind.FEATURE_VECTOR), lambda q: (4 * q,)),
    (ParamLayout(LayoutKind.FEATURE_VECTOR, stride=2), lambda q: (4 * q,)),
    (ParamLayout(LayoutKind.FEATURE_TABLE), lambda q: (5, 3 * q)),
]


@pytest.mark.parametrize("what, shape, make", ONE_D, ids=[d for d, _, _ in ONE_D])
@pytest.mark.parametrize("tp", [2, 3])
def test_every_one_d_block_is_the_block_of_the_full_tensor(what, shape, make, tp):
    if shape[make(tp).partition_dim] % (tp * make(tp).partition_stride):
        pytest.skip("shape not divisible")
    full = _full(shape)
    for rank in range(tp):
        local = make(tp)
        initialize_parameter(local, "w", NORMAL, seed=1234, tp_rank=rank, tp_size=tp)
        assert torch.equal(local, tp_block(full, local, rank, tp)), (what, rank)


@pytest.mark.parametrize("layout, serial", OPTIMUS, ids=[f"{l.kind.value}-{l.stride}" for l, _ in OPTIMUS])
@pytest.mark.parametrize("side", [2, 3])
def test_every_optimus_block_is_the_block_of_the_full_tensor(layout, serial, side):
    shape = serial(side)
    full = _full(shape)
    tp = side * side
    for rank in range(tp):
        local = _tp_param(tuple(tp_block(full, _tp_param((0,), layout=layout), rank, tp).shape), layout=layout)
        initialize_parameter(local, "w", NORMAL, seed=1234, tp_rank=rank, tp_size=tp)
        assert torch.equal(local, tp_block(full, local, rank, tp)), rank


def test_table_rows_do_not_depend_on_the_number_of_rows():
    name = "embedding.word_embeddings.weight"
    assert torch.equal(_full((100, 8), name)[:97], _full((97, 8), name))
    assert not torch.equal(_full((100, 8), name)[:, :4], _full((100, 4), name))  # width matters


def test_values_follow_the_init_callable_and_the_name():
    big = (256, 256)
    scaled = functools.partial(torch.nn.init.normal_, mean=0.0, std=0.02 / math.sqrt(2 * 8))
    assert _full(big, init=NORMAL).std().item() == pytest.approx(0.02, rel=0.02)
    assert _full(big, init=scaled).std().item() == pytest.approx(0.02 / 4, rel=0.02)
    assert _full(big, init=functools.partial(torch.nn.init.normal_, mean=1.0, std=0.5)).mean().item() == pytest.approx(1.0, abs=0.01)
    xavier = _full((30, 50), init=torch.nn.init.xavier_uniform_)
    bound = math.sqrt(6 / 80)
    assert xavier.abs().max().item() <= bound and xavier.abs().max().item() > 0.95 * bound
    assert torch.equal(_full((3, 4), init=torch.nn.init.ones_), torch.ones(3, 4))
    assert torch.equal(_full((5,), init=torch.nn.init.zeros_), torch.zeros(5))
    assert not torch.equal(_full(big, "a"), _full(big, "b"))
    assert torch.equal(_full(big, "a"), _full(big, "a"))


def test_learnable_softmax_offset_follows_megatron_init():
    """megatron-core's ``DotProductAttention`` draws its learnable offset with ``config.init_method``."""
    from megatron.core.transformer import TransformerConfig

    from megatron_bitpipe.model.init import init_method_for

    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, softmax_type="learnable")
    assert init_method_for("decoder.layers.1.self_attention.core_attention.softmax_offset", config) is config.init_method


def test_another_init_callable_gives_the_block_of_its_full_tensor():
    def custom(tensor):
        return tensor.uniform_(-3.0, -2.0)

    full = _full((12, 10), init=custom)
    assert full.min() >= -3 and full.max() <= -2
    assert torch.equal(full, _full((12, 10), init=custom))
    for rank in range(2):
        local = _tp_param((12, 5), partition_dim=1)
        initialize_parameter(local, "w", custom, seed=1234, tp_rank=rank, tp_size=2)
        assert torch.equal(local, tp_block(full, local, rank, 2))


_PEAK = """
import resource, torch
from megatron_bitpipe.model.init import initialize_parameter
from megatron_bitpipe.model_partition import full_shape
local = torch.nn.Parameter(torch.empty(64, 16384), requires_grad=False)
local.tensor_model_parallel, local.partition_dim, local.partition_stride = True, 0, 1
assert full_shape(local, 512) == (32768, 16384)  # 2 GiB in fp32
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
initialize_parameter(local, "w", torch.nn.init.normal_, seed=1, tp_rank=77, tp_size=512)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.multirank  # a process of its own
def test_a_block_is_drawn_without_the_full_tensor():
    """A 4 MiB block of a 2 GiB weight raises the peak memory by far less than the weight."""
    result = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) < 256, f"peak grew by {result.stdout.strip()} MiB"


GATED_BIAS = [(True, False), (True, True), (False, False)]


def _tensor_parallel_attributes() -> dict:
    """Rank body: per (gated, bias) of :data:`GATED_BIAS`, and for a learnable softmax offset with
    megatron's defaults set, with / without megatron's initialisation: {parameter:
    (tensor_model_parallel, partition_dim, partition_stride)} of a tiny GPT, marked by
    ``mark_tensor_parallel_weights``."""
    from megatron_bitpipe.benchmarking import megatron_baseline as baseline
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.model.build import init_megatron_state
    from megatron_bitpipe.execution.groups import ParallelGrid
    from megatron_bitpipe.model.chunks import mark_tensor_parallel_weights
    from megatron_bitpipe.training.config import mlp_fields
    from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes

    enable_cpu_megatron()
    pg = baseline.build_looped_process_groups(ParallelGrid())
    init_megatron_state(pg, 1234)
    out = {}
    for (gated, bias), initialise in ((case, initialise) for case in GATED_BIAS for initialise in (True, False)):
        config = baseline.tiny_gpt_config(
            num_layers=2, hidden_size=16, num_attention_heads=2, **mlp_fields(gated), add_bias_linear=bias,
            perform_initialization=initialise,
        )  # fmt: skip
        model = baseline.build_megatron_gpt_model(config, pg, vocab_size=64, max_sequence_length=8)
        mark_tensor_parallel_weights(model)
        out[(gated, bias, initialise)] = _attributes(model)
    for initialise in (True, False):
        config = baseline.tiny_gpt_config(num_layers=2, hidden_size=16, num_attention_heads=2, softmax_type="learnable", perform_initialization=initialise)
        model = baseline.build_megatron_gpt_model(config, pg, vocab_size=64, max_sequence_length=8)
        for param in model.parameters():  # as Megatron-LM's get_model leaves them: megatron's defaults say unsplit
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        mark_tensor_parallel_weights(model)
        out[("learnable softmax", initialise)] = _attributes(model)
    return out


def _attributes(model) -> dict:
    return {
        name: tuple(getattr(p, key, None) for key in ("tensor_model_parallel", "partition_dim", "partition_stride"))
        for name, p in model.named_parameters()
    }


@pytest.fixture(scope="module")
def tensor_parallel_attributes() -> dict:
    from megatron_bitpipe.cpu.launcher import launch

    return launch(_tensor_parallel_attributes, 1, timeout=300)[0]


@pytest.mark.multirank
@pytest.mark.parametrize("gated, bias", GATED_BIAS)
def test_weights_built_without_megatron_init_get_its_tensor_parallel_attributes(tensor_parallel_attributes, gated, bias):
    with_init, without = tensor_parallel_attributes[(gated, bias, True)], tensor_parallel_attributes[(gated, bias, False)]
    assert without == with_init
    assert with_init["decoder.layers.0.mlp.linear_fc1.weight"] == (True, 0, 2 if gated else 1)
    assert with_init["decoder.layers.0.self_attention.linear_proj.weight"] == (True, 1, 1)
    assert with_init["embedding.word_embeddings.weight"] == (True, 0, 1)


@pytest.mark.multirank
def test_learnable_softmax_offset_is_marked_split_over_the_heads(tensor_parallel_attributes):
    """Each tensor-parallel rank holds its heads' offsets (megatron splits them along dim 0 in
    checkpoints but leaves them marked unsplit)."""
    name = "decoder.layers.1.self_attention.core_attention.softmax_offset"
    for initialise in (True, False):
        assert tensor_parallel_attributes[("learnable softmax", initialise)][name] == (True, 0, 1)
