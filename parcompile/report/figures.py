"""The report's plots, drawn with matplotlib (the ``report`` extra) as SVG for inlining:
memory per stage as stacked bars against the capacity, the step time by cause, a search's
candidates. Deterministic bytes: the SVG ids are salted with the figure's name
(``svg.hashsalt``, so two inlined figures never share an id), no date in the metadata,
text kept as text (``svg.fonttype = none``). Without matplotlib every function returns
None and the report shows its tables alone.
"""

from __future__ import annotations

import io
import re
from contextlib import contextmanager

from parcompile.report.search import Point
from parcompile.report.tables import memory_terms

#: matplotlib's tab10, the order terms are coloured in
PALETTE = ("#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#eeca3b", "#b279a2", "#ff9da6", "#9d755d",
           "#bab0ac")


def available() -> bool:
    """Whether matplotlib can be imported (``pip install parcompile[report]``)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@contextmanager
def _figure(name: str, width: float, height: float):
    """A matplotlib Figure (no pyplot state) inside deterministic SVG settings; yields
    ``(fig, out)`` where ``out`` receives the SVG text on exit."""
    import matplotlib
    from matplotlib.figure import Figure

    out: list[str] = []
    with matplotlib.rc_context({"svg.hashsalt": f"parcompile-{name}", "svg.fonttype": "none",
                                "font.family": "sans-serif", "font.size": 9}):
        fig = Figure(figsize=(width, height), layout="constrained")
        yield fig, out
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
    svg = buf.getvalue()
    # inline: drop the XML declaration and DOCTYPE; the figure's name on the root element
    svg = svg[svg.index("<svg"):]
    out.append(re.sub(r"^<svg ", f'<svg data-plot="{name}" role="img" ', svg, count=1))


def _unit(largest: float) -> tuple[str, int]:
    """The binary unit the memory axis counts in: the largest that keeps ``largest`` >= 1."""
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= size:
            return name, size
    return "B", 1


def memory_svg(data: dict) -> str | None:
    """``memory.per_stage`` as horizontal stacked bars (bytes per rank, a bar per pipeline
    stage), the terms of :func:`~parcompile.report.tables.memory_terms`, with the usable
    capacity (``memory.capacity``) and the device's memory as vertical lines; a capacity
    over four times the largest bar is named in the legend instead (the bars would not show)."""
    if not available():
        return None
    mem = data["memory"]
    stages = mem["per_stage"]
    terms = memory_terms(data)
    largest = max(sum(s.get(k) or 0 for k, _ in terms) for s in stages) if stages else 0
    unit, size = _unit(max(largest, 1))
    with _figure("memory", 8.5, 1.2 + 0.35 * len(stages)) as (fig, out):
        ax = fig.subplots()
        left = [0.0] * len(stages)
        ys = [s["stage"] for s in stages]
        for j, (key, name) in enumerate(terms):
            w = [(s.get(key) or 0) / size for s in stages]
            ax.barh(ys, w, left=left, color=PALETTE[j % len(PALETTE)], label=name, height=0.6)
            left = [a + b for a, b in zip(left, w)]
        for key, name, style in (("capacity", "capacity", "--"), ("device_memory", "device memory", ":")):
            v = mem.get(key)
            if not v:
                continue
            if v <= 4 * largest:
                ax.axvline(v / size, color="black" if style == "--" else "grey", linestyle=style, linewidth=1,
                           label=name)
            else:   # off the scale of the bars: named, not drawn
                ax.plot([], [], " ", label=f"{name} {v / 2**30:.2f} GiB (off the axis)")
        ax.set_yticks(ys, [f"stage {y}" for y in ys])
        ax.invert_yaxis()
        ax.set_xlabel(f"{unit} per rank")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(stages) < 3 else -0.2), ncol=5, frameon=False,
                  fontsize=8)
    return out[0]


def breakdown_svg(name: str, bars: list[tuple[str, float]]) -> str | None:
    """Seconds by cause as horizontal bars, in milliseconds: ``bars`` is (cause, seconds)
    in the order shown, zeros left out; causes that share a prefix (``decode_``,
    ``prefill_``) share a colour when every cause has one."""
    if not available():
        return None
    bars = [(k, v) for k, v in bars if v]
    groups = [k.split("_")[0] if "_" in k else k for k, _ in bars]
    grouped = len(set(groups)) < len(groups)
    order = list(dict.fromkeys(groups))
    with _figure(name, 8.5, 0.8 + 0.28 * max(len(bars), 1)) as (fig, out):
        ax = fig.subplots()
        ys = list(range(len(bars)))
        colours = [PALETTE[(order.index(g) if grouped else i) % len(PALETTE)] for i, g in enumerate(groups)]
        drawn = ax.barh(ys, [v * 1e3 for _, v in bars], color=colours, height=0.6)
        ax.bar_label(drawn, [f"{v * 1e3:,.4g} ms" for _, v in bars], padding=3, fontsize=8)
        ax.set_yticks(ys, [k for k, _ in bars])
        ax.invert_yaxis()
        ax.set_xlabel("milliseconds")
        ax.margins(x=0.15)
    return out[0]


def search_svg(pts: list[Point], serve: bool, capacity: int | None = None) -> str | None:
    """A search's candidates as a scatter, the chosen one marked: step time against memory
    peak (layout search, with the capacity as a line), or tokens/s per GPU against tokens/s
    per user with the Pareto front (sizing search)."""
    if not available():
        return None
    with _figure("search", 8.5, 4.2) as (fig, out):
        ax = fig.subplots()
        if serve:
            ax.scatter([p.x for p in pts], [p.y for p in pts], s=12, color="#bab0ac", label="fits, carries the load")
            front = sorted((p for p in pts if p.front), key=lambda p: p.x)
            ax.plot([p.x for p in front], [p.y for p in front], "o-", color=PALETTE[0], markersize=4,
                    label="Pareto front")
            ax.set_xlabel("output tokens/s per user (1 / TPOT)")
            ax.set_ylabel("output tokens/s per GPU")
        else:
            largest = max((p.y for p in pts), default=1)
            unit, size = _unit(max(largest, 1))
            ax.scatter([p.x for p in pts], [p.y / size for p in pts], s=12, color=PALETTE[0], label="candidates")
            if capacity and capacity <= 4 * largest:
                ax.axhline(capacity / size, color="black", linestyle="--", linewidth=1, label="capacity")
            elif capacity:   # off the scale of the points: named, not drawn
                ax.plot([], [], " ", label=f"capacity {capacity / 2**30:.2f} GiB (off the axis)")
            ax.set_xlabel("estimated step time (s)")
            ax.set_ylabel(f"memory peak per rank ({unit})")
        for p in pts:
            if p.chosen:
                ax.scatter([p.x], [p.y if serve else p.y / size], s=160, marker="*", color=PALETTE[2], zorder=3,
                           label=f"chosen: {p.label}")
        ax.legend(loc="best", fontsize=8)
    return out[0]
