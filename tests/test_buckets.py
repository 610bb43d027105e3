"""Gradient buckets (issue 7): the partition rule, the plan's collectives, memory and
estimate, the `bucket_size` key, and the runtime's bucket layout and launch logic, all
without a process group (the torchrun cases are in tests/test_verify_buckets.py)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import parcompile
from parcompile.analysis.buckets import GRAD_BYTES, GradUnit, partition, shard_elements, stage_buckets
from parcompile.config.schema import DEFAULT_BUCKET_SIZE
from parcompile.driver import compile_config
from parcompile.runtime.train.buckets import GradBuckets, GradSync, param_units
from parcompile.runtime.distributed.context import AXES, Axis, ParallelContext
from parcompile.runtime.train.wgrad import STORE
from tests.program_utils import build_program, tiny_config
from tests.test_checks import diags, spec

REPO = Path(__file__).resolve().parent.parent
KIB = 1024


# --------------------------------------------------------------------------------------
# The rule


def _random_units(rng: random.Random) -> list[GradUnit]:
    units = []
    for chunk in reversed(range(rng.randint(1, 3))):
        names = (["tied_head"] if rng.random() < 0.2 else []) + (["output"] if rng.random() < 0.5 else [])
        names += [f"layers.{i}" for i in reversed(range(rng.randint(0, 6)))]
        names += (["embedding"] if rng.random() < 0.5 else []) + (["tied_embedding"] if rng.random() < 0.2 else [])
        for name in names:
            units.append(GradUnit(chunk, name, rng.randint(1, 5000), rng.choice([0, 0, rng.randint(1, 3000)]),
                                  alone=name.startswith("tied_")))
    return units


@pytest.mark.parametrize("seed", range(40))
def test_partition_covers_each_unit_once_in_order_and_closes_at_the_size(seed):
    rng = random.Random(seed)
    units = _random_units(rng)
    size = rng.choice([0, 1, 4 * 1000, 4 * 3000, 4 * 20000])
    for kind in ("dense", "expert"):
        buckets = partition(units, size, kind)
        want = [(u.chunk, u.name) for u in units if u.size(kind) > 0]
        got = [(b.chunk, name) for b in buckets for name in b.units]
        assert got == want                                       # every unit once, in ready order
        sizes = {(u.chunk, u.name): u.size(kind) for u in units}
        for i, b in enumerate(buckets):
            assert b.elements == sum(sizes[(b.chunk, n)] for n in b.units)
            alone = [n for n in b.units if n.startswith("tied_")]
            assert not alone or b.units == tuple(alone)          # a tied embedding is alone
            if size and not alone:
                # it closes as soon as it reaches the size: without its last unit it is smaller
                assert GRAD_BYTES * (b.elements - sizes[(b.chunk, b.units[-1])]) < size
                nxt = buckets[i + 1] if i + 1 < len(buckets) else None
                if nxt is not None and nxt.chunk == b.chunk and not nxt.units[0].startswith("tied_"):
                    assert b.bytes >= size                       # not the last of its chunk: full
        if size == 0:   # one bucket per chunk, besides the tied embedding
            plain = [b.chunk for b in buckets if not b.units[0].startswith("tied_")]
            assert len(plain) == len(set(plain))


def test_shards_round_up_per_bucket():
    units = [GradUnit(0, "layers.1", 5), GradUnit(0, "layers.0", 7)]
    buckets = partition(units, 4 * 5, "dense")
    assert [b.elements for b in buckets] == [5, 7]
    assert shard_elements(buckets, 4) == 2 + 2 > math.ceil(12 / 4)
    assert shard_elements(buckets, 1) == 12


# --------------------------------------------------------------------------------------
# The key


def test_bucket_size_parses_sizes_and_zero():
    from parcompile.frontend import load_spec

    for text, want in (("40 MB", 40 * 10**6), ("64 KiB", 65536), ("0", 0), ("0 MB", 0), ("1.5 MB", 1_500_000)):
        cfg, _ = load_spec(spec(parallel={"bucket_size": text}))
        assert cfg.parallel.bucket_size == want, text
    cfg, _ = load_spec(spec())
    assert cfg.parallel.bucket_size == DEFAULT_BUCKET_SIZE == 4 * 40_000_000


@pytest.mark.parametrize("value,message,help_has", [
    ("-1 MB", "bucket_size must not be negative, got `-1 MB`", "0 or more"),
    ("-3", "bucket_size must not be negative, got `-3`", "40 MB"),
    ("40000000", "missing unit: bucket_size takes a memory size", "write `160 MB`"),
    ("40 GB/s", "expected a memory size, got a bandwidth", "`MB`"),
    ("auto", "expected a memory size, got `auto`", "bucket_size = 40 MB"),
    # below one fp32 gradient: rounding would silently make it 0 (no overlap)
    ("0.5 B", "bucket_size must be 0 or at least 4 B (one fp32 gradient), got `0.5 B`", "use 0"),
])
def test_bucket_size_mistakes(value, message, help_has):
    found = [d for d in diags(spec(parallel={"bucket_size": value})) if d[0] == "error"]
    assert len(found) == 1, found
    assert found[0][1] == message and help_has in found[0][4]


def test_bucket_size_without_data_parallelism_warns():
    text = spec(parallel={"dp": "1", "tp": "2", "pp": "2", "global_batch": "8", "bucket_size": "1 MB"},
                cluster={"gpus_per_node": "4"})
    found = diags(text)
    assert [d[1] for d in found] == ["bucket_size has no effect: with dp * cp = 1 no gradient is reduced over "
                                     "data parallelism"]


# --------------------------------------------------------------------------------------
# The plan


PLANS = {
    "dp2_tp2_pp2_tied_sp_learned": dict(dp=2, tp=2, pp=2, model=dict(tie_embeddings=True, position="learned"),
                                        parallel=dict(sequence_parallel=True)),
    "dp2_pp2_interleaved": dict(dp=2, pp=2, model=dict(layers=8),
                                parallel=dict(schedule="interleaved_1f1b", virtual_stages=2, global_batch=8)),
    "dp4_moe_ep2": dict(dp=4, model=dict(experts=4, top_k=2), parallel=dict(ep=2)),
    "dp2_tied_pp1": dict(dp=2, model=dict(tie_embeddings=True)),
}


def _cfg(name: str, **parallel):
    kw = dict(PLANS[name])
    par = dict(kw.pop("parallel", {}))
    par.update(parallel)
    return tiny_config(kw.pop("dp", 1), kw.pop("tp", 1), kw.pop("pp", 1), parallel=par, **kw)


def _grad_entries(plan: dict, stage: int, where: str) -> list[dict]:
    return [c for c in plan["comm"]["collectives"] if c["stage"] == stage and c["where"] == where]


@pytest.mark.parametrize("name", sorted(PLANS))
@pytest.mark.parametrize("zero", [0, 1])
def test_plan_buckets_cover_the_parameters_and_match_the_collectives(name, zero):
    small = compile_config(_cfg(name, bucket_size=16 * KIB, zero=zero)).data
    one = compile_config(_cfg(name, bucket_size=0, zero=zero)).data
    deg = small["degrees"]
    d, ed = deg["dp"] * deg["cp"], deg["expert_dp"]
    for st, row in zip(small["stages"], small["comm"]["grad_buckets"]["per_stage"]):
        s = st["index"]
        dense, expert = [b["elements"] for b in row["dense"]], [b["elements"] for b in row["expert"]]
        assert sum(dense) + sum(expert) == st["params_per_rank"]
        # per bucket one all-reduce (ZeRO: reduce-scatter of the padded slice + all-gather)
        op = "all_reduce" if zero == 0 else "reduce_scatter"
        for where, sizes, n in (("grads", dense, d), ("expert_grads", expert, ed)):
            got = sorted(c["bytes"] for c in _grad_entries(small, s, where) for _ in range(c["count"]))
            want = sorted(4 * (x if zero == 0 else math.ceil(x / n)) for x in sizes) if n > 1 else []
            assert got == want, (s, where)
            assert all(c["op"] == op for c in _grad_entries(small, s, where))
        if zero == 0:   # same bytes in all, whatever the buckets: per_step is unchanged
            assert sum(c["bytes"] * c["count"] for c in _grad_entries(small, s, "grads")) == \
                sum(c["bytes"] * c["count"] for c in _grad_entries(one, s, "grads"))
    if zero == 0:
        assert small["comm"]["per_step"] == one["comm"]["per_step"]
    assert len(small["comm"]["grad_buckets"]["per_stage"][0]["dense"]) > 1


def test_zero_states_round_up_per_bucket():
    """ZeRO 2: gradients and optimizer states are sum ceil(n_b / d) per rank (each bucket is a
    sharded buffer), which the plan's memory counts."""
    cfg = _cfg("dp2_tp2_pp2_tied_sp_learned", bucket_size=16 * KIB, zero=2)
    plan = compile_config(cfg)
    for sp, mem in zip(plan.passes.collectives.stage_params, plan.data["memory"]["per_stage"]):
        dense, _ = stage_buckets(sp, cfg.parallel.bucket_size)
        shard = sum(math.ceil(b.elements / 2) for b in dense)
        assert mem["grads"] == 4 * shard
        assert mem["optimizer"] == 8 * shard          # fp32 Adam: two moments
        assert mem["params"] == 4 * sp.dense


