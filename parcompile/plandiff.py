"""What changed between two plans (``parcompile diff OLD NEW``, :func:`parcompile.diff`).

:func:`diff_plans` compares two plan.json dicts section by section and lists every change
as a :class:`Change`, in the order a reviewer reads a layout change: the plan itself,
degrees, groups, model, stages, schedule, memory per stage, communication per step,
collectives (runs and bytes per step, by op and axis), compute and the estimate (and the
serving figures of serve plans). Unchanged values are left out. :class:`PlanDiff` renders
the list as text (a terminal), Markdown (a pull-request comment) or JSON (tools).

``--fail-on`` bounds (:func:`parse_bound`) turn a diff into a CI gate: each names a
metric (:data:`METRICS`, or any plan.json path to a number, ``estimate.breakdown.dp_comm``,
``memory.per_stage.0.total``) and how far it may move:

==========================  ===========================================================
``peak_memory=+5%``         fails when the new value is more than 5% above the old
``tokens_per_s=-2%``        fails when it is more than 2% below the old
``step_time=3%``            fails when it moves more than 3% either way
``peak_memory=+2GiB``       an absolute bound, in the metric's unit (bytes, seconds: any
                            `.par` unit of that dimension, ``2GiB``, ``50ms``) or a plain
                            number in plan.json's units (bytes, seconds, counts)
``degrees``                 a bare name fails on any change of the value or section
==========================  ===========================================================

``%`` is always relative to the old value (``mfu=-2%`` is 2% of the old MFU; ``mfu=-0.02``
is two points). Only plan.json dicts are read here: loading specs and files is
:mod:`parcompile.api`'s.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

from parcompile.config.units import DIMENSION_WORDS, UNITS
from parcompile.core.units import bytes_text
from parcompile.plan_schema import Breakdown, Compute, Degrees, Groups, Model, PerStep, Serve

Unit = Literal["count", "bytes", "seconds", "fraction", "rate", "text"]

#: the named metrics of ``--fail-on`` and their plan.json paths (any path to a number works too)
METRICS: dict[str, str] = {
    "peak_memory": "memory.peak",
    "step_time": "estimate.step_time",
    "tokens_per_s": "estimate.tokens_per_s",
    "tflops_per_gpu": "estimate.tflops_per_gpu",
    "mfu": "estimate.mfu",
    "bubble": "schedule.bubble_fraction",
    "comm_bytes": "comm.per_step",   # summed over the axes: bytes the busiest ranks send per step
    "ttft": "serve.ttft",
    "tpot": "serve.tpot",
    "world_size": "world_size",
}

#: the relative difference below which two floats of two plans are one value: the last bits
#: of a sum taken in another order (a time of 0.0006568 s read as "+3.47e-18 s, +0.0%"), far
#: below the 4 significant digits any rendering shows
FLOAT_RTOL = 1e-12


def same_value(old: Any, new: Any) -> bool:
    """Whether ``old`` and ``new`` (plan.json values) are the same: equal, or floats within
    :data:`FLOAT_RTOL` of each other."""
    nums = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (old, new))
    if nums and (isinstance(old, float) or isinstance(new, float)):
        return math.isclose(old, new, rel_tol=FLOAT_RTOL, abs_tol=0.0)
    return old == new


#: memory components compared per stage, in report.md's order
_MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers", "kv_cache")


def unit_of(path: str) -> Unit:
    """The unit of the number at plan.json ``path`` (``memory.peak`` -> bytes,
    ``estimate.step_time`` -> seconds), from SPEC 3's rule: bytes are integers, times are
    seconds, rates per second."""
    last = path.rsplit(".", 1)[-1]
    if path.startswith("memory.") and last not in ("fits", "stage"):
        return "bytes"
    if path.startswith("comm.per_step") or "bytes" in last or path.startswith("collectives."):
        return "count" if last == "count" else "bytes"
    if last in ("mfu", "bubble_fraction"):
        return "fraction"
    if last.endswith("_per_s"):
        return "rate"
    if (path.startswith(("estimate.breakdown", "serve.breakdown")) or last in ("step_time", "ttft", "tpot")
            or path.startswith("estimate.grad_reduction") and last in ("seconds", "hidden", "exposed")):
        return "seconds"
    return "count"


def value_text(v: Any, unit: Unit) -> str:
    """A value as the diff shows it (``-`` for absent)."""
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v).lower() if isinstance(v, bool) else str(v)
    if unit == "bytes":
        return bytes_text(v)
    if unit == "seconds":
        return f"{v:.4g} s"
    if unit == "fraction":
        return f"{v:.2%}"
    if unit == "rate":
        return f"{v:,.0f}/s"
    return f"{v:,}" if isinstance(v, int) else f"{v:.4g}"


@dataclass(frozen=True)
class Change:
    """One value that differs between the two plans.

    ``section``: where it sits (``degrees``, ``memory``...); ``name``: what it is, in
    words (``stage 0 total``); ``path``: its plan.json path (``memory.per_stage.0.total``;
    collectives ``collectives.all_gather.tp.bytes``); ``old``/``new``: the values (None:
    absent from that plan); ``unit``: how numbers read (:data:`Unit`).
    """

    section: str
    name: str
    path: str
    old: Any
    new: Any
    unit: Unit = "count"

    @property
    def numeric(self) -> bool:
        return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (self.old, self.new))

    @property
    def delta(self) -> float | None:
        """``new - old`` for numbers, else None."""
        return self.new - self.old if self.numeric else None

    @property
    def relative(self) -> float | None:
        """``(new - old) / old`` for numbers (``inf`` from zero), else None."""
        if not self.numeric:
            return None
        if self.old == 0:
            return 0.0 if self.new == 0 else math.copysign(math.inf, self.new)
        return (self.new - self.old) / abs(self.old)

    def change_text(self) -> str:
        """``+29.8%`` (with the absolute step where the percentage hides it), ``new``,
        ``removed`` or empty for text."""
        if self.old is None:
            return "new"
        if self.new is None:
            return "removed"
        rel = self.relative
        if rel is None:
            return ""
        if math.isinf(rel):
            return "from 0"
        step = ""
        if self.unit == "bytes":
            step = f"{'+' if self.delta >= 0 else '-'}{bytes_text(abs(self.delta))}"
        elif self.unit == "fraction":
            step = f"{self.delta * 100:+.2f} pt"
        elif self.unit == "seconds" and abs(rel) < 0.0005:
            step = f"{self.delta:+.3g} s"
        pct = f"{rel:+.1%}"
        return f"{step}, {pct}" if step else pct

    def to_dict(self) -> dict:
        return {"section": self.section, "name": self.name, "path": self.path, "old": self.old, "new": self.new,
                "unit": self.unit, "delta": self.delta,
                "relative": None if self.relative is None or math.isinf(self.relative) else self.relative}


# --------------------------------------------------------------------------------------
# Comparing


def _layers_text(layers: list[int]) -> str:
    """``[0, 1, ..., 19]`` -> ``0-19``; runs joined by commas (interleaved chunks)."""
    if not layers:
        return "-"
    runs, start, prev = [], layers[0], layers[0]
    for x in layers[1:]:
        if x != prev + 1:
            runs.append((start, prev))
            start = x
        prev = x
    runs.append((start, prev))
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def _groups_text(groups: list[list[int]]) -> str:
    if not groups:
        return "-"
    sizes = sorted({len(g) for g in groups})
    size = str(sizes[0]) if len(sizes) == 1 else "/".join(map(str, sizes))
    return f"{len(groups)} x {size} ranks"


def _collective_totals(plan: dict) -> dict[tuple[str, str], tuple[int, int]]:
    """(op, axis) -> (runs per step, bytes per step): every stage's collectives summed,
    bytes as plan.json counts them (the tensor each produces) times its runs."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for c in plan.get("comm", {}).get("collectives", []):
        key = (c["op"], c["axis"])
        n, b = out.get(key, (0, 0))
        out[key] = (n + c["count"], b + c["bytes"] * c["count"])
    return out


