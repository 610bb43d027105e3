"""The generated program's model classes in order, each a header, a docstring and a body
(issue 31): the attention, the dense MLP, a MoE layer's shared experts and its MoE
module, and Block. The bodies are written op by op from the sharded graph
(:mod:`parcompile.codegen.blocks`, emit's ``_classes``); which classes exist is a fact of
the graph (the ops the representative layers hold), and their docstrings say what the
layer's ops do on one rank. The templates loop over this list; they decide nothing.
"""

from __future__ import annotations

from parcompile.codegen.program_data import ProgramData
from parcompile.codegen.stage import router_words


def _cls(head: str, doc: str, body: str) -> dict:
    return {"head": head, "doc": doc, "body": body}


def _attention_doc(m, pd: ProgramData, heads_local: int, kv_local: int, mla_grads: str) -> str:
    layer = pd.dense_layer or pd.moe_layer
    if layer.op("attn.wkv_a") is None:
        return (f"Causal self-attention; heads split over tp: {m.heads} query / {m.kv_heads} kv heads ->\n"
                f"    {heads_local} / {kv_local} per rank. wq, wk, wv column-parallel, wo row-parallel.")
    q = m.q_lora_rank
    return (f"Multi-head latent attention (DeepSeek-V2/V3): {m.heads} heads -> {heads_local} per rank.\n"
            f"    {'wq_a (h -> %d), its norm, ' % q if q else ''}wkv_a (h -> {m.kv_lora_rank} + {m.qk_rope_head_dim}) "
            "and kv_a_norm replicated;\n"
            f"    {'wq_b' if q else 'wq'} and wkv_b column-parallel by heads (q: {m.qk_nope_head_dim} + "
            f"{m.qk_rope_head_dim} per head, kv: {m.qk_nope_head_dim} + {m.v_head_dim} per head), wo row-parallel.\n"
            f"    Backward all-reduces over tp: {mla_grads}.")


def _block_doc(m, pd: ProgramData, tables: dict[str, list[str]], serve: bool) -> str:
    """Block's docstring: the residual form, then (training) each layer kind's ops on one
    rank (``tables``: ``dense``/``moe``, one line per op)."""
    if m.parallel_residual:
        doc = ("Decoder layer with parallel residual" + ("" if serve else " (GPT-NeoX)")
               + ": x + attn(norm1(x)) + mlp(norm2(x))")
    else:
        doc = "Decoder layer (pre-norm): x += attn(norm(x)); x += mlp(norm(x))"
    if serve:
        return doc + "."
    doc += ".\n"
    moe = pd.moe_layer is not None
    if tables["dense"]:
        doc += (f"\n    Its ops on one rank (layer {pd.dense_layer.index} of the sharded graph"
                f"{'; every dense layer alike' if moe else '; every layer alike'}):\n")
        doc += "".join(f"        {row}\n" for row in tables["dense"])
    if tables["moe"]:
        doc += f"\n    A MoE layer's ops (layer {pd.moe_layer.index}; every MoE layer alike):\n"
        doc += "".join(f"        {row}\n" for row in tables["moe"])
    return doc + "    "


def _mlp_classes(c: dict) -> list[dict]:
    """The dense MLP's and the shared experts' classes where the graph has them (``c``: emit's
    class bodies and docs), the same in training and serving."""
    out = []
    if c["mlp_class"]:
        out.append(_cls("MLP(nn.Module)", c["mlp_doc"], c["mlp_class"]))
    if c["shared_class"]:
        out.append(_cls("SharedMLP(nn.Module)", "A MoE layer's shared (always-on) experts, one MLP: " + c["shared_doc"],
                        c["shared_class"]))
    return out


