"""Data-parallel sharding as one value (issue 46, core/data_parallel.py): what each ZeRO stage
shards, the step's collectives on which group, the value the pass sets on the plan and the
program carries, and HSDP (replicate x shard) in the optimizer: replicate 2 x shard 2 trains
to the weights ZeRO-3 over 4 ranks reaches (tests/hsdp_worker.py, torchrun with gloo)."""

from pathlib import Path

import pytest
import torch

from parcompile.codegen.emit import render_program, write_files
from parcompile.core.data_parallel import DataParallelSharding, data_parallel_sharding
from parcompile.driver import compile_config
from tests.program_utils import tiny_config


@pytest.mark.parametrize("stage,sharded", [(0, ()), (1, ("optimizer",)), (2, ("grads", "optimizer")),
                                           (3, ("params", "grads", "optimizer"))])
def test_each_stage_shards_what_zero_defines(stage, sharded):
    """Rajbhandari et al. 2020 section 5: P_os (1), P_os+g (2), P_os+g+p (3)."""
    dps = DataParallelSharding(stage=stage, shard=4)
    got = dict(params=dps.shards_parameters, grads=dps.shards_gradients, optimizer=dps.shards_optimizer_states)
    assert tuple(s for s, on in got.items() if on) == sharded
    assert dps.sharded == (stage > 0)
    assert not DataParallelSharding(stage=stage, shard=1).sharded   # one rank: nothing is split


def test_the_step_collectives_follow_the_stage_and_the_groups():
    """DDP all-reduces gradients; ZeRO reduce-scatters them and all-gathers the parameters,
    after the step (1, 2) or where they are used (3); experts shard over expert_dp."""
    assert [DataParallelSharding(stage=z, shard=8).gradient_reduction for z in range(4)] == \
        ["all_reduce"] + ["reduce_scatter"] * 3
    assert [DataParallelSharding(stage=z, shard=8).parameter_gather for z in range(4)] == \
        [None, "after_step", "after_step", "before_use"]
    hsdp = DataParallelSharding(stage=3, shard=4, replicate=2, shard_group="dp_shard", replicate_group="dp_replicate")
    assert hsdp.size == 8 and hsdp.sharded
    ex = hsdp.experts(2)
    assert (ex.shard_group, ex.shard, ex.replicate, ex.stage) == ("expert_dp", 2, 1, 3)


@pytest.mark.parametrize("bad", [dict(stage=4), dict(shard=0), dict(stage=3, replicate=2),
                                 dict(stage=1, per_microbatch=True)])
def test_an_impossible_sharding_is_refused(bad):
    with pytest.raises(ValueError):
        DataParallelSharding(**bad)


def test_the_pass_sets_the_value_the_program_carries(tmp_path):
    """shard-data-parallel returns the plan's sharding (plan.passes.data_parallel), the one
    data_parallel_sharding makes of the spec; the program renders it as DP_SHARDING."""
    cfg = tiny_config(2, parallel=dict(zero=2))
    plan = compile_config(cfg)
    dps = plan.passes.data_parallel
    assert dps == data_parallel_sharding(cfg.parallel)
    assert (dps.stage, dps.shard, dps.per_microbatch) == (2, 2, True)
    zb = data_parallel_sharding(tiny_config(2, parallel=dict(zero=2, schedule="zero_bubble")).parallel)
    assert not zb.per_microbatch   # the zero-bubble schedule reduces once per step
    text = render_program(cfg, plan, tmp_path)
    assert "DP_SHARDING = rt.DataParallelSharding(stage=2, shard=2, per_microbatch=True)" in text


@pytest.mark.torchrun
def test_hsdp_replicate_2_by_shard_2_trains_as_zero3_over_4(tmp_path):
    """HSDP's gradients (reduce-scatter over 2, all-reduce over the other 2) are ZeRO-3's over
    4 up to the order of the sums: after 3 steps every rank's parameters agree. SGD, whose
    update is linear in the gradient: Adam's first steps move each weight by about lr times
    the gradient's sign, so a near-zero gradient summed in another order moves it by up to
    2 lr (parcompile/verification.py's tolerance says the same)."""
    from parcompile.verification import _torchrun

    cfg = tiny_config(4, parallel=dict(zero=3, bucket_size=16 * 1024), train=dict(optimizer="sgd", lr=0.5))
    plan = compile_config(cfg)
    prog = tmp_path / "p"
    write_files(prog, {"plan.json": plan.to_json(), "program.py": render_program(cfg, plan, prog)})
    out = tmp_path / "out"
    out.mkdir()
    proc = _torchrun(4, [str(Path(__file__).with_name("hsdp_worker.py")), str(prog), str(out)], 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in range(4):
        got = torch.load(out / f"rank{r}.pt", weights_only=True)
        assert got["zero3"].keys() == got["hsdp"].keys()
        for name, w in got["zero3"].items():
            torch.testing.assert_close(got["hsdp"][name], w, rtol=1e-5, atol=1e-6, msg=name)
        assert any(not torch.equal(w, got["init"][n]) for n, w in got["zero3"].items())   # it trained
