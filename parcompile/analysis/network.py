"""The network model (``docs/clusters.md``): how the groups of an axis sit on NVLink domains
(:class:`Link`: ranks per domain, domains spanned, the links' bandwidths and latencies) and
how long one collective takes on them (:func:`collective_time`: the algorithm NCCL would
pick, :func:`collective_algorithm`, among ring, tree, NVLS and all-to-all, with NCCL's
tuning figures). The step-time estimate (:mod:`parcompile.analysis.estimate`), the serving
analysis and the search's bounds time every collective with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

from parcompile.analysis.efficiency import Efficiency, efficiency
from parcompile.core.axes import AXIS_FAMILY
from parcompile.core.groups import groups_placement


#: NCCL's tree all-reduce reaches 0.92 of the ring's bus bandwidth at large messages
#: (NVIDIA/nccl src/graph/tuning.cc, ``busBw * .92`` for NCCL_ALGO_TREE, commit 5067397)
TREE_BANDWIDTH = 0.92
#: an NVLS (NVLink SHARP) collective's fixed latency in steps of ``intra_node_latency``
#: (tuning.cc: 25 us NVLS hardware latency against a ring step's 3.4-5 us)
NVLS_LATENCY_STEPS = 5
#: the all-reduce message size at which the algorithm is chosen (NCCL chooses per size; one
#: choice per group keeps every collective's time affine in its bytes, what the search's
#: bounds rest on): 64 MiB, the order of a gradient bucket, an FSDP unit or a tensor-parallel
#: activation at 8k tokens
REFERENCE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Link:
    """How the groups of one axis sit on the machines, and what the network gives them
    (the network model, ``docs/clusters.md``).

    ``k``: the fewest ranks one group has in an NVLink domain (``cluster.domain_size``
    consecutive ranks: the node, or an NVL72 rack); ``domains``: the most domains one group
    spans (1: the group is inside NVLink). Bandwidths are bytes/s per GPU, one direction,
    achieved at large messages: ``nvlink`` NCCL's ring bus bandwidth over NVLink
    (``intra_node_bw * eff.link``); ``nic`` a GPU's share of the network
    (``inter_node_bw * eff.net``: each GPU drives its own rail NIC); ``nvls`` the NVLS
    all-reduce's algorithm bandwidth (``intra_node_bw * eff.nvls``; 0 without NVLink SHARP).
    Latencies in seconds per step."""

    k: int
    domains: int
    intra_latency: float
    inter_latency: float
    nvlink: float
    nic: float
    nvls: float = 0.0

    @property
    def crosses(self) -> bool:
        """Whether a group spans NVLink domains (its traffic leaves through the NICs)."""
        return self.domains > 1

    def ring_bus_bw(self) -> float:
        """Ring bus bandwidth (bytes/s): NVLink inside a domain; across domains, ``k`` rails
        carry a group's ring (one NCCL channel per NIC), bounded by NVLink when ``k > 1``."""
        if not self.crosses:
            return self.nvlink
        net = self.k * self.nic
        return min(self.nvlink, net) if self.k > 1 else net


@dataclass(frozen=True)
class Algorithm:
    """One collective as :func:`collective_algorithm` times it: NCCL's algorithm name
    (``ring``, ``tree``, ``nvls``, ``nvls_tree``, ``alltoall``, ``p2p``), ``alpha`` seconds of
    latency, ``per_byte`` seconds per byte of the collective's ``nbytes``, and ``bus_bw``
    (nccl-tests' bus bandwidth, bytes/s, at large messages)."""

    name: str
    alpha: float
    per_byte: float
    bus_bw: float

    def seconds(self, nbytes: float) -> float:
        return self.alpha + nbytes * self.per_byte


def _bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor (``doc/PERFORMANCE.md``) in bytes per byte of the
    collective's ``nbytes`` as this module counts them: all-reduce ``2(n-1)/n`` of the
    buffer; all-gather and all-to-all ``(n-1)/n`` of the gathered output; reduce-scatter
    ``n-1`` times the output shard; send 1."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "all_to_all"):
        return (n - 1) / n
    if op == "reduce_scatter":
        return float(n - 1)
    return 1.0


