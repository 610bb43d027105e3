"""The search over fine-tuning layouts (issue 49): LoRA priced as `parcompile plan` prices it,
`offload = auto` only where nothing fits without it, and `dp_replicate` / `dp_shard = auto`
(HSDP) with its shard groups inside a node. Each chosen layout is written out as a spec and
planned by the compiler; its figures are the expected values."""

from __future__ import annotations

import itertools
import pathlib
import re

import pytest

from parcompile.driver import compile_config
from parcompile.frontend import load_spec
from parcompile.layout_search import Coster, search, with_parallel
from parcompile.passes.manager import cost_without_schedule
from tests import test_search as searched
from tests.test_search import EIGHT_B_AUTO, THIRTY_AUTO, _errors

ROOT = pathlib.Path(__file__).parent.parent
LORA_EXAMPLE = ROOT / "examples/lora/llama3.1_70b_lora_1x8_h100.par"
OFFLOAD_EXAMPLE = ROOT / "examples/llama31_70b_offload_1x8_h100.par"

LORA_TRAIN = """train {
    method       = lora
    lora_rank    = 16
    lora_alpha   = 32
    lora_targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
}
"""
# Llama 3.1 70B on one node of 8 H100s (the LoRA example's model and cluster), layout left open
SEVENTY_B_ONE_NODE = """model llama31_70b from "llama3-70b" {
    rope_theta = 500_000
    seq_len    = 4096
}
cluster dgx_h100 from "h100-sxm" { nodes = 1 }
parallel {
%s}
"""
LORA_AUTO = SEVENTY_B_ONE_NODE % """    tp = auto
    pp = auto
    sequence_parallel = auto
    zero = auto
    recompute = auto
    micro_batch = auto
    global_batch = 32
""" + LORA_TRAIN
FULL_AUTO = SEVENTY_B_ONE_NODE % """    tp = auto
    pp = auto
    zero = auto
    recompute = auto
    micro_batch = 1
    global_batch = 64
%s""" + "train { optimizer = adamw }\n"
# Llama 3 8B, ZeRO-3 over 4 nodes of 8 H100s with one NIC per node: the inter-node links are
# scarce, so keeping ZeRO-3's gathers and reduce-scatters inside a node pays (HSDP)
HSDP_AUTO = """model m from "llama3-8b" { seq_len = 4096 }
cluster c from "h100-sxm" {
    nodes = 4
    nics_per_node = 1
}
parallel {
    tp = 1
    zero = 3
    %s
    recompute = auto
    micro_batch = 1
    global_batch = 128
}
"""


def _written_out(text: str, par) -> str:
    """``text`` with its `parallel` block replaced by layout ``par`` written out key by key."""
    keys = {"dp": par.dp, "tp": par.tp, "pp": par.pp, "cp": par.cp, "micro_batch": par.micro_batch,
            "global_batch": par.global_batch, "zero": par.zero, "recompute": par.recompute,
            "sequence_parallel": str(par.sequence_parallel).lower(), "dp_replicate": par.dp_replicate,
            "offload": par.offload}
    if par.pp > 1:
        keys.update(schedule=par.schedule, virtual_stages=par.virtual_stages)
    if par.stage_layers is not None:
        keys["stage_layers"] = "[" + ", ".join(map(str, par.stage_layers)) + "]"
    if par.microbatch_group_size is not None:
        keys["microbatch_group_size"] = par.microbatch_group_size
    block = "parallel {\n" + "".join(f"    {k} = {v}\n" for k, v in keys.items()) + "}\n"
    return re.sub(r"parallel \{.*?\n\}\n", lambda _m: block, text, count=1, flags=re.S)


def _plan(text: str):
    cfg, _ = load_spec(text)
    assert not _errors(cfg)
    return compile_config(cfg).data


def _same_as_plan(c, plan) -> None:
    assert c.peak == plan["memory"]["peak"]
    assert c.step_time == pytest.approx(plan["estimate"]["step_time"], rel=1e-9)
    assert c.mfu == pytest.approx(plan["estimate"]["mfu"], rel=1e-9)


