"""Hugging Face checkpoints in and out, against transformers' own classes (fp32, CPU).

For each family (llama, qwen2 with q/k/v biases and tied embeddings, gpt2 with Conv1D,
fused c_attn, learned positions and tied head, mistral with a sliding window, gpt_neox
with per-head interleaved query_key_value, partial rotary and parallel residual, mixtral
with routed experts, qwen3 with qk-norm and its own head_dim, qwen3_moe with a dense first layer and
unnormalised top-k weights): a tiny random transformers model is saved with ``save_pretrained``;
its config.json imported with ``from_hf_dict``; ``load_hf`` fills a single-process
program whose logits must equal transformers'; ``write_hf_checkpoint`` of that program's
parameters loads back with ``from_pretrained`` into the same state and logits; a tp = 2
layout's shards equal the slices of the full tensors. Then the header checks of
``check_checkpoint`` and ``read_dcp_global`` of a DCP checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from parcompile import runtime as rt
from parcompile.core.hf import from_hf_dict
from parcompile.core.hf_weights import (HFWeightsError, check_checkpoint, expected_shapes, hf_config, hf_family,
                                          init_from_kind, tensor_map)
from parcompile.runtime.distributed.context import AXES, Axis, ParallelContext, _find, init_parallel
from parcompile.runtime.state.hf_export import export_weights, read_dcp_global, write_hf_checkpoint
from parcompile.core.outputs import HF_MARKER
from parcompile.runtime.state.weights import WeightsError, load_hf
from tests.program_utils import build_program, tiny_config

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (pip install -e .[test])")

B, T = 2, 16


def _hf_config(family: str):
    common = dict(vocab_size=300, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    llama = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                 rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    if family == "llama":
        return transformers.LlamaConfig(**common, **llama)
    if family == "qwen2":
        return transformers.Qwen2Config(**{**common, "tie_word_embeddings": True}, **llama)
    if family == "mistral":
        return transformers.MistralConfig(**common, **llama, sliding_window=5, head_dim=32)   # heads * head_dim != hidden
    if family == "qwen3":   # qk-norm (q_norm, k_norm over head_dim); heads * head_dim != hidden
        return transformers.Qwen3Config(**common, **llama, head_dim=32, use_sliding_window=False)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, **llama, num_local_experts=4, num_experts_per_tok=2,
                                          router_jitter_noise=0.0)
    if family == "qwen3_moe":   # a dense first layer (mlp_only_layers), top-k weights not renormalised
        return transformers.Qwen3MoeConfig(**common, **llama, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=48, mlp_only_layers=[0], norm_topk_prob=False,
                                           use_sliding_window=False)
    if family == "gpt2":
        return transformers.GPT2Config(**{**common, "tie_word_embeddings": True}, n_embd=64, n_layer=2, n_head=4,
                                       n_inner=128, n_positions=40, activation_function="gelu",
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if family == "gpt_neox":
        return transformers.GPTNeoXConfig(**common, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=64, hidden_act="gelu",
                                          use_parallel_residual=True, attention_bias=True,
                                          rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                                           "partial_rotary_factor": 0.5},
                                          hidden_dropout=0.0, attention_dropout=0.0)
    raise AssertionError(family)


FAMILIES = ["llama", "qwen2", "gpt2", "mistral", "gpt_neox", "mixtral", "qwen3", "qwen3_moe"]


def _import(cfg: dict) -> dict:
    """`model` keys of a saved config.json. transformers 5 keeps NeoX's rotary fraction in
    `rope_parameters.partial_rotary_factor`, which parcompile.core.hf does not read yet
    (only `rotary_pct`): taken from there when the importer left it out."""
    keys = from_hf_dict(cfg)
    rp = cfg.get("rope_parameters") or {}
    if cfg["model_type"] == "gpt_neox" and "rotary_pct" not in cfg and "partial_rotary_factor" in rp:
        keys["rotary_fraction"] = float(rp["partial_rotary_factor"])
    keys = {k: v for k, v in keys.items() if v is not None}
    keys.setdefault("kv_heads", keys["heads"])   # tiny_config's default is 2
    keys.update(seq_len=T, dtype="fp32")
    return keys


def _save_hf(family: str, path: Path):
    hcfg = _hf_config(family)
    torch.manual_seed(FAMILIES.index(family) + 11)
    hf = transformers.AutoModelForCausalLM.from_config(hcfg, attn_implementation="eager").float().eval()
    with torch.no_grad():   # non-trivial norms and biases, so a misplaced one shows
        for n, p in hf.named_parameters():
            if "norm" in n or "ln_" in n:
                p.uniform_(0.5, 1.5) if n.endswith("weight") else p.uniform_(-0.2, 0.2)
            elif n.endswith("bias"):
                p.uniform_(-0.1, 0.1)
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def _stage(module, plan, ctx):
    with rt.no_init():
        return module.Stage(plan, ctx)


def _logits(stage, ids):
    stage.eval()
    with torch.no_grad():
        return stage.forward_chunk(0, ids)


def _fake_ctx(plan: dict, rank: int) -> ParallelContext:
    """This rank's axes of ``plan`` without process groups (enough to build parameters)."""
    world = plan["world_size"]
    axes = {}
    for name in AXES:
        mine = _find(plan["groups"].get(name) or [[r] for r in range(world)], rank)
        axes[name] = Axis(name, mine, mine.index(rank), None)
    return ParallelContext(rank, world, axes, torch.device("cpu"), None, distributed=False)


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory):
    family = request.param
    tmp = tmp_path_factory.mktemp(family)
    hf = _save_hf(family, tmp / "hf")
    keys = _import(json.loads((tmp / "hf" / "config.json").read_text()))
    cfg = tiny_config(model=keys, name=family)
    module, plan = build_program(cfg, tmp / "prog")
    stage = _stage(module, plan, init_parallel(plan))
    load_hf(stage, str(tmp / "hf"))
    return dict(family=family, tmp=tmp, hf=hf, cfg=cfg, stage=stage, keys=keys)


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(0))


