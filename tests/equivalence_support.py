"""Rank-side code of the equivalence tests: a single-process reference trainer and
the same training through the plan executor on a pipeline layout.

Both train the same tiny GPT (weights from the seed alone) for STEPS optimizer steps on the
same global batches and record, per step: the loss of every micro-batch, every gradient
(full, unsharded), the grad norm and every weight after the step, then the loss of an
evaluation batch (forward only).
"""

from __future__ import annotations

import gc

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

NUM_LAYERS = 8
HIDDEN = 32
HEADS = 4
VOCAB = 128
SEQ = 16
MICRO_BATCH = 2
SEED = 1234
STEPS = 3
LR = 1e-3
# Adam divides each gradient by its own magnitude (+ eps), so an entry whose gradient is tiny
# turns its rounding error into an O(lr) difference of the update. Layouts with data or tensor
# parallelism sum in another order, so their rounding differs; the worst entry is the key bias,
# whose gradient is mathematically zero (softmax ignores a per-query constant) and is ~1e-12 of
# noise. eps=1e-4 bounds that amplification by lr/eps = 10x the gradient error.
ADAM_EPS = 1e-4
RTOL, ATOL = 1e-5, 1e-6


@dataclass(frozen=True)
class Case:
    """One pipeline run: schedule on ``pp`` pipeline ranks (x tp x dp), ``n`` micro-batches per dp rank.

    The model-specific parts of :func:`pipeline` (chunk builder arguments, forward step,
    data, recorded loss) are methods, so another model's case can subclass this one.
    """

    name: str
    schedule: str
    pp: int
    n: int
    tp: int = 1
    dp: int = 1
    tied: bool = True
    clip_grad: float = 0.0
    overlap_p2p_comm: bool = False
    deallocate_pipeline_outputs: bool = False
    overlap_grad_reduce: bool = True
    sequence_parallel: bool = False
    tensor_parallel_mode: str = "1d"
    split_backward: bool = False
    distributed_optimizer: bool = False
    overlap_param_gather: bool = False  # the distributed optimizer's gather overlapped with the next forward
    swiglu: bool = False  # a gated MLP (--swiglu): linear_fc1 is [gate; up], split with stride 2
    ep: int = 1  # expert-parallel ranks inside the data-parallel ones (a mixture-of-experts case's)
    cp: int = 1  # context-parallel ranks splitting each sequence (needs an SDPA layer spec in model_kwargs)
    t_p2p: float = 0.0  # the message time (in t_F) the plan is ordered for

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def global_microbatches(self) -> int:
        return self.n * self.dp

    @property
    def reference_key(self):
        key = (self.tied, self.global_microbatches, self.clip_grad)
        # Optimus' vocab-parallel cross entropy is exact fp32, megatron's fused one is not.
        optimus = self.tensor_parallel_mode == "optimus2d"
        if self.swiglu:
            return key + (optimus, True)
        return key + (True,) if optimus else key

    def model_kwargs(self) -> dict:
        """Arguments of ``build_pipeline_model`` besides the layout, sizes and seed."""
        return dict(share_embeddings_and_output_weights=self.tied)

    def config_overrides(self) -> dict:
        """Model config fields besides the layout's (activation recompute, ...)."""
        from megatron_bitpipe.training.config import mlp_fields

        return mlp_fields(self.swiglu)

    def forward_step(self, data_iterator, model):
        from megatron_bitpipe.benchmarking.megatron_baseline import mean_loss_forward_step

        return mean_loss_forward_step(data_iterator, model)

    def rank_forward_step(self, groups):
        """The forward step this rank runs: :meth:`forward_step`, or with context parallelism
        the same model's on this rank's part of every sequence."""
        if self.cp == 1:
            return self.forward_step
        from megatron_bitpipe.benchmarking.megatron_baseline import context_parallel_forward_step

        return context_parallel_forward_step(groups.rank_pgs.cp)

    def batches(self, step: Optional[int], count: int) -> list:
        """The global batch of ``step``; ``step=None``: the evaluation batch."""
        return gpt_batches(step, count)

    def recorded_loss(self, report: dict):
        """What is compared per micro-batch: its loss report's value(s)."""
        return report["lm loss"].item()


def gpt_batches(step: Optional[int], count: int) -> list:
    """The ``count`` GPT micro-batches of training step ``step`` (None: the evaluation batch)."""
    from megatron_bitpipe.benchmarking.megatron_baseline import synthetic_microbatches

    seed = SEED + 100 * (STEPS + 7 if step is None else step)
    return synthetic_microbatches(seed, count, MICRO_BATCH, SEQ, VOCAB)


