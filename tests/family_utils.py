"""What the model-family tests share (Qwen3-MoE, Gemma 3, gpt-oss against transformers):
import a saved ``config.json``, build a single-process program filled from the Hugging
Face checkpoint, its logits, and a short fine-tune that writes ``hf_output``."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import torch

from parcompile import runtime as rt
from parcompile.core.hf import from_hf_dict
from parcompile.runtime.distributed.context import init_parallel
from parcompile.runtime.state.weights import load_hf
from tests.program_utils import build_program

B, T = 2, 16   # the batch and the tokens the families' logits are compared on


def import_keys(directory: Path, seq_len: int = T) -> dict:
    """The `model` keys of ``directory/config.json`` (None dropped), fp32, ``seq_len`` tokens."""
    keys = {k: v for k, v in from_hf_dict(json.loads((directory / "config.json").read_text())).items()
            if v is not None}
    keys.update(seq_len=seq_len, dtype="fp32")
    return keys


def stage_from_hf(cfg, hf_dir: Path, out: Path):
    """The single-process program of ``cfg`` written into ``out``, its Stage filled from the
    checkpoint ``hf_dir`` (``load_hf``); returns (stage, plan dict)."""
    module, plan = build_program(cfg, out)
    with rt.no_init():
        stage = module.Stage(plan, init_parallel(plan))
    load_hf(stage, str(hf_dir))
    return stage, plan


def token_ids(vocab: int) -> torch.Tensor:
    """(B, T) token ids, the same in every family test."""
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(0))


def logits(stage, ids: torch.Tensor) -> torch.Tensor:
    """The stage's (B, T, V') logits in eval mode, no gradient."""
    stage.eval()
    with torch.no_grad():
        return stage.forward_chunk(0, ids)


def fine_tune(cfg, init_from: Path, out: Path, steps: int = 2) -> Path:
    """``steps`` steps of ``cfg``'s single-process program from ``init_from`` with
    ``hf_output``: the program's own ``main()`` in this process (as verify runs its
    reference). Returns the written Hugging Face directory."""
    hf_out = out / "hf_out"
    cfg = cfg.model_copy(update=dict(train=cfg.train.model_copy(update=dict(
        init_from=str(init_from), hf_output=str(hf_out), steps=steps, lr=1e-2))))
    module, _ = build_program(cfg, out / "prog")
    saved = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if k in os.environ}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            module.main(["--plan", str(out / "prog" / "plan.json"), "--metrics-dir", str(out / "metrics"),
                         "--steps", str(steps), "--checkpoint-dir", ""])
    finally:
        os.environ.update(saved)
    return hf_out


def assert_logits_equal(stage, hf, vocab: int) -> None:
    """The stage's logits of :func:`token_ids` equal the transformers model ``hf``'s (fp32,
    1e-5), which must not be flat (a model whose outputs barely vary proves nothing)."""
    ids = token_ids(vocab)
    ours = logits(stage, ids)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    assert ref.std() > 1e-3
    torch.testing.assert_close(ours[..., :vocab], ref, atol=1e-5, rtol=1e-5)


def check_written_back(cfg, out: Path, ref_hf, prog: Path, moved: tuple[str, ...]):
    """The Hugging Face directory ``out`` a fine-tune of ``cfg`` wrote: transformers loads
    it (eager attention) with ``ref_hf``'s tensor names and layer kinds, the tensors whose
    names hold each of ``moved`` changed, parcompile reads it back (written into ``prog``)
    with the logits transformers gives, its config.json imports as the same model, and
    its safetensors headers hold every expected shape. Returns the loaded model."""
    import transformers

    from parcompile.core.hf_weights import check_checkpoint, expected_shapes
    from tests.program_utils import tiny_config

    back = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    back.config._attn_implementation = "eager"
    ref_sd, got_sd = ref_hf.state_dict(), back.state_dict()
    assert set(ref_sd) == set(got_sd)
    changed = [k for k in ref_sd if not torch.equal(ref_sd[k], got_sd[k])]
    for part in moved:
        assert any(part in k for k in changed), part
    for attr in ("layer_types", "rope_parameters"):
        assert getattr(back.config, attr, None) == getattr(ref_hf.config, attr, None), attr
    stage, _ = stage_from_hf(cfg, out, prog)
    assert_logits_equal(stage, back, cfg.model.vocab)
    assert tiny_config(model=import_keys(out)).model == cfg.model
    assert not check_checkpoint(out, expected_shapes(cfg.model), cfg.model)
    return back


def tiny_qwen3():
    """A tiny Qwen3 (qk-norm, its own head_dim 32, 2 layers, h 64, 300 tokens) with random
    weights, norms drawn from [0.5, 1.5]: the one the qk-norm and quantized-weights tests
    save and serve."""
    import transformers

    hcfg = transformers.Qwen3Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, tie_word_embeddings=False,
        use_sliding_window=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(9)
    hf = transformers.Qwen3ForCausalLM(hcfg).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return hf


def tiny_gpt_oss(vocab: int, hidden: int, expert_ffn: int, experts: int, top_k: int):
    """A tiny gpt-oss (biased router and experts, the clamped SwiGLU, attention sinks, a
    sliding and a full layer, YaRN RoPE) with random weights, its biases small beside the
    experts' output so that both show in the tokens."""
    import transformers

    hcfg = transformers.GptOssConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=expert_ffn, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, sliding_window=4,
        num_local_experts=experts, num_experts_per_tok=top_k, router_aux_loss_coef=0.0, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 2.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32},
        layer_types=["sliding_attention", "full_attention"], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(5)
    hf = transformers.AutoModelForCausalLM.from_config(hcfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("router.weight"):
                p.normal_(0.0, 0.5)
            elif "bias" in n:
                p.normal_(0.0, 0.05)
            elif "sinks" in n:
                p.normal_(0.0, 1.0)
            elif "experts" in n:
                p.normal_(0.0, 0.1)
    return hf
