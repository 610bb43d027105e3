"""``parcompile export --to vllm`` / ``--to sglang`` (serve specs): a ``vllm serve`` or
``python -m sglang.launch_server`` command with the plan's parallel sizes, context,
concurrent sequences, KV cache dtype and memory fraction (:func:`serve_memory_fraction`)."""

from __future__ import annotations

import shlex

from parcompile.core.quant import DEFAULT_FORMAT
from parcompile.exporters.common import SERVE_TARGETS, Export, comments, degrees, layout_line
from parcompile.exporters.model_keys import checkpoint_key_errors, model_key_errors
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
    ``(flag, value or None)`` pairs, the notes and the errors: first the model keys the server
    would read otherwise from the checkpoint's config.json
    (:func:`parcompile.exporters.model_keys.checkpoint_key_errors`)."""
    cfg = plan.config
    m, sv = cfg.model, cfg.serve
    deg = degrees(plan)
    s = plan.data["serve"]
    notes: list[str] = []
    errors = model_key_errors(plan, target) + checkpoint_key_errors(plan, target)
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
    a += _budget_and_quantization(plan, target, notes, errors)
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


#: ``serve.weight_dtype = fp8`` over a 16-bit (or no) checkpoint, quantized as the server loads
#: it: the plan's format (``serve.weight_format``, else fp8-block) -> ``--quantization``. vLLM
#: 0.33.0's online schemes (vllm/config/quantization.py _ONLINE_SHORTHANDS,
#: docs/features/quantization/online.md: fp8_per_block 128 x 128 weight blocks, as the plan's
#: fp8-block; its plain ``fp8`` is deprecated for this and is fp8_per_tensor:
#: vllm/model_executor/model_loader/weight_utils.py get_quant_config); SGLang 0.5.23's ``fp8``
#: (sglang/srt/layers/quantization/fp8.py Fp8LinearMethod.process_weights_after_loading: one
#: scale per output channel where its CUTLASS FP8 GEMM runs, Hopper, else per tensor). The 4-bit
#: formats need a checkpoint quantized so, which both servers read from its ``quantization_config``
ONLINE_QUANTIZATION = {
    "vllm": {"fp8-block": "fp8_per_block", "fp8-tensor": "fp8_per_tensor", "fp8-channel": "fp8_per_channel"},
    "sglang": {"fp8-block": "fp8", "fp8-tensor": "fp8", "fp8-channel": "fp8"},
}
ONLINE_SCALES = {"vllm": {"fp8-block": "one fp32 scale per 128 x 128 block", "fp8-tensor": "one scale per tensor",
                          "fp8-channel": "one scale per output channel"},
                 "sglang": dict.fromkeys(("fp8-block", "fp8-tensor", "fp8-channel"),
                                         "one scale per output channel (per tensor without CUTLASS FP8)")}
#: SGLang's --max-prefill-tokens default: it bounds a prefill batch's prompt tokens beside
#: --chunked-prefill-size (sglang/srt/arg_groups/fields/schedule.py; PrefillAdder.rem_input_tokens
#: in sglang/srt/managers/schedule_policy.py)
SGLANG_MAX_PREFILL_TOKENS = 16384


def _budget_and_quantization(plan: Plan, target: str, notes: list[str], errors: list[str]) -> list[tuple[str, str | None]]:
    """The chunked-prefill budget (``serve.max_prefill_tokens``: vLLM's
    ``--max-num-batched-tokens``, SGLang's ``--chunked-prefill-size``; without it the server's
    default, which the plan assumes) and the weights' quantization: a checkpoint quantized so
    is read as it is (its ``quantization_config``); fp8 over a 16-bit or no checkpoint is
    ``--quantization`` (:data:`ONLINE_QUANTIZATION`); mxfp4 / int4 need a checkpoint quantized so (a note: the front
    end refuses a 16-bit ``weights`` checkpoint for them)."""
    sv = plan.config.serve
    a: list[tuple[str, str | None]] = []
    if sv.max_prefill_tokens:
        a.append(("--max-num-batched-tokens" if target == "vllm" else "--chunked-prefill-size",
                  str(sv.max_prefill_tokens)))
        seqs = plan.data["serve"]["batch_per_replica"]
        if target == "vllm" and sv.max_prefill_tokens < seqs:
            # vllm/config/scheduler.py SchedulerConfig.verify_max_model_len refuses it
            errors.append(f"max_prefill_tokens {sv.max_prefill_tokens}: vLLM's --max-num-batched-tokens must be at "
                          f"least --max-num-seqs ({seqs}): every decoding sequence's token counts in the budget")
        if target == "sglang" and sv.max_prefill_tokens > SGLANG_MAX_PREFILL_TOKENS:
            a.append(("--max-prefill-tokens", str(sv.max_prefill_tokens)))
    if sv.weight_dtype == "model":
        return a
    if sv.quantized_checkpoint:
        notes.append(f"weights: the checkpoint's own {sv.weight_format} (its quantization_config; the server reads it)")
    elif sv.weight_dtype == "fp8":
        fmt = sv.weight_format or DEFAULT_FORMAT["fp8"]
        a.append(("--quantization", ONLINE_QUANTIZATION[target][fmt]))
        notes.append(f"weights: quantized to FP8 as {SERVE_TARGETS[target]} loads them, {ONLINE_SCALES[target][fmt]} "
                     f"(the plan prices {fmt}: the same bytes within 0.1%); an FP8 checkpoint serves as published "
                     "without the flag")
    else:   # the servers read these from the checkpoint's quantization_config
        what = "a 4-bit AWQ or GPTQ checkpoint (group 128)" if sv.weight_dtype == "int4" else "an MXFP4 checkpoint"
        notes.append(f"weights: weight_dtype {sv.weight_dtype}: the model directory must be {what} of the model; "
                     "the server reads its quantization_config")
    return a


def serve_export(plan: Plan, target: str) -> Export:
    """``--to vllm`` / ``--to sglang``: the server command with :func:`serve_args`; notes and
    errors as comments."""
    cfg = plan.config
    args, notes, errors = serve_args(plan, target)
    if cfg.serve.disaggregated:
        return _disaggregated(plan, target, args, notes, errors)
    weights = cfg.serve.weights or "MODEL"
    if not cfg.serve.weights:
        notes.append("weights: the spec names no checkpoint; put the model's Hugging Face directory for MODEL")
    head = (["vllm", "serve", weights] if target == "vllm" else
            ["python", "-m", "sglang.launch_server", "--model-path", weights])
    launch = " ".join(shlex.quote(w) for w in head)
    lines = [f"# {SERVE_TARGETS[target]} server for `{cfg.name}`: {layout_line(plan)} (exported by parcompile)"]
    lines += comments("error", errors) + comments("note", notes)
    lines.append(launch + " \\")
    body = [f"    {flag}" + ("" if v is None else f" {shlex.quote(v)}") for flag, v in args]
    lines += [b + " \\" for b in body[:-1]] + [body[-1]]
    return Export(target, "\n".join(lines) + "\n", notes, launch, f"{cfg.name}_{target}.sh", errors)


#: the flags that say an instance's role in a disaggregated deployment and how its KV cache
#: moves: vLLM 0.33.0's NIXL connector (``--kv-transfer-config``, KVTransferConfig in
#: vllm/config/kv_transfer.py; docs/features/nixl_connector_usage.md: ``kv_producer`` for the
#: prefill instance, ``kv_consumer`` for the decode one; ``kv_both`` is deprecated with
#: NixlConnector, vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py), SGLang
#: 0.5.23's ``--disaggregation-mode prefill|decode`` (sglang/srt/server_args.py,
#: docs/advanced_features/pd_disaggregation.md; its KV transfer backend by default Mooncake)
NIXL = {role: '{"kv_connector":"NixlConnector","kv_role":"%s"}' % kv
        for role, kv in (("prefill", "kv_producer"), ("decode", "kv_consumer"))}
#: the ports the two instances listen on (each server's ``--port``)
PREFILL_PORT, DECODE_PORT = 8100, 8200


def _disaggregated(plan: Plan, target: str, decode: list, notes: list[str], errors: list[str]) -> Export:
    """A disaggregated serve plan as two server commands, the prefill pool's instance (tp
    ``prefill_tp``, dp ``prefill_replicas``) and the decode pool's (the plan's layout), each
    with its role flags and port; a note names the router that sends each request to both."""
    cfg = plan.config
    sv = cfg.serve
    p = plan.data["serve"]["prefill_pool"]
    names = {"vllm": ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size"),
             "sglang": ("--tp-size", "--pp-size", "--dp-size")}[target]
    # the prefill instance's memory is its own (weights over its tp, a budget's prompts): the server's default
    prefill = [(f, v) for f, v in decode if f not in names + ("--gpu-memory-utilization", "--mem-fraction-static")]
    prefill = [(names[0], str(p["tp"])), (names[1], "1")] + ([(names[2], str(p["replicas"]))] if p["replicas"] > 1
                                                             else []) + prefill
    if target == "vllm":
        role = {name: [("--kv-transfer-config", NIXL[name])] for name in NIXL}
        notes.append("route each request to both with vLLM's disaggregated proxy (examples/disaggregated/"
                     f"disaggregated_serving) or NVIDIA Dynamo: prefill on port {PREFILL_PORT}, decode on {DECODE_PORT}")
    else:
        role = {"prefill": [("--disaggregation-mode", "prefill")], "decode": [("--disaggregation-mode", "decode")]}
        notes.append(f"route each request to both: python -m sglang_router.launch_router --pd-disaggregation "
                     f"--prefill http://HOST:{PREFILL_PORT} --decode http://HOST:{DECODE_PORT}")
    weights = sv.weights or "MODEL"
    if not sv.weights:
        notes.append("weights: the spec names no checkpoint; put the model's Hugging Face directory for MODEL")
    head = (["vllm", "serve", weights] if target == "vllm" else
            ["python", "-m", "sglang.launch_server", "--model-path", weights])
    launch = " ".join(shlex.quote(w) for w in head)
    lines = [f"# {SERVE_TARGETS[target]} disaggregated servers for `{cfg.name}`: prefill {p['replicas']} x tp "
             f"{p['tp']}, decode {layout_line(plan)} (exported by parcompile)"]
    lines += comments("error", errors) + comments("note", notes)
    for name, args, port in (("prefill", prefill, PREFILL_PORT), ("decode", decode, DECODE_PORT)):
        body = [f"    {flag}" + ("" if v is None else f" {shlex.quote(v)}")
                for flag, v in args + role[name] + [("--port", str(port))]]
        lines += [f"# the {name} pool", launch + " \\"] + [b + " \\" for b in body[:-1]] + [body[-1] + " &"]
    lines.append("wait")
    return Export(target, "\n".join(lines) + "\n", notes, launch, f"{cfg.name}_{target}.sh", errors)
