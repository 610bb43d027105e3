"""AST -> :class:`~parcompile.config.schema.SpecConfig`: keys, types, units, presets, defaults.

:func:`build_config` reads every block of a parsed spec, checks each entry on its own
(known key, given once, right type, unit of the right dimension, in range), applies
`from` presets and Hugging Face imports (block keys override them), fills defaults,
resolves ``auto`` degrees and then runs the cross-field checks of
:mod:`parcompile.frontend.checks`. Every problem becomes a diagnostic in the bag; none
stops the others. A value found wrong is left out (its default or a placeholder takes
its place) and its ``"block.key"`` is marked bad, so that no check built on it adds a
second, derived error.

The key table :data:`KEYS` is the single list of what each block accepts.
"""

from __future__ import annotations

import json
import math
import os
import typing
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from parcompile.frontend import checks
from parcompile.frontend.parser import MAX_INT_DIGITS
from parcompile.frontend.checks import AUTO, CheckContext
from parcompile.frontend.checks_offload import auto_dp_shard, resolve_dp_shard
from parcompile.core.hf import HFConfigError, load_hf_config
from parcompile.config.presets import (
    CLUSTER_PRESET_NAMES,
    MODEL_PRESET_NAMES,
    cluster_preset,
    model_preset,
)
from parcompile.config.schema import (
    ClusterConfig,
    ModelConfig,
    ParallelConfig,
    ServeConfig,
    SpecConfig,
    TrainConfig,
)
from parcompile.config.text import and_list, did_you_mean, or_list
from parcompile.config.units import DIMENSION_WORDS, SUGGESTED_UNIT, UNITS, dimension_of, to_si, units_of
from parcompile.frontend.paths import SpecPaths, model_source_on_disk
from parcompile.frontend.checks_recompute import convert_module_list
from parcompile.core.recompute import RECOMPUTE_MODULES
from parcompile.frontend.serve_values import (SERVE_AUTO_PLACEHOLDERS, checkpoint_quantization, prefill_gpus,
                                              serve_defaults)
from parcompile.core.model import MODEL_KEY_CHECKS, REQUIRED_MODEL_KEYS
from parcompile.diagnostics import DiagnosticBag, Span
from parcompile.frontend import ast

# --------------------------------------------------------------------------------------
# What each block accepts

Kind = Literal["int", "float", "bool", "enum", "str", "quantity", "fraction", "int_list", "float_list", "names"]


@dataclass(frozen=True)
class KeyType:
    """The type of one key: its kind and the range or choices its values must meet.

    ``low``/``high`` bound numbers (and list items), open when ``*_open``; ``choices``
    lists an enum's values; ``dimension`` a quantity's; ``auto`` admits the word
    ``auto``; ``length`` fixes a list's length.
    """

    kind: Kind
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    high_open: bool = False
    choices: tuple = ()
    dimension: str | None = None
    auto: bool = False
    length: int | None = None
    #: a quantity that also takes a bare ``0`` (no unit needed for nothing)
    zero_ok: bool = False
    #: bare words also accepted, returned as themselves (``eval_batches = all``)
    words: tuple[str, ...] = ()
    #: an enum that also takes a list of these names (``recompute = [moe_act, layernorm]``),
    #: returned as a tuple (:func:`parcompile.frontend.checks_recompute.convert_module_list`)
    list_choices: tuple[str, ...] = ()


def _choices(model: type[BaseModel], field: str) -> tuple:
    """The values of a ``Literal`` (or ``Optional[Literal]``) field of the schema."""
    annotation = model.model_fields[field].annotation
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is not Literal:  # Optional[Literal[...]]
        args = next(typing.get_args(a) for a in args if typing.get_origin(a) is Literal)
    return tuple(args)


def _enum(model: type[BaseModel], field: str) -> KeyType:
    return KeyType("enum", choices=_choices(model, field))


#: what an `auto` key holds until the search resolves it (``ParallelConfig.auto`` names it)
AUTO_PLACEHOLDERS = {"zero": 0, "recompute": "none", "schedule": "1f1b", "sequence_parallel": False, "offload": "none"}

_COUNT = KeyType("int", low=1)
_COUNT_OR_AUTO = KeyType("int", low=1, auto=True)
_NONNEG_INT = KeyType("int", low=0)
#: a seed: torch.manual_seed takes a signed 64-bit value; 0 .. 2**63 - 1 is the range every
#: consumer (torch generators, the data permutation) reads the same way
_SEED = KeyType("int", low=0, high=2**63 - 1)
_POSITIVE = KeyType("float", low=0, low_open=True)
_NONNEG = KeyType("float", low=0)
_BOOL = KeyType("bool")
_STR = KeyType("str")


def _quantity(dimension: str, low_open: bool = True) -> KeyType:
    return KeyType("quantity", low=0, low_open=low_open, dimension=dimension)


