"""LoRA (``train.method = lora``, issue 49) in the exports: what each engine's config says for
the adapters :mod:`parcompile.core.lora` plans (Hugging Face PEFT's: one ``A`` (r, in) and one
``B`` (out, r) per targeted projection, scaled by ``alpha / r``, dropout on the adapter's
input), and what it cannot say (an error naming the engine's rule). The engines' other
settings are their exporters'.

- Megatron-Bridge 0.3.1 (NVIDIA-NeMo/Megatron-Bridge tag v0.3.1, commit
  9c9dd848966322fc3ed7706747ec13219ef49dda): ``ConfigContainer.peft``
  (``src/megatron/bridge/training/config.py`` line 1342), run by ``finetune()``
  (``src/megatron/bridge/training/finetune.py``, which needs ``checkpoint.pretrained_checkpoint``;
  ``ConfigContainer.validate`` asserts it for PEFT, config.py line 1589). Its ``LoRA``
  (``src/megatron/bridge/peft/lora.py``) adapts the fused ``linear_qkv`` and ``linear_fc1``
  with one adapter each: one ``A`` shared by the query, key and value (by the gate and up
  projections), another model than PEFT's. ``CanonicalLoRA``
  (``src/megatron/bridge/peft/canonical_lora.py``: "This follows more closely with
  Huggingface's implementation of LoRA") keeps one adapter per projection: ``linear_q``,
  ``linear_k``, ``linear_v``, ``linear_proj``, ``linear_fc1_gate``, ``linear_fc1_up``,
  ``linear_fc2`` (:data:`MEGATRON_BRIDGE_MODULES`), ``dim`` r, ``alpha`` (scale ``alpha / dim``,
  ``src/megatron/bridge/peft/utils.py`` ``ParallelLinearAdapter``), ``dropout`` at
  ``dropout_position = "pre"`` (the adapter's input, as PEFT); ``A`` starts Xavier-normal where
  PEFT's starts Kaiming-uniform (a note). Its ``LoRALinearSplitQKV.forward`` calls ``adapter_q``,
  ``adapter_k`` and ``adapter_v`` each (``LoRALinearSplitFC1UpGate.forward`` ``adapter_gate`` and
  ``adapter_up``), which are None for an untargeted one (a TypeError at the first step; so at
  main, 067f987df03b8355b03192d88d70f1709fedf51a, too): the query, key and value are targeted
  together or not at all, and so are the gate and up projections. Its names match by suffix, so ``linear_fc1``'s and
  ``linear_fc2``'s adapters would also go on a MoE model's routed experts, which parcompile
  does not adapt: refused.
- torchtitan 0.3.0 (the PyPI wheel's ``torchtitan/components/lora.py``, the same file as
  pytorch/torchtitan main at b5bcd76c66d0acb1a08b176d9639425bc55e0b2a; added by #3264, commit
  74181b1e873a7be7a7d736bc5b1fa5d760d948e1, after v0.2.2, which has none):
  ``LoRAConverter.Config(rank, alpha, target_modules)``, a model converter handed to
  ``llama3.model_registry(flavor, converters=[...])`` (``torchtitan/models/llama3/__init__.py``);
  its ``LoRALinear`` is ``base + (alpha / rank) * lora_b(lora_a(x))``, ``lora_a``
  Kaiming-uniform, ``lora_b`` zero, every other weight frozen, and no dropout (a dropout is
  refused). ``target_modules`` match the last name of the model config tree: ``wq``, ``wkv``
  (one config that builds both ``wk`` and ``wv``: the key and value are adapted together or
  not at all), ``wo``, ``w1``, ``w2``, ``w3`` (:data:`TORCHTITAN_MODULES`), with the query,
  key and value unfused (``fuse_qkv=False``: a fused ``wqkv`` would take one adapter). Under
  tp, ``lora_a`` of a column-parallel base is replicated, not split over r (a note: the
  plan's adapter memory per rank is Megatron-Bridge's split).
- vLLM 0.33.0 serves the adapter on the frozen base model: ``--enable-lora``,
  ``--max-lora-rank`` (``vllm/config/lora.py`` ``MaxLoRARanks``: :data:`VLLM_MAX_LORA_RANKS`;
  the adapter's r rounded up to one of them) and ``--lora-modules name=path``
  (``vllm/entrypoints/common/cli_args.py`` ``LoRAParserAction``: ``name=path`` split at its
  ``=``, so only for a path without ``,`` or ``=``; else a JSON object); ``vllm/engine/arg_utils.py`` ``EngineArgs.add_cli_args``.
- DeepSpeed 0.19's config has no LoRA: a DeepSpeed user wraps the model with Hugging Face
  PEFT (``peft.get_peft_model(model, LoraConfig(...))``) before ``deepspeed.initialize``, which
  then optimizes, offloads and shards only the adapters' states (its optimizer takes the
  parameters that require gradients). The export writes the ZeRO config and the
  ``LoraConfig`` to build (:func:`peft_lora_config`) in a note, as it does for the model.
- Megatron-LM's ``pretrain_gpt.py`` has no LoRA: refused (:data:`LORA_REFUSED`).
"""

