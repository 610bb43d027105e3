"""qk-norm (issue 17: adding an op kind is one table row plus its runtime module; the first
op issue 18's Qwen3 and Gemma 3 need): RMSNorm over head_dim of every q and k head, one
``(head_dim,)`` weight each, replicated over tp with its gradient summed over tp.

Expected values are written from the model's sizes here, not read off the plan. The
numerics are held elsewhere: against transformers' Qwen3 (tests/test_reference_hf.py,
tests/test_hf_weights.py, tests/test_serve.py) and across layouts under torchrun
(tests/test_verify.py, the ``*qk_norm`` cases).
"""

from __future__ import annotations

from parcompile.driver import compile_config
from tests.program_utils import tiny_config

# tiny_config: 4 layers, hidden 64, heads 4, kv_heads 2 -> head_dim 16; micro_batch 2, seq_len 16, fp32
LAYERS, HEAD_DIM, HEADS, KV_HEADS, B, S, E = 4, 16, 4, 2, 2, 16, 4


def _plan(qk_norm: bool, tp: int = 1, pp: int = 1, sp: bool = False):
    return compile_config(tiny_config(tp=tp, pp=pp, model=dict(qk_norm=qk_norm),
                                      parallel=dict(sequence_parallel=sp)))


def _step(plan, where: str) -> list[tuple[int, int]]:
    return [(c["stage"], c["bytes"]) for c in plan.data["comm"]["collectives"] if c["where"] == where]


def test_parameters_two_head_dim_vectors_per_layer_and_no_flops():
    with_, without = _plan(True), _plan(False)
    assert with_.data["model"]["params"] - without.data["model"]["params"] == LAYERS * 2 * HEAD_DIM
    # model FLOPs count matmuls only (SPEC 3): a norm adds none
    assert with_.data["compute"]["model_flops_per_step"] == without.data["compute"]["model_flops_per_step"]


def test_the_op_sits_between_the_projection_and_rope_split_on_heads_with_a_replicated_weight():
    g = _plan(True, tp=2).graph
    for name, src, dim in (("q_norm", "wq", "q"), ("k_norm", "wk", "kv")):
        nd = g.node(f"layers.1.attn.{name}")
        assert nd.kind == "qk_norm"
        assert g.inputs(nd.name) == [f"layers.1.attn.{src}"]
        assert [v for v, _ in g.users(nd.name)] == [f"layers.1.attn.rope_{name[0]}"]
        assert nd.sharding.axis_of(dim) == "tp"                 # heads split: no collective
        (w,) = nd.params
        assert w.name == f"layers.1.attn.{name}.weight" and w.type.shape == (HEAD_DIM,)
        assert not w.sharding.split and w.grad_partial == ("tp",)
    (w,) = _plan(True, tp=1).graph.node("layers.0.attn.q_norm").params
    assert w.grad_partial == ()                                 # tp = 1: nothing to sum


def test_gradients_summed_over_tp_once_per_step():
    per_stage = 4 * 2 * HEAD_DIM * (LAYERS // 2)               # fp32 gradients of the stage's qk-norm weights
    assert _step(_plan(True, tp=2, pp=2), "tp_partial_grads") == [(0, per_stage), (1, per_stage)]
    assert _step(_plan(False, tp=2, pp=2), "tp_partial_grads") == []
    assert _step(_plan(True, tp=1), "tp_partial_grads") == []
    # sequence parallelism sums every tp-replicated gradient already: the weights join that one
    with_, without = _step(_plan(True, tp=2, sp=True), "sp_norm_grads"), _step(_plan(False, tp=2, sp=True),
                                                                                "sp_norm_grads")
    assert _step(_plan(True, tp=2, sp=True), "tp_partial_grads") == []
    assert with_[0][1] - without[0][1] == 4 * 2 * HEAD_DIM * LAYERS


def test_saved_activations_are_the_norm_inputs_and_their_rms():
    tp = 2
    rows = B * S * (HEADS + KV_HEADS) // tp                    # (token, local head) pairs of q and k
    want = rows * HEAD_DIM * E + rows * 4                       # the projections' outputs + fp32 1/rms each
    got = [a - b for (_, a), (_, b) in zip(_plan(True, tp=tp).data["memory"]["per_stage"][0]["activations_per_layer"],
                                           _plan(False, tp=tp).data["memory"]["per_stage"][0]["activations_per_layer"])]
    assert got == [want] * LAYERS


def test_the_program_normalises_q_and_k_before_rope(tmp_path):
    from parcompile.codegen.emit import render_program

    cfg = tiny_config(tp=2, model=dict(qk_norm=True))
    text = render_program(cfg, compile_config(cfg))
    assert text.count("rt.QKNorm(") == 2
    # written from the op table's Code rows, in graph order: the norms before RoPE
    assert text.index("q = self.q_norm(q)") < text.index("k = self.k_norm(k)") < text.index("q = rt.apply_rope(q")
    assert 'rt.QKNorm(f"layers.{i}.attn.q_norm", head_dim=16, eps=1e-05, seed=SEED, tp=tp)' in text
    assert "all-reduced over tp with the step (tp_partial_grads)" in text  # its tp-partial gradient
    plain = tiny_config(tp=2)
    assert "QKNorm" not in render_program(plain, compile_config(plain))


def test_qk_norm_with_layernorm_is_a_spanned_error():
    from tests.test_checks import one, spec

    text = spec(model={"norm": "layernorm", "qk_norm": "true"})
    message, help, _ = one(text, "qk_norm = true")
    assert message == "qk_norm is an RMSNorm over head_dim; norm = layernorm"
    assert help.startswith("set norm = rmsnorm")


def test_megatron_export_asks_for_qk_layernorm():
    from parcompile.exporters import megatron_args

    args, _ = megatron_args(_plan(True, tp=2))
    assert ("--qk-layernorm", None) in args
    assert all(flag != "--qk-layernorm" for flag, _ in megatron_args(_plan(False, tp=2))[0])


def test_qwen3_config_json_imports_with_qk_norm():
    from parcompile.core.hf import from_hf_dict

    qwen3_8b = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
                "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                "use_sliding_window": False, "sliding_window": None, "hidden_act": "silu"}
    keys = from_hf_dict(qwen3_8b)
    assert keys["qk_norm"] is True and keys["qkv_bias"] is False and keys["bias"] is False
    assert keys["head_dim"] == 128 and "sliding_window" not in keys
    assert "qk_norm" not in from_hf_dict({**qwen3_8b, "model_type": "qwen2"})


def test_qwen3_8b_parameter_count():
    """Qwen3-8B's config.json: 8,190,735,360 parameters (transformers' count), written out."""
    from parcompile.analysis.params import model_params
    from parcompile.config.schema import ModelConfig
    from parcompile.ir.lower import lower

    m = ModelConfig(layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn_hidden=12288, vocab=151936,
                    seq_len=4096, qk_norm=True, norm_eps=1e-6, rope_theta=1e6)
    h, q, kv, f = 4096, 32 * 128, 8 * 128, 12288
    layer = h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h + 2 * 128
    assert model_params(lower(m)) == 36 * layer + 2 * 151936 * h + h == 8_190_735_360
