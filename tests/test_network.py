"""The network model (analysis/estimate.py ``Link``, ``collective_algorithm``) against the
published nccl-tests bus bandwidths it was calibrated on (docs/clusters.md gives each
source), and the placement logic: a group with k ranks per node uses k NICs, a group inside
a node uses NVLink, a pipeline send between nodes uses one NIC, all-to-all across nodes
sends (n-k)/n of its data through each rank's NIC. Fast: no torchrun, no graphs."""

from __future__ import annotations

import pytest

from parcompile.analysis.estimate import (Link, axis_link, collective_algorithm, collective_time, make_link,
                                          REFERENCE_BYTES)
from parcompile.config.presets import cluster_preset
from parcompile.config.schema import ClusterConfig, ParallelConfig
from parcompile.core.groups import axis_placement, groups_placement, rank_groups

GB = 1e9
BIG = 8 * 2**30   # nccl-tests' largest size, where bus bandwidth peaks


def cluster(preset: str, nodes: int = 1) -> ClusterConfig:
    return ClusterConfig(name="c", preset=preset, **{**cluster_preset(preset, "bf16"), "nodes": nodes})


def bus_bw(op: str, n: int, link: Link, nbytes: float = BIG) -> float:
    """nccl-tests' bus bandwidth of the model's time at ``nbytes`` (its definitions:
    doc/PERFORMANCE.md; ``nbytes`` the all-reduce buffer / the gathered output)."""
    t = collective_time(op, nbytes if op != "reduce_scatter" else nbytes / n, n, link)
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_to_all": (n - 1) / n}[op]
    return nbytes * factor / t


def link_of(preset: str, nodes: int, gpus: int | None = None) -> tuple[int, Link]:
    """A group of ``gpus`` ranks per node on ``nodes`` nodes (all 8 by default)."""
    cl = cluster(preset, nodes)
    k = gpus or cl.gpus_per_node
    return k * nodes, make_link(cl, k, nodes)


# (preset, nodes, op, published bus bandwidth GB/s, source). Each is nccl-tests at 8 GB
# (or its peak), 8 GPUs per node; see docs/clusters.md, "Network model".
PUBLISHED = [
    # one DGX H100 / H200: NVLS all-reduce 479.4 (NVIDIA/nccl-tests#347, H100), 479.98
    # (Azure/AI-benchmarking-guide Azure_Results/ND_H200_v5_results.md @7f20e5f, H200)
    ("h100-sxm", 1, "all_reduce", 479.4, "nccl-tests#347"),
    ("h200", 1, "all_reduce", 479.98, "Azure ND H200 v5"),
    # ring / non-all-reduce collectives on NVLink 4: "effective NVLink bandwidth of
    # 370GB/s ... when running non-allreduce operations" (sjeaugey, nccl-tests#212)
    ("h100-sxm", 1, "all_gather", 370.0, "nccl-tests#212"),
    ("h100-sxm", 1, "reduce_scatter", 370.0, "nccl-tests#212"),
    ("h100-sxm", 1, "all_to_all", 370.0, "nccl-tests#212"),
    # multi-node H100 all-reduce with 8 x 400G NDR: about 380 GB/s at scale (GTC 2024,
    # quoted in NVIDIA/nccl#1649: NVLSTree 370-380, without SHARP about 380); 16 nodes
    ("h100-sxm", 16, "all_reduce", 380.0, "nccl#1649"),
    # two H100 nodes with NVLSTree: about 470 GB/s (nccl#2409 citing nccl-tests#309)
    ("h100-sxm", 2, "all_reduce", 470.0, "nccl#2409"),
    # one DGX A100 (no NVLS): ring all-reduce 231.58 (Azure ND A100 v4 @3bb66ca), 232.54
    # (NVIDIA/nccl#1048)
    ("a100-80gb", 1, "all_reduce", 231.58, "Azure ND A100 v4"),
]


