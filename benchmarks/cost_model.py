"""Print the cost model's estimates beside published measurements (not a timed test).

Rows: Megatron-LM 2021 Table 1 and Korthikanti et al. 2022 Table 5 (see
parcompile/analysis/calibration.py for sources and configurations). ``C`` rows were used
to fit the efficiencies of parcompile/analysis/estimate.py; ``H`` rows are held out. Also
prints the first stage's activation memory beside Korthikanti's whole-stage formula.

    python benchmarks/cost_model.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from parcompile.analysis.calibration import ROWS, row_config, stage_activation_bytes  # noqa: E402
from parcompile.passes.manager import cost_without_schedule  # noqa: E402
from parcompile.analysis.memory import closed_form_in_flight  # noqa: E402


def main() -> int:
    head = (f"{'row':26s} {'set':3s} {'source':34s} {'published s':>11s} {'estimate s':>10s} {'error':>7s} "
            f"{'TFLOP/s':>7s} {'MFU':>5s} {'bubble':>6s} {'act GB':>7s} {'formula GB':>10s} {'act err':>7s}")
    print(head)
    print("-" * len(head))
    worst = {"C": 0.0, "H": 0.0}
    for row in ROWS:
        cfg = row_config(row)
        cost = cost_without_schedule(cfg)
        t = cost.time
        err = t.step_time / row.step_time - 1
        kind = "H" if row.held_out else "C"
        worst[kind] = max(worst[kind], abs(err))
        par = cfg.parallel
        flight = closed_form_in_flight(par.schedule, par.pp, par.virtual_stages, par.num_microbatches)
        act = cost.memory.per_stage[0].activations
        want = float(stage_activation_bytes(cfg, 0, flight[0]))
        src = row.source.split(" (")[0]
        print(f"{row.name:26s} {kind:3s} {src:34s} {row.step_time:11.2f} {t.step_time:10.2f} {100 * err:+6.1f}% "
              f"{t.tflops_per_gpu:7.1f} {t.mfu:5.3f} {t.bubble_fraction:6.3f} {act / 1e9:7.2f} {want / 1e9:10.2f} "
              f"{100 * (act / want - 1):+6.2f}%")
    print(f"\nlargest error: calibration rows {100 * worst['C']:.1f}%, held-out rows {100 * worst['H']:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
