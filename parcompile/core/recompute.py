"""``parallel.recompute`` (SPEC 1, `parallel`): the three modes and Megatron-Core's
module-level selective recomputation, a list of ``--recompute-modules`` names.

Megatron-Core (NVIDIA/Megatron-LM d98e8a6, ``megatron/core/transformer/transformer_config.py``
``recompute_modules``; default ``["core_attn"]``, read only with
``--recompute-granularity selective``) names the modules below. Where each is applied, at the
same commit:

=================  ===============================================================  ==================
name               what is recomputed (Megatron-Core)                               checkpoint
=================  ===============================================================  ==================
``core_attn``      the attention core (``transformer_block.py`` / ``attention.py``)  keeps its inputs
``moe_act``        the experts' activation, probabilities applied inside it          drops its output
                   (``moe/experts.py`` ``TEGroupedMLP``: ``bias_act_func`` under
                   ``CheckpointWithoutOutput``, ``linear_fc2`` reads it)
``layernorm``      ``input_layernorm`` and ``pre_mlp_layernorm``                    drops its output
                   (``transformer_layer.py`` ``recompute_input_layernorm``)
``mla_up_proj``    MLA's up projections and RoPE (``multi_latent_attention.py``)     drops its output
``mlp``            a dense layer's MLP (``transformer_layer.py`` ``recompute_mlp``)  keeps its input
``moe``            the whole MoE layer, dispatch included (``moe/moe_layer.py``)     keeps its input
``shared_experts`` the shared experts (``moe/shared_experts.py``)                   keeps its input
=================  ===============================================================  ==================

"keeps its inputs": ``tensor_parallel.checkpoint`` holds the module's inputs and reruns its
forward in backward; "drops its output": ``CheckpointWithoutOutput`` frees the module's output
once its consumers have saved it and rebuilds it before their backward, so neither the module's
output nor the consumers' copies of it are kept. ``recompute = selective`` is ``[core_attn]``
(Megatron-Core's default list).
"""

from __future__ import annotations

from typing import Union

#: Megatron-Core's ``--recompute-modules`` names parcompile prices and runs (module docstring)
RECOMPUTE_MODULES: tuple[str, ...] = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                                      "shared_experts")

#: the modules whose checkpoint drops their output (``CheckpointWithoutOutput``)
OUTPUT_DISCARDING: frozenset[str] = frozenset({"moe_act", "layernorm", "mla_up_proj"})

#: the three modes of ``parallel.recompute``
MODES: tuple[str, ...] = ("none", "selective", "full")

#: a ``parallel.recompute`` value: a mode or a tuple of module names
Recompute = Union[str, tuple]


def is_module_list(recompute: Recompute) -> bool:
    """True for a list of modules (``recompute = [moe_act, layernorm]``)."""
    return isinstance(recompute, tuple)


def modules_of(recompute: Recompute) -> frozenset[str]:
    """The Megatron-Core modules ``recompute`` recomputes: its list, ``{core_attn}`` for
    ``selective`` (Megatron-Core's default list), nothing for ``none`` and ``full`` (full
    recomputation is of whole layers, not modules)."""
    if is_module_list(recompute):
        return frozenset(recompute)
    return frozenset({"core_attn"}) if recompute == "selective" else frozenset()


def recompute_words(recompute: Recompute) -> str:
    """``recompute`` as the spec writes it: ``none``, ``selective``, ``full`` or
    ``[moe_act, layernorm]``."""
    return "[" + ", ".join(recompute) + "]" if is_module_list(recompute) else str(recompute)


__all__ = ["RECOMPUTE_MODULES", "OUTPUT_DISCARDING", "MODES", "Recompute", "is_module_list", "modules_of",
           "recompute_words"]
