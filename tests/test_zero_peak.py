"""Issue 16, first item: ZeRO-2/3 lower the planned peak.

ZeRO 2 and 3 reduce-scatter every gradient bucket in each micro-batch's backward and keep
only the rank's fp32 shard across the step (DeepSpeed ZeRO-2, FSDP2), so the full fp32
gradients are never all alive at once: the plan holds the buckets in flight
(``grad_buckets_in_flight``, two adjacent buckets of a chunk at most) instead of all of
them. With ``pp = 1`` ZeRO-3 gathers every bucket just in time, the embedding and the
output layer too (FSDP2 / torchtitan), so it holds two neighbouring units' buckets at
most; ``reduce_dtype = bf16`` holds and reduce-scatters the buckets in flight in 16 bits
(FSDP2's ``MixedPrecisionPolicy(reduce_dtype)``, DeepSpeed's ``communication_data_type``);
and the logits and the recomputation's working set, never alive at once, count as the
larger of the two. These tests hold the issue's "done when" figures on the plan, and the
new rules against closed forms from element counts.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

import parcompile
from parcompile.analysis.memory import buffer_total
from parcompile.driver import compile_config
from parcompile.layout_search import Coster
from tests.program_utils import tiny_config
from tests.verify_batch import result_of, verify_fixture


def _llama3_8b(tp: int, zero: int) -> str:
    # 8 x H100, dp = 8 / tp, micro-batch 1, 4 micro-batches per step
    return f"""
