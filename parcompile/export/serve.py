"""``parcompile export --to vllm`` / ``--to sglang`` (serve specs): a ``vllm serve`` or
``python -m sglang.launch_server`` command with the plan's parallel sizes, context,
concurrent sequences, KV cache dtype and memory fraction (:func:`serve_memory_fraction`)."""

from __future__ import annotations

import shlex

from parcompile.export.common import SERVE_TARGETS, Export, degrees, layout_line
from parcompile.plan import Plan


#: the plan's KV-cache dtype -> the servers' --kv-cache-dtype when it differs from the model's
#: ("auto": the model's dtype); both take fp8_e4m3 and fp8_e5m2 (vLLM: CacheDType in
#: vllm/config/cache.py; SGLang: --kv-cache-dtype in sglang/srt/server_args.py)
KV_CACHE_DTYPE = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
#: the model dtype -> the servers' --dtype
SERVE_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def serve_memory_fraction(plan: Plan, with_workspace: bool) -> float:
    """The fraction of one GPU's memory the plan's memory model gives the server: weights,
    KV cache and (``with_workspace``) the activation workspace per rank over the GPU's memory
    (``plan.json`` ``serve``), rounded up to 0.01. vLLM's ``--gpu-memory-utilization`` bounds
    everything vLLM allocates (weights, activations at its profiling run, KV cache); SGLang's
    ``--mem-fraction-static`` bounds weights and the KV pool (its activations come on top)."""
    s = plan.data["serve"]
    used = s["weights_bytes_per_rank"] + s["kv_cache_bytes_per_rank"]
    if with_workspace:
        used += s["workspace_bytes_per_rank"]
    return min(1.0, -(-100 * used // plan.config.cluster.memory) / 100)



def serve_fraction_sequences(plan: Plan, with_workspace: bool) -> int:
    """Sequences of ``prompt_len + max_new_tokens`` tokens whose KV cache fits in the memory
    fraction ``serve_memory_fraction`` gives (the same ``with_workspace``): that fraction of
    the GPU's memory less the weights (and the workspace) per rank, over one sequence's KV
    cache per rank (``kv_cache_bytes_per_rank / batch_per_replica``)."""
    s = plan.data["serve"]
    left = serve_memory_fraction(plan, with_workspace) * plan.config.cluster.memory - s["weights_bytes_per_rank"]
    if with_workspace:
        left -= s["workspace_bytes_per_rank"]
    per_sequence = s["kv_cache_bytes_per_rank"] / s["batch_per_replica"]
    return int(left // per_sequence) if per_sequence else 0

def serve_args(plan: Plan, target: str) -> tuple[list[tuple[str, str | None]], list[str], list[str]]:
    """The server arguments for a serve ``plan`` (``target`` ``vllm`` or ``sglang``) as
    ``(flag, value or None)`` pairs, the notes and the errors."""
    cfg = plan.config
    m, sv = cfg.model, cfg.serve
    deg = degrees(plan)
    s = plan.data["serve"]
    notes, errors = [], []
    kv = "auto" if sv.kv_dtype == m.dtype else KV_CACHE_DTYPE.get(sv.kv_dtype)
    if kv is None:
        errors.append(f"kv_dtype {sv.kv_dtype}: {SERVE_TARGETS[target]} keeps the KV cache in the model's dtype "
                      f"({m.dtype}) or fp8; not {sv.kv_dtype}")
        kv = "auto"
    max_len = sv.prompt_len + sv.max_new_tokens
    if deg["cp"] > 1:
        errors.append(f"cp {deg['cp']}: {SERVE_TARGETS[target]} has no context parallelism for decoding")
    if deg["ep"] > 1 and deg["ep"] != deg["tp"] * deg["dp"]:
        errors.append(f"ep {deg['ep']}: expert parallelism spans tp x dp ({deg['tp'] * deg['dp']}) ranks in "
                      f"{SERVE_TARGETS[target]}")
    a: list[tuple[str, str | None]] = []
    if target == "vllm":
        a += [("--tensor-parallel-size", str(deg["tp"])), ("--pipeline-parallel-size", str(deg["pp"]))]
        if deg["dp"] > 1:
            a.append(("--data-parallel-size", str(deg["dp"])))
        if deg["ep"] > 1:
            a.append(("--enable-expert-parallel", None))
        a += [("--max-model-len", str(max_len)), ("--max-num-seqs", str(s["batch_per_replica"])),
              ("--kv-cache-dtype", kv), ("--gpu-memory-utilization", f"{serve_memory_fraction(plan, True):.2f}"),
              ("--dtype", SERVE_DTYPE[m.dtype]), ("--seed", str(sv.seed))]
    else:
        a += [("--tp-size", str(deg["tp"])), ("--pp-size", str(deg["pp"]))]
        if deg["dp"] > 1:
            a.append(("--dp-size", str(deg["dp"])))
        if deg["ep"] > 1:
            a.append(("--ep-size", str(deg["ep"])))
        a += [("--context-length", str(max_len)), ("--max-running-requests", str(s["batch_per_replica"])),
              ("--kv-cache-dtype", kv), ("--mem-fraction-static", f"{serve_memory_fraction(plan, False):.2f}"),
              ("--dtype", SERVE_DTYPE[m.dtype]), ("--random-seed", str(sv.seed))]
    if s.get("max_concurrent_sequences", 0) > s["batch_per_replica"]:
        flag, fraction = a[[k for k, _ in a].index(
            "--gpu-memory-utilization" if target == "vllm" else "--mem-fraction-static")]
        notes.append(f"{flag} {fraction} sizes the KV cache for about {serve_fraction_sequences(plan, target == 'vllm')} "
                     f"sequences of {max_len} tokens (the plan's {s['batch_per_replica']} per replica, the fraction "
                     f"rounded up); the GPU's free memory would hold {s['max_concurrent_sequences']}: raise {flag} "
                     "to serve more at once")
    if cfg.cluster.nodes > 1:
        notes.append("multi-node: see the server's multi-node launch (Ray for vLLM, --nnodes/--node-rank for SGLang)")
    return a, notes, errors


def serve_export(plan: Plan, target: str) -> Export:
    """``--to vllm`` / ``--to sglang``: the server command with :func:`serve_args`; notes and
    errors as comments."""
    cfg = plan.config
    args, notes, errors = serve_args(plan, target)
    weights = cfg.serve.weights or "MODEL"
    if not cfg.serve.weights:
        notes.append("weights: the spec names no checkpoint; put the model's Hugging Face directory for MODEL")
    head = (["vllm", "serve", weights] if target == "vllm" else
            ["python", "-m", "sglang.launch_server", "--model-path", weights])
    launch = " ".join(shlex.quote(w) for w in head)
    lines = [f"# {SERVE_TARGETS[target]} server for `{cfg.name}`: {layout_line(plan)} (exported by parcompile)"]
    lines += [f"# error: {e}" for e in errors] + [f"# note: {n}" for n in notes]
    lines.append(launch + " \\")
    body = [f"    {flag}" + ("" if v is None else f" {shlex.quote(v)}") for flag, v in args]
    lines += [b + " \\" for b in body[:-1]] + [body[-1]]
    return Export(target, "\n".join(lines) + "\n", notes, launch, f"{cfg.name}_{target}.sh", errors)