def model_config(**kw):
    """The tiny GPT's fp32 config (NUM_LAYERS, HIDDEN, HEADS); ``kw`` go to ``tiny_gpt_config``."""
    from megatron_bitpipe.benchmarking.megatron_baseline import tiny_gpt_config

    return tiny_gpt_config(num_layers=NUM_LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, **kw)


def _optimizer_config(clip_grad: float, distributed: bool = False):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=LR, adam_eps=ADAM_EPS, weight_decay=0.01, clip_grad=clip_grad, use_distributed_optimizer=distributed
    )


def train_single_process(model, config, pg, clip_grad: float, run, batches, global_microbatches: int) -> dict:
    """STEPS steps of one process training ``model`` (already seed-initialised) with megatron DDP
    and Adam, then an evaluation; the record :func:`assert_equals_reference` compares with.

    ``run(ddp, micro_batch) -> (loss, recorded value)``; ``batches(step, count)`` gives a step's
    micro-batches (``step=None``: the evaluation batch). Each micro-batch's loss is divided by
    ``global_microbatches``, as megatron's schedules do (and a mixture-of-experts model's
    auxiliary losses scaled by its inverse).
    """
    from megatron.core.distributed import finalize_model_grads

    from megatron_bitpipe.benchmarking import megatron_baseline as baseline
    from megatron_bitpipe.testing.weights import collect_full

    if config.num_moe_experts:  # the auxiliary losses' gradients, scaled as megatron's schedules scale them
        from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

        # on the model's device, as megatron's schedules make it (a GPU run cannot scale by a host tensor)
        device = next(model.parameters()).device
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=device) / global_microbatches)
    [ddp] = baseline.wrap_looped_ddp([model], config, pg)
    optimizer = baseline.build_baseline_optimizer([ddp], pg, lr=LR, adam_eps=ADAM_EPS, clip_grad=clip_grad)
    record = {"initial": collect_full(ddp), "steps": []}
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        losses = []
        for batch in batches(step, global_microbatches):
            loss, value = run(ddp, batch)
            (loss / global_microbatches).backward()
            losses.append(value)
        finalize_model_grads([ddp], pg_collection=pg)
        grads = collect_full(ddp, lambda p: p.main_grad)
        success, grad_norm, _ = optimizer.step()
        assert success
        record["steps"].append(dict(losses=losses, grads=grads, grad_norm=grad_norm, weights=collect_full(ddp)))
    with torch.no_grad():
        record["eval"] = [run(ddp, batch)[1] for batch in batches(None, global_microbatches)]
    return record


def _loss(model, tokens, labels, fp32_cross_entropy: bool) -> torch.Tensor:
    """Mean token loss: megatron-core's own (fused 'native' cross entropy, which rounds the
    logits' gradient to bf16), or torch's fp32 cross entropy of the model's logits. The
    micro-batch goes to the model's device."""
    device = next(model.parameters()).device
    tokens, labels = tokens.to(device), labels.to(device)
    position_ids = torch.arange(SEQ, device=device).expand_as(tokens)
    if not fp32_cross_entropy:
        return model(tokens, position_ids, None, labels=labels).float().mean()
    logits = model(tokens, position_ids, None)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def reference(tied: bool, global_microbatches: int, clip_grad: float, fp32_cross_entropy: bool = False, swiglu: bool = False) -> dict:
    """Single-process training of the stock megatron-core GPTModel (``swiglu``: with a gated MLP)."""
    from megatron_bitpipe.training.config import mlp_fields

    return reference_training(tied, global_microbatches, clip_grad, model_config(**mlp_fields(swiglu)), fp32_cross_entropy)


def reference_training(
    tied: bool, global_microbatches: int, clip_grad: float, config, fp32_cross_entropy: bool = False,
    position_embedding_type: str = "learned_absolute",
) -> dict:
    """Single-process training of the stock megatron-core GPTModel of ``config`` (its local layer
    spec; with ``config.num_moe_experts`` megatron's local MoE layer in every layer) with
    ``position_embedding_type`` (megatron's ``learned_absolute`` or ``rope``)."""
    from megatron_bitpipe import megatron_compat
    from megatron_bitpipe.model.build import init_megatron_state
    from megatron_bitpipe.model.experts import moe_gpt_layer_specs
    from megatron_bitpipe.model.init import initialize_from_seed
    from megatron_bitpipe.model_partition import ChunkLayers
    from megatron_bitpipe.benchmarking import megatron_baseline as baseline
    from megatron_bitpipe.execution.groups import ParallelGrid

    pg = baseline.build_looped_process_groups(ParallelGrid())
    init_megatron_state(pg, SEED)
    layer_spec = None
    if config.num_moe_experts:
        megatron_compat.enable_moe_without_transformer_engine()
        layer_spec = moe_gpt_layer_specs(config)[0]
    model = baseline.build_megatron_gpt_model(
        config, pg, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied, layer_spec=layer_spec,
        position_embedding_type=position_embedding_type,
    )
    initialize_from_seed([model], [ChunkLayers(0, NUM_LAYERS, True, True, tied)], SEED)

    def run(ddp, batch):
        loss = _loss(ddp, *batch, fp32_cross_entropy)
        return loss, loss.item()

    return train_single_process(model, config, pg, clip_grad, run, gpt_batches, global_microbatches)


