"""Equivalence: each parallel layout, run under torchrun on CPU with gloo, computes what the
single-process reference computes (losses, first-step gradients, final weights), and its
measured parameters per rank and collectives per step equal the plan's.

The cases of one world size share one torchrun launch (``verify.verify_many``; a launch of
2 to 8 processes costs 10-30 s to start on 2 cores).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from parcompile.verification import Tolerances, compare, miniature, reference
from tests.program_utils import tiny_config
from tests.verify_batch import result_of, verify_fixture

CASES = {
    "dp2": dict(dp=2),
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),
    "tp2_pp2_1f1b": dict(tp=2, pp=2),
    "dp2_tp2_pp2_1f1b": dict(dp=2, tp=2, pp=2),
    "dp2_tp2_pp2_gpipe": dict(dp=2, tp=2, pp=2, parallel=dict(schedule="gpipe")),
    # uneven chunks: tests/test_uneven.py (an automatic split, interleaved)
    "dp2_tp2_pp2_tied_embeddings": dict(dp=2, tp=2, pp=2, model=dict(tie_embeddings=True)),
    "tp2_tied_padded_vocab": dict(tp=2, model=dict(vocab=300, tie_embeddings=True)),
    "tp2_pp2_padded_vocab_gpt": dict(tp=2, pp=2, model=dict(vocab=300, norm="layernorm", activation="gelu",
                                                            position="learned", bias=True, attention="unfused")),
    # issue 6: schedules and sequence dimensions
    "pp2_interleaved_v2": dict(pp=2, model=dict(layers=8),
                               parallel=dict(schedule="interleaved_1f1b", virtual_stages=2, global_batch=8)),
    "pp2_zero_bubble": dict(pp=2, parallel=dict(schedule="zero_bubble")),
    # Megatron-Core's rounds of N micro-batches per virtual stage, N = 3 != pp = 2 on m = 5
    # (its own example: ModelParallelConfig.microbatch_group_size_per_vp_stage)
    "pp2_interleaved_v2_group3": dict(pp=2, model=dict(layers=8), parallel=dict(
        schedule="interleaved_1f1b", virtual_stages=2, microbatch_group_size=3, micro_batch=1, global_batch=5)),
    # issue 29: layer-less end chunks (Llama 3 paper section 3.3.2): an embedding-only first
    # model chunk and an output-only last one, alone on their local chunk of the rank
    "pp2_interleaved_v2_layerless_ends": dict(pp=2, model=dict(layers=3), parallel=dict(
        schedule="interleaved_1f1b", virtual_stages=2, stage_layers=(0, 2, 1, 0), global_batch=8)),
    "dp2_tp2_pp2_v2_layerless_ends_zero2_sp": dict(dp=2, tp=2, pp=2, parallel=dict(
        schedule="interleaved_1f1b", virtual_stages=2, stage_layers=(0, 2, 2, 0), global_batch=8, zero=2,
        sequence_parallel=True)),
    "pp4_zero_bubble": dict(pp=4, parallel=dict(schedule="zero_bubble")),
    "tp2_pp2_zero_bubble_tied": dict(tp=2, pp=2, model=dict(tie_embeddings=True),
                                     parallel=dict(schedule="zero_bubble")),
    "tp2_sequence_parallel": dict(tp=2, parallel=dict(sequence_parallel=True)),
    "cp2": dict(parallel=dict(cp=2)),
    "cp2_tp2": dict(tp=2, parallel=dict(cp=2)),
    "cp2_tp2_pp2_gpt_window": dict(tp=2, pp=2, parallel=dict(cp=2),
                                   model=dict(norm="layernorm", activation="gelu", position="learned", bias=True,
                                              sliding_window=6)),
    "dp2_cp2_pp2_mqa": dict(dp=2, pp=2, model=dict(heads=4, kv_heads=1), parallel=dict(cp=2)),
    # issue 7: activation recomputation (torch.utils.checkpoint; collectives repeat as planned)
    "tp2_pp2_recompute_full": dict(tp=2, pp=2, parallel=dict(recompute="full")),
    "dp2_tp2_recompute_selective_unfused": dict(dp=2, tp=2, model=dict(attention="unfused"),
                                                parallel=dict(recompute="selective")),
    "tp2_sequence_parallel_recompute_full": dict(tp=2, parallel=dict(sequence_parallel=True, recompute="full")),
    # issue 7: ZeRO 1-3 over dp (reduce-scatter + all-gather); measured state bytes = plan's
    "dp2_tp2_pp2_zero1": dict(dp=2, tp=2, pp=2, parallel=dict(zero=1)),
    "dp4_tp2_zero1": dict(dp=4, tp=2, parallel=dict(zero=1)),
    "dp2_tp2_pp2_zero2_tied": dict(dp=2, tp=2, pp=2, model=dict(tie_embeddings=True), parallel=dict(zero=2)),
    "dp4_tp2_zero2": dict(dp=4, tp=2, parallel=dict(zero=2)),
    "dp2_tp2_zero3": dict(dp=2, tp=2, parallel=dict(zero=3)),
    "dp4_tp2_zero3": dict(dp=4, tp=2, parallel=dict(zero=3)),
    # issue 8: mixture of experts, token all-to-all over ep (uneven splits), experts folded
    # onto the dense ranks; routed bytes checked at the router's real rows (check_routed)
    "moe_dp2_ep2": dict(dp=2, model=dict(experts=4, top_k=2), parallel=dict(ep=2)),
    "moe_dp4_ep4": dict(dp=4, model=dict(experts=8, top_k=2), parallel=dict(ep=4)),
    "moe_dp2_tp2_ep2_sequence_parallel": dict(dp=2, tp=2, model=dict(experts=4, top_k=2),
                                              parallel=dict(ep=2, sequence_parallel=True)),
    "moe_dp2_pp2_ep2_shared_dense_first": dict(dp=2, pp=2, model=dict(experts=4, top_k=2, shared_experts=1,
                                                                       dense_layers=1), parallel=dict(ep=2)),
    "moe_dp4_ep2_expert_tp2": dict(dp=4, model=dict(experts=4, top_k=2), parallel=dict(ep=2, expert_tp=2)),
    "moe_dp4_ep2_zero1": dict(dp=4, model=dict(experts=4, top_k=2), parallel=dict(ep=2, zero=1)),
    # issue 17: qk-norm (Qwen3): a per-head RMSNorm whose replicated weight's gradient sums over tp
    "tp2_pp2_qk_norm": dict(tp=2, pp=2, model=dict(qk_norm=True)),
    "tp2_sequence_parallel_qk_norm": dict(tp=2, model=dict(qk_norm=True), parallel=dict(sequence_parallel=True)),
    "dp2_tp2_zero1_qk_norm": dict(dp=2, tp=2, model=dict(qk_norm=True), parallel=dict(zero=1)),
    # issue 18: Qwen3-MoE (qk-norm, routed experts over ep, a dense first layer, top-k weights not renormalised)
    "qwen3_moe_tp2_pp2_ep2": dict(tp=2, pp=2, model=dict(qk_norm=True, experts=4, top_k=2, dense_layers=1,
                                                         norm_topk_prob=False),
                                  parallel=dict(ep=2, expert_tp=1, sequence_parallel=True)),
    # issue 18: Gemma 3 (sandwich (1 + w) norms, GeGLU, qk-norm, scaled embeddings, local and global
    # layers with their own RoPE tables; tied embeddings across pp), plain tp and sequence parallel
    "gemma3_tp2_pp2": dict(tp=2, pp=2, model=dict(
        qk_norm=True, zero_centered_gamma=True, sandwich_norm=True, scale_embeddings=True, activation="geglu",
        sliding_window=4, sliding_window_pattern=2, rope_local_base_freq=100.0, rope_scaling_factor=2.0,
        query_pre_attn_scalar=24.0, tie_embeddings=True)),
    "gemma3_dp2_tp2_sequence_parallel": dict(dp=2, tp=2, model=dict(
        qk_norm=True, zero_centered_gamma=True, sandwich_norm=True, scale_embeddings=True, activation="geglu",
        sliding_window=4, sliding_window_pattern=2, rope_local_base_freq=100.0, tie_embeddings=True),
        parallel=dict(sequence_parallel=True)),
    # issue 31: Gemma 2 (Gemma 3 without qk-norm; attention scores and final logits soft-capped,
    # caps low enough to bite on the miniature; local and global layers alternating; the
    # final cap on each tp rank's vocab shard before the vocab-parallel loss; tied across pp)
    "gemma2_tp2_pp2_softcap": dict(tp=2, pp=2, model=dict(
        zero_centered_gamma=True, sandwich_norm=True, scale_embeddings=True, activation="geglu",
        sliding_window=4, sliding_window_pattern=2, query_pre_attn_scalar=24.0, tie_embeddings=True,
        attn_logit_softcapping=0.5, final_logit_softcapping=0.5)),
    # issue 18: gpt-oss's attention: sinks split over tp with the heads, local and global layers
    # alternating, YaRN RoPE, biases on every linear layer
    "sinks_tp2_pp2_yarn": dict(tp=2, pp=2, model=dict(
        attention_sinks=True, sliding_window=4, sliding_window_pattern=2, bias=True, rope_type="yarn",
        rope_scaling_factor=32.0, rope_original_max_positions=8, rope_truncate=False)),
    # gpt-oss: every layer MoE over ep with a biased router, biased experts and the clamped SwiGLU
    "gpt_oss_tp2_pp2_ep2": dict(tp=2, pp=2, model=dict(
        attention_sinks=True, sliding_window=4, sliding_window_pattern=2, bias=True, rope_type="yarn",
        rope_scaling_factor=4.0, rope_original_max_positions=8, rope_truncate=False, experts=4, top_k=2,
        router_bias=True, swiglu_alpha=1.702, swiglu_limit=7.0),
        parallel=dict(ep=2, expert_tp=1, sequence_parallel=True)),
    # DeepSeek-V3: multi-head latent attention (down projections replicated, up projections by
    # heads, the shared RoPE key's gradient summed over tp; interleaved YaRN RoPE with mscale)
    # and group-limited sigmoid routing with a correction bias over ep, a shared expert, a dense
    # first layer; and MLA without the query latent, selective recomputation of the padded core
    "deepseek_v3_tp2_pp2_ep2": dict(tp=2, pp=2, model=dict(
        kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kv_heads=4,
        rope_interleave=True, rope_type="yarn", rope_scaling_factor=4.0, rope_original_max_positions=8,
        rope_mscale=0.707, rope_mscale_all_dim=1.0, experts=4, top_k=2, shared_experts=1, dense_layers=1,
        scoring_func="sigmoid", topk_method="noaux_tc", n_group=2, topk_group=1, routed_scaling_factor=2.5),
        parallel=dict(ep=2, expert_tp=1, sequence_parallel=True)),
    # issue 46: Llama 4's text model (RoPE and NoPE layers, chunks of 6 of 16 tokens on the RoPE
    # layers, temperature-tuned NoPE layers, the L2 qk-norm, complex RoPE pairs with llama3
    # scaling; MoE every 2nd layer over ep with a shared expert, the sigmoid router's weights
    # on the experts' inputs), dp x tp x pp
    "llama4_dp2_tp2_pp2_ep2": dict(dp=2, tp=2, pp=2, model=dict(
        rope_interleave=True, nope_layer_interval=2, attention_chunk_size=6, attn_temperature_tuning=True,
        floor_scale=4.0, attn_scale=0.5, qk_l2_norm=True, rope_type="llama3", rope_scaling_factor=8.0,
        rope_original_max_positions=8, experts=4, top_k=2, shared_experts=1, interleave_moe_layer_step=2,
        scoring_func="sigmoid", norm_topk_prob=False, moe_apply_probs_on_input=True),
        parallel=dict(ep=2, expert_tp=1, sequence_parallel=True)),
    # its attention alone (dense, no ep): the saved activations per layer are checked against the plan
    "llama4_dense_tp2_pp2": dict(tp=2, pp=2, model=dict(
        rope_interleave=True, nope_layer_interval=2, attention_chunk_size=6, attn_temperature_tuning=True,
        floor_scale=4.0, attn_scale=0.5, qk_l2_norm=True)),
    "mla_dp2_tp2_no_q_lora_selective": dict(dp=2, tp=2, model=dict(
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kv_heads=4),
        parallel=dict(recompute="selective")),
    "dp2_tp2_pp2_sequence_parallel_gpt": dict(
        dp=2, tp=2, pp=2, parallel=dict(sequence_parallel=True),
        model=dict(norm="layernorm", activation="gelu", position="learned", bias=True, tie_embeddings=True)),
    # issue 32: FP8 GEMMs (runtime/model/fp8.py) against the one-process FP8 reference, with
    # verify's FP8 tolerances (Tolerances.for_dtype: the same scales, so tight on step 1)
    "fp8_dp2_tp2_pp2_zero1": dict(dp=2, tp=2, pp=2, parallel=dict(zero=1), train=dict(precision="fp8")),
    "fp8_rowwise_dp2_tp2_zero3_sequence_parallel": dict(
        dp=2, tp=2, parallel=dict(zero=3, bucket_size=16 * 1024, sequence_parallel=True),
        train=dict(precision="fp8", fp8_recipe="rowwise")),
    # ZeRO-3 with FP8 all-gather (tensorwise): each bucket's FP8 weights gathered as E4M3 with
    # the whole weight's scale (amaxes all-reduced over dp), the rest in 16 bits
    "fp8_zero3_fp8_all_gather": dict(
        dp=2, tp=2, parallel=dict(zero=3, bucket_size=16 * 1024),
        train=dict(precision="fp8", fp8_all_gather=True)),
    # the first layer's GEMMs in 16 bits (fp8_bf16_layers_start, Megatron's --first-last-layers-bf16):
    # layer 0 (stage 0) in 16 bits, layers 1-3 in FP8, by global layer index
    "fp8_dp2_tp2_pp2_zero1_bf16_first_layer": dict(dp=2, tp=2, pp=2, parallel=dict(zero=1), train=dict(
        precision="fp8", fp8_bf16_layers_start=1)),
    # full recomputation: a layer's forward, its FP8 casts and their amax all-reduces over tp, run again
    # issue 47: tensorwise's tp all-gathers are listed at FP8 bytes (what torchao's Float8 TP plan
    # moves) with the 16 bits the program gathers as program_bytes, which verify compares
    "fp8_tp2_sequence_parallel": dict(tp=2, parallel=dict(sequence_parallel=True), train=dict(precision="fp8")),
    "fp8_tp2_pp2_recompute_full": dict(tp=2, pp=2, parallel=dict(recompute="full"), train=dict(precision="fp8")),
    # MXFP8 (32-element E8M0 blocks along each GEMM's reduction dimension, emulated on the CPU:
    # runtime/model/fp8.py mx_mm); sequence parallelism so the column-parallel GEMMs read gathered inputs
    "mxfp8_dp2_tp2_zero1_sequence_parallel": dict(
        dp=2, tp=2, parallel=dict(zero=1, sequence_parallel=True), train=dict(precision="fp8", fp8_recipe="mxfp8")),
    # zero-bubble: B's input gradients in FP8, W's weight-gradient GEMMs deferred from the FP8
    # operands B cast (tp amaxes all-reduced in B)
    "fp8_pp2_zero_bubble_tp2": dict(tp=2, pp=2, parallel=dict(schedule="zero_bubble"),
                                    train=dict(precision="fp8")),
    # FP8 routed experts (runtime/model/moe.py expert_linear): rowwise over dp 2 x ep 2 (each expert's
    # group holds both dp ranks' rows where the reference's holds one micro-batch's: power-of-two
    # scales make the casts independent of the group's amax) and with expert_tp 2 (per-row
    # amaxes of w2's split input all-reduced over it); tensorwise with ep over the
    # sequence-parallel tp ranks (an expert's group is one micro-batch's rows, as in the
    # reference: the same per-expert scales), shared expert in FP8 too. (Tensorwise over dp 2 x
    # ep 2 mixes two dp ranks' rows in one expert group, whose scale the reference's groups do
    # not share, as in Transformer Engine; measured 1.5e-4 on losses and 2.1e-4 on gradients,
    # inside FP8_TOLERANCES but near their 2.5e-4, so not a case here)
    "fp8_moe_rowwise_dp2_ep2": dict(dp=2, model=dict(experts=4, top_k=2), parallel=dict(ep=2),
                                    train=dict(precision="fp8", fp8_recipe="rowwise")),
    "fp8_moe_rowwise_dp4_ep2_expert_tp2": dict(dp=4, model=dict(experts=4, top_k=2),
                                               parallel=dict(ep=2, expert_tp=2),
                                               train=dict(precision="fp8", fp8_recipe="rowwise")),
    # ZeRO-3 FP8 all-gather in a MoE model: the dense FP8 weights gathered as E4M3 over dp_cp
    # (one amax each all-reduced), the experts' ZeRO-3 shards over expert_dp in 16 bits
    # (runtime/train/optim_moe.py MoEOptimizer, fp8_weight_ids; the plan's fp8_weights)
    "fp8_moe_dp2_tp2_ep2_zero3_fp8_all_gather": dict(
        dp=2, tp=2, model=dict(experts=4, top_k=2),
        parallel=dict(ep=2, expert_tp=1, sequence_parallel=True, zero=3, bucket_size=16 * 1024),
        train=dict(precision="fp8", fp8_all_gather=True)),
    # both: FP8 experts (weight gradients in B) beside the dense FP8 layers' deferred W
    "fp8_moe_rowwise_dp2_pp2_ep2_zero_bubble": dict(dp=2, pp=2, model=dict(experts=4, top_k=2),
                                                    parallel=dict(ep=2, schedule="zero_bubble"),
                                                    train=dict(precision="fp8", fp8_recipe="rowwise")),
    # MXFP8 routed experts (blocks along each expert GEMM's reduction dimension: h or ffn for
    # the forward and input-gradient GEMMs, as in the reference; the group's rows for the weight
    # gradient, zero-padded to whole blocks). Over dp the run's groups hold both dp ranks' rows
    # (the reference's one micro-batch's), so the weight gradient's row blocks are cut
    # elsewhere: measured 1.0e-3 on losses, 1.1e-4 on gradients (dp 2 x ep 2) and 1.0e-3, 6.5e-5
    # (dp 4 x ep 2 x expert_tp 2); with ep over the sequence-parallel tp ranks a group is the
    # reference's rows in the reference's order: 0 on losses, 3.4e-8 on gradients
    "mxfp8_moe_dp2_ep2": dict(dp=2, model=dict(experts=4, top_k=2), parallel=dict(ep=2),
                              train=dict(precision="fp8", fp8_recipe="mxfp8")),
    "mxfp8_moe_dp4_ep2_expert_tp2": dict(dp=4, model=dict(experts=4, top_k=2), parallel=dict(ep=2, expert_tp=2),
                                         train=dict(precision="fp8", fp8_recipe="mxfp8")),
    "mxfp8_moe_tp2_ep2_sequence_parallel": dict(tp=2, model=dict(experts=4, top_k=2),
                                                parallel=dict(ep=2, expert_tp=1, sequence_parallel=True),
                                                train=dict(precision="fp8", fp8_recipe="mxfp8")),
    "fp8_moe_tp2_ep2_sequence_parallel": dict(tp=2, model=dict(experts=4, top_k=2, shared_experts=1),
                                              parallel=dict(ep=2, expert_tp=1, sequence_parallel=True),
                                              train=dict(precision="fp8")),
    # issue 48: Megatron-Core's module recomputation (rt.checkpointed around the MoE layer's MLP,
    # the dense MLP, the shared experts; the attention core), dispatch all-to-alls rerun in backward
    "moe_dp2_ep2_recompute_moe_core_attn": dict(dp=2, model=dict(experts=4, top_k=2, shared_experts=1),
                                                parallel=dict(ep=2, recompute=("moe", "core_attn"))),
    # moe_act: the experts' activation output freed after w2 saved it, rebuilt before w2's backward
    # (runtime/model/discard.py); the saved bytes per layer are measured against the plan's
    "moe_dp2_recompute_moe_act": dict(dp=2, model=dict(experts=4, top_k=2), parallel=dict(recompute=("moe_act",))),
    # layernorm: the norms' outputs freed once attention / the MLP ran (with sequence parallelism
    # the split output the column-parallel linears keep), rebuilt before their backward
    "tp2_sequence_parallel_pp2_recompute_layernorm": dict(tp=2, pp=2, parallel=dict(
        sequence_parallel=True, recompute=("layernorm", "core_attn"))),
    # mla_up_proj: MLA's up projections and RoPE run without a graph (rt.discarding), the query,
    # key and value freed once the attention core ran and rebuilt before its backward; the saved
    # bytes per layer are measured against the plan's (Megatron-Core's pricing); DeepSeek-V3's
    # attention with the query latent, and without it (wq inside the region) beside core_attn
    "mla_dp2_tp2_recompute_mla_up_proj": dict(dp=2, tp=2, model=dict(
        kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kv_heads=4,
        rope_interleave=True, rope_type="yarn", rope_scaling_factor=4.0, rope_original_max_positions=8,
        rope_mscale=0.707, rope_mscale_all_dim=1.0), parallel=dict(recompute=("mla_up_proj",))),
    "mla_tp2_pp2_no_q_lora_recompute_mla_up_proj_core_attn": dict(tp=2, pp=2, model=dict(
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kv_heads=4),
        parallel=dict(recompute=("mla_up_proj", "core_attn"))),
    # with the split sequence regathered before the down projections and k, v gathered over cp in the core
    "mla_tp2_cp2_sequence_parallel_recompute_mla_up_proj": dict(tp=2, model=dict(
        kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kv_heads=4),
        parallel=dict(cp=2, sequence_parallel=True, recompute=("mla_up_proj",))),
    "moe_dp2_pp2_recompute_mlp_shared_experts": dict(dp=2, pp=2, model=dict(
        layers=4, experts=4, top_k=2, shared_experts=1, dense_layers=1),
        parallel=dict(ep=2, recompute=("mlp", "shared_experts"))),
}


MIXED_CASES = {
    # issue 7: mixed precision (16-bit weights and activations, fp32 gradients and masters;
    # fp16 with dynamic loss scaling), tolerances of verify.BF16_TOLERANCES
    "bf16_dp2_tp2_pp2": dict(dtype="bf16", dp=2, tp=2, pp=2),
    "bf16_dp2_tp2_zero1": dict(dtype="bf16", dp=2, tp=2, parallel=dict(zero=1)),
    # zero 3 with 16-bit weights keeps a 16-bit slice per bucket (SPEC: 2/d bytes of parameters)
    "bf16_dp2_tp2_zero3": dict(dtype="bf16", dp=2, tp=2, parallel=dict(zero=3, bucket_size=16 * 1024)),
    "fp16_dp2_tp2_pp2_loss_scaling": dict(dtype="fp16", dp=2, tp=2, pp=2),
    "fp16_dp2_tp2_zero2_loss_scaling": dict(dtype="fp16", dp=2, tp=2, parallel=dict(zero=2)),
    # FP8 all-gather from the 16-bit slices zero 3 keeps (issue 32): bf16 rest, E4M3 weights
    "bf16_fp8_dp2_tp2_zero3_fp8_all_gather": dict(dtype="bf16", dp=2, tp=2, parallel=dict(
        zero=3, bucket_size=16 * 1024), train=dict(precision="fp8", fp8_all_gather=True)),
    # zero-bubble's deferred FP8 weight gradients into the fp32 main_grad of bf16 weights, with
    # dp's bucketed reduction waiting for them (runtime/train/grads.py accumulate)
    # FP8 routed experts with bf16 weights and activations (fp32 main_grad over expert_dp)
    "bf16_fp8_moe_rowwise_dp4_ep2_zero1": dict(dtype="bf16", dp=4, model=dict(experts=4, top_k=2), parallel=dict(
        ep=2, zero=1), train=dict(precision="fp8", fp8_recipe="rowwise")),
    "bf16_fp8_dp2_pp2_zero_bubble_zero1": dict(dtype="bf16", dp=2, pp=2, parallel=dict(
        schedule="zero_bubble", zero=1, bucket_size=16 * 1024), train=dict(precision="fp8")),
    # issue 48: bf16 gradient buffers (Megatron-Core --grad-reduce-in-bf16), accumulated over 2
    # micro-batches and reduced in bf16, against the single process accumulating in bf16 too
    "bf16_grads_dp2_tp2_zero1": dict(dtype="bf16", dp=2, tp=2, parallel=dict(
        zero=1, grad_dtype="bf16", global_batch=8)),
    "bf16_grads_dp2_pp2_zero0_moe": dict(dtype="bf16", dp=2, pp=2, model=dict(experts=4, top_k=2), parallel=dict(
        ep=2, grad_dtype="bf16")),
}


def _shard_scales(mini) -> None:
    """Make the miniature's FP8 casts scale each tp shard by its own amax (no all-reduce over
    tp), for this program's ``main`` only (a launch runs several programs in one process)."""
    prog = mini / "program.py"
    text = prog.read_text()
    assert text.count("\ndef main(argv=None)") == 1
    prog.write_text(text.replace("\ndef main(argv=None)", """
def main(argv=None):
    import parcompile.runtime.model.fp8 as fp8
    saved, fp8._max_over = fp8._max_over, lambda t, axis, rows=None: t
    try:
        return _main(argv)
    finally:
        fp8._max_over = saved


def _main(argv=None)""", 1))


