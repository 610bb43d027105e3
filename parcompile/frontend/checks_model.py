"""The model's shape checks of a spec (SPEC 1 `model`, `parallel.tp`): heads and kv heads
against tp (:func:`check_heads`), the widths tp and expert_tp split (:func:`check_widths`),
the attention kinds' keys (:func:`check_attention_kinds`), multi-head latent attention's
(:func:`check_mla`) and Llama 4's layer keys (:func:`check_llama4`). Run by :func:`parcompile.frontend.checks.check_config` (its
:data:`~parcompile.frontend.checks.CHECKS`).
"""

from __future__ import annotations

import math

from parcompile.config.schema import SpecConfig
from parcompile.config.text import and_list, divisors
from parcompile.core.model import LLAMA4_KEYS, moe_layer, rope_layer
from parcompile.frontend.check_context import CheckContext, may_be


def _tp_choices(cfg: SpecConfig, limits: list[tuple[str, int]]) -> list[int]:
    """The tp degrees that divide every width in ``limits`` (and, when serving, the kv-head
    multiples vLLM-style replication allows)."""
    m = cfg.model
    serve_kv = cfg.workload == "serve" and any(k == "kv_heads" for k, _ in limits)
    common = math.gcd(*(v for k, v in limits if not (serve_kv and k == "kv_heads")))
    if not serve_kv:
        return divisors(common)
    kv = m.kv_heads
    return [t for t in divisors(common) if kv % t == 0 or t % kv == 0]


def check_heads(cfg: SpecConfig, ctx: CheckContext) -> None:
    """heads, kv_heads, hidden; and tp against every width it splits (heads, kv heads, MLP).

    One wrong tp gives one error: the first width it fails names the message, a note
    names the others, and the help lists the tp that divide them all.
    """
    m, p = cfg.model, cfg.parallel
    tp_span = ctx.span("parallel.tp")
    kv_ok = ctx.ok("model.heads", "model.kv_heads")
    if kv_ok and m.heads % m.kv_heads:
        kv_ok = False
        ctx.bag.error(f"kv_heads = {m.kv_heads} does not divide heads = {m.heads}", ctx.span("model.kv_heads"),
                      help=f"kv_heads may be {may_be(divisors(m.heads))}")
    if ctx.ok("model.heads", "model.hidden") and not _explicit_head_dim(ctx) and not m.kv_lora_rank \
            and m.hidden % m.heads:   # (MLA's head_dim is qk_nope + qk_rope, not hidden / heads)
        ctx.bag.error(f"heads = {m.heads} does not divide hidden = {m.hidden}", ctx.span("model.heads"),
                      help=f"give `head_dim` explicitly, or use heads = {may_be(divisors(m.hidden))}")
    if not ctx.ok("parallel.tp"):
        return
    tp = p.tp
    limits: list[tuple[str, int]] = []
    if ctx.ok("model.heads"):
        limits.append(("heads", m.heads))
    if kv_ok and m.kv_heads != m.heads:
        limits.append(("kv_heads", m.kv_heads))
    if ctx.ok("model.ffn_hidden"):
        limits.append(("ffn_hidden", m.ffn_hidden))
    if not limits:
        return
    kv = m.kv_heads
    serve = cfg.workload == "serve"
    failed = []
    for key, value in limits:
        if key == "kv_heads" and serve:
            if value % tp and tp % value:
                failed.append((key, value))
        elif value % tp:
            failed.append((key, value))
    if not failed:
        return
    choices = _tp_choices(cfg, limits)
    widths = and_list(f"{k} = {v}" for k, v in limits)
    key, value = failed[0]
    others = [f"{k} = {v}" for k, v in failed[1:]]
    also = f"tp = {tp} does not divide {and_list(others)} either" if others else None
    if key == "kv_heads" and serve:
        message = f"tp = {tp} neither divides nor is a multiple of kv_heads = {kv}"
        rest = and_list(f"{k} = {v}" for k, v in limits if k != "kv_heads")
        help = f"tp may be {may_be(choices)} (dividing {rest}, and dividing or a multiple of kv_heads = {kv})"
        note = also
    elif key == "kv_heads":
        message = f"tp = {tp} does not divide kv_heads = {kv}"
        help = f"for training, tp may be {may_be(choices)}"
        help += f" (to divide {widths})" if len(limits) > 1 else ""
        serve_note = "serving may also use a multiple of kv_heads (kv heads replicated)"
        note = f"{also}; {serve_note}" if also else serve_note
    else:
        message = f"tp = {tp} does not divide {key} = {value}"
        help = f"tp may be {may_be(choices)}" + (f" (to divide {widths})" if len(limits) > 1 else "")
        note = also
    ctx.bag.error(message, tp_span, help=help, note=note)


