"""LoRA's outputs (``train.method = lora``): a Hugging Face PEFT adapter and, on request
(``train.lora_merge``), the weights with the adapters merged back.

The adapter is what ``peft.PeftModel.from_pretrained(model, directory)`` loads onto
transformers' model (checked against peft 0.21.2's ``save_pretrained``): ``adapter_config.json``
(``peft_type`` LORA, ``task_type`` CAUSAL_LM, ``r``, ``lora_alpha``, ``lora_dropout``,
``target_modules`` as Hugging Face module names) and ``adapter_model.safetensors`` whose keys
are the transformers module names under ``base_model.model.``:
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (r, in) and
``...lora_B.weight`` (out, r), in the model's dtype. Merged: ``W + (alpha / r) B A`` per
adapted weight (PEFT's ``merge_and_unload``), computed in fp32, written as any Hugging Face
checkpoint (:func:`parcompile.runtime.state.hf_export.write_hf_checkpoint`), with the adapter
beside it in ``adapter/``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch

from parcompile.core.hf_weights import hf_family, tensor_map
from parcompile.core.model import ModelKeys
from parcompile.core.outputs import HF_MARKER, HF_OUTPUT_HELP, hf_output_problem
from parcompile.runtime.machine.dtypes import TORCH_DTYPES
from parcompile.runtime.state.hf_export import write_hf_checkpoint
from parcompile.runtime.state.weights import WeightsError

#: the infix of an adapter tensor's name (ours: ``layers.0.attn.wq.lora_A.weight``)
ADAPTER_PARTS = (".lora_A.weight", ".lora_B.weight")


def adapter_names(state: dict[str, torch.Tensor]) -> list[str]:
    """Our adapter tensors of ``state``, sorted."""
    return sorted(k for k in state if k.endswith(ADAPTER_PARTS))


def _hf_module(model: ModelKeys, base: str, tmap) -> str:
    """The transformers module name of our linear ``base`` (``layers.0.attn.wq`` ->
    ``model.layers.0.self_attn.q_proj``), from the family's tensor map."""
    srcs = tmap.get(f"{base}.weight")
    if not srcs or not srcs[0].name.endswith(".weight"):
        raise WeightsError(f"{base} has no Hugging Face module of its own to carry a LoRA adapter")
    return srcs[0].name[:-len(".weight")]


def peft_tensors(state: dict[str, torch.Tensor], model: ModelKeys, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """PEFT's adapter tensors (its safetensors names, module docstring) of ``state``."""
    tmap = tensor_map(model, hf_family(model))
    out = {}
    for name in adapter_names(state):
        base, part = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
        out[f"base_model.model.{_hf_module(model, base, tmap)}.{part}.weight"] = state[name].to(dtype).contiguous()
    return out


def adapter_config(model: ModelKeys, state: dict[str, torch.Tensor], lora: dict, base: str | None) -> dict:
    """``adapter_config.json`` (module docstring): the keys PEFT's ``LoraConfig`` reads, the
    rest left to its defaults; ``base``: ``base_model_name_or_path``, what PEFT writes there
    (``PeftModel.save_pretrained`` fills it with the base model's ``name_or_path``, the name
    or path it was loaded from, or None: peft 0.21.2 ``src/peft/peft_model.py``): the
    directory the run's ``init_from`` loaded, or None for weights drawn from ``seed``."""
    tmap = tensor_map(model, hf_family(model))
    targets = sorted({_hf_module(model, n.rsplit(".", 2)[0], tmap).rsplit(".", 1)[1] for n in adapter_names(state)})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora["rank"], "lora_alpha": lora["alpha"],
            "lora_dropout": lora["dropout"], "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
            "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "base_model_name_or_path": base}


def merged(state: dict[str, torch.Tensor], lora: dict) -> dict[str, torch.Tensor]:
    """``state`` without its adapters, each adapted weight ``W + (alpha / r) B A`` (fp32
    sums, cast back to ``W``'s dtype)."""
    out = {k: v for k, v in state.items() if not k.endswith(ADAPTER_PARTS)}
    scale = lora["alpha"] / lora["rank"]
    for name in adapter_names(state):
        if name.endswith(".lora_A.weight"):
            base = name[:-len(".lora_A.weight")]
            w = out[f"{base}.weight"]
            delta = state[f"{base}.lora_B.weight"].float() @ state[name].float()
            out[f"{base}.weight"] = (w.float() + scale * delta).to(w.dtype)
    return out


def _write_adapter_files(directory: Path, state, model: ModelKeys, lora: dict, base: str | None) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = peft_tensors(state, model, TORCH_DTYPES[model.dtype])
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = adapter_config(model, state, lora, base)
    (directory / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write_lora_output(state: dict[str, torch.Tensor], model: ModelKeys, out_dir: str | os.PathLike, lora: dict,
                      tokenizer_files: Iterable[str | os.PathLike] = (), *, generation_config: dict | None = None,
                      run: dict | None = None, force: bool = False) -> Path:
    """Write ``hf_output`` of a LoRA run from our global tensors ``state`` (the frozen
    weights and the adapters): the PEFT adapter (with the tokenizer files), or with
    ``lora["merge"]`` the merged Hugging Face checkpoint and the adapter in ``adapter/``
    (module docstring). Atomic, and replacing only an earlier output of parcompile, as
    :func:`parcompile.runtime.state.hf_export.write_hf_checkpoint`.

    Raises:
        WeightsError: no adapter in ``state``; a targeted weight without a Hugging Face
            module of its own; ``out_dir`` as :func:`write_hf_checkpoint` refuses it.
    """
    if not adapter_names(state):
        raise WeightsError("the weights hold no LoRA adapter (lora_A / lora_B tensors)")
    base = lora.get("base")
    if lora.get("merge"):
        out = write_hf_checkpoint(merged(state, lora), model, out_dir, tokenizer_files,
                                  generation_config=generation_config, run=run, force=force)
        _write_adapter_files(out / "adapter", state, model, lora, base)
        marker = json.loads((out / HF_MARKER).read_text())
        marker["files"] = sorted(set(marker["files"]) | {"adapter"})
        (out / HF_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        return out
    problem = hf_output_problem(out_dir, run=run, force=force)
    if problem:
        raise WeightsError(problem, HF_OUTPUT_HELP)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        for f in tokenizer_files:
            shutil.copy2(f, tmp / Path(f).name)
        _write_adapter_files(tmp, state, model, lora, base)
        marker = {"written_by": "parcompile", "files": sorted(f.name for f in tmp.iterdir())}
        if run is not None:
            marker["run"] = run
        (tmp / HF_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