def _mx_blocks_of_16(mini) -> None:
    """Make the miniature's MXFP8 casts use 16-element blocks (the run's block boundaries
    not the one-process run's: what a tp shard with a local reduction of 16 elements does),
    for this program's ``main`` only."""
    prog = mini / "program.py"
    text = prog.read_text()
    assert text.count("\ndef main(argv=None)") == 1
    prog.write_text(text.replace("\ndef main(argv=None)", """
def main(argv=None):
    import parcompile.runtime.model.fp8 as fp8
    saved, fp8.MX_BLOCK = fp8.MX_BLOCK, 16
    try:
        return _main(argv)
    finally:
        fp8.MX_BLOCK = saved


def _main(argv=None)""", 1))


def _build(test: str, case: str) -> tuple:
    kw = dict((MIXED_CASES if test.startswith("test_mixed") else CASES)[case])
    dtype = kw.pop("dtype", "fp32")
    cfg = tiny_config(kw.pop("dp", 1), kw.pop("tp", 1), kw.pop("pp", 1), **kw)
    if test.startswith("test_fp8_scales"):
        return cfg, dtype, None, _shard_scales
    if test.startswith("test_mxfp8_blocks"):
        return cfg, dtype, None, _mx_blocks_of_16
    return cfg, dtype


verified = verify_fixture(__name__, _build)


