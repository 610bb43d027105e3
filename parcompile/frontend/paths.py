"""The file paths a spec names (:class:`SpecPaths`), beside :mod:`parcompile.frontend.build`,
their one reader: each relative to the spec's directory, and checked where the spec needs
what they name."""

from __future__ import annotations

import glob
import os

from parcompile.config.schema import BUILTIN_SOURCES
from parcompile.core.files import what_is
from parcompile.diagnostics import DiagnosticBag
from parcompile.frontend.check_context import CheckContext


#: The example each empty-path diagnostic suggests.
_EXAMPLE_PATHS = {"data": "train.jsonl", "eval_data": "eval.jsonl", "init_from": "Llama-3.2-1B",
                  "hf_output": "finetuned", "checkpoint_dir": "checkpoints", "tokenizer": "tokenizer.json",
                  "weights": "Llama-3.2-1B"}


class SpecPaths:
    """The paths of one spec: resolved against ``source_dir`` (the spec's directory; None:
    the working directory, paths as written) by :meth:`resolve`; the `train` block's
    (:meth:`resolve_train`: ``data`` and ``eval_data`` sources, the ``init_from``
    checkpoint, ``hf_output``, ``checkpoint_dir`` and the tokenizer) checked, a path that
    names nothing an error in ``bag`` at its value (marked bad in ``ctx``) and dropped."""

    def __init__(self, source_dir: str | None, bag: DiagnosticBag, ctx: CheckContext):
        self.source_dir, self.bag, self.ctx = source_dir, bag, ctx

    def resolve(self, path: str) -> str:
        """``path`` relative to the spec's directory (an absolute one as it is)."""
        if os.path.isabs(path) or not self.source_dir:
            return path
        return os.path.normpath(os.path.join(self.source_dir, path))

    def resolve_train(self, values: dict) -> None:
        """Resolve the `train` block's paths in ``values`` in place: the data sources
        (:meth:`data_source`), ``init_from`` (a directory, else an error and dropped),
        ``hf_output`` and ``checkpoint_dir`` relative to the spec, as ``data``; the tokenizer
        a path, "bytes", or (not given) the ``init_from`` directory's if it has one (SPEC),
        else "bytes"."""
        for key in ("data", "eval_data", "init_from", "hf_output", "checkpoint_dir", "tokenizer"):
            self.refuse_empty(values, "train", key)
        for key in ("data", "eval_data"):
            self.data_source(values, key)
        given = values.get("init_from")
        for key in ("init_from", "hf_output", "checkpoint_dir"):   # relative to the spec, as `data`
            if values.get(key) is not None:
                values[key] = self.resolve(values[key])
        init_from = values.get("init_from")
        if init_from is not None and not os.path.isdir(init_from):
            what = what_is(init_from)
            what = "is a file, not a directory" if what is None else what.replace("not a regular file", "not a directory")
            self.bag.error(f"init_from directory `{given}` {what}", self.ctx.span("train.init_from"),
                           help="give a Hugging Face checkpoint directory (config.json and *.safetensors) "
                                "or a `checkpoint_dir` a training run wrote")
            self.ctx.bad.add("train.init_from")
            values.pop("init_from")
            init_from = None
        tok = values.get("tokenizer")
        if tok is not None and tok != "bytes":
            values["tokenizer"] = self.resolve(tok)
        elif tok is None:   # SPEC: the init_from directory's tokenizer if it has one
            values["tokenizer"] = tokenizer_beside(init_from) or "bytes"

    def refuse_empty(self, values: dict, block: str, key: str) -> None:
        """An empty path (``checkpoint_dir = ""``) is an error in ``bag`` and dropped: joined
        to the spec's directory it would name that directory itself, where a run would write
        (or an export replace) files beside the user's spec."""
        value = values.get(key)
        if isinstance(value, str) and not value.strip():
            self.bag.error(f"`{key}` is an empty path", self.ctx.span(f"{block}.{key}"),
                           help=f'name a path, e.g. `{key} = "{_EXAMPLE_PATHS.get(key, "out")}"`, or leave the key out')
            self.ctx.bad.add(f"{block}.{key}")
            values.pop(key)

    def data_source(self, values: dict, key: str) -> None:
        """Resolve the `data`/`eval_data` value ``values[key]`` in place: a built-in name, or
        a file, directory or glob relative to the spec's directory; a source that names
        nothing is an error (and is dropped)."""
        data = values.get(key)
        if data is None or data == "synthetic":
            return
        if data.startswith("builtin:"):
            if data not in BUILTIN_SOURCES:
                self.bag.error(f"unknown built-in text `{data}`", self.ctx.span(f"train.{key}"),
                               help="built-in texts: " + ", ".join(f'"{b}"' for b in BUILTIN_SOURCES))
                self.ctx.bad.add(f"train.{key}")
                values.pop(key)
            return
        resolved = self.resolve(data)
        what = what_is(resolved)   # None: a regular file
        if what is None or what == "is a directory" or (glob.has_magic(resolved) and glob.glob(resolved)):
            values[key] = resolved
            return
        where = f"relative to `{self.source_dir}`" if self.source_dir else "relative to the working directory"
        if glob.has_magic(data):
            what = "matches no file"
        self.bag.error(f"{key} `{data}` {what}", self.ctx.span(f"train.{key}"),
                       help=f"give a file, a directory of .txt/.jsonl/.parquet files or a glob ({where}), "
                            '`"builtin:pydoc"` (English text every Python carries) or `"synthetic"`')
        self.ctx.bad.add(f"train.{key}")
        values.pop(key)


def tokenizer_beside(init_from: str | None) -> str | None:
    """The directory holding the tokenizer of an ``init_from`` checkpoint: the directory
    itself (a Hugging Face checkpoint; a training program's `checkpoint_dir`, where
    checkpoints keep a copy of the run's tokenizer), or for a ``step_N`` directory its
    `checkpoint_dir`. None when there is none."""
    if init_from is None:
        return None
    for d in (init_from, os.path.dirname(os.path.normpath(init_from))):
        if os.path.isfile(os.path.join(d, "tokenizer.json")):
            return d
        if not os.path.basename(os.path.normpath(init_from)).startswith("step_"):
            break
    return None


def model_source_on_disk(source: str, source_dir: str | None) -> tuple[str, str] | None:
    """The error (message, help) for a model's ``from "SOURCE"`` that is no preset and does
    not end in ``.json`` (the two forms a model source takes) but names something on disk,
    relative to the spec's directory: a Hugging Face checkpoint directory (help: its
    ``config.json``), a file without the suffix, a FIFO. None when nothing is there (the
    caller's "unknown model preset")."""
    path = source if os.path.isabs(source) or not source_dir else os.path.join(source_dir, source)
    if not source.strip() or not os.path.lexists(path):
        return None
    what = what_is(path) or "is a file without the `.json` suffix"
    config = os.path.join(source.rstrip("/") or "/", "config.json")
    return (f"`{source}` {what}: a model's `from` takes a preset name or the path of a Hugging Face `config.json`",
            f'write `from "{config}"`' if os.path.isfile(os.path.join(path, "config.json")) else
            "name the checkpoint's config.json file (a path ending in `.json`)")
