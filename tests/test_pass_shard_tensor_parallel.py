import math

from tests.plan_factories import run_until, spec, tiny_model


def test_megatron_column_and_row_layouts():
    g, ctx = run_until(spec(tp=2), "shard-tensor-parallel")
    for w in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3"):
        nd = g.node(f"layers.0.{w}")
        out_dim = nd.type.dims[-1].name
        assert nd.sharding.split_map == {out_dim: "tp"}, w
        assert nd.params[0].sharding.split_map == {out_dim: "tp"}
        assert nd.grads[0].partial == {"tp"}          # copy to the tp region: grad is partial
    for w in ("attn.wo", "mlp.w2"):
        nd = g.node(f"layers.0.{w}")
        assert nd.sharding.partial == {"tp"}, w
        in_dim = nd.op.attr("in_dim").name
        assert nd.requires[0].split_map == {in_dim: "tp"}
        assert nd.params[0].sharding.split_map == {in_dim: "tp"}
    assert g.node("embedding").sharding.partial == {"tp"}
    assert g.node("embedding").params[0].sharding.split_map == {"vocab": "tp"}
    assert g.node("lm_head").sharding.split_map == {"vocab": "tp"}
    assert g.node("loss").requires[0].split_map == {"vocab": "tp"}
    assert not g.node("layers.0.attn_norm").sharding.split


def test_vocab_is_padded_per_megatron_rule_and_counted_unpadded():
    m = tiny_model(vocab=1000)
    g, ctx = run_until(spec(m, tp=4), "shard-tensor-parallel")
    padded = math.ceil(1000 / (128 * 4)) * 128 * 4       # = 1024
    emb = g.node("embedding").params[0]
    assert emb.type.shape == (padded, 64)
    assert emb.numel == 1000 * 64
    assert g.node("lm_head").type.dim("vocab").size == padded
    # tp = 1 pads to a multiple of 128 too
    g1, _ = run_until(spec(m), "shard-tensor-parallel")
    assert g1.node("embedding").params[0].type.shape == (1024, 64)


def test_sequence_parallel_splits_the_residual_stream():
    g, _ = run_until(spec(tp=2, sequence_parallel=True), "shard-tensor-parallel")
    for n in ("layers.0.attn_norm", "layers.0.attn_residual", "layers.0.mlp_residual", "final_norm"):
        assert g.node(n).sharding.split_map == {"seq": "tp"}, n
    assert g.node("layers.0.attn.wq").requires[0].split_map == {}