@pytest.mark.parametrize("preset,nodes,op,published,source", PUBLISHED,
                         ids=[f"{p[0]}-{p[1]}n-{p[2]}" for p in PUBLISHED])
def test_bus_bandwidth_matches_nccl_tests(preset, nodes, op, published, source):
    n, link = link_of(preset, nodes)
    got = bus_bw(op, n, link) / GB
    assert abs(got / published - 1) <= 0.10, (source, got, published)


def test_all_to_all_across_nodes_runs_at_one_nic():
    # "Alltoall cannot aggregate the bandwidth of multiple NICs, so the performance you should
    # see is the performance of a single NIC"; NDR "should achieve up to 48-49GB/s per NIC"
    # (NVIDIA/nccl-tests#267, 6 nodes x 8 H100 with 8 x 400G) and 46-48 (nccl-tests#290):
    # the bytes each rank sends to other nodes over the time, 6 nodes x 8
    n, link = link_of("h100-sxm", 6)
    t = collective_time("all_to_all", BIG, n, link)
    per_nic = (n - 8) / n * BIG / t / GB
    assert 46 * 0.95 <= per_nic <= 49 * 1.05, per_nic


def test_a100_multinode_ring_is_bounded_by_the_nics_share():
    # DGX A100 with 4 HDR NICs per node (3 nodes, 24 GPUs): 100 GB/s theoretical, 96 peak
    # measured (NVIDIA/nccl-tests#119); the per-GPU share is 12.5 GB/s, 8 GPUs per node
    cl = ClusterConfig(name="c", preset="a100-80gb", **{**cluster_preset("a100-80gb", "bf16"), "nodes": 3,
                                                        "inter_node_bw": 12.5e9, "nics_per_node": 4})
    link = make_link(cl, 8, 3)
    assert abs(bus_bw("all_reduce", 24, link) / GB / 96 - 1) <= 0.10


def test_group_inside_a_node_uses_nvlink():
    cl = cluster("h100-sxm", 4)
    par = ParallelConfig(tp=8, dp=4)
    link = axis_link(cl, rank_groups(par), "tp")
    assert (link.k, link.domains) == (8, 1) and not link.crosses
    # an all-gather inside the node runs at NVLink's ring rate, never the NIC's
    assert collective_algorithm("all_gather", 8, link).bus_bw == pytest.approx(450e9 * 0.82)


def test_k_ranks_per_node_use_k_nics():
    cl = cluster("h100-sxm", 8)
    nic = cl.inter_node_bw * 0.94
    # FSDP over 32 ranks on 8 nodes (4 per node, tp 2): the ring crosses nodes on 4 rails
    par = ParallelConfig(tp=2, dp=32)
    link = axis_link(cl, rank_groups(par), "dp_cp")
    assert (link.k, link.domains) == (4, 8)
    ag = collective_algorithm("all_gather", 32, link)
    assert ag.name == "ring" and ag.bus_bw == pytest.approx(4 * nic)
    # one rank per node (tp 8 fills the node): one NIC
    one = axis_link(cl, rank_groups(ParallelConfig(tp=8, dp=8)), "dp_cp")
    assert (one.k, one.domains) == (1, 8)
    assert collective_algorithm("all_gather", 8, one).bus_bw == pytest.approx(nic)
    # 4 NICs' share is 4 times faster than one NIC's for the same bytes per rank
    big = 2**30
    t4 = collective_time("all_gather", 32 * big, 32, link)
    t1 = collective_time("all_gather", 32 * big, 32, make_link(cl, 1, 32))
    assert t1 / t4 == pytest.approx(4, rel=0.01)
    # k rails never beat NVLink: 8 per node is bounded by the ring on NVLink
    full = make_link(cl, 8, 4)
    assert collective_algorithm("all_gather", 32, full).bus_bw == pytest.approx(min(450e9 * 0.82, 8 * nic))


