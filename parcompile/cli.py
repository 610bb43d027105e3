"""The `parcompile` command line (SPEC section 2), on argparse: a thin layer over the
Python API, :mod:`parcompile.api` (each command reads its arguments, calls the API and
prints what it returns).

Exit status: 0 success, 1 the spec has errors (or a check failed), 2 usage error.
Diagnostics go to stderr in the SPEC format; results go to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from dataclasses import replace

from parcompile import api
from parcompile.api import prepare_data
from parcompile.core import outputs
from parcompile.diagnostics import SHOWN, Diagnostic, SpecError, render_all
from parcompile.frontend.parser import source_text

EXIT_OK, EXIT_SPEC, EXIT_USAGE = 0, 1, 2


class _Usage(Exception):
    """A usage error: bad arguments or an unreadable spec file (exit 2)."""


def _read(path: str) -> tuple[Path, str]:
    """The spec's path and text. A missing file or a directory is a usage error (exit 2);
    text that is not UTF-8 is left to the front end, which reports it as a diagnostic. Only a
    regular file of at most :data:`~parcompile.core.files.MAX_SPEC_BYTES` is read (a FIFO or
    ``/dev/zero`` is a usage error, never waited on or read)."""
    from parcompile.core.files import MAX_SPEC_BYTES, read_bytes

    p = Path(path)
    try:
        # a byte order mark and lone CRs are read as the front end reads them, so excerpts line up
        return p, source_text(read_bytes(p, MAX_SPEC_BYTES).decode("utf-8", errors="replace"))
    except FileNotFoundError:
        raise _Usage(f"cannot read {path}: no such file") from None
    except OSError as e:   # a directory, a FIFO, a device, a file over the limit: never waited on nor read
        fix = "a spec is a few kilobytes" if "bytes" in (e.strerror or "") else "give a .par file"
        raise _Usage(f"cannot read {path}: it {e.strerror or e}; {fix}") from None


def _print_diags(diags: list[Diagnostic], source: str | None, fmt: str = "text") -> None:
    if not diags:
        return
    diags = sorted(diags, key=lambda d: (d.span.file, d.span.line, d.span.column))
    if fmt == "json":
        for d in diags:
            print(d.to_json())
    else:
        print(render_all(diags, source, SHOWN), file=sys.stderr)


def _compile(path: str):
    """Parse, check and plan ``path``; returns (plan, source). Raises SpecError."""
    p, source = _read(path)
    try:
        plan = api.compile(p)
    except SpecError as e:
        e.source = e.source or source
        raise
    if plan.search is not None:   # say which layout `auto` became
        res = plan.search
        among = (f"{len(res.candidates)} deployments that meet the targets" if hasattr(res, "pareto")
                 else f"{res.fitting} fitting layouts")
        print(f"note: auto: chose {res.best.degrees_text()} (best of {among}; "
              f"`parcompile search {path}` ranks them)", file=sys.stderr)
    return plan, source


def cmd_search(args) -> int:
    """`parcompile search SPEC`: rank the layouts the spec's `auto` keys allow (SPEC 2);
    exit 1 when none fits memory."""
    from parcompile.layout_search import stderr_progress

    if args.top < 1:
        raise _Usage("--top must be at least 1")
    p, source = _read(args.spec)
    try:
        report = api.search(p, top=args.top, cross_node_tp=args.cross_node_tp, progress=stderr_progress())
    except SpecError as e:   # with no layout that fits: the warnings, then the error
        _print_diags(e.diagnostics, e.source or source)
        return EXIT_SPEC
    _print_diags(report.warnings, source)
    print(report.text())
    if args.explain:
        print()
        print(report.explain())
    if args.html is not None:
        try:
            plan = report.plan(0)
        except SpecError as e:
            _print_diags(e.diagnostics, e.source or source)
            return EXIT_SPEC
        _write_html(args, plan, p, report.result)
    return EXIT_OK


def _write_html(args, plan, spec: Path, search=None) -> None:
    """``--html FILE``: the plan's HTML report (:func:`parcompile.report.render_html`),
    written atomically (:func:`_write_atomic`; FILE may not be the spec)."""
    from parcompile.report import render_html

    if not args.html.strip():
        raise _Usage("--html needs a file name, got an empty string")
    _write_atomic(Path(args.html), render_html(plan, search), inputs=(spec,), flag="--html", what="report")
    print(f"wrote {args.html}", file=sys.stderr)


def _summary(plan) -> str:
    d = plan.data
    deg = d["degrees"]
    mem = d["memory"]
    from parcompile.config.text import plural
    from parcompile.core.units import bytes_text

    parts = [f"dp {deg['dp']} x tp {deg['tp']} x pp {deg['pp']}"]
    if deg.get("cp", 1) > 1:
        parts.append(f"cp {deg['cp']}")
    m = d["schedule"]["num_microbatches"]
    if "serve" in d:   # a serve spec runs no micro-batches: its latencies instead
        from parcompile.core.units import seconds_text

        sv = d["serve"]
        work = f"TTFT {seconds_text(sv['ttft'])}, TPOT {seconds_text(sv['tpot'])}, {sv['tokens_per_s']:,.0f} tokens/s"
    else:
        work = f"{m} micro-batch{'es' if m != 1 else ''}"
    return (f"{plan.config.filename}: ok: {plural(d['world_size'], 'rank')} ({' x '.join(parts)}), "
            f"{d['model']['params']:,} parameters, {work}, "
            f"peak memory {bytes_text(mem['peak'])} of {bytes_text(mem['capacity'])} per rank"
            f"{'' if mem['fits'] else ' (does NOT fit)'}")


def _summary_dict(plan) -> dict:
    """The JSON line `check --format json` prints for a spec without errors."""
    d = plan.data
    mem = d["memory"]
    return {
        "severity": "ok",
        "file": plan.config.filename,
        "message": _summary(plan),
        "world_size": d["world_size"],
        "degrees": d["degrees"],
        "params": d["model"]["params"],
        "num_microbatches": d["schedule"]["num_microbatches"],
        "memory_peak": mem["peak"],
        "memory_capacity": mem["capacity"],
        "fits": mem["fits"],
        "warnings": len(plan.warnings),
    }


def cmd_check(args) -> int:
    try:
        plan, source = _compile(args.spec)
    except SpecError as e:
        _print_diags(e.diagnostics, e.source, args.format)
        return EXIT_SPEC
    _print_diags(plan.warnings, source, args.format)
    if args.format == "text":
        print(_summary(plan))
    else:  # a positive signal for editors and CI: one JSON line, after the warnings
        print(json.dumps(_summary_dict(plan), sort_keys=True))
    return EXIT_OK


def _plan_format(args) -> str:
    """The format `plan` prints: ``--json`` is short for ``--format json``, so the two may
    be given together only when they agree (``--json --format dot`` is a usage error)."""
    if args.json and args.format not in (None, "json"):
        raise _Usage(f"--json is short for --format json; it cannot be combined with --format {args.format}")
    return "json" if args.json else (args.format or "text")


def cmd_plan(args) -> int:
    fmt = _plan_format(args)
    try:
        plan, source = _compile(args.spec)
    except SpecError as e:
        _print_diags(e.diagnostics, e.source)
        return EXIT_SPEC
    _print_diags(plan.warnings, source)
    if fmt == "json":
        sys.stdout.write(plan.to_json())
    elif fmt == "dot":
        sys.stdout.write(plan.graph_dot())
    else:
        sys.stdout.write(plan.report_md())
    if args.html is not None:
        _write_html(args, plan, Path(args.spec))
    return EXIT_OK


def _output_dir(args) -> Path | None:
    """``-o DIR`` as a path (None: the default). An empty or blank DIR is a usage error:
    it would otherwise mean the working directory, where `compile` removes stale files."""
    if args.output is None:
        return None
    if not args.output.strip():
        raise _Usage("-o needs a directory name, got an empty string; omit -o for build/<spec name>/")
    return Path(args.output)


def _compile_to(args, plan=None, source: str | None = None) -> tuple[object, Path, list[str]]:
    """Compile ``args.spec`` (or take ``plan``, already compiled) and write its files
    (:meth:`parcompile.plan.Plan.write`); returns the plan, the directory, the names written."""
    from parcompile.codegen.emit import program_gaps
    from parcompile.codegen.k8s import K8sError

    output = _output_dir(args)  # before compiling: a usage error comes first
    k8s = _k8s_options(args)
    try:
        k8s.checked()
    except K8sError as e:
        raise _Usage(str(e)) from None
    if plan is None:
        plan, source = _compile(args.spec)
    gaps = program_gaps(plan.config, "error" if args.command == "run" else "warning")
    if any(g.severity == "error" for g in gaps):
        raise SpecError(gaps, source)
    _print_diags(plan.warnings + gaps, source)
    name = plan.config.name if plan.config.name not in ("", ".", "..") else "spec"
    out = output if output is not None else Path("build") / name
    _refuse_output_over_build(plan.config, out, source)
    try:
        written = plan.write(out, k8s)
    except K8sError as e:   # the spec's side (a serve spec without its text)
        raise _Usage(str(e)) from None
    except OSError as e:
        raise _Usage(f"cannot write {out}/: {e.strerror or e}") from None
    return plan, out, written


#: Warning codes that `check`, `plan` and `compile` report and `run` and `serve` refuse to start
#: with (SPEC: a plan that does not fit is a warning for compile, an error for run): the
#: memory, and serve weights that hold no tensors yet.
STARTS_ONLY_WITHOUT = ("does-not-fit", "no-weights")


def _refuse_output_over_build(cfg, out: Path, source: str | None) -> None:
    """A training spec's ``hf_output`` that is the build directory ``out`` or holds it, as
    written or once links are followed: the end of the run replaces that directory with the
    Hugging Face checkpoint, so the program, plan.json and the metrics would go with it (the
    ranks' preflight refused it only after the launch). Raises :class:`SpecError` at the value."""
    hf = cfg.train.hf_output if cfg.workload == "train" else None
    if not hf:
        return
    for resolve in (os.path.abspath, os.path.realpath):
        build = Path(resolve(out))
        if Path(resolve(hf)) in (build, *build.parents):
            raise SpecError([Diagnostic(
                "error", f"hf_output `{hf}` holds the build directory `{out}/` (the program, plan.json, "
                "metrics), which writing the output would replace", cfg.span("train.hf_output"),
                help=f'write the output beside the build, e.g. `hf_output = "{build.name}-hf"`, or compile '
                     "elsewhere with -o")], source)


def _k8s_options(args):
    """``compile``'s ``--image``, ``--namespace`` and ``--storage`` (the Kubernetes manifests'; defaults
    for the commands that have none)."""
    from parcompile.codegen.k8s import K8sOptions

    return K8sOptions(image=getattr(args, "image", None), namespace=getattr(args, "namespace", None),
                      storage=getattr(args, "storage", None))


def cmd_compile(args) -> int:
    try:
        plan, out, written = _compile_to(args)
    except SpecError as e:
        _print_diags(e.diagnostics, e.source)
        return EXIT_SPEC
    print(f"wrote {out}/ ({', '.join(written)})")
    if plan.config.cluster.nodes == 1:
        print(f"run it: {out / 'launch.sh'}")
    else:   # launch.sh's own comment says what each node sets
        print(f"run it: NODE_RANK=<0..{plan.config.cluster.nodes - 1}> MASTER_ADDR=<node 0> {out / 'launch.sh'} "
              f"on each node, or sbatch {out / 'slurm.sbatch'}")
    return EXIT_OK


def _device_problems(cfg, command: str) -> list[Diagnostic]:
    """An error at the `cluster` block when the plan's devices need a package this Python
    cannot import (torch_npu for Ascend's npu), instead of one traceback per rank once
    torchrun has started them (:func:`parcompile.runtime.machine.device.missing_plugin`)."""
    from parcompile.runtime.machine.device import missing_plugin

    accel = cfg.cluster.accelerator
    plugin = missing_plugin(accel.device)
    if plugin is None:
        return []
    return [Diagnostic(
        "error", f"this plan runs on {accel.name}, and {plugin} is not installed in this Python", cfg.span("cluster"),
        help=f"pip install {plugin.replace('_', '-')} on a machine with them, or run it here on the CPU with gloo: "
             f"PARCOMPILE_DEVICE=cpu parcompile {command} ...")]


def _missing_weights(cfg) -> list[Diagnostic]:
    """A serve spec's weights directory that does not exist: `run`'s and `serve`'s error, naming it absolute."""
    return [] if cfg.workload != "serve" or not cfg.serve.weights or Path(cfg.serve.weights).is_dir() else [Diagnostic(
        "error", f"weights directory `{os.path.abspath(cfg.serve.weights)}` does not exist", cfg.span("serve.weights"),
        help="train with `checkpoint_dir` set to it first, or give a Hugging Face checkpoint directory")]


def cmd_run(args) -> int:
    _output_dir(args)  # a usage error comes first; then --checkpoint-dir by the preflight's rule, before any launch
    if args.checkpoint_dir is not None and (why := "an empty name" if not args.checkpoint_dir.strip()
                                            else outputs.write_problem(args.checkpoint_dir)):
        raise _Usage(f"--checkpoint-dir: {why}; give a directory that can be created and written")
    try:
        plan, source = _compile(args.spec)
        if plan.config.workload == "train":
            data = prepare_data(plan.config)   # before anything is written or any rank starts
            if any(d.severity == "error" for d in data):
                raise SpecError(data, None)    # spans in data files: no spec excerpt
            _print_diags(data, None)
        plan, out, _ = _compile_to(args, plan, source)
    except SpecError as e:
        _print_diags(e.diagnostics, e.source)
        return EXIT_SPEC
    cfg = plan.config
    # a plan that does not fit memory is a warning for compile, an error for run (SPEC)
    problems = [replace(d, severity="error") for d in plan.warnings if d.code in STARTS_ONLY_WITHOUT]
    if cfg.cluster.nodes > 1:
        problems.append(Diagnostic(
            "error", f"`run` launches on this machine only; the cluster has {cfg.cluster.nodes} nodes",
            cfg.span("cluster.nodes"), help=f"on the cluster, run {out}/launch.sh on every node"))
    else:
        problems += _device_problems(cfg, "run")
    serve = cfg.workload == "serve"
    problems += _missing_weights(cfg)
    if serve and args.steps:
        raise _Usage("--steps is for training specs; this spec has a `serve` block")
    if not serve and args.prompt:
        raise _Usage("--prompt is for serve specs; this spec trains")
    if serve and args.checkpoint_dir:
        raise _Usage("--checkpoint-dir is for training specs; a serve spec reads `weights`")
    if getattr(args, "force", False) and (serve or not cfg.train.hf_output):
        raise _Usage("--force replaces the spec's hf_output; this spec has none")
    if problems:
        _print_diags(problems, _read(args.spec)[1])
        return EXIT_SPEC
    script = out / ("serve.py" if serve else "program.py")
    argv = []
    if args.steps:
        argv += ["--steps", str(args.steps)]
    if args.checkpoint_dir:   # relative to where `parcompile run` runs, not to the program
        argv += ["--checkpoint-dir", str(Path(args.checkpoint_dir).absolute())]
    for p in args.prompt or []:
        argv += ["--prompt", p]
    if getattr(args, "force", False):
        argv += ["--force"]
    print(f"running: torchrun --standalone --nproc-per-node {cfg.cluster.gpus_per_node} {script}", flush=True)
    from parcompile import jobs, torchrun

    log_dir = torchrun.run_dir(script)
    cmd = torchrun.command(cfg.cluster.gpus_per_node, script, argv, log_dir)   # a failed rank: one line (issue 51)

    def interrupted(name: str) -> None:   # one line, as `serve` says it
        torchrun.remove(log_dir)          # torchrun was killed: nothing of it to keep
        print(f"interrupted ({name}): stopped torchrun and its {cfg.cluster.gpus_per_node} rank(s)", file=sys.stderr,
              flush=True)

    return jobs.run(cmd, on_interrupt=interrupted)


def cmd_serve(args) -> int:
    """`parcompile serve`: compile a serve spec and answer OpenAI's API on it (SPEC 4)."""
    _output_dir(args)
    try:
        plan, source = _compile(args.spec)
        cfg = plan.config
        if cfg.workload != "serve":
            raise _Usage("`serve` takes a spec with a `serve` block; this spec trains (use `parcompile run`)")
        problems = [replace(d, severity="error") for d in plan.warnings if d.code in STARTS_ONLY_WITHOUT]
        if cfg.cluster.nodes > 1:
            problems.append(Diagnostic(
                "error", f"`serve` launches on this machine only; the cluster has {cfg.cluster.nodes} nodes",
                cfg.span("cluster.nodes"), help="serve from one node, or with vLLM: parcompile export --to vllm"))
        else:
            problems += _device_problems(cfg, "serve")
        problems += _missing_weights(cfg)
        if problems:
            raise SpecError(problems, source)
        args.command = "run"     # the program must be complete, as for `run`
        plan, out, _ = _compile_to(args, plan, source)
    except SpecError as e:
        _print_diags(e.diagnostics, e.source)
        return EXIT_SPEC
    from parcompile.server import API_KEY_ENV, run_server

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    return run_server(plan, out / "serve.py", args.host, args.port, api_key=api_key, max_body=args.max_body)


def cmd_verify(args) -> int:
    try:
        plan, _ = _compile(args.spec)
        report = api.verify(plan, steps=args.steps, dtype=args.dtype)
    except SpecError as e:
        _print_diags(e.diagnostics, e.source)
        return EXIT_SPEC
    except RuntimeError as e:
        print(f"error: the miniature's run failed: {e}", file=sys.stderr)
        return EXIT_SPEC
    sys.stdout.write(report.text())
    return EXIT_OK if report.passed else EXIT_SPEC


def _write_atomic(path: Path, text: str, inputs=(), flag: str = "-o", what: str = "export") -> None:
    """Write ``text`` to ``path`` through a temporary file in its directory and ``os.replace``:
    an interrupted write leaves the old file or none. A path that exists and is no regular
    file (``/dev/stdout``, a FIFO, bash's ``>(cmd)``) is written through, as a shell
    redirection would, never replaced. ``path`` may not be one of the files ``inputs`` names
    (the spec, its data: as gcc refuses "input file is the same as output file"), whatever
    the spelling or symbolic link; the refusal names ``flag`` and ``what`` ("-o", "export").
    Raises ``_Usage`` naming the path."""
    import os
    import stat
    import tempfile

    for source in inputs:
        try:
            same = os.path.samefile(path, source) or os.path.realpath(path) == os.path.realpath(source)
        except (OSError, ValueError):   # either absent, a NUL byte
            same = False
        if same:
            raise _Usage(f"{flag} {path} is an input of this {what} ({source}); nothing written: "
                         "give another file name")
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        mode = None
    if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise _Usage(f"cannot write {path}: {e.strerror or e}") from None
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent if str(path.parent) else ".")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)   # mkstemp's 0600 would differ from a plain write's mode
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise _Usage(f"cannot write {path}: {e.strerror or e}") from None

