import pytest

from parcompile.config.schema import ParallelConfig
from parcompile.core.groups import RankGenerator, rank_groups, stage_ranks


def test_spec_example_16_ranks_tp2_pp4():
    g = rank_groups(ParallelConfig(tp=2, pp=4, dp=2))
    assert g["tp"] == [[2 * i, 2 * i + 1] for i in range(8)]
    assert g["dp"][:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert g["dp_cp"] == g["dp"]
    assert g["cp"] == [[r] for r in range(16)]
    assert stage_ranks(g["pp"], 1) == [4, 5, 6, 7]


def test_context_parallel_and_dp_cp():
    # order tp-cp-ep-dp-pp: tp fastest, then cp, then dp
    g = rank_groups(ParallelConfig(tp=2, cp=2, dp=2))
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["embedding"] == [[r] for r in range(8)]       # pp = 1: one rank each


def test_expert_groups_fold_onto_dense_ranks():
    # tp 2 * dp 2 = 4 ranks; experts: expert_tp 1, ep 2 -> expert_dp 2
    p = ParallelConfig(tp=2, dp=2, ep=2, expert_tp=1)
    g = rank_groups(p)
    assert p.expert_dp == 2
    assert g["expert_tp"] == [[0], [1], [2], [3]]
    assert g["ep"] == [[0, 1], [2, 3]]
    assert g["expert_dp"] == [[0, 2], [1, 3]]


def test_other_orders_and_every_rank_once():
    g = rank_groups(ParallelConfig(tp=2, pp=2, dp=2, order="tp-pp-dp"))
    assert g["pp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for axis, groups in g.items():
        if axis != "embedding":
            assert sorted(r for grp in groups for r in grp) == list(range(8)), axis


def test_generator_rejects_unnamed_axes():
    with pytest.raises(ValueError):
        RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-pp")
    with pytest.raises(ValueError):
        RankGenerator(tp=1, ep=2, dp=1, pp=1, cp=2, order="tp-cp-ep-dp-pp")
