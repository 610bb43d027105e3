"""Serving mixture-of-experts models (issue 18): the serve program's MoE layer (vLLM's
tensor-parallel experts, written op by op from the serving graph: runtime/model/moe.py Router,
dispatch, GroupedExperts, combine; one all-reduce of the partial sums) and the plan's MoE
serving figures.

A tiny Qwen3-MoE (a dense first layer through ``mlp_only_layers = [0]``, ``norm_topk_prob``
true and false), a tiny Mixtral and a tiny gpt-oss (biased router and experts, clamped
SwiGLU), transformers' own classes with random weights, saved with ``save_pretrained`` and
imported with ``from "hf/config.json"``; serve's ``weights = "hf"`` loads them. Greedy
tokens of the single-process serve program equal transformers' ``generate``; a training
program's DCP checkpoint serves as transformers generates from its ``hf_output``; under
torchrun with tp 2 (and tp 2 x pp 2) the tokens equal the single process's (shared experts
too, seeded), and each rank's KV cache bytes, parameters and collectives equal what the
plan says (counted by hand from the plan's stages: two all-reduces over tp per layer, the
MoE layer's one included, one for the embedding, the logits' all-gather, the pp hops).
Plan: weights per rank (all experts / tp, the router whole) and the decode time's expert
bytes (``min(E, b top_k)`` of E read per step) by hand for Qwen3-30B-A3B and gpt-oss-120b
on one 8 x H100 node; ep and expert_tp other than tp are refused at their keys.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import parcompile
from parcompile.codegen.emit import render_serve
from parcompile.diagnostics import SpecError
from parcompile.driver import compile_config
from tests.serve_utils import (build_serve, measured_collectives, planned_collectives, records, replica_tokens,
                               run_in_process, run_torchrun, serve_config)

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (pip install -e .[test])")

PROMPTS = [[5, 17, 99, 3, 250, 42], [7, 7, 120, 9, 31, 299]]
ARGS = sum((["--prompt-ids", ",".join(map(str, p))] for p in PROMPTS), [])
NEW = 8
H, VOCAB, EXPERTS, TOP_K, EXPERT_FFN = 64, 300, 8, 2, 32


def _decisive(hf, router_suffix: str):
    """Non-trivial norms, a decisive router and experts whose output outweighs the
    residual stream, so a misplaced weight or a wrong routing changes the greedy tokens."""
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith(router_suffix):
                p.normal_(0.0, 0.5)
            elif "experts" in n:
                p.normal_(0.0, 0.2)
    return hf


def _qwen3_moe(path: Path, norm_topk_prob: bool = True):
    hcfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=96, moe_intermediate_size=EXPERT_FFN, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob, mlp_only_layers=[0], decoder_sparse_step=1, router_aux_loss_coef=0.001,
        tie_word_embeddings=False, use_sliding_window=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(23 + norm_topk_prob)
    hf = transformers.AutoModelForCausalLM.from_config(hcfg, attn_implementation="eager").float().eval()
    _decisive(hf, "mlp.gate.weight").save_pretrained(path, safe_serialization=True)
    return hf


def _mixtral(path: Path):
    hcfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=EXPERT_FFN, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, router_aux_loss_coef=0.0, tie_word_embeddings=False, sliding_window=None,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(31)
    hf = transformers.AutoModelForCausalLM.from_config(hcfg, attn_implementation="eager").float().eval()
    _decisive(hf, "gate.weight").save_pretrained(path, safe_serialization=True)
    return hf


def _gpt_oss(path: Path):
    """gpt-oss: biased router and experts, the clamped SwiGLU, attention sinks, a sliding
    and a full layer, YaRN RoPE (tests/family_utils.py tiny_gpt_oss)."""
    from tests.family_utils import tiny_gpt_oss

    hf = tiny_gpt_oss(VOCAB, H, EXPERT_FFN, EXPERTS, TOP_K)
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def _generate(hf) -> list[list[int]]:
    with torch.no_grad():
        out = hf.generate(torch.tensor(PROMPTS), max_new_tokens=NEW, do_sample=False,
                          attention_mask=torch.ones(len(PROMPTS), len(PROMPTS[0]), dtype=torch.long))
    return out[:, len(PROMPTS[0]):].tolist()


def _spec(root: Path, tp: int = 1, pp: int = 1):
    """The serve spec of the checkpoint in ``root/hf`` (fp32, the `cpu` cluster)."""
    from parcompile.frontend import load_spec

    src = (f'model m from "hf/config.json" {{ dtype = fp32 }}\ncluster c from "cpu" {{ gpus_per_node = {tp * pp} }}\n'
           f'parallel {{ tp = {tp}, pp = {pp} }}\n'
           f'serve {{ batch = 2, prompt_len = 6, max_new_tokens = {NEW}, weights = "hf" }}\n')
    spec = root / f"serve_{tp}_{pp}.par"
    spec.write_text(src)
    cfg, _ = load_spec(spec)
    return cfg


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each family's saved checkpoint, its transformers tokens and the single-process
    serve program's record."""
    out = {}
    for name, save in (("qwen3_moe", _qwen3_moe), ("qwen3_moe_raw", lambda p: _qwen3_moe(p, False)),
                       ("mixtral", _mixtral), ("gpt_oss", _gpt_oss)):
        root = tmp_path_factory.mktemp(name)
        hf = save(root / "hf")
        cfg = _spec(root)
        plan = build_serve(cfg, root / "one")
        rec = run_in_process(root / "one", ARGS)
        out[name] = dict(root=root, hf=hf, cfg=cfg, plan=plan, want=_generate(hf), one=rec)
    return out


