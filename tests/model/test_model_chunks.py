"""BitPipe chunks, groups, seed initialisation and replicas on CPU ranks (gloo).

One reference launch trains the tiny GPT on one rank (stock megatron-core GPTModel, seed
initialisation, megatron DDP, Adam with clipping) on a global batch of GLOBAL_MICROBATCHES.
One 2-rank and one 4-rank launch build the bidirectional-V (BitPipe) chunks on several
layouts and check their structure, then push the same global batch through them by hand,
without a schedule: each pipeline runs its half of the micro-batches stage by stage
(forward, loss, backward) over the p2p channel groups, with the local hand-over at the turn
of the V, each loss divided by all the rank's micro-batches; then megatron's
``finalize_model_grads`` sums the replicas (averaging over data parallelism) and the
optimizer steps. Loss, gradients, grad norm and weights must equal the reference, and the
two replicas must stay bit-identical.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List

import pytest
import torch

from megatron_bitpipe.model_partition import chunk_specs
from megatron_bitpipe.schedules.placement import bidirectional, bidirectional_v, looped

from ..equivalence_support import ADAM_EPS, ATOL, HIDDEN, LR, MICRO_BATCH, NUM_LAYERS, RTOL, SEQ, VOCAB, model_config

GLOBAL_MICROBATCHES = 4
SEED = 4321
CLIP_GRAD = 0.5  # below the grad norm: the clipping path runs


@dataclass(frozen=True)
class Case:
    name: str
    pp: int
    tp: int = 1
    dp: int = 1
    tied: bool = True

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def reference_key(self) -> bool:
        return self.tied


CASES_2 = [Case("pp2_tied", pp=2)]
CASES_4 = [
    Case("pp4_tied", pp=4),
    Case("pp4_untied", pp=4, tied=False),
    Case("tp2_pp2_tied", pp=2, tp=2),
    Case("dp2_pp2_untied", pp=2, dp=2, tied=False),
]
CASES = CASES_2 + CASES_4


# ---------------------------------------------------------------------------- pure layout


def test_bidirectional_v_chunk_layers_d4():
    """BitPipe's placement at D=4, 8 layers (one per stage): rank 0 holds s1, s4, s8, s5 (Wu et al., 2024)."""
    placement = bidirectional_v(4)
    expected = {  # rank -> (pipeline, stage) per chunk
        0: [(0, 0), (1, 3), (0, 7), (1, 4)],
        1: [(0, 1), (1, 2), (0, 6), (1, 5)],
        2: [(0, 2), (1, 1), (0, 5), (1, 6)],
        3: [(0, 3), (1, 0), (0, 4), (1, 7)],
    }
    for rank, roles in expected.items():
        specs = chunk_specs(placement, 16, rank)
        assert [(s.pipeline, s.stage) for s in specs] == roles
        assert [list(s.layers) for s in specs] == [[2 * st, 2 * st + 1] for _, st in roles]
        assert [s.pre_process for s in specs] == [st == 0 for _, st in roles]
        assert [s.post_process for s in specs] == [st == 7 for _, st in roles]


def test_bidirectional_v_chunk_layers_d2():
    specs = [chunk_specs(bidirectional_v(2), 8, rank) for rank in range(2)]
    assert [[(s.pipeline, s.first_layer) for s in rank] for rank in specs] == [
        [(0, 0), (1, 2), (0, 6), (1, 4)],
        [(0, 2), (1, 0), (0, 4), (1, 6)],
    ]
    # Embedding and head of one replica on one rank: A on rank 0, B on rank 1.
    assert [(s.pipeline, s.pre_process, s.post_process) for s in specs[0] if s.pre_process or s.post_process] == [
        (0, True, False),
        (0, False, True),
    ]
    assert {s.pipeline for s in specs[1] if s.pre_process or s.post_process} == {1}


def test_tied_head_copies_only_where_megatron_ties_across_ranks():
    """Looped placements over several ranks tie megatron's way (a head copy of the embedding);
    V placements and a single rank tie one Parameter."""

    assert looped(4).head_copies_embedding and looped(2, 2).head_copies_embedding
    assert not any(p.head_copies_embedding for p in (looped(1), bidirectional_v(4), bidirectional(4)))
    interleaved = [chunk_specs(looped(2, 2), 8, rank, tied=True) for rank in range(2)]
    assert [[s.tied for s in rank] for rank in interleaved] == [[False, False], [False, True]]
    assert not any(s.tied for rank in range(4) for s in chunk_specs(bidirectional_v(4), 8, rank, tied=True))


