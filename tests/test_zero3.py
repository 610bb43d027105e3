"""ZeRO-3 gathers parameters just in time (issue 7): the rule (analysis/buckets.py), what
the plan says of it (all-gathers per step, the ``zero3_gather`` buffer), the search's
fast memory path agreeing with the plan, and one torchrun run holding exactly the plan's
gathered bytes, fewer than the whole stage's."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from parcompile.analysis.buckets import Bucket, reshard_after_forward, zero3_gather_counts, zero3_gathered
from parcompile.driver import compile_config
from parcompile.layout_search import Coster
from tests.program_utils import tiny_config
from tests.verify_batch import result_of, verify_fixture


def test_rule_pp1_gathers_every_bucket_just_in_time():
    """pp = 1: every bucket only while its units run (issue 16: the embedding and the output
    layer too, as torchtitan's FSDP2 does), the most held at once being the buckets of two
    units adjacent in forward order [embedding, layers, output]; padded to a multiple of d.
    A tied embedding (the LM head reads it) is kept for the step."""
    dense = [Bucket(0, ("output", "layers.3"), 10), Bucket(0, ("layers.2", "layers.1"), 7),
             Bucket(0, ("layers.0",), 5), Bucket(0, ("embedding",), 4)]
    expert = [Bucket(0, ("layers.3",), 3), Bucket(0, ("layers.1",), 6)]
    # d = 2: output+3 -> 10, layers 2,1 -> 8, layer 0 -> 6, embedding -> 4; experts (ed = 4):
    # layer 3 -> 4, layer 1 -> 8. Neighbours in forward order hold: embedding + 0: 4 + 6 = 10;
    # 0 + 1: 6 + 8 + 8 = 22; 1 + 2: 8 + 8 = 16; 2 + 3: 8 + 10 + 4 = 22; 3 + output: 10 + 4 = 14.
    assert zero3_gathered([(dense, 2), (expert, 4)], per_microbatch=True) == (0, 22)
    # tied embedding (pp = 1): its bucket for the step; the neighbours' sums are the same
    assert zero3_gathered([(dense, 2), (expert, 4)], per_microbatch=True, head_reads_embedding=True) == (4, 22)
    # one layer in the chunk: no neighbour
    assert zero3_gathered([([Bucket(0, ("layers.0",), 6)], 2)], per_microbatch=True) == (0, 6)
    # the output layer next to the last layer: 10 + 6 (not the embedding's 4 + 6)
    assert zero3_gathered([([Bucket(0, ("output",), 10), Bucket(0, ("layers.0",), 6),
                             Bucket(0, ("embedding",), 4)], 2)], per_microbatch=True) == (0, 16)
    # kept across micro-batches (pp > 1): every bucket at once
    assert zero3_gathered([(dense, 2), (expert, 4)], per_microbatch=False) == (10 + 8 + 6 + 4 + 4 + 8, 0)
    # one rank in the group: nothing sharded, nothing gathered
    assert zero3_gathered([(dense, 1), (expert, 1)], per_microbatch=True) == (0, 0)
    # m = 3: a layer bucket 2 m (forward, backward); the output layer's m (kept from its forward
    # through its backward); the embedding's m (its backward reads the token ids only)
    assert zero3_gather_counts(dense, 3, True) == [3, 6, 6, 3]
    assert zero3_gather_counts(dense, 3, True, head_reads_embedding=True) == [3, 6, 6, 1]
    assert zero3_gather_counts(dense, 3, False) == [1, 1, 1, 1]
    assert reshard_after_forward(1) and not reshard_after_forward(2)


def _padded(rows, d):
    return [math.ceil(r["elements"] / d) * d for r in rows]


def _layer_only(row) -> bool:
    return all(u.startswith("layers.") for u in row["units"])


def _held_pp1(buckets: list[dict], d: int) -> int:
    """Elements a pp = 1 rank holds at most, from the plan's bucket listing when every
    bucket holds one unit: over the units in forward order (embedding, layers by id,
    output layer), the largest sum of two neighbours' (one runs while the next is
    prefetched; the output layer's backward while the last layer is)."""
    full = _padded(buckets, d)
    assert all(len(b["units"]) == 1 for b in buckets)
    order = {"embedding": -1, "output": 10**9}
    by_pos = sorted((order.get(b["units"][0]) if b["units"][0] in order else int(b["units"][0].split(".")[1]), f)
                    for b, f in zip(buckets, full))
    return max(x + y for (_, x), (_, y) in zip(by_pos, by_pos[1:]))


def _gathers_pp1(row, m: int) -> int:
    """All-gathers per step of a one-unit bucket with pp = 1: a layer's twice per micro-batch
    (forward, backward), the output layer's once (kept from its forward through its
    backward), the embedding's once (its backward reads no weight)."""
    return 2 * m if _layer_only(row) else m


@pytest.mark.parametrize("pp", [1, 2])
def test_plan_counts_the_gathers_and_the_buffer(pp):
    """From the plan's own bucket listing (comm.grad_buckets): with pp = 1 each layer-only
    bucket is all-gathered 2 m times per step, the embedding's and the output layer's m
    times, and the buffer is two neighbouring units' buckets; with pp = 2 once per step and
    every bucket."""
    cfg = tiny_config(dp=2, pp=pp, model=dict(dtype="bf16"), parallel=dict(zero=3, bucket_size=4))
    plan = compile_config(cfg).data
    m = cfg.parallel.num_microbatches
    for s, row in enumerate(plan["comm"]["grad_buckets"]["per_stage"]):
        buckets = row["dense"]
        full = _padded(buckets, 2)
        gathers, want = Counter(), Counter()   # runs per step by size (equal sizes share an entry)
        for c in plan["comm"]["collectives"]:
            if c["stage"] == s and c["where"] == "params":
                gathers[c["bytes"]] += c["count"]
        for b, f in zip(buckets, full):
            want[2 * f] += _gathers_pp1(b, m) if pp == 1 else 1
        assert gathers == want
        got = plan["memory"]["per_stage"][s]["buffer_parts"]["zero3_gather"]
        if pp == 1:
            assert got == 2 * _held_pp1(buckets, 2) < 2 * sum(full)
        else:
            assert got == 2 * sum(full)


@pytest.mark.parametrize("layout", ["dense", "moe", "tied_full"])
def test_search_peak_equals_plan_with_zero3_pp1(layout):
    """The search's integer memory path mirrors the plan's just-in-time buffer and the
    gradient buckets in flight (ZeRO 2 and 3), and the full buffers of zero-bubble."""
    model = {"dense": {}, "moe": dict(experts=4, top_k=2), "tied_full": dict(tie_embeddings=True)}[layout]
    for bucket_size, rc, zero, pp in itertools.product([4, 64 * 1024, 160 * 10**6], ["none", "full"], [2, 3], [1, 2]):
        extra = dict(schedule="zero_bubble") if pp == 2 and bucket_size == 4 else {}
        cfg = tiny_config(dp=4, pp=pp, model=dict(model, dtype="bf16"),
                          parallel=dict(zero=zero, bucket_size=bucket_size, recompute=rc, **extra))
        plan = compile_config(cfg).data
        coster = Coster(cfg)
        counts = cfg.parallel.layers_per_chunk(cfg.model.layers)
        assert coster.peak(cfg, coster.probe(cfg.parallel), counts) == (plan["memory"]["peak"],
                                                                        plan["memory"]["capacity"])


@pytest.mark.torchrun
def test_program_holds_one_layer_at_a_time(tmp_path):
    """dp 2, pp 1, one bucket per layer, full recomputation (the layer's forward runs again
    inside its backward): the program's most gathered bytes equal the plan's buffer, which
    is less than the stage's parameters, and it runs the plan's 2 m all-gathers per layer
    bucket and m per embedding and output bucket (every collective is compared with the
    plan), prefetches included."""
    from parcompile.verification import compare_with_plan, measure

    cfg = tiny_config(dp=2, parallel=dict(zero=3, bucket_size=4, recompute="full"))
    plan, records = measure(cfg, tmp_path, steps=1)
    want = plan["memory"]["per_stage"][0]["buffer_parts"]["zero3_gather"]
    buckets = plan["comm"]["grad_buckets"]["per_stage"][0]["dense"]
    # 4 layers, an embedding and an output layer: two neighbouring units' buckets, not all six
    assert want == 4 * _held_pp1(buckets, 2) < 4 * sum(_padded(buckets, 2))
    grads = plan["memory"]["per_stage"][0]["buffer_parts"]["grad_buckets_in_flight"]
    for r in records:
        assert r["zero3_gathered"] == want
        # fp32, padded buckets: two adjacent ones in flight, not all of them
        assert r["grad_buckets_in_flight"] == grads == 4 * _in_flight(buckets, 2) < 4 * sum(_padded(buckets, 2))
    checks = compare_with_plan(records, plan)
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]


