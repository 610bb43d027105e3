"""Reading a user's file: regular files only, with a size limit.

Every file a spec names (the spec itself, a ``config.json`` it imports, ``data``,
``tokenizer``, ``init_from``'s files) may be anything: a FIFO would block a plain ``open``
forever, ``/dev/zero`` would be read until the kernel kills the process, ``/dev/null``
reads as empty. :func:`read_bytes` opens without blocking, reads only a regular file and
at most ``limit`` bytes; :func:`what_is` names what a path is for the diagnostics ("is a
FIFO (named pipe), not a regular file").
"""

from __future__ import annotations

import errno
import json
import os
import stat

#: the largest spec (bytes) read; a spec is a few kilobytes
MAX_SPEC_BYTES = 16 * 2**20
#: the largest JSON side file read whole (config.json, tokenizer_config.json, an index)
MAX_JSON_BYTES = 64 * 2**20

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


class FileReadError(OSError):
    """A path that is no regular file, or a file over the size limit. An ``OSError``
    whose ``strerror`` says what is wrong ("is a FIFO (named pipe), not a regular file")."""

    def __init__(self, reason: str, path: str | os.PathLike):
        super().__init__(errno.EINVAL, reason, os.fspath(path))


def _kind(mode: int) -> str | None:
    """What a stat mode is when not a regular file ("a FIFO (named pipe)"), else None."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def what_is(path: str | os.PathLike) -> str | None:
    """None when ``path`` is a regular file (symbolic links followed), else what it is, as
    the end of a sentence: "does not exist", "is a directory", "is a FIFO (named pipe),
    not a regular file", "is a character device, not a regular file"."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as e:
        return f"cannot be read: {e.strerror or e}"
    kind = _kind(mode)
    if kind is None:
        return None
    return "is a directory" if kind == "a directory" else f"is {kind}, not a regular file"


def read_bytes(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    Opened with ``O_NONBLOCK`` (a FIFO is neither waited on nor read) and checked with
    ``fstat`` on the open file, so what is read is what was checked.

    Raises:
        FileNotFoundError, PermissionError, ...: as ``open`` does.
        FileReadError: not a regular file, or larger than ``limit`` bytes.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        kind = _kind(st.st_mode)
        if kind is not None:
            raise FileReadError("is a directory" if kind == "a directory" else f"is {kind}, not a regular file",
                                path)
        if st.st_size > limit:
            raise FileReadError(f"is {st.st_size:,} bytes, more than the {limit:,} this file may have", path)
        chunks, size = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:   # grew while read
                raise FileReadError(f"is more than the {limit:,} bytes this file may have", path)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, limit: int) -> str:
    """:func:`read_bytes` decoded as UTF-8 (``UnicodeDecodeError`` when it is not)."""
    return read_bytes(path, limit).decode("utf-8")


def json_loads(text: str | bytes):
    """``json.loads(text)`` for a user's file, where nesting too deep for the decoder (it
    recurses once per ``[`` or ``{``: a RecursionError) and an integer of more digits than
    Python converts (``sys.get_int_max_str_digits``: a ValueError that is no
    JSONDecodeError) are bad JSON like any other.

    Raises:
        json.JSONDecodeError (a ValueError): not JSON, "nested too deeply" or "an integer of
            too many digits" (at 1:1).
    """
    doc = text if isinstance(text, str) else ""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", doc, 0) from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:   # int("1" * 5000): "Exceeds the limit (4300 digits) for integer string conversion"
        raise json.JSONDecodeError(f"an integer of too many digits ({e})", doc, 0) from None


__all__ = ["FileReadError", "MAX_JSON_BYTES", "MAX_SPEC_BYTES", "json_loads", "read_bytes", "read_text", "what_is"]