def test_num_layers_must_divide_into_stages():
    with pytest.raises(ValueError, match=r"--num-layers 12 must be divisible by 2 x --pipeline-model-parallel-size = 16"):
        chunk_specs(bidirectional_v(8), 12, 0)


def test_microbatches_per_replica():
    from megatron_bitpipe.execution.replicas import microbatches_per_replica

    assert microbatches_per_replica(8, bidirectional_v(4)) == 4
    assert microbatches_per_replica(3, looped(4)) == 3
    for bad in (1, 3):
        with pytest.raises(ValueError, match="--global-batch-size"):
            microbatches_per_replica(bad, bidirectional_v(2))


def test_init_rules_cover_transformer_engine_names():
    """The Transformer Engine spec fuses norms into linears (untestable here without TE)."""
    from megatron.core.transformer import TransformerConfig

    from megatron_bitpipe.model.init import init_method_for

    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2)
    layer = "decoder.layers.1."
    rules = {
        layer + "self_attention.linear_qkv.layer_norm_weight": torch.nn.init.ones_,
        layer + "self_attention.linear_qkv.layer_norm_bias": torch.nn.init.zeros_,
        layer + "mlp.linear_fc1.layer_norm_weight": torch.nn.init.ones_,
        layer + "self_attention.q_layernorm.weight": torch.nn.init.ones_,
        layer + "self_attention.linear_qkv.weight": config.init_method,
        layer + "self_attention.linear_proj.weight": config.output_layer_init_method,
        layer + "mlp.linear_fc2.weight": config.output_layer_init_method,
        layer + "mlp.router.weight": config.init_method,
        "embedding.word_embeddings.weight": config.embedding_init_method,
        "output_layer.weight": config.init_method,
    }
    for name, rule in rules.items():
        assert init_method_for(name, config) is rule, name
    with pytest.raises(KeyError, match="no initialisation rule"):
        init_method_for(layer + "mlp.experts.weight1", config)


# ---------------------------------------------------------------------------- launched ranks


def _batches(case_dp: int, dp_rank: int):
    from megatron_bitpipe.benchmarking import megatron_baseline as baseline

    batches = baseline.synthetic_microbatches(SEED, GLOBAL_MICROBATCHES, MICRO_BATCH, SEQ, VOCAB)
    per_dp = GLOBAL_MICROBATCHES // case_dp
    first = dp_rank * per_dp
    return list(enumerate(batches))[first : first + per_dp]


def _init_stats(model) -> Dict[str, tuple]:
    """Per parameter: constant value if it is constant, else None, and the standard deviation."""
    stats = {}
    for name, param in model.named_parameters():
        flat = param.detach().flatten()
        constant = flat[0].item() if bool((flat == flat[0]).all()) else None
        stats[name] = (constant, flat.std().item())
    return stats


def _reference(tied: bool) -> dict:
    """Single process, stock GPTModel: initial weights, losses, grads, grad norm, weights.

    Also the parameter statistics of megatron's own initialisation and of the seed's
    (``native_stats``, ``seed_stats``), to check the seed follows megatron's conventions.
    """
    from megatron.core.distributed import finalize_model_grads

    from megatron_bitpipe.model.init import initialize_from_seed
    from megatron_bitpipe.model_partition import ChunkLayers
    from megatron_bitpipe.benchmarking import megatron_baseline as baseline
    from megatron_bitpipe.execution.groups import ParallelGrid
    from megatron_bitpipe.model.build import init_megatron_state
    from megatron_bitpipe.testing.weights import collect_full

    pg = baseline.build_looped_process_groups(ParallelGrid())
    init_megatron_state(pg, SEED)
    config = model_config()
    model = baseline.build_megatron_gpt_model(
        config, pg, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied
    )
    native_stats = _init_stats(model)
    initialize_from_seed([model], [ChunkLayers(0, NUM_LAYERS, True, True, tied)], SEED)
    seed_stats = _init_stats(model)
    initial = collect_full(model)
    [ddp] = baseline.wrap_looped_ddp([model], config, pg)
    optimizer = baseline.build_baseline_optimizer([ddp], pg, lr=LR, adam_eps=ADAM_EPS, clip_grad=CLIP_GRAD)
    losses = {}
    batches = _batches(1, 0)
    for index, (tokens, labels) in batches:
        position_ids = torch.arange(SEQ).expand_as(tokens)
        loss = ddp(tokens, position_ids, None, labels=labels).float().mean()
        (loss / len(batches)).backward()
        losses[index] = loss.item()
    finalize_model_grads([ddp], pg_collection=pg)
    grads = collect_full(ddp, lambda p: p.main_grad)
    success, grad_norm, _ = optimizer.step()
    assert success
    return dict(
        initial=initial,
        native_stats=native_stats,
        seed_stats=seed_stats,
        losses=losses,
        grads=grads,
        grad_norm=grad_norm,
        weights=collect_full(ddp),
    )


