"""Quantized Hugging Face checkpoints served as published (issue 45; ``serve.weight_dtype``,
parcompile/core/quant.py, parcompile/runtime/model/quant.py), against transformers on the same files.

Each checkpoint is made here by the format's own code: FP8 block-scaled by transformers'
``Fp8Quantize`` (``integrations/finegrained_fp8.py``; a tiny Qwen3, 32 x 32 blocks, so that a
tp-2 row-parallel shard of the 96-wide MLP starts inside a block; a tiny Qwen3-MoE whose
per-expert tensors are FP8 too, its 32-wide experts split inside a block at tp 2); compressed-tensors FP8
(per tensor with a static input scale, per channel with dynamic per-token activations) by
compressed-tensors' own ``apply_quantization_config`` and ``ModelCompressor``; gpt-oss's
MXFP4 experts by compressed-tensors' MXFP4 quantizer and packer, laid out as gpt-oss
publishes them (``*_blocks`` (E, out, in/32, 16), ``*_scales`` (E, out, in/32); a tp-2 shard
of the 32-wide experts starts inside a 32-value block); 4-bit AWQ (GEMM) and GPTQ (v1) of a
tiny Llama packed here from those formats' documented layout, held to the dense model of
their dequantized weights (transformers reads them only through gptqmodel, a GPU library;
a tp-2 row-parallel shard of the 128-wide attention output starts inside a group of 128).
transformers loads the others with
``from_pretrained`` on the CPU (FP8 and MXFP4: dequantized on load; compressed-tensors:
decompressed, its activations fake-quantized) and generates greedily; ``parcompile``'s serve
program, one process and tp = 2, must give the same tokens (and, in one process, the same
logits). ``weight_dtype = fp8`` over a 16-bit checkpoint quantizes on load, one scale per
tensor, checked against that rule written out here. The ranks hold the weights quantized
(E4M3 bytes, MXFP4 blocks); broken checkpoints give `parcompile check` diagnostics naming
the file, the tensor, what it needs and what it holds.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from parcompile.cli import main
from parcompile.core.hf_weights import check_checkpoint, expected_shapes
from parcompile.core.quant import FORMATS, format_named
from parcompile.runtime.model import quant as rq
from tests.serve_utils import build_serve, records, replica_tokens, run_in_process, run_torchrun, serve_config

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (pip install -e .[test])")
safetensors_torch = pytest.importorskip("safetensors.torch")

PROMPTS = [[5, 17, 99, 3, 250, 42], [7, 7, 120, 9, 31, 299]]
NEW = 8
ARGS = sum((["--prompt-ids", ",".join(map(str, p))] for p in PROMPTS), [])


# --------------------------------------------------------------------------- checkpoints


def _qwen3():
    from tests.family_utils import tiny_qwen3

    return tiny_qwen3()


def _rewrite(path: Path, convert, quantization_config: dict) -> None:
    """Replace ``path``'s tensors by ``convert(name, tensor)`` (a dict each) and add the
    ``quantization_config`` to its config.json."""
    sd = safetensors_torch.load_file(path / "model.safetensors")
    out = {}
    for k, v in sd.items():
        out.update(convert(k, v))
    safetensors_torch.save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(cfg, indent=1))


def _save_fp8_block(path: Path, block=(32, 32)) -> None:
    """A tiny Qwen3 whose decoder linear layers are FP8 with one fp32 scale per block, made
    by transformers' own quantizer (as Qwen3-*-FP8 ship)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    _qwen3().save_pretrained(path, safe_serialization=True)
    qcfg = FineGrainedFP8Config(weight_block_size=list(block))
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(qcfg))
    _rewrite(path, lambda k, v: quantize._quantize_one(k, v) if ".layers." in k and k.endswith("proj.weight")
             else {k: v}, {**qcfg.to_dict(), "quant_method": "fp8"})