from __future__ import annotations

import json
import re
import shlex

from parcompile.analysis.lora import is_lora
from parcompile.core.lora import targeted
from parcompile.exporters.common import Export, comments, fmt_num
from parcompile.exporters.serve import SERVE_DTYPE
from parcompile.plan import Plan

#: why a training target does not carry ``train.method = lora``: the export would train every weight
LORA_REFUSED = {
    "megatron": "Megatron-LM's pretrain_gpt.py has no LoRA (NVIDIA's LoRA is Megatron-Bridge's `peft`: "
                "export --to megatron-bridge)",
}
#: our projection -> Megatron-Bridge 0.3.1 CanonicalLoRA's target name (module docstring)
MEGATRON_BRIDGE_MODULES = {"wq": "linear_q", "wk": "linear_k", "wv": "linear_v", "wo": "linear_proj",
                           "w1": "linear_fc1_gate", "w3": "linear_fc1_up", "w2": "linear_fc2"}
#: our projection -> torchtitan 0.3.0's llama3 model config name (module docstring)
TORCHTITAN_MODULES = {"wq": "wq", "wk": "wkv", "wv": "wkv", "wo": "wo", "w1": "w1", "w3": "w3", "w2": "w2"}
#: vLLM 0.33.0's --max-lora-rank values (vllm/config/lora.py MaxLoRARanks)
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_MLP = ("w1", "w2", "w3")


def lora_leaves(plan: Plan) -> list[str]:
    """Our leaf names of the targeted projections (``wq``...), sorted."""
    t = plan.config.train
    return sorted({lin.leaf for lin in targeted(plan.config.model, t.lora_targets)})


def _alpha(plan: Plan) -> int | float:
    a = float(plan.config.train.lora_alpha)
    return int(a) if a.is_integer() else a


def _mapped(plan: Plan, names: dict[str, str], engine: str, errors: list[str]) -> list[str]:
    """The engine's target names for the plan's targets in the order of ``names``; an
    error for a projection it has no name for, and for routed experts a name would reach."""
    leaves = lora_leaves(plan)
    missing = [leaf for leaf in leaves if leaf not in names]
    if missing:
        errors.append(f"lora_targets {', '.join(missing)}: {engine} has no LoRA target for "
                      + ("this projection" if len(missing) == 1 else "these projections"))
    if plan.config.model.experts and any(leaf in _MLP for leaf in leaves):
        errors.append(f"lora_targets with MLP projections on a MoE model: {engine}'s MLP target names also match "
                      "the routed experts' projections, which parcompile's LoRA leaves frozen; target the attention "
                      "projections only")
    return list(dict.fromkeys(name for leaf, name in names.items() if leaf in leaves))   # the engine's order


