"""LoRA adapters in a generated training program (``train.method = lora``; the plan's facts
are :mod:`parcompile.core.lora`'s): the model's weights frozen, each targeted linear
``y = W x`` gaining ``(alpha / r) B (A x)`` with A (r, in) and B (out, r) trained.

Initialisation as Hugging Face PEFT's ``LoraLayer.reset_lora_parameters`` (``init_lora_weights
= True``): A Kaiming-uniform with ``a = sqrt(5)`` (uniform in ``+-1/sqrt(in)``), B zeros, so
the adapted model starts as the base model; the global A is drawn from the run's seed and the
tensor's name, as every other parameter (:func:`parcompile.runtime.model.layers.global_init`),
and each rank keeps its shard. Dropout on the adapter's input as PEFT's ``lora_dropout``.

Tensor parallelism as Megatron-Bridge's ``ParallelLinearAdapter``
(NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/peft/utils.py @
067f987df03b8355b03192d88d70f1709fedf51a):

* column-parallel base (input replicated, output split over ``out``): A split over r, its
  output all-gathered along r (``linear_in = ColumnParallelLinear(in, r,
  gather_output=True)``; the backward reduce-scatters the r-wide gradient, which every
  rank's B shard adds to); B split over ``out`` like the base (``linear_out``, no gather):
  the adapter's output is this rank's columns, added to the base's;
* row-parallel base (input split over ``in``, output all-reduced): A split over ``in`` like
  the base, its r-wide partial sums all-reduced (``linear_in = RowParallelLinear(in, r,
  input_is_parallel=True)``); B split over ``out``, its output all-gathered along ``out``
  (``linear_out = ColumnParallelLinear(r, out, gather_output=True)``; the backward keeps
  this rank's columns of the whole gradient, and the r-wide input's gradient is all-reduced):
  the adapter's output is whole on every rank, added after the base's all-reduce.
"""

from __future__ import annotations

import math
import re
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from parcompile.runtime.distributed.comm import all_gather_dim, copy_to_tp, gather_along, gather_keep_slice, reduce_from_tp
from parcompile.runtime.distributed.context import Axis
from parcompile.runtime.model.layers import ColumnParallelLinear, RowParallelLinear, shard_part

_TARGET = re.compile(r"^layers\.\d+\..+\.([A-Za-z0-9_]+)\.weight$")


def lora_a_init(name: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """The global fp32 initial A (r, in): PEFT's ``nn.init.kaiming_uniform_(a=math.sqrt(5))``,
    i.e. uniform in ``+-1 / sqrt(in)``, from a generator seeded as
    :func:`parcompile.runtime.model.layers.global_init` seeds one."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=g)


def _param(name: str, full_shape: tuple[int, int], value, dim: int, tp: Axis, dtype) -> nn.Parameter:
    """This rank's shard (along ``dim`` over ``tp``) of an adapter tensor, with the layout
    attributes checkpoints and exports read (as :func:`parcompile.runtime.model.layers.make_param`)."""
    parts = tp.size
    p = nn.Parameter(shard_part(value(), dim, tp.index, parts).to(dtype))
    p.global_name = name
    p.shard_dim = dim if parts > 1 else None
    p.shard_index = tp.index if parts > 1 else 0
    p.num_shards = parts
    p.global_shape = tuple(full_shape)
    p.valid_rows = None
    p.lora = True
    return p


class LoraAdapter(nn.Module):
    """The adapter of one linear layer (module docstring): ``base`` its name
    (``layers.0.attn.wq``), ``row`` whether the base is row-parallel, ``sequence_parallel``
    whether a row-parallel base's output is reduce-scattered along the sequence (the
    adapter's output then keeps this rank's tokens)."""

    def __init__(self, base: str, in_features: int, out_features: int, rank: int, alpha: float, dropout: float,
                 tp: Axis, seed: int, row: bool, sequence_parallel: bool, dtype: torch.dtype):
        super().__init__()
        if rank % tp.size and not row:
            raise ValueError(f"{base}: lora rank {rank} does not split over tp = {tp.size}")
        self.tp, self.row, self.sp = tp, row, sequence_parallel
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        a_name, b_name = f"{base}.lora_A.weight", f"{base}.lora_B.weight"
        self.lora_A = _param(a_name, (rank, in_features), lambda: lora_a_init(a_name, (rank, in_features), seed),
                             1 if row else 0, tp, dtype)
        self.lora_B = _param(b_name, (out_features, rank), lambda: torch.zeros(out_features, rank), 0, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the base layer's input on this rank -> the adapter's share of its output."""
        x = self.dropout(x)
        if not self.row:
            h = gather_along(F.linear(x, self.lora_A), self.tp, -1)          # (.., r)
            return F.linear(h, self.lora_B) * self.scaling                   # (.., out/tp)
        h = copy_to_tp(reduce_from_tp(F.linear(x, self.lora_A), self.tp), self.tp)   # (.., r), whole
        y = F.linear(h, self.lora_B) * self.scaling                          # (.., out/tp)
        if self.tp.size > 1:
            y = gather_keep_slice(y, self.tp, y.dim() - 1)              # (.., out), whole
        if self.sp and self.tp.size > 1:
            y = _SplitSequence.apply(y, self.tp)
        return y


