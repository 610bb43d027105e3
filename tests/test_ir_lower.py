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
