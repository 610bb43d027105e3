"""The attention kernel each engine runs for each attention variant: the one table the
memory model (bytes saved for backward, :mod:`parcompile.ir.ops` ``_attention_extra``) and
the time model (:func:`parcompile.analysis.compute.compute_report`: which cores are one
fused kernel, at what rate, over which score blocks) read.

Rows (``engine``): ``megatron``, ``eager``, ``compile`` and ``automodel`` are ``cluster.engine``
(:data:`parcompile.analysis.efficiency.ENGINES`); ``program`` is the program parcompile
generates, which runs on the ``cpu`` preset (:func:`attention_engine`) and whose saved
bytes ``parcompile verify`` measures (:func:`parcompile.verification.compare_activations`), so
what the plan counts there is what :func:`parcompile.runtime.model.core_attention.attention_core` keeps.

Variants (:func:`variant`, from the attention op's attributes; the first that applies):
``sinks`` (one learnable logit per head in each softmax's denominator, gpt-oss),
``softcap`` (Gemma 2's ``attn_logit_softcapping``: ``cap * tanh(scores / cap)`` before the
softmax, which torch SDPA and Transformer Engine's fused attention cannot apply; a sliding
window or an MLA value width besides is the kernel's business), ``mla`` (the value head dim
differs from the query/key one: DeepSeek-V3's 192 / 128), ``sliding_window`` (a window shorter than the
sequence), ``causal`` (plain causal attention). qk-norm (Qwen3, Gemma 3, OLMo 2) is not a kernel variant: the norm is its own
op before the kernel (``qk_norm`` in :mod:`parcompile.ir.ops`), which sees ordinary q and k,
so a qk-norm layer takes its window's or plain causal row. ``model.attention = unfused``
asks for the unfused core on every engine (Megatron-LM 2021-22's, the A100 calibration
rows): :func:`attention_kernel`.

A fused kernel keeps q, k, v, its output and an fp32 log-sum-exp per query and head, never
the ``s x s`` scores (FlashAttention-2/3, cuDNN, FlexAttention alike); the unfused core
keeps its 16-bit softmax output (and dropout mask). Kernels that skip the score blocks a
sliding window masks out (cuDNN, FlashAttention-3, FlexAttention's block mask) run only
the window's FLOPs; torch SDPA given the window as an explicit mask (the generated program)
runs every causal block and keeps the ``(s, seq_len)`` mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Kernel:
    """One attention kernel, as the memory and time models see it.

    * ``fused``: one kernel, no ``s x s`` tensor kept (output and fp32 log-sum-exp instead);
    * ``skips_masked_blocks``: a sliding window costs only its own blocks' FLOPs;
    * ``explicit_mask``: a window or context-parallel positions are passed as an
      ``(s, seq_len)`` mask tensor, which the kernel keeps for backward;
    * ``pads_v``: MLA's value is padded to the query/key head dim (and its output with it);
    * ``sink_rescale``: sinks applied after the kernel by rescaling its output with
      ``sigmoid(lse - sink)`` (torchtitan's gpt-oss), which keeps one more output-sized tensor;
    * ``speed``: the kernel's rate over the engine's attention rate
      (:func:`parcompile.analysis.estimate.attention_efficiency`, forward and backward
      together)."""

    name: str
    fused: bool
    description: str
    skips_masked_blocks: bool = True
    explicit_mask: bool = False
    pads_v: bool = False
    sink_rescale: bool = False
    speed: float = 1.0


#: the kernels of :data:`ATTENTION_KERNELS`, by name
KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("cudnn", True,
           "Transformer Engine's fused attention (cuDNN's SDPA; FlashAttention-3 where installed): causal, "
           "sliding window, learnable sinks and q/k head dims unequal to v's in one kernel"),
    Kernel("sdpa_flash", True,
           "torch.nn.functional.scaled_dot_product_attention on the GPU (FlashAttention-2 / cuDNN / "
           "memory-efficient backends): causal, any value head dim (Ev)"),
    # PyTorch's FlexAttention post (pytorch.org/blog/flexattention, Aug 2024): about 90% of
    # FlashAttention-2's forward and 85% of its backward; backward is 2/3 of the time: 3/(1/0.9 + 2/0.85)
    Kernel("flex", True,
           "torch FlexAttention (compiled Triton kernel): block mask (sliding window: masked blocks skipped), "
           "return_lse for sinks applied after it", speed=0.87, sink_rescale=True),
    Kernel("sdpa", True,
           "the generated program's torch SDPA: is_causal, or an explicit (s, seq_len) boolean mask for a window "
           "or context-parallel positions (every causal block computed); MLA's value padded to the qk head dim "
           "(runtime/model/mla.py)", skips_masked_blocks=False, explicit_mask=True, pads_v=True),
    Kernel("unfused", False,
           "the softmax spelt out: Q K^T, scale-mask-softmax (16-bit probabilities kept), dropout, A V",
           skips_masked_blocks=False),
)}


@dataclass(frozen=True)
class KernelChoice:
    """The kernel an engine runs for a variant, and where that is documented."""

    kernel: str
    source: str


_TE_SINK = ("Transformer Engine DotProductAttention(softmax_type='learnable') on cuDNN >= 9.13 "
            "(NVIDIA/TransformerEngine#2318: TE 2.8 with cuDNN 9.10 fell back to unfused; PR #2568: THD sink "
            "attention on cuDNN 9.18 for GPT-OSS in Megatron-Bridge; #3249: sinks with d_qk 192 / d_v 128 pass "
            "on cuDNN 9.26)")
_TE_WINDOW = ("Transformer Engine DotProductAttention(window_size=(w, 0)), cuDNN sliding window; FlashAttention-3 "
              "hopper/flash_attn_interface.py window_size_left (Dao-AILab/flash-attention@0251105a)")
_TE_MLA = ("Transformer Engine head_dim_qk != head_dim_v (NVIDIA/TransformerEngine#3249: d_qk 192, d_v 128 on "
           "Hopper); FlashAttention-3 hopper/setup.py HDIMDIFF192 (Dao-AILab/flash-attention@0251105a), "
           "as Megatron-Core's MLA runs it")
_TE_CAUSAL = ("Megatron-Core TEDotProductAttention (Transformer Engine fused attention: cuDNN / "
              "FlashAttention-3, Shah et al. 2024)")
_SDPA = ("torch.nn.functional.scaled_dot_product_attention docs: query (N,...,L,E), key (N,...,S,E), value "
         "(N,...,S,Ev); no sink logits; torchtitan llama3 attn_type 'sdpa'")
_FLEX = ("torchtitan torchtitan/models/gpt_oss/model/model.py@00b1b07d: FlexAttentionWrapper with "
         "get_sliding_window_mask_mod, return_lse=True, sinks as sigmoid(lse - sinks); "
         "torch.nn.attention.flex_attention docs (block_mask, return_lse)")
_SOFTCAP_MEGATRON = ("Megatron-Bridge src/megatron/bridge/models/gemma/gemma2_provider.py@d9f7643b "
                     "(NVIDIA-NeMo/Megatron-Bridge): gemma2_layer_spec's core_attention is Gemma2DotProductAttention, "
                     "'unfused SDPA for attn logit softcapping' (baddbmm, logit_softcapping, FusedScaleMaskSoftmax)")
_SOFTCAP_FLEX = ("torch FlexAttention score_mod cap * tanh(score / cap) (pytorch.org/blog/flexattention, Aug 2024: "
                 "the soft-capping example) with the window's block mask; transformers 5.24 "
                 "models/gemma2/modeling_gemma2.py: _supports_sdpa = False ('sdpa does not support softcapping'), "
                 "_supports_flex_attn = True")
_PROGRAM = ("parcompile/runtime/model/core_attention.py attention_core (training, what verify measures) and "
            "runtime/serve/generate.py cached_attention (serving), as the program's row says (parcompile/ir/ops/attention.py)")
_COMPILE = ("torchtitan with torch.compile runs the same attention modules as eager (820504e "
            "torchtitan/models/llama3/model.py: SDPA; gpt-oss: FlexAttention, compiled either way)")
_AUTOMODEL_TE = ("NeMo AutoModel BackendConfig attn: te (Transformer Engine DotProductAttention: cuDNN fused, "
                 "sliding window and q/k head dims unequal to v's), its Qwen3 MoE and DeepSeek-V3 benchmark "
                 "recipes (examples/benchmark/configs/*_te_deepep.yaml@8d9bfb9)")
_AUTOMODEL_FLEX = ("NeMo AutoModel BackendConfig attn: flex, its gpt-oss recipe (gptoss_20b_te_deepep.yaml@8d9bfb9): "
                   "nemo_automodel/components/attention/flex_attention.py@8d9bfb9 runs flex_attention with "
                   "return_lse=True and rescales the output by sigmoid(lse - sinks)")

#: (engine, variant) -> the kernel it runs (module docstring)
ATTENTION_KERNELS: dict[tuple[str, str], KernelChoice] = {
    ("megatron", "causal"): KernelChoice("cudnn", _TE_CAUSAL),
    ("megatron", "sliding_window"): KernelChoice("cudnn", _TE_WINDOW),
    ("megatron", "sinks"): KernelChoice("cudnn", _TE_SINK),
    ("megatron", "mla"): KernelChoice("cudnn", _TE_MLA),
    ("eager", "causal"): KernelChoice("sdpa_flash", _SDPA),
    ("eager", "sliding_window"): KernelChoice("flex", _FLEX),
    ("eager", "sinks"): KernelChoice("flex", _FLEX),
    ("eager", "mla"): KernelChoice("sdpa_flash", _SDPA),
    ("compile", "causal"): KernelChoice("sdpa_flash", _SDPA + "; " + _COMPILE),
    ("compile", "sliding_window"): KernelChoice("flex", _FLEX + "; " + _COMPILE),
    ("compile", "sinks"): KernelChoice("flex", _FLEX + "; " + _COMPILE),
    ("compile", "mla"): KernelChoice("sdpa_flash", _SDPA + "; " + _COMPILE),
    ("automodel", "causal"): KernelChoice("cudnn", _AUTOMODEL_TE),
    ("automodel", "sliding_window"): KernelChoice("cudnn", _AUTOMODEL_TE),
    ("automodel", "sinks"): KernelChoice("flex", _AUTOMODEL_FLEX),
    ("automodel", "mla"): KernelChoice("cudnn", _AUTOMODEL_TE),
    ("megatron", "softcap"): KernelChoice("unfused", _SOFTCAP_MEGATRON),
    ("eager", "softcap"): KernelChoice("flex", _SOFTCAP_FLEX),
    ("compile", "softcap"): KernelChoice("flex", _SOFTCAP_FLEX + "; " + _COMPILE),
    ("automodel", "softcap"): KernelChoice("flex", _SOFTCAP_FLEX + " (AutoModel runs transformers' Gemma2 modules)"),
    ("program", "softcap"): KernelChoice("unfused", _PROGRAM + ": torch's SDPA cannot soft-cap, the softmax is spelt "
                                                    "out on the capped scores"),
    ("program", "causal"): KernelChoice("sdpa", _PROGRAM + ": F.scaled_dot_product_attention(is_causal=True)"),
    ("program", "sliding_window"): KernelChoice("sdpa", _PROGRAM + ": SDPA with causal_mask(q_pos, k_pos, window)"),
    ("program", "sinks"): KernelChoice("unfused", _PROGRAM + ": torch's SDPA takes no sinks, the softmax is "
                                                  "spelt out with one more column"),
    ("program", "mla"): KernelChoice("sdpa", _PROGRAM + ": v padded to the qk head dim, output cut"),
}

#: the rows of :data:`ATTENTION_KERNELS`
KERNEL_ENGINES = ("megatron", "eager", "compile", "automodel", "program")
#: the variants of :data:`ATTENTION_KERNELS`, in the order :func:`variant` tries them
VARIANTS = ("sinks", "softcap", "mla", "sliding_window", "causal")


def variant(attrs: Mapping) -> str:
    """The variant (:data:`VARIANTS`) of an attention op from its attributes: ``sinks``
    when it has sink logits, ``softcap`` when the scores are soft-capped (an MLA core's too:
    no fused SDPA caps them), ``mla`` when ``v_head_dim`` differs from ``head_dim``,
    ``sliding_window`` when ``0 < window < seq_len``, else ``causal``."""
    if attrs.get("sinks"):
        return "sinks"
    if attrs.get("softcap") is not None:
        return "softcap"
    v = attrs.get("v_head_dim")
    if v and v != attrs.get("head_dim"):
        return "mla"
    w = attrs.get("window") or 0
    if 0 < w < attrs.get("seq_len", 0):
        return "sliding_window"
    return "causal"


def attention_engine(cluster) -> str:
    """The row of :data:`ATTENTION_KERNELS` for ``cluster`` (a ClusterConfig): ``program``
    on the ``cpu`` preset (the generated program runs there, and ``verify`` measures it),
    else ``cluster.engine``."""
    if getattr(cluster, "preset", None) == "cpu":
        return "program"
    return getattr(cluster, "engine", None) or "megatron"


def kernel_choice(attrs: Mapping, engine: str) -> KernelChoice:
    """The :class:`KernelChoice` for an attention op's attributes under ``engine`` (a row
    of :data:`ATTENTION_KERNELS`); ``impl = unfused`` (``model.attention = unfused``) is the
    unfused core everywhere. Raises KeyError for an unknown engine."""
    if engine not in KERNEL_ENGINES:
        raise KeyError(f"no attention kernels for engine {engine!r} (one of {', '.join(KERNEL_ENGINES)})")
    if attrs.get("impl") == "unfused":
        return KernelChoice("unfused", "model.attention = unfused")
    return ATTENTION_KERNELS[(engine, variant(attrs))]


def attention_kernel(attrs: Mapping, engine: str | None = None) -> Kernel:
    """The :class:`Kernel` an attention op runs. ``engine`` None reads the ``kernel``
    attribute :func:`with_kernel` set, else takes the generated program's row (what the
    graph alone says)."""
    if engine is None:
        name = attrs.get("kernel")
        if name is not None:
            return KERNELS[name]
        engine = "program"
    return KERNELS[kernel_choice(attrs, engine).kernel]


def with_kernel(attrs: Mapping, engine: str) -> dict:
    """``attrs`` (an attention op's) with ``kernel`` set to the name of the kernel
    ``engine`` runs: what :mod:`parcompile.ir.ops`' memory and traffic rules read."""
    return {**attrs, "kernel": kernel_choice(attrs, engine).kernel}


__all__ = ["ATTENTION_KERNELS", "KERNELS", "KERNEL_ENGINES", "VARIANTS", "Kernel", "KernelChoice",
           "attention_engine", "attention_kernel", "kernel_choice", "variant", "with_kernel"]
