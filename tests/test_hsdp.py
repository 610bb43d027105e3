"""HSDP (issue 49, SPEC `parallel.dp_replicate` / `dp_shard`): the checks, the plan's shard
and replicate groups (torchtitan's dp_replicate x dp_shard mesh), the states sharded over
dp_shard only, the collectives on their own groups and links, and `parcompile verify` of a
replicate 2 x shard 2 miniature against the single process."""

from __future__ import annotations

import math

import pytest

from parcompile.core.data_parallel import data_parallel_sharding
from parcompile.core.groups import hsdp_groups, rank_groups
from parcompile.driver import compile_config
from parcompile.frontend import load_spec
from tests.program_utils import tiny_config
from tests.test_checks import diags, one, spec
from tests.test_export_engines import torchtitan  # noqa: F401  (the fixture: torchtitan 0.3.0's config parser)


def test_dp_shard_is_the_other_way_to_write_dp_replicate():
    cfg, _ = load_spec(spec(parallel={"dp": "4", "tp": "2", "pp": None, "zero": "3", "dp_shard": "2",
                                      "global_batch": "8"}))
    assert (cfg.parallel.dp_replicate, cfg.parallel.dp_shard) == (2, 2)
    cfg, _ = load_spec(spec(parallel={"dp": "4", "tp": "2", "pp": None, "zero": "3", "global_batch": "8"}))
    assert (cfg.parallel.dp_replicate, cfg.parallel.dp_shard) == (1, 4)   # SPEC's defaults: 1, dp


@pytest.mark.parametrize("keys,entry,message", [
    ({"dp_replicate": "3", "zero": "3"}, "dp_replicate = 3", "dp_replicate = 3 does not divide dp = 2"),
    ({"dp_shard": "3", "zero": "3"}, "dp_shard = 3", "dp_shard = 3 does not divide dp = 2"),
    ({"dp_replicate": "2", "dp_shard": "2", "zero": "3"}, "dp_shard = 2",
     "dp_replicate * dp_shard = 2 * 2 is not dp = 2"),
    ({"dp_replicate": "2"}, "dp_replicate = 2", "dp_replicate = 2 needs zero = 1, 2 or 3"),
])
def test_a_bad_mesh_is_one_diagnostic_at_its_key(keys, entry, message):
    text = spec(parallel=keys)
    got, help, _ = one(text, entry)
    assert got.startswith(message) and help


def test_dp_shard_with_dp_left_to_the_search_is_refused():
    """dp = auto resolves at once where the other degrees are given (dp_shard then divides
    it); with tp = auto each candidate has its own dp, so dp_shard has nothing to divide."""
    cfg, _ = load_spec(spec(parallel={"dp": "auto", "dp_shard": "1", "zero": "3"}))
    assert (cfg.parallel.dp, cfg.parallel.dp_replicate) == (2, 2)
    found = diags(spec(parallel={"dp": None, "tp": "auto", "dp_shard": "2", "zero": "3"}))
    assert any(sev == "error" and msg.startswith("dp_shard = 2 needs a numeric dp") for sev, msg, *_ in found)