def run_references(keys) -> dict:
    """On one launched rank: the single-process :func:`reference` of every key
    (``Case.reference_key``); the test modules' ``run_references`` (see ``conftest.py``)."""
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    return {key: reference(*key) for key in keys}


def pipeline(case: Case, instrument: Optional[list] = None) -> dict:
    """Train ``case`` through ``make_step_func(ScheduleChoice(case.schedule, case.split_backward))`` on this rank."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_bitpipe import megatron_compat, schedules
    from megatron_bitpipe.model.build import build_pipeline_model
    from megatron_bitpipe.training.optimizer import build_optimizer
    from megatron_bitpipe.execution.forward_backward import make_step_func
    from megatron_bitpipe.execution.groups import ParallelGrid
    from megatron_bitpipe.execution.replicas import max_replica_difference
    from megatron_bitpipe.testing.weights import collect_full, merge_full

    gc.collect()  # the previous case's model, and with it its destroyed groups' gloo threads
    choice = schedules.ScheduleChoice(case.schedule, case.split_backward, schedules.CostModel(t_p2p=case.t_p2p))
    config = model_config(
        tensor_model_parallel_size=case.tp,
        pipeline_model_parallel_size=case.pp,
        overlap_p2p_comm=case.overlap_p2p_comm,
        deallocate_pipeline_outputs=case.deallocate_pipeline_outputs,
        sequence_parallel=case.sequence_parallel,
        context_parallel_size=case.cp,
        **case.config_overrides(),
    )
    if choice.splits_backward:  # as the scripts do: the deferral contract before the model is built
        megatron_compat.enable_delay_wgrad_compute(config)
    model = build_pipeline_model(
        config,
        ParallelGrid(tp=case.tp, dp=case.dp, pp=case.pp, ep=case.ep, cp=case.cp),
        choice.placement(case.pp),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        seed=SEED,
        ddp_config=DistributedDataParallelConfig(
            overlap_grad_reduce=case.overlap_grad_reduce,
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=case.distributed_optimizer,
            overlap_param_gather=case.overlap_param_gather,
            delay_wgrad_compute=choice.splits_backward,
        ),
        **case.model_kwargs(),
        tensor_parallel_mode=case.tensor_parallel_mode,
    )
    groups = model.groups
    optimizer = build_optimizer(model, _optimizer_config(case.clip_grad, case.distributed_optimizer))
    step_func = make_step_func(choice)
    forward_step = case.rank_forward_step(groups)

    def full(tensor_of=lambda p: p) -> Dict[str, torch.Tensor]:
        return merge_full(
            collect_full(c, tensor_of, chunk=s, tp_group=groups.tp) for c, s in zip(model.chunks, model.specs)
        )

    traces: List[List[str]] = []  # the actions each step executed on this rank

    def run(step: Optional[int], forward_only: bool = False) -> Dict[int, float]:
        """This dp rank's block of ``case.batches(step, ...)`` through the schedule; the loss
        reports of this rank by global micro-batch index."""
        first = groups.dp_rank * case.n
        result = step_func(
            forward_step_func=forward_step,
            data_iterator=iter(case.batches(step, case.global_microbatches)[first : first + case.n]),
            model=model.chunks,
            num_microbatches=case.n,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=forward_only,
        )
        traces.append(result.trace)
        return {first + m: case.recorded_loss(r) for m, r in result.losses.items()}

    record = {"initial": full(), "replica_diff": [max_replica_difference(model.chunks, groups)], "steps": []}
    restore = _instrument(model.chunks, instrument) if instrument is not None else None
    overlap = case.overlap_param_gather
    if overlap:
        record["parameter_uses"] = _count_parameter_uses(model.chunks)

    def after_step(entry: dict) -> None:
        entry["weights"] = full()
        record["replica_diff"].append(max_replica_difference(model.chunks, groups))

    # Overlapped gathers: the weights after a step are read once the next forward has waited
    # for the gathers (reading them earlier would wait here, and the forwards would wait for nothing).
    completed_by_next_forward = None
    for step in range(STEPS):
        for chunk in model.chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = run(step)
        if completed_by_next_forward is not None:
            after_step(completed_by_next_forward)
        if restore is not None:
            restore()
            restore = None
        # The distributed optimizer reduce-scatters: each rank holds only its shard's sum
        # (compared with the same layout's, not with the single process).
        grads = full(lambda p: p.main_grad)
        success, grad_norm, _ = optimizer.step()
        assert success
        entry = dict(losses=losses, grads=grads, grad_norm=grad_norm, gathers_in_flight=_gathers_in_flight(model.chunks))
        record["steps"].append(entry)
        if overlap:
            completed_by_next_forward = entry
        else:
            after_step(entry)
    record["eval"] = run(None, forward_only=True)
    if completed_by_next_forward is not None:
        record["gathers_in_flight_after_eval"] = _gathers_in_flight(model.chunks)
        after_step(completed_by_next_forward)
    record["eval_trace"] = traces[-1]
    record["pp_rank"] = groups.pp_rank
    record["optimizers"] = sorted({type(o).__name__ for o in getattr(optimizer, "chained_optimizers", [optimizer])})
    groups.destroy()  # the launch's next case builds its own groups
    return record


def merged_losses(records, key) -> Dict[int, object]:
    """Union over ranks of ``record[key]`` (micro-batch -> loss); ranks holding one must agree."""
    merged: Dict[int, object] = {}
    for record in records:
        for m, value in record[key].items():
            assert m not in merged or merged[m] == value
            merged[m] = value
    return merged


def merged(records, *path) -> Dict[str, torch.Tensor]:
    """Union over ranks of per-parameter tensors; copies held by several ranks must be identical."""
    out: Dict[str, torch.Tensor] = {}
    for record in records:
        value = record
        for key in path:
            value = value[key]
        for name, tensor in value.items():
            if name in out:
                assert torch.equal(out[name], tensor), f"{name} differs between ranks"
            out[name] = tensor
    return out


def assert_tensors_close(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], what: str):
    """Each tensor of ``actual`` equals ``expected``'s entry by entry to ``RTOL`` relative, and to
    an absolute tolerance on the tensor's own scale: ``max(ATOL, RTOL * ||expected||_2)``.

    An fp32 sum's rounding error is bounded by the size of its terms, not of its result, so an
    entry near zero in a tensor of large entries (a tied embedding's gradient one step after
    Adam's update) may differ by more than ``ATOL`` between two summation orders (another
    layout, or another CPU's vector width) while the tensor as a whole agrees to ``RTOL``.
    """
    assert actual.keys() == expected.keys(), what
    for name in expected:
        atol = max(ATOL, RTOL * float(expected[name].double().norm()))
        torch.testing.assert_close(actual[name], expected[name], rtol=RTOL, atol=atol, msg=lambda m: f"{what} {name}: {m}")


def assert_equals_reference(case: Case, records: List[dict], ref: dict) -> None:
    """The :func:`pipeline` records of all ranks of ``case`` equal the single-process ``ref``:
    initial weights; per step every micro-batch's loss once, gradients (not with the
    distributed optimizer, whose ranks each hold one shard of the reduced gradients), weights,
    grad norm; replicas bit-identical throughout; evaluation losses."""
    import pytest

    assert_tensors_close(merged(records, "initial"), ref["initial"], "initial weight")
    for record in records:
        assert record["replica_diff"] == [0.0] * (STEPS + 1), "replicas must stay bit-identical"
    for step in range(STEPS):
        expected = ref["steps"][step]
        losses = merged_losses([r["steps"][step] for r in records], "losses")
        assert sorted(losses) == list(range(case.global_microbatches)), f"step {step}: every micro-batch once"
        torch.testing.assert_close(
            torch.tensor([losses[m] for m in sorted(losses)]), torch.tensor(expected["losses"]), rtol=RTOL, atol=ATOL
        )
        if not case.distributed_optimizer:
            assert_tensors_close(merged(records, "steps", step, "grads"), expected["grads"], f"step {step} gradient of")
        assert_tensors_close(merged(records, "steps", step, "weights"), expected["weights"], f"step {step} weight")
        for record in records:
            assert record["steps"][step]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=RTOL)
    evaluation = merged_losses(records, "eval")
    assert sorted(evaluation) == list(range(case.global_microbatches))
    torch.testing.assert_close(
        torch.tensor([evaluation[m] for m in sorted(evaluation)]), torch.tensor(ref["eval"]), rtol=RTOL, atol=ATOL
    )


def _gathers_in_flight(chunks) -> int:
    """Bucket groups of this rank's chunks whose parameter all-gather is started and not waited for."""
    from megatron_bitpipe import megatron_compat

    return sum(megatron_compat.param_gather_state(chunk).in_flight for chunk in chunks)


