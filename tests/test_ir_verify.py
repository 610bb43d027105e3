import pytest

from parcompile.ir.lower import lower
from parcompile.ir.types import Sharding
from parcompile.ir.verify import VerifyError, verify
from tests.plan_factories import spec, run_until, tiny_model


def test_lowered_graph_verifies():
    verify(lower(tiny_model()), {})


def test_a_mismatched_edge_is_caught_after_insert_collectives():
    g, ctx = run_until(spec(tp=2), "insert-collectives")
    verify(g, ctx.degrees, staged=True, inserted=True)
    # break one edge: wo's output is partial, its consumer now wants it split on seq
    g.set_sharding("layers.0.attn.all_reduce", out=Sharding.make({}, {"tp"}))
    with pytest.raises(VerifyError) as e:
        verify(g, ctx.degrees, staged=True, inserted=True)
    assert "layers.0.attn_residual" in str(e.value)


def test_indivisible_layout_names_op_and_numbers():
    g = lower(tiny_model())
    g.set_sharding("layers.0.attn.wq", out=Sharding.make({"q": "tp"}))
    with pytest.raises(VerifyError) as e:
        verify(g, {"tp": 3})
    assert "layers.0.attn.wq" in str(e.value) and "tp = 3" in str(e.value)


def test_cross_chunk_edge_without_send_recv_is_caught():
    g, ctx = run_until(spec(pp=2), "insert-collectives")
    verify(g, ctx.degrees, staged=True, inserted=True)
    g.set_stage("layers.2.attn_norm", 0, 0)   # its input arrives via send_recv on chunk 1
    with pytest.raises(VerifyError, match="crosses model chunks|send/recv"):
        verify(g, ctx.degrees, staged=True, inserted=True)