def test_the_fast_cost_prices_lora_as_the_compiler():
    """The probe-composed cost of a LoRA layout (frozen weights, adapters' states, saves,
    GEMMs and collectives, the adapters' step) equals the whole graph's, over ZeRO and
    recomputation, with and without a pipeline."""
    cfg, _ = load_spec(LORA_EXAMPLE)
    coster = Coster(cfg)
    p = cfg.parallel
    for upd, z, rc in itertools.chain(
            itertools.product([{}], [0, 2, 3], ["selective", "full"]),
            [({"tp": 4, "expert_tp": 4, "pp": 2, "global_batch": 32}, 1, "none")]):
        c = with_parallel(cfg, p.model_copy(update={**upd, "zero": z, "recompute": rc}))
        assert not _errors(c)
        fast, full = coster.cost(c, with_memory=True), cost_without_schedule(c)
        assert fast.peak == full.memory.peak
        assert fast.step_time == pytest.approx(full.time.step_time, rel=1e-9)
        assert fast.mfu == pytest.approx(full.time.mfu, rel=1e-9)


def test_a_lora_search_of_70b_on_one_node_fits_and_equals_the_plan_of_its_layout():
    """Llama 3.1 70B LoRA on 8 H100s, the layout left to the search: a fitting layout whose
    memory peak, step time and MFU are `plan`'s of that layout written out; its tp divides
    the rank (the adapters split over tp); the full fine-tune of the same model on the same
    node fits no layout (the search priced LoRA, not full training)."""
    cfg, _ = load_spec(LORA_AUTO)
    res = search(cfg, top=3)
    assert res.candidates
    best = res.best
    assert best.fits and 16 % best.parallel.tp == 0
    for c in res.candidates:   # zero 3 among them: LoRA's frozen weights gathered as ZeRO-3 does
        _same_as_plan(c, _plan(_written_out(LORA_AUTO, c.parallel)))
    full, _ = load_spec(FULL_AUTO % "")
    assert not search(full, top=1).candidates


def test_offload_auto_offloads_the_optimizer_only_where_nothing_fits_without():
    """The full fine-tune of Llama 3.1 70B on one node of 8 H100s: planned by hand, ZeRO-3
    over the 8 GPUs does not fit without offload and fits with the optimizer offloaded (the
    offload example); the search with `offload = auto` chooses offload = optimizer, with
    `plan`'s figures for its layout. A model that fits without offload is not offloaded."""
    hand = OFFLOAD_EXAMPLE.read_text()
    assert _plan(hand)["memory"]["fits"]
    assert not _plan(hand.replace("offload      = optimizer", "offload      = none"))["memory"]["fits"]
    text = FULL_AUTO % "    offload = auto\n"
    cfg, _ = load_spec(text)
    assert "offload" in cfg.parallel.auto
    res = search(cfg, top=3)
    assert res.candidates and all(c.parallel.offload == "optimizer" for c in res.candidates)
    _same_as_plan(res.best, _plan(_written_out(text, res.best.parallel)))
    small, _ = load_spec(text.replace('from "llama3-70b"', 'from "llama3-8b"').replace("rope_theta = 500_000", ""))
    assert search(small, top=3).best.parallel.offload == "none"


def test_offload_auto_that_fits_nowhere_names_the_smallest_peak_not_a_refused_offload():
    """`offload = auto` beside `zero = 0` where nothing fits: the checker refuses both
    offloads (they need zero >= 1), so the no-fit error is the one without offload (its
    smallest peak), as without `offload = auto`; was: the last try's (params, 0 valid),
    "no layout passes the checks"."""
    from parcompile.layout_search import no_fit_diagnostic

    text = FULL_AUTO.replace("zero = auto", "zero = 0") % "    offload = auto\n"
    without = no_fit_diagnostic(search(load_spec(text.replace("    offload = auto\n", ""))[0], top=3))
    res = search(load_spec(text)[0], top=3)
    assert not res.candidates and res.valid and res.closest is not None
    assert no_fit_diagnostic(res).help == without.help and "smallest peak" in without.help


@pytest.mark.parametrize("key", ["dp_replicate = auto", "dp_shard = auto"])
def test_hsdp_auto_shards_inside_a_node_and_replicates_across(key):
    """ZeRO-3 over 4 nodes with `dp_replicate = auto` (or `dp_shard = auto`): the layouts
    tried are plain ZeRO-3 and HSDP with each shard degree whose groups stay inside a node
    (8, 4, 2); the estimate picks shard 8 = GPUs per node, replicate 4 = nodes (torchtitan's
    HSDP), and its figures are `plan`'s of the hand-written HSDP layout."""
    text = HSDP_AUTO % key
    cfg, _ = load_spec(text)
    assert "dp_replicate" in cfg.parallel.auto
    res = search(cfg, top=10)
    assert res.enumerated == 4 * 3   # dp_replicate 1, 4, 8, 16 x three recompute modes
    assert {c.parallel.dp_replicate for c in res.candidates} >= {1, 4}
    assert all(c.parallel.dp_shard <= cfg.cluster.gpus_per_node for c in res.candidates if c.parallel.dp_replicate > 1)
    best = res.best.parallel
    assert (best.dp_replicate, best.dp_shard) == (4, 8)
    hand = (HSDP_AUTO % "dp_replicate = 4").replace("recompute = auto", f"recompute = {best.recompute}")
    _same_as_plan(res.best, _plan(hand))
    plain = _plan((HSDP_AUTO % "").replace("recompute = auto", f"recompute = {best.recompute}"))
    assert res.best.step_time < plain["estimate"]["step_time"]   # the estimate prefers HSDP here


