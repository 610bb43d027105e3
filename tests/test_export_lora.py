"""LoRA (``train.method = lora``) in the exports (issue 49; parcompile/exporters/lora.py), each
read back by the engine's own code where it installs here and otherwise against its fields
pinned from its source:

- torchtitan 0.3.0 (installed): the exported module loaded by its ``ConfigManager`` and the
  model built by torchtitan with its ``LoRAConverter``: the adapters sit on the projections
  parcompile adapts, with the plan's shapes and scale, and nothing else trains.
- Megatron-Bridge 0.3.1: the ``CanonicalLoRA`` keywords against its dataclass fields and target
  names (``src/megatron/bridge/peft/canonical_lora.py`` at tag v0.3.1,
  9c9dd848966322fc3ed7706747ec13219ef49dda); ``tests/check_engine_parsers.py megatron-bridge``
  builds the exported ``config()`` with Bridge's own classes and runs ``runtime_config_update``.
- vLLM 0.33.0: the flags against its parser's (``vllm/engine/arg_utils.py``,
  ``vllm/entrypoints/common/cli_args.py``) and ``--max-lora-rank`` against ``MaxLoRARanks``
  (``vllm/config/lora.py``); ``tests/check_engine_parsers.py vllm`` parses them with
  ``vllm serve``'s own parser.
- Run on 2026-12-07 (``check_engine_parsers.py megatron-bridge`` in a venv of megatron-bridge
  0.3.1 + megatron-core 0.16.1; ``vllm`` with the 0.33.0 sdist): Bridge accepted all four
  specs' exports through ``runtime_config_update`` with the plan's layout, ``cfg.peft`` a
  CanonicalLoRA mapping ``linear_qkv`` to {q, k, v}, ``linear_fc1`` to {gate, up} and the rest
  as targeted (lora_zero2_offload with ``optimizer_cpu_offload``); vLLM's parser and LoRAConfig
  accepted all four (max_lora_rank 8 for r 8, 16 for r 12 and 16); its parser refuses
  ``--max-lora-rank 12`` ("invalid choice").
- DeepSpeed 0.19.8 (installed): the ZeRO config with offload read by ``DeepSpeedZeroConfig``;
  the note's ``peft.LoraConfig`` built by PEFT and applied to transformers' Llama, whose
  trainable parameters are the plan's adapters.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess

import pytest

import parcompile
from parcompile.core.lora import targeted
from parcompile.exporters import export
from parcompile.exporters.lora import vllm_max_lora_rank
from tests.test_checks import spec
from tests.test_export import _bridge_container, serve_commands, serve_flags
from tests.test_export_engines import torchtitan  # noqa: F401  (the fixture: torchtitan 0.3's ConfigManager)
from tests.test_export_keys_torchtitan import _built

ALL = '["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]'
#: LoRA specs the exports carry (tests/check_engine_parsers.py runs them through the engines too)
LORA_SPECS = {
    "lora_all_linear": spec(train={"method": "lora", "lora_rank": "8", "lora_alpha": "16"}),
    "lora_attention_dropout": spec(train={"method": "lora", "lora_rank": "12", "lora_alpha": "24",
                                          "lora_dropout": "0.05", "lora_targets": '["q_proj", "k_proj", "v_proj"]'}),
    "lora_attention": spec(train={"method": "lora", "lora_targets": '["q_proj", "k_proj", "v_proj", "o_proj"]'}),
    "lora_zero2_offload": spec(parallel={"dp": "8", "tp": "1", "pp": "1", "zero": "2", "offload": "optimizer"},
                               train={"method": "lora", "lora_rank": "16", "lora_targets": ALL}),
}

def lora_plan(name: str):
    return parcompile.compile(LORA_SPECS[name], f"{name}.par")


#: Megatron-Bridge 0.3.1 CanonicalLoRA's dataclass fields (canonical_lora.py, with PEFT's and
#: ModuleMatcher's: exclude_modules, canonical_mapping is set in __post_init__)
CANONICAL_LORA_0_3_1_FIELDS = frozenset({"target_modules", "exclude_modules", "dim", "alpha", "dropout",
                                         "dropout_position", "lora_A_init_method", "lora_B_init_method"})
#: its target names and the Hugging Face Llama projection each adapts (the docstring: q, k, v of
#: the fused linear_qkv, up and gate of linear_fc1, separately)
CANONICAL_LORA_0_3_1_TARGETS = {"linear_q": "q_proj", "linear_k": "k_proj", "linear_v": "v_proj",
                                "linear_proj": "o_proj", "linear_fc1_up": "up_proj", "linear_fc1_gate": "gate_proj",
                                "linear_fc2": "down_proj"}
#: vLLM 0.33.0: the LoRA flags (arg_utils.py lora_group, cli_args.py --lora-modules) and MaxLoRARanks
VLLM_0_33_0_LORA_FLAGS = frozenset({"--enable-lora", "--max-lora-rank", "--lora-modules"})
VLLM_0_33_0_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _hf_targets(plan) -> set[str]:
    t = plan.config.train
    return {lin.hf_leaf for lin in targeted(plan.config.model, t.lora_targets)}


@pytest.mark.parametrize("name", ["lora_all_linear", "lora_attention_dropout", "lora_attention"])
def test_megatron_bridge_writes_canonical_lora(name):
    plan = lora_plan(name)
    t = plan.config.train
    ex = export(plan, "megatron-bridge")
    assert ex.errors == [], ex.errors
    c = _bridge_container(ex.text)
    peft = c["peft"]
    assert set(peft) <= CANONICAL_LORA_0_3_1_FIELDS, set(peft) - CANONICAL_LORA_0_3_1_FIELDS
    assert {CANONICAL_LORA_0_3_1_TARGETS[m] for m in peft["target_modules"]} == _hf_targets(plan)
    assert (peft["dim"], peft["alpha"], peft["dropout"], peft["dropout_position"]) == \
        (t.lora_rank, t.lora_alpha, t.lora_dropout, "pre")   # PEFT's: dropout on the adapter's input
    assert c["checkpoint"]["pretrained_checkpoint"]   # ConfigContainer.validate asserts one for PEFT
    code = ast.parse(ex.text)
    imported = {(n.module, a.name) for n in ast.walk(code) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert {("megatron.bridge.peft.canonical_lora", "CanonicalLoRA"),
            ("megatron.bridge.training.finetune", "finetune")} <= imported
    assert ex.text.rstrip().endswith("finetune(config(), forward_step)")
    full = export(parcompile.compile(spec()), "megatron-bridge")
    assert "peft" not in _bridge_container(full.text) and "pretrain(config(), forward_step)" in full.text


def test_megatron_bridge_refuses_half_a_fused_projection():
    """CanonicalLoRA runs all of q, k, v (gate, up) once one is targeted: a part is refused."""
    plan = parcompile.compile(spec(train={"method": "lora", "lora_rank": "8", "lora_targets": '["q_proj", "up_proj"]'}))
    errors = export(plan, "megatron-bridge").errors
    assert len(errors) == 2 and all("target" in e and "together" in e for e in errors), errors


def _torchtitan_model(plan, cm, tmp_path, monkeypatch):
    """torchtitan's build of ``plan``'s export (an export without errors)."""
    errors = export(plan, "torchtitan").errors
    assert errors == [], errors
    return _built(plan, cm, tmp_path, monkeypatch)[1]


@pytest.mark.parametrize("name", ["lora_all_linear", "lora_attention"])
def test_torchtitan_builds_the_plans_adapters(name, torchtitan, tmp_path, monkeypatch):  # noqa: F811
    """torchtitan builds the exported model with its LoRAConverter: an adapter (lora_a r x in,
    lora_b out x r, scale alpha / r) on each projection parcompile adapts, and only those train."""
    plan = lora_plan(name)
    t, m = plan.config.train, plan.config.model
    model = _torchtitan_model(plan, torchtitan, tmp_path, monkeypatch)
    got = {}
    for fqn, mod in model.named_modules():
        if hasattr(mod, "lora_a"):
            layer, leaf = re.fullmatch(r"layers\.(\d+)\..*\.(\w+)", fqn).groups()
            got[(int(layer), leaf)] = (tuple(mod.lora_a.weight.shape), tuple(mod.lora_b.weight.shape),
                                      mod._lora_scaling)
    want = {(int(lin.module.split(".")[1]), lin.leaf): ((t.lora_rank, lin.in_features),
                                                        (lin.out_features, t.lora_rank), t.lora_alpha / t.lora_rank)
            for lin in targeted(m, t.lora_targets)}
    assert got == want
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_a." in n or ".lora_b." in n for n in trainable), trainable


def test_torchtitan_refuses_what_its_lora_cannot_train():
    plan = lora_plan("lora_attention_dropout")   # dropout 0.05: torchtitan's LoRALinear has none
    assert [e for e in export(plan, "torchtitan").errors if e.startswith("lora_dropout 0.05")]
    half = parcompile.compile(spec(train={"method": "lora", "lora_rank": "8", "lora_targets": '["k_proj"]'}))
    assert any("wkv" in e for e in export(half, "torchtitan").errors)
    assert any("torchtitan 0.2.2 has no LoRA" in e for e in export(lora_plan("lora_all_linear"), "torchtitan",
                                                                     "0.2").errors)


def test_megatron_bridge_recipe_speaks_bridge():
    """The recipe's docstring says what it is built from without pointing at `export --to
    megatron` for the arguments (that export refuses LoRA), and its notes name the
    ConfigContainer fields the recipe sets, not pretrain_gpt.py flags (issue 49: 'exported
    as --use-torch-fsdp2' in a Python recipe); the field named is one the recipe sets."""
    import re

    from parcompile.exporters.megatron_bridge import MEGATRON_BRIDGE_FIELDS

    plan = parcompile.compile(spec(parallel={"dp": "8", "tp": "1", "pp": "1", "zero": "3"},
                                   train={"method": "lora", "lora_targets": ALL}), "lora_zero3.par")
    ex = export(plan, "megatron-bridge")
    assert ex.errors == [], ex.errors
    doc = ast.get_docstring(ast.parse(ex.text))
    assert "from the arguments of" not in doc and "CanonicalLoRA" in doc
    flags = {f for f in re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", doc) if MEGATRON_BRIDGE_FIELDS.get(f)}
    assert not flags, flags
    assert "zero 3: exported as dist.use_torch_fsdp2" in doc
    assert _bridge_container(ex.text)["dist"]["use_torch_fsdp2"] is True


def test_vllm_note_says_the_rank_rule():
    text = LORA_SPECS["lora_attention_dropout"].replace("method = lora", 'method = lora\n    hf_output = "out"')
    ex = export(parcompile.compile(text, "lora_attention_dropout.par"), "vllm")
    assert any("--max-lora-rank 16: vLLM's smallest allowed max-lora-rank at or above lora_rank 12" in n
               for n in ex.notes), ex.notes


def _vllm(plan):
    ex = export(plan, "vllm")
    (command,) = serve_commands(ex.text)
    launcher, flags = serve_flags(command)
    return launcher, flags, ex


@pytest.mark.parametrize("name, rank", [("lora_all_linear", 8), ("lora_attention_dropout", 16),
                                        ("lora_attention", 16)])
def test_vllm_serves_the_adapter(name, rank, tmp_path):
    text = LORA_SPECS[name].replace(
        "method = lora", f'method = lora\n    hf_output = "{tmp_path}/out"')
    plan = parcompile.compile(text, f"{name}.par")
    launcher, flags, ex = _vllm(plan)
    assert ex.errors == [] and launcher == ["vllm", "serve", "MODEL"]   # no init_from: the base model's place
    assert any(n.startswith("weights: the spec names no init_from") for n in ex.notes)
    assert VLLM_0_33_0_LORA_FLAGS <= set(flags)
    r = int(flags["--max-lora-rank"])
    assert r in VLLM_0_33_0_MAX_LORA_RANKS and r >= plan.config.train.lora_rank and r == rank
    assert all(x < plan.config.train.lora_rank for x in VLLM_0_33_0_MAX_LORA_RANKS if x < r)   # the smallest
    assert flags["--lora-modules"] == f"{name}={tmp_path}/out"   # cli_args.py: name=path
    assert int(flags["--max-model-len"]) == plan.config.model.seq_len


def _vllm_lora_modules(item: str) -> tuple[str, str]:
    """(name, path) as vLLM 0.33.0 reads one --lora-modules value (vllm/entrypoints/common/
    cli_args.py LoRAParserAction: `name, path = item.split("=")` when the item has `=` and no
    `,`, else json.loads into LoRAModulePath(name, path))."""
    if "=" in item and "," not in item:
        name, path = item.split("=")
        return name, path
    d = json.loads(item)
    return d["name"], d["path"]


@pytest.mark.parametrize("out", ["run=1/adapter", "a,b", 'q"uote $(x) =,'])
def test_vllm_reads_back_an_adapter_path_with_its_separators(out, tmp_path):
    """vLLM splits `name=path` at every `=`: a path holding `=` (or `,`) goes as the JSON
    object; was `NAME=run=1/adapter`, which vLLM's parser fails on (ValueError)."""
    hf_output = f"hf_output = {json.dumps(out)}"   # a spec string escapes as JSON's
    text = LORA_SPECS["lora_attention"].replace("method = lora", f"method = lora\n    {hf_output}")
    plan = parcompile.compile(text, "lora_attention.par")
    _, flags, _ = _vllm(plan)
    assert _vllm_lora_modules(flags["--lora-modules"]) == ("lora_attention", out)


def test_vllm_serves_merged_weights_and_refuses_a_rank_it_cannot(tmp_path):
    text = LORA_SPECS["lora_all_linear"].replace("method = lora", f'method = lora\n    lora_merge = true\n'
                                                 f'    hf_output = "{tmp_path}/out"')
    launcher, flags, ex = _vllm(parcompile.compile(text))
    assert launcher == ["vllm", "serve", f"{tmp_path}/out"] and not VLLM_0_33_0_LORA_FLAGS & set(flags)
    assert (vllm_max_lora_rank(512), vllm_max_lora_rank(513), vllm_max_lora_rank(257)) == (512, None, 320)
    with pytest.raises(parcompile.SpecError):   # a full fine-tune has no adapter: serve it from a serve spec
        export(parcompile.compile(spec()), "vllm")


def test_deepspeed_offload_and_peft_note():
    """ZeRO-2 with optimizer offload for a LoRA plan: DeepSpeed's own ZeRO config reads the
    offload; the note's LoraConfig, built by PEFT onto transformers' Llama of the spec's shape,
    trains exactly the plan's adapter elements."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    plan = lora_plan("lora_zero2_offload")
    ex = export(plan, "deepspeed")
    assert ex.errors == [], ex.errors
    import json

    z = DeepSpeedZeroConfig(**json.loads(ex.text)["zero_optimization"])
    assert (z.stage, z.offload_optimizer.device, z.offload_param) == (2, "cpu", None)
    note = next(n for n in ex.notes if n.startswith("LoRA:"))
    call = re.search(r"(peft\.LoraConfig\(.*?\))\)", note).group(1)
    lora_config = eval(compile(ast.parse(call, mode="eval"), "note", "eval"), {"peft": peft})
    m, t = plan.config.model, plan.config.train
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=m.hidden, intermediate_size=m.ffn_hidden, num_hidden_layers=m.layers, num_attention_heads=m.heads,
        num_key_value_heads=m.kv_heads, vocab_size=m.vocab))
    model = peft.get_peft_model(base, lora_config)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trained == sum(lin.adapter_elements(t.lora_rank) for lin in targeted(m, t.lora_targets))
    assert (lora_config.r, lora_config.lora_alpha) == (t.lora_rank, t.lora_alpha)


def test_megatron_lm_still_refuses_lora():
    errors = export(lora_plan("lora_all_linear"), "megatron").errors
    assert any(e.startswith("method = lora: Megatron-LM's pretrain_gpt.py has no LoRA") for e in errors), errors


def test_a_newline_in_hf_output_stays_in_the_scripts_comments(tmp_path):
    """A spec string may hold a newline (``"\\n"``): the exported script's notes name
    hf_output, and each of their lines is a comment, so bash runs only ``vllm serve``
    (a stub here) with the path whole, never the line after the newline."""
    marker = tmp_path / "ran"
    out = f"{tmp_path}/out\ntouch {marker}\n#"
    text = LORA_SPECS["lora_attention"].replace(
        "method = lora", f"method = lora\n    lora_merge = true\n    hf_output = {json.dumps(out)}")
    script = tmp_path / "serve.sh"
    script.write_text(export(parcompile.compile(text, "nl.par"), "vllm").text)
    stub = tmp_path / "bin" / "vllm"
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/sh\nprintf %s "$2" > {tmp_path}/model\n')
    stub.chmod(0o755)
    subprocess.run(["bash", str(script)], check=True, env={"PATH": f"{stub.parent}:/usr/bin:/bin"})
    assert not marker.exists()
    assert (tmp_path / "model").read_text() == out


def test_one_rule_says_a_plan_trains_lora():
    """The exporters ask the analysis' ``is_lora`` (of the plan's config) whether a plan trains
    LoRA: one definition in the package, not one per layer."""
    import pathlib

    import parcompile.analysis.lora
    import parcompile.exporters.lora

    package = pathlib.Path(parcompile.__file__).parent
    defs = [str(p.relative_to(package)) for p in sorted(package.rglob("*.py")) if "def is_lora(" in p.read_text()]
    assert defs == ["analysis/lora.py"]
    assert parcompile.exporters.lora.is_lora is parcompile.analysis.lora.is_lora
    assert parcompile.exporters.lora.is_lora(lora_plan("lora_attention").config)
    assert not parcompile.exporters.lora.is_lora(parcompile.compile(spec(), "full.par").config)
