"""Where our parameters live in a Hugging Face checkpoint, standard library only: the
compiler's checks (:mod:`parcompile.frontend.checks`) and the
runtime's loader and exporter (:mod:`parcompile.runtime.state.weights`,
:mod:`parcompile.runtime.state.hf_export`) read the same tables.

A model is written as one Hugging Face ``model_type`` (:func:`hf_family`), whose module in
:mod:`parcompile.core.families` holds what is particular to it (its tensor names, its
config.json fields, what it cannot express); this module holds what every family shares.

:func:`tensor_map` gives, for every global parameter name of ours
(``layers.3.attn.wq.weight``), the :class:`Source` s it can be read from: an HF tensor
name, that tensor's shape, and how our tensor's rows sit in it (fused tensors: offsets
and strides; Conv1D: transposed), so that each rank reads its shard as a few slices of
the HF tensor (``safetensors``' ``get_slice``) and an exporter can assemble the HF
tensors from our global ones. :func:`hf_config` is the ``config.json`` transformers
loads into the same function. :func:`check_checkpoint` validates a checkpoint directory
by reading only the safetensors headers (8-byte little-endian length + JSON).

Shapes here are global and, for the vocabulary (``embedding.weight``, ``lm_head.weight``),
unpadded: ``(vocab, hidden)``; the padded rows of a plan are zeros that HF files never hold.

A model is anything with the attributes of :class:`parcompile.core.model.ModelKeys`: a
ModelKeys (the runtime) or the compiler's :class:`parcompile.config.schema.ModelConfig`.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import replace
from pathlib import Path

from parcompile.core import families
from parcompile.core.dtypes import TORCH_NAMES
from parcompile.core.families.base import (HFWeightsError, Problem, Source, foreign_problems, router)
from parcompile.core.files import json_loads
from parcompile.core.hf import SUPPORTED_MODEL_TYPES, HFConfigError, from_hf_dict
from parcompile.core.model import GATED_ACTIVATIONS, ModelKeys, moe_layer, rotary_dim
from parcompile.core.quant import QuantConfigError, QuantFormat, checkpoint_format, stored_quantized, stored_tensors

#: every model_type parcompile writes (:data:`parcompile.core.families.MODEL_TYPES`)
FAMILIES = families.MODEL_TYPES
#: model_type -> transformers' architecture class
ARCHITECTURES = families.ARCHITECTURES

#: our dtype names -> the config.json / safetensors names
HF_DTYPES = TORCH_NAMES  # config.json's torch_dtype is torch's name
#: bytes per element of the safetensors dtypes
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
                     "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}

#: every dtype name a safetensors header may hold (safetensors' ``Dtype``; sub-byte ones have no width above)
SAFETENSORS_DTYPES = frozenset(SAFETENSORS_BYTES) | {"F4", "F6_E2M3", "F6_E3M2", "F8_E8M0", "F8_E4M3FNUZ",
                                                     "F8_E5M2FNUZ", "U16", "U32", "U64", "C64"}

#: parameters whose rows are the (padded) vocabulary
VOCAB_PARAMS = ("embedding.weight", "lm_head.weight")

TRANSFORMERS_VERSION = "5.24.0"   # the version the written files were checked against

#: persistent buffers a checkpoint holds beside the parameters, by the last part of our
#: name: not parameters (no gradient; transformers' ``parameters()`` and every parameter
#: count leave them out), listed by :func:`expected_shapes` only with ``buffers=True``.
#: DeepSeek's router bias for choosing experts, (experts,) fp32 in HF files
BUFFERS = ("e_score_correction_bias",)


def is_buffer(name: str) -> bool:
    """Whether our global tensor ``name`` is a buffer (:data:`BUFFERS`), not a parameter."""
    return name.rpartition(".")[2] in BUFFERS


# --------------------------------------------------------------------------- families


def rope_dim(m: ModelKeys) -> int:
    """Rotary dims per head, as the generated program computes them (:func:`parcompile.core.model.rotary_dim`)."""
    return rotary_dim(m)


def family_problems(m: ModelKeys, family: str) -> list[Problem]:
    """Why ``family`` cannot express ``m`` (empty: it can): the keys of other families
    ``m`` has (:func:`parcompile.core.families.base.foreign_problems`), then the family's
    own requirements."""
    fam = families.get(family)
    if fam is None:
        return [Problem(f"unknown Hugging Face family `{family}`", "families: " + ", ".join(FAMILIES))]
    out = foreign_problems(m, fam, families.FEATURES) + fam.problems(m)
    if not out:
        return []
    return [Problem(f"the model cannot be written as a Hugging Face `{family}` checkpoint: " + "; ".join(out),
                    families.FAMILIES_HELP)]


def hf_family(model: ModelKeys) -> str:
    """The Hugging Face ``model_type`` to write ``model`` as (:func:`parcompile.core.families.for_model`).

    Raises:
        HFWeightsError: no family expresses the model (e.g. RMSNorm with GELU, shared
            experts, LayerNorm without biases); the message lists what does not fit.
    """
    family = families.for_model(model).model_type
    problems = family_problems(model, family)
    if problems:
        raise HFWeightsError(problems[0].message, problems[0].help)
    return family


# --------------------------------------------------------------------------- tensor layout


def expected_shapes(model: ModelKeys, tp: int | None = None, buffers: bool = False) -> dict[str, tuple[int, ...]]:
    """Our global parameter names -> global shapes, in layer order, as a training program
    of ``model`` holds them: the vocabulary unpadded (``tp = None``) or padded for ``tp``
    (``model.padded_vocab(tp)`` rows). A tied model has no ``lm_head.weight``.

    ``buffers``: also the persistent buffers a checkpoint holds (:data:`BUFFERS`: the
    DeepSeek router's ``layers.{i}.mlp.router.e_score_correction_bias`` (experts,) with
    ``topk_method = "noaux_tc"``). Without it the shapes are the parameters alone, whose
    elements add up to transformers' ``sum(p.numel() for p in model.parameters())``.

    Multi-head latent attention (``kv_lora_rank > 0``; H heads, ``nope``, ``rope``, ``v``
    the qk_nope, qk_rope and v head dims): ``attn.wq_a`` (q_lora_rank, hidden),
    ``attn.q_a_norm`` (q_lora_rank,), ``attn.wq_b`` (H (nope + rope), q_lora_rank), or
    ``attn.wq`` (H (nope + rope), hidden) when ``q_lora_rank`` is 0; ``attn.wkv_a``
    (kv_lora_rank + rope, hidden), ``attn.kv_a_norm`` (kv_lora_rank,), ``attn.wkv_b``
    (H (nope + v), kv_lora_rank), ``attn.wo`` (hidden, H v)."""
    m = model
    h, v = m.hidden, m.vocab if tp is None else m.padded_vocab(tp)
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    out: dict[str, tuple[int, ...]] = {"embedding.weight": (v, h)}
    if m.position == "learned":
        out["pos_embedding.weight"] = (m.max_positions, h)
    for i in range(m.layers):
        p = f"layers.{i}"
        _add_norm(out, m, f"{p}.attn_norm")
        if m.kv_lora_rank:
            _add_mla(out, m, p)
        else:
            _add_linear(out, f"{p}.attn.wq", q, h, m.qkv_bias)
            _add_linear(out, f"{p}.attn.wk", kv, h, m.qkv_bias)
            _add_linear(out, f"{p}.attn.wv", kv, h, m.qkv_bias)
            if m.qk_norm:
                out[f"{p}.attn.q_norm.weight"] = (m.head_dim,)
                out[f"{p}.attn.k_norm.weight"] = (m.head_dim,)
            out[f"{p}.attn.wo.weight"] = (h, q)
            if m.bias:
                out[f"{p}.attn.wo.bias"] = (h,)
        if m.attention_sinks:
            out[f"{p}.attn.sinks"] = (m.heads,)
        if m.sandwich_norm:
            _add_norm(out, m, f"{p}.attn_post_norm")
        _add_norm(out, m, f"{p}.mlp_norm")
        if moe_layer(m, i):
            _add_moe(out, m, p, buffers)
        else:
            _add_mlp(out, m, f"{p}.mlp", m.ffn_hidden)
        if m.sandwich_norm:
            _add_norm(out, m, f"{p}.mlp_post_norm")
    _add_norm(out, m, "final_norm")
    if not m.tie_embeddings:
        out["lm_head.weight"] = (v, h)
    return out


def _add_norm(out: dict, m: ModelKeys, name: str) -> None:
    """A norm's weight (and a LayerNorm's bias), (hidden,) each, into ``out``."""
    out[f"{name}.weight"] = (m.hidden,)
    if m.norm == "layernorm":
        out[f"{name}.bias"] = (m.hidden,)


def _add_linear(out: dict, name: str, o: int, i: int, bias: bool) -> None:
    """A linear layer's weight (o, i) and, with ``bias``, its bias (o,) into ``out``."""
    out[f"{name}.weight"] = (o, i)
    if bias:
        out[f"{name}.bias"] = (o,)