def test_hsdp_is_not_tried_inside_one_node_nor_without_zero_3():
    cfg, _ = load_spec((HSDP_AUTO % "dp_replicate = auto").replace("nodes = 4", "nodes = 1"))
    assert {c.parallel.dp_replicate for c in search(cfg, top=10).candidates} == {1}
    cfg, _ = load_spec((HSDP_AUTO % "dp_replicate = auto").replace("zero = 3", "zero = 2"))
    assert {c.parallel.dp_replicate for c in search(cfg, top=10).candidates} == {1}


# the bounds hold for LoRA, offload and HSDP layouts too (tests/test_search.py's checks)
THIRTY_LORA = THIRTY_AUTO + LORA_TRAIN.replace("lora_rank    = 16", "lora_rank    = 8")
EIGHT_B_OFFLOAD = EIGHT_B_AUTO.replace("    global_batch = 64", "    offload = optimizer\n    global_batch = 64")
EIGHT_B_HSDP = EIGHT_B_AUTO.replace("    global_batch = 64", "    dp_replicate = auto\n    global_batch = 64")


@pytest.mark.parametrize("text,top,unfit", [(THIRTY_LORA, 3, False), (EIGHT_B_OFFLOAD, 30, True),
                                             (EIGHT_B_HSDP, 30, True)], ids=["lora", "offload", "hsdp"])
def test_bounded_search_ranks_as_costing_every_layout(text, top, unfit, monkeypatch):
    searched.test_bounded_search_ranks_the_best_as_costing_every_layout(text, top, unfit, monkeypatch)


@pytest.mark.parametrize("text,every,unfit", [(THIRTY_LORA, 23, False), (EIGHT_B_OFFLOAD, 211, None),
                                               (EIGHT_B_HSDP, 109, None)], ids=["lora", "offload", "hsdp"])
def test_each_bound_holds(text, every, unfit):
    if "dp_replicate = auto" in text:   # the rows sampled hold HSDP layouts
        cfg, _ = load_spec(text)
        assert any(r[13] > 1 for r in searched._valid_rows(cfg, every))
    searched.test_each_bound_is_below_what_it_bounds(text, every, unfit)


def test_dp_shard_auto_beside_a_numeric_dp_replicate_is_one_diagnostic():
    from parcompile.diagnostics import SpecError

    with pytest.raises(SpecError) as e:
        load_spec((HSDP_AUTO % "dp_replicate = 4\n    dp_shard = auto"))
    [d] = [d for d in e.value.diagnostics if d.severity == "error"]
    assert d.message.startswith("dp_shard = auto with dp_replicate = 4") and "dp_replicate = auto" in d.help
    assert (d.span.line, d.span.column) == (10, 16)


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "cp-tp-dp-pp", "tp-dp-pp-cp"])
def test_shard_domains_without_the_groups_equals_the_groups_placement(order):
    """hsdp_replicas' placement of the shard groups (folded into a layout of dp = dp_shard where
    pp follows dp) is axis_placement of the HSDP layout's own dp_shard groups."""
    from parcompile.config.schema import ParallelConfig
    from parcompile.core.groups import axis_placement
    from parcompile.layout_search.space import shard_domains

    for tp, cp, dp, pp in [(1, 1, 32, 1), (2, 1, 16, 2), (1, 2, 8, 4), (4, 2, 8, 1), (1, 1, 24, 2)]:
        for shard in (s for s in range(2, dp) if dp % s == 0):
            par = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, order=order, zero=3, micro_batch=1, global_batch=dp)
            for domain in (4, 8, 16):
                exact = axis_placement(par.model_copy(update={"dp_replicate": dp // shard}), "dp_shard", domain)[1]
                assert shard_domains(par, shard, domain) == exact, (tp, cp, dp, pp, shard, domain)