def test_plan_bucket_units_follow_the_gradient_ready_order():
    plan = compile_config(_cfg("dp2_tp2_pp2_tied_sp_learned", bucket_size=0)).data
    first, last = plan["comm"]["grad_buckets"]["per_stage"]
    assert [b["units"] for b in first["dense"]] == [["layers.1", "layers.0", "embedding"], ["tied_embedding"]]
    assert [b["units"] for b in last["dense"]] == [["tied_head"], ["output", "layers.3", "layers.2"]]
    inter = compile_config(_cfg("dp2_pp2_interleaved", bucket_size=0)).data
    # two chunks per rank: the last local chunk's gradients are ready first
    assert [b["chunk"] for b in inter["comm"]["grad_buckets"]["per_stage"][0]["dense"]] == [1, 0]


def test_estimate_hides_buckets_behind_the_backward():
    """The 70B example: per-layer buckets hide most of the reduction; one bucket per
    chunk (bucket_size = 0) hides none of it."""
    plan = parcompile.compile(REPO / "examples" / "llama3_70b_8x8_h100.par")
    red = plan.data["estimate"]["grad_reduction"]
    assert len(red) == plan.data["degrees"]["pp"]
    for r in red:
        assert r["hidden"] > 0.8 * r["seconds"] and r["exposed"] == pytest.approx(r["seconds"] - r["hidden"])
    dp = plan.data["estimate"]["breakdown"]["dp_comm"]
    cfg0 = plan.config.model_copy(update={"parallel": plan.config.parallel.model_copy(update={"bucket_size": 0})})
    plan0 = compile_config(cfg0)
    for r in plan0.data["estimate"]["grad_reduction"]:
        assert r["hidden"] == 0 and r["exposed"] == r["seconds"] > 0
    assert plan0.data["estimate"]["breakdown"]["dp_comm"] > dp
    report = plan.report_md()
    assert "## Gradient reduction (data parallel)" in report and "160 MB" in report and "hidden" in report


