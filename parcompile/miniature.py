"""The miniature of a spec that `parcompile verify` runs (SPEC 1 `verify`): the same model
family and layout, shrunk until every rank runs as a CPU process on this machine
(:func:`miniature`; :data:`MINIATURE_KEYS` the model keys it keeps), its single-process
reference (:func:`reference`) and a `serve` spec's (:func:`serve_miniature`). No torch here:
:mod:`parcompile.verification` runs and compares them.
"""

from __future__ import annotations


from parcompile.ir.fp8 import enabled as fp8_enabled
from parcompile.config.schema import (ClusterConfig, ModelConfig, ParallelConfig, ServeConfig, SpecConfig,
                                      TrainConfig)
from parcompile.core.data_parallel import data_parallel_sharding
from parcompile.core.model import MODEL_KEY_CHECKS
from parcompile.core.schedule import group_error
from parcompile.diagnostics import Diagnostic, SpecError


#: the miniature's gradient bucket size: a miniature layer holds a few KiB of gradients, so
#: with the spec's own size (160 MB by default) it would reduce one bucket per chunk
MINI_BUCKET_SIZE = 16 * 1024
MAX_WORLD = 16          # CPU processes verify will start on this machine
VERIFY_ADAM_EPS = 1e-5  # see parcompile.verification.Tolerances