def _add_mlp(out: dict, m: ModelKeys, prefix: str, f: int) -> None:
    """A dense MLP of inner width ``f``: w1 (and w3 when gated) (f, hidden), w2 (hidden, f)."""
    h = m.hidden
    _add_linear(out, f"{prefix}.w1", f, h, m.bias)
    if m.activation in GATED_ACTIVATIONS:
        _add_linear(out, f"{prefix}.w3", f, h, m.bias)
    out[f"{prefix}.w2.weight"] = (h, f)
    if m.bias:
        out[f"{prefix}.w2.bias"] = (h,)


def _add_mla(out: dict, m: ModelKeys, p: str) -> None:
    """Layer ``p``'s multi-head latent attention (:func:`expected_shapes`' docstring); biases
    as ir/lower.py's mla(): qkv_bias on the down projections."""
    h = m.hidden
    heads, nope, rd, vd = m.heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    if m.q_lora_rank:
        _add_linear(out, f"{p}.attn.wq_a", m.q_lora_rank, h, m.qkv_bias)
        out[f"{p}.attn.q_a_norm.weight"] = (m.q_lora_rank,)
        _add_linear(out, f"{p}.attn.wq_b", heads * (nope + rd), m.q_lora_rank, False)
    else:
        _add_linear(out, f"{p}.attn.wq", heads * (nope + rd), h, False)
    _add_linear(out, f"{p}.attn.wkv_a", m.kv_lora_rank + rd, h, m.qkv_bias)
    out[f"{p}.attn.kv_a_norm.weight"] = (m.kv_lora_rank,)
    _add_linear(out, f"{p}.attn.wkv_b", heads * (nope + vd), m.kv_lora_rank, False)
    _add_linear(out, f"{p}.attn.wo", h, heads * vd, m.bias)