# --------------------------------------------------------------------------------------
# The runtime: its buckets are the plan's, and they launch in order once final


def _context(plan: dict, rank: int) -> ParallelContext:
    """Rank ``rank``'s axes of ``plan`` without process groups (to build its modules)."""
    axes = {}
    for name in AXES:
        groups = plan["groups"].get(name) or [[r] for r in range(plan["world_size"])]
        mine = next((list(g) for g in groups if rank in g), [rank])
        axes[name] = Axis(name, mine, mine.index(rank), None)
    return ParallelContext(rank, plan["world_size"], axes, torch.device("cpu"), None)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_runtime_buckets_equal_the_plans(name, tmp_path):
    cfg = _cfg(name, bucket_size=16 * KIB)
    module, plan = build_program(cfg, tmp_path)
    for st in plan["stages"]:
        rank = st["ranks"][-1]
        model = module.Stage(plan, _context(plan, rank))
        params = list(model.parameters())
        dense = [p for p in params if not getattr(p, "expert", False)]
        expert = [p for p in params if getattr(p, "expert", False)]
        row = plan["comm"]["grad_buckets"]["per_stage"][st["index"]]
        for kind, ps in (("dense", dense), ("expert", expert)):
            units = [u for u, _ in param_units(ps, model.chunks)]
            got = [{"chunk": b.chunk, "elements": b.elements, "units": list(b.units)}
                   for b in partition(units, cfg.parallel.bucket_size, "dense")]
            assert got == row[kind], (st["index"], kind)


