"""Per-layer attributes (issue 46): an op kind declares the attributes that may differ from
one decoder layer to the next (``OpSpec.per_layer``, parcompile/ir/ops/); codegen writes
one class for many layers, so each declared attribute that differs becomes a per-layer table
the class reads (``ATTN_CORE_SCALE[i]``), and any other difference is an internal error.

The probe of issue 46: the four attention cores of examples/tiny.par's graph given the
scales 0.1 / 0.2 / 0.3 / 0.4 rendered ``scale=0.1`` for every layer (the class was written
from layer 0 and nothing compared attributes).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import parcompile
from parcompile.codegen.blocks import LayerValue
from parcompile.codegen.emit import render_program, render_serve
from parcompile.codegen.program_data import LayerAttributeError, LayerTable, program_data
from parcompile.driver import compile_config
from parcompile.ir import ops
from parcompile.runtime.distributed.context import init_parallel
from tests.program_utils import import_program, tiny_config
from tests.serve_utils import serve_config

REPO = Path(__file__).resolve().parent.parent
SCALES = (0.1, 0.2, 0.3, 0.4)
#: examples/tiny.par's model (one process: the layers' classes are what is tested, not the layout)
TINY = dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256, seq_len=16, dtype="fp32",
            norm="rmsnorm", activation="swiglu", position="rope")


def _with(plan, attr: str, values, op: str = "attn.core"):
    """``plan`` with ``layers.<i>.<op>``'s ``attr`` set to ``values[i]`` in its sharded graph."""
    for i, v in enumerate(values):
        plan.graph.set_attrs(f"layers.{i}.{op}", **{attr: v})
    return plan


def test_tiny_par_renders_the_four_scales():
    """The probe on examples/tiny.par itself (dp 2 x tp 2 x pp 2): one table, read by the one
    Attention class; the literal of layer 0 nowhere."""
    plan = _with(parcompile.compile(Path("examples/tiny.par").resolve()), "scale", SCALES)
    text = render_program(plan.config, plan)
    assert "ATTN_CORE_SCALE = (0.1, 0.2, 0.3, 0.4)" in text
    assert "self.scale = ATTN_CORE_SCALE[i]" in text and "scale=self.scale" in text
    assert "scale=0.1" not in text


def test_each_layer_computes_with_its_own_scale(tmp_path):
    """The generated single-process program's layers hold the graph's scales, and its logits
    are transformers' Llama with each layer's attention scaling set to the same values."""
    transformers = pytest.importorskip("transformers")
    from tests.test_reference_hf import _llama_state

    cfg = tiny_config(model=TINY)
    plan = _with(compile_config(cfg), "scale", SCALES)
    module = import_program(cfg, plan, tmp_path / "prog")
    stage = module.Stage(plan.data, init_parallel(plan.data))
    assert [stage.layers[str(i)].attn.scale for i in range(4)] == list(SCALES)

    m = cfg.model
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.ffn_hidden, num_hidden_layers=m.layers,
        num_attention_heads=m.heads, num_key_value_heads=m.kv_heads, max_position_embeddings=m.seq_len,
        rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=False, attn_implementation="eager",
        bos_token_id=None, eos_token_id=None, pad_token_id=None)).float().eval()
    for layer, s in zip(hf.model.layers, SCALES):
        layer.self_attn.scaling = s
    with torch.no_grad():
        for name, p in stage.named_parameters():
            p.copy_(_llama_state(hf.state_dict(), m)[name])
    ids = torch.randint(0, m.vocab, (2, m.seq_len), generator=torch.Generator().manual_seed(0))
    stage.eval()
    with torch.no_grad():
        ours = stage.forward_chunk(0, ids)[..., :m.vocab]
        ref = hf(input_ids=ids).logits
        for layer in hf.model.layers:   # the reference at one scale differs: the test can fail
            layer.self_attn.scaling = SCALES[0]
        one = hf(input_ids=ids).logits
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    assert (one - ref).abs().max() > 1e-3


