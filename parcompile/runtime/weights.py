"""Loading a serve program's weights, each rank reading only its shard where it can.

Three sources (:func:`weights_kind`):

* ``seed``: no directory; the layers drew their shards from the global initialisation
  (:func:`parcompile.runtime.layers.global_init`), exactly as a training program of the
  same seed starts;
* ``dcp``: a ``torch.distributed.checkpoint`` directory (it holds ``.metadata``) that a
  training program of any layout wrote with :func:`parcompile.runtime.checkpoint.save`: global tensors keyed by
  parameter name, tensor-parallel shards saved as DTensors. Ordinary tp shards are loaded
  as DTensors over this plan's tp group, so each rank reads its own slice; the vocabulary
  rows (padding differs between layouts) and replicated kv heads are read whole and cut
  here. A tied LM head is not in the checkpoint: it reads ``embedding.weight``;
* ``hf``: a Hugging Face Llama-family directory (``*.safetensors``, optionally an
  ``model.safetensors.index.json``): each rank reads its slice of every tensor through
  ``safetensors``' ``get_slice`` (split on load).

Every parameter carries its layout (``global_name``, ``global_shape``, ``shard_dim``,
``shard_index``, ``num_shards``, ``valid_rows``; see :func:`parcompile.runtime.layers.make_param`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn

from parcompile.runtime.context import ParallelContext
from parcompile.runtime.generate import ServeError

#: our parameter names -> Hugging Face Llama names ({i}: layer)
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


def weights_kind(path: str | None) -> str:
    """``seed`` (no path), ``dcp`` or ``hf`` for a directory.

    Raises:
        ServeError: the directory is missing or holds neither kind of checkpoint.
    """
    if not path:
        return "seed"
    p = Path(path)
    if not p.is_dir():
        raise ServeError(f"weights directory {path} does not exist; train with `checkpoint_dir` set, "
                         "or give a Hugging Face checkpoint directory")
    if (p / ".metadata").is_file():
        return "dcp"
    from parcompile.runtime.checkpoint import newest

    if newest(p) is not None:   # a training program's checkpoint directory: its newest step
        return "dcp"
    if any(p.glob("*.safetensors")):
        return "hf"
    raise ServeError(f"{path} holds neither a torch.distributed.checkpoint (.metadata) nor *.safetensors files")


def _target_slice(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a global tensor whose vocabulary rows may be padded differently:
    rows past ``valid_rows`` are zero, then the rows or columns of the shard."""
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
        raise ServeError(f"{p.global_name}: the checkpoint's shape {tuple(full.shape)} differs from this "
                         f"model's {tuple(shape)}; was it written for another model?")
    if p.shard_dim is None:
        return full
    n = shape[p.shard_dim] // p.num_shards
    return full.narrow(p.shard_dim, p.shard_index * n, n)


def _params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if hasattr(p, "global_name")]


def load_dcp(model: nn.Module, path: str, ctx: ParallelContext) -> None:
    """Load a training program's DCP checkpoint into this rank's shards (module docstring).

    Raises:
        ServeError: a parameter is missing from the checkpoint, or its shape differs.
    """
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(path)
    meta = reader.read_metadata().state_dict_metadata
    mesh = None
    if ctx.distributed and ctx.tp.size > 1:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(ctx.tp.group, ctx.device.type)
    groups: dict[str, list[nn.Parameter]] = {}
    for p in _params(model):
        groups.setdefault(p.global_name, []).append(p)
    state = {}
    for name, ps in groups.items():
        p = ps[0]
        if name not in meta:
            raise ServeError(f"the checkpoint {path} has no `{name}`; was it written for another model?")
        size = tuple(meta[name].size)
        dtype = meta[name].properties.dtype
        if p.valid_rows is None and size != tuple(p.global_shape):
            raise ServeError(f"{name}: the checkpoint's shape {size} differs from this model's "
                             f"{tuple(p.global_shape)}; was it written for another model?")
        standard = (len(ps) == 1 and mesh is not None and p.shard_dim is not None and p.valid_rows is None
                    and p.num_shards == ctx.tp.size and p.shard_index == ctx.tp.index)
        if standard:   # read only this rank's slice
            from torch.distributed.tensor import DTensor, Shard

            buf = torch.empty(tuple(p.shape), dtype=dtype)
            state[name] = DTensor.from_local(buf, mesh, [Shard(p.shard_dim)], run_check=False)
        else:          # vocabulary rows, replicated kv heads, tp = 1: read whole, cut here
            state[name] = torch.empty(size, dtype=dtype)
    dcp.load(state, checkpoint_id=path, no_dist=not ctx.distributed)
    with torch.no_grad():
        for name, ps in groups.items():
            t = state[name]
            for p in ps:
                if hasattr(t, "to_local"):
                    p.copy_(t.to_local())
                else:
                    p.copy_(_target_slice(t, p))