def miniature(cfg: SpecConfig, steps: int = 3, dtype: str = "fp32") -> SpecConfig:
    """A small model with the same parallel structure as ``cfg`` (:mod:`parcompile.verification`'s docstring).

    Widths: 2 query heads per tp rank (GQA kept as 2 query heads per kv head, at least one
    kv head per tp rank; a serving layout with fewer kv heads than tp ranks keeps its kv
    heads, each replicated on tp / kv_heads ranks), head_dim 8 (32 with mxfp8: :func:`_mini_head_dim`), ffn = 2 * hidden, seq_len 16 (at most 64 for
    prompt_completion and chat samples), dropout 0, fp32; the spec's data and tokenizer
    (a Hugging Face tokenizer sets the vocabulary), its own random weights.
    Layers: the stage layout's shape (1 layer for the smallest nonzero `stage_layers` entries, 2 for
    larger ones, 0 for a layer-less first or last chunk; 1 per chunk when even; 3 for ZeRO-3 with pp = 1, so that the two adjacent
    layers it holds at once are not all of them). Micro-batches: at most 2 * pp (a multiple of pp);
    with ``microbatch_group_size`` N, N kept and at most N + pp (one round and a last of pp).
    Gradient buckets: at most :data:`MINI_BUCKET_SIZE` (``bucket_size = 0`` stays 0), so a
    miniature reduces several buckets per rank, as the full model does with its own size.

    Raises:
        SpecError: the miniature would need more than ``MAX_WORLD`` processes.
    """
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.world_size > MAX_WORLD:
        raise SpecError([Diagnostic(
            "error", f"verify runs every rank as a CPU process; world_size {p.world_size} > {MAX_WORLD}",
            cfg.span("parallel"), help="verify a smaller layout with the same kinds of parallelism "
            "(e.g. tp = 2, pp = 2, dp = 2 on a `cpu` cluster)")])
    tp = p.tp
    heads, kv = _mini_heads(cfg)
    head_dim = _mini_head_dim(cfg)
    hidden = heads * head_dim
    stage_layers, layers = _mini_layers(p)
    text = t.data != "synthetic"
    # byte-level text needs all 256 byte values; a Hugging Face tokenizer all of its own
    vocab = (tokenizer_vocab(t.tokenizer) if t.tokenizer != "bytes" else 256) if text else min(m.vocab, 512)
    mult = m.vocab_multiple
    if m.vocab % (mult * tp) and not vocab % (mult * tp):
        vocab += 3 if text else -3                # keep the vocabulary padding of the original
    # prompt_completion / chat: one example is one sample, its loss on the completion or
    # the assistant turns only; a longer miniature sequence keeps some of them
    seq_len = 16 if t.data_format == "text" else min(m.seq_len, 64)
    mini_m, group = _mini_microbatches(p), p.microbatch_group_size
    # multi-head latent attention: one kv per query head, a latent narrower than the heads
    mla = dict(kv_lora_rank=16, q_lora_rank=16 if m.q_lora_rank else 0, qk_nope_head_dim=8, qk_rope_head_dim=4,
               v_head_dim=8, rope_interleave=m.rope_interleave, head_dim=12) if m.kv_lora_rank else {}
    if mla:
        kv = heads
    keys = dict(
        {k: getattr(m, k) for k in MODEL_KEY_CHECKS if k not in MINIATURE_KEYS},   # the model's own
        name=m.name + "_mini", layers=layers, hidden=hidden, heads=heads, kv_heads=kv, head_dim=head_dim,
        ffn_hidden=2 * hidden, vocab=vocab, seq_len=seq_len, sliding_window=min(m.sliding_window, 8), dropout=0.0,
        # local and global layers both present in the miniature (Gemma 3's 6 -> at most its layers)
        sliding_window_pattern=min(m.sliding_window_pattern, max(layers, 2)) if m.sliding_window_pattern else 0,
        dtype=dtype, vocab_multiple=mult, **_mini_experts(m, p, hidden, layers),
        # Llama 4's: chunks and a temperature that bite within 16 tokens, NoPE and MoE layers within its layers
        rope_interleave=m.rope_interleave, attention_chunk_size=min(m.attention_chunk_size, 6),
        floor_scale=min(m.floor_scale, 4.0), nope_layer_interval=min(m.nope_layer_interval, layers),
        interleave_moe_layer_step=min(m.interleave_moe_layer_step, layers),
    )
    model = ModelConfig(**{**keys, **mla})
    par = p.model_copy(update=dict(
        stage_layers=stage_layers, global_batch=p.micro_batch * p.dp * mini_m, auto=(), microbatch_group_size=group,
        bucket_size=min(p.bucket_size, MINI_BUCKET_SIZE),
        # a 16-bit reduce dtype is the model's: the miniature's 16-bit dtype, fp32 in an fp32 miniature
        reduce_dtype="fp32" if p.reduce_dtype == "fp32" or dtype == "fp32" else dtype,
        grad_dtype="fp32" if dtype == "fp32" else p.grad_dtype,   # bf16 gradients need a bf16 miniature
    ))
    train = TrainConfig(
        optimizer=t.optimizer, lr=min(t.lr, 1e-2), weight_decay=t.weight_decay, grad_clip=t.grad_clip,
        steps=steps, seed=t.seed, data=(t.data if text else "synthetic"), log_every=1, eps=VERIFY_ADAM_EPS,
        betas=t.betas, tokenizer=t.tokenizer, data_format=t.data_format, text_field=t.text_field,
        precision=t.precision, fp8_recipe=t.fp8_recipe, fp8_all_gather=t.fp8_all_gather,
        **_mini_bf16_layers(t, layers), **_mini_lora(t, tp),
    )   # the miniature's own random weights (not init_from: other shapes), no eval, no hf_output
    cluster = ClusterConfig(name="cpu", preset="cpu", nodes=1, gpus_per_node=p.world_size)
    return cfg.model_copy(update=dict(name=cfg.name + "_mini", model=model, parallel=par, train=train,
                                      cluster=cluster, workload="train", serve=None))


def _mini_lora(t: TrainConfig, tp: int) -> dict:
    """LoRA's keys in the miniature (``method = lora``): the spec's targets, alpha and a rank of
    at most 8 (the miniature's narrowest projection is 8 wide), a multiple of tp; no dropout
    (the reference draws other masks), as the model's."""
    if t.method != "lora":
        return {}
    r = min(t.lora_rank, 8)
    return dict(method="lora", lora_rank=max(tp, r - r % tp), lora_alpha=t.lora_alpha, lora_dropout=0.0,
                lora_targets=t.lora_targets)


def _mini_bf16_layers(t: TrainConfig, layers: int) -> dict[str, int]:
    """The miniature's ``fp8_bf16_layers_start`` / ``_end``: one layer kept in 16 bits at an
    end where the spec keeps any, as long as one FP8 layer remains (first the start's)."""
    start = min(1, t.fp8_bf16_layers_start, max(0, layers - 1))
    end = min(1, t.fp8_bf16_layers_end, max(0, layers - 1 - start))
    return dict(fp8_bf16_layers_start=start, fp8_bf16_layers_end=end)


