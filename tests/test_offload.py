"""CPU offload (issue 49, SPEC `parallel.offload`): the checks, the plan's GPU and host memory
(held against the same plan without offload), the PCIe traffic and CPU step, the 70B example
on one node of 8 H100s, and the program: bit-for-bit the run without offload on the CPU,
`parcompile verify` of a zero 3 x dp 4 miniature, resumed from its checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parcompile.codegen.emit import program_gaps
from parcompile.config.presets import cluster_preset
from parcompile.driver import compile_config
from parcompile.frontend import load_spec
from tests.program_utils import tiny_config
from tests.test_checks import one, spec

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "llama31_70b_offload_1x8_h100.par"


def test_offload_with_zero_0_is_one_diagnostic_naming_the_engine_rule():
    """The hostile case of issue 49's done-when: DeepSpeed's offload_optimizer is a ZeRO
    feature (stages 1-3), offload_param ZeRO-3's (deepspeed/runtime/zero/config.py)."""
    message, help, _ = one(spec(parallel={"offload": "optimizer"}), "offload = optimizer")
    assert message.startswith("offload = optimizer needs zero >= 1, not zero = 0: DeepSpeed's offload_optimizer")
    assert "zero" in help
    message, _, _ = one(spec(parallel={"offload": "params", "zero": "2"}), "offload = params")
    assert message.startswith("offload = params needs zero >= 3, not zero = 2")
    cfg, warnings = load_spec(spec(parallel={"offload": "optimizer", "zero": "1"}))
    assert cfg.parallel.offload == "optimizer" and not warnings


def _stage(cfg):
    plan = compile_config(cfg)
    return plan, plan.data["memory"]["per_stage"][0]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_states_move_to_host_memory(dtype):
    """ZeRO-3 over 4 ranks, against the same plan without offload: the GPU keeps the
    parameter and gradient shards and no optimizer state; the host holds the optimizer's
    states and masters, an fp32 gradient shard and (fp32 model) a copy of the parameter
    shard it steps: host = optimizer + grads (+ params when fp32)."""
    base = dict(zero=3, bucket_size=16 * 1024)
    _, off = _stage(tiny_config(4, model=dict(dtype=dtype), parallel=dict(base, offload="optimizer")))
    plan0, on = _stage(tiny_config(4, model=dict(dtype=dtype), parallel=base))
    assert (off["params"], off["grads"], off["optimizer"]) == (on["params"], on["grads"], 0)
    assert off["host"] == on["optimizer"] + on["grads"] + (on["params"] if dtype == "fp32" else 0)
    assert off["total"] == on["total"] - on["optimizer"]
    assert "host" not in on and "host_per_node" not in plan0.data["memory"]


def test_pcie_traffic_and_cpu_step_follow_zero_offload():
    """ZeRO-Offload (Ren et al. 2021, section 4.1): a bf16 model's rank sends 2 bytes per
    owned parameter down and receives 2 up per step, at the preset's host link (PCIe Gen5,
    64 GB/s each way); the CPU step moves the optimizer's bytes per parameter at the node's
    host memory bandwidth over its GPUs; the step waits for the CPU step and the copy up."""
    cfg, _ = load_spec('model m from "llama3-8b" { layers = 2, dtype = bf16 }\n'
                       'cluster c from "h100-sxm" { nodes = 1 }\n'
                       "parallel {\n    dp = 8\n    zero = 3\n    offload = optimizer\n}\n")
    plan = compile_config(cfg)
    off = plan.data["estimate"]["assumptions"]["offload"]
    base = compile_config(cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"offload": "none"})}))
    owned = base.data["memory"]["per_stage"][0]["optimizer"] // 12   # Adam: 4 (master) + 8 (moments) per element
    preset = cluster_preset("h100-sxm", "bf16")
    assert preset["host_link_bw"] == 64e9 and preset["host_memory_bw"] == 614.4e9
    assert off["pcie_down_bytes"] == off["pcie_up_bytes"] == 2 * owned
    assert off["pcie_up"] == pytest.approx(2 * owned / 64e9)
    assert off["cpu_step"] == pytest.approx(owned * (28 + 2) / (614.4e9 / 8))
    assert plan.data["estimate"]["breakdown"]["optimizer"] == pytest.approx(off["exposed"])
    assert off["exposed"] == pytest.approx(off["cpu_step"] + off["pcie_up"])
    mem = plan.data["memory"]
    assert mem["host_per_node"] == 8 * mem["per_stage"][0]["host"] and mem["host_memory"] == 2 * 10**12


