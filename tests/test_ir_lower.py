from parcompile.ir.lower import lower
from tests.plan_factories import tiny_model


def names(g):
    return {p.name for _, p in g.params()}


def test_llama_like_parameter_names_match_the_runtime():
    g = lower(tiny_model(layers=2))
    want = {"embedding.weight", "final_norm.weight", "lm_head.weight"}
    for i in range(2):
        want |= {f"layers.{i}.attn_norm.weight", f"layers.{i}.mlp_norm.weight"}
        want |= {f"layers.{i}.attn.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
        want |= {f"layers.{i}.mlp.{w}.weight" for w in ("w1", "w2", "w3")}
    assert names(g) == want


def test_gpt_like_has_learned_positions_biases_and_no_w3():
    g = lower(tiny_model(layers=1, norm="layernorm", activation="gelu", position="learned", bias=True))
    n = names(g)
    assert "pos_embedding.weight" in n
    assert "layers.0.attn_norm.bias" in n and "final_norm.bias" in n
    assert {f"layers.0.attn.{w}.bias" for w in ("wq", "wk", "wv", "wo")} <= n
    assert {"layers.0.mlp.w1.bias", "layers.0.mlp.w2.bias"} <= n
    assert not any("w3" in x for x in n)
    assert "layers.0.attn.rope_q" not in g
    assert g.node("layers.0.mlp.act").op.attr("fn") == "gelu"


def test_qkv_bias_only():
    n = names(lower(tiny_model(layers=1, qkv_bias=True)))
    assert {"layers.0.attn.wq.bias", "layers.0.attn.wk.bias", "layers.0.attn.wv.bias"} <= n
    assert "layers.0.attn.wo.bias" not in n


def test_gqa_shapes():
    m = tiny_model(layers=1)   # 4 heads of 16, 2 kv heads
    g = lower(m, batch=3)
    assert g.node("layers.0.attn.wq").type.shape == (3, 64, 4 * 16)
    assert g.node("layers.0.attn.wk").type.shape == (3, 64, 2 * 16)
    wk = g.node("layers.0.attn.wk").params[0]
    assert wk.type.shape == (2 * 16, 64)


def test_tied_embeddings_share_one_parameter():
    g = lower(tiny_model(layers=1, tie_embeddings=True))
    assert "lm_head.weight" not in names(g)
    head = g.node("lm_head").params[0]
    assert head.name == "embedding.weight"


def test_parallel_residual_reads_the_layer_input():
    g = lower(tiny_model(layers=2, parallel_residual=True))
    assert g.inputs("layers.1.mlp_norm") == ["layers.0.mlp_residual"]
    assert g.inputs("layers.1.attn_norm") == ["layers.0.mlp_residual"]
    assert g.inputs("layers.1.mlp_residual") == ["layers.1.attn_residual", "layers.1.mlp.w2"]
    g2 = lower(tiny_model(layers=1))
    assert g2.inputs("layers.0.mlp_norm") == ["layers.0.attn_residual"]


def test_ops_are_named_hierarchically_and_in_model_order():
    g = lower(tiny_model(layers=2))
    order = g.topological()
    assert order.index("layers.0.attn.wq") < order.index("layers.1.attn.wq") < order.index("loss")
    assert g.node("layers.1.attn.wq").op.layer == 1
    assert g.node("layers.1.attn.wq").op.module == "layers.1.attn"


def _rules(keys):
    from parcompile.config.schema import ModelConfig
    from parcompile.ir.lower import select_rules
    return select_rules(ModelConfig(**keys))


def test_families_of_one_structure_share_the_rules_others_differ_where_their_keys_do():
    from parcompile.core.families import model_presets
    from parcompile.ir.lower import Rules
    presets = model_presets()
    llama = Rules(embedding="tokens", attention="mha", mlp="gated", moe=False, norms="pre",
                  residual="sequential", head="untied", logits="plain")
    for name in ("llama2-7b", "llama3.1-405b", "mistral-7b", "qwen2-72b", "qwen3-8b"):
        assert _rules(presets[name]) == llama, name
    for name in ("mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-20b"):   # routed experts, Llama's attention
        assert _rules(presets[name]) == Rules(**{**llama.__dict__, "moe": True}), name
    assert _rules(presets["deepseek-v3"]) == Rules(**{**llama.__dict__, "attention": "mla", "moe": True})
    assert _rules(presets["gemma3-27b"]) == Rules(**{**llama.__dict__, "norms": "sandwich", "head": "tied"})
    assert _rules(presets["gpt3-175b"]) == Rules(**{**llama.__dict__, "embedding": "learned", "mlp": "ungated",
                                                    "head": "tied"})


def test_gpt_neox_and_gemma2_select_their_rules_from_their_config_json():
    from pathlib import Path
    from parcompile.core.hf import from_hf_dict, load_hf_config
    neox = _rules(load_hf_config(Path(__file__).parent / "data" / "hf" / "pythia-160m.json"))
    assert (neox.residual, neox.mlp, neox.norms) == ("parallel", "ungated", "pre")
    gemma2 = _rules(from_hf_dict({"model_type": "gemma2", "vocab_size": 300, "hidden_size": 64,
                                  "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
                                  "sliding_window": 4, "final_logit_softcapping": 30.0,
                                  "attn_logit_softcapping": 50.0, "tie_word_embeddings": True}))
    assert (gemma2.norms, gemma2.head, gemma2.logits) == ("sandwich", "tied", "softcap")


def test_moe_rule_starts_at_dense_layers_and_shared_experts_take_the_dense_rule():
    g = lower(tiny_model(layers=3, experts=4, top_k=2, expert_ffn_hidden=32, dense_layers=1, shared_experts=2))
    assert "layers.0.mlp.w3" in g and "layers.0.mlp.router" not in g
    assert "layers.1.mlp.router" in g and "layers.1.mlp.w3" not in g
    assert g.node("layers.2.mlp.shared.w1").type.shape[-1] == 2 * 32
    assert g.inputs("layers.2.mlp.shared_add") == ["layers.2.mlp.combine", "layers.2.mlp.shared.w2"]
