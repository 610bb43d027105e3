"""Loading weights into a program's shards, each rank reading only its shard where it can.

Three sources (:func:`weights_kind`):

* ``seed``: no directory; the layers drew their shards from the global initialisation
  (:func:`parcompile.runtime.model.layers.global_init`), exactly as a training program of the
  same seed starts;
* ``dcp``: a ``torch.distributed.checkpoint`` directory (it holds ``.metadata``) that a
  training program of any layout wrote with :func:`parcompile.runtime.state.checkpoint.save`
  (or its root, whose newest ``step_N`` is read): global tensors keyed by parameter name,
  tensor-parallel shards saved as DTensors. Ordinary tp shards are loaded as DTensors
  over this plan's tp group, so each rank reads its own slice; the vocabulary rows
  (padding differs between layouts) and replicated kv heads are read whole and cut here.
  A tied LM head is not in the checkpoint: it reads ``embedding.weight``;
* ``hf``: a Hugging Face checkpoint (``config.json`` + ``*.safetensors``, optionally a
  ``model.safetensors.index.json``) of any family of :mod:`parcompile.core.hf_weights`
  (gpt2, gpt_neox, llama, mistral, mixtral, qwen2, qwen3): each rank reads the rows or columns
  of its shards through ``safetensors``' ``get_slice``; fused HF tensors (GPT-2
  ``c_attn``, GPT-NeoX ``query_key_value``, Mixtral ``gate_up_proj``) are read at the
  offsets of our tensor; GPT-2's ``Conv1D`` weights are transposed; vocabulary rows past
  ``vocab`` are zero (padding); a tied checkpoint's missing head reads the embedding (an
  untied one's is an error naming ``lm_head.weight``). A checkpoint quantized as published
  (its config.json's ``quantization_config``: FP8 block-scaled, compressed-tensors FP8,
  gpt-oss's MXFP4; :mod:`parcompile.core.quant`) is read quantized, each rank its shard
  (:mod:`parcompile.runtime.model.quant`): the weights a serve program holds quantized stay so
  (``quantized``), any other is dequantized on load.

Every parameter carries its layout (``global_name``, ``global_shape``, ``shard_dim``,
``shard_index``, ``num_shards``, ``valid_rows``; see :func:`parcompile.runtime.model.layers.make_param`).

Errors are :class:`WeightsError` (a :class:`~parcompile.runtime.serve.generate.ServeError`, so
the serve program reports them as one line): ``message`` and an optional ``help``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
import torch.nn as nn

from parcompile.core.hf import HFConfigError
from parcompile.core.hf_weights import (UNTIED_HEAD_HELP, HFWeightsError, Source, hf_family, model_from_checkpoint_config, read_config,
                                        scan_checkpoint, tensor_map)
from parcompile.core.model import ModelKeys
from parcompile.core.quant import QuantConfigError, checkpoint_format, format_named, stored_quantized
from parcompile.runtime.model import quant as rq
from parcompile.runtime.distributed.context import ParallelContext
from parcompile.runtime.serve.generate import ServeError

#: a complete checkpoint of a training program: ``step_NNNNNNNN`` (:mod:`parcompile.runtime.state.checkpoint`)
STEP_DIR = re.compile(r"^step_(\d{8})$")


class WeightsError(ServeError):
    """Weights that cannot be loaded (a missing tensor, a shape of another model, a
    directory that holds no checkpoint): ``message`` and an optional ``help``."""

    def __init__(self, message: str, help: str | None = None):
        super().__init__(message)
        self.message = message
        self.help = help


#: our parameter names -> Hugging Face Llama names ({i}: layer); kept for callers of the
#: serve loader of old (the full mapping of every family: hf_weights.tensor_map)
HF_LLAMA = {
    "embedding.weight": "model.embed_tokens.weight",
    "lm_head.weight": "lm_head.weight",
    "final_norm.weight": "model.norm.weight",
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attn.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attn.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attn.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attn.wq.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "layers.{i}.attn.wk.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "layers.{i}.attn.wv.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "layers.{i}.attn.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.mlp.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.mlp.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.mlp.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def newest(directory: str | os.PathLike) -> tuple[Path, int] | None:
    """The newest complete checkpoint (``step_N`` holding ``.metadata``; module docstring
    of :mod:`parcompile.runtime.state.checkpoint`) in ``directory`` and its step, or None."""
    d = Path(directory)
    if not d.is_dir():
        return None
    found = sorted((int(m.group(1)), p) for p in d.iterdir()
                   if (m := STEP_DIR.match(p.name)) and (p / ".metadata").is_file())
    return (found[-1][1], found[-1][0]) if found else None


def dcp_metadata_path(directory: str | os.PathLike) -> Path:
    """``directory/.metadata``, or that of the newest complete ``step_N`` of a training
    program's checkpoint root.

    Raises:
        WeightsError: neither exists.
    """
    d = Path(directory)
    if (d / ".metadata").is_file():
        return d / ".metadata"
    found = newest(d)
    if found is None:
        raise WeightsError(f"{directory} holds no complete checkpoint (.metadata or step_NNNNNNNN/.metadata)",
                           "give a training program's checkpoint_dir or one of its step_N directories")
    return found[0] / ".metadata"


def read_dcp_metadata(directory: str | os.PathLike):
    """The ``Metadata`` of the DCP checkpoint in ``directory`` (:func:`dcp_metadata_path`),
    read without running code (:mod:`parcompile.runtime.state.dcp_safe`: torch itself would
    ``pickle.load`` it).

    Raises:
        WeightsError: no checkpoint; a ``.metadata`` that is not a DCP metadata pickle, or
            that refers to a name a DCP metadata never holds (named: it could run code).
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    from parcompile.runtime.state.dcp_safe import RefusedName, unpickle_metadata

    path = dcp_metadata_path(directory)
    try:
        meta = unpickle_metadata(path.read_bytes())
    except RefusedName as e:
        raise WeightsError(f"{path} refers to `{e.name}`, which a torch.distributed.checkpoint's metadata never "
                           "holds: refusing to read it (a pickle that names a function can run code)",
                           "use only checkpoints you or a training program of parcompile wrote") from None
    except OSError as e:
        raise WeightsError(f"cannot read {path}: {e.strerror or e}") from None
    except Exception as e:   # a truncated or garbled pickle: UnpicklingError, EOFError, ValueError...
        raise WeightsError(f"{path} is damaged: not a torch.distributed.checkpoint metadata "
                           f"({type(e).__name__}: {e})".splitlines()[0]) from None
    entries = getattr(meta, "state_dict_metadata", None)
    if not isinstance(meta, Metadata) or not isinstance(entries, dict) or not all(
            isinstance(k, str) and isinstance(v, (TensorStorageMetadata, BytesStorageMetadata))
            for k, v in entries.items()):
        raise WeightsError(f"{path} is damaged: not a torch.distributed.checkpoint metadata")
    return meta


