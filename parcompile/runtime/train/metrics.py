"""What a training run reports (SPEC "Real training jobs"): per logged step ``loss``, ``lr``,
``grad_norm``, ``tokens_per_s``, ``tflops_per_gpu``, ``mfu``, ``step_time``,
``predicted_step_time`` and ``peak_memory`` (the caching allocator's ``max_memory_allocated``,
with ``peak_memory_reserved`` its ``max_memory_reserved``, through ``torch.accelerator`` on
every device type that has them; on the CPU ``peak_rss``, and ``peak_memory_reserved`` is
``"not available"``); ``eval_loss`` lines. One JSON object per line in ``metrics.jsonl``
(beside the program unless ``--metrics FILE``), the same as a printed line, and
TensorBoard event files when ``tensorboard`` is installed (``tensorboard/`` beside it).

The printed step line fits an 80-column terminal on the CPU (step, loss, learning rate,
gradient norm, step time against the plan's); on accelerators it adds tokens/s, TFLOP/s per
GPU, MFU and the allocator's peaks, which mean something there (the CPU's are in
``metrics.jsonl``). :meth:`RunLog.summary` ends a run with what it did and where its outputs
went.

``tflops_per_gpu = model_flops_per_step / (step_time * world_size) / 1e12`` and
``mfu = tflops_per_gpu * 1e12 / peak_flops`` (SPEC section 3, the plan's own formulas
applied to the measured step time; ``model_flops_per_step`` counts matmuls of forward and
backward, no recomputation, Korthikanti et al. 2022).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from parcompile.runtime.machine.device import allocator_peaks  # the caching allocator's peaks, per device type


#: what a step record says for the allocator's peaks where the device has no caching
#: allocator (CPU processes under gloo)
NOT_AVAILABLE = "not available"


def peak_memory(ctx) -> dict[str, list[int]]:
    """Every rank's peak memory in bytes, gathered to all ranks (a collective: every rank
    calls it). On accelerators ``allocated`` and ``reserved`` of the caching allocator
    (:func:`allocator_peaks`); on the CPU, or a device without those counters, the
    process's peak resident set (``rss``), the nearest measure there is."""
    peaks = allocator_peaks(ctx.device)
    if peaks is not None:
        mine = [peaks["allocated"], peaks["reserved"]]
        keys = ("allocated", "reserved")
    else:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        mine = [rss * (1 if sys.platform == "darwin" else 1024)]   # Linux reports KiB
        keys = ("rss",)
    if not ctx.distributed:   # one process: nothing to gather, no tensor on the device
        return {k: [v] for k, v in zip(keys, mine)}
    t = torch.tensor(mine, dtype=torch.int64, device=ctx.device)
    parts = [torch.empty_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(parts, t)   # not counted: reporting, outside the plan's collectives
    return {k: [int(p[i]) for p in parts] for i, k in enumerate(keys)}


class RunLog:
    """Prints and records a run's metrics on the reporting rank (``enabled``); the other
    ranks only take part in the collectives of :func:`peak_memory`.

    Args:
        path: ``metrics.jsonl``; opened for appending (a resumed run continues it).
        plan: the plan.json dict (``compute.model_flops_per_step``, ``estimate.step_time``).
        peak_flops: the cluster's dense peak per GPU for the model's dtype, FLOP/s.
        tokens_per_step: global batch x seq_len.
        enabled: this rank prints and writes.
    """

    def __init__(self, path: str | os.PathLike | None, plan: dict, peak_flops: float, tokens_per_step: int,
                 enabled: bool):
        self.enabled = enabled
        self.flops = float(plan["compute"]["model_flops_per_step"])
        self.predicted = float(plan["estimate"]["step_time"])
        self.world = int(plan["world_size"])
        self.peak_flops = float(peak_flops)
        self.tokens = tokens_per_step
        self.file = None
        self.tb = None
        self.path = Path(path) if path else None
        self.started = time.perf_counter()
        self.last: dict | None = None   # the newest step record
        if enabled and path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", encoding="utf-8")
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:   # tensorboard is optional
                SummaryWriter = None
            if SummaryWriter is not None:
                self.tb = SummaryWriter(str(Path(path).parent / "tensorboard"))

    def _write(self, record: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record, sort_keys=True) + "\n")
            self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, record["step"])

    def step(self, step: int, total: int, loss: float, lr: float, grad_norm: float, step_time: float,
             memory: dict[str, list[int]]) -> dict:
        """Record step ``step`` (1-based count of steps done); returns the record."""
        tflops = self.flops / (step_time * self.world) / 1e12
        rec = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time": step_time,
               "tokens_per_s": self.tokens / step_time, "tflops_per_gpu": tflops,
               "mfu": tflops * 1e12 / self.peak_flops, "predicted_step_time": self.predicted}
        if "allocated" in memory:
            rec["peak_memory"] = memory["allocated"]
            rec["peak_memory_reserved"] = memory["reserved"]
        else:
            rec["peak_rss"] = memory["rss"]
            rec["peak_memory_reserved"] = NOT_AVAILABLE   # peak_memory (SPEC: bytes, on GPUs) left out
        self.last = rec
        if self.enabled:
            print(self.line(rec, total), flush=True)
            self._write(rec)
        return rec

    def line(self, rec: dict, total: int) -> str:
        """The printed line of step record ``rec`` of ``total`` steps: on the CPU what an
        80-column terminal holds (throughput and RSS stay in metrics.jsonl); on accelerators
        with tokens/s, TFLOP/s per GPU, MFU and the allocator's peaks."""
        line = (f"step {rec['step']:>{len(str(total))}}/{total} | loss {rec['loss']:.4f} | lr {rec['lr']:.1e} | "
                f"gnorm {rec['grad_norm']:.3g} | {rec['step_time']:.3f} s (plan {self.predicted:.3g} s)")
        if "peak_memory" in rec:
            line += (f" | {rec['tokens_per_s']:,.0f} tok/s | {rec['tflops_per_gpu']:.3g} TFLOP/s/GPU | "
                     f"MFU {100 * rec['mfu']:.1f}% | peak {max(rec['peak_memory']) / 2**30:.2f} GiB "
                     f"(reserved {max(rec['peak_memory_reserved']) / 2**30:.2f})")
        return line

    def summary(self, steps: int, outputs: dict[str, str | None]) -> str:
        """Print (on the reporting rank) and return the run's end: ``steps`` trained in this
        run, the wall time since the log was made, the tokens (``steps x tokens_per_step``)
        and their rate, the last logged loss, then where each output went: ``metrics.jsonl``,
        the TensorBoard command, and ``outputs`` (a name -> path; None or "" left out: a
        checkpoint, the Hugging Face checkpoint). The other ranks return ""."""
        if not self.enabled:
            return ""
        wall = time.perf_counter() - self.started
        tokens = steps * self.tokens
        lines = [f"done: {steps} step{'s' * (steps != 1)} in {wall:.1f} s, {tokens:,} tokens "
                 f"({tokens / max(wall, 1e-9):,.0f} tok/s)"
                 + (f", final loss {self.last['loss']:.4f}" if self.last else "")]
        where = {"metrics": str(self.path) if self.path else None,
                 "TensorBoard": f"tensorboard --logdir {self.path.parent / 'tensorboard'}" if self.tb else None,
                 **outputs}
        width = max(map(len, where))
        lines += [f"  {k:<{width}}  {v}" for k, v in where.items() if v]
        text = "\n".join(lines)
        print(text, flush=True)
        return text

    def eval(self, step: int, loss: float, tokens: int) -> None:
        """Record an evaluation after ``step`` steps: mean cross-entropy over ``tokens``
        unmasked targets."""
        if self.enabled:
            print(f"eval after step {step}: loss {loss:.4f} over {tokens:,} tokens", flush=True)
            self._write({"step": step, "eval_loss": loss, "eval_tokens": tokens})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
