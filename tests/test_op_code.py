"""The op table's Code rows (issue 31): every op kind inside a decoder layer says how the
program runs it, and codegen writes the layer's classes from those rows and the sharded
graph alone (parcompile/codegen/blocks.py).

The rows' calls run the plan's collectives (issue 17): each pipeline stage of a generated
program runs in this process, on one rank of every axis, with ``torch.distributed``'s
collectives replaced by shape-true stand-ins (the runtime still counts every call in
``rt.COUNTER``). Forward and backward hooks on every decoder layer attribute each counted
collective to its layer; the plan's ``comm.collectives`` entries of that layer (``where =
layers.<i>...``), divided by the micro-batches, must be exactly what the program called:
same ops, axes, bytes and counts, forward and backward (with recomputation) apart. The
runtime sizes its collectives itself (the MoE token all-to-alls by the router's choice),
the plan by :func:`parcompile.ir.ops.op_collectives`: this keeps the two equal on every
layout of tests/test_verify*.py and the miniature of every example (examples/*.par: the
same parallel layout, a small model; verify's :func:`miniature`). And a generated program
defines nothing it does not read; codegen does no degree arithmetic.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import parcompile
import parcompile.verification as verify_mod
from parcompile import runtime as rt
from parcompile.codegen.blocks import module_methods
from parcompile.codegen.emit import render_program, render_serve
from parcompile.codegen.program_data import program_data
from parcompile.core.axes import GROUP_AXES
from parcompile.driver import compile_config
from parcompile.ir.ops import Code, code_of
from parcompile.ir.types import Dim
from parcompile.runtime.distributed import comm
from parcompile.runtime.model import moe
from parcompile.runtime.distributed.context import Axis
from tests.program_utils import import_program, tiny_config
from tests.test_verify import CASES, MIXED_CASES
from tests.test_verify_buckets import BUCKET
from tests.test_verify_buckets import CASES as BUCKET_CASES

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.par"))
CODEGEN = REPO / "parcompile" / "codegen"

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
    text = module_methods(pd.dense_layer, "attn", pd.ops).text("i, tp, cp")
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
    from parcompile.runtime.model.moe import ExpertAxes, GroupedExperts

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
MODEL_SECTIONS = {"program.py.j2": ('{% include "_model.py.j2" %}', "def main"),
                  "serve.py.j2": ('{% include "_model.py.j2" %}', "def generate"),
                  "_model.py.j2": ("{{ norm_def }}", "{% endfor %}")}
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
    """The model classes and the Stage are written from the sharded graph: from ``Norm``
    to ``def main`` (serving: ``def generate``) the templates read nothing of
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
    if name != "_model.py.j2":   # the model partial prints no degree
        assert PARALLEL_READS.findall(_tags(text))   # the check sees the reads that remain: printed values


#: what a template condition may read: the run's settings (the train and serve blocks, the
#: cluster's allocator mode) and the fp16 loss scaling (precision); nothing of the model
CONDITION_NAMES = {"t", "s", "expandable_segments", "loss_scaled"}
_NOT_NAMES = {"and", "or", "not", "in", "is", "None", "True", "False"}


def _condition_roots(cond: str) -> set[str]:
    """The names a condition reads (``m`` for ``m.position``), string literals left out."""
    cond = re.sub(r'"[^"]*"|\'[^\']*\'', "", cond)
    return {n.split(".")[0] for n in re.findall(r"\b[A-Za-z_][\w.]*", cond)} - _NOT_NAMES


def test_condition_names_are_found():   # the check below sees a branch on the model
    text = '{% if m.position == "learned" %}x{% elif mla %}y{% endif %} {{ "a" if moe else "b" }} {{ m.hidden }}'
    assert [_condition_roots(c) for c in _branch_conditions(text)] == [{"m"}, {"mla"}, {"moe"}]
    assert _condition_roots(' t.hf_output and "m.x" ') == {"t"}