def _run_pipeline(chunks, groups, pipeline: int, batches, divisor: int) -> Dict[int, float]:
    """Forward and backward ``batches`` through ``pipeline``'s stages, one micro-batch at a time.

    Every rank walks all stages in order and acts where it is the sender, receiver or holder;
    cross-rank hand-overs use the channel groups, the V-turn is a local hand-over.
    """
    import torch.distributed as dist

    from megatron.core.utils import unwrap_model
    from megatron_bitpipe.schedules.comm import Payload, Transfer

    stages = groups.placement.stages[pipeline]
    last = len(stages) - 1
    me = groups.pp_rank
    losses = {}

    def hand_over(payload, microbatch, src, dst, value):
        """``value`` on the holder of ``src`` becomes the return value on the holder of ``dst``."""
        transfer = Transfer(payload, pipeline, microbatch, src, dst)
        if transfer.is_local:
            return value.detach() if dst.rank == me else None
        group = groups.channel_group(transfer)
        if src.rank == me:
            dist.send(value.detach().contiguous(), groups.pp_global_rank(dst.rank), group=group)
        if dst.rank == me:
            received = torch.empty(SEQ, MICRO_BATCH, HIDDEN)
            dist.recv(received, groups.pp_global_rank(src.rank), group=group)
            return received
        return None

    for microbatch, (tokens, labels) in batches:
        position_ids = torch.arange(SEQ).expand_as(tokens)
        inputs, outputs, received = {}, {}, None
        for s, loc in enumerate(stages):
            if s > 0:
                received = hand_over(Payload.ACTIVATION, microbatch, stages[s - 1], loc, outputs.get(s - 1))
            if loc.rank != me:
                continue
            chunk = chunks[loc.chunk]
            if s > 0:
                inputs[s] = received.requires_grad_()
                unwrap_model(chunk).set_input_tensor(inputs[s])
            output = chunk(tokens, position_ids, None, labels=labels)
            if s == last:
                loss = output.float().mean()
                losses[microbatch] = loss.item()
                output = loss / divisor
            outputs[s] = output
        grad = None
        for s in range(last, -1, -1):
            loc = stages[s]
            if s < last:
                grad = hand_over(Payload.GRADIENT, microbatch, stages[s + 1], loc, outputs.get(s + 1))
            if loc.rank == me:
                torch.autograd.backward(outputs[s], grad_tensors=None if s == last else grad)
                # Input gradient, handed to the previous stage's holder (None on stage 0).
                outputs[s] = inputs[s].grad if s > 0 else None
    return losses


def _channel_facts(groups) -> dict:
    import torch.distributed as dist

    channels = groups.channels
    return {
        "keys": sorted((p.value, pipe, d, parity) for p, pipe, d, parity in channels),
        "distinct": len({id(g) for g in channels.values()}),
        "members": {tuple(dist.get_process_group_ranks(g)) for g in channels.values()},
        "stage_members": {s: tuple(dist.get_process_group_ranks(g)) for s, g in groups.stage_groups.items()},
        "distinct_stage_groups": len({id(g) for g in groups.stage_groups.values()}),
    }