def test_pp_send_between_nodes_uses_one_nic():
    cl = cluster("h100-sxm", 2)
    par = ParallelConfig(tp=8, pp=2)
    link = axis_link(cl, rank_groups(par), "pp")
    assert link.crosses
    a = collective_algorithm("send", 2, link)
    assert a.name == "p2p" and a.bus_bw == pytest.approx(cl.inter_node_bw * 0.94)
    assert collective_time("send", 1e9, 2, link) == pytest.approx(cl.inter_node_latency + 1e9 / (50e9 * 0.94))
    inside = axis_link(cl, rank_groups(ParallelConfig(tp=2, pp=2, dp=2)), "pp")
    assert not inside.crosses and collective_algorithm("send", 2, inside).bus_bw == pytest.approx(450e9 * 0.82)


def test_all_to_all_across_nodes_sends_the_remote_share_through_each_nic():
    cl = cluster("h100-sxm", 8)
    nic, nv = cl.inter_node_bw * 0.94, cl.intra_node_bw * 0.82
    # ep 64 over 8 nodes, 8 per node: 56/64 of each rank's data leaves through its NIC
    link = make_link(cl, 8, 8)
    b = 64 * 2**20 * 64
    t = collective_time("all_to_all", b, 64, link)
    lat = 7 * cl.intra_node_latency + 56 * cl.inter_node_latency
    assert t == pytest.approx(lat + max(56 / 64 * b / nic, 7 / 64 * b / nv))
    # ep 16 over 2 nodes: half the data stays on NVLink, the NIC carries the other half
    two = make_link(cl, 8, 2)
    assert collective_time("all_to_all", b, 16, two) == pytest.approx(
        8 * cl.inter_node_latency + 7 * cl.intra_node_latency + b / 2 / nic)
    # inside a node: NVLink only
    assert collective_algorithm("all_to_all", 8, make_link(cl, 8, 1)).bus_bw == pytest.approx(nv)


def test_algorithm_choice():
    h = cluster("h100-sxm", 64)
    # inside a node: NVLS for an all-reduce over 4 or 8 GPUs, the ring for 2 (NVLS's
    # algorithm bandwidth is each GPU's, the ring's grows as n/(2(n-1)))
    assert collective_algorithm("all_reduce", 8, make_link(h, 8, 1)).name == "nvls"
    assert collective_algorithm("all_reduce", 2, make_link(h, 2, 1)).name == "ring"
    # no NVLink SHARP on A100: the ring
    a = cluster("a100-80gb", 64)
    assert collective_algorithm("all_reduce", 8, make_link(a, 8, 1)).name == "ring"
    # across many nodes with one rank each: the tree (log2 latency) beats the ring's 2(n-1)
    # steps at the reference size
    assert collective_algorithm("all_reduce", 512, make_link(a, 1, 512)).name == "tree"
    assert collective_algorithm("all_reduce", 4, make_link(a, 1, 4)).name == "ring"
    # NVLink SHARP with 8 per node across nodes: NVLSTree
    assert collective_algorithm("all_reduce", 128, make_link(h, 8, 16)).name == "nvls_tree"
    # all-gather and reduce-scatter across nodes: the ring only
    assert collective_algorithm("all_gather", 128, make_link(h, 8, 16)).name == "ring"
    assert collective_algorithm("all_reduce", 1, make_link(h, 1, 1)) is None
    assert collective_time("all_reduce", 1e9, 1, make_link(h, 1, 1)) == 0.0


def test_times_are_affine_in_bytes_and_grow_with_the_group():
    # the search's bounds rest on both (search/bounds.py step_floor, _base_work)
    h = cluster("h100-sxm", 64)
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"):
        for k, nodes in ((8, 1), (4, 1), (1, 16), (8, 16), (2, 2)):
            link = make_link(h, k, nodes)
            n = k * nodes
            t0, t1, t2 = (collective_time(op, b, n, link) for b in (1e6, 2e6, 3e6))
            assert t2 - t1 == pytest.approx(t1 - t0) and t1 >= t0
    for k in (1, 8):
        times = [collective_time("all_reduce", REFERENCE_BYTES, k * nodes, make_link(h, k, nodes))
                 for nodes in (2, 4, 8, 16, 64)]
        assert times == sorted(times)


