"""The model keys each export target carries: an allowlist per engine, declared here once, and
the gate every exporter runs first (issue 46).

A model key at a value other than its default (:func:`set_model_keys`; the required keys
always) that its target does not carry refuses the export, with an error naming the key, its
value and the engine (:func:`model_key_errors`). Each :class:`TargetKeys` lists every key of
the spec language (:data:`parcompile.core.model.MODEL_KEY_CHECKS`) once, either in
``carries`` (how the target carries it: a :class:`Carried`) or in ``refused`` (why it cannot),
so a new model key is refused by every engine until someone says how each one carries it
(``tests/test_export_keys.py`` fails on a key missing from a declaration). A carried key may
still be refused at some values by the target's own checks (``torchtitan_errors``,
``megatron_errors``, :func:`checkpoint_key_errors`); the allowlist is the first gate.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Mapping

from parcompile.core.model import LLAMA4_KEYS, MODEL_KEY_CHECKS, ModelKeys, derived_defaults
from parcompile.exporters.common import fmt_num
from parcompile.plan import Plan

#: the export writes the key: ``how`` is the flag or field that states it
SET = "set"
#: the model is code the user brings (DeepSpeed's train.py): the export writes the key and its
#: value into a note for it
NOTE = "note"
#: a serving engine reads the key from the checkpoint's config.json (``how``: the field):
#: :func:`checkpoint_key_errors` refuses a value that file does not state
CHECKPOINT = "checkpoint"
#: the engine runs the same model at any value of the key (``how``: why), nothing to write
SAME = "same"
KINDS = (SET, NOTE, CHECKPOINT, SAME)


@dataclass(frozen=True)
class Carried:
    """How a target carries one model key: ``kind`` (:data:`SET`, :data:`NOTE`,
    :data:`CHECKPOINT`, :data:`SAME`) and ``how`` (the flag, field or file, or why it needs none)."""

    kind: str
    how: str


def written(how: str) -> Carried:
    """A key the export writes (:data:`SET`), by ``how``."""
    return Carried(SET, how)


def same(why: str) -> Carried:
    """A key whose value changes nothing the engine runs (:data:`SAME`), because ``why``."""
    return Carried(SAME, why)


@dataclass(frozen=True)
class TargetKeys:
    """One export target's model keys: its name in messages (``engine``), the keys it carries
    (``carries``: the allowlist) and the keys it refuses with the reason (``refused``). Every
    model key is in exactly one of the two."""

    engine: str
    carries: Mapping[str, Carried]
    refused: Mapping[str, str] = field(default_factory=dict)


def _each(keys: str, reason: str) -> dict[str, str]:
    """``reason`` for each of the space-separated ``keys``."""
    return dict.fromkeys(keys.split(), reason)


#: keys whose value in effect is another key's when it equals it: query_pre_attn_scalar =
#: head_dim scales the attention scores by 1 / sqrt(head_dim), the default scale (Gemma 2 9B)
SAME_AS: dict[str, Callable[[Any], Any]] = {"query_pre_attn_scalar": lambda m: m.head_dim}


def key_default(model, key: str) -> Any:
    """The default of model key ``key`` for ``model``: ModelKeys' default, a derived one
    (:func:`parcompile.core.model.derived_defaults`, from the model's other keys) for the keys
    that default to None; MISSING for the required keys."""
    f = next(f for f in fields(ModelKeys) if f.name == key)
    if f.default is MISSING or f.default is not None:
        return f.default
    values = {k: getattr(model, k) for k in MODEL_KEY_CHECKS}
    return derived_defaults({**values, key: None}).get(key)


def effective(model, key: str) -> Any:
    """``model``'s value of ``key`` in effect: a None that means another key's value
    (:data:`SAME_AS`) is that value."""
    value = getattr(model, key)
    return SAME_AS[key](model) if value is None and key in SAME_AS else value


def set_model_keys(model) -> dict[str, Any]:
    """The model keys of ``model`` (a ModelKeys or the compiler's ModelConfig) that are set:
    the required ones, and every other at a value that is not its default
    (:func:`key_default`) nor the same in effect (:data:`SAME_AS`), in declared order."""
    out = {}
    for key in MODEL_KEY_CHECKS:
        value, default = getattr(model, key), key_default(model, key)
        if default is MISSING or (value != default and not (key in SAME_AS and value == SAME_AS[key](model))):
            out[key] = value
    return out


def show(value: Any) -> str:
    """A key's value as a spec writes it (``7``, ``true``, ``rmsnorm``; ``none`` for None)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return fmt_num(value)
    return str(value)


def model_key_errors(plan: Plan, target: str) -> list[str]:
    """The allowlist gate: an error for each set model key (:func:`set_model_keys`) that
    ``target``'s declaration (:data:`TARGET_KEYS`) does not carry, naming the key, its value,
    the engine and why."""
    decl = TARGET_KEYS[target]
    errors = []
    for key, value in set_model_keys(plan.config.model).items():
        if key in decl.carries:
            continue
        why = decl.refused.get(key, "parcompile has not declared how this engine carries the key")
        errors.append(f"{key} = {show(value)}: {decl.engine} does not carry this model key: {why}")
    return errors


def checkpoint_key_errors(plan: Plan, target: str) -> list[str]:
    """What a serving engine, which reads the model from the checkpoint's config.json, would
    serve otherwise than the spec: each key the target carries as :data:`CHECKPOINT` whose
    value differs in the config.json of ``serve.weights`` (when it has one of a model_type
    parcompile reads) or, without one, in the config.json parcompile writes for the model
    (``parcompile export-weights``, ``hf_output``: a key no Hugging Face family states, such as
    query_pre_attn_scalar on a Llama, reads back as its default there); an error when no family
    expresses the model."""
    from parcompile.core.families.base import HFConfigError, HFWeightsError
    from parcompile.core.hf_weights import hf_config, model_from_checkpoint_config, read_config

    decl, m = TARGET_KEYS[target], plan.config.model
    weights = plan.config.serve.weights
    cfg, problems = read_config(weights) if weights else (None, [])
    cfg = None if problems else cfg   # a model_type parcompile does not read: compare with its own config.json
    source = f"`{weights}/config.json`" if cfg is not None else "the config.json parcompile writes for this model"
    try:
        if cfg is None:
            cfg = hf_config(m)
            source += f" (a Hugging Face `{cfg['model_type']}` checkpoint)"
        served = model_from_checkpoint_config(cfg, seq_len=m.seq_len)
    except (HFWeightsError, HFConfigError) as e:
        return [f"model: {e.message}; {decl.engine} reads the model from a Hugging Face config.json, so it cannot "
                "serve this one"]
    except (TypeError, ValueError) as e:
        return [f"model: {source} cannot be read as a model ({e}); {decl.engine} reads the model from it"]
    return [f"{key} = {show(getattr(m, key))}: {decl.engine} reads the model from the checkpoint's config.json, and "
            f"{source} states {show(getattr(served, key))} ({c.how})" for key, c in decl.carries.items()
            if c.kind == CHECKPOINT and effective(m, key) != effective(served, key)]


# --------------------------------------------------------------------------- the declarations

#: the keys only Llama 4 sets (core/model.py LLAMA4_KEYS) and its temperature's scales
_LLAMA4_KEYS = " ".join([*LLAMA4_KEYS, "floor_scale", "attn_scale"])

_MEGATRON_SOURCE = "core_v0.19.0 5be9626709af2722333bf54797c954c09edeada3"
#: Megatron-LM core_v0.19's pretrain_gpt.py (flags: megatron/training/arguments.py, the
#: TransformerConfig fields made flags by ArgumentGroupFactory less its exclude list)
MEGATRON = TargetKeys("Megatron-LM (pretrain_gpt.py)", {
    "layers": written("--num-layers"),
    "hidden": written("--hidden-size"),
    "heads": written("--num-attention-heads"),
    "kv_heads": written("--group-query-attention --num-query-groups"),
    "head_dim": written("--kv-channels (multi-latent attention: --qk-head-dim + --qk-pos-emb-head-dim)"),
    "ffn_hidden": written("--ffn-hidden-size"),
    "vocab": written("--vocab-size"),
    "seq_len": written("--seq-length"),
    "max_positions": written("--max-position-embeddings"),
    "norm": written("--normalization"),
    "activation": written("--swiglu; gelu is the default (relu, geglu: megatron_errors)"),
    "position": written("--position-embedding-type"),
    "bias": written("--disable-bias-linear when false"),
    "qkv_bias": written("--add-qkv-bias"),
    "norm_eps": written("--norm-epsilon"),
    "rope_theta": written("--rotary-base"),
    "rotary_fraction": written("--rotary-percent"),
    "qk_norm": written("--qk-layernorm"),
    "rope_type": written("llama3: --use-rope-scaling; yarn (multi-latent attention): --rotary-scaling-factor "
                         "(linear, yarn elsewhere: megatron_errors)"),
    "rope_scaling_factor": written("--rope-scaling-factor / --rotary-scaling-factor"),
    "rope_original_max_positions": written("fixed by Megatron-Core: 8192 (Llama 3), 4096 (MLA's YaRN); "
                                           "another value: megatron_errors"),
    "rope_low_freq_factor": written("fixed at 1 by --use-rope-scaling (another: megatron_errors)"),
    "rope_high_freq_factor": written("fixed at 4 by --use-rope-scaling (another: megatron_errors)"),
    "rope_mscale": written("--mscale"),
    "rope_mscale_all_dim": written("--mscale-all-dim"),
    "q_lora_rank": written("--q-lora-rank"),
    "kv_lora_rank": written("--multi-latent-attention --kv-lora-rank"),
    "qk_nope_head_dim": written("--qk-head-dim"),
    "qk_rope_head_dim": written("--qk-pos-emb-head-dim"),
    "v_head_dim": written("--v-head-dim"),
    "rope_interleave": same("interleaved and half-split RoPE pairs are one model up to a fixed permutation of the "
                            "q/k rows (a note says so; Megatron-Bridge's DeepSeek converter permutes them)"),
    "zero_centered_gamma": written("--apply-layernorm-1p (TransformerConfig.layernorm_zero_centered_gamma)"),
    "attention": written("--attention-backend"),
    "dropout": written("--attention-dropout --hidden-dropout"),
    "tie_embeddings": written("--untie-embeddings-and-output-weights when false"),
    "dtype": written("--bf16 / --fp16"),
    "experts": written("--num-experts"),
    "top_k": written("--moe-router-topk"),
    "expert_ffn_hidden": written("--moe-ffn-hidden-size"),
    "shared_experts": written("--moe-shared-expert-intermediate-size"),
    "dense_layers": written("--moe-layer-freq"),
    "router_aux_loss": written("--moe-aux-loss-coeff"),
    "norm_topk_prob": written("--moe-router-pre-softmax when false (sigmoid scores: megatron_errors unless "
                                "false exactly at top_k 1)"),
    "scoring_func": written("--moe-router-score-function"),
    "topk_method": written("--moe-router-enable-expert-bias"),
    "n_group": written("--moe-router-num-groups"),
    "topk_group": written("--moe-router-group-topk"),
    "routed_scaling_factor": written("--moe-router-topk-scaling-factor"),
    "vocab_multiple": written("--make-vocab-size-divisible-by"),
}, {
    **_each("parallel_residual", "pretrain_gpt.py has no parallel attention/MLP residual"),
    **_each("sliding_window sliding_window_pattern",
            "parcompile writes no --window-size / --window-attn-skip-freq (Transformer Engine attention only; "
            "the off-by-one of its window against transformers' sliding_window is unchecked)"),
    **_each("rope_local_base_freq", "pretrain_gpt.py's RoPE has one base for every layer"),
    **_each("rope_beta_fast rope_beta_slow rope_truncate",
            "Megatron-Core's YaRN fixes beta_fast 32, beta_slow 1 and truncation (MLATransformerConfig), "
            "without flags"),
    **_each("sandwich_norm scale_embeddings",
            "pretrain_gpt.py's GPT layer has no post-sublayer norms nor scaled embeddings (Megatron-Bridge's "
            "Gemma providers add them in code)"),
    **_each("query_pre_attn_scalar",
            "the attention scale is TransformerConfig.softmax_scale, which megatron/training/arguments.py "
            f"_add_network_size_args excludes from the command line ({_MEGATRON_SOURCE}); export --to "
            "megatron-bridge, whose GPTModelProvider takes softmax_scale"),
    **_each("attention_sinks", "parcompile writes no --softmax-type learnable"),
    **_each("attn_logit_softcapping final_logit_softcapping",
            "pretrain_gpt.py has no soft-capping argument (Megatron-Bridge's Gemma2ModelProvider caps the scores "
            "in its Gemma2DotProductAttention and the logits in its Gemma2OutputLayer: gemma2_provider.py@d9f7643b)"),
    **_each("router_bias", "Megatron-Core's router has no bias"),
    **_each("swiglu_alpha swiglu_limit",
            "the clamped SwiGLU needs TransformerConfig.activation_func, which has no flag"),
    **_each(_LLAMA4_KEYS, "parcompile writes none of Llama 4's NoPE, chunked-attention, temperature, L2 qk-norm "
                          "or interleaved-MoE settings to pretrain_gpt.py"),
})

#: Megatron-Bridge 0.3.1: the Megatron-LM arguments renamed (MEGATRON_BRIDGE_FIELDS), but
#: multi-latent attention needs its MLAModelProvider, and the attention scale is a field
MEGATRON_BRIDGE = TargetKeys("Megatron-Bridge (GPTModelProvider)", {
    **{k: Carried(c.kind, f"the GPTModelProvider field of {c.how}" if c.kind == SET else c.how)
       for k, c in MEGATRON.carries.items()
       if k not in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "rope_mscale", "rope_mscale_all_dim", "rope_interleave")},
    "max_positions": same("GPTModelProvider sizes positions by seq_length: a RoPE model's values within it do not "
                          "depend on the table's length (learned positions of another length: "
                          "megatron_bridge_config refuses)"),
    "query_pre_attn_scalar": written("model.softmax_scale = query_pre_attn_scalar ** -0.5 (TransformerConfig's; "
                                     "Megatron-Bridge v0.3.1 gemma3_bridge.py sets it so)"),
}, {
    **{k: v for k, v in MEGATRON.refused.items() if k != "query_pre_attn_scalar"},
    **_each("q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim rope_mscale rope_mscale_all_dim "
            "rope_interleave",
            "multi-head latent attention needs Megatron-Bridge's MLAModelProvider; export --to megatron"),
})

_LLAMA3 = "torchtitan's llama3 (RMSNorm, SwiGLU, RoPE, no biases, head_dim = dim / n_heads)"
_TORCHTITAN_REFUSED = {
    **_each("head_dim", f"{_LLAMA3} uses dim / n_heads"),
    **_each("norm activation position", f"{_LLAMA3} has only RMSNorm, SwiGLU and RoPE"),
    **_each("bias qkv_bias", "torchtitan's llama3 linear layers have no biases"),
    **_each("rotary_fraction", "torchtitan's llama3 rotates the whole head"),
    **_each("parallel_residual", "torchtitan's llama3 block is sequential"),
    **_each("sliding_window sliding_window_pattern rope_local_base_freq",
            "torchtitan's llama3 attends to the whole context with one RoPE"),
    **_each("qk_norm", "torchtitan's llama3 has no q/k norm (its qwen3 model has one)"),
    **_each("rope_beta_fast rope_beta_slow rope_truncate rope_mscale rope_mscale_all_dim",
            "torchtitan's llama3 RoPE scales as none or llama (Llama 3.1): no YaRN"),
    **_each("q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim rope_interleave",
            "multi-head latent attention: torchtitan's llama3 has none (its deepseek_v3 model has)"),
    **_each("zero_centered_gamma sandwich_norm scale_embeddings attn_logit_softcapping final_logit_softcapping",
            "torchtitan's llama3 has none of Gemma's norms, scaled embeddings or soft-capping"),
    **_each("query_pre_attn_scalar",
            "torchtitan 0.3's GQAttention scales the scores by head_dim ** -0.5 (models/common/attention.py "
            "GQAttention.__init__ `self.scaling`), with no config field for another scale"),
    **_each("attention_sinks", "torchtitan's llama3 attention has no sinks"),
    **_each("dropout", "torchtitan's llama3 has no dropout"),
    **_each(_LLAMA4_KEYS, "Llama 4's layers: torchtitan's llama3 has none (its llama4 model has)"),
    **_each("experts top_k expert_ffn_hidden shared_experts dense_layers router_aux_loss norm_topk_prob router_bias "
            "scoring_func topk_method n_group topk_group routed_scaling_factor swiglu_alpha swiglu_limit",
            "parcompile exports dense llama3-family models to torchtitan; its MoE models (deepseek_v3, qwen3) need "
            "a flavor registered by hand"),
}
_SAME_KERNEL = same("the attention kernel (torchtitan's flex or sdpa backend): the same softmax attention")
_UNPADDED = same("torchtitan's vocabulary is unpadded (vocab_size); parcompile masks its padded logits, "
                 "so the padding changes no value")
#: torchtitan 0.3: the exported module registers the spec's shape as a llama3 flavor
TORCHTITAN = TargetKeys("torchtitan 0.3 (a llama3 flavor)", {
    "layers": written("n_layers"), "hidden": written("dim"), "heads": written("n_heads"),
    "kv_heads": written("n_kv_heads"), "ffn_hidden": written("hidden_dim"), "vocab": written("vocab_size"),
    "seq_len": written("training.seq_len"), "max_positions": written("ComplexRoPE max_seq_len"),
    "norm_eps": written("the RMSNorms' eps"), "rope_theta": written("ComplexRoPE theta"),
    "rope_type": written("ComplexRoPE scaling \"llama\" for llama3 (others: torchtitan_errors)"),
    "rope_scaling_factor": written("ComplexRoPE scaling_factor"),
    "rope_original_max_positions": written("ComplexRoPE original_max_position_embeddings"),
    "rope_low_freq_factor": written("ComplexRoPE low_freq_factor"),
    "rope_high_freq_factor": written("ComplexRoPE high_freq_factor"),
    "tie_embeddings": written("enable_weight_tying"),
    "dtype": written("training.mixed_precision_param (fp16: torchtitan_errors)"),
    "attention": _SAME_KERNEL, "vocab_multiple": _UNPADDED,
}, _TORCHTITAN_REFUSED)

#: torchtitan 0.2: the TOML names a llama3 flavor (8B, 70B, 405B) and overrides none of its
#: fields; the export is refused unless the flavor is the spec's model field by field
TORCHTITAN02 = TargetKeys("torchtitan 0.2 (a named llama3 flavor)", {
    **{k: written("the named flavor's field (torchtitan02_flavor: refused where it differs)")
       for k in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "norm_eps", "rope_theta", "rope_type",
                 "rope_scaling_factor", "rope_original_max_positions", "rope_low_freq_factor",
                 "rope_high_freq_factor", "tie_embeddings")},
    "seq_len": written("training.seq_len"),
    "max_positions": same("the RoPE table's length: a RoPE model's values within seq_len do not depend on it"),
    "dtype": written("training.mixed_precision_param (fp16: torchtitan_errors)"),
    "attention": _SAME_KERNEL, "vocab_multiple": _UNPADDED,
}, {**_TORCHTITAN_REFUSED, "query_pre_attn_scalar": "torchtitan 0.2's llama3 Attention scales the scores by "
                                                    "head_dim ** -0.5 (F.scaled_dot_product_attention's default)"})