class _SplitSequence(torch.autograd.Function):
    """Forward: this rank's part of the sequence (dim 1) of a tensor whole on every rank.
    Backward: all-gather the parts' gradients along the sequence (Megatron-Core's
    ``scatter_to_sequence_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x.chunk(axis.size, dim=1)[axis.index].contiguous()

    @staticmethod
    def backward(ctx, g):
        return all_gather_dim(g.contiguous(), ctx.axis, 1), None


def add_lora(model: nn.Module, lora: dict, tp: Axis, seed: int, dtype: torch.dtype) -> list[str]:
    """Freeze every parameter of ``model`` and give each targeted linear an adapter.

    ``lora``: the program's ``LORA`` (``rank``, ``alpha``, ``dropout``, ``modules``: our leaf
    names, ``wq``...). Returns the adapted layers' names, in model order.

    Raises:
        ValueError: a targeted linear whose output stays a partial sum over tp (the program
            reduces it later, after other partial sums: no adapter can be added there).
    """
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for module in list(model.modules()):
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        m = _TARGET.match(getattr(module.weight, "global_name", ""))
        if m is None or m.group(1) not in lora["modules"]:
            continue
        base = module.weight.global_name[:-len(".weight")]
        out_f, in_f = module.weight.global_shape
        row = isinstance(module, RowParallelLinear)
        if row and module.partial and tp.size > 1:
            raise ValueError(f"{base}: its output stays a partial sum over tp; LoRA cannot adapt it")
        module.lora = LoraAdapter(base, in_f, out_f, lora["rank"], lora["alpha"], lora["dropout"], tp, seed,
                                  row, row and module.sequence_parallel, dtype).to(module.weight.device)
        names.append(base)
    return names


class Adapters(nn.Module):
    """A module view over the adapters' parameters of a stage (what the optimizer, the
    gradient buckets and checkpoints see under LoRA), with the stage's ``chunks``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.held = nn.ParameterList([p for p in model.parameters() if getattr(p, "lora", False)])
        self.chunks = getattr(model, "chunks", None)
        self.__dict__["base"] = model   # the stage (not a submodule: its parameters are not the adapters')


def frozen_bytes(model: nn.Module) -> int:
    """Bytes of the frozen parameters of ``model`` (each once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not getattr(p, "lora", False))


def lora_state_bytes(model: nn.Module, opt) -> dict[str, int]:
    """``opt.state_bytes()`` (the adapters') with the frozen weights added to ``params``
    (zero 3: this rank's shards of them, ``opt.frozen_shards``): what the plan's memory
    counts per rank (:mod:`parcompile.analysis.lora`)."""
    out = dict(opt.state_bytes())
    shards = getattr(opt, "frozen_shards", None)
    out["params"] = out.get("params", 0) + (shards.shard_bytes() if shards is not None else frozen_bytes(model))
    return out
