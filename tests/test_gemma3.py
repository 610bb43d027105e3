"""Gemma 3 (`gemma3_text`, issue 18) against transformers' own Gemma3ForCausalLM (fp32, CPU).

A tiny random Gemma3TextConfig (4 layers, hidden 64, head_dim 16, sliding window 4 on
layers 0, 1 and 3, layer 2 global (``sliding_window_pattern = 3``), local and global RoPE
bases, ``query_pre_attn_scalar`` 24, tied embeddings), with and without linear RoPE scaling
of the global layers, saved with ``save_pretrained``. Its config.json is imported with
``from_hf_dict``; the plan's parameter count must equal transformers'; ``load_hf`` fills a
single-process program whose logits (16 tokens, past the window) must equal transformers';
the serve program's greedy tokens equal ``generate``; ``hf_output`` of a short fine-tune
loads back with ``from_pretrained``. Every new rule is read off transformers' module
(zero-centred norms, sandwich norms, scaled embeddings, GeGLU, scores scaled by
``query_pre_attn_scalar``), never from parcompile's output.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from parcompile.core.hf import HFConfigError, from_hf_dict
from parcompile.core.hf_weights import expected_shapes, hf_family
from tests.family_utils import assert_logits_equal, check_written_back, fine_tune, import_keys, stage_from_hf
from tests.program_utils import tiny_config
from tests.serve_utils import build_serve, run_in_process

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (pip install -e .[test])")

LAYERS, WINDOW = 4, 4


def _hf_config(scaling: float | None, **extra):
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    if scaling:
        rope["full_attention"] = {"rope_type": "linear", "factor": scaling, "rope_theta": 1e6}
    return transformers.Gemma3TextConfig(**{**dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
        sliding_window=WINDOW, sliding_window_pattern=3, query_pre_attn_scalar=24, rope_parameters=rope,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None), **extra})


def _save(scaling: float | None, path: Path):
    torch.manual_seed(23)
    hf = transformers.Gemma3ForCausalLM(_hf_config(scaling)).float().eval()
    hf.config._attn_implementation = "eager"
    with torch.no_grad():   # Gemma's norms start at 0 ((1 + w) = 1): make them matter
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.normal_(0.0, 0.5)
    hf.save_pretrained(path, safe_serialization=True)
    return hf




@pytest.fixture(scope="module", params=[None, 2.0], ids=["default_rope", "linear_rope"])
def case(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma3")
    hf = _save(request.param, tmp / "hf")
    keys = import_keys(tmp / "hf")
    cfg = tiny_config(model=keys, name="gemma3")
    stage, plan = stage_from_hf(cfg, tmp / "hf", tmp / "prog")
    return dict(scaling=request.param, tmp=tmp, hf=hf, cfg=cfg, stage=stage, plan=plan)




def test_import_maps_every_field(case):
    m, hf = case["cfg"].model, case["hf"]
    assert [bool(w) for w in m.layer_windows] == [k == "sliding_attention" for k in hf.config.layer_types]
    assert (m.sliding_window, m.head_dim, m.query_pre_attn_scalar) == (WINDOW, 16, 24.0)
    assert (m.rope_theta, m.rope_local_base_freq, m.rope_scaling_factor) == (1e6, 1e4, case["scaling"] or 1.0)
    assert (m.zero_centered_gamma, m.sandwich_norm, m.scale_embeddings, m.activation, m.qk_norm) == (
        True, True, True, "geglu", True)
    assert m.tie_embeddings and hf_family(m) == "gemma3_text"


def test_parameter_count_equals_transformers(case):
    total = sum(p.numel() for p in case["hf"].parameters())
    assert case["plan"]["model"]["params"] == total
    assert sum(math.prod(s) for s in expected_shapes(case["cfg"].model).values()) == total


def test_logits_equal_transformers(case):
    assert_logits_equal(case["stage"], case["hf"], case["cfg"].model.vocab)


def test_greedy_serving_equals_generate(case, tmp_path):
    src = ('model m from "hf/config.json" { dtype = fp32 }\ncluster c from "cpu" { gpus_per_node = 1 }\n'
           'parallel { }\nserve { batch = 2, prompt_len = 6, max_new_tokens = 8, weights = "hf" }\n')
    (case["tmp"] / "s.par").write_text(src)
    from parcompile.frontend import load_spec

    cfg, _ = load_spec(case["tmp"] / "s.par")
    plan = build_serve(cfg, tmp_path / "prog")
    prompts = [[5, 17, 99, 3, 250, 42], [7, 7, 120, 9, 31, 299]]
    with torch.no_grad():
        want = case["hf"].generate(torch.tensor(prompts), max_new_tokens=8, do_sample=False,
                                   attention_mask=torch.ones(2, 6, dtype=torch.long))[:, 6:].tolist()
    got = run_in_process(tmp_path / "prog", sum((["--prompt-ids", ",".join(map(str, p))] for p in prompts), []))
    assert got["tokens"] == want
    # three sliding layers keep 4 tokens, the global one all 14: 2 x (K, V) x 2 kv heads x 16 x 4 bytes each
    per = 2 * 2 * 16 * 4
    assert got["cache_bytes"] == plan["serve"]["kv_cache_bytes_per_rank"] == 2 * per * (3 * WINDOW + 14)


PROMPTS = [[5, 17, 99, 3, 250, 42], [7, 7, 120, 9, 31, 299]]


def _serve_spec(root: Path, tp: int):
    from parcompile.frontend import load_spec

    spec = root / f"serve_tp{tp}.par"
    spec.write_text('model m from "hf/config.json" { dtype = fp32 }\n'
                    f'cluster c from "cpu" {{ gpus_per_node = {tp} }}\nparallel {{ tp = {tp} }}\n'
                    'serve { batch = 2, prompt_len = 6, max_new_tokens = 8, weights = "hf" }\n')
    cfg, _ = load_spec(spec)
    return cfg


@pytest.fixture(scope="module")
def tp2_served(tmp_path_factory):
    """Both cases served under tp 2 in one torchrun launch of 2 ranks (a launch costs more
    than both runs on CI's 2 cores): rope scaling -> (plan, each rank's record)."""
    from tests.serve_utils import serve_cases_in_one_launch

    return serve_cases_in_one_launch(tmp_path_factory, "gemma3_tp2", (None, 2.0), _save, _serve_spec, PROMPTS)


@pytest.mark.torchrun
def test_tp2_greedy_serving_equals_generate(case, tp2_served):
    """tp 2 (one launch for both cases): heads, kv heads, the GeGLU and the sandwich norms
    split as planned; the tokens equal transformers' generate and each rank's cache the plan's."""
    from tests.serve_utils import replica_tokens

    plan, recs = tp2_served[case["scaling"]]
    with torch.no_grad():
        want = case["hf"].generate(torch.tensor(PROMPTS), max_new_tokens=8, do_sample=False,
                                   attention_mask=torch.ones(2, 6, dtype=torch.long))[:, 6:].tolist()
    assert replica_tokens(recs) == want
    assert all(r["cache_bytes"] == plan["serve"]["kv_cache_bytes_per_rank"] for r in recs)


