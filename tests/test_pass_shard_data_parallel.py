from tests.plan_factories import run_until, spec


def test_batch_split_over_dp_and_seq_over_cp():
    cfg = spec(dp=2, cp=2, micro_batch=3, global_batch=12)
    g, ctx = run_until(cfg, "shard-data-parallel")
    deg = ctx.degrees
    tok = g.node("tokens")
    # the graph holds micro_batch * dp = 6 sequences; each rank 3, and seq 64 / cp 2 = 32
    assert tok.type.shape == (6, 64)
    assert tok.sharding.local_type(tok.type, deg).shape == (3, 32)
    wq = g.node("layers.0.attn.wq")
    assert wq.requires[0].split_map == {"batch": "dp", "seq": "cp"}
    assert wq.grads[0] == wq.requires[0]
    # parameters stay replicated
    assert all(not p.sharding.split for _, p in g.params())


def test_noop_without_dp_or_cp():
    g, _ = run_until(spec(), "shard-data-parallel")
    assert all(not n.sharding.split for n in g.nodes())