@pytest.fixture(scope="module")
def trained(models, tmp_path_factory):
    """A training program's DCP checkpoint of the Qwen3-MoE (two steps from its Hugging Face
    weights, with ``hf_output``): the serve spec reading it (``weights`` = the checkpoint
    directory) and transformers' greedy tokens of the ``hf_output`` it also wrote."""
    import contextlib
    import io
    import json
    import os

    from parcompile.core.hf import from_hf_dict
    from tests.program_utils import build_program, tiny_config

    root = tmp_path_factory.mktemp("trained")
    src = models["qwen3_moe"]["root"] / "hf"
    keys = {k: v for k, v in from_hf_dict(json.loads((src / "config.json").read_text())).items() if v is not None}
    keys.update(seq_len=16, dtype="fp32")
    cfg = tiny_config(model=keys, name="qwen3_moe_train",
                      train=dict(init_from=str(src), hf_output=str(root / "hf"), steps=2, lr=1e-2))
    module, _ = build_program(cfg, root / "train")
    saved = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if k in os.environ}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            module.main(["--plan", str(root / "train" / "plan.json"), "--steps", "2",
                         "--checkpoint-dir", str(root / "ckpt")])
    finally:
        os.environ.update(saved)
    back = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", attn_implementation="eager").float().eval()
    return dict(root=root, want=_generate(back))


def _dcp_spec(root: Path, tp: int = 1):
    """The serve spec of ``root``'s trained model (its hf_output's config.json), weights
    from the training program's checkpoint directory."""
    cfg = _spec(root, tp)
    return cfg.model_copy(update=dict(serve=cfg.serve.model_copy(update=dict(weights=str(root / "ckpt")))))


# ---- the program, in one process ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_raw", "mixtral", "gpt_oss"])
def test_single_process_greedy_equals_transformers_generate(models, name):
    m = models[name]
    cfg = m["cfg"].model
    assert cfg.experts == EXPERTS and cfg.top_k == TOP_K and cfg.expert_ffn_hidden == EXPERT_FFN
    assert cfg.dense_layers == (1 if name.startswith("qwen3") else 0)
    assert cfg.norm_topk_prob is (name != "qwen3_moe_raw")
    rec = m["one"]
    assert rec["weights"] == "hf"
    assert rec["tokens"] == m["want"], name
    # every parameter of transformers' model is on the one rank (no tied head: same count)
    assert rec["params"] == m["plan"]["stages"][0]["params_per_rank"] == sum(
        p.numel() for p in m["hf"].parameters()) + (m["plan"]["model"]["padded_vocab"] - VOCAB) * H * 2
    assert rec["cache_bytes"] == m["plan"]["serve"]["kv_cache_bytes_per_rank"]