def _mini_head_dim(cfg: SpecConfig) -> int:
    """The miniature's head_dim: 8, or 32 for ``fp8_recipe = mxfp8``, so that every
    tp-local reduction dimension of its FP8 GEMMs (a kv head, hidden / tp, ffn / tp, each a
    multiple of the head's width) holds whole 32-element MX blocks, as the full model's do
    (hidden / tp = 512 for Llama 3 8B at tp 8): each block then sits on one rank, as in the
    one-process reference (runtime/model/fp8.py, ``mx_cast``)."""
    t = cfg.train
    fp8_mx = cfg.workload == "train" and t is not None and t.precision == "fp8" and t.fp8_recipe == "mxfp8"
    return 32 if fp8_mx else 8


def _mini_heads(cfg: SpecConfig) -> tuple[int, int]:
    """The miniature's (query heads, kv heads): 2 query heads per tp rank, GQA kept as 2 query
    heads per kv head with at least one kv head per tp rank; a serving layout with fewer kv
    heads than tp ranks keeps its kv heads."""
    m, tp = cfg.model, cfg.parallel.tp
    kv = tp if m.kv_heads < m.heads else 2 * tp
    if cfg.workload == "serve" and m.kv_heads < tp and not m.kv_lora_rank:
        kv = m.kv_heads   # serving replicates each kv head on tp / kv_heads ranks (vLLM): kept
    heads = 2 * tp if m.kv_heads == m.heads or kv < tp else kv * 2
    return heads, min(kv, heads)


def _mini_layers(p) -> tuple[tuple[int, ...] | None, int]:
    """The miniature's (``stage_layers``, layers): the stage layout's shape (see :func:`miniature`)."""
    if p.stage_layers is not None:
        # a layer-less first or last chunk (embedding or output only) stays layer-less
        low = min((x for x in p.stage_layers if x), default=1)
        stage_layers = tuple(0 if x == 0 else 1 if x == low else 2 for x in p.stage_layers)
    else:
        stage_layers = None
    chunks = p.pp * p.virtual_stages
    layers = sum(stage_layers) if stage_layers else chunks * (2 if chunks <= 2 else 1)
    if data_parallel_sharding(p).shards_parameters and chunks == 1 and not stage_layers:
        layers = 3   # ZeRO-3, pp = 1: a layer runs while the next is prefetched; 3 shows it is not all
    return stage_layers, layers


def _mini_microbatches(p) -> int:
    """The miniature's micro-batches per step: at most 2 * pp (a multiple of pp for the
    interleaved schedule); with ``microbatch_group_size`` N, N kept and at most N + pp."""
    num_mb = p.num_microbatches
    mini_m = min(num_mb, 2 * p.pp) if p.pp > 1 else min(num_mb, 2)
    group = p.microbatch_group_size
    rounds = p.pipeline_schedule.rounds
    if rounds and group is not None:
        # rounds of N kept: one round and a last one of pp micro-batches (at most the spec's
        # m; m >= N >= pp there), fewer until Megatron-Core runs it (core.schedule.group_error)
        mini_m = min(num_mb, max(mini_m, group + p.pp))
        mini_m = next((k for k in range(mini_m, 0, -1) if group_error(p.pp, k, group) is None), mini_m)
    elif rounds:
        mini_m = max(p.pp, mini_m - mini_m % p.pp)
    return mini_m


#: the model keys a miniature sets itself (:func:`miniature`: its widths, depth, vocabulary,
#: length, window, dtype; its experts, :func:`_mini_experts`; its latent attention); it
#: keeps every other key of the model (norms, activation, positions and RoPE scaling,
#: biases, Gemma's and gpt-oss's keys), so that a new key reaches the miniature unasked
MINIATURE_KEYS = frozenset({
    "layers", "hidden", "heads", "kv_heads", "head_dim", "ffn_hidden", "vocab", "seq_len", "max_positions",
    "sliding_window", "sliding_window_pattern", "dropout", "dtype", "vocab_multiple",
    # _mini_experts (all of them, or none: a dense model's take their defaults)
    "experts", "top_k", "expert_ffn_hidden", "shared_experts", "dense_layers", "router_aux_loss", "norm_topk_prob",
    "router_bias", "swiglu_alpha", "swiglu_limit", "scoring_func", "topk_method", "n_group", "topk_group",
    "routed_scaling_factor",
    # multi-head latent attention (`mla` in miniature; a model without it takes the defaults)
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave",
    # Llama 4's chunk, temperature unit and layer intervals (shrunk to bite in the miniature)
    "attention_chunk_size", "floor_scale", "nope_layer_interval", "interleave_moe_layer_step",
})