class _Rows:
    def __init__(self):
        self.changes: list[Change] = []

    def add(self, section: str, name: str, path: str, old: Any, new: Any, unit: Unit | None = None) -> None:
        if not same_value(old, new):
            self.changes.append(Change(section, name, path, old, new, unit or unit_of(path)))

    def keys(self, section: str, path: str, old: dict | None, new: dict | None,
             keys: Iterable[str] | None = None, unit: Unit | None = None, prefix: str = "") -> None:
        """Every key of two dicts: ``keys`` in their order, then any others sorted (so a
        plan read from plan.json, keys sorted, and one compiled in memory read the same)."""
        old, new = old or {}, new or {}
        names = list(keys or ())
        names += sorted(k for k in {*old, *new} if k not in names)
        for k in names:
            o, n = old.get(k), new.get(k)
            if isinstance(o, (dict, list)) or isinstance(n, (dict, list)):
                continue
            self.add(section, prefix + k, f"{path}.{k}" if path else k, o, n, unit)


def _fields(model) -> tuple[str, ...]:
    """The keys of a plan.json section in its model's order (:mod:`parcompile.plan_schema`)."""
    return tuple(model.model_fields)


def diff_plans(old: dict, new: dict) -> list[Change]:
    """Every change from plan.json dict ``old`` to ``new`` (module docstring), in reading
    order. Sections a plan lacks (``serve`` of a training plan) count as absent values;
    plan.json files of older versions compare on the keys they have."""
    r = _Rows()
    r.keys("plan", "", old, new, ("name", "workload", "world_size", "order", "version"),
           unit="count")
    r.keys("degrees", "degrees", old.get("degrees"), new.get("degrees"), _fields(Degrees))
    og, ng = old.get("groups", {}), new.get("groups", {})
    for axis in _fields(Groups) + tuple(sorted({*og, *ng} - set(_fields(Groups)))):
        o, n = og.get(axis), ng.get(axis)
        if o == n:
            continue
        ot, nt = (_groups_text(o) if o is not None else None), (_groups_text(n) if n is not None else None)
        if ot == nt:   # same shape, other ranks: show the first group that differs
            i = next(i for i, (a, b) in enumerate(zip(o, n)) if a != b)
            ot, nt = f"group {i}: {o[i]}", f"group {i}: {n[i]}"
        r.add("groups", axis, f"groups.{axis}", ot, nt, "text")
    r.keys("model", "model", old.get("model"), new.get("model"), _fields(Model))
    os_, ns = old.get("stages", []), new.get("stages", [])
    r.add("stages", "stages", "stages", len(os_), len(ns), "count")
    for i in range(max(len(os_), len(ns))):
        o = os_[i] if i < len(os_) else {}
        n = ns[i] if i < len(ns) else {}
        r.add("stages", f"stage {i} layers", f"stages.{i}.layers",
              _layers_text(o["layers"]) if o else None, _layers_text(n["layers"]) if n else None, "text")
        r.add("stages", f"stage {i} params/rank", f"stages.{i}.params_per_rank",
              o.get("params_per_rank"), n.get("params_per_rank"), "count")
    osch, nsch = old.get("schedule", {}), new.get("schedule", {})
    r.keys("schedule", "schedule", osch, nsch, ("name", "num_microbatches", "bubble_fraction"))
    oin, nin = osch.get("in_flight"), nsch.get("in_flight")
    if oin != nin:
        r.add("schedule", "in_flight", "schedule.in_flight", str(oin), str(nin), "text")
    om, nm = old.get("memory", {}), new.get("memory", {})
    ops, nps = om.get("per_stage", []), nm.get("per_stage", [])
    for i in range(max(len(ops), len(nps))):
        o = ops[i] if i < len(ops) else {}
        n = nps[i] if i < len(nps) else {}
        r.keys("memory", f"memory.per_stage.{i}", o, n, ("total",) + _MEMORY_PARTS, "bytes", prefix=f"stage {i} ")
    r.keys("memory", "memory", om, nm, ("peak", "capacity", "fits"))
    r.keys("comm", "comm.per_step", old.get("comm", {}).get("per_step"), new.get("comm", {}).get("per_step"),
           _fields(PerStep), unit="bytes")
    oc, nc = _collective_totals(old), _collective_totals(new)
    for op, axis in sorted(set(oc) | set(nc), key=lambda k: (k[1], k[0])):
        o, n = oc.get((op, axis), (None, None)), nc.get((op, axis), (None, None))
        r.add("collectives", f"{op} {axis} runs", f"collectives.{op}.{axis}.count", o[0], n[0], "count")
        r.add("collectives", f"{op} {axis} bytes", f"collectives.{op}.{axis}.bytes", o[1], n[1], "bytes")
    r.keys("compute", "compute", old.get("compute"), new.get("compute"), _fields(Compute))
    oe, ne = old.get("estimate", {}), new.get("estimate", {})
    r.keys("estimate", "estimate", oe, ne, ("step_time", "tokens_per_s", "tflops_per_gpu", "mfu"))
    r.keys("estimate", "estimate.breakdown", oe.get("breakdown"), ne.get("breakdown"), _fields(Breakdown),
           unit="seconds")
    if "serve" in old or "serve" in new:
        r.keys("serve", "serve", old.get("serve"), new.get("serve"), _fields(Serve))
    return r.changes