class _Layer(nn.Module):
    def __init__(self, i: int, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))
        self.w.global_name = f"layers.{i}.w"


def _toy(sizes: list[int]) -> tuple[nn.ModuleList, GradBuckets]:
    layers = nn.ModuleList(_Layer(i, n) for i, n in enumerate(sizes))
    gb = GradBuckets(list(layers.parameters()), [list(range(len(sizes)))], Axis("dp_cp", [0], 0), 4 * 10,
                     sharded=False, scale=1.0)
    return layers, gb


def test_buckets_launch_in_order_only_in_the_last_backward():
    layers, gb = _toy([10, 10, 10])               # one layer per bucket: layers 2, 1, 0
    sync = GradSync([gb])
    actions = [{"op": "backward", "microbatch": mb, "chunk": 0} for mb in range(2)]
    sync.start(actions)
    sync.begin(0)                                 # micro-batch 0: nothing is final
    for p in layers.parameters():
        gb.listen(p)
    sync.end(0)
    assert [b.launched for b in gb.buckets] == [False, False, False]
    sync.begin(1)                                 # the last backward
    gb.listen(layers[0].w)                        # layer 0's bucket is last: it waits for the others
    assert [b.launched for b in gb.buckets] == [False, False, False]
    gb.listen(layers[2].w)
    assert [b.launched for b in gb.buckets] == [True, False, False]
    gb.listen(layers[1].w)
    assert [b.launched for b in gb.buckets] == [True, True, True]
    assert all(b.early for b in gb.buckets)       # inside the backward
    sync.end(1)
    gb.finish()
    assert [r["early"] for r in gb.report()] == [True, True, True]


def test_a_parameter_without_gradient_is_ready_when_its_chunk_ends():
    layers, gb = _toy([10, 10])
    sync = GradSync([gb])
    sync.start([{"op": "backward", "microbatch": 0, "chunk": 0}])
    sync.begin(0)
    gb.listen(layers[1].w)                        # layer 0 (an unused expert, say) gets nothing
    assert [b.launched for b in gb.buckets] == [True, False]
    sync.end(0)
    assert [b.launched for b in gb.buckets] == [True, True]
    assert [b.early for b in gb.buckets] == [True, False]   # the second one: after the last backward


def test_zero_bubble_weights_wait_for_their_deferred_gradient():
    """In a zero-bubble B a weight whose gradient is filed for W is not ready (autograd runs
    its hook without a gradient); it is when its W closure has run."""
    layers, gb = _toy([10, 10])
    sync = GradSync([gb])
    actions = [{"op": "backward_input", "microbatch": 0, "chunk": 0},
               {"op": "backward_weight", "microbatch": 0, "chunk": 0}]
    sync.start(actions)
    w = layers[1].w
    sync.begin(0)
    with STORE.collecting((0, 0)):
        STORE.file(lambda: gb.listen(w), w)       # W will deliver layer 1's gradient
    gb.listen(w)                                  # its hook in B, without a gradient
    gb.listen(layers[0].w)                        # a norm-like parameter: final in B
    sync.end(0)
    assert [b.launched for b in gb.buckets] == [False, False]   # bucket 0 (layer 1) waits for W
    sync.begin(1)
    STORE.flush((0, 0))
    assert [b.launched for b in gb.buckets] == [True, True]
    sync.end(1)
    assert not STORE.has_pending(w)


