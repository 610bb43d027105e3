"""torchrun as `parcompile run` and `parcompile serve` start it (issue 51): torch's own
launcher (``torch.distributed.run``), in a process that says in one line why a job failed.

torchrun ends the job when one rank fails, stopping the others (SIGTERM), and raises
``ChildFailedError``: each failed rank with its pid, exit code or signal and error file
(torch/distributed/elastic/multiprocessing/errors/__init__.py, torch 2.13). Run as
``python -m torch.distributed.run`` it prints that as a traceback and a 30-line summary,
after the agent's log lines and the other ranks' tracebacks: 96 lines and 3 tracebacks
for a kill -9 of one rank, which never said which rank died. Here, run as
``python -m parcompile.torchrun LOG_DIR TORCHRUN_ARGS...`` (:func:`command`):

* ``LOG_DIR``, made new (:func:`run_dir`: ``logs/run-TIME-RANDOM`` in the build directory;
  never over anything), is torchrun's ``--log-dir`` (each rank's ``error.json``) and holds
  ``torchrun.log``: the agent's log (torch's loggers, as ``OMP_NUM_THREADS`` notes and
  ``Sending process ... closing signal``) and, on a failure, torchrun's whole summary;
* the ranks write to the terminal as before; a rank's error is recorded in its error file
  instead of printed (:func:`parcompile.runtime.distributed.failure.run_main`, under
  :data:`LAUNCHER_ENV`), and printed here once: the program's own one-line error
  (``TrainError``, as a NaN loss) as it is, a Python exception as its traceback followed
  by one line; a rank killed by a signal or exiting with a status as one line
  (:func:`summary`): which rank, its pid, the signal or status, that the others were
  stopped, the log's path. Exit status 1, as torchrun's;
* a job that succeeds, is stopped, or ends with the program's own error (whose line names
  no log) leaves no directory (:func:`remove`; the front removes it after Ctrl-C, when it
  kills this process).
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from parcompile.core.process import LAUNCHER_ENV



def run_dir(program: str | os.PathLike) -> Path:
    """The path of a new log directory for one launch of ``program``:
    ``logs/run-TIME-RANDOM`` beside it (the build directory). :func:`main` makes it (never
    over anything: where it cannot, a new temporary directory instead); :func:`remove`
    removes it when the job succeeded or was interrupted."""
    return Path(program).parent / "logs" / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"


def command(nproc: int, program: str | os.PathLike, args: Sequence[str], log_dir: str | os.PathLike) -> list[str]:
    """The command that launches ``program`` (with ``args``) on ``nproc`` local ranks under
    torchrun (``--standalone``) through this module, its logs in ``log_dir`` (:func:`run_dir`)."""
    return [sys.executable, "-m", "parcompile.torchrun", str(log_dir), "--standalone",
            f"--nproc-per-node={nproc}", str(program), *map(str, args)]


def first_failure(failures: dict) -> tuple[int, object]:
    """The rank whose failure ended the job, and its ``ProcessFailure``, of torchrun's
    ``failures`` (global rank -> ``ProcessFailure``).

    torch's own ``ChildFailedError.get_first_failure`` takes the earliest timestamp, in
    whole seconds, and a failure without an error file is stamped when the agent sees it:
    a rank killed by SIGKILL loses to the survivor whose collective then failed within
    the same second or the next. Here: the ranks torchrun did not stop itself (exit code
    other than -SIGTERM, the signal it stops the others with; all, if it stopped every
    one), of those the ones killed by a signal (a peer's death makes a rank raise, never
    die by a signal), of those the earliest: by its error file's modification time where it
    wrote one (sub-second, where a peer's error written a few milliseconds later has the
    same whole second), else torch's timestamp; the first seen on a tie."""
    own = {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
    pool = {r: f for r, f in own.items() if f.exitcode < 0} or own
    return min(pool.items(), key=lambda item: _written(item[1]))


def _written(failure) -> float:
    """When ``failure``'s rank wrote its error file (seconds since the epoch), else torch's timestamp."""
    try:
        return os.stat(failure.error_file).st_mtime
    except (OSError, TypeError, ValueError):
        return float(failure.timestamp)


def own_error(failure) -> bool:
    """Whether torchrun's ``failure`` is the program's own error (a ``TrainError``, as a NaN
    loss, recorded by :func:`parcompile.runtime.distributed.failure.run_main`): its one line
    says everything, so :func:`main` keeps no log of it."""
    return failure.exitcode > 0 and failure.error_file != "<N/A>" and isinstance(failure.message, str)


def summary(rank: int, failure, nproc: int, log: Path) -> list[str]:
    """The lines that say why the job failed (see the module docstring): ``failure`` is
    torchrun's ``ProcessFailure`` of global rank ``rank``, ``nproc`` the ranks of the job,
    ``log`` the log's path."""
    message = failure.message
    if own_error(failure):
        return [f"error: {message}"]    # the program's own error (run_main): as it says it
    who = f"rank {rank} (pid {failure.pid})"
    lines = []
    if failure.exitcode < 0:
        name = failure.signal_name()
        what = f"{who} was killed by {name}" if name != "<N/A>" else f"{who} was killed by signal {-failure.exitcode}"
        if failure.exitcode == -signal.SIGKILL:
            what += " (kill -9, or the kernel's out-of-memory killer: see `dmesg`)"
    elif isinstance(message, dict):     # a Python exception the rank recorded: its traceback once
        lines.append(message.get("extraInfo", {}).get("py_callstack", "").rstrip("\n"))
        what = f"{who} failed: {(str(message.get('message', '')).splitlines() or ['?'])[0]}"
    else:
        what = f"{who} exited with status {failure.exitcode}"
    others = f"; torchrun stopped the other {nproc - 1} rank(s)" if nproc > 1 else ""
    return [line for line in lines if line] + [f"error: {what}{others}; torchrun's log: {log}"]


def _log_to(stream) -> None:
    """Send every logger's terminal output, Python's warnings and logging's last resort to ``stream``."""
    import logging

    logging.captureWarnings(True)
    for logger in [logging.getLogger()] + [v for v in logging.Logger.manager.loggerDict.values()
                                           if isinstance(v, logging.Logger)]:
        for h in list(logger.handlers):
            if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in (sys.stderr, sys.stdout):
                to_log = logging.StreamHandler(stream)   # same level, format and filters, into the log
                to_log.setLevel(h.level)
                to_log.setFormatter(h.formatter)
                to_log.filters = list(h.filters)
                logger.removeHandler(h)
                logger.addHandler(to_log)
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler(stream))
    logging.lastResort = logging.StreamHandler(stream)


