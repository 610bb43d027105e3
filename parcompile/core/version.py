"""The compiler's version: plan.json's ``version``, the header of every generated program,
``parcompile --version`` and ``parcompile.__version__``. pyproject.toml reads it (``[tool.setuptools.dynamic]``,
``attr``): the one place the version is written."""

from __future__ import annotations

VERSION = "0.1.0"


def version() -> str:
    """:data:`VERSION`."""
    return VERSION


__all__ = ["VERSION", "version"]
