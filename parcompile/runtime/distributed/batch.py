"""Run several generated training programs one after another in one torchrun launch.

Starting a torchrun job costs more than a miniature's whole run on a small machine (every
rank imports torch; about 10 s for 4 to 8 ranks on 2 cores), so ``parcompile verify`` of
many layouts of one world size (the project's tests) launches once and runs them here::

    torchrun --standalone --nproc-per-node W -m parcompile.runtime.distributed.batch JOBS.json

``JOBS.json`` is a list of ``{"program": path, "argv": [...]}`` whose plans all have world
size ``W``. This module initialises the default process group once (gloo: verify runs its
miniatures on CPU); each program's
``main(argv)`` then runs on it (``init_parallel`` finds the group initialised and creates
only its own subgroups; ``shutdown`` frees those and leaves the world). After job ``i``
finishes on every rank, rank 0 writes ``JOBS.json.done`` with ``i + 1`` (the number of
jobs completed), so a caller can tell a failing job from those that never ran. A job that
raises ends the launch with a non-zero exit (the other ranks may be waiting in one of its
collectives; the process-group timeout ends them), except a job marked
``"expect_error": true`` that stops with :class:`parcompile.runtime.train.step.TrainError`
(raised on every rank together): rank 0 prints ``job I: error: MESSAGE`` as the program
would, and the next job runs.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from parcompile.runtime.train.step import TrainError


def _load(path: Path, index: int):
    """Import ``path`` as a fresh module (each program has its own constants and classes)."""
    spec = importlib.util.spec_from_file_location(f"parcompile_batch_program_{index}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(jobs_file: str | os.PathLike, timeout_s: float = 600.0) -> int:
    """Run every job of ``jobs_file`` in order on one process group; returns the count done.

    Raises:
        whatever a program raises (the launch then exits non-zero).
    """
    jobs_path = Path(jobs_file)
    jobs = json.loads(jobs_path.read_text())
    done_path = jobs_path.with_name(jobs_path.name + ".done")
    dist.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        for i, job in enumerate(jobs):
            try:
                _load(Path(job["program"]), i).main(list(job["argv"]))
            except TrainError as e:
                if not job.get("expect_error"):
                    raise
                if dist.get_rank() == 0:
                    print(f"job {i}: error: {e}", flush=True)
            dist.barrier()
            if dist.get_rank() == 0:
                tmp = done_path.with_suffix(".tmp")
                tmp.write_text(str(i + 1))
                tmp.replace(done_path)
    finally:
        dist.destroy_process_group()
    return len(jobs)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: torchrun --nproc-per-node W -m parcompile.runtime.distributed.batch JOBS.json")
    run(sys.argv[1])
