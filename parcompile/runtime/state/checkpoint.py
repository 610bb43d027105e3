"""Training checkpoints with torch.distributed.checkpoint (DCP) that survive faults and
move between plans.

Layout: ``CHECKPOINT_DIR/step_00000040/`` holds one DCP checkpoint of the state after 40
optimizer steps:

- every parameter under its global name (``layers.3.attn.wq.weight``), tensor-parallel
  shards as DTensors over the tp group, so the checkpoint holds global tensors; so are the
  persistent buffers with a layout (DeepSeek-V3's ``layers.3.mlp.router.e_score_correction_bias``);
- the optimizer's states in the same layout as their parameter, under
  ``optim/<state>/<name>`` (``exp_avg``, ``exp_avg_sq``, and ``master`` for the fp32
  master weights of 16-bit models; ZeRO shards are gathered into that layout first);
- ``train/step``;
- fp16: the dynamic loss scaler (``train/loss_scale``, ``train/good_steps``,
  ``train/skipped_steps``), so a resumed run scales its loss as the uninterrupted run
  would, and its optimizer counts the steps it really took (skipped steps do not update
  Adam's bias correction).

A checkpoint is written to ``step_N.partial`` and renamed to ``step_N`` by rank 0 once
every rank has finished, so a directory named ``step_N`` is always complete; resuming
takes the newest one. Loading reads each tensor into this plan's layout: DTensor reads
when the tp split matches, otherwise the whole tensor, cut here (vocabulary rows padded
for another tp, a single process). Data-parallel replicas are deduplicated by DCP.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from parcompile.core.model import ModelKeys
from parcompile.core.outputs import (HF_OUTPUT_HELP, checkpoint_bytes, hf_output_problem, run_identity, space_problem,
                                     write_problem)
from parcompile.runtime.state.hf_export import export_weights, read_dcp_global, tokenizer_outputs
from parcompile.runtime.state.peft_export import write_lora_output
from parcompile.runtime.distributed.context import ParallelContext
from parcompile.runtime.data.dataset import load_tokenizer
from parcompile.runtime.state.dcp_safe import failure_reason
from parcompile.runtime.train.step import fail_together
from parcompile.runtime.state.weights import WeightsError, load_dcp_tensors, read_dcp_metadata
from parcompile.runtime.state.weights import STEP_DIR, layout_tensors, newest, target_slice, tp_mesh  # noqa: F401  (newest, STEP_DIR: this module's API)


def _global(t: torch.Tensor, p: torch.Tensor, mesh):
    if mesh is not None and getattr(p, "shard_dim", None) is not None and getattr(p, "num_shards", None) in (
            None, mesh.size()):
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(t.contiguous(), mesh, [Shard(p.shard_dim)], run_check=False)
    return t


def _saved_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters (a tied copy once), then the persistent buffers with a layout
    (:func:`parcompile.runtime.state.weights.layout_tensors`)."""
    buffers = [b for b in layout_tensors(model) if not isinstance(b, nn.Parameter)]
    return [p for p in model.parameters() if not getattr(p, "tied_copy", False)] + buffers


def preflight(directory: str | os.PathLike | None, hf_output: str | os.PathLike | None, plan: dict,
              optimizer: str, ctx: ParallelContext, force: bool = False) -> None:
    """Before the first step: ``directory`` (the checkpoint_dir, None: no checkpoints) can
    be created and written and its file system holds one checkpoint of the plan's
    parameters (plan.json ``model.params`` and ``model.dtype``, trained with
    ``optimizer``: :func:`parcompile.core.outputs.checkpoint_bytes`); ``hf_output`` may be
    written, apart from ``directory`` (:mod:`parcompile.core.outputs`, the rules the
    spec's checks apply; ``--checkpoint-dir`` may name another directory, and files change
    between check and run), and holds no output of another run
    (:func:`parcompile.core.outputs.run_identity` of ``plan`` and ``directory``) unless
    ``force`` (the program's ``--force``). Rank 0 looks; every rank raises together.

    Raises:
        TrainError: naming the path and why.
    """
    problem = help = None
    if ctx.rank == 0:
        if directory:
            problem = write_problem(directory) or space_problem(
                directory, checkpoint_bytes(plan["model"]["params"], plan["model"]["dtype"], optimizer))
            problem = problem and f"checkpoint_dir: {problem}"
            help = "give a writable directory with room for a checkpoint (--checkpoint-dir, or the spec's key)"
        if not problem and hf_output:
            problem = hf_output_problem(hf_output, directory or None, run_identity(plan, directory or None), force)
            problem, help = problem and f"hf_output: {problem}", HF_OUTPUT_HELP
    fail_together(ctx, problem, help)


def _newest_text(root: Path) -> str | None:
    found = newest(root)
    return str(found[0]) if found else None