def test_the_70b_full_fine_tune_fits_one_node_with_offload():
    """Issue 49's done-when: Llama 3.1 70B's full fine-tune on one node of 8 H100s plans as
    fitting with offload = optimizer and shows host memory and the PCIe time; without
    offload the optimizer states alone would not fit."""
    cfg, _ = load_spec(EXAMPLE.read_text(), filename=str(EXAMPLE))
    plan = compile_config(cfg)
    mem = plan.data["memory"]
    assert mem["fits"] and mem["per_stage"][0]["optimizer"] == 0
    assert 0 < mem["host_per_node"] <= mem["host_memory"]
    assert plan.data["estimate"]["assumptions"]["offload"]["pcie_up"] > 0
    assert "Host memory (offload = optimizer)" in plan.report_md() and "PCIe per step" in plan.report_md()
    base = compile_config(cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"offload": "none"})}))
    assert not base.data["memory"]["fits"]


def test_what_the_program_does_not_offload_is_refused_not_run():
    cfg = tiny_config(4, parallel=dict(zero=3, offload="params"))
    _, st = _stage(cfg)
    assert st["params"] == 0 and st["host"] > 0
    gaps = program_gaps(cfg)
    assert len(gaps) == 1 and gaps[0].severity == "error" and "offload = params" in gaps[0].message
    # one rank: the program's optimizer is not sharded, so nothing would be offloaded
    gaps = program_gaps(tiny_config(1, parallel=dict(zero=1, offload="optimizer")))
    assert len(gaps) == 1 and gaps[0].severity == "error" and "dp * cp = 1" in gaps[0].message
    assert not program_gaps(tiny_config(2, parallel=dict(zero=1, offload="optimizer")))


def _metric_losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for f in sorted(path.glob("*.jsonl"))
            for line in f.read_text().splitlines() if '"loss"' in line]


@pytest.mark.torchrun
def test_offload_trains_bit_for_bit_as_no_offload_and_resumes(tmp_path):
    """On the CPU the host optimizer steps the same fp32 values with the same kernel: zero 3
    over 2 ranks with offload gives the run without offload's losses exactly; and stopped
    after step 2, resumed from its checkpoint (Adam states restored into the host
    optimizer), it continues the uninterrupted curve exactly."""
    from tests.test_resume import _whole_and_resumed

    def edit(offload):
        return lambda text: text.replace("global_batch = 8 }", f"global_batch = 8, zero = 3, offload = {offload} }}")

    (tmp_path / "plain").mkdir()
    (tmp_path / "off").mkdir()
    _, plain, _ = _whole_and_resumed(tmp_path / "plain", edit("none"), 4)
    _, want, got = _whole_and_resumed(tmp_path / "off", edit("optimizer"), 4)
    assert want == plain   # to the bit: the same floats
    for step, loss in got.items():
        assert loss == want[step], (step, loss, want[step])


@pytest.mark.torchrun
def test_verify_passes_offload_zero3_dp4(tmp_path):
    """Issue 49's done-when: verify of an offload (zero 3, dp 4) miniature against the single
    process, its host bytes per rank equal to the plan's."""
    from parcompile.verification import verify

    cfg = tiny_config(4, parallel=dict(zero=3, offload="optimizer", bucket_size=16 * 1024))
    result = verify(cfg, steps=3, workdir=tmp_path)
    assert result.ok, result.table()
    assert any("host" in c.what and c.ok for c in result.checks)
    assert all("host" in s for s in result.plan["memory"]["per_stage"])   # the miniature offloads too


# Megatron-LM core_v0.19.0 (5be9626709af2722333bf54797c954c09edeada3) megatron/training/arguments.py:
# --optimizer-cpu-offload line 2781, --use-precision-aware-optimizer line 3500 (validate_args asserts
# it with the offload, lines 1803-1807), --num-distributed-optimizer-instances line 3049; read in the
# tree, not run through check_engine_parsers.py
MEGATRON_OFFLOAD_HSDP_FLAGS = {"--optimizer-cpu-offload", "--use-precision-aware-optimizer",
                               "--num-distributed-optimizer-instances"}


def _export(cfg, target, **kw):
    from parcompile.exporters import export
    from parcompile.plan import Plan   # noqa: F401  (compile_config returns one)

    return export(compile_config(cfg), target, **kw)


