"""The op table's Code rows (issue 31): every op kind inside a decoder layer says how the
program runs it, and codegen writes the layer's classes from those rows and the sharded
graph alone (parcompile/codegen/blocks.py)."""

from __future__ import annotations

import re

import pytest
import torch

from parcompile import runtime as rt
from parcompile.codegen.blocks import module_methods
from parcompile.codegen.program_data import program_data
from parcompile.driver import compile_config
from parcompile.ir.ops import Code, code_of
from parcompile.runtime.context import Axis
from tests.program_utils import tiny_config

ONE = Axis("tp", [0], 0)


def _layers(cfg):
    plan = compile_config(cfg)
    return program_data(plan.graph, plan.degrees)


#: kinds whose classes codegen writes from their rows (slices of issue 31 done so far)
EMITTED = {"norm", "linear", "add", "act", "swiglu", "geglu", "redistribute", "rope", "qk_norm", "attention",
           "latent_norm", "latent_rope", "mla_key", "mla_value", "router", "moe_dispatch", "experts", "moe_combine"}


@pytest.mark.parametrize("model,parallel", [
    (dict(), dict()),
    (dict(activation="gelu", bias=True, norm="layernorm", position="learned"), dict(sequence_parallel=True)),
    (dict(activation="geglu", qk_norm=True, sandwich_norm=True), dict(sequence_parallel=True)),
    (dict(experts=4, top_k=2, shared_experts=1, dense_layers=1), dict(ep=2, sequence_parallel=True)),
    (dict(kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kv_heads=4),
     dict(sequence_parallel=True)),
])
def test_every_emitted_kind_has_a_row(model, parallel):
    pd = _layers(tiny_config(2, 2, 1, model=model, parallel=parallel))
    kinds = {o.kind for layer in pd.layers for o in layer.ops}
    assert kinds <= EMITTED, kinds - EMITTED   # a new kind needs its row
    for kind in sorted(kinds & EMITTED):
        for o in (o for layer in pd.layers for o in layer.ops if o.kind == kind):
            assert isinstance(code_of(kind, dict(o.attrs)), Code), (kind, o.name)


def test_linear_rows_follow_the_tensor_parallel_style():
    assert "ColumnParallelLinear" in code_of("linear", {"tp": "column"}).build
    row = code_of("linear", {"tp": "row"})
    assert "RowParallelLinear" in row.build and row.fold_after
    assert code_of("linear", {"tp": "column"}).keep_split and not row.keep_split


def test_conversion_rows_by_their_collectives():
    enter = code_of("redistribute", {"fwd": (), "bwd": (("all_reduce", "tp"),)})
    assert enter.call.startswith("rt.copy_to_tp")
    sp = code_of("redistribute", {"fwd": (("all_gather", "tp"),), "bwd": (("reduce_scatter", "tp"),)})
    assert "sequence_parallel=True" in sp.call
    with pytest.raises(ValueError, match="no program code"):
        code_of("redistribute", {"fwd": (("all_to_all", "cp"),), "bwd": ()})


def test_mlp_is_written_from_the_graph():
    sp = _layers(tiny_config(1, 2, 1, parallel=dict(sequence_parallel=True)))
    text = module_methods(sp.dense_layer, "mlp", sp.ops).text("i: int, tp: rt.Axis")
    assert "local=(64, 64)" in text                      # ffn 128 / tp 2, hidden 64: the graph's
    assert 'reduce="reduce_scatter"' in text and "keep_split_input" in text
    plain = _layers(tiny_config(1, 1, 1))
    text = module_methods(plain.dense_layer, "mlp", plain.ops).text("i: int, tp: rt.Axis")
    assert "enter_tp" not in text and "copy_to_tp" not in text and "self.tp" not in text   # tp = 1: no conversion
    assert "reduce=None" in text and "local=(128, 64)" in text


