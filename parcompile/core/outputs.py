"""Where parcompile may write: the rules the checks, the generated programs and
``export-weights`` share, so that no output deletes what the tool did not write.

- A Hugging Face output (``hf_output``, ``export-weights -o``) is a directory written into
  a temporary sibling and renamed into place, replacing what was there. It may be absent,
  an empty directory, or a directory that holds only what an earlier output of parcompile
  wrote: :data:`HF_MARKER` lists those files (:func:`hf_output_problem`). Anything else
  (a file, a directory holding the training data, the spec's own directory, a marker that
  is no small regular file of parcompile's: :func:`_marker`) is refused before anything is
  written. The marker also records which run wrote the output
  (:func:`run_identity`: the plan's name and digest, the checkpoint directory and step); an
  output of another run is refused unless the user forces it (``export-weights --force``,
  ``parcompile run --force``), naming that run (:func:`hf_output_problem`).
- A checkpoint directory (``checkpoint_dir``) must be creatable and writable: no file in
  its place or above it, and a real write probe succeeds (permission bits say nothing to
  root; a read-only mount or a file in the way does) (:func:`write_problem`); and its
  file system must hold one checkpoint (:func:`space_problem`, with
  :func:`checkpoint_bytes`).

Standard library only (:mod:`parcompile.core`). Each function returns None when the path
is usable, else one sentence saying why not, naming the path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from parcompile.core.dtypes import DTYPE_BYTES, OPTIMIZER_STATES
from parcompile.core.files import json_loads, read_bytes
from parcompile.core.units import bytes_text

#: the file a Hugging Face output of parcompile holds beside its tensors: JSON
#: ``{"written_by": "parcompile", "files": [the names written], "run": run_identity(...)}``
HF_MARKER = ".parcompile-output.json"
#: the largest marker read (a few file names and a run: well under a kilobyte as written)
MAX_MARKER_BYTES = 2**20
#: the most characters of a name from a marker or a directory listing an error shows
SHOWN_CHARS = 200


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (``/`` at worst)."""
    p = path
    while not os.path.lexists(p) and p.parent != p:
        p = p.parent
    return p


def write_problem(path: str | os.PathLike) -> str | None:
    """Why a directory cannot be created at ``path`` and written into, or None.

    Refused: ``path`` exists and is not a directory; an ancestor is a file (nothing can be
    created under it); the nearest existing directory refuses a write probe (a file
    created and removed at once: read-only file systems, permissions for non-root users).
    A path holding a NUL byte names nothing and is refused too.
    """
    base = path
    try:
        p = Path(os.path.abspath(path))
        if os.path.lexists(p) and not p.is_dir():
            return f"`{path}` is {_kind(p)}, not a directory"
        base = _nearest_existing(p)
        if not base.is_dir():
            return f"`{base}` is {_kind(base)}, so `{path}` cannot be created under it"
        fd, probe = tempfile.mkstemp(dir=base, prefix=".parcompile-probe-")
        os.close(fd)
        os.unlink(probe)
    except ValueError:   # an embedded NUL byte
        return f"`{path!r}` is not a path (it holds a NUL byte)"
    except OSError as e:
        return f"`{path}` cannot be written: a test file in `{base}` failed ({e.strerror or e})"
    return None


def _kind(p: Path) -> str:
    if p.is_symlink() and not p.exists():
        return "a broken symbolic link"
    if p.is_file():
        return "a file"
    if p.is_dir():
        return "a directory"
    return "a special file (a FIFO, socket or device)"


def space_problem(path: str | os.PathLike, need_bytes: int) -> str | None:
    """Why the file system of ``path`` (its nearest existing ancestor) cannot take
    ``need_bytes`` more bytes (:func:`shutil.disk_usage`'s ``free``), or None."""
    try:
        base = _nearest_existing(Path(os.path.abspath(path)))
        free = shutil.disk_usage(base if base.is_dir() else base.parent).free
    except (OSError, ValueError):
        return None   # write_problem reports a path that cannot be used
    if free < need_bytes:
        return (f"`{path}` has {bytes_text(free)} free on its file system; one checkpoint of this plan "
                f"needs {bytes_text(need_bytes)}")
    return None


