"""fp16 with dynamic loss scaling: the plan schedules skip the steps Megatron's own schedule skips.

The reference is megatron-core's ``forward_backward_no_pipelining`` on one process (the loss
scaled by megatron's ``grad_scale_func`` and divided by the number of micro-batches, fp16
weights, megatron's mixed-precision Adam with its dynamic grad scaler). BitPipe, ZB-V and
DualPipeV at pipeline 2 train the same fp16 model from the same weights on the same batches,
with fp16 gradient buffers and with ``grad_reduce_in_fp32`` (``--accumulate-allreduce-grads-in-fp32``),
BitPipe also with its per-chunk distributed optimizers. The initial loss scale is far too
large, so the first steps overflow in fp16 and are skipped while the scale halves.

Asserted per step: the same steps skipped, the same loss scale in every chunk's optimizer (one
scale for the whole model), the micro-batch losses equal — bit for bit up to the first applied
update (the forward in fp16 is the same arithmetic in any layout), afterwards to ``LOSS_RTOL``:
the gradients are summed in another order (two pipelines' halves, then the all-reduce), which
in fp16 buffers rounds differently from one running sum.

One launch per world size serves all cases (``tests/conftest.py``: ``references`` on one
rank, ``launched`` on two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import pytest
import torch

from ..equivalence_support import ADAM_EPS, LR, MICRO_BATCH, SEED, SEQ, VOCAB, gpt_batches, model_config

pytestmark = [pytest.mark.strict_p2p]

STEPS = 5
MICROBATCHES = 4
#: above what the tiny GPT's fp16 backward holds: the first steps overflow (twice at 2**20,
#: megatron's hysteresis of 2; with fp16 gradient buffers once more at 2**19, where fp32
#: buffers hold the sum), the others train
INITIAL_LOSS_SCALE = 2.0**20
#: relative difference of the losses once updates applied (fp16 gradient sums in another order)
LOSS_RTOL = 2e-4


@dataclass(frozen=True)
class Fp16Case:
    name: str
    schedule: str  # "megatron": megatron-core's forward_backward_no_pipelining on one rank
    pp: int
    grad_reduce_in_fp32: bool
    distributed_optimizer: bool = False

    @property
    def world_size(self) -> int:
        return self.pp

    @property
    def reference_key(self) -> bool:
        """The reference with the same gradient-buffer precision."""
        return self.grad_reduce_in_fp32


CASES = [
    Fp16Case(f"{schedule}_pp2_{'fp32' if fp32 else 'fp16'}_grads", schedule, 2, fp32)
    for schedule in ("bitpipe", "zbv", "dualpipev")
    for fp32 in (False, True)
] + [Fp16Case("bitpipe_pp2_fp16_grads_distopt", "bitpipe", 2, False, distributed_optimizer=True)]


def fp16_training(case: Fp16Case) -> dict:
    """Train ``case`` for STEPS steps on this rank; per step the loss scale the backward used,
    every chunk optimizer's loss scale after the step, whether it was applied, the losses."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.pipeline_parallel import schedules as megatron_schedules

    from megatron_bitpipe import schedules
    from megatron_bitpipe.benchmarking.megatron_baseline import mean_loss_forward_step
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.execution.forward_backward import make_step_func
    from megatron_bitpipe.execution.groups import ParallelGrid
    from megatron_bitpipe.model.build import build_pipeline_model
    from megatron_bitpipe.optimus.grads import finalize_model_grads_func
    from megatron_bitpipe.schedules.placement import looped
    from megatron_bitpipe.training.optimizer import build_optimizer

    enable_cpu_megatron()
    megatron = case.schedule == "megatron"
    choice = None if megatron else schedules.ScheduleChoice(case.schedule)
    config = model_config(pipeline_model_parallel_size=case.pp, fp16=True, params_dtype=torch.float16, pipeline_dtype=torch.float16)
    model = build_pipeline_model(
        config, ParallelGrid(pp=case.pp), looped(1) if megatron else choice.placement(case.pp),
        vocab_size=VOCAB, max_sequence_length=SEQ, seed=SEED,
        ddp_config=DistributedDataParallelConfig(
            overlap_grad_reduce=not megatron, grad_reduce_in_fp32=case.grad_reduce_in_fp32,
            use_distributed_optimizer=case.distributed_optimizer,
        ),
    )
    optimizer = build_optimizer(
        model,
        OptimizerConfig(
            optimizer="adam", lr=LR, adam_eps=ADAM_EPS, weight_decay=0.01, fp16=True, params_dtype=torch.float16,
            initial_loss_scale=INITIAL_LOSS_SCALE, use_distributed_optimizer=case.distributed_optimizer,
        ),
    )
    model.config.grad_scale_func = optimizer.scale_loss  # as Megatron-LM's training loop sets it
    model.config.finalize_model_grads_func = finalize_model_grads_func(model.groups.mesh)
    step_func = None if megatron else make_step_func(choice)
    out: dict = {"steps": []}
    for step in range(STEPS):
        for chunk in model.chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        scale = float(optimizer.get_loss_scale())
        kwargs = dict(
            forward_step_func=mean_loss_forward_step, data_iterator=iter(gpt_batches(step, MICROBATCHES)), model=model.chunks,
            num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False,
        )
        if megatron:
            reports = megatron_schedules.forward_backward_no_pipelining(**kwargs, pg_collection=model.groups.rank_pgs)
            losses = {m: r["lm loss"].item() for m, r in enumerate(reports)}
        else:
            losses = {m: r["lm loss"].item() for m, r in step_func(**kwargs).losses.items()}
        applied, _, _ = optimizer.step()
        parts = getattr(optimizer, "chained_optimizers", [optimizer])
        out["steps"].append(
            dict(scale=scale, applied=bool(applied), losses=losses, scales_after=[float(p.get_loss_scale()) for p in parts])
        )
    return out