model m from "llama3-8b" {{ }}
cluster c from "h100-sxm" {{ nodes = 1 }}
parallel {{
    tp = {tp}
    dp = auto
    zero = {zero}
    micro_batch = 1
    global_batch = {4 * 8 // tp}
}}
train {{ optimizer = adamw }}
"""


@pytest.mark.parametrize("tp", [1, 2])
def test_llama3_8b_peak_decreases_with_every_zero_stage(tp):
    """Llama-3 8B on 8 x H100 at tp 1 (dp 8) and tp 2 (dp 4), m = 4: the planned peak
    strictly decreases from zero 0 to 1 to 2 to 3 (issue 16: zero 2 and 3 used to hold
    every full fp32 gradient buffer through the backward and planned above zero 1)."""
    peaks = []
    for zero in range(4):
        plan = parcompile.compile(_llama3_8b(tp, zero)).data
        assert plan["schedule"]["num_microbatches"] == 4
        assert plan["degrees"]["dp"] == 8 // tp
        parts = plan["memory"]["per_stage"][0]["buffer_parts"]
        assert "full_grads" not in parts
        assert ("grad_buckets_in_flight" in parts) == (zero >= 2)
        peaks.append(plan["memory"]["peak"])
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3], [round(p / 2**30, 2) for p in peaks]


def deepspeed_zero3_estimate(total_params: int, largest_layer_params: int, gpus: int) -> int:
    """DeepSpeed's ZeRO-3 model-states estimator without offload
    (``deepspeed/runtime/train/zero/stage3.py: estimate_zero3_model_states_mem_needs``, documented
    in DeepSpeed's "Memory Requirements" page): ``largest_layer_memory + 18 * total_params /
    total_gpus`` bytes per GPU, with ``largest_layer_memory = 4 * largest_layer_params`` (the
    16-bit parameters and gradients of the largest module) and 18 bytes per parameter
    of 16-bit parameters, fp32 gradients and Adam's fp32 master weights and two moments,
    all sharded."""
    return 4 * largest_layer_params + int(18 * total_params / gpus)


LLAMA3_70B_ZERO3 = """
model m from "llama3-70b" { seq_len = 4096 }
cluster c from "a100-80gb" { nodes = 4 }
parallel {
    tp = 1
    pp = 1
    dp = auto
    zero = 3
    reduce_dtype = bf16
    recompute = full
    micro_batch = 1
    global_batch = 32
}
train { optimizer = adamw }
"""


def _llama3_70b(spec: str = LLAMA3_70B_ZERO3):
    plan = parcompile.compile(spec).data
    st = plan["memory"]["per_stage"][0]
    total = plan["model"]["params"]
    # the largest module: the embedding (= the LM head), padded vocab x hidden
    largest = plan["model"]["padded_vocab"] * plan["model"]["hidden"]
    ds = deepspeed_zero3_estimate(total, largest, plan["degrees"]["dp"])
    return plan, st, ds


def test_llama3_70b_zero3_model_states_are_deepspeeds():
    """Llama-3 70B full fine-tune, 32 x A100 80 GB, tp 1, pp 1, seq 4096, full recompute,
    zero 3: the plan's model states are DeepSpeed's 18 bytes per parameter over 32 GPUs
    (within the bucket padding), and the plan no longer holds the model's full fp32
    gradients (316 GiB before issue 16): its full gradient buffers are two buckets."""
    plan, st, ds = _llama3_70b()
    states = st["params"] + st["grads"] + st["optimizer"]
    assert states == pytest.approx(18 * plan["model"]["params"] / 32, rel=1e-4)
    assert st["buffer_parts"]["grad_buckets_in_flight"] < 8 * 2**30
    assert plan["memory"]["peak"] < 64 * 2**30    # was 316 GiB


def test_llama3_70b_zero3_within_10_percent_of_deepspeeds_estimate():
    """The issue's figure: within 10% of DeepSpeed's estimator for its model states plus the
    plan's own activations. The spec reduces in bf16 (``reduce_dtype = bf16``), as DeepSpeed
    does by default for a bf16 model (``communication_data_type`` defaults to the model's
    dtype), and as the estimator counts: its ``4 x largest layer`` is a 16-bit layer and its
    16-bit gradient (2 + 2 bytes per parameter). The plan is above it by what DeepSpeed's
    formula leaves out and the program holds: two neighbouring units gathered at once (the
    output layer, 1.05 B elements, while the last layer is prefetched) and two 16-bit
    buckets in flight, against one largest layer's parameters and gradient; and the larger
    of the logits and the recomputation's working set."""
    plan, st, ds = _llama3_70b()
    want = ds + st["activations"]
    assert plan["memory"]["peak"] == pytest.approx(want, rel=0.10)


#: Llama-3 70B (Meta's config.json): hidden, layers, FFN width, query and kv heads, vocabulary
H, LAYERS, FFN, HEADS, KV_HEADS, VOCAB = 8192, 80, 28672, 64, 8, 128256


def _pad(n: int, d: int) -> int:
    return math.ceil(n / d) * d


@pytest.mark.parametrize("reduce_dtype", ["bf16", "fp32"])
def test_llama3_70b_zero3_buffers_from_element_counts(reduce_dtype):
    """The 70B plan from element counts alone (not from the plan's buckets): a decoder
    layer has ``2 h^2 + 2 h (kv_heads * head_dim) + 3 h ffn + 2 h`` parameters (q, o; k, v;
    SwiGLU; two RMSNorms), the output layer ``V h + h`` (LM head, final norm), the
    embedding ``V h``; each is a bucket of its own (every one exceeds the 40M-element
    default bucket) padded to a multiple of d = 32. ZeRO-3 with pp = 1 holds the largest
    pair of neighbours in [embedding, layer 0..79, output] in bf16: the output layer and
    the last layer; the buckets in flight are the largest two adjacent buckets in gradient
    order (output, layers 79..0, embedding), in the reduce dtype; the buffers add the larger
    of the logits (``2 s V`` bytes, micro-batch 1) and the recomputation's working set; the
    model states are ``(2 + 4 + 12)`` bytes per element of the padded shards."""
    plan, st, _ = _llama3_70b(LLAMA3_70B_ZERO3.replace("bf16", reduce_dtype))
    d, seq = 32, 4096
    head_dim = H // HEADS
    layer = 2 * H * H + 2 * H * KV_HEADS * head_dim + 3 * H * FFN + 2 * H
    output, embedding = VOCAB * H + H, VOCAB * H
    assert plan["model"]["params"] == LAYERS * layer + output + embedding
    parts = st["buffer_parts"]
    assert parts["zero3_gather"] == 2 * (_pad(output, d) + _pad(layer, d))
    nbytes = {"bf16": 2, "fp32": 4}[reduce_dtype]
    assert parts["grad_buckets_in_flight"] == nbytes * (_pad(output, d) + _pad(layer, d))
    assert parts["logits"] == 2 * seq * VOCAB
    # the buckets in flight (output layer, layer 79) are full once layer 79's backward has
    # freed its kept input (full recomputation: 2 s h bytes, micro-batch 1): they count net of it
    assert st["buffers"] == parts["zero3_gather"] + parts["grad_buckets_in_flight"] + max(
        parts["logits"], parts["recompute"]) - 2 * seq * H
    shard = (_pad(output, d) + LAYERS * _pad(layer, d) + _pad(embedding, d)) // d
    assert (st["params"], st["grads"], st["optimizer"]) == (2 * shard, 4 * shard, 12 * shard)
    assert plan["memory"]["peak"] == 18 * shard + st["activations"] + st["buffers"]
    # the reduce-scatters: m = 1 per bucket, ceil(n / d) elements of the reduce dtype each
    assert _runs(plan, "grads") == Counter({nbytes * _pad(output, d) // d: 1, nbytes * _pad(embedding, d) // d: 1,
                                            nbytes * _pad(layer, d) // d: LAYERS})
    assert plan["comm"]["grad_buckets"]["reduce_dtype"] == reduce_dtype


def _runs(plan: dict, where: str, stage: int | None = None) -> Counter:
    """Runs per step of the plan's collectives of ``where``, by size (equal sizes share an
    entry in ``comm.collectives``)."""
    out = Counter()
    for c in plan["comm"]["collectives"]:
        if c["where"] == where and stage in (None, c["stage"]):
            out[c["bytes"]] += c["count"]
    return out


def _in_flight(buckets, d):
    """Elements of the largest two adjacent (padded) buckets of a chunk (one alone in a
    chunk of one): the buckets a rank holds in flight."""
    best = 0
    for c in {b["chunk"] for b in buckets}:
        sizes = [_pad(b["elements"], d) for b in buckets if b["chunk"] == c]
        best = max([best, sizes[0]] + [x + y for x, y in zip(sizes, sizes[1:])])
    return best


@pytest.mark.parametrize("zero,pp", [(2, 1), (3, 1), (2, 2), (3, 2)])
def test_reduce_dtype_halves_buckets_in_flight_and_reduce_scatters(zero, pp):
    """bf16 model, dp 4, several buckets: with ``reduce_dtype = bf16`` the buckets in flight
    are 2 bytes per (padded) element and each micro-batch's reduce-scatter sends 2 bytes per
    shard element, against 4 with fp32; the fp32 gradient shards (state), the parameter
    all-gathers and the counts (m per bucket) do not change."""
    plans = {}
    for rd in ("fp32", "bf16"):
        cfg = tiny_config(dp=4, pp=pp, model=dict(dtype="bf16"),
                          parallel=dict(zero=zero, bucket_size=4096, reduce_dtype=rd))
        plans[rd] = compile_config(cfg).data
    m = plans["bf16"]["schedule"]["num_microbatches"]
    assert m >= 2
    for rd, nbytes in (("fp32", 4), ("bf16", 2)):
        plan = plans[rd]
        for st in plan["memory"]["per_stage"]:
            buckets = plan["comm"]["grad_buckets"]["per_stage"][st["stage"]]["dense"]
            assert st["buffer_parts"]["grad_buckets_in_flight"] == nbytes * _in_flight(buckets, 4)
            assert st["grads"] == 4 * sum(_pad(b["elements"], 4) for b in buckets) // 4
            want = Counter()
            for b in buckets:
                want[nbytes * _pad(b["elements"], 4) // 4] += m
            assert _runs(plan, "grads", st["stage"]) == want
    assert _runs(plans["fp32"], "params") == _runs(plans["bf16"], "params")
    assert [s["params"] + s["optimizer"] for s in plans["fp32"]["memory"]["per_stage"]] == \
        [s["params"] + s["optimizer"] for s in plans["bf16"]["memory"]["per_stage"]]


def test_zero3_pp1_tied_embedding_is_kept_for_the_step():
    """Tied embeddings with pp = 1: the LM head reads the embedding table, so its bucket is
    gathered once per step and kept; every other bucket (the output layer is its final norm
    alone) just in time: the buffer is the embedding's bucket plus the largest pair of
    neighbours among [layer 0..3, output] (the embedding is not just in time), and the
    counts are 2 m per layer bucket, m for the output layer's, 1 for the embedding's."""
    cfg = tiny_config(dp=2, model=dict(dtype="bf16", tie_embeddings=True), parallel=dict(zero=3, bucket_size=4))
    plan = compile_config(cfg).data
    m = cfg.parallel.num_microbatches
    h, v, L = cfg.model.hidden, cfg.model.padded_vocab(1), cfg.model.layers
    buckets = {tuple(b["units"]): b["elements"] for b in plan["comm"]["grad_buckets"]["per_stage"][0]["dense"]}
    assert buckets[("embedding",)] == v * h and buckets[("output",)] == h
    layer = buckets[("layers.0",)]
    pairs = [2 * _pad(layer, 2)] * (L - 1) + [_pad(layer, 2) + _pad(h, 2)]
    st = plan["memory"]["per_stage"][0]
    assert st["buffer_parts"]["zero3_gather"] == 2 * (_pad(v * h, 2) + max(pairs))
    assert _runs(plan, "params") == Counter({2 * _pad(v * h, 2): 1, 2 * _pad(layer, 2): 2 * m * L, 2 * _pad(h, 2): m})


def test_logits_and_recompute_count_as_the_larger():
    """The logits (alive from the LM head's forward until the loss has its fp32 copy; their
    gradient from the loss's backward through the LM head's) and the recomputation's
    working set (alive inside one layer's backward) are never alive at once: the stage's
    buffers are the sum of the other parts plus the larger of the two (the gradient buckets
    in flight net of the activations their layers' backward freed)."""
    assert buffer_total({"logits": 5, "recompute": 7, "p2p": 3}) == 10
    assert buffer_total({"logits": 9, "recompute": 7, "zero3_gather": 1}) == 10
    assert buffer_total({"logits": 9, "tp_gather": 2}) == 11
    for rc in ("full", "none"):
        cfg = tiny_config(dp=2, pp=2, model=dict(dtype="bf16", vocab=4096),
                          parallel=dict(zero=3, recompute=rc, bucket_size=4096))
        plan = compile_config(cfg).data
        last = plan["memory"]["per_stage"][-1]
        parts = last["buffer_parts"]
        assert parts["logits"] == 2 * cfg.parallel.micro_batch * cfg.model.seq_len * cfg.model.padded_vocab(1)
        assert ("recompute" in parts) == (rc != "none")
        others = sum(b for k, b in parts.items() if k not in ("logits", "recompute"))
        # less the kept bytes of the one or two layers whose backward filled the buckets in
        # flight (analysis/memory.py backward_freed)
        kept = {b for _, b in last["activations_per_layer"]}.pop()
        freed = others + max(parts["logits"], parts.get("recompute", 0)) - last["buffers"]
        assert freed in {min(parts["grad_buckets_in_flight"], k * kept) for k in (1, 2)}
        assert last["total"] == last["params"] + last["grads"] + last["optimizer"] + last["activations"] + \
            last["buffers"]


@pytest.mark.parametrize("tied", [False, True])
def test_search_peak_mirrors_the_plan_with_16_bit_reduces(tied):
    """The search's integer memory path (``Coster.peak``) equals the plan's peak with bf16
    reduces, the just-in-time embedding and output layer (pp = 1) and the larger of the
    logits and the recomputation's working set."""
    for zero, pp, rc, bucket_size in [(2, 1, "full", 4096), (3, 1, "full", 4), (3, 1, "selective", 64 * 1024),
                                      (3, 2, "full", 4096), (2, 2, "none", 4)]:
        cfg = tiny_config(dp=4, pp=pp, model=dict(dtype="bf16", tie_embeddings=tied),
                          parallel=dict(zero=zero, recompute=rc, bucket_size=bucket_size, reduce_dtype="bf16"))
        plan = compile_config(cfg).data
        coster = Coster(cfg)
        counts = cfg.parallel.layers_per_chunk(cfg.model.layers)
        assert coster.peak(cfg, coster.probe(cfg.parallel), counts) == (plan["memory"]["peak"],
                                                                        plan["memory"]["capacity"]), (zero, pp, rc)


def _diags(text: str):
    from parcompile.diagnostics import SpecError
    from parcompile.frontend import load_spec

    try:
        return load_spec(text, filename="t.par")[1]
    except SpecError as e:
        return e.diagnostics


def _spec(dtype: str, reduce: str, zero: int = 2, dp: int = 2, schedule: str = "1f1b") -> str:
    return (f"model tiny {{ layers = 4, hidden = 64, heads = 4, vocab = 256, seq_len = 64, dtype = {dtype} }}\n"
            f'cluster local from "cpu" {{ nodes = 1, gpus_per_node = {2 * dp} }}\n'
            f"parallel {{\n    dp = {dp}\n    pp = 2\n    zero = {zero}\n    schedule = {schedule}\n"
            f"    reduce_dtype = {reduce}\n    global_batch = {4 * dp}\n}}\n")


def test_reduce_dtype_checks():
    """A 16-bit reduce dtype must be the model's (an error at the value, with a help); it
    has no effect where buckets are reduced once per step in fp32 (zero 0 and 1, the
    zero-bubble schedule) or with one data-parallel rank (a warning naming why)."""
    text = _spec("fp32", "bf16")
    [at] = [(i, line.index("=") + 3) for i, line in enumerate(text.splitlines(), 1) if "reduce_dtype" in line]
    [d] = [x for x in _diags(text) if "reduce_dtype" in x.message]
    assert d.severity == "error" and d.message == "reduce_dtype = bf16 needs a bf16 model; the model's dtype is fp32"
    assert (d.span.line, d.span.column) == at
    assert d.help == "`reduce_dtype = fp32` (an fp32 model reduces its fp32 gradients)"
    [d] = [x for x in _diags(_spec("bf16", "fp16")) if "reduce_dtype" in x.message]
    assert d.severity == "error" and d.help == "`reduce_dtype = fp32`, or `reduce_dtype = bf16`"
    assert not [x for x in _diags(_spec("bf16", "bf16")) if "reduce_dtype" in x.message]
    for zero, dp, schedule, why in [(1, 2, "1f1b", "with zero = 1 the generated program accumulates gradients"),
                                    (2, 2, "zero_bubble", "the zero-bubble schedule"),
                                    (3, 1, "1f1b", "with dp * cp = 1 no gradient")]:
        [d] = [x for x in _diags(_spec("bf16", "bf16", zero, dp, schedule)) if "reduce_dtype" in x.message]
        assert d.severity == "warning" and d.message.startswith(f"reduce_dtype = bf16 has no effect: {why}"), d.message
        assert (d.span.line, d.span.column) == at


def test_does_not_fit_help_suggests_a_16_bit_reduce():
    """A plan that does not fit at zero >= 2 with fp32 reduces of a 16-bit model is told it
    may reduce in 16 bits, and not once it does (or at zero 1, where it would not apply)."""
    from parcompile.frontend.checks import does_not_fit_help
    from parcompile.config.schema import ParallelConfig

    want = "hold and reduce-scatter the gradient buckets in bf16 (reduce_dtype = bf16)"
    assert want in does_not_fit_help(ParallelConfig(dp=4, zero=3, recompute="full"), "bf16")
    assert want not in does_not_fit_help(ParallelConfig(dp=4, zero=3, reduce_dtype="bf16"), "bf16")
    assert want not in does_not_fit_help(ParallelConfig(dp=4, zero=1), "bf16")
    assert "reduce_dtype" not in does_not_fit_help(ParallelConfig(dp=4, zero=2), "fp32")
    spec = LLAMA3_70B_ZERO3.replace("nodes = 4", "nodes = 1").replace("    reduce_dtype = bf16\n", "")
    [d] = [w for w in parcompile.compile(spec).warnings if w.code == "does-not-fit"]
    assert d.help == "raise tp or pp or " + want


def _build_16_bit(test: str, case: tuple[int, int]) -> tuple:
    zero, pp = case
    return tiny_config(dp=4, pp=pp, model=dict(dtype="bf16"),
                       parallel=dict(zero=zero, reduce_dtype="bf16",
                                     global_batch=4 * 4 * 2 if pp == 1 else 32)), "bf16"


verified = verify_fixture(__name__, _build_16_bit)   # launches shared with other modules


@pytest.mark.torchrun
@pytest.mark.parametrize("case", [(3, 1), (2, 2)], ids=["zero3_pp1", "zero2_pp2"])
def test_verify_16_bit_reduces(case, verified, request):
    """``parcompile verify`` of a bf16 miniature with ``reduce_dtype = bf16``, dp 4 and m = 4
    micro-batches: losses, gradients and parameters match the single-process reference, and
    the measured 16-bit buckets in flight (and, at zero 3 with pp = 1, the gathered
    parameters, embedding and output layer just in time) equal the plan's."""
    zero, pp = case
    result = result_of(verified, request, case)
    assert result.ok, result.table()
    rows = {c.what.split(" (")[0]: c for c in result.checks}
    assert rows["full gradient buffers at most at once during the step"].ok, result.table()
    assert (zero == 3) == ("ZeRO-3 gathered parameters at most at once" in rows), result.table()


@pytest.mark.torchrun
def test_program_holds_the_plans_buffers_pp1_m4_16_bit_reduces(tmp_path):
    """The spec itself (no miniature): bf16, dp 4, pp 1, m = 4 micro-batches, zero 3, one
    unit per bucket, ``reduce_dtype = bf16``. Every rank's most gathered parameter bytes
    (the embedding and the output layer gathered just in time: two neighbouring units, not
    the embedding and output layer and two layers) and its most 16-bit gradient bytes in
    flight equal the plan's, and it runs exactly the plan's collectives (2 m all-gathers per
    layer bucket, m for the embedding's and the output layer's, m 16-bit reduce-scatters
    per bucket)."""
    from parcompile.verification import compare_with_plan, measure

    cfg = tiny_config(dp=4, model=dict(dtype="bf16"),
                      parallel=dict(zero=3, bucket_size=4, reduce_dtype="bf16", global_batch=32))
    assert cfg.parallel.num_microbatches == 4
    plan, records = measure(cfg, tmp_path, steps=1)
    st = plan["memory"]["per_stage"][0]
    buckets = plan["comm"]["grad_buckets"]["per_stage"][0]["dense"]
    units = {tuple(b["units"]): _pad(b["elements"], 4) for b in buckets}
    layer, emb, out = units[("layers.0",)], units[("embedding",)], units[("output",)]
    assert st["buffer_parts"]["zero3_gather"] == 2 * max(emb + layer, 2 * layer, layer + out)
    assert st["buffer_parts"]["grad_buckets_in_flight"] == 2 * max(out + layer, 2 * layer, layer + emb)
    for r in records:
        assert r["zero3_gathered"] == st["buffer_parts"]["zero3_gather"]
        assert r["grad_buckets_in_flight"] == st["buffer_parts"]["grad_buckets_in_flight"]
    checks = compare_with_plan(records, plan)
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_search_keeps_the_specs_bucket_size_and_reduce_dtype():
    """`auto` layout keys: the chosen layout is the spec's in every key the search does not
    choose (bucket_size and reduce_dtype were once dropped and fell back to defaults)."""
    src = _llama3_8b(1, 3).replace("    zero = 3\n", "    zero = 3\n    bucket_size = 64 MB\n    reduce_dtype = bf16\n")
    src = src.replace("micro_batch = 1", "micro_batch = auto")
    plan = parcompile.compile(src)
    assert plan.config.parallel.bucket_size == 64 * 10**6
    assert plan.config.parallel.reduce_dtype == "bf16"
    assert plan.data["comm"]["grad_buckets"]["reduce_dtype"] == "bf16"