def test_load_hf_matches_transformers(case):
    m = case["cfg"].model
    assert hf_family(m) == case["family"]
    ids = _ids(m.vocab)
    ours = _logits(case["stage"], ids)
    with torch.no_grad():
        ref = case["hf"](input_ids=ids).logits
    assert ref.std() > 1e-3
    torch.testing.assert_close(ours[..., :m.vocab], ref, atol=1e-5, rtol=1e-5)
    assert ours[..., m.vocab:].abs().max() == 0   # padded vocabulary rows stay zero


def test_write_hf_checkpoint_loads_back_with_from_pretrained(case):
    m, stage, tmp = case["cfg"].model, case["stage"], case["tmp"]
    state = {p.global_name: p.detach() for p in stage.parameters()}
    (tmp / "tokenizer.json").write_text('{"version": "1.0"}')
    out = write_hf_checkpoint(state, m, tmp / "out", tokenizer_files=[tmp / "tokenizer.json"],
                              generation_config={"eos_token_id": 1})
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 1
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert back.config.eos_token_id == 1 and back.config.bos_token_id is None
    ref_sd, got_sd = case["hf"].state_dict(), back.state_dict()
    assert set(ref_sd) == set(got_sd)
    for k, v in ref_sd.items():
        torch.testing.assert_close(got_sd[k], v, atol=0, rtol=0, msg=k)
    ids = _ids(m.vocab)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, _logits(stage, ids)[..., :m.vocab], atol=1e-5, rtol=1e-5)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == case["family"] and written["dtype"] == "float32"
    assert tiny_config(model=_import(written)).model == m   # the config imports as the same model
    if m.tie_embeddings:
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert not any("lm_head" in k or "embed_out" in k for k in f.keys())
    assert not check_checkpoint(out, expected_shapes(m), m)


def test_tp2_shards_are_slices_of_the_full_tensors(case):
    keys, tmp, full_stage = case["keys"], case["tmp"], case["stage"]
    moe = dict(sequence_parallel=True, expert_tp=2) if keys.get("experts") else None   # experts split too
    cfg = tiny_config(tp=2, model=keys, parallel=moe, name=case["family"] + "_tp2")
    module, plan = build_program(cfg, tmp / "prog_tp2")
    full = {p.global_name: p.detach() for p in full_stage.parameters()}
    vocab = cfg.model.vocab
    seen = set()
    for rank in range(2):
        stage = _stage(module, plan, _fake_ctx(plan, rank))
        load_hf(stage, str(tmp / "hf"))
        for p in stage.parameters():
            want = full[p.global_name]
            if p.valid_rows is not None:   # padded differently for tp = 2
                want = torch.cat([want[:vocab], want.new_zeros((p.global_shape[0] - vocab,) + want.shape[1:])])
            if p.shard_dim is not None:
                n = p.global_shape[p.shard_dim] // p.num_shards
                want = want.narrow(p.shard_dim, p.shard_index * n, n)
                seen.add(p.global_name)
            torch.testing.assert_close(p.detach(), want, atol=0, rtol=0, msg=p.global_name)
    assert any(".wq." in n for n in seen) and any(".w2." in n for n in seen)
    assert not keys.get("experts") or any(".experts." in n for n in seen)


