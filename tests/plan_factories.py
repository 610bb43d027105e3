"""Config builders for the IR/pass/analysis tests (pydantic constructors, no parser)."""

from __future__ import annotations

from parcompile.config.schema import ClusterConfig, ModelConfig, ParallelConfig, SpecConfig
from parcompile.passes.manager import PASSES, run_pass
from parcompile.ir.lower import lower
from parcompile.passes.base import PassContext


def tiny_model(**kw) -> ModelConfig:
    """hidden 64, heads 4, kv_heads 2, ffn 128, vocab 256, seq 64, 4 layers, fp32 (overridable)."""
    base = dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256, seq_len=64, dtype="fp32")
    base.update(kw)
    return ModelConfig(**base)


def spec(model: ModelConfig | None = None, nodes: int | None = None, gpus_per_node: int | None = None,
         cluster: dict | None = None, **par) -> SpecConfig:
    """A SpecConfig whose cluster has exactly world = tp * cp * dp * pp GPUs (one node)."""
    p = ParallelConfig(**par)
    cl = dict(nodes=nodes or 1, gpus_per_node=gpus_per_node or p.world_size)
    cl.update(cluster or {})
    return SpecConfig(model=model or tiny_model(), cluster=ClusterConfig(**cl), parallel=p)


def run_until(cfg: SpecConfig, last: str):
    """Lower ``cfg`` and run the passes up to and including the one named ``last``."""
    ctx = PassContext.of(cfg)
    g = lower(cfg.model, batch=cfg.parallel.micro_batch * cfg.parallel.dp)
    for p in PASSES:
        run_pass(p, g, ctx)
        if p.name == last:
            return g, ctx
    raise KeyError(last)


def llama2_7b() -> ModelConfig:
    """Published dims (Touvron et al. 2023, HF config.json)."""
    return ModelConfig(layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, vocab=32000,
                       seq_len=4096, norm="rmsnorm", activation="swiglu", position="rope", dtype="bf16")


def llama3_8b() -> ModelConfig:
    return ModelConfig(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256,
                       seq_len=8192, norm="rmsnorm", activation="swiglu", position="rope", dtype="bf16")


def llama3_70b() -> ModelConfig:
    return ModelConfig(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256,
                       seq_len=8192, dtype="bf16")


def gpt3_175b() -> ModelConfig:
    return ModelConfig(layers=96, hidden=12288, heads=96, ffn_hidden=4 * 12288, vocab=51200, seq_len=2048,
                       norm="layernorm", activation="gelu", position="learned", bias=True, dtype="bf16")