def _explicit_head_dim(ctx: CheckContext) -> bool:
    return "model.head_dim" in ctx.provided or "model.head_dim" in ctx.bad


def check_widths(cfg: SpecConfig, ctx: CheckContext) -> None:
    """The widths a split or a kernel needs: expert_tp dividing ``expert_ffn_hidden``, an
    even number of RoPE dims per head, and qk-norm over RMSNorm."""
    m, p = cfg.model, cfg.parallel
    if m.experts > 0 and ctx.ok("model.expert_ffn_hidden", "parallel.expert_tp", "parallel.tp") \
            and m.expert_ffn_hidden % p.expert_tp:
        ctx.bag.error(f"expert_tp = {p.expert_tp} does not divide expert_ffn_hidden = {m.expert_ffn_hidden}",
                      ctx.span("parallel.expert_tp", "parallel.tp"),
                      help=f"expert_tp may be {may_be(divisors(m.expert_ffn_hidden))}")
    head_dim_ok = _explicit_head_dim(ctx) or m.hidden % m.heads == 0
    if m.position == "rope" and head_dim_ok and not m.kv_lora_rank and ctx.ok(
            "model.rotary_fraction", "model.head_dim", "model.hidden", "model.heads"):
        rotary = m.head_dim * m.rotary_fraction
        if rotary != int(rotary) or int(rotary) % 2:
            ctx.bag.error(f"RoPE needs an even number of dims per head: head_dim({m.head_dim}) * "
                          f"rotary_fraction({m.rotary_fraction:g}) = {rotary:g}",
                          ctx.span("model.rotary_fraction", "model.head_dim", "model.heads"),
                          help="make head_dim * rotary_fraction an even whole number (another `heads`, "
                               "`head_dim` or `rotary_fraction`), or use `position = learned` or `none`")


    if m.qk_norm and m.norm != "rmsnorm" and ctx.ok("model.qk_norm", "model.norm"):
        # transformers' qk-norm families (Qwen3, Gemma 3, OLMo 2) all use RMSNorm there
        ctx.bag.error(f"qk_norm is an RMSNorm over head_dim; norm = {m.norm}",
                      ctx.span("model.qk_norm", "model.norm"),
                      help="set norm = rmsnorm (Qwen3, Gemma 3 and OLMo 2 use RMSNorm), or qk_norm = false")


