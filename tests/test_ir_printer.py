from parcompile.ir.lower import lower
from parcompile.ir.printer import dump
from tests.plan_factories import run_until, spec, tiny_model


def test_dump_is_stable_and_one_line_per_op():
    a, b = dump(lower(tiny_model())), dump(lower(tiny_model()))
    assert a == b
    g = lower(tiny_model())
    assert len(a.splitlines()) == len(g)
    assert a.endswith("\n")


def test_line_format_after_passes():
    g, ctx = run_until(spec(tp=2, pp=2, dp=2, micro_batch=2, global_batch=16), "insert-collectives")
    lines = {ln.split(" = ")[0]: ln for ln in dump(g, ctx.degrees).splitlines()}
    # batch = micro_batch * dp = 4 globally, 2 locally; q = 4 heads x 16 = 64, 32 per tp rank
    assert lines["layers.0.attn.wq"] == (
        "layers.0.attn.wq = linear(layers.0.attn.bwd_all_reduce) : [batch=4, seq=64, q=64] fp32 "
        "-> local [2, 64, 32] {batch:dp,q:tp} @stage 0 params=layers.0.attn.wq.weight{q:tp}")
    assert lines["layers.0.attn.all_reduce"].endswith("@stage 0 fwd=all_reduce(tp) bwd=-")
    assert "@stage 1" in lines["loss"]