def test_full_recomputation_keeps_nothing_split_in_layers():
    pd = _layers(tiny_config(1, 2, 1, parallel=dict(sequence_parallel=True, recompute="full")))
    assert not any(o.regather for o in pd.dense_layer.ops)
    assert pd.conversion_into("lm_head").regather          # the head is not recomputed


def test_runtime_layers_check_the_programs_local_shapes():
    lin = rt.ColumnParallelLinear("w", 8, 6, False, ONE, 0, local=(6, 8))
    assert tuple(lin.weight.shape) == (6, 8)
    with pytest.raises(ValueError, match="expects a shard of shape"):
        rt.ColumnParallelLinear("w", 8, 6, False, ONE, 0, local=(3, 8))
    with pytest.raises(ValueError, match="expects a shard of shape"):
        rt.RowParallelLinear("w", 8, 6, False, ONE, 0, reduce=None, local=(6, 4))
    with pytest.raises(ValueError, match="one rank"):
        rt.RowParallelLinear("w", 8, 6, False, ONE, 0, reduce="all_reduce")
    row = rt.RowParallelLinear("w", 8, 6, True, ONE, 0, reduce=None, local=(6, 8))
    assert row(torch.ones(1, 2, 8)).shape == (1, 2, 6)


@pytest.mark.parametrize("parallel,has,lacks", [
    (dict(cp=2), ["gather_kv=self.cp", "self.cp = ", "all_gather(cp)"], ["recompute=True"]),
    (dict(recompute="selective"), ["recompute=True"], ["gather_kv"]),
    (dict(sequence_parallel=True), ["keep_split_input", "unflatten(-1, (2, 16))"], ["gather_kv", "recompute=True"]),
])
def test_attention_is_written_from_graph_facts(parallel, has, lacks):
    pd = _layers(tiny_config(1, 2, 1, parallel=parallel))
    text = module_methods(pd.dense_layer, "attn", pd.ops, {"window": "WINDOW"}).text("i, tp, cp")
    for s in has:
        assert s in text, s
    for s in lacks:
        assert s not in text, s


def test_selective_recomputation_is_a_mark_on_the_core():
    pd = _layers(tiny_config(1, 2, 1, parallel=dict(recompute="selective")))
    assert pd.dense_layer.op("attn.core").attr("recompute") == "selective"
    assert _layers(tiny_config(1, 2, 1)).dense_layer.op("attn.core").attr("recompute", None) is None


def test_grouped_experts_check_the_programs_local_shapes():
    """The experts take their count and shard shape from the program (the graph's) and
    check them against the layout: ep 1 holds all 4 experts, (16, 8) w1 shards."""
    from parcompile.runtime.moe import ExpertAxes, GroupedExperts

    axes = ExpertAxes(ep=Axis("ep", [0], 0), expert_tp=Axis("expert_tp", [0], 0), expert_dp=Axis("expert_dp", [0], 0))
    GroupedExperts("m", 4, 8, 16, "swiglu", axes, 0, 0.02, local=(4, 16, 8))
    with pytest.raises(ValueError, match="expects 2 experts per ep rank"):
        GroupedExperts("m", 4, 8, 16, "swiglu", axes, 0, 0.02, local=(2, 16, 8))
    with pytest.raises(ValueError, match="expects w1 shards of"):
        GroupedExperts("m", 4, 8, 16, "swiglu", axes, 0, 0.02, local=(4, 8, 8))
    with pytest.raises(ValueError, match="expects a"):
        rt.Router("m.router", 8, 4, 2, ONE, 0, local=(4, 16))


