"""What a decoder layer keeps for backward under Megatron-Core's module-level recomputation
(``recompute = [moe_act, layernorm, ...]``, :mod:`parcompile.core.recompute`) and under
Megatron-Core's MoE kernels (``engine = megatron``): the rules
:func:`parcompile.analysis.memory.saved_bytes` applies.

Module recomputation (NVIDIA/Megatron-LM d98e8a6, :mod:`parcompile.core.recompute`'s table):

* a module under ``tensor_parallel.checkpoint`` (``core_attn``, ``mlp``, ``moe``,
  ``shared_experts``) keeps only the tensors its ops read from outside it (its inputs, and the
  operands gathered inside it: context-parallel k and v, expert_tp rows); what its ops save
  of each other and their extras (masks, log-sum-exp, the experts' activations) are rebuilt;
* a module under ``CheckpointWithoutOutput`` (``layernorm``, ``mla_up_proj``) does the same
  and its output is freed too: no consumer keeps it (the linear after ``input_layernorm``
  keeps no input; the attention core keeps no q, k, v after MLA's up projections, but for
  the copies it makes of them: k and v gathered over cp, the padded v of the generated
  program's core; :func:`kept_with_modules`);
* ``moe_act`` frees the experts' activation output (``linear_fc2``'s input): of the
  ``experts`` op's activations (gate, up and their product for a gated MLP; pre- and
  post-activation otherwise) the last one.

Megatron-Core's MoE kernels (the same commit), whatever is recomputed:

* the router's gating GEMM (``moe/moe_utils.py`` ``RouterGatingLinearFunction``) saves its
  16-bit input and weight and casts them inside: no fp32 copies of the input
  (:func:`megatron_router_attrs`);
* the router's weights are applied inside the experts' activation (``moe/experts.py``
  ``TEGroupedMLP.forward``: ``bias_act_func`` multiplies by ``permuted_probs``), so the
  combine keeps no expert outputs, only its permutation indices and the weights.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from parcompile.core.model import GATED_ACTIVATIONS
from parcompile.core.recompute import OUTPUT_DISCARDING, Recompute, is_module_list, modules_of
from parcompile.ir.graph import Graph
from parcompile.ir.ops import Trait, spec
from parcompile.ir.recompute import node_modules

#: the suffix of a saved FP8 cast (memory.py ``FP8_COPY``)
_FP8_SUFFIX = "#fp8"


def module_regions(graph: Graph, recompute: Recompute) -> dict[str, tuple[int, frozenset[str]]] | None:
    """Per op of a decoder layer, ``(layer, modules)``: the recomputed modules (of
    ``recompute``'s list) whose region holds it (:func:`parcompile.ir.recompute.node_modules`);
    None when ``recompute`` is not a list of modules. The generated program runs each module
    as Megatron-Core does (``core_attn``, ``mlp``, ``moe``, ``shared_experts`` checkpointed;
    ``moe_act``'s, ``layernorm``'s and ``mla_up_proj``'s outputs freed:
    runtime/model/discard.py), so one rule prices both."""
    if not is_module_list(recompute):
        return None
    mods = modules_of(recompute)
    return {nd.name: (nd.op.layer, node_modules(nd) & mods) for nd in graph.nodes() if nd.op.layer is not None}


def kept_with_modules(graph: Graph, nd, a: Mapping[str, Any], keep: list[str], x: int, gathered: int,
                      regions: Mapping[str, tuple[int, frozenset[str]]], nbytes: Callable[[str], int]
                      ) -> tuple[list[str], int]:
    """What the layer op ``nd`` (attributes ``a``) keeps through the forward under module
    recomputation (module docstring): ``(keep, extra)`` from what it saves when nothing is
    recomputed (``keep`` tensor names, ``x`` bytes of extras, ``gathered`` bytes of gathered
    operands: :func:`parcompile.analysis.memory._node_saves`) and ``regions``
    (:func:`module_regions`); ``nbytes``: a kept tensor's bytes on one rank.

    A freed output (``mla_up_proj``'s key or value) an attention core holds in a copy of its
    own still costs its bytes there (:func:`_core_copies`)."""
    layer, mine = regions.get(nd.name, (None, frozenset()))
    wrapped = mine - {"moe_act"}
    if wrapped:
        # a checkpointed op keeps only what is made outside its module (of the same layer)
        keep = [t for t in keep if not (regions.get(_producer(t), (None, frozenset()))[0] == layer
                                        and regions[_producer(t)][1] & wrapped)]
        x = gathered
    elif "moe_act" in mine and nd.kind == "experts":
        mats = 3 if a["activation"] in GATED_ACTIVATIONS else 2
        x -= (x - gathered) // mats   # the activation's output, linear_fc2's input
    dropped = OUTPUT_DISCARDING - {"moe_act"}
    gone = [t for t in keep if regions.get(_producer(t), (None, frozenset()))[1] & dropped]
    if gone and nd.has_trait(Trait.ATTENTION):
        copies = _core_copies(graph, nd, a, bool(wrapped), gathered)
        x += sum(nbytes(t) for t in gone if _producer(t) in copies)
    return [t for t in keep if t not in gone], x


def _core_copies(graph: Graph, nd, a: Mapping[str, Any], wrapped: bool, gathered: int) -> set[str]:
    """The inputs of the attention core ``nd`` whose values it keeps in copies of its own,
    which freeing the inputs leaves: k and v all-gathered over cp (``gathered`` > 0: the
    core keeps the gathered tensors, checkpointed or not: runtime/model/core_attention.py
    ``attention``), else v padded to the head dim by a kernel that pads it (``pads_v``: the
    generated program's fused core, ``_padded_core``), the core not checkpointed."""
    ins = graph.inputs(nd.name)
    if gathered:
        return {ins[1], ins[2]}
    if not wrapped and spec(nd.kind).kernel(a).pads_v and a.get("v_head_dim", a["head_dim"]) < a["head_dim"]:
        return {ins[2]}
    return set()


def _producer(tensor: str) -> str:
    """The op whose output a saved tensor's name stands for (an FP8 cast's: its source's)."""
    return tensor[:-len(_FP8_SUFFIX)] if tensor.endswith(_FP8_SUFFIX) else tensor


def megatron_router_attrs(a: Mapping[str, Any]) -> Mapping[str, Any]:
    """A router op's attributes as Megatron-Core runs it (module docstring): its 16-bit input
    saved, no fp32 copies (``fp32_input`` off)."""
    return {**a, "fp32_input": False} if a.get("fp32_input") else a


__all__ = ["module_regions", "kept_with_modules", "megatron_router_attrs"]
