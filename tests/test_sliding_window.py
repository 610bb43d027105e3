"""Sliding-window attention in serving: a sliding-window layer's KV cache keeps only its
last `window` tokens (the plan says so, the program allocates so), and the greedy tokens
still equal transformers' `generate` of the same checkpoint when prompt + new tokens run
past the window. One process, transformers' own Mistral as the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.serve_utils import build_serve, run_in_process

WINDOW = 4


def _mistral(tmp_path: Path, window: int):
    transformers = pytest.importorskip("transformers")
    hcfg = transformers.MistralConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, sliding_window=window,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(11)
    hf = transformers.MistralForCausalLM(hcfg).float().eval()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    return hf


def _spec(tmp_path: Path, prompt_len: int, new: int):
    from parcompile.frontend import load_spec

    src = ('model m from "hf/config.json" { dtype = fp32 }\ncluster c from "cpu" { gpus_per_node = 1 }\n'
           f'parallel {{ }}\nserve {{ batch = 2, prompt_len = {prompt_len}, max_new_tokens = {new}, weights = "hf" }}\n')
    (tmp_path / "s.par").write_text(src)
    cfg, _ = load_spec(tmp_path / "s.par")
    return cfg


def test_a_sliding_window_cache_stops_growing_at_the_window_and_tokens_equal_transformers(tmp_path):
    hf = _mistral(tmp_path, WINDOW)
    cfg = _spec(tmp_path, 6, 8)
    assert cfg.model.sliding_window == WINDOW
    plan = build_serve(cfg, tmp_path / "prog")
    sv = plan["serve"]
    # 2 layers x 2 (K, V) x 2 kv heads x 16 x 4 bytes per token; each layer keeps WINDOW of the 14 tokens
    per_token = 2 * 2 * 2 * 16 * 4
    assert sv["kv_bytes_per_token"] == per_token
    assert sv["kv_cache_bytes_per_rank"] == 2 * WINDOW * per_token          # batch 2, not 2 * 14 tokens
    prompts = [[5, 17, 99, 3, 250, 42], [7, 7, 120, 9, 31, 299]]
    with torch.no_grad():
        want = hf.generate(torch.tensor(prompts), max_new_tokens=8, do_sample=False,
                           attention_mask=torch.ones(2, 6, dtype=torch.long))[:, 6:].tolist()
    got = run_in_process(tmp_path / "prog", sum((["--prompt-ids", ",".join(map(str, p))] for p in prompts), []))
    assert got["tokens"] == want
    assert got["cache_bytes"] == sv["kv_cache_bytes_per_rank"]


def test_the_cache_of_a_longer_context_grows_only_in_full_attention_layers(tmp_path):
    from parcompile.frontend import load_spec
    from parcompile.driver import compile_config

    def kv(prompt_len: int, pattern: int) -> int:
        src = ("model m { layers = 6, hidden = 64, heads = 4, vocab = 256, seq_len = 512, sliding_window = 16, "
               f"sliding_window_pattern = {pattern}, dtype = bf16 }}\n"
               'cluster c from "cpu" { gpus_per_node = 1 }\nparallel { }\n'
               f"serve {{ batch = 1, prompt_len = {prompt_len}, max_new_tokens = 1 }}\n")
        (tmp_path / "k.par").write_text(src)
        cfg, _ = load_spec(tmp_path / "k.par")
        return compile_config(cfg).data["serve"]["kv_cache_bytes_per_rank"]

    per_layer_token = 2 * 4 * 16 * 2                     # K and V, 4 kv heads x head_dim 16, bf16
    # pattern 3: layers 2 and 5 are global, the other four keep at most 16 tokens
    assert kv(127, 3) == per_layer_token * (2 * 128 + 4 * 16)
    assert kv(255, 3) - kv(127, 3) == per_layer_token * 2 * 128
    # short contexts: every layer keeps every token
    assert kv(7, 3) == per_layer_token * 6 * 8


def test_model_flops_of_local_layers_are_bounded_by_the_window(tmp_path):
    """Attention FLOPs (matmul, fwd + 2x bwd: 3 x 4 b s s_kv d per head, no causal
    halving, ir/ops/attention.py) of a local layer use s_kv = window: Gemma-style pattern 3 on 6
    layers has 4 local layers, each saving 12 b s (s - w) heads d against full attention."""
    import parcompile

    def flops(window: int, pattern: int) -> int:
        (tmp_path / "f.par").write_text(
            f"model m {{ layers = 6, hidden = 64, heads = 4, vocab = 256, seq_len = 64, sliding_window = {window}, "
            f"sliding_window_pattern = {pattern} }}\n"
            'cluster c from "cpu" { gpus_per_node = 1 }\nparallel { micro_batch = 2, global_batch = 2 }\n')
        return parcompile.compile(tmp_path / "f.par").data["compute"]["model_flops_per_step"]

    b, s, w, heads, d = 2, 64, 16, 4, 16
    assert flops(0, 0) - flops(w, 3) == 4 * 3 * 4 * b * s * (s - w) * heads * d


def test_a_decode_step_reads_at_most_the_window_of_a_local_layer(tmp_path):
    """The serving estimate's cache read per decode step (``breakdown.decode_kv``) at the mean
    context P + G / 2 = 1,100 tokens, the new token's own keys aside (analysis/serve_steps.py
    ``Segment.cached``: 1,099 cached): a sliding-window layer reads its 128, a global layer all
    1,099 (pattern 2: layers 1 and 3 global of 4), against the same model without windows."""
    from parcompile.driver import compile_config
    from parcompile.frontend import load_spec

    def decode_kv(window: str) -> float:
        src = (f"model m {{ layers = 4, hidden = 64, heads = 4, vocab = 256, seq_len = 2048{window}, dtype = bf16 }}\n"
               'cluster c from "h100-sxm" { gpus_per_node = 1 }\nparallel { }\n'
               "serve { batch = 2, prompt_len = 1000, max_new_tokens = 200 }\n")
        (tmp_path / "d.par").write_text(src)
        cfg, _ = load_spec(tmp_path / "d.par")
        return compile_config(cfg).data["serve"]["breakdown"]["decode_kv"]

    full = decode_kv("")
    local = decode_kv(", sliding_window = 128, sliding_window_pattern = 2")
    assert local / full == pytest.approx((2 * 1099 + 2 * 128) / (4 * 1099), rel=1e-12)


def test_serving_mask_takes_a_window_longer_than_any_tensor_compares_with():
    """A spec may write ``sliding_window = 10**30`` (the checks warn, no more): the serving
    mask (runtime/serve/generate.py Requests.step) is the full causal one, not an
    OverflowError in every rank (the training mask: core_attention.causal_mask)."""
    import torch

    from parcompile.runtime.serve.generate import Requests

    for step in ((0, 5), (5, 6)):
        huge = Requests([[1, 2, 3], [4, 5, 6, 7, 8]], 4, (10**30, 0), torch.device("cpu")).step(*step)
        assert torch.equal(huge.masks[10**30], huge.masks[0])