#: DeepSpeed 0.19: the JSON has no model; train.py (the user's code) builds it, and the
#: export's model note lists every set key with its value
DEEPSPEED = TargetKeys("DeepSpeed", {
    **{k: Carried(NOTE, "train.py builds the model: the model note lists the key and its value")
       for k in MODEL_KEY_CHECKS},
    "dtype": written("bf16.enabled / fp16.enabled"),
})

#: what a Hugging Face config.json states each key as, for the serving engines
_HF_FIELDS = {
    "layers": "num_hidden_layers (GPT-2: n_layer)", "hidden": "hidden_size (n_embd)",
    "heads": "num_attention_heads (n_head)", "kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "ffn_hidden": "intermediate_size (n_inner)", "vocab": "vocab_size",
    "max_positions": "max_position_embeddings (n_positions)", "norm": "model_type (gpt2, gpt_neox: LayerNorm)",
    "activation": "hidden_act / hidden_activation", "position": "model_type (gpt2: learned)",
    "bias": "attention_bias / mlp_bias (gpt2, gpt_neox: always)", "qkv_bias": "attention_bias (qwen2: always)",
    "norm_eps": "rms_norm_eps / layer_norm_eps", "rope_theta": "rope_parameters.rope_theta",
    "rotary_fraction": "partial_rotary_factor / rotary_pct", "parallel_residual": "use_parallel_residual",
    "sliding_window": "sliding_window", "qk_norm": "model_type (qwen3, gemma3_text)",
    "sliding_window_pattern": "layer_types", "rope_local_base_freq": "rope_local_base_freq",
    "rope_type": "rope_parameters.rope_type", "rope_scaling_factor": "rope_parameters.factor",
    "rope_original_max_positions": "rope_parameters.original_max_position_embeddings",
    "rope_beta_fast": "rope_parameters.beta_fast", "rope_beta_slow": "rope_parameters.beta_slow",
    "rope_truncate": "rope_parameters.truncate", "rope_low_freq_factor": "rope_parameters.low_freq_factor",
    "rope_high_freq_factor": "rope_parameters.high_freq_factor", "rope_mscale": "rope_parameters.mscale",
    "rope_mscale_all_dim": "rope_parameters.mscale_all_dim", "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim", "rope_interleave": "rope_interleave",
    "zero_centered_gamma": "model_type (gemma2, gemma3_text)", "sandwich_norm": "model_type (gemma2, gemma3_text)",
    "scale_embeddings": "model_type (gemma2, gemma3_text)",
    # vLLM's and SGLang's Gemma2Attention: self.scaling = config.query_pre_attn_scalar**-0.5
    # (vllm/model_executor/models/gemma2.py at 025adfb9; python/sglang/srt/models/gemma2.py at 00b08c49)
    "query_pre_attn_scalar": "query_pre_attn_scalar (gemma2, gemma3_text)",
    "attention_sinks": "model_type (gpt_oss)", "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping", "tie_embeddings": "tie_word_embeddings",
    "experts": "num_local_experts / num_experts / n_routed_experts", "top_k": "num_experts_per_tok",
    "expert_ffn_hidden": "moe_intermediate_size (mixtral: intermediate_size)",
    "shared_experts": "n_shared_experts", "dense_layers": "first_k_dense_replace / mlp_only_layers",
    "norm_topk_prob": "norm_topk_prob", "router_bias": "model_type (gpt_oss)",
    "scoring_func": "model_type (deepseek_v3: sigmoid)", "topk_method": "model_type (deepseek_v3: noaux_tc)",
    "n_group": "n_group", "topk_group": "topk_group", "routed_scaling_factor": "routed_scaling_factor",
    "swiglu_alpha": "swiglu_alpha", "swiglu_limit": "swiglu_limit",
    # Llama 4 (llama4_text): vLLM's and SGLang's Llama4 models read these Llama4TextConfig fields
    "nope_layer_interval": "no_rope_layers", "attention_chunk_size": "attention_chunk_size",
    "attn_temperature_tuning": "attn_temperature_tuning", "floor_scale": "floor_scale", "attn_scale": "attn_scale",
    "qk_l2_norm": "use_qk_norm (llama4_text)", "interleave_moe_layer_step": "moe_layers / interleave_moe_layer_step",
    "moe_apply_probs_on_input": "model_type (llama4_text)",
}
_SERVED = {
    **{k: Carried(CHECKPOINT, f"config.json field {f}") for k, f in _HF_FIELDS.items()},
    "seq_len": same("the training sequence: a server's context is --max-model-len / --context-length "
                    "(prompt_len + max_new_tokens)"),
    "attention": same("the attention kernel (the server's own backend): the same softmax attention"),
    "dropout": same("training only: inference applies no dropout"),
    "router_aux_loss": same("training only: a loss term"),
    "vocab_multiple": same("the embedding's padding rows: the server pads to its own multiple; no token uses them"),
    "dtype": written("--dtype"),
}
#: vLLM 0.33 and SGLang 0.5.23: the model is the checkpoint's config.json (checkpoint_key_errors)
VLLM = TargetKeys("vLLM", _SERVED)
SGLANG = TargetKeys("SGLang", _SERVED)