# --------------------------------------------------------------------------------------
# --fail-on bounds


class BoundError(ValueError):
    """A ``--fail-on`` bound that cannot be read (a usage error: exit 2)."""


@dataclass(frozen=True)
class Bound:
    """One ``--fail-on`` bound (module docstring). ``direction``: ``+`` (a rise), ``-`` (a
    fall), ``±`` (either), or ``any`` (any change, no amount); ``amount`` is relative
    (0.05 for ``5%``) when ``relative``, else in plan.json's unit of the metric."""

    text: str
    metric: str
    path: str
    direction: Literal["+", "-", "±", "any"]
    amount: float = 0.0
    relative: bool = False


_BOUND = re.compile(r"^\s*([+-]?)\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z%/]*)\s*$")


def parse_bound(text: str) -> Bound:
    """Read ``METRIC[=[+|-]AMOUNT[%|UNIT]]`` (module docstring).

    Raises:
        BoundError: a bound that does not read (the message says what would).
    """
    metric, eq, amount = text.partition("=")
    metric = metric.strip()
    if not metric:
        raise BoundError(f"--fail-on {text!r}: name a metric, e.g. peak_memory=+5%")
    path = METRICS.get(metric, metric)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*", path):
        raise BoundError(f"--fail-on {text!r}: `{metric}` is neither a metric ({', '.join(METRICS)}) "
                         "nor a plan.json path such as estimate.breakdown.dp_comm")
    if not eq:
        return Bound(text, metric, path, "any")
    m = _BOUND.match(amount)
    if not m:
        raise BoundError(f"--fail-on {text!r}: the bound is +N% (a rise), -N% (a fall), N% (either way), or an "
                         "amount with a unit (+2GiB, +50ms); e.g. peak_memory=+5%")
    sign, number, unit = m.groups()
    value = float(number)
    direction = {"+": "+", "-": "-", "": "±"}[sign]
    if unit == "%":
        return Bound(text, metric, path, direction, value / 100, True)
    want = {"bytes": "memory", "seconds": "time"}.get(unit_of(path) if metric != "comm_bytes" else "bytes")
    if unit:
        u = UNITS.get(unit)
        if u is None:
            raise BoundError(f"--fail-on {text!r}: unknown unit `{unit}`; use % or a unit such as GiB, MB, s, ms")
        if u.dimension != want:
            raise BoundError(f"--fail-on {text!r}: `{metric}` is "
                             f"{DIMENSION_WORDS.get(want, 'a plain number') if want else 'a plain number'}, "
                             f"`{unit}` is {DIMENSION_WORDS[u.dimension]}")
        value *= u.factor
    return Bound(text, metric, path, direction, value, False)


