"""The generated program's model outside its decoder layers, written from the sharded graph
(issue 31): the constants, the ``Norm`` of the residual stream, the model classes in
order, and the pipeline ``Stage``'s ``__init__``, ``embed``, ``head`` and ``head_weight``.

The Stage is a walk over the ops outside the layers in graph order (the first model
chunk's: the embedding, a learned position embedding and their sum; the last chunk's: the
final norm, the conversion into the head, the LM head and every op after it before the
loss, Gemma 2's soft-cap), each written by its op-table :class:`~parcompile.ir.ops.Code`
row (:func:`parcompile.codegen.blocks.methods`, the same writer as the layers'). What the
layers' attention needs from the Stage (the positions of this rank's tokens, the k/v
positions of a context-parallel gather, the RoPE tables per base) is read off the
attention ops. The templates keep the skeleton and format what is written here; they
decide nothing about the model.
"""

from __future__ import annotations

import re
from typing import Sequence

from parcompile.codegen.blocks import COMMENT_COLUMN, DIM_CONSTANTS, Methods, methods, wrap_statement
from parcompile.codegen.program_data import LayerAttributeError, OpData, ProgramData
from parcompile.ir.ops import Trait, has_trait

#: the ops outside the layers that the Stage does not walk: the loss (``Stage.loss``) and
#: the stage boundaries (the schedule's send/recv)
NOT_WALKED = ("cross_entropy", "send_recv")
#: the Stage's ``__init__`` lines sit 12 columns in: a constructor longer than this wraps
STAGE_WRAP = 104
#: the per-layer attributes (``OpSpec.per_layer``) that reach the layers through the Stage, not
#: through a table their classes read: each RoPE op's base and scaling, one table of cos and
#: sin per distinct pair (``ROPE_BASES``), each layer's an index into them (``LAYER_ROPE``)
POSITION_ATTRS = {"rope": ("theta", "scaling"), "latent_rope": ("theta", "scaling")}


def outer_ops(pd: ProgramData) -> tuple[tuple[OpData, ...], tuple[OpData, ...]]:
    """The ops outside the decoder layers in graph order: those before the layers (the
    model's first chunk: embedding) and those after them (its last: final norm, head and
    what follows the head), the loss and stage boundaries left out."""
    before, after, late = [], [], set()
    for o in pd.ops.values():
        if o.name.startswith("layers.") or o.kind in NOT_WALKED:
            continue
        if any(u.startswith("layers.") or u in late for u in o.inputs):
            late.add(o.name)
            after.append(o)
        else:
            before.append(o)
    return tuple(before), tuple(after)


def _indent(lines: Sequence[str], n: int) -> str:
    return "\n".join((" " * n + ln) if ln else "" for s in lines for ln in s.split("\n"))


def _method_text(m: Methods, n: int = 4) -> str:
    """A generated method (signature and body) indented for the Stage's class body."""
    return _indent([m.forward_signature], n) + "\n" + _indent(m.forward, n + 4)


def _init_lines(m: Methods) -> list[str]:
    """The walk's ``__init__`` statements, each wrapped for the Stage's deeper indentation;
    a walk's ``self.tp = tp`` dropped (the Stage holds its own ``self.tp``, ctx.tp)."""
    out = []
    for stmt in m.init:
        if stmt.startswith("self.tp = "):
            continue
        if not stmt.startswith("if "):
            stmt = "\n".join(wrap_statement(re.sub(r"\n\s+", " ", stmt), STAGE_WRAP))
        out.append(stmt)
    return out


def _rope(pd: ProgramData) -> bool:
    return any(has_trait(o.kind, Trait.ROTARY) for layer in pd.layers for o in layer.ops)


