"""Published measurements the cost model is checked against, and Korthikanti's formulas.

Rows (all GPT-style: layernorm, gelu, learned positions, biases, dropout 0.1, tied
embeddings, unfused attention; fp16, s = 2048, V = 51,200, A100-80GB, Adam):

* Megatron-LM, Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
  GPU Clusters Using Megatron-LM", Table 1 (full recomputation; micro-batch sizes and
  virtual stages from Megatron-LM's ``examples/sc21/run_table_1.sh``). The paper gives
  TFLOP/s per GPU; the step time is derived with its own FLOP count
  ``F = 96 B s l h^2 (1 + s/6h + V/16lh)``: ``t = F / (n * X)``.
* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", Table 5: seconds per iteration with full recomputation and with sequence
  parallelism + selective recomputation (configurations from their Table 3).

``calibration`` rows are what the efficiencies of :mod:`parcompile.analysis.estimate`
were tuned to; ``held_out`` rows were not looked at while tuning. A row's spec is
:func:`row_config`; :func:`parcompile.passes.manager.cost_without_schedule` costs it (running the
passes belongs to the driver: the analyses import no pass).

:func:`layer_activation_bytes` is Korthikanti's Table 2 (bytes per layer, 16-bit);
:func:`stage_activation_bytes` their whole-stage value (section 4.3: the layers of the
first stage times the micro-batches in flight, plus the embedding dropout mask; the
output layer ``4sbh/t (1 + V/h)`` on the last stage).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from parcompile.config.presets import cluster_preset
from parcompile.config.schema import ClusterConfig, ModelConfig, ParallelConfig, SpecConfig, TrainConfig


@dataclass(frozen=True)
class PublishedRow:
    """One published configuration and its measured seconds per step."""

    name: str
    source: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    micro_batch: int
    step_time: float
    virtual_stages: int = 1
    recompute: str = "full"
    sequence_parallel: bool = False
    held_out: bool = False

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


def _megatron(name, a, h, L, t, p, n, B, b, tflops, v=1, held_out=False) -> PublishedRow:
    s, V = 2048, 51200
    flops = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return PublishedRow(name, f"Megatron-LM 2021 Table 1 ({tflops} TFLOP/s per GPU)", a, h, L, t, p, n, B, b,
                        flops / (n * tflops * 1e12), v, held_out=held_out)


def _korthikanti(name, a, h, L, p, n, B, full, present, v=1, b=1, held_out=False) -> list[PublishedRow]:
    src = "Korthikanti et al. 2022 Table 5"
    return [PublishedRow(f"{name} full recompute", src, a, h, L, 8, p, n, B, b, full, v, "full", False, held_out),
            PublishedRow(f"{name} SP + selective", src, a, h, L, 8, p, n, B, b, present, v, "selective", True,
                         held_out)]


ROWS: tuple[PublishedRow, ...] = (
    _megatron("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 137),
    _megatron("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 138, held_out=True),
    _megatron("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 142, held_out=True),
    _megatron("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 135),
    _megatron("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 138, held_out=True),
    _megatron("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 140, v=3, held_out=True),
    _megatron("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 148, v=2),
    _megatron("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 155, v=2, held_out=True),
    _megatron("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 163, v=3, held_out=True),
    _megatron("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 163),
    *_korthikanti("22B", 64, 6144, 48, 1, 8, 4, 1.42, 1.10, b=4),
    *_korthikanti("175B", 96, 12288, 96, 8, 64, 64, 18.13, 13.75, held_out=True),
    *_korthikanti("530B", 128, 20480, 105, 35, 280, 280, 49.05, 37.83, v=3),
    *_korthikanti("1T", 160, 25600, 128, 64, 512, 512, 94.42, 71.49, held_out=True),
)


def row_config(row: PublishedRow) -> SpecConfig:
    """The spec of a published row (module docstring)."""
    model = ModelConfig(name=f"gpt_{row.name.split()[0]}", layers=row.layers, hidden=row.hidden, heads=row.heads,
                        vocab=51200, seq_len=2048, norm="layernorm", activation="gelu", position="learned",
                        bias=True, dropout=0.1, tie_embeddings=True, attention="unfused", dtype="fp16")
    cl = cluster_preset("a100-80gb", "fp16")
    cl.update(nodes=max(1, row.gpus // 8), gpus_per_node=min(8, row.gpus))
    cluster = ClusterConfig(name="selene", preset="a100-80gb", **cl)
    par = ParallelConfig(dp=row.dp, tp=row.tp, pp=row.pp, micro_batch=row.micro_batch,
                         global_batch=row.global_batch, recompute=row.recompute,
                         sequence_parallel=row.sequence_parallel, virtual_stages=row.virtual_stages,
                         schedule="interleaved_1f1b" if row.virtual_stages > 1 else "1f1b")
    return SpecConfig(name=model.name, model=model, cluster=cluster, parallel=par,
                      train=TrainConfig(optimizer="adam"))


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none") -> Fraction:
    """Korthikanti et al. 2022, Table 2: activation bytes of one GPT layer (16-bit).

    none: ``sbh(34 + 5as/h)``; tensor parallel: ``sbh(10 + 24/t + 5as/(ht))``; + sequence
    parallel: ``sbh/t (34 + 5as/h)``; + selective recompute: ``34 sbh/t`` (tensor parallel
    only: ``sbh(10 + 24/t)``); full recompute: ``2sbh`` (``2sbh/t`` with sequence
    parallelism, where Megatron keeps the layer input split).
    """
    sbh = Fraction(s * b * h)
    attn = Fraction(5 * a * s, h)
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if recompute == "selective":
        attn = Fraction(0)
    if sequence_parallel:
        return sbh / t * (34 + attn)
    return sbh * (10 + Fraction(24, t) + attn / t)


def stage_activation_bytes(row_cfg: SpecConfig, stage: int, in_flight: Fraction | int) -> Fraction:
    """Korthikanti's whole-stage value for ``stage`` of a GPT spec: its layers times the
    micro-batches in flight, plus the embedding dropout mask (first stage, ``sbh/t`` with
    sequence parallelism, else ``sbh``) and the output layer ``4sbh/t (1 + V/h)`` (last
    stage; ``V`` padded)."""
    m, par = row_cfg.model, row_cfg.parallel
    s, b, h, a, t = m.seq_len, par.micro_batch, m.hidden, m.heads, par.tp
    layers = sum(n for k, n in enumerate(par.layers_per_chunk(m.layers)) if k % par.pp == stage)
    one = layer_activation_bytes(s, b, h, a, t, par.sequence_parallel, par.recompute)
    total = Fraction(in_flight) * layers * one
    split = t if par.sequence_parallel else 1
    if stage == 0 and m.dropout > 0:
        total += Fraction(in_flight) * s * b * h / split
    if stage == par.pp - 1:
        total += Fraction(4 * s * b * h, split) + Fraction(4 * s * b * m.padded_vocab(t), t)
    return total