def run_cases(cases: List[Fp16Case]) -> dict:
    return {case.name: fp16_training(case) for case in cases}


def run_references(keys) -> dict:
    """Megatron's own schedule on one process, with fp32 gradient buffers or not (``keys``)."""
    return {key: fp16_training(Fp16Case(f"megatron_fp32_grads_{key}", "megatron", 1, key)) for key in keys}


@pytest.mark.multirank
def test_the_reference_skips_overflowing_steps_then_trains(references):
    """The test is about skipped steps: each reference skips its first two steps (the loss scale
    halves after the second), trains in its last ones, and the fp16 gradient buffers overflow
    where fp32 ones do not (the same skips in both would not tell the precisions apart)."""
    for reference in references.values():
        steps = reference["steps"]
        assert [s["applied"] for s in steps[:2]] == [False, False] and steps[-1]["applied"]
        assert [s["scale"] for s in steps[:3]] == [INITIAL_LOSS_SCALE, INITIAL_LOSS_SCALE, INITIAL_LOSS_SCALE / 2]
    skips = {key: sum(not s["applied"] for s in reference["steps"]) for key, reference in references.items()}
    assert skips[False] > skips[True], skips


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_same_skips_loss_scales_and_losses_as_megatron(case, references, launched):
    reference = references[case.reference_key]["steps"]
    first_update = next(i for i, s in enumerate(reference) if s["applied"])
    for rank, record in enumerate(launched[case]):
        steps = record["steps"]
        assert [s["applied"] for s in steps] == [s["applied"] for s in reference], f"rank {rank}: skipped steps"
        assert [s["scale"] for s in steps] == [s["scale"] for s in reference], f"rank {rank}: loss scale"
        for step, (mine, expected) in enumerate(zip(steps, reference)):
            assert set(mine["scales_after"]) == {expected["scales_after"][0]}, f"rank {rank} step {step}: one loss scale"
    for step, expected in enumerate(reference):
        losses = {}
        for record in launched[case]:
            losses.update(record["steps"][step]["losses"])
        assert sorted(losses) == list(range(MICROBATCHES))
        rtol = 0.0 if step <= first_update else LOSS_RTOL
        torch.testing.assert_close(
            torch.tensor([losses[m] for m in range(MICROBATCHES)]), torch.tensor([expected["losses"][m] for m in range(MICROBATCHES)]),
            rtol=rtol, atol=0.0, msg=lambda m: f"step {step}: {m}",
        )


class _Scaler:
    """What megatron's ``prepare_grads`` uses of a grad scaler: ``inv_scale`` and ``update``."""

    inv_scale = torch.ones(1)

    def __init__(self):
        self.updates: List[bool] = []

    def __bool__(self) -> bool:
        return True

    def update(self, found_inf: bool) -> None:
        self.updates.append(found_inf)


class _ChunkOptimizer:
    """A chunk's mixed-precision optimizer as far as its grad scaler goes: megatron's
    ``prepare_grads`` unscales with ``inv_scale``, then updates the scaler with its own
    chunk's (all-reduced) overflow flag and returns it."""

    def __init__(self, overflow: bool):
        self.grad_scaler, self.overflow = _Scaler(), overflow

    def prepare_grads(self) -> bool:
        assert self.grad_scaler.inv_scale is _Scaler.inv_scale
        self.grad_scaler.update(self.overflow)
        return self.overflow


def test_an_overflow_in_one_chunk_updates_every_chunks_scaler():
    """Per-chunk distributed optimizers: an overflow in one chunk's gradients updates every
    chunk's grad scaler as an overflow (one loss scale, every chunk skips)."""
    from megatron_bitpipe.execution.distributed_optimizer import ChunkDistributedOptimizer

    chain = ChunkDistributedOptimizer.__new__(ChunkDistributedOptimizer)
    chain.chained_optimizers = [_ChunkOptimizer(False), _ChunkOptimizer(True), _ChunkOptimizer(False)]
    assert chain.prepare_grads() is True
    assert [part.grad_scaler.updates for part in chain.chained_optimizers] == [[True]] * 3
    chain.chained_optimizers = [_ChunkOptimizer(False), _ChunkOptimizer(False)]
    assert chain.prepare_grads() is False
    assert [part.grad_scaler.updates for part in chain.chained_optimizers] == [[False]] * 2
