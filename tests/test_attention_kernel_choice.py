"""One decision of the attention kernel (issue 46): "is this attention fused?" is the attention
op's ``attention_kernel_for`` (parcompile/ir/ops/attention.py), and the cost model, the
training program, the serve program and the runtime all follow it. Before, it was decided in
five places (ir/code.py, ir/scratch.py, core/attention.py, runtime/model/layers.py,
runtime/serve/generate.py): the program asked for ``fused=True`` on a core with sinks, which the
runtime silently overrode, and an MLA core with a soft-cap was priced as torch's fused SDPA
while the program spelt its softmax out.

For each variant (plain causal, a sliding window, sinks, a soft-cap, ``attention = unfused``,
local and global layers, MLA, MLA with a soft-cap) on the ``cpu`` preset: the kernel the cost model prices (the
engine row the analysis resolves) is fused exactly when the generated training program and
the serve program pass ``fused=True``, and the runtime called with what the program passes
runs torch's fused SDPA exactly then (counted by wrapping it).
"""

from __future__ import annotations

import re

import pytest
import torch

import parcompile.runtime.model.core_attention as core_attention
from parcompile.codegen.emit import render_program, render_serve
from parcompile.core.attention import attention_engine, with_kernel
from parcompile.driver import compile_config
from parcompile.ir.ops import spec
from parcompile.runtime.serve.generate import cached_attention
from tests.program_utils import tiny_config
from tests.serve_utils import serve_config

MLA = dict(kv_lora_rank=16, q_lora_rank=0, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
CASES = {
    "causal": {},
    "window": {"sliding_window": 4},
    "local_global": {"sliding_window": 4, "sliding_window_pattern": 2},   # windows differing per layer
    "sinks": {"attention_sinks": True},
    "softcap": {"attn_logit_softcapping": 30.0},
    "unfused": {"attention": "unfused"},
    "mla": MLA,
    "mla_softcap": {**MLA, "attn_logit_softcapping": 30.0},
}
#: which variants run torch's fused SDPA in the generated programs, written apart from the table
#: (torch's SDPA takes no sink logits and cannot soft-cap; ``attention = unfused`` asks for none)
FUSED = {"causal": True, "window": True, "local_global": True, "sinks": False, "softcap": False, "unfused": False, "mla": True,
         "mla_softcap": False}


def _core_attrs(plan) -> dict:
    return dict(plan.graph.node("layers.0.attn.core").op.attrs)


def _priced_fused(cfg, attrs) -> bool:
    """What the cost model prices: the attention op's kernel for the engine row it resolves."""
    engine = attention_engine(cfg.cluster)
    assert engine == "program"
    return spec("attention").kernel(with_kernel(attrs, engine)).fused


def _fused_arg(text: str, call: str) -> bool:
    got = re.findall(re.escape(call) + r"\(.*?fused=(True|False)", text)
    assert got, call
    assert len(set(got)) == 1
    return got[0] == "True"


@pytest.mark.parametrize("case", sorted(CASES))
def test_cost_model_training_program_and_serve_program_run_one_kernel(case):
    model = CASES[case]
    cfg = tiny_config(model={"layers": 2, **model})
    plan = compile_config(cfg)
    attrs = _core_attrs(plan)
    priced = _priced_fused(cfg, attrs)
    assert priced == FUSED[case]
    assert _fused_arg(render_program(cfg, plan), "rt.attention") == priced

    scfg = serve_config(model={"layers": 2, **model})
    splan = compile_config(scfg)
    sattrs = _core_attrs(splan)
    call = "rt.latent_attention" if sattrs.get("latent") else "gen.serve_attention"
    assert _fused_arg(render_serve(scfg, splan), call) == _priced_fused(scfg, sattrs) == FUSED[case]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_runtime_runs_the_kernel_the_program_passes(case, monkeypatch):
    """attention_core (training) and cached_attention (serving) given the program's ``fused``
    and the op's sinks / soft-cap call torch's SDPA exactly when the decision says fused."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: (calls.append(1), sdpa(*a, **k))[1])
    cfg = tiny_config(model={"layers": 2, **CASES[case]})
    a = _core_attrs(compile_config(cfg))
    fused = _priced_fused(cfg, a)
    g = torch.Generator().manual_seed(0)
    d, dv = a["head_dim"], a.get("v_head_dim", a["head_dim"])
    q, k = torch.randn(1, 2, 6, d, generator=g), torch.randn(1, 2, 6, d, generator=g)
    v = torch.randn(1, 2, 6, dv, generator=g)
    kw = dict(scale=a.get("scale"), softcap=a.get("softcap"), sinks=torch.zeros(2) if a.get("sinks") else None)
    core_attention._padded_core(q, k, v, fused=fused, dropout=0.0, training=False, window=a.get("window") or 0, **kw)
    assert bool(calls) == fused
    calls.clear()
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    cached_attention(q, k, v, mask, fused, **kw)
    assert bool(calls) == fused


def test_training_and_serving_spell_the_softmax_out_in_one_function(monkeypatch):
    """The attention math is written once (runtime/model/core_attention.py spelled_out): the training
    core and the serving core both run it, and its grouped (training) and expanded (serving)
    GQA forms agree on a soft-capped, windowed core with sinks."""
    import parcompile.runtime.serve.generate as generate

    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8,
                                                                                                      generator=g)
    keep = core_attention.causal_mask(torch.arange(5), torch.arange(5), 3)
    kw = dict(scale=0.3, softcap=2.0, sinks=torch.randn(4, generator=g))
    grouped = core_attention.spelled_out(q, k, v, keep, **kw)
    expanded = core_attention.spelled_out(q, k, v, keep[None, None].expand(2, 1, 5, 5), expand_kv=True, **kw)
    torch.testing.assert_close(grouped, expanded, atol=1e-6, rtol=1e-6)
    calls = []
    real = core_attention.spelled_out
    spy = lambda *a, **k: (calls.append(k.get("expand_kv", False)), real(*a, **k))[1]   # noqa: E731
    monkeypatch.setattr(core_attention, "spelled_out", spy)
    monkeypatch.setattr(generate, "spelled_out", spy)
    train = core_attention.attention_core(q, k, v, False, 0.0, False, 3, **kw)
    serve = generate.cached_attention(q, k, v, keep[None, None].expand(2, 1, 5, 5), False, **kw)
    assert calls == [False, True]
    torch.testing.assert_close(train, serve, atol=1e-6, rtol=1e-6)


def test_megatron_export_runs_the_kernel_the_plan_priced(monkeypatch):
    """``--attention-backend`` is the kernel the attention op's decision gives Megatron-LM
    (Transformer Engine's cuDNN fused attention: ``fused``; ``attention = unfused``:
    ``unfused``), read from that one decision: a table that said otherwise moves the flag."""
    import parcompile
    from parcompile.core import attention as table
    from parcompile.core.attention import KernelChoice

    def backend(cfg) -> str:
        words = parcompile.export(compile_config(cfg), "megatron").text.split()
        return words[words.index("--attention-backend") + 1]

    assert backend(tiny_config(2)) == "fused"
    assert backend(tiny_config(2, model={"attention": "unfused"})) == "unfused"
    monkeypatch.setitem(table.ATTENTION_KERNELS, ("megatron", "causal"), KernelChoice("unfused", "a test's"))
    assert backend(tiny_config(2)) == "unfused"