def _add_moe(out: dict, m: ModelKeys, p: str, buffers: bool) -> None:
    """Layer ``p``'s mixture of experts: the router (experts, hidden) with its bias and, with
    ``buffers``, DeepSeek's score correction bias; each expert's MLP of width
    ``expert_ffn_hidden``; the shared experts as one dense MLP ``shared_experts`` times as wide."""
    h, f = m.hidden, m.expert_ffn_hidden
    out[f"{p}.mlp.router.weight"] = (m.experts, h)
    if m.router_bias:
        out[f"{p}.mlp.router.bias"] = (m.experts,)
    if buffers and router(m, "topk_method") == "noaux_tc":
        out[f"{p}.mlp.router.e_score_correction_bias"] = (m.experts,)
    for e in range(m.experts):
        out[f"{p}.mlp.experts.{e}.w1.weight"] = (f, h)
        if m.activation in GATED_ACTIVATIONS:
            out[f"{p}.mlp.experts.{e}.w3.weight"] = (f, h)
        out[f"{p}.mlp.experts.{e}.w2.weight"] = (h, f)
        if m.bias:
            out[f"{p}.mlp.experts.{e}.w1.bias"] = (f,)
            if m.activation in GATED_ACTIVATIONS:
                out[f"{p}.mlp.experts.{e}.w3.bias"] = (f,)
            out[f"{p}.mlp.experts.{e}.w2.bias"] = (h,)
    if m.shared_experts:
        _add_mlp(out, m, f"{p}.mlp.shared", m.shared_experts * f)


