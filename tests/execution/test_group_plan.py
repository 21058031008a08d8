"""The group plan (:mod:`megatron_bitpipe.execution.group_plan`): which process groups a layout
creates, with which ranks, in which order — pure, no process group.

* the families of a layout in creation order, and the rank lists of each, against the rules
  of the module docstring: the grid's groups (megatron's order, tp fastest), one channel
  family per channel group key, each stage's gradient-sync groups over its replicas x the
  data-parallel ranks, the expert families with expert parallelism, the replica families
  on request, the Optimus mesh's rows and columns, megatron's embedding group where the
  placement ties embeddings its way;
* partitions: within a family no rank is in two groups; the grid's and the channel families
  cover every rank once;
* warm-ups: the channel families in key order with their links, then the stage, expert and
  replica families;
* a bad layout is refused naming the rule, before any group exists;
* the plan is a function of the layout alone (the same on every rank).
"""

from __future__ import annotations

import pytest

from megatron_bitpipe.execution.group_plan import GroupPlan, ParallelGrid, WarmUp, channel_family, placement_links
from megatron_bitpipe.schedules import placement as placements
from megatron_bitpipe.schedules.comm import Payload

GRID_FAMILIES = ["tp", "dp", "pp", "mp", "solo", "world"]


def _channels(num_pipelines: int):
    return [channel_family((payload, p, direction, parity)) for payload in Payload for p in range(num_pipelines)
            for direction in (+1, -1) for parity in (0, 1)]  # fmt: skip


def test_bitpipe_tp2_dp2_pp4_families_in_creation_order():
    grid, placement = ParallelGrid(tp=2, dp=2, pp=4), placements.bidirectional_v(4)
    plan = GroupPlan.for_layout(grid, placement)
    stages = [f"stage/{s}" for s in range(8)]
    assert [f.name for f in plan] == GRID_FAMILIES + _channels(2) + stages
    assert plan.family("tp").rank_lists == tuple((r, r + 1) for r in range(0, 16, 2))
    assert plan.family("dp").rank_lists[:2] == ((0, 2), (1, 3))
    assert plan.family("pp").rank_lists == ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15))
    assert plan.family("world").rank_lists == (tuple(range(16)),)
    # stage 0 (pipeline A's first on rank 0, B's last on rank 3: BitPipe's mirror pair), per tp rank x both dp ranks
    assert placement.replicas(0)[0].rank == 0 and placement.replicas(0)[1].rank == 3
    assert plan.family("stage/0").rank_lists == ((0, 2, 12, 14), (1, 3, 13, 15))
    assert plan.family("stage/1").rank_lists == ((4, 6, 8, 10), (5, 7, 9, 11))
    assert all(plan.family(name).rank_lists == plan.family("pp").rank_lists for name in _channels(2))
    assert "embedding" not in plan and "ep" not in plan and not any(f.name.startswith("replica/") for f in plan)


@pytest.mark.parametrize("grid", [ParallelGrid(tp=2, dp=2, pp=4), ParallelGrid(tp=1, dp=4, pp=2, ep=2), ParallelGrid(tp=4, pp=2)])
def test_families_are_partitions_and_cover_the_world(grid):
    placement = placements.bidirectional_v(grid.pp)
    plan = GroupPlan.for_layout(grid, placement, replica_groups=True)
    world = list(range(grid.world_size))
    for family in plan:
        members = [r for ranks in family.rank_lists for r in ranks]
        assert len(members) == len(set(members)), family.name
        assert all(list(ranks) == sorted(ranks) for ranks in family.rank_lists)
        if family.name in GRID_FAMILIES or family.name.startswith("channel/"):
            assert sorted(members) == world, family.name
    for rank in world:
        mine = plan.groups_of(rank)
        assert all(rank in ranks for ranks in mine.values())
        tp_rank, dp_rank, pp_rank = grid.coords(rank)
        held = {role.stage for role in (placement.role(pp_rank, c) for c in range(placement.chunks_per_rank))}
        assert {name for name in mine if name.startswith("stage/")} == {f"stage/{s}" for s in held}
        assert len(mine["stage/" + str(min(held))]) == placement.num_pipelines * grid.dp


