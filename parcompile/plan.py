"""The compiled plan: config, graph, the ``plan.json`` dict, warnings, and its renderings.

``Plan.to_json()`` is byte-stable: sorted keys, 2-space indent, trailing newline, no
timestamps and no absolute paths (SPEC 3). ``Plan.report_md()`` is the human-readable
report ``parcompile compile`` writes next to it; ``Plan.write(directory)`` writes every
file ``parcompile compile -o DIR`` writes (``compile`` calls it). The sections of
plan.json are typed attributes (``plan.memory.peak``, ``plan.estimate.step_time``): the
models of :mod:`parcompile.plan_schema`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from parcompile.config.schema import SpecConfig
from parcompile.config.text import plural
from parcompile.core.units import bytes_text, seconds_text
from parcompile.diagnostics import Diagnostic, Sources, SpecError
from parcompile.ir.graph import Graph
from parcompile.ir.printer import dot, dump
if TYPE_CHECKING:
    from parcompile.codegen.k8s import K8sOptions
    from parcompile.passes.results import PassResults
from parcompile.plan_schema import (Comm, Compute, Estimate, Groups, Memory, Model, PlanJSON, Schedule, Serve,
                                    Stage, Train, validate_plan)

FORMAT = "parcompile.plan/1"

#: every file ``compile`` may write (:meth:`Plan.write`) beside the Kubernetes manifests
#: (:data:`parcompile.codegen.k8s.K8S_FILES`); ones a new plan does not produce are removed
#: from the directory
GENERATED = ("plan.json", "report.md", "report.html", "graph.txt", "trace.json", "timeline.svg", "program.py",
             "serve.py", "launch.sh", "slurm.sbatch")
#: the files :meth:`Plan.write` marks executable
EXECUTABLE = ("launch.sh", "slurm.sbatch")
TIMELINE_SECTION = """
## Timeline of one step

![simulated timeline of one step](timeline.svg)