def _nproc(args) -> int:
    try:
        return int(args.nproc_per_node)
    except (TypeError, ValueError):
        return 0


def main(argv: Sequence[str]) -> int:
    """``LOG_DIR TORCHRUN_ARGS...``: run torchrun with ``TORCHRUN_ARGS`` (see the module
    docstring); returns the exit status (0; 1 when a rank failed or torchrun could not
    start the job; 128 + N when this process was stopped by signal N)."""
    log_dir, rest = Path(argv[0]), list(argv[1:])
    try:
        log_dir.parent.mkdir(parents=True, exist_ok=True)
        log_dir.mkdir()                              # new: never over a file
    except OSError:                                  # there already, or logs/ is not a writable directory
        log_dir = Path(tempfile.mkdtemp(prefix="parcompile-run-"))
    log_path = log_dir / "torchrun.log"
    with open(log_path, "x", buffering=1) as log:
        log.write(f"torchrun {' '.join(rest)}\n")
        os.environ[LAUNCHER_ENV] = str(log_path)      # the ranks inherit it (run_main)
        import torch.distributed.run as torchrun
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        _log_to(log)
        args = torchrun.parse_args(["--log-dir", str(log_dir)] + rest)
        try:
            torchrun.run(args)
        except ChildFailedError as e:
            log.write(e.format_msg() + "\n")
            rank, failure = first_failure(e.failures)
            print("\n".join(summary(rank, failure, _nproc(args) or len(e.failures), log_path)),
                  file=sys.stderr, flush=True)
            if own_error(failure):                   # its line names no log: none is left behind
                log.close()
                remove(log_dir)
            return 1
        except SignalException as e:                 # stopped (the front's SIGTERM): the agent ended the ranks
            remove(log_dir)
            return 128 + int(e.sigval)
        except Exception as e:                       # torchrun could not run the job (rendezvous, a port)
            import traceback

            log.write(traceback.format_exc())
            print(f"error: torchrun failed: {type(e).__name__}: {e}; torchrun's log: {log_path}", file=sys.stderr,
                  flush=True)
            return 1
    remove(log_dir)
    return 0


def remove(log_dir: str | os.PathLike) -> None:
    """Remove the log directory of a job that succeeded or was stopped (and ``logs/`` if it
    is then empty): only a failure's log is worth keeping."""
    import shutil

    shutil.rmtree(log_dir, ignore_errors=True)
    if Path(log_dir).parent.name == "logs":         # run_dir's, not the temporary directory
        try:
            Path(log_dir).parent.rmdir()
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__ = ["command", "first_failure", "main", "own_error", "remove", "run_dir", "summary"]