def head_weight(last: Sequence[OpData]) -> str:
    """``head_weight``'s return statement: the LM head's own weight, or (tied) the
    embedding's where this rank holds the embedding, else the head's copy of it."""
    head = next(o for o in last if o.kind == "linear" and o.dims[-1] == "vocab")
    tied = (head.param_tied[0] or "").removesuffix(".weight") if head.param_tied else ""
    attr = head.name
    return f"return self.{tied}.weight if self.has_first else self.{attr}.weight" if tied else \
        f"return self.{attr}.weight"


def stage_code(pd: ProgramData, serve: bool = False) -> dict:
    """The Stage's model code from the walk over :func:`outer_ops`: ``first_init`` and
    ``last_init`` (``__init__`` lines under ``if self.has_first`` / ``has_last``), the
    ``embed`` and ``head`` methods, ``head_weight``'s body, ``embed_call`` (the first
    chunk's call; serving passes the step: learned positions read its positions),
    ``logits_shape`` (the head's per-rank output)."""
    first, last = outer_ops(pd)
    kw = dict(serve=serve, constants=DIM_CONSTANTS)
    emb = methods(first, -1, "", pd.ops, method="embed", pos_type="gen.StepInput", **kw)
    emb = Methods(emb.init, f"{emb.forward_signature:<{COMMENT_COLUMN + 3}} # x: token ids (B, T)", emb.forward)
    head = methods(last, -1, "", pd.ops, method="head", **kw)
    logits = last[-1]
    return {
        "first_init": _indent(_init_lines(emb), 12),
        "last_init": _indent(_init_lines(head), 12),
        "embed_method": _method_text(emb),
        "head_method": _method_text(head),
        "head_weight": head_weight(last),
        "embed_call": "self.embed(x, step)" if "pos:" in emb.forward_signature else "self.embed(x)",
        "logits_shape": logits.shape_comment(),
    }


def train_positions(pd: ProgramData, rope_bases: str | None) -> dict:
    """What the training Stage gives the layers' attention, from its ops: the positions of
    this rank's tokens (the cp chunks it holds), the k/v positions where the core gathers
    k and v over cp, and the RoPE tables at those positions (one per base where layers
    differ: ``rope_bases`` the program's ``ROPE_BASES``). ``positions_init``: ``__init__``
    lines; ``positions``: forward's ``pos = ...``; ``layer_call``: a layer's call (full
    recomputation where the pass marked the layers' ops)."""
    layer = pd.dense_layer or pd.moe_layer
    gathered = any(c.axis == "cp" for c in layer.op("attn.core").collectives)
    init = ["# positions of this rank's tokens in the sequence (the cp chunks it holds)",
            'self.register_buffer("positions", rt.chunk_positions(SEQ_LEN, cp.index, cp.size), persistent=False)']
    if gathered:
        init.append('self.register_buffer("kv_positions", rt.gathered_positions(SEQ_LEN, cp.size), persistent=False)')
    qk = f"q={'self.positions' if gathered else 'None'}, k={'self.kv_positions' if gathered else 'None'}"
    arg = "pos"
    if _rope(pd) and rope_bases:
        init += ["for j, (theta, scaling) in enumerate(ROPE_BASES):       # one table per RoPE base",
                 "    cos, sin = rt.rope_tables(SEQ_LEN, ROPE_DIM, theta, scaling=scaling)",
                 '    self.register_buffer(f"rope_cos_{j}", cos[self.positions], persistent=False)',
                 '    self.register_buffer(f"rope_sin_{j}", sin[self.positions], persistent=False)']
        pos = ['pos = [rt.Positions(rope=(getattr(self, f"rope_cos_{j}"), getattr(self, f"rope_sin_{j}")),',
               f"                    {qk})",
               "       for j in range(len(ROPE_BASES))]                # per RoPE base; layer i takes pos[LAYER_ROPE[i]]"]
        arg = "pos[LAYER_ROPE[i]]"
    elif _rope(pd):
        init += ["cos, sin = rt.rope_tables(SEQ_LEN, ROPE_DIM, ROPE_THETA)",
                 'self.register_buffer("rope_cos", cos[self.positions], persistent=False)',
                 'self.register_buffer("rope_sin", sin[self.positions], persistent=False)']
        pos = ["pos = rt.Positions(rope=(self.rope_cos, self.rope_sin),", f"                   {qk})"]
    else:
        pos = ["pos = rt.Positions(rope=None,", f"                   {qk})"]
    recomputed = any(o.attr("recompute", None) == "full" for o in layer.ops)
    call = (f"rt.recompute(self.layers[str(i)], x, {arg})   # full recomputation: keep the layer's input only"
            if recomputed else f"self.layers[str(i)](x, {arg})")
    return {"positions_init": _indent(init, 8), "positions": _indent(pos, 8), "layer_call": call}


