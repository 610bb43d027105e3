"""The `cpu` preset describes the machine it runs on (issue 30.5; parcompile/frontend/host.py, measured by parcompile/runtime/machine/host.py).

The suite pins the fixed figures (tests/conftest.py: PARCOMPILE_CPU_PROBE=fixed); these
tests set the variable themselves, and point the probe cache at a temporary directory.
"""

from __future__ import annotations

import json

import pytest

import parcompile
from parcompile.diagnostics import SpecError
from parcompile.frontend import host
from parcompile.runtime.machine import host as runtime_host

GiB = 2**30

# the reproducer: a small tp 2 x pp 2 serve spec without kv_cache_tokens
SERVE = """model tiny {
    layers = 4, hidden = 64, heads = 4, kv_heads = 2, ffn_hidden = 128
    vocab = 256, seq_len = 64, dtype = fp32, norm = rmsnorm, activation = swiglu, position = rope
}
cluster local from "cpu" { gpus_per_node = 4 }
parallel { tp = 2, pp = 2 }
serve {
    batch = 8
    prompt_len = 16
    max_new_tokens = 48
}
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "parcompile" / "cpu-probe.json"


def test_the_cpu_preset_shares_this_machines_memory_between_the_ranks(monkeypatch, cache):
    """Before: 16 GiB per rank whatever the machine, so the default KV cache of this spec
    took about 14 GiB per rank (56 GiB on a 24 GiB machine: the kernel killed the ranks)."""
    monkeypatch.setenv(host.ENV, "memory=24GiB,flops=50GFLOPS,bw=10GB/s,overhead=10us,latency=300us")
    plan = parcompile.compile(SERVE, filename="s.par")
    assert plan.config.cluster.memory == 6 * GiB - host.PROCESS_BYTES      # 24 GiB / 4 ranks, less each process's torch
    sv = plan.data["serve"]
    room = sv["max_concurrent_tokens"] * sv["kv_bytes_per_token"]   # the cache the memory would allow
    per_rank = room + sv["weights_bytes_per_rank"] + sv["workspace_bytes_per_rank"]
    assert 4 * per_rank <= 24 * GiB * 0.9 and room > 4 * GiB
    # what each rank's serve engine allocates: the running batch at its longest (issue 47), 8 x (16 + 48) tokens
    assert sv["kv_cache_tokens"] == 8 * 64
    cl = plan.config.cluster
    share = min(1.0, host.cores() / 4)               # the node's cores shared by 4 single-threaded ranks
    assert cl.peak_flops == pytest.approx(50e9 * share) and cl.hbm_bw == pytest.approx(10e9 * share)
    figures = plan.data["estimate"]["assumptions"]["cluster_figures"]
    assert "24.0 GiB available / 4 rank(s) - 512 MiB per process" in figures and "pinned by PARCOMPILE_CPU_PROBE" in figures
    assert not cache.exists()                   # nothing probed: every figure was pinned
    # an explicit `memory` in the spec still wins
    own = parcompile.compile(SERVE.replace("gpus_per_node = 4", "gpus_per_node = 4, memory = 2 GiB"), filename="s.par")
    assert own.config.cluster.memory == 2 * GiB


def test_fixed_figures_keep_plans_machine_independent_and_a_bad_variable_is_a_spec_error(monkeypatch, cache):
    monkeypatch.setenv(host.ENV, "fixed")
    a = parcompile.compile(SERVE, filename="s.par")
    assert a.config.cluster.memory == 16 * GiB and a.config.cluster.peak_flops == 1e12
    assert "fixed" in a.data["estimate"]["assumptions"]["cluster_figures"]
    assert a.to_json() == parcompile.compile(SERVE, filename="s.par").to_json()
    monkeypatch.setenv(host.ENV, "memory=lots")
    with pytest.raises(SpecError) as e:
        parcompile.compile(SERVE, filename="s.par")
    d = e.value.diagnostics[0]
    assert "PARCOMPILE_CPU_PROBE: `memory=lots`" in d.message and d.span.line == 5 and "fixed" in d.help


def test_the_probe_is_short_cached_atomically_per_machine_and_torch_and_refreshable(monkeypatch, cache):
    monkeypatch.delenv(host.ENV, raising=False)
    first = host.host_figures()       # how long it takes: benchmarks/cpu_estimate.py prints it
    assert first.gemm_flops > 1e8 and first.copy_bw > 1e8 and first.memory >= host.MEMORY_STEP
    assert 0 < first.op_overhead < 1e-2 and first.latency is None      # no rank count asked: no gloo figure
    assert first.memory % host.MEMORY_STEP == 0 and first.cores >= 1
    stored = json.loads(cache.read_text())
    assert list(stored) == [host._machine_key()] and "torch" in host._machine_key()
    assert not list(cache.parent.glob(".cpu-probe.*"))          # no temporary file left

    def no_probe():
        raise AssertionError("probed although the cache holds this machine")

    monkeypatch.setattr(host, "probe", no_probe)
    again = host.host_figures()
    assert (again.gemm_flops, again.copy_bw) == (first.gemm_flops, first.copy_bw) and "cached in" in again.source
    monkeypatch.setattr(host, "probe", lambda: (2e9, 3e9, 4e-6))
    monkeypatch.setattr(host, "_machine_key", lambda: "other machine|torch 9")
    other = host.host_figures()
    assert (other.gemm_flops, other.copy_bw) == (2e9, 3e9) and len(json.loads(cache.read_text())) == 2
    monkeypatch.setattr(host, "probe", lambda: (4e9, 5e9, 4e-6))
    assert host.host_figures("probe").gemm_flops == 4e9               # refreshed on request
    cache.write_text("{not json")
    assert host.host_figures().gemm_flops == 4e9                      # a damaged cache is probed again
    blocker = cache.parent.parent.parent / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))        # the cache would be under a file: not writable
    unwritable = host.host_figures()
    assert unwritable.gemm_flops == 4e9 and "not cached" in unwritable.source


def test_per_rank_figures_divide_the_node():
    f = host.HostFigures(memory=24 * GiB, cores=2, gemm_flops=80e9, copy_bw=30e9, source="test")
    fixed = {"gpus_per_node": 8, "memory": 16 * GiB, "peak_flops": 1e12, "hbm_bw": 20e9}
    one = host.cpu_values(fixed, 1, f)
    assert one["memory"] == 24 * GiB - host.PROCESS_BYTES and one["peak_flops"] == 160e9 and one["hbm_bw"] == 30e9   # one process, 2 cores
    eight = host.cpu_values(fixed, 8, f)
    assert eight["memory"] == 3 * GiB - host.PROCESS_BYTES and eight["peak_flops"] == 20e9 and eight["hbm_bw"] == 7.5e9
    assert "24.0 GiB available / 8 rank(s) - 512 MiB per process" in eight["figures"]


# ---- the estimate's host terms: op overhead and gloo latency (issue 30.5) ----------------

#: the tiny spec at world 1: 4 layers, global batch 16 in micro-batches of 2 (m = 8)
SINGLE = """model tiny {
    layers = 4, hidden = 64, heads = 4, kv_heads = 2, ffn_hidden = 128
    vocab = 256, seq_len = 64, dtype = fp32, norm = rmsnorm, activation = swiglu, position = rope
}
cluster local from "cpu" { gpus_per_node = 1 }
parallel { micro_batch = 2, global_batch = 16 }
train { steps = 1 }
"""
#: its graph ops per micro-batch: each layer's attn_norm, wq, wk, wv, rope_q, rope_k, core,
#: wo, add, mlp_norm, w1, w3, swiglu, w2, add (15), then embedding, final norm, lm_head, loss
SINGLE_OPS = 4 * 15 + 4


def test_every_op_of_every_micro_batch_costs_the_op_overhead_forward_once_and_backward_twice(monkeypatch):
    """Before: no term for the eager program's per-op cost, so a CPU run of a small model
    was predicted 10-25x too fast (0.0198 s for examples/tiny.par against 0.3-0.6 s)."""
    def plan_with(overhead: str):
        monkeypatch.setenv(host.ENV, f"memory=24GiB,flops=50GFLOPS,bw=10GB/s,overhead={overhead},latency=100us")
        return parcompile.compile(SINGLE, filename="s.par")

    base, slow = plan_with("0us"), plan_with("20us")
    assert slow.config.cluster.op_overhead == pytest.approx(20e-6)          # one rank: a whole core, no slowdown
    m = slow.data["schedule"]["num_microbatches"]
    assert m == 8
    expected = 3 * m * SINGLE_OPS * 20e-6
    br = slow.data["estimate"]["breakdown"]
    assert br["op_overhead"] == pytest.approx(expected)
    assert slow.data["estimate"]["step_time"] - base.data["estimate"]["step_time"] == pytest.approx(expected)
    assert sum(v for k, v in br.items()) == pytest.approx(slow.data["estimate"]["step_time"])
    assert "20.0 us per op" in slow.data["estimate"]["assumptions"]["cluster_figures"]


def test_ranks_beyond_the_cores_share_them_and_gloo_latency_is_taken_at_the_rank_count():
    f = host.HostFigures(memory=24 * GiB, cores=2, gemm_flops=80e9, copy_bw=30e9, source="test",
                         op_overhead=10e-6, latency=400e-6)
    fixed = {"gpus_per_node": 8, "memory": 16 * GiB, "peak_flops": 1e12, "hbm_bw": 20e9,
             "intra_node_latency": 50e-6, "inter_node_latency": 100e-6, "op_overhead": 20e-6}
    eight = host.cpu_values(fixed, 8, f)
    assert eight["op_overhead"] == pytest.approx(40e-6)              # 8 single-threaded ranks on 2 cores
    assert eight["intra_node_latency"] == eight["inter_node_latency"] == 400e-6   # measured at 8 ranks: as is
    assert host.cpu_values(fixed, 2, f)["op_overhead"] == pytest.approx(10e-6)
    assert host.cpu_values(fixed, 1, f)["op_overhead"] == pytest.approx(10e-6)    # more cores: Python no faster
    unknown = host.cpu_values(fixed, 8, host.HostFigures(24 * GiB, 2, 80e9, 30e9, "test"))
    assert unknown["op_overhead"] == 20e-6 and unknown["intra_node_latency"] == 50e-6   # the fixed figures
    assert "gloo latency fixed (50 us)" in unknown["figures"]


def test_the_gloo_figure_is_probed_once_per_rank_count_and_cached(monkeypatch, cache):
    monkeypatch.delenv(host.ENV, raising=False)
    monkeypatch.setattr(host, "probe", lambda: (2e9, 3e9, 4e-6))
    asked = []

    def fake_gloo(ranks=2):
        asked.append(ranks)
        return 1e-4 * ranks

    monkeypatch.setattr(host, "gloo_latency", fake_gloo)
    assert host.host_figures(ranks=4).latency == pytest.approx(4e-4)
    assert host.host_figures(ranks=4).latency == pytest.approx(4e-4) and asked == [4]
    assert host.host_figures(ranks=2).latency == pytest.approx(2e-4) and asked == [4, 2]
    stored = json.loads(cache.read_text())[host._machine_key()]
    assert stored["gloo_latency"] == {"4": pytest.approx(4e-4), "2": pytest.approx(2e-4)}
    assert host.host_figures().latency is None and asked == [4, 2]         # no ranks: no gloo figure
    monkeypatch.setenv(host.ENV, "latency=70us")
    assert host.host_figures(ranks=8).latency == pytest.approx(70e-6) and asked == [4, 2]   # pinned: not probed
    # a cache from before the per-op figure is probed again
    cache.write_text(json.dumps({host._machine_key(): {"gemm_flops": 1e9, "copy_bw": 1e9, "when": "x"}}))
    monkeypatch.delenv(host.ENV)
    assert host.host_figures().op_overhead == 4e-6


def test_gloo_latency_measures_two_ranks_and_ends_its_busy_processes():
    import os

    before = set(os.listdir("/proc")) if os.path.isdir("/proc") else set()
    t = host.gloo_latency(4)          # two gloo ranks beside two busy processes
    assert t is None or 0 < t < 1.0
    if before:
        mine = [p for p in set(os.listdir("/proc")) - before if p.isdigit()
                and _parent(p) == os.getpid()]
        assert mine == []                                 # no busy process left behind


def _parent(pid: str) -> int | None:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def test_gpu_presets_have_no_op_overhead_and_a_spec_may_set_one():
    gpu = """model m from "llama3-8b" { layers = 2, seq_len = 1024 }
