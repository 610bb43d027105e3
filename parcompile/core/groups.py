"""Process groups, exactly as Megatron-Core's two ``RankGenerator`` s make them (the ground
floor: standard library only).

Megatron-Core (``megatron/core/parallel_state.py``) lays ranks out on a mesh whose axes
follow ``order`` fastest-varying first (default ``tp-cp-ep-dp-pp``). A group of the
axes ``t1-t2...`` holds the ranks that differ only in those coordinates; within a
group the ranks enumerate the masked coordinates fastest-first, and groups enumerate
the remaining coordinates fastest-first.

* the dense generator: ``tp, cp, dp, pp`` with ``ep = 1`` -> groups ``tp``, ``cp``,
  ``dp``, ``pp``, ``dp_cp`` (the ``dp-cp`` group dense gradients are reduced over);
* the expert generator: ``tp = expert_tp, ep, dp = expert_dp, cp = 1, pp`` -> groups
  ``ep``, ``expert_tp``, ``expert_dp`` (parallel folding);
* ``embedding``: the first and last rank of each pp group (one rank when pp = 1).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Protocol



class Layout(Protocol):
    """What the groups read of a layout (a ``parcompile.config.schema.ParallelConfig``, or
    any object with these attributes): the degrees and Megatron-Core's ``order`` string."""

    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    expert_tp: int
    expert_dp: int
    order: str


def _strides(sizes: list[int]) -> list[int]:
    out, acc = [], 1
    for s in sizes:
        out.append(acc)
        acc *= s
    return out


def masked_groups(sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Rank groups over the masked axes of a mesh of ``sizes`` (fastest-varying first).

    Group ``g`` (enumerating the unmasked coordinates) lists, for each rank index ``j``
    in it (enumerating the masked coordinates), the rank whose masked digits are those
    of ``j`` and unmasked digits those of ``g``; the same arithmetic as Megatron-Core's
    ``generate_masked_orthogonal_rank_groups``.
    """
    stride = _strides(sizes)
    offsets = [0]   # the masked coordinates' offsets, group index fastest-first
    bases = [0]     # the unmasked coordinates' offsets, group order
    for size, st, k in zip(sizes, stride, mask):
        steps = [c * st for c in range(size)]
        if k:
            offsets = [o + x for x in steps for o in offsets]
        else:
            bases = [b + x for x in steps for b in bases]
    # the masked strides grow at least as fast as the digits they weigh, so each group
    # lists its ranks in increasing order (already sorted)
    return [[b + o for o in offsets] for b in bases]


class RankGenerator:
    """Megatron-Core's rank generator for one set of degrees and an ``order`` string.

    Axes missing from ``order`` must have degree 1 (they are appended).

    Raises:
        ValueError: an axis of degree > 1 is missing from ``order``, or both ``ep`` and
            ``cp`` exceed 1 (Megatron-Core keeps them in separate generators).
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str):
        if ep > 1 and cp > 1:
            raise ValueError("ep and cp cannot both exceed 1 in one rank generator")
        size = {"tp": tp, "ep": ep, "dp": dp, "pp": pp, "cp": cp}
        names = [t for t in order.lower().split("-") if t]
        for n, s in size.items():
            if n not in names:
                if s != 1:
                    raise ValueError(f"{n} = {s} but order {order!r} does not name {n}")
                names.append(n)
        self.order = names
        self.sizes = [size[n] for n in names]
        self.world_size = tp * ep * dp * pp * cp

    def get_ranks(self, token: str) -> list[list[int]]:
        """Groups of the axes in ``token`` (``"dp"``, ``"dp-cp"`` ...)."""
        want = set(token.split("-"))
        return masked_groups(self.sizes, [n in want for n in self.order])


def rank_groups(par: Layout) -> dict[str, list[list[int]]]:
    """Every group of every axis of ``par`` (SPEC 3 ``groups``): ``tp``, ``cp``, ``dp``,
    ``pp``, ``dp_cp``, ``ep``, ``expert_tp``, ``expert_dp``, ``embedding``, and with HSDP
    ``dp_shard`` and ``dp_replicate`` (:func:`hsdp_groups`). Each group is a
    sorted rank list; groups of an axis come in Megatron-Core's order."""
    dense = RankGenerator(par.tp, 1, par.dp, par.pp, par.cp, par.order)
    expert = RankGenerator(par.expert_tp, par.ep, par.expert_dp, par.pp, 1, par.order)
    out = {
        "tp": dense.get_ranks("tp"),
        "cp": dense.get_ranks("cp"),
        "dp": dense.get_ranks("dp"),
        "pp": dense.get_ranks("pp"),
        "dp_cp": dense.get_ranks("dp-cp"),
        "ep": expert.get_ranks("ep"),
        "expert_tp": expert.get_ranks("tp"),
        "expert_dp": expert.get_ranks("dp"),
    }
    out["embedding"] = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in out["pp"]]
    out.update(hsdp_groups(out["dp_cp"], getattr(par, "dp_replicate", 1)))
    return out   # each group is already sorted (masked_groups)