def serve_positions(pd: ProgramData, rope_bases: str | None, rope_dim: int) -> dict:
    """The serving Stage's RoPE tables (fp32, every position up to SEQ_LEN; one per base
    where layers differ) and, per step, their rows at each sequence's positions; ``None``
    without RoPE (learned positions)."""
    if _rope(pd) and rope_bases:
        init = "self.rope = [rt.rope_tables(SEQ_LEN, ROPE_DIM, theta, scaling=scaling) for theta, scaling in ROPE_BASES]  # fp32 cos, sin"
        step = [f"ropes = [gen.rope_at(t, step.positions, x.device) for t in self.rope]   # per RoPE base: cos, sin (B, T, {rope_dim})"]
        arg = "ropes[LAYER_ROPE[i]]"
    else:
        init = (f"self.rope = rt.rope_tables(SEQ_LEN, ROPE_DIM, ROPE_THETA)     # fp32 cos, sin: (SEQ_LEN, {rope_dim})"
                if _rope(pd) else "self.rope = None")
        step = [f"rope = gen.rope_at(self.rope, step.positions, x.device)       # cos, sin (B, T, {rope_dim}) at each "
                "sequence's positions"]
        arg = "rope"
    return {"rope_init": init, "rope_step": _indent(step, 8), "layer_rope": arg}


def rope_bases(pd: ProgramData) -> dict:
    """The RoPE tables the Stage makes for the layers (:data:`POSITION_ATTRS`): where the
    layers' RoPE ops differ in base, or scale it (Gemma 3's local and global layers, Llama
    3.1's scaling), ``rope_thetas`` (the program's ``ROPE_BASES``: each distinct (base,
    scaling)) and ``layer_rope`` (``LAYER_ROPE``: each layer's index into them); None where
    one unscaled table of ``ROPE_THETA`` serves every layer.

    Raises:
        LayerAttributeError: the RoPE ops of one layer differ (the layer takes one table)."""
    bases = []
    for x in sorted(pd.layers, key=lambda x: x.index):
        got = list(dict.fromkeys((o.attr("theta"), o.attr("scaling", None)) for o in x.ops if o.kind in POSITION_ATTRS))
        if len(got) > 1:
            raise LayerAttributeError(f"internal error: the RoPE ops of layer {x.index} differ in base or scaling "
                                      f"({got}); the Stage gives a layer one RoPE table")
        bases += got
    thetas = tuple(dict.fromkeys(bases))
    if len(thetas) <= 1 and all(s is None for _, s in thetas):
        return {"rope_thetas": None, "layer_rope": None}
    return {"rope_thetas": repr(tuple((t, dict(s) if s else None) for t, s in thetas)),
            "layer_rope": repr(tuple(thetas.index(b) for b in bases))}


