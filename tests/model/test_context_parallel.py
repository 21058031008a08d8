"""Context parallelism's pure parts (:mod:`megatron_bitpipe.model.context_parallel`,
:mod:`megatron_bitpipe.execution.group_plan`): no process group.

* the split of a sequence equals megatron-core's ``get_batch_on_this_cp_rank`` (tokens, labels,
  loss mask, position ids), every position on exactly one rank, ``S / cp`` per rank;
* each rank's two causal chunk masks are the rows of the whole sequence's causal mask at its
  positions (keys beyond a chunk's end all masked, so they are not computed);
* the grid's groups with context parallelism are megatron's (``RankGenerator``, order
  ``tp-cp-ep-dp-pp``): tp, cp, dp, dp-cp, pp and model-parallel groups; the stage groups span
  dp x cp; the cp families are created and warmed up only at ``cp > 1``;
* refusals, each one line naming the flag, before any group exists: cp with expert
  parallelism, with Optimus 2D, with replica groups; a sequence not divisible into ``2 cp``
  chunks; a model whose core attention is not SDPA, or whose config disagrees with the grid.

The training equivalence of every schedule under context parallelism is
``tests/execution/test_context_parallel_equivalence.py``.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from megatron_bitpipe.execution.group_plan import GroupPlan, ParallelGrid
from megatron_bitpipe.model.build import check_context_parallel_model
from megatron_bitpipe.model.context_parallel import causal_chunk_masks, context_parallel_batch, cp_positions
from megatron_bitpipe.schedules import placement as placements


class _Group:
    """What the split reads of a process group: its size and this rank's rank in it."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("cp", [2, 4])
def test_split_equals_megatron_and_covers_every_position_once(cp, monkeypatch):
    from megatron.core.utils import get_batch_on_this_cp_rank

    # megatron reads the group's size and rank (0.16: group.size() once torch.distributed is
    # initialised; 0.19: torch.distributed.get_world_size/get_rank of the group): the fake's
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: group.size())
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: group.rank())
    # megatron-core 0.19 also asks whether context parallelism is its hybrid kind (it is not)
    hybrid = dict(is_hybrid_cp=False) if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters else {}

    seq = 16
    tokens = torch.arange(2 * seq).view(2, seq)
    batch = dict(tokens=tokens, labels=tokens + 100, loss_mask=(tokens % 3).float(), position_ids=torch.arange(seq).expand(2, seq))
    held = []
    for rank in range(cp):
        ours = context_parallel_batch(batch, _Group(cp, rank))
        theirs = get_batch_on_this_cp_rank({k: v.clone() for k, v in batch.items()}, cp_group=_Group(cp, rank), **hybrid)
        for name in batch:
            assert torch.equal(ours[name], theirs[name]), name
        positions = cp_positions(seq, cp, rank)
        assert torch.equal(ours["position_ids"][0], positions) and len(positions) == seq // cp
        held += positions.tolist()
    assert sorted(held) == list(range(seq))


def test_split_without_context_parallelism_is_the_batch():
    batch = dict(tokens=torch.arange(8).view(1, 8), loss_mask=None)
    out = context_parallel_batch(batch, None)
    assert out["tokens"] is batch["tokens"] and out["loss_mask"] is None