def check_attention_kinds(cfg: SpecConfig, ctx: CheckContext) -> None:
    """Local and global layers (Gemma 2/3, gpt-oss) and Gemma's norm: the window and its
    pattern, the local RoPE base, the zero-centred RMSNorm."""
    m = cfg.model
    if m.sliding_window_pattern == 1 and ctx.ok("model.sliding_window_pattern"):
        ctx.bag.error("sliding_window_pattern = 1 makes every layer a full-attention layer",
                      ctx.span("model.sliding_window_pattern"),
                      help="use 0 (every layer takes sliding_window) or N >= 2 (every Nth layer full: Gemma 3 "
                           "uses 6, gpt-oss 2), or set sliding_window = 0")
    elif m.sliding_window_pattern >= 2 and not m.sliding_window and ctx.given("model.sliding_window_pattern") \
            and ctx.ok("model.sliding_window_pattern", "model.sliding_window"):   # a preset's: moot
        ctx.bag.error(f"sliding_window_pattern = {m.sliding_window_pattern} needs a window: sliding_window = 0",
                      ctx.span("model.sliding_window_pattern", "model.sliding_window"),
                      help="set sliding_window to the local layers' window in tokens (Gemma 3: 1024, "
                           "gpt-oss: 128), or remove sliding_window_pattern")
    if m.sliding_window > m.seq_len and ctx.ok("model.sliding_window", "model.seq_len"):
        ctx.bag.warning(f"sliding_window = {m.sliding_window} is larger than seq_len = {m.seq_len}: "
                        "no sequence is long enough for the window to matter",
                        ctx.span("model.sliding_window", "model.seq_len"),
                        help=f"lower sliding_window to at most {m.seq_len}, or 0 for full attention")
    # (only where the spec writes it: a preset's local base on a model made all-global is moot)
    if m.rope_local_base_freq is not None and ctx.given("model.rope_local_base_freq") \
            and ctx.ok("model.rope_local_base_freq", "model.sliding_window", "model.position"):
        if m.position != "rope":
            ctx.bag.error(f"rope_local_base_freq is a RoPE base; position = {m.position}",
                          ctx.span("model.rope_local_base_freq", "model.position"),
                          help="set position = rope, or remove rope_local_base_freq")
        elif not any(m.layer_windows):
            ctx.bag.error("rope_local_base_freq is the RoPE base of the sliding-window layers; this model has "
                          "none (sliding_window = 0)",
                          ctx.span("model.rope_local_base_freq", "model.sliding_window"),
                          help="set sliding_window (and sliding_window_pattern), or remove rope_local_base_freq")
    if m.rope_type in ("yarn", "llama3") and m.rope_original_max_positions is None \
            and ctx.ok("model.rope_type", "model.rope_original_max_positions"):
        ctx.bag.error(f"rope_type = {m.rope_type} needs rope_original_max_positions, the context the model was "
                      "pretrained with", ctx.span("model.rope_type"),
                      help="set rope_original_max_positions (Hugging Face `original_max_position_embeddings`: "
                           "gpt-oss 4096, Llama 3.1 8192)")
    if m.rope_type == "default" and m.rope_scaling_factor != 1.0 and ctx.given("model.rope_scaling_factor") \
            and ctx.ok("model.rope_scaling_factor", "model.rope_type"):
        ctx.bag.warning(f"rope_scaling_factor = {m.rope_scaling_factor:g} has no effect with rope_type = default",
                        ctx.span("model.rope_scaling_factor"),
                        help="set rope_type = linear, yarn or llama3, or remove rope_scaling_factor")
    clamp = m.swiglu_alpha is not None or m.swiglu_limit is not None
    if clamp and ctx.ok("model.swiglu_alpha", "model.swiglu_limit", "model.activation", "model.experts",
                        "model.dense_layers", "model.shared_experts"):
        key = "model.swiglu_limit" if m.swiglu_limit is not None else "model.swiglu_alpha"
        if m.swiglu_alpha is None or m.swiglu_limit is None:
            ctx.bag.error("gpt-oss's clamped SwiGLU needs both swiglu_alpha and swiglu_limit", ctx.span(key),
                          help="set swiglu_alpha = 1.702 and swiglu_limit = 7.0 (gpt-oss), or neither")
        elif m.activation != "swiglu" or m.experts == 0 or m.dense_layers or m.shared_experts:
            ctx.bag.error("swiglu_alpha and swiglu_limit clamp the routed experts' SwiGLU (gpt-oss); this model "
                          "has " + ("no experts" if m.experts == 0 else f"activation = {m.activation}"
                                    if m.activation != "swiglu" else "dense layers or shared experts"),
                          ctx.span(key, "model.activation", "model.experts"),
                          help="use them with activation = swiglu on a model whose every layer is a MoE layer "
                               "without shared experts, or remove them")
    if m.zero_centered_gamma and m.norm != "rmsnorm" and ctx.ok("model.zero_centered_gamma", "model.norm"):
        ctx.bag.error(f"zero_centered_gamma is Gemma's RMSNorm, (1 + weight); norm = {m.norm}",
                      ctx.span("model.zero_centered_gamma", "model.norm"),
                      help="set norm = rmsnorm, or zero_centered_gamma = false")