def dcp_tensor(meta, name: str, path: str | os.PathLike):
    """The ``TensorStorageMetadata`` of ``name`` in ``meta`` (:func:`read_dcp_metadata`),
    or None when absent.

    Raises:
        WeightsError: ``name`` is stored as a pickled object (torch would read it with
            torch.load with weights_only=False), not as a tensor.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = meta.state_dict_metadata.get(name)
    if md is not None and not isinstance(md, TensorStorageMetadata):
        raise WeightsError(f"the checkpoint {path} stores `{name}` as a pickled object, not a tensor: refusing "
                           "to read it (it could run code)")
    return md


def load_dcp_tensors(state: dict, directory: str | os.PathLike, no_dist: bool, meta=None) -> None:
    """Fill the tensors ``state`` (name -> tensor or DTensor) from the DCP checkpoint in
    ``directory`` (a ``step_N``), its metadata read by :func:`read_dcp_metadata` (or
    ``meta`` already read so), never unpickled by torch.

    Raises:
        WeightsError: see :func:`read_dcp_metadata`; a name missing or not a tensor; a
            data file that cannot be read (truncated, damaged), on every rank.
    """
    from parcompile.runtime.state import dcp_safe

    from torch.distributed.checkpoint.api import CheckpointException

    meta = meta if meta is not None else read_dcp_metadata(directory)
    for name in state:
        if dcp_tensor(meta, name, directory) is None:
            raise WeightsError(f"the checkpoint {directory} has no `{name}`; was it written for another model?")
    try:
        dcp_safe.load(state, directory, no_dist, meta)
    except (CheckpointException, OSError, RuntimeError, ValueError) as e:   # a truncated or damaged data file
        raise WeightsError(f"cannot read the checkpoint {directory}: {dcp_safe.failure_reason(e)}",
                           "its files are damaged or incomplete: copy the checkpoint again") from None


def tp_mesh(ctx: ParallelContext):
    """A one-dimensional DeviceMesh over this rank's tp group (DTensor reads and writes of
    tensor-parallel shards), or None with tp = 1 or a single process."""
    if ctx.distributed and ctx.tp.size > 1:
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(ctx.tp.group, ctx.device.type)
    return None


def weights_kind(path: str | None) -> str:
    """``seed`` (no path), ``dcp`` or ``hf`` for a directory.

    Raises:
        WeightsError: the directory is missing or holds neither kind of checkpoint.
    """
    if not path:
        return "seed"
    p = Path(path)
    if not p.is_dir():
        raise WeightsError(f"weights directory {path} does not exist; train with `checkpoint_dir` set, "
                           "or give a Hugging Face checkpoint directory")
    if (p / ".metadata").is_file():
        return "dcp"
    if newest(p) is not None:   # a training program's checkpoint directory: its newest step
        return "dcp"
    if any(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").is_file():
        return "hf"
    raise WeightsError(f"{path} holds neither a torch.distributed.checkpoint (.metadata) nor *.safetensors files",
                       "give a Hugging Face checkpoint directory or a training program's checkpoint directory")


def target_slice(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full``, a global tensor of parameter ``p`` (its layout
    attributes: ``global_shape``, ``valid_rows``, ``shard_dim``, ``num_shards``,
    ``shard_index``) whose vocabulary rows may be padded differently: rows past
    ``valid_rows`` are zero, then the rows or columns of the shard.

    Raises:
        WeightsError: ``full`` has another shape than ``p``'s global one.
    """
    shape = p.global_shape
    if p.valid_rows is not None and tuple(full.shape) != tuple(shape):
        fixed = torch.zeros(shape, dtype=full.dtype)
        rows = min(p.valid_rows, full.shape[0])
        fixed[:rows] = full[:rows]
        full = fixed
    elif p.valid_rows is not None:
        full = full.clone()
        full[p.valid_rows:] = 0
    if tuple(full.shape) != tuple(shape):
        raise WeightsError(f"{p.global_name}: the checkpoint's shape {tuple(full.shape)} differs from this "
                           f"model's {tuple(shape)}; was it written for another model?")
    if p.shard_dim is None:
        return full
    n = shape[p.shard_dim] // p.num_shards
    return full.narrow(p.shard_dim, p.shard_index * n, n)