#: every export target's declaration, by target (torchtitan 0.2: ``torchtitan-0.2``)
TARGET_KEYS: dict[str, TargetKeys] = {
    "megatron": MEGATRON, "megatron-bridge": MEGATRON_BRIDGE, "torchtitan": TORCHTITAN, "torchtitan-0.2": TORCHTITAN02,
    "deepspeed": DEEPSPEED, "vllm": VLLM, "sglang": SGLANG,
}

#: the cells of :func:`keys_table`, by kind
_CELL = {SET: "carried", NOTE: "note", CHECKPOINT: "config.json", SAME: "same model"}


def keys_table() -> str:
    """The declarations as docs/export.md's table: a row per model key, a column per target
    (vLLM and SGLang share one), each cell how the target carries the key (``carried``: a flag
    or field; ``note``: the model note; ``config.json``: the checkpoint's, checked; ``same
    model``: no setting needed) or ``refused``."""
    columns = [("Megatron-LM", MEGATRON), ("Megatron-Bridge", MEGATRON_BRIDGE), ("torchtitan 0.3", TORCHTITAN),
               ("torchtitan 0.2", TORCHTITAN02), ("DeepSpeed", DEEPSPEED), ("vLLM, SGLang", VLLM)]
    lines = ["| model key | " + " | ".join(name for name, _ in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for key in MODEL_KEY_CHECKS:
        cells = [_CELL[d.carries[key].kind] if key in d.carries else "**refused**" if key in d.refused else
                 "undeclared" for _, d in columns]
        lines.append(f"| `{key}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
