"""Start-up progress of a generated program (issue 47): what rank 0 is doing between
torchrun's start and the first training step, or the first generated token / the server's
"serving" line, which takes tens of seconds on a CPU (importing torch, the process groups,
building or loading the model, the data, the KV cache, a compile's warm-up).

Only rank 0 speaks (torchrun sets ``RANK``; a program launched in a batch of jobs, with the
process group already made by its launcher, keeps quiet). Where a person watches (the stream
is a terminal) a tqdm bar counts the stages with each finished stage written above it; in a
pipe or a CI log every stage is one plain line, flushed at once so that `parcompile run` and
`parcompile serve`, whose ranks write to the front's own stdout, show it as it happens::

    start-up  3.9 s | process group up: 2 ranks (gloo)

The time is since the rank's process started (Linux: ``/proc/self/stat``'s ``starttime``, so
importing torch counts), else since the :class:`Startup` was made.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: field 22 of ``/proc/self/stat``, in clock
    ticks since boot, against ``/proc/uptime``; proc(5)); None where they cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        ticks = int(stat.rsplit(")", 1)[1].split()[19])   # after "pid (comm)": field 22 is index 19
        return max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class Startup:
    """The start-up stages of one rank's program, printed by rank 0 (see the module docstring).

    Args:
        stages: how many stages :meth:`done` will be called for (the bar's total; more calls
            are fine).
        enabled: None: rank 0 of a job that makes its own process group (``RANK`` unset or 0
            and torch.distributed not yet initialised); True or False forces it.
        stream: where to write (default ``sys.stdout``); a terminal gets a tqdm bar.
    """

    def __init__(self, stages: int, enabled: bool | None = None, stream: TextIO | None = None):
        if enabled is None:
            import torch.distributed as dist

            enabled = os.environ.get("RANK", "0") == "0" and not (dist.is_available() and dist.is_initialized())
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stdout
        age = process_age_s()
        self.t0 = time.monotonic() - (age or 0.0)
        self.bar = None
        if enabled and _isatty(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=stages, desc="start-up", unit="stage", file=self.stream, leave=False,
                            bar_format="{desc}: {n_fmt}/{total_fmt} stages [{elapsed}] {postfix}")

    def line(self, text: str) -> str:
        """The printed line of a stage that has just finished: the seconds since the start, then ``text``."""
        return f"start-up {time.monotonic() - self.t0:5.1f} s | {text}"

    def done(self, text: str) -> None:
        """A stage has finished: say ``text`` (one line; rank 0 only) and move the bar on."""
        if not self.enabled:
            return
        line = self.line(text)
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        """Remove the bar (a terminal); the stages' lines stay."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def group_text(ctx) -> str:
    """What :meth:`Startup.done` says once ``ctx``'s process groups are up: the ranks and the backend."""
    if not ctx.distributed:
        return "one process (no process group)"
    import torch.distributed as dist

    return f"process group up: {ctx.world_size} ranks ({dist.get_backend()})"


__all__ = ["Startup", "group_text", "process_age_s"]
