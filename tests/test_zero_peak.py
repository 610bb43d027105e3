"""Issue 16, first item: ZeRO-2/3 lower the planned peak.

ZeRO 2 and 3 reduce-scatter every gradient bucket in each micro-batch's backward and keep
only the rank's fp32 shard across the step (DeepSpeed ZeRO-2, FSDP2), so the full fp32
gradients are never all alive at once: the plan holds the buckets in flight
(``grad_buckets_in_flight``, two adjacent buckets of a chunk at most) instead of all of
them. These tests hold the issue's "done when" figures on the plan.
"""

from __future__ import annotations

import pytest

import parcompile


def _llama3_8b(tp: int, zero: int) -> str:
    # 8 x H100, dp = 8 / tp, micro-batch 1, 4 micro-batches per step
    return f"""
model m from "llama3-8b" {{ }}
cluster c from "h100-sxm" {{ nodes = 1 }}
parallel {{
    tp = {tp}
    dp = auto
    zero = {zero}
    micro_batch = 1
    global_batch = {4 * 8 // tp}
}}
train {{ optimizer = adamw }}
"""


@pytest.mark.parametrize("tp", [1, 2])
def test_llama3_8b_peak_decreases_with_every_zero_stage(tp):
    """Llama-3 8B on 8 x H100 at tp 1 (dp 8) and tp 2 (dp 4), m = 4: the planned peak
    strictly decreases from zero 0 to 1 to 2 to 3 (issue 16: zero 2 and 3 used to hold
    every full fp32 gradient buffer through the backward and planned above zero 1)."""
    peaks = []
    for zero in range(4):
        plan = parcompile.compile(_llama3_8b(tp, zero)).data
        assert plan["schedule"]["num_microbatches"] == 4
        assert plan["degrees"]["dp"] == 8 // tp
        parts = plan["memory"]["per_stage"][0]["buffer_parts"]
        assert "full_grads" not in parts
        assert ("grad_buckets_in_flight" in parts) == (zero >= 2)
        peaks.append(plan["memory"]["peak"])
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3], [round(p / 2**30, 2) for p in peaks]


def deepspeed_zero3_estimate(total_params: int, largest_layer_params: int, gpus: int) -> int:
    """DeepSpeed's ZeRO-3 model-states estimator without offload
    (``deepspeed/runtime/zero/stage3.py: estimate_zero3_model_states_mem_needs``, documented
    in DeepSpeed's "Memory Requirements" page): ``largest_layer_memory + 18 * total_params /
    total_gpus`` bytes per GPU, with ``largest_layer_memory = 4 * largest_layer_params`` (the
    16-bit parameters and gradients of the largest module) and 18 bytes per parameter
    of 16-bit parameters, fp32 gradients and Adam's fp32 master weights and two moments,
    all sharded."""
    return 4 * largest_layer_params + int(18 * total_params / gpus)


LLAMA3_70B_ZERO3 = """
model m from "llama3-70b" { seq_len = 4096 }
cluster c from "a100-80gb" { nodes = 4 }
parallel {
    tp = 1
    pp = 1
    dp = auto
    zero = 3
    recompute = full
    micro_batch = 1
    global_batch = 32
}
train { optimizer = adamw }
"""


def _llama3_70b():
    plan = parcompile.compile(LLAMA3_70B_ZERO3).data
    st = plan["memory"]["per_stage"][0]
    total = plan["model"]["params"]
    # the largest module: the embedding (= the LM head), padded vocab x hidden
    largest = plan["model"]["padded_vocab"] * plan["model"]["hidden"]
    ds = deepspeed_zero3_estimate(total, largest, plan["degrees"]["dp"])
    return plan, st, ds


def test_llama3_70b_zero3_model_states_are_deepspeeds():
    """Llama-3 70B full fine-tune, 32 x A100 80 GB, tp 1, pp 1, seq 4096, full recompute,
    zero 3: the plan's model states are DeepSpeed's 18 bytes per parameter over 32 GPUs
    (within the bucket padding), and the plan no longer holds the model's full fp32
    gradients (316 GiB before issue 16): its full gradient buffers are two buckets."""
    plan, st, ds = _llama3_70b()
    states = st["params"] + st["grads"] + st["optimizer"]
    assert states == pytest.approx(18 * plan["model"]["params"] / 32, rel=1e-4)
    assert st["buffer_parts"]["grad_buckets_in_flight"] < 8 * 2**30
    assert plan["memory"]["peak"] < 64 * 2**30    # was 316 GiB


@pytest.mark.xfail(strict=True, reason=(
    "issue 16, not met yet: the plan (64.7 GB) is 26% above DeepSpeed's estimator (43.9 GB) plus the "
    "plan's activations (7.6 GB). Beyond the model states both count, the plan holds ZeRO-3's gathered "
    "parameters (7.6 GB: the embedding and the output layer kept gathered for the step, 2.1 GB each in "
    "bf16, and two adjacent layers) and the fp32 gradient buckets in flight (7.6 GB: the 1.05 B-element "
    "output layer and a layer), where DeepSpeed's 4 x largest layer counts one 16-bit layer and its "
    "16-bit gradient (4.2 GB). Closing it needs 16-bit reduce buckets and just-in-time gathers of the "
    "embedding and output layer."))
def test_llama3_70b_zero3_within_10_percent_of_deepspeeds_estimate():
    """The issue's figure: within 10% of DeepSpeed's estimator for its model states plus the
    plan's own activations."""
    plan, st, ds = _llama3_70b()
    want = ds + st["activations"]
    assert plan["memory"]["peak"] == pytest.approx(want, rel=0.10)