def test_mixtral_fused_expert_layout_loads(tmp_path):
    """transformers' in-memory layout (gate_up_proj, down_proj, mlp.gate) is read too."""
    from safetensors.torch import save_file

    hf = _save_hf("mixtral", tmp_path / "hf")
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(tmp_path / "hf" / "config.json", fused)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(fused / "model.safetensors"))
    keys = _import(json.loads((fused / "config.json").read_text()))
    module, plan = build_program(tiny_config(model=keys), tmp_path / "prog")
    stage = _stage(module, plan, init_parallel(plan))
    load_hf(stage, str(fused))
    ids = _ids(keys["vocab"])
    with torch.no_grad():
        torch.testing.assert_close(_logits(stage, ids)[..., :keys["vocab"]], hf(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)
    back = transformers.AutoModelForCausalLM.from_pretrained(fused)   # transformers reads it too
    torch.testing.assert_close(back.state_dict()["model.layers.1.mlp.experts.down_proj"],
                               hf.state_dict()["model.layers.1.mlp.experts.down_proj"])


# ---- check_checkpoint: headers only ------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama_check")
    _save_hf("llama", tmp / "hf")
    keys = _import(json.loads((tmp / "hf" / "config.json").read_text()))
    return tmp / "hf", tiny_config(model=keys).model


def _messages(problems) -> str:
    return "\n".join(p.message for p in problems)


def test_check_checkpoint_accepts_a_good_one_and_reports_shapes(llama_dir, tmp_path):
    d, m = llama_dir
    assert check_checkpoint(d, expected_shapes(m), m) == []
    wider = m.model_copy(update={"ffn_hidden": 128})
    text = _messages(check_checkpoint(d, expected_shapes(wider), wider))
    assert "model.layers.0.mlp.gate_proj.weight` has shape (96, 64)" in text
    assert "`layers.0.mlp.w1.weight` (128, 64) needs (128, 64)" in text


def test_check_checkpoint_missing_tensor_and_truncated_file(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    d, m = llama_dir
    cut = tmp_path / "missing"
    shutil.copytree(d, cut)
    tensors = load_file(str(cut / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(cut / "model.safetensors"))
    text = _messages(check_checkpoint(cut, expected_shapes(m), m))
    assert "no tensor `model.layers.1.self_attn.k_proj.weight`" in text and "layers.1.attn.wk.weight" in text
    with pytest.raises(WeightsError, match="k_proj"):
        module, plan = build_program(tiny_config(model=_import(json.loads((d / "config.json").read_text()))),
                                     tmp_path / "prog")
        load_hf(_stage(module, plan, init_parallel(plan)), str(cut))

    short = tmp_path / "short"
    shutil.copytree(d, short)
    f = short / "model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    (problem,) = check_checkpoint(short, expected_shapes(m), m)
    assert "model.safetensors` is truncated" in problem.message
    assert str(size // 2) in problem.message and str(size) in problem.message
    with open(f, "r+b") as fh:
        fh.truncate(5)
    assert "truncated" in _messages(check_checkpoint(short, expected_shapes(m), m))


def test_check_checkpoint_index_missing_file_and_foreign_model_type(llama_dir, tmp_path):
    d, m = llama_dir
    from safetensors.torch import load_file

    from parcompile.runtime.state.weights import hf_files

    state = {}
    for name, shape in expected_shapes(m).items():
        state[name] = torch.randn(shape)
    out = write_hf_checkpoint(state, m, tmp_path / "sharded", max_shard_bytes=60_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert check_checkpoint(out, expected_shapes(m), m) == []
    assert set(load_file(str(out / files[0]))) <= set(index["weight_map"])
    moved = next(k for k, v in index["weight_map"].items() if v == files[-1])
    wrong = {**index, "weight_map": {**index["weight_map"], moved: files[0]}}
    (out / "model.safetensors.index.json").write_text(json.dumps(wrong))
    assert f"{files[0]}` has no tensor `{moved}`" in _messages(check_checkpoint(out, expected_shapes(m), m))
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / files[1]).unlink()
    text = _messages(check_checkpoint(out, expected_shapes(m), m))
    assert f"names `{files[1]}`, which is not in" in text
    with pytest.raises(WeightsError, match=files[1]):
        hf_files(out)

    cfg = json.loads((d / "config.json").read_text())
    bert = tmp_path / "bert"
    shutil.copytree(d, bert)
    (bert / "config.json").write_text(json.dumps({**cfg, "model_type": "bert"}))
    (problem,) = check_checkpoint(bert, expected_shapes(m), m)
    assert 'model_type "bert"' in problem.message and "llama" in problem.help


def test_init_from_kind_and_atomic_replace(llama_dir, tmp_path):
    d, m = llama_dir
    assert init_from_kind(d) == "hf"
    (tmp_path / "empty").mkdir()
    with pytest.raises(HFWeightsError, match="neither"):
        init_from_kind(tmp_path / "empty")
    assert "neither" in check_checkpoint(tmp_path / "empty", {}, m)[0].message
    with pytest.raises(HFWeightsError, match="not a directory"):
        init_from_kind(tmp_path / "nowhere")
    # a failed export leaves an existing output (one parcompile wrote: its marker lists it) as it was
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    (out / HF_MARKER).write_text(json.dumps({"written_by": "parcompile", "files": ["keep"]}))
    with pytest.raises(WeightsError, match="no `embedding.weight`"):
        write_hf_checkpoint({}, m, out)
    assert (out / "keep").is_file() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_fused_gpt2_shape_mismatch_is_reported_once_per_tensor(tmp_path):
    m = tiny_config(model=dict(norm="layernorm", activation="gelu", position="learned", bias=True, kv_heads=4,
                               tie_embeddings=True, layers=1)).model
    out = write_hf_checkpoint({k: torch.zeros(v) for k, v in expected_shapes(m).items()}, m, tmp_path / "gpt2")
    wide = m.model_copy(update={"hidden": 128, "heads": 8})   # head_dim 16 still
    problems = check_checkpoint(out, expected_shapes(wide), wide)
    c_attn = [p for p in problems if "h.0.attn.c_attn.weight`" in p.message]
    assert len(c_attn) == 1 and "(64, 192) in the checkpoint" in c_attn[0].message
    assert "needs (128, 384)" in c_attn[0].message


def test_models_without_a_family_are_refused():
    base = tiny_config().model
    with pytest.raises(HFWeightsError, match="gelu"):
        hf_family(base.model_copy(update={"activation": "gelu"}))
    with pytest.raises(HFWeightsError, match="shared_experts"):
        hf_family(base.model_copy(update={"experts": 4, "shared_experts": 1}))
    with pytest.raises(HFWeightsError, match="norm_topk_prob = false"):   # Mixtral renormalises
        hf_family(base.model_copy(update={"experts": 4, "top_k": 2, "norm_topk_prob": False}))
    with pytest.raises(HFWeightsError, match="shared_experts"):
        hf_family(base.model_copy(update={"experts": 4, "shared_experts": 1, "qk_norm": True}))
    assert hf_family(base.model_copy(update={"experts": 4, "qk_norm": True, "dense_layers": 1})) == "qwen3_moe"
    assert hf_config(base)["rope_parameters"]["rope_theta"] == base.rope_theta
    assert set(tensor_map(base, "llama")) == set(expected_shapes(base)) | {"lm_head.weight"}


# ---- DCP checkpoints of training programs ---------------------------------------------------


class _Optimizer:   # what checkpoint.save asks of an optimizer
    def __init__(self, params):
        self.params = list(params)

    def export_states(self):
        return {id(p): {"exp_avg": torch.full_like(p, 3.0)} for p in self.params}


def test_read_dcp_global_and_export(tmp_path):
    from parcompile.runtime.state import checkpoint

    cfg = tiny_config(model=dict(layers=2, tie_embeddings=True, vocab=300))   # padded to 384 rows
    module, plan = build_program(cfg, tmp_path / "prog")
    ctx = init_parallel(plan)
    stage = module.Stage(plan, ctx)
    checkpoint.save(tmp_path / "ckpt", 7, stage, _Optimizer(stage.parameters()), ctx)
    for where in (tmp_path / "ckpt", tmp_path / "ckpt" / "step_00000007"):
        got = read_dcp_global(where)
        want = {p.global_name: p.detach() for p in stage.parameters()}
        assert set(got) == set(want) and "lm_head.weight" not in got
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, atol=0, rtol=0)
    assert init_from_kind(tmp_path / "ckpt") == "dcp" and check_checkpoint(tmp_path / "ckpt", {}, cfg.model) == []
    out = export_weights(tmp_path / "ckpt", cfg.model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = _ids(cfg.model.vocab)
    torch.testing.assert_close(hf(input_ids=ids).logits, _logits(stage, ids)[..., :300], atol=1e-5, rtol=1e-5)
    with pytest.raises(WeightsError, match="no complete checkpoint"):
        read_dcp_global(tmp_path / "prog")


@pytest.mark.parametrize("model", [
    dict(experts=4, shared_experts=1, dense_layers=1, layers=3),
    dict(norm="layernorm", activation="gelu", position="learned", bias=True, tie_embeddings=True, max_positions=32),
    dict(qkv_bias=True, vocab=300),
    dict(qk_norm=True, head_dim=32),
])
def test_expected_shapes_are_the_programs_parameters(model, tmp_path):
    cfg = tiny_config(model=model)
    module, plan = build_program(cfg, tmp_path / "prog")
    stage = _stage(module, plan, init_parallel(plan))
    assert expected_shapes(cfg.model, tp=1) == {p.global_name: tuple(p.global_shape) for p in stage.parameters()}