cluster c from "h100-sxm" { }
parallel { tp = 8 }
"""
    plan = parcompile.compile(gpu, filename="g.par")
    assert plan.config.cluster.op_overhead == 0 and "op_overhead" not in plan.data["estimate"]["breakdown"]
    own = parcompile.compile(gpu.replace("{ }", "{ op_overhead = 5 us }", 1).replace(
        'from "h100-sxm" { }', 'from "h100-sxm" { op_overhead = 5 us }'), filename="g.par")
    assert own.config.cluster.op_overhead == pytest.approx(5e-6)
    assert own.data["estimate"]["breakdown"]["op_overhead"] > 0
    with pytest.raises(SpecError) as e:
        parcompile.compile(gpu.replace('from "h100-sxm" { }', 'from "h100-sxm" { op_overhead = 5 }'), filename="g.par")
    assert "op_overhead" in e.value.diagnostics[0].message or "time" in e.value.diagnostics[0].message

def test_a_figure_pinned_twice_is_a_spec_error(monkeypatch, cache):
    """Before: `memory=24GiB,memory=1GiB` planned with the last one, silently."""
    monkeypatch.setenv(host.ENV, "memory=24GiB,flops=50GFLOPS,memory=1GiB")
    with pytest.raises(SpecError) as e:
        parcompile.compile(SERVE, filename="s.par")
    assert "PARCOMPILE_CPU_PROBE: `memory` is given twice" in e.value.diagnostics[0].message


@pytest.mark.parametrize("value", ["memory=1e400GiB", "flops=1e999GFLOPS", "bw=1e309GB/s"])
def test_an_infinite_pinned_figure_is_a_spec_error(monkeypatch, cache, value):
    """Before: `memory=1e400GiB` parsed as inf and `int(inf)` was an OverflowError traceback
    out of `parcompile check`; an infinite flops or bandwidth planned steps of 0 s. Now the
    variable's diagnostic, as for any figure that is no positive number."""
    monkeypatch.setenv(host.ENV, value)
    with pytest.raises(SpecError) as e:
        parcompile.compile(SERVE, filename="s.par")
    assert f"PARCOMPILE_CPU_PROBE: `{value}`" in e.value.diagnostics[0].message


