"""The generated program's decoder-layer classes, written op by op from the sharded graph
(issue 31: nnScaler's per-rank code from each node, nanoGPT's readability).

A class is a set of ops of one representative layer (:class:`~parcompile.codegen.program_data.LayerData`)
in graph order: the MLP's ``mlp.*`` ops, a MoE layer's shared experts ``mlp.shared.*``, the
layer itself (``Block``: its norms and residual adds, with ``attn.*`` and ``mlp.*`` as
sub-modules). Each op is written by its kind's :class:`~parcompile.ir.ops.Code` row
(:func:`~parcompile.ir.ops.code_of`): its ``__init__`` line from the node's local types and
attributes, its forward expression, and the collectives of the conversions around it
(``redistribute`` ops: a tensor-parallel region entered replicated or sequence-parallel, a
row-parallel layer's partial sum all-reduced or reduce-scattered). Nothing here reads the
config: whether a line exists, and what it calls, is a fact of the graph.

Forward code is SSA turned into Python: a value used once whose row allows it is written
inside its consumer's expression; the others get a variable (the consumer's name for the
operand, ``gate``/``up``, else the row's), a name being reused once its value is dead.
Each statement carries the per-rank shape of what it computes and the collectives it runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from parcompile.codegen.program_data import LayerAttributeError, LayerData, LayerTable, OpData
from parcompile.ir.ops import Code, Trait, code_of, has_trait

#: the program's constants for the global sizes of the graph's dims (``ir/lower.py``'s names)
DIM_CONSTANTS = {"hidden": "HIDDEN", "ffn": "FFN_HIDDEN", "q": "HEADS * HEAD_DIM", "kv": "KV_HEADS * HEAD_DIM",
                 "shared_ffn": "SHARED_FFN", "vocab": "PADDED_VOCAB", "experts": "EXPERTS", "topk": "TOP_K"}
#: the same in a program with multi-head latent attention (its own head widths)
MLA_CONSTANTS = {**DIM_CONSTANTS, "q": "HEADS * (QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM)", "q_lora": "Q_LORA_RANK",
                 "kv_a": "KV_LORA_RANK + QK_ROPE_HEAD_DIM", "kv_lora": "KV_LORA_RANK",
                 "kv_b": "HEADS * (QK_NOPE_HEAD_DIM + V_HEAD_DIM)", "v": "HEADS * V_HEAD_DIM"}
COMMENT_COLUMN = 56
#: the axes a class's forward may read (``self.<axis>``) and where its ``__init__`` takes them
#: from: its arguments ``tp``, ``cp`` and a MoE layer's ``experts`` (``rt.ExpertAxes``)
AXIS_SOURCES = {"tp": "tp", "cp": "cp", "ep": "experts.ep", "expert_tp": "experts.expert_tp"}


def describe(calls) -> str:
    """``forward all_reduce(tp) x 3, backward ...``: runs of equal collectives counted."""
    out: list[list] = []
    for c in calls:
        if out and out[-1][0] == c.describe():
            out[-1][1] += 1
        else:
            out.append([c.describe(), 1])
    return ", ".join(d if n == 1 else f"{d} x {n}" for d, n in out)


def calls_comment(op: OpData | None, layer: int | None = None, none: str = "no collective",
                  forward_only: bool = False) -> str:
    """A conversion's collectives for a comment, by the plan's name for it:
    ``layers.{i}.attn.all_gather: forward all_gather(tp), backward reduce_scatter(tp)``
    (``layer``: the index written as ``{i}``, the program's classes serve every layer;
    ``forward_only``: a serving program's, which has no backward)."""
    calls = [c for c in op.collectives if not forward_only or c.phase == "forward"] if op is not None else []
    if not calls:
        return none
    name = op.name if layer is None else op.name.replace(f"layers.{layer}.", "layers.{i}.", 1)
    return f"{name}: " + describe(calls)


@dataclass(frozen=True)
class Submodule:
    """A group of a layer's ops that a class runs as one module of another generated class:
    ``self.<attr> = <build>`` in ``__init__``, ``self.<attr>(<inputs><extra>)`` in forward."""

    attr: str
    build: str
    extra: str = ""
    #: the op names (after the class's prefix) it runs; empty: those named ``<attr>.*``
    members: tuple[str, ...] = ()


class LayerValue:
    """A per-layer attribute's value as a generated class's lines read it: the class's own
    attribute ``self.<var>``, which its ``__init__`` sets from the program's table of the
    layers' values (:class:`~parcompile.codegen.program_data.LayerTable`). A row writes it
    (``{a[scale]!r}``, ``f"{a['scale']!r}"``) but may not decide on its value: that is one
    layer's."""

    def __init__(self, var: str, table: LayerTable):
        self.var, self.table = var, table

    def __repr__(self) -> str:
        return f"self.{self.var}"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return format(repr(self), spec)

    def __bool__(self) -> bool:
        raise LayerAttributeError(f"internal error: a program row decides on {self.table.attr!r} of "
                                  f"layers.{{i}}.{self.table.op}, which differs between layers "
                                  f"({self.table.literal()}); a row may only write it")


@dataclass
class _Value:
    text: str                 # a variable name, or an expression still to be written (pending)
    pending: bool
    notes: list[str] = field(default_factory=list)
    refs: frozenset[str] = frozenset()   # variables a pending expression reads


@dataclass(frozen=True)
class Methods:
    """A generated class's ``__init__`` body lines and ``forward`` (signature and body)."""

    init: tuple[str, ...]
    forward_signature: str
    forward: tuple[str, ...]

    def text(self, init_signature: str) -> str:
        """The two methods, indented for a class body."""
        lines = [f"    def __init__(self, {init_signature}):", "        super().__init__()"]
        lines += [f"        {ln}" for s in self.init for ln in s.split("\n")]
        lines += ["", f"    {self.forward_signature}"]
        lines += [f"        {ln}" for s in self.forward for ln in s.split("\n")]
        return "\n".join(lines)


def _fstring_name(name: str, layer: int) -> str:
    """A layer's name as the f-string its class writes (``f"layers.{i}.attn.wq"``); a name
    outside the layers (``embedding``) as a plain string."""
    if not name.startswith(f"layers.{layer}."):
        return f'"{name}"'
    return 'f"' + name.replace(f"layers.{layer}.", "layers.{i}.", 1) + '"'


def program_attrs(op: OpData, every: Mapping[str, OpData]) -> dict:
    """``op``'s attributes with the graph facts a :class:`Code` row reads beside them:
    ``_gathers`` (the axes it all-gathers operands over itself, from its collectives),
    ``_out_local`` (its output's per-rank shape), ``_axes`` (every axis its collectives
    cross), ``_bias`` (it has a bias parameter),
    ``_seq_split`` (the axes splitting its output's sequence), ``_split_dim`` (a local
    split's dim), ``_tied_to`` (the parameter
    its first parameter is tied to: a tied LM head) and ``_tied_by`` (another op's
    parameter is tied to its first: the embedding of a tied head)."""
    seq = op.splits[op.dims.index("seq")] if "seq" in op.dims else ()
    first = op.param_names[0] if op.param_names else None
    return {**dict(op.attrs),
            "_gathers": tuple(sorted({c.axis for c in op.collectives if c.op == "all_gather" and c.phase == "forward"})),
            "_seq_split": seq,
            "_out_local": tuple(op.local_shape),
            "_axes": tuple(sorted({c.axis for c in op.collectives})),
            "_bias": any(n.endswith(".bias") for n in op.param_names),
            "_tied_to": (op.param_tied[0] or "").removesuffix(".weight") if op.param_tied else "",
            "_tied_by": first is not None and any(first in o.param_tied for o in every.values()),
            # a conversion splitting locally: the dim its split axis splits
            "_split_dim": next((k for k, axes in enumerate(op.splits) for kind, ax in dict(op.attrs).get("fwd", ())
                                if kind == "split" and ax in axes), None)}


def _facts(op: OpData, layer: int, reduce: str | None, constants: Mapping[str, str] = DIM_CONSTANTS) -> dict:
    """The fields a :class:`Code` row's ``build`` reads (its docstring); ``constants``: the
    program's constant for each dim's global size (else the number)."""
    a = dict(op.attrs)

    def _size(dim) -> str:
        return constants.get(dim.name, str(dim.size))

    base = op.param_names[0].rsplit(".", 1)[0] if op.param_names else op.name
    facts = {"name": _fstring_name(base, layer), "bias": a.get("bias", False),
             "reduce": f'"{reduce}"' if reduce else "None",
             "local": op.param_local[0] if op.param_local else None, "a": a,
             "dim": constants.get(op.dims[-1], str(op.global_shape[-1])),
             "fp8": f', fp8="{op.fp8}"' if op.fp8 else "",
             "param": f'"{op.param_names[0]}"' if op.param_names else None,
             "scatter": reduce == "reduce_scatter",
             "op": _fstring_name(op.name, layer)}
    if "top_k" in a:
        facts["top_k"] = constants.get("topk", str(a["top_k"]))
    if a.get("kv_replicas") and facts["local"] is not None and "out_dim" in a:
        # a k or v projection of a replicated kv head: one head of the whole projection (a
        # replicated head's k_norm weight is head_dim wide either way)
        facts["local"] = (a["out_dim"].unit, *facts["local"][1:])
    if "in_dim" in a:
        facts["in_features"] = _size(a["in_dim"])
    if "out_dim" in a:
        facts["out_features"] = _size(a["out_dim"])
    return facts


WRAP = 100   # a statement longer than this continues on lines aligned after its call's parenthesis
INIT_WRAP = 140   # the same for __init__'s constructor lines (one module per line reads best)


def _comment(stmt: str, shape: str, notes: list[str], column: int = COMMENT_COLUMN) -> str:
    """``stmt`` with ``# shape: notes`` beside it (on its last line), at ``column`` (the
    program's comment column); a long call is wrapped after commas (:data:`WRAP`)."""
    text = shape + (": " + "; ".join(notes) if notes else "")
    lines = wrap_statement(stmt)
    last = lines[-1]
    lines[-1] = f"{last:<{column - 1}} # {text}" if len(last) < column - 1 else f"{last}  # {text}"
    return "\n".join(lines)


def wrap_statement(stmt: str, wrap: int = WRAP) -> list[str]:
    """``stmt`` cut after the commas of its outermost call so that each line is at most
    ``wrap`` long where it can be."""
    if len(stmt) <= wrap:
        return [stmt]
    depth, opening, cuts = 0, None, []
    for k, ch in enumerate(stmt):
        if ch in "([{":
            depth += 1
            if depth == 1 and opening is None and ch == "(":
                opening = k
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 1 and opening is not None:
            cuts.append(k + 1)
    if opening is None or not cuts:
        return [stmt]
    pad = " " * (opening + 1)
    lines, start, width = [], 0, wrap
    for a, b in zip(cuts, cuts[1:] + [len(stmt)]):
        if b - start > width and a > start:
            lines.append(stmt[start:a].rstrip())
            start = a + 1   # the space after the comma
            width = wrap - len(pad)
    lines.append(stmt[start:])
    return [lines[0]] + [pad + ln for ln in lines[1:]]


def methods(ops: tuple[OpData, ...], layer: int, prefix: str, every: Mapping[str, OpData],
            subs: Mapping[str, Submodule] | None = None, tables: Mapping[str, str] | None = None,
            constants: Mapping[str, str] = DIM_CONSTANTS, serve: bool = False, method: str = "forward",
            pos_type: str | None = None, per_layer: Sequence[LayerTable] = ()) -> Methods:
    """``__init__`` and ``forward`` of the class running ``ops`` (one layer's, graph order).

    ``prefix`` is what the op names start with inside the class (``layers.3.mlp.``; its
    modules are ``self.<rest of the name>``); ``subs`` maps an attribute (``attn``) to the
    sub-module running the ops named ``<prefix><attr>.*`` (or its ``members``); ``every``
    is every op by name (an input from outside ``ops``: its shape for the signature's
    comment); ``tables``: the program's expression in ``__init__`` for a per-layer fact
    that is no op attribute (``fp8``: ``LAYER_FP8[i]``); ``per_layer``: the per-layer
    attributes that differ between the layers the class serves
    (:attr:`~parcompile.codegen.program_data.ProgramData.layer_tables`): a row reads each as
    ``self.<attribute>`` (:class:`LayerValue`), which ``__init__`` sets from the program's
    table (``self.scale = ATTN_CORE_SCALE[i]``); ``constants``: the program's constants
    for the dims' global sizes. ``serve``: the serving program's
    class (the rows' ``serve_call``/``serve_init``; conversions that move nothing forward
    dropped, there is no backward; ``pos`` a :class:`~parcompile.runtime.serve.generate.LayerStep`;
    the step's tokens ``T`` unsized). ``method``: the name of the forward method (the
    Stage's ``embed``, ``head``); ``pos_type``: its ``pos`` argument's type where the
    ops read one (default: a layer's).

    Raises:
        ValueError: an op with no Code row, a conversion the runtime has no call for, or
            not exactly one value leaving the ops (the forward's return).
    """
    w = _Writer(ops, layer, prefix, every, dict(subs or {}), dict(tables or {}), constants, serve, per_layer)
    w.method, w.pos_type = method, pos_type
    return w.write()


_Unit = tuple  # (name of the value it gives, OpData or Submodule, operand names, the op whose shape it shows)


class _LayerAttributes:
    """The attributes a class's Code rows read (:func:`program_attrs`), and the per-layer
    ones: for each table of an attribute differing between the layers the class serves
    (:class:`~parcompile.codegen.program_data.LayerTable`), the ``self.<var>`` that holds
    it (its name chosen on first read, kept clear of the class's modules) and the
    ``__init__`` line setting it from the program's table."""

    def __init__(self, ops, layer, prefix, every, per_layer=()):
        self.ops, self.layer, self.prefix, self.every = ops, layer, prefix, every
        self.per_layer: dict[str, list[LayerTable]] = {}
        for table in per_layer:
            self.per_layer.setdefault(table.op, []).append(table)
        self.layer_vars: dict[tuple[str, str], str] = {}   # (op inside the layer, attribute) -> self.<var>

    def of(self, op: OpData) -> dict:
        """``op``'s attributes as its Code row reads them (:func:`program_attrs`), each of its
        per-layer tables' attributes a :class:`LayerValue` (``self.scale``), and
        ``_each_layer``: every layer's own attributes (its tables' values in place), for a row
        whose decision must hold for each layer it is written for (the attention kernel)."""
        attrs = program_attrs(op, self.every)
        suffix = op.name.removeprefix(f"layers.{self.layer}.")
        each: dict[int, dict] = {}
        for table in self.per_layer.get(suffix, ()):
            for i, v in table.values:
                each.setdefault(i, dict(attrs))[table.attr] = v
        attrs["_each_layer"] = tuple(each[i] for i in sorted(each))
        for table in self.per_layer.get(suffix, ()):
            key = (suffix, table.attr)
            if key not in self.layer_vars:
                var = table.attr
                if var in self.layer_vars.values() or any(o.name == self.prefix + var for o in self.ops):
                    var = f"{suffix.rsplit('.', 1)[-1]}_{table.attr}"
                self.layer_vars[key] = var
            attrs[table.attr] = LayerValue(self.layer_vars[key], table)
        return attrs

    @staticmethod
    def table_lines(attrs: dict, texts: list[str]) -> list[str]:
        """Each per-layer table whose value an op's lines read (``self.<var>`` in ``texts``):
        ``self.<var> = <TABLE>[i]``, for ``__init__`` before the op's own lines."""
        return [f"self.{v.var} = {v.table.name}[i]" for v in attrs.values() if isinstance(v, LayerValue)
                and any(re.search(rf"\bself\.{v.var}\b", s) for s in texts)]


class _Dataflow:
    """What a class's ops compute from what, as its writer reads it: the ops grouped into
    units (an op, or a sub-module's ops), each op's Code row, the conversions folded into
    the op before them (``alias``, ``shown``, ``reduce``), the units reading each value
    (``consumers``), the one value leaving (``outputs``), the values from outside
    (``external``), and the name the readers give a value.

    Raises:
        ValueError: an op with no Code row, or not exactly one value leaving the ops or a
            sub-module.
    """

    def __init__(self, ops, prefix, subs, serve, attrs):
        self.ops, self.prefix, self.subs, self.serve = ops, prefix, subs, serve
        self.names = {o.name for o in ops}
        self.by_name = {o.name: o for o in ops}
        self.units: list[_Unit] = self._units()
        self.codes: dict[str, Code] = {}
        for name, op, _, _ in self.units:
            if isinstance(op, OpData):
                code = code_of(op.kind, attrs(op))
                if code is None:
                    raise ValueError(f"{op.name}: no program code for ops of kind {op.kind!r}")
                self.codes[name] = code
        self.alias: dict[str, str] = {}          # a folded conversion -> the op running it
        self.shown: dict[str, OpData] = {}       # an op -> the conversion whose shape and calls it shows
        self.reduce: dict[str, str | None] = {}
        self._fold()
        self.consumers: dict[str, list[str]] = {}
        for name, _, ins, _ in self.units:
            if name not in self.alias:
                for u in ins:
                    self.consumers.setdefault(self.alias.get(u, u), []).append(name)
        self.unit_inputs = {u[0]: u[2] for u in self.units}
        names = [u[0] for u in self.units]
        self.outputs = [n for n in names if n not in self.alias and not self.consumers.get(n) and
                        (_used_outside(self.shown[n].name if n in self.shown else n, self.names, ops)
                         or n == names[-1])]
        if len(self.outputs) != 1:
            raise ValueError(f"{prefix}*: {len(self.outputs)} values leave the ops, the program expects one")
        self.external = list(dict.fromkeys(u for _, _, ins, _ in self.units for u in ins
                                           if u not in self.names and self.alias.get(u, u) not in names))

    def _units(self) -> list[_Unit]:
        """The ops in graph order, each sub-module's ops as one unit where the first of them is."""
        group_of: dict[str, str] = {}
        for o in self.ops:
            rest = o.name.removeprefix(self.prefix)
            for attr, sub in self.subs.items():
                if (rest in sub.members) if sub.members else rest.startswith(attr + "."):
                    group_of[o.name] = attr
        for o in self.ops:   # a conversion into (or out of) a sub-module alone is the sub-module's
            if has_trait(o.kind, Trait.CONVERSION) and o.name not in group_of:
                readers = {group_of.get(r.name) for r in self.ops if o.name in r.inputs}
                if len(readers) == 1 and None not in readers:
                    group_of[o.name] = readers.pop()
                elif o.inputs and o.inputs[0] in group_of:
                    group_of[o.name] = group_of[o.inputs[0]]
        grouped: dict[str, list[OpData]] = {}
        for o in self.ops:
            if o.name in group_of:
                grouped.setdefault(group_of[o.name], []).append(o)
        units, done = [], set()
        for o in self.ops:
            g = group_of.get(o.name)
            if g is None:
                units.append((o.name, o, o.inputs, o))
            elif g not in done:
                done.add(g)
                members = {m.name for m in grouped[g]}
                ins = tuple(dict.fromkeys(u for m in grouped[g] for u in m.inputs if u not in members))
                leaving = [m for m in grouped[g] if _used_outside(m.name, members, self.ops)]
                if len(leaving) != 1:
                    raise ValueError(f"{self.prefix}{g}: {len(leaving)} values leave the module, the program "
                                     "expects one")
                units.append((leaving[0].name, self.subs[g], ins, leaving[0]))
        return units

    def _fold(self) -> None:
        """Conversions after an op that runs them itself (a row-parallel linear's reduction);
        serving: conversions whose collectives are all in backward (none run)."""
        for name, op, ins, _ in self.units:
            if self.serve and isinstance(op, OpData) and has_trait(op.kind, Trait.CONVERSION) and ins and not any(
                    c.phase == "forward" for c in op.collectives):
                self.alias[name] = ins[0]
                continue
            if isinstance(op, OpData) and has_trait(op.kind, Trait.CONVERSION) and ins and ins[0] in self.codes \
                    and self.codes[ins[0]].fold_after:
                self.alias[name] = ins[0]
                kinds = [k for k, _ in dict(op.attrs)["fwd"] if k in ("all_reduce", "reduce_scatter")]
                self.reduce[ins[0]] = kinds[0] if kinds else None
                self.shown[ins[0]] = op

    def preferred(self, name: str, base: str) -> str:
        """The readers' name for this value (``gate``, ``q``, ``kv``), through ops that keep
        their operand's name (RoPE, qk-norm); else ``base``."""
        users = self.consumers.get(name, [])
        if not users or any(u not in self.codes for u in users):
            return base
        codes, ins = self.codes, self.unit_inputs
        named = {codes[u].operands[list(ins[u]).index(name)] for u in users
                 if codes[u].operands and name in ins[u]}
        if len(named) == 1 and all(codes[u].operands for u in users):   # every reader calls it alike
            return named.pop()
        if len(users) == 1 and codes[users[0]].var == "":
            return self.preferred(users[0], base)
        return base


class _Region:
    """The ops of ``recompute = [mla_up_proj]`` in a class (marked ``recompute =
    "mla_up_proj"`` by passes/insert_collectives.py; with the conversions between them):
    MLA's up projections and the RoPE on their outputs, written as a nested function the
    forward runs output-discarding (``rt.discarding``: its inputs kept, no graph, the query,
    key and value it returns freed once the attention core ``consumer`` ran and rebuilt
    before its backward), as Megatron-Core runs ``qkv_up_proj_and_rope_apply`` under
    ``CheckpointWithoutOutput`` (NVIDIA/Megatron-LM 003b4ce
    ``megatron/core/transformer/multi_latent_attention.py``). ``inputs``: the values from
    outside it its ops read (value -> variable), kept live until the function is written;
    ``outputs``: its values read outside it; ``body``: its ops' lines."""

    MODULE = "mla_up_proj"

    def __init__(self, units, consumers):
        marked = {n for n, op, _, _ in units if isinstance(op, OpData) and op.attr("recompute", None) == self.MODULE}
        for n, op, ins, _ in units:
            if marked and isinstance(op, OpData) and has_trait(op.kind, Trait.CONVERSION) and ins and ins[0] in marked \
                    and consumers.get(n) and all(c in marked for c in consumers[n]):
                marked.add(n)
        self.members = marked
        self.outputs = [n for n, _, _, _ in units if n in marked and any(c not in marked for c in consumers.get(n, ()))]
        self.consumer = next((n for n, op, _, _ in units if marked and isinstance(op, OpData)
                              and has_trait(op.kind, Trait.ATTENTION)), None)
        self.inputs: dict[str, str] = {}
        self.body: list[str] = []
        self.handle: str | None = None   # the rt.discarding call's variable, once written

    def pinned(self, name: str, users: list[str]) -> bool:
        """Whether value ``name`` must be a variable: it leaves the region, enters it, or is
        the attention core's output (the discard's trigger)."""
        inside = name in self.members
        return (inside and any(u not in self.members for u in users)) or name == self.consumer \
            or (not inside and any(u in self.members for u in users))


class _Writer:
    """One class's methods being written (:func:`methods`) from its ops' dataflow
    (:class:`_Dataflow`): each unit's value placed, pending inside its reader's
    expression, a statement, a ``keep_split_input`` block or the return, with the
    ``__init__`` lines of its modules and of the per-layer attributes it reads
    (:class:`_LayerAttributes`)."""

    def __init__(self, ops, layer, prefix, every, subs, tables, constants, serve=False, per_layer=()):
        self.layer, self.prefix, self.every = layer, prefix, every
        self.tables, self.constants, self.serve = tables, constants, serve
        self.attributes = _LayerAttributes(ops, layer, prefix, every, per_layer)
        self.flow = flow = _Dataflow(ops, prefix, subs, serve, self.attributes.of)
        self.by_name, self.units, self.codes, self.consumers = flow.by_name, flow.units, flow.codes, flow.consumers
        self.alias, self.shown, self.reduce = flow.alias, flow.shown, flow.reduce
        self.outputs, self.external = flow.outputs, flow.external
        self.values = {u: _Value("x" if k == 0 else f"x{k}", False) for k, u in enumerate(self.external)}
        self.remaining = {n: len(c) for n, c in self.consumers.items()}
        self.bound = {v.text: u for u, v in self.values.items()}   # variable -> the value it holds
        self.init: list[str] = []
        self.once: list[str] = []
        self.body: list[str] = []
        self.per_head: set[str] = set()   # values in (B, T, heads, head_dim) layout
        self.with_ops: set[str] = set()
        self.indent = ""
        self.needs_pos = False
        self.method, self.pos_type = "forward", None
        self.region = _Region(self.units, self.consumers) if not serve else _Region((), {})

    def shape(self, op: OpData) -> str:
        """``op``'s per-rank shape for a comment; serving: ``T`` the step's tokens (the
        prompt, then 1), not the graph's sequence length."""
        text = op.shape_comment()
        return re.sub(r"\bT=\d+", "T", text) if self.serve else text

    # ---------------------------------------------------------------- names

    def fresh(self, base: str) -> str:
        """``base``, or ``base1``, ... : the first name holding no live value and read by no
        expression still to be written."""
        k = 0
        while True:
            var = base if k == 0 else f"{base}{k}"
            held = self.bound.get(var)
            live = held is not None and self.remaining.get(held, 0) > 0
            if not live and not any(var in v.refs for v in self.values.values() if v.pending):
                return var
            k += 1

    # ---------------------------------------------------------------- units

    def _operands(self, ins) -> tuple[list[str], list[str], set[str]]:
        """The operands' texts (pending expressions are written into this one), their
        notes and the variables they read."""
        texts, notes, refs = [], [], set()
        for u in ins:
            src = self.alias.get(u, u)
            v = self.values[src]
            texts.append(v.text)
            notes += v.notes
            refs |= v.refs if v.pending else {v.text}
            if v.pending:
                v.pending, v.refs = False, frozenset()   # consumed: written into this expression
            self.remaining[src] = self.remaining.get(src, 1) - 1
        return texts, notes, refs

    def _submodule(self, name: str, sub: Submodule, texts: list[str], notes: list[str]) -> tuple[Code, str]:
        self.init.append("\n".join(wrap_statement(f"self.{sub.attr} = {sub.build}", INIT_WRAP)))
        self.needs_pos = self.needs_pos or "pos" in sub.extra
        return Code(var="h"), f"self.{sub.attr}({', '.join(texts)}{sub.extra})"

    def _read_tables(self, attrs: dict, at: int, texts: list[str]) -> None:
        """The per-layer tables the op's lines read, set in ``__init__`` at ``at``, before its own."""
        lines = self.attributes.table_lines(attrs, texts)
        self.init[at:at] = [ln for ln in lines if ln not in self.init]

    def _op(self, name: str, op: OpData, texts: list[str], notes: list[str], show: OpData) -> tuple[Code, str]:
        """An op's ``__init__`` lines and forward expression from its Code row."""
        code = self.codes[name]
        attrs = self.attributes.of(op)
        more = dict(code.facts(attrs)) if code.facts is not None else {}
        at, once = len(self.init), len(self.once)
        self._init_lines(name, op, code, attrs, more)
        extra_notes = more.pop("notes", ())
        call = code.serve_call if self.serve and code.serve_call is not None else code.call
        text = call.format(*texts, x=texts[0] if texts else "", self=f"self.{name.removeprefix(self.prefix)}",
                           a=attrs, **more)
        self._read_tables(attrs, at, self.init[at:] + self.once[once:] + [text])
        self.needs_pos = self.needs_pos or re.search(r"\bpos\b", call) is not None
        notes += ([code.comment] if code.comment else []) + list(extra_notes)
        if any(c.phase == "forward" or not self.serve for c in show.collectives):
            notes.append(calls_comment(show, self.layer, forward_only=self.serve))
        users = self.consumers.get(name, [])
        if code.heads_out or (has_trait(op.kind, Trait.CONVERSION) and self.alias.get(op.inputs[0], op.inputs[0])
                              in self.per_head):
            self.per_head.add(name)
        elif users and all(self.codes.get(u) is not None and self.codes[u].heads_in for u in users):
            # a flat projection read per head: (B, T, heads * d) -> (B, T, heads, d), d the dim's unit
            unit = dict(op.attrs)["out_dim"].unit
            # a kv projection replicated over kv_replicas ranks holds one head (its Code row)
            n = 1 if op.attr("kv_replicas", None) else op.local_shape[-1] // unit
            text += f".unflatten(-1, ({n}, {unit}))"
            notes.append(f"{n} head{'s' if n != 1 else ''} of {unit}")
        return code, text

    def _init_lines(self, name: str, op: OpData, code: Code, attrs: dict, more: dict) -> None:
        """The op's ``__init__`` lines: its module's constructor (``build``) and the row's
        ``init`` lines (each once per class); ``more``: the row's ``facts`` (its ``init`` taken)."""
        attr = name.removeprefix(self.prefix)
        facts = _facts(op, self.layer, self.reduce.get(name), self.constants)
        facts["attr"], facts["a"] = attr, attrs
        # some layers keep their GEMMs in 16 bits: each layer's recipe from a per-layer table (the
        # representative layer may be one of them: its op has no recipe, the others' do); the
        # ops that can run FP8 are those of Trait.FP8_GEMM (the rule ir/fp8.py fp8_kind applies)
        if "fp8" in self.tables and has_trait(op.kind, Trait.FP8_GEMM):
            facts["fp8"] = f", fp8={self.tables['fp8']}"
        build = code.build
        if build is None and code.module is not None:   # rt.<module>(name, <arg>=<attr>, ..., seed=SEED, tp=tp)
            args = "".join(f", {k}={attrs[k]!r}" for k in code.args if attrs.get(k) is not None)
            build = f"rt.{code.module}({{name}}{args}, seed=SEED, tp=tp)"
        if build is not None:
            if not self.serve and any("tp" in axes for axes in op.grad_partial):
                # the plan's name for that step all-reduce: sequence parallelism's norm
                # gradients when the module's input is split over tp, else tp-partial ones
                sp = any("tp" in axes for u in self.external if u in self.every for axes in self.every[u].splits)
                self.init.append("# replicated weight; each rank sums its own heads' gradient, all-reduced over "
                                 f"tp with the step ({'sp_norm_grads' if sp else 'tp_partial_grads'})")
            fields = {k: v for k, v in more.items() if k not in ("init", "notes")}
            self.init.append("\n".join(wrap_statement(f"self.{attr} = " + build.format(**facts, **fields), INIT_WRAP)))
        init = code.serve_init if self.serve and code.serve_init is not None else (*code.init, *more.get("init", ()))
        more.pop("init", None)
        for line in init:
            line = "\n".join(wrap_statement(line.format(t=self.tables, **facts), INIT_WRAP))
            if line not in self.once:
                self.once.append(line)

    def _keep_split(self, name: str, op: OpData, text: str, texts: list[str], notes: list[str],
                    show: OpData) -> None:
        """Sequence parallelism: the layers after a regathered conversion keep its split
        input and all-gather it again in backward (insert-collectives' regather)."""
        users = self.consumers.get(name, [])
        if not all(self.codes.get(c) is not None and self.codes[c].keep_split for c in users):
            raise ValueError(f"{op.name}: a regathered input read by ops that cannot keep it split")
        src = texts[0]
        var = self.fresh("x")
        if var == src:   # the gathered input takes the split one's name: keep the split one as xs
            split = self.fresh(src + "s")
            self.body.append(_comment(f"{split}, {var} = {src}, {text}", self.shape(show), notes))
        else:
            split = src
            self.body.append(_comment(f"{var} = {text}", self.shape(show), notes))
        self.body.append(_comment(f"with rt.keep_split_input({split}, {var}, self.tp):",
                                  f"backward keeps {split} and all-gathers it again", []))
        self.with_ops, self.indent = set(users), "    "
        self.values[name] = _Value(var, False)
        self.bound[var] = name

    def _place(self, name, op, code: Code, text: str, texts, notes, refs, show) -> None:
        """Write a unit's value: pending in its reader, a keep-split block, the return or
        a statement."""
        users = self.consumers.get(name, [])
        in_with = name in self.with_ops
        region = name in self.region.members
        if region and (in_with or (isinstance(op, OpData) and op.regather) or name in self.outputs):
            raise ValueError(f"{op.name}: recompute = [{_Region.MODULE}] with a kept split input or as the "
                             "class's output: the program writes its ops as one function")
        body, pad = (self.region.body, "    ") if region else (self.body, "")
        if (code.inline and len(users) == 1 and name not in self.outputs and not in_with
                and not self.region.pinned(name, users)
                and users[0] not in self.with_ops and not (users[0] in self.codes and self.codes[users[0]].heads_in)
                and not (users[0] in self.by_name and self.by_name[users[0]].regather)):   # kept split: a variable
            self.values[name] = _Value(text, True, notes, frozenset(refs))
            return
        if isinstance(op, OpData) and op.regather:
            self._keep_split(name, op, text, texts, notes, show)
            return
        if name in self.outputs:
            self.body.append(_comment(f"{self.indent}return {text}", self.shape(show), notes))
            return
        base = code.var or (texts[0] if texts and texts[0].isidentifier() else "h")
        var = self.fresh(self.flow.preferred(name, base))
        body.append(_comment(f"{pad}{self.indent}{var} = {text}", self.shape(show), notes))
        self.values[name] = _Value(var, False)
        self.bound[var] = name
        if in_with:
            self.with_ops.discard(name)
            if not self.with_ops:
                self.indent = ""

    def _hold_region_inputs(self, ins) -> None:
        """A region op's operands from outside the region stay live (their variables the
        nested function's parameters) until it is written (:meth:`_write_region`)."""
        for u in ins:
            src = self.alias.get(u, u)
            if src not in self.region.members and src not in self.region.inputs:
                self.remaining[src] = self.remaining.get(src, 0) + 1
                self.region.inputs[src] = self.values[src].text

    def _write_region(self) -> None:
        """The region's nested function and its ``rt.discarding`` call (:class:`_Region`),
        before the first op outside it reading its outputs."""
        r = self.region
        fn, r.handle = self.fresh("up_proj"), self.fresh("qkv_up")
        params = ", ".join(r.inputs.values())
        outs = ", ".join(self.values[n].text for n in r.outputs)
        self.body.append(_comment(f"def {fn}({params}):", "recompute = [mla_up_proj]",
                                  ["run without a graph, outputs freed after the core, rebuilt before its backward"]))
        self.body += r.body + [f"    return {outs}", f"{r.handle} = rt.discarding({fn}, {params})",
                               f"{outs} = {r.handle}.out"]
        for src in r.inputs:
            self.remaining[src] -= 1

    def write(self) -> Methods:
        for name, op, ins, out_op in self.units:
            if name in self.alias:
                continue
            r = self.region
            if r.handle is None and name not in r.members and any(self.alias.get(u, u) in r.members for u in ins):
                self._write_region()
            texts, notes, refs = self._operands(ins)
            if name in r.members:
                self._hold_region_inputs(ins)
            show = self.shown.get(name, out_op)
            if isinstance(op, Submodule):
                code, text = self._submodule(name, op, texts, notes)
            else:
                code, text = self._op(name, op, texts, notes, show)
            self._place(name, op, code, text, texts, notes, refs, show)
            if name == r.consumer and r.handle is not None:
                self.body.append(f"{r.handle}.discard({self.values[name].text})")
        init = list(self.init)
        axes = [a for a in AXIS_SOURCES if any(re.search(rf"\bself\.{a}\b", ln) for ln in self.body + init + self.once)]
        if axes:
            init.insert(0, f"self.{', self.'.join(axes)} = {', '.join(AXIS_SOURCES[a] for a in axes)}")
        params = ", ".join(f"x{k}" if k else "x" for k in range(len(self.external)))
        first = self.every.get(self.external[0]) if self.external else None
        kind = self.pos_type or ("gen.LayerStep" if self.serve else "rt.Positions")
        sig = f"def {self.method}(self, {params}{f', pos: {kind}' if self.needs_pos else ''}):"
        if first is not None:
            sig = _comment(sig, f"x: {self.shape(first)}", [], COMMENT_COLUMN + 4)
        return Methods(tuple(init + self.once), sig.rstrip(), tuple(self.body))


def _used_outside(name: str, members: set[str], ops: tuple[OpData, ...]) -> bool:
    """``name`` is read by an op of ``ops`` outside ``members``, or by none of ``ops`` (it
    leaves the layer)."""
    readers = [o.name for o in ops if name in o.inputs]
    return not readers or any(r not in members for r in readers)


def module_methods(layer: LayerData, prefix: str, every: Mapping[str, OpData],
                   tables: Mapping[str, str] | None = None, constants: Mapping[str, str] = DIM_CONSTANTS,
                   serve: bool = False, per_layer: Sequence[LayerTable] = ()) -> Methods:
    """The methods of the module run by ``layer``'s ops named ``layers.<i>.<prefix>.*``
    (``attn``, ``mlp``, a MoE layer's shared experts ``mlp.shared``), with the conversions
    into and out of it (:func:`methods`; ``per_layer``: its per-layer tables)."""
    full = f"layers.{layer.index}.{prefix}."
    inside = {o.name for o in layer.ops if o.name.startswith(full) and not has_trait(o.kind, Trait.CONVERSION)}
    ops = [o for o in layer.ops if o.name in inside
           or (has_trait(o.kind, Trait.CONVERSION) and (set(o.inputs) & inside or _feeds_only(o, inside, layer)))]
    return methods(tuple(ops), layer.index, full, every, tables=tables, constants=constants, serve=serve,
                   per_layer=per_layer)


def _feeds_only(conv: OpData, inside: set[str], layer: LayerData) -> bool:
    readers = [o.name for o in layer.ops if conv.name in o.inputs]
    return bool(readers) and all(r in inside for r in readers)


def mlp_doc(layer: LayerData, prefix: str) -> str:
    """One line on the MLP's layout: which projections are column- and row-parallel, its
    inner width and the part of it a rank holds (from the graph's local types)."""
    full = f"layers.{layer.index}.{prefix}."
    linears = [o for o in layer.ops if o.name.startswith(full) and o.kind == "linear"]
    col = [o.name.removeprefix(full) for o in linears if o.attr("tp") == "column"]
    row = [o.name.removeprefix(full) for o in linears if o.attr("tp") == "row"]
    act = next(o for o in layer.ops if o.name == full + "act")
    what = {"swiglu": "SwiGLU", "geglu": "GeGLU"}.get(act.kind, act.attr("fn", act.kind))
    width, local = linears[0].global_shape[-1], linears[0].local_shape[-1]
    per = f" -> {local} per rank" if local != width else ""
    return f"{what} MLP: {', '.join(col)} column-parallel, {', '.join(row)} row-parallel; {width} inner units{per}."


__all__ = ["DIM_CONSTANTS", "MLA_CONSTANTS", "LayerValue", "Methods", "Submodule", "calls_comment", "describe", "methods", "mlp_doc", "module_methods",
           "program_attrs", "wrap_statement"]
