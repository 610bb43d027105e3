"""RoPE scaling (`rope_type` linear, yarn, llama3) against transformers' own
``ROPE_INIT_FUNCTIONS`` (the inverse frequencies and the cos/sin factor), and a tiny
Llama 3.1-style checkpoint (llama3 scaling) whose logits equal transformers' after
``from "config.json"``: a config.json's scaling is read, not dropped."""

from __future__ import annotations

import json

import pytest
import torch

from parcompile.runtime.model.layers import rope_inv_freq

transformers = pytest.importorskip("transformers")


def _reference(kind: str, params: dict):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=32768,
                                   rope_parameters={"rope_type": kind, "rope_theta": 150000.0, **params})
    return ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")


@pytest.mark.parametrize("kind, params, ours", [
    ("linear", {"factor": 8.0}, {"factor": 8.0}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192},
     {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    ("yarn", {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
              "original_max_position_embeddings": 4096},
     {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 8192},
     {"factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True, "original_max_position_embeddings": 8192}),
])
def test_inverse_frequencies_equal_transformers(kind, params, ours):
    want, factor = _reference(kind, params)
    got, got_factor = rope_inv_freq(64, 150000.0, {"rope_type": kind, **ours})
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)
    assert got_factor == pytest.approx(factor)


def test_a_llama31_checkpoint_keeps_its_rope_scaling(tmp_path):
    from parcompile import runtime as rt
    from parcompile.core.hf import from_hf_dict
    from parcompile.runtime.distributed.context import init_parallel
    from parcompile.runtime.state.weights import load_hf
    from tests.program_utils import build_program, tiny_config

    hcfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(hcfg).float().eval()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    keys = {k: v for k, v in from_hf_dict(json.loads((tmp_path / "hf" / "config.json").read_text())).items()
            if v is not None}
    assert keys["rope_type"] == "llama3" and keys["rope_original_max_positions"] == 16
    cfg = tiny_config(model={**keys, "seq_len": 32, "dtype": "fp32"}, name="llama31")
    module, plan = build_program(cfg, tmp_path / "prog")
    with rt.no_init():
        stage = module.Stage(plan, init_parallel(plan))
    load_hf(stage, str(tmp_path / "hf"))
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    stage.eval()
    with torch.no_grad():
        ours = stage.forward_chunk(0, ids)[..., :300]
        ref = hf(input_ids=ids).logits
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


# ---- attention sinks (gpt-oss) ---------------------------------------------------------------------


def _eager_with_sinks(q, k, v, sinks, window: int):
    """transformers' GptOss eager_attention_forward, written out: scores, a causal (and
    window) mask, the sink as one more column, softmax, the column dropped."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    T = q.shape[2]
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    keep = (j <= i) & ((i - j) < window if window else True)
    scores = scores.masked_fill(~keep, float("-inf"))
    combined = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, T, 1)], dim=-1)
    return torch.softmax(combined, dim=-1)[..., :-1] @ v


@pytest.mark.parametrize("window", [0, 3])
def test_attention_sinks_equal_the_eager_formula_with_gradients(window):
    from parcompile.runtime.model.core_attention import attention_core

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 8, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 8, 16, generator=g, requires_grad=True)
    sinks = torch.randn(4, generator=g, requires_grad=True)
    with pytest.raises(ValueError, match="sinks"):   # torch's SDPA takes none: the program never asks
        attention_core(q, k, v, fused=True, dropout=0.0, training=False, window=window, sinks=sinks)
    got = attention_core(q, k, v, fused=False, dropout=0.0, training=False, window=window, sinks=sinks)
    want = _eager_with_sinks(q, k, v, sinks, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v, sinks))
    refs = torch.autograd.grad(want.square().sum(), (q, k, v, sinks))
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert refs[3].abs().sum() > 0
