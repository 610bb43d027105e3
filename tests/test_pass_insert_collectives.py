from collections import Counter

from parcompile.analysis.comm import comm_report
from parcompile.ir.verify import verify
from tests.plan_factories import run_until, spec, tiny_model


def table(cfg):
    g, ctx = run_until(cfg, "insert-collectives")
    verify(g, ctx.degrees, staged=True, inserted=True)
    rep = comm_report(g, ctx.degrees, cfg.parallel.num_microbatches, cfg.parallel.recompute, cfg.parallel.pp)
    per_stage = [Counter() for _ in range(cfg.parallel.pp)]
    for c in rep.collectives:
        per_stage[c.stage][(c.op, c.axis, c.bytes)] += c.count
    return g, per_stage


def layer_params_per_rank(h, q, kv, f, tp, swiglu=True):
    # norms replicated; wq, wk, wv, wo, w1, (w3), w2 split over tp
    return 2 * h + (h * q + 2 * h * kv + q * h + (3 if swiglu else 2) * h * f) // tp


def test_matches_the_internals_table_dp2_tp2_pp2():
    cfg = spec(dp=2, tp=2, pp=2, micro_batch=2, global_batch=16)
    g, st = table(cfg)
    b, t, h, e, m, V = 2, 64, 64, 4, 16 // (2 * 2), 256
    act = b * t * h * e
    lp = layer_params_per_rank(h, 64, 32, 128, 2)
    p0 = V // 2 * h + 2 * lp                 # embedding + layers 0, 1
    p1 = 2 * lp + h + V // 2 * h             # layers 2, 3 + final norm + head
    want0 = Counter({
        ("all_reduce", "tp", act): 4 * 2 * m + m,          # 4 per layer per micro-batch + embedding
        ("send", "pp", act): m, ("recv", "pp", act): m,
        ("all_reduce", "dp_cp", 4 * p0): 1,
        ("all_reduce", "tp", 4): 1, ("all_reduce", "pp", 4): 1,
    })
    want1 = Counter({
        ("all_reduce", "tp", act): 4 * 2 * m + m,          # + lm_head backward
        ("all_reduce", "tp", b * t * 4): 3 * m,            # vocab-parallel cross-entropy
        ("send", "pp", act): m, ("recv", "pp", act): m,
        ("all_reduce", "dp_cp", 4 * p1): 1,
        ("all_reduce", "tp", 4): 1, ("all_reduce", "pp", 4): 1,
        ("all_reduce", "dp_cp", 4): 1,                      # loss for logging
    })
    assert st[0] == want0
    assert st[1] == want1


def test_where_names_the_module():
    g, _ = table(spec(tp=2))
    wo = g.users("layers.1.attn.wo")[0][0]
    assert g.node(wo).op.attr("where") == "layers.1.attn"
    assert g.node(g.inputs("layers.1.mlp.w1")[0]).op.attr("where") == "layers.1.mlp"
    # wq, wk, wv share one copy-to-tp-region (one backward all-reduce per layer)
    assert g.inputs("layers.1.attn.wq") == g.inputs("layers.1.attn.wk") == g.inputs("layers.1.attn.wv")


def test_tied_embedding_and_nothing_on_single_rank_axes():
    cfg = spec(tiny_model(tie_embeddings=True), pp=2, global_batch=2)
    _, st = table(cfg)
    V, h = 256, 64
    for s in (0, 1):
        assert st[s][("all_reduce", "embedding", 4 * V * h)] == 1
        assert not any(axis in ("tp", "dp_cp") for _, axis, _ in st[s])


def test_sequence_parallel_uses_gather_and_scatter():
    cfg = spec(tp=2, sequence_parallel=True)
    _, st = table(cfg)
    b, t, h, e = 1, 64, 64, 4
    full, shard = b * t * h * e, b * t * h * e // 2
    c = st[0]
    # per layer: all-gather before attention and MLP (fwd), again in their backward (the
    # kept sequence-split input, Megatron-LM) and after them (bwd of the reduce-scatter);
    # reduce-scatters: fwd after and bwd before each; plus the head's gather (and its
    # backward re-gather) and the embedding's scatter
    layers = 4
    assert c[("all_gather", "tp", full)] == 6 * layers + 2 + 1
    assert c[("reduce_scatter", "tp", shard)] == 4 * layers + 1 + 1
    assert c[("all_reduce", "tp", full)] == 0


def test_send_recv_per_chunk_boundary_with_virtual_stages():
    cfg = spec(tiny_model(layers=8), pp=2, virtual_stages=2, schedule="gpipe", global_batch=2)
    g, st = table(cfg)
    act = 1 * 64 * 64 * 4
    m = 2
    # model chunks 0|1|2|3 on ranks 0,1,0,1: rank 0 sends at 0->1 and 2->3, receives at 1->2
    assert st[0][("send", "pp", act)] == 2 * m + m      # two forward boundaries + one backward
    assert st[0][("recv", "pp", act)] == m + 2 * m
    assert st[1][("send", "pp", act)] == 3 * m
