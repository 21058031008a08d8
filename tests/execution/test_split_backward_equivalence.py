"""Split backward (``I`` = input gradient, ``W`` = deferred weight gradients) through the plan executor.

* the deferrable linear (megatron's column- and row-parallel linears, bias, TP=1) gives the
  input and bias gradients in ``I`` and, after ``W``, the weight gradient megatron's own
  linear gives — into ``.grad``, or into ``main_grad`` with gradient-accumulation fusion; inside
  megatron DDP through DDP's own gradient hook (``main_grad``, ``.grad`` cleared, the bucket
  told once, after ``W``); a call whose weight would be the output's only autograd edge is refused;
* BitPipe with every ``B`` split equals single-process training (loss, every gradient,
  weights after 3 Adam steps, replicas identical, evaluation, tied embeddings): with the
  plans of ``schedules.generate(..., split_backward=True)`` (also ordered for a message
  time, the list-scheduled plan), and with a variant derived here
  (:func:`late_split_plan`) that defers every ``W`` to just before its chunk's ``SYNC``
  (long-lived deferred work, ``W``'s long after their ``I``); TP=2 with sequence parallelism;
  and at D=4 with Transformer Engine's deferral contract in the layers (the test double of
  :mod:`tests.execution.te_double` as QKV, projection, fc1, fc2, under megatron DDP's
  ``delay_wgrad_compute``; the LM head stays a local linear): every double's ``backward_dw``
  finds work, none is left;
* layers whose weight gradients cannot be deferred are refused naming the flag.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import List

import pytest
import torch

from megatron_bitpipe.cpu.launcher import launch

from ..equivalence_support import STEPS, Case, assert_equals_reference, pipeline, run_references  # noqa: F401 - run_references: conftest

pytestmark = pytest.mark.strict_p2p


@dataclasses.dataclass(frozen=True)
class SplitCase(Case):
    """``late``: the plan of :func:`late_split_plan` instead of the generator's split plan;
    ``te_double``: the layers' linears are Transformer Engine test doubles."""

    split_backward: bool = True
    late: bool = False
    te_double: bool = False

    def model_kwargs(self) -> dict:
        if not self.te_double:
            return super().model_kwargs()
        from ..equivalence_support import model_config
        from .te_double import te_double_layer_spec

        return dict(super().model_kwargs(), layer_spec=te_double_layer_spec(model_config()))


CASES_2 = [
    SplitCase("split_bitpipe_pp2_n2", "bitpipe", pp=2, n=2),
    SplitCase("split_bitpipe_pp2_n4_late", "bitpipe", pp=2, n=4, late=True),
]
CASES_4 = [
    SplitCase("split_bitpipe_pp4_n4", "bitpipe", pp=4, n=4),
    SplitCase("split_bitpipe_pp4_n8_p2p", "bitpipe", pp=4, n=8, t_p2p=0.2),  # the latency-aware order
    SplitCase("split_bitpipe_pp4_n8_late", "bitpipe", pp=4, n=8, late=True),
    SplitCase("split_bitpipe_pp4_n4_te_double", "bitpipe", pp=4, n=4, te_double=True),
    SplitCase("split_bitpipe_tp2_sp_pp2_n4_late", "bitpipe", pp=2, n=4, tp=2, sequence_parallel=True, late=True),
]
CASES = CASES_2 + CASES_4


def late_split_plan(plan):
    """``plan`` with every ``B(c, m)`` replaced by ``I(c, m)`` and chunk ``c``'s ``W``'s, in
    ``I`` order, just before its ``SYNC``."""
    from megatron_bitpipe.schedules.actions import Action, ActionType

    actions = []
    for rank_actions in plan.actions:
        out, pending = [], defaultdict(list)
        for action in rank_actions:
            if action.type is ActionType.BACKWARD:
                out.append(Action(ActionType.BACKWARD_INPUT, action.chunk, action.microbatch))
                pending[action.chunk].append(Action(ActionType.BACKWARD_WEIGHT, action.chunk, action.microbatch))
            else:
                if action.type is ActionType.SYNC:
                    out.extend(pending.pop(action.chunk, []))
                out.append(action)
        actions.append(tuple(out))
    return dataclasses.replace(plan, actions=tuple(actions))


