import pytest

from parcompile.ir.types import REPLICATED, Dim, Sharding, ShardingError, TensorType


def t(*dims, dtype="bf16"):
    return TensorType(tuple(Dim(*d) for d in dims), dtype)


def test_type_sizes():
    x = t(("batch", 2), ("seq", 8), ("hidden", 16))
    assert x.shape == (2, 8, 16)
    assert x.numel == 2 * 8 * 16
    assert x.nbytes == 2 * 8 * 16 * 2
    assert str(x) == "[batch=2, seq=8, hidden=16] bf16"


def test_local_type_splits_named_dims():
    x = t(("batch", 4), ("seq", 8), ("hidden", 16))
    s = Sharding.make({"batch": "dp", "hidden": "tp"})
    assert s.local_type(x, {"dp": 2, "tp": 4}).shape == (2, 8, 4)
    # partial sums do not change the local shape; degree-1 axes do nothing
    assert Sharding.make({}, {"tp"}).local_type(x, {"tp": 4}).shape == (4, 8, 16)
    assert s.local_type(x, {"dp": 1, "tp": 1}).shape == (4, 8, 16)


def test_local_type_failure_names_both_numbers():
    x = t(("hidden", 10))
    with pytest.raises(ShardingError) as e:
        Sharding.make({"hidden": "tp"}).local_type(x, {"tp": 4})
    assert "10" in str(e.value) and "tp = 4" in str(e.value)
    assert e.value.axis == "tp"


def test_split_respects_units_of_heads():
    # 4 heads of 16: 64 elements divide by 8, but 4 heads do not
    q = TensorType((Dim("q", 64, 16),), "fp32")
    with pytest.raises(ShardingError) as e:
        Sharding.make({"q": "tp"}).local_type(q, {"tp": 8})
    assert "4 units of 16" in str(e.value) and "tp = 8" in str(e.value)
    assert Sharding.make({"q": "tp"}).local_type(q, {"tp": 2}).shape == (32,)


def test_sharding_invariants():
    with pytest.raises(ShardingError):
        Sharding.make({"a": "tp", "b": "tp"})
    with pytest.raises(ShardingError):
        Sharding.make({"a": "tp"}, {"tp"})
    s = REPLICATED.with_split("seq", "tp").with_partial("dp")
    assert s.dim_of("tp") == "seq" and s.partial == {"dp"}
    assert s.without_partial() == Sharding.make({"seq": "tp"})
    assert str(s) == "{seq:tp,partial:dp}"
    assert str(REPLICATED) == "R"
    # equal shardings hash equal whatever the construction order
    assert Sharding.make({"a": "dp", "b": "tp"}) == Sharding.make({"b": "tp", "a": "dp"})