def tensor_map(model: ModelKeys, family: str, tied: bool | None = None) -> dict[str, list[Source]]:
    """Our global parameter name -> the :class:`Source` s it can be read from, preferred
    first (the first is what :mod:`parcompile.runtime.state.hf_export` writes). Covers every
    name of :func:`expected_shapes` with its buffers (``buffers=True``) and always
    ``lm_head.weight``. The embedding tensor is the head's last source only when the
    checkpoint ties them (``tied``, default ``model.tie_embeddings``: a checkpoint of
    ``tie_word_embeddings: true`` holds no head tensor); an untied checkpoint without its
    head tensor lacks ``lm_head.weight`` (transformers would draw it at random).

    Raises:
        HFWeightsError: ``family`` is not one of :data:`FAMILIES`.
    """
    fam = families.get(family)
    if fam is None:
        raise HFWeightsError(f"unsupported Hugging Face model_type `{family}`",
                             "supported: " + ", ".join(FAMILIES))
    shapes = expected_shapes(model, buffers=True)
    v, h = model.vocab, model.hidden
    shapes.setdefault("lm_head.weight", (v, h))
    out: dict[str, list[Source]] = {}
    for name, shape in shapes.items():
        if name == "lm_head.weight":
            tie = bool(model.tie_embeddings) if tied is None else tied
            srcs = [Source(n, shape) for n in fam.head] + (out["embedding.weight"] if tie else [])
        else:
            srcs = fam.sources(model, name, shape)
        if srcs:
            out[name] = [replace(s, ours=tuple(shape)) for s in srcs]
    return out


# --------------------------------------------------------------------------- config.json


