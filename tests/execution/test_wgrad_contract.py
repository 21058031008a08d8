"""The weight-gradient deferral contract of the split backward, in one process (no launch).

megatron-core's contract for Transformer Engine (``delay_wgrad_compute``): every deferring
linear queues one entry of weight work per backward (FIFO), ``backward_dw()`` runs the
oldest, megatron-core's ``SelfAttention.backward_dw`` / ``MLP.backward_dw`` roll it up per
layer and :class:`~megatron_bitpipe.execution.weight_grad.ChunkWeightGrad` per chunk. Checked
here on the Transformer Engine test double (:mod:`tests.execution.te_double`) inside megatron-core's
real attention / MLP / layer classes, and through the executor on a one-rank plan:

* FIFO order and count: after ``I`` of micro-batches 0 and 1 the first chunk ``backward_dw``
  gives exactly micro-batch 0's weight gradients, the second adds micro-batch 1's; every
  module is reached once per call; gradients equal the non-deferred backward's (fp32);
* errors: ``backward_dw`` with nothing queued, a ``W`` out of the ``I`` order, and weight work
  left at the end of a step (it would be dropped) raise, naming the module or action;
* refusals: a TE-contract linear of a transformer layer built without
  ``delay_wgrad_compute`` (one outside the layers, as the LM head, is accepted undeferred),
  and TE's deferred weights under a megatron DDP without ``delay_wgrad_compute``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_bitpipe.execution.weight_grad import (
    ChunkWeightGrad,
    SplitBackwardError,
    WeightGradQueue,
    enable_split_backward,
)

from .te_double import PlainDoubleLinear

H = 4


def test_queue_runs_oldest_first_once_and_refuses_when_empty():
    queue, ran = WeightGradQueue("decoder.layers.0.mlp.linear_fc1"), []
    weight = torch.nn.Parameter(torch.zeros(1))
    for microbatch in range(3):
        queue.push(weight, lambda m=microbatch: ran.append(m))
    assert len(queue) == 3 and list(queue.parameters()) == [weight] * 3
    queue.backward_dw()
    queue.backward_dw()
    assert ran == [0, 1] and len(queue) == 1
    queue.backward_dw()
    with pytest.raises(SplitBackwardError, match=r"backward_dw\(\) on decoder.layers.0.mlp.linear_fc1: no deferred"):
        queue.backward_dw()
    assert ran == [0, 1, 2]


def _layer(config, generator):
    """A megatron-core ``TransformerLayer`` holding a real ``SelfAttention`` and ``MLP`` (their
    ``backward_dw`` roll-ups) around four double linears; built without process groups."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    def bare(cls):
        module = cls.__new__(cls)
        torch.nn.Module.__init__(module)
        return module

    layer, attention, mlp = bare(TransformerLayer), bare(SelfAttention), bare(MLP)
    attention.linear_qkv = PlainDoubleLinear(config, H, 3 * H, generator)
    attention.linear_proj = PlainDoubleLinear(config, H, H, generator)
    mlp.linear_fc1 = PlainDoubleLinear(config, H, 2 * H, generator)
    mlp.linear_fc2 = PlainDoubleLinear(config, 2 * H, H, generator)
    layer.self_attention, layer.mlp = attention, mlp
    return layer


class _Chunk(torch.nn.Module):
    """Two layers and a head outside them (as the LM head); ``forward`` returns a scalar loss."""

    def __init__(self, delay: bool):
        super().__init__()
        config = SimpleNamespace(delay_wgrad_compute=delay)
        generator = torch.Generator().manual_seed(11)
        self.layers = torch.nn.ModuleList(_layer(config, generator) for _ in range(2))
        self.head = PlainDoubleLinear(config, H, 3, generator)
        self.input_tensor = None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor

    def forward(self, x):
        for layer in self.layers:
            attention, mlp = layer.self_attention, layer.mlp
            qkv = attention.linear_qkv(x)[0]
            x = x + attention.linear_proj(torch.tanh(qkv[..., :H] * qkv[..., H:2 * H] + qkv[..., 2 * H:]))[0]
            x = x + mlp.linear_fc2(torch.tanh(mlp.linear_fc1(x)[0]))[0]
        return (self.head(x)[0] ** 2).mean()


def _inputs():
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(3, 2, H, generator=generator) for _ in range(2)]


def _weights(chunk):
    return {n: p for n, p in chunk.named_parameters() if n.endswith("weight")}


