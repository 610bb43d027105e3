"""The single-process program against implementations nobody here wrote: Hugging Face
transformers' LlamaForCausalLM and GPT2LMHeadModel holding the same weights (fp32).

Otherwise a bug shared by every layout (RoPE layout, GQA grouping, norm placement,
cross-entropy) would pass `verify`, which only compares layouts with each other.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parcompile.runtime.distributed.context import init_parallel
from tests.program_utils import build_program, tiny_config

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (pip install -e .[test])")

B, T = 3, 16


def _ours(cfg, tmp_path, state: dict[str, torch.Tensor]):
    module, plan = build_program(cfg, tmp_path / "prog")
    ctx = init_parallel(plan)
    model = module.Stage(plan, ctx)
    ours = dict(model.named_parameters())
    assert set(ours) == set(state), (sorted(set(ours) ^ set(state)))
    with torch.no_grad():
        for name, p in ours.items():
            assert p.shape == state[name].shape, name
            p.copy_(state[name])
    return model


def _compare(model, hf, vocab: int):
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (B, T + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    model.eval()
    hf.eval()
    with torch.no_grad():
        ours = model.forward_chunk(0, x)
        loss = model.loss(ours, y) / y.numel()   # the stage's loss sums the token losses
        ref = hf(input_ids=x).logits
    ref_loss = F.cross_entropy(ref.reshape(-1, ref.shape[-1]), y.reshape(-1))
    assert ours.shape[:2] == ref.shape[:2]
    torch.testing.assert_close(ours[..., :vocab], ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    # the logits really depend on the weights: a sanity check that the test can fail
    assert ref.std() > 1e-3


def _llama_state(sd: dict, m, qk_norm: bool = False) -> dict:
    """Our parameter names for a transformers Llama-style ``state_dict`` (written out here,
    independently of parcompile's own mapping), the vocabulary padded with zero rows."""
    padded = m.padded_vocab(1)

    def pad(w):
        return torch.cat([w, torch.zeros(padded - w.shape[0], w.shape[1])])

    names = {"attn_norm": "input_layernorm", "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj",
             "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
             "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj"}
    if qk_norm:
        names.update({"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"})
    state = {"embedding.weight": pad(sd["model.embed_tokens.weight"]), "lm_head.weight": pad(sd["lm_head.weight"]),
             "final_norm.weight": sd["model.norm.weight"]}
    for i in range(m.layers):
        state.update({f"layers.{i}.{ours}.weight": sd[f"model.layers.{i}.{theirs}.weight"]
                      for ours, theirs in names.items()})
    return state


def test_llama_style_matches_transformers(tmp_path):
    cfg = tiny_config(model=dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab=300,
                                 norm="rmsnorm", activation="swiglu", position="rope", rope_theta=500000.0,
                                 norm_eps=1e-6))
    m = cfg.model
    hcfg = transformers.LlamaConfig(
        vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.ffn_hidden, num_hidden_layers=m.layers,
        num_attention_heads=m.heads, num_key_value_heads=m.kv_heads, max_position_embeddings=m.seq_len,
        rms_norm_eps=m.norm_eps, rope_parameters={"rope_theta": m.rope_theta, "rope_type": "default"},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    )
    hcfg._attn_implementation = "eager"
    torch.manual_seed(123)
    hf = transformers.LlamaForCausalLM(hcfg).float()
    with torch.no_grad():  # non-trivial norms, so a misplaced norm weight shows
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    sd = hf.state_dict()
    assert m.padded_vocab(1) > m.vocab  # 300 -> 384: the test covers vocabulary padding too
    model = _ours(cfg, tmp_path, _llama_state(sd, m))
    _compare(model, hf, m.vocab)


