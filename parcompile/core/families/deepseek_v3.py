"""DeepSeek-V3 (``deepseek_v3``): multi-head latent attention (``kv_lora_rank > 0``) and
DeepSeek's router (sigmoid scores, ``e_score_correction_bias``, groups), shared experts,
the first ``dense_layers`` layers dense; its multi-token-prediction layers are left out.

Weights: ``self_attn.q_a_proj`` (our ``attn.wq_a``), ``q_a_layernorm`` (``attn.q_a_norm``),
``q_b_proj`` (``attn.wq_b``) or, with ``q_lora_rank`` 0 (HF null), ``q_proj``
(``attn.wq``); ``kv_a_proj_with_mqa`` (``attn.wkv_a``: the latent rows, then the RoPE
key's), ``kv_a_layernorm`` (``attn.kv_a_norm``), ``kv_b_proj`` (``attn.wkv_b``: per head
nope then v rows), ``o_proj`` (``attn.wo``), all one to one (the RoPE rows are not
permuted: the runtime rotates interleaved pairs when ``rope_interleave``); router
``mlp.gate.weight`` and the buffer ``mlp.gate.e_score_correction_bias``
(``mlp.router.e_score_correction_bias``, fp32); experts as qwen3_moe's (saved
``mlp.experts.{e}.gate_proj/up_proj/down_proj``, fused layout read too); shared experts
``mlp.shared_experts.gate_proj/up_proj/down_proj`` (``mlp.shared.w1/w3/w2``). The
multi-token-prediction layers (``model.layers.{layers}.*`` on) are not read.
"""

from __future__ import annotations

import json
from typing import Any

from parcompile.core.families.base import (Family, HFConfigError, Source, activation, drop_none, llama_config,
                                           read_bool, read_float, read_int, read_layers, read_str,
                                           rope_dict, rope_scaling_keys, rope_theta, router)
from parcompile.core.families.llama import GATED_MLP, llama_style, qwen3_moe_sources
from parcompile.core.model import ModelKeys

#: transformers 5.24's DeepseekV3Config defaults of the fields that shape the model (what it
#: loads when a config.json leaves one out); `n_routed_experts` is also written
#: `num_local_experts`, `num_nextn_predict_layers` also `num_mtp_layers`
DEEPSEEK_V3_DEFAULTS = {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                        "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
                        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
                        "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
                        "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
                        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                        "rope_interleave": True, "attention_bias": False, "rope_theta": 10000.0}