def test_chunk_backward_dw_runs_one_microbatch_per_call_in_fifo_order():
    x0, x1 = _inputs()
    whole = _Chunk(delay=False)
    whole(x0).backward()
    after_first = {n: p.grad.clone() for n, p in _weights(whole).items()}
    whole(x1).backward()
    after_both = {n: p.grad.clone() for n, p in _weights(whole).items()}

    split = _Chunk(delay=True)
    assert enable_split_backward([split]) == 9  # 4 per layer + the head, TE-contract modules used as built
    rollup = ChunkWeightGrad(split)
    assert [name for name, _ in rollup.units] == ["layers.0.self_attention", "layers.0.mlp",
                                                  "layers.1.self_attention", "layers.1.mlp", "head"]
    split(x0).backward()  # I of micro-batch 0
    split(x1).backward()  # I of micro-batch 1
    assert all(p.grad is None for p in _weights(split).values())
    assert sorted(rollup.pending()) == sorted((name, 2) for name, _ in rollup.modules) and rollup.defers
    rollup.backward_dw()  # W of micro-batch 0: exactly its gradients
    for name, param in _weights(split).items():
        torch.testing.assert_close(param.grad, after_first[name], rtol=1e-6, atol=0)
    assert {count for _, count in rollup.pending()} == {1}  # each module reached once
    rollup.backward_dw()  # W of micro-batch 1
    for name, param in _weights(split).items():
        torch.testing.assert_close(param.grad, after_both[name], rtol=1e-6, atol=0)
    assert rollup.pending() == []
    with pytest.raises(SplitBackwardError, match="no deferred weight-gradient work queued in layers.0.self_attention.linear_qkv"):
        rollup.backward_dw()  # TE's own backward_dw would return silently: the roll-up refuses


def test_refuses_te_layers_built_without_the_flag_or_under_ddp_without_it():
    generator = torch.Generator().manual_seed(0)
    built_without = _Chunk(delay=False)
    with pytest.raises(SplitBackwardError, match="layers.0.self_attention.linear_qkv .* only when built with delay_wgrad_compute"):
        enable_split_backward([built_without])
    # outside the layers (an LM head that does not defer): its weight gradient stays in I
    head_only = torch.nn.Sequential(PlainDoubleLinear(SimpleNamespace(delay_wgrad_compute=False), 2, 2, generator))
    assert enable_split_backward([head_only]) == 0 and not ChunkWeightGrad(head_only).defers
    chunk = torch.nn.Sequential(PlainDoubleLinear(SimpleNamespace(delay_wgrad_compute=True), 2, 2, generator))
    chunk.ddp_config = SimpleNamespace(delay_wgrad_compute=False)
    with pytest.raises(SplitBackwardError, match=r"DistributedDataParallelConfig\(delay_wgrad_compute=True\)"):
        enable_split_backward([chunk])


# -- through the executor, one rank -------------------------------------------------------------


def _execute(actions: str, chunk: torch.nn.Module):
    """Run ``actions`` (one rank, one chunk, 2 micro-batches of :func:`_inputs`) on ``chunk``."""
    from megatron.core.transformer import TransformerConfig

    from megatron_bitpipe.execution.executor import MicrobatchSource, PlanExecutor
    from megatron_bitpipe.schedules.actions import Action, make_plan
    from megatron_bitpipe.schedules.placement import looped

    config = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=1, pipeline_dtype=torch.float32)
    plan = make_plan("manual", looped(1), 2, [0], [[Action.parse(a) for a in actions.split()]])
    groups = SimpleNamespace(pp_rank=0, rank_pgs=SimpleNamespace(cp=SimpleNamespace(size=lambda: 1)))

    def forward_step_func(data_iterator, model):
        loss = model(next(data_iterator))
        return loss, lambda output: (output, {"loss": output.detach()})

    executor = PlanExecutor(plan, [chunk], groups, config, (3, 2, H), forward_step_func=forward_step_func,
                            source=MicrobatchSource(iter(_inputs()), 2), loss_divisor=1, eager_sync=False)
    return executor.run()


def test_executor_w_calls_the_chunk_backward_dw_in_i_order():
    whole = _Chunk(delay=False)
    _execute("F0.0 F0.1 B0.0 B0.1 S0", whole)
    split = _Chunk(delay=True)
    enable_split_backward([split])
    calls = []
    for _, module in ChunkWeightGrad(split).modules:
        original = module.backward_dw
        module.backward_dw = lambda original=original, module=module: (calls.append(module), original())[1]
    result = _execute("F0.0 F0.1 I0.0 I0.1 W0.0 W0.1 S0", split)
    assert result.trace == ["F0.0", "F0.1", "I0.0", "I0.1", "W0.0", "W0.1", "S0"]
    assert len(calls) == 2 * 9 and len(set(map(id, calls))) == 9  # every module once per W
    for name, param in _weights(split).items():
        torch.testing.assert_close(param.grad, _weights(whole)[name].grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "actions,message",
    [
        ("F0.0 F0.1 I0.0 I0.1 W0.1 W0.0 S0", r"plan runs W0.1 but chunk 0's weight-gradient FIFO holds micro-batches \[0, 1\]"),
        ("F0.0 W0.0 F0.1 I0.0 I0.1 S0", r"plan runs W0.0 but chunk 0's weight-gradient FIFO holds micro-batches \[\]"),
        ("F0.0 F0.1 I0.0 I0.1 W0.0 S0", r"plan runs S0 before W0.1, whose deferred weight gradients add to chunk 0's"),
        ("F0.0 F0.1 I0.0 I0.1 W0.0", r"W due by chunk \{0: \[1\]\}, weight-gradient work queued by chunk \{0: \[\('layers.0"),
    ],
)
def test_executor_refuses_w_out_of_order_and_work_left_at_the_end(actions, message):
    split = _Chunk(delay=True)
    enable_split_backward([split])
    with pytest.raises(RuntimeError, match=message):
        _execute(actions, split)
