"""A training program's weights as a Hugging Face checkpoint that ``from_pretrained`` loads.

:func:`read_dcp_global` reads a DCP checkpoint (:mod:`parcompile.runtime.state.checkpoint`) in
one process into full global tensors; :func:`write_hf_checkpoint` writes global tensors as
the model's Hugging Face family (:func:`parcompile.core.hf_weights.hf_family`):
``config.json``, safetensors shards named as transformers names them
(``model.safetensors``, or ``model-00001-of-00003.safetensors`` ... with
``model.safetensors.index.json``), the tokenizer files, optionally
``generation_config.json``, and :data:`parcompile.core.outputs.HF_MARKER` listing what was
written. Fused HF tensors are assembled from our tensors at the
offsets of :func:`parcompile.core.hf_weights.tensor_map`; vocabulary rows are cut to
``vocab``; a tied model writes no head tensor (the family ties it on load). The output
appears atomically: everything is written into a temporary sibling directory renamed
into place at the end (an existing output is replaced only then, and only when it is
empty or holds nothing but an earlier output of parcompile:
:func:`parcompile.core.outputs.hf_output_problem`, checked before anything is written).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch

from parcompile.core.hf_weights import (HF_DTYPES, VOCAB_PARAMS, HFWeightsError, Source, expected_shapes, hf_config,
                                        hf_family, is_buffer, tensor_map)
from parcompile.core.model import ModelKeys
from parcompile.core.outputs import HF_MARKER, HF_OUTPUT_HELP, hf_output_problem
from parcompile.runtime.data.dataset import load_tokenizer
from parcompile.runtime.machine.dtypes import TORCH_DTYPES
from parcompile.runtime.state.weights import WeightsError, dcp_metadata_path, load_dcp_tensors, read_dcp_metadata


def _dtype_name(dtype) -> str:
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        for k, v in TORCH_DTYPES.items():
            if v == dtype:
                return k
        raise WeightsError(f"cannot write {dtype} weights", "dtype: fp32, bf16 or fp16")
    if dtype in TORCH_DTYPES:
        return dtype
    inv = {v: k for k, v in HF_DTYPES.items()}
    if dtype in inv:
        return inv[dtype]
    raise WeightsError(f"cannot write {dtype} weights", "dtype: fp32, bf16 or fp16")


def _layout(model: ModelKeys, family: str) -> dict[str, list[tuple[str, Source]]]:
    """HF tensor name -> the (our name, source) pieces it is made of, in layer order."""
    try:
        tmap = tensor_map(model, family)
    except HFWeightsError as e:
        raise WeightsError(e.message, e.help) from None
    out: dict[str, list[tuple[str, Source]]] = {}
    names = list(expected_shapes(model))
    # and the buffers the map names beside the parameters (DeepSeek-V3's correction bias)
    names += [n for n in tmap if n not in names and n != "lm_head.weight"]
    for name in names:
        src = tmap[name][0]
        out.setdefault(src.name, []).append((name, src))
    return out


def _written_dtype(pieces: list[tuple[str, Source]], td: torch.dtype) -> torch.dtype:
    """The dtype an HF tensor is written in: ``td``, or fp32 for a buffer
    (:func:`parcompile.core.hf_weights.is_buffer`: DeepSeek-V3's correction bias, fp32 in
    the program and in transformers, its ``_keep_in_fp32_modules_strict``)."""
    return torch.float32 if any(is_buffer(ours) for ours, _ in pieces) else td


def _ours(state: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Our global tensor ``name`` from ``state``, on the CPU, vocabulary rows cut.

    Raises:
        WeightsError: missing, or of another shape.
    """
    if name not in state:
        raise WeightsError(f"no `{name}` among the weights to export",
                           "was the checkpoint written by a training program of this model?")
    t = state[name].detach()
    if hasattr(t, "full_tensor"):   # a DTensor
        t = t.full_tensor()
    if name in VOCAB_PARAMS and t.dim() == 2 and t.shape[0] >= shape[0]:
        t = t[: shape[0]]
    if tuple(t.shape) != tuple(shape):
        raise WeightsError(f"`{name}` has shape {tuple(t.shape)}, this model's is {tuple(shape)}",
                           "was the checkpoint written by a training program of this model?")
    return t.cpu()


