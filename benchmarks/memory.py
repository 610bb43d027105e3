"""Predicted against measured memory per rank (issue 7). Prints figures; not a timed test.

For every spec in ``examples/``:

* a training spec on the ``cpu`` cluster (``tiny.par``) is compiled as it is and its
  program runs one step under torchrun here;
* a training spec for GPUs runs its ``parcompile verify`` miniature (same degrees,
  schedule, ZeRO stage, recomputation, dtype kinds; small widths) when its world fits
  this machine (``verify.MAX_WORLD`` processes); larger worlds are skipped, saying so;
* serve specs are skipped (their memory is weights and KV cache, checked by
  ``tests/test_serve.py``).

Per rank it prints the plan's parameter, gradient and optimizer bytes next to what the
program held (``state_bytes``), and the bytes one micro-batch saves for backward summed
over the rank's layers (plan ``activations_per_layer`` against the saved-tensor hooks of
``parcompile.runtime.machine.memory``), with the largest per-layer deviation. On a GPU it adds
the allocator's peak (allocated / reserved) against the plan's ``total``, and how much
the allocator reserved beyond what was allocated against ``memory_reserve`` (the share
of memory the plan sets aside for fragmentation); a CPU run has no allocator to ask
(process RSS is mostly Python and torch, not the model).

With ZeRO-3 it adds, per stage, the most gathered parameter bytes a rank held at once
(layer buckets are gathered just in time) against the plan's ``zero3_gather`` buffer and
against the stage's parameters gathered whole. ``--zero 3 --bucket-size 4`` runs every
example that way (one bucket per layer).

Run: ``python benchmarks/memory.py [--only NAME] [--steps N] [--zero Z] [--bucket-size B]``;
``--smoke`` runs one step of a two-layer model on one CPU rank instead of the examples
(the test suite's run of this script, ``tests/test_benchmarks_smoke.py``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from parcompile.diagnostics import SpecError
from parcompile.frontend import load_spec
from parcompile.layout_search import with_parallel
from parcompile.verification import MAX_WORLD, measure, miniature

ROOT = Path(__file__).resolve().parents[1]

#: ``--smoke``: the smallest training spec the report covers (one rank under torchrun)
SMOKE = """model smoke {
    layers = 2
    hidden = 32
    heads = 2
    ffn_hidden = 64
    vocab = 256
    seq_len = 16
    dtype = fp32
}
cluster local from "cpu" {
    gpus_per_node = 1
}
parallel {
    micro_batch = 1
    global_batch = 2
}
train {
    lr = 1e-3
    steps = 1
}
"""


def _kib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024:,.1f}"


def rows(plan: dict, records: list[dict]) -> list[tuple]:
    """One row per rank: (rank, stage, (kind, planned, measured) x 4, worst layer deviation,
    cuda peak or None)."""
    out = []
    for r in records:
        st = plan["memory"]["per_stage"][r["stage"]]
        got = r.get("state_bytes") or {}
        layers = st.get("activations_per_layer", [])
        measured = r.get("saved_per_layer") or {}
        plan_acts = sum(b for _, b in layers)
        meas_acts = sum(measured.get(str(layer), 0) for layer, _ in layers)
        worst = max((abs(measured.get(str(layer), 0) - b) / b for layer, b in layers if b), default=0.0)
        out.append((r["rank"], r["stage"],
                    [(k, st[k], got.get(k)) for k in ("params", "grads", "optimizer")]
                    + [("saved/layer", plan_acts, meas_acts)],
                    worst, r.get("allocator_peak"), st["total"]))
    return out


def fragmentation(records: list[dict], reserve: float) -> str | None:
    """On a GPU: the share of reserved memory the caching allocator held beyond what was
    allocated at the peak (fragmentation and cached blocks), worst rank, against the
    spec's ``memory_reserve``; None without allocator peaks (CPU runs)."""
    peaks = [r["allocator_peak"] for r in records if r.get("allocator_peak")]
    if not peaks:
        return None
    worst = max(1 - p["allocated"] / p["reserved"] for p in peaks if p["reserved"])
    verdict = "within" if worst <= reserve else "MORE than"
    return (f"   allocator: reserved exceeds allocated by up to {100 * worst:.1f}% of reserved at the peak, "
            f"{verdict} memory_reserve = {100 * reserve:.0f}%")