def _count_parameter_uses(chunks) -> Dict[str, int]:
    """Count, from a forward pre-hook on every module holding parameters (run after megatron
    DDP's own, registered at its construction), the module calls (``"checked"``) and those
    that found a parameter's all-gather still in flight (``"unwaited"``); a live dict."""
    counts = {"checked": 0, "unwaited": 0}

    def check(ddp):
        def hook(module, *unused):
            counts["checked"] += 1
            groups = [ddp.param_to_bucket_group[p] for p in module.parameters(recurse=False) if p in ddp.param_to_bucket_group]
            counts["unwaited"] += any(group.param_gather_handle is not None for group in groups)

        return hook

    for ddp in chunks:
        for module in ddp.module.modules():
            if next(module.parameters(recurse=False), None) is not None:
                module.register_forward_pre_hook(check(ddp))
    return counts


def _instrument(chunks, events: list):
    """Log, in call order, every executed backward ``("B", chunk, microbatch)`` and every
    gradient-sync start ``("S", chunk, all_reduce_outstanding)``; returns an undo function."""
    from megatron_bitpipe.execution.executor import PlanExecutor

    original_backward = PlanExecutor._backward

    def logged_backward(self, action, *inputs):
        events.append(("B", action.chunk, action.microbatch))
        return original_backward(self, action, *inputs)

    def logged_sync(chunk_id, chunk, start):
        def start_grad_sync(*args):
            start(*args)
            events.append(("S", chunk_id, any(g.grad_reduce_handle is not None for g in chunk.bucket_groups)))

        return start_grad_sync

    PlanExecutor._backward = logged_backward
    originals = [chunk.start_grad_sync for chunk in chunks]
    for chunk_id, chunk in enumerate(chunks):
        chunk.start_grad_sync = logged_sync(chunk_id, chunk, originals[chunk_id])

    def restore():
        PlanExecutor._backward = original_backward
        for chunk, original in zip(chunks, originals):
            chunk.start_grad_sync = original

    return restore