def train_classes(m, pd: ProgramData, c: dict, tables: dict[str, list[str]], sizes: dict) -> list[dict]:
    """The training program's classes (``c``: emit's class bodies and docs; ``sizes``:
    ``heads_local``, ``kv_local``, ``experts_local``, ``mla_grads``)."""
    out = [_cls("Attention(nn.Module)", _attention_doc(m, pd, sizes["heads_local"], sizes["kv_local"],
                                                       sizes["mla_grads"]), c["attn_class"])]
    out += _mlp_classes(c)
    if pd.moe_layer is not None:
        el, etp = sizes["experts_local"], c["moe_expert_tp"]
        doc = (f"Mixture of experts (runtime/model/moe.py): a top-{m.top_k} router ({router_words(m)}) over {m.experts} "
               "experts; each\n"
               "    (token, expert) row goes by all-to-all over ep to the rank holding its expert (experts\n"
               f"    [r * {el}, (r + 1) * {el}) on ep rank r){', all-gathered over expert_tp' if etp else ''}; the\n"
               f"    expert MLPs run, and the rows return{' (reduce-scattered over expert_tp)' if etp else ''} by "
               "all-to-all, weighted by the router.")
        if c["shared_class"]:
            doc += (f"\n\n    Shared experts: a dense MLP of {m.shared_experts * m.expert_ffn_hidden} units on every "
                    "token, added.")
        out.append(_cls("MoE(nn.Module)", doc + "\n    ", c["moe_class"]))
    out.append(_cls("Block(nn.Module)", _block_doc(m, pd, tables, serve=False), c["block_methods"]))
    return out


def _serve_attn_doc(layer, heads_local: int, kv_local: int) -> str:
    """The serving Attention's docstring from the graph: its heads (global -> per rank) and
    what its cache keeps (MLA: the latent and the RoPE key of ``attn.kv_a_norm`` and
    ``attn.rope_k``; else ``kv_local`` kv heads, the plan's: a replicated kv head is unsplit
    in the graph)."""
    core = layer.op("attn.core")
    heads = core.attr("heads")
    latent = layer.op("attn.kv_a_norm")
    if latent is not None and core.attr("latent", None):
        rope = layer.op("attn.rope_k").attr("out_dim").size
        return (f"Multi-head latent attention over the latent cache (DeepSeek-V2/V3, absorbed form; runtime/model/mla.py): "
                f"{heads} heads ->\n    {heads_local} per rank; the cache holds the normed {latent.attr('out_dim').size}-wide "
                f"latent and the {rope}-wide RoPE key per token,\n    the same on every tp rank; wkv_b's key rows "
                "absorbed into the query, its value rows into the output.")
    return (f"Causal self-attention over the KV cache; {heads} query / {core.attr('kv_heads')} kv heads ->\n"
            f"    {heads_local} / {kv_local} per rank. wq, wk, wv column-parallel, wo row-parallel.")


def serve_classes(m, pd: ProgramData, c: dict, sizes: dict) -> list[dict]:
    """The serving program's classes (``c``: emit's serving class bodies and docs;
    ``sizes``: ``heads_local``, ``kv_local``, ``experts_local``, ``expert_ffn_local``)."""
    layer = pd.dense_layer or pd.moe_layer
    out = [_cls("Attention(nn.Module)", _serve_attn_doc(layer, sizes["heads_local"], sizes["kv_local"]),
                c["attn_class"])]
    out += _mlp_classes(c)
    if pd.moe_layer is not None:
        doc = (f"Mixture of experts: a top-{m.top_k} router over {m.experts} experts ({sizes['experts_local']} per ep "
               f"rank), each of\n    {m.expert_ffn_hidden} inner units -> {sizes['expert_ffn_local']} per rank; "
               f"{c['moe_doc']}.\n")
        if pd.moe_layer.op("mlp.shared.w1") is not None:
            doc += f"    Shared experts: a dense MLP of {m.shared_experts * m.expert_ffn_hidden} units on every token, added.\n"
        out.append(_cls("MoE(nn.Module)", doc + "    ", c["moe_class"]))
    out.append(_cls("Block(nn.Module)", _block_doc(m, pd, {}, serve=True), c["block_methods"]))
    return out


__all__ = ["serve_classes", "train_classes"]
