"""The mesh axes and the names of the process groups built from them (SPEC 1 `parallel`, 3 `groups`).

:data:`GROUP_AXES` names every axis a plan has a group for; the tuples below are its subsets,
each in the order its users rely on. Derived groups: ``dp_cp`` (the ranks that average dense
gradients, dp x cp), ``expert_tp`` / ``expert_dp`` (the expert layout, Megatron-Core's
expert-tensor and expert-data parallel groups) and ``embedding`` (the first and last pipeline
stage, which share a tied embedding), and with HSDP ``dp_shard`` / ``dp_replicate`` (the
shard and replicate groups splitting ``dp_cp``; plans without HSDP do not list them).
"""

from __future__ import annotations

#: every group a plan's ``groups`` holds, in the order the runtime creates them
GROUP_AXES: tuple[str, ...] = ("tp", "cp", "dp", "pp", "dp_cp", "ep", "expert_tp", "expert_dp", "embedding",
                                "dp_shard", "dp_replicate")

#: the five degrees a spec sets, in the order of SPEC's default ``order`` ("tp-cp-ep-dp-pp",
#: fastest-varying first); ``parallel.order`` is a permutation of them
DEGREE_AXES: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")

#: the degree (link family) each group's traffic is accounted to: ``comm.per_step`` per SPEC
#: axis, and the link (inside a node or across) the estimate times it on
AXIS_FAMILY: dict[str, str] = {"tp": "tp", "expert_tp": "tp", "dp": "dp", "dp_cp": "dp", "expert_dp": "dp",
                               "pp": "pp", "embedding": "pp", "cp": "cp", "ep": "ep",
                               "dp_shard": "dp", "dp_replicate": "dp"}

#: the groups fp16's overflow flag (dynamic loss scaling, ``found_inf``) is max-reduced over,
#: in this order: the plan's ``found_inf`` collectives and ``runtime/train/loss_scale.py``
FOUND_INF_AXES: tuple[str, ...] = ("tp", "pp", "dp_cp")

__all__ = ["GROUP_AXES", "DEGREE_AXES", "AXIS_FAMILY", "FOUND_INF_AXES"]