#: what transformers' DeepseekV3TopkRouter always does, whatever the config.json says
#: (these fields come from DeepSeek's own modelling code, which transformers ignores)
DEEPSEEK_ROUTER = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def _keys(cfg: dict, common: dict[str, Any]) -> dict[str, Any]:
    """`model` keys of a ``deepseek_v3`` config.json (transformers' DeepseekV3Config; absent
    fields take its defaults, :data:`DEEPSEEK_V3_DEFAULTS`).

    Multi-head latent attention: ``q_lora_rank`` (null: one query projection, our 0),
    ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
    ``rope_interleave``; our ``head_dim`` is ``qk_nope_head_dim + qk_rope_head_dim``
    (derived: the file's ``head_dim`` is transformers' RoPE width, ``qk_rope_head_dim``).
    ``num_key_value_heads`` must equal the heads (DeepseekV3Attention up-projects a key and a
    value per head). YaRN RoPE with ``mscale`` / ``mscale_all_dim`` (:func:`~parcompile.core.families.base.rope_scaling_keys`).

    Mixture of experts: the first ``first_k_dense_replace`` layers dense (``dense_layers``;
    all of them: ``experts = 0``), then ``n_routed_experts`` experts of width
    ``moe_intermediate_size``, top ``num_experts_per_tok``, ``n_shared_experts`` shared
    experts of that width, and DeepseekV3TopkRouter's sigmoid scores with the per-expert
    ``e_score_correction_bias`` for choosing (``scoring_func = "sigmoid"``,
    ``topk_method = "noaux_tc"``; a config.json naming another is refused: transformers does
    not run it), ``n_group`` / ``topk_group``, ``norm_topk_prob``,
    ``routed_scaling_factor``. ``router_aux_loss`` is DeepSeek's ``aux_loss_alpha`` (the
    published config.json's 0.001, the weight of its complementary balance loss), 0 when the
    file has none: transformers' DeepseekV3 computes no auxiliary loss (DeepSeek-V3 balances
    by the bias).

    Left out: the multi-token-prediction layers (``num_nextn_predict_layers``, or
    ``num_mtp_layers``; DeepSeek-V3's checkpoint holds one, ``model.layers.61.*``), which
    transformers' DeepseekV3ForCausalLM does not run either: the field is ignored.

    Raises :class:`HFConfigError`: ``attention_bias`` true (biases on q_a_proj,
    kv_a_proj_with_mqa and o_proj only), ``num_key_value_heads`` != heads, an activation
    other than silu, another ``scoring_func`` / ``topk_method``.
    """
    common = {"dtype": common["dtype"]}   # the vocabulary: DeepseekV3Config's default when absent
    c = {**DEEPSEEK_V3_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k == "q_lora_rank"}}
    if "n_routed_experts" not in cfg and cfg.get("num_local_experts") is not None:
        c["n_routed_experts"] = cfg["num_local_experts"]
    heads = read_int(c, "num_attention_heads")
    kv_heads = _mappable_kv_heads(c, heads)
    layers = read_layers(c, "num_hidden_layers")
    dense = read_int(c, "first_k_dense_replace")
    experts = read_int(c, "n_routed_experts")
    moe = bool(experts) and (layers is None or dense is None or dense < layers)
    q_lora = read_int(c, "q_lora_rank")
    rope = rope_dict(cfg)
    theta = rope_theta(cfg)
    max_pos = read_int(c, "max_position_embeddings")
    return drop_none({
        **common,
        "vocab": read_int(c, "vocab_size"),
        "layers": layers,
        "hidden": read_int(c, "hidden_size"),
        "ffn_hidden": read_int(c, "intermediate_size"),
        "heads": heads,
        "kv_heads": kv_heads,
        "seq_len": max_pos,
        "max_positions": max_pos,
        "tie_embeddings": read_bool(c, "tie_word_embeddings"),
        "norm": "rmsnorm",
        "norm_eps": read_float(c, "rms_norm_eps"),
        "activation": activation(read_str(c, "hidden_act"), gated=True),
        "position": "rope",
        "rope_theta": theta if theta is not None else DEEPSEEK_V3_DEFAULTS["rope_theta"],
        **rope_scaling_keys(rope, mscale=True),
        "bias": False,
        "qkv_bias": False,
        "q_lora_rank": q_lora or 0,
        "kv_lora_rank": read_int(c, "kv_lora_rank"),
        "qk_nope_head_dim": read_int(c, "qk_nope_head_dim"),
        "qk_rope_head_dim": read_int(c, "qk_rope_head_dim"),
        "v_head_dim": read_int(c, "v_head_dim"),
        "rope_interleave": read_bool(c, "rope_interleave"),
        **(_moe_keys(c, cfg, experts, dense) if moe else {"experts": 0}),
    })


def _mappable_kv_heads(c: dict, heads: int) -> int:
    """``num_key_value_heads`` of a deepseek_v3 config.json (``c``, defaults applied) once
    :func:`_keys`' refusals pass: raises :class:`HFConfigError` for kv heads other than
    ``heads``, ``attention_bias`` true, or a router other than :data:`DEEPSEEK_ROUTER`."""
    kv_heads = read_int(c, "num_key_value_heads", heads)
    if kv_heads != heads:
        raise HFConfigError(f"`num_key_value_heads` = {kv_heads} with {heads} heads in a deepseek_v3 config.json "
                            "cannot be mapped: multi-head latent attention up-projects a key and a value for "
                            "every head", help="set `num_key_value_heads` to `num_attention_heads` (or remove it)")
    if read_bool(c, "attention_bias"):
        raise HFConfigError("`attention_bias` = true in a deepseek_v3 config.json cannot be mapped: it puts biases "
                            "on q_a_proj, kv_a_proj_with_mqa and o_proj only",
                            help="parcompile models biases on the QKV projections only (`qkv_bias = true`) or "
                                 "on every linear layer (`bias = true`)")
    for key, value in DEEPSEEK_ROUTER.items():
        got = read_str(c, key, value)
        if got != value:
            raise HFConfigError(f"`{key}` = {json.dumps(got)} in a deepseek_v3 config.json: transformers' "
                                f"DeepseekV3 router always runs `{key}` = \"{value}\"",
                                help=f"remove `{key}` from a copy of the config.json to import the model as "
                                     "transformers runs it")
    return kv_heads