@pytest.mark.parametrize("name", list(MODEL_SECTIONS))
def test_the_templates_branch_on_no_model_family(name):
    """Issue 31: the templates hold no branch on the model. Rule: every template condition
    (``{% if %}``/``{% elif %}`` and inline ``a if c else b``) reads only the run's settings,
    :data:`CONDITION_NAMES` (``t.`` training, ``s.`` serving, the allocator mode, fp16's loss
    scaling). A read of the model block (``m.position``, ``m.tie_embeddings``, ``m.norm``) or
    of a fact emit derived from the model's ops (``mla``, ``moe``, ``has_mlp``,
    ``norm_extra``, ``rope_thetas``, a class's presence) fails: such facts reach the program
    as text written from the graph (codegen/stage.py: the constants, Norm, the Stage's walk
    over the outer ops; codegen/classes.py: the model classes). Values may still be
    printed (``{{ m.hidden }}`` in a comment)."""
    text = _template(name)
    bad = [c.strip() for c in _branch_conditions(text) if not _condition_roots(c) <= CONDITION_NAMES]
    assert bad == []


def test_mla_checks_the_programs_local_heads():
    """The serving program's MLA functions take the per-rank sizes the program read off the
    graph; the runtime checks them against the weights and tensors and derives nothing."""
    heads, nope, v, c, r = 2, 8, 4, 16, 4
    w = torch.randn(heads * (nope + v), c)
    q = torch.randn(1, 3, heads, nope + r)
    q_latent = rt.mla_absorb_query(q, w, heads=heads, nope=nope, v_dim=v, latent=c)
    assert q_latent.shape == (1, 3, heads, c + r)
    # [q_nope W_uk, q_rope]: W_uk each head's first nope rows of wkv_b
    w_uk = w.view(heads, nope + v, c)[1, :nope]
    assert torch.allclose(q_latent[0, 2, 1, :c], q[0, 2, 1, :nope] @ w_uk, atol=1e-5)
    assert torch.equal(q_latent[..., c:], q[..., nope:])
    with pytest.raises(ValueError, match=r"expects \(36, 16\), got \(24, 16\)"):
        rt.mla_absorb_query(q, w, heads=3, nope=nope, v_dim=v, latent=c)   # the weight holds 2 heads
    y = torch.randn(1, 3, heads, c)
    assert rt.mla_value_up(y, w, heads=heads, nope=nope, v_dim=v, latent=c).shape == (1, 3, heads * v)
    with pytest.raises(ValueError, match="the latent attention's output"):
        rt.mla_value_up(y[..., :8], w, heads=heads, nope=nope, v_dim=v, latent=c)


def test_mla_serving_class_is_written_from_the_absorbed_graph():
    """Serving MLA (the serve graph's absorbed form, ir/lower.py ``mla_absorbed``) is written
    op by op like every attention: wkv_b held once for W_uk and W_uv, the core attending the
    latent and the RoPE key, each call with the graph's per-rank heads."""
    from tests.serve_utils import serve_config
    from parcompile.codegen.blocks import MLA_CONSTANTS

    mla = dict(kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kv_heads=4)
    pd = _layers(serve_config(1, 2, 1, model=mla))
    layer = pd.layers[0]
    kinds = [o.kind for o in layer.ops if o.name.startswith("layers.0.attn.") and o.kind != "redistribute"]
    assert kinds == ["linear", "norm", "linear", "latent_norm", "latent_rope", "linear", "rope", "mla_absorb",
                     "attention", "mla_value_up", "linear"]
    assert layer.op("attn.key") is None and layer.op("attn.core").attr("latent") == 16
    text = module_methods(layer, "attn", pd.ops, {}, MLA_CONSTANTS, serve=True).text("i, tp")
    assert "self.wkv_b = rt.ColumnParallelLinear(" in text and "local=(32, 16)" in text   # 2 of 4 heads x (8 + 8)
    assert "rt.mla_absorb_query(q, self.wkv_b.weight, heads=2, nope=8, v_dim=8, latent=16)" in text
    assert "rt.latent_attention(q, latent, k_rope, pos, 0, heads=2" in text   # one window: a literal
    assert "rt.mla_value_up(y, self.wkv_b.weight, heads=2" in text
    assert "# (B, T, q_latent/tp=40)" in text and "# (B, T, y_latent/tp=32)" in text