VERIFY_CASES = {
    # MoE: dense and expert layer buckets (one per layer), each gathered and prefetched on
    # its own group, with the layer's forward run again inside its backward
    "moe_dp2_full": (tiny_config(2, model=dict(experts=4, top_k=2),
                                 parallel=dict(zero=3, bucket_size=4, recompute="full")), "fp32"),
    # 16-bit slices gathered, tensor and sequence parallel inside the gathered layers
    "bf16_dp2_tp2_sp": (tiny_config(2, 2, model=dict(dtype="bf16"),
                                    parallel=dict(zero=3, bucket_size=4, sequence_parallel=True)), "bf16"),
}


verified = verify_fixture(__name__, lambda test, case: VERIFY_CASES[case])   # launches shared with other modules


@pytest.mark.torchrun
@pytest.mark.parametrize("case", sorted(VERIFY_CASES))
def test_just_in_time_layouts_match_single_process(case, verified, request):
    """``parcompile verify`` with one bucket per layer (every layer gathered just in time,
    prefetched, freed): losses, gradients and parameters match the single-process
    reference, and the gathered bytes, collectives and state bytes match the plan."""
    result = result_of(verified, request, case)
    assert result.ok, result.table()
    assert any(c.what.startswith("ZeRO-3 gathered") and c.ok for c in result.checks), result.table()


