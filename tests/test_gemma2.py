"""Gemma 2 (`gemma2`, issue 31's proof) against transformers' own Gemma2ForCausalLM (fp32, CPU).

A tiny random Gemma2Config (4 layers, hidden 64, head_dim 16, local (window 4) and global
layers alternating, ``query_pre_attn_scalar`` 24, tied embeddings) with both soft-caps set
low enough to bite (attention 2.0, logits 3.0: the random model's scores and logits exceed
them), saved with ``save_pretrained``. Its config.json is imported with ``from_hf_dict``;
the plan's parameter count must equal transformers'; ``load_hf`` fills a single-process
program whose logits (16 tokens, past the window) must equal transformers'. The serve
program (tp 1 in this process, tp 2 under torchrun, and the paged engine with chunked
prefill and prefix caching) must generate transformers' greedy tokens (and, tp 1, its
logits at every step), with the attention's cap changing them. The caps are read off
transformers' module (``modeling_gemma2.py``), never from parcompile's output.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from parcompile.core.hf import from_hf_dict
from parcompile.core.hf_weights import expected_shapes, hf_family
from tests.family_utils import (assert_logits_equal, check_written_back, fine_tune, import_keys, stage_from_hf,
                                token_ids)
from tests.program_utils import tiny_config
from tests.serve_utils import build_serve, run_in_process

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (pip install -e .[test])")

LAYERS, WINDOW = 4, 4
ATTN_CAP, FINAL_CAP = 2.0, 3.0


def _hf_config(**extra):
    return transformers.Gemma2Config(**{**dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
        sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=ATTN_CAP,
        final_logit_softcapping=FINAL_CAP, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        pad_token_id=None), **extra})


def _save(path: Path, **extra):
    torch.manual_seed(29)
    hf = transformers.Gemma2ForCausalLM(_hf_config(**extra)).float().eval()
    hf.config._attn_implementation = "eager"
    with torch.no_grad():   # Gemma's norms start at 0 ((1 + w) = 1): make them matter; scores large
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.normal_(0.0, 0.5)
            elif "q_proj" in n or "k_proj" in n:
                p.mul_(8.0)
    hf.save_pretrained(path, safe_serialization=True)
    return hf


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma2")
    hf = _save(tmp / "hf")
    keys = import_keys(tmp / "hf")
    cfg = tiny_config(model=keys, name="gemma2")
    stage, plan = stage_from_hf(cfg, tmp / "hf", tmp / "prog")
    return dict(tmp=tmp, hf=hf, cfg=cfg, stage=stage, plan=plan)


def test_import_maps_every_field(case):
    m, hf = case["cfg"].model, case["hf"]
    assert [bool(w) for w in m.layer_windows] == [k == "sliding_attention" for k in hf.config.layer_types]
    assert (m.sliding_window, m.sliding_window_pattern, m.head_dim, m.query_pre_attn_scalar) == (WINDOW, 2, 16, 24.0)
    assert (m.attn_logit_softcapping, m.final_logit_softcapping) == (ATTN_CAP, FINAL_CAP)
    assert (m.zero_centered_gamma, m.sandwich_norm, m.scale_embeddings, m.activation, m.qk_norm) == (
        True, True, True, "geglu", False)
    assert m.rope_local_base_freq is None and m.tie_embeddings and hf_family(m) == "gemma2"


def test_config_round_trips(case):
    """keys -> config.json (hf_config) -> keys: the same model, the caps included."""
    from parcompile.core.hf_weights import hf_config

    m = case["cfg"].model
    written = hf_config(m)
    assert written["model_type"] == "gemma2"
    assert (written["attn_logit_softcapping"], written["final_logit_softcapping"]) == (ATTN_CAP, FINAL_CAP)
    assert written["layer_types"] == case["hf"].config.layer_types
    assert tiny_config(model={**import_keys(case["tmp"] / "hf"), **{
        k: v for k, v in from_hf_dict(written).items() if v is not None and k not in ("seq_len", "dtype")}}).model == m


def test_parameter_count_equals_transformers(case):
    total = sum(p.numel() for p in case["hf"].parameters())
    assert case["plan"]["model"]["params"] == total
    assert sum(math.prod(s) for s in expected_shapes(case["cfg"].model).values()) == total


def test_the_caps_bite(case):
    """The tiny model's logits reach past the cap without it and its scores past theirs, so
    the logits test below would fail if either cap were dropped."""
    hf = case["hf"]
    ids = token_ids(case["cfg"].model.vocab)
    with torch.no_grad():
        capped = hf(input_ids=ids).logits
        for cfg_key in ("final_logit_softcapping", "attn_logit_softcapping"):
            old = getattr(hf.config, cfg_key)
            setattr(hf.config, cfg_key, None)
            for layer in hf.model.layers:
                layer.self_attn.attn_logit_softcapping = hf.config.attn_logit_softcapping
            uncapped = hf(input_ids=ids).logits
            setattr(hf.config, cfg_key, old)
            for layer in hf.model.layers:
                layer.self_attn.attn_logit_softcapping = hf.config.attn_logit_softcapping
            assert (uncapped - capped).abs().max() > 1e-2, cfg_key
    assert capped.abs().max() < FINAL_CAP


def test_logits_equal_transformers(case):
    assert_logits_equal(case["stage"], case["hf"], case["cfg"].model.vocab)


def test_default_gemma2_counts_as_transformers_on_the_meta_device(tmp_path):
    """transformers' default Gemma2Config (gemma-2-2b's shape: 26 layers, hidden 2304, vocab
    256,000, caps 50 and 30) as a spec's `model m from "config.json"`: the plan's parameter
    count equals the module's on the meta device; tp 2 x pp 2 plans."""
    import parcompile

    hcfg = transformers.Gemma2Config()
    with torch.device("meta"):
        total = sum(p.numel() for p in transformers.Gemma2ForCausalLM(hcfg).parameters())
    (tmp_path / "config.json").write_text(hcfg.to_json_string())
    spec = tmp_path / "g.par"
    spec.write_text('model g from "config.json" { }\ncluster c from "h100-sxm" { }\n'
                    'parallel { tp = 2, pp = 2, global_batch = 16 }\n')
    plan = parcompile.compile(spec)
    m = plan.config.model
    assert (m.attn_logit_softcapping, m.final_logit_softcapping) == (50.0, 30.0)
    assert m.layer_windows == tuple(4096 if i % 2 == 0 else 0 for i in range(26))
    assert plan.data["model"]["params"] == total


