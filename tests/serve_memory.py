"""Measuring the activation bytes of one prefill of a generated serve program on CPU
(tests/test_serve_memory.py): the peak, over the step, of the bytes the allocator holds
beyond what it held when the step began (weights and the KV cache are allocated before),
from ``torch.profiler``'s memory events (``profile_memory=True``: every allocation and
free on the CPU allocator, in order).

A tp > 1 plan is measured in one process with the shapes of its tp rank 0: the program's
layers are built with a tp axis of that size and no process group, so every weight and
activation has rank 0's local shape and the collectives are skipped (the values are not
the model's, the bytes are)."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from parcompile.core.axes import GROUP_AXES
from parcompile.runtime.serve import generate as gen
from parcompile.runtime.distributed.context import Axis, ParallelContext

_counter = itertools.count()


#: the GEMM ops whose own scratch (a 16-bit GEMM's packing or fp32 conversion buffers, freed
#: before the op returns) the plan leaves out (analysis/serve_memory.py): inside one, only the
#: net of its memory events (its output) counts
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})


def peak_live_bytes(events) -> int:
    """The largest running sum of the profiler's ``[memory]`` events (bytes allocated > 0,
    freed < 0), in time order: the peak bytes allocated inside the profiled block beyond
    its start. The events inside a GEMM op (:data:`GEMM_OPS`) count as one, their net (the
    op's output), at the op's start: a CPU without native bf16 GEMMs (AMD EPYC here) converts
    a bf16 GEMM's operands to fp32 in buffers it frees before returning, which the plan's
    workspace leaves out ("the CPU's 16-bit GEMM's internal buffers")."""
    events = list(events)
    spans = sorted((e.start_ns(), e.end_ns()) for e in events if e.name() in GEMM_OPS)
    mem = []
    net: dict[tuple[int, int], int] = {}
    for t, nb in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        span = _inside(spans, t)
        if span is None:
            mem.append((t, nb))
        else:
            net[span] = net.get(span, 0) + nb
    mem = sorted(mem + [(span[0], nb) for span, nb in net.items()])
    live = peak = 0
    for _, nb in mem:
        live += nb
        peak = max(peak, live)
    return peak


def _inside(spans: list[tuple[int, int]], t: int) -> tuple[int, int] | None:
    """The (outermost) span of ``spans`` (sorted by start) holding time ``t``, or None."""
    for lo, hi in spans:
        if lo > t:
            return None
        if lo <= t <= hi:
            return lo, hi
    return None


def measure_prefill(out: Path, batch: int, prompt_len: int, seed: int = 0) -> int:
    """Peak activation bytes of one prefill of ``batch`` random prompts of ``prompt_len``
    tokens through ``out/serve.py`` (its plan.json beside it; one pipeline stage), at tp
    rank 0's shapes: the layers, the final norm, the LM head and the tokens sampled with a
    temperature and top-p (the sampler's largest path)."""
    spec = importlib.util.spec_from_file_location(f"parcompile_serve_mem_{next(_counter)}", out / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    plan = json.loads((out / "plan.json").read_text())
    if plan["degrees"].get("pp", 1) != 1:
        raise ValueError("measure_prefill runs one pipeline stage")
    tp = plan["degrees"].get("tp", 1)
    axes = {name: Axis(name, list(range(tp)) if name == "tp" else [0], 0, None) for name in GROUP_AXES}
    ctx = ParallelContext(0, 1, axes, torch.device("cpu"), None, distributed=False)
    torch.manual_seed(seed)
    model = mod.Stage(plan, ctx)
    for p in model.parameters():
        p.data = p.data.to(mod.DTYPE)
    model.eval()
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, mod.VOCAB, (batch, prompt_len), generator=g).tolist()
    window = mod.ATTN_CORE_WINDOW if hasattr(mod, "ATTN_CORE_WINDOW") else mod.WINDOW   # per layer where they differ
    req = gen.Requests(prompts, 1, window, ctx.device)
    model.new_cache(req.batch, req.max_len, ctx.device)
    ids = req.ids[:, :prompt_len]
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step = req.step(0, prompt_len)                  # the step's masks
        logits = model.forward(ids, step)
        full = gen.gather_vocab(logits, ctx.tp)
        # nucleus sampling: the sampler's largest working set (analysis/serve_memory.py SAMPLER_BYTES)
        gen.pick_tokens(full, mod.VOCAB, 0.7, 0, torch.Generator().manual_seed(seed), 0.9)
        del logits, full, step
    return peak_live_bytes(prof.profiler.kineto_results.events())