def _ring_alpha(op: str, n: int, link: Link) -> float:
    """The ring's latency: ``2(n-1)`` steps for an all-reduce, ``n-1`` otherwise, of which
    the ones that cross domains (``2(N-1)`` or ``N-1``) at ``inter_latency`` and the rest at
    ``intra_latency`` (NCCL tuning.cc, ring latency)."""
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    if not link.crosses:
        return steps * link.intra_latency
    inter = min(steps, 2 * (link.domains - 1) if op == "all_reduce" else link.domains - 1)
    if link.k == 1:
        inter = steps
    return (steps - inter) * link.intra_latency + inter * link.inter_latency


def collective_algorithms(op: str, n: int, link: Link) -> list[Algorithm]:
    """The algorithms NCCL has for ``op`` on a group of ``n`` ranks placed as ``link``
    (empty for a group of one, but for ``send``). Bus bandwidths (``B`` the collective's
    ``nbytes`` as :func:`_bus_factor` counts them; ``k``, ``N``, bandwidths: :class:`Link`):

    * inside a domain: ``ring`` at ``nvlink``; an all-reduce also ``nvls`` where the
      switches reduce (algorithm bandwidth ``nvls``, whatever ``n``: each GPU sends and
      receives its buffer once);
    * across domains: ``ring`` at :meth:`Link.ring_bus_bw` (``k`` NICs; one NIC when ``k = 1``);
      an all-reduce also ``tree`` (NCCL's double binary tree between domains, chains inside:
      0.92 of the ring's bandwidth, latency ``2((k-1) alpha_intra + ceil(log2 N) alpha_inter)``)
      and, with NVLink SHARP and ``k > 1``, ``nvls_tree`` (NVLS inside, a tree between
      domains: ``min(nvls * 2(k-1)/k, k * nic * (2 if N = 2 else 1))``, tuning.cc's two-node
      doubling);
    * ``all_to_all``: each rank sends ``(n-k)/n`` of its data through its own NIC (PXN
      routes it to the peer's rail) and ``(k-1)/n`` over NVLink, at once: ``max`` of the two;
      latency ``(k-1) alpha_intra + (n-k) alpha_inter``;
    * ``send``: one NIC across domains (``alpha_inter + B / nic``), else NVLink.

    Raises ValueError for an unknown ``op``."""
    if op == "recv":
        return [Algorithm("p2p", 0.0, 0.0, 0.0)]
    if op == "send":
        if link.crosses:
            return [Algorithm("p2p", link.inter_latency, 1 / link.nic, link.nic)]
        return [Algorithm("p2p", link.intra_latency, 1 / link.nvlink, link.nvlink)]
    if op not in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        raise ValueError(f"unknown collective {op!r}")
    if n <= 1:
        return []
    f = _bus_factor(op, n)
    k = max(1, min(link.k, n))
    if op == "all_to_all":
        if not link.crosses:
            return [Algorithm("alltoall", (n - 1) * link.intra_latency, f / link.nvlink, link.nvlink)]
        # seconds per byte of the gathered size: the network share and the NVLink share at once
        per = max((n - k) / n / link.nic, (k - 1) / n / link.nvlink)
        alpha = (k - 1) * link.intra_latency + (n - k) * link.inter_latency
        return [Algorithm("alltoall", alpha, per, f / per)]
    ring_bw = link.ring_bus_bw()
    out = [Algorithm("ring", _ring_alpha(op, n, link), f / ring_bw, ring_bw)]
    if op != "all_reduce":
        return out
    if not link.crosses:
        if link.nvls > 0 and n > 1:
            out.append(Algorithm("nvls", NVLS_LATENCY_STEPS * link.intra_latency, 1 / link.nvls, f * link.nvls))
        return out
    nodes = link.domains
    log_n = max(1, math.ceil(math.log2(nodes)))
    tree_bw = TREE_BANDWIDTH * ring_bw
    out.append(Algorithm("tree", 2 * ((k - 1) * link.intra_latency + log_n * link.inter_latency), f / tree_bw,
                         tree_bw))
    if link.nvls > 0 and k > 1:
        bw = min(link.nvls * 2 * (k - 1) / k, k * link.nic * (2 if nodes == 2 else 1))
        out.append(Algorithm("nvls_tree", NVLS_LATENCY_STEPS * link.intra_latency + 2 * log_n * link.inter_latency,
                             f / bw, bw))
    return out


@lru_cache(maxsize=1 << 16)
def collective_algorithm(op: str, n: int, link: Link) -> Algorithm | None:
    """The algorithm NCCL would pick for ``op`` over ``n`` ranks placed as ``link``: the
    fastest of :func:`collective_algorithms` for a message of :data:`REFERENCE_BYTES` (ties:
    the first listed, the ring); None for a group of one. One choice per (op, group), so a
    collective's time is affine in its bytes."""
    algos = collective_algorithms(op, n, link)
    if not algos:
        return None
    return min(algos, key=lambda a: a.seconds(REFERENCE_BYTES))