KEYS: dict[str, dict[str, KeyType]] = {
    # the model keys are declared once, with their checks, in core.model.ModelKeys
    "model": {name: KeyType(**asdict(check)) for name, check in MODEL_KEY_CHECKS.items()},
    "cluster": {
        "nodes": _COUNT, "gpus_per_node": _COUNT,
        "memory": _quantity("memory"),
        "peak_flops": _quantity("compute"),
        "hbm_bw": _quantity("bandwidth"),
        "op_overhead": _quantity("time", low_open=False),
        "intra_node_bw": _quantity("bandwidth"),
        "inter_node_bw": _quantity("bandwidth"),
        "intra_node_latency": _quantity("time", low_open=False),
        "inter_node_latency": _quantity("time", low_open=False),
        "memory_reserve": KeyType("fraction", low=0, high=1, high_open=True),
        "engine": _enum(ClusterConfig, "engine"),
        "nvlink_domain": _COUNT, "nics_per_node": _COUNT, "nvls": _BOOL,
        "expandable_segments": _BOOL, "tp_comm_overlap": _BOOL, "overlap_p2p_comm": _BOOL,
        "host_link_bw": _quantity("bandwidth"), "host_memory_bw": _quantity("bandwidth"),
        "host_memory": _quantity("memory"),
    },
    "parallel": {
        "dp": _COUNT_OR_AUTO, "tp": _COUNT_OR_AUTO, "pp": _COUNT_OR_AUTO,
        "cp": _COUNT_OR_AUTO, "ep": _COUNT_OR_AUTO,
        "expert_tp": _COUNT,
        "sequence_parallel": KeyType("bool", auto=True),
        "zero": replace(_enum(ParallelConfig, "zero"), auto=True),
        "micro_batch": _COUNT_OR_AUTO,
        "global_batch": _COUNT,
        "schedule": replace(_enum(ParallelConfig, "schedule"), auto=True),
        "virtual_stages": _COUNT_OR_AUTO,
        "microbatch_group_size": _COUNT,
        "stage_layers": KeyType("int_list", low=0),   # 0: first/last chunk only (checks.py)
        "recompute": replace(_enum(ParallelConfig, "recompute"), auto=True, list_choices=RECOMPUTE_MODULES),
        "order": _STR,
        "bucket_size": KeyType("quantity", low=0, dimension="memory", zero_ok=True),
        "reduce_dtype": _enum(ParallelConfig, "reduce_dtype"),
        "grad_dtype": _enum(ParallelConfig, "grad_dtype"),
        "dp_replicate": _COUNT_OR_AUTO, "dp_shard": _COUNT_OR_AUTO,
        "offload": replace(_enum(ParallelConfig, "offload"), auto=True),
    },
    "train": {
        "optimizer": _enum(TrainConfig, "optimizer"),
        "lr": _POSITIVE, "weight_decay": _NONNEG, "grad_clip": _NONNEG,
        "steps": _COUNT, "seed": _SEED, "data": _STR,
        "checkpoint_dir": _STR, "checkpoint_every": _NONNEG_INT, "log_every": _COUNT,
        "lr_schedule": _enum(TrainConfig, "lr_schedule"),
        "warmup_steps": _NONNEG_INT, "min_lr": _NONNEG,
        "betas": KeyType("float_list", low=0, high=1, high_open=True, length=2),
        "eps": _POSITIVE,
        "precision": _enum(TrainConfig, "precision"), "fp8_recipe": _enum(TrainConfig, "fp8_recipe"),
        "fp8_all_gather": _BOOL, "fp8_bf16_layers_start": _NONNEG_INT, "fp8_bf16_layers_end": _NONNEG_INT,
        "tokenizer": _STR, "eval_data": _STR, "text_field": _STR,
        "data_format": _enum(TrainConfig, "data_format"),
        "init_from": _STR, "eval_every": _NONNEG_INT,
        "eval_batches": KeyType("int", low=1, words=("all",)), "hf_output": _STR,
        "method": _enum(TrainConfig, "method"), "lora_rank": _COUNT, "lora_alpha": _POSITIVE,
        "lora_dropout": KeyType("fraction", low=0, high=1, high_open=True), "lora_targets": KeyType("names"),
        "lora_merge": _BOOL,
    },
    "serve": {
        "batch": _COUNT, "prompt_len": _COUNT, "max_new_tokens": _COUNT,
        "kv_dtype": _enum(ServeConfig, "kv_dtype"),
        "weights": _STR, "seed": _SEED,
        "temperature": _NONNEG, "top_k": _NONNEG_INT, "prompt": _STR,
        "block_size": KeyType("int", low=1, high=2**16), "kv_cache_tokens": KeyType("int", low=1, high=2**40), "prefix_caching": _BOOL,
        "max_prefill_tokens": _COUNT, "compile": _BOOL, "stream_interval": _COUNT,
        "waiting_served_ratio": _NONNEG, "max_waiting_steps": _NONNEG_INT,
        "engine": _enum(ServeConfig, "engine"),
        "weight_dtype": replace(_enum(ServeConfig, "weight_dtype"), auto=True),
        "concurrency": _COUNT,
        "request_rate": KeyType("float", low=0, low_open=True, words=("inf",)),
        "ttft_target": _quantity("time"), "tpot_target": _quantity("time"),
        "disaggregated": KeyType("bool", auto=True),
        "prefill_replicas": _COUNT, "prefill_tp": _COUNT,
    },
}
# `auto` in a serve spec: the sizing search fills them (parcompile/layout_search/serve.py)
KEYS["serve"].update(batch=_COUNT_OR_AUTO, kv_dtype=replace(KEYS["serve"]["kv_dtype"], auto=True))

