"""Every model key of the spec language against every export target (issue 46): each key set to
a valid value other than its default is either carried by the target (in its allowlist,
``parcompile.exporters.model_keys.TARGET_KEYS``, and then the export shows it) or refused with an
error naming the key. A key that is neither (an export that silently drops it) fails here, and
so does a model key without a value in :data:`VALUES` or without a place in every target's
declaration."""

from __future__ import annotations

import functools
import re

import pytest

import parcompile
from parcompile.core.families.base import HFWeightsError
from parcompile.core.hf_weights import hf_config, model_from_checkpoint_config
from parcompile.core.model import MODEL_KEY_CHECKS, KeyCheck
from parcompile.diagnostics import SpecError
from parcompile.exporters import export
from parcompile.exporters import model_keys as mk
from parcompile.exporters.model_keys import CHECKPOINT, KINDS, NOTE, SET, TARGET_KEYS, effective, set_model_keys

MOE = {"experts": 4, "top_k": 2}
MLA = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16}
YARN = {"rope_type": "yarn", "rope_scaling_factor": 2.0, "rope_original_max_positions": 32}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_scaling_factor": 8.0, "rope_original_max_positions": 32}
NOAUX = {**MOE, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def _mla_without(key: str) -> dict:
    return {k: v for k, v in MLA.items() if k != key}


#: every model key -> the values (not its default) it is tried at, each with the other keys it
#: needs (a value the front end refuses without them); more than one where engines carry some
#: values and refuse others. A model key missing here fails test_every_key_has_values_and_declarations.
VALUES: dict[str, list[tuple[object, dict]]] = {
    "layers": [(6, {})], "hidden": [(96, {})], "heads": [(8, {})], "kv_heads": [(2, {})], "head_dim": [(32, {})],
    "ffn_hidden": [(192, {})], "vocab": [(320, {})], "seq_len": [(128, {})], "max_positions": [(256, {})],
    "norm": [("layernorm", {})], "activation": [("gelu", {}), ("relu", {}), ("geglu", {})],
    "position": [("learned", {}), ("none", {})], "bias": [(True, {})], "qkv_bias": [(True, {})],
    "norm_eps": [(1e-6, {})], "rope_theta": [(500000.0, {})], "rotary_fraction": [(0.5, {})],
    "parallel_residual": [(True, {})], "sliding_window": [(16, {})], "qk_norm": [(True, {})],
    "sliding_window_pattern": [(2, {"sliding_window": 16})],
    "rope_local_base_freq": [(20000.0, {"sliding_window": 16, "sliding_window_pattern": 2})],
    "rope_type": [("linear", {"rope_scaling_factor": 2.0}), ("yarn", {"rope_scaling_factor": 2.0,
                                                                       "rope_original_max_positions": 32}),
                  ("llama3", {"rope_scaling_factor": 8.0, "rope_original_max_positions": 8192})],
    "rope_scaling_factor": [(4.0, {"rope_type": "linear"})],
    "rope_original_max_positions": [(32, {"rope_type": "yarn", "rope_scaling_factor": 2.0})],
    "rope_beta_fast": [(16.0, YARN)], "rope_beta_slow": [(2.0, YARN)], "rope_truncate": [(False, YARN)],
    "rope_low_freq_factor": [(2.0, LLAMA3_ROPE)], "rope_high_freq_factor": [(8.0, LLAMA3_ROPE)],
    "rope_mscale": [(1.0, {**MLA, **YARN})], "rope_mscale_all_dim": [(1.0, {**MLA, **YARN})],
    "q_lora_rank": [(24, MLA)], "kv_lora_rank": [(16, _mla_without("kv_lora_rank"))],
    "qk_nope_head_dim": [(8, _mla_without("qk_nope_head_dim"))],
    "qk_rope_head_dim": [(8, _mla_without("qk_rope_head_dim"))], "v_head_dim": [(16, _mla_without("v_head_dim"))],
    "rope_interleave": [(True, MLA)],
    "zero_centered_gamma": [(True, {})], "sandwich_norm": [(True, {})], "scale_embeddings": [(True, {})],
    # Gemma 2 27B's is 144 with head_dim 128: a scale of 0.083 instead of 0.088
    "query_pre_attn_scalar": [(7.0, {})], "attention_sinks": [(True, {})],
    "attn_logit_softcapping": [(50.0, {})], "final_logit_softcapping": [(30.0, {})],
    "attention": [("unfused", {})], "dropout": [(0.1, {})], "tie_embeddings": [(True, {})],
    "dtype": [("fp32", {}), ("fp16", {})],
    "experts": [(4, {})], "top_k": [(1, {"experts": 4})], "expert_ffn_hidden": [(64, MOE)],
    "shared_experts": [(1, MOE)], "dense_layers": [(1, MOE)], "router_aux_loss": [(0.02, MOE)],
    "norm_topk_prob": [(False, MOE)], "router_bias": [(True, MOE)], "scoring_func": [("sigmoid", MOE)],
    "topk_method": [("noaux_tc", {**MOE, "scoring_func": "sigmoid"})],
    "n_group": [(2, {**NOAUX, "topk_group": 1})], "topk_group": [(2, {**NOAUX, "n_group": 2})],
    "routed_scaling_factor": [(2.5, MOE)],
    "swiglu_alpha": [(1.702, {**MOE, "swiglu_limit": 7.0})], "swiglu_limit": [(7.0, {**MOE, "swiglu_alpha": 1.702})],
    "vocab_multiple": [(64, {})],
    # Llama 4's
    "nope_layer_interval": [(2, {})], "attention_chunk_size": [(16, {})],
    "attn_temperature_tuning": [(True, {"nope_layer_interval": 2})],
    "floor_scale": [(4.0, {"nope_layer_interval": 2, "attn_temperature_tuning": True})],
    "attn_scale": [(0.5, {"nope_layer_interval": 2, "attn_temperature_tuning": True})], "qk_l2_norm": [(True, {})],
    "interleave_moe_layer_step": [(2, MOE)], "moe_apply_probs_on_input": [(True, MOE)],
}
#: the model every spec starts from (the required keys; everything else at its default)
BASE = {"layers": 4, "hidden": 64, "heads": 4, "ffn_hidden": 128, "vocab": 256, "seq_len": 64}
LAYOUT = {
    "train": 'cluster local from "cpu" { nodes = 1, gpus_per_node = 8 }\n'
             "parallel { dp = 4, tp = 1, pp = 2, micro_batch = 2, global_batch = 16 }\ntrain { steps = 10 }\n",
    "serve": 'cluster local from "cpu" { nodes = 1, gpus_per_node = 2 }\nparallel { tp = 2, pp = 1 }\n'
             "serve { batch = 4, prompt_len = 16, max_new_tokens = 16 }\n",
}
#: export targets by workload: (the declaration's name, export's target, torchtitan version)
TARGETS = {
    "train": [("megatron", "megatron", "0.3"), ("megatron-bridge", "megatron-bridge", "0.3"),
              ("torchtitan", "torchtitan", "0.3"), ("torchtitan-0.2", "torchtitan", "0.2"),
              ("deepspeed", "deepspeed", "0.3")],
    "serve": [("vllm", "vllm", "0.3"), ("sglang", "sglang", "0.3")],
}


def _literal(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return v if isinstance(v, str) else repr(v)


def spec(keys: dict, workload: str) -> str:
    body = "".join(f"    {k} = {_literal(v)}\n" for k, v in {**BASE, **keys}.items())
    return "model m {\n" + body + "}\n" + LAYOUT[workload]


@functools.lru_cache(maxsize=None)
def _compile(src: str):
    """The plan of ``src``, or None when the front end refuses it."""
    try:
        return parcompile.compile(src, "keys.par")
    except SpecError:
        return None


def names(errors: list[str], key: str) -> bool:
    """Whether an error names model key ``key`` (as a word)."""
    return any(re.search(rf"(?<![\w.]){key}(?![\w])", e) for e in errors)


def walk(workload: str) -> tuple[list[str], dict[str, int]]:
    """Every key at every value of :data:`VALUES` against every target of ``workload``: the
    problems (a key neither carried nor refused; a carried key the export drops) and the
    counts (specs compiled, skipped by the front end, carried, refused)."""
    problems: list[str] = []
    counts = dict.fromkeys(("compiled", "skipped", "carried", "refused", "refused_value"), 0)
    for key, values in VALUES.items():
        for value, needs in values:
            plan = _compile(spec({**needs, key: value}, workload))
            if plan is None:
                counts["skipped"] += 1
                continue
            counts["compiled"] += 1
            if key not in set_model_keys(plan.config.model):
                problems.append(f"{key} = {value}: not set in the compiled model (its default in effect)")
            base = _compile(spec(needs, workload))
            for decl_name, target, version in TARGETS[workload]:
                problems += _check(key, value, plan, base, decl_name, target, version, counts)
    return problems, counts


def _check(key, value, plan, base, decl_name, target, version, counts) -> list[str]:
    """One key at one value against one target: refused (named by an error) unless the
    target's declaration carries it; carried, an accepted export shows it."""
    decl = TARGET_KEYS[decl_name]
    ex = export(plan, target, torchtitan_version=version)
    where = f"{key} = {value} -> {decl_name}"
    if key not in decl.carries:
        counts["refused"] += 1
        return [] if names(ex.errors, key) else [f"{where}: not carried, yet no error names it: {ex.errors}"]
    counts["carried"] += 1
    kind = decl.carries[key].kind
    if ex.errors:   # refused (a value the engine cannot take, or another key): nothing written, nothing dropped
        counts["refused_value"] += names(ex.errors, key)
        return []
    if kind in (SET, NOTE) and base is not None:
        ex0 = export(base, target, torchtitan_version=version)
        if (ex.text, ex.notes) == (ex0.text, ex0.notes):
            return [f"{where}: carried ({decl.carries[key].how}), yet the export is the one without it: dropped"]
    if kind == CHECKPOINT:
        m = plan.config.model
        try:
            served = model_from_checkpoint_config(hf_config(m), seq_len=m.seq_len)
        except HFWeightsError as e:
            return [f"{where}: carried by config.json, yet no Hugging Face config.json states the model: {e.message}"]
        if effective(served, key) != effective(m, key):
            return [f"{where}: carried by config.json, yet the config.json of the model states "
                    f"{getattr(served, key)!r}"]
    return []


def _valid(check: KeyCheck, v) -> bool:
    """Whether ``v`` is a value of a key of ``check`` (the front end's KeyType, by hand)."""
    if check.kind == "bool":
        return isinstance(v, bool)
    if check.kind == "enum":
        return v in check.choices
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (check.kind == "int" and not isinstance(v, int)):
        return False
    lo = check.low is None or (v > check.low if check.low_open else v >= check.low)
    hi = check.high is None or (v < check.high if check.high_open else v <= check.high)
    return lo and hi


def declaration_problems(keys=None, values=None, decls=None) -> list[str]:
    """What the declarations and :data:`VALUES` lack: a model key (default: every key of
    :data:`MODEL_KEY_CHECKS`) without values, with an invalid one, or not in exactly one of a
    target's ``carries`` and ``refused``; a declared key that is no model key; a kind not in
    :data:`KINDS`."""
    keys = MODEL_KEY_CHECKS if keys is None else keys
    values = VALUES if values is None else values
    decls = TARGET_KEYS if decls is None else decls
    out = [f"{k}: no values in VALUES" for k in keys if not values.get(k)]
    out += [f"{k} = {v}: not a value of {keys[k]}" for k in keys for v, _ in values.get(k, ())
            if not _valid(keys[k], v)]
    out += [f"{k}: in VALUES, not a model key" for k in values if k not in keys]
    for name, d in decls.items():
        out += [f"{name}: {k} neither carried nor refused" for k in keys if k not in d.carries and k not in d.refused]
        out += [f"{name}: {k} both carried and refused" for k in keys if k in d.carries and k in d.refused]
        out += [f"{name}: {k} declared, not a model key" for k in (*d.carries, *d.refused) if k not in keys]
        out += [f"{name}: {k} carried as {c.kind!r}" for k, c in d.carries.items() if c.kind not in KINDS]
    return out


def test_every_key_has_values_and_declarations():
    """Every model key has values to try and a place in every target's declaration."""
    assert set(TARGET_KEYS) == {"megatron", "megatron-bridge", "torchtitan", "torchtitan-0.2", "deepspeed", "vllm",
                                "sglang"}
    assert declaration_problems() == []


@pytest.mark.parametrize("workload", ["train", "serve"])
def test_every_key_is_carried_or_refused_by_every_engine(workload):
    """Each model key at each value of VALUES, compiled (the front end may refuse a
    combination: counted, and every key still compiles at one value at least), exported to
    every engine of the workload: carried (and the accepted export shows it: it differs from
    the export without the key; a server's config.json states it) or refused naming the key."""
    problems, counts = walk(workload)
    assert problems == []
    compiled = {k for k, vals in VALUES.items() for v, needs in vals
                if _compile(spec({**needs, k: v}, workload)) is not None}
    assert compiled == set(VALUES), set(VALUES) - compiled
    assert counts["compiled"] + counts["skipped"] == sum(map(len, VALUES.values()))
    assert counts["carried"] and counts["refused" if workload == "train" else "refused_value"]


def test_query_pre_attn_scalar_is_carried_or_refused_by_each_engine():
    """Gemma 2 27B's query_pre_attn_scalar (144 over head_dim 128): Megatron-Bridge writes
    softmax_scale, DeepSpeed's model note names it, and pretrain_gpt.py (no softmax-scale flag),
    both torchtitans (head_dim ** -0.5 built in) and the servers of a Llama checkpoint refuse it;
    equal to head_dim it is the default scale."""
    plan = _compile(spec({"query_pre_attn_scalar": 144.0, "head_dim": 128}, "train"))
    errors = {t: export(plan, t).errors for t in ("megatron", "megatron-bridge", "torchtitan")}
    assert [e for e in errors["megatron"] if e.startswith("query_pre_attn_scalar = 144: Megatron-LM")]
    assert "excludes from the command line" in errors["megatron"][0]
    assert names(export(plan, "torchtitan", torchtitan_version="0.2").errors, "query_pre_attn_scalar")
    assert names(errors["torchtitan"], "query_pre_attn_scalar")
    assert not names(errors["megatron-bridge"], "query_pre_attn_scalar")
    assert "softmax_scale=0.08333333333333333," in export(plan, "megatron-bridge").text
    assert "query_pre_attn_scalar 144" in " ".join(export(plan, "deepspeed").notes)
    served = _compile(spec({"query_pre_attn_scalar": 144.0, "head_dim": 128}, "serve"))
    for target in ("vllm", "sglang"):
        e = export(served, target).errors
        says = "the config.json parcompile writes for this model (a Hugging Face `llama` checkpoint) states none"
        assert e and e[0].startswith("query_pre_attn_scalar = 144: ") and says in e[0], e
    same = _compile(spec({"query_pre_attn_scalar": 32.0, "head_dim": 32}, "train"))
    assert "query_pre_attn_scalar" not in set_model_keys(same.config.model)
    assert not names(export(same, "megatron").errors, "query_pre_attn_scalar")


def test_a_server_checks_the_checkpoints_config_json(tmp_path):
    """With a checkpoint named, the servers compare the model with its config.json: a key the
    spec sets otherwise (a scale the checkpoint does not have) is refused, naming the file."""
    import json

    from parcompile.core.model import ModelKeys

    m = ModelKeys(**BASE, query_pre_attn_scalar=12.0, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps({**hf_config(ModelKeys(**BASE)), "head_dim": 16}))
    src = spec({"query_pre_attn_scalar": m.query_pre_attn_scalar, "head_dim": 16}, "serve").replace(
        "serve {", f"serve {{ weights = {json.dumps(str(tmp_path))},", 1)
    plan = _compile(src)
    assert plan is not None
    for target in ("vllm", "sglang"):
        e = export(plan, target).errors
        assert e[0].startswith("query_pre_attn_scalar = 12: ") and f"`{tmp_path}/config.json` states none" in e[0], e


# --------------------------------------------------------------------------- the test can fail


def test_a_key_removed_from_an_allowlist_fails():
    """Deleting a key from a target's declaration (carried by none, refused by none) is a
    problem the declaration check names; so is a new model key nobody declared."""
    doctored = dict(mk.MEGATRON_BRIDGE.carries)
    del doctored["query_pre_attn_scalar"]
    decls = {**TARGET_KEYS, "megatron-bridge": mk.TargetKeys("x", doctored, mk.MEGATRON_BRIDGE.refused)}
    assert declaration_problems(decls=decls) == ["megatron-bridge: query_pre_attn_scalar neither carried nor refused"]
    keys = {**MODEL_KEY_CHECKS, "attention_temperature": KeyCheck("float", low=0, low_open=True)}
    problems = declaration_problems(keys=keys)
    assert "attention_temperature: no values in VALUES" in problems
    assert "megatron: attention_temperature neither carried nor refused" in problems
    assert len(problems) == 1 + len(TARGET_KEYS)


def test_a_key_an_allowlist_carries_but_the_export_drops_fails(monkeypatch):
    """An allowlist that says Megatron-LM carries query_pre_attn_scalar (as the exports did
    before issue 46: nothing refused it) lets the export through without it: the walker
    names the drop."""
    carries = {**mk.MEGATRON.carries, "query_pre_attn_scalar": mk.written("nothing")}
    refused = {k: v for k, v in mk.MEGATRON.refused.items() if k != "query_pre_attn_scalar"}
    monkeypatch.setitem(TARGET_KEYS, "megatron", mk.TargetKeys("Megatron-LM", carries, refused))
    plan = _compile(spec({"query_pre_attn_scalar": 7.0}, "train"))
    base = _compile(spec({}, "train"))
    counts = dict.fromkeys(("carried", "refused", "refused_value"), 0)
    problems = _check("query_pre_attn_scalar", 7.0, plan, base, "megatron", "megatron", "0.3", counts)
    assert problems and "yet the export is the one without it: dropped" in problems[0]


def test_docs_table_is_the_declarations():
    """docs/export.md's model keys table is :func:`parcompile.exporters.model_keys.keys_table`."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "export.md").read_text()
    assert mk.keys_table() in doc


def test_megatron_refuses_sigmoid_weights_it_would_normalise_otherwise():
    """Megatron-Core's sigmoid routing divides the top-k scores by their sum only for k > 1
    (megatron/core/transformer/moe/moe_utils.py topk_routing_with_score_function at core_v0.19.0:
    ``scores / (scores.sum(...) + 1e-20) if topk > 1 else scores``), parcompile's whenever
    norm_topk_prob: a single expert's weight there is its score s, here s / s = 1. Refused for
    both Megatron targets unless norm_topk_prob is false (the same weights); at k = 2 the
    unnormalised scores are refused, the normalised carried."""
    sigmoid = {"experts": 4, "scoring_func": "sigmoid"}
    for top_k, norm, refused in ((1, True, True), (1, False, False), (2, False, True), (2, True, False)):
        plan = _compile(spec({**sigmoid, "top_k": top_k, "norm_topk_prob": norm}, "train"))
        for target in ("megatron", "megatron-bridge"):
            errors = [e for e in export(plan, target).errors if "sigmoid" in e]
            assert bool(errors) == refused, (top_k, norm, target, errors)
            assert not refused or errors[0].startswith(f"norm_topk_prob = {'true' if norm else 'false'} with "
                                                       f"top_k {top_k} and sigmoid scores: Megatron-Core"), errors