def test_an_op_after_the_head_is_written_by_the_stage_walk(tmp_path):
    """The Stage's head is a walk over the graph's ops after the layers: Gemma 2's final
    soft-cap (an op after ``lm_head``, its own Code row) reaches training's and serving's
    program with no code of its own in codegen, and the serving program runs it: its
    logits are capped."""
    from parcompile.codegen.emit import render_program
    from tests.serve_utils import build_serve, run_in_process, serve_config

    cfg = tiny_config(1, 1, 1, model=dict(final_logit_softcapping=0.5))
    program = render_program(cfg, compile_config(cfg))
    assert "rt.softcap(rt.linear(" in program[program.index("    def head("):program.index("    def forward_chunk(")]
    assert "softcap" not in render_program(tiny_config(1, 1, 1), compile_config(tiny_config(1, 1, 1)))
    build_serve(serve_config(1, 1, 1, model=dict(final_logit_softcapping=0.05)), tmp_path)   # below the logits
    text = (tmp_path / "serve.py").read_text()
    head = text[text.index("    def head("):text.index("    def new_cache(")]
    assert "rt.softcap(" in head
    record = run_in_process(tmp_path, ["--max-new-tokens", "2", "--record-logits"])
    assert record["logits"].abs().max() <= 0.05 and len(record["tokens"][0]) == 2


@pytest.mark.parametrize("model,parallel,has,lacks", [
    # GPT-2's learned positions under sequence parallelism: this rank's slice of its positions,
    # the embedding reduce-scatters, the head keeps its split input
    (dict(norm="layernorm", activation="gelu", position="learned", bias=True), dict(sequence_parallel=True),
     ["self.pos_embedding.weight[self.positions.chunk(self.tp.size)[self.tp.index]]", "sequence_parallel=True",
      "with rt.keep_split_input(h, x, self.tp):", "Norm = rt.LayerNorm", "MAX_POSITIONS = "],
     ["rope_tables", "ROPE_THETA"]),
    # a tied head across pp: a copy on the last stage, the embedding's weight where it is held
    (dict(tie_embeddings=True), dict(),
     ['self.lm_head = rt.ColumnParallelLinear("embedding"', "tied_copy = True", "self.embedding.weight.tied = True",
      "return self.embedding.weight if self.has_first else self.lm_head.weight", "ROPE_THETA = "],
     ['"lm_head", HIDDEN', "pos_embedding", "MAX_POSITIONS"]),
    (dict(), dict(), ['"lm_head", HIDDEN', "return self.lm_head.weight", "rt.copy_to_tp(self.final_norm(x), self.tp)",
                      "rope_tables(SEQ_LEN, ROPE_DIM, ROPE_THETA)", "Norm = rt.RMSNorm"],
     ["tied", "pos_embedding", "keep_split_input"]),
])
def test_the_stage_is_written_from_the_outer_ops(model, parallel, has, lacks):
    """The Stage's modules, its ``embed``/``head`` and ``head_weight``, the constants and
    Norm follow the graph's ops outside the layers (the learned position table, the tied
    head's weight, the head's conversion) and its attention ops (RoPE tables)."""
    from parcompile.codegen.emit import render_program

    cfg = tiny_config(1, 2, 2, model=model, parallel=parallel)
    text = render_program(cfg, compile_config(cfg))
    text = text[:text.index("    def forward_chunk(")]
    for s in has:
        assert s in text, s
    for s in lacks:
        assert s not in text, s


def test_layers_that_differ_are_refused():
    plan = compile_config(tiny_config(1, 2, 1))
    g = plan.graph
    nd = g.node("layers.2.mlp.w1")
    g.retype("layers.2.mlp.w1", nd.type.replace_dim("ffn", Dim("ffn", 256)))
    with pytest.raises(ValueError, match="layer 2 of the sharded graph differs from layer 0"):
        program_data(g, plan.degrees)


# ---- the rows' calls run the plan's collectives (moved from tests/test_codegen_graph.py)