BLOCK_KINDS: tuple[str, ...] = tuple(KEYS)
#: Blocks a spec must have, with an example for the help line (`parallel` defaults).
REQUIRED_BLOCKS = {"model": 'model llama from "llama3-8b" { }', "cluster": 'cluster gpus from "h100-sxm" { nodes = 1 }'}
#: Blocks that take a name and a `from` source.
NAMED_BLOCKS = ("model", "cluster")
#: `model` keys whose default derives from others (a default of a bad value is bad too).
DERIVED_MODEL_KEYS = {
    "kv_heads": ("heads",),
    "head_dim": ("hidden", "heads"),
    "ffn_hidden": ("hidden",),
    "expert_ffn_hidden": ("ffn_hidden",),
    "max_positions": ("seq_len",),
}

_INVALID = object()  # what a wrong value converts to
_PRESET_CASE = "preset names are case-sensitive"
_CASE = "values are case-sensitive"
ZERO_HELP = "0 none, 1 shards optimizer states, 2 also gradients, 3 also parameters"
#: what a bare number given to a quantity key most likely meant, by key
QUANTITY_NOTES = {
    "bucket_size": ("bucket_size counts bytes of fp32 gradients (4 per element); Megatron-LM's "
                    "--ddp-bucket-size and DeepSpeed's reduce_bucket_size count elements; `0` means one "
                    "bucket per model chunk, reduced after the backward"),
}
#: the example a help line writes for a bare number, by key (default: the number itself)
QUANTITY_EXAMPLES = {"bucket_size": "40 MB"}


# --------------------------------------------------------------------------------------
# One value


def _interval(t: KeyType) -> str:
    lo = "(" if t.low_open else "["
    hi = ")" if t.high_open else "]"
    return f"{lo}{t.low:g}, {t.high:g}{hi}"