def hf_config(model: ModelKeys, family: str | None = None, dtype: str | None = None,
              tokens: dict | None = None) -> dict:
    """The ``config.json`` (a dict) of ``model`` as a Hugging Face ``family`` (default:
    :func:`hf_family`) that transformers 5 loads into the same function: vocabulary
    unpadded, ``tie_word_embeddings``, ``rope_parameters`` (and the transformers 4 keys
    ``rope_theta``/``rotary_pct``/``rotary_emb_base`` beside it), norm eps, ``head_dim``,
    biases, ``dtype`` (and ``torch_dtype``; ``dtype``: our name, default the model's),
    ``max_position_embeddings`` = ``max_positions``, ``architectures``; ``tokens``: the
    ``bos_token_id``/``eos_token_id``/``pad_token_id`` to write (default null, not the
    family's defaults, which may lie outside a small vocabulary). The family's fields are
    its module's (:attr:`parcompile.core.families.base.Family.config`).

    Raises:
        HFWeightsError: the family cannot express the model (:func:`family_problems`).
    """
    m = model
    family = family or hf_family(m)
    problems = family_problems(m, family)
    if problems:
        raise HFWeightsError(problems[0].message, problems[0].help)
    hf_dtype = HF_DTYPES[dtype or m.dtype]
    common = {"architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": m.vocab,
              "tie_word_embeddings": bool(m.tie_embeddings), "dtype": hf_dtype, "torch_dtype": hf_dtype,
              "use_cache": True, "transformers_version": TRANSFORMERS_VERSION,
              "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    common.update({k: v for k, v in (tokens or {}).items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    return families.get(family).config(m, common)


# --------------------------------------------------------------------------- checkpoints


def init_from_kind(directory: str | os.PathLike) -> str:
    """``"hf"`` (``*.safetensors`` files, or a ``model.safetensors.index.json``) or
    ``"dcp"`` (a ``torch.distributed.checkpoint``: ``.metadata``, or a training program's
    checkpoint root holding ``step_NNNNNNNN/.metadata``) for an ``init_from`` directory.

    Raises:
        HFWeightsError: the directory does not exist or holds neither.
    """
    d = Path(directory)
    if not d.is_dir():
        raise HFWeightsError(f"`{directory}` is not a directory",
                             "init_from is a Hugging Face checkpoint directory (config.json + *.safetensors) "
                             "or a checkpoint directory a training program wrote")
    if (d / ".metadata").is_file() or any((p / ".metadata").is_file() for p in d.glob("step_*")
                                          if p.is_dir() and not p.name.endswith(".partial")):
        return "dcp"
    if (d / "model.safetensors.index.json").is_file() or any(d.glob("*.safetensors")):
        return "hf"
    found = sorted(p.name for p in d.iterdir())[:6]
    bins = any(d.glob("*.bin")) or any(d.glob("*.pt"))
    raise HFWeightsError(
        f"`{directory}` holds neither *.safetensors files nor a torch.distributed.checkpoint "
        f"(.metadata or step_*/.metadata)" + (f"; it has: {', '.join(found)}" if found else "; it is empty"),
        "convert PyTorch .bin weights with `save_pretrained(dir, safe_serialization=True)`" if bins else
        "give a Hugging Face checkpoint directory or a training program's checkpoint_dir")


#: The largest safetensors header read (bytes): safetensors' own ``MAX_HEADER_SIZE``
#: (huggingface/safetensors, safetensors/src/tensor.rs, 100_000_000 since v0.3).
MAX_HEADER_BYTES = 100_000_000


def _count(x) -> int:
    """A shape entry or byte offset of a safetensors header: a JSON integer >= 0 (not a
    float such as 64.5, a bool or a string), else ValueError."""
    if type(x) is not int or x < 0:
        raise ValueError(f"{x!r} is not a count")
    return x


def shard_name_problem(index: str | os.PathLike, name: str) -> Problem | None:
    """Why ``name``, a file a ``model.safetensors.index.json`` lists in its ``weight_map``,
    may not be read: it must be a plain file name in the checkpoint's directory (no
    directory part, not ``..``: an index naming ``/etc/passwd`` or ``../x`` would read
    outside it) ending in ``.safetensors``."""
    if not name or name != os.path.basename(name) or name in (".", "..") or "\\" in name or "\x00" in name \
            or not name.endswith(".safetensors"):
        return Problem(f"`{index}` names the shard {name[:200]!r}, which is not a *.safetensors file name in the "
                       "checkpoint's directory", "an index lists its shards by file name, e.g. "
                       "model-00001-of-00002.safetensors; download the checkpoint again")
    return None


def read_header(path: str | os.PathLike) -> tuple[dict[str, tuple[str, tuple[int, ...]]], list[Problem]]:
    """The tensors of one safetensors file, name -> (dtype, shape), from its header alone,
    and the problems found (a truncated header or data, a header that is not JSON)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return {}, [Problem(f"`{p}` is truncated: {size} bytes, not even the 8-byte header length",
                                    "download or copy the file again")]
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:   # a sparse file may claim gigabytes it does not hold
                return {}, [Problem(f"`{p}` is not a safetensors file: its header claims {n:,} bytes, over "
                                    f"safetensors' limit of {MAX_HEADER_BYTES:,}", "download or copy the file again")]
            if 8 + n > size:
                return {}, [Problem(f"`{p}` is truncated: its header needs {8 + n} bytes but the file has {size}",
                                    "download or copy the file again")]
            raw = fh.read(n)
    except OSError as e:
        return {}, [Problem(f"cannot read `{p}`: {e.strerror or e}")]
    try:
        header = json_loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (UnicodeDecodeError, ValueError) as e:
        return {}, [Problem(f"`{p}` is not a safetensors file: its header is not JSON ({e})")]
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        try:
            shape = tuple(_count(x) for x in info["shape"])
            start, stop = (_count(x) for x in info["data_offsets"])
            dtype = str(info["dtype"])
        except (KeyError, TypeError, ValueError):   # also a shape of 64.5, -1 or "8", which int() would take
            return tensors, [Problem(f"`{p}` has a malformed header entry for `{name}`")]
        width = SAFETENSORS_BYTES.get(dtype)
        if dtype not in SAFETENSORS_DTYPES:
            return tensors, [Problem(f"`{p}` has a malformed header: `{name}` has dtype {dtype!r}, which safetensors "
                                     "does not know", "download or copy the file again")]
        count = 1
        for x in shape:
            count *= x
        if stop < start or (width is not None and stop - start != count * width):
            return tensors, [Problem(f"`{p}` has a malformed header: `{name}` {dtype} {shape} spans bytes "
                                     f"[{start}, {stop})", "download or copy the file again")]
        tensors[name] = (dtype, shape)
        end = max(end, stop)
    if 8 + n + end > size:
        return tensors, [Problem(f"`{p}` is truncated: its tensors need {8 + n + end} bytes but the file has {size}",
                                 "download or copy the file again")]
    spans = sorted((info["data_offsets"][0], info["data_offsets"][1]) for k, info in header.items()
                   if k != "__metadata__" and isinstance(info, dict))
    at = 0
    for start, stop in spans:   # safetensors' own rule: the tensors tile the data, no gap, no overlap
        if start != at:
            return tensors, [Problem(f"`{p}` has a malformed header: its tensors leave a gap or overlap at byte "
                                     f"{min(start, at)} of the data", "download or copy the file again")]
        at = stop
    if 8 + n + at != size:
        return tensors, [Problem(f"`{p}` has {size - 8 - n - at} bytes after its last tensor, which safetensors "
                                 "refuses", "download or copy the file again")]
    return tensors, []


def scan_checkpoint(directory: str | os.PathLike) -> tuple[dict[str, str], dict[str, tuple[str, tuple[int, ...]]],
                                                        list[Problem], bool]:
    """What a Hugging Face directory holds, from ``model.safetensors.index.json`` (when
    there is one: its files must exist) and the safetensors headers: (HF tensor name ->
    file name, HF tensor name -> (dtype, shape), problems, whether every header was read)."""
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    problems: list[Problem] = []
    names: dict[str, str] = {}
    if index.is_file():
        try:
            data = json_loads(index.read_text(encoding="utf-8"))
            wm = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(wm, dict):   # also `[]` or a number: was "list indices must be integers..."
                raise ValueError("it holds no `weight_map` object (tensor name -> shard file)")
        except (OSError, UnicodeDecodeError, ValueError) as e:
            return {}, {}, [Problem(f"cannot read `{index}`: {e}")], False
        names = {str(k): str(v) for k, v in wm.items()}
        files = sorted(set(names.values()))
        bad = [pr for pr in (shard_name_problem(index, f) for f in files) if pr is not None]
        if bad:
            return {}, {}, bad[:1], False
        for f in files:
            if not (d / f).is_file():
                problems.append(Problem(f"`{index}` names `{f}`, which is not in `{d}`",
                                        "the download is incomplete: fetch every file the index lists"))
    else:
        files = sorted(f.name for f in d.glob("*.safetensors"))
        if not files:
            return {}, {}, [Problem(f"`{d}` has no *.safetensors file")], False
    headers: dict[str, tuple[str, tuple[int, ...]]] = {}
    complete = not problems
    for f in files:
        if not (d / f).is_file():
            continue
        tensors, file_problems = read_header(d / f)
        problems += file_problems
        complete = complete and not (file_problems and not tensors)
        headers.update(tensors)
        for k in tensors:
            names.setdefault(k, f)
    return names, headers, problems, complete


def checkpoint_files(directory: str | os.PathLike) -> tuple[dict[str, str], list[Problem]]:
    """HF tensor name -> file name (relative to ``directory``) and the problems found
    (:func:`scan_checkpoint`)."""
    names, _, problems, _ = scan_checkpoint(directory)
    return names, problems


def read_config(directory: str | os.PathLike) -> tuple[dict | None, list[Problem]]:
    """The parsed ``config.json`` of a checkpoint directory (None when absent) and the
    problems found (not JSON, a ``model_type`` we do not import)."""
    f = Path(directory) / "config.json"
    if not f.is_file():
        return None, []
    try:
        cfg = json_loads(f.read_text(encoding="utf-8"))
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, [Problem(f"cannot read `{f}`: {e}")]
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        return cfg, [Problem(f"`{f}` has model_type {json.dumps(mt)}, which parcompile does not import",
                             "supported: " + ", ".join(SUPPORTED_MODEL_TYPES))]
    return cfg, []


def _cap(problems: list[Problem], limit: int, what: str) -> list[Problem]:
    if len(problems) <= limit:
        return problems
    return problems[:limit] + [Problem(f"... and {len(problems) - limit} more {what}")]


def check_checkpoint(directory: str | os.PathLike, expected: dict[str, tuple[int, ...]],
                     model: ModelKeys) -> list[Problem]:
    """Whether ``directory`` can initialise a model of ``model`` with global parameters
    ``expected`` (our name -> global shape, vocabulary unpadded), reading only headers.

    A DCP directory (:func:`init_from_kind`) is accepted here: its metadata is a pickle
    that needs torch, and :func:`parcompile.frontend.checks._check_init_from` checks its
    shapes. For a Hugging Face directory the problems are: a ``config.json``
    whose ``model_type`` we do not import; an index naming a missing file; a truncated
    safetensors file (header or data past the end: the file and both sizes); a tensor
    missing (the HF name and ours); a shape that differs (the HF tensor, the shape it
    needs for our tensor and the checkpoint's). The layout is the family of the
    ``config.json`` (else :func:`hf_family` of ``model``). The model's buffers
    (:data:`BUFFERS`, e.g. DeepSeek's ``e_score_correction_bias``) are checked beside
    ``expected``; tensors the model does not read (DeepSeek-V3's multi-token-prediction
    layers, ``model.layers.61.*``) are not reported.

    A checkpoint whose ``config.json`` has a ``quantization_config`` (:mod:`parcompile.core.quant`)
    may store a weight quantized (:func:`parcompile.core.quant.stored_quantized`): then each
    tensor the format stores it as (:func:`parcompile.core.quant.stored_tensors`: the values
    and their scales) must be there with its dtype and the shape this model's weight gives
    (the problem names the file, the tensor, what it needs and what it found); weights the
    format leaves in 16 bits are checked as any. A quantization_config parcompile does not
    serve is a problem (:class:`parcompile.core.quant.QuantConfigError`'s message).
    """
    try:
        if init_from_kind(directory) == "dcp":
            return []
    except HFWeightsError as e:
        return [e.problem]
    d = Path(directory)
    cfg, problems = read_config(d)
    if problems:
        return problems
    try:
        family, fmt = _layout_of(d, cfg, model)
    except HFWeightsError as e:
        return [e.problem]
    names, headers, problems, complete = scan_checkpoint(d)
    dtypes = {k: v[0] for k, v in headers.items()}
    tmap = tensor_map(model, family, tied=_checkpoint_tied(cfg, model))
    missing: list[Problem] = []
    shapes: list[Problem] = []
    reported: set[str] = set()
    buffers = {k: v for k, v in expected_shapes(model, buffers=True).items() if is_buffer(k)}
    for name, ours in {**expected, **buffers}.items():
        srcs = tmap.get(name)
        if not srcs:
            missing.append(Problem(f"a Hugging Face `{family}` checkpoint has no tensor for `{name}`",
                                   "the spec's model has a parameter this family does not hold"))
            continue
        src = next((s for s in srcs if s.name in names or s.name in headers or stored_quantized(fmt, s.name, dtypes)),
                   None)
        if src is None and complete:
            missing.append(Problem(f"`{d}` has no tensor `{srcs[0].name}` (for this model's `{name}` {tuple(ours)})",
                                   UNTIED_HEAD_HELP if name == "lm_head.weight" else
                                   "was the checkpoint written for another model? the spec's model must match "
                                   "its config.json"))
            continue
        if src is None:
            continue
        if stored_quantized(fmt, src.name, dtypes):
            if src.name not in reported:   # once per fused tensor
                reported.add(src.name)
                shapes += _quantized_problems(d, names, headers, fmt, src, name, ours)
            continue
        if src.name not in headers:
            if complete:   # the index names a file that lacks it
                missing.append(Problem(f"`{d / names[src.name]}` has no tensor `{src.name}` (for this model's "
                                       f"`{name}`), though model.safetensors.index.json says so",
                                       "the download is incomplete or the index is of another checkpoint"))
            continue   # else in a missing or unreadable file: reported above
        shapes += _dense_problems(d, names, headers, fmt, src, name, ours, reported)
    return problems + _cap(missing, 8, "missing tensors") + _cap(shapes, 8, "shape mismatches")


def _layout_of(d: Path, cfg: dict | None, model: ModelKeys) -> tuple[str, QuantFormat | None]:
    """``(family, quantized format)`` of checkpoint ``d``: its config.json's ``model_type``
    (else :func:`hf_family` of ``model``) and ``quantization_config`` (None without one).
    Raises :class:`HFWeightsError` for a model no family holds or a quantization_config
    parcompile does not serve."""
    family = cfg.get("model_type") if cfg else None
    if family is None:
        family = hf_family(model)
    try:
        return family, (checkpoint_format(cfg) if cfg else None)
    except QuantConfigError as e:
        raise HFWeightsError(f"`{d / 'config.json'}`: {e.message}", e.help) from None


def _dense_problems(d: Path, names: dict[str, str], headers: dict[str, tuple[str, tuple[int, ...]]],
                    fmt: QuantFormat | None, src: Source, name: str, ours: tuple[int, ...],
                    reported: set[str]) -> list[Problem]:
    """What is wrong with a tensor stored in 16 or 32 bits: another dtype than a float one
    (a quantized tensor its config.json does not say), or another shape than ``src`` needs
    (once per fused tensor: ``reported`` keeps those said)."""
    dtype, got = headers[src.name]
    if dtype not in ("F64", "F32", "BF16", "F16"):
        said = (f"its config.json's quantization_config says {fmt.description}" if fmt is not None else
                "its config.json has no quantization_config")
        return [Problem(f"`{d / names.get(src.name, '')}`: `{src.name}` is stored as {dtype}, but {said}",
                        "parcompile loads float32, bfloat16 or float16 weights, or the quantized ones a "
                        "published checkpoint's quantization_config names (fp8, compressed-tensors FP8, "
                        "mxfp4): use the checkpoint's own config.json")]
    if tuple(got) != tuple(src.shape) and src.name not in reported:
        reported.add(src.name)
        return [Problem(f"`{src.name}` has shape {tuple(got)} in the checkpoint; this model's `{name}` "
                        f"{tuple(ours)} needs {tuple(src.shape)}",
                        "the spec's model differs from the checkpoint's config.json (hidden, heads, kv_heads, "
                        "ffn_hidden, vocab?)")]
    return []


def _quantized_problems(d: Path, names: dict[str, str], headers: dict[str, tuple[str, tuple[int, ...]]],
                        fmt: QuantFormat, src: Source, ours_name: str, ours: tuple[int, ...]) -> list[Problem]:
    """What is wrong with the tensors ``src`` is stored as in format ``fmt``
    (:func:`parcompile.core.quant.stored_tensors`, their shapes from this model's ``src.shape``):
    one missing, or of another dtype or shape; each problem names the file and the tensor."""
    if src.transpose and fmt.family != "mxfp4":
        return [Problem(f"`{d / names.get(src.name, '')}`: `{src.name}` is stored as {fmt.description}, which "
                        "parcompile reads only for tensors stored (out, in)")]
    out = []
    first = names.get(src.name) or names.get(f"{src.name}_blocks", "")
    for t in stored_tensors(fmt, src.name, tuple(src.shape), src.transpose):
        if t.name not in headers:
            if not t.optional:
                out.append(Problem(f"`{d / first}` stores `{src.name}` (this model's `{ours_name}` {tuple(ours)}) "
                                   f"as {fmt.description} but has no `{t.name}` ({t.wanted()})",
                                   "the checkpoint is incomplete, or its files are of another format than its "
                                   "config.json's quantization_config: download it again"))
            continue
        dtype, got = headers[t.name]
        if not t.fits(dtype, got):
            out.append(Problem(f"`{d / names.get(t.name, first)}`: `{t.name}` is {dtype} {tuple(got)}; this model's "
                               f"`{ours_name}` {tuple(ours)} stored as {fmt.description} needs {t.wanted()}",
                               "the spec's model differs from the checkpoint's config.json, or the file is of "
                               "another quantization"))
    return out


#: the fix for an untied checkpoint without its head tensor
UNTIED_HEAD_HELP = ("the checkpoint does not tie its head to the embedding (tie_word_embeddings is false or its "
                    "family's default), so the head is a tensor of its own: copy the complete checkpoint, or set "
                    "\"tie_word_embeddings\": true in its config.json if the head is the embedding")


def _checkpoint_tied(cfg: dict | None, model: ModelKeys) -> bool:
    """Whether a checkpoint of config.json ``cfg`` ties its head to the embedding
    (``tie_word_embeddings``, else its family's default: :func:`parcompile.core.hf.from_hf_dict`);
    ``model``'s own when there is no readable config.json."""
    if cfg is None:
        return bool(model.tie_embeddings)
    try:
        return bool(from_hf_dict(cfg).get("tie_embeddings", False))
    except (HFConfigError, TypeError, ValueError, AttributeError):
        return bool(model.tie_embeddings)


def model_from_checkpoint_config(cfg: dict, **overrides) -> ModelKeys:
    """The :class:`~parcompile.core.model.ModelKeys` of a checkpoint's parsed
    ``config.json`` (through :func:`parcompile.core.hf.from_hf_dict`), for reading its
    tensor layout.

    Raises:
        parcompile.core.hf.HFConfigError: the config cannot be imported.
        TypeError: it lacks a key every model has (layers, hidden, heads, vocab).
    """
    keys = from_hf_dict(cfg)
    keys.setdefault("seq_len", keys.get("max_positions") or 2048)
    if keys.get("dtype") not in HF_DTYPES:   # a torch_dtype we do not train in: the layout does not need it
        keys.pop("dtype", None)
    keys = {k: v for k, v in keys.items() if v is not None}
    keys.update(overrides)
    keys.setdefault("dtype", "fp32")
    return ModelKeys(**keys)


__all__ = [
    "FAMILIES", "Problem", "HFWeightsError", "Source", "hf_family", "family_problems", "tensor_map",
    "expected_shapes", "hf_config", "init_from_kind", "check_checkpoint", "read_header", "scan_checkpoint", "checkpoint_files",
    "read_config", "model_from_checkpoint_config", "rope_dim", "VOCAB_PARAMS", "HF_DTYPES", "BUFFERS", "is_buffer",
    "UNTIED_HEAD_HELP", "ARCHITECTURES",
]