def tokenizer_vocab(tokenizer: str) -> int:
    """The vocabulary a model needs for ``tokenizer`` (its largest id + 1)."""
    from parcompile.runtime.data.dataset import load_tokenizer

    return load_tokenizer(tokenizer).vocab_size


def _mini_experts(m: ModelConfig, p: ParallelConfig, hidden: int, layers: int) -> dict:
    """MoE keys of the miniature: 2 experts per ep rank (ep divides them), top_k kept (at
    most the experts), expert width = hidden (divisible by expert_tp, as heads are), at most
    one shared expert and one leading dense layer, the router's kind kept (two expert groups
    for group-limited routing), and no load-balancing loss (it is
    computed on each rank's own tokens, so it differs between layouts; runtime/model/moe.py)."""
    if m.experts == 0:
        return {}
    experts = p.ep * max(1, min(2, m.experts // p.ep))
    top_k = min(m.top_k, experts)
    # DeepSeek-V3's group-limited routing: two groups (of at least two experts) when the
    # model has groups, the kept groups enough for top_k
    groups = 2 if m.n_group > 1 and experts >= 4 else 1
    kept = min(m.topk_group, groups)
    if top_k > kept * experts // groups:
        kept = groups
    return dict(experts=experts, top_k=top_k, expert_ffn_hidden=hidden,
                shared_experts=min(m.shared_experts, 1), dense_layers=min(m.dense_layers, 1, layers - 1),
                router_aux_loss=0.0, norm_topk_prob=m.norm_topk_prob, router_bias=m.router_bias,
                swiglu_alpha=m.swiglu_alpha, swiglu_limit=m.swiglu_limit, scoring_func=m.scoring_func,
                topk_method=m.topk_method, n_group=groups, topk_group=kept,
                routed_scaling_factor=m.routed_scaling_factor)


def reference(mini: SpecConfig) -> SpecConfig:
    """The miniature with every degree 1 on one process (same global batch and data), its
    gradients accumulated in the same dtype (``grad_dtype``: bf16 sums over the micro-batches)."""
    p = mini.parallel
    par = ParallelConfig(micro_batch=p.micro_batch, global_batch=p.global_batch, schedule="1f1b",
                         grad_dtype=p.grad_dtype)
    cluster = ClusterConfig(name="cpu", preset="cpu", nodes=1, gpus_per_node=1)
    return mini.model_copy(update=dict(name=mini.name + "_reference", parallel=par, cluster=cluster))


#: a serve miniature's requests: sequences per dp replica, the longest prompt, new tokens
#: (prompt + new = the miniature's seq_len of 16, so a sliding window of 8 fills and slides)
SERVE_BATCH_PER_REPLICA = 2
SERVE_PROMPT_LEN = 8
SERVE_NEW_TOKENS = 8


def serve_miniature(cfg: SpecConfig, dtype: str = "fp32") -> SpecConfig:
    """The miniature of a `serve` spec: :func:`miniature`'s model and layout (its own random
    weights, not the spec's checkpoint), serving :data:`SERVE_BATCH_PER_REPLICA` greedy
    sequences per dp replica, prompts of up to :data:`SERVE_PROMPT_LEN` tokens and
    :data:`SERVE_NEW_TOKENS` new ones, the KV cache in the model's dtype.

    Raises:
        SpecError: as :func:`miniature`; a compute dtype other than fp32 (greedy tokens are
            compared exactly, so both runs must round alike to a few ulps).
    """
    if dtype != "fp32":
        raise SpecError([Diagnostic(
            "error", f"verify runs the miniature of a `serve` spec in fp32 only (--dtype {dtype} was given)",
            cfg.span("serve"), help="drop `--dtype`: greedy tokens are compared exactly, and 16-bit rounding "
                                    "in a different order per layout can flip a near tie")])
    mini = miniature(cfg, 1, dtype)
    serve = ServeConfig(batch=SERVE_BATCH_PER_REPLICA * mini.parallel.dp, prompt_len=SERVE_PROMPT_LEN,
                        max_new_tokens=SERVE_NEW_TOKENS, seed=cfg.serve.seed, temperature=0.0)
    return mini.model_copy(update=dict(workload="serve", serve=serve, train=cfg.train))
