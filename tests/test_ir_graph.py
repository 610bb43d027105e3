import pytest

from parcompile.ir.graph import Graph, GraphError
from parcompile.ir.ops import Param, convert, dual
from parcompile.ir.types import REPLICATED, Dim, Sharding, TensorType

B, S, H, F = Dim("batch", 2), Dim("seq", 4), Dim("hidden", 8), Dim("ffn", 16)


def small():
    g = Graph()
    g.add_op("x", "input", [], {"dims": (B, S, H), "dtype": "fp32"})
    g.add_op("fc1", "linear", ["x"], {"in_dim": H, "out_dim": F}, params=[Param("fc1.weight", TensorType((F, H), "fp32"))])
    g.add_op("fc2", "linear", ["fc1"], {"in_dim": F, "out_dim": H})
    g.add_op("sum", "add", ["x", "fc2"])
    return g


def test_add_op_infers_types_and_keeps_operand_order():
    g = small()
    assert g.node("fc1").type.shape == (2, 4, 16)
    assert g.node("fc2").type.shape == (2, 4, 8)
    assert g.inputs("sum") == ["x", "fc2"]
    assert g.users("x") == [("fc1", 0), ("sum", 0)]
    assert g.topological() == ["x", "fc1", "fc2", "sum"]


def test_one_tensor_may_feed_one_op_twice():
    g = small()
    g.add_op("double", "add", ["x", "x"])
    assert g.inputs("double") == ["x", "x"]
    assert ("double", 0) in g.users("x") and ("double", 1) in g.users("x")


def test_errors_name_the_op():
    g = small()
    with pytest.raises(GraphError, match="fc1"):
        g.add_op("fc1", "act", ["x"])
    with pytest.raises(GraphError, match="nope"):
        g.add_op("y", "act", ["nope"])
    with pytest.raises(GraphError, match="2 operands"):
        g.add_op("z", "add", ["x"])
    with pytest.raises(GraphError, match="3 operands|operands"):
        g.set_sharding("sum", requires=[REPLICATED])


def test_insert_between_rewires_only_given_consumers():
    g = small()
    g.set_stage("sum", 1)
    g.insert_between("x", [("sum", 0)], "x.copy", "redistribute", {"fwd": (), "bwd": (), "where": "x"})
    assert g.inputs("sum") == ["x.copy", "fc2"]
    assert g.inputs("fc1") == ["x"]
    assert g.node("x.copy").type == g.node("x").type
    assert g.node("x.copy").stage == 1
    with pytest.raises(GraphError):
        g.insert_between("x", [("sum", 0)], "again", "redistribute", {"fwd": (), "bwd": (), "where": "x"})


def test_unique_name_and_deterministic_order():
    g = small()
    assert g.unique_name("fc1") == "fc1.1"
    assert g.unique_name("new") == "new"
    assert small().topological() == small().topological()


def test_convert_is_the_one_rule():
    deg = {"tp": 2, "dp": 2}
    part = Sharding.make({}, {"tp"})
    seq = Sharding.make({"seq": "tp"})
    assert convert(part, REPLICATED, deg) == [("all_reduce", "tp")]
    assert convert(part, seq, deg) == [("reduce_scatter", "tp")]
    assert convert(seq, REPLICATED, deg) == [("all_gather", "tp")]
    assert convert(seq, Sharding.make({"hidden": "tp"}), deg) == [("all_to_all", "tp")]
    assert convert(REPLICATED, seq, deg) == [("split", "tp")]
    assert convert(seq, seq, deg) == []
    # axes of degree one never communicate
    assert convert(part, REPLICATED, {"tp": 1}) == []
    with pytest.raises(ValueError):
        convert(REPLICATED, part, deg)
    assert dual(Sharding.make({"seq": "tp"}, {"dp"})) == seq