def layer_table_rows(pd: ProgramData, written: str) -> list[tuple]:
    """The program's per-layer tables (:attr:`ProgramData.layer_tables`) as constant rows:
    each one that ``written`` (the program's classes and what else reads them: the serving
    cache's windows) reads by name; the RoPE ops' bases are the Stage's tables
    (:func:`rope_bases`).

    Raises:
        LayerAttributeError: a declared per-layer attribute that differs between layers and
            that nothing reads per layer (its row decided on it, or never wrote it): every
            layer would run with one layer's value."""
    rows = []
    for table in pd.layer_tables:
        if table.attr in POSITION_ATTRS.get(table.kind, ()):
            continue
        if not re.search(rf"\b{table.name}\b", written):
            raise LayerAttributeError(
                f"internal error: attribute {table.attr!r} of op layers.{{i}}.{table.op} (kind {table.kind!r}) differs "
                f"between layers ({table.literal()}) and no line of the program reads it per layer: its program row "
                "must write it ({a[" + table.attr + "]!r}, ir/ops/)")
        rows.append(table.row())
    return rows


def norm_definition(pd: ProgramData) -> str:
    """The program's ``Norm`` (the residual stream's norms, ``Norm(name, dim, eps, seed,
    tp)``), from the final norm's attributes: RMSNorm or LayerNorm, Gemma's ``(1 + w)``
    form (``zero_centered``)."""
    op = pd.ops["final_norm"]
    cls = "RMSNorm" if op.attr("norm") == "rmsnorm" else "LayerNorm"
    if op.attr("zero_centered", False):
        return (f"\ndef Norm(name: str, dim: int, eps: float, seed: int, tp: rt.Axis) -> rt.{cls}:\n"
                '    """Gemma\'s RMSNorm: (x / rms(x)) * (1 + weight), the weight starting at 0."""\n'
                f"    return rt.{cls}(name, dim, eps, seed, tp, zero_centered=True)")
    return f"Norm = rt.{cls}"


def router_words(m) -> str:
    """How model ``m``'s router scores and picks its top-k, in the programs' words (the
    constants' comments and the MoE docstring): its scores (``scoring_func``), the group limit
    (``topk_method = noaux_tc``) and whether the k weights are renormalised (``norm_topk_prob``,
    which changes nothing for a single softmax choice)."""
    return ("sigmoid" if m.scoring_func == "sigmoid" else "softmax") + (
        f", within {m.topk_group} of {m.n_group} groups" if m.topk_method == "noaux_tc" else "") + (
        ", renormalised over the k" if m.norm_topk_prob and (m.top_k > 1 or m.scoring_func == "sigmoid") else "")


def constant_lines(rows: Sequence[tuple]) -> list[str]:
    """``NAME = value  # comment`` per row (``(NAME, value, comment)``; a row without a
    NAME is a comment line)."""
    out = []
    for name, value, note in rows:
        if name is None:
            out.append(f"# {note}")
        else:
            out.append(f"{name} = {value}" + (f"  # {note}" if note else ""))
    return out


def _attention_rows(m, mla: bool, serve: bool) -> list[tuple]:
    rows = [("HIDDEN", m.hidden, "h"), ("HEADS", m.heads, "query heads")]
    if not mla:
        gqa = f" (GQA: {m.heads // m.kv_heads} query heads per kv head)" if m.kv_heads < m.heads and not serve else ""
        return rows + [("KV_HEADS", m.kv_heads, "key/value heads" + gqa), ("HEAD_DIM", m.head_dim, "")]
    if serve:
        return rows + [("Q_LORA_RANK", m.q_lora_rank, "the query latent (0: one projection)"),
                       ("KV_LORA_RANK", m.kv_lora_rank,
                        "the key-value latent: what the cache keeps per token, with the RoPE key"),
                       ("QK_NOPE_HEAD_DIM", m.qk_nope_head_dim, ""), ("QK_ROPE_HEAD_DIM", m.qk_rope_head_dim, ""),
                       ("V_HEAD_DIM", m.v_head_dim, "")]
    if m.q_lora_rank:
        rows.append(("Q_LORA_RANK", m.q_lora_rank, "the query latent (wq_a h -> Q_LORA_RANK, wq_b -> heads x head dims)"))
    return rows + [("KV_LORA_RANK", m.kv_lora_rank, "the key-value latent per token"),
                   ("QK_NOPE_HEAD_DIM", m.qk_nope_head_dim, "per head: query/key dims without RoPE"),
                   ("QK_ROPE_HEAD_DIM", m.qk_rope_head_dim,
                    "per head: query/key dims with RoPE (the key's shared by every head)"),
                   ("V_HEAD_DIM", m.v_head_dim, "")]