def lookup(plan: dict, path: str) -> Any:
    """The value at dotted ``path`` of a plan.json dict (list items by index), None when
    absent; ``comm.per_step`` (the ``comm_bytes`` metric) sums its axes, and
    ``collectives.OP.AXIS.count`` / ``.bytes`` are the diff's totals per step."""
    node: Any = plan
    if path == "collectives" or path.startswith("collectives."):
        node = {}
        for (op, axis), (n, b) in _collective_totals(plan).items():
            node.setdefault(op, {})[axis] = {"count": n, "bytes": b}
        node = {"collectives": node} if node else {}
    for part in path.split("."):
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
        if node is None:
            return None
    if path == "comm.per_step" and isinstance(node, dict):
        return sum(node.values())
    return node


@dataclass(frozen=True)
class BoundCheck:
    """A bound held against the two plans: ``crossed`` when it fails."""

    bound: Bound
    old: Any
    new: Any
    crossed: bool
    message: str

    def to_dict(self) -> dict:
        return {"bound": self.bound.text, "metric": self.bound.metric, "path": self.bound.path,
                "old": self.old, "new": self.new, "crossed": self.crossed, "message": self.message}


def check_bound(bound: Bound, old: dict, new: dict, changes: list[Change] | None = None) -> BoundCheck:
    """Hold ``bound`` against plan.json dicts ``old`` and ``new`` (``changes``: their
    :func:`diff_plans`, which names what changed in a section given by a bare name).

    Raises:
        BoundError: neither plan has the metric, or a numeric bound on a value that is not
            a number (a section: use the bare name for "any change").
    """
    o, n = lookup(old, bound.path), lookup(new, bound.path)
    if o is None and n is None:
        raise BoundError(f"--fail-on {bound.text}: neither plan has `{bound.path}`")
    unit = "bytes" if bound.metric == "comm_bytes" else unit_of(bound.path)
    c = Change("", bound.metric, bound.path, o, n, unit)
    if bound.direction == "any":
        crossed = not same_value(o, n)
        if not isinstance(o, (dict, list)) and not isinstance(n, (dict, list)):
            what = f"{value_text(o, unit)} -> {value_text(n, unit)}"
        else:   # a section: what changed in it
            inside = [c for c in (changes if changes is not None else diff_plans(old, new))
                      if c.path.startswith(bound.path + ".")]
            what = "; ".join(f"{c.name} {value_text(c.old, c.unit)} -> {value_text(c.new, c.unit)}"
                             for c in inside[:6]) + (f"; {len(inside) - 6} more" if len(inside) > 6 else "")
            what = what or "changed"
        return BoundCheck(bound, o, n, crossed, what if crossed else "unchanged")
    if o is None or n is None:
        return BoundCheck(bound, o, n, True, f"only in the {'new' if o is None else 'old'} plan")
    if not c.numeric:
        raise BoundError(f"--fail-on {bound.text}: `{bound.path}` is not a number; "
                         f"give the bare name (--fail-on {bound.metric}) to fail on any change")
    step = c.relative if bound.relative else c.delta
    limit = bound.amount
    crossed = {"+": step > limit, "-": step < -limit, "±": abs(step) > limit}[bound.direction]
    moved = f"{value_text(o, unit)} -> {value_text(n, unit)}" + (f" ({c.change_text()})" if o != n else "")
    return BoundCheck(bound, o, n, bool(crossed), moved)


