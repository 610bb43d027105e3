"""Print the serving estimate beside published GPU serving runs (not a timed test).

The three rows issue 45 hands over, the only ones the serving engines' fitted constants
were fitted to (parcompile/analysis/serve_calibration.py gives each row's source, commit,
configuration and what was assumed; parcompile/analysis/serve_engines.py the constants):
vLLM's nightly latency tests of Llama 3.1 8B (tp 1) and 70B (tp 4) on H100, and silybench's
Qwen3-8B on one H100 at concurrency 1. For each: the published and planned time per output
token (and time to first token where published), the error, and the plan's breakdown of a
decode step.

    python benchmarks/serve_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import parcompile  # noqa: E402
from parcompile.analysis.serve_calibration import SERVE_ROWS  # noqa: E402


def main() -> int:
    head = f"{'row':24s} {'figure':6s} {'published':>10s} {'planned':>10s} {'error':>7s}"
    print(head)
    print("-" * len(head))
    worst = 0.0
    notes = []
    for row in SERVE_ROWS:
        sv = parcompile.compile(row.spec, filename=f"{row.name}.par").data["serve"]
        got = row.planned(sv)
        for key, pub in row.published.items():
            err = got[key] / pub - 1
            worst = max(worst, abs(err))
            print(f"{row.name:24s} {key:6s} {pub * 1e3:8.2f}ms {got[key] * 1e3:8.2f}ms {err:+7.1%}")
        parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sv["breakdown"].items() if k.startswith("decode_") and v)
        notes.append(f"{row.name}: {row.source} ({row.commit}); configuration: {row.configuration}; assumed: "
                     f"{row.assumed}; decode step (ms): {parts}; planned {got['tokens_per_s']:,.0f} output tokens/s")
    print()
    for n in notes:
        print(n)
    print(f"\nlargest error {worst:.1%} (issue 45: within 10%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