@pytest.mark.torchrun
@pytest.mark.parametrize("case", sorted(MIXED_CASES))
def test_mixed_precision_layout_matches_single_process(case, verified, request):
    result = result_of(verified, request, case)
    print(result.table())
    assert result.ok, result.table()
    assert result.mini.model.dtype == MIXED_CASES[case]["dtype"]


@pytest.mark.torchrun
@pytest.mark.parametrize("case", ["fp8_dp2_tp2_pp2_zero1"])
def test_fp8_scales_of_tp_shards_fail_verify(case, verified, request):
    """FP8 tensorwise scales taken on each tp shard instead of the whole tensor (the amax not
    all-reduced over tp): verify's FP8 tolerances (verify.FP8_TOLERANCES) report it."""
    result = result_of(verified, request, case)
    assert not result.ok, result.table()
    bad = {c.what.split(",")[0].split(" (")[0] for c in result.checks if not c.ok}
    assert bad & {"loss", "gradients"}, result.table()


@pytest.mark.torchrun
@pytest.mark.parametrize("case", ["mxfp8_dp2_tp2_zero1_sequence_parallel"])
def test_mxfp8_blocks_cut_elsewhere_than_the_reference_fail_verify(case, verified, request):
    """MXFP8 blocks of 16 in the parallel run (its block boundaries not the one-process
    run's): verify's FP8 tolerances report it (verify.Tolerances.for_dtype)."""
    result = result_of(verified, request, case)
    print(result.table())
    assert not result.ok, result.table()
    bad = {c.what.split(",")[0].split(" (")[0] for c in result.checks if not c.ok}
    assert bad & {"loss", "gradients"}, result.table()