def cmd_export(args) -> int:
    """`parcompile export SPEC --to megatron|megatron-bridge|torchtitan|deepspeed|vllm|sglang [-o FILE]`: the plan as
    another engine's configuration (stdout, or FILE); notes about what the target cannot
    express go to stderr as `note:` lines (they are also comments in the Megatron and
    torchtitan outputs), and for DeepSpeed the launcher line too. An export the engine would
    run as another model or layout (``Export.errors``) prints only its `error:` lines and
    writes nothing (no stdout, no FILE): exit 1."""
    if args.output is not None and not args.output.strip():
        raise _Usage("-o needs a file name, got an empty string; omit -o to print to stdout")
    if args.torchtitan_version is not None and args.to != "torchtitan":
        raise _Usage(f"--torchtitan-version applies to --to torchtitan, not --to {args.to}: drop it")
    try:
        plan, source = _compile(args.spec)
        result = api.export(plan, args.to, args.torchtitan_version or "0.3")
    except SpecError as e:
        _print_diags(e.diagnostics, e.source or _read(args.spec)[1])
        return EXIT_SPEC
    _print_diags(plan.warnings, source)
    if result.errors:   # the engine would train or serve another model or layout: nothing is written
        for e in result.errors:
            print(f"error: {e}", file=sys.stderr)
        print(f"error: `export --to {args.to}` refused: nothing written"
              + (f" ({args.output} untouched)" if args.output is not None else ""), file=sys.stderr)
        return EXIT_SPEC
    commented = args.to != "deepspeed"   # notes already in the text, as comments
    notes, launch = list(result.notes), result.launch
    if args.output is None:
        sys.stdout.write(result.text)
    else:
        t = plan.config.train
        reads = [args.spec] + ([t.data, t.eval_data, t.tokenizer] if t is not None else [])
        _write_atomic(Path(args.output), result.text, [r for r in reads if r and r != "bytes"])
        print(f"wrote {args.output} ({args.to})", file=sys.stderr)
        written = Path(args.output)
        if written.name != result.filename and args.to == "deepspeed":   # the launch names the file written
            launch = launch.replace(f"--deepspeed_config {result.filename}",
                                    f"--deepspeed_config {shlex.quote(args.output)}")
        elif written.name != result.filename and result.filename.endswith(".py"):   # torchtitan 0.3's module
            if written.stem.isidentifier() and written.suffix == ".py":
                notes.append(f"torchtitan imports the config module by its file name: launch this file with "
                             f"--module {written.stem} (its docstring names {result.filename[:-3]}, the default name)")
            else:
                notes.append(f"torchtitan imports the config module by its file name and `{written.name}` is no "
                             f"importable module name: write it as {result.filename}, the name its launch line uses")
    if args.output is not None or not commented:
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
    if not commented:
        print(f"launch: {launch}", file=sys.stderr)
    return EXIT_OK