@pytest.mark.parametrize("domain", [4, 8, 72])
def test_placement_without_groups_equals_the_groups(domain):
    for par in (ParallelConfig(tp=2, dp=16, pp=2), ParallelConfig(tp=4, cp=2, dp=6, pp=3),
                ParallelConfig(tp=1, dp=8, ep=4, pp=2), ParallelConfig(tp=2, dp=9, order="tp-cp-ep-pp-dp", pp=4),
                ParallelConfig(tp=2, dp=8, pp=2, zero=3, dp_replicate=2)):
        groups = rank_groups(par)
        for axis in sorted({*groups, "dp_shard", "dp_replicate"}):   # HSDP's axes: none without dp_replicate
            gs = groups.get(axis, [])
            assert axis_placement(par, axis, domain) == groups_placement(gs, domain), (par, axis)


def test_nvlink_domain_larger_than_a_node():
    # a GB200 NVL72 rack: 4 GPUs per node tray, 72 on one NVLink domain: tp 8 across two
    # trays is still NVLink
    cl = ClusterConfig(name="nvl72", gpus_per_node=4, nodes=18, nvlink_domain=72, nvls=True)
    link = axis_link(cl, rank_groups(ParallelConfig(tp=8, dp=9)), "tp")
    assert not link.crosses
    assert axis_link(cl.model_copy(update={"nvlink_domain": None}), rank_groups(ParallelConfig(tp=8, dp=9)),
                     "tp").crosses


def test_network_keys_in_a_spec():
    from parcompile.diagnostics import SpecError
    from parcompile.frontend import load_spec

    def spec(body: str) -> str:
        return ('cluster c from "h100-sxm" {\n' + body + '\n}\nmodel m from "llama3-8b" { }\n'
                "parallel { tp = 8 }\n")

    cl = load_spec(spec(""))[0].cluster
    assert (cl.nvls, cl.nics_per_node, cl.nvlink_domain, cl.domain_size) == (True, 8, None, 8)
    cl = load_spec(spec("nodes = 18\ngpus_per_node = 4\nnvlink_domain = 72\nnvls = false\nnics_per_node = 4"))[0].cluster
    assert (cl.nvls, cl.nics_per_node, cl.domain_size) == (False, 4, 72)
    assert load_spec('cluster c from "a100-80gb" { }\nmodel m from "llama3-8b" { }\nparallel { tp = 8 }\n'
                     )[0].cluster.nvls is False
    with pytest.raises(SpecError) as e:
        load_spec(spec("nvlink_domain = 0"), filename="n.par")
    assert "n.par:2:" in str(e.value)


def test_nics_per_node_decides_what_a_group_with_few_ranks_per_node_drives():
    """The node's network is inter_node_bw x gpus_per_node over nics_per_node NICs; a group
    with k ranks per node uses min(k, NICs) of them (was: nics_per_node changed nothing)."""
    from parcompile.analysis.estimate import nic_share

    base = cluster_preset("h100-sxm", "bf16")
    share = base["inter_node_bw"]

    def cl(nics):
        return ClusterConfig(name="c", preset="h100-sxm", **{**base, "nodes": 4, "nics_per_node": nics})

    # one NIC per GPU: every rank drives its own share, whatever k
    assert [nic_share(cl(8), k) for k in (1, 2, 8)] == [share] * 3
    # 2 NICs of 4 shares each: one rank drives a whole NIC (4 shares), 8 ranks share 2 NICs
    assert nic_share(cl(2), 1) == pytest.approx(4 * share)
    assert nic_share(cl(2), 8) * 8 == pytest.approx(8 * share)
    # many small NICs: a rank drives one of them
    assert nic_share(cl(64), 1) == pytest.approx(share / 8)