def _save_fp8_block_moe(path: Path) -> None:
    """A tiny Qwen3-MoE whose attention and every expert (per-expert tensors, as
    Qwen3-30B-A3B-FP8 ship) are FP8 in 32 x 32 blocks; the router stays 16-bit."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    hcfg = transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64, rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None, router_aux_loss_coef=0.0)
    torch.manual_seed(3)
    hf = transformers.Qwen3MoeForCausalLM(hcfg).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("gate.weight"):
                p.normal_(0.0, 0.5)   # a decisive router
    hf.save_pretrained(path, safe_serialization=True)
    qcfg = FineGrainedFP8Config(weight_block_size=[32, 32])
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(qcfg))
    _rewrite(path, lambda k, v: quantize._quantize_one(k, v) if ".layers." in k and k.endswith("proj.weight")
             else {k: v}, {**qcfg.to_dict(), "quant_method": "fp8"})


def _save_dense(path: Path) -> None:
    _qwen3().save_pretrained(path, safe_serialization=True)


def _save_compressed(path: Path, preset: str) -> None:
    """A tiny Llama in compressed-tensors' FP8 format (``preset``: ``FP8``, per-tensor
    weights and a static input scale calibrated on the prompts; ``FP8_DYNAMIC``, per-channel
    weights and dynamic per-token activations), by compressed-tensors itself (RedHatAI's
    ``*-FP8`` / ``*-FP8-dynamic``)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams

    hcfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                                    pad_token_id=None)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hcfg).float().eval()
    amax = {}   # each linear layer's input amax on the prompts: the static input scales' calibration
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: amax.__setitem__(n, max(amax.get(n, 0.0),
                                                                                 i[0].abs().max().item())))
             for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    with torch.no_grad():
        hf(torch.tensor(PROMPTS))
    for h in hooks:
        h.remove()
    scheme = preset_name_to_scheme(preset, ["Linear"])
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                                     quantization_status="frozen"))
    for n, m in hf.named_modules():
        if getattr(m, "quantization_scheme", None) is None:
            continue
        w = m.weight.detach()
        lo, hi = (w.min().reshape(1), w.max().reshape(1)) if scheme.weights.strategy == "tensor" else \
            (w.amin(1, keepdim=True), w.amax(1, keepdim=True))
        scale, _ = calculate_qparams(lo, hi, scheme.weights)
        m.weight_scale.data = scale.reshape(m.weight_scale.shape).to(m.weight_scale.dtype)
        if hasattr(m, "input_scale"):
            m.input_scale.data.fill_(amax[n] / 448.0)
    compressor = ModelCompressor.from_pretrained_model(hf)
    compressor.compress_model(hf)
    hf.save_pretrained(path, safe_serialization=True)
    compressor.update_config(path)


