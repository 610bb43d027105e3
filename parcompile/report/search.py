"""The points of the report's search figures: a layout search's candidates (step time
against memory peak, :class:`parcompile.layout_search.SearchResult`) or a sizing search's
deployments (tokens/s per user against tokens/s per GPU, the Pareto front,
:class:`parcompile.layout_search.serve.ServeSearch`). The search's own figures: nothing is
re-costed here."""

from __future__ import annotations

from dataclasses import dataclass

from parcompile.core.units import bytes_text, seconds_text

#: at most this many candidates in the figure and its table (the best first)
MAX_POINTS = 2000


@dataclass(frozen=True)
class Point:
    """One candidate of a search: ``label`` (its layout, as ``parcompile search`` prints
    it), ``x`` and ``y`` (the figure's axes: seconds and bytes for a layout search, tokens/s
    per user and per GPU for a sizing search), ``chosen`` (the one the plan is of),
    ``front`` (on the Pareto front; sizing searches), ``texts`` (x and y as they read),
    ``extra`` (further columns: name, text)."""

    label: str
    x: float
    y: float
    chosen: bool
    front: bool = False
    texts: tuple[str, str] = ("", "")
    extra: tuple[tuple[str, str], ...] = ()


def is_serve_search(result) -> bool:
    """Whether ``result`` is a sizing search's (it has a Pareto front)."""
    return hasattr(result, "pareto")


def train_points(result) -> list[Point]:
    """A layout search's candidates, best first: x the estimated step time (seconds), y the
    memory peak per rank (bytes); the first is the chosen one."""
    out = []
    for i, c in enumerate(result.candidates[:MAX_POINTS]):
        out.append(Point(c.degrees_text(), c.step_time, c.peak, i == 0,
                         texts=(seconds_text(c.step_time), bytes_text(c.peak)),
                         extra=(("MFU", f"{c.mfu:.1%}"), ("capacity", bytes_text(c.capacity)))))
    return out


def serve_points(result) -> list[Point]:
    """A sizing search's deployments that fit memory and carry the load: x tokens/s per
    user (1 / TPOT), y output tokens/s per GPU; ``front`` on the Pareto front, ``chosen``
    the best that meets the targets (``candidates[0]``, the one a plan of the spec is of)."""
    front = result.pareto()
    best = result.candidates[0] if result.candidates else None   # the deployment resolve_serve plans
    pts = sorted(result.fitting_all, key=lambda d: (d != best, d not in front, not d.meets, -d.per_gpu))[:MAX_POINTS]
    return [Point(d.text(), d.per_user, d.per_gpu, d == best, d in front,
                  texts=(f"{d.per_user:,.1f}", f"{d.per_gpu:,.1f}"),
                  extra=(("GPUs", str(d.gpus)), ("TTFT", seconds_text(d.ttft)), ("TPOT", seconds_text(d.tpot)),
                         ("meets the targets", "yes" if d.meets else "no")))
            for d in pts]


def points(result) -> list[Point]:
    """:func:`serve_points` or :func:`train_points`, as ``result`` is."""
    return serve_points(result) if is_serve_search(result) else train_points(result)
