"""parcompile's Python API: what the command line does, as functions (docs/python.md).

The package re-exports these (``parcompile.compile``, ``parcompile.search``...); the
`parcompile` command line (:mod:`parcompile.cli`) is a thin layer over them: it reads
arguments, calls one of these, and prints what it returns.

- :func:`compile`: a spec (text or a path), with ``overrides``, to a
  :class:`~parcompile.plan.Plan`: ``plan.memory.peak``, ``plan.to_json()``,
  ``plan.write(directory)`` (what ``compile -o`` writes);
- :func:`search`: the ranked layouts of a spec's ``auto`` keys (:class:`SearchReport`);
- :func:`verify`: run a miniature of the plan and compare it with a single process
  (:class:`VerifyReport`: the rows ``parcompile verify`` prints, ``.passed``);
- :func:`export`: the plan as another engine's configuration;
- :func:`diff`: what changed between two plans (:class:`~parcompile.plandiff.PlanDiff`),
  with ``fail_on`` bounds for CI; :func:`load_plan` reads a plan.json file, typed.

Every function raises :class:`~parcompile.diagnostics.SpecError` for a spec with errors
(``str(err)`` renders the diagnostics with excerpts, ``err.diagnostics`` lists them) and
:class:`TypeError` for arguments of the wrong type; none prints anything.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from parcompile.core.files import MAX_JSON_BYTES, json_loads, read_text
from parcompile.diagnostics import Diagnostic, Sources, Span, SpecError
from parcompile.plan import Plan
from parcompile.plan_schema import PlanJSON

if TYPE_CHECKING:   # the search, verify and export modules load on use (verify needs torch)
    from parcompile.exporters import Export
    from parcompile.plandiff import PlanDiff
    from parcompile.layout_search import Candidate, SearchResult
    from parcompile.config.schema import SpecConfig
    from parcompile.verification import Check, VerifyResult

__all__ = ["compile", "search", "verify", "export", "diff", "load_plan", "SearchReport", "VerifyReport",
           "PlanFileError", "prepare_data"]


def _check_filename(filename: object) -> None:
    """A mapping passed where the file name goes is overrides given by position."""
    if isinstance(filename, Mapping):
        raise TypeError("the second argument is the file name diagnostics show; pass overrides by keyword: "
                        "parcompile.compile(source, overrides={\"parallel.tp\": 4})")


def compile(source: str | Path, filename: str | None = None, *,  # noqa: A001 - SPEC fixes the name
            overrides: Mapping[str, Any] | None = None) -> Plan:
    """Compile a spec to its :class:`~parcompile.plan.Plan` (``parcompile plan`` /
    ``compile``; the steps are :func:`parcompile.driver.compile_source`'s).

    Args:
        source: the spec's text, or a :class:`pathlib.Path` to a `.par` file.
        filename: the name diagnostics show for text sources (default ``<spec>``); it
            also names the plan (``build/<stem>``) and anchors relative paths.
        overrides: ``{"block.key": value}`` applied as if written in the spec
            (:mod:`parcompile.frontend.overrides`): ``{"parallel.tp": 4, "model.seq_len":
            4096, "parallel.schedule": "1f1b", "cluster.memory": "80 GiB"}``; ``None`` as a
            value removes the key. Every check applies; a bad override is a diagnostic
            at ``<override parallel.tp>:1:COL``.

    Returns:
        the plan: ``plan.to_json()`` (plan.json, byte for byte), ``plan.write(dir)``,
        typed sections (``plan.memory.peak`` in bytes, ``plan.estimate.step_time`` in
        seconds), ``plan.warnings`` (diagnostics; render with ``d.render(plan.source)``).

    Raises:
        SpecError: the spec (or an override) has errors, all of them in ``.diagnostics``;
            a spec with ``auto`` keys none of whose layouts fits memory (code ``does-not-fit``).
        TypeError: ``source`` is neither a str nor a ``pathlib.Path``; ``overrides`` is not
            a mapping with str keys.
    """
    from parcompile.driver import compile_source

    _check_filename(filename)
    return compile_source(source, filename, overrides)


# --------------------------------------------------------------------------------------
# search


@dataclass
class SearchReport:
    """The layouts of a spec's ``auto`` keys, ranked (``parcompile search``).

    ``candidates``: the best ``top`` :class:`~parcompile.layout_search.Candidate` s, best first,
    each with its layout (``.parallel``, a ``ParallelConfig``; ``.degrees_text()``) and
    estimates (``.step_time`` s, ``.mfu``, ``.tflops_per_gpu``, ``.peak`` and
    ``.capacity`` bytes per rank, ``.bubble_fraction``, ``.breakdown``); ``result``: the
    whole :class:`~parcompile.layout_search.SearchResult` (counts, the user's own layout, the
    closest layout that does not fit); ``warnings``: the spec's.
    """

    candidates: list["Candidate"]
    result: "SearchResult"
    warnings: list[Diagnostic] = field(default_factory=list)
    source: Sources = None

    @property
    def best(self) -> "Candidate":
        return self.candidates[0]

    def config(self, i: int = 0) -> "SpecConfig":
        """The spec's config with candidate ``i``'s layout."""
        return self.result.config(i)

    def text(self) -> str:
        """The table ``parcompile search`` prints (a serve spec's: the ranked deployments,
        the fewest GPUs that carry the load, the Pareto front)."""
        from parcompile.layout_search import table

        if hasattr(self.result, "pareto"):
            return self.result.table(len(self.candidates))
        return table(self.result, len(self.candidates))

    def explain(self) -> str:
        """What ``parcompile search --explain`` adds: why the best beats the runner-up,
        how far the spec's own layout is from it (a serve spec's: the best deployment's
        keys, to write it out)."""
        from parcompile.layout_search import explain

        if hasattr(self.result, "pareto"):
            best = self.result.best
            keys = ", ".join(f"{k} = {v}" for k, v in best.overrides(self.result.cfg).items())
            return f"best: {best.text()} on {best.gpus} GPUs; written out: {keys}"
        return explain(self.result)

    def plan(self, i: int = 0) -> Plan:
        """Candidate ``i``'s plan (``parcompile search --html`` reports the best's): the spec
        with its ``auto`` keys filled by that candidate, its split settled
        (:func:`parcompile.layout_search.settle_split`) and compiled
        (:func:`parcompile.driver.compile_config`) as :func:`compile` does after its own
        search, with this search as the plan's ``search`` for the best (``i`` = 0) only:
        plan.json's ``search.chosen`` and the report's star name the best, which another
        candidate's plan is not of.

        Raises:
            SpecError: as :func:`compile` (what only the analyses show).
        """
        from parcompile.driver import compile_config
        from parcompile.layout_search import settle_split

        cfg, note = settle_split(self.config(i))
        plan = compile_config(cfg, list(self.warnings) + ([note] if note is not None else []),
                              search=self.result if i == 0 else None)
        plan.source = self.source
        return plan


def search(source: str | Path, top: int = 10, *, filename: str | None = None,
           overrides: Mapping[str, Any] | None = None, cross_node_tp: bool = False,
           progress: Callable[[int, int], None] | None = None) -> SearchReport:
    """Rank the layouts a spec's ``auto`` keys allow (``parcompile search``;
    :func:`parcompile.layout_search.search`); for a ``serve`` spec, the deployments that carry its
    workload within its targets (:func:`parcompile.layout_search.serve.search_serve`: the report's
    ``result`` is a :class:`~parcompile.layout_search.serve.ServeSearch`, its candidates
    :class:`~parcompile.layout_search.serve.Deployment` s).

    Args:
        source, filename, overrides: as for :func:`compile`.
        top: candidates kept (at least 1).
        cross_node_tp: also try tensor parallelism across nodes.
        progress: ``progress(done, total)`` called now and then.

    Raises:
        SpecError: the spec has errors, or no layout fits memory (its diagnostics: the
            spec's warnings, then one error with code ``does-not-fit`` naming the
            closest layout).
        ValueError: ``top`` is below 1.
    """
    from parcompile.frontend import check_spec, parse_spec
    from parcompile.layout_search import no_fit_diagnostic, search as rank

    _check_filename(filename)
    if not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be a whole number of at least 1, got {top!r}")
    parsed = parse_spec(source, filename, overrides)
    try:
        cfg, warnings = check_spec(parsed)
        if cfg.workload == "serve":   # sizing a deployment (parcompile/layout_search/serve.py)
            from parcompile.layout_search.serve import no_deployment_diagnostic, search_serve

            res = search_serve(cfg, top=top)
            if not res.candidates:
                raise SpecError(warnings + [no_deployment_diagnostic(res)])
            return SearchReport(res.candidates[:top], res, warnings, parsed.sources)
        res = rank(cfg, top=top, cross_node_tp=cross_node_tp, progress=progress)
        if not res.candidates:
            raise SpecError(warnings + [no_fit_diagnostic(res)])
    except SpecError as e:
        e.source = e.source or parsed.sources
        raise
    return SearchReport(res.candidates[:top], res, warnings, parsed.sources)


# --------------------------------------------------------------------------------------
# verify


def prepare_data(cfg: "SpecConfig") -> list[Diagnostic]:
    """Tokenize a training spec's `data` and `eval_data` into the token cache (once; a
    cache that exists is reused), before any rank starts, and check the samples: at least
    one global batch of training samples. Returns the diagnostics: errors at the data
    file's path and line (a note names the spec key), warnings (truncated examples, chat
    examples without an assistant turn). Nothing is cached from data with errors."""
    from parcompile.runtime.data import dataset

    t, m, p = cfg.train, cfg.model, cfg.parallel
    out: list[Diagnostic] = []
    for key in ("data", "eval_data"):
        source = getattr(t, key)
        if source in (None, "synthetic"):
            continue
        where = cfg.span(f"train.{key}")
        note = f"reading `{key}` ({where.file}:{where.line}:{where.column})"
        try:
            cache = dataset.prepare(source, tokenizer=t.tokenizer, data_format=t.data_format,
                                    text_field=t.text_field)
            if key == "data":
                dataset.TrainBatches(cache, m.seq_len, p.global_batch, t.seed)
            else:
                dataset.EvalBatches(cache, m.seq_len, p.global_batch, t.eval_batches)
        except dataset.DataError as e:
            span = Span(str(e.path), e.line or 1, 1) if e.path else where
            out.append(Diagnostic("error", e.message, span, help=e.help, note=note))
            continue
        if cache.max_token_id >= m.vocab:
            out.append(Diagnostic("error", f"token id {cache.max_token_id} is outside the model's vocab = {m.vocab}",
                                  cfg.span("train.tokenizer", "model.vocab"),
                                  help=f"set `vocab = {cache.max_token_id + 1}` or more"))
        for w in cache.sample_warnings(m.seq_len):
            out.append(Diagnostic("warning", w, where, note=note))
        lossless = cache.without_loss(m.seq_len)
        if lossless:
            every = lossless == cache.num_examples
            out.append(Diagnostic(
                "error" if every else "warning",
                f"{'all ' if every else ''}{lossless:,} of {cache.num_examples:,} examples have no loss token within "
                f"seq_len = {m.seq_len} tokens (the prompt fills the sample){'; nothing would be learned' if every else ''}",
                where, note=note, help=f"raise `seq_len` or shorten the prompts; {'the run would train on loss 0' if every else 'those examples train nothing'}"))
    return out


@dataclass
class VerifyReport:
    """One ``parcompile verify`` run: ``rows`` (the checks the table prints: what, max
    |diff|, tolerance, ok), ``losses`` and ``ref_losses`` (the miniature's and the
    single-process reference's, per step), ``passed``; ``result`` is the whole
    :class:`~parcompile.verification.VerifyResult` (``.mini``: the miniature's config,
    ``.plan``: its plan.json, ``.records``: what each rank measured)."""

    result: "VerifyResult"
    steps: int
    dtype: str
    plan: Plan
    warnings: list[Diagnostic] = field(default_factory=list)

    @property
    def rows(self) -> list["Check"]:
        return self.result.checks

    @property
    def passed(self) -> bool:
        """True when every check is within its tolerance."""
        return self.result.ok

    @property
    def losses(self) -> list[float]:
        return self.result.losses

    @property
    def ref_losses(self) -> list[float]:
        return self.result.ref_losses

    def text(self) -> str:
        """What ``parcompile verify`` prints: the miniature, both losses, the table, the verdict."""
        from parcompile.config.text import plural

        r = self.result
        m, p = r.mini.model, r.mini.parallel
        if r.mini.workload == "serve":   # greedy requests through the serve program
            s, replicas = r.mini.serve, r.plan["model"]["kv_head_replicas"]
            return "\n".join([
                f"miniature: {m.layers} layers, hidden {m.hidden}, heads {m.heads}/{m.kv_heads}, vocab {m.vocab}; "
                f"dp {p.dp} x tp {p.tp} x pp {p.pp}"
                + (f", each kv head on {replicas} tp ranks" if replicas > 1 else "")
                + f"; {plural(s.batch, 'greedy sequence')}, prompts of up to {s.prompt_len} tokens + "
                f"{s.max_new_tokens} new; reference: one process",
                "tokens:    " + " | ".join(" ".join(map(str, t)) for t in r.tokens),
                "reference: " + " | ".join(" ".join(map(str, t)) for t in r.ref_tokens),
                r.table(),
                "verify: " + ("passed" if self.passed else "FAILED"),
            ]) + "\n"
        return "\n".join([
            f"miniature: {m.layers} layers, hidden {m.hidden}, heads {m.heads}/{m.kv_heads}, vocab {m.vocab}, "
            f"seq {m.seq_len}; dp {p.dp} x tp {p.tp} x pp {p.pp}" + (f" x cp {p.cp}" if p.cp > 1 else "")
            + (f" (ep {p.ep})" if p.ep > 1 else "") + f", {p.schedule}, "
            f"{plural(p.num_microbatches, 'micro-batch', 'micro-batches')}, {plural(self.steps, 'step')}; "
            f"reference: one process",
            "losses:    " + " ".join(f"{x:.6f}" for x in self.losses),
            "reference: " + " ".join(f"{x:.6f}" for x in self.ref_losses),
            self.result.table(),
            "verify: " + ("passed" if self.passed else "FAILED"),
        ]) + "\n"


def verify(source: str | Path | Plan, *, filename: str | None = None, overrides: Mapping[str, Any] | None = None,
           steps: int = 3, dtype: str = "fp32", timeout_s: float = 900.0) -> VerifyReport:
    """Run a miniature of the spec's plan on this machine's CPU (same layout, small
    model) under torchrun and compare it with a single-process reference (``parcompile
    verify``; :func:`parcompile.verification.verify`). Takes a while: it starts the ranks.

    Args:
        source, filename, overrides: as for :func:`compile`; ``source`` may also be a
            :class:`~parcompile.plan.Plan` already compiled.
        steps: training steps compared.
        dtype: compute dtype of the miniature and its reference (``fp32``, ``bf16``,
            ``fp16``); fp32 checks tightest.
        timeout_s: the torchrun job's limit.

    Raises:
        SpecError: the spec has errors, its data cannot be read, or it cannot be verified
            here (too many ranks, a feature the program does not run yet).
        RuntimeError: the miniature's run failed (its output is in the message).
    """
    from parcompile.verification import verify as run_verify

    if isinstance(source, Plan):
        if overrides or filename is not None:
            raise TypeError("a compiled Plan takes no filename or overrides; give them to parcompile.compile")
        plan = source
    else:
        plan = compile(source, filename, overrides=overrides)
    warnings: list[Diagnostic] = []
    if plan.config.workload == "train":
        warnings = prepare_data(plan.config)   # data errors as diagnostics, before any rank starts
        if any(d.severity == "error" for d in warnings):
            raise SpecError(warnings, None)    # spans in data files: no spec excerpt
    try:
        result = run_verify(plan.config, steps=steps, dtype=dtype, timeout_s=timeout_s)
    except SpecError as e:
        e.source = e.source or plan.source
        raise
    return VerifyReport(result, steps, dtype, plan, warnings)


# --------------------------------------------------------------------------------------
# export


def export(plan: Plan, target: str, torchtitan_version: str = "0.3") -> "Export":
    """The plan as another engine's configuration (``parcompile export --to TARGET``;
    :func:`parcompile.exporters.export`): ``.text`` (the file), ``.notes`` (what the target
    expresses differently), ``.errors`` (where it would train or serve another model or
    layout: the CLI exits 1), ``.launch`` (the command that runs it), ``.filename``.
    ``target``: megatron, megatron-bridge, torchtitan, deepspeed (training specs), vllm, sglang (serve
    specs); ``torchtitan_version``: ``"0.3"`` (a config registry module) or ``"0.2"`` (TOML).

    Raises:
        TypeError: ``plan`` is not a compiled :class:`~parcompile.plan.Plan`.
        ValueError: an unknown target.
        SpecError: a plan the target cannot run (a ``serve`` spec for a training engine).
    """
    from parcompile.exporters import export as export_plan

    if not isinstance(plan, Plan):
        raise TypeError(f"export needs a compiled Plan, got {type(plan).__name__}; "
                        "parcompile.export(parcompile.compile(pathlib.Path(\"spec.par\")), \"megatron\")")
    return export_plan(plan, target, torchtitan_version)


# --------------------------------------------------------------------------------------
# plans on disk, diff


class PlanFileError(ValueError):
    """A path given as a plan that holds no plan.json parcompile can read (the message says
    which file and why)."""


def _read_plan_file(path: Path) -> dict:
    """The plan.json dict at ``path`` (a file, or a directory ``compile -o`` wrote)."""
    if path.is_dir():
        if not (path / "plan.json").is_file():
            raise PlanFileError(f"{path}: a directory without plan.json; give a plan.json, a .par spec "
                                "or a directory `parcompile compile -o` wrote")
        path = path / "plan.json"
    try:
        text = read_text(path, MAX_JSON_BYTES)   # a regular file only, size-limited
    except FileNotFoundError:
        raise PlanFileError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PlanFileError(f"{path}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
    try:
        data = json_loads(text)
    except json.JSONDecodeError as e:
        raise PlanFileError(f"{path}:{e.lineno}:{e.colno}: not JSON: {e.msg}") from None
    if not isinstance(data, dict) or not str(data.get("format", "")).startswith("parcompile.plan/"):
        raise PlanFileError(f"{path}: not a parcompile plan.json (no \"format\": \"parcompile.plan/1\")")
    _check_plan_types(path, data)
    return data


def _check_plan_types(path: Path, data: dict) -> None:
    """A plan.json's values have the types of its schema (:func:`parcompile.plan_schema.validate_plan`),
    so that no reader meets a string where a table was; keys it lacks are let through (a
    plan.json an earlier version wrote, before a key was added). Raises PlanFileError naming
    the keys."""
    from pydantic import ValidationError

    from parcompile.plan_schema import validate_plan

    try:
        validate_plan(data)
    except ValidationError as e:
        wrong = [err for err in e.errors() if err["type"] != "missing"]
        if wrong:
            shown = "; ".join(f"{'.'.join(map(str, err['loc'])) or '(top)'}: {err['msg']}" for err in wrong[:5])
            raise PlanFileError(f"{path}: does not match plan.json's schema ({len(wrong)} problems): {shown}"
                                + (" ..." if len(wrong) > 5 else "")) from None


def plan_data(plan: Any) -> tuple[dict, str]:
    """A plan given any way :func:`diff` takes it, as its plan.json dict and a name for it.

    Raises:
        PlanFileError: a path that holds no readable plan.json.
        SpecError: a `.par` spec with errors.
        TypeError: anything else.
    """
    if isinstance(plan, Plan):
        return plan.data, plan.config.filename
    if isinstance(plan, PlanJSON):
        return plan.model_dump(exclude_none=True), plan.name
    if isinstance(plan, Mapping):
        return dict(plan), str(plan.get("name", "plan"))
    if isinstance(plan, (str, os.PathLike)):
        path = Path(plan)
        if path.suffix == ".par":
            return compile(path).data, str(path)
        return _read_plan_file(path), str(path)
    raise TypeError(f"a plan is a Plan, a plan.json dict or PlanJSON, or a path to a plan.json, a directory "
                    f"holding one or a .par spec; got {type(plan).__name__}")


def load_plan(path: str | os.PathLike) -> PlanJSON:
    """Read a plan.json file (or the plan.json of a directory ``compile -o`` wrote) as its
    typed model: ``load_plan("build/x/plan.json").memory.peak``.

    Raises:
        PlanFileError: the file cannot be read, is not JSON, is not a plan.json, or does
            not match this version's schema (the message names the keys).
    """
    from pydantic import ValidationError

    from parcompile.plan_schema import validate_plan

    path = Path(path)
    data = _read_plan_file(path)
    try:
        return validate_plan(data)
    except ValidationError as e:
        raise PlanFileError(f"{path}: does not match plan.json's schema ({e.error_count()} problems):\n{e}") from None


def diff(old: Any, new: Any, *, fail_on: Iterable[str] = ()) -> "PlanDiff":
    """What changed from plan ``old`` to plan ``new`` (``parcompile diff``;
    :mod:`parcompile.plandiff`): degrees, groups, stages, memory per stage, communication,
    collectives, the estimate. ``.text()``, ``.markdown()``, ``.to_json()``,
    ``.changes`` (:class:`~parcompile.plandiff.Change`: ``.path``, ``.old``, ``.new``,
    ``.relative``).

    Args:
        old, new: each a :class:`~parcompile.plan.Plan`, a plan.json dict or
            :class:`~parcompile.plan_schema.PlanJSON`, or a path (str or Path) to a
            plan.json, a directory ``compile -o`` wrote, or a `.par` spec (compiled).
        fail_on: bounds such as ``"peak_memory=+5%"``, ``"step_time=+2%"``
            (:func:`parcompile.plandiff.parse_bound`); ``.failed`` says whether one is
            crossed, ``.checks`` holds each.

    Raises:
        PlanFileError: a path that holds no readable plan.json.
        SpecError: a `.par` spec with errors.
        BoundError: a bound that does not read (:class:`parcompile.plandiff.BoundError`, a ValueError).
    """
    from parcompile.plandiff import PlanDiff, diff_plans, parse_bound

    bounds = [parse_bound(b) for b in ([fail_on] if isinstance(fail_on, str) else fail_on)]   # before compiling
    (o, oname), (n, nname) = plan_data(old), plan_data(new)
    result = PlanDiff(o, n, diff_plans(o, n), oname, nname)
    result.check(bounds)
    return result