def test_expert_families_follow_megatron_expert_order():
    grid = ParallelGrid(tp=1, dp=4, pp=2, ep=2)
    plan = GroupPlan.for_layout(grid, placements.bidirectional_v(2))
    names = [f.name for f in plan]
    assert names[names.index("stage/3") + 1:] == ["expert-dp", "ep", "tp-ep", "tp-ep-pp"] + [f"expert-stage/{s}" for s in range(4)]
    assert plan.family("ep").rank_lists == ((0, 1), (2, 3), (4, 5), (6, 7))  # ep consecutive data-parallel ranks
    assert plan.family("expert-dp").rank_lists == ((0, 2), (1, 3), (4, 6), (5, 7))
    # stage 0 on pipeline ranks 0 and 1 (the mirror pair at D = 2): per expert rank, both blocks, both holders
    assert plan.family("expert-stage/0").rank_lists == ((0, 2, 4, 6), (1, 3, 5, 7))
    warm = [w.family for w in plan.warm_ups]
    assert warm[-6:] == ["ep", "tp-ep"] + [f"expert-stage/{s}" for s in range(4)]


def test_replica_families_only_on_request_and_only_for_several_pipelines():
    grid = ParallelGrid(tp=2, dp=2, pp=2)
    asked = GroupPlan.for_layout(grid, placements.bidirectional_v(2), replica_groups=True)
    assert asked.family("replica/0").rank_lists == ((0, 4), (1, 5), (2, 6), (3, 7))  # per (tp, dp): the two holders
    assert [w.family for w in asked.warm_ups][-4:] == [f"replica/{s}" for s in range(4)]
    one_pipeline = GroupPlan.for_layout(grid, placements.looped(2), replica_groups=True)
    assert not any(f.name.startswith("replica/") for f in one_pipeline)


def test_optimus_mesh_rows_and_columns_of_every_tp_group():
    plan = GroupPlan.for_layout(ParallelGrid(tp=4, pp=2), placements.looped(2), "optimus2d")
    assert plan.family("optimus-row").rank_lists == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert plan.family("optimus-column").rank_lists == ((0, 2), (1, 3), (4, 6), (5, 7))
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2 is not a square"):
        GroupPlan.for_layout(ParallelGrid(tp=2), placements.looped(1), "optimus2d")


def test_megatron_embedding_group_where_the_placement_copies_the_embedding():
    grid = ParallelGrid(tp=1, dp=2, pp=4)
    looped = GroupPlan.for_layout(grid, placements.looped(4))
    assert looped.family("embedding").rank_lists == ((0, 6), (1, 7))  # first and last stage of each dp slice
    assert "embedding" not in GroupPlan.for_layout(grid, placements.v_shape(4))  # ends on one rank: one Parameter


def test_warm_ups_walk_the_channels_in_key_order_with_their_links_then_the_stages():
    placement = placements.bidirectional_v(4)
    plan = GroupPlan.for_layout(ParallelGrid(pp=4), placement)
    channels = [w for w in plan.warm_ups if w.family.startswith("channel/")]
    assert sorted(w.family for w in channels) == sorted(_channels(2))
    assert [w.family for w in channels[:5]] == [  # payload, pipeline, direction (-1 first), parity
        "channel/activation/0/-1/0", "channel/activation/0/-1/1", "channel/activation/0/+1/0",
        "channel/activation/0/+1/1", "channel/activation/1/-1/0"]  # fmt: skip
    assert channels[0].links == ((1, 0), (3, 2)) and channels[2].links == ((0, 1), (2, 3))
    links = {w.family: w.links for w in channels}
    assert all(links[channel_family(k)] == tuple(pairs) for k, pairs in placement_links(placement).items())
    assert [w for w in plan.warm_ups if w.family.startswith("stage/")] == [WarmUp(f"stage/{s}") for s in range(8)]
    assert plan.warm_ups.index(WarmUp("stage/0")) == len(channels)


def test_bad_layouts_are_refused_before_any_group():
    with pytest.raises(ValueError, match="has 4 pipeline ranks, --pipeline-model-parallel-size is 2"):
        GroupPlan.for_layout(ParallelGrid(pp=2), placements.bidirectional_v(4))
    with pytest.raises(ValueError, match="--tensor-parallel-mode '2d' is not one of"):
        GroupPlan.for_layout(ParallelGrid(), placements.looped(1), "2d")
    with pytest.raises(ValueError, match="--expert-model-parallel-size 3 must divide"):
        ParallelGrid(dp=4, ep=3)


def test_the_plan_depends_on_the_layout_alone():
    layout = (ParallelGrid(tp=2, dp=2, pp=4, ep=2), placements.bidirectional_v(4), "1d", True)
    assert GroupPlan.for_layout(*layout) == GroupPlan.for_layout(*layout)
    with pytest.raises(KeyError, match="no group family 'cp'"):
        GroupPlan.for_layout(*layout).family("cp")