PROMPTS = [[5, 17, 99, 3, 250, 42], [7, 7, 120, 9, 31, 299]]
NEW = 8


def _serve(hf_dir: Path, out: Path, prompt_len: int = 6) -> dict:
    """The tp 1 serve program of the checkpoint ``hf_dir`` (a spec read from its
    config.json, as a user writes it) compiled into ``out``; returns its plan.json dict."""
    from parcompile.frontend import load_spec

    spec = hf_dir.parent / f"serve_{out.name}.par"
    spec.write_text(f'model m from "{hf_dir.name}/config.json" {{ dtype = fp32 }}\n'
                    'cluster c from "cpu" { gpus_per_node = 1 }\nparallel { }\n'
                    f'serve {{ batch = 2, prompt_len = {prompt_len}, max_new_tokens = {NEW}, weights = "{hf_dir.name}" }}\n')
    cfg, _ = load_spec(spec)
    return build_serve(cfg, out)


def _served(out: Path, prompts=PROMPTS) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens and each step's logits (steps, B, vocab) of the serve program in ``out``
    run in this process on ``prompts``."""
    rec = run_in_process(out, sum((["--prompt-ids", ",".join(map(str, p))] for p in prompts), [])
                         + ["--out", str(out / "rec"), "--record-logits"])
    return rec["tokens"], torch.load(out / "rec" / "rank0.pt", weights_only=True)["logits"]


def _generate(hf, prompts=PROMPTS) -> tuple[list[list[int]], torch.Tensor]:
    """transformers' greedy ``generate`` (eager attention: the caps applied) of ``prompts`` of
    one length: new tokens and each step's logits (steps, B, vocab)."""
    n = len(prompts[0])
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompts), max_new_tokens=NEW, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, attention_mask=torch.ones(len(prompts), n, dtype=torch.long))
    return out.sequences[:, n:].tolist(), torch.stack(out.logits)