def layout_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors a checkpoint holds: every parameter with a layout (``global_name``...),
    then every persistent buffer with one (DeepSeek-V3's ``router.e_score_correction_bias``:
    :class:`parcompile.runtime.model.moe.Router`), loaded and saved alike."""
    return ([p for p in model.parameters() if hasattr(p, "global_name")]
            + [b for b in model.buffers() if hasattr(b, "global_name")])


_params = layout_tensors


def load_dcp(model: nn.Module, path: str, ctx: ParallelContext) -> None:
    """Load a training program's DCP checkpoint into this rank's shards (module docstring).

    Raises:
        WeightsError: a parameter is missing from the checkpoint, or its shape differs.
    """
    metadata = read_dcp_metadata(path)   # .metadata is a pickle: read without running code
    mesh = tp_mesh(ctx)
    groups: dict[str, list[nn.Parameter]] = {}
    for p in _params(model):
        groups.setdefault(p.global_name, []).append(p)
    state = {}
    for name, ps in groups.items():
        p = ps[0]
        md = dcp_tensor(metadata, name, path)
        if md is None:
            raise WeightsError(f"the checkpoint {path} has no `{name}`; was it written for another model?")
        size = tuple(md.size)
        dtype = md.properties.dtype
        if p.valid_rows is None and size != tuple(p.global_shape):
            raise WeightsError(f"{name}: the checkpoint's shape {size} differs from this model's "
                               f"{tuple(p.global_shape)}; was it written for another model?")
        standard = (len(ps) == 1 and mesh is not None and p.shard_dim is not None and p.valid_rows is None
                    and p.num_shards == ctx.tp.size and p.shard_index == ctx.tp.index)
        if standard:   # read only this rank's slice
            from torch.distributed.tensor import DTensor, Shard

            buf = torch.empty(tuple(p.shape), dtype=dtype)
            state[name] = DTensor.from_local(buf, mesh, [Shard(p.shard_dim)], run_check=False)
        else:          # vocabulary rows, replicated kv heads, tp = 1: read whole, cut here
            state[name] = torch.empty(size, dtype=dtype)
    load_dcp_tensors(state, path, not ctx.distributed, metadata)
    with torch.no_grad():
        for name, ps in groups.items():
            t = state[name]
            for p in ps:
                if hasattr(t, "to_local"):
                    p.copy_(t.to_local())
                else:
                    p.copy_(target_slice(t, p))


def hf_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a Hugging Face checkpoint directory.

    Raises:
        WeightsError: the index cannot be read or names a missing file, a file is truncated.
    """
    names, _, problems, _ = scan_checkpoint(path)
    if problems:
        raise WeightsError(problems[0].message, problems[0].help)
    return {k: path / v for k, v in names.items()}