def test_training_checkpoint_serves_as_transformers_generates(trained):
    """A training program's DCP checkpoint of a MoE model loads into the serve program
    (the expert weights under the same names) and generates what transformers generates
    from the Hugging Face checkpoint the same training wrote."""
    root = trained["root"]
    build_serve(_dcp_spec(root), root / "one")
    rec = run_in_process(root / "one", ARGS)
    assert rec["weights"] == "dcp"
    assert rec["tokens"] == trained["want"]


def test_the_serve_program_routes_with_the_model_flag(models):
    """Both router settings of Qwen3-MoE load and follow transformers; the program says
    which and the MoE class is built for the MoE layers only."""
    for name, flag in (("qwen3_moe", True), ("qwen3_moe_raw", False)):
        text = (models[name]["root"] / "one" / "serve.py").read_text()
        assert ("norm_topk_prob=False" in text) is (not flag)
        assert "self.mlp = MoE(i, tp) if i >= DENSE_LAYERS else MLP(i, tp)" in text
    mix = (models["mixtral"]["root"] / "one" / "serve.py").read_text()
    assert "self.mlp = MoE(i, tp)\n" in mix and "class MLP" not in mix


def test_compile_no_longer_warns_that_serving_skips_experts(models):
    from parcompile.codegen.emit import program_gaps

    assert program_gaps(models["mixtral"]["cfg"], "error") == []


# ---- the plan ----------------------------------------------------------------------------------

def _qwen3_30b(batch: int, extra: str = "") -> str:
    return ('model m from "qwen3-30b-a3b" { seq_len = 4096 }\ncluster c from "h100-sxm" { gpus_per_node = 8 }\n'
            f"parallel {{ tp = 8{extra} }}\nserve {{\n    batch = {batch}\n    prompt_len = 1024\n"
            "    max_new_tokens = 1024\n}\n")