class _Values:
    """Converts AST values to Python values of a :class:`KeyType`, reporting mistakes."""

    def __init__(self, bag: DiagnosticBag):
        self.bag = bag

    def convert(self, key: str, t: KeyType, v: ast.Value) -> Any:
        """The Python value of ``v`` for ``key`` (SI for quantities), or ``_INVALID``."""
        if t.auto and isinstance(v, ast.Word) and v.value == "auto":
            return AUTO
        if isinstance(v, ast.Word) and v.value in t.words:
            return v.value
        method = getattr(self, "_" + t.kind)
        return method(key, t, v)

    def _expected(self, what: str, v: ast.Value, help: str | None = None) -> object:
        if isinstance(v, ast.Quantity):
            help = f"drop the unit `{v.unit}`"
        self.bag.error(f"expected {what}, got `{v.text}`", v.span, help=help)
        return _INVALID

    def _in_range(self, key: str, t: KeyType, x: float, v: ast.Value) -> bool:
        if not math.isfinite(x):
            scale = to_si(1.0, v.unit) if isinstance(v, ast.Quantity) else 0.0   # > 1: 1e308 TB/s overflows in SI
            self.bag.error(f"expected a finite number, got `{v.text}`", v.span, help=f"`{v.text}` overflows a float" + (
                f" in base units ({scale:g} per {v.unit}): write a number below {1.7e308 / scale:.2g} {v.unit}"
                if scale > 1 else ": write a number below 1.8e308"))
            return False
        too_low = t.low is not None and (x <= t.low if t.low_open else x < t.low)
        too_high = t.high is not None and (x >= t.high if t.high_open else x > t.high)
        if not (too_low or too_high):
            return True
        if t.kind == "int" and too_high:   # a whole-number range (seed): exact bounds
            self.bag.error(f"{key} must be in [{t.low}, {t.high}], got `{v.text}`", v.span,
                           help=f"use a whole number from {t.low} to {t.high}"
                                + (" (2**63 - 1)" if t.high == 2**63 - 1 else ""))
        elif t.high is not None and t.kind != "int":
            self.bag.error(f"{key} must be in {_interval(t)}, got `{v.text}`", v.span,
                           help=f"{key} is a fraction: write e.g. `{t.high * 0.1:g}` or `{10 * t.high:g}%`")
        elif t.low == 0 and t.low_open:
            self.bag.error(f"{key} must be positive, got `{v.text}`", v.span, help="use a number above 0")
        elif t.low == 0:
            self.bag.error(f"{key} must not be negative, got `{v.text}`", v.span, help="use 0 or more")
        else:
            self.bag.error(f"{key} must be at least {t.low:g}, got `{v.text}`", v.span,
                           help=f"use {t.low:g} or more")
        return False

    def _int(self, key: str, t: KeyType, v: ast.Value) -> Any:
        if not isinstance(v, ast.Int):
            help = f"{key} takes a whole number" + (" or `auto`" if t.auto else "") \
                + "".join(f" or `{w}`" for w in t.words)
            return self._expected("an integer", v, help)
        return v.value if self._in_range(key, t, v.value, v) else _INVALID

    def _float(self, key: str, t: KeyType, v: ast.Value) -> Any:
        if not isinstance(v, (ast.Int, ast.Float)):
            return self._expected("a number", v, help=f"{key} takes a number such as `0.1` or `3e-4`")
        return float(v.value) if self._in_range(key, t, float(v.value), v) else _INVALID

    def _bool(self, key: str, t: KeyType, v: ast.Value) -> Any:
        if not isinstance(v, ast.Bool):
            return self._expected("`true` or `false`", v, help=f"write `{key} = true` or `{key} = false`")
        return v.value

    def _str(self, key: str, t: KeyType, v: ast.Value) -> Any:
        if not isinstance(v, (ast.String, ast.Word)):
            return self._expected("a string", v, help=f'write it in double quotes: `{key} = "..."`')
        return v.value

    def _enum(self, key: str, t: KeyType, v: ast.Value) -> Any:
        allowed = or_list(t.choices + (("auto",) if t.auto else ()), quote=True)   # `auto` for the search
        if t.list_choices and isinstance(v, ast.List):
            out = convert_module_list(self.bag, key, t.choices, t.list_choices, v)
            return _INVALID if out is None else out
        if isinstance(t.choices[0], int):  # zero = 0..3
            if isinstance(v, ast.Int) and v.value in t.choices:
                return v.value
            self.bag.error(f"{key} must be {or_list(t.choices)}, got `{v.text}`", v.span,
                           help=ZERO_HELP if key == "zero" else None)
            return _INVALID
        if isinstance(v, (ast.Word, ast.String)) and v.value in t.choices:
            return v.value
        word = v.value if isinstance(v, (ast.Word, ast.String)) else v.text
        self.bag.error(f"unknown {key} `{word}`", v.span,
                       help=f"{did_you_mean(str(word), t.choices + tuple(f'[{m}]' for m in t.list_choices), case_note=_CASE)}"
                            f"{key} may be {allowed}" + (", or a list of " + or_list(t.list_choices, quote=True)
                                                         if t.list_choices else ""))
        return _INVALID

    def _unit_ok(self, q: ast.Quantity) -> bool:
        if q.unit in UNITS:
            return True
        self.bag.error(f"unknown unit `{q.unit}`", q.unit_span,
                       help=f"{did_you_mean(q.unit, UNITS, case_note='units are case-sensitive')}units are "
                            f"{or_list(UNITS, quote=True)}")
        return False

    def _quantity(self, key: str, t: KeyType, v: ast.Value) -> Any:
        dim = t.dimension
        assert dim is not None
        wanted = DIMENSION_WORDS[dim]
        example_unit = SUGGESTED_UNIT[dim]
        if isinstance(v, (ast.Int, ast.Float)):
            if t.zero_ok and v.value == 0:
                return 0
            if t.zero_ok and v.value < 0:
                self.bag.error(f"{key} must not be negative, got `{v.text}`", v.span,
                               help=f"use 0 or a size such as `{QUANTITY_EXAMPLES.get(key, '1 GiB')}`")
                return _INVALID
            example = QUANTITY_EXAMPLES.get(key, f"{v.text} {example_unit}")
            help = f"write `{example}`; {wanted} takes {or_list(units_of(dim), quote=True)}"
            if key == "bucket_size" and isinstance(v, ast.Int):   # most likely elements, as Megatron-LM counts
                b = 4 * v.value
                size = f"{b // 10**6} MB" if b % 10**6 == 0 else f"{b} B"
                help = f"for {v.text} fp32 elements write `{size}`; or a size such as `{example}`"
            self.bag.error(f"missing unit: {key} takes {wanted}", v.span, help=help, note=QUANTITY_NOTES.get(key))
            return _INVALID
        if not isinstance(v, ast.Quantity):
            return self._expected(wanted, v, help=f"write e.g. `{key} = {QUANTITY_EXAMPLES.get(key, '80 ' + example_unit)}`")
        if not self._unit_ok(v):
            return _INVALID
        got = dimension_of(v.unit)
        if got != dim:
            self.bag.error(f"expected {wanted}, got {DIMENSION_WORDS[got]}", v.span,
                           help=f"{key} takes {or_list(units_of(dim), quote=True)}")
            return _INVALID
        x = to_si(float(v.number.value), v.unit)
        if not self._in_range(key, t, x, v):
            return _INVALID
        if key == "bucket_size" and 0 < x < 4:
            # below one fp32 gradient; rounding would silently turn it into 0 (no overlap)
            self.bag.error(f"bucket_size must be 0 or at least 4 B (one fp32 gradient), got `{v.text}`", v.span,
                           help="use 0 for one bucket per model chunk, or a size such as `40 MB`")
            return _INVALID
        return int(round(x)) if dim == "memory" else x

    def _fraction(self, key: str, t: KeyType, v: ast.Value) -> Any:
        if isinstance(v, ast.Quantity):
            if not self._unit_ok(v):
                return _INVALID
            if v.unit != "%":
                self.bag.error(f"expected a fraction, got {DIMENSION_WORDS[dimension_of(v.unit)]}", v.span,
                               help="write a number such as `0.1` or a percentage such as `10%`")
                return _INVALID
            x = to_si(float(v.number.value), "%")
        elif isinstance(v, (ast.Int, ast.Float)):
            x = float(v.value)
        else:
            return self._expected("a fraction", v, help="write a number such as `0.1` or a percentage such as `10%`")
        return x if self._in_range(key, t, x, v) else _INVALID

    def _list(self, key: str, t: KeyType, v: ast.Value, item: KeyType, example: str) -> Any:
        if not isinstance(v, ast.List):
            return self._expected("a list", v, help=f"write `{key} = {example}`")
        if t.length is not None and len(v.items) != t.length:
            self.bag.error(f"{key} needs {t.length} entries, got {len(v.items)}", v.span,
                           help=f"write `{key} = {example}`")
            return _INVALID
        out = [self.convert(f"each {key} entry", item, x) for x in v.items]
        return _INVALID if any(x is _INVALID for x in out) else tuple(out)

    def _int_list(self, key: str, t: KeyType, v: ast.Value) -> Any:
        return self._list(key, t, v, KeyType("int", low=t.low), "[8, 8, 7, 7]")

    def _float_list(self, key: str, t: KeyType, v: ast.Value) -> Any:
        item = KeyType("float", low=t.low, low_open=t.low_open, high=t.high, high_open=t.high_open)
        return self._list(key, t, v, item, "[0.9, 0.95]")

    def _names(self, key: str, t: KeyType, v: ast.Value) -> Any:
        """A name or a list of names (strings or bare words), as a tuple (``lora_targets``)."""
        if isinstance(v, (ast.String, ast.Word)):
            return (v.value,)
        return self._list(key, t, v, KeyType("str"), '["q_proj", "v_proj"]')


