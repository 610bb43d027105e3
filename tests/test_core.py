"""The ground-floor rules of ``parcompile.core`` against their sources."""

from __future__ import annotations

import pytest

from parcompile.core.axes import AXIS_FAMILY, DEGREE_AXES, FOUND_INF_AXES, GROUP_AXES
from parcompile.core.dtypes import DTYPE_BYTES, GRAD_BYTES, TORCH_NAMES
from parcompile.core.heads import kv_head_replicas, kv_heads_per_rank, kv_heads_replicated


@pytest.mark.parametrize("kv", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16, 32])
def test_kv_heads_follow_vllm(kv, tp):
    # vLLM QKVParallelLinear: tp >= kv heads -> 1 kv head per rank, replicated tp / kv times
    # (tp a multiple of kv); else kv / tp heads per rank, no replicas (tp divides kv)
    if tp >= kv:
        per, reps = 1, tp // kv
    else:
        per, reps = kv // tp, 1
    assert kv_heads_per_rank(kv, tp) == per
    assert kv_head_replicas(kv, tp) == reps
    assert kv_heads_replicated(kv, tp) == (reps > 1)
    assert per * tp == kv * reps   # every kv head held by `reps` ranks, every rank holds `per`


def test_axes_are_one_set():
    assert len(set(GROUP_AXES)) == len(GROUP_AXES) == 11   # with HSDP's dp_shard and dp_replicate
    assert set(DEGREE_AXES) | set(AXIS_FAMILY) | set(FOUND_INF_AXES) <= set(GROUP_AXES)
    assert set(AXIS_FAMILY) == set(GROUP_AXES) and set(AXIS_FAMILY.values()) == set(DEGREE_AXES)


def test_dtypes_match_torch():
    torch = pytest.importorskip("torch")
    for name, tname in TORCH_NAMES.items():
        assert getattr(torch, tname).itemsize == DTYPE_BYTES[name]
    assert torch.float32.itemsize == GRAD_BYTES
    assert torch.int64.itemsize == DTYPE_BYTES["int64"] and torch.bool.itemsize == DTYPE_BYTES["bool"]
    if hasattr(torch, "float8_e4m3fn"):
        assert torch.float8_e4m3fn.itemsize == DTYPE_BYTES["fp8"]


# --------------------------------------------------------------------------- model keys


def _schema():
    from parcompile.config.schema import ModelConfig

    return ModelConfig


def test_model_keys_have_model_config_fields_and_defaults():
    """ModelKeys (the runtime's model block) and ModelConfig (the compiler's) are one
    list of keys: same names, same defaults, same required ones."""
    import dataclasses

    from parcompile.core.model import ModelKeys

    fields = {f.name: f for f in dataclasses.fields(ModelKeys)}
    schema = _schema().model_fields
    assert set(fields) == set(schema)
    for name, info in schema.items():
        f = fields[name]
        if info.is_required():
            assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, name
        else:
            assert f.default == info.default, name


@pytest.mark.parametrize("keys", [
    dict(layers=2, hidden=64, heads=4, vocab=1000, seq_len=32),
    dict(layers=2, hidden=96, heads=6, kv_heads=2, vocab=50257, seq_len=128, bias=True, experts=8),
    dict(layers=1, hidden=64, heads=4, head_dim=32, ffn_hidden=100, qkv_bias=True, vocab=7, seq_len=8,
         max_positions=64, experts=4, top_k=1, expert_ffn_hidden=24, vocab_multiple=64),
])
def test_model_keys_derive_like_model_config(keys):
    from parcompile.core.model import ModelKeys

    mk, mc = ModelKeys(**keys), _schema()(**keys)
    assert mk.as_dict() == mc.model_dump()
    for tp in (1, 2, 3, 8):
        assert mk.padded_vocab(tp) == mc.padded_vocab(tp)
    assert mk.dtype_bytes == mc.dtype_bytes


def test_derived_defaults_by_hand():
    from parcompile.core.model import ModelKeys, padded_vocab

    m = ModelKeys(layers=2, hidden=96, heads=6, vocab=1000, seq_len=40, bias=True, experts=4)
    # SPEC 1: kv_heads = heads, head_dim = hidden / heads, ffn_hidden = 4 hidden, qkv_bias =
    # bias, max_positions = seq_len, top_k = 2 with experts, expert_ffn_hidden = ffn_hidden
    assert (m.kv_heads, m.head_dim, m.ffn_hidden, m.qkv_bias, m.max_positions, m.top_k, m.expert_ffn_hidden) == \
        (6, 16, 384, True, 40, 2, 384)
    assert ModelKeys(layers=1, hidden=8, heads=2, vocab=5, seq_len=4).top_k == 0
    # Megatron-LM: 1000 rows over 128 * tp -> 1024 (tp 1, 2, 4, 8), 1152 for tp 3 (384 * 3)
    assert [padded_vocab(1000, 128, tp) for tp in (1, 2, 3, 4, 8)] == [1024, 1024, 1152, 1024, 1024]
    with pytest.raises(TypeError):
        ModelKeys(layers=1, hidden=8, heads=2, vocab=5)          # seq_len missing
    with pytest.raises(TypeError):
        ModelKeys(layers=1, hidden=8, heads=2, vocab=5, seq_len=4, widht=3)   # unknown key


def test_hf_layout_reads_model_keys_and_model_config_alike():
    """The HF tables (core.hf_weights) take the runtime's ModelKeys and the compiler's
    ModelConfig alike: the same tensor map and shapes."""
    from parcompile.core.hf_weights import expected_shapes, hf_config, hf_family, tensor_map
    from parcompile.core.model import ModelKeys

    keys = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=1000, seq_len=32, experts=4, dtype="fp32")
    mk, mc = ModelKeys(**keys), _schema()(**keys)
    assert hf_family(mk) == hf_family(mc) == "mixtral"
    assert expected_shapes(mk, 2) == expected_shapes(mc, 2)
    assert tensor_map(mk, "mixtral") == tensor_map(mc, "mixtral")
    assert hf_config(mk) == hf_config(mc)


def test_model_from_checkpoint_config_is_stdlib_keys():
    from parcompile.core.hf_weights import model_from_checkpoint_config
    from parcompile.core.model import ModelKeys

    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 128}
    m = model_from_checkpoint_config(cfg)
    assert isinstance(m, ModelKeys)
    # config.json's keys, and the defaults: head_dim = 64 / 4, seq_len = max_positions, fp32
    assert (m.hidden, m.ffn_hidden, m.kv_heads, m.head_dim, m.seq_len, m.dtype) == (64, 160, 2, 16, 128, "fp32")


# --------------------------------------------------------------------------- buckets


def test_analysis_buckets_reexports_the_core_rule():
    """analysis.buckets keeps its importers working with the very objects of core.buckets."""
    import parcompile.analysis.buckets as ab
    import parcompile.core.buckets as cb

    for name in ab.__all__:
        if name != "buckets_to_dict":
            assert getattr(ab, name) is getattr(cb, name), name
