"""LoRA in the generated program (parcompile/runtime/model/lora.py): adapters trained on
frozen weights under dp x tp x pp, verified against the single process; checkpoints hold the
adapters and their optimizer states only and resume bit-exact."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import parcompile
from parcompile.miniature import miniature
from parcompile.runtime.model.lora import lora_a_init

from tests.program_utils import run_in_one_launch
from tests.test_checks import spec
from tests.test_resume import SPEC, _compiled, _metric_losses

LORA_TRAIN = {"method": "lora", "lora_rank": "8", "lora_alpha": "16"}


def test_a_is_peft_kaiming_uniform():
    """A's initialisation is PEFT's: ``kaiming_uniform_(a=sqrt(5))`` on (r, in), bound 1/sqrt(in)."""
    a = lora_a_init("x.lora_A.weight", (8, 400), 3)
    bound = 1 / 400 ** 0.5
    assert a.abs().max() <= bound and a.abs().max() > 0.95 * bound
    ref = torch.empty(8, 400)
    torch.nn.init.kaiming_uniform_(ref, a=5 ** 0.5)   # the same distribution (not the same draw)
    assert abs(ref.abs().max().item() - bound) < 0.05 * bound
    assert torch.equal(a, lora_a_init("x.lora_A.weight", (8, 400), 3))   # from the seed and the name


@pytest.mark.torchrun
def test_verify_lora_dp2_tp2_pp2():
    """The miniature (dp 2 x tp 2 x pp 2) against one process: losses, adapter gradients and
    parameters, the frozen weights unchanged alike, measured parameter/gradient/optimizer
    bytes and collectives equal to the plan's."""
    result = parcompile.verify(spec(train=LORA_TRAIN))
    assert result.passed, result
    names = {c.what.split(" (")[0] for c in result.rows}
    assert {"parameter, gradient, optimizer", "collectives per step"} <= names   # each name before its " (..."


@pytest.mark.torchrun
def test_checkpoint_holds_adapters_and_resumes_bit_exact(tmp_path):
    """A LoRA run stopped after step 2 resumes from a checkpoint holding only the adapters
    (and their Adam states) and continues the uninterrupted run's losses exactly."""
    def lora(text):
        return text.replace('data = "builtin:pydoc" }', 'data = "builtin:pydoc", method = lora, lora_rank = 8 }')

    def spec_file(name, ckpt, n):
        path = tmp_path / f"{name}.par"
        path.write_text(lora(SPEC.format(world=4, dp=1, tp=2, pp=2, steps=n, ckpt=ckpt)))
        return path

    whole = _compiled(tmp_path, spec_file("whole", tmp_path / "whole_ckpt", 4))
    part_spec = spec_file("part", tmp_path / "ckpt", 4)
    part = _compiled(tmp_path, part_spec)
    _resumes_as_whole(tmp_path, 4, whole, part)
    from parcompile.runtime.state.weights import read_dcp_metadata

    meta = read_dcp_metadata(tmp_path / "ckpt" / "step_00000002").state_dict_metadata
    tensors = {k for k in meta if not k.startswith("train/")}
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors), sorted(tensors)[:5]
    assert any(k.startswith("optim/exp_avg/") for k in tensors)
    # export-weights: the adapters-only checkpoint as a PEFT adapter (PEFT's key names)
    from safetensors.torch import load_file

    from parcompile.cli import main
    from parcompile.runtime.state.hf_export import read_dcp_global

    assert main(["export-weights", str(part_spec), str(tmp_path / "ckpt"), "-o", str(tmp_path / "adapter")]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 32.0)
    got = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    ours = read_dcp_global(tmp_path / "ckpt")
    assert len(got) == len(ours) == 4 * 7 * 2
    for i, (mine, hf) in enumerate([("attn.wq", "self_attn.q_proj"), ("mlp.w2", "mlp.down_proj")]):
        for part in ("lora_A", "lora_B"):
            assert torch.equal(got[f"base_model.model.model.layers.{i}.{hf}.{part}.weight"],
                               ours[f"layers.{i}.{mine}.{part}.weight"])


@pytest.mark.torchrun
def test_verify_lora_variants():
    """LoRA miniatures (dp 2 x tp 2 x pp 2) with ZeRO 1 and 2, full recomputation, partial
    targets (the MLP only; v only: frozen linears without an adapter keep no input), sequence
    parallelism (all targets; o_proj only, down_proj only: saved bytes per layer as planned
    but for the norms' statistics) and recompute = ["mlp"] against the single process, in one launch."""
    from parcompile.frontend import load_spec
    from parcompile.verification import verify_many

    base = {"method": "lora", "lora_rank": "8"}
    cases = {
        "zero1": spec(parallel={"zero": "1"}, train=base),
        "zero2_full_recompute": spec(parallel={"zero": "2", "recompute": "full"}, train=base),
        "mlp_only": spec(train={**base, "lora_targets": '["gate_proj", "up_proj", "down_proj"]'}),
        "v_only": spec(train={**base, "lora_targets": '["v_proj"]'}),
        # the collectives a gradient reaches (analysis/lora.py frozen_backward): the sequence-parallel
        # all-gathers of the frozen start's backward
        "sequence_parallel": spec(parallel={"sequence_parallel": "true"}, train=base),
        # Megatron-Core's module list: the MLP adapters' forward collectives run again, their
        # r-wide outputs are not kept (analysis/compute.py recomputed, as for the graph's ops)
        "recompute_mlp": spec(parallel={"recompute": '["mlp"]'}, train=base),
        # sequence parallelism with some modules targeted: no op before the first adapter saves
        # anything (analysis/lora.py frozen_saves, op by op), and a sequence-split input is kept
        # only where an adapted linear reads it (runtime/distributed/comm.py keep_split_input)
        "sp_o_proj": spec(parallel={"sequence_parallel": "true"}, train={**base, "lora_targets": '["o_proj"]'}),
        "sp_down_proj": spec(parallel={"sequence_parallel": "true"},
                             train={**base, "lora_targets": '["down_proj"]'}),
    }
    cfgs = {k: load_spec(v)[0] for k, v in cases.items()}
    results = verify_many(cfgs, steps=3)
    for name, r in results.items():
        assert not isinstance(r, Exception) and r.ok, (name, r if isinstance(r, Exception) else r.table())
    for name in ("sp_o_proj", "sp_down_proj", "sequence_parallel", "v_only"):
        _saved_bytes_exact(results[name], miniature(cfgs[name], steps=3))