# --------------------------------------------------------------------------------------
# The whole spec


class _Reader:
    """A spec's blocks and entries, each checked on its own (:meth:`read_blocks`): owns the
    blocks by kind (``blocks``), the values read per block (``values``, each converted by
    :class:`_Values`) and the :class:`CheckContext` (``ctx``: the spans, the bad keys)."""

    def __init__(self, spec: ast.Spec, bag: DiagnosticBag):
        self.spec = spec
        self.bag = bag
        self.values_of = _Values(bag)
        self.blocks: dict[str, ast.Block] = {}
        self.values: dict[str, dict[str, Any]] = {kind: {} for kind in KEYS}
        self.ctx = CheckContext(bag=bag, filename=spec.filename)

    def read_blocks(self) -> None:
        """Every block of the spec (a known kind, given once, named where named, `from` only
        where it imports) and its entries (:meth:`read_entries`); one of `train` and `serve`;
        the required blocks."""
        for block in self.spec.blocks:
            kind = block.kind
            if kind not in KEYS:
                self.bag.error(f"unknown block `{kind}`", block.span,
                               help=f"{did_you_mean(kind, KEYS, case_note='block kinds are lowercase')}blocks are "
                                    f"{or_list(KEYS, quote=True)}")
                continue
            if kind in self.blocks:
                first = self.blocks[kind].span.line
                self.bag.error(f"block `{kind}` given twice", block.span, note=f"first given at line {first}",
                               help=f"move its keys into the `{kind}` block at line {first} and remove this one")
                continue
            if kind not in NAMED_BLOCKS:
                if block.name is not None:
                    self.bag.error(f"`{kind}` takes no name", block.name_span,
                                   help=f"write `{kind} {{ ... }}`")
                if block.source is not None:
                    self.bag.error(f"`{kind}` takes no `from`", block.source_span,
                                   help="only `model` and `cluster` import presets")
            elif block.name is None:
                self.bag.error(f"`{kind}` block needs a name", block.span,
                               help=f"write `{_named_example(block)}`; the name is a word such as "
                                    f"`{_NAME_EXAMPLES[kind]}`")
            self.blocks[kind] = block
            self.ctx.spans[kind] = block.span
            self.read_entries(block)
        if "train" in self.blocks and "serve" in self.blocks:
            train, serve = self.blocks["train"], self.blocks["serve"]
            later, earlier = (serve, train) if serve.span.line >= train.span.line else (train, serve)
            self.bag.error("a spec has `train` or `serve`, not both", later.span,
                           note=f"`{earlier.kind}` given at line {earlier.span.line}",
                           help="remove one of them: a training spec and a serving spec are two files (the same "
                                "`model` block in each)")
        for kind, example in REQUIRED_BLOCKS.items():
            if kind not in self.blocks:
                self.bag.error(f"missing `{kind}` block", Span.unknown(self.spec.filename),
                               help=f"add one, e.g. `{example}`")

    def read_entries(self, block: ast.Block) -> None:
        """``block``'s entries: a key of its kind, given once, its value converted and checked
        (:meth:`_Values.convert`) into ``values``, or its path marked bad."""
        keys = KEYS[block.kind]
        seen: dict[str, ast.Entry] = {}
        for entry in block.entries:
            key = entry.key
            if key in seen:
                self.bag.error(f"key `{key}` given twice", entry.key_span,
                               note=f"first given at line {seen[key].key_span.line}",
                               help=f"keep one `{key} = ...`: remove this line or line {seen[key].key_span.line}")
                continue
            seen[key] = entry
            if key not in keys:
                elsewhere = [kind for kind, ks in KEYS.items() if key in ks and kind != block.kind]
                hint = (f"`{key}` is a key of the `{elsewhere[0]}` block; move it there. " if elsewhere else
                        did_you_mean(key, keys, case_note='keys are lower_snake_case'))
                self.bag.error(f"unknown key `{key}` in `{block.kind}`", entry.key_span,
                               help=f"{hint}keys of `{block.kind}` are {', '.join(keys)}")
                continue
            path = f"{block.kind}.{key}"
            self.ctx.spans[path] = entry.value_span
            if isinstance(entry.value, ast.List):   # each entry's own span: "parallel.recompute[1]"
                self.ctx.spans.update((f"{path}[{i}]", x.span) for i, x in enumerate(entry.value.items))
            value = self.values_of.convert(key, keys[key], entry.value)
            if value is _INVALID:
                self.ctx.bad.add(path)
            else:
                self.values[block.kind][key] = value