def _moe_keys(c: dict, cfg: dict, experts: int, dense: int | None) -> dict[str, Any]:
    """The mixture-of-experts `model` keys of :func:`_keys` (``c``: the config.json with
    defaults applied, ``cfg`` as written: ``aux_loss_alpha`` has no default)."""
    return {
        "experts": experts,
        "top_k": read_int(c, "num_experts_per_tok"),
        "expert_ffn_hidden": read_int(c, "moe_intermediate_size"),
        "shared_experts": read_int(c, "n_shared_experts"),
        "dense_layers": dense,
        "norm_topk_prob": read_bool(c, "norm_topk_prob"),
        "router_aux_loss": read_float(cfg, "aux_loss_alpha", 0.0) or 0.0,
        **DEEPSEEK_ROUTER,
        "n_group": read_int(c, "n_group"),
        "topk_group": read_int(c, "topk_group"),
        "routed_scaling_factor": read_float(c, "routed_scaling_factor"),
    }


def _config(m: ModelKeys, common: dict) -> dict:
    """hf_config's DeepseekV3Config fields: ``head_dim`` is transformers' RoPE width
    (``qk_rope_head_dim``), ``q_lora_rank`` null for 0, no multi-token-prediction layers
    (``num_nextn_predict_layers`` 0); a model without experts has every layer dense
    (``first_k_dense_replace`` = layers), which imports back as ``experts = 0``;
    ``router_aux_loss`` as DeepSeek's ``aux_loss_alpha`` (transformers keeps it unused)."""
    moe = m.experts > 0
    cfg = llama_config(m, common)
    cfg.update(
        head_dim=m.qk_rope_head_dim, q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
        rope_interleave=bool(m.rope_interleave), attention_bias=False,
        n_routed_experts=m.experts, num_experts_per_tok=m.top_k if moe else 0,
        moe_intermediate_size=m.expert_ffn_hidden, n_shared_experts=m.shared_experts,
        first_k_dense_replace=m.dense_layers if moe else m.layers, norm_topk_prob=bool(m.norm_topk_prob),
        routed_scaling_factor=float(router(m, "routed_scaling_factor")), n_group=router(m, "n_group"),
        topk_group=router(m, "topk_group"), num_nextn_predict_layers=0, output_router_logits=False,
        aux_loss_alpha=float(m.router_aux_loss) if moe else 0.0)
    return cfg


