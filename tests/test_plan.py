import json

import pytest

from parcompile.driver import compile_config
from tests.plan_factories import gpt3_175b, llama3_70b, spec, tiny_model

SECTION3 = {
    "format": None, "world_size": None,
    "degrees": {"dp", "tp", "pp", "cp", "ep", "expert_tp", "expert_dp", "virtual_stages"},
    "order": None,
    "groups": {"tp", "cp", "dp", "pp", "dp_cp", "ep", "expert_tp", "expert_dp", "embedding"},
    "model": {"params", "active_params", "padded_vocab", "kv_heads_per_rank"},
    "stages": None,
    "schedule": {"name", "num_microbatches", "bubble_fraction", "in_flight", "actions"},
    "memory": {"per_stage", "peak", "capacity", "fits"},
    "comm": {"per_step", "collectives"},
    "compute": {"model_flops_per_step", "hardware_flops_per_step"},
    "estimate": {"step_time", "tokens_per_s", "tflops_per_gpu", "mfu", "breakdown"},
}


def tiny_cfg(**kw):
    par = dict(dp=2, tp=2, pp=2, micro_batch=2, global_batch=16)
    par.update(kw)
    return spec(tiny_model(), **par)


def test_every_section3_field_is_present():
    d = compile_config(tiny_cfg()).data
    for key, sub in SECTION3.items():
        assert key in d, key
        if sub:
            assert sub <= set(d[key]), key
    assert d["format"] == "parcompile.plan/1"
    assert d["world_size"] == 8
    for s in d["stages"]:
        assert {"index", "layers", "chunks", "ranks", "params_per_rank"} <= set(s)
    for s in d["memory"]["per_stage"]:
        assert {"stage", "params", "grads", "optimizer", "activations", "kv_cache", "total"} <= set(s)
    for c in d["comm"]["collectives"]:
        assert {"op", "axis", "bytes", "count", "where", "stage"} <= set(c)
    assert set(d["comm"]["per_step"]) == {"tp", "dp", "pp", "cp", "ep"}
    assert {"compute", "tp_comm", "pp_comm", "dp_comm", "bubble"} <= set(d["estimate"]["breakdown"])
    assert d["stages"][1]["ranks"] == [4, 5, 6, 7]
    assert d["memory"]["peak"] == max(s["total"] for s in d["memory"]["per_stage"])


def test_json_is_byte_identical_and_canonical():
    a = compile_config(tiny_cfg()).to_json()
    b = compile_config(tiny_cfg()).to_json()
    assert a == b
    assert a.endswith("}\n")
    assert a == json.dumps(json.loads(a), sort_keys=True, indent=2) + "\n"
    assert "/work" not in a and "/tmp" not in a


def test_version_is_recorded():
    import parcompile
    d = compile_config(tiny_cfg()).data
    assert d["version"] == getattr(parcompile, "__version__", "0.1.0")


def test_not_fitting_is_a_warning():
    cfg = spec(tiny_model(), cluster={"memory": 10**6})
    plan = compile_config(cfg)
    assert plan.data["memory"]["fits"] is False
    assert [w.severity for w in plan.warnings] == ["warning"]
    assert "per GPU" in plan.warnings[0].message and "B " in plan.warnings[0].message


def test_report_and_graph_dump():
    plan = compile_config(tiny_cfg())
    md = plan.report_md()
    for head in ("## Degrees", "## Groups", "## Stages", "## Memory", "## Communication", "## Estimate"):
        assert head in md
    dump = plan.graph_dump()
    assert dump == compile_config(tiny_cfg()).graph_dump()
    assert "layers.3.mlp.w2" in dump


def test_serve_section():
    from parcompile.config.schema import ServeConfig, SpecConfig
    base = spec(tiny_model(), tp=2)
    cfg = SpecConfig(model=base.model, cluster=base.cluster, parallel=base.parallel, workload="serve",
                     serve=ServeConfig(batch=2, prompt_len=16, max_new_tokens=16))
    d = compile_config(cfg).data
    # 4 layers x 2 (k, v) x 1 kv head per rank x head_dim 16 x 4 bytes
    assert d["serve"]["kv_bytes_per_token"] == 4 * 2 * 1 * 16 * 4
    assert d["memory"]["per_stage"][0]["kv_cache"] == 2 * 32 * 4 * 2 * 1 * 16 * 4


@pytest.mark.parametrize("model,nodes,par", [
    (llama3_70b, 8, dict(tp=8, pp=4, dp=2, global_batch=512, sequence_parallel=True, zero=1)),
    (gpt3_175b, 192, dict(tp=8, pp=16, dp=12, global_batch=1536, recompute="full")),
])
def test_large_plans_compile(model, nodes, par):
    """Large worlds compile to a complete plan (their speed is measured by
    benchmarks/planning.py, not asserted here: timed tests flake on a loaded machine)."""
    cfg = spec(model(), nodes=nodes, gpus_per_node=8, **par)
    plan = compile_config(cfg)
    data = json.loads(plan.to_json())
    assert data["world_size"] == nodes * 8
    assert sum(len(g) for g in data["groups"]["tp"]) == nodes * 8


def test_a_crash_inside_a_pass_names_the_pass_and_op():
    from dataclasses import dataclass

    from parcompile.passes.manager import run_pass
    from parcompile.ir.lower import lower
    from parcompile.passes.base import PassContext, PassError

    @dataclass(frozen=True)
    class Broken:
        name: str = "broken-pass"

        def apply(self, graph, ctx):
            for n in ctx.visit(graph.topological()):
                if n == "layers.1.attn.wq":
                    raise KeyError("boom")

    cfg = tiny_cfg()
    with pytest.raises(PassError) as e:
        run_pass(Broken(), lower(cfg.model), PassContext.of(cfg))
    assert "broken-pass" in str(e.value) and "layers.1.attn.wq" in str(e.value)