class _Sources:
    """What a block's `from` gives it: a model preset or a Hugging Face ``config.json``
    (:meth:`model_base`, each imported key checked as if written in the spec), a cluster
    preset (:meth:`cluster_base`), this machine's figures for `cpu` (:meth:`host_base`); a
    source that fails is an error at the `from` (``bag``), its bad keys marked in ``ctx``.
    Reads the keys the blocks give (``values``: they replace the imported ones), relative
    paths from ``source_dir``."""

    def __init__(self, reader: _Reader, source_dir: str | None):
        self.bag, self.ctx, self.values, self.source_dir = reader.bag, reader.ctx, reader.values, source_dir

    def _source_error(self, block: ast.Block, message: str, help: str | None = None) -> None:
        self.bag.error(message, block.source_span or block.span, help=help)

    def model_base(self, block: ast.Block) -> dict[str, Any] | None:
        """What `from` gives the model block ({} without `from`); None when it failed."""
        src = block.source
        if src is None:
            return {}
        preset = model_preset(src)
        if preset is not None:
            return preset
        if src.endswith(".json"):
            path = Path(src) if os.path.isabs(src) else Path(self.source_dir or ".") / src
            try:
                return self._imported_values(block, load_hf_config(path))
            except HFConfigError as e:
                self._source_error(block, e.message, e.help)
                return None
        if src in CLUSTER_PRESET_NAMES:
            self._source_error(block, f"`{src}` is a cluster preset, not a model preset",
                               help=f"model presets are {or_list(MODEL_PRESET_NAMES, quote=True)}")
            return None
        self._source_error(block, *(model_source_on_disk(src, self.source_dir) or (
            f"unknown model preset `{src}`", f"{did_you_mean(src, MODEL_PRESET_NAMES, case_note=_PRESET_CASE)}model "
            f"presets are {or_list(MODEL_PRESET_NAMES, quote=True)}, or a path to a Hugging Face `config.json`")))
        return None

    def _imported_values(self, block: ast.Block, base: dict[str, Any]) -> dict[str, Any]:
        """The `model` keys a config.json gave, each checked as if written in the spec (its
        type, range, choices; integers of at most :data:`MAX_INT_DIGITS` digits, as the
        parser allows). A bad one is an error at the `from` source, naming the key, and is
        dropped (the checks that read it skip)."""
        keys, out = KEYS["model"], {}
        span = block.source_span or block.span
        given = self.values["model"]   # keys written in the block replace the file's
        for key, value in base.items():
            t = keys.get(key)
            if t is None or key in given or t.kind not in ("int", "float", "bool", "str", "enum"):
                out[key] = value
                continue
            text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
            if isinstance(value, bool):
                node: Any = ast.Bool(value, text, span)
            elif isinstance(value, int):
                if len(str(abs(value))) > MAX_INT_DIGITS:
                    self.bag.error(f"`{block.source}` gives {key} an integer of {len(str(abs(value)))} digits",
                                   span, help=f"{key} takes at most {MAX_INT_DIGITS} digits: fix the config.json")
                    self.ctx.bad.add(f"model.{key}")
                    continue
                node = ast.Int(value, text, span)
            elif isinstance(value, float):
                node = ast.Float(value, text, span)
            else:
                node = ast.String(str(value), text, span)
            scratch = DiagnosticBag()
            converted = _Values(scratch).convert(key, t, node)
            for d in scratch.items:
                self.bag.error(f"`{block.source}` gives an invalid {key}: {d.message}", span,
                               help=(d.help + "; " if d.help else "") + f"fix the config.json, or write `{key} = ...` "
                                                                         f"in the block")
            if converted is _INVALID:
                self.ctx.bad.add(f"model.{key}")
            else:
                out[key] = value
        return out

    def cluster_base(self, block: ast.Block, dtype: str) -> dict[str, Any] | None:
        src = block.source
        if src is None:
            return {}
        preset = cluster_preset(src, dtype)
        if preset is not None:
            return preset
        if src in MODEL_PRESET_NAMES:
            message = f"`{src}` is a model preset, not a cluster preset"
        else:
            message = f"unknown cluster preset `{src}`"
        self._source_error(block, message,
                           help=f"{did_you_mean(src, CLUSTER_PRESET_NAMES, case_note=_PRESET_CASE)}cluster presets are "
                                f"{or_list(CLUSTER_PRESET_NAMES, quote=True)}")
        return None

    def host_base(self, block: ast.Block, fixed: dict[str, Any]) -> dict[str, Any]:
        """The `cpu` preset on this machine (:func:`parcompile.frontend.host.cpu_values`) for
        the spec's ``gpus_per_node`` ranks; the fixed figures, with an error at the block,
        when ``PARCOMPILE_CPU_PROBE`` is malformed."""
        from parcompile.frontend import host

        ranks = self.values["cluster"].get("gpus_per_node", fixed.get("gpus_per_node", 8))
        ranks = ranks if isinstance(ranks, int) and not isinstance(ranks, bool) and ranks > 0 else fixed["gpus_per_node"]
        try:
            return host.cpu_values(fixed, ranks)
        except host.HostError as e:
            self._source_error(block, str(e), f"unset {host.ENV}, or set it to `fixed`, `probe` or figures")
            return fixed

