"""Training data files and their records (:mod:`parcompile.runtime.data.dataset` tokenizes them):
the sources a ``data`` key names (:func:`resolve_files`), the records of a ``.txt``,
``.jsonl`` or ``.parquet`` file in each ``data_format`` (:func:`iter_records`, checked field
by field), and :class:`DataError`, which names the data file and its 1-based line (jsonl line,
parquet row) for every user mistake."""

from __future__ import annotations

import glob as globmod
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Iterator

from parcompile.core.files import what_is

#: the data files a directory or glob source takes
DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")
#: what one record of each field looks like, for help lines
_EXAMPLE = {"text": '{"text": "a document"}', "prompt": '{"prompt": "Question?", "completion": " The answer."}',
            "completion": '{"prompt": "Question?", "completion": " The answer."}',
            "messages": '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}'}


class DataError(Exception):
    """A mistake in the training data or tokenizer.

    Attributes: ``message`` (str), ``path`` (str | None: the data or tokenizer file),
    ``line`` (int | None: 1-based jsonl line or parquet row), ``help`` (str | None: how to
    fix it). ``str(e)`` is ``"path:line: message"``, ``"path: message"`` or ``"message"``.
    """

    def __init__(self, message: str, path: str | os.PathLike | None = None, line: int | None = None,
                 help: str | None = None):
        self.message = message
        self.path = None if path is None else str(path)
        self.line = line
        self.help = help
        super().__init__(str(self))

    def __str__(self) -> str:
        if self.path is None:
            return self.message
        if self.line is None:
            return f"{self.path}: {self.message}"
        return f"{self.path}:{self.line}: {self.message}"


def _pydoc_path() -> Path:
    spec = importlib.util.find_spec("pydoc_data.topics")
    return Path(spec.origin)


def resolve_files(source: str) -> list[Path]:
    """The data files of a source: a file; a directory (its ``.txt``, ``.jsonl``,
    ``.parquet`` files, recursively, hidden ones skipped, sorted by path); a glob
    (its matching files, directories among them expanded as above, sorted); or
    ``"builtin:pydoc"`` (Python's ``pydoc_data/topics.py``, read as one text document).

    Raises: DataError when nothing matches (or a directory holds no data file).
    """
    if source == "builtin:pydoc":
        return [_pydoc_path()]
    p = Path(source)
    if p.is_file():
        return [p]

    def expand(d: Path) -> list[Path]:
        out = []
        for f in d.rglob("*"):
            rel = f.relative_to(d).parts
            if f.is_file() and f.suffix in DATA_SUFFIXES and not any(s.startswith(".") for s in rel):
                out.append(f)
        return out

    if p.is_dir():
        files = sorted(expand(p))
        if not files:
            raise DataError("directory holds no .txt, .jsonl or .parquet file", p,
                            help="data may be a file, a directory of .txt/.jsonl/.parquet files, or a glob")
        return files
    if globmod.has_magic(source):
        found: set[Path] = set()
        for m in globmod.glob(source, recursive=True):
            mp = Path(m)
            if mp.is_file():
                found.add(mp)
            elif mp.is_dir():
                found.update(expand(mp))
        if not found:
            raise DataError("no file matches this pattern", source,
                            help="data may be a file, a directory of .txt/.jsonl/.parquet files, or a glob")
        return sorted(found)
    what = what_is(p)
    raise DataError("data file not found" if what == "does not exist" else f"data {what}", source,
                    help="data may be \"synthetic\", \"builtin:pydoc\", a file, a directory or a glob")


def json_type(v: Any) -> str:
    """A JSON value's kind for messages (``null``, ``a number``, ``an object``...)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _fields(obj: dict) -> str:
    names = list(obj)
    return ", ".join(f"`{n}`" for n in names[:12]) + (", ..." if len(names) > 12 else "") if names else "none"


def _field(obj: Any, name: str, path: Path, line: int, kind: str) -> Any:
    if not isinstance(obj, dict):
        raise DataError(f"expected a JSON object, found {json_type(obj)}", path, line,
                        help=f"each {_kind_word(path)} is one object, e.g. {_EXAMPLE.get(name, _EXAMPLE['text'])}")
    if name not in obj:
        help = None
        if kind == "text":
            help = "set text_field to the field that holds the documents"
        raise DataError(f"no field `{name}` (the {_kind_word(path)} has: {_fields(obj)})", path, line, help=help)
    return obj[name]


def _kind_word(path: Path) -> str:
    return "row" if path.suffix == ".parquet" else "line"


def _check_str(value: Any, name: str, path: Path, line: int) -> str:
    if not isinstance(value, str):
        raise DataError(f"field `{name}` is {json_type(value)}, not a string", path, line,
                        help=f"write it as a string, e.g. {_EXAMPLE.get(name, _EXAMPLE['text'])}")
    return _check_text(value, f"field `{name}`", path, line)


def _check_text(value: str, what: str, path: Path, line: int) -> str:
    """``value`` when it is text UTF-8 can hold: JSON's ``\\udc80``-style escapes decode to
    lone surrogates, which no tokenizer (nor UTF-8) accepts. Raises DataError."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{what} holds a lone surrogate (\\u{ord(value[e.start]):04x}) at character {e.start + 1}: "
                        f"not text", path, line,
                        help="JSON's \\ud800-\\udfff escapes come in pairs (one character beyond U+FFFF); "
                             "fix or drop the escape") from None
    return value