def collective_time(op: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds for one collective of ``nbytes`` (as :func:`_bus_factor` counts them) over a
    group of ``n`` ranks placed as ``link``: the algorithm :func:`collective_algorithm`
    picks; 0 for a group of one (but ``send``) and for ``recv``. Affine in ``nbytes`` with
    non-negative coefficients, and not decreasing with ``n``."""
    a = collective_algorithm(op, n, link)
    return a.seconds(nbytes) if a is not None else 0.0


def make_link(cluster, k: int, domains: int, eff: Efficiency | None = None) -> Link:
    """The :class:`Link` of groups with ``k`` ranks per NVLink domain spanning ``domains``
    domains on ``cluster`` (a ClusterConfig), with its preset's efficiencies."""
    eff = eff or efficiency(cluster)
    return Link(k, domains, cluster.intra_node_latency, cluster.inter_node_latency,
                cluster.intra_node_bw * eff.link, nic_share(cluster, k) * eff.net,
                cluster.intra_node_bw * eff.nvls if getattr(cluster, "nvls", False) else 0.0)


def nic_share(cluster, k: int) -> float:
    """Bytes/s of network (one direction, nominal) each of ``k`` ranks of one group in one
    NVLink domain drives: the node's network is ``inter_node_bw * gpus_per_node`` (each
    GPU's share) over ``nics_per_node`` NICs (default one per GPU, rail-optimised); the
    ``k`` ranks use ``min(k, NICs of the domain)`` of them (NCCL builds a channel per NIC,
    and with PXN a rank reaches a NIC of another rail through NVLink), shared equally. With
    one NIC per GPU that is ``inter_node_bw``; with fewer, larger NICs a group with few
    ranks per node gets more than its GPUs' shares, with more, smaller ones less."""
    gpn = cluster.gpus_per_node
    nics = getattr(cluster, "nics_per_node", None) or gpn
    domain = _domain(cluster)
    nic_bw = cluster.inter_node_bw * gpn / nics
    in_domain = max(1, nics * domain // gpn)
    k = max(1, k)
    return min(k, in_domain) * nic_bw / k


def _domain(cluster) -> int:
    return getattr(cluster, "domain_size", None) or cluster.gpus_per_node


def axis_link(cluster, groups: Mapping[str, list[list[int]]], axis: str, eff: Efficiency | None = None) -> Link:
    """The :class:`Link` of ``axis``'s groups (``groups[axis]``; none: one rank) on
    ``cluster``: where the groups fall on NVLink domains
    (:func:`~parcompile.core.groups.groups_placement`)."""
    k, domains = groups_placement(groups.get(axis) or [], _domain(cluster))
    return make_link(cluster, k, domains, eff)


def links_of(cluster, placements: Mapping[str, tuple[int, int]], eff: Efficiency | None = None) -> dict[str, Link]:
    """:class:`Link` per axis of :data:`~parcompile.core.axes.AXIS_FAMILY` from each axis's ``(k, domains)``
    (:func:`~parcompile.core.groups.axis_placement`; missing axes: one rank): what
    :func:`axis_link` finds from the groups, without building them (the search)."""
    return {a: make_link(cluster, *placements.get(a, (1, 1)), eff) for a in AXIS_FAMILY}


def axis_crosses_nodes(cluster, groups: Mapping[str, list[list[int]]], axis: str) -> bool:
    """Whether some group of ``axis`` has ranks in two NVLink domains (nodes)."""
    return groups_placement(groups.get(axis) or [], _domain(cluster))[1] > 1


#: NCCL's LL protocol on a ring (NVIDIA/nccl ``src/graph/tuning.cc`` @01afd20a: ``baseLat`` of
#: Ring/LL 3.6 us, ``hwLat`` NVLink Ring/LL 0.47 us per step, and LL's bus bandwidth a quarter
#: of the ring's for an all-reduce): what NCCL picks for the few-KB all-reduces of a decode step
NCCL_LL_BASE = 3.6e-6
NCCL_LL_STEP = 0.47e-6
NCCL_LL_BANDWIDTH = 0.25
#: ... across nodes: a step over the network 2.7 us (``hwLat`` NET Ring/LL), an NVLink step 1.8x
#: its one-node latency
NCCL_LL_NET_STEP = 2.7e-6
NCCL_LL_MULTINODE = 1.8


def serve_allreduce(nbytes: float, n: int, link: Link, engine, nccl: bool = True) -> tuple[str, float]:
    """``(algorithm, seconds)`` of one all-reduce of ``nbytes`` over ``n`` ranks placed as
    ``link`` in a serving engine's step (``engine``: a
    :class:`~parcompile.analysis.serve_engines.ServeEngine`), chosen by message size as the
    engine chooses:

    * the engine's own custom all-reduce where it has one, the group sits inside one NVLink
      domain, ``n`` is 2, 4, 6 or 8 and the message is below the engine's limit for ``n``
      (:meth:`~parcompile.analysis.serve_engines.ServeEngine.custom_limit`; vLLM's
      ``should_custom_ar``): ``oneshot`` (every rank reads its peers' buffers and
      reduces: ``latency + nbytes (n - 1) / nvlink``) for two ranks or below
      ``engine.oneshot_bytes`` (half of it for more than 4 ranks), else ``twoshot`` (a
      reduce-scatter then an all-gather through peer memory: ``latency + 2 nbytes (n - 1)
      / n / nvlink``), ``latency`` the engine's :attr:`allreduce_latency` (fitted per
      all-reduce of a decode step: the ranks' synchronisation dominates it, once;
      csrc/custom_all_reduce.cuh @c9eabec7);
    * otherwise NCCL (``nccl``: the stack's collective library is NCCL or RCCL), which picks
      per message the fastest of its LL ring (latency-bound: :data:`NCCL_LL_BASE` + ``2 (n -
      1)`` steps of :data:`NCCL_LL_STEP`, those across nodes :data:`NCCL_LL_NET_STEP` and the
      others 1.8x slower, a quarter of the ring's bandwidth) and the large-message algorithms
      of :func:`collective_algorithms`, never below the engine's ``allreduce_latency`` (every
      rank waits for the slowest, as in the custom all-reduce); another library (gloo on the
      CPU) the latter only (:func:`collective_time`).

    ``("none", 0.0)`` for a group of one."""
    if n <= 1:
        return "none", 0.0
    if engine is not None and not link.crosses and nbytes < engine.custom_limit(n):
        limit = engine.oneshot_bytes if n <= 4 else engine.oneshot_bytes // 2
        lat = engine.allreduce_latency
        if n == 2 or nbytes < limit:
            return "oneshot", lat + nbytes * (n - 1) / link.nvlink
        return "twoshot", lat + 2 * nbytes * (n - 1) / n / link.nvlink
    if not nccl:
        a = collective_algorithm("all_reduce", n, link)
        return a.name, a.seconds(nbytes)
    f = _bus_factor("all_reduce", n)
    steps, inter = 2 * (n - 1), (2 * (link.domains - 1) if link.crosses else 0)
    ll_step = NCCL_LL_STEP * (NCCL_LL_MULTINODE if link.crosses else 1.0)
    best = ("ll", NCCL_LL_BASE + (steps - inter) * ll_step + inter * NCCL_LL_NET_STEP
            + nbytes * f / (NCCL_LL_BANDWIDTH * link.ring_bus_bw()))
    for a in collective_algorithms("all_reduce", n, link):
        t = a.seconds(nbytes)
        if t < best[1]:
            best = (a.name, t)
    # in a serving engine's step every all-reduce also waits for the slowest rank: at least the
    # engine's own small all-reduce takes (its fitted latency), whichever library runs it
    floor = engine.allreduce_latency if engine is not None else 0.0
    return best[0], max(best[1], floor)


def replica_all_reduce_time(sharding, elements: int, links: Mapping[str, Link], cluster) -> float:
    """Seconds of HSDP's all-reduce of one gradient bucket's fp32 shard (``ceil(elements /
    shard)`` elements) over the replicate group (``sharding``: a
    :class:`~parcompile.core.data_parallel.DataParallelSharding` with ``replicate > 1``), on
    that group's link: FSDP2's 2-D mesh reduce-scatters over the shard group, then all-reduces
    the shard over the replicas (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``
    ``foreach_reduce``), once per step in the generated program."""
    link = links.get(sharding.replicate_group) or make_link(cluster, 1, 1)
    return collective_time("all_reduce", 4 * -(-elements // sharding.shard), sharding.replicate, link)

