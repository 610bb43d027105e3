"""Pipeline placements and schedules as values (parcompile.core.schedule: Placement, Schedule,
lookup), checked against torch.distributed.pipelining's own stage-to-rank mapping and
torchtitan's rank-to-stage-indices mapping, and the V placement honoured by the action
lists and the simulator."""

import pytest

from parcompile.core.schedule import (LOOP, SCHEDULES, V, Schedule, ScheduleError, build_actions, in_flight,
                                      lookup, simulate)

_utils = pytest.importorskip("torch.distributed.pipelining._utils")

LAYOUTS = [(pp, v) for pp in (1, 2, 3, 4, 8) for v in (1, 2, 3, 4)]


@pytest.mark.parametrize("pp,v", LAYOUTS)
@pytest.mark.parametrize("placement", [LOOP, V], ids=lambda p: p.name)
def test_stage_to_rank_is_torchs(placement, pp, v):
    want = _utils.generate_stage_to_rank_mapping(pp, pp * v, style=placement.name)
    assert placement.ranks(pp, v) == tuple(want[k] for k in range(pp * v))
    for r in range(pp):
        mine = placement.chunks(r, pp, v)
        assert sorted(mine) == sorted(k for k, at in want.items() if at == r)
        assert list(mine) == sorted(mine)            # local chunk c is the c-th lap
        for c, k in enumerate(mine):
            assert placement.local(k, pp) == c and placement.rank(k, pp) == r


@pytest.mark.parametrize("pp", [1, 2, 4, 8])
@pytest.mark.parametrize("style", ["loop", "v"])
def test_rank_to_chunks_is_torchtitans(style, pp):
    pipeline_parallel = pytest.importorskip("torchtitan.distributed.pipeline_parallel")
    sched = {"loop": "Interleaved1F1B", "v": "ZBVZeroBubble"}[style]
    placement = {"loop": LOOP, "v": V}[style]
    for r in range(pp):
        want = pipeline_parallel._get_pp_rank_to_stage_indices_mapping(r, pp, sched, 2 * pp)
        assert placement.chunks(r, pp, 2) == tuple(want)


def test_layers_per_rank():
    chunks = [[0], [1, 2], [3], [4], [5], [6], [7], [8, 9]]   # 8 model chunks on pp = 4, v = 2
    assert LOOP.layers(1, chunks, 4) == [[1, 2], [6]]
    assert V.layers(0, chunks, 4) == [[0], [8, 9]]            # both ends of the model on rank 0
    assert V.layers(3, chunks, 4) == [[4], [5]]


def test_schedules_by_name():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"}
    assert all(s.placement is LOOP for s in SCHEDULES.values())
    assert lookup("zero_bubble").split_backward and lookup("gpipe").forwards_first
    assert lookup("interleaved_1f1b").rounds and lookup("interleaved_1f1b").virtual_stages is None
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zbv'"):
        lookup("zbv")


@pytest.mark.parametrize("pp,m", [(2, 2), (3, 4), (4, 5)])
def test_v_placement_in_actions_and_simulator(pp, m):
    """A V-placed GPipe (two chunks per rank): its action lists send from the last rank's
    first chunk to its own second chunk, the simulator runs them with the V placement and
    refuses them with the loop one."""
    gpipe_v = Schedule("gpipe_v", placement=V, virtual_stages=2, forwards_first=True)
    acts = build_actions(gpipe_v, pp, m, 2)
    f = [1.0 + k for k in range(2 * pp)]
    b = [2 * x for x in f]
    sim = simulate(acts, f, b, pp, 2, m, placement=V)
    assert sim.busy == tuple(m * sum(f[k] + b[k] for k in V.chunks(r, pp, 2)) for r in range(pp))
    # rank 0 holds the first and the last model chunk: no input to receive, no gradient either
    first = [a["op"] for a in acts[0] if a["chunk"] == 1]
    assert "send_forward" not in first and "recv_backward" not in first
    assert in_flight(acts, pp, 2, [1] * (2 * pp), V) == tuple([m] * pp)
    with pytest.raises(ScheduleError):
        simulate(acts, f, b, pp, 2, m, placement=LOOP)


def test_every_reader_honours_a_v_placement(monkeypatch):
    """The readers ask the schedule value, never the name or ``k % pp``: swap the Schedule the
    name ``gpipe`` looks up for a V-placed GPipe with two chunks per rank, and the split
    pass, the schedule pass, plan.json's stages, the memory and time estimates and the
    exports follow it (rank 0 holds model chunks 0 and 3 of pp = 2: the embedding and the
    head). The program cannot run it yet (a rank sends to itself at the V's turn)."""
    from parcompile.core import schedule as S
    from parcompile.driver import compile_config
    from parcompile.exporters import export
    from tests.plan_factories import spec, tiny_model

    monkeypatch.setitem(S.SCHEDULES, "gpipe", Schedule("gpipe", placement=V, virtual_stages=2, forwards_first=True))
    cfg = spec(tiny_model(layers=8), pp=2, virtual_stages=2, schedule="gpipe")
    assert cfg.parallel.rank_chunks(0) == (0, 3) and cfg.parallel.rank_chunks(1) == (1, 2)
    plan = compile_config(cfg)
    stages = plan.data["stages"]
    assert stages[0]["chunks"] == [[0, 1], [6, 7]] and stages[1]["chunks"] == [[2, 3], [4, 5]]
    g = plan.graph
    assert (g.node("embedding").stage, g.node("loss").stage, g.node("loss").chunk) == (0, 0, 3)
    assert (g.node("layers.4.attn.wq").stage, g.node("layers.4.attn.wq").chunk) == (1, 2)
    acts = plan.data["schedule"]["actions"]
    assert not any(a["chunk"] == 1 and a["op"] in ("send_forward", "recv_backward") for a in acts[0])
    # the simulator refuses the action lists with the loop placement (they were built for V)
    rep = plan.passes.schedule.report
    with pytest.raises(ScheduleError):
        simulate(rep.actions, rep.fwd_time, rep.bwd_time, 2, 2, rep.num_microbatches, placement=LOOP)
    assert plan.data["schedule"]["in_flight"] == [rep.num_microbatches] * 2     # GPipe holds them all
    assert "Megatron-LM" in " ".join(export(plan, "megatron").errors)
    assert "torchtitan" in " ".join(export(plan, "torchtitan").errors)


def test_the_program_reads_the_placement_of_the_plans_schedule():
    """The runtime's context takes the placement from plan.json's schedule name; a name
    this version does not know is an error, not a silent loop placement (a V-placed plan
    run with loop peers would send to the wrong ranks)."""
    from parcompile.runtime.distributed.context import plan_placement

    assert plan_placement({}) is LOOP and plan_placement({"schedule": None}) is LOOP
    assert plan_placement({"schedule": {"name": "zero_bubble"}}) is lookup("zero_bubble").placement
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zbv'"):
        plan_placement({"schedule": {"name": "zbv"}})