def test_program_records_the_buckets(tmp_path):
    """One process, dp = 1: the program runs the bucket logic (no collective) and records,
    per bucket, that it was launched during the backward."""
    cfg = tiny_config(1, 1, 1, parallel=dict(bucket_size=16 * KIB, schedule="zero_bubble"),
                      model=dict(tie_embeddings=True))
    module, plan = build_program(cfg, tmp_path)
    module.main(["--plan", str(tmp_path / "plan.json"), "--metrics-dir", str(tmp_path / "m"), "--steps", "1",
                 "--checkpoint-dir", ""])
    rec = json.loads((tmp_path / "m" / "rank0.json").read_text())
    want = [b["elements"] for b in plan["comm"]["grad_buckets"]["per_stage"][0]["dense"]]
    assert [b["elements"] for b in rec["grad_buckets"]] == want and len(want) > 1
    assert all(b["early"] for b in rec["grad_buckets"][:-1])


def test_export_rounds_bucket_bytes_up_to_elements():
    """Megatron and DeepSpeed count elements; a bucket closes at >= bucket_size bytes, so
    10 B is 3 elements, not 2."""
    from parcompile.exporters import export

    cfg = tiny_config(dp=2, parallel=dict(bucket_size=10))
    plan = compile_config(cfg)
    assert "--ddp-bucket-size 3" in " ".join(export(plan, "megatron").text.split())
    assert '"reduce_bucket_size": 3' in export(plan, "deepspeed").text


# --------------------------------------------------------------------------------------
# issue 16: the reduce dtype and the order ZeRO-3 gathers units in


def test_bucket_element_bytes_follow_the_reduce_dtype_where_it_applies():
    """``reduce_dtype`` sets the bytes of the buckets reduced per micro-batch (zero 2, 3, not
    zero-bubble); buckets reduced once per step stay fp32."""
    from types import SimpleNamespace

    from parcompile.analysis.buckets import bucket_element_bytes
    from parcompile.core.data_parallel import data_parallel_sharding

    for zero in range(4):
        for schedule in ("1f1b", "zero_bubble"):
            per_mb = zero >= 2 and schedule != "zero_bubble"
            dps = data_parallel_sharding(SimpleNamespace(zero=zero, dp=2, cp=1, schedule=schedule))
            assert dps.per_microbatch == per_mb
            assert bucket_element_bytes(dps, "fp32") == GRAD_BYTES
            for rd in ("bf16", "fp16"):
                assert bucket_element_bytes(dps, rd) == (2 if per_mb else GRAD_BYTES)
                # Megatron-Core (engine megatron): the step's buffers are in the reduce dtype too
                assert bucket_element_bytes(dps, rd, step_buffers=True) == 2
            assert bucket_element_bytes(dps, "fp32", step_buffers=True) == GRAD_BYTES


def test_units_in_forward_order_and_what_the_backward_reads():
    """ZeRO-3's just-in-time rule walks a chunk's units in forward order: the embedding,
    the layers by id (not by name), the output layer; the embedding's backward reads no
    weight, the output layer's bucket is kept through its backward."""
    from parcompile.analysis.buckets import (Bucket, bucket_positions, holds_output, needed_in_backward,
                                            unit_position, zero3_just_in_time)

    names = ["output", "layers.10", "layers.9", "layers.0", "embedding"]
    assert sorted(names, key=unit_position) == ["embedding", "layers.0", "layers.9", "layers.10", "output"]
    emb, mixed, out = Bucket(0, ("embedding",), 4), Bucket(0, ("layers.0", "embedding"), 9), Bucket(0, ("output",), 3)
    assert [needed_in_backward(b) for b in (emb, mixed, out)] == [False, True, True]
    assert [holds_output(b) for b in (emb, mixed, out)] == [False, False, True]
    assert bucket_positions(mixed) == (unit_position("embedding"), unit_position("layers.0"))
    # pp = 1: all just in time but a tied embedding's; pp > 1: layer buckets only
    assert [zero3_just_in_time(b, True) for b in (emb, mixed, out)] == [True, True, True]
    assert [zero3_just_in_time(b, True, head_reads_embedding=True) for b in (emb, mixed, out)] == [False, False, True]
    assert [zero3_just_in_time(b, False) for b in (emb, mixed, out)] == [False, False, False]