@pytest.mark.parametrize("bad", [0, -1.0, "nan", "inf", 1e400, "x", None])
def test_a_damaged_probe_cache_figure_is_probed_again(monkeypatch, cache, bad):
    """Before: a cached rate of 0, a negative one, NaN or inf (a hand-edited or damaged
    cpu-probe.json) went into the plan (NaN or infinite step times, or a ZeroDivisionError).
    Now such an entry is probed again and rewritten."""
    monkeypatch.delenv(host.ENV, raising=False)
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({host._machine_key(): {"gemm_flops": bad, "copy_bw": 3e9, "op_overhead": 1e-5,
                                                       "when": "x"}}))
    monkeypatch.setattr(host, "probe", lambda: (2e9, 4e9, 2e-5))
    monkeypatch.setattr(host, "gloo_latency", lambda ranks: 1e-4)
    f = host.host_figures()
    assert (f.gemm_flops, f.copy_bw) == (2e9, 4e9) and "probed" in f.source
    assert json.loads(cache.read_text())[host._machine_key()]["gemm_flops"] == 2e9


def test_a_probe_cache_that_is_a_fifo_is_not_waited_on(monkeypatch, cache):
    """Before: a FIFO at the cache's path (or /dev/zero linked there) blocked every command
    that plans for the `cpu` preset, forever. Now only a regular, size-limited file is read
    (parcompile.core.files); anything else is probed again."""
    import os
    import threading

    monkeypatch.delenv(host.ENV, raising=False)
    cache.parent.mkdir(parents=True)
    os.mkfifo(cache)
    monkeypatch.setattr(host, "probe", lambda: (2e9, 4e9, 2e-5))
    got = []
    t = threading.Thread(target=lambda: got.append(host.probed_rates()), daemon=True)
    t.start()
    t.join(10)
    if not got:   # unblock a blocked reader so that the test process can end (never block here)
        try:
            os.close(os.open(cache, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    assert got and got[0][:2] == (2e9, 4e9)


def test_engine_threads_leave_the_front_a_core():
    """A serve engine rank's intra-op threads: the cores less one (the front's), shared by
    the ranks, never below one."""
    assert [runtime_host.engine_threads(r, cpus=16) for r in (1, 2, 4, 8, 15, 16, 32)] == [15, 7, 3, 1, 1, 1, 1]
    assert runtime_host.engine_threads(1, cpus=2) == 1 and runtime_host.engine_threads(1, cpus=1) == 1
    with pytest.raises(ValueError, match="ranks"):
        runtime_host.engine_threads(0)
