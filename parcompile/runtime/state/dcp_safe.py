"""Reading a torch.distributed.checkpoint (DCP) directory without running its code.

A DCP checkpoint's ``.metadata`` is a pickle, and torch 2.13 reads it with ``pickle.load``
(``torch/distributed/checkpoint/filesystem.py``: ``FileSystemReader.read_metadata``): a
pickle can call any importable function, so a checkpoint from someone else could run
code in ``parcompile check``, in ``export-weights`` and in every rank that loads it.
torch also reads every non-tensor entry (``BytesStorageMetadata``) with
``torch.load(weights_only=False)`` (``default_planner.py``: ``load_bytes``), so a
metadata that calls a parameter "bytes" could do the same through its data file.

Here ``.metadata`` is read by :class:`_MetadataUnpickler`, which resolves only the names a
checkpoint's metadata is made of (:data:`ALLOWED`: the dataclasses of
``torch.distributed.checkpoint.metadata``, ``_StorageInfo``, ``torch.Size``, torch's
dtypes, layouts and memory formats, ``pathlib`` paths and plain builtin containers), and
refuses any other (:class:`RefusedName`). Loads go through :func:`load`, whose reader
hands DCP that metadata (torch never unpickles the file); the callers
(:func:`parcompile.runtime.state.weights.read_dcp_metadata`, ``load_dcp_tensors``) request
tensors only: an entry requested as a tensor must be a ``TensorStorageMetadata`` (the
tensor data files are read by torch with ``weights_only=True``). This module imports
nothing of parcompile; the messages are :mod:`parcompile.runtime.state.weights`'.

Trust boundary (docs/checkpoints.md): a checkpoint's tensors are data and may hold any
values; nothing in a checkpoint directory is executed.
"""

from __future__ import annotations

import io
import os
import pickle

#: module -> names a DCP ``.metadata`` may refer to (torch 2.13's, and those of the 2.x
#: releases before it: ``torch/distributed/checkpoint/metadata.py``)
ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),   # and torch's dtypes, layouts and memory formats: _torch_value
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
    "builtins": frozenset({"set", "frozenset", "list", "tuple", "dict", "int", "float", "str", "bytes", "bool",
                           "complex", "slice"}),
    "collections": frozenset({"OrderedDict"}),
}


def _torch_value(name: str):
    """torch's dtype, layout or memory format ``name`` (``torch.float32``), else None."""
    import torch

    v = getattr(torch, name, None)
    return v if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)) else None


class RefusedName(pickle.UnpicklingError):
    """A pickle that refers to a name outside :data:`ALLOWED`: ``name`` (``posix.system``)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class _MetadataUnpickler(pickle.Unpickler):
    """A pickle reader that resolves only :data:`ALLOWED` names (module docstring)."""

    def find_class(self, module: str, name: str):
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and _torch_value(name) is not None:
            return _torch_value(name)
        raise RefusedName(f"{module}.{name}")


def unpickle_metadata(data: bytes):
    """The object the ``.metadata`` bytes ``data`` hold, built from :data:`ALLOWED` names
    only.

    Raises:
        RefusedName: the pickle names anything else (it could run code).
        Exception: whatever a damaged pickle raises (UnpicklingError, EOFError, ...).
    """
    return _MetadataUnpickler(io.BytesIO(data)).load()


def load(state: dict, directory: str | os.PathLike, no_dist: bool, meta) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` (name -> tensor or DTensor,
    filled in place) from the checkpoint ``directory`` (a ``step_N``), DCP's reader
    handed ``meta`` (read by :func:`unpickle_metadata`) instead of unpickling
    ``.metadata`` itself. The caller checks that every name of ``state`` is a tensor
    entry of ``meta``."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):   # never torch's pickle.load of .metadata
            if getattr(meta, "storage_meta", None) is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    with warnings.catch_warnings():   # one process: DCP warns that it assumes so
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=_Reader(str(directory)), no_dist=no_dist)


def failure_reason(e: BaseException) -> str:
    """One line for why a DCP read or write failed: its first failing rank's error
    (``CheckpointException.failures``, a BaseException gathering every rank's) or ``e``'s:
    an OSError's text and file name, else the type and first line."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    if isinstance(e, OSError):
        return f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    return f"{type(e).__name__}: {e}".splitlines()[0]


__all__ = ["ALLOWED", "RefusedName", "unpickle_metadata", "load", "failure_reason"]



