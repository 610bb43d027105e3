"""LoRA's plan facts, standard library only (SPEC "New names": ``train.method = lora``,
``lora_rank``, ``lora_alpha``, ``lora_dropout``, ``lora_targets``): which linear layers
take adapters, and the elements an adapter holds per tensor-parallel rank. The front end's
checks (:mod:`parcompile.frontend.checks_lora`) and the memory and time analyses read the
same rules.

LoRA (Hu et al. 2021, as Hugging Face PEFT implements it): a frozen linear ``y = W x`` with
``W`` of shape (out, in) gains ``y += (alpha / r) * B (A x)``, ``A`` (r, in) and ``B``
(out, r) the trainable adapter weights.

Targets: the 2-D weights of the decoder layers' linear layers (attention and MLP
projections: ours ``wq wk wv wo w1 w3 w2``, Hugging Face's ``q_proj k_proj v_proj o_proj
gate_proj up_proj down_proj``), named either way (:func:`target_names`);
``"all-linear"`` is every one of them, PEFT's ``INCLUDE_LINEAR_LAYERS_SHORTHAND`` (which
leaves the output layer out: huggingface/peft src/peft/tuners/tuners_utils.py
``_maybe_include_all_linear_layers``). Routed experts and routers take no adapter here.

Tensor parallelism, as Megatron-Bridge's ``ParallelLinearAdapter`` splits an adapter
(NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/peft/utils.py @
067f987df03b8355b03192d88d70f1709fedf51a): on a column-parallel base (``input_is_parallel
= False``) ``linear_in`` (A) is a ``ColumnParallelLinear(in, r, gather_output=True)``,
split over r, its r-wide output all-gathered, and ``linear_out`` (B) a
``ColumnParallelLinear(r, out, gather_output=False)``, split over out like the base; on a
row-parallel base (``input_is_parallel = True``) ``linear_in`` is a
``RowParallelLinear(in, r, input_is_parallel=True)``, split over in like the base, its r-wide
output all-reduced, and ``linear_out`` a ``ColumnParallelLinear(r, out, gather_output=True)``,
split over out, its output all-gathered. Either way every adapter tensor is split over tp:
``r (in + out) / tp`` elements per rank, and r must be a multiple of tp (Megatron-Core's
``divide``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from parcompile.core.hf_weights import expected_shapes, hf_family, tensor_map
from parcompile.core.families.base import HFWeightsError

#: ``lora_targets``' word for every linear layer of the decoder layers (PEFT's shorthand)
ALL_LINEAR = "all-linear"

_LAYER_LINEAR = re.compile(r"^layers\.(\d+)\.(.+)\.weight$")


@dataclass(frozen=True)
class LoraLinear:
    """One linear layer that can take an adapter: ``module`` our name (``layers.3.attn.wq``),
    ``leaf`` its last part (``wq``), ``hf_leaf`` Hugging Face's (``q_proj``; ``leaf`` when
    the model has no Hugging Face family), ``out_features`` x ``in_features`` the base
    weight's global shape."""

    module: str
    leaf: str
    hf_leaf: str
    out_features: int
    in_features: int

    def adapter_elements(self, rank: int, tp: int = 1) -> int:
        """Elements of A (r, in) and B (out, r) on one tensor-parallel rank: ``r (in + out) /
        tp`` (module docstring: Megatron-Bridge splits both over tp)."""
        return rank * (self.in_features + self.out_features) // tp


def lora_linears(model) -> tuple[LoraLinear, ...]:
    """Every linear layer of ``model`` (a :class:`parcompile.core.model.ModelKeys` or the
    compiler's ModelConfig) that can take an adapter, in layer order: the 2-D weights of
    the decoder layers but the routed experts' and the routers' (module docstring)."""
    hf = _hf_leaves(model)
    out = []
    for name, shape in expected_shapes(model).items():
        m = _LAYER_LINEAR.match(name)
        if m is None or len(shape) != 2 or ".experts." in name or ".router" in name:
            continue
        module = name[:-len(".weight")]
        leaf = module.rsplit(".", 1)[1]
        out.append(LoraLinear(module, leaf, hf.get(name, leaf), shape[0], shape[1]))
    return tuple(out)


def _hf_leaves(model) -> dict[str, str]:
    """Our weight name -> the Hugging Face module's last name part (``q_proj``), from the
    family's tensor map (:func:`parcompile.core.hf_weights.tensor_map`); empty when no
    family writes the model."""
    try:
        tmap = tensor_map(model, hf_family(model))
    except HFWeightsError:
        return {}
    return {name: srcs[0].name.rsplit(".", 2)[-2] for name, srcs in tmap.items()
            if srcs and srcs[0].name.endswith(".weight")}


def target_names(model) -> dict[str, str]:
    """Every name ``lora_targets`` accepts for ``model`` -> our leaf name: ours (``wq``) and
    Hugging Face's (``q_proj``)."""
    out: dict[str, str] = {}
    for lin in lora_linears(model):
        out.setdefault(lin.leaf, lin.leaf)
        out.setdefault(lin.hf_leaf, lin.leaf)
    return out


def unknown_targets(model, targets: tuple[str, ...]) -> list[str]:
    """The entries of ``targets`` that name no linear layer of ``model`` (``"all-linear"``
    names them all)."""
    names = target_names(model)
    return [t for t in targets if t != ALL_LINEAR and t not in names]


def targeted(model, targets: tuple[str, ...]) -> tuple[LoraLinear, ...]:
    """The linear layers ``targets`` names, in layer order (module docstring); unknown names
    are ignored (the checks report them: :func:`unknown_targets`)."""
    linears = lora_linears(model)
    if ALL_LINEAR in targets:
        return linears
    names = target_names(model)
    leaves = {names[t] for t in targets if t in names}
    return tuple(lin for lin in linears if lin.leaf in leaves)


def scaling(rank: int, alpha: float) -> float:
    """The adapter's output scale ``alpha / r`` (PEFT's ``LoraLayer.scaling`` without rsLoRA)."""
    return alpha / rank


def lora_settings(cfg) -> dict:
    """What a generated training program holds as its ``LORA`` constant for ``cfg`` (a
    SpecConfig with ``train.method = lora``): ``rank``, ``alpha``, ``dropout``, the
    targeted linears' leaf names (ours: ``wq``...) sorted, and ``merge`` (``lora_merge``:
    what ``hf_output`` holds)."""
    t = cfg.train
    return {"rank": t.lora_rank, "alpha": float(t.lora_alpha), "dropout": float(t.lora_dropout),
            "modules": sorted({lin.leaf for lin in targeted(cfg.model, t.lora_targets)}), "merge": t.lora_merge}