def checkpoint_bytes(params: int, dtype: str, optimizer: str) -> int:
    """Bytes of one training checkpoint (:mod:`parcompile.runtime.state.checkpoint`) of
    ``params`` parameters of ``dtype`` (``fp32``, ``bf16``, ``fp16``) trained with
    ``optimizer``: the weights in their dtype, the optimizer's fp32 states
    (:data:`parcompile.core.dtypes.OPTIMIZER_STATES`) and the fp32 master weights of a
    16-bit model. Metadata and the tokenizer copy are small and not counted."""
    width = DTYPE_BYTES[dtype]
    master = 4 if width < 4 else 0
    return params * (width + 4 * OPTIMIZER_STATES[optimizer] + master)


def _marker(directory: str | os.PathLike) -> dict | None:
    """The JSON object of ``directory``'s :data:`HF_MARKER` when parcompile wrote it, else
    None: the marker must be a regular file itself (not a symbolic link, whose target another
    directory's marker may be, nor a directory, FIFO or device), of at most
    :data:`MAX_MARKER_BYTES` (:func:`parcompile.core.files.read_bytes`: never blocks on a FIFO
    or reads ``/dev/zero``), JSON (:func:`parcompile.core.files.json_loads`) and an object
    with ``"written_by": "parcompile"``."""
    path = Path(directory) / HF_MARKER
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        data = json_loads(read_bytes(path, MAX_MARKER_BYTES))
    except (OSError, ValueError):   # FileReadError is an OSError, UnicodeDecodeError a ValueError
        return None
    return data if isinstance(data, dict) and data.get("written_by") == "parcompile" else None


def written_files(directory: str | os.PathLike) -> set[str] | None:
    """The names an earlier Hugging Face output of parcompile wrote in ``directory`` (its
    :data:`HF_MARKER`, :func:`_marker`), or None when it has no readable marker."""
    files = (_marker(directory) or {}).get("files")
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return set(files)


def run_identity(plan: dict, checkpoint_dir: str | os.PathLike | None = None, step: int | None = None) -> dict:
    """Which run writes a Hugging Face output (the :data:`HF_MARKER`'s ``run``): ``plan`` the
    plan.json's ``name``, ``plan_digest`` the first 16 hex digits of the SHA-256 of plan.json
    (``plan``, a dict, serialized with sorted keys: the same spec compiles to the same plan),
    ``checkpoint_dir`` the run's checkpoint root (real path; None: a run without checkpoints),
    ``step`` the optimizer steps the weights went through (None: not known yet). Two outputs
    are of the same run when the digests agree and so do the checkpoint roots where both have
    one (:func:`same_run`: a later step of the same run replaces its earlier output, and so does
    the same spec run again, with or without checkpoints)."""
    text = json.dumps(plan, sort_keys=True, separators=(",", ":"))
    return {"plan": str(plan.get("name", "")), "plan_digest": hashlib.sha256(text.encode()).hexdigest()[:16],
            "checkpoint_dir": os.path.realpath(checkpoint_dir) if checkpoint_dir else None, "step": step}


def written_run(directory: str | os.PathLike) -> dict | None:
    """The ``run`` an earlier Hugging Face output of parcompile in ``directory`` recorded in
    its :data:`HF_MARKER` (:func:`run_identity`), or None (no readable marker, or one written
    before outputs recorded their run: such an output is replaced as before). A ``run`` whose
    fields are not of :func:`run_identity`'s types is ``{}``: no run's, so the output is
    refused as another run's (:func:`run_text` says its record cannot be read)."""
    data = _marker(directory)
    run = None if data is None else data.get("run")
    if run is None:
        return None
    return run if _is_run(run) else {}


def _is_run(run) -> bool:
    """Whether ``run`` has :func:`run_identity`'s fields and types."""
    return (isinstance(run, dict) and isinstance(run.get("plan"), str) and isinstance(run.get("plan_digest"), str)
            and isinstance(run.get("checkpoint_dir"), (str, type(None)))
            and (run.get("step") is None or type(run.get("step")) is int))


def _shown(text: str) -> str:
    """``text`` for a one-line error: non-printable characters (line breaks, terminal
    escapes) as ``?``, at most :data:`SHOWN_CHARS` characters (then ``...``)."""
    text = "".join(ch if ch.isprintable() else "?" for ch in text[:SHOWN_CHARS + 1])
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def same_run(a: dict, b: dict) -> bool:
    """Whether run identities ``a`` and ``b`` (:func:`run_identity`) name the same run: the same
    plan digest, and the same checkpoint root unless one of them has none."""
    ca, cb = a.get("checkpoint_dir"), b.get("checkpoint_dir")
    return a.get("plan_digest") == b.get("plan_digest") and (ca is None or cb is None or ca == cb)


