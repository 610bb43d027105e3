"""The search's result for people: the ranked table, why the best wins, the diagnostic
when nothing fits, progress on stderr."""

from __future__ import annotations

import sys
import time
from typing import Callable

from parcompile.config.text import plural
from parcompile.core.units import bytes_text
from parcompile.diagnostics import Diagnostic
from parcompile.layout_search.candidate import Candidate
from parcompile.layout_search.rank import RETIME, SearchResult
from parcompile.layout_search.space import check_layout, layouts, with_parallel


def no_fit_diagnostic(res: SearchResult) -> Diagnostic:
    """The error when no candidate fits (SPEC: ``search`` exits 1)."""

    cfg = res.cfg
    if res.valid == 0:   # every layout refused by a rule: say the first enumerated layout's first error
        first = next(layouts(cfg), None)
        errors = [d for d in check_layout(with_parallel(cfg, first)) if d.severity == "error"] if first else []
        if errors:
            e = errors[0]
            return Diagnostic("error", f"no layout passes the checks ({res.enumerated} enumerated); the first: "
                              f"{e.message}", e.span, help=e.help, note=e.note, code="does-not-fit")
    if res.closest is not None:
        c = res.closest
        help = (f"the smallest peak, {bytes_text(c.peak)} per GPU ({c.degrees_text()}), exceeds the "
                f"{bytes_text(c.capacity)} available; use more GPUs, GPUs with more memory, or a smaller global_batch")
    else:
        help = "no layout passes the checks; give more of the degrees explicitly to see why"
    return Diagnostic("error", f"no layout fits: {res.valid} valid of {res.enumerated} enumerated, none fits memory",
                      cfg.span("parallel"), help=help, code="does-not-fit")


def _why(best: Candidate, other: Candidate) -> str:
    """The breakdown terms that differ most between two candidates, in words."""
    diffs = []
    for k in sorted(set(best.breakdown) | set(other.breakdown)):
        d = other.breakdown.get(k, 0.0) - best.breakdown.get(k, 0.0)
        if abs(d) > 1e-4 * max(best.step_time, 1e-9):
            diffs.append((d, k))
    diffs.sort(key=lambda x: -abs(x[0]))
    words = []
    for d, k in diffs[:3]:
        words.append(f"{k} {'+' if d > 0 else '-'}{abs(d) * 1e3:.1f} ms")
    return ", ".join(words) if words else "same estimate; simpler layout"


def table(res: SearchResult, top: int = 10) -> str:
    """The ranked candidates as a text table."""
    rows = [("#", "layout", "peak mem", "step", "MFU", "bubble", "vs best")]
    best = res.candidates[0] if res.candidates else None
    for i, c in enumerate(res.candidates[:top]):
        why = "best" if i == 0 else f"+{(c.step_time / best.step_time - 1) * 100:.1f}%: {_why(best, c)}"
        rows.append((str(i + 1), c.degrees_text(), bytes_text(c.peak), f"{c.step_time:.3f} s", f"{c.mfu * 100:.1f}%",
                     f"{c.bubble_fraction * 100:.1f}%", why))
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]) - 1)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    skipped = ""
    if res.unfit or res.bounded:
        skipped = (f"; not costed: {res.unfit} shown not to fit memory, {res.bounded} shown slower than the "
                   f"{max(RETIME, top)} best (the candidates re-timed with their simulated schedules)")
    head = (f"{res.cfg.name}: {plural(res.enumerated, 'layout')} enumerated, {res.valid} pass the checks, "
            f"{res.fitting} fit memory, {res.pruned} dominated by less recomputation{skipped} ({res.seconds:.2f} s)")
    return "\n".join([head, ""] + lines)


def explain(res: SearchResult) -> str:
    """Why the best beats the runner-up, and how far the user's own layout is from it."""
    if not res.candidates:
        return ""
    best = res.candidates[0]
    out = [f"best: {best.degrees_text()}: {best.step_time:.3f} s per step, MFU {best.mfu * 100:.1f}%, "
           f"peak {best.peak / 2**30:.1f} GiB of {best.capacity / 2**30:.1f} GiB"]
    bd = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in best.breakdown.items() if v > 0)
    out.append(f"  breakdown: {bd}")
    if len(res.candidates) > 1:
        ru = res.candidates[1]
        out.append(f"runner-up: {ru.degrees_text()}: {ru.step_time:.3f} s "
                   f"(+{(ru.step_time / best.step_time - 1) * 100:.2f}%): {_why(best, ru)}")
    if res.user is not None:
        u = res.user
        if u.parallel == best.parallel or abs(u.step_time - best.step_time) < 1e-12:
            out.append("your layout is the best one found")
        else:
            rank = next((i + 1 for i, c in enumerate(res.candidates) if c.parallel == u.parallel), None)
            fit = "" if u.fits else f"; it does not fit memory (peak {u.peak / 2**30:.1f} GiB)"
            where = f"ranked {rank} of {len(res.candidates)}" if rank else "not among the ranked candidates"
            out.append(f"your layout: {u.degrees_text()}: {u.step_time:.3f} s "
                       f"(+{(u.step_time / best.step_time - 1) * 100:.1f}% vs best, {where}){fit}: "
                       f"{_why(best, u)}")
    return "\n".join(out)


def stderr_progress(min_seconds: float = 1.0) -> Callable[[int, int], None]:
    """A progress callback that draws a bar on stderr when it is a terminal, or after
    ``min_seconds`` (a long search), and stays silent otherwise."""
    t0 = time.perf_counter()
    tty = sys.stderr.isatty()
    shown = [False]

    last = [-1]

    def report(done: int, total: int) -> None:
        if not (tty or time.perf_counter() - t0 > min_seconds or shown[0]):
            return
        shown[0] = True
        n = 30 * done // max(total, 1)
        if tty:
            end = "\n" if done >= total else ""
            print(f"\rsearching [{'#' * n}{'.' * (30 - n)}] {done}/{total}", end=end, file=sys.stderr, flush=True)
        elif n // 6 != last[0]:   # a log, not a terminal: a line every fifth of the way
            last[0] = n // 6
            print(f"searching: {done}/{total} layouts", file=sys.stderr, flush=True)

    return report