@pytest.mark.parametrize("pp", [1, 2])
def test_report_says_how_zero3_gathers(pp):
    cfg = tiny_config(dp=2, pp=pp, parallel=dict(zero=3, bucket_size=4))
    plan = compile_config(cfg)
    line = next(x for x in plan.report_md().splitlines() if x.startswith("ZeRO-3 gathers"))
    assert ("pp = 1" in line) == (pp == 1) and ("pp > 1" in line) == (pp > 1)
    for st in plan.data["memory"]["per_stage"]:
        n = sum(c["count"] for c in plan.data["comm"]["collectives"]
                if c["stage"] == st["stage"] and c["where"] == "params")
        assert f"stage {st['stage']}: " in line and f"{n:,} all-gathers per step" in line
    # without ZeRO-3 (or with one data-parallel rank) nothing is gathered, nothing said
    for other in (tiny_config(dp=2, pp=pp, parallel=dict(zero=2)), tiny_config(dp=1, pp=pp, parallel=dict(zero=3))):
        assert "ZeRO-3 gathers" not in compile_config(other).report_md()


def _in_flight(buckets, d):
    """ZeRO 2/3 reducing per micro-batch: the most full buckets held at once, the largest
    sum of two adjacent (padded) buckets of a chunk (one alone in a chunk of one)."""
    best = 0
    for c in {b["chunk"] for b in buckets}:
        sizes = [-(-b["elements"] // d) * d for b in buckets if b["chunk"] == c]
        best = max([best, sizes[0]] + [x + y for x, y in zip(sizes, sizes[1:])])
    return best


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_plan_counts_gradient_buffers(zero):
    """Gradients live in one fp32 buffer per bucket, padded to a multiple of d with ZeRO:
    kept as state at zero 0 and 1; at 2 and 3, whose state is the owned slices, each bucket
    is reduce-scattered in every micro-batch and only the buckets in flight are held in
    full (``grad_buckets_in_flight``): two adjacent ones at most, m reduce-scatters each."""
    cfg = tiny_config(dp=3, parallel=dict(zero=zero, bucket_size=4096))
    plan = compile_config(cfg).data
    st = plan["memory"]["per_stage"][0]
    buckets = plan["comm"]["grad_buckets"]["per_stage"][0]["dense"]
    padded = sum(_padded(buckets, 3))
    n = sum(b["elements"] for b in buckets)
    assert padded > n   # some bucket is not a multiple of 3: the padding shows
    want_state = {0: 4 * n, 1: 4 * padded, 2: 4 * padded // 3, 3: 4 * padded // 3}[zero]
    assert st["grads"] == want_state
    assert "full_grads" not in st["buffer_parts"]
    assert st["buffer_parts"].get("grad_buckets_in_flight", 0) == (4 * _in_flight(buckets, 3) if zero >= 2 else 0)
    assert zero < 2 or 0 < 4 * _in_flight(buckets, 3) < 4 * padded
    m = plan["schedule"]["num_microbatches"]
    counts = [c["count"] for c in plan["comm"]["collectives"] if c["where"] == "grads"]
    assert sum(counts) == len(buckets) * (m if zero >= 2 else 1)


def test_zero_bubble_keeps_one_reduction_per_step():
    """The zero-bubble schedule (B before W) keeps ZeRO-2's once-per-step reduction, and
    its full buffers (``full_grads``)."""
    cfg = tiny_config(dp=2, pp=2, parallel=dict(zero=2, bucket_size=4096, schedule="zero_bubble"))
    plan = compile_config(cfg).data
    for st in plan["memory"]["per_stage"]:
        buckets = plan["comm"]["grad_buckets"]["per_stage"][st["stage"]]["dense"]
        assert st["buffer_parts"]["full_grads"] == 4 * sum(_padded(buckets, 2))
        assert "grad_buckets_in_flight" not in st["buffer_parts"]
    n = sum(len(x["dense"]) for x in plan["comm"]["grad_buckets"]["per_stage"])
    assert sum(c["count"] for c in plan["comm"]["collectives"] if c["where"] == "grads") == n


def test_verify_flags_a_rank_that_holds_more_than_the_plan():
    """The verify rows for the ZeRO buffers fail on any difference, name the rank, and are
    absent for programs that do not record them."""
    from parcompile.verification import _buffer_check

    plan = compile_config(tiny_config(dp=2, parallel=dict(zero=3, bucket_size=4))).data
    want = plan["memory"]["per_stage"][0]["buffer_parts"]["zero3_gather"]
    ok = _buffer_check([{"rank": 0, "stage": 0, "zero3_gathered": want}], plan, "zero3_gathered", "zero3_gather", "g")
    bad = _buffer_check([{"rank": 0, "stage": 0, "zero3_gathered": want},
                         {"rank": 1, "stage": 0, "zero3_gathered": want + 2}], plan,
                        "zero3_gathered", "zero3_gather", "g")
    assert ok.ok and not bad.ok and bad.detail.startswith("rank 1:")
    assert _buffer_check([{"rank": 0, "stage": 0}], plan, "grad_buckets_in_flight",
                         ("grad_buckets_in_flight", "full_grads"), "f") is None