def test_gpt2_style_matches_transformers(tmp_path):
    cfg = tiny_config(model=dict(layers=2, hidden=64, heads=4, kv_heads=4, ffn_hidden=256, vocab=256,
                                 norm="layernorm", activation="gelu", position="learned", bias=True,
                                 tie_embeddings=True, norm_eps=1e-5, attention="unfused", max_positions=40))
    m = cfg.model
    assert m.max_positions > m.seq_len  # the position table is sized by n_positions, not seq_len
    hcfg = transformers.GPT2Config(
        vocab_size=m.vocab, n_positions=m.max_positions, n_embd=m.hidden, n_layer=m.layers, n_head=m.heads,
        n_inner=m.ffn_hidden, activation_function="gelu", layer_norm_epsilon=m.norm_eps,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
    )
    hcfg._attn_implementation = "eager"
    torch.manual_seed(321)
    hf = transformers.GPT2LMHeadModel(hcfg).float()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "ln" in n or n.endswith("bias"):
                p.uniform_(-0.5, 1.5) if n.endswith("weight") else p.uniform_(-0.1, 0.1)
    sd = hf.state_dict()
    h = m.hidden
    state = {"embedding.weight": sd["transformer.wte.weight"], "pos_embedding.weight": sd["transformer.wpe.weight"],
             "final_norm.weight": sd["transformer.ln_f.weight"], "final_norm.bias": sd["transformer.ln_f.bias"]}
    for i in range(m.layers):
        p = f"transformer.h.{i}."
        qkv_w = sd[p + "attn.c_attn.weight"].t()  # Conv1D stores (in, out)
        qkv_b = sd[p + "attn.c_attn.bias"]
        for j, name in enumerate(("wq", "wk", "wv")):
            state[f"layers.{i}.attn.{name}.weight"] = qkv_w[j * h:(j + 1) * h]
            state[f"layers.{i}.attn.{name}.bias"] = qkv_b[j * h:(j + 1) * h]
        state.update({
            f"layers.{i}.attn_norm.weight": sd[p + "ln_1.weight"], f"layers.{i}.attn_norm.bias": sd[p + "ln_1.bias"],
            f"layers.{i}.attn.wo.weight": sd[p + "attn.c_proj.weight"].t(),
            f"layers.{i}.attn.wo.bias": sd[p + "attn.c_proj.bias"],
            f"layers.{i}.mlp_norm.weight": sd[p + "ln_2.weight"], f"layers.{i}.mlp_norm.bias": sd[p + "ln_2.bias"],
            f"layers.{i}.mlp.w1.weight": sd[p + "mlp.c_fc.weight"].t(), f"layers.{i}.mlp.w1.bias": sd[p + "mlp.c_fc.bias"],
            f"layers.{i}.mlp.w2.weight": sd[p + "mlp.c_proj.weight"].t(),
            f"layers.{i}.mlp.w2.bias": sd[p + "mlp.c_proj.bias"],
        })
    model = _ours(cfg, tmp_path, state)
    _compare(model, hf, m.vocab)


def _qwen3(m, seed: int = 7):
    """transformers' Qwen3ForCausalLM of the tiny model ``m`` (fp32, eager attention),
    every norm weight (the per-head q_norm and k_norm included) drawn away from 1."""
    hcfg = transformers.Qwen3Config(
        vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.ffn_hidden, num_hidden_layers=m.layers,
        num_attention_heads=m.heads, num_key_value_heads=m.kv_heads, head_dim=m.head_dim,
        max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_eps,
        rope_parameters={"rope_theta": m.rope_theta, "rope_type": "default"},
        tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
    )
    hcfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.Qwen3ForCausalLM(hcfg).float()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return hf


def test_qwen3_qk_norm_matches_transformers(tmp_path):
    """qk-norm (issue 17's added op): Qwen3's per-head RMSNorm of q and k before RoPE, with
    a head_dim that is not hidden / heads (Qwen3's own head_dim key); logits, loss and the
    plan's parameter count against transformers' Qwen3ForCausalLM."""
    from parcompile.driver import compile_config

    cfg = tiny_config(model=dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, ffn_hidden=96, vocab=300,
                                 norm="rmsnorm", activation="swiglu", position="rope", rope_theta=1e6,
                                 norm_eps=1e-6, qk_norm=True))
    m = cfg.model
    hf = _qwen3(m)
    sd = hf.state_dict()
    assert sd["model.layers.0.self_attn.q_norm.weight"].shape == (m.head_dim,)
    # parameters: transformers' count (2 * head_dim per layer for qk-norm)
    assert compile_config(cfg).data["model"]["params"] == sum(p.numel() for p in hf.parameters())
    model = _ours(cfg, tmp_path, _llama_state(sd, m, qk_norm=True))
    _compare(model, hf, m.vocab)