The schedule's actions run by the simulator with the cost model's times; `trace.json` holds
the same timeline in Chrome trace format (open it in Perfetto or chrome://tracing).
"""


@dataclass
class Plan:
    """A compiled spec. ``data`` is the plan.json dict (SPEC 3 plus extensions:
    ``stages[].chunks``, ``collectives[].stage`` / ``.phase``, ``estimate.assumptions``)."""

    config: SpecConfig
    graph: Graph
    data: dict[str, Any]
    warnings: list[Diagnostic] = field(default_factory=list)
    degrees: dict[str, int] = field(default_factory=dict)
    #: the search that filled the spec's ``auto`` keys (:class:`parcompile.layout_search.SearchResult`), else None
    search: Any = None
    #: the text the warnings quote (:data:`parcompile.diagnostics.Sources`: the spec's, and its overrides')
    source: Sources = None
    #: what the passes returned (:class:`parcompile.passes.results.PassResults`: the model
    #: chunks, the stages' parameters, the simulated schedule)
    passes: "PassResults | None" = None

    def to_json(self) -> str:
        """The plan.json text, byte for byte."""
        return dumps_sorted(self.data) + "\n"

    # -- plan.json, typed ----------------------------------------------------------------

    @cached_property
    def typed(self) -> PlanJSON:
        """plan.json as its pydantic model (:class:`parcompile.plan_schema.PlanJSON`),
        validated once on first use. Its sections are also attributes of the plan
        (``plan.memory``); ``plan.typed.degrees`` and ``plan.typed.search`` are the typed
        forms of the two that :attr:`degrees` and :attr:`search` name otherwise."""
        return validate_plan(self.data)

    @property
    def format(self) -> str:
        """plan.json ``format``: ``"parcompile.plan/1"``."""
        return self.typed.format

    @property
    def version(self) -> str:
        """plan.json ``version``: the parcompile version that compiled it."""
        return self.typed.version

    @property
    def name(self) -> str:
        """plan.json ``name``: the spec file's stem."""
        return self.typed.name

    @property
    def workload(self) -> str:
        """plan.json ``workload``: ``"train"`` or ``"serve"``."""
        return self.typed.workload

    @property
    def world_size(self) -> int:
        """plan.json ``world_size``: ranks."""
        return self.typed.world_size

    @property
    def order(self) -> str:
        """plan.json ``order``: rank order, fastest-varying first."""
        return self.typed.order

    @property
    def groups(self) -> Groups:
        """plan.json ``groups``: each axis's rank groups (``plan.groups.tp``)."""
        return self.typed.groups

    @property
    def model(self) -> Model:
        """plan.json ``model``: parameter counts and shape (``plan.model.params``)."""
        return self.typed.model

    @property
    def stages(self) -> list[Stage]:
        """plan.json ``stages``: one per pipeline rank (``plan.stages[0].layers``)."""
        return self.typed.stages

    @property
    def schedule(self) -> Schedule:
        """plan.json ``schedule`` (``plan.schedule.bubble_fraction``)."""
        return self.typed.schedule

    @property
    def memory(self) -> Memory:
        """plan.json ``memory``, bytes per rank (``plan.memory.peak``, ``plan.memory.per_stage[0].total``)."""
        return self.typed.memory

    @property
    def comm(self) -> Comm:
        """plan.json ``comm`` (``plan.comm.per_step.tp``: bytes per step)."""
        return self.typed.comm

    @property
    def compute(self) -> Compute:
        """plan.json ``compute`` (``plan.compute.model_flops_per_step``)."""
        return self.typed.compute

    @property
    def estimate(self) -> Estimate:
        """plan.json ``estimate`` (``plan.estimate.step_time``: seconds; ``.mfu``)."""
        return self.typed.estimate

    @property
    def train(self) -> Optional[Train]:
        """plan.json ``train`` (training specs; None for serving): ``plan.train.method``,
        ``.trainable_params`` against ``.frozen_params`` (whole model), ``.lora`` (LoRA)."""
        return self.typed.train

    @property
    def serve(self) -> Optional[Serve]:
        """plan.json ``serve`` (serve specs; None for training): ``plan.serve.tpot``."""
        return self.typed.serve

    # -- the files compile writes --------------------------------------------------------

    def outputs(self, directory: str | Path, k8s: "K8sOptions | None" = None) -> dict[str, str]:
        """Every file :meth:`write` writes into ``directory``, name -> text: plan.json,
        report.md, report.html, graph.txt, trace.json, timeline.svg, the program (program.py or
        serve.py), launch.sh, slurm.sbatch and the Kubernetes manifests ``k8s/*.yaml``
        (:mod:`parcompile.codegen.k8s`; ``k8s``: their image, namespace and storage, defaults
        where None). ``directory`` matters to the program (it names the spec's data files
        relative to it).

        Raises:
            K8sError: a ``k8s`` option the API server would refuse (nothing is written).
            SpecError: the spec asks for what the generated program cannot run and does not
                stand in for (FP8 training: :func:`parcompile.codegen.emit.program_gaps`, the
                refusal of ``compile``)."""
        from parcompile.codegen.emit import program_gaps, render_launch, render_program, render_serve, render_slurm
        from parcompile.codegen.k8s import k8s_files

        refused = [g for g in program_gaps(self.config) if g.severity == "error"]
        if refused:
            raise SpecError(refused)
        out_dir = Path(directory)
        timeline = self.timeline_svg()
        files = {
            "plan.json": self.to_json(),
            "report.md": self.report_md() + TIMELINE_SECTION,
            "graph.txt": self.graph_dump(),
            "trace.json": self.trace_json(),
            "timeline.svg": timeline,
            "report.html": self.report_html(timeline),
        }
        if self.config.workload == "train":
            files["program.py"] = render_program(self.config, self, out_dir)
        else:
            files["serve.py"] = render_serve(self.config, self, out_dir)
        files["launch.sh"] = render_launch(self.config)
        files["slurm.sbatch"] = render_slurm(self.config)
        files.update(k8s_files(self.config, files, k8s, self._spec_text(), out_dir))
        return files

    def _spec_text(self) -> str | None:
        """The spec's text as compiled (None where not known)."""
        if isinstance(self.source, str):
            return self.source
        return self.source.get(self.config.filename) if self.source else None

    def write(self, directory: str | Path, k8s: "K8sOptions | None" = None) -> list[str]:
        """Write the plan's files into ``directory`` (created if needed), exactly what
        ``parcompile compile SPEC -o DIRECTORY`` writes, byte for byte (:meth:`outputs`):
        atomically (each file old or new, never half-written; a new directory appears
        whole), launch.sh and slurm.sbatch executable, and the files of
        :data:`GENERATED` that this plan does not produce removed (a serve plan's
        directory loses an earlier program.py) when the directory holds an earlier
        plan's plan.json: a directory parcompile did not write keeps its own files (a
        user's program.py). Returns the names written, sorted.

        Raises:
            OSError: the directory cannot be created or written (nothing is left half-written).
            SpecError, K8sError: as :meth:`outputs` (nothing is written).
        """
        from parcompile.codegen.emit import write_files
        from parcompile.codegen.k8s import K8S_FILES

        files = self.outputs(directory, k8s)
        ours = _holds_a_plan(Path(directory) / "plan.json")
        write_files(Path(directory), files, executable=EXECUTABLE, stale=GENERATED + K8S_FILES if ours else ())
        return sorted(files)

    def graph_dump(self) -> str:
        """One line per op (see :mod:`parcompile.ir.printer`)."""
        return dump(self.graph, self.degrees)

    def trace_json(self) -> str:
        """``trace.json``: the simulated timeline of one step (Chrome trace format)."""
        from parcompile.analysis.trace import chrome_trace

        return chrome_trace(self)

    def timeline_svg(self) -> str:
        """``timeline.svg``: the same timeline as a picture (linked from report.md)."""
        from parcompile.analysis.trace import timeline_svg

        return timeline_svg(self)

    def report_html(self, timeline: str | None = None) -> str:
        """``report.html``: the plan as one self-contained HTML page, with the search that
        chose its layout when it had one (:func:`parcompile.report.render_html`;
        ``timeline``: :meth:`timeline_svg`'s text, when the caller has it already)."""
        from parcompile.report import render_html

        return render_html(self, timeline=timeline)

    def graph_dot(self) -> str:
        """The graph in Graphviz DOT (``parcompile plan --format dot``)."""
        return dot(self.graph, self.degrees)

    def report_md(self) -> str:
        """A readable markdown report of the plan."""
        from parcompile.frontend.checks import does_not_fit_help

        return render_report(self.data, does_not_fit_help(self.config.parallel, self.config.model.dtype))


def _holds_a_plan(path: Path) -> bool:
    """Whether ``path`` is a plan.json parcompile wrote (its ``format`` key). Only a
    regular, size-limited file is read (a FIFO there is not waited on)."""
    from parcompile.core.files import read_text

    try:   # keys sorted: "format" follows "comm"; a plan of 16,384 ranks is tens of MB
        return '"format": "parcompile.plan/' in read_text(path, 2**30)
    except (OSError, UnicodeDecodeError):
        return False


class _Unusual(Exception):
    """A value :func:`dumps_sorted`'s fast path does not handle (json.dumps does)."""


_esc = json.encoder.encode_basestring_ascii
_INTS = frozenset((int,))


def _float(o: float) -> str:
    if o != o:
        return "NaN"
    if o in (float("inf"), float("-inf")):
        return "Infinity" if o > 0 else "-Infinity"
    return float.__repr__(o)


def _enc(o: Any, ind: str, out: list) -> None:
    t = type(o)
    if t is str:
        out.append(_esc(o))
    elif t is int:
        out.append(int.__repr__(o))
    elif t is float:
        out.append(_float(o))
    elif o is True:
        out.append("true")
    elif o is False:
        out.append("false")
    elif o is None:
        out.append("null")
    elif t is list or t is tuple:
        if not o:
            out.append("[]")
            return
        inner = ind + "  "
        sep = ",\n" + inner
        if _INTS.issuperset(map(type, o)):   # rank lists: the bulk of a large plan
            body = repr(o)[1:-1].replace(", ", sep) if t is list else sep.join(map(int.__repr__, o))
            out.append("[\n" + inner + body + "\n" + ind + "]")
            return
        if type(o[0]) is list:   # lists of rank lists (groups)
            inner2 = inner + "  "
            sep2 = ",\n" + inner2
            parts = []
            for g in o:
                if type(g) is not list or not _INTS.issuperset(map(type, g)):
                    break
                parts.append("[\n" + inner2 + repr(g)[1:-1].replace(", ", sep2) + "\n" + inner + "]" if g else "[]")
            else:
                out.append("[\n" + inner + sep.join(parts) + "\n" + ind + "]")
                return
        out.append("[\n" + inner)
        first = True
        for x in o:
            if not first:
                out.append(sep)
            first = False
            _enc(x, inner, out)
        out.append("\n" + ind + "]")
    elif t is dict:
        if not o:
            out.append("{}")
            return
        if not all(type(k) is str for k in o):
            raise _Unusual
        inner = ind + "  "
        sep = ",\n" + inner
        out.append("{\n" + inner)
        first = True
        for k in sorted(o):
            if not first:
                out.append(sep)
            first = False
            out.append(_esc(k) + ": ")
            _enc(o[k], inner, out)
        out.append("\n" + ind + "}")
    else:
        raise _Unusual


def dumps_sorted(obj: Any) -> str:
    """``json.dumps(obj, sort_keys=True, indent=2)``, byte for byte, several times faster
    on plan-sized dicts (the stdlib encodes indented JSON in pure Python). Values it does
    not know (non-string keys, subclasses) go to ``json.dumps`` itself."""
    out: list[str] = []
    try:
        _enc(obj, "", out)
    except _Unusual:
        return json.dumps(obj, sort_keys=True, indent=2)
    return "".join(out)


def _groups_line(groups: list[list[int]], limit: int = 4) -> str:
    shown = " ".join("[" + ",".join(str(r) for r in g) + "]" for g in groups[:limit])
    more = f" ... ({len(groups)} groups)" if len(groups) > limit else ""
    return shown + more


def plan_warnings(d: dict[str, Any], advice: str | None = None) -> list[str]:
    """Plain-language warnings about a plan.json dict: memory that does not fit (with
    ``advice``: what the layout could change, :func:`parcompile.frontend.checks.does_not_fit_help`),
    a modelled reserved peak (``memory.reserved_peak``) above the GPU's memory, a pipeline
    bubble above 20% of compute, tensor parallelism across nodes."""
    out = []
    mem = d["memory"]
    if not mem["fits"]:
        worst = max(mem["per_stage"], key=lambda s: s["total"])
        advice = advice or "raise tp or pp, shard optimizer states (zero = 1) or recompute activations"
        out.append(f"The plan does not fit: stage {worst['stage']} needs {bytes_text(worst['total'])} per GPU, "
                   f"{bytes_text(mem['capacity'])} are usable. {advice[0].upper() + advice[1:]}.")
    bubble = d["schedule"].get("bubble_fraction", 0.0)
    if bubble > 0.2:
        sch = d["schedule"]
        out.append(f"The pipeline idles {bubble:.0%} of its compute time (bubble, {sch['name']} with "
                   f"{plural(sch['num_microbatches'], 'micro-batch', 'micro-batches')} over "
                   f"{plural(d['degrees']['pp'], 'stage')}). More "
                   "micro-batches per step, fewer stages or virtual stages (interleaved_1f1b) shrink it.")
    if mem["fits"] and mem.get("device_memory") and mem.get("reserved_peak", 0) > mem["device_memory"]:
        worst = max(mem["per_stage"], key=lambda s: s["total"] + s.get("allocator", 0))
        out.append(f"The caching allocator would reserve {bytes_text(worst['total'] + worst.get('allocator', 0))} "
                   f"per GPU on stage {worst['stage']}, more than the GPU's {bytes_text(mem['device_memory'])}: "
                   + ("run with expandable segments (cluster.expandable_segments = true)."
                      if mem.get("expandable_segments") is False else
                      "leave more memory free (smaller micro-batches, more recomputation or sharding)."))
    links = d["estimate"].get("assumptions", {}).get("links", {})
    if links.get("tp") == "inter-node":
        out.append(f"Tensor parallelism (tp = {d['degrees']['tp']}) crosses nodes: its collectives run every "
                   "layer on the network instead of NVLink. Keep tp within a node (tp <= gpus_per_node).")
    return out


def render_report(d: dict[str, Any], advice: str | None = None) -> str:
    """Markdown for a plan.json dict: degrees, groups, stages, memory, comm, estimate
    (``advice``: what a plan that does not fit could change, see :func:`plan_warnings`)."""
    out = _layout_report(d)
    serve = "serve" in d
    if serve:
        out += [""] + _serve_report(d) + [""]
        return "\n".join(out)
    sch = d["schedule"]
    out += ["", "## Schedule", "",
            f"`{sch['name']}`, {plural(sch['num_microbatches'], 'micro-batch', 'micro-batches')}, bubble "
            f"{sch['bubble_fraction']:.3f}, in flight per stage {sch['in_flight']}.", ""]
    warns = plan_warnings(d, advice) if "serve" not in d else []
    if warns:
        out += ["## Warnings", ""] + [f"- {w}" for w in warns] + [""]
    out += _memory_report(d)
    out += _estimate_report(d)
    out += _comm_report(d)
    out += [""] + _grad_reduction_report(d)
    return "\n".join(out)


def _layout_report(d: dict[str, Any]) -> list[str]:
    """The report's title, degrees, groups, model and stages."""
    out = [f"# Plan `{d.get('name', 'spec')}`", "",
           f"parcompile {d['version']}, {plural(d['world_size'], 'rank')}, order `{d['order']}`, "
           f"workload `{d.get('workload', 'train')}`.", ""]
    deg = d["degrees"]
    out += ["## Degrees", "", "| " + " | ".join(deg) + " |", "|" + "---|" * len(deg),
            "| " + " | ".join(str(v) for v in deg.values()) + " |", ""]
    out += ["## Groups", ""]
    for k, g in d["groups"].items():
        out.append(f"- `{k}` ({plural(len(g[0]) if g else 0, 'rank')} each): {_groups_line(g)}")
    mdl = d["model"]
    out += ["", "## Model", "",
            f"{mdl['params']:,} parameters ({mdl['active_params']:,} active), padded vocabulary "
            f"{mdl['padded_vocab']:,}, {mdl['kv_heads_per_rank']} kv heads per rank"
            + (f" (each kv head replicated on {mdl['kv_head_replicas']} ranks of its tp group)"
               if mdl.get("kv_head_replicas", 1) > 1 else "") + ".", ""] + _train_report(d)
    out += ["## Stages", "", "| stage | layers | ranks | params/rank |", "|---|---|---|---|"]
    for s in d["stages"]:
        layers = f"{s['layers'][0]}-{s['layers'][-1]}" if s["layers"] else "-"
        ranks = _groups_line([s["ranks"]], 1) if len(s["ranks"]) <= 8 else f"{len(s['ranks'])} ranks"
        out.append(f"| {s['index']} | {layers} | {ranks} | {s['params_per_rank']:,} |")
    return out


def _train_report(d: dict[str, Any]) -> list[str]:
    """What the run trains (plan.json ``train``): under LoRA the adapters' settings and the
    trainable (adapter) against frozen parameters; empty for a full fine-tune or a serve plan."""
    tr = d.get("train")
    if not tr or tr["method"] != "lora":
        return []
    lo = tr["lora"]
    return [f"LoRA: rank {lo['rank']}, alpha {lo['alpha']:g}, dropout {lo['dropout']:g}, adapters on "
            f"{', '.join(lo['targets'])} ({lo['adapted_linears']:,} linears); {tr['trainable_params']:,} trainable "
            f"parameters (the adapters, {tr['trainable_params'] / tr['frozen_params']:.2%} of the base), "
            f"{tr['frozen_params']:,} frozen.", ""]


def _host_memory_report(d: dict[str, Any]) -> list[str]:
    """CPU offload (``parallel.offload``): host memory per rank and node, the PCIe traffic and
    the CPU step (``memory.host_per_node``, ``estimate.assumptions.offload``); empty without."""
    mem, off = d["memory"], d["estimate"]["assumptions"].get("offload")
    if "host_per_node" not in mem or not off:
        return []
    ranks = ", ".join(f"stage {s['stage']}: {bytes_text(s.get('host', 0))}" for s in mem["per_stage"])
    return [f"Host memory (offload = {off['mode']}): per rank {ranks}; per node {bytes_text(mem['host_per_node'])} "
            f"of {bytes_text(mem['host_memory'])}. PCIe per step and rank: {bytes_text(off['pcie_down_bytes'])} "
            f"down ({seconds_text(off['pcie_down'])}, hidden under the backward), "
            f"{bytes_text(off['pcie_up_bytes'])} up ({seconds_text(off['pcie_up'])}); the CPU optimizer step "
            f"{seconds_text(off['cpu_step'])}; the step waits {seconds_text(off['exposed'])} for them.", ""]


def _memory_report(d: dict[str, Any]) -> list[str]:
    """Memory per rank: the per-stage table, the peak, the caching allocator, what each decoder
    layer saves for backward, and ZeRO-3's gathered parameters."""
    out: list[str] = []
    mem = d["memory"]
    alloc = "reserved_peak" in mem
    out += ["## Memory (per rank)", "",
            "| stage | params | grads | optimizer | activations | buffers | kv cache | total |"
            + (" allocator | reserved |" if alloc else ""),
            "|---|---|---|---|---|---|---|---|" + ("---|---|" if alloc else "")]
    for s in mem["per_stage"]:
        out.append(f"| {s['stage']} | {bytes_text(s['params'])} | {bytes_text(s['grads'])} | {bytes_text(s['optimizer'])} | "
                   f"{bytes_text(s['activations'])} | {bytes_text(s.get('buffers', 0))} | {bytes_text(s['kv_cache'])} | "
                   f"{bytes_text(s['total'])} |"
                   + (f" {bytes_text(s.get('allocator', 0))} | {bytes_text(s['total'] + s.get('allocator', 0))} |"
                      if alloc else ""))
    out += ["", f"Peak {bytes_text(mem['peak'])} of {bytes_text(mem['capacity'])}: "
            + ("fits." if mem["fits"] else "**does not fit**.")
            + (" Activations are what the micro-batches in flight keep for backward; buffers are "
               "temporary (" + ", ".join(sorted({k for s in mem["per_stage"] for k in s.get("buffer_parts", {})}))
               + ")." if any(s.get("buffer_parts") for s in mem["per_stage"]) else "")]
    if alloc:
        mode = "with" if mem.get("expandable_segments", True) else "without"
        out += [f"PyTorch's caching allocator ({mode} expandable segments) would reserve "
                f"{bytes_text(mem['reserved_peak'])} at the peak (`torch.cuda.max_memory_reserved`): the allocator "
                "column is what it holds beyond the live tensors, "
                + ("the largest temporary buffer (a gap of that size stays mapped)" if mode == "with" else
                   "every temporary buffer again (each cached in its own segment)")
                + (f"; more than the GPU's {bytes_text(mem['device_memory'])}."
                   if mem.get("device_memory") and mem["reserved_peak"] > mem["device_memory"] else ".")]
    out += [""] + _host_memory_report(d)
    per_layer = [(s["stage"], s.get("activations_per_layer", [])) for s in mem["per_stage"]]
    if any(layers for _, layers in per_layer):
        parts = []
        for stage, layers in per_layer:
            sizes = sorted({b for _, b in layers})
            if sizes:
                span = bytes_text(sizes[0]) if len(sizes) == 1 else f"{bytes_text(sizes[0])} to {bytes_text(sizes[-1])}"
                parts.append(f"stage {stage}: {span} x {len(layers)} layers")
        out += ["Saved for backward per decoder layer and micro-batch, after recomputation: "
                + "; ".join(parts) + ". Generated programs measure this with saved-tensor hooks "
                "(`saved_per_layer` in their metrics).", ""]
    gathered = [(s["stage"], s["buffer_parts"]["zero3_gather"]) for s in mem["per_stage"]
                if s.get("buffer_parts", {}).get("zero3_gather")]
    if gathered:
        gathers = {}
        for c in d["comm"]["collectives"]:
            if c["where"] in ("params", "expert_params"):
                gathers[c["stage"]] = gathers.get(c["stage"], 0) + c["count"]
        when = ("every bucket just before its first unit (embedding, decoder layers, output layer), prefetched "
                "one unit ahead, freed after each micro-batch's forward and gathered again for its backward "
                "(pp = 1, FSDP's reshard after forward; the output layer's kept through its backward, the "
                "embedding's not regathered, a tied embedding's kept for the step)" if d["degrees"]["pp"] == 1 else
                "the embedding and output buckets for the step, each bucket of decoder layers just before its "
                "first layer, prefetched one layer ahead, kept across the step's micro-batches (pp > 1, as "
                "torchtitan's FSDP + PP)")
        out += ["ZeRO-3 gathers parameters per gradient bucket where they are used: "
                f"{when}, and frees each once its gradients are reduced. Held at "
                "most at once (`zero3_gather`): " + "; ".join(
                    f"stage {st}: {bytes_text(b)}, {gathers.get(st, 0):,} all-gathers per step" for st, b in gathered)
                + ".", ""]
    return out


def _estimate_report(d: dict[str, Any]) -> list[str]:
    """The estimate per step: time, throughput, MFU, the breakdown and the assumptions."""
    out: list[str] = []
    comp, est = d["compute"], d["estimate"]
    step = est["step_time"]
    out += ["## Estimate (time per step)", "",
            f"**{step:.4g} s** per step: {est['tokens_per_s']:,.0f} tokens/s, "
            f"{est['tflops_per_gpu']:.4g} TFLOP/s per GPU, MFU {est['mfu']:.1%} "
            f"(model FLOPs {comp['model_flops_per_step']:.4g} per step; with recomputation "
            f"{comp['hardware_flops_per_step']:.4g}).", "",
            "| part | seconds | share |", "|---|---|---|"]
    for k, v in est["breakdown"].items():
        if v:
            out.append(f"| {k} | {v:.4g} | {v / step:.1%} |" if step else f"| {k} | {v:.4g} | - |")
    out += [""]
    a = est.get("assumptions", {})
    if a:
        out += ["Assumptions:", ""] + [f"- {k}: {v}" for k, v in a.items()] + [""]
    return out


def _comm_report(d: dict[str, Any]) -> list[str]:
    """Communication per step: bytes per axis and the collectives per stage."""
    out: list[str] = []
    cm = d["comm"]
    out += ["## Communication (per step)", "", "| axis | bytes sent by the busiest rank |", "|---|---|"]
    for ax, b in cm["per_step"].items():
        out.append(f"| {ax} | {bytes_text(b)} |")
    agg: dict[tuple, int] = {}
    for c in cm["collectives"]:
        key = (c["op"], c["axis"], c["bytes"], c["stage"])
        agg[key] = agg.get(key, 0) + c["count"]
    out += ["", "| stage | op | axis | bytes | count |", "|---|---|---|---|---|"]
    for (op, axis, b, s), n in sorted(agg.items(), key=lambda kv: (kv[0][3], kv[0][0], kv[0][1], kv[0][2])):
        out.append(f"| {s} | {op} | {axis} | {b:,} | {n} |")
    return out


def _grad_reduction_report(d: dict[str, Any]) -> list[str]:
    """The data-parallel gradient reduction: buckets per stage, their sizes, and how much
    of their reduction the backward hides (estimate.grad_reduction)."""
    gb, red = d["comm"].get("grad_buckets"), d["estimate"].get("grad_reduction")
    if not gb or not red or not any(r["buckets"] for r in red):
        return []
    size = gb["bucket_size"]
    exact = next((f"{size // f:,} {u}" for u, f in (("GB", 10**9), ("GiB", 2**30), ("MB", 10**6), ("MiB", 2**20),
                                                    ("KB", 10**3), ("KiB", 2**10)) if size % f == 0), f"{size:,} B")
    rule = (f"buckets close at {exact} of fp32 gradients" if size else
            "bucket_size = 0: one bucket per model chunk, reduced after the backward")
    how = (f"in buckets launched as the backward produces them ({rule}; a layer is never split)" if size
           else "in one bucket per model chunk, reduced after the backward (bucket_size = 0)")
    out = ["## Gradient reduction (data parallel)", "",
           f"Each rank reduces its gradients {how}; with zero = 2 or 3 every bucket is reduce-scattered "
           "in each micro-batch's backward" + (f", in {gb['reduce_dtype']} (reduce_dtype), into fp32 shards"
                                               if gb.get("reduce_dtype", "fp32") != "fp32" else "") +
           ", otherwise once, in the last micro-batch's. Time per step from "
           "the estimate: the part hidden behind the backward, and the part exposed after it.", "",
           "| stage | buckets | bucket sizes | reduction | hidden | exposed |", "|---|---|---|---|---|---|"]
    deg = d["degrees"]
    # only buckets that are reduced: dense ones over dp_cp, expert ones over expert_dp
    reduced = {"dense": deg["dp"] * deg["cp"] > 1, "expert": deg.get("expert_dp", 1) > 1}
    sizes = {row["stage"]: [4 * b["elements"] for kind in ("dense", "expert") if reduced[kind] for b in row[kind]]
             for row in gb["per_stage"]}
    for r in red:
        sz = sizes.get(r["stage"], [])
        span = (f"{bytes_text(min(sz))}" + (f" - {bytes_text(max(sz))}" if max(sz) != min(sz) else "")) if sz else "-"
        share = f" ({r['hidden'] / r['seconds']:.0%})" if r["seconds"] else ""
        out.append(f"| {r['stage']} | {r['buckets']} | {span} | {r['seconds']:.4g} s | {r['hidden']:.4g} s{share} | "
                   f"{r['exposed']:.4g} s |")
    return out + [""]


def replica_shares(batch: int, dp: int) -> str:
    """How ``dp`` replicas share the serve ``batch`` (SPEC 1: the plan's concurrent
    sequences), in words: contiguous shares, the first replicas one more when ``dp`` does not
    divide it (``runtime/generate.replica_slice``); with fewer sequences than replicas, some
    replicas idle."""
    if batch < dp:
        return f"1 per replica on {batch} of {dp} replicas; the others idle"
    lo, hi = batch // dp, -(-batch // dp)
    return f"{lo if lo == hi else f'{lo} to {hi}'} per replica, {plural(dp, 'replica')}"


def _workload_words(sv: dict[str, Any]) -> str:
    """plan.json ``serve.workload`` in words."""
    w = sv["workload"]
    if w["kind"] == "closed_loop":
        return f"{w['concurrency']:,} closed-loop client{'s' if w['concurrency'] != 1 else ''}"
    if w["kind"] == "burst":
        return f"{w['requests']:,} request{'s' if w['requests'] != 1 else ''} at once"
    return f"{w['request_rate']:,.4g} requests/s (Poisson)"


def _count(x: float) -> str:
    """A mean count of things: whole below a thousand with one decimal, grouped above."""
    return f"{x:,.1f}" if x < 1000 else f"{x:,.0f}"


def _weights_words(sv: dict[str, Any], d: dict[str, Any]) -> str:
    """How the weights are stored, in words."""
    if sv["weight_dtype"] == "model":
        return f"in {d['model']['dtype']}"
    return f"in {sv['weight_dtype']}" + (f" (`{sv['weight_format']}`)" if sv.get("weight_format") else "")


def _prefill_pool_words(sv: dict[str, Any]) -> list[str]:
    """A disaggregated deployment's prefill pool, in words (none otherwise)."""
    p = sv.get("prefill_pool")
    if p is None:
        return []
    return ["", f"Disaggregated: {plural(p['replicas'], 'prefill instance')} of {p['tp']} GPUs "
                f"({bytes_text(p['weights_bytes_per_rank'] + p['workspace_bytes_per_rank'])} per GPU"
                + ("" if p["fits"] else ", **does not fit**") + f"), a prompt in {seconds_text(p['prompt_time'])}, "
                f"its KV cache ({bytes_text(p['kv_transfer_bytes'])}) to the decode pool in "
                f"{seconds_text(p['kv_transfer_time'])}; the pool prefills at most {p['max_requests_per_s']:,.1f} "
                "requests/s."]


def _serve_report(d: dict[str, Any]) -> list[str]:
    """The serving sections of the report: memory per rank, KV cache, time."""
    sv, mem = d["serve"], d["memory"]
    out = ["## Serving", "",
           f"{plural(sv['batch'], 'sequence')} ({replica_shares(sv['batch'], sv['replicas'])}) "
           f"of {sv['prompt_len']:,} prompt + {sv['max_new_tokens']:,} new "
           f"tokens; KV cache in {sv['kv_dtype']}, {sv['kv_heads_per_rank']} kv head(s) per rank"
           + (f", each replicated on {sv['kv_head_replicas']} ranks" if sv["kv_head_replicas"] > 1 else "") + ".", "",
           "| stage | weights | workspace | KV cache | KV bytes/token | total |", "|---|---|---|---|---|---|"]
    for s, k in zip(mem["per_stage"], sv["kv_bytes_per_token_per_stage"]):
        out.append(f"| {s['stage']} | {bytes_text(s['params'])} | {bytes_text(s['activations'])} | {bytes_text(s['kv_cache'])} | "
                   f"{k:,} | {bytes_text(s['total'])} |")
    out += ["", f"Peak {bytes_text(mem['peak'])} of {bytes_text(mem['capacity'])}: " + ("fits." if mem["fits"] else "**does not fit**.")
            + f" Room for {sv['max_concurrent_tokens']:,} tokens of cache ({sv['max_concurrent_sequences']:,} "
              f"sequences of {sv['prompt_len'] + sv['max_new_tokens']:,} tokens).", "",
            "## Estimate (serving)", "",
            f"{_workload_words(sv)} on engine `{sv['engine']}`, weights {_weights_words(sv, d)}: time to first "
            f"token **{seconds_text(sv['ttft'])}**, time per output token **{seconds_text(sv['tpot'])}** "
            f"({sv['tokens_per_s_per_user']:,.1f} tokens/s per user); {sv['tokens_per_s']:,.0f} output tokens/s"
            f" ({sv['tokens_per_s'] / sv['gpus']:,.0f} per GPU of {sv['gpus']})"
            + (f", {_count(sv['running'])} sequences running (at most {sv['running_limit']:,})" if "running" in sv else "")
            + (("; a wave's prompts in {} steps of {:,.0f} tokens" if sv["workload"]["kind"] == "burst" else
                "; each prompt in {} chunks of {:,.0f} tokens").format(sv["prefill_steps"], sv["prefill_chunk"])
               if sv.get("prefill_steps", 1) > 1 else "") + "."] + _prefill_pool_words(sv) + ["",
            "| part | seconds |", "|---|---|"]
    out += [f"| {k} | {v:.4g} |" for k, v in sv["breakdown"].items()]
    return out
