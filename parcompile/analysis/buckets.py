"""Gradient buckets on the plan's side: the rule itself (units, partition, ZeRO-3's
gathers, reductions per step, buckets in flight) is :mod:`parcompile.core.buckets`,
shared with the runtime; this module adds what reads the analysis's stage parameters for
plan.json (:func:`buckets_to_dict`) and re-exports the rule's names for its importers.
The sharded state bytes per bucket are :func:`parcompile.analysis.memory.stage_state_bytes`.
"""

from __future__ import annotations

from parcompile.core.buckets import (EMBEDDING_UNITS, GRAD_BYTES, OUTPUT_UNITS, Bucket, GradUnit, bucket_element_bytes,
                                     bucket_layers, bucket_positions, buckets_in_flight, head_reads_embedding,
                                     holds_output, is_layer_bucket, needed_in_backward, partition, reduce_counts,
                                     reshard_after_forward, shard_elements, stage_buckets,
                                     unit_order_key, unit_position, zero3_gather_counts, zero3_gathered,
                                     zero3_just_in_time)


def buckets_to_dict(sp, bucket_size: int) -> dict:
    """One stage's entry of plan.json ``comm.grad_buckets.per_stage``: per kind (dense,
    expert) the buckets of :func:`parcompile.core.buckets.stage_buckets` of ``sp`` (a
    :class:`~parcompile.analysis.params.StageParams`), each ``{"chunk", "elements", "units"}``."""
    dense, expert = stage_buckets(sp, bucket_size)

    def rows(bs: list[Bucket]) -> list[dict]:
        return [{"chunk": b.chunk, "elements": b.elements, "units": list(b.units)} for b in bs]

    return {"stage": sp.stage, "dense": rows(dense), "expert": rows(expert)}


__all__ = ["GRAD_BYTES", "GradUnit", "Bucket", "partition", "stage_buckets", "shard_elements",
           "buckets_to_dict", "unit_order_key", "is_layer_bucket", "bucket_layers",
           "reshard_after_forward", "zero3_gathered", "zero3_gather_counts",
           "reduce_counts", "buckets_in_flight", "bucket_element_bytes", "unit_position",
           "bucket_positions", "zero3_just_in_time", "needed_in_backward", "holds_output", "head_reads_embedding",
           "EMBEDDING_UNITS", "OUTPUT_UNITS"]