def _layout(root: Path, config: ModelKeys | None) -> tuple[str, dict[str, list[Source]]]:
    """The family and tensor map of a checkpoint: from its config.json (its own layout),
    else from ``config`` (this model's family)."""
    cfg, problems = read_config(root)
    if problems:
        raise WeightsError(problems[0].message, problems[0].help)
    try:
        if cfg is not None:
            family = cfg["model_type"]
            try:
                layout_model = model_from_checkpoint_config(cfg)
            except (HFConfigError, TypeError, ValueError) as e:
                if config is None:
                    raise WeightsError(f"cannot read the layout of {root / 'config.json'}: "
                                       f"{getattr(e, 'message', e)}") from None
                layout_model = config
            return family, tensor_map(layout_model, family)
        if config is None:
            raise WeightsError(f"{root} has no config.json: its layout is unknown",
                               "add the checkpoint's config.json")
        family = hf_family(config)
        return family, tensor_map(config, family)
    except HFWeightsError as e:
        raise WeightsError(e.message, e.help) from None


class _Reader:
    """Open safetensors files of one directory, each opened once."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self.handles: dict[Path, object] = {}

    def slice(self, name: str):
        from safetensors import safe_open

        f = self.files[name]
        try:
            if f not in self.handles:
                self.handles[f] = safe_open(str(f), framework="pt").__enter__()
            return self.handles[f].get_slice(name)
        except Exception as e:   # safetensors' own header validation (SafetensorError), an OSError
            raise WeightsError(f"cannot read `{name}` from {f}: {str(e).splitlines()[0] if str(e) else e!r}",
                               "the file is damaged or incomplete: download or copy it again") from None

    def close(self) -> None:
        for h in self.handles.values():
            h.__exit__(None, None, None)
        self.handles.clear()


def read_region(sl, src: Source, rows: tuple[int, int], cols: tuple[int, int] | None) -> torch.Tensor:
    """Our rows ``[rows)`` (and columns ``[cols)`` of a 2-D tensor) read from the HF
    tensor slice ``sl`` (``get_slice``) at ``src``: (rows, cols) or (rows,), our orientation."""
    parts = []
    for _, hf_row, n in src.runs(*rows):
        r = slice(hf_row, hf_row + n)
        if cols is None:
            idx = src.lead + (r,)
        elif src.transpose:
            idx = src.lead + (slice(*cols), r)
        else:
            idx = src.lead + (r, slice(*cols))
        t = sl[idx]
        parts.append(t.t() if src.transpose and cols is not None else t)
    if not parts:
        width = () if cols is None else (cols[1] - cols[0],)
        return torch.empty((0,) + width)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _shard_range(p: torch.Tensor, dim: int) -> tuple[int, int]:
    size = p.global_shape[dim]
    if p.shard_dim != dim:
        return 0, size
    n = size // p.num_shards
    return p.shard_index * n, (p.shard_index + 1) * n


def _checkpoint_quant(root: Path, holding: rq.Holding | None):
    """The checkpoint's format (its config.json's ``quantization_config``; None: none), how it
    quantizes a layer's input (:func:`parcompile.runtime.model.quant.input_scheme`) and what its
    zero points lack (:func:`parcompile.runtime.model.quant.zero_offset`).

    Raises:
        WeightsError: a quantization_config parcompile does not serve, or of another format
            than the program holds (``holding``).
    """
    cfg, _ = read_config(root)
    try:
        fmt = checkpoint_format(cfg) if cfg else None
        mode = rq.input_scheme(cfg.get("quantization_config")) if fmt is not None else None
        zero_add = rq.zero_offset(cfg.get("quantization_config")) if fmt is not None else 0
    except QuantConfigError as e:
        raise WeightsError(f"{root / 'config.json'}: {e.message}", e.help) from None
    except rq.QuantError as e:
        raise WeightsError(f"{root / 'config.json'}: {e.message}", e.help) from None
    if fmt is not None and holding is not None and fmt.name != holding.fmt.name:
        raise WeightsError(f"the program holds its weights as {holding.fmt.description} ({holding.fmt.name}), but "
                           f"{root} holds {fmt.description} ({fmt.name})",
                           "compile the spec again against this checkpoint (`parcompile compile`)")
    return fmt, mode, zero_add


def load_hf(model: nn.Module, path: str, config: ModelKeys | None = None,
            holding: rq.Holding | None = None) -> bool:
    """Load a Hugging Face safetensors checkpoint of any supported family (module
    docstring) into ``model``'s shards, each rank reading only its rows or columns.

    The HF layout (family, fused tensors' offsets) is that of the checkpoint's
    ``config.json``; ``config`` (this model) is used when the directory has none. A weight
    the checkpoint stores quantized is held quantized where ``holding`` holds it
    (:func:`parcompile.runtime.model.quant.hold`), else dequantized into its parameter. Returns
    whether the checkpoint is quantized (its config.json has a ``quantization_config``).

    Raises:
        WeightsError: a tensor is missing or its shape differs from the model's; a
            truncated file; an index naming a missing file; an unsupported model_type; a
            quantized tensor missing, of another dtype or shape (its file and name), or of
            another format than ``holding``'s.
    """
    root = Path(path)
    family, tmap = _layout(root, config)
    fmt, input_mode, zero_add = _checkpoint_quant(root, holding)
    names, headers, problems, _ = scan_checkpoint(root)
    if problems:
        raise WeightsError(problems[0].message, problems[0].help)
    files = {k: root / v for k, v in names.items()}
    dtypes = {k: v[0] for k, v in headers.items()}
    reader = _Reader(files)
    qreader = rq.Reader(reader.slice, files)
    table = rq.owners(model) if fmt is not None else {}
    try:
        with torch.no_grad():
            for p in _params(model):
                src, quantized = _source(p, tmap, files, fmt, dtypes, family, path)
                want = tuple(p.global_shape)
                if p.valid_rows is not None:
                    want = (p.valid_rows,) + want[1:]
                if not quantized:
                    sl = reader.slice(src.name)
                    got = tuple(sl.get_shape())
                    if got != tuple(src.shape):
                        raise WeightsError(f"{src.name}: the checkpoint's shape {got} differs from the "
                                           f"{tuple(src.shape)} its config.json gives; is the file of another model?")
                if tuple(src.ours) != want:
                    raise WeightsError(
                        f"{src.name}: the checkpoint holds `{p.global_name}` as {tuple(src.ours)} but this "
                        f"model's is {want}; does the spec match config.json?",
                        "import the model from the checkpoint's config.json (`model m from \"DIR/config.json\"`)")
                r0, r1 = _shard_range(p, 0)
                cols = _shard_range(p, 1) if len(want) == 2 else None
                real = min(r1, p.valid_rows) if p.valid_rows is not None else r1
                if quantized:
                    if len(want) != 2:
                        raise WeightsError(f"{files[src.name] if src.name in files else root}: `{src.name}` is "
                                           f"stored quantized, but `{p.global_name}` {want} is not a matrix")
                    keep = holding is not None and holding.holds(p.global_name) and real == r1
                    try:
                        q = rq.read(qreader, src, p, fmt, (r0, max(r0, real)), cols,
                                    holding.dtype if keep else torch.float32,
                                    holding.device if keep else "cpu", input_mode, zero_add)
                    except rq.QuantError as e:
                        raise WeightsError(e.message, e.help) from None
                    if q.shape != tuple(p.shape) and not (p.valid_rows is not None and not keep):
                        raise WeightsError(f"{src.name}: read {q.shape} for `{p.global_name}`'s shard {tuple(p.shape)}")
                    if keep:
                        owner, attr, _ = table[id(p)]
                        rq.hold(owner, attr, q)
                        continue
                    t = q.dequantize()
                else:
                    t = read_region(sl, src, (r0, max(r0, real)), cols)
                if real < r1:   # padded vocabulary rows
                    pad = torch.zeros((r1 - max(r0, real),) + tuple(t.shape[1:]), dtype=t.dtype)
                    t = torch.cat([t, pad])
                if tuple(t.shape) != tuple(p.shape):
                    raise WeightsError(f"{src.name}: read {tuple(t.shape)} for `{p.global_name}`'s shard "
                                       f"{tuple(p.shape)}")
                p.copy_(t)
    finally:
        reader.close()
    return fmt is not None


def _source(p, tmap: dict, files: dict, fmt, dtypes: dict, family: str, path: str):
    """``(source, quantized)``: where parameter ``p`` is read from in the checkpoint (the
    first of its :func:`tensor_map` sources the files hold, as stored or quantized) and
    whether ``fmt`` stores it quantized. Raises :class:`WeightsError` when it holds none."""
    srcs = tmap.get(p.global_name)
    if not srcs:
        raise WeightsError(f"a Hugging Face `{family}` checkpoint has no tensor for `{p.global_name}`",
                           "the spec's model has a parameter the checkpoint's family does not hold")
    src = next((s for s in srcs if s.name in files or stored_quantized(fmt, s.name, dtypes)), None)
    if src is None:
        raise WeightsError(f"the checkpoint {path} has no tensor `{srcs[0].name}` for "
                           f"`{p.global_name}`" + ("" if p.global_name == "lm_head.weight" else
                                                   "; was it written for another model?"),
                           UNTIED_HEAD_HELP if p.global_name == "lm_head.weight" else None)
    return src, stored_quantized(fmt, src.name, dtypes)


def load_weights(model: nn.Module, path: str | None, ctx: ParallelContext,
                 config: ModelKeys | None = None, *, weight_format: str | None = None,
                 quantized: tuple[str, ...] = (), dtype: torch.dtype | None = None) -> str:
    """Fill ``model``'s shards from ``path`` (None: keep the seeded initialisation);
    returns the kind loaded (``seed``, ``dcp`` or ``hf``). ``config``: see :func:`load_hf`.

    A serve program of quantized weights (``serve.weight_dtype``) passes its
    ``weight_format`` (:func:`parcompile.core.quant.format_named`), the weights it holds so
    (``quantized``: :func:`parcompile.core.quant.weight_key` s) and its compute ``dtype``: a
    checkpoint quantized so is read quantized (:func:`load_hf`); the weights of any other
    source (seed, DCP, a 16-bit checkpoint) are quantized after loading
    (:func:`parcompile.runtime.model.quant.quantize_on_load`: fp8 only).

    Raises:
        WeightsError: see :func:`weights_kind`, :func:`load_dcp`, :func:`load_hf`; an mxfp4 or
            int4 program without a checkpoint quantized so.
    """
    holding = None
    if weight_format is not None:
        holding = rq.Holding(format_named(weight_format), frozenset(quantized), dtype or torch.float32, ctx.device)
    kind = weights_kind(path)
    published = False
    if kind == "dcp":
        if not (Path(path) / ".metadata").is_file():
            path = str(newest(path)[0])
        load_dcp(model, path, ctx)
    elif kind == "hf":
        published = load_hf(model, path, config, holding)
    if holding is not None and not published:
        try:
            rq.quantize_on_load(model, holding)
        except rq.QuantError as e:
            raise WeightsError(e.message, e.help) from None
    return kind


__all__ = ["WeightsError", "dcp_metadata_path", "read_dcp_metadata", "dcp_tensor", "load_dcp_tensors", "layout_tensors", "weights_kind", "load_weights", "load_dcp", "load_hf", "read_region", "HF_LLAMA", "newest",
           "tp_mesh", "target_slice", "hf_files", "STEP_DIR"]