def save(directory: str | os.PathLike, step: int, model: nn.Module, optimizer, ctx: ParallelContext,
         tokenizer: str | None = None) -> Path:
    """Save parameters, optimizer states (none when ``optimizer`` is None) and the step
    count (module docstring). Every rank calls it; returns the final directory. A Hugging
    Face ``tokenizer``'s files are copied beside the steps (``directory/tokenizer.json``...),
    so that ``init_from = directory`` and ``export-weights`` find the run's tokenizer.

    Raises:
        TrainError: on every rank, when the checkpoint cannot be written (a full disk, a
            directory that became read-only or a file): the partial step is removed, the
            newer complete checkpoints are kept, the message says why in one line.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    root = Path(os.path.normpath(directory))
    final, partial = root / f"step_{step:08d}", root / f"step_{step:08d}.partial"

    def failed(e: BaseException | None) -> None:   # every rank, together
        message = None
        if e is not None:
            kept = _newest_text(root) if ctx.rank == 0 else None
            message = (f"cannot save the checkpoint of step {step} in {root}: {failure_reason(e)}; "
                       + (f"the newest complete checkpoint, {kept}, is kept" if kept else "no checkpoint was saved"))
            if ctx.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
        fail_together(ctx, message, "free space or fix the directory, then run again: it resumes from the "
                                    "newest complete checkpoint")

    error = None
    if ctx.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        except OSError as e:
            error = e
    failed(error)
    mesh = tp_mesh(ctx)
    states = optimizer.export_states() if optimizer is not None else {}
    state: dict[str, object] = {"train/step": torch.tensor(step, dtype=torch.int64)}
    scaler = getattr(optimizer, "scaler", None)
    if scaler is not None:   # fp16
        state.update({f"train/{k}": v for k, v in scaler.state_dict().items()})
    for p in _saved_params(model):
        name = p.global_name
        state[name] = _global(p.detach(), p, mesh)
        for key, t in states.get(id(p), {}).items():
            state[f"optim/{key}/{name}"] = _global(t, p, mesh)
    error = None
    try:
        with warnings.catch_warnings():   # one process: DCP warns that it assumes so
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=_writer(str(partial), ctx, step), no_dist=not ctx.distributed)
    except (Exception, CheckpointException) as e:   # OSError; DCP's gathers every rank's (a BaseException)
        error = e
    failed(error)
    error = None
    if ctx.rank == 0:
        try:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            if tokenizer and tokenizer != "bytes":
                for f in load_tokenizer(tokenizer).files:
                    tmp = root / f".{f.name}.tmp"
                    shutil.copy2(f, tmp)
                    os.replace(tmp, root / f.name)
        except OSError as e:
            error = e
    failed(error)
    return final


def load(directory: str | os.PathLike, model: nn.Module, optimizer, ctx: ParallelContext) -> int:
    """Resume from the newest complete checkpoint in ``directory``; returns its step (0,
    and nothing loaded, when there is none).

    Raises:
        RuntimeError: the checkpoint lacks a tensor of this model or has another shape.
        WeightsError: its ``.metadata`` is damaged or refers to code, or an entry this
            model reads is a pickled object (:func:`parcompile.runtime.state.weights.read_dcp_metadata`).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    found = newest(directory)
    if found is None:
        return 0
    path, step = found
    metadata = read_dcp_metadata(path)   # .metadata is a pickle: read without running code
    meta = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    mesh = tp_mesh(ctx)
    params = list(model.parameters()) + [b for b in layout_tensors(model) if not isinstance(b, nn.Parameter)]
    keys = ["param"] + sorted({k.split("/")[1] for k in meta if k.startswith("optim/")})
    wanted: dict[str, tuple[nn.Parameter, str]] = {}
    for p in params:
        for key in keys:
            ck = p.global_name if key == "param" else f"optim/{key}/{p.global_name}"
            if ck in meta:
                wanted.setdefault(ck, (p, key))
            elif key == "param":
                raise RuntimeError(f"checkpoint {path} has no `{ck}`: written for another model?")
    state: dict[str, object] = {}
    for ck, (p, _) in wanted.items():
        size, dtype = tuple(meta[ck].size), meta[ck].properties.dtype
        same_split = (mesh is not None and getattr(p, "shard_dim", None) is not None
                      and getattr(p, "valid_rows", None) is None and size == tuple(p.global_shape))
        if same_split:
            state[ck] = _global(torch.empty(tuple(p.global_local_shape if hasattr(p, "global_local_shape")
                                                    else p.shape), dtype=dtype), p, mesh)
        else:
            state[ck] = torch.empty(size, dtype=dtype)
    load_dcp_tensors(state, path, not ctx.distributed, metadata)

    def local(ck: str, p: nn.Parameter) -> torch.Tensor:
        t = state[ck]
        return t.to_local() if hasattr(t, "to_local") else target_slice(t, p)

    loaded: dict[int, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for p in params:
            name = p.global_name
            value = local(name, p)
            if p.data.numel() == 0:   # ZeRO 3 between steps: the optimizer keeps the shard
                p.data = torch.empty(value.shape, dtype=p.dtype, device=ctx.device)
            p.data.copy_(value)
            loaded[id(p)] = {key: local(f"optim/{key}/{name}", p).to(ctx.device)
                             for key in keys[1:] if f"optim/{key}/{name}" in state}
    scaler = getattr(optimizer, "scaler", None)
    skipped = 0
    if scaler is not None and "train/loss_scale" in meta:   # fp16, saved by an fp16 run
        saved = {k: torch.empty((), dtype=torch.float64 if k == "loss_scale" else torch.int64)
                 for k in ("loss_scale", "good_steps", "skipped_steps")}
        load_dcp_tensors({f"train/{k}": v for k, v in saved.items()}, path, not ctx.distributed, metadata)
        scaler.load_state_dict(saved)
        skipped = scaler.skipped
    optimizer.import_states(loaded, step - skipped)   # the optimizer's own step count
    return step


def maybe_fail(ctx: ParallelContext, step: int) -> None:
    """A testing hook: ``PARCOMPILE_FAIL_AT=RANK:STEP`` kills rank RANK (SIGKILL) at the
    start of step STEP, as a crashed machine would."""
    spec = os.environ.get("PARCOMPILE_FAIL_AT")
    if spec:
        rank, at = (int(x) for x in spec.split(":"))
        if rank == ctx.rank and step == at:
            import signal

            print(f"rank {ctx.rank}: PARCOMPILE_FAIL_AT kills this rank at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def _writer(path: str, ctx: ParallelContext, step: int):
    """DCP's file-system writer of ``path``. A testing hook: ``PARCOMPILE_FAIL_SAVE=RANK:STEP``
    makes rank RANK's writes of the step-STEP checkpoint fail inside DCP as on a full disk
    (``ENOSPC``), while the other ranks' succeed."""
    import errno

    import torch.distributed.checkpoint as dcp

    spec = os.environ.get("PARCOMPILE_FAIL_SAVE")
    if not spec or tuple(int(x) for x in spec.split(":")) != (ctx.rank, step):
        return dcp.FileSystemWriter(path)

    class _Full(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    return _Full(path)


def write_hf_output(out_dir: str | os.PathLike, step: int, model: nn.Module, ctx: ParallelContext,
                    model_keys: dict, tokenizer: str | None, plan: dict | None = None,
                    checkpoint_dir: str | os.PathLike | None = None, force: bool = False,
                    lora: dict | None = None) -> None:
    """Write a Hugging Face checkpoint of the trained weights to ``out_dir`` (``hf_output``):
    every rank saves its shards as a parameters-only DCP checkpoint in a temporary
    sibling directory, then rank 0 reads the global tensors back and writes config.json,
    safetensors shards and the tokenizer files (:func:`parcompile.runtime.state.hf_export.export_weights`,
    atomic: a temporary directory renamed into place). One rule for every layout (tp, pp,
    ZeRO-3, tied heads), the same that ``parcompile export-weights`` runs on a checkpoint.
    ZeRO-3 parameters must be gathered first (``opt.gather_for_export()``). With ``plan``
    (plan.json) the output records its run (:func:`parcompile.core.outputs.run_identity` of
    ``plan``, ``checkpoint_dir`` and ``step``) and replaces another run's only with ``force``.
    ``lora`` (the program's ``LORA``, ``method = lora``): the PEFT adapter, or the merged
    weights and the adapter (:func:`parcompile.runtime.state.peft_export.write_lora_output`).
    """
    out = Path(out_dir)
    tmp = out.parent / f".{out.name}.dcp"
    if ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    final = save(tmp, step, model, None, ctx)
    problem = None
    if ctx.rank == 0:
        try:
            files, generation = tokenizer_outputs(tokenizer)
            run = run_identity(plan, checkpoint_dir or None, step) if plan is not None else None
            if lora is not None:
                write_lora_output(read_dcp_global(final), ModelKeys(**model_keys), out, lora, files,
                                  generation_config=generation, run=run, force=force)
            else:
                export_weights(final, ModelKeys(**model_keys), out, files, generation_config=generation, run=run,
                               force=force)
        except (WeightsError, OSError) as e:   # e.g. hf_output became a directory of other files
            problem = f"hf_output: {failure_reason(e) if isinstance(e, OSError) else e.message}"
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    fail_together(ctx, problem, HF_OUTPUT_HELP)
