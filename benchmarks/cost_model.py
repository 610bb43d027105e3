"""Print the cost model's estimates beside published measurements (not a timed test).

A100 rows: Megatron-LM 2021 Table 1 and Korthikanti et al. 2022 Table 5; H100 rows:
torchtitan's Llama 3.1 8B FSDP row, Megatron-Bridge's GPT-OSS 120B row, the Llama 3
paper's 405B row, torchtitan's 2025 FSDP + TP rows (Llama 3.1 70B and 8B, torch.compile)
and NeMo AutoModel's GPT-OSS 20B and Qwen3-30B-A3B rows; FP8 rows: torchtitan's float8 tensorwise and
rowwise rows of the same 2025 tables and Megatron-Bridge's DGX-H100 FP8 Llama 3 70B row, each beside
its bf16 row where one was published (parcompile/analysis/calibration.py
gives every source, configuration and assumption; the last lines print each row's source
commit and what was assumed). ``C`` rows were used to fit the efficiencies of parcompile/analysis/estimate.py;
``H`` rows are held out. Also prints the first stage's activation memory beside
Korthikanti's whole-stage formula (A100) and, per H100 row, the peak memory against what the
cluster may use (fits or not) and beside the published one where there is one. Last, the
memory-fit rows (Megatron-Bridge's GPT-OSS 120B BF16 layouts, parcompile/analysis/memory_rows.py):
each layout's peak against what its GPU may use, and its published tokens per second per GPU
(held out: no number of the estimate is fitted to them) beside the plan's, with its source.

    python benchmarks/cost_model.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parcompile.analysis.calibration import (FITTED, FP8_ROWS, H100_ROWS, ROWS, h100_config,  # noqa: E402
                                             row_config, stage_activation_bytes)
from parcompile.analysis.estimate import engine  # noqa: E402
from parcompile.passes.manager import cost_without_schedule  # noqa: E402
from parcompile.analysis.memory import closed_form_in_flight  # noqa: E402
from parcompile.analysis.memory_rows import MEMORY_ROWS, memory_row_config  # noqa: E402
from parcompile.core.recompute import is_module_list, recompute_words  # noqa: E402

GIB = 2 ** 30


def _layout(par) -> str:
    parts = [f"dp{par.dp}"] + [f"{k}{getattr(par, k)}" for k in ("tp", "pp", "ep") if getattr(par, k) > 1]
    if par.virtual_stages > 1:
        parts.append(f"v{par.virtual_stages}")
        if par.microbatch_group_size is not None:
            parts.append(f"N{par.microbatch_group_size}")
    if par.stage_layers is not None and 0 in (par.stage_layers[0], par.stage_layers[-1]):
        parts.append("ends0")   # a layer-less first or last model chunk
    parts += [f"mb{par.micro_batch}", f"gbs{par.global_batch}"]
    if par.zero:
        parts.append(f"zero{par.zero}")
    parts.append(recompute_words(par.recompute) if is_module_list(par.recompute) else
                 {"none": "", "selective": "sel", "full": "full"}[par.recompute])
    if par.sequence_parallel:
        parts.append("sp")
    return " ".join(p for p in parts if p)


def main() -> int:
    head = (f"{'row':22s} {'set':3s} {'source':46s} {'layout':34s} {'published s':>11s} {'estimate s':>10s} "
            f"{'error':>7s} {'TFLOP/s':>7s} {'MFU':>5s} {'bubble':>6s}")
    print(head)
    print("-" * len(head))
    errs: dict[str, list[float]] = {"A100": [], "H100": []}
    memory_lines = []
    for row in ROWS:
        cfg = row_config(row)
        cost = cost_without_schedule(cfg)
        t = cost.time
        err = t.step_time / row.step_time - 1
        errs["A100"].append(err)
        kind = "H" if row.held_out else "C"
        par = cfg.parallel
        flight = closed_form_in_flight(par.schedule, par.pp, par.virtual_stages, par.num_microbatches,
                                       par.microbatch_group_size)
        act = cost.memory.per_stage[0].activations
        want = float(stage_activation_bytes(cfg, 0, flight[0]))
        memory_lines.append(f"{row.name:26s} first-stage activations {act / 1e9:7.2f} GB, Korthikanti's formula "
                            f"{want / 1e9:7.2f} GB ({100 * (act / want - 1):+.2f}%)")
        src = row.source.split(" (")[0]
        print(f"{row.name:22s} {kind:3s} {src + ' (A100)':46s} {_layout(par):34s} {row.step_time:11.2f} "
              f"{t.step_time:10.2f} {100 * err:+6.1f}% {t.tflops_per_gpu:7.1f} {t.mfu:5.3f} {t.bubble_fraction:6.3f}")
    sources = []
    for row in H100_ROWS:
        cfg = h100_config(row)
        cost = cost_without_schedule(cfg)
        t = cost.time
        flops = t.tflops_per_gpu * 1e12 * t.step_time * cfg.parallel.world_size
        pub = row.published_step_time(flops)
        err = t.step_time / pub - 1
        errs["H100"].append(err)
        print(f"{row.name:22s} {'C':3s} {row.source + ' (H100)':46s} {_layout(cfg.parallel):34s} {pub:11.2f} "
              f"{t.step_time:10.2f} {100 * err:+6.1f}% {t.tflops_per_gpu:7.1f} {t.mfu:5.3f} {t.bubble_fraction:6.3f}")
        if row.tokens_per_s_per_gpu:
            rate = (f"{t.tokens_per_s / cfg.parallel.world_size:,.0f} tokens/s per GPU (published "
                    f"{row.tokens_per_s_per_gpu:,.0f})")
        elif row.tflops_per_gpu:
            rate = f"{t.tflops_per_gpu:.0f} TFLOP/s per GPU (published {row.tflops_per_gpu:.0f})"
        else:
            rate = f"{t.step_time:.2f} s per step (published {row.step_time:.2f})"
        fits = "fits" if cost.memory.fits else "DOES NOT FIT"
        line = (f"{row.name:26s} engine {engine(cfg.cluster).name}: {rate}; peak {cost.memory.peak / GIB:.1f} GiB "
                f"of {cost.memory.capacity / GIB:.1f} usable ({fits})")
        reserved = cost.memory.reserved_peak / GIB
        line += f", reserved {reserved:.1f} GiB (allocator term)"
        if row.peak_gib:
            line += (f" ({100 * (reserved / row.peak_gib - 1):+.1f}% of the published {row.peak_gib} GiB max "
                     f"reserved; allocated {100 * (cost.memory.peak / GIB / row.peak_gib - 1):+.1f}%)")
        else:
            line += "; no memory published"
        memory_lines.append(line)
        sources.append(f"{row.name:26s} {row.source} @ {row.commit}; assumed: {row.assumed}")
    print()
    print(f"{'FP8 row':38s} {'recipe':10s} {'published tok/s/GPU':>19s} {'estimate':>9s} {'error':>7s} "
          f"{'bf16 published':>14s} {'bf16 estimate':>13s}")
    bf16 = {r.name: r for r in H100_ROWS}
    errs["FP8"] = []
    for row in FP8_ROWS:
        cfg = h100_config(row)
        t = cost_without_schedule(cfg).time
        got = t.tokens_per_s / cfg.parallel.world_size
        err = got / row.tokens_per_s_per_gpu - 1
        errs["FP8"].append(err)
        line = (f"{row.name:38s} {cfg.train.fp8_recipe:10s} {row.tokens_per_s_per_gpu:19,.1f} {got:9,.1f} "
                f"{100 * err:+6.1f}%")
        if row.bf16_row:
            b = bf16[row.bf16_row]
            bc = h100_config(b)
            bt = cost_without_schedule(bc).time
            line += f" {b.tokens_per_s_per_gpu:14,.1f} {bt.tokens_per_s / bc.parallel.world_size:13,.1f}"
        print(line)
        sources.append(f"{row.name:26s} {row.source} @ {row.commit}; assumed: {row.assumed}")
    print()
    for k, e in errs.items():
        print(f"{k} rows: mean |error| {100 * sum(map(abs, e)) / len(e):.2f}%, largest {100 * max(map(abs, e)):.1f}%")
    print()
    print("\n".join(memory_lines))
    print()
    print("\n".join(sources))
    print()
    for f in FITTED:
        print(f"fitted: {f.label()} = {f.value():g} to {', '.join(f.rows)}")
    print()
    memory_fit_rows()
    return 0


def memory_fit_rows() -> None:
    """The memory-fit rows (parcompile/analysis/memory_rows.py): each published layout's peak
    against what its GPU may use, with its source and what was assumed."""
    print(f"{'memory-fit row':30s} {'layout':62s} {'peak GiB':>8s} {'usable':>7s} fits "
          f"{'without recompute list, fp32 grads':>34s} {'H tok/s/GPU published':>21s} {'plan':>6s} {'step error':>10s}")
    for row in MEMORY_ROWS:
        cfg = memory_row_config(row)
        cost = cost_without_schedule(cfg)
        mem = cost.memory
        plain = cost_without_schedule(memory_row_config(row, recompute="none", grad_dtype="fp32")).memory
        rate = cost.time.tokens_per_s / cfg.parallel.world_size
        held = (f" {row.tokens_per_s_per_gpu:21,.0f} {rate:6,.0f} {100 * (row.tokens_per_s_per_gpu / rate - 1):+9.1f}%"
                if row.tokens_per_s_per_gpu else "")
        print(f"{row.name:30s} {_layout(cfg.parallel) + ' ' + cfg.parallel.grad_dtype + ' grads':62s} "
              f"{mem.peak / GIB:8.1f} {mem.capacity / GIB:7.1f} {'yes' if mem.fits else 'NO ':4s} "
              f"{plain.peak / GIB:30.1f} GiB{held}")
    for row in MEMORY_ROWS:
        print(f"{row.name:30s} {row.source}, {row.container} NeMo Container; assumed: {row.assumed}")


if __name__ == "__main__":
    raise SystemExit(main())