def _position_rows(m, pd: ProgramData, kinds: dict, rope_dim: int, serve: bool) -> list[tuple]:
    """The positions' constants: a learned table's rows, the RoPE bases and dims (where the
    graph has RoPE ops), the serving cache's attention window where every layer has one,
    then the per-layer tables (``kinds["layer_tables"]``: :func:`layer_table_rows`)."""
    rows = []
    if any(has_trait(o.kind, Trait.EMBEDDING) and o.attr("positional", False) for o in pd.ops.values()):
        rows.append(("MAX_POSITIONS", m.max_positions, "" if serve else "rows of the learned position table (>= SEQ_LEN)"))
    if _rope(pd):
        if kinds["rope_thetas"]:
            rows += [("ROPE_BASES", kinds["rope_thetas"], "(RoPE base, its scaling) of the layers' tables"),
                     ("LAYER_ROPE", kinds["layer_rope"], "each layer's RoPE table (an index into ROPE_BASES)")]
        else:   # one table: the base the layers' RoPE ops rotate by
            rope = next(o for layer in pd.layers for o in layer.ops if has_trait(o.kind, Trait.ROTARY))
            rows.append(("ROPE_THETA", rope.attr("theta", m.rope_theta), ""))
        rows.append(("ROPE_DIM", rope_dim, "rotary dims per head" + ("" if serve else
                                                                     f" (rotary_fraction {m.rotary_fraction})")))
    if serve and kinds["window_table"] == "WINDOW":   # the KV cache's (a per-layer table where they differ)
        rows.append(("WINDOW", kinds["window"], "sliding attention window in tokens (0: full causal)"))
    return rows + kinds["layer_tables"]


def train_constants(m, pd: ProgramData, kinds: dict, padded: int, rope_dim: int, dtype: str, out_std: str,
                    aux: dict) -> list[str]:
    """The training program's model constants (global sizes before sharding), each present
    where the graph has the ops that read it (``aux``: ``experts_local``,
    ``expert_ffn_local``, ``aux_loss_scale``, ``seq_ranks``)."""
    layer = pd.dense_layer or pd.moe_layer
    mla = layer.op("attn.wkv_a") is not None
    rows = _attention_rows(m, mla, serve=False)
    if pd.dense_layer is not None and pd.dense_layer.op("mlp.w1") is not None:   # the dense MLP reads it (the
        rows.append(("FFN_HIDDEN", m.ffn_hidden, ""))                            # shared experts: SHARED_FFN)
    rows += [("VOCAB", m.vocab, ""),
             ("PADDED_VOCAB", padded, f"Megatron's rule: a multiple of {m.vocab_multiple} * tp; padded rows stay zero"),
             ("SEQ_LEN", m.seq_len, ""), ("NORM_EPS", m.norm_eps, ""), ("DROPOUT", m.dropout, "")]
    rows += _position_rows(m, pd, kinds, rope_dim, serve=False)
    if kinds.get("layer_fp8"):
        rows.append(("LAYER_FP8", kinds["layer_fp8"], "each layer's FP8 recipe (None: its GEMMs in 16 bits, "
                                                      "fp8_bf16_layers_*)"))
    rows += [("OUT_STD", out_std, "0.02 / sqrt(2 * layers) for output projections (GPT-2, Megatron-LM)"),
             ("ACT_DTYPE", f"torch.{dtype}", "weights, activations, and what crosses a stage boundary")]
    if pd.moe_layer is not None:
        rows += [("EXPERTS", m.experts, f"routed experts per MoE layer: {aux['experts_local']} per ep rank"),
                 ("TOP_K", m.top_k, f"experts per token ({router_words(m)}; dropless)"),
                 ("EXPERT_FFN", m.expert_ffn_hidden,
                  f"inner width of one expert: {aux['expert_ffn_local']} per expert_tp rank")]
        if pd.moe_layer.op("mlp.shared.w1") is not None:
            rows.append(("SHARED_FFN", m.shared_experts * m.expert_ffn_hidden,
                         f"{m.shared_experts} shared (always-on) expert(s), one MLP, tensor parallel over tp"))
        if pd.dense_layer is not None:
            rows.append(("DENSE_LAYERS", m.dense_layers, "leading layers with a dense MLP"))
            if m.interleave_moe_layer_step > 1:
                rows.append(("MOE_LAYER_STEP", m.interleave_moe_layer_step, "after them every Nth layer is MoE"))
        seq = aux["seq_ranks"]
        rows += [(None, None, f"load-balancing loss alpha * E * sum_e f_e P_e (Switch Transformer), alpha = "
                              f"{m.router_aux_loss}; its"),
                 (None, None, "gradient is scaled like the loss: / micro-batches"
                              + (f" / {seq} (the tp ranks splitting a sequence)" if seq > 1 else "")),
                 ("AUX_LOSS_SCALE", aux["aux_loss_scale"], "")]
    return constant_lines(rows)