@pytest.mark.torchrun
@pytest.mark.parametrize("case", sorted(CASES))
def test_layout_matches_single_process(case, verified, request):
    result = result_of(verified, request, case)
    assert result.mini.parallel.world_size <= 8
    print(result.table())
    assert result.ok, result.table()
    assert len(result.losses) == 3
    names = [c.what for c in result.checks]
    assert any("collectives" in n for n in names) and any("gradients" in n for n in names)


def test_miniature_keeps_the_parallel_structure():
    cfg = tiny_config(2, 2, 2, model=dict(layers=30, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                                           vocab=50_257, seq_len=8192),
                      parallel=dict(stage_layers=(16, 14), global_batch=512, micro_batch=1))
    mini = miniature(cfg)
    p, m = mini.parallel, mini.model
    assert (p.dp, p.tp, p.pp, p.schedule) == (2, 2, 2, "1f1b")
    assert p.stage_layers == (2, 1) and m.layers == 3          # uneven stays uneven, in the same order
    assert m.heads % 2 == 0 and m.kv_heads % 2 == 0 and m.kv_heads < m.heads  # GQA kept, divisible by tp
    assert m.vocab % (m.vocab_multiple * 2) != 0               # 50257 needs padding at tp=2; so does the mini
    assert p.num_microbatches == 4                             # 2 * pp
    ref = reference(mini)
    assert ref.parallel.world_size == 1 and ref.parallel.global_batch == p.global_batch