def cmd_export_weights(args) -> int:
    """`parcompile export-weights SPEC CKPT_DIR -o DIR`: the newest checkpoint a training
    program of SPEC wrote in CKPT_DIR (or a `step_N` directory) as a Hugging Face
    checkpoint in DIR (config.json of the family, safetensors shards with an index, the
    spec's tokenizer files), written atomically. Any layout's checkpoint: DCP holds
    global tensors. A LoRA spec's checkpoint (adapters only) is written as a PEFT adapter."""
    from parcompile.runtime.data.dataset import DataError
    from parcompile.core.lora import lora_settings
    from parcompile.core.files import what_is
    from parcompile.core.outputs import run_identity
    from parcompile.runtime.state.hf_export import checkpoint_step, export_weights, read_dcp_global, tokenizer_outputs
    from parcompile.runtime.state.peft_export import write_lora_output
    from parcompile.runtime.state.weights import WeightsError

    if not args.output.strip():
        raise _Usage("-o needs a directory name, got an empty string")
    if not Path(args.ckpt_dir).is_dir():   # what it is instead (core.files.what_is: None, a regular file)
        raise _Usage(f"cannot read {args.ckpt_dir}: it {(what_is(args.ckpt_dir) or 'is a file').split(', not a')[0]}; "
                     "give a `checkpoint_dir` a training run wrote")
    try:
        plan, source = _compile(args.spec)
    except SpecError as e:
        _print_diags(e.diagnostics, e.source)
        return EXIT_SPEC
    cfg = plan.config
    if cfg.workload != "train":
        raise _Usage("export-weights takes a training spec (its model and tokenizer)")
    try:
        files, generation = tokenizer_outputs(cfg.train.tokenizer)
    except DataError as e:
        print(f"error: tokenizer: {e}", file=sys.stderr)
        return EXIT_SPEC
    try:
        root, step = checkpoint_step(args.ckpt_dir)
        run = run_identity(json.loads(plan.to_json()), root, step)
        if cfg.train.method == "lora":   # the checkpoint holds the adapters: a PEFT adapter
            write_lora_output(read_dcp_global(args.ckpt_dir), cfg.model, args.output,
                              {**lora_settings(cfg), "merge": False, "base": cfg.train.init_from}, files, generation_config=generation, run=run,
                              force=args.force)
        else:
            export_weights(args.ckpt_dir, cfg.model, args.output, files, generation_config=generation, run=run,
                           force=args.force)
    except (WeightsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_SPEC
    what = "PEFT adapter" if cfg.train.method == "lora" else "Hugging Face checkpoint"
    print(f"wrote {args.output}/ ({what} of {args.ckpt_dir})")
    if cfg.train.method == "lora" and cfg.train.lora_merge:
        print("note: a LoRA checkpoint holds the adapters only: merged weights come from the run's hf_output "
              "(lora_merge = true), or from peft's merge_and_unload on this adapter", file=sys.stderr)
    return EXIT_OK


def _diff_side(path: str) -> tuple[dict, str]:
    """One side of `diff`: a .par spec compiled (its diagnostics printed), else a plan.json
    file or a directory `compile -o` wrote. Raises SpecError, _Usage."""
    if Path(path).suffix == ".par":
        plan, source = _compile(path)
        _print_diags(plan.warnings, plan.source or source)
        return plan.data, path
    try:
        return api.plan_data(Path(path))[0], path
    except api.PlanFileError as e:
        raise _Usage(str(e)) from None


def cmd_diff(args) -> int:
    """`parcompile diff OLD NEW [--format text|markdown|json] [--fail-on BOUND ...]`: what
    changed between two plans (specs, plan.json files or `compile -o` directories); exit 1
    when a --fail-on bound is crossed (:mod:`parcompile.plandiff`), 2 on bad usage."""
    from parcompile.plandiff import BoundError, PlanDiff, diff_plans, parse_bound

    try:
        bounds = [parse_bound(b) for b in args.fail_on or []]   # bad usage first, before compiling
    except BoundError as e:
        raise _Usage(str(e)) from None
    try:
        (old, old_name), (new, new_name) = _diff_side(args.old), _diff_side(args.new)
    except SpecError as e:
        _print_diags(e.diagnostics, e.source)
        return EXIT_SPEC
    result = PlanDiff(old, new, diff_plans(old, new), old_name, new_name)
    try:
        result.check(bounds)
    except BoundError as e:
        raise _Usage(str(e)) from None
    sys.stdout.write(result.render(args.format))
    return EXIT_SPEC if result.failed else EXIT_OK


def cmd_schema(args) -> int:
    """`parcompile schema [-o FILE]`: the JSON Schema of plan.json (docs/plan.schema.json)."""
    from parcompile.plan_schema import json_schema_text

    if args.output is None:
        sys.stdout.write(json_schema_text())
    elif not args.output.strip():
        raise _Usage("-o needs a file name, got an empty string; omit -o to print to stdout")
    else:
        _write_atomic(Path(args.output), json_schema_text(), what="schema")
    return EXIT_OK


def _api_key(text: str) -> str:
    """argparse type: a non-empty API key (usage error otherwise: an empty `--api-key "$KEY"`
    must not serve with no key)."""
    import argparse

    if not text:
        raise argparse.ArgumentTypeError("the key is empty; give a key, or leave --api-key out to serve without one")
    return text


def _at_least_one(text: str) -> int:
    """argparse type: an integer >= 1 (usage error otherwise)."""
    import argparse

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n

def make_parser() -> argparse.ArgumentParser:
    """The ``parcompile`` argument parser: one subcommand per SPEC command, each with its
    ``fn`` (``cmd_*``)."""
    ap = argparse.ArgumentParser(prog="parcompile", description="Compile .par specs into parallel training and serving plans: "
                                                          "plan, search, verify, run, serve and export them.")
    from parcompile import __version__

    ap.add_argument("--version", action="version", version=f"parcompile {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_plan_commands(sub)
    _add_run_commands(sub)
    _add_search_commands(sub)
    _add_export_commands(sub)
    _add_tool_commands(sub)
    return ap


def _add_plan_commands(sub) -> None:
    """``check``, ``plan`` and ``compile``: read a spec, report or write its plan."""
    p = sub.add_parser("check", help="validate a spec; print diagnostics or one summary line")
    p.add_argument("spec")
    p.add_argument("--format", choices=["text", "json"], default="text")
    p.set_defaults(fn=cmd_check)

    p = sub.add_parser("plan", help="print the plan report, plan.json or the graph (Graphviz)")
    p.add_argument("spec")
    p.add_argument("--format", choices=["text", "json", "dot"], default=None,
                   help="text (the report, default), json (plan.json) or dot (the graph, Graphviz)")
    p.add_argument("--json", action="store_true", help="short for --format json")
    p.add_argument("--html", metavar="FILE", help="also write the plan's report as one self-contained HTML file")
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("compile", help="write plan.json, report.md, program.py and launch.sh")
    p.add_argument("spec")
    p.add_argument("-o", "--output", help="output directory (default build/<spec name>/)")
    p.add_argument("--image", help="k8s/: the container image (torch and parcompile; default parcompile:<version>)")
    p.add_argument("--namespace", default="default", help="k8s/: the namespace of every object (default default)")
    p.add_argument("--storage", metavar="CLAIM",
                   help="k8s/: a PersistentVolumeClaim mounted as the pods' workspace (default an emptyDir)")
    p.set_defaults(fn=cmd_compile)


def _add_run_commands(sub) -> None:
    """``run`` and ``serve``: compile and launch on this machine."""
    p = sub.add_parser("run", help="compile and launch the program on this machine under torchrun")
    p.add_argument("spec")
    p.add_argument("-o", "--output", help="output directory (default build/<spec name>/)")
    p.add_argument("--steps", type=_at_least_one, help="override the number of training steps")
    p.add_argument("--checkpoint-dir", help="training specs: save the final weights here (DCP), for serving")
    p.add_argument("--prompt", action="append", help="serve specs: a prompt (repeat for a batch)")
    p.add_argument("--force", action="store_true",
                   help="training specs: replace an hf_output another run wrote (refused by default, naming that run)")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("serve", help="start the serve program as an OpenAI-compatible HTTP server")
    p.add_argument("spec")
    p.add_argument("-o", "--output", help="output directory (default build/<spec name>/)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--api-key", type=_api_key, default=None,
                   help="answer /v1 requests without `Authorization: Bearer KEY` with 401 (default: "
                        "$PARCOMPILE_API_KEY; none: open)")
    p.add_argument("--max-body", type=_at_least_one, default=None, metavar="BYTES",
                   help="refuse request bodies above BYTES with 413 (default 64 bytes per context token, at least "
                        "1 MiB)")
    p.set_defaults(fn=cmd_serve)


def _add_search_commands(sub) -> None:
    """``search`` (fill the ``auto`` keys) and ``verify`` (a miniature against a reference)."""
    p = sub.add_parser("search", help="fill every `auto` by searching; print the ranked candidates",
                       description="Fill every `auto` layout key by searching; print the ranked candidates. "
                                   "`sequence_parallel` left unset is searched as `auto` (with and without it "
                                   "where tp > 1; each candidate says `sp` or `no-sp`); compiled without a "
                                   "search it stays `false`. `cp` left unset stays 1.")
    p.add_argument("spec")
    p.add_argument("--top", type=_at_least_one, default=10, help="candidates to print (default 10)")
    p.add_argument("--explain", action="store_true",
                   help="why the best beats the runner-up, and how far the spec's own layout is from it")
    p.add_argument("--cross-node-tp", action="store_true", help="also try tensor parallelism across nodes")
    p.add_argument("--html", metavar="FILE",
                   help="also write the best candidate's report, with every candidate plotted, as one HTML file")
    p.set_defaults(fn=cmd_search)

    p = sub.add_parser("verify", help="run a miniature on CPU and compare with a single-process reference")
    p.add_argument("spec")
    p.add_argument("--steps", type=_at_least_one, default=3,
                   help="training steps to compare (default 3; a serve spec runs greedy requests instead)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="compute dtype of the miniature and its reference (default fp32: tightest check)")
    p.set_defaults(fn=cmd_verify)


def _add_export_commands(sub) -> None:
    """``export`` (the plan for another engine) and ``export-weights`` (a Hugging Face checkpoint)."""
    p = sub.add_parser("export", help="the plan for Megatron-LM, Megatron-Bridge, torchtitan, DeepSpeed (training) "
                                      "or vLLM, SGLang (serving)")
    p.add_argument("spec")
    p.add_argument("--to", required=True,
                   choices=["megatron", "megatron-bridge", "torchtitan", "deepspeed", "vllm", "sglang"],
                   help="target engine")
    p.add_argument("--torchtitan-version", choices=["0.3", "0.2"], default=None,
                   help="torchtitan release: 0.3 (a config registry module, default) or 0.2 (a TOML job config)")
    p.add_argument("-o", "--output", help="write to FILE instead of stdout")
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("export-weights", help="a training checkpoint as a Hugging Face checkpoint directory")
    p.add_argument("spec")
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", help="a checkpoint_dir a training program wrote (or a step_N)")
    p.add_argument("-o", "--output", required=True, help="the Hugging Face checkpoint directory to write")
    p.add_argument("--force", action="store_true",
                   help="replace an output another run wrote there (refused by default, naming that run)")
    p.set_defaults(fn=cmd_export_weights)


def _add_tool_commands(sub) -> None:
    """``diff`` (two plans) and ``schema`` (plan.json's JSON Schema)."""
    p = sub.add_parser("diff", help="what changed between two plans (specs, plan.json files or compile -o directories)",
                       description="Compare two plans: degrees, groups, stages, memory per stage, communication, "
                                   "collectives and the estimate. Exit 1 when a --fail-on bound is crossed.")
    p.add_argument("old", metavar="OLD", help="a .par spec, a plan.json, or a directory `compile -o` wrote")
    p.add_argument("new", metavar="NEW", help="the same kinds as OLD")
    p.add_argument("--format", choices=["text", "markdown", "json"], default="text",
                   help="text (default), markdown (a pull-request comment) or json")
    p.add_argument("--fail-on", action="append", metavar="BOUND",
                   help="exit 1 when crossed: METRIC=+N%% (a rise of more than N%%), -N%% (a fall), N%% (either "
                        "way), an amount (+2GiB, +50ms), or a bare METRIC (any change); METRIC is peak_memory, "
                        "step_time, tokens_per_s, tflops_per_gpu, mfu, bubble, comm_bytes, ttft, tpot, world_size "
                        "or a plan.json path (estimate.breakdown.dp_comm, degrees); repeatable")
    p.set_defaults(fn=cmd_diff)

    p = sub.add_parser("schema", help="print the JSON Schema of plan.json (docs/plan.schema.json)")
    p.add_argument("-o", "--output", help="write to FILE instead of stdout")
    p.set_defaults(fn=cmd_schema)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `parcompile` console script and `python -m parcompile`."""
    ap = make_parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # argparse: 2 on usage errors, 0 for --help
        return int(e.code or 0)
    try:
        return args.fn(args)
    except _Usage as e:
        print(f"parcompile: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:   # `parcompile search ... | head`: the reader left; say nothing more, as cat does
        try:
            sys.stdout = open(os.devnull, "w")   # the interpreter's own flush at exit would raise again
        except OSError:
            pass
        return 141   # 128 + SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