def report(name: str, how: str, plan: dict, records: list[dict], reserve: float | None = None) -> str:
    lines = [f"== {name}: {how}",
             f"{'rank':>4} {'stage':>5}  {'params KiB plan/meas':>22}  {'grads KiB':>19}  "
             f"{'optimizer KiB':>19}  {'saved act KiB (1 mb)':>21}  {'worst layer':>11}"]
    exact = True
    table = rows(plan, records)
    for rank, stage, parts, worst, peak, total in table:
        cells = []
        for kind, p, m in parts:
            cells.append(f"{_kib(p):>10}/{_kib(m):<10}")
            if kind != "saved/layer" and p != m:
                exact = False
        line = f"{rank:>4} {stage:>5}  " + "  ".join(cells) + f"  {100 * worst:>10.2f}%"
        if peak:
            alloc = plan["memory"]["per_stage"][stage].get("allocator")
            line += f"  cuda peak {peak['allocated'] / 2**20:,.0f}/{peak['reserved'] / 2**20:,.0f} MiB " \
                    f"(plan total {total / 2**20:,.0f} MiB" + (
                        f", reserved {(total + alloc) / 2**20:,.0f} MiB: allocator {alloc / 2**20:,.0f} planned, "
                        f"{(peak['reserved'] - peak['allocated']) / 2**20:,.0f} held)" if alloc is not None else ")")
        lines.append(line)
    worst_all = max((row[3] for row in table), default=0.0)
    planned = sum(row[2][3][1] for row in table)
    measured = sum(row[2][3][2] for row in table)
    lines.append(f"   model states {'equal the plan exactly' if exact else 'DIFFER from the plan'}; "
                 f"saved activations per layer within {100 * worst_all:.2f}% of the plan on every rank, "
                 f"{100 * (measured - planned) / max(planned, 1):+.2f}% summed over ranks")
    frag = fragmentation(records, reserve) if reserve is not None else None
    if frag:
        lines.append(frag)
    full = [(r["stage"], r["grad_buckets_in_flight"]) for r in records if "grad_buckets_in_flight" in r]
    for stage in sorted({s for s, _ in full}):
        bp = plan["memory"]["per_stage"][stage]["buffer_parts"]
        want = bp.get("grad_buckets_in_flight", 0) + bp.get("full_grads", 0)
        got = sorted({g for s, g in full if s == stage})
        lines.append(f"   stage {stage}: full fp32 gradient buffers at most at once {_kib(want)} KiB planned, "
                     f"{'/'.join(_kib(g) for g in got)} KiB held (ZeRO 2/3: "
                     + ("reduced once per step)" if "full_grads" in bp else "buckets in flight)"))
    gathered = [(r["stage"], r["zero3_gathered"]) for r in records if "zero3_gathered" in r]
    for stage in sorted({s for s, _ in gathered}):
        st = plan["memory"]["per_stage"][stage]
        got = sorted({g for s, g in gathered if s == stage})
        lines.append(f"   stage {stage}: ZeRO-3 gathered parameters at most {_kib(st['buffer_parts'].get('zero3_gather', 0))} "
                     f"KiB planned, {'/'.join(_kib(g) for g in got)} KiB held; the stage's parameters "
                     f"are {_kib(_full_params(plan, stage))} KiB gathered")
    return "\n".join(lines)


def _full_params(plan: dict, stage: int) -> int:
    """Bytes of the stage's parameters on one rank if all were gathered at once (padded
    buckets, the model's dtype), from the plan's bucket listing."""
    e = {"fp32": 4}.get(plan["model"].get("dtype", "fp32"), 2)
    d, ed = plan["degrees"]["dp"] * plan["degrees"]["cp"], plan["degrees"]["expert_dp"]
    row = plan["comm"]["grad_buckets"]["per_stage"][stage]
    pad = lambda n, k: -(-n // k) * k if k > 1 else 0   # noqa: E731
    return e * (sum(pad(b["elements"], d) for b in row["dense"]) + sum(pad(b["elements"], ed) for b in row["expert"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run only the example with this file stem")
    ap.add_argument("--steps", type=int, default=1, help="optimizer steps per run (state bytes are read after step 1)")
    ap.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="run every example with this ZeRO stage instead")
    ap.add_argument("--bucket-size", type=int, help="... and this bucket_size in bytes (ZeRO-3 gathers per bucket)")
    ap.add_argument("--smoke", action="store_true", help="one step of a tiny 1-rank spec instead of the examples")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be at least 1, got {args.steps}")
    if args.bucket_size is not None and (args.bucket_size < 0 or 0 < args.bucket_size < 4):
        ap.error(f"--bucket-size must be 0 (one bucket per chunk) or at least 4 bytes, got {args.bucket_size}")
    paths = sorted((ROOT / "examples").glob("*.par"))
    if args.smoke:
        tmp_spec = Path(tempfile.mkdtemp(prefix="parcompile-mem-smoke-")) / "smoke.par"
        tmp_spec.write_text(SMOKE)
        paths, args.only = [tmp_spec], None
    if args.only and args.only not in {p.stem for p in paths}:
        ap.error(f"no example named {args.only!r}; examples: {', '.join(p.stem for p in paths)}")
    for path in paths:
        if args.only and path.stem != args.only:
            continue
        try:
            cfg, _ = load_spec(path)
        except SpecError as e:
            print(f"== {path.stem}: does not compile ({e})")
            continue
        if cfg.workload == "train" and (args.zero is not None or args.bucket_size is not None):
            update = {k: v for k, v in (("zero", args.zero), ("bucket_size", args.bucket_size)) if v is not None}
            cfg = with_parallel(cfg, cfg.parallel.model_copy(update=update))
        if cfg.workload != "train":
            print(f"== {path.stem}: skipped (serve spec: weights and KV cache, see tests/test_serve.py)\n")
            continue
        world = cfg.parallel.world_size
        if cfg.cluster.preset == "cpu":
            run_cfg, how = cfg, f"the spec itself, {world} CPU ranks"
        elif world <= MAX_WORLD:
            run_cfg, how = miniature(cfg, args.steps), (f"its verify miniature ({world} CPU ranks; "
                                                         f"{cfg.model.name} is too large for this machine)")
        else:
            print(f"== {path.stem}: skipped ({world} ranks; this machine runs at most {MAX_WORLD})\n")
            continue
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="parcompile-mem-") as tmp:
            try:
                plan, records = measure(run_cfg, tmp, steps=args.steps)
            except (RuntimeError, SpecError) as e:
                print(f"== {path.stem}: run failed: {str(e)[:400]}\n")
                continue
        print(report(path.stem, how, plan, records, run_cfg.cluster.memory_reserve))
        print(f"   ({time.perf_counter() - t0:.1f} s)\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
