"""benchmarks/memory.py's report (issue 7): the lines it derives from a run's records, fed
with records a GPU run would write (this machine has none to produce them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from parcompile.driver import compile_config
from tests.program_utils import tiny_config

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "benchmarks" / "memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _records(plan: dict, **extra) -> list[dict]:
    st = plan["memory"]["per_stage"][0]
    return [{"rank": r, "stage": 0, "state_bytes": {k: st[k] for k in ("params", "grads", "optimizer")},
             "saved_per_layer": {str(layer): b for layer, b in st["activations_per_layer"]}, **extra}
            for r in range(2)]


def test_fragmentation_against_memory_reserve():
    bench = _bench()
    plan = compile_config(tiny_config(2)).data
    # 0.90 allocated of reserved on the worst rank: 10% held beyond what was allocated
    recs = _records(plan, allocator_peak={"allocated": 900, "reserved": 1000})
    recs[1]["allocator_peak"] = {"allocated": 950, "reserved": 1000}
    assert "up to 10.0%" in bench.fragmentation(recs, 0.15) and "within" in bench.fragmentation(recs, 0.15)
    assert "MORE than memory_reserve = 5%" in bench.fragmentation(recs, 0.05)
    assert bench.fragmentation(_records(plan), 0.1) is None   # CPU: no allocator peak
    text = bench.report("t", "test", plan, recs, 0.05)
    assert "model states equal the plan exactly" in text and "MORE than" in text


def test_zero3_line_compares_gathered_bytes_with_the_plan():
    bench = _bench()
    plan = compile_config(tiny_config(2, parallel=dict(zero=3, bucket_size=4))).data
    want = plan["memory"]["per_stage"][0]["buffer_parts"]["zero3_gather"]
    full = plan["memory"]["per_stage"][0]["buffer_parts"]["grad_buckets_in_flight"]
    text = bench.report("t", "test", plan, _records(plan, zero3_gathered=want, grad_buckets_in_flight=full))
    assert f"full fp32 gradient buffers at most at once {full / 1024:,.1f} KiB planned, " \
           f"{full / 1024:,.1f} KiB held (ZeRO 2/3: buckets in flight)" in text
    line = next(x for x in text.splitlines() if "ZeRO-3" in x)
    kib = f"{want / 1024:,.1f}"
    assert f"at most {kib} KiB planned, {kib} KiB held" in line
    # the whole stage gathered: every bucket padded to a multiple of dp, 4 bytes (fp32)
    rows = plan["comm"]["grad_buckets"]["per_stage"][0]["dense"]
    whole = 4 * sum(-(-b["elements"] // 2) * 2 for b in rows)
    assert line.endswith(f"{whole / 1024:,.1f} KiB gathered") and whole > want
