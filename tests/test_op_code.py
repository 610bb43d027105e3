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
           "latent_norm", "latent_rope", "mla_key", "mla_value", "mla_absorb", "mla_value_up"}
#: kinds a MoE layer runs as one runtime module (runtime/moe.py MoELayer), no row of their own yet
ROUTED = {"router", "moe_dispatch", "experts", "moe_combine"}


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
    assert kinds <= EMITTED | ROUTED, kinds - EMITTED - ROUTED   # a new kind needs its row
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


def test_moe_layer_checks_the_programs_local_expert_count():
    from parcompile.runtime.moe import ExpertAxes

    axes = ExpertAxes(ep=Axis("ep", [0], 0), expert_tp=Axis("expert_tp", [0], 0), expert_dp=Axis("expert_dp", [0], 0))
    rt.MoELayer("m", 8, 4, 2, 16, "swiglu", axes, ONE, 0, 0.02, local_experts=4)
    with pytest.raises(ValueError, match="expects 2 experts per ep rank"):
        rt.MoELayer("m", 8, 4, 2, 16, "swiglu", axes, ONE, 0, 0.02, local_experts=2)


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
    text = module_methods(layer, "attn", pd.ops, {"window": "WINDOW"}, MLA_CONSTANTS, serve=True).text("i, tp")
    assert "self.wkv_b = rt.ColumnParallelLinear(" in text and "local=(32, 16)" in text   # 2 of 4 heads x (8 + 8)
    assert "rt.mla_absorb_query(q, self.wkv_b.weight, heads=2, nope=8, v_dim=8, latent=16)" in text
    assert "rt.latent_attention(q, latent, k_rope, pos, self.window, heads=2" in text
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


def test_a_row_may_be_written_in_its_op_table_entry_but_never_twice():
    """A constant row lives in its kind's OpSpec (Gemma 2's ``softcap``: one op, one place);
    ir/code.py's CODES holds the others; a kind with both is refused at import."""
    from dataclasses import replace

    from parcompile.ir import ops
    from parcompile.ir.code import CODES

    assert "softcap" not in CODES and isinstance(code_of("softcap", {"cap": 30.0}), Code)
    assert "rt.softcap(" in code_of("softcap", {"cap": 30.0}).call
    assert ops.OPS["add"].code is CODES["add"]
    with pytest.raises(ValueError, match="two program rows"):
        ops._program_row(replace(ops.OPS["add"], code=Code()))


def test_every_runtime_name_the_rows_templates_and_goldens_call_is_exported():
    """``rt.<name>`` in the op table's rows, codegen and its templates, and the golden
    programs resolves in ``parcompile.runtime`` (layers and MLA export their ``__all__``
    whole: a new runtime function needs no edit of runtime/__init__.py)."""
    from pathlib import Path

    import parcompile

    pkg = Path(parcompile.__file__).parent
    files = [pkg / "ir" / "ops.py", pkg / "ir" / "code.py", *(pkg / "codegen").rglob("*.py"),
             *(pkg / "codegen").rglob("*.j2"), *(Path(__file__).parent / "golden").rglob("*.py")]
    names = {n for f in files for n in re.findall(r"\brt\.([A-Za-z_]\w*)", f.read_text())}
    assert {"softcap", "attention", "ColumnParallelLinear", "latent_attention"} <= names
    assert sorted(n for n in names if not hasattr(rt, n)) == []
