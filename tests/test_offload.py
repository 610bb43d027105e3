"""CPU offload (issue 49, SPEC `parallel.offload`): the checks, the plan's GPU and host memory
(held against the same plan without offload), the PCIe traffic and CPU step, the 70B example
on one node of 8 H100s, and the program (offload = optimizer and params, fp32 and bf16):
bit-for-bit the run without offload on the CPU, `parcompile verify` of zero 3 x dp 4 miniatures
with their host bytes as planned, resumed from its checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

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


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_lora_offloads_the_adapters_states_not_the_frozen_weights(dtype):
    """LoRA with offload = optimizer: the host holds what the adapters' optimizer steps (their
    states, an fp32 gradient shard, an fp32 model's parameter copy), as without LoRA but of
    the adapters only. Was: offload_states sized the gradient shard and the copy by the
    whole stage's parameters (the frozen weights have neither), so the tiny LoRA spec planned
    74.81 KiB of host memory per rank where its run held 2.5 KiB (verify: 'host 2560 != plan
    67776' on a dp 4 zero 3 miniature) and the 70B's host_per_node was overstated alike."""
    lora = dict(method="lora", lora_rank=4, lora_targets=["q_proj", "down_proj"])
    base = dict(zero=3, bucket_size=16 * 1024)
    _, off = _stage(tiny_config(4, model=dict(dtype=dtype), parallel=dict(base, offload="optimizer"), train=lora))
    _, on = _stage(tiny_config(4, model=dict(dtype=dtype), parallel=base, train=lora))
    assert (off["params"], off["grads"], off["optimizer"]) == (on["params"], on["grads"], 0)
    assert on["grads"] > 0   # the adapters' fp32 gradient shard: 4 bytes per owned element
    assert off["host"] == on["optimizer"] + on["grads"] + (on["grads"] if dtype == "fp32" else 0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_lora_offload_params_keeps_the_frozen_shards_on_the_device(dtype):
    """LoRA with zero 3 and offload = params: the program moves to host memory what the
    optimizer steps (the adapters' parameter shards beside their states) and keeps the
    frozen weights' shards on the device (runtime/train/zero_frozen.FrozenShards: no offload).
    The plan put every parameter shard in host memory (GPU params 0), so a dp 4 miniature
    failed verify ('params 31968 != plan 0, host 9600 != plan 41568') and a plan could fit
    where the run would not. Now: the same plan at offload = optimizer, plus the adapters'
    parameter shard moved from the device to the host (dtype bytes per owned element; the
    fp32 gradient shard is 4 per element)."""
    lora = dict(method="lora", lora_rank=4, lora_targets=["q_proj", "down_proj"])
    base = dict(zero=3, bucket_size=16 * 1024)
    _, opt = _stage(tiny_config(4, model=dict(dtype=dtype), parallel=dict(base, offload="optimizer"), train=lora))
    _, par = _stage(tiny_config(4, model=dict(dtype=dtype), parallel=dict(base, offload="params"), train=lora))
    adapters = opt["grads"] // 4 * (4 if dtype == "fp32" else 2)   # the adapters' parameter shard, in bytes
    assert adapters > 0 and par["params"] == opt["params"] - adapters > 0
    assert par["host"] == opt["host"] + adapters and (par["grads"], par["optimizer"]) == (opt["grads"], 0)


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


def test_the_program_offloads_params_and_refuses_offload_without_a_data_parallel_group():
    """offload = params (zero 3) is generated: the plan keeps no parameter on the GPU and
    the program keeps the shard in host memory; one rank has no sharded optimizer, so
    nothing would be offloaded: refused."""
    cfg = tiny_config(4, parallel=dict(zero=3, offload="params"))
    _, st = _stage(cfg)
    assert st["params"] == 0 and st["host"] > 0
    assert not program_gaps(cfg)
    gaps = program_gaps(tiny_config(1, parallel=dict(zero=1, offload="optimizer")))
    assert len(gaps) == 1 and gaps[0].severity == "error" and "dp * cp = 1" in gaps[0].message
    assert not program_gaps(tiny_config(2, parallel=dict(zero=1, offload="optimizer")))


@pytest.mark.torchrun
def test_offload_trains_bit_for_bit_as_no_offload_and_resumes(tmp_path):
    """On the CPU the host optimizer steps the same fp32 values with the same kernel: zero 3
    over 2 ranks with offload = optimizer or params (fp32, and bf16 with its fp32 masters
    in host memory) gives the run without offload's losses exactly; and stopped after step
    2, resumed from its checkpoint (Adam states and masters restored into the host
    optimizer, the parameter shard into host memory), it continues the uninterrupted curve
    exactly. One torchrun launch for the five variants."""
    from tests.test_resume import _whole_and_resumed_many

    def edit(offload, dtype="fp32"):
        return lambda text: text.replace("dtype = fp32", f"dtype = {dtype}").replace(
            "global_batch = 8 }", f"global_batch = 8, zero = 3, offload = {offload} }}")

    _, curves = _whole_and_resumed_many(tmp_path, {
        "plain": edit("none"), "optimizer": edit("optimizer"), "params": edit("params"),
        "plain_bf16": edit("none", "bf16"), "params_bf16": edit("params", "bf16")}, 4)
    for name, plain in (("optimizer", "plain"), ("params", "plain"), ("params_bf16", "plain_bf16")):
        want, got = curves[name]
        assert want == curves[plain][0], name   # to the bit: the same floats
        for step, loss in got.items():
            assert loss == want[step], (name, step, loss, want[step])


@pytest.mark.torchrun
def test_verify_passes_offload_zero3_dp4_bit_for_bit_with_host_bytes_as_planned(tmp_path, monkeypatch):
    """Issue 49's done-when: verify of offload (zero 3, dp 4) miniatures against the single
    process, in one launch: fp32 with offload = optimizer and = params, and bf16 (whose fp32
    master weights the plan keeps in host memory with the optimizer, as ZeRO-Offload does)
    with both, and bf16 at zero 1 with offload = optimizer. Each passes, its measured per-rank parameter, gradient, optimizer and host
    bytes equal to the plan's (bf16: no optimizer byte on the device, the masters counted
    in host memory because they are the host optimizer's copies); and its first-step
    gradients, updated parameters and losses equal the same miniature's without offload
    to the bit."""
    import parcompile.verification as verification

    runs, compare = {}, verification.compare

    def keep(ref_dir, run_dir, plan, mini, tol):   # the run's tensors, before its directory goes
        res = compare(ref_dir, run_dir, plan, mini, tol)
        runs[id(res)] = (verification.load_global(run_dir, "grads"), verification.load_global(run_dir, "params"))
        return res

    monkeypatch.setattr(verification, "compare", keep)
    cases = [(dtype, off, 3) for dtype in ("fp32", "bf16") for off in ("none", "optimizer", "params")]
    cfgs = {(dtype, off, zero): tiny_config(4, parallel=dict(zero=zero, offload=off, bucket_size=16 * 1024))
            for dtype, off, zero in cases + [("bf16", "none", 1), ("bf16", "optimizer", 1)]}
    results = verification.verify_many(cfgs, steps=3, workdir=tmp_path, dtypes={k: k[0] for k in cfgs})
    for (dtype, off, zero), res in results.items():
        assert not isinstance(res, Exception) and res.ok, (dtype, off, zero, res if isinstance(res, Exception) else
                                                           res.table())
        plan = res.plan["memory"]["per_stage"][0]
        if off == "none":
            assert "host" not in plan
            continue
        assert any("host" in c.what and c.ok for c in res.checks)
        assert plan["optimizer"] == 0 and plan["host"] > 0 and (plan["params"] == 0) == (off == "params")
        for rec in res.records:
            assert rec["state_bytes"] == {k: plan[k] for k in ("params", "grads", "optimizer", "host")}, (dtype, off)
        base = results[(dtype, "none", zero)]
        assert res.losses == base.losses, (dtype, off)
        for got, want in zip(runs[id(res)], runs[id(base)]):
            assert got.keys() == want.keys()
            for name in want:
                assert all(torch.equal(a, b) for a, b in zip(got[name], want[name])), (dtype, off, name)


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
