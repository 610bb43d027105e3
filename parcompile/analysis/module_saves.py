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
  keeps no input; the attention core keeps no q, k, v after MLA's up projections);
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

from typing import Any, Mapping

from parcompile.core.model import GATED_ACTIVATIONS
from parcompile.core.recompute import OUTPUT_DISCARDING, Recompute, is_module_list, modules_of
from parcompile.ir.graph import Graph
from parcompile.ir.recompute import node_modules

#: the suffix of a saved FP8 cast (memory.py ``FP8_COPY``)
_FP8_SUFFIX = "#fp8"


#: the output-discarding modules the generated program does not run yet (it frees ``moe_act``'s
#: and ``layernorm``'s outputs: runtime/model/discard.py)
PROGRAM_KEEPS = frozenset({"mla_up_proj"})


def module_regions(graph: Graph, recompute: Recompute, program: bool = False
                   ) -> dict[str, tuple[int, frozenset[str]]] | None:
    """Per op of a decoder layer, ``(layer, modules)``: the recomputed modules (of
    ``recompute``'s list) whose region holds it (:func:`parcompile.ir.recompute.node_modules`);
    None when ``recompute`` is not a list of modules. ``program``: the plan is for the
    generated program itself (the ``cpu`` preset), which checkpoints ``core_attn``, ``mlp``,
    ``moe`` and ``shared_experts`` and frees ``moe_act``'s and ``layernorm``'s outputs but not
    yet ``mla_up_proj``'s: it is left out (:data:`PROGRAM_KEEPS`, priced as kept;
    frontend/checks_recompute.py warns)."""
    if not is_module_list(recompute):
        return None
    mods = modules_of(recompute) - (PROGRAM_KEEPS if program else frozenset())
    return {nd.name: (nd.op.layer, node_modules(nd) & mods) for nd in graph.nodes() if nd.op.layer is not None}


def kept_with_modules(graph: Graph, nd, a: Mapping[str, Any], keep: list[str], x: int, gathered: int,
                      regions: Mapping[str, tuple[int, frozenset[str]]]) -> tuple[list[str], int]:
    """What the layer op ``nd`` (attributes ``a``) keeps through the forward under module
    recomputation (module docstring): ``(keep, extra)`` from what it saves when nothing is
    recomputed (``keep`` tensor names, ``x`` bytes of extras, ``gathered`` bytes of gathered
    operands: :func:`parcompile.analysis.memory._node_saves`) and ``regions``
    (:func:`module_regions`)."""
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
    keep = [t for t in keep if not (regions.get(_producer(t), (None, frozenset()))[1] & dropped)]
    return keep, x


def _producer(tensor: str) -> str:
    """The op whose output a saved tensor's name stands for (an FP8 cast's: its source's)."""
    return tensor[:-len(_FP8_SUFFIX)] if tensor.endswith(_FP8_SUFFIX) else tensor


def megatron_router_attrs(a: Mapping[str, Any]) -> Mapping[str, Any]:
    """A router op's attributes as Megatron-Core runs it (module docstring): its 16-bit input
    saved, no fp32 copies (``fp32_input`` off)."""
    return {**a, "fp32_input": False} if a.get("fp32_input") else a


__all__ = ["module_regions", "kept_with_modules", "megatron_router_attrs"]