def bf16_losses(case: Case, steps: int = 2) -> dict:
    """Train ``case``'s model with BitPipe on ``case.pp`` ranks in bf16 (chunks wrapped in
    ChunkFloat16Module, mixed-precision optimizer, distributed with ``case.distributed_optimizer``);
    return this rank's recorded losses per step, the dtypes of the reported losses and the
    largest difference between replicas after the last step."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_bitpipe.model.build import build_pipeline_model

    from megatron_bitpipe.training.optimizer import build_optimizer
    from megatron_bitpipe.execution.forward_backward import forward_backward_bitpipe
    from megatron_bitpipe.execution.groups import ParallelGrid
    from megatron_bitpipe.execution.replicas import max_replica_difference
    from megatron_bitpipe.schedules.placement import bidirectional_v

    pp, n = case.pp, case.n
    config = model_config(pipeline_model_parallel_size=pp, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    model = build_pipeline_model(
        config, ParallelGrid(pp=pp), bidirectional_v(pp), vocab_size=VOCAB, max_sequence_length=SEQ, seed=SEED,
        ddp_config=DistributedDataParallelConfig(
            overlap_grad_reduce=True, grad_reduce_in_fp32=True, use_distributed_optimizer=case.distributed_optimizer
        ),
        **case.model_kwargs(),
    )
    config = OptimizerConfig(optimizer="adam", lr=LR, adam_eps=ADAM_EPS, bf16=True, use_distributed_optimizer=case.distributed_optimizer)
    optimizer = build_optimizer(model, config)
    out = {"losses": [], "dtypes": set()}
    for step in range(steps):
        for chunk in model.chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reports = forward_backward_bitpipe(
            forward_step_func=case.forward_step,
            data_iterator=iter(case.batches(step, n)),
            model=model.chunks,
            num_microbatches=n,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
        )
        out["losses"].append([case.recorded_loss(r) for r in reports])
        out["dtypes"] |= {str(value.dtype) for r in reports for value in r.values()}
        success, _, _ = optimizer.step()
        assert success
    out["replica_diff"] = max_replica_difference(model.chunks, model.groups)
    return out