def _saved_bytes_exact(result, mini) -> None:
    """Each rank's measured bytes saved per layer equal the plan's but for the norms' fp32
    statistics the plan leaves out (verification.py ACTIVATION_RTOL): at most two norms of
    ``tokens * 4`` bytes per layer, ``tokens`` this rank's (split over tp by sequence
    parallelism)."""
    par = mini.parallel
    stats = 2 * 4 * par.micro_batch * mini.model.seq_len // (par.tp if par.sequence_parallel else 1)
    for r in result.records:
        got = r["saved_per_layer"]
        for layer, want in result.plan["memory"]["per_stage"][r["stage"]]["activations_per_layer"]:
            assert 0 <= got[str(layer)] - want <= stats, (r["rank"], layer, got[str(layer)], want)


@pytest.mark.torchrun
def test_verify_lora_zero3():
    """LoRA with ZeRO-3 (runtime/train/zero_frozen.py: the frozen weights sharded over dp and
    all-gathered per layer, no gradient; the adapters sharded with their states) against the
    single process: dp 4, dp 2 x tp 2 with sequence parallelism, HSDP (replicate 2 x shard 2)
    and dp 2 x tp 2 x pp 2. Losses, adapter gradients, parameters, the per-rank
    parameter/gradient/optimizer bytes, the collectives per step (the frozen buckets' all-gathers
    included) and the most gathered bytes at once equal the plan's. Fails where LoRA with
    zero = 3 is refused."""
    from parcompile.frontend import load_spec
    from parcompile.verification import verify_many

    base = {"method": "lora", "lora_rank": "8"}
    four = {"nodes": "1", "gpus_per_node": "4"}
    z3 = {"zero": "3", "pp": "1"}
    cases = {
        "dp4": spec(cluster=four, parallel={**z3, "dp": "4", "tp": "1"}, train=base),
        "dp2_tp2_sp": spec(cluster=four, parallel={**z3, "tp": "2", "sequence_parallel": "true"}, train=base),
        "hsdp": spec(cluster=four, parallel={**z3, "dp": "4", "tp": "1", "dp_replicate": "2", "dp_shard": "2"},
                     train=base),
        "dp2_tp2_pp2": spec(parallel={"zero": "3"}, train=base),
    }
    results = verify_many({k: load_spec(v)[0] for k, v in cases.items()}, steps=3)
    for name, r in results.items():
        assert not isinstance(r, Exception) and r.ok, (name, r if isinstance(r, Exception) else r.table())
        names = {c.what.split(" (")[0] for c in r.checks}
        assert {"ZeRO-3 gathered parameters at most at once", "collectives per step",
                "parameter, gradient, optimizer"} <= names, (name, names)


@pytest.mark.torchrun
def test_zero3_checkpoint_resumes_bit_exact(tmp_path):
    """LoRA with ZeRO-3 (dp 2): a run stopped after step 2 resumes from its adapters-only
    checkpoint (the frozen shards are rebuilt from the seed) and continues the uninterrupted
    run's losses exactly."""
    def spec_file(name, ckpt):
        path = tmp_path / f"{name}.par"
        text = SPEC.format(world=2, dp=2, tp=1, pp=1, steps=4, ckpt=ckpt)
        text = text.replace("global_batch = 8 }", "global_batch = 8, zero = 3 }")
        path.write_text(text.replace('data = "builtin:pydoc" }', 'data = "builtin:pydoc", method = lora, lora_rank = 8 }'))
        return path

    whole = _compiled(tmp_path, spec_file("whole", tmp_path / "whole_ckpt"))
    part = _compiled(tmp_path, spec_file("part", tmp_path / "ckpt"))
    _resumes_as_whole(tmp_path, 2, whole, part)


def _resumes_as_whole(tmp_path, ranks: int, whole, part) -> None:
    """In one launch of ``ranks``: program ``whole`` for 4 steps, ``part`` stopped after step 2
    and resumed from its checkpoint; the resumed steps 3 and 4 equal the whole run's losses
    exactly."""
    m = tmp_path / "metrics"
    log = run_in_one_launch(ranks, [(whole, ["--metrics-dir", m / "whole", "--checkpoint-dir", ""]),
                                    (part, ["--steps", 2, "--metrics-dir", m / "first"]),
                                    (part, ["--metrics-dir", m / "resumed"])], tmp_path / "jobs.json")
    assert re.search(r"^resumed from \S+/ckpt after step 2$", log, re.M), log
    want = dict(enumerate(_metric_losses(m / "whole"), start=1))
    got = dict(enumerate(_metric_losses(m / "resumed"), start=3))
    assert got == {s: want[s] for s in (3, 4)}
