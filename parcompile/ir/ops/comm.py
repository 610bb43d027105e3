"""The op kinds the passes insert: a layout conversion (``redistribute``: the one rule,
:func:`convert`), a pipeline stage boundary (``send_recv``) and a collective of the step
(``step_collective``), with the collectives each runs.
"""

from __future__ import annotations

from typing import Mapping

from parcompile.ir.ops.base import COMM_KINDS, Code, Collective, OpSpec, Trait, same_type
from parcompile.ir.types import Sharding, TensorType


def _scalar(a, ins):
    return TensorType((), "fp32")


def convert(src: Sharding, dst: Sharding, degrees: Mapping[str, int]) -> list[tuple[str, str]]:
    """The collectives that turn layout ``src`` into layout ``dst``, one per mesh axis
    that differs (axes of degree 1 never communicate). The one rule of the compiler:

    ========================  ==========================  ===============
    src on axis a             dst on axis a               collective
    ========================  ==========================  ===============
    partial                   replicated                  ``all_reduce``
    partial                   split(d)                    ``reduce_scatter``
    split(d)                  replicated                  ``all_gather``
    split(d)                  split(d')                   ``all_to_all``
    replicated                split(d)                    ``split`` (local, free)
    ========================  ==========================  ===============

    A nested split (``seq: cp*tp``) is one split per axis, each inside the ones before it:
    ``seq: cp*tp -> seq: cp`` is an all-gather over tp of the cp rank's part, ``seq: cp
    -> seq: cp*tp`` a local split, ``partial(tp), seq: cp -> seq: cp*tp`` a
    reduce-scatter over tp (Megatron-Core's sequence parallelism inside context
    parallelism). The same dim split over ``a`` inside different outer axes is an
    ``all_to_all`` over ``a``.

    Returns ``[(kind, axis), ...]`` sorted by axis; empty when nothing is needed.

    Raises:
        ValueError: the conversion is impossible (anything -> partial).
    """
    out: list[tuple[str, str]] = []
    for axis in sorted(src.axes | dst.axes):
        if degrees.get(axis, 1) == 1:
            continue
        s_part, d_part = axis in src.partial, axis in dst.partial
        s_dim, d_dim = src.dim_of(axis), dst.dim_of(axis)
        if s_part and d_part:
            continue
        if d_part:
            raise ValueError(f"cannot produce partial({axis}) from {src}")
        if s_part:
            out.append(("reduce_scatter" if d_dim else "all_reduce", axis))
        elif s_dim and d_dim:
            # the same dim, split inside the same outer axes (a nested split, ``seq: cp*tp``):
            # the same slices; otherwise the slices move between ranks
            if s_dim != d_dim or _outer(src, axis, degrees) != _outer(dst, axis, degrees):
                out.append(("all_to_all", axis))
        elif s_dim:
            out.append(("all_gather", axis))
        elif d_dim:
            out.append(("split", axis))
    return out


def _outer(s: Sharding, axis: str, degrees: Mapping[str, int]) -> tuple[str, ...]:
    """The axes of more than one rank that a nested split puts outside ``axis``."""
    return tuple(a for a in s.outer_axes(axis) if degrees.get(a, 1) > 1)


def dual(s: Sharding) -> Sharding:
    """The layout of the gradient a tensor of layout ``s`` needs: the same splits, no
    partial axes (the gradient of a partial sum is the full gradient on every rank)."""
    return s.without_partial()


# --- program row (:class:`Code`)

def _redistribute_code(a) -> Code:
    """A conversion inside a decoder layer as a runtime call, by its collectives
    (:func:`convert`'s rule): entering a tensor-parallel region replicated (its gradient
    all-reduced) or sequence-parallel (all-gathered, the gradient reduce-scattered); a
    partial sum all-reduced or reduce-scattered (when no op before it runs it itself)."""
    fwd = tuple((k, ax) for k, ax in a["fwd"] if k in COMM_KINDS)
    bwd = tuple((k, ax) for k, ax in a["bwd"] if k in COMM_KINDS)
    splits = [ax for k, ax in a["fwd"] if k == "split"]
    if not fwd and not bwd and len(splits) == 1 and a.get("_split_dim") is not None:
        # a replicated value split locally (each rank keeps its slice; no collective)
        ax, d = splits[0], a["_split_dim"]
        return Code(call=f"{{x}}.chunk(self.{ax}.size, dim={d})[self.{ax}.index]", var="",
                    comment=f"this rank's slice over {ax}")
    calls = {
        ((), (("all_reduce", "tp"),)): "rt.copy_to_tp({x}, self.tp)",
        ((("all_gather", "tp"),), (("reduce_scatter", "tp"),)): "rt.enter_tp({x}, self.tp, sequence_parallel=True)",
        ((("all_reduce", "tp"),), ()): "rt.reduce_from_tp({x}, self.tp)",
        ((("reduce_scatter", "tp"),), (("all_gather", "tp"),)): "rt.leave_tp({x}, self.tp, sequence_parallel=True)",
        # MLA's replicated down projections under sequence parallelism: the gradient is whole
        # on every rank, so the backward keeps this rank's slice (no collective)
        ((("all_gather", "tp"),), ()): "rt.gather_replicated({x}, self.tp, sequence_parallel=True)",
    }
    if (fwd, bwd) not in calls:
        raise ValueError(f"no program code for the conversion forward {list(fwd)}, backward {list(bwd)}")
    return Code(call=calls[(fwd, bwd)], inline=False, var="")



def _conversion_collectives(node, degrees, local_in, local_out) -> list[Collective]:
    """A conversion's collectives: forward at the output's local size, backward at its gradient's."""
    a = node.op.attr_map
    where = a["where"]
    res = [Collective(kind, axis, local_out.nbytes, "forward", where) for kind, axis in a["fwd"] if kind in COMM_KINDS]
    g = node.grads[0].local_type(node.type, degrees) if node.grads else local_out
    return res + [Collective(kind, axis, g.nbytes, "backward", where) for kind, axis in a["bwd"] if kind in COMM_KINDS]


def _stage_collectives(node, degrees, local_in, local_out) -> list[Collective]:
    """A stage boundary: send and recv of the activation forward, of its gradient backward."""
    a = node.op.attr_map
    where = f"stage {a['src_stage']} -> {a['dst_stage']}"
    nb = local_out.nbytes
    return [
        Collective("send", "pp", nb, "forward", where, stage=a["src_stage"]),
        Collective("recv", "pp", nb, "forward", where, stage=a["dst_stage"]),
        Collective("send", "pp", nb, "backward", where, stage=a["dst_stage"]),
        Collective("recv", "pp", nb, "backward", where, stage=a["src_stage"]),
    ]


def _step_collectives(node, degrees, local_in, local_out) -> list[Collective]:
    a = node.op.attr_map
    return [Collective(a["op"], a["axis"], a["bytes"], "step", a["where"], per="step", count=int(a.get("count", 1)))]


#: the op kinds of this module
DEFINITIONS = [
    OpSpec("redistribute", same_type, arity=1, code=_redistribute_code, collectives=_conversion_collectives,
           traits=frozenset({Trait.CONVERSION, Trait.EXPRESSION})),
    OpSpec("send_recv", same_type, arity=1, collectives=_stage_collectives,
           traits=frozenset({Trait.STAGE_TRANSFER, Trait.NOT_AN_OP})),
    OpSpec("step_collective", _scalar, arity=0, collectives=_step_collectives,
           traits=frozenset({Trait.STEP_COLLECTIVE, Trait.NOT_AN_OP})),
]
