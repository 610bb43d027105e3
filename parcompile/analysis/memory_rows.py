"""Published layouts that ran, held as memory-fit rows: the plan must fit each of them
(``python benchmarks/cost_model.py`` prints them with their source; ``tests/test_memory_rows.py``
holds each). No step time is calibrated on them: their published tokens per second per GPU
(``tokens_per_s_per_gpu``, the same tables) are held out, printed beside the plan's.

Megatron-Bridge's GPT-OSS 120B BF16 pre-training rows on DGX-H100 and DGX-B200, every
container of its performance tables (NVIDIA-NeMo/Megatron-Bridge 067f987,
``docs/performance-summary-archive.md``: 25.11, 26.02, 26.02.01, 26.04, 26.04.01; the later
containers publish no BF16 H100 or B200 row). All: 64 GPUs, seq 4096, TP 1, CP 1, FSDP 0
(Megatron-Core's distributed optimizer: ``zero = 1``). Their recipes, at the release of each
container, set what the tables leave out:

* ``recompute_modules = ["layernorm", "moe_act"]`` with ``recompute_granularity =
  "selective"``: v0.2.0 and v0.3.0 / v0.4.0 ``scripts/performance/configs/gpt_oss/``
  ``(gpt_oss_)workload_base_configs.py`` (``GPT_OSS_120B_{H100,B200}_BF16``); 067f987
  ``src/megatron/bridge/perf_recipes/gpt_oss/{h100,b200}/gpt_oss.py``;
* ``grad_reduce_in_fp32 = False`` for the DDP and mixed-precision configs: v0.2.0 / v0.4.0
  ``gpt_oss_llm_pretrain.py`` ``set_gpt_oss_common_configs``; 067f987 ``perf_recipes/_common.py``
  ``_benchmark_common``: ``grad_dtype = bf16`` (Megatron-Core ``--grad-reduce-in-bf16``).

The 25.11 table prints H100 at MBS 4 and GBS 512, which no layout of 64 H100s at PP 4 holds:
at micro-batch 4 the first stage keeps 4 micro-batches of 9 layers in flight, 1.5 GiB a layer
each by Megatron-Core's own saves (:mod:`parcompile.analysis.module_saves`), 55 GiB beside 45
GiB of model state. Its recipe at that release (v0.2.0 ``workload_base_configs.py``:
``GPT_OSS_120B_H100_BF16_BASE_CONFIG`` keeps the base's ``micro_batch_size = 1``, as every later
H100 row) is taken: micro-batch 1. The 25.11 B200 row prints EP 8 where its recipe has 64:
the table's (the larger per-rank expert state) is taken.
"""

from __future__ import annotations

from dataclasses import dataclass

from parcompile.config.presets import cluster_preset, model_preset
from parcompile.config.schema import ClusterConfig, ModelConfig, ParallelConfig, SpecConfig, TrainConfig

#: the source of every row (module docstring)
MB_TABLES = "Megatron-Bridge 067f987 docs/performance-summary-archive.md"
#: the recipes' memory settings (module docstring)
MB_RECIPE = ("recompute_modules [layernorm, moe_act] and grad_reduce_in_fp32 False (Megatron-Bridge v0.2.0, "
             "v0.4.0 scripts/performance/configs/gpt_oss; 067f987 perf_recipes/gpt_oss)")


@dataclass(frozen=True)
class MemoryRow:
    """One published layout (module docstring): its name, source, container, cluster preset
    and nodes of 8 GPUs, model preset and sequence length, and ``parallel`` keys."""

    name: str
    source: str
    container: str
    cluster: str
    nodes: int
    model: str
    seq_len: int
    parallel: tuple[tuple[str, object], ...]
    #: what was taken where the table and its recipe disagree or are silent
    assumed: str = MB_RECIPE
    #: the table's tokens / sec / GPU (held out: no number of the estimate is fitted to it)
    tokens_per_s_per_gpu: float | None = None


def _gpt_oss(gpu: str, container: str, pp: int, ep: int, mb: int, gbs: int, assumed: str = MB_RECIPE,
             tokens: float | None = None) -> MemoryRow:
    par = (("tp", 1), ("pp", pp), ("ep", ep), ("dp", 64 // pp), ("zero", 1), ("micro_batch", mb),
           ("global_batch", gbs), ("recompute", ("layernorm", "moe_act")), ("grad_dtype", "bf16"))
    preset = {"H100": "h100-sxm", "B200": "b200"}[gpu]
    return MemoryRow(f"GPT-OSS 120B {gpu} {container}", MB_TABLES, container, preset, 8, "gpt-oss-120b", 4096,
                     par, assumed, tokens)


_H100_2511 = MB_RECIPE + "; micro-batch 1 from its v0.2.0 recipe (the table prints MBS 4: module docstring)"
_B200_2511 = MB_RECIPE + "; EP 8 as the table prints it (its v0.2.0 recipe: EP 64)"

MEMORY_ROWS: tuple[MemoryRow, ...] = (
    _gpt_oss("H100", "25.11", pp=4, ep=8, mb=1, gbs=512, assumed=_H100_2511, tokens=5630),
    _gpt_oss("H100", "26.02", pp=4, ep=8, mb=1, gbs=1280, tokens=5993),
    _gpt_oss("H100", "26.02.01", pp=4, ep=8, mb=1, gbs=1280, tokens=5984),
    _gpt_oss("H100", "26.04", pp=4, ep=8, mb=1, gbs=1280, tokens=5810),
    _gpt_oss("H100", "26.04.01", pp=4, ep=8, mb=1, gbs=1280, tokens=5824),
    _gpt_oss("B200", "25.11", pp=1, ep=8, mb=4, gbs=512, assumed=_B200_2511, tokens=8213),
    _gpt_oss("B200", "26.02", pp=1, ep=64, mb=4, gbs=1280, tokens=8047),
    _gpt_oss("B200", "26.02.01", pp=1, ep=8, mb=4, gbs=1280, tokens=13722),
    _gpt_oss("B200", "26.04", pp=1, ep=8, mb=4, gbs=1280, tokens=13045),
    _gpt_oss("B200", "26.04.01", pp=1, ep=8, mb=4, gbs=1280, tokens=13568),
)


def memory_row_config(row: MemoryRow, **parallel) -> SpecConfig:
    """The spec of a memory row: its model preset at ``seq_len``, its cluster preset (bf16)
    with ``nodes``, its ``parallel`` keys (``parallel``: keys replaced, e.g. ``recompute =
    "none"`` to see what the recipe's settings save), AdamW."""
    values = {**model_preset(row.model), "seq_len": row.seq_len}
    values.setdefault("max_positions", row.seq_len)
    model = ModelConfig(name=row.model.replace("-", "_").replace(".", "_"), **values)
    cluster = ClusterConfig(name=row.cluster, preset=row.cluster, **{**cluster_preset(row.cluster, "bf16"),
                                                                     "nodes": row.nodes})
    par = ParallelConfig(**{**dict(row.parallel), **parallel})
    return SpecConfig(name=model.name, model=model, cluster=cluster, parallel=par,
                      train=TrainConfig(optimizer="adamw"))


__all__ = ["MemoryRow", "MEMORY_ROWS", "memory_row_config", "MB_TABLES", "MB_RECIPE"]