def run_text(run: dict) -> str:
    """A run identity in words, on one line (:func:`_shown`): ``plan `tiny` (a1b2c3d4e5f60718),
    checkpoint_dir `/x/ckpt` step 40``; a record that is not one (:func:`written_run`'s ``{}``):
    ``a run its .parcompile-output.json does not record readably``."""
    if not _is_run(run):
        return f"a run its {HF_MARKER} does not record readably"
    out = f"plan `{_shown(run['plan'])}` ({_shown(run['plan_digest'])})"
    if run.get("checkpoint_dir"):
        out += f", checkpoint_dir `{_shown(run['checkpoint_dir'])}`"
    if run.get("step") is not None:
        out += f" step {_shown(str(run['step']))}"
    return out


def hf_output_problem(path: str | os.PathLike, checkpoint_dir: str | os.PathLike | None = None,
                      run: dict | None = None, force: bool = False) -> str | None:
    """Why a Hugging Face output may not be written at ``path`` (module docstring), or
    None: absent, an empty directory, or one whose every entry is a file an earlier
    output of parcompile listed in its :data:`HF_MARKER`; and its parent can be written
    (the output is renamed into place from a sibling). With the run's ``checkpoint_dir``
    (None: no checkpoints), the two must not overlap (:func:`overlaps`): replacing the
    output would replace the checkpoints, or the checkpoints make it a directory of other
    files that the end of the run refuses to replace. With ``run`` (the writer's
    :func:`run_identity`), an earlier output that another run wrote (:func:`written_run`,
    :func:`same_run`) is refused, naming that run, unless ``force``."""
    problem = _hf_output_problem(path)
    if problem is None and checkpoint_dir is not None and overlaps(path, checkpoint_dir):
        problem = (f"hf_output `{path}` and checkpoint_dir `{checkpoint_dir}` overlap: writing the output would "
                   "replace the checkpoints")
    if problem is None and run is not None and not force:
        earlier = written_run(path)
        if earlier is not None and not same_run(earlier, run):
            problem = (f"`{path}` holds the Hugging Face output of another run ({run_text(earlier)}); "
                       "pass --force to replace it")
    return problem


def _hf_output_problem(path: str | os.PathLike) -> str | None:
    try:
        p = Path(os.path.abspath(path))
        if os.path.lexists(p):
            if p.is_symlink() or not p.is_dir():
                return f"`{path}` is {'a symbolic link' if p.is_symlink() else _kind(p)}; writing the output " \
                       "would replace it"
            entries = sorted(os.listdir(p))
            if entries:
                written = written_files(p)   # None: no marker parcompile wrote (the marker itself is foreign)
                foreign = [e for e in entries if written is None or (e != HF_MARKER and (
                    e not in written or not (p / e).is_file() or (p / e).is_symlink()))]
                if foreign:
                    shown = ", ".join(map(_shown, foreign[:4])) + (f" and {len(foreign) - 4} more"
                                                                    if len(foreign) > 4 else "")
                    return (f"`{path}` is a directory holding {shown}, which parcompile did not write; "
                            "writing the output would replace it")
        return write_problem(p.parent)
    except ValueError:
        return f"`{path!r}` is not a path (it holds a NUL byte)"
    except OSError as e:
        return f"cannot read `{path}`: {e.strerror or e}"


def overlaps(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether the directories ``a`` and ``b`` are the same or one holds the other, as
    written or once symbolic links are followed (``os.path.realpath``: a link into the
    other directory overlaps it)."""
    try:
        pairs = [(Path(os.path.abspath(a)), Path(os.path.abspath(b))),
                 (Path(os.path.realpath(a)), Path(os.path.realpath(b)))]
    except (ValueError, OSError):   # a NUL byte; a symbolic-link loop (realpath raises on some versions)
        return False
    return any(x == y or x in y.parents or y in x.parents for x, y in pairs)


HF_OUTPUT_HELP = ("give a new directory (or an empty one, or one an earlier hf_output or export-weights "
                  "of this run wrote; --force replaces another run's); parcompile replaces only what it wrote")

__all__ = ["HF_MARKER", "HF_OUTPUT_HELP", "write_problem", "space_problem", "checkpoint_bytes", "written_files",
           "hf_output_problem", "overlaps", "run_identity", "written_run", "same_run", "run_text"]