@pytest.fixture(scope="module")
def served(case):
    """The capped checkpoint served (tp 1, contiguous cache) and the same weights with the
    attention's cap nulled in config.json (transformers and parcompile alike then cap none)."""
    tmp = case["tmp"]
    if not (tmp / "uncapped").exists():
        shutil.copytree(tmp / "hf", tmp / "uncapped")
        cfg = json.loads((tmp / "uncapped" / "config.json").read_text())
        cfg["attn_logit_softcapping"] = None
        (tmp / "uncapped" / "config.json").write_text(json.dumps(cfg))
    out = {}
    for name in ("hf", "uncapped"):
        plan = _serve(tmp / name, tmp / f"serve_{name}")
        out[name] = dict(plan=plan, got=_served(tmp / f"serve_{name}"))
    uncapped = transformers.Gemma2ForCausalLM.from_pretrained(tmp / "uncapped").float().eval()
    uncapped.config._attn_implementation = "eager"
    out["hf"]["want"], out["uncapped"]["want"] = _generate(case["hf"]), _generate(uncapped)
    return out


def test_greedy_serving_equals_generate(served):
    """serve.py's greedy tokens and every step's logits (prefill and decode, both caps
    applied) equal transformers' ``generate``; with the attention's cap nulled, both
    again (the serving attention caps only when the attention op says so)."""
    for name in ("hf", "uncapped"):
        (tokens, logits), (want, want_logits) = served[name]["got"], served[name]["want"]
        assert tokens == want, name
        torch.testing.assert_close(logits[..., :want_logits.shape[-1]], want_logits, atol=1e-4, rtol=1e-4)


def test_the_attention_cap_changes_the_served_argmax(served):
    """The attention cap bites while serving: capped and uncapped weights pick other tokens
    (the first greedy token already: an argmax the prefill's capped scores change), so the
    test above fails if serve.py dropped the cap."""
    capped, uncapped = served["hf"]["got"], served["uncapped"]["got"]
    assert capped[0] != uncapped[0]
    assert not torch.equal(capped[1][0].argmax(-1), uncapped[1][0].argmax(-1))
    assert served["hf"]["plan"]["serve"]["kv_cache_bytes_per_rank"] > 0


def test_paged_serving_with_prefix_caching_and_chunked_prefill_equals_generate(case, tmp_path):
    """The engine's paged cache (runtime/serve/paged.py): requests joining a running batch, prompts
    prefilled in chunks of 3 tokens, the last one finding the first one's two full blocks in
    the prefix cache (its prefill reads them through the paged attention): each sequence's
    greedy tokens equal transformers' ``generate`` of its prompt alone."""
    from tests.serve_utils import paged_generate

    first = [5, 17, 99, 3, 250, 42, 7, 120, 9]
    prompts = [first, [7, 7, 120], [9, 31], first[:8] + [31, 299]]
    _serve(case["tmp"] / "hf", tmp_path / "p", prompt_len=10)
    got, peak, stats = paged_generate(tmp_path / "p", prompts, NEW, max_seqs=3, blocks=16, block_size=4,
                                      weights=str(case["tmp"] / "hf"), max_prefill_tokens=3)
    assert stats["prefix_cache_hits"] == 8 and peak == 3
    for p, toks in zip(prompts, got):
        assert toks == _generate(case["hf"], [p])[0][0], p


