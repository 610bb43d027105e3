"""LoRA's outputs (parcompile/runtime/state/peft_export.py): a tiny Hugging Face Llama made
here, fine-tuned with LoRA under tp 2 x pp 2 on a local jsonl; peft loads the written adapter
onto transformers' model and transformers loads the merged weights, each giving the run's
final eval loss."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_training_jobs import _job, _metrics, _spec, assets  # noqa: F401  (assets: the fixture)
from tests.test_training_jobs import model_eval_loss as _eval_loss

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _base(assets):  # noqa: F811
    return transformers.AutoModelForCausalLM.from_pretrained(str(assets / "llama"), dtype=torch.float32).eval()


@pytest.mark.torchrun
def test_lora_tp2_pp2_adapter_loads_in_peft_and_merged_in_transformers(assets):  # noqa: F811
    spec = _spec(assets, "lora", "llama", dp=1, tp=2, pp=2, steps=5,
                 train="method = lora, lora_rank = 8, lora_alpha = 16, lora_merge = true")
    plan, result = _job(spec, assets / "run_lora")
    assert result.ok, result.table()
    cfg = plan.config
    evals = [r["eval_loss"] for r in _metrics(assets / "run_lora" / "prog") if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0]                    # the adapters trained
    out = assets / "out_lora"
    # B starts at zero: the first eval is the base model's
    assert evals[0] == pytest.approx(_eval_loss(_base(assets), cfg), rel=1e-5)
    # PEFT's adapter onto transformers' model
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 16.0)
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"])
    adapted = peft.PeftModel.from_pretrained(_base(assets), str(out / "adapter")).eval()
    assert evals[1] == pytest.approx(_eval_loss(adapted, cfg), abs=1e-5)
    # the adapter names its base (init_from): PEFT's AutoPeftModel loads the base from it alone
    assert peft.PeftConfig.from_pretrained(str(out / "adapter")).base_model_name_or_path == str(assets / "llama")
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(str(out / "adapter"), dtype=torch.float32).eval()
    assert evals[1] == pytest.approx(_eval_loss(auto, cfg), abs=1e-5)
    # the merged weights, as any Hugging Face checkpoint
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert evals[1] == pytest.approx(_eval_loss(merged, cfg), abs=1e-5)


def test_adapter_without_merge_is_peft_save_pretrained(tmp_path):
    """write_lora_output's adapter (no merge) holds the keys and config PEFT's own
    save_pretrained writes for the same targets, and peft loads it to the merged function."""
    from parcompile.core.model import ModelKeys
    from parcompile.runtime.state.peft_export import merged, write_lora_output

    m = ModelKeys(name="m", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=64, seq_len=16,
                  dtype="fp32")
    hf_cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      rms_norm_eps=m.norm_eps, tie_word_embeddings=False)
    ref = peft.get_peft_model(transformers.LlamaForCausalLM(hf_cfg),
                              peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    ref.save_pretrained(tmp_path / "peft")
    from safetensors.torch import load_file

    want = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    names = {"q_proj": "attn.wq", "down_proj": "mlp.w2"}
    state = {}
    for k, v in want.items():   # ours from PEFT's, B made non-zero so that the adapter matters
        i, mod, part = k.split(".")[4], k.split(".")[-3], k.split(".")[-2]
        state[f"layers.{i}.{names[mod]}.{part}.weight"] = torch.randn_like(v)
    for name, shape in (("attn.wq", (32, 32)), ("mlp.w2", (32, 64))):
        for i in range(2):
            state[f"layers.{i}.{name}.weight"] = torch.randn(shape)
    lora = {"rank": 4, "alpha": 8.0, "dropout": 0.0}
    write_lora_output(state, m, tmp_path / "ours", lora)
    got = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want)
    adapted = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM(hf_cfg).eval(), str(tmp_path / "ours")).eval()
    x = torch.randint(0, 64, (1, 8))
    lin = adapted.base_model.model.model.layers[1].self_attn.q_proj
    h = torch.randn(1, 8, 32)
    delta = merged(state, lora)["layers.1.attn.wq.weight"] - state["layers.1.attn.wq.weight"]
    torch.testing.assert_close(lin(h) - lin.base_layer(h), h @ delta.T, atol=1e-5, rtol=1e-5)
    assert adapted(input_ids=x).logits.shape == (1, 8, 64)


def test_adapter_names_its_base_model(assets):  # noqa: F811
    """adapter_config.json's ``base_model_name_or_path`` is the spec's ``init_from``, the
    directory the run loaded (what PEFT's save_pretrained writes: the path the base was
    loaded from), so that PEFT's
    own PeftConfig reads it and AutoPeftModelForCausalLM loads the base from it alone
    (issue 49: it was null). Driven through `parcompile export-weights` on a DCP checkpoint
    of the adapters, so that it fails where the command stops passing the base (before, the
    test called the writer with the base itself and read back what it had passed)."""
    import parcompile
    from parcompile.cli import main
    from parcompile.core.lora import lora_settings
    from tests.test_files import _dcp_checkpoint

    spec = _spec(assets, "lora_base", "llama", dp=1, tp=1, pp=1, train="method = lora")
    plan = parcompile.compile(spec)
    r, h = lora_settings(plan.config)["rank"], plan.config.model.hidden
    state = {"layers.0.attn.wq.lora_A.weight": torch.randn(r, h), "layers.0.attn.wq.lora_B.weight": torch.randn(h, r)}
    ck = _dcp_checkpoint(assets / "ck_lora_base", state)
    out = assets / "out_lora_base"
    assert main(["export-weights", str(spec), str(ck), "-o", str(out)]) == 0
    assert peft.PeftConfig.from_pretrained(str(out)).base_model_name_or_path == str(assets / "llama")
    adapted = peft.AutoPeftModelForCausalLM.from_pretrained(str(out))
    torch.testing.assert_close(adapted.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight,
                               state["layers.0.attn.wq.lora_A.weight"])


@pytest.mark.torchrun
def test_run_says_whole_model_counts_and_peft_adapter(assets):  # noqa: F811
    """`parcompile run` of a LoRA spec: the start-up line gives the whole model's frozen and
    trainable (adapter) parameters, the same under zero 3 (dp 4) and tp 2 x pp 2, equal to
    transformers' and PEFT's own counts of the base and its adapters; the final lines name
    hf_output a PEFT adapter (issue 49: per-rank counts that differed by layout, and
    "Hugging Face" for an adapter)."""
    import subprocess
    import sys

    base = _base(assets)
    frozen = base.num_parameters()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    trainable, _ = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=targets)).get_nb_trainable_parameters()
    want = f"model built: {frozen:,} frozen parameters and {trainable:,} trainable (the LoRA adapters) in the whole model"
    for name, kw in (("lora_z3", dict(dp=4, tp=1, pp=1, parallel="zero = 3")), ("lora_tp2pp2", dict(dp=1, tp=2, pp=2))):
        spec = _spec(assets, name, "llama", steps=1, eval_data=None, train="method = lora, lora_rank = 8", **kw)
        run = subprocess.run([sys.executable, "-m", "parcompile", "run", str(spec)], capture_output=True, text=True,
                             timeout=600, cwd=assets)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert want in run.stdout, (name, [ln for ln in run.stdout.splitlines() if "model built" in ln])
        ends = run.stdout[run.stdout.index("done: "):]
        assert f"PEFT adapter  {assets / f'out_{name}'}" in ends and "Hugging Face" not in ends, ends