def _hf_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a Hugging Face checkpoint directory."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ServeError(f"cannot read {index}: {e}") from None
        return {k: path / v for k, v in wm.items()}
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = f
    return out


def _hf_name(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "layers":
        key = ".".join(["layers", "{i}"] + parts[2:])
        hf = HF_LLAMA.get(key)
        return hf.format(i=parts[1]) if hf else None
    return HF_LLAMA.get(name)


def load_hf(model: nn.Module, path: str) -> None:
    """Load a Hugging Face Llama-family safetensors checkpoint, each rank reading only the
    rows or columns of its shards (module docstring). A missing ``lm_head.weight`` (tied
    word embeddings) reads ``model.embed_tokens.weight``.

    Raises:
        ServeError: a tensor is missing or its shape differs from the model's.
    """
    from safetensors import safe_open

    root = Path(path)
    files = _hf_files(root)
    handles: dict[Path, object] = {}
    try:
        with torch.no_grad():
            for p in _params(model):
                hf = _hf_name(p.global_name)
                if hf == "lm_head.weight" and hf not in files:
                    hf = "model.embed_tokens.weight"
                if hf is None or hf not in files:
                    raise ServeError(f"the checkpoint {path} has no tensor for `{p.global_name}`"
                                     + (f" (`{hf}`)" if hf else "") + "; only Llama-family models load")
                f = files[hf]
                if f not in handles:
                    handles[f] = safe_open(str(f), framework="pt").__enter__()
                sl = handles[f].get_slice(hf)
                shape = tuple(sl.get_shape())
                want = tuple(p.global_shape)
                rows_differ = p.valid_rows is not None and shape[1:] == want[1:]
                if shape != want and not rows_differ:
                    raise ServeError(f"{hf}: the checkpoint's shape {shape} differs from this model's "
                                     f"{want} for `{p.global_name}`; does the spec match config.json?")
                if p.shard_dim is None or rows_differ:
                    p.copy_(_target_slice(sl[:], p))
                    continue
                n = want[p.shard_dim] // p.num_shards
                a, b = p.shard_index * n, (p.shard_index + 1) * n
                p.copy_(sl[a:b] if p.shard_dim == 0 else sl[:, a:b])
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


def load_weights(model: nn.Module, path: str | None, ctx: ParallelContext) -> str:
    """Fill ``model``'s shards from ``path`` (None: keep the seeded initialisation);
    returns the kind loaded (``seed``, ``dcp`` or ``hf``).

    Raises:
        ServeError: see :func:`weights_kind`, :func:`load_dcp`, :func:`load_hf`.
    """
    kind = weights_kind(path)
    if kind == "dcp":
        from parcompile.runtime.checkpoint import newest

        if not (Path(path) / ".metadata").is_file():
            path = str(newest(path)[0])
        load_dcp(model, path, ctx)
    elif kind == "hf":
        load_hf(model, path)
    return kind


__all__ = ["weights_kind", "load_weights", "load_dcp", "load_hf", "HF_LLAMA"]