def serve_constants(m, pd: ProgramData, kinds: dict, padded: int, rope_dim: int, dtype: str, kv_dtype: str,
                    aux: dict) -> list[str]:
    """The serving program's model constants (:func:`train_constants`' rule; ``aux``:
    ``experts_local``, ``expert_ffn_local``)."""
    layer = pd.dense_layer or pd.moe_layer
    rows = _attention_rows(m, layer.op("attn.wkv_a") is not None, serve=True)
    if pd.dense_layer is not None:
        rows.append(("FFN_HIDDEN", m.ffn_hidden, ""))
    if pd.moe_layer is not None:
        rows += [("EXPERTS", m.experts, f"routed experts per MoE layer, {aux['experts_local']} on each ep rank"),
                 ("EXPERTS_PER_TOKEN", m.top_k, f"the router's top-k ({router_words(m)}; dropless)"),
                 ("EXPERT_FFN", m.expert_ffn_hidden, f"inner width of one expert: {aux['expert_ffn_local']} per rank")]
        if m.shared_experts:
            rows.append(("SHARED_FFN", m.shared_experts * m.expert_ffn_hidden,
                         f"{m.shared_experts} shared (always-on) expert(s), one MLP split over tp"))
        if pd.dense_layer is not None:
            rows.append(("DENSE_LAYERS", m.dense_layers, "leading layers with a dense MLP; the rest are MoE layers"))
            if m.interleave_moe_layer_step > 1:
                rows.append(("MOE_LAYER_STEP", m.interleave_moe_layer_step, "after them every Nth layer is MoE"))
    rows += [("VOCAB", m.vocab, ""),
             ("PADDED_VOCAB", padded,
              f"a multiple of {m.vocab_multiple} * tp; padded rows stay zero and are never sampled"),
             ("SEQ_LEN", m.seq_len, "the longest request (prompt + new tokens)"), ("NORM_EPS", m.norm_eps, "")]
    rows += _position_rows(m, pd, kinds, rope_dim, serve=True)
    rows += [("DTYPE", f"torch.{dtype}", "weights and activations"),
             ("KV_DTYPE", f'gen.TORCH_DTYPES["{kv_dtype}"]', "the KV cache")]
    return constant_lines(rows)


__all__ = ["POSITION_ATTRS", "constant_lines", "head_weight", "layer_table_rows", "norm_definition", "outer_ops",
           "rope_bases", "router_words", "serve_constants", "serve_positions", "stage_code", "train_constants",
           "train_positions"]