def megatron_bridge_peft(plan: Plan) -> tuple[dict[str, object] | None, list[str], list[str]]:
    """Megatron-Bridge's ``CanonicalLoRA`` keyword arguments for a LoRA ``plan`` (None for full
    training), the notes and the errors (module docstring)."""
    if not is_lora(plan.config):
        return None, [], []
    t, notes, errors = plan.config.train, [], []
    leaves = set(lora_leaves(plan))
    for group, names, module in ((("wq", "wk", "wv"), "q_proj, k_proj and v_proj", "LoRALinearSplitQKV"),
                                 (("w1", "w3"), "gate_proj and up_proj", "LoRALinearSplitFC1UpGate")):
        if 0 < len(leaves.intersection(group)) < len(group):
            errors.append(f"lora_targets: Megatron-Bridge's CanonicalLoRA runs every adapter of its {module} "
                          f"(an untargeted one is None there and fails the first step); target {names} together")
    peft = {"target_modules": _mapped(plan, MEGATRON_BRIDGE_MODULES, "Megatron-Bridge's CanonicalLoRA", errors),
            "dim": t.lora_rank, "alpha": _alpha(plan), "dropout": float(t.lora_dropout), "dropout_position": "pre"}
    notes.append("LoRA: CanonicalLoRA, one adapter per projection as Hugging Face PEFT's (Megatron-Bridge's LoRA "
                 "shares one A between the fused query/key/value and gate/up projections); its A starts "
                 "Xavier-normal (PEFT's Kaiming-uniform); finetune() starts from checkpoint.pretrained_checkpoint, a "
                 "Megatron checkpoint: convert the Hugging Face one with Megatron-Bridge's AutoBridge.import_ckpt")
    return peft, notes, errors


def megatron_bridge_pretrained(plan: Plan) -> str:
    """``checkpoint.pretrained_checkpoint`` of a LoRA export: the Megatron checkpoint converted
    from ``init_from`` (``<init_from>-megatron``), or a placeholder without one."""
    src = plan.config.train.init_from
    return f"{src.rstrip('/')}-megatron" if src else "PRETRAINED_MEGATRON_CHECKPOINT"


def torchtitan_lora(plan: Plan, version: str) -> tuple[dict[str, object] | None, list[str], list[str]]:
    """torchtitan's ``LoRAConverter.Config`` keyword arguments for a LoRA ``plan`` (None for full
    training), the notes and the errors; ``version`` ``"0.3"`` or ``"0.2"`` (no LoRA)."""
    if not is_lora(plan.config):
        return None, [], []
    if version != "0.3":
        return None, [], ["method = lora: torchtitan 0.2.2 has no LoRA (its LoRAConverter came with 0.3.0, "
                          "pytorch/torchtitan #3264); export --torchtitan-version 0.3"]
    t, notes, errors = plan.config.train, [], []
    leaves = lora_leaves(plan)
    if ("wk" in leaves) != ("wv" in leaves):
        errors.append("lora_targets: torchtitan's llama3 builds the key and value projections from one config "
                      "(wkv), so LoRAConverter adapts both or neither; target k_proj and v_proj together")
    if t.lora_dropout:
        errors.append(f"lora_dropout {fmt_num(t.lora_dropout)}: torchtitan's LoRALinear has no dropout; use "
                      "lora_dropout = 0, or export --to megatron-bridge")
    conv = {"rank": t.lora_rank, "alpha": float(t.lora_alpha),
            "target_modules": _mapped(plan, TORCHTITAN_MODULES, "torchtitan's LoRAConverter", errors)}
    if plan.data["degrees"]["tp"] > 1:
        notes.append("LoRA under tp: torchtitan keeps a column-parallel projection's lora_a whole on every tp rank "
                     "(split over r in the plan's memory, as Megatron-Bridge splits it)")
    notes.append("LoRA: load the base weights with checkpoint.initial_load_path (initial_load_in_hf for a Hugging "
                 "Face checkpoint); torchtitan's optimizer takes only the adapters (the parameters needing gradients)")
    return conv, notes, errors


def peft_lora_config(plan: Plan) -> str:
    """Hugging Face PEFT's ``LoraConfig(...)`` for a LoRA ``plan`` as Python source: r, alpha,
    dropout and Hugging Face's module names of the targets (what ``hf_output`` writes in
    ``adapter_config.json``)."""
    t = plan.config.train
    names = sorted({lin.hf_leaf for lin in targeted(plan.config.model, t.lora_targets)})
    return (f"peft.LoraConfig(r={t.lora_rank}, lora_alpha={_alpha(plan)!r}, lora_dropout={float(t.lora_dropout)!r}, "
            f"target_modules={names!r}, task_type=\"CAUSAL_LM\")")


def deepspeed_lora_note(plan: Plan) -> list[str]:
    """The note of a DeepSpeed export of a LoRA ``plan`` (module docstring); empty otherwise."""
    if not is_lora(plan.config):
        return []
    return [f"LoRA: DeepSpeed's config has no LoRA; train.py wraps the model with model = peft.get_peft_model(model, "
            f"{peft_lora_config(plan)}) before deepspeed.initialize(model=model, model_parameters=[p for p in "
            "model.parameters() if p.requires_grad], ...), so ZeRO shards and offloads the adapters' gradients "
            "and optimizer states only"]