def _verify_layouts() -> dict[str, tuple]:
    """name -> (config, dtype) of every layout tests/test_verify*.py launches."""
    out = {}
    for name, kw in CASES.items():
        kw = dict(kw)
        out[f"verify:{name}"] = (tiny_config(kw.pop("dp", 1), kw.pop("tp", 1), kw.pop("pp", 1), **kw), "fp32")
    for name, kw in MIXED_CASES.items():
        kw = dict(kw)
        dtype = kw.pop("dtype")
        out[f"mixed:{name}"] = (tiny_config(kw.pop("dp", 1), kw.pop("tp", 1), kw.pop("pp", 1), **kw), dtype)
    for name, kw in BUCKET_CASES.items():
        kw = dict(kw)
        par = dict(kw.pop("parallel", {}), bucket_size=BUCKET)
        out[f"buckets:{name}"] = (tiny_config(kw.pop("dp", 1), kw.pop("tp", 1), kw.pop("pp", 1),
                                              parallel=par, **kw), "fp32")
    return out


LAYOUTS = _verify_layouts()


# --------------------------------------------------------------------------- stand-in collectives


class _Done:
    def wait(self) -> None:
        return None


def _all_reduce(t, op=None, group=None, async_op=False):
    return _Done() if async_op else None


def _all_gather(out, x, group=None, async_op=False):
    out.view((out.shape[0] // x.shape[0],) + tuple(x.shape)).copy_(x)   # every rank sent x
    return _Done() if async_op else None


def _reduce_scatter(out, x, group=None, async_op=False):
    out.copy_(x[:out.shape[0]])
    return _Done() if async_op else None


def _all_to_all(out, x, out_splits=None, in_splits=None, group=None, async_op=False):
    out.copy_(x.reshape(out.shape))   # every rank sends what it receives (balanced)
    return _Done() if async_op else None


@pytest.fixture
def fake_dist(monkeypatch):
    """Collectives that keep shapes and are still counted by the runtime."""
    monkeypatch.setattr(dist, "all_reduce", _all_reduce)
    monkeypatch.setattr(dist, "all_to_all_single", _all_to_all)
    for mod in (comm, moe):
        if hasattr(mod, "all_gather_single"):
            monkeypatch.setattr(mod, "all_gather_single", _all_gather)
        if hasattr(mod, "reduce_scatter_single"):
            monkeypatch.setattr(mod, "reduce_scatter_single", _reduce_scatter)
    yield


def _context(plan: dict, stage: int) -> rt.ParallelContext:
    """Rank 0 of every axis but pp (this stage), each with a stand-in group."""
    deg = plan["degrees"]
    axes = {}
    for name in GROUP_AXES:
        size = len(plan["groups"][name][0]) if name in plan["groups"] else deg.get(name, 1)
        index = stage if name == "pp" else 0
        axes[name] = rt.Axis(name, list(range(size)), index, object() if size > 1 else None)
    return rt.ParallelContext(0, plan["world_size"], axes, torch.device("cpu"), None)


# --------------------------------------------------------------------------- measuring


def _key(e: dict) -> tuple:
    """(op, axis, bytes); MoE token traffic (whose size the router decides) without bytes; a
    planned collective at the size the generated program moves (``program_bytes``: FP8 tp
    all-gathers the program runs in 16 bits, as :func:`parcompile.verification.predicted_collectives`
    reads them)."""
    routed = e.get("routed") or e.get("rows", -1) >= 0
    return e["op"], e["axis"], None if routed else int(e.get("program_bytes") or e["bytes"])


def _counts() -> Counter:
    """The counter's calls by :func:`_key`, summed (routed calls of different sizes share a key)."""
    out: Counter = Counter()
    for (op, ax, b, r), n in rt.COUNTER.counts.items():
        out[_key({"op": op, "axis": ax, "bytes": b, "rows": r})] += n
    return out


def measured_per_layer(module, plan: dict, cfg) -> dict[int, dict[str, Counter]]:
    """Run every stage's chunks forward and backward once (one micro-batch); per decoder
    layer, the collectives counted inside its forward and inside its backward (recomputation
    included)."""
    m, p = cfg.model, cfg.parallel
    out: dict[int, dict[str, Counter]] = {}
    for s in range(p.pp):
        ctx = _context(plan, s)
        torch.manual_seed(0)
        model = module.Stage(plan, ctx).to(dtype=module.ACT_DTYPE)
        model.train()
        phase = {"now": "forward"}

        def hooks(i: int, block) -> None:
            rec = out.setdefault(i, {"forward": Counter(), "backward": Counter()})
            mark = {}

            def pre(_mod, args):
                if phase["now"] == "forward":
                    mark["fwd"] = _counts()

            def post(_mod, args, y):
                if phase["now"] != "forward":
                    return
                rec["forward"] += _counts() - mark["fwd"]
                y.register_hook(lambda g: mark.__setitem__("bwd", _counts()))
                args[0].register_hook(lambda g: rec["backward"].update(_counts() - mark["bwd"]))

            block.register_forward_pre_hook(pre)
            block.register_forward_hook(post)

        for name, block in model.layers.items():
            hooks(int(name), block)
        seq = m.seq_len // p.cp                                  # tokens per cp rank
        resid = seq // (p.tp if p.sequence_parallel and p.tp > 1 else 1)
        for c in range(len(model.chunks)):
            k = c * model.num_stages + model.stage
            phase["now"] = "forward"
            rt.COUNTER.reset()
            if k == 0:
                x = torch.randint(0, m.vocab, (p.micro_batch, seq))
            else:
                x = torch.randn(p.micro_batch, resid, m.hidden, dtype=module.ACT_DTYPE, requires_grad=True)
            y = model.forward_chunk(c, x)
            if k == model.num_model_chunks - 1:
                loss = model.loss(y, torch.randint(0, m.vocab, (p.micro_batch, seq)))
            else:
                loss = y.float().sum()
            phase["now"] = "backward"
            loss.backward()
    return out


def planned_per_layer(plan: dict, compiled=None) -> dict[int, dict[str, Counter]]:
    """The plan's collectives of each decoder layer per micro-batch: forward, and backward
    with recomputation. ``compiled`` (the compiled plan): also each layer's FP8 amax
    all-reduces over tp, which plan.json lists per stage (``where`` ``fp8_amax_tp``), from the
    rule the plan sums (:func:`parcompile.ir.fp8.amax_collectives`, per op)."""
    m = plan["schedule"]["num_microbatches"]
    out: dict[int, dict[str, Counter]] = {}
    for e in plan["comm"]["collectives"]:
        got = re.match(r"layers\.(\d+)\.", e["where"])
        if not got or e["phase"] == "step":
            continue
        assert e["count"] % m == 0, e
        window = "forward" if e["phase"] == "forward" else "backward"
        rec = out.setdefault(int(got.group(1)), {"forward": Counter(), "backward": Counter()})
        rec[window][_key(e)] += e["count"] // m
    if compiled is not None:
        from parcompile.ir.fp8 import amax_collectives
        again = compiled.config.parallel.recompute == "full"
        for nd in compiled.graph.nodes():
            for op, axis, nbytes, phase, per_row in amax_collectives(compiled.graph, nd, compiled.degrees):
                key = (op, axis, None if per_row else nbytes)   # a routed group's rows: the router decides
                rec = out.setdefault(nd.op.layer, {"forward": Counter(), "backward": Counter()})
                rec[phase][key] += 1
                if again and phase == "forward":
                    rec["backward"][key] += 1
    return out


def _check(cfg, dtype: str, tmp_path: Path) -> None:
    mini = verify_mod.miniature(cfg, dtype=dtype)
    plan_obj = compile_config(mini)
    module = import_program(mini, plan_obj, tmp_path)
    plan = plan_obj.data
    measured = measured_per_layer(module, plan, mini)
    planned = planned_per_layer(plan, plan_obj)
    assert sorted(measured) == list(range(mini.model.layers))
    for i in range(mini.model.layers):
        want = planned.get(i, {"forward": Counter(), "backward": Counter()})
        for window in ("forward", "backward"):
            assert +measured[i][window] == +want[window], (
                f"layer {i} {window}: the program called {dict(+measured[i][window])}, "
                f"the plan has {dict(+want[window])}")


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_program_calls_the_plans_collectives_per_layer(name, tmp_path, fake_dist):
    cfg, dtype = LAYOUTS[name]
    if cfg.train.fp8_all_gather:
        pytest.skip("ZeRO-3's FP8 all-gather hands the layers their E4M3 weights from the optimizer, which this "
                    "one-layer harness does not run; verify compares every collective of these layouts exactly")
    _check(cfg, dtype, tmp_path)


@pytest.mark.parametrize("spec", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_programs_call_the_plans_collectives_per_layer(spec, tmp_path, fake_dist, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = parcompile.compile(spec.relative_to(REPO)).config
    if cfg.workload != "train":
        pytest.skip("serving programs: no backward, no per-layer training collectives")
    monkeypatch.setattr("parcompile.miniature.MAX_WORLD", 1 << 20)   # the layout is all this test keeps
    _check(cfg, "fp32", tmp_path)


def test_a_missing_collective_fails(tmp_path, fake_dist, monkeypatch):
    """The property can fail: a program whose row-parallel layers skip their all-reduce
    calls fewer collectives than the plan."""
    cfg = verify_mod.miniature(tiny_config(1, 2, 1))
    plan_obj = compile_config(cfg)
    module = import_program(cfg, plan_obj, tmp_path)
    planned = planned_per_layer(plan_obj.data)
    assert measured_per_layer(module, plan_obj.data, cfg)[0]["forward"] == planned[0]["forward"]
    monkeypatch.setattr(rt.RowParallelLinear, "forward", lambda self, x: rt.linear(x, self.weight))
    assert measured_per_layer(module, plan_obj.data, cfg)[0]["forward"] != planned[0]["forward"]


# --------------------------------------------------------------------------- static checks


def _unread_constants(text: str) -> list[str]:
    """Module-level names a program assigns and never reads."""
    tree = ast.parse(text)
    assigned = [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]
    loads = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return [a for a in assigned if a not in loads]


@pytest.mark.parametrize("spec", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_programs_define_nothing_unread(spec, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    plan = parcompile.compile(spec.relative_to(REPO))
    render = render_program if plan.config.workload == "train" else render_serve
    assert _unread_constants(render(plan.config, plan, tmp_path)) == []


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_programs_define_nothing_unread(name, tmp_path):
    cfg, dtype = LAYOUTS[name]
    mini = verify_mod.miniature(cfg, dtype=dtype)
    assert _unread_constants(render_program(mini, compile_config(mini), tmp_path)) == []


def test_unread_constant_check_can_fail():
    assert _unread_constants("A = 1\nB = 2\nprint(A)\n") == ["B"]


DEGREE_ARITHMETIC = re.compile(r"//\s*\(?\s*(?:p\.|par\.|parallel\.|cfg\.parallel\.)?"
                               r"(?:tp|pp|cp|dp|ep|expert_tp|expert_dp|world_size|num_shards)\b")


def test_no_degree_arithmetic_in_codegen():
    hits = []
    for path in sorted(CODEGEN.rglob("*")):
        if path.suffix in (".py", ".j2"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if DEGREE_ARITHMETIC.search(line):
                    hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert hits == []
    assert DEGREE_ARITHMETIC.search("heads_local = m.heads // p.tp")
    assert DEGREE_ARITHMETIC.search("x // tp")


def test_every_kind_is_defined_once_with_its_row_in_its_definition():
    """Each op kind is one OpSpec in one module of parcompile/ir/ops/ (issue 46): its program
    row is its definition's (no second table of rows), and a kind defined in two modules is
    refused when the table is built."""
    import types
    from dataclasses import replace

    from parcompile.ir import ops

    assert isinstance(code_of("softcap", {"cap": 30.0}), Code)
    assert "rt.softcap(" in code_of("softcap", {"cap": 30.0}).call
    assert not hasattr(ops, "CODES")
    # the kinds without a row are the ones the templates' skeleton runs
    assert sorted(k for k, s in ops.OPS.items() if s.code is None) == [
        "cross_entropy", "input", "send_recv", "step_collective"]
    twice = types.SimpleNamespace(__name__="twice", DEFINITIONS=[replace(ops.OPS["add"], code=Code())])
    with pytest.raises(ValueError, match="'add' is defined twice"):
        ops._table(ops.dense, twice)


def test_every_runtime_name_the_rows_templates_and_goldens_call_is_exported():
    """``rt.<name>`` in the op table's rows, codegen and its templates, and the golden
    programs resolves in ``parcompile.runtime`` (layers and MLA export their ``__all__``
    whole: a new runtime function needs no edit of runtime/__init__.py)."""
    from pathlib import Path

    import parcompile

    pkg = Path(parcompile.__file__).parent
    files = [*(pkg / "ir" / "ops").glob("*.py"), *(pkg / "codegen").rglob("*.py"),
             *(pkg / "codegen").rglob("*.j2"), *(Path(__file__).parent / "golden").rglob("*.py")]
    names = {n for f in files for n in re.findall(r"\brt\.([A-Za-z_]\w*)", f.read_text())}
    assert {"softcap", "attention", "ColumnParallelLinear", "latent_attention"} <= names
    assert sorted(n for n in names if not hasattr(rt, n)) == []


def test_row_parallel_without_reduction_leaves_a_partial_sum_with_the_bias_once():
    """reduce=None under tp > 1 (a served MoE layer's shared experts, reduced after the
    add): no collective, each rank's partial sum, the bias on tp rank 0 only, so the sum
    over the ranks is the whole layer's output."""
    torch.manual_seed(0)
    whole = rt.RowParallelLinear("w", 8, 6, True, ONE, 0)
    torch.nn.init.normal_(whole.bias)
    x = torch.randn(1, 3, 8)
    parts = []
    for r in range(2):
        tp = rt.Axis("tp", [0, 1], r)   # no process group: a collective here would fail
        row = rt.RowParallelLinear("w", 8, 6, True, tp, 0, reduce=None, local=(6, 4))
        with torch.no_grad():
            row.weight.copy_(whole.weight[:, 4 * r:4 * r + 4])
            row.bias.copy_(whole.bias)
        parts.append(row(x[..., 4 * r:4 * r + 4]))
    assert not torch.allclose(parts[1], parts[0])
    torch.testing.assert_close(parts[0] + parts[1], whole(x))


def test_traits_are_declared_on_the_definitions_and_agree_with_them():
    """The kind lists became traits on the op definitions (issue 46): every trait is some
    kind's; a kind that is not an op of the forward has no program row, no FLOPs and is
    never a GEMM; the FP8 GEMMs are GEMMs; a kind of no known module is a KeyError."""
    from parcompile.ir import ops
    from parcompile.ir.ops import Trait, has_trait, kinds_with

    assert all(kinds_with(t) for t in Trait)
    for kind in kinds_with(Trait.NOT_AN_OP):
        s = ops.spec(kind)
        assert s.code is None and not has_trait(kind, Trait.GEMM), kind
    assert kinds_with(Trait.FP8_GEMM) <= kinds_with(Trait.GEMM)
    assert kinds_with(Trait.ROTARY) == {k for k, s in ops.OPS.items() if "theta" in s.per_layer}
    with pytest.raises(KeyError, match="unknown op kind 'nope'"):
        has_trait("nope", Trait.GEMM)


def test_a_kinds_own_tensor_parallel_style_is_in_its_definition():
    """A tp style of one op kind lives in that kind's definition (OpSpec.tp_styles): a linear
    layer's ``column`` resolves for ``linear`` and is refused for a norm; the shared styles
    (ir/tp.py) resolve for any kind."""
    from parcompile.ir.ops import spec
    from parcompile.ir.tp import tp_rule
    from parcompile.ir.types import Dim, TensorType

    h, f = Dim("hidden", 8), Dim("ffn", 16)
    x, y = TensorType((Dim("seq", 4), h), "fp32"), TensorType((Dim("seq", 4), f), "fp32")
    a = {"in_dim": h, "out_dim": f}
    assert tp_rule("column", a, [x], y, False, spec("linear").tp_styles).out_split == "ffn"
    with pytest.raises(ValueError, match="unknown tensor-parallel style 'column'"):
        tp_rule("column", a, [x], y, False, spec("norm").tp_styles)
    assert tp_rule("residual", {}, [x], x, True, spec("norm").tp_styles).out_split == "seq"