def _check_messages(value: Any, path: Path, line: int) -> list[dict]:
    if not isinstance(value, list):
        raise DataError(f"field `messages` is {json_type(value)}, not a list of {{role, content}} objects",
                        path, line, help=f"e.g. {_EXAMPLE['messages']}")
    if not value:
        raise DataError("field `messages` is an empty list", path, line, help=f"e.g. {_EXAMPLE['messages']}")
    out = []
    for i, m in enumerate(value, 1):
        if not isinstance(m, dict):
            raise DataError(f"message {i} is {json_type(m)}, not a {{role, content}} object", path, line,
                            help=f"e.g. {_EXAMPLE['messages']}")
        for key in ("role", "content"):
            if key not in m:
                raise DataError(f"message {i} has no `{key}` (it has: {_fields(m)})", path, line,
                                help=f"e.g. {_EXAMPLE['messages']}")
            if not isinstance(m[key], str):
                raise DataError(f"message {i}: `{key}` is {json_type(m[key])}, not a string", path, line,
                                help=f"e.g. {_EXAMPLE['messages']}")
            _check_text(m[key], f"message {i}: `{key}`", path, line)
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def _record(obj: Any, data_format: str, text_field: str, path: Path, line: int):
    """Validate one jsonl/parquet record: a str (text), (prompt, completion) or messages."""
    if data_format == "text":
        return _check_str(_field(obj, text_field, path, line, "text"), text_field, path, line)
    if data_format == "prompt_completion":
        p = _check_str(_field(obj, "prompt", path, line, "pc"), "prompt", path, line)
        c = _check_str(_field(obj, "completion", path, line, "pc"), "completion", path, line)
        return p, c
    return _check_messages(_field(obj, "messages", path, line, "chat"), path, line)


def iter_records(path: Path, data_format: str, text_field: str, raw_bytes: bool
                  ) -> Iterator[tuple[int | None, Any, int]]:
    """(line | None, record, bytes consumed) of one data file."""
    suffix = path.suffix
    if suffix == ".jsonl":
        try:
            fh = open(path, "rb")
        except OSError as e:
            raise DataError(f"cannot read: {e.strerror}", path) from None
        with fh:
            for lineno, raw in enumerate(fh, 1):
                if not raw.strip():
                    yield lineno, None, len(raw)
                    continue
                try:
                    obj = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise DataError(f"not valid JSON: {e.msg} (column {e.colno})", path, lineno,
                                    help="a .jsonl file holds one JSON object per line") from None
                except UnicodeDecodeError as e:
                    raise DataError(f"not UTF-8 text: {e.reason}", path, lineno,
                                    help="convert the file to UTF-8") from None
                except RecursionError:   # json's decoder recurses once per `[` or `{`
                    raise DataError("not valid JSON: nested too deeply to read", path, lineno,
                                    help="a .jsonl file holds one JSON object per line, such as "
                                         '{"text": "..."}') from None
                yield lineno, _record(obj, data_format, text_field, path, lineno), len(raw)
    elif suffix == ".parquet":
        yield from _iter_parquet(path, data_format, text_field)
    else:
        if data_format != "text":
            raise DataError(f"a {suffix or 'plain'} file holds one text document; data_format = "
                            f"{data_format} needs .jsonl or .parquet records", path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read: {e.strerror}", path) from None
        if raw_bytes:
            yield None, data, len(data)
            return
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise DataError(f"not UTF-8 text: {e.reason} at byte {e.start}", path, line,
                            help="convert the file to UTF-8") from None
        yield None, text, len(data)


def _iter_parquet(path: Path, data_format: str, text_field: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading .parquet files needs pyarrow", path, help="pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"not a parquet file: {e}", path,
                        help="a .parquet file must be Apache Parquet (e.g. written by pandas.to_parquet)") from None
    columns = {"text": [text_field], "prompt_completion": ["prompt", "completion"], "chat": ["messages"]}[data_format]
    names = pf.schema_arrow.names
    for c in columns:
        if c not in names:
            help = "set text_field to the column that holds the documents" if data_format == "text" else None
            raise DataError(f"no column `{c}` (the file has: {', '.join(f'`{n}`' for n in names) or 'none'})",
                            path, help=help)
    size = path.stat().st_size
    total_rows = max(pf.metadata.num_rows, 1)
    row = 0
    for batch in pf.iter_batches(batch_size=4096, columns=columns):
        cols = [batch.column(c).to_pylist() for c in columns]
        n = batch.num_rows
        per_row = size / total_rows
        for k in range(n):
            row += 1
            obj = {c: col[k] for c, col in zip(columns, cols)}
            yield row, _record(obj, data_format, text_field, path, row), per_row