def run_cases(cases: List[SplitCase]) -> dict:
    from megatron_bitpipe.execution import forward_backward
    from megatron_bitpipe.execution.weight_grad import ChunkWeightGrad, queued_weight_work
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    from .te_double import _DeferringContract

    enable_cpu_megatron()
    plain = forward_backward.PlanCache.plan  # a step function's validated plan of its choice
    chunk_backward_dw, double_backward_dw = ChunkWeightGrad.backward_dw, _DeferringContract.backward_dw
    deferred, double_calls = [], []

    def queued(rollup):
        return sum(queued_weight_work(module) or 0 for _, module in rollup.modules)

    def counted_backward_dw(rollup):
        before = queued(rollup)
        chunk_backward_dw(rollup)
        deferred.append(before - queued(rollup))

    def counted_double(module):
        double_calls.append(not module.wgrad_store.context.empty())
        double_backward_dw(module)

    ChunkWeightGrad.backward_dw = counted_backward_dw
    _DeferringContract.backward_dw = counted_double
    out = {}
    for case in cases:
        served = []
        deferred.clear()
        double_calls.clear()

        def derived(cache, num_ranks, num_microbatches, forward_only, case=case, served=served):
            served.append(cache.choice.split_backward and not forward_only)
            if not (case.late and served[-1]):
                return plain(cache, num_ranks, num_microbatches, forward_only)
            whole = forward_backward.PlanCache(dataclasses.replace(cache.choice, split_backward=False))
            return late_split_plan(plain(whole, num_ranks, num_microbatches, forward_only))

        forward_backward.PlanCache.plan = derived
        out[case.name] = pipeline(case)
        out[case.name]["split_plans_served"] = served
        out[case.name]["deferred_per_W"] = list(deferred)
        out[case.name]["double_calls"] = list(double_calls)
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_split_backward_equals_single_process_training(case, references, launched):
    assert_equals_reference(case, launched[case], references[case.reference_key])


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_training_steps_ran_split_plans(case, launched):
    """Every training step got a split plan, the evaluation a plain forward-only one, and
    every ``W`` (the chunk's ``backward_dw``) ran one queued entry of each deferring linear (4
    per transformer layer of the chunk); with the TE doubles, each of their ``backward_dw``
    calls found work (TE's would return silently on an empty queue)."""
    for result in launched[case]:
        assert result["split_plans_served"] == [True] * STEPS + [False]
        assert result["deferred_per_W"] and min(result["deferred_per_W"]) >= 4
        if case.te_double:
            assert len(result["double_calls"]) >= 4 * len(result["deferred_per_W"]) and all(result["double_calls"])
        else:
            assert result["double_calls"] == []


def test_message_time_case_runs_a_list_scheduled_plan():
    from megatron_bitpipe import schedules
    from megatron_bitpipe.schedules.split_backward import split_backward

    costs = schedules.CostModel(t_p2p=0.2)
    plan = schedules.generate("bitpipe", 4, 8, split_backward=True, costs=costs)
    assert plan.compute_only().actions != split_backward(schedules.generate("bitpipe", 4, 8), costs, 4).actions


def test_late_plans_are_valid_and_defer_weight_gradients_past_later_backwards():
    """The ``late`` variant is a valid plan that runs ``W``'s long after their ``I``."""
    from megatron_bitpipe import schedules

    for case in CASES_2 + CASES_4:
        if not case.late:
            continue
        plan = late_split_plan(schedules.generate(case.schedule, case.pp, case.n))
        schedules.validate_plan(plan)
        for actions in plan.actions:
            names = [str(a) for a in actions]
            assert not any(a.startswith("B") for a in names)
            gaps = [names.index("W" + a[1:]) - i for i, a in enumerate(names) if a.startswith("I")]
            assert len(gaps) == sum(a.startswith("W") for a in names) > 0 and max(gaps) > 2


# -- the deferrable linear, one process ---------------------------------------------------------