def _save_mxfp4(path: Path) -> None:
    """A tiny gpt-oss whose experts are MXFP4 as gpt-oss publishes them, quantized and packed
    by compressed-tensors' MXFP4 code (its nibble order and table are gpt-oss's: the even
    element in the low nibble)."""
    from compressed_tensors.compressors.mx_utils import compress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    from tests.family_utils import tiny_gpt_oss

    hf = tiny_gpt_oss(300, 64, 32, 4, 2)
    hf.save_pretrained(path, safe_serialization=True)
    args = preset_name_to_scheme("MXFP4A16", ["Linear"]).weights

    def mx(w):   # (out, in) -> blocks (out, in/32, 16), E8M0 scales (out, in/32)
        o, i = w.shape
        g = w.reshape(o, i // 32, 32)
        scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args)
        return (quantize_and_pack_fp4(w, scale, group_size=32).reshape(o, i // 32, 16),
                compress_mx_scale(scale, torch.uint8))

    def convert(k, v):
        if not k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return {k: v}
        blocks, scales = zip(*(mx(v[e].t().contiguous()) for e in range(v.shape[0])))   # dense (E, in, out)
        return {f"{k}_blocks": torch.stack(blocks), f"{k}_scales": torch.stack(scales)}

    _rewrite(path, convert, {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})


def _pack_int4(values: torch.Tensor, dim: int, order=(0, 1, 2, 3, 4, 5, 6, 7)) -> torch.Tensor:
    """4-bit ``values`` packed eight to an int32 along ``dim``: nibble ``i`` (bits 4i) of word
    ``k`` holds element ``8k + order[i]`` (GPTQ: in order; AutoAWQ's GEMM: 0, 2, 4, 6, 1, 3, 5, 7,
    ``WQLinear_GEMM.from_linear``)."""
    v = values.movedim(dim, -1).long()
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    word = sum(v[..., order[i]] << (4 * i) for i in range(8))
    word = torch.where(word >= 2**31, word - 2**32, word)   # the int32 of the same bits
    return word.to(torch.int32).movedim(-1, dim).contiguous()


def _save_int4(path: Path, method: str) -> None:
    """A tiny Llama (hidden 128: one group of 128 per row) whose decoder linear weights are 4-bit
    with an fp16 scale and a zero point per group of 128 (asymmetric min-max), packed as AutoAWQ's
    GEMM (``qweight`` (in, out/8), ``qzeros`` (in/128, out/8), ``scales`` (in/128, out)) or as
    GPTQ's v1 checkpoints (``qweight`` (in/8, out), ``qzeros`` (in/128, out/8) holding
    zero - 1, ``scales``, ``g_idx``), from those formats' documented layout (transformers loads
    them only through gptqmodel, a GPU library). Beside it, ``path/../ref``: the dense model of
    the dequantized weights, ``(q - z) * s`` in fp16, the reference."""
    hcfg = transformers.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                                    pad_token_id=None)
    torch.manual_seed(4)
    hf = transformers.LlamaForCausalLM(hcfg).float().eval()
    hf.save_pretrained(path, safe_serialization=True)
    dense = {}

    def convert(k, w):
        if ".layers." not in k or not k.endswith("proj.weight"):
            dense[k] = w
            return {k: w}
        o, i = w.shape
        g = w.reshape(o, i // 128, 128)
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-5).half()                       # (out, G)
        zero = torch.round(-lo / scale.float()).clamp(1 if method == "gptq" else 0, 15).int()   # v1 stores zero - 1
        q = torch.clamp(torch.round(g / scale.float()[..., None]) + zero[..., None], 0, 15).int().reshape(o, i)
        dense[k] = ((q - zero.repeat_interleave(128, 1)).half() * scale.repeat_interleave(128, 1)).float()
        stem = k.removesuffix(".weight")
        if method == "awq":
            order = (0, 2, 4, 6, 1, 3, 5, 7)
            return {f"{stem}.qweight": _pack_int4(q.t(), 1, order), f"{stem}.qzeros": _pack_int4(zero.t(), 1, order),
                    f"{stem}.scales": scale.t().contiguous()}
        return {f"{stem}.qweight": _pack_int4(q.t(), 0), f"{stem}.qzeros": _pack_int4(zero.t() - 1, 1),
                f"{stem}.scales": scale.t().contiguous(), f"{stem}.g_idx": (torch.arange(i) // 128).int()}

    qc = ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
          if method == "awq" else
          {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False,
           "checkpoint_format": "gptq"})
    _rewrite(path, convert, qc)
    hf.load_state_dict(dense)
    hf.save_pretrained(path.parent / "ref", safe_serialization=True)


def _hf_generate(hf) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens and each step's logits (steps, B, V) of a transformers model."""
    with torch.no_grad():
        out = hf.generate(torch.tensor(PROMPTS), max_new_tokens=NEW, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, attention_mask=torch.ones(2, 6, dtype=torch.long))
    return out.sequences[:, 6:].tolist(), torch.stack(out.logits)


def _load_hf(path: Path):
    kw = {"attn_implementation": "eager"} if "gpt_oss" in (path / "config.json").read_text() else {}
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def _fp8_reference(path: Path):
    """The 16-bit checkpoint ``path`` with each decoder linear weight through E4M3 with one
    scale per tensor (amax / 448), written out from the rule (vLLM's ``--quantization fp8``)."""
    hf = _load_hf(path)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if ".layers." in n and n.endswith("proj.weight"):
                scale = p.abs().max() / 448.0
                p.copy_((p / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale)
    return hf


def _spec(root: Path, tp: int, name: str, extra: str = ""):
    from parcompile.frontend import load_spec

    src = (f'model m from "hf/config.json" {{ dtype = fp32 }}\ncluster c from "cpu" {{ gpus_per_node = {tp} }}\n'
           f'parallel {{ tp = {tp} }}\n'
           f'serve {{ batch = 2, prompt_len = 6, max_new_tokens = {NEW}, weights = "hf"{extra} }}\n')
    (root / f"{name}.par").write_text(src)
    cfg, _ = load_spec(root / f"{name}.par")
    return cfg


#: each case: how its checkpoint is written, the serve keys it adds, the format the spec reads,
#: the transformers model it is held to (default: the checkpoint loaded by transformers)
CASES = {
    "fp8_block": (_save_fp8_block, "", "fp8-block32x32", _load_hf),
    "fp8_block_moe": (_save_fp8_block_moe, "", "fp8-block32x32", _load_hf),
    "ct_fp8": (lambda p: _save_compressed(p, "FP8"), "", "fp8-tensor", _load_hf),
    "ct_fp8_dynamic": (lambda p: _save_compressed(p, "FP8_DYNAMIC"), "", "fp8-channel", _load_hf),
    "mxfp4": (_save_mxfp4, "", "mxfp4", _load_hf),
    "fp8_on_load": (_save_dense, ", weight_dtype = fp8", "fp8-tensor", _fp8_reference),
    "awq": (lambda p: _save_int4(p, "awq"), "", "int4-awq", lambda p: _load_hf(p.parent / "ref")),
    "gptq": (lambda p: _save_int4(p, "gptq"), "", "int4-gptq", lambda p: _load_hf(p.parent / "ref")),
}
#: a model of several 128 x 128 blocks per weight, served from its seeded weights with
#: weight_dtype = fp8 (fp8-block, 128 x 128): at tp 2 the MLP's down projection (384 wide)
#: splits inside a block
SEEDED = dict(layers=2, hidden=256, heads=4, kv_heads=2, ffn_hidden=384, vocab=256, seq_len=32)
#: the cases also served at tp = 2 (one torchrun launch for all)
TP2 = ("fp8_block", "fp8_block_moe", "ct_fp8", "mxfp4", "fp8_on_load", "awq", "gptq")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Per case: its directory, transformers' tokens and logits on it (for fp8_on_load, awq
    and gptq: on the reference) and the one-process record (with logits)."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is a test dependency (pip install -e .[test])")
    out = {}
    for key, (save, extra, fmt, reference) in CASES.items():
        root = tmp_path_factory.mktemp(key)
        save(root / "hf")
        hf = reference(root / "hf")
        tokens, logits = _hf_generate(hf)
        cfg = _spec(root, 1, "one", extra)
        assert cfg.serve.weight_format == fmt, key
        build_serve(cfg, root / "one")
        out[key] = dict(root=root, tokens=tokens, logits=logits, one=run_in_process(root / "one", ARGS + ["--record-logits"]))
    return out