@pytest.mark.parametrize("cp", [2, 4])
def test_chunk_masks_are_the_causal_rows_of_this_ranks_positions(cp):
    seq = 32
    full = torch.ones(seq, seq, dtype=torch.bool).tril()  # True: query row attends key column
    for rank in range(cp):
        positions = cp_positions(seq, cp, rank)
        masks = causal_chunk_masks(seq, cp, rank, device="cpu")
        assert [rows for rows, _, _ in masks] == [slice(0, seq // (2 * cp)), slice(seq // (2 * cp), seq // cp)]
        for rows, keys, mask in masks:
            expected = full[positions[rows]]
            assert torch.equal(mask, expected[:, :keys]) and not expected[:, keys:].any()


def test_sequence_not_divisible_into_two_chunks_per_rank_is_refused():
    with pytest.raises(ValueError, match=r"--seq-length 12 must be divisible by 2 x --context-parallel-size = 8"):
        cp_positions(12, 4, 0)


def test_groups_are_megatrons_with_context_parallelism():
    from megatron.core.parallel_state import RankGenerator

    grid = ParallelGrid(tp=2, dp=2, pp=2, cp=2)
    plan = GroupPlan.for_layout(grid, placements.looped(2, 1))
    megatron = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2, order="tp-cp-ep-dp-pp")
    for ours, token in [("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("dp-cp", "dp-cp"), ("pp", "pp"), ("mp", "tp-pp")]:
        assert sorted(plan.family(ours).rank_lists) == sorted(tuple(r) for r in megatron.get_ranks(token)), ours
    # one stage per pipeline rank: its grad-sync groups are the dp x cp ranks of each tp rank
    assert sorted(plan.family("stage/0").rank_lists) == sorted(r for r in plan.family("dp-cp").rank_lists if r[0] < 8)
    assert grid.cp_rank(2) == 1 and grid.coords(2) == (0, 0, 0) and grid.rank(0, 0, 0, cp_rank=1) == 2
    names = [f.name for f in plan]
    assert names.index("cp") == names.index("world") + 1 and names.index("dp-cp") == names.index("cp") + 1
    assert [w.family for w in plan.warm_ups if w.family in ("cp", "dp-cp")] == ["cp", "dp-cp"]


def test_without_context_parallelism_the_plan_has_no_cp_families():
    plan = GroupPlan.for_layout(ParallelGrid(tp=2, dp=2, pp=2), placements.bidirectional_v(2))
    assert "cp" not in plan and "dp-cp" not in plan


def test_context_parallel_layouts_refused_before_any_group():
    with pytest.raises(ValueError, match=r"^--context-parallel-size 2 with --expert-model-parallel-size 2: "):
        ParallelGrid(dp=2, cp=2, ep=2)
    with pytest.raises(ValueError, match=r"^--context-parallel-size 2 with --tensor-parallel-mode optimus2d"):
        GroupPlan.for_layout(ParallelGrid(tp=4, pp=2, cp=2), placements.bidirectional_v(2), "optimus2d")
    with pytest.raises(ValueError, match=r"^--context-parallel-size 2 with decentralized data parallelism"):
        GroupPlan.for_layout(ParallelGrid(dp=2, pp=2, cp=2), placements.bidirectional_v(2), replica_groups=True)


def test_context_parallel_models_refused_before_any_group():
    from megatron_bitpipe.benchmarking.megatron_baseline import tiny_gpt_config
    from megatron_bitpipe.model.chunks import default_gpt_layer_spec
    from megatron_bitpipe.model.sdpa_attention import SdpaDotProductAttention, with_core_attention

    config = tiny_gpt_config(context_parallel_size=2)
    grid = ParallelGrid(pp=2, cp=2)
    local = default_gpt_layer_spec(config)
    sdpa = with_core_attention(local, SdpaDotProductAttention)
    check_context_parallel_model(config, grid, sdpa, "data-parallel")
    with pytest.raises(ValueError, match=r"^--context-parallel-size 2 needs --attention-backend sdpa"):
        check_context_parallel_model(config, grid, local, "data-parallel")
    with pytest.raises(ValueError, match=r"^--context-parallel-size 2 needs synchronous data-parallel gradient reduction"):
        check_context_parallel_model(config, grid, sdpa, "replicas")
    with pytest.raises(ValueError, match=r"context_parallel_size 2 differs from --context-parallel-size 1"):
        check_context_parallel_model(config, ParallelGrid(pp=2), sdpa, "data-parallel")


def test_script_flags_refused_in_one_line_each():
    from megatron_bitpipe.training.arguments import BitPipeConfigError, parse_args
    from megatron_bitpipe.training.gpt import GPTTask

    base = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "127", "--train-iters", "3", "--lr", "1e-3",
            "--context-parallel-size", "2", "--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2"]  # fmt: skip
    args = parse_args(GPTTask(), [*base, "--attention-backend", "sdpa"], world_size=8)
    assert args.data_parallel_size == 2 and args.context_parallel_size == 2
    checkpointed = parse_args(GPTTask(), [*base, "--attention-backend", "sdpa", "--save", "ckpt", "--load", "ckpt"], world_size=4)
    assert checkpointed.save == checkpointed.load == "ckpt"
    for extra, line in [
        ([], "--context-parallel-size 2 needs --attention-backend sdpa"),
        (["--attention-backend", "sdpa", "--attention-dropout", "0.1"], "--context-parallel-size 2 needs --attention-dropout 0"),
        (["--attention-backend", "sdpa", "--seq-length", "18"], "--context-parallel-size 2 needs --seq-length 18 divisible by 2 x 2"),
        (["--attention-backend", "sdpa", "--pipeline-schedule", "1f1b"], "--context-parallel-size 2 runs with the plan-executed schedules"),
    ]:
        with pytest.raises(BitPipeConfigError) as refused:
            parse_args(GPTTask(), [*base, *extra], world_size=4)
        assert line in str(refused.value) and str(refused.value).count("--context-parallel-size") == 1
    with pytest.raises(BitPipeConfigError, match=r"world size 4 is not divisible by .* x --context-parallel-size = 8"):
        parse_args(GPTTask(), [*base, "--attention-backend", "sdpa", "--tensor-model-parallel-size", "2"], world_size=4)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_steps_read_each_causal_pair_once_and_balance_the_work(cp):
    """Over the ``cp`` ring steps, rank r's queries read every key at or before them exactly once
    and no later key (chunk pairs the mask discards wholly are skipped); every rank computes as
    many chunk pairs at every step."""
    from megatron_bitpipe.model.ring_attention import ring_block_reads

    seq = 4 * cp
    chunk = seq // (2 * cp)
    for rank in range(cp):
        queries = cp_positions(seq, cp, rank)
        reads = torch.zeros(seq // cp, seq, dtype=torch.long)
        for step in range(cp):
            source = (rank - step) % cp
            keys = cp_positions(seq, cp, source)
            pairs = 0
            for local, span, causal in ring_block_reads(cp, rank, source):
                if span is None:
                    continue
                pairs += span.stop - span.start
                rows = slice(local * chunk, (local + 1) * chunk)
                cols = keys[span.start * chunk : span.stop * chunk]
                allowed = torch.ones(chunk, len(cols), dtype=torch.bool)
                if causal:
                    allowed = allowed.tril(diagonal=len(cols) - chunk)
                reads[rows][:, cols] += allowed.long()
                block = queries[rows].unsqueeze(1) >= cols.unsqueeze(0)
                assert torch.equal(block, allowed), (rank, step)  # the mask is the causal rule
            assert pairs == (3 if step == 0 else 2), (rank, step)
        assert torch.equal(reads, (queries.unsqueeze(1) >= torch.arange(seq)).long()), rank


def test_cp_comm_type_is_decided_once_and_a2a_refused():
    from megatron_bitpipe.run_config import RunConfig
    from megatron_bitpipe.training.arguments import BitPipeConfigError, parse_args
    from megatron_bitpipe.training.config import transformer_config
    from megatron_bitpipe.training.gpt import GPTTask

    base = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "127", "--train-iters", "3", "--lr", "1e-3",
            "--context-parallel-size", "2", "--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2",
            "--attention-backend", "sdpa"]  # fmt: skip
    assert RunConfig.from_args(parse_args(GPTTask(), base, world_size=4)).layout.context_comm == "all_gather"
    run = RunConfig.from_args(parse_args(GPTTask(), [*base, "--cp-comm-type", "p2p"], world_size=4))
    assert run.layout.context_comm == "p2p"
    assert transformer_config(run).cp_comm_type == "p2p"
    for value in ("a2a", "a2a+p2p"):
        with pytest.raises(BitPipeConfigError, match=rf"--cp-comm-type {re.escape(value)} is not built: .*all-to-all"):
            parse_args(GPTTask(), [*base, "--cp-comm-type", value], world_size=4)