def test_exports_carry_offload_where_the_engine_has_it():
    """DeepSpeed: offload_optimizer (and offload_param) with device cpu; torchtitan: only the
    whole-state CPUOffloadPolicy (enable_cpu_offload) for offload = params, a refusal for
    the optimizer alone; Megatron-LM: --optimizer-cpu-offload with the distributed optimizer
    (zero 1, 2), a refusal with FSDP2 or for parameters."""
    from tests.test_export import MEGATRON_CORE_V0_19_0_FLAGS, parse_command

    ds = json.loads(_export(tiny_config(4, parallel=dict(zero=3, offload="params")), "deepspeed").text)
    z = ds["zero_optimization"]
    assert z["stage"] == 3
    assert z["offload_optimizer"] == z["offload_param"] == {"device": "cpu", "pin_memory": True}
    ds = json.loads(_export(tiny_config(4, parallel=dict(zero=2, offload="optimizer")), "deepspeed").text)
    assert "offload_optimizer" in ds["zero_optimization"] and "offload_param" not in ds["zero_optimization"]
    tt = _export(tiny_config(4, parallel=dict(zero=3, offload="params")), "torchtitan")
    assert not tt.errors and "enable_cpu_offload=True" in tt.text
    tt = _export(tiny_config(4, parallel=dict(zero=3, offload="params")), "torchtitan", torchtitan_version="0.2")
    assert "enable_cpu_offload = true" in tt.text   # (0.2 refuses the tiny shape: no registered flavor)
    assert _export(tiny_config(4, parallel=dict(zero=3, offload="optimizer")), "torchtitan").errors
    mg = _export(tiny_config(4, parallel=dict(zero=1, offload="optimizer")), "megatron")
    _, _, flags = parse_command(mg.text, "pretrain_gpt.py")
    assert not mg.errors and {"--optimizer-cpu-offload", "--use-precision-aware-optimizer",
                              "--use-distributed-optimizer"} <= set(flags)
    assert set(flags) <= MEGATRON_CORE_V0_19_0_FLAGS | MEGATRON_OFFLOAD_HSDP_FLAGS
    assert any("zero 3" in e for e in _export(tiny_config(4, parallel=dict(zero=3, offload="optimizer")),
                                              "megatron").errors)


#: full training with optimizer offload and HSDP at zero 1: Megatron-Bridge's offload and
#: distributed-optimizer instances (`check_engine_parsers.py megatron-bridge` builds it too)
OFFLOAD_HSDP = spec(parallel={"dp": "8", "tp": "1", "pp": "1", "zero": "1", "offload": "optimizer",
                              "dp_replicate": "2"})


def test_megatron_bridge_carries_optimizer_offload_and_hsdp():
    """Megatron-LM's --optimizer-cpu-offload --use-precision-aware-optimizer and
    --num-distributed-optimizer-instances as megatron-core 0.16.1's OptimizerConfig and
    DistributedDataParallelConfig fields (test_export.py's MEGATRON_BRIDGE_0_3_1_FIELDS), at the
    values the Megatron-LM export gives them."""
    import parcompile
    from parcompile.exporters import export
    from tests.test_export import _bridge_container, parse_megatron

    plan = parcompile.compile(OFFLOAD_HSDP, "offload_hsdp.par")
    ex = export(plan, "megatron-bridge")
    assert ex.errors == [], ex.errors
    _, flags = parse_megatron(export(plan, "megatron").text)
    c = _bridge_container(ex.text)
    assert (c["optimizer"]["optimizer_cpu_offload"], c["optimizer"]["use_precision_aware_optimizer"]) == \
        (flags["--optimizer-cpu-offload"], flags["--use-precision-aware-optimizer"]) == (True, True)
    assert c["ddp"]["num_distributed_optimizer_instances"] == int(flags["--num-distributed-optimizer-instances"]) \
        == plan.passes.data_parallel.replicate == 2


@pytest.mark.parametrize("zero, offload", [(3, "params"), (2, "optimizer")])
def test_deepspeed_config_class_reads_the_offload(zero, offload, monkeypatch):
    """DeepSpeed's own DeepSpeedConfig (deepspeed/runtime/config.py, DeepSpeedZeroConfig) reads
    the exported offload_optimizer / offload_param as CPU offload with pinned memory; the
    examples hold offload = optimizer only, so offload = params is read here."""
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    c = json.loads(_export(tiny_config(4, parallel=dict(zero=zero, offload=offload)), "deepspeed").text)
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)   # (test_export_engines.py's setup)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: 4)   # no mpu: every rank is dp
    ds = ds_config.DeepSpeedConfig(c)
    z = ds.zero_config
    assert ds.zero_optimization_stage == zero and ds.world_size == 4
    assert z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory
    assert (z.offload_param is not None and z.offload_param.device == "cpu") == (offload == "params")