def _linear_checks() -> dict:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_bitpipe.model.build import init_megatron_state
    from megatron_bitpipe.execution.weight_grad import SplitBackwardError, enable_split_backward
    from megatron_bitpipe.benchmarking import megatron_baseline as baseline
    from megatron_bitpipe.execution.groups import ParallelGrid
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    pg = baseline.build_looped_process_groups(ParallelGrid())
    init_megatron_state(pg, 7)
    config = baseline.tiny_gpt_config(num_layers=1, hidden_size=8, num_attention_heads=2)

    def make(kind, fusion=False):
        torch.manual_seed(3)
        common = dict(config=config, init_method=torch.nn.init.normal_, bias=True, skip_bias_add=False, tp_group=pg.tp)
        if kind == "column":
            layer = ColumnParallelLinear(8, 12, gather_output=False, **common)
        else:
            layer = RowParallelLinear(8, 12, input_is_parallel=True, **common)
        layer.gradient_accumulation_fusion = fusion
        if fusion:
            layer.weight.main_grad = torch.zeros_like(layer.weight)
        return layer

    torch.manual_seed(5)
    x = torch.randn(4, 2, 8)
    g = torch.randn(4, 2, 12)
    out = {}
    for kind in ("column", "row"):
        for fusion in (False, True):
            name = f"{kind}{'_fused' if fusion else ''}"
            ref, split = make(kind, fusion), make(kind, fusion)
            config.delay_wgrad_compute = False
            assert enable_split_backward([split]) == enable_split_backward([split]) == 1
            record = {"flag_set": split.config.delay_wgrad_compute is True}
            x_ref, x_split = x.clone().requires_grad_(), x.clone().requires_grad_()
            ref(x_ref)[0].backward(g)
            y = split(x_split)[0]
            y.backward(g)
            weight_grad = split.weight.main_grad if fusion else split.weight.grad
            record.update({
                "output": torch.equal(y, ref(x)[0]),
                "input_grad": torch.equal(x_split.grad, x_ref.grad),
                "bias_grad_in_I": torch.equal(split.bias.grad, ref.bias.grad),
                "weight_grad_waits": (weight_grad is None or not weight_grad.any()) and len(split.wgrad_queue) == 1,
            })
            split.backward_dw()
            ref_weight_grad = ref.weight.main_grad if fusion else ref.weight.grad
            weight_grad = split.weight.main_grad if fusion else split.weight.grad
            record["weight_grad_after_W"] = torch.allclose(weight_grad, ref_weight_grad, rtol=1e-6, atol=0)
            record["queue_empty"] = len(split.wgrad_queue) == 0
            try:
                split.backward_dw()
                record["empty_queue_refused"] = False
            except SplitBackwardError:
                record["empty_queue_refused"] = True
            # without delay_wgrad_compute: megatron's own function, weight gradient at once
            config.delay_wgrad_compute = False
            split.zero_grad()
            ref.zero_grad()
            if fusion:
                split.weight.main_grad.zero_()
                ref.weight.main_grad.zero_()
            split(x)[0].backward(g)
            ref(x)[0].backward(g)
            plain = split.weight.main_grad if fusion else split.weight.grad
            record["outside_is_megatron"] = torch.equal(plain, ref.weight.main_grad if fusion else ref.weight.grad)
            record["nothing_queued_outside"] = len(split.wgrad_queue) == 0
            out[name] = record
    return out


class _FakeFusedKernel:
    """Stands in for apex's ``fused_weight_gradient_mlp_cuda``: main_grad += gradᵀ · input."""

    @staticmethod
    def wgrad_gemm_accum_fp32(input_2d, grad_2d, main_grad):
        main_grad.add_(grad_2d.t().matmul(input_2d))

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def _linear_checks_with_fake_fusion() -> dict:
    from megatron.core.tensor_parallel import layers as megatron_layers

    megatron_layers._grad_accum_fusion_available = True
    megatron_layers.fused_weight_gradient_mlp_cuda = _FakeFusedKernel
    return _linear_checks()