def hsdp_groups(dp_cp: list[list[int]], replicate: int) -> dict[str, list[list[int]]]:
    """HSDP's groups (``parallel.dp_replicate > 1``; empty otherwise): each ``dp_cp`` group of
    ``n`` ranks split into ``replicate`` shard groups of ``s = n / replicate`` consecutive
    members (``dp_shard``) and ``s`` replicate groups of every ``s``-th member
    (``dp_replicate``): torchtitan's ``dp_replicate`` x ``fsdp`` mesh, the shard dim fastest
    (torchtitan 0.3.0 ``torchtitan/distributed/parallel_dims.py`` ``build_mesh``), so with
    Megatron-Core's order (tp fastest, then cp, then dp) a shard group stays inside a node
    when ``tp * cp * dp_shard`` fits one."""
    if replicate <= 1:
        return {}
    shard = [g[i * (len(g) // replicate):(i + 1) * (len(g) // replicate)] for g in dp_cp for i in range(replicate)]
    rep = [g[j::len(g) // replicate] for g in dp_cp for j in range(len(g) // replicate)]
    return {"dp_shard": sorted(shard), "dp_replicate": sorted(rep)}


def groups_placement(groups: list[list[int]], domain: int) -> tuple[int, int]:
    """``(k, nodes)`` of a list of rank groups on domains of ``domain`` consecutive ranks
    (NVLink domains: the node, or a larger NVSwitch domain): ``k`` the fewest ranks one group
    has on any domain it touches, ``nodes`` the most domains one group spans; ``(1, 1)`` for
    no groups. What the network model (analysis/estimate.py ``Link``) reads of a layout."""
    k, nodes = None, 1
    for g in groups:
        counts: dict[int, int] = {}
        for r in g:
            counts[r // domain] = counts.get(r // domain, 0) + 1
        if counts:
            k = min(counts.values()) if k is None else min(k, min(counts.values()))
            nodes = max(nodes, len(counts))
    return (k or 1), nodes


def axis_placement(par: Layout, axis: str, domain: int) -> tuple[int, int]:
    """:func:`groups_placement` of the groups of ``axis`` (a key of :func:`rank_groups`)
    without building them: each group is a base rank plus fixed offsets, and how a group
    falls on domains of ``domain`` ranks depends only on its base modulo ``domain``; the
    bases' residues are built axis by axis. Exact; the work
    is the group size times at most ``domain`` residues."""
    if axis in ("dp_shard", "dp_replicate"):   # HSDP's: split from dp_cp's (hsdp_groups)
        if getattr(par, "dp_replicate", 1) <= 1:
            return 1, 1                        # no HSDP: no such groups (what the groups give), none built
        return groups_placement(rank_groups(par).get(axis, []), domain)
    pp_ends = axis == "embedding"
    if pp_ends:
        axis = "pp"
    if axis in ("ep", "expert_tp", "expert_dp"):
        gen = RankGenerator(par.expert_tp, par.ep, par.expert_dp, par.pp, 1, par.order)
        token = {"ep": ("ep",), "expert_tp": ("tp",), "expert_dp": ("dp",)}[axis]
    else:
        gen = RankGenerator(par.tp, 1, par.dp, par.pp, par.cp, par.order)
        token = ("dp", "cp") if axis == "dp_cp" else (axis,)
    stride = _strides(gen.sizes)
    offsets = [0]
    for name, size, st in zip(gen.order, gen.sizes, stride):
        if name in token:
            offsets = [o + c * st for c in range(size) for o in offsets]
    if pp_ends and len(offsets) > 1:
        offsets = [0, max(offsets)]
    residues = {0}
    for name, size, st in zip(gen.order, gen.sizes, stride):
        if name in token or size == 1:
            continue
        period = domain // math.gcd(st, domain)
        steps = [(c * st) % domain for c in range(min(size, period))]
        residues = {(r + x) % domain for r in residues for x in steps}
    return _placement_of(sorted(residues), offsets, domain)


def _placement_of(bases: list[int], offsets: list[int], domain: int) -> tuple[int, int]:
    """:func:`groups_placement` of the groups ``base + offsets`` (one per base): a layout
    search asks it of groups of thousands of ranks, so each group's domains are counted by
    :class:`collections.Counter` (its counting loop is in C) and no group is built."""
    k, nodes = None, 1
    for b in bases:
        counts = Counter([(b + o) // domain for o in offsets]).values()
        if counts:
            least = min(counts)
            k = least if k is None else min(k, least)
            nodes = max(nodes, len(counts))
    return (k or 1), nodes


def stage_ranks(pp_groups: list[list[int]], stage: int) -> list[int]:
    """The ranks of pipeline rank ``stage``: the ``stage``-th member of every pp group."""
    return sorted(g[stage] for g in pp_groups)