def test_moe_layer_is_written_op_by_op():
    """A MoE layer's class calls the router, the dispatch, the experts and the combine, the
    dispatch over the axes its collectives cross (ep, expert_tp), with the graph's local
    expert count."""
    from parcompile.codegen.emit import _moe_methods

    pd = _layers(tiny_config(4, 1, 1, model=dict(experts=4, top_k=2), parallel=dict(ep=2, expert_tp=2)))
    text = _moe_methods(pd)
    held = pd.moe_layer.op("mlp.experts").param_local[0]   # (experts held, ffn / expert_tp, h)
    assert held[0] == 2
    for s in ("route = self.router(x)", "rt.dispatch(x, route, local_experts=2, ep=self.ep, expert_tp=self.expert_tp)",
              "rows = self.experts(rows)", "rt.combine(rows, route", f"local={held}",
              "self.ep, self.expert_tp = experts.ep, experts.expert_tp"):
        assert s in text, s
    one = _moe_methods(_layers(tiny_config(1, 1, 1, model=dict(experts=4, top_k=2))))
    assert "rt.dispatch(x, route, local_experts=4)" in one and "self.ep" not in one


#: each template's model section (the decoder-layer classes and the Stage), first line to end
MODEL_SECTIONS = {"program.py.j2": ("class Attention", "def main"), "serve.py.j2": ("class Attention", "def generate")}
#: a read of the parallel block (``p.tp``, ``p.zero``, ...) or of sequence parallelism
PARALLEL_READS = re.compile(r"\bp\.\w+|\bsp\b")


def _template(name: str) -> str:
    from pathlib import Path

    import parcompile.codegen

    return (Path(parcompile.codegen.__file__).parent / "templates" / name).read_text()


def _tags(part: str) -> str:
    return " ".join(re.findall(r"{{.*?}}|{%.*?%}", part, re.S))


def _branch_conditions(part: str) -> list[str]:
    """The conditions a template decides on: ``{% if/elif ... %}`` blocks and inline
    ``{{ a if cond else b }}`` expressions."""
    blocks = re.findall(r"{%-?\s*(?:el)?if\b(.*?)-?%}", part, re.S)
    inline = [m for expr in re.findall(r"{{(.*?)}}", part, re.S) for m in re.findall(r"\bif\b(.*?)(?:\belse\b|$)", expr, re.S)]
    return blocks + inline


def test_branch_conditions_are_found():   # the checks below can see a branch on a degree
    text = '{% if p.zero == 3 %}x{% endif %} {{ "a" if sp else "b" }} {{ p.dp }}'
    assert [PARALLEL_READS.findall(c) for c in _branch_conditions(text)] == [["p.zero"], ["sp"]]
    assert PARALLEL_READS.findall(_tags(text)) == ["p.zero", "sp", "p.dp"]


@pytest.mark.parametrize("name", list(MODEL_SECTIONS))
def test_the_model_and_stage_of_the_templates_read_no_parallel_setting(name):
    """The decoder-layer classes are written from the sharded graph: from ``class
    Attention`` to ``def main`` (serving: ``def generate``) the templates read nothing of
    the parallel block (``p.``, ``sp``); the degrees and recomputation reach them as graph
    facts (cp positions, full recomputation, the head's keep-split, the kv-head rule)."""
    text = _template(name)
    first, end = MODEL_SECTIONS[name]
    assert PARALLEL_READS.findall(_tags(text[text.index(first):text.index(end)])) == []


@pytest.mark.parametrize("name", list(MODEL_SECTIONS))
def test_the_templates_branch_on_no_parallel_degree(name):
    """Issue 31: the templates hold no branch on a parallel degree, anywhere (main's ZeRO
    decisions are the program's ``ZERO`` read by runtime calls, or comments emit writes);
    a degree is only printed (the header's layout, the constants)."""
    text = _template(name)
    assert [c.strip() for c in _branch_conditions(text) if PARALLEL_READS.search(c)] == []
    assert PARALLEL_READS.findall(_tags(text))   # the check sees the reads that remain: printed values


def test_mla_checks_the_programs_local_heads():
    """The serving program's MLA module states its heads per rank (the graph's); the runtime
    checks them and derives nothing the program did not say."""
    args = ("m", 16, 4, 0, 8, 4, 2, 4, ONE, 0, 0.02, False, 1e-5)
    rt.MLAttention(*args, heads_local=4)
    with pytest.raises(ValueError, match="expects 2 heads per rank"):
        rt.MLAttention(*args, heads_local=2)
