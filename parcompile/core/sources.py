"""Names of training texts that need no file (SPEC: ``train.data``): the front end accepts
them and the runtime's data loader reads them (:mod:`parcompile.runtime.data.dataset`)."""

from __future__ import annotations

#: ``train.data`` names for texts that ship with Python itself (read as bytes)
BUILTIN_SOURCES = ("builtin:pydoc",)

__all__ = ["BUILTIN_SOURCES"]