def test_cached_attention_caps_as_transformers_eager_attention():
    """The serving kernel (runtime/serve/generate.py cached_attention: the contiguous and the paged
    cache's) against transformers' Gemma 2 ``eager_attention_forward`` on the same q, k, v
    (GQA, 3 new queries after 5 cached keys, a causal mask with a padded key): equal, and
    unequal without the cap (the cap bites); asked to fuse a capped core (torch's SDPA cannot
    cap: the program's kernel choice never does) it refuses rather than skip the cap."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from parcompile.runtime.serve.generate import cached_attention

    g = torch.Generator().manual_seed(3)
    B, H, Hkv, T, L, D, cap, scale = 2, 4, 2, 3, 8, 16, 2.0, 24 ** -0.5
    q, k, v = (torch.randn(B, h, n, D, generator=g) * 3 for h, n in ((H, T), (Hkv, L), (Hkv, L)))
    keep = torch.arange(L)[None, :] <= torch.arange(L - T, L)[:, None]          # (T, L) causal
    keep = keep[None, None].repeat(B, 1, 1, 1)
    keep[1, :, :, 0] = False                                                     # row 1: a padded first key
    additive = torch.zeros(B, 1, T, L).masked_fill(~keep, float("-inf"))
    module = SimpleNamespace(head_dim=D, num_key_value_groups=H // Hkv, training=False)
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=scale, softcap=cap)
    got = cached_attention(q, k, v, keep, False, scale, softcap=cap).transpose(1, 2)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="soft-cap"):
        cached_attention(q, k, v, keep, True, scale, softcap=cap)
    uncapped = cached_attention(q, k, v, keep, True, scale).transpose(1, 2)
    assert (uncapped - want).abs().max() > 1e-2


def _serve_spec(root: Path, tp: int):
    from parcompile.frontend import load_spec

    spec = root / f"serve_tp{tp}.par"
    spec.write_text('model m from "hf/config.json" { dtype = fp32 }\n'
                    f'cluster c from "cpu" {{ gpus_per_node = {tp} }}\nparallel {{ tp = {tp} }}\n'
                    f'serve {{ batch = 2, prompt_len = 6, max_new_tokens = {NEW}, weights = "hf" }}\n')
    cfg, _ = load_spec(spec)
    return cfg


@pytest.mark.torchrun
def test_tp2_greedy_serving_equals_generate(case, served, tmp_path_factory):
    """tp 2 (heads and kv heads split, each rank's vocab shard of the logits capped): the
    checkpoint's greedy tokens equal transformers' generate, each rank's cache the plan's."""
    from tests.serve_utils import replica_tokens, serve_cases_in_one_launch

    plan, recs = serve_cases_in_one_launch(tmp_path_factory, "gemma2_tp2", (None,), lambda key, path: _save(path),
                                           _serve_spec, PROMPTS)[None]
    assert replica_tokens(recs) == served["hf"]["want"][0]
    assert all(r["cache_bytes"] == plan["serve"]["kv_cache_bytes_per_rank"] for r in recs)


def test_hf_output_of_a_fine_tune_loads_back_in_transformers(case, tmp_path):
    cfg = case["cfg"]
    out = fine_tune(cfg, case["tmp"] / "hf", tmp_path)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "gemma2"
    assert (written["attn_logit_softcapping"], written["final_logit_softcapping"]) == (ATTN_CAP, FINAL_CAP)
    check_written_back(cfg, out, case["hf"], tmp_path / "prog_back", moved=("post_feedforward_layernorm",))


def test_megatron_export_refuses_both_caps(tmp_path):
    """pretrain_gpt.py has no soft-capping argument: the export is refused, naming each cap
    (Megatron-LM does not carry them: parcompile.exporters.model_keys.MEGATRON)."""
    import parcompile
    from parcompile.exporters import export

    (tmp_path / "config.json").write_text(transformers.Gemma2Config().to_json_string())
    spec = tmp_path / "g.par"
    spec.write_text('model g from "config.json" { }\ncluster c from "h100-sxm" { }\nparallel { tp = 2 }\n')
    errors = export(parcompile.compile(spec), "megatron").errors
    assert any(e.startswith("attn_logit_softcapping = 50: Megatron-LM") for e in errors)
    assert any(e.startswith("final_logit_softcapping = 30: Megatron-LM") and "Gemma2OutputLayer" in e for e in errors)


def test_the_caps_belong_to_gemma2_alone():
    """The soft-cap keys are Gemma 2's (its ``owns``): Gemma 3 and Llama refuse a model with
    one, naming it; a Gemma 3 model (qk-norm, no caps) is still guessed Gemma 3, and Gemma 2
    refuses its qk-norm."""
    from parcompile.core.hf_weights import family_problems
    from parcompile.config.presets import MODEL_PRESETS
    from parcompile.core.model import ModelKeys

    gemma3 = ModelKeys(**MODEL_PRESETS["gemma3-27b"])
    assert hf_family(gemma3) == "gemma3_text"
    assert "qk_norm = true" in family_problems(gemma3, "gemma2")[0].message
    capped = ModelKeys(**{**MODEL_PRESETS["gemma3-27b"], "qk_norm": False, "rope_local_base_freq": None,
                          "attn_logit_softcapping": 50.0})
    assert hf_family(capped) == "gemma2"
    assert "attn_logit_softcapping = 50.0" in family_problems(capped, "gemma3_text")[0].message
    llama = ModelKeys(**{**MODEL_PRESETS["llama3-8b"], "final_logit_softcapping": 30.0})
    assert "final_logit_softcapping = 30.0" in family_problems(llama, "llama")[0].message