def _assemble(pieces: list[tuple[str, Source]], state: dict[str, torch.Tensor], td: torch.dtype) -> torch.Tensor:
    """One HF tensor from our tensors (transposed, placed at their offsets)."""
    td = _written_dtype(pieces, td)
    name, src = pieces[0]
    whole = tuple(src.ours[::-1]) if src.transpose else tuple(src.ours)
    if len(pieces) == 1 and tuple(src.shape) == whole and not src.lead and not src.offset and not src.block:
        t = _ours(state, name, src.ours).to(td)
        return (t.t() if src.transpose else t).contiguous()
    out = torch.zeros(src.shape, dtype=td)
    for name, src in pieces:
        t = _ours(state, name, src.ours).to(td)
        dest = out[src.lead] if src.lead else out
        for ours, hf_row, n in src.runs(0, t.shape[0]):
            if src.transpose:
                dest[:, hf_row:hf_row + n] = t[ours:ours + n].t()
            else:
                dest[hf_row:hf_row + n] = t[ours:ours + n]
    return out


def hf_tensors(state: dict[str, torch.Tensor], model: ModelKeys, family: str | None = None,
               dtype=None) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors (HF name -> tensor, in layer order) of our global tensors
    ``state`` (our name -> global tensor; vocabulary rows may be padded: cut to
    ``model.vocab``; extra keys ignored; a tied model's ``lm_head.weight`` is ignored).

    Raises:
        WeightsError: a parameter is missing from ``state`` or has another shape; the
            model has no Hugging Face family.
    """
    family = family or _family(model)
    td = TORCH_DTYPES[_dtype_name(dtype) or model.dtype]
    return {hf: _assemble(pieces, state, td) for hf, pieces in _layout(model, family).items()}


def _family(model: ModelKeys) -> str:
    try:
        return hf_family(model)
    except HFWeightsError as e:
        raise WeightsError(e.message, e.help) from None


def _shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """HF names grouped into files of at most ``max_bytes`` (a larger tensor alone), in order."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, n in sizes.items():
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_hf_checkpoint(state: dict[str, torch.Tensor], model: ModelKeys, out_dir: str | os.PathLike,
                        tokenizer_files: Iterable[str | os.PathLike] = (), dtype=None,
                        max_shard_bytes: int = 5 * 2**30, *, generation_config: dict | None = None,
                        run: dict | None = None, force: bool = False) -> Path:
    """Write our global tensors ``state`` as a Hugging Face checkpoint of ``model``'s
    family into ``out_dir`` (module docstring); returns ``out_dir``.

    ``dtype``: ``fp32``/``bf16``/``fp16`` (or a torch dtype; default the model's);
    ``max_shard_bytes``: the largest safetensors file (one tensor larger than it gets a
    file of its own); ``tokenizer_files`` are copied beside; ``generation_config``:
    written as ``generation_config.json`` when given (its ``bos_token_id``,
    ``eos_token_id``, ``pad_token_id`` go into config.json too; else they are null);
    ``run``: the writer's :func:`parcompile.core.outputs.run_identity`, recorded in the
    marker; an output another run wrote is replaced only with ``force``.

    Raises:
        WeightsError: see :func:`hf_tensors`; a tokenizer file that does not exist;
            ``out_dir`` holds something parcompile did not write (a file, a directory of
            other files) or, without ``force``, the output of another run
            (:func:`parcompile.core.outputs.hf_output_problem`).
    """
    from safetensors.torch import save_file

    problem = hf_output_problem(out_dir, run=run, force=force)
    if problem:
        raise WeightsError(problem, HF_OUTPUT_HELP)

    family = _family(model)
    name = _dtype_name(dtype) or model.dtype
    td = TORCH_DTYPES[name]
    layout = _layout(model, family)
    for pieces in layout.values():   # every tensor there, of its shape, before anything is written
        for ours, src in pieces:
            _ours(state, ours, src.ours)
    sizes = {hf: math.prod(pieces[0][1].shape) * torch.empty((), dtype=_written_dtype(pieces, td)).element_size()
             for hf, pieces in layout.items()}
    tok = [Path(f) for f in tokenizer_files]
    for f in tok:
        if not f.is_file():
            raise WeightsError(f"tokenizer file {f} does not exist")
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for f in tok:   # first: the files written below win over a tokenizer file of the same name
            shutil.copy2(f, tmp / f.name)
        shards = _shards(sizes, max_shard_bytes)
        meta = {"format": "pt"}
        weight_map = {}
        for k, names in enumerate(shards, 1):   # one file's tensors in memory at a time
            fname = "model.safetensors" if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            save_file({hf: _assemble(layout[hf], state, td) for hf in names}, str(tmp / fname), metadata=meta)
            weight_map.update({hf: fname for hf in names})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        cfg = hf_config(model, family, name, tokens=generation_config)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if generation_config is not None:
            gen = {"_from_model_config": False, **generation_config}
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
        marker = {"written_by": "parcompile", "files": sorted(f.name for f in tmp.iterdir())}
        if run is not None:
            marker["run"] = run
        (tmp / HF_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            os.replace(old, out)
        raise
    return out


def read_dcp_global(ckpt_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The parameters of a training program's DCP checkpoint as full global tensors (our
    names; vocabulary rows as padded by the writer's plan), read in this one process.
    ``ckpt_dir`` is a ``step_N`` directory (holding ``.metadata``) or the checkpoint root
    (its newest complete step). Optimizer (``optim/``) and ``train/`` entries are not
    read; a tied model has no ``lm_head.weight``.

    Raises:
        WeightsError: no checkpoint in ``ckpt_dir``; a ``.metadata`` that is damaged or
            refers to code (:func:`parcompile.runtime.state.weights.read_dcp_metadata`).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = dcp_metadata_path(ckpt_dir).parent
    meta = read_dcp_metadata(path)   # .metadata is a pickle: read without running code
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
             if "/" not in k and isinstance(v, TensorStorageMetadata)}
    load_dcp_tensors(state, path, True, meta)
    return state


def tokenizer_outputs(tokenizer: str | None) -> tuple[list[Path], dict | None]:
    """What a Hugging Face output takes from the spec's ``tokenizer``: its files to copy
    (tokenizer.json, tokenizer_config.json, ...) and a generation config with its special
    token ids (None for ``"bytes"``: no tokenizer, no ids).

    Raises:
        parcompile.runtime.data.dataset.DataError: the tokenizer cannot be read.
    """
    if not tokenizer or tokenizer == "bytes":
        return [], None
    tok = load_tokenizer(tokenizer)
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    return list(tok.files), {k: v for k, v in ids.items() if v is not None} or None


def export_weights(ckpt_dir: str | os.PathLike, model: ModelKeys, out_dir: str | os.PathLike,
                   tokenizer_files: Iterable[str | os.PathLike] = (), **kw) -> Path:
    """:func:`read_dcp_global` then :func:`write_hf_checkpoint` (``kw``: its keywords)."""
    return write_hf_checkpoint(read_dcp_global(ckpt_dir), model, out_dir, tokenizer_files, **kw)


def checkpoint_step(ckpt_dir: str | os.PathLike) -> tuple[Path, int | None]:
    """The checkpoint root and step of what :func:`read_dcp_global` reads from ``ckpt_dir``
    (a root: its newest complete ``step_N``; a ``step_N`` directory: its parent and N); the
    step is None for a directory not named ``step_N``.

    Raises:
        WeightsError: no checkpoint in ``ckpt_dir`` (:func:`dcp_metadata_path`).
    """
    step_dir = dcp_metadata_path(ckpt_dir).parent
    name = step_dir.name
    if name.startswith("step_") and name[5:].isdigit():
        return step_dir.parent, int(name[5:])
    return step_dir, None


__all__ = ["write_hf_checkpoint", "read_dcp_global", "export_weights", "checkpoint_step", "hf_tensors",
           "tokenizer_outputs"]
