"""Passes talk through typed results (issue 31), not through a dict on the graph: each pass
returns its frozen result, the pass manager records it in ``ctx.results`` and verifies the
graph with the invariants the results switch on."""

import dataclasses

import pytest

from parcompile.ir.types import Sharding
from parcompile.ir.verify import VerifyError, verify
from parcompile.passes.results import CollectivesInserted, PassResults, ScheduleResult, StageSplit
from tests.plan_factories import run_until, spec, tiny_model


def test_each_pass_records_its_result_and_the_graph_carries_none():
    cfg = spec(tiny_model(layers=4), tp=2, pp=2, global_batch=8)
    g, ctx = run_until(cfg, "insert-collectives")
    res = ctx.results
    assert res.staged and res.inserted and res.schedule is None
    assert res.chunks == ((0, 1), (2, 3))
    assert len(res.collectives.stage_params) == 2
    assert not hasattr(g, "meta")
    g2, ctx2 = run_until(cfg, "schedule-pipeline")
    sched = ctx2.results.schedule
    assert isinstance(sched, ScheduleResult) and sched.report.num_microbatches == cfg.parallel.num_microbatches == 8
    assert len(sched.compute.chunk_fwd_flops) == 2 and sched.comm.collectives
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx2.results.split = None


def test_results_before_the_split_have_no_chunks_and_refuse_a_foreign_result():
    empty = PassResults()
    assert not empty.staged and not empty.inserted
    with pytest.raises(LookupError, match="split-pipeline-stages"):
        empty.chunks
    assert empty.add(None) is empty
    with pytest.raises(TypeError, match="dict"):
        empty.add({"chunks": [[0]]})
    got = empty.add(StageSplit(((0,),))).add(CollectivesInserted(()))
    assert got.chunks == ((0,),) and got.inserted and empty.split is None


def test_verify_checks_edges_only_when_told_collectives_are_in():
    """The edge invariants are arguments of verify (the pass manager passes the results'
    flags): the same broken edge passes without ``inserted`` and is caught with it."""
    g, ctx = run_until(spec(tp=2), "insert-collectives")
    g.set_sharding("layers.0.attn.all_reduce", out=Sharding.make({}, {"tp"}))
    verify(g, ctx.degrees, staged=True, inserted=False)
    with pytest.raises(VerifyError, match="layers.0.attn_residual"):
        verify(g, ctx.degrees, staged=ctx.results.staged, inserted=ctx.results.inserted)