#: our MLA names (after ``layers.{i}.attn.``) -> DeepseekV3Attention's (after ``self_attn.``)
_MLA_NAMES = {"wq_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "wq_b": "q_b_proj", "wq": "q_proj",
              "wkv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}


def _sources(m: ModelKeys, name: str, shape: tuple[int, ...]) -> list[Source]:
    """DeepseekV3ForCausalLM's names (module docstring): MLA one to one, the router and its
    bias buffer, shared experts; routed experts as Qwen3-MoE's (saved per expert first, the
    fused 3-D layout second)."""
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "layers":
        base = f"model.layers.{parts[1]}."
        if parts[2] == "attn" and len(parts) == 5 and parts[3] in _MLA_NAMES:
            return [Source(f"{base}self_attn.{_MLA_NAMES[parts[3]]}.{parts[4]}", shape)]
        if parts[2:4] == ["mlp", "router"] and len(parts) == 5:
            return [Source(f"{base}mlp.gate.{parts[4]}", shape)]
        if parts[2:4] == ["mlp", "shared"] and len(parts) == 6 and parts[4] in GATED_MLP:
            return [Source(f"{base}mlp.shared_experts.{GATED_MLP[parts[4]]}.{parts[5]}", shape)]
    return qwen3_moe_sources(m, name, shape)


def _problems(m: ModelKeys) -> list[str]:
    """Why transformers' DeepseekV3ForCausalLM cannot run ``m`` (family_problems' part)."""
    out: list[str] = []
    if m.kv_lora_rank <= 0:
        out.append("kv_lora_rank = 0 (it has multi-head latent attention)")
    want = {"norm": "rmsnorm", "activation": "swiglu", "position": "rope", "bias": False, "qkv_bias": False,
            "parallel_residual": False, "sliding_window": 0, "rotary_fraction": 1.0}   # qk_norm: family_problems
    out += [f"{k} = {getattr(m, k)} (DeepSeek-V3 has {v})" for k, v in want.items() if getattr(m, k) != v]
    if m.kv_heads != m.heads:
        out.append(f"kv_heads = {m.kv_heads} != heads (multi-head latent attention has a key and value per head)")
    if m.kv_lora_rank > 0 and m.head_dim != m.qk_nope_head_dim + m.qk_rope_head_dim:
        out.append(f"head_dim = {m.head_dim} != qk_nope_head_dim + qk_rope_head_dim")
    if m.kv_lora_rank > 0 and (m.v_head_dim <= 0 or m.qk_rope_head_dim <= 0):
        out.append("v_head_dim or qk_rope_head_dim 0")
    if m.experts:
        out += [f"{k} = {router(m, k)} (transformers' DeepSeek-V3 router has {v})"
                for k, v in DEEPSEEK_ROUTER.items() if router(m, k) != v]
        if m.dense_layers >= m.layers:
            out.append(f"dense_layers = {m.dense_layers} with experts (no mixture-of-experts layer)")
    return out


FAMILIES = (Family("deepseek_v3", "DeepseekV3ForCausalLM", keys=_keys, config=_config, sources=_sources,
                   problems=_problems, matches=lambda m: m.kv_lora_rank > 0, rank=10,
                   features=frozenset({"mla", "rope_pairs", "router"}), title="DeepSeek-V3"),)

PRESETS: dict[str, dict[str, Any]] = {
    # deepseek-ai/DeepSeek-V3 config.json (deepseek_v3): multi-head latent attention (q_lora
    # 1536, kv_lora 512, nope 128 + rope 64 per q/k head, v 128; interleaved RoPE, YaRN factor
    # 40 over 4,096 positions with mscale 1, mscale_all_dim 1), 256 routed experts of width
    # 2048 top-8 by sigmoid scores with a correction bias within 4 of 8 groups (noaux_tc),
    # weights normalised and times 2.5, one shared expert, the first 3 layers dense (18,432);
    # vocab 129,280, untied. seq_len 4,096 is the pre-training context (DeepSeek-V3 report,
    # section 4.2; max_position_embeddings 163,840 after the long-context extension). The
    # multi-token-prediction module (num_nextn_predict_layers = 1) is left out:
    # 671,026,404,352 parameters (transformers counts the same), 37,552,282,624 active per token
    "deepseek-v3": llama_style(
        layers=61, hidden=7168, ffn_hidden=18432, heads=128, kv_heads=128, vocab=129280, seq_len=4096,
        max_positions=163840, norm_eps=1e-6, rope_theta=10000.0, rope_type="yarn", rope_scaling_factor=40.0,
        rope_original_max_positions=4096, rope_beta_fast=32.0, rope_beta_slow=1.0, rope_mscale=1.0,
        rope_mscale_all_dim=1.0, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, rope_interleave=True, experts=256, top_k=8, expert_ffn_hidden=2048, shared_experts=1,
        dense_layers=3, scoring_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, router_aux_loss=0.001,
    ),
}