class _Builder:
    """The :class:`SpecConfig` of a spec: its blocks read (:class:`_Reader`), each config
    made from its block's values over what `from` gives (:class:`_Sources`), with defaults
    and placeholders for what is missing or bad, paths resolved (:class:`SpecPaths`),
    ``auto`` degrees resolved or left to the search, then the cross-field checks
    (:meth:`build`)."""

    def __init__(self, spec: ast.Spec, bag: DiagnosticBag, source_dir: str | None):
        self.reader = _Reader(spec, bag)
        self.sources = _Sources(self.reader, source_dir)
        self.spec, self.bag, self.source_dir = spec, bag, source_dir
        self.blocks, self.values, self.ctx = self.reader.blocks, self.reader.values, self.reader.ctx
        self.paths = SpecPaths(source_dir, bag, self.ctx)

    def _make(self, cls: type[BaseModel], kind: str, **values: Any) -> Any:
        """Construct ``cls``; a validation error (a checker gap) becomes a diagnostic."""
        try:
            return cls(**values)
        except ValidationError as e:  # pragma: no cover - every key is checked above
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            self.bag.error(f"invalid `{kind}` {where}: {first['msg']}", self.ctx.span(kind))
            return None

    def model(self) -> ModelConfig:
        block = self.blocks.get("model")
        given = self.values["model"]
        base = self.sources.model_base(block) if block is not None else None
        if base is None:  # no block, or `from` failed: what is missing is not the user's slip
            self.ctx.bad.update(f"model.{k}" for k in REQUIRED_MODEL_KEYS if k not in given)
            base = {}
        values = {**base, **given}
        missing = [k for k in REQUIRED_MODEL_KEYS if k not in values and f"model.{k}" not in self.ctx.bad]
        if missing:
            assert block is not None
            plural = "s" if len(missing) > 1 else ""
            self.bag.error(f"missing required key{plural} {and_list(missing, quote=True)} in `model`", block.span,
                           help=f"add `{missing[0]} = ...`, or start from a preset: "
                                f"`model {block.name or 'llama'} from \"llama3-8b\" {{ ... }}`")
            self.ctx.bad.update(f"model.{k}" for k in missing)
        self.ctx.provided.update(f"model.{k}" for k in values)
        for key, sources in DERIVED_MODEL_KEYS.items():  # in dependency order
            if key not in values and not self.ctx.ok(*(f"model.{k}" for k in sources)):
                self.ctx.bad.add(f"model.{key}")
        placeholders = {k: 1 for k in REQUIRED_MODEL_KEYS}  # for bad keys; checks skip them
        name = (block.name if block is not None else None) or _preset_name(block) or "model"
        return (self._make(ModelConfig, "model", name=name, **{**placeholders, **values})
                or ModelConfig(name=name, **placeholders))

    def cluster(self, dtype: str) -> ClusterConfig:
        block = self.blocks.get("cluster")
        if block is None:
            self.ctx.bad.update({"cluster.nodes", "cluster.gpus_per_node"})
            return ClusterConfig()
        base = self.sources.cluster_base(block, dtype)
        if base is None:
            base = {}
        if block.source == "cpu":       # this machine's figures, shared by the node's ranks (frontend/host.py)
            base = self.sources.host_base(block, base)
        values = {**base, **self.values["cluster"]}
        self.ctx.provided.update(f"cluster.{k}" for k in values)
        name = block.name or block.source or "cluster"
        preset = block.source if block.source in CLUSTER_PRESET_NAMES else None
        return self._make(ClusterConfig, "cluster", name=name, preset=preset, **values) or ClusterConfig()

    def parallel(self, cluster: ClusterConfig) -> ParallelConfig:
        values = dict(self.values["parallel"])
        auto_dp_shard(values, self.ctx)
        serve = "serve" in self.blocks   # a serve spec has no global batch: the sizing search sets dp (replicas)
        auto = [k for k, v in values.items() if v is AUTO and not (serve and k == "dp_replicate")]   # dropped below
        for k in auto:
            if k != "dp":
                # a placeholder: `parcompile search` (and compile, plan, check) choose the
                # value; checks that read an `auto` key skip until the search fills it
                values[k] = AUTO_PLACEHOLDERS.get(k, 1)
        if "global_batch" not in values and "global_batch" not in self.ctx.bad and not serve:
            for k in ("dp", "micro_batch"):
                if k in auto:
                    self.bag.error(f"{k} = auto needs `global_batch`", self.ctx.span(f"parallel.{k}"),
                                   help="add `global_batch = N` (sequences per optimizer step)")
        if "dp" not in values:
            auto.insert(0, "dp")  # dp's default is `auto`
            varies = [k for k in ("tp", "pp", "cp") if k in auto]
            if varies and "global_batch" not in values and "global_batch" not in self.ctx.bad and not serve:
                # each candidate's dp fills the world, so the default global batch (micro_batch * dp)
                # would differ between the layouts the search compares by step time
                self.bag.error(f"{varies[0]} = auto with dp left to fill the world needs `global_batch`",
                               self.ctx.span(f"parallel.{varies[0]}"),
                               help="add `global_batch = N` (sequences per optimizer step), or give dp",
                               note="each layout's dp = world / (tp * pp * cp) differs, and so would its default "
                                    "global batch (micro_batch * dp): the search would compare steps of different "
                                    "sizes")
        dp = values.get("dp", AUTO)
        if dp is AUTO or not any(k in auto for k in ("tp", "pp", "cp")):
            values["dp"] = checks.resolve_dp(dp, values, cluster, self.ctx, prefill_gpus(self.values.get("serve") or {}, values))
        for k in auto:
            if k != "dp":
                self.ctx.bad.add(f"parallel.{k}")
        if any(k != "dp" for k in auto):
            self.ctx.bad.add("parallel.dp")   # resolved per candidate by the search
        resolve_dp_shard(values, self.ctx, searched=any(k != "dp" for k in auto))
        if serve and values.get("dp_replicate", 1) != 1:   # dropped (`auto` too): HSDP's degrees of dp would not hold
            del values["dp_replicate"]
            self.bag.warning("HSDP (dp_replicate, dp_shard) has no effect: a `serve` spec has no states to shard",
                             self.ctx.span("parallel.dp_replicate", "parallel.dp_shard"),
                             help="remove `dp_replicate` and `dp_shard`")
        return self._make(ParallelConfig, "parallel", auto=tuple(sorted(auto)), **values) or ParallelConfig()

    def train(self) -> TrainConfig:
        values = dict(self.values["train"])
        if values.get("eval_batches") == "all":
            values["eval_batches"] = None
        self.paths.resolve_train(values)
        return self._make(TrainConfig, "train", **values) or TrainConfig()

    def serve(self, model: ModelConfig, cluster: ClusterConfig) -> ServeConfig | None:
        if "serve" not in self.blocks:
            return None
        values = dict(self.values["serve"])
        auto = sorted(k for k, v in values.items() if v is AUTO)
        for k in auto:
            values[k] = SERVE_AUTO_PLACEHOLDERS[k]
            self.ctx.bad.add(f"serve.{k}")   # checks that read it skip until the search fills it
        serve_defaults(values, model.dtype, cluster.preset)
        self.paths.refuse_empty(values, "serve", "weights")
        weights = values.get("weights")
        if weights is not None:
            values["weights"] = self.paths.resolve(weights)
            if os.path.exists(values["weights"]) and not os.path.isdir(values["weights"]):
                # a file (model.safetensors itself), a FIFO, a device: was "does not exist yet"
                self.bag.error(f"weights `{weights}` is not a directory: a checkpoint is a directory (config.json "
                               "and *.safetensors, or a training run's checkpoint_dir)", self.ctx.span("serve.weights"),
                               help="give the directory that holds the checkpoint's files")
                self.ctx.bad.add("serve.weights")
            elif not os.path.isdir(values["weights"]):
                self.bag.warning(f"weights directory `{weights}` does not exist yet",
                                 self.ctx.span("serve.weights"),
                                 help="it must hold a Hugging Face checkpoint or one written by a training run")
            else:
                checkpoint_quantization(values, auto, self.bag, self.ctx)
        return self._make(ServeConfig, "serve", auto=tuple(auto), **values) or ServeConfig()

    def build(self, name: str) -> SpecConfig:
        self.reader.read_blocks()
        model = self.model()
        cluster = self.cluster(model.dtype)
        parallel = self.parallel(cluster)
        train = self.train()
        serve = self.serve(model, cluster)
        cfg = SpecConfig(
            name=name,
            filename=self.spec.filename,
            source_dir=self.source_dir,
            model=model,
            cluster=cluster,
            parallel=parallel,
            workload="serve" if serve is not None and "train" not in self.blocks else "train",
            train=train,
            serve=serve,
            spans=dict(self.ctx.spans),
        )
        checks.check_config(cfg, self.ctx)
        return cfg


_NAME_EXAMPLES = {"model": "llama", "cluster": "gpus"}


def _named_example(block: ast.Block) -> str:
    """``model llama from "llama3-8b" { ... }``: ``block``'s header with an example name."""
    source = f' from "{block.source}"' if block.source is not None else ""
    return f"{block.kind} {_NAME_EXAMPLES[block.kind]}{source} {{ ... }}"


def _preset_name(block: ast.Block | None) -> str | None:
    """The `from` source of ``block`` unless it is a file (a default for the block's name)."""
    if block is None or block.source is None or block.source.endswith(".json"):
        return None
    return block.source


def build_config(spec: ast.Spec, bag: DiagnosticBag, name: str = "spec",
                 source_dir: str | None = None) -> SpecConfig:
    """Build the resolved :class:`SpecConfig` of ``spec``, reporting every mistake into ``bag``.

    ``name`` becomes ``SpecConfig.name``; ``source_dir`` is where `from "x.json"` and
    `data` paths are resolved (None: the working directory). Always returns a config;
    when ``bag`` holds errors its values are partly placeholders and must not be used.
    """
    return _Builder(spec, bag, source_dir).build(name)