def test_miniature_keeps_layer_less_end_chunks():
    """Issue 29: Meta's split (an embedding-only first chunk, an output-only last one) stays
    so in the miniature; the layered chunks get 1 or 2 layers as usual."""
    cfg = tiny_config(1, 1, 2, model=dict(layers=129), parallel=dict(
        schedule="interleaved_1f1b", virtual_stages=2, stage_layers=(0, 64, 65, 0), global_batch=8))
    mini = miniature(cfg)
    assert mini.parallel.stage_layers == (0, 1, 2, 0) and mini.model.layers == 3


def test_miniature_keeps_interleaved_rounds():
    """microbatch_group_size stays (one round of N and a last of pp micro-batches, at most the
    spec's m), in Megatron-Core's range (core.schedule.group_error)."""
    from parcompile.core.schedule import group_error
    for n, gb, want_m in ((6, 32, 8), (3, 5, 5), (4, 8, 6), (5, 6, 5)):
        cfg = tiny_config(1, 1, 2, model=dict(layers=8), parallel=dict(
            schedule="interleaved_1f1b", virtual_stages=2, microbatch_group_size=n, micro_batch=1,
            global_batch=gb))
        p = miniature(cfg).parallel
        assert (p.microbatch_group_size, p.num_microbatches) == (n, want_m), n
        assert group_error(p.pp, p.num_microbatches, n) is None


def test_compare_reports_a_wrong_weight(tmp_path):
    """verify must fail when one parameter of the run differs from the reference's."""
    from parcompile.verification import _emit, _run_reference

    cfg = reference(miniature(tiny_config(1, 1, 1)))
    plan = _emit(cfg, tmp_path / "a")
    _run_reference(tmp_path / "a", tmp_path / "a" / "metrics", 2)
    shutil.copytree(tmp_path / "a" / "metrics", tmp_path / "b")
    ok = compare(tmp_path / "a" / "metrics", tmp_path / "b", plan, cfg, Tolerances())
    assert ok.ok, ok.table()
    state = torch.load(tmp_path / "b" / "rank0.pt", weights_only=False)
    state["params"]["layers.0.mlp.w2.weight"]["tensor"][0, 0] += 1e-3
    torch.save(state, tmp_path / "b" / "rank0.pt")
    bad = compare(tmp_path / "a" / "metrics", tmp_path / "b", plan, cfg, Tolerances())
    assert not bad.ok
    assert "layers.0.mlp.w2.weight" in bad.table()