def test_hf_output_of_a_fine_tune_loads_back_in_transformers(case, tmp_path):
    cfg = case["cfg"]
    out = fine_tune(cfg, case["tmp"] / "hf", tmp_path)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "gemma3_text"
    check_written_back(cfg, out, case["hf"], tmp_path / "prog_back", moved=("post_feedforward_layernorm",))


def test_a_layer_arrangement_without_a_pattern_is_refused():
    raw = _hf_config(None).to_dict()
    raw["layer_types"] = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    with pytest.raises(HFConfigError, match="not on every Nth layer") as e:
        from_hf_dict(raw)
    assert "sliding_window_pattern" in e.value.help


def test_soft_capping_is_refused():
    raw = _hf_config(None).to_dict()
    raw["final_logit_softcapping"] = 30.0
    with pytest.raises(HFConfigError, match="soft-capping"):
        from_hf_dict(raw)


def test_gemma3_27b_preset_counts_as_transformers_and_plans(tmp_path):
    """The preset against transformers' module of google/gemma-3-27b-it's text_config
    (written out here, meta device), and a plan on 2 x 8 H100."""
    import parcompile

    hcfg = transformers.Gemma3TextConfig(
        vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
        num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168, sliding_window=1024,
        max_position_embeddings=131072,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    with torch.device("meta"):
        total = sum(p.numel() for p in transformers.Gemma3ForCausalLM(hcfg).parameters())
    spec = tmp_path / "g.par"
    spec.write_text('model g from "gemma3-27b" { seq_len = 8192 }\ncluster c from "h100-sxm" { nodes = 2 }\n'
                    'parallel { tp = 8, pp = 2, sequence_parallel = true, global_batch = 64 }\n')
    plan = parcompile.compile(spec)
    assert plan.data["model"]["params"] == total == 27_009_346_304
    windows = plan.config.model.layer_windows
    assert windows.count(0) == 10 and set(windows) == {0, 1024}   # layers 5, 11, ..., 59 global
    assert plan.data["memory"]["fits"]


def test_the_preset_made_all_global_plans_and_a_written_local_base_without_windows_is_an_error(tmp_path):
    """`sliding_window = 0` on the preset: every layer global, its cache 4.75x the
    five-in-six local one at 17k tokens; rope_local_base_freq written by the user on a model
    without windows is a spanned error."""
    import parcompile

    def kv(extra: str) -> int:
        spec = tmp_path / "s.par"
        spec.write_text(f'model g from "gemma3-27b" {{ {extra} }}\ncluster c from "h100-sxm" {{ }}\n'
                        'parallel { tp = 8 }\nserve { batch = 32, prompt_len = 16384, max_new_tokens = 1024 }\n')
        return parcompile.compile(spec).data["serve"]["kv_cache_bytes_per_rank"]

    per_layer_token = 2 * 2 * 128 * 2       # K, V; 16 kv heads / tp 8; head_dim 128; bf16
    tokens = 16384 + 1024
    assert kv("") == 32 * per_layer_token * (10 * tokens + 52 * 1024)
    assert kv("sliding_window = 0") == 32 * per_layer_token * 62 * tokens
    spec = tmp_path / "e.par"
    spec.write_text('model g from "gemma3-27b" { sliding_window = 0, rope_local_base_freq = 1e4 }\n'
                    'cluster c from "h100-sxm" { }\nparallel { tp = 8 }\n')
    with pytest.raises(parcompile.SpecError) as e:
        parcompile.compile(spec)
    [d] = [d for d in e.value.diagnostics if "rope_local_base_freq" in d.message]
    assert d.span.line == 1 and "sliding-window" in d.message
