"""One rank of tests/test_data_parallel.py's HSDP run (torchrun, 4 ranks, gloo): a generated
dp 4 program's stage trained 3 steps twice from the same weights and batches, once with
ZeRO-3 over all 4 data-parallel ranks and once with HSDP, replicate 2 x shard 2 (FSDP2's 2-D
mesh: states sharded over the shard group, replicated over the replicate group), each
rank's parameters after the last step written to ``OUT/rank{r}.pt`` for the test to compare.

Usage: ``torchrun --nproc-per-node 4 tests/hsdp_worker.py PROGRAM_DIR OUT``.
"""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from parcompile import runtime as rt
from parcompile.core.data_parallel import DataParallelSharding
from parcompile.runtime.distributed.context import Axis


def hsdp_axes(ctx, replicate: int) -> dict:
    """The shard and replicate groups splitting ``dp_cp`` into ``replicate`` x ``shard`` ranks
    (torchtitan's dp_replicate x dp_shard order: the shard group is contiguous). Every rank
    creates every group, in the same order, as torch.distributed.new_group requires."""
    ranks = ctx.axes["dp_cp"].ranks
    shard = len(ranks) // replicate
    out = {}
    for name, groups in (("dp_shard", [ranks[i * shard:(i + 1) * shard] for i in range(replicate)]),
                         ("dp_replicate", [ranks[j::shard] for j in range(shard)])):
        for g in groups:
            pg = dist.new_group(g, backend="gloo")
            if ctx.rank in g:
                out[name] = Axis(name, g, g.index(ctx.rank), pg)
    return out


def train(mod, plan, ctx, sharding: DataParallelSharding, steps: int) -> tuple[dict, dict]:
    """The program's training step (program.py.j2's loop, fp32, no evaluation) with
    ``sharding``; returns this rank's parameters before and after ``steps`` steps."""
    torch.manual_seed(mod.SEED)
    model = mod.Stage(plan, ctx).to(device=ctx.device, dtype=mod.ACT_DTYPE)
    init = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = rt.step_optimizer(model, ctx, mod.TRAIN, sharding, mod.BUCKET_SIZE, mod.SP, mod.REDUCE_DTYPE)
    data = rt.training_data("synthetic", dict(mod.DATA_FORMAT), mod.VOCAB, mod.SEQ_LEN,
                            mod.GLOBAL_BATCH, mod.SEED)
    actions = plan["schedule"]["actions"][ctx.stage]
    for step in range(steps):
        tokens, targets = data.batch(step)
        norm, _ = rt.loss_normaliser(targets, ctx)
        mbs = [rt.split_microbatch(x, ctx.axes["cp"], y)
               for x, y in rt.local_rows(tokens, targets, ctx.dp.index, ctx.dp.size, mod.MICRO_BATCH)]
        opt.zero_grad()
        opt.set_lr(rt.lr_at(step, mod.TRAIN))
        opt.begin_step()
        rt.run_schedule(actions, ctx, model.forward_chunk, lambda y, t: model.loss(y, t) * norm, mbs,
                        mod.VIRTUAL_STAGES, (mod.MICRO_BATCH, mod.SEQ_LEN, mod.HIDDEN), mod.ACT_DTYPE,
                        opt.loss_scale, grad_sync=opt.grad_sync)
        opt.reduce_gradients()
        assert opt.unscale()
        opt.clip(opt.grad_norm(), mod.TRAIN["grad_clip"])
        opt.step()
    opt.gather_for_export()
    return init, {name: p.detach().clone() for name, p in model.named_parameters()}


def main(program_dir: str, out: str) -> None:
    spec = importlib.util.spec_from_file_location("hsdp_program", Path(program_dir) / "program.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    plan = json.loads((Path(program_dir) / "plan.json").read_text())
    ctx = rt.init_parallel(plan, device="cpu", gather_groups=True)
    hctx = dataclasses.replace(ctx, axes={**ctx.axes, **hsdp_axes(ctx, 2)})
    zero3_sharding = mod.DP_SHARDING   # the plan's: ZeRO-3 over all of dp_cp
    assert zero3_sharding.shards_parameters and zero3_sharding.shard == ctx.axes["dp_cp"].size
    init, zero3 = train(mod, plan, ctx, zero3_sharding, 3)
    _, hsdp = train(mod, plan, hctx, dataclasses.replace(zero3_sharding, shard=zero3_sharding.shard // 2, replicate=2,
                                                         shard_group="dp_shard", replicate_group="dp_replicate"), 3)
    torch.save({"init": init, "zero3": zero3, "hsdp": hsdp}, Path(out) / f"rank{ctx.rank}.pt")
    rt.shutdown(ctx)


if __name__ == "__main__":
    main(*sys.argv[1:])
