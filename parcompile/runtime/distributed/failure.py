"""How a generated program ends on an error (issue 51): once, from the rank that failed.

When one rank fails, the others fail after it (a peer gone from a collective), each with
a traceback of its own, before torchrun stops them. torchrun gives each rank an error file
(``TORCHELASTIC_ERROR_FILE``) for the cause: torch's ``@record``
(torch/distributed/elastic/multiprocessing/errors/__init__.py, torch 2.13) writes the
exception there, and torchrun names the rank whose failure came first. :func:`run_main`
writes it the same way; under `parcompile run` / `parcompile serve`
(:data:`parcompile.core.process.LAUNCHER_ENV` set) the rank prints nothing and the launcher
prints the first failure once; elsewhere (a plain torchrun, ``launch.sh``, one process)
the program prints as it did.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable

from parcompile.core.process import LAUNCHER_ENV


def _error_file() -> str | None:
    """This rank's error file (torchrun sets it for each rank), or None."""
    return os.environ.get("TORCHELASTIC_ERROR_FILE") or None


def run_main(main: Callable[[], object], explained: tuple[type[BaseException], ...] = (),
             speaks: Callable[[BaseException], bool] = lambda e: True) -> None:
    """Run ``main()``. An error of ``explained`` (the program's own errors, whose message
    says what went wrong and how to fix it, as ``TrainError``) is written to this rank's
    error file as a plain message (torch's string form: ``{"message": str, "timestamp":
    int}``) and, unless :data:`~parcompile.core.process.LAUNCHER_ENV` says the launcher
    reports it (and the file could be written), printed as ``error: MESSAGE`` where
    ``speaks(e)``; any other exception is recorded with its traceback (torch's
    ``ErrorHandler.record_exception``, what ``@record`` does) and raised again, or, under
    the launcher, only recorded. Either way the process then exits with status 1 (the
    exception raised again: Python's 1)."""
    quiet = bool(os.environ.get(LAUNCHER_ENV)) and _error_file() is not None
    try:
        main()
    except explained as e:
        path = _error_file()
        try:
            if path:
                with open(path, "w") as f:
                    json.dump({"message": str(e), "timestamp": int(time.time())}, f)
        except OSError:   # as torch's ErrorHandler: not recorded, so said here, launcher or not
            quiet = False
        if not quiet and speaks(e):
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as e:
        if _error_file():
            from torch.distributed.elastic.multiprocessing.errors import get_error_handler

            get_error_handler().record_exception(e)
        if not quiet:
            raise
        sys.exit(1)


__all__ = ["run_main"]