def _emulated_layer_checks() -> dict:
    """Two emulated layers (backward 0.2 s, of which weight gradients 0.15 s) on an
    asynchronous emulated device, backward split: the compute each part launched on the device
    and the live activations after ``I`` and after ``W``, gradients against the whole backward."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_bitpipe.benchmarking.emulation import EmulatedDevice, emulated_layer_spec
    from megatron_bitpipe.benchmarking.megatron_baseline import tiny_gpt_config
    from megatron_bitpipe.benchmarking.meters import LiveActivationMeter

    config = tiny_gpt_config(num_layers=2, hidden_size=8, num_attention_heads=2)
    spec = emulated_layer_spec(0.0, 0.2, 0.15)
    layers = [build_module(spec, config=config, layer_number=i + 1) for i in range(2)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.uniform_(-1, 1)
    x = torch.randn(4, 3, 8, requires_grad=True)

    def run():
        hidden = x
        for layer in layers:
            hidden, _ = layer(hidden_states=hidden)
        return (hidden * hidden).sum()

    run().backward()
    whole = [x.grad.clone()] + [layer.weight.grad.clone() for layer in layers]
    x.grad = None
    for layer in layers:
        layer.weight.grad = None
    facts = {}
    config.delay_wgrad_compute = True
    meter = LiveActivationMeter([layer.weight for layer in layers])
    with EmulatedDevice(asynchronous=True) as device, meter:
        loss = run()
        launched = device.launched_seconds
        loss.backward()
        facts["I_s"] = device.launched_seconds - launched
        facts["held_after_I"] = meter.live_layer_bytes
        facts["weight_grads_after_I"] = [layer.weight.grad for layer in layers]
        launched = device.launched_seconds
        for layer in layers:
            layer.backward_dw()
        facts["W_s"] = device.launched_seconds - launched
        facts["held_after_W"] = meter.live_layer_bytes
    split = [x.grad] + [layer.weight.grad for layer in layers]
    facts["grads_equal"] = all(torch.allclose(a, b) for a, b in zip(split, whole))
    facts["x_bytes"] = x.numel() * 4
    return facts


def _ddp_sink_checks() -> dict:
    """A deferring linear inside megatron DDP (``overlap_grad_reduce``, outside ``no_sync``, as
    the last micro-batch of a step): ``W`` hands the gradient to DDP's own hook — ``main_grad``
    equals the unsplit linear's, ``.grad`` is cleared, the bucket counts the parameter ready
    once (after ``W``, not after ``I``) — with and without gradient-accumulation fusion (a
    stand-in kernel)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.tensor_parallel import layers as megatron_layers

    from megatron_bitpipe.benchmarking import megatron_baseline as baseline
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.execution.groups import ParallelGrid
    from megatron_bitpipe.execution.replicas import ChunkDistributedDataParallel
    from megatron_bitpipe.execution.weight_grad import SplitBackwardError, enable_split_backward
    from megatron_bitpipe.model.build import init_megatron_state

    enable_cpu_megatron()
    megatron_layers._grad_accum_fusion_available = True
    megatron_layers.fused_weight_gradient_mlp_cuda = _FakeFusedKernel
    pg = baseline.build_looped_process_groups(ParallelGrid())
    init_megatron_state(pg, 7)
    torch.manual_seed(5)
    x, g = torch.randn(4, 2, 8).cuda().requires_grad_(), torch.randn(4, 2, 12).cuda()  # on the device, as DDP's buffers
    out = {}
    for fusion in (False, True):
        config = baseline.tiny_gpt_config(num_layers=1, hidden_size=8, num_attention_heads=2)
        config.gradient_accumulation_fusion = fusion
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True)

        def wrapped():
            torch.manual_seed(3)
            linear = ColumnParallelLinear(8, 12, config=config, init_method=torch.nn.init.normal_, bias=False,
                                          gather_output=False, tp_group=pg.tp).cuda()  # fmt: skip
            return ChunkDistributedDataParallel(config, ddp_config, linear, disable_bucketing=True, pg_collection=pg)

        ref, split = wrapped(), wrapped()
        enable_split_backward([split])
        ref(x)[0].backward(g)
        weight = split.module.weight
        bucket = split.param_to_bucket_group[weight]
        split(x)[0].backward(g)
        ready_after_i = bucket.per_param_grad_ready_counts.get(weight, 0)
        main_grad_after_i = weight.main_grad.abs().sum().item()
        split.module.backward_dw()
        out["fused" if fusion else "plain"] = {
            "nothing_after_I": ready_after_i == 0 and main_grad_after_i == 0,
            "main_grad_after_W": torch.allclose(weight.main_grad, ref.module.weight.main_grad, rtol=1e-6, atol=0),
            "grad_cleared": weight.grad is None,
            "ready_once": bucket.per_param_grad_ready_counts.get(weight) == 1,
        }
    try:  # no bias and an input without gradient: the weight would be the output's only edge
        split(x.detach())
        out["plain"]["lone_weight_refused"] = False
    except SplitBackwardError as error:
        out["plain"]["lone_weight_refused"] = "needs no gradient and has no bias" in str(error)
    return out


def _single_process_checks() -> dict:
    linears = _linear_checks_with_fake_fusion()
    return {"linears": linears, "ddp": _ddp_sink_checks(), "emulated": _emulated_layer_checks()}


@pytest.fixture(scope="module")
def single_process() -> dict:
    return launch(_single_process_checks, 1, timeout=120)[0]


@pytest.mark.multirank
def test_deferrable_linear_matches_megatron(single_process):
    results = single_process["linears"]
    assert set(results) == {"column", "column_fused", "row", "row_fused"}
    for name, checks in results.items():
        assert all(checks.values()), f"{name}: {checks}"


@pytest.mark.multirank
def test_deferred_weight_gradients_go_through_megatron_ddps_hook(single_process):
    results = single_process["ddp"]
    assert set(results) == {"plain", "fused"}
    for name, checks in results.items():
        assert all(checks.values()), f"{name}: {checks}"


@pytest.mark.multirank
def test_emulated_layer_splits_time_and_holds_its_input_until_w(single_process):
    facts = single_process["emulated"]
    assert facts["grads_equal"]
    assert facts["weight_grads_after_I"] == [None, None]
    assert facts["I_s"] == pytest.approx(2 * 0.05)  # input-gradient part of both layers
    assert facts["W_s"] == pytest.approx(2 * 0.15)
    assert facts["held_after_I"] >= facts["x_bytes"] and facts["held_after_W"] == 0


def test_layers_that_cannot_defer_are_refused_naming_the_flag():
    from megatron_bitpipe.optimus.layers import OptimusLinear
    from megatron_bitpipe.execution.weight_grad import SplitBackwardError, enable_split_backward

    optimus = OptimusLinear.__new__(OptimusLinear)
    torch.nn.Module.__init__(optimus)
    with pytest.raises(SplitBackwardError, match="--tensor-parallel-mode"):
        enable_split_backward([torch.nn.Sequential(torch.nn.Linear(2, 2), optimus)])
