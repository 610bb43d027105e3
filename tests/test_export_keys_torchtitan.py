"""The model keys torchtitan 0.3 carries (``parcompile.exporters.model_keys.TORCHTITAN``), read back
from torchtitan's own code: each spec of ``tests/test_export_keys.py``'s walk that the torchtitan
export accepts is loaded through torchtitan's ``ConfigManager`` (the exported module, as the
launch line names it), its model built by torchtitan (``Llama3Model.Config.build``), and every
carried key is read off what torchtitan built (:data:`READS`: the layers, widths, norms' eps,
weight tying, the RoPE cache torchtitan computes, the training section), not off the exported
text. A key the export drops or writes into the wrong field reads back as torchtitan's default.
"""

from __future__ import annotations

import shlex
import sys

import pytest
import torch

from parcompile.core.model import rope_scaling, rotary_dim
from parcompile.exporters import export
from parcompile.exporters.model_keys import SET, TORCHTITAN, set_model_keys
from parcompile.runtime.model.layers import rope_tables
from tests.test_export_engines import torchtitan  # noqa: F401  (the fixture: torchtitan 0.3's ConfigManager)
from tests.test_export_keys import VALUES, _compile, spec


def _block(model):
    return model.layers["0"]


def _rope_matches(plan, model) -> bool:
    """torchtitan's RoPE cache (complex, its interleaved pairs) against the angles of the
    runtime's tables for the spec's theta and scaling (parcompile.runtime.model.layers.rope_tables)."""
    m = plan.config.model
    cache = _block(model).attention.rope.cache
    cos, sin = rope_tables(cache.shape[0], rotary_dim(m), m.rope_theta, scaling=rope_scaling(m))
    half = cos.shape[-1] // 2
    return torch.allclose(cache.real, cos[:, :half], atol=1e-5) and torch.allclose(cache.imag, sin[:, :half], atol=1e-5)


def _norm_eps(model) -> set[float]:
    b = _block(model)
    return {b.attention_norm.eps, b.ffn_norm.eps, model.norm.eps}


#: each key torchtitan carries as a setting (SET) -> (what torchtitan built or parsed says, what
#: the spec says); ``cfg`` is torchtitan's Trainer.Config, ``model`` its built Llama3Model
READS = {
    "layers": lambda cfg, model, plan, m: (len(model.layers), m.layers),
    "hidden": lambda cfg, model, plan, m: (model.tok_embeddings.embedding_dim, m.hidden),
    "heads": lambda cfg, model, plan, m: (_block(model).attention.n_heads, m.heads),
    "kv_heads": lambda cfg, model, plan, m: (_block(model).attention.n_kv_heads, m.kv_heads),
    "ffn_hidden": lambda cfg, model, plan, m: (_block(model).feed_forward.w1.out_features, m.ffn_hidden),
    "vocab": lambda cfg, model, plan, m: ((model.tok_embeddings.num_embeddings, model.lm_head.out_features),
                                          (m.vocab, m.vocab)),
    "seq_len": lambda cfg, model, plan, m: (cfg.training.seq_len, m.seq_len),
    "max_positions": lambda cfg, model, plan, m: (_block(model).attention.rope.cache.shape[0], m.max_positions),
    "norm_eps": lambda cfg, model, plan, m: (_norm_eps(model), {m.norm_eps}),
    "tie_embeddings": lambda cfg, model, plan, m: (model.lm_head.weight is model.tok_embeddings.weight,
                                                   m.tie_embeddings),
    "dtype": lambda cfg, model, plan, m: (cfg.training.mixed_precision_param,
                                          {"bf16": "bfloat16", "fp32": "float32"}[m.dtype]),
    **{k: lambda cfg, model, plan, m: (_rope_matches(plan, model), True)
       for k in ("rope_theta", "rope_type", "rope_scaling_factor", "rope_original_max_positions",
                 "rope_low_freq_factor", "rope_high_freq_factor")},
}


def _accepted_specs():
    """(key, value, plan) of each walked spec the torchtitan 0.3 export accepts."""
    out = []
    for key, values in VALUES.items():
        for value, needs in values:
            plan = _compile(spec({**needs, key: value}, "train"))
            if plan is not None and not export(plan, "torchtitan").errors:
                out.append((key, value, plan))
    return out


def _built(plan, cm, tmp_path, monkeypatch):
    """torchtitan's Trainer.Config and built model of ``plan``'s torchtitan export."""
    ex = export(plan, "torchtitan")
    (tmp_path / ex.filename).write_text(ex.text)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(ex.filename[:-3], None)
    words = shlex.split(ex.launch)
    cfg = cm().parse_args(words[words.index("--module"):])
    sys.modules.pop(ex.filename[:-3], None)
    with torch.device("cpu"):
        return cfg, cfg.model_spec.model.build()


def _problems(plan, cm, tmp_path, monkeypatch) -> list[str]:
    cfg, model = _built(plan, cm, tmp_path, monkeypatch)
    m = plan.config.model
    out = []
    for key, read in READS.items():
        got, want = read(cfg, model, plan, m)
        if got != want:
            out.append(f"{key}: torchtitan has {got!r}, the spec {want!r}")
    return out


def test_reads_cover_every_key_torchtitan_writes():
    assert set(READS) == {k for k, c in TORCHTITAN.carries.items() if c.kind == SET}


def test_torchtitan_builds_every_carried_key(torchtitan, tmp_path, monkeypatch):  # noqa: F811
    """Every accepted spec of the walk: torchtitan's built model and config hold each key
    torchtitan carries at the spec's value; each of those keys is at a value other than its
    default in one spec at least (rope_scaling_factor and rope_original_max_positions in the
    Llama 3.1 RoPE specs: their own walked values are YaRN's and linear's, which torchtitan
    refuses)."""
    specs = _accepted_specs()
    shown = {k for _, _, plan in specs for k in set_model_keys(plan.config.model)}
    assert set(READS) <= shown, set(READS) - shown   # each at a value other than its default somewhere
    problems = []
    for key, value, plan in specs:
        problems += [f"{key} = {value}: {p}" for p in _problems(plan, torchtitan, tmp_path, monkeypatch)]
    assert problems == []


def test_a_dropped_key_reads_back_as_torchtitans_default(torchtitan, tmp_path, monkeypatch):  # noqa: F811
    """The check can fail: an export that wrote another eps for the norms, or stopped writing
    Llama 3.1's RoPE scaling, is named."""
    from parcompile.exporters import torchtitan as tt_export

    plan = _compile(spec({"norm_eps": 1e-5, "rope_type": "llama3", "rope_scaling_factor": 8.0,
                          "rope_original_max_positions": 32}, "train"))
    assert _problems(plan, torchtitan, tmp_path, monkeypatch) == []
    original = tt_export._torchtitan3_model

    def dropped(p):
        md = original(p)
        md["rope"] = {"theta": md["rope"]["theta"], "max_seq_len": md["rope"]["max_seq_len"], "scaling": "none"}
        return {**md, "norm_eps": 1e-6}

    monkeypatch.setattr(tt_export, "_torchtitan3_model", dropped)
    problems = _problems(plan, torchtitan, tmp_path, monkeypatch)
    assert any(p.startswith("norm_eps: ") for p in problems), problems
    assert any(p.startswith("rope_type: ") for p in problems), problems


if __name__ == "__main__":   # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
