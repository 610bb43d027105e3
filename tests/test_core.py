"""The ground-floor rules of ``parcompile.core`` against their sources."""

from __future__ import annotations

import pytest

from parcompile.core.axes import AXIS_FAMILY, DEGREE_AXES, FOUND_INF_AXES, GROUP_AXES, MeshAxis
from parcompile.core.dtypes import DTYPE_BYTES, GRAD_BYTES, TORCH_NAMES
from parcompile.core.heads import kv_head_replicas, kv_heads_per_rank, kv_heads_replicated


@pytest.mark.parametrize("kv", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16, 32])
def test_kv_heads_follow_vllm(kv, tp):
    # vLLM QKVParallelLinear: tp >= kv heads -> 1 kv head per rank, replicated tp / kv times
    # (tp a multiple of kv); else kv / tp heads per rank, no replicas (tp divides kv)
    if tp >= kv:
        per, reps = 1, tp // kv
    else:
        per, reps = kv // tp, 1
    assert kv_heads_per_rank(kv, tp) == per
    assert kv_head_replicas(kv, tp) == reps
    assert kv_heads_replicated(kv, tp) == (reps > 1)
    assert per * tp == kv * reps   # every kv head held by `reps` ranks, every rank holds `per`


def test_axes_are_one_set():
    assert GROUP_AXES == tuple(a.value for a in MeshAxis)
    assert len(set(GROUP_AXES)) == len(GROUP_AXES) == 9
    assert set(DEGREE_AXES) | set(AXIS_FAMILY) | set(FOUND_INF_AXES) <= set(GROUP_AXES)
    assert set(AXIS_FAMILY) == set(GROUP_AXES) and set(AXIS_FAMILY.values()) == set(DEGREE_AXES)
    assert MeshAxis.EXPERT_TP == "expert_tp" and f"{MeshAxis.DP_CP}" == "dp_cp"


def test_dtypes_match_torch():
    torch = pytest.importorskip("torch")
    for name, tname in TORCH_NAMES.items():
        assert getattr(torch, tname).itemsize == DTYPE_BYTES[name]
    assert torch.float32.itemsize == GRAD_BYTES
    assert torch.int64.itemsize == DTYPE_BYTES["int64"] and torch.bool.itemsize == DTYPE_BYTES["bool"]
    if hasattr(torch, "float8_e4m3fn"):
        assert torch.float8_e4m3fn.itemsize == DTYPE_BYTES["fp8"]
