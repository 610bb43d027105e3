"""Serve values the builder derives from other things than the spec's text: the stored
format of the `weights` checkpoint's quantized weights (:func:`checkpoint_quantization`) and
the GPUs a disaggregated spec's prefill pool takes from the cluster (:func:`prefill_gpus`)."""

from __future__ import annotations

import math
import os

from parcompile.core.files import MAX_JSON_BYTES, json_loads, read_text
from parcompile.core.quant import QuantConfigError, checkpoint_format
from parcompile.diagnostics import DiagnosticBag
from parcompile.frontend.check_context import CheckContext


#: what a serve key given as `auto` holds until the search fills it
SERVE_AUTO_PLACEHOLDERS = {"batch": 1, "kv_dtype": None, "weight_dtype": "model", "disaggregated": False}


def checkpoint_quantization(values: dict, auto: list[str], bag: DiagnosticBag, ctx: CheckContext) -> None:
    """The stored format of the `weights` checkpoint in ``values`` (its config.json's
    ``quantization_config``, core/quant.py): sets ``weight_format`` and
    ``quantized_checkpoint`` and, when ``weight_dtype`` is not given or ``auto`` (then no
    longer searched: ``auto`` loses it), the checkpoint's ``weight_dtype`` (vLLM reads the
    checkpoint so too); a given ``weight_dtype`` of another family is an error at the key, as
    is ``mxfp4`` or ``int4`` over a checkpoint that is not quantized (``fp8`` of one is made on
    load, one scale per tensor: ``weight_format = fp8-tensor``)."""
    path = os.path.join(values["weights"], "config.json")
    if not os.path.exists(path):
        return   # not a Hugging Face checkpoint (a training program's, or none yet): the weights' own checks say so
    try:
        config = json_loads(read_text(path, MAX_JSON_BYTES))   # a regular file only, size-limited
    except (OSError, ValueError) as e:
        why = e.msg if hasattr(e, "msg") else getattr(e, "strerror", None) or str(e)
        bag.error(f"weights `{values['weights']}`: its config.json cannot be read: {why}", ctx.span("serve.weights"),
                  help="a Hugging Face checkpoint's config.json is a JSON object (transformers' save_pretrained "
                       "writes it)")
        ctx.bad.add("serve.weights")
        return
    if not isinstance(config, dict):
        bag.error(f"weights `{values['weights']}`: its config.json is not a JSON object", ctx.span("serve.weights"),
                  help="a Hugging Face checkpoint's config.json is a JSON object (transformers' save_pretrained "
                       "writes it)")
        ctx.bad.add("serve.weights")
        return
    try:
        fmt = checkpoint_format(config)
    except QuantConfigError as e:
        bag.error(f"weights `{values['weights']}`: {e.message}", ctx.span("serve.weights"), help=e.help)
        ctx.bad.add("serve.weights")
        return
    searched = "weight_dtype" in auto
    given = None if searched else values.get("weight_dtype")
    if fmt is None:
        if given in ("mxfp4", "int4"):
            bag.error(f"weight_dtype = {given} needs a checkpoint quantized so; `{values['weights']}` has no "
                      f"quantization_config", ctx.span("serve.weight_dtype"),
                      help="give a published " + ("MXFP4 (gpt-oss) checkpoint" if given == "mxfp4" else
                                                  "AWQ or GPTQ (4-bit, group 128) checkpoint")
                           + ", or remove weight_dtype (the checkpoint's own dtype)",
                      note="fp8 can be made on load from a 16-bit checkpoint (per tensor, as vLLM's "
                           "--quantization fp8_per_tensor); 4-bit formats need calibration")
            ctx.bad.add("serve.weight_dtype")
        elif given == "fp8":
            values["weight_format"] = "fp8-tensor"   # quantized on load, one scale per tensor
        return
    if searched:   # the checkpoint's format is the only one it serves
        auto.remove("weight_dtype")
        ctx.bad.discard("serve.weight_dtype")
    if given is None:
        values["weight_dtype"] = fmt.family
    elif given != fmt.family:
        bag.error(f"weight_dtype = {given}, but the checkpoint `{values['weights']}` holds {fmt.description}",
                  ctx.span("serve.weight_dtype"),
                  help=f"set weight_dtype = {fmt.family} (or remove it: the checkpoint's format)")
        ctx.bad.add("serve.weight_dtype")
        return
    values["weight_format"] = fmt.name
    values["quantized_checkpoint"] = True


def serve_defaults(values: dict, model_dtype: str, preset: str | None) -> None:
    """The serve defaults that depend on other keys, set in ``values`` (the block's values):
    ``kv_dtype`` the model's, ``batch`` the ``concurrency`` given (every client's request runs),
    ``engine`` parcompile on the ``cpu`` preset and vLLM elsewhere, ``request_rate = inf`` as
    a float."""
    if values.get("kv_dtype") is None:
        values["kv_dtype"] = model_dtype
    if "batch" not in values and isinstance(values.get("concurrency"), int):
        values["batch"] = values["concurrency"]
    values.setdefault("engine", "parcompile" if preset == "cpu" else "vllm")
    if values.get("request_rate") == "inf":
        values["request_rate"] = math.inf


def prefill_gpus(serve: dict, parallel: dict) -> int:
    """GPUs a disaggregated serve spec's prefill pool takes from the cluster
    (``prefill_replicas * prefill_tp``; ``serve`` and ``parallel``: the blocks' values as
    written, the layout being the decode pool's), else 0."""
    if serve.get("disaggregated") is not True:
        return 0
    tp = serve.get("prefill_tp") or parallel.get("tp", 1)
    return (serve.get("prefill_replicas") or 1) * (tp if isinstance(tp, int) else 1)


__all__ = ["SERVE_AUTO_PLACEHOLDERS", "checkpoint_quantization", "prefill_gpus", "serve_defaults"]