def test_the_groups_split_dp_cp_into_torchtitans_mesh():
    """torchtitan's mesh ["dp_replicate", "dp_shard"] over a dp_cp group: the shard dim is the
    fastest, so shard groups are consecutive members and replicate groups strided. tp 2 x dp 4
    on 8 ranks: the dp groups are [0,2,4,6] and [1,3,5,7] (Megatron-Core's order)."""
    g = rank_groups(tiny_config(4, 2, parallel=dict(zero=3, dp_replicate=2)).parallel)
    assert g["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["dp_shard"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp_replicate"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hsdp_groups([[0, 1, 2, 3]], 1) == {}
    assert "dp_shard" not in rank_groups(tiny_config(4, parallel=dict(zero=3)).parallel)   # no HSDP: none


def test_states_are_sharded_over_dp_shard_only():
    """HSDP's per-rank parameters, gradients and optimizer states are ZeRO-3's over dp_shard
    ranks: replicate 2 x shard 2 holds what zero 3 over dp 2 holds, and twice what zero 3
    over dp 4 holds (up to bucket padding)."""
    hsdp = compile_config(tiny_config(4, parallel=dict(zero=3, dp_replicate=2))).data["memory"]["per_stage"][0]
    two = compile_config(tiny_config(2, parallel=dict(zero=3))).data["memory"]["per_stage"][0]
    four = compile_config(tiny_config(4, parallel=dict(zero=3))).data["memory"]["per_stage"][0]
    for part in ("params", "grads", "optimizer"):
        assert hsdp[part] == two[part]
        assert math.isclose(hsdp[part], 2 * four[part], rel_tol=1e-3)


def _collectives(plan):
    return {(c["op"], c["axis"]) for c in plan.data["comm"]["collectives"] if c["phase"] == "step"}


def test_the_step_reduces_in_the_shard_group_then_across_replicas():
    """FSDP2's HSDP: reduce-scatter and all-gather over dp_shard, the gradient shards
    all-reduced over dp_replicate (fp32, one per bucket and step)."""
    plan = compile_config(tiny_config(4, parallel=dict(zero=3, dp_replicate=2)))
    ops = _collectives(plan)
    assert {("reduce_scatter", "dp_shard"), ("all_gather", "dp_shard"), ("all_reduce", "dp_replicate")} <= ops
    assert not {op for op in ops if op[1] == "dp_cp" and op[0] != "all_reduce"}
    shards = {c["where"]: c for c in plan.data["comm"]["collectives"] if c["axis"] == "dp_replicate"}
    rs = [c for c in plan.data["comm"]["collectives"] if c["op"] == "reduce_scatter"]
    assert sum(c["bytes"] for c in shards.values()) <= sum(c["bytes"] for c in rs)
    assert all(c["count"] == 1 for c in plan.data["comm"]["collectives"] if c["axis"] == "dp_replicate")


def test_the_shard_group_stays_on_nvlink_and_the_replicas_cross_nodes():
    """2 nodes of 8 H100s, dp 16 = replicate 2 x shard 8: the shard groups are one node each,
    the replicate groups span both (the network model's placement of each group)."""
    text = ('model m from "llama3-8b" { layers = 2 }\ncluster c from "h100-sxm" { nodes = 2 }\n'
            "parallel {\n    dp = 16\n    dp_replicate = 2\n    zero = 3\n}\n")
    cfg, _ = load_spec(text)
    assert data_parallel_sharding(cfg.parallel).shard == 8
    net = compile_config(cfg).data["estimate"]["assumptions"]["network"]
    assert (net["dp_shard"]["ranks_per_node"], net["dp_shard"]["nodes"]) == (8, 1)
    assert (net["dp_replicate"]["ranks_per_node"], net["dp_replicate"]["nodes"]) == (1, 2)


@pytest.mark.torchrun
def test_verify_passes_replicate_2_by_shard_2(tmp_path):
    """Issue 49's done-when: verify of an HSDP miniature (replicate 2 x shard 2, zero 3)
    equals the single process, with the planned collectives on dp_shard and dp_replicate."""
    from parcompile.verification import verify

    cfg = tiny_config(4, parallel=dict(zero=3, dp_replicate=2, bucket_size=16 * 1024))
    result = verify(cfg, steps=3, workdir=tmp_path)
    assert result.ok, result.table()


def test_exports_carry_hsdp_where_the_engine_has_it():
    """torchtitan: data_parallel_replicate_degree x data_parallel_shard_degree; DeepSpeed:
    refused (0.19 removed MiCS; hpZ copies parameters only); Megatron-LM:
    --num-distributed-optimizer-instances for the distributed optimizer, refused with FSDP2."""
    from parcompile.exporters import export
    from tests.test_export import MEGATRON_CORE_V0_19_0_FLAGS, parse_command
    from tests.test_offload import MEGATRON_OFFLOAD_HSDP_FLAGS

    z3 = compile_config(tiny_config(4, parallel=dict(zero=3, dp_replicate=2)))
    tt = export(z3, "torchtitan")
    assert not tt.errors
    assert "data_parallel_replicate_degree=2" in tt.text and "data_parallel_shard_degree=2" in tt.text
    assert any("removed MiCS" in e for e in export(z3, "deepspeed").errors)
    assert any("zero 3" in e for e in export(z3, "megatron").errors)
    z1 = compile_config(tiny_config(4, parallel=dict(zero=1, dp_replicate=2)))
    assert export(z1, "deepspeed").errors
    mg = export(z1, "megatron")
    _, _, flags = parse_command(mg.text, "pretrain_gpt.py")
    assert not mg.errors and flags["--num-distributed-optimizer-instances"] == "2"
    assert set(flags) <= MEGATRON_CORE_V0_19_0_FLAGS | MEGATRON_OFFLOAD_HSDP_FLAGS


def test_torchtitan_parses_hsdp_with_parameter_offload(torchtitan, tmp_path, monkeypatch):
    """torchtitan 0.3.0's own config parser and ParallelDims read the export of replicate 2 x
    shard 2 with offload = params as a 2 x 2 HSDP mesh with CPU offload."""
    import shlex

    pytest.importorskip("torchtitan")
    from torchtitan.distributed.parallel_dims import ParallelDims

    from parcompile.exporters import export

    monkeypatch.syspath_prepend(str(tmp_path))
    ex = export(compile_config(tiny_config(4, parallel=dict(zero=3, dp_replicate=2, offload="params"))), "torchtitan")
    assert not ex.errors
    (tmp_path / ex.filename).write_text(ex.text)
    words = shlex.split(ex.launch)
    cfg = torchtitan().parse_args(words[words.index("--module"):])
    dims = ParallelDims.from_config(cfg.parallelism, 4)
    assert (dims.dp_replicate, dims.dp_shard) == (2, 2) and cfg.training.enable_cpu_offload


@pytest.mark.parametrize("keys", ["dp_replicate = 2\n    zero = 3", "zero = 3\n    offload = optimizer",
                                  "dp_replicate = 2\n    zero = 1\n    offload = optimizer"])
def test_the_search_costs_hsdp_and_offload_as_the_compiler(keys):
    """The search's fast cost (one probe layer, multiplied; the layout's groups placed without
    building them) gives the compiler's memory peak and step time for HSDP and offload, and
    the search's candidates keep both keys (tp = auto: each candidate's dp fills the world)."""
    from parcompile.layout_search import Coster, search
    from parcompile.passes.manager import cost_without_schedule

    text = ('model m from "llama3-8b" { layers = 4 }\ncluster c from "h100-sxm" { nodes = 2 }\n'
            f"parallel {{\n    dp = 16\n    {keys}\n    global_batch = 64\n}}\n")
    cfg, _ = load_spec(text)
    fast, full = Coster(cfg).cost(cfg, with_memory=True), cost_without_schedule(cfg)
    assert fast.peak == full.memory.peak
    assert fast.step_time == pytest.approx(full.time.step_time, rel=1e-9)
    auto, _ = load_spec(text.replace("dp = 16", "tp = auto"))
    best = search(auto, top=1).best.parallel
    assert (best.dp_replicate, best.offload) == (cfg.parallel.dp_replicate, cfg.parallel.offload)



@pytest.mark.parametrize("dp, key", [(1, "dp_replicate = 2"), (2, "dp_shard = 1"), (1, "dp_replicate = auto"),
                                     (2, "dp_replicate = auto"), (2, "dp_shard = auto")])
def test_hsdp_in_a_serve_spec_is_one_warning_and_the_plan_is_built(dp, key):
    """A serve spec has no states to shard: HSDP's keys are dropped with a warning at the
    key written, ``auto`` as any other value. Was: the warning, then dp_replicate kept beside
    the replica count, and for dp_replicate = 2 of dp = 1 the shard-data-parallel pass's
    traceback (shard 0, replicate 2); ``auto`` passed in silence (its placeholder 1 read as
    no HSDP) and left dp to the search."""
    import parcompile

    text = f"""model m from "llama3-8b" {{ seq_len = 4096 }}
cluster c from "h100-sxm" {{ nodes = 1 }}
parallel {{
    tp = {8 // dp}
    dp = {dp}
    {key}
}}
serve {{
    batch = 4
    prompt_len = 128
    max_new_tokens = 16
}}
"""
    message, help, _ = one(text, key)
    assert message.startswith("HSDP (dp_replicate, dp_shard) has no effect") and "remove" in help
    plan = parcompile.compile(text)
    assert plan.config.parallel.dp_replicate == 1 and plan.data["degrees"]["dp"] == dp
    assert "dp_replicate" not in load_spec(text)[0].parallel.auto


@pytest.mark.parametrize("value", ["optimizer", "auto"])
def test_offload_in_a_serve_spec_is_one_warning_at_the_key(value):
    """A serve spec has no optimizer: ``offload`` is one warning at the key written, ``auto``
    as any other value. Was: ``offload = auto`` passed in silence (``auto`` reads as none
    until the search, and the check returned on none)."""
    text = f"""model m from "llama3-8b" {{ seq_len = 4096 }}
cluster c from "h100-sxm" {{ nodes = 1 }}
parallel {{
    tp = 8
    offload = {value}
}}
serve {{
    batch = 4
    prompt_len = 128
    max_new_tokens = 16
}}
"""
    message, help, _ = one(text, f"offload = {value}")
    assert message == f"offload = {value} has no effect: a `serve` spec has no optimizer" and help == "remove `offload`"


def test_dp_replicate_auto_beside_dp_shard_in_a_serve_spec_is_the_one_warning():
    """``dp_replicate = auto`` with a numeric ``dp_shard`` in a serve spec: the one warning,
    at ``dp_replicate`` (the builder keeps the ``auto`` to drop it). Was: the error
    "dp_shard = 2 needs a numeric dp" at ``dp_shard`` beside ``dp = 2`` (the placeholder
    made dp the search's)."""
    text = """model m from "llama3-8b" { seq_len = 4096 }
cluster c from "h100-sxm" { nodes = 1 }
parallel {
    tp = 4
    dp = 2
    dp_replicate = auto
    dp_shard = 2
}
serve {
    batch = 4
    prompt_len = 128
    max_new_tokens = 16
}
"""
    message, help, _ = one(text, "dp_replicate = auto")
    assert message.startswith("HSDP (dp_replicate, dp_shard) has no effect") and "remove" in help