def test_16_bit_buckets_need_16_bit_parameters():
    """The runtime refuses a 16-bit reduce dtype for fp32 parameters (their gradients could
    not be views of a 16-bit bucket); the checker refuses such a spec first."""
    layer = nn.Linear(4, 4, bias=False)
    layer.weight.global_name = "layers.0.w"
    axis = Axis("dp_cp", [0, 1], 0)
    with pytest.raises(ValueError, match="reduce_dtype bf16 needs bf16 parameters"):
        GradBuckets([layer.weight], [[0]], axis, 64, sharded=True, scale=0.5, per_microbatch=True, reduce_dtype="bf16")
    layer = layer.to(torch.bfloat16)
    layer.weight.global_name = "layers.0.w"
    gb = GradBuckets([layer.weight], [[0]], axis, 64, sharded=True, scale=0.5, per_microbatch=True,
                     reduce_dtype="bf16")
    gb.prepare(layer.weight)
    assert gb.buckets[0].flat.dtype == torch.bfloat16 and gb.peak_bytes == 2 * 16
    assert gb.buckets[0].acc.dtype == torch.float32


def test_fp8_gather_elements_holds_every_rank_of_every_layout():
    """FP8 all-gather (issue 32): whatever the order of FP8 and 16-bit parameters in a
    bucket, each rank's FP8 elements fit the E4M3 all-gather and its other elements (the
    padding with them) the 16-bit one; and a bound is met by some layout (not loose)."""
    import itertools
    import random

    from parcompile.core.buckets import fp8_gather_elements
    rng = random.Random(0)
    for _ in range(300):
        sizes = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
        fp8 = [rng.random() < 0.6 for _ in sizes]
        d = rng.randint(1, 5)
        n, f = sum(sizes), sum(s for s, x in zip(sizes, fp8) if x)
        n8, n16 = fp8_gather_elements(n, f, d)
        shard = -(-n // d)
        best8 = best16 = 0
        for order in itertools.islice(itertools.permutations(range(len(sizes))), 24):
            flags = [x for i in order for x in [fp8[i]] * sizes[i]] + [False] * (shard * d - n)
            for r in range(d):
                mine = flags[r * shard:(r + 1) * shard]
                assert sum(mine) <= n8 and len(mine) - sum(mine) <= n16, (sizes, fp8, d, order, r)
                best8, best16 = max(best8, sum(mine)), max(best16, len(mine) - sum(mine))
        if len(sizes) == 1 or d == 1:
            assert (best8, best16) == (n8, n16)


def test_per_microbatch_reduction_refuses_a_split_backward():
    """The buckets reduce per micro-batch as the plan's DataParallelSharding.per_microbatch
    says (core/data_parallel.py: not under zero_bubble); an action list with B/W halves
    given to per-micro-batch buckets is an error, not a silent switch to once per step."""
    from parcompile.core.schedule import build_actions

    layer = nn.Linear(4, 4, bias=False)
    layer.weight.global_name = "layers.0.w"
    axis = Axis("dp_cp", [0, 1], 0)
    zb, plain = build_actions("zero_bubble", 1, 2), build_actions("1f1b", 1, 2)
    per_mb = GradBuckets([layer.weight], [[0]], axis, 64, sharded=True, scale=0.5, per_microbatch=True)
    GradSync([per_mb]).start(plain[0])
    with pytest.raises(RuntimeError, match="split backward"):
        GradSync([per_mb]).start(zb[0])
    once = GradBuckets([layer.weight], [[0]], axis, 64, sharded=True, scale=0.5, per_microbatch=False)
    GradSync([once]).start(zb[0])
    assert once.buckets[0].flat is not None   # full buffers for the step, reduced once