def _bitpipe(case: Case) -> dict:
    """Build, check and train one step of ``case`` on this rank; see the module docstring."""
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

    from megatron_bitpipe.execution.groups import ParallelGrid, PipelineGroups
    from megatron_bitpipe.model.init import initialize_from_seed
    from megatron_bitpipe.model.chunks import build_gpt_chunks
    from megatron_bitpipe.execution.replicas import (
        mark_replica_parameters,
        max_replica_difference,
        microbatches_per_replica,
        stage_order,
        wrap_ddp,
    )
    from megatron_bitpipe.benchmarking import megatron_baseline as baseline
    from megatron_bitpipe.model.build import init_megatron_state
    from megatron_bitpipe.testing.weights import collect_full, merge_full

    grid = ParallelGrid(tp=case.tp, dp=case.dp, pp=case.pp)
    groups = PipelineGroups.build(grid, bidirectional_v(case.pp))
    init_megatron_state(groups.rank_pgs, SEED)
    config = model_config(
        tensor_model_parallel_size=case.tp,
        pipeline_model_parallel_size=case.pp,
    )
    chunks = build_gpt_chunks(
        config, groups, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=case.tied
    )
    specs = chunk_specs(groups.placement, NUM_LAYERS, groups.pp_rank)
    record = {
        "pp_rank": groups.pp_rank,
        "specs": specs,
        "layer_numbers": [[layer.layer_number for layer in c.decoder.layers] for c in chunks],
        "flags": [(c.pre_process, c.post_process) for c in chunks],
        "channels": _channel_facts(groups),
        "tied": [],
    }
    by_pipeline = {s.pipeline: c for c, s in zip(chunks, specs) if s.pre_process}
    for chunk, spec in zip(chunks, specs):
        if spec.post_process:
            record["tied"].append(
                {
                    "is_embedding": chunk.output_layer.weight
                    is by_pipeline[spec.pipeline].embedding.word_embeddings.weight,
                    "registered": "output_layer.weight" in dict(chunk.named_parameters()),
                    "in_state_dict": "output_layer.weight" in chunk.state_dict(),
                }
            )

    initialize_from_seed(chunks, specs, SEED, groups.tp)
    record["initial"] = merge_full(collect_full(c, chunk=s, tp_group=groups.tp) for c, s in zip(chunks, specs))
    record["replica_diff_initial"] = max_replica_difference(chunks, groups)

    model = wrap_ddp(chunks, groups, config, DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    mark_replica_parameters(model, specs)
    optimizer = baseline.build_baseline_optimizer(model, groups.rank_pgs, lr=LR, adam_eps=ADAM_EPS, clip_grad=CLIP_GRAD)

    mine = _batches(case.dp, groups.dp_rank)
    per_pipeline = microbatches_per_replica(len(mine), groups.placement)
    losses = {}
    for pipeline in range(groups.placement.num_pipelines):
        batches = mine[pipeline * per_pipeline : (pipeline + 1) * per_pipeline]
        # megatron's divisor: every micro-batch of this data-parallel rank (DDP sums the replicas)
        losses.update(_run_pipeline(model, groups, pipeline, batches, len(mine)))
    finalize_model_grads([model[c] for c in stage_order(groups)], pg_collection=groups.rank_pgs)
    record["losses"] = losses
    record["grads"] = merge_full(
        collect_full(c, lambda p: p.main_grad, chunk=s, tp_group=groups.tp) for c, s in zip(model, specs)
    )
    success, grad_norm, _ = optimizer.step()
    assert success
    record["grad_norm"] = grad_norm
    record["weights"] = merge_full(collect_full(c, chunk=s, tp_group=groups.tp) for c, s in zip(model, specs))
    record["replica_diff_after_step"] = max_replica_difference(model, groups)
    return record


def _p2p_order(shared: bool) -> list:
    """Rank 0 sends three messages on two streams to rank 1, rank 1 sends one back (D = 2).

    Rank 1 posts its receives in another order than rank 0's sends. With one group per
    (payload, pipeline, direction) every message lands in the right buffer; with one shared
    group (``shared``) gloo matches by posting order and mixes the streams up.
    """
    import torch.distributed as dist

    from megatron_bitpipe.execution.groups import ParallelGrid, PipelineGroups
    from megatron_bitpipe.schedules.comm import Payload, Transfer
    from megatron_bitpipe.schedules.placement import StageLocation

    groups = PipelineGroups.build(ParallelGrid(pp=2), bidirectional_v(2))
    a, b = StageLocation(0, 0), StageLocation(1, 0)
    act_down = Transfer(Payload.ACTIVATION, 0, 0, a, b)
    grad_down = Transfer(Payload.GRADIENT, 1, 0, a, b)
    act_up = Transfer(Payload.ACTIVATION, 0, 0, b, a)
    group = (lambda t: groups.pp) if shared else groups.channel_group
    peer = groups.pp_global_rank(1 - groups.pp_rank)
    if groups.pp_rank == 0:
        works = [
            dist.isend(torch.tensor([1.0]), peer, group=group(act_down)),
            dist.isend(torch.tensor([2.0]), peer, group=group(grad_down)),
            dist.isend(torch.tensor([3.0]), peer, group=group(act_down)),
        ]
        back = torch.zeros(1)
        works.append(dist.irecv(back, peer, group=group(act_up)))
        for work in works:
            work.wait()
        return [back.item()]
    grad, act1, act2 = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    works = [
        dist.isend(torch.tensor([4.0]), peer, group=group(act_up)),
        dist.irecv(grad, peer, group=group(grad_down)),
        dist.irecv(act1, peer, group=group(act_down)),
        dist.irecv(act2, peer, group=group(act_down)),
    ]
    for work in works:
        work.wait()
    return [grad.item(), act1.item(), act2.item()]


def _looped_specs_match_megatron() -> bool:
    """chunk_specs of the looped placement agree with megatron's own offsets."""
    from megatron_bitpipe.benchmarking import megatron_baseline as baseline
    from megatron_bitpipe.testing.weights import looped_chunk_layers

    for pp, vp in ((2, None), (4, 2), (2, 4)):
        config = baseline.tiny_gpt_config(
            num_layers=16, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp
        )
        for rank in range(pp):
            specs = chunk_specs(looped(pp, vp or 1), 16, rank)
            for v, spec in enumerate(specs):
                theirs = looped_chunk_layers(config, rank, v if vp else None)
                if (spec.first_layer, spec.num_layers, spec.pre_process, spec.post_process) != (
                    theirs.first_layer,
                    theirs.num_layers,
                    theirs.pre_process,
                    theirs.post_process,
                ):
                    return False
    return True


def _errors() -> List[str]:
    """Messages of the configuration errors the builders raise."""
    from megatron_bitpipe.execution.groups import ParallelGrid, PipelineGroups
    from megatron_bitpipe.model.chunks import build_gpt_chunks
    from megatron_bitpipe.benchmarking import megatron_baseline as baseline

    messages = []
    chimera = PipelineGroups.build(ParallelGrid(pp=2), bidirectional(2))
    config = baseline.tiny_gpt_config(num_layers=4, pipeline_model_parallel_size=2)
    attempts = [
        lambda: build_gpt_chunks(
            config, chimera, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=True
        ),
        lambda: build_gpt_chunks(
            baseline.tiny_gpt_config(num_layers=6, pipeline_model_parallel_size=2),
            PipelineGroups.build(ParallelGrid(pp=2), bidirectional_v(2)),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
        ),
    ]
    for attempt in attempts:
        try:
            attempt()
        except ValueError as error:
            messages.append(str(error))
    return messages


def run_cases(cases: List[Case]) -> dict:
    """Every case, and on the 2-rank launch the p2p-order, looped-layout and error checks."""
    import torch.distributed as dist

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    out = {case.name: _bitpipe(case) for case in cases}
    if dist.get_world_size() == 2:
        out["p2p"] = _p2p_order(shared=False)
        out["p2p_shared"] = _p2p_order(shared=True)
        out["looped"] = _looped_specs_match_megatron()
        out["errors"] = _errors()
    return out


def run_references(keys) -> dict:
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    return {tied: _reference(tied) for tied in keys}


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_chunk_structure(case: Case, launched):
    for record in launched[case]:
        specs = record["specs"]
        assert specs == chunk_specs(bidirectional_v(case.pp), NUM_LAYERS, record["pp_rank"])
        assert record["layer_numbers"] == [[layer + 1 for layer in spec.layers] for spec in specs]
        assert record["flags"] == [(s.pre_process, s.post_process) for s in specs]
        expected_tied = {"is_embedding": True, "registered": False, "in_state_dict": False}
        untied = {"is_embedding": False, "registered": True, "in_state_dict": True}
        # Every rank holds exactly one LM head (pipeline A's on rank 0, B's on rank D-1, none between).
        edge = record["pp_rank"] in (0, case.pp - 1)
        assert record["tied"] == ([expected_tied if case.tied else untied] if edge else [])


@pytest.mark.multirank
@pytest.mark.parametrize("tied", [False, True])
def test_seed_init_follows_megatron_conventions(tied, references):
    """Same constants (norm weights 1, biases 0) and, for random tensors, the same std as
    megatron's own initialisation (N(0, 0.02); N(0, 0.02 / sqrt(2 * layers)) for output projections)."""
    native, seeded = references[tied]["native_stats"], references[tied]["seed_stats"]
    assert native.keys() == seeded.keys()
    for name, (constant, std) in native.items():
        assert seeded[name][0] == constant, name
        if constant is None:
            assert 0.85 < seeded[name][1] / std < 1.15, (name, seeded[name][1], std)
    assert [s for n, (_, s) in seeded.items() if n.endswith("linear_fc2.weight")][0] < 0.01


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_initial_weights_are_layout_independent(case: Case, references, launched):
    records = launched[case]
    expected = references[case.tied]["initial"]
    actual = {}
    for record in records:  # merge_full inside each rank already required replica copies to be equal
        actual.update(record["initial"])
        assert record["replica_diff_initial"] == 0.0
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_one_step_matches_single_process(case: Case, references, launched):
    """Loss, gradients (tied embedding included), grad norm and weights after the step."""
    close = functools.partial(torch.testing.assert_close, rtol=RTOL, atol=ATOL)
    ref = references[case.tied]
    records = launched[case]
    losses = {}
    for record in records:
        losses.update(record["losses"])
    assert sorted(losses) == sorted(ref["losses"])
    close(torch.tensor([losses[i] for i in sorted(losses)]), torch.tensor([ref["losses"][i] for i in sorted(losses)]))
    norms = {record["grad_norm"] for record in records}
    assert len(norms) == 1, f"ranks disagree on the grad norm: {norms}"
    close(norms.pop(), ref["grad_norm"])
    for key in ("grads", "weights"):
        actual = {}
        for record in records:
            actual.update(record[key])
        assert actual.keys() == ref[key].keys()
        for name in ref[key]:
            close(actual[name], ref[key][name], msg=lambda m: f"{key}[{name}]: {m}")
    assert all(record["replica_diff_after_step"] == 0.0 for record in records)


@pytest.mark.multirank
def test_channel_groups(launched):
    for case in (CASES_2[0], CASES_4[0]):
        facts = launched[case][0]["channels"]
        pp = case.pp
        assert facts["keys"] == sorted(
            (p, pipe, d, parity)
            for p in ("activation", "gradient")
            for pipe in (0, 1)
            for d in (1, -1)
            for parity in (0, 1)
        )
        assert facts["distinct"] == 16
        # Stage s is held by ranks s' and D-1-s' (s' = s or 2D-1-s): the mirror pair.
        for stage, members in facts["stage_members"].items():
            d = stage if stage < pp else 2 * pp - 1 - stage
            assert members == tuple(sorted({d, pp - 1 - d}))
    assert launched[CASES_2[0]][0]["channels"]["members"] == {(0, 1)}


@pytest.mark.multirank
def test_p2p_channels_keep_streams_apart_at_d2(launched):
    two_ranks = launched.ranks(2)
    assert two_ranks[0]["p2p"] == [4.0]
    assert two_ranks[1]["p2p"] == [2.0, 1.0, 3.0]
    # Control: one shared group mixes the streams up, so the check above is meaningful.
    assert two_ranks[1]["p2p_shared"] != [2.0, 1.0, 3.0]


@pytest.mark.multirank
def test_looped_specs_agree_with_megatron(launched):
    assert launched.ranks(2)[0]["looped"]


@pytest.mark.multirank
def test_configuration_errors(launched):
    chimera, layers = launched.ranks(2)[0]["errors"]
    assert "tied embeddings need each pipeline's first and last stage on one rank" in chimera
    assert "--num-layers 6" in layers
