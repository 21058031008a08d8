"""Rank-side code of the memory check: one training step of a small GPT through the plan
executor, measuring what the simulator's memory model predicts.

Measured on each rank:

* parameters: the bytes of the rank's distinct Parameters (a tied output layer sharing the
  embedding's counted once);
* gradients: the bytes of their gradients (megatron DDP's ``main_grad``);
* optimizer state: the bytes of the optimizer's per-parameter state tensors after the step
  (Adam's moments; its scalar step counters left out);
* peak activations: the largest number of bytes, over the step, held by the live tensors
  autograd saved for a backward (``torch.autograd.graph.saved_tensors_hooks``) and by the
  inputs and output gradients a split backward's deferred weight-gradient work keeps
  (:class:`~megatron_bitpipe.execution.weight_grad.WeightGradQueue`) — each storage counted once,
  whole, while anything holds it; Parameters and gradient buffers left out.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

HIDDEN, HEADS, SEQ, MICRO_BATCH, VOCAB, SEED = 64, 4, 32, 2, 256, 1234


class LiveBytes:
    """Bytes of the storages something holds, each storage once, and their peak."""

    def __init__(self, excluded: set) -> None:
        self.excluded = excluded  # storage data pointers never counted (parameters, gradient buffers)
        self.held: Dict[int, List[int]] = {}  # data pointer -> [holders, bytes]
        self.live = self.peak = 0

    def hold(self, tensor: torch.Tensor) -> Optional[int]:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.excluded or storage.nbytes() == 0:
            return None
        entry = self.held.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return key

    def release(self, key: Optional[int]) -> None:
        if key is None:
            return
        entry = self.held[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.held[key]


class _Saved:
    """A saved tensor as autograd keeps it: released from the count when autograd drops it."""

    __slots__ = ("tensor", "key", "counter")

    def __init__(self, counter: LiveBytes, tensor: torch.Tensor) -> None:
        self.counter, self.tensor, self.key = counter, tensor, counter.hold(tensor)

    def __del__(self) -> None:
        self.counter.release(self.key)


def _count_deferred_work(counter: LiveBytes):
    """Count the tensors each queued weight-gradient closure keeps until it runs; returns an undo."""
    from megatron_bitpipe.execution.weight_grad import WeightGradQueue

    original = WeightGradQueue.push

    def push(self, param, closure):
        cells = dict(zip(closure.__code__.co_freevars, (c.cell_contents for c in closure.__closure__)))
        keys = [counter.hold(cells[name]) for name in ("input", "grad_output")]

        def run() -> None:
            closure()
            for key in keys:
                counter.release(key)

        original(self, param, run)

    WeightGradQueue.push = push
    return lambda: setattr(WeightGradQueue, "push", original)


def measure_step(
    schedule: str, split_backward: bool, pp: int, stage_layers: Tuple[int, ...], num_microbatches: int, tied: bool,
    distributed_optimizer: bool = False,
) -> dict:
    """On this rank: build the GPT of ``stage_layers`` for ``schedule`` on ``pp`` pipeline
    ranks, train one step of ``num_microbatches`` and measure (module docstring)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_bitpipe import megatron_compat, schedules
    from megatron_bitpipe.benchmarking.megatron_baseline import mean_loss_forward_step, synthetic_microbatches, tiny_gpt_config
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.execution.forward_backward import make_step_func
    from megatron_bitpipe.execution.groups import ParallelGrid
    from megatron_bitpipe.model.build import build_pipeline_model
    from megatron_bitpipe.schedules.layer_split import StageLayers
    from megatron_bitpipe.training.optimizer import build_optimizer

    enable_cpu_megatron()
    choice = schedules.ScheduleChoice(schedule, split_backward)
    layers = StageLayers(stage_layers)
    config = tiny_gpt_config(num_layers=layers.num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS, pipeline_model_parallel_size=pp)
    if choice.splits_backward:
        megatron_compat.enable_delay_wgrad_compute(config)
    model = build_pipeline_model(
        config, ParallelGrid(tp=1, dp=1, pp=pp), choice.placement(pp), vocab_size=VOCAB, max_sequence_length=SEQ, seed=SEED,
        share_embeddings_and_output_weights=tied, stage_layers=layers,
        ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True, delay_wgrad_compute=choice.splits_backward,
                                                use_distributed_optimizer=distributed_optimizer),
    )  # fmt: skip
    optimizer = build_optimizer(model, OptimizerConfig(optimizer="adam", lr=1e-3, bf16=False, fp16=False, clip_grad=0.0,
                                                       use_distributed_optimizer=distributed_optimizer))  # fmt: skip
    params = list({id(p): p for chunk in model.chunks for p in chunk.parameters()}.values())
    excluded = {p.untyped_storage().data_ptr() for p in params} | {p.main_grad.untyped_storage().data_ptr() for p in params}
    counter = LiveBytes(excluded)
    undo = _count_deferred_work(counter)
    step = make_step_func(choice)
    batches = synthetic_microbatches(SEED, num_microbatches, MICRO_BATCH, SEQ, VOCAB)
    for chunk in model.chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: _Saved(counter, t), lambda saved: saved.tensor):
            step(forward_step_func=mean_loss_forward_step, data_iterator=iter(batches), model=model.chunks,
                 num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False)  # fmt: skip
    finally:
        undo()
    assert counter.live == 0, f"{counter.live} bytes of saved activations outlived the step"
    assert optimizer.step()[0]
    state = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for values in inner.optimizer.state.values():
            state += sum(v.numel() * v.element_size() for v in values.values() if torch.is_tensor(v) and v.dim() > 0)
    return {
        "pp_rank": model.groups.pp_rank,
        "parameters": sum(p.numel() * p.element_size() for p in params),
        "gradients": sum(p.main_grad.numel() * p.main_grad.element_size() for p in params),
        "optimizer_state": state,
        "activations": counter.peak,
    }
