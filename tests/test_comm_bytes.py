"""Each collective listed at the bytes it moves (issue 47): an FP8 plan's tp all-gathers at 1 byte
per element plus scales (ir/fp8.py moved_bytes), and for plans of every axis the listed
collectives' bytes x count add up to plan.json's per-step communication totals, which the time
estimate prices."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

import parcompile
from parcompile.core.axes import AXIS_FAMILY

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _plan(example: str, **overrides) -> dict:
    path = EXAMPLES / example
    return json.loads(parcompile.compile(path.read_text(), filename=str(path), overrides=overrides).to_json())


def _ring_sent(op: str, nbytes: int, n: int) -> Fraction:
    """Bytes one rank sends under ring algorithms (nccl-tests doc/PERFORMANCE.md, NVIDIA/nccl-tests:
    all-reduce 2 (n-1)/n of the buffer; all-gather and all-to-all (n-1)/n of the whole output;
    reduce-scatter (n-1)/n of the whole input, i.e. n-1 output shards); send the buffer."""
    if n <= 1:
        return Fraction(0)
    return {"all_reduce": Fraction(2 * (n - 1), n) * nbytes, "all_gather": Fraction(n - 1, n) * nbytes,
            "all_to_all": Fraction(n - 1, n) * nbytes, "reduce_scatter": Fraction(n - 1) * nbytes,
            "send": Fraction(nbytes)}.get(op, Fraction(0))


def test_fp8_plan_lists_its_tp_all_gathers_at_one_byte_per_element():
    """The 70B example with precision = fp8 (tensorwise, sequence parallelism, tp 8): every
    decoder layer's tp all-gather gathers micro_batch x seq_len x hidden elements at 1 byte
    (tensorwise: no per-element scales), the LM head's gather stays 16-bit; the bf16 plan lists
    the same gathers at 2 bytes. Before issue 47 both listed 134,217,728 bytes."""
    fp8 = _plan("llama3_70b_8x8_h100.par", **{"train.precision": "fp8"})
    bf16 = _plan("llama3_70b_8x8_h100.par")
    m = fp8["model"]
    elements = 1 * m["seq_len"] * m["hidden"]   # micro_batch 1: the gathered (whole-sequence) activation
    layer = [c for c in fp8["comm"]["collectives"] if c["op"] == "all_gather" and c["axis"] == "tp"
             and c["where"].startswith("layers.")]
    assert layer and {c["phase"] for c in layer} == {"forward", "backward", "recompute"}
    assert {c["bytes"] for c in layer} == {elements * 1}
    assert {c.get("program_bytes") for c in layer} == {elements * 2}   # the program gathers 16 bits (verify)
    head = [c for c in fp8["comm"]["collectives"] if c["op"] == "all_gather" and c["axis"] == "tp"
            and c["where"] == "lm_head"]
    assert head and {c["bytes"] for c in head} == {elements * 2}
    assert {c["bytes"] for c in bf16["comm"]["collectives"] if c["op"] == "all_gather" and c["axis"] == "tp"
            } == {elements * 2}
    assert fp8["comm"]["per_step"]["tp"] < bf16["comm"]["per_step"]["tp"]


def test_rowwise_tp_all_gathers_stay_16_bit():
    """rowwise (like mxfp8) casts after the gather (all communication in 16 bits): its tp
    all-gathers are the 16-bit ones."""
    plan = _plan("llama3_70b_8x8_h100.par", **{"train.precision": "fp8", "train.fp8_recipe": "rowwise"})
    m = plan["model"]
    assert {c["bytes"] for c in plan["comm"]["collectives"] if c["op"] == "all_gather" and c["axis"] == "tp"
            } == {2 * m["seq_len"] * m["hidden"]}


def test_layers_kept_in_16_bits_gather_16_bits():
    """train.fp8_bf16_layers_start = 2 (Megatron's --first-last-layers-bf16): layers 0 and 1 run
    their GEMMs in 16 bits, so their tp all-gathers move 2 bytes per element (and the program's
    size is the listed one: no program_bytes); layers 2.. gather at 1 byte, the program's 2 bytes
    as program_bytes. Elements: micro_batch x seq_len x hidden, from the spec's keys."""
    path = EXAMPLES / "llama3_8b_2x8_h100.par"
    compiled = parcompile.compile(path.read_text(), filename=str(path), overrides={
        "parallel.sequence_parallel": True, "train.precision": "fp8", "train.fp8_bf16_layers_start": 2})
    plan, micro = json.loads(compiled.to_json()), compiled.config.parallel.micro_batch
    m = plan["model"]
    elements = micro * m["seq_len"] * m["hidden"]
    by_layer: dict[int, set] = {}
    for c in plan["comm"]["collectives"]:
        if c["op"] == "all_gather" and c["axis"] == "tp" and c["where"].startswith("layers."):
            by_layer.setdefault(int(c["where"].split(".")[1]), set()).add((c["bytes"], c.get("program_bytes")))
    assert by_layer.keys() == set(range(m["layers"]))
    assert by_layer[0] == by_layer[1] == {(2 * elements, None)}
    assert all(by_layer[i] == {(elements, 2 * elements)} for i in range(2, m["layers"]))


PLANS = {
    "70b_fp8": ("llama3_70b_8x8_h100.par", {"train.precision": "fp8"}),
    "70b_bf16": ("llama3_70b_8x8_h100.par", {}),
    "8b_tp_pp": ("llama3_8b_2x8_h100.par", {}),
    "8b_fp8_sp_cp_zero3": ("llama3_8b_2x8_h100.par", {
        "parallel.tp": 4, "parallel.cp": 2, "parallel.sequence_parallel": True, "parallel.zero": 3,
        "train.precision": "fp8", "train.fp8_all_gather": True}),
    "8b_fp8_bf16_first_layers": ("llama3_8b_2x8_h100.par", {
        "parallel.sequence_parallel": True, "train.precision": "fp8", "train.fp8_bf16_layers_start": 2}),
    "mixtral_ep": ("mixtral_8x7b_8x8_h100.par", {}),
    "deepseek_moe": ("deepseek_moe_16b_1x8_h100.par", {}),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_collectives_bytes_times_count_add_up_to_the_per_step_totals(name):
    """Per SPEC axis (group axes folded: dp_cp/expert_dp -> dp, embedding -> pp, expert_tp -> tp),
    the largest over stages of sum(ring bytes sent of each listed collective x its count) is
    plan.json's ``comm.per_step`` (what the report's "Communication (per step)" prints)."""
    example, overrides = PLANS[name]
    plan = _plan(example, **overrides)
    sizes = {axis: len(groups[0]) for axis, groups in plan["groups"].items()}
    stages: dict[int, dict[str, Fraction]] = {}
    for c in plan["comm"]["collectives"]:
        fam = AXIS_FAMILY.get(c["axis"], c["axis"])
        st = stages.setdefault(c["stage"], {})
        st[fam] = st.get(fam, Fraction(0)) + _ring_sent(c["op"], c["bytes"], sizes.get(c["axis"], 1)) * c["count"]
    for axis, total in plan["comm"]["per_step"].items():
        assert total == int(round(max((st.get(axis, Fraction(0)) for st in stages.values()), default=0))), axis


def test_the_estimate_prices_the_bytes_the_collectives_list(monkeypatch):
    """The one rule (ir/fp8.py moved_bytes, applied in analysis/comm.py) moves the listed bytes,
    the per-step totals and the estimate's tp time together: with the rule undone (every
    collective at its 16-bit size) the 70B FP8 plan lists 16-bit gathers and its tp time grows
    back; the time model has no FP8 byte scaling of its own."""
    import parcompile.analysis.comm as comm

    fp8 = _plan("llama3_70b_8x8_h100.par", **{"train.precision": "fp8"})
    monkeypatch.setattr(comm, "moved_bytes", lambda graph, nd, c: c.bytes)
    wide = _plan("llama3_70b_8x8_h100.par", **{"train.precision": "fp8"})
    bf16 = _plan("llama3_70b_8x8_h100.par")
    def gathers(plan):
        return {c["bytes"] for c in plan["comm"]["collectives"] if c["op"] == "all_gather" and c["axis"] == "tp"}

    assert gathers(wide) == gathers(bf16) != gathers(fp8)
    assert wide["comm"]["per_step"]["tp"] > fp8["comm"]["per_step"]["tp"]
    t8, t16 = fp8["estimate"]["breakdown"]["tp_comm"], wide["estimate"]["breakdown"]["tp_comm"]
    assert t8 < t16