# --------------------------------------------------------------------------------------
# The report


_SECTION_TITLES = {
    "plan": "plan", "degrees": "degrees", "groups": "groups", "model": "model", "stages": "stages",
    "schedule": "schedule", "memory": "memory (bytes per rank)", "comm": "communication (bytes the busiest rank of "
    "each axis sends per step)", "collectives": "collectives (runs and tensor bytes per step, all stages)",
    "compute": "compute (FLOPs per step)", "estimate": "estimate (per step)", "serve": "serving",
}


def plan_label(plan: dict) -> str:
    """``llama3_70b: 64 ranks, tp 8 x pp 4 x dp 2``: a plan in one line."""
    deg = plan.get("degrees", {})
    parts = [f"{k} {deg[k]}" for k in ("tp", "pp", "dp", "cp", "ep") if k in deg and (deg[k] > 1 or k in ("tp", "pp", "dp"))]
    return f"{plan.get('name', '?')}: {plan.get('world_size', '?')} ranks, {' x '.join(parts)}"


@dataclass
class PlanDiff:
    """The changes from one plan to another (:func:`diff_plans`) and the ``--fail-on``
    checks held against them. ``old_name``/``new_name`` say where each plan came from."""

    old: dict
    new: dict
    changes: list[Change]
    old_name: str = "old"
    new_name: str = "new"
    checks: list[BoundCheck] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """True when the plans differ in anything the diff compares."""
        return bool(self.changes)

    @property
    def failed(self) -> bool:
        """True when a ``--fail-on`` bound is crossed."""
        return any(c.crossed for c in self.checks)

    def check(self, bounds: Iterable[Bound | str]) -> list[BoundCheck]:
        """Hold ``bounds`` (:class:`Bound` or their text, ``"peak_memory=+5%"``) against
        the two plans; records and returns the checks.

        Raises:
            BoundError: a bound that does not read or names no value of either plan.
        """
        new = [check_bound(b if isinstance(b, Bound) else parse_bound(b), self.old, self.new, self.changes)
               for b in bounds]
        self.checks += new
        return new

    def sections(self) -> dict[str, list[Change]]:
        out: dict[str, list[Change]] = {}
        for c in self.changes:
            out.setdefault(c.section, []).append(c)
        return out

    def _heading(self) -> list[str]:
        return [f"old: {self.old_name} ({plan_label(self.old)})", f"new: {self.new_name} ({plan_label(self.new)})"]

    def text(self) -> str:
        """The diff for a terminal: one block per section, ``name  old -> new  change``."""
        out = [f"parcompile diff {self.old_name} {self.new_name}"] + ["  " + h for h in self._heading()]
        if not self.changes:
            out.append("no changes")
        for section, rows in self.sections().items():
            out += ["", _SECTION_TITLES.get(section, section)]
            cells = [(c.name, value_text(c.old, c.unit), value_text(c.new, c.unit), c.change_text()) for c in rows]
            w = [max(len(r[j]) for r in cells) for j in range(3)]
            out += [f"  {a:<{w[0]}}  {b:>{w[1]}} -> {c:<{w[2]}}  {d}".rstrip() for a, b, c, d in cells]
        if self.checks:
            out.append("")
            out += [f"fail-on {k.bound.text}: {'CROSSED' if k.crossed else 'ok'}: {k.message}" for k in self.checks]
        return "\n".join(out) + "\n"

    def markdown(self) -> str:
        """The diff for a pull-request comment: a table per section."""
        def cell(s: str) -> str:
            return s.replace("|", "\\|")

        out = [f"### parcompile diff: `{self.old_name}` → `{self.new_name}`", ""]
        out += [f"- {h.split(': ', 1)[0]}: `{cell(h.split(': ', 1)[1])}`" for h in self._heading()]
        if self.checks:
            out += ["", "| fail-on | result | |", "|---|---|---|"]
            out += [f"| `{cell(k.bound.text)}` | {'**crossed**' if k.crossed else 'ok'} | {cell(k.message)} |"
                    for k in self.checks]
        if not self.changes:
            out += ["", "No changes."]
        for section, rows in self.sections().items():
            out += ["", f"#### {_SECTION_TITLES.get(section, section)}", "", "| | old | new | change |",
                    "|---|---:|---:|---:|"]
            out += [f"| {cell(c.name)} | {cell(value_text(c.old, c.unit))} | {cell(value_text(c.new, c.unit))} | "
                    f"{cell(c.change_text())} |" for c in rows]
        return "\n".join(out) + "\n"

    def to_dict(self) -> dict:
        return {"old": {"name": self.old_name, "plan": plan_label(self.old)},
                "new": {"name": self.new_name, "plan": plan_label(self.new)},
                "changed": self.changed, "changes": [c.to_dict() for c in self.changes],
                "checks": [k.to_dict() for k in self.checks], "failed": self.failed}

    def to_json(self) -> str:
        """The diff as JSON (sorted keys, 2-space indent): ``changes`` with raw values in
        plan.json units, ``checks``, ``failed``."""
        return json.dumps(self.to_dict(), sort_keys=True, indent=2) + "\n"

    def render(self, fmt: str = "text") -> str:
        """``text``, ``markdown`` or ``json`` (ValueError otherwise)."""
        if fmt not in ("text", "markdown", "json"):
            raise ValueError(f"unknown diff format {fmt!r}; choose text, markdown or json")
        return {"text": self.text, "markdown": self.markdown, "json": self.to_json}[fmt]()