def test_the_serve_program_reads_the_same_table():
    cfg = serve_config(model={"layers": 4})
    plan = _with(compile_config(cfg), "scale", SCALES)
    text = render_serve(cfg, plan)
    assert "ATTN_CORE_SCALE = (0.1, 0.2, 0.3, 0.4)" in text and "self.scale = ATTN_CORE_SCALE[i]" in text
    assert "gen.serve_attention(q, k, v, pos, window=0, fused=True, scale=self.scale)" in text


def test_windows_that_differ_are_the_same_mechanism():
    """Gemma's local and global layers: the window table is the generic one, read by the
    Attention class and (serving) by the KV cache; one window is a literal."""
    model = {"sliding_window": 4, "sliding_window_pattern": 2}
    cfg = tiny_config(model=model)
    text = render_program(cfg, compile_config(cfg))
    assert "ATTN_CORE_WINDOW = (4, 0, 4, 0)" in text and "self.window = ATTN_CORE_WINDOW[i]" in text
    assert "window=self.window" in text and "WINDOW =" not in text.replace("ATTN_CORE_WINDOW =", "")
    cfg = serve_config(model=model)
    text = render_serve(cfg, compile_config(cfg))
    assert "gen.Requests(prompts, max_new, ATTN_CORE_WINDOW, ctx.device)" in text
    cfg = tiny_config()
    text = render_program(cfg, compile_config(cfg))
    assert "window=0, pos=pos" in text and "WINDOW" not in text


def test_an_undeclared_difference_is_an_internal_error():
    """Gemma 2's soft-cap is one value for every layer (not declared per-layer): layers that
    differ in it are refused, naming the op, the layers and the attribute."""
    cfg = tiny_config()
    plan = _with(compile_config(cfg), "softcap", (None, 30.0, None, 50.0))
    assert "softcap" not in ops.spec("attention").per_layer
    with pytest.raises(LayerAttributeError) as e:
        program_data(plan.graph, plan.degrees)
    msg = str(e.value)
    assert msg.startswith("internal error") and "layers.{i}.attn.core" in msg and "'softcap'" in msg
    assert "layers 0, 2: unset; layer 1: 30.0; layer 3: 50.0" in msg
    with pytest.raises(LayerAttributeError, match="softcap"):
        render_program(cfg, plan)


def test_a_declared_difference_nothing_reads_is_an_internal_error(monkeypatch):
    """A per-layer attribute whose program row does not write it (the norms' eps: the
    program's NORM_EPS) would run every layer with one value: refused."""
    monkeypatch.setitem(ops.OPS, "norm", dataclasses.replace(ops.OPS["norm"], per_layer=("eps",)))
    cfg = tiny_config()
    plan = _with(compile_config(cfg), "eps", (1e-5, 1e-6, 1e-5, 1e-6), op="attn_norm")
    assert [(t.op, t.attr) for t in program_data(plan.graph, plan.degrees).layer_tables] == [("attn_norm", "eps")]
    with pytest.raises(LayerAttributeError, match=r"'eps' of op layers\.\{i\}\.attn_norm .* no line of the program"):
        render_program(cfg, plan)


def test_a_row_may_not_decide_on_a_per_layer_value():
    value = LayerValue("window", LayerTable("attn.core", "attention", "window", ((0, 4), (1, 0))))
    assert f"{value!r}" == repr(value) == "self.window"
    with pytest.raises(LayerAttributeError, match="decides on 'window'"):
        bool(value)


def test_a_table_over_some_layers_is_a_mapping():
    table = LayerTable("mlp.router", "router", "top_k", ((1, 2), (2, 4), (3, 2)))
    assert table.name == "MLP_ROUTER_TOP_K" and table.literal() == "{1: 2, 2: 4, 3: 2}"
    assert LayerTable("attn.core", "attention", "scale", ((0, 0.5), (1, None))).literal() == "(0.5, None)"
