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


def test_parameter_offload_is_planned_but_not_generated():
    cfg = tiny_config(4, parallel=dict(zero=3, offload="params"))
    _, st = _stage(cfg)
    assert st["params"] == 0 and st["host"] > 0
    gaps = program_gaps(cfg)
    assert len(gaps) == 1 and gaps[0].severity == "error" and "offload = params" in gaps[0].message


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