def vllm_max_lora_rank(rank: int) -> int | None:
    """The smallest of :data:`VLLM_MAX_LORA_RANKS` at least ``rank``; None above 512."""
    return next((r for r in VLLM_MAX_LORA_RANKS if r >= rank), None)


def vllm_lora_export(plan: Plan) -> Export:
    """``--to vllm`` of a LoRA training ``plan``: ``vllm serve`` of the base model (``init_from``)
    with the adapter ``hf_output`` writes (``--enable-lora --max-lora-rank --lora-modules``), or
    of the merged weights for ``lora_merge``; the context, dtype and seed the fine-tune ran with.
    The serving layout is not planned here: a note says to plan a serve spec."""
    cfg = plan.config
    t, m = cfg.train, cfg.model
    notes, errors = [], []
    out = t.hf_output or "HF_OUTPUT"
    if not t.hf_output:
        notes.append("adapter: the spec names no hf_output; put the directory the run wrote the PEFT adapter to "
                     "for HF_OUTPUT")
    if t.lora_merge:
        model, lora = out, []
        notes.append(f"lora_merge: serving the merged weights in {out}; its adapter/ is the PEFT adapter, served "
                     f"on the base model with --enable-lora --lora-modules NAME={out}/adapter")
    else:
        model = t.init_from or "MODEL"
        if not t.init_from:
            notes.append("weights: the spec names no init_from; put the base model's Hugging Face directory for MODEL")
        rank = vllm_max_lora_rank(t.lora_rank)
        if rank is None:
            errors.append(f"lora_rank {t.lora_rank}: vLLM serves adapters of rank at most "
                          f"{VLLM_MAX_LORA_RANKS[-1]} (--max-lora-rank)")
            rank = VLLM_MAX_LORA_RANKS[-1]
        name = re.sub(r"[^A-Za-z0-9._-]", "_", cfg.name)
        # LoRAParserAction: `name=path` is item.split("=") into two (a path with `=` or `,` would
        # not be): the JSON object then
        module = f"{name}={out}" if not {",", "="} & set(out) else json.dumps({"name": name, "path": out})
        lora = [("--enable-lora", None), ("--max-lora-rank", str(rank)), ("--lora-modules", module)]
        notes.append(f"LoRA: requests name the adapter as the model {name!r}; --max-lora-rank {rank}: vLLM's "
                     f"smallest allowed max-lora-rank at or above lora_rank {t.lora_rank}")
    notes.append("layout: a training spec plans no server; plan one with a serve spec (weights = the base model) "
                 "and add these flags to its export")
    args = lora + [("--max-model-len", str(m.seq_len)), ("--dtype", SERVE_DTYPE[m.dtype]), ("--seed", str(t.seed))]
    launch = f"vllm serve {shlex.quote(model)}"
    lines = [f"# vLLM server for the LoRA fine-tune `{cfg.name}` (exported by parcompile)"]
    lines += comments("error", errors) + comments("note", notes)
    body = [f"    {flag}" + ("" if v is None else f" {shlex.quote(v)}") for flag, v in args]
    lines += [launch + " \\"] + [b + " \\" for b in body[:-1]] + [body[-1]]
    return Export("vllm", "\n".join(lines) + "\n", notes, launch, f"{cfg.name}_vllm.sh", errors)


def lora_errors(plan: Plan, target: str) -> list[str]:
    """The export errors of a LoRA ``plan`` for a training ``target`` that has no LoRA
    (:data:`LORA_REFUSED`); none for full training."""
    if not is_lora(plan.config) or target not in LORA_REFUSED:
        return []
    return [f"method = lora: {LORA_REFUSED[target]}; the export would train every weight. Train with "
            f"`parcompile run` (its hf_output is a PEFT adapter), or export with method = full"]


__all__ = ["LORA_REFUSED", "MEGATRON_BRIDGE_MODULES", "TORCHTITAN_MODULES", "VLLM_MAX_LORA_RANKS",
           "lora_leaves", "megatron_bridge_peft", "megatron_bridge_pretrained", "torchtitan_lora", "peft_lora_config",
           "deepspeed_lora_note", "vllm_max_lora_rank", "vllm_lora_export", "lora_errors"]