#: the model keys that describe multi-head latent attention (with kv_lora_rank; rope_interleave
#: also Llama 4's ordinary attention, its complex RoPE pairs)
_MLA_KEYS = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def check_mla(cfg: SpecConfig, ctx: CheckContext) -> None:
    """Multi-head latent attention (DeepSeek-V2/V3, ``kv_lora_rank > 0``): its widths, what
    it replaces (kv heads, head_dim, rotary_fraction) and what it is not built with."""
    m, p = cfg.model, cfg.parallel
    if not m.kv_lora_rank:
        if m.rope_interleave and m.rotary_fraction != 1.0 and ctx.ok("model.rope_interleave", "model.rotary_fraction"):
            ctx.bag.error("rope_interleave with a partial rotary_fraction is not built", ctx.span("model.rope_interleave"),
                          help="rotate the whole head (rotary_fraction = 1, as Llama 4) or remove rope_interleave")
        for key in _MLA_KEYS:
            if ctx.given(f"model.{key}") and ctx.ok(f"model.{key}", "model.kv_lora_rank"):
                ctx.bag.error(f"{key} describes multi-head latent attention, which this model does not use "
                              "(kv_lora_rank = 0)", ctx.span(f"model.{key}"),
                              help="set kv_lora_rank (DeepSeek-V3: 512) with qk_nope_head_dim, qk_rope_head_dim "
                                   f"and v_head_dim, or remove {key}")
                return
        return
    keys = tuple(f"model.{k}" for k in ("kv_lora_rank", "rope_interleave") + _MLA_KEYS)
    if not ctx.ok(*keys):
        return
    for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(m, key) <= 0:
            ctx.bag.error(f"multi-head latent attention needs {key} > 0", ctx.span(f"model.{key}", "model.kv_lora_rank"),
                          help="DeepSeek-V3 has qk_nope_head_dim = 128, qk_rope_head_dim = 64, v_head_dim = 128")
            return
    if m.qk_rope_head_dim % 2:
        ctx.bag.error(f"RoPE needs an even number of dims per head: qk_rope_head_dim = {m.qk_rope_head_dim}",
                      ctx.span("model.qk_rope_head_dim"), help=f"use {m.qk_rope_head_dim + 1}")
    if m.position != "rope" and ctx.ok("model.position"):
        ctx.bag.error(f"multi-head latent attention rotates its shared key with RoPE; position = {m.position}",
                      ctx.span("model.position", "model.kv_lora_rank"), help="set position = rope")
    if m.kv_heads != m.heads and ctx.ok("model.kv_heads", "model.heads"):
        ctx.bag.error(f"multi-head latent attention has one key and value per query head: kv_heads = {m.kv_heads} "
                      f"!= heads = {m.heads}", ctx.span("model.kv_heads"),
                      help=f"remove kv_heads (it defaults to heads), or set kv_heads = {m.heads}")
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.head_dim != qk and ctx.ok("model.head_dim"):
        ctx.bag.error(f"with multi-head latent attention a query/key head is qk_nope_head_dim + qk_rope_head_dim = "
                      f"{qk} wide; head_dim = {m.head_dim}", ctx.span("model.head_dim"),
                      help=f"remove head_dim, or set head_dim = {qk}")
    for key, what in (("qk_norm", "qk-norm"), ("attention_sinks", "attention sinks"),
                      ("sliding_window", "a sliding window"), ("rotary_fraction", "rotary_fraction")):
        value = getattr(m, key)
        if (value != 1.0 if key == "rotary_fraction" else bool(value)) and ctx.ok(f"model.{key}"):
            ctx.bag.error(f"{what} with multi-head latent attention is not built "
                          + ("(its RoPE dims are qk_rope_head_dim)" if key == "rotary_fraction" else
                             "(no DeepSeek model has it)"),
                          ctx.span(f"model.{key}", "model.kv_lora_rank"), help=f"remove {key}")
    if p.cp > 1 and ctx.ok("parallel.cp"):
        ctx.bag.error(f"context parallelism (cp = {p.cp}) with multi-head latent attention is not built",
                      ctx.span("parallel.cp"), note=f"the model uses MLA (kv_lora_rank = {m.kv_lora_rank})",
                      help="use cp = 1 (split the sequence with sequence_parallel = true inside tp instead)")


#: Llama 4's attention keys, which act on its RoPE layers (chunk, L2 norm) and NoPE layers
#: (temperature): core/model.py ``rope_layer``
_ROPE_LAYER_KEYS = ("nope_layer_interval", "attention_chunk_size", "qk_l2_norm", "attn_temperature_tuning")


def check_llama4(cfg: SpecConfig, ctx: CheckContext) -> None:
    """Llama 4's layer keys written where the rest of the model gives them nothing to act on:
    an error without RoPE (its NoPE and RoPE layers are ``position = rope`` ones), warnings for
    a chunk no sequence fills, a temperature without NoPE layers, MoE keys without a MoE layer."""
    m = cfg.model
    written = [k for k in _ROPE_LAYER_KEYS if ctx.given(f"model.{k}") and ctx.ok(f"model.{k}")
               and getattr(m, k) != LLAMA4_KEYS[k]]
    if written and m.position != "rope" and ctx.ok("model.position"):
        ctx.bag.error(f"{written[0]} describes Llama 4's RoPE and NoPE layers; position = {m.position}",
                      ctx.span(f"model.{written[0]}", "model.position"),
                      help=f"set position = rope, or remove {and_list(written)}")
        return
    no_effect = []
    if "attention_chunk_size" in written and ctx.ok("model.seq_len") and m.attention_chunk_size >= m.seq_len:
        no_effect.append(("attention_chunk_size", f"no sequence is longer than a chunk (seq_len = {m.seq_len})",
                          f"a chunk below {m.seq_len} tokens, or 0 for none"))
    nope = [i for i in range(m.layers) if not rope_layer(m, i)]
    if m.attn_temperature_tuning and "attn_temperature_tuning" in written and not nope:
        no_effect.append(("attn_temperature_tuning", "it scales the queries of the NoPE layers and there is none",
                          f"set nope_layer_interval (Llama 4: 4) to at most layers = {m.layers}"))
    moe_keys = [k for k in ("interleave_moe_layer_step", "moe_apply_probs_on_input") if ctx.given(f"model.{k}")]
    if moe_keys and ctx.ok("model.experts", "model.dense_layers", *(f"model.{k}" for k in moe_keys)) \
            and not any(moe_layer(m, i) for i in range(m.layers)):
        no_effect += [(k, "no layer is a MoE layer", "set experts, and interleave_moe_layer_step to at most "
                       f"layers - dense_layers = {m.layers - m.dense_layers}") for k in moe_keys]
    for key, why, fix in no_effect:
        ctx.bag.warning(f"{key} has no effect: {why}", ctx.span(f"model.{key}"), help=f"{fix}, or remove {key}")