@pytest.fixture(scope="module")
def served_tp2(served, tmp_path_factory):
    """The tp-2 tokens of each case of :data:`TP2`, and of the seeded model quantized on load
    (``seeded``: its directory, the one-process record and the tp-2 tokens), one torchrun
    launch for all."""
    jobs = []
    for key in TP2:
        root = served[key]["root"]
        build_serve(_spec(root, 2, "tp2", CASES[key][1]), root / "tp2")
        jobs.append((root / "tp2", ARGS, root / "tp2" / "out"))
    seeded = tmp_path_factory.mktemp("fp8_seeded")   # no checkpoint: the seeded weights quantized on load
    for tp in (1, 2):
        build_serve(serve_config(tp=tp, model=SEEDED, serve=dict(weight_dtype="fp8"), name="seeded"), seeded / f"tp{tp}")
    jobs.append((seeded / "tp2", [], seeded / "tp2" / "out"))
    run_torchrun(2, jobs)
    out = {key: replica_tokens(records(served[key]["root"] / "tp2" / "out")) for key in TP2}
    out["seeded"] = dict(root=seeded, one=run_in_process(seeded / "tp1", []),
                         tp2=replica_tokens(records(seeded / "tp2" / "out")))
    return out


@pytest.mark.parametrize("key", list(CASES))
def test_serves_the_tokens_transformers_generates(served, key):
    """One process: greedy tokens and every step's logits equal transformers' on the same
    checkpoint (compressed-tensors' activation fake-quantization included: without it the
    logits differ by ~1e-2)."""
    case = served[key]
    assert case["one"]["weights"] == "hf"
    assert case["one"]["tokens"] == case["tokens"], key
    torch.testing.assert_close(case["one"]["logits"], case["logits"][..., :300], atol=2e-5, rtol=1e-5)


@pytest.mark.torchrun
def test_tp2_serves_the_tokens_transformers_generates(served, served_tp2):
    """tp = 2 (each rank its shard; the MLP's and the experts' row-parallel shards start inside
    a scale block): transformers' greedy tokens again."""
    for key in TP2:
        assert served_tp2[key] == served[key]["tokens"], key


@pytest.mark.torchrun
def test_fp8_made_on_load_is_the_same_in_every_layout(served_tp2):
    """weight_dtype = fp8 over the seeded weights (fp8-block, 128 x 128): one scale per block of
    the global tensor, so tp = 2, whose down projection splits inside a block, holds the
    same values and gives one process's tokens; the ranks hold E4M3 and the blocks' scales."""
    case = served_tp2["seeded"]
    assert case["tp2"] == case["one"]["tokens"]
    mod, model = _stage(case["root"] / "tp1", None)
    held = rq.held(model)
    assert mod.WEIGHT_FORMAT == "fp8-block" and len(held) == 2 * 7
    w2 = next(q for q in held if q.global_name == "layers.0.mlp.w2.weight")
    assert w2.data.dtype == torch.float8_e4m3fn and tuple(w2.scale.shape) == (2, 3)
    dense = w2.dequantize()
    assert dense.shape == (256, 384) and torch.equal(dense, model.layers["0"].mlp.w2.weight)