def test_moe_weights_per_rank_are_all_experts_over_tp():
    """Qwen3-30B-A3B at tp 8 (no sequence parallelism needed to serve): every rank holds
    all 128 experts of each of the 48 layers at 768 / 8 inner units, the router whole."""
    d = parcompile.compile(_qwen3_30b(1), filename="s.par").data
    h, f, E, L, tp = 2048, 768, 128, 48, 8
    heads, kv, hd, V = 32, 4, 128, 151_936
    assert kv < tp                                                  # each rank holds one (replicated) kv head
    attn = h * heads * hd // tp * 2 + 2 * h * 1 * hd + 2 * hd      # wq, wo split; wk, wv of one kv head; q/k norms
    experts = E * 3 * h * f // tp
    per_layer = attn + experts + E * h + 2 * h                      # + router (replicated) + 2 norms
    padded = -(-V // (128 * tp)) * 128 * tp
    want = L * per_layer + 2 * padded // tp * h + h                 # embedding, lm_head, final norm
    assert d["stages"][0]["params_per_rank"] == want
    assert d["serve"]["weights_bytes_per_rank"] == want * 2


def test_decode_reads_only_the_chosen_experts():
    """A decode step reads min(E, b * top_k) of the E experts per layer (b = 1: 8 of 128):
    decode_weights is the bytes read over memory_eff * hbm_bw (Pope et al. 2022; at b = 1
    a decode step is memory-bound), the bytes counted by hand."""
    from parcompile.analysis.estimate import efficiency

    plan = parcompile.compile(_qwen3_30b(1), filename="s.par")
    d, cl = plan.data, plan.config.cluster
    h, f, E, L, tp, V = 2048, 768, 128, 48, 8, 151_936
    padded = -(-V // (128 * tp)) * 128 * tp
    expert_bytes = L * E * 3 * h * f // tp * 2
    read = d["serve"]["weights_bytes_per_rank"] - padded // tp * h * 2 - expert_bytes * (E - 8) // E
    rate = efficiency(cl).memory * cl.hbm_bw
    assert d["serve"]["breakdown"]["decode_weights"] == pytest.approx(read / rate, rel=1e-12)
    # more sequences choose more experts: 32 closed-loop clients (a decode step beside the others'
    # ~31 decode rows, the rest being in their prompts) read every expert
    d32 = parcompile.compile(_qwen3_30b(32), filename="s.par").data
    full = d32["serve"]["weights_bytes_per_rank"] - padded // tp * h * 2
    assert d32["serve"]["breakdown"]["decode_weights"] == pytest.approx(full / rate, rel=1e-12)


def test_gpt_oss_120b_serves_on_one_h100_node():
    """Issue 18's done-when: gpt-oss-120b (bf16) served with tp 8 on one 8 x H100 node fits;
    each rank holds all 128 experts at 2880 / 8 inner units with their biases (w2's whole),
    the attention heads and sinks split, one of the 8 kv heads, the router whole."""
    src = ('model m from "gpt-oss-120b" { seq_len = 4096 }\ncluster c from "h100-sxm" { nodes = 1, gpus_per_node = 8 }\n'
           "parallel { tp = 8 }\nserve {\n    batch = 32\n    prompt_len = 2048\n    max_new_tokens = 512\n}\n")
    d = parcompile.compile(src, filename="s.par").data
    h, hd, E, f, L, tp, V = 2880, 64, 128, 2880, 36, 8, 201_088
    q, fl = 64 * hd // tp, f // tp
    attn = (h * q + q) + 2 * (h * hd + hd) + (q * h + h) + 64 // tp    # wq, wk, wv (one kv head), wo; biases; sinks
    experts = E * (2 * (fl * h + fl) + (h * fl + h))                     # w1, w3 split with their biases; w2 + bias
    padded = -(-V // (128 * tp)) * 128 * tp
    want = L * (attn + 2 * h + E * h + E + experts) + 2 * padded // tp * h + h
    assert d["stages"][0]["params_per_rank"] == want
    sv = d["serve"]
    assert sv["weights_bytes_per_rank"] == want * 2 and sv["fits"] and d["memory"]["fits"]
    assert sv["kv_heads_per_rank"] == 1 and sv["tpot"] > 0



def test_expert_parallel_serving_splits_the_experts_inside_the_tp_group():
    """Issue 33: ep x expert_tp = tp serves (the experts over ep inside the tp group):
    each rank holds E / ep experts at ffn / expert_tp inner units."""
    d = parcompile.compile(_qwen3_30b(1, ", ep = 2, expert_tp = 4"), filename="s.par").data
    whole = parcompile.compile(_qwen3_30b(1), filename="s.par").data
    assert d["degrees"]["ep"] == 2 and d["degrees"]["expert_tp"] == 4
    # the same experts' bytes per rank (128/2 experts at 768/4 units vs 128 at 768/8), the same router
    assert d["stages"][0]["params_per_rank"] == whole["stages"][0]["params_per_rank"]


@pytest.mark.parametrize("shared", [0, 2])
def test_ep1_serving_graph_is_what_the_program_runs(shared):
    """Serving with ep = 1 under tp 2: the router replicated, a dispatch and a combine that
    move nothing, the experts' ffn split over tp with partial outputs, the shared experts'
    w2 unreduced and added, and one all-reduce over tp in the layer's MLP, after the sum;
    the serve program calls the same runtime functions, with the experts on every tp rank."""
    from parcompile.ir.ops import op_collectives
    from parcompile.passes.manager import compile_graph

    model = dict(experts=4, top_k=2, expert_ffn_hidden=32, dense_layers=1, shared_experts=shared)
    cfg = serve_config(tp=2, model=model)
    c = compile_graph(cfg)
    g, deg = c.graph, c.ctx.degrees
    assert g.node("layers.1.mlp.router").sharding.partial == frozenset()
    for n in ("layers.1.mlp.dispatch", "layers.1.mlp.combine"):
        nd = g.node(n)
        assert nd.op.attr("ffn_axis") == "tp"
        assert op_collectives(nd, deg, [t for t in g.input_types(n)], nd.type) == []
    assert "tp" in g.node("layers.1.mlp.combine").sharding.partial
    w1 = next(p for p in g.node("layers.1.mlp.experts").params if p.name.endswith("w1.weight"))
    assert w1.sharding.local_type(w1.type, deg).dim("expert_ffn").size == 16
    reduces = [nd for nd in g.nodes() if nd.op.module.startswith("layers.1.mlp") and nd.kind == "redistribute"
               and any(k == "all_reduce" for k, _ in nd.op.attr("fwd"))]
    assert len(reduces) == 1
    [src] = g.inputs(reduces[0].name)
    assert src == ("layers.1.mlp.shared_add" if shared else "layers.1.mlp.combine")
    text = render_serve(cfg, compile_config(cfg), None)
    assert "rt.ExpertAxes.tensor_parallel(tp)" in text and "rt.dispatch(x, route, local_experts=4)" in text
    assert "rt.reduce_from_tp(" in text
    assert ("reduce=None" in text) is bool(shared)   # the shared experts' w2 left unreduced


@pytest.mark.parametrize("extra, key, message", [
    (", ep = 4, expert_tp = 4", "ep", "serving with ep = 4 x expert_tp = 4 != tp = 8"),
    (", expert_tp = 4", "expert_tp", "serving with expert_tp = 4 is not supported"),
])
def test_expert_layouts_serving_cannot_run_are_refused_at_their_key(extra, key, message):
    src = _qwen3_30b(1, extra)
    with pytest.raises(SpecError) as e:
        parcompile.compile(src, filename="s.par")
    [d] = [d for d in e.value.diagnostics if message in d.message]
    line = src.splitlines()[2]
    assert d.span.line == 3 and d.span.column == line.index(f"{key} = ") + len(f"{key} = ") + 1   # at the value
    assert d.help


# ---- the program under torchrun -------------------------------------------------------------------

def _expected_comm(plan: dict, stage: int, batch: int, prompt: int, new: int, e: int = 4) -> list[dict]:
    """The collectives one rank of ``stage`` runs to serve the request, from the plan's
    stages (layers) and degrees (analysis/serve.py: two all-reduces over tp per layer, the
    MoE layer's one among them, one for the embedding on the first stage; the logits'
    all-gather on the last; the hidden state sent / received and the tokens broadcast over pp)."""
    deg = plan["degrees"]
    tp, pp = deg["tp"], deg["pp"]
    layers = len(plan["stages"][stage]["layers"])
    first, last = stage == 0, stage == pp - 1
    counts: dict[tuple, int] = {}

    def add(op, axis, nbytes, n=1):
        counts[(op, axis, nbytes)] = counts.get((op, axis, nbytes), 0) + n

    for t in [prompt] + [1] * (new - 1):
        act = batch * t * H * e
        if tp > 1:
            add("all_reduce", "tp", act, 2 * layers + first)
            if last:
                add("all_gather", "tp", batch * plan["model"]["padded_vocab"] * 4)
        if pp > 1:
            add("broadcast", "pp", batch * 8)
            if not last:
                add("send", "pp", act)
            if not first:
                add("recv", "pp", act)
    return [{"op": op, "axis": ax, "bytes": b, "count": c} for (op, ax, b), c in sorted(counts.items())]


def _check_records(name: str, plan: dict, recs: list[dict], want: list[list[int]], cfg) -> None:
    """Tokens, cache bytes, parameters and collectives of every rank; the collectives also
    equal the serving estimate's (costed from the graph, MoE layers as served: one all-reduce)."""
    assert replica_tokens(recs) == want, name
    planned = planned_collectives(cfg, NEW)
    assert len(recs) == plan["world_size"]
    for r in recs:
        s = r["stage"]
        # pp = 1: the plan's cache (a sliding-window layer's holds its window); pp = 2 runs
        # full-attention models only, whose stages hold every token
        cache = (plan["serve"]["kv_cache_bytes_per_rank"] if plan["degrees"]["pp"] == 1
                 else plan["serve"]["kv_bytes_per_token_per_stage"][s] * 2 * (6 + NEW))
        assert r["cache_bytes"] == cache, (name, r["rank"])
        assert r["params"] == plan["stages"][s]["params_per_rank"], (name, r["rank"])
        assert r["comm"] == _expected_comm(plan, s, 2, 6, NEW), (name, r["rank"])
        assert measured_collectives(r) == planned[s], (name, r["rank"])


@pytest.mark.torchrun
def test_tp2_serving_equals_single_process_and_transformers(models, trained, tmp_path):
    """One launch of 2 ranks: Qwen3-MoE (both router settings), Mixtral and gpt-oss under tp 2,
    weights from the Hugging Face checkpoints, and the trained Qwen3-MoE from its DCP
    checkpoint: the single process's tokens (= transformers'), the planned cache bytes,
    parameters and collectives on every rank."""
    jobs, plans, cfgs = [], {}, {}
    for name, m in models.items():
        d = tmp_path / name
        cfgs[name] = _spec(m["root"], tp=2)
        plans[name] = build_serve(cfgs[name], d)
        jobs.append((d, ARGS, d / "out"))
    cfgs["dcp"] = _dcp_spec(trained["root"], tp=2)
    plans["dcp"] = build_serve(cfgs["dcp"], tmp_path / "dcp")
    jobs.append((tmp_path / "dcp", ARGS, tmp_path / "dcp" / "out"))
    # shared experts (one MLP beside the routed ones, in the same all-reduce), seeded weights
    shared = dict(experts=4, top_k=2, expert_ffn_hidden=32, dense_layers=1, shared_experts=2, vocab=VOCAB)
    plan_one = build_serve(serve_config(model=shared, serve=dict(max_new_tokens=NEW)), tmp_path / "shared_one")
    shared_one = run_in_process(tmp_path / "shared_one", ARGS)
    assert shared_one["params"] == plan_one["stages"][0]["params_per_rank"]
    cfgs["shared"] = serve_config(tp=2, model=shared, serve=dict(max_new_tokens=NEW))
    plans["shared"] = build_serve(cfgs["shared"], tmp_path / "shared")
    jobs.append((tmp_path / "shared", ARGS, tmp_path / "shared" / "out"))
    run_torchrun(2, jobs)
    attn, norms = 2 * H * H + 2 * H * 2 * 16, 2 * H   # wq, wo; wk, wv of 2 kv heads of 16; the layer's norms
    moe_layer = 4 * H + 4 * 3 * H * 32 + 3 * H * 64   # router, 4 experts, the shared MLP of 2 x 32 units
    assert plans["shared"]["model"]["params"] == (4 * (attn + norms) + 3 * H * 128 + 3 * moe_layer
                                                  + 2 * VOCAB * H + H)
    _check_records("shared", plans["shared"], records(tmp_path / "shared" / "out"), shared_one["tokens"],
                   cfgs["shared"])
    for name, m in models.items():
        assert plans[name]["degrees"]["tp"] == 2 and plans[name]["degrees"]["expert_tp"] == 2
        _check_records(name, plans[name], records(tmp_path / name / "out"), m["one"]["tokens"], cfgs[name])
        assert m["one"]["tokens"] == m["want"]
    dcp = records(tmp_path / "dcp" / "out")
    assert all(r["weights"] == "dcp" for r in dcp)
    _check_records("dcp", plans["dcp"], dcp, trained["want"], cfgs["dcp"])


@pytest.mark.torchrun
def test_tp2_pp2_serving_equals_single_process(models, tmp_path):
    """One launch of 4 ranks: Qwen3-MoE (its dense layer 0 and MoE layer 1 on stage 0, MoE
    layers 2, 3 on stage 1) and Mixtral under tp 2 x pp 2."""
    jobs, plans, cfgs = [], {}, {}
    for name in ("qwen3_moe", "mixtral"):
        d = tmp_path / name
        cfgs[name] = _spec(models[name]["root"], tp=2, pp=2)
        plans[name] = build_serve(cfgs[name], d)
        jobs.append((d, ARGS, d / "out"))
    run_torchrun(4, jobs)
    for name, plan in plans.items():
        _check_records(name, plan, records(tmp_path / name / "out"), models[name]["one"]["tokens"], cfgs[name])


def test_moe_serve_programs_define_nothing_unread(models):
    from tests.test_op_code import _unread_constants

    for name, m in models.items():
        assert _unread_constants((m["root"] / "one" / "serve.py").read_text()) == [], name