def test_quantized_tokens_differ_from_the_dense_model(served):
    """The checkpoints are quantized enough to matter: transformers' FP8-block tokens differ
    from the dense model's (so serving the wrong weights would show)."""
    dense = _hf_generate(_qwen3())[0]
    assert served["fp8_block"]["tokens"] != dense
    assert served["fp8_on_load"]["tokens"] != dense


@pytest.mark.parametrize("key", ["fp8_block", "ct_fp8_dynamic", "mxfp4"])
def test_the_engine_serves_the_same_tokens(served, key):
    """`parcompile serve`'s engine (runtime/serve/paged.py: requests joining a running batch, the
    step's tokens packed) on the quantized weights, in this process: transformers' tokens."""
    from tests.serve_utils import paged_generate

    root = served[key]["root"]
    got, _, _ = paged_generate(root / "one", PROMPTS, NEW, 2, 16, 4, weights=str(root / "hf"))
    assert got == served[key]["tokens"]


@pytest.mark.torchrun
@pytest.mark.parametrize("key", ["mxfp4", "fp8_block"])
def test_parcompile_serve_answers_with_the_tokens_transformers_generates(served, tmp_path, key):
    """`parcompile serve` of the MXFP4 gpt-oss checkpoint and of the block-scaled FP8 Qwen3
    one as published, tp = 2: the completions endpoint's greedy token ids are transformers'."""
    httpx = pytest.importorskip("httpx")
    from tests.serve_utils import serving

    root = served[key]["root"]
    spec = tmp_path / "quantized.par"
    spec.write_text(f'model m from "{root / "hf" / "config.json"}" {{ dtype = fp32 }}\n'
                    'cluster c from "cpu" { gpus_per_node = 2 }\nparallel { tp = 2 }\n'
                    f'serve {{ batch = 2, prompt_len = 6, max_new_tokens = {NEW}, weights = "{root / "hf"}", '
                    'kv_cache_tokens = 64, block_size = 4 }\n')
    env = dict(os.environ, OMP_NUM_THREADS="1", PARCOMPILE_DEVICE="cpu",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    with serving(spec, tmp_path / "out", env) as (_, base):
        name = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(base + "/v1/completions", timeout=120, json={
            "model": name, "prompt": PROMPTS, "max_tokens": NEW, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == served[key]["tokens"]


# --------------------------------------------------------------------------- held quantized


def _stage(prog: Path, weights: Path):
    """``prog/serve.py``'s Stage in this process (a world of one), loaded as main() loads it."""
    from parcompile import runtime as rt
    from parcompile.runtime.state.weights import load_weights

    spec = importlib.util.spec_from_file_location(f"quant_prog_{prog.parent.name}", prog / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    plan = json.loads((prog / "plan.json").read_text())
    saved = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if k in os.environ}
    try:
        ctx = rt.init_parallel(plan, force_cpu=True)
    finally:
        os.environ.update(saved)
    with rt.no_init() if weights else contextlib.nullcontext():   # loaded weights need no initial values
        model = mod.Stage(plan, ctx)
    load_weights(model, weights and str(weights), ctx, weight_format=mod.WEIGHT_FORMAT, quantized=mod.QUANTIZED_WEIGHTS,
                 dtype=mod.DTYPE)
    return mod, model


@pytest.mark.parametrize("key", ["fp8_block", "mxfp4", "fp8_on_load", "awq"])
def test_ranks_hold_the_weights_quantized(served, key):
    """The decoder's linear weights (gpt-oss: the experts') are held as E4M3 bytes, MXFP4
    blocks or packed int4 words with their scales, never as parameters; the bytes are the
    format's (values at 1 or 1/2 byte each); `module.weight` gives the dense weight in the
    compute dtype."""
    root = served[key]["root"]
    mod, model = _stage(root / "one", root / "hf")
    held = rq.held(model)
    names = {n for n, _ in model.named_parameters()}
    assert held and not any(q.global_name in names for q in held)
    fmt = format_named(mod.WEIGHT_FORMAT)
    if fmt.family == "fp8":
        for q in held:
            assert isinstance(q, rq.FP8Weight) and q.data.dtype == torch.float8_e4m3fn
            assert tuple(q.data.shape) == q.shape and q.data.nbytes == q.shape[0] * q.shape[1]
            assert q.scale.dtype == torch.float32 and q.scale.numel() == (
                -(-q.shape[0] // fmt.block[0]) * -(-q.shape[1] // fmt.block[1]) if fmt.block != (0, 0) else 1)
        assert len(held) == 2 * 7   # q, k, v, o, gate, up, down in 2 layers
        layer = model.layers["0"]
        w = layer.attn.wq.weight
        assert w.dtype == mod.DTYPE and tuple(w.shape) == (128, 64) and not isinstance(w, torch.nn.Parameter)
    elif fmt.family == "int4":
        for q in held:
            assert isinstance(q, rq.Int4Weight) and q.qweight.dtype == torch.int32 and q.scales.dtype == torch.float16
            assert q.qweight.nbytes == q.shape[0] * q.shape[1] // 2
            assert q.nbytes == FORMATS["int4-awq"].weight_bytes(q.shape) + 4 * q.shape[1]   # + each input's group
        assert len(held) == 2 * 7
        w = model.layers["0"].mlp.w2.weight
        assert w.dtype == mod.DTYPE and tuple(w.shape) == (128, 256)
    else:
        for q in held:
            assert isinstance(q, rq.MXFP4Weight) and q.blocks.dtype == torch.uint8 and q.scales.dtype == torch.uint8
            assert q.blocks.nbytes == q.shape[0] * q.shape[1] // 2 and q.scales.nbytes == q.shape[0] * q.shape[1] // 32
            assert q.nbytes == FORMATS["mxfp4"].weight_bytes(q.shape)
        assert len(held) == 2 * 4 * 3   # w1, w3, w2 of 4 experts in 2 layers
        assert all(".experts." in q.global_name for q in held)
        assert "layers.0.attn.wq.weight" in names   # attention stays 16-bit (modules_to_not_convert)


# --------------------------------------------------------------------------- the rule itself


def test_fp8_block_dequantization_cuts_the_edge_blocks():
    """A weight whose sides are no multiple of the block (DeepSeek-V3's 576-row
    kv_a_proj_with_mqa): ceil(out/b0) x ceil(in/b1) scales, the last ones cut; a shard read
    from the covering blocks (rows 5..17, columns 3..20 of a 20 x 21 weight in 8 x 8 blocks)
    is exactly those elements of the whole dequantized weight."""
    torch.manual_seed(0)
    q = torch.randn(20, 21).to(torch.float8_e4m3fn)
    s = torch.rand(3, 3) + 0.5
    whole = q.float() * s.repeat_interleave(8, 0)[:20].repeat_interleave(8, 1)[:, :21]
    rows, cols = torch.arange(5, 17) // 8, torch.arange(3, 20) // 8
    w = rq.FP8Weight(q, "fp8-block8x8", torch.float32, q[5:17, 3:20], s[rows.min():rows.max() + 1, :],
                     (rows - rows.min()).int(), cols.int())
    assert torch.equal(w.dequantize(), whole[5:17, 3:20])


def test_mxfp4_dequantization_is_transformers():
    """runtime/model/quant.py's MXFP4 rule is transformers' ``convert_moe_packed_tensors`` (one
    expert, its transpose)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (1, 6, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 134, (1, 6, 3), dtype=torch.uint8, generator=g)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)[0].t()
    assert torch.equal(rq.dequantize_mxfp4(blocks[0], scales[0], torch.float32), want)


class _Slice:
    """A tensor as safetensors' ``get_slice`` shows it (``[...]``, ``get_shape``, ``get_dtype``)."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    def __getitem__(self, idx):
        return self.t[idx]

    def get_shape(self):
        return list(self.t.shape)

    def get_dtype(self):
        return {torch.int32: "I32", torch.float16: "F16"}[self.t.dtype]


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_shard_inside_words_and_groups(method):
    """An int4 shard whose rows start inside a packed word (out 3..19 of 24) and whose
    columns start inside a word and a group (in 77..200 of 256): runtime/quant.read keeps the
    covering words and groups, and dequantizes to exactly those elements of the whole weight."""
    from parcompile.core.families.base import Source

    g = torch.Generator().manual_seed(2)
    out, inp = 24, 256
    q = torch.randint(0, 16, (out, inp), generator=g)
    zero = torch.randint(1, 16, (out, inp // 128), generator=g)   # GPTQ v1 stores zero - 1: no zero of 0
    scale = (torch.rand(out, inp // 128, generator=g) + 0.5).half()
    whole = ((q - zero.repeat_interleave(128, 1)).half() * scale.repeat_interleave(128, 1)).float()
    if method == "awq":
        order = (0, 2, 4, 6, 1, 3, 5, 7)
        tensors = {"w.qweight": _pack_int4(q.t(), 1, order), "w.qzeros": _pack_int4(zero.t(), 1, order)}
    else:
        tensors = {"w.qweight": _pack_int4(q.t(), 0), "w.qzeros": _pack_int4(zero.t() - 1, 1),
                   "w.g_idx": (torch.arange(inp) // 128).int()}
    tensors["w.scales"] = scale.t().contiguous()
    reader = rq.Reader(lambda name: _Slice(tensors[name]), {k: Path("m.safetensors") for k in tensors})
    p = torch.nn.Parameter(torch.empty(16, 123))
    p.global_name, p.global_shape = "layers.0.mlp.w1.weight", (out, inp)
    w = rq.read(reader, Source("w.weight", (out, inp)), p, FORMATS[f"int4-{method}"], (3, 19), (77, 200),
                torch.float32, "cpu", zero_add=1 if method == "gptq" else 0)
    assert w.shape == (16, 123) and torch.equal(w.dequantize(), whole[3:19, 77:200])


# --------------------------------------------------------------------------- broken checkpoints


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_broken")
    _save_fp8_block(root / "hf")
    return root / "hf"


def _broken(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    sd = safetensors_torch.load_file(dst / "model.safetensors")
    edit(sd)
    safetensors_torch.save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _check(tmp_path: Path, capsys) -> tuple[int, str]:
    (tmp_path / "s.par").write_text('model m from "hf/config.json" { dtype = fp32 }\ncluster c from "cpu" { }\n'
                                    'serve { batch = 2, prompt_len = 6, max_new_tokens = 8, weights = "hf" }\n')
    code = main(["check", str(tmp_path / "s.par")])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_check_names_a_missing_scale_and_a_wrong_shape(fp8_dir, tmp_path, capsys):
    """`parcompile check` of a serve spec whose FP8 checkpoint lacks one weight's scales and
    has another's of the wrong shape: one diagnostic each, naming the file, the tensor, what
    it needs and what it found; no traceback (main returns 1)."""
    scale = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    other = "model.layers.1.mlp.down_proj.weight_scale_inv"

    def edit(sd):
        del sd[scale]
        sd[other] = sd[other][:, :1].contiguous()

    _broken(fp8_dir, tmp_path / "hf", edit)
    code, text = _check(tmp_path, capsys)
    assert code == 1 and "Traceback" not in text
    file = tmp_path / "hf" / "model.safetensors"
    assert f"`{file}` stores `model.layers.0.self_attn.q_proj.weight`" in text
    assert f"has no `{scale}` (F32 or BF16 or F16 (4, 2))" in text
    assert f"`{file}`: `{other}` is F32 (2, 1); this model's `layers.1.mlp.w2.weight` (64, 96)" in text
    assert "needs F32 or BF16 or F16 (2, 3)" in text


def test_a_rank_reports_a_missing_scale_in_one_line(fp8_dir, tmp_path):
    """A serve program compiled against a good checkpoint whose files then lose a scale: its
    load raises WeightsError (the program prints it as one line) naming the tensor."""
    from parcompile.runtime.state.weights import WeightsError

    build_serve(_spec(fp8_dir.parent, 1, "good"), tmp_path / "prog")
    scale = "model.layers.1.self_attn.k_proj.weight_scale_inv"
    _broken(fp8_dir, tmp_path / "hf", lambda sd: sd.pop(scale))
    with pytest.raises(WeightsError, match=f"has no `{scale}` \\(F32 or BF16 or F16 \\(2, 2\\)\\) for "
                                           "`layers.1.attn.wk.weight`"):
        _stage(tmp_path / "prog", tmp_path / "hf")


def test_check_refuses_fp8_tensors_without_a_quantization_config(fp8_dir, tmp_path, capsys):
    """FP8 tensors in a checkpoint whose config.json has no quantization_config (its scales'
    meaning unknown): an error naming the file and the tensor."""
    shutil.copytree(fp8_dir, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    code, text = _check(tmp_path, capsys)
    assert code == 1 and "Traceback" not in text
    assert (f"`{tmp_path / 'hf' / 'model.safetensors'}`: `model.layers.0.self_attn.q_proj.weight` is stored as "
            "F8_E4M3, but its config.json has no quantization_config") in text


def test_check_mxfp4_blocks_of_another_shape(served, tmp_path):
    """gpt-oss MXFP4 blocks of the wrong width (the experts' hidden halved): check_checkpoint
    names the blocks and the shape this model needs."""
    src = served["mxfp4"]["root"] / "hf"
    name = "model.layers.1.mlp.experts.down_proj_blocks"
    _broken(src, tmp_path / "hf", lambda sd: sd.__setitem__(name, sd[name][:, :32].contiguous()))
    from parcompile.core.hf import from_hf_dict
    from parcompile.core.model import ModelKeys

    keys = {k: v for k, v in from_hf_dict(json.loads((src / "config.json").read_text())).items() if v is not None}
    model = ModelKeys(**{**keys, "seq_len": 16, "dtype": "fp32"})
    text = "\n".join(p.message for p in check_checkpoint(tmp_path / "hf", expected_shapes(model), model))
    assert f"`{name}` is U8 (4, 32, 1, 16)" in text and "needs U8 (4, 64, 1, 16)" in text


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq_broken")
    _save_int4(root / "hf", "gptq")
    return root / "hf"


@pytest.mark.parametrize("group", [7, -1])
def test_a_rank_refuses_a_gptq_g_idx_outside_the_groups(gptq_dir, tmp_path, group):
    """A GPTQ `g_idx` naming a group the checkpoint's `qzeros` and `scales` do not have (the
    down projection's 256 inputs have groups 0 and 1): the load raises WeightsError naming the
    file and the tensor (was: the load passed and the first forward died in index_select)."""
    from parcompile.runtime.state.weights import WeightsError

    build_serve(_spec(gptq_dir.parent, 1, "good"), tmp_path / "prog")
    name = "model.layers.0.mlp.down_proj.g_idx"
    _broken(gptq_dir, tmp_path / "hf", lambda sd: sd.__setitem__(name, torch.full_like(sd[name], group)))
    with pytest.raises(WeightsError, match=f"model.safetensors: `{name}` holds group {group}, outside the 2 groups"):
        _stage(tmp_path / "prog", tmp_path / "hf")


@pytest.mark.parametrize("block", [[10**20, 1], [1, 2**63]])
def test_check_refuses_a_block_size_past_int32(fp8_dir, tmp_path, capsys, block):
    """A weight_block_size side past 2**31 - 1 (no weight is that long; a rank holds its
    blocks' indices as int32): an error at the key in `parcompile check` (was: no error there,
    and a rank's load died of an OverflowError (10**20) or its first forward in index_select
    (2**63), the scales of such blocks being of the right shape)."""
    from parcompile.core.quant import QuantConfigError, from_quantization_config

    def edit(sd):   # scales of the shape such blocks give: the checkpoint is otherwise well formed
        for k in [k for k in sd if k.endswith("weight_scale_inv")]:
            rows, cols = sd[k.removesuffix("_scale_inv")].shape
            sd[k] = torch.ones(-(-rows // block[0]), -(-cols // block[1]))

    _broken(fp8_dir, tmp_path / "hf", edit)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = block
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    code, text = _check(tmp_path, capsys)
    assert code == 1 and "Traceback" not in text
    assert f"quantization_config.weight_block_size must be two positive integers of at most 2147483647, got {block}" in text
    assert from_quantization_config({"quant_method": "fp8", "weight_block_size": [2**31 - 1, 1]}).block == (2**31 - 1, 1)
    with pytest.raises(QuantConfigError):
        from_quantization_config({"quant_method": "fp8", "weight_block_size": [2**31, 1]})


def test_fp8_made_on_load_in_blocks_longer_than_the_weight(tmp_path):
    """weight_dtype = fp8 made on load (the seeded weights) in blocks of 2**31 - 1 rows by 1
    column (the longest weight_block_size a checkpoint may give, which a program compiled
    against it keeps for any other weights, `--weights seed` included): one scale per column
    of each weight, its rows whole (was: each weight zero-padded to whole blocks first, a
    (2**31 - 1) x in fp32 buffer: a rank died of "can't allocate memory")."""
    model = dict(layers=1, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab=256, seq_len=32)
    build_serve(serve_config(model=model, serve=dict(weight_dtype="fp8", weight_format=f"fp8-block{2**31 - 1}x1")),
                tmp_path / "prog")
    _, stage = _stage(tmp_path / "prog", None)
    w2 = next(q for q in rq.held(stage) if q.global_name == "layers.0.mlp.w2.weight")
    assert tuple(w2.scale.shape) == (1, 96) and tuple(w2.data.shape) == (64, 96)
