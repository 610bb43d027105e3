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
from typing import Mapping

from parcompile.codegen.program_data import LayerData, OpData
from parcompile.ir.ops import Code, code_of

#: the program's constants for the global sizes of the graph's dims (``ir/lower.py``'s names)
DIM_CONSTANTS = {"hidden": "HIDDEN", "ffn": "FFN_HIDDEN", "q": "HEADS * HEAD_DIM", "kv": "KV_HEADS * HEAD_DIM",
                 "shared_ffn": "SHARED_FFN"}
#: the same in a program with multi-head latent attention (its own head widths)
MLA_CONSTANTS = {**DIM_CONSTANTS, "q": "HEADS * (QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM)", "q_lora": "Q_LORA_RANK",
                 "kv_a": "KV_LORA_RANK + QK_ROPE_HEAD_DIM", "kv_lora": "KV_LORA_RANK",
                 "kv_b": "HEADS * (QK_NOPE_HEAD_DIM + V_HEAD_DIM)", "v": "HEADS * V_HEAD_DIM"}
COMMENT_COLUMN = 56


def describe(calls) -> str:
    """``forward all_reduce(tp) x 3, backward ...``: runs of equal collectives counted."""
    out: list[list] = []
    for c in calls:
        if out and out[-1][0] == c.describe():
            out[-1][1] += 1
        else:
            out.append([c.describe(), 1])
    return ", ".join(d if n == 1 else f"{d} x {n}" for d, n in out)


def calls_comment(op: OpData | None, layer: int | None = None, none: str = "no collective") -> str:
    """A conversion's collectives for a comment, by the plan's name for it:
    ``layers.{i}.attn.all_gather: forward all_gather(tp), backward reduce_scatter(tp)``
    (``layer``: the index written as ``{i}``, the program's classes serve every layer)."""
    if op is None or not op.collectives:
        return none
    name = op.name if layer is None else op.name.replace(f"layers.{layer}.", "layers.{i}.", 1)
    return f"{name}: " + describe(op.collectives)


@dataclass(frozen=True)
class Submodule:
    """A group of a layer's ops that a class runs as one module of another generated class:
    ``self.<attr> = <build>`` in ``__init__``, ``self.<attr>(<inputs><extra>)`` in forward."""

    attr: str
    build: str
    extra: str = ""
    #: the op names (after the class's prefix) it runs; empty: those named ``<attr>.*``
    members: tuple[str, ...] = ()
    #: its ops' collectives go in the call's comment
    show_calls: bool = False


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
    return 'f"' + name.replace(f"layers.{layer}.", "layers.{i}.", 1) + '"'


def _facts(op: OpData, layer: int, reduce: str | None, constants: Mapping[str, str] = DIM_CONSTANTS) -> dict:
    """The fields a :class:`Code` row's ``build`` reads (its docstring); ``constants``: the
    program's constant for each dim's global size (else the number)."""
    a = dict(op.attrs)

    def _size(dim) -> str:
        return constants.get(dim.name, str(dim.size))

    base = op.param_names[0].rsplit(".", 1)[0] if op.param_names else op.name
    facts = {"name": _fstring_name(base, layer), "bias": a.get("bias", False), "reduce": reduce,
             "local": op.param_local[0] if op.param_local else None, "a": a,
             "dim": constants.get(op.dims[-1], str(op.global_shape[-1]))}
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
    lines = _wrap(stmt)
    last = lines[-1]
    lines[-1] = f"{last:<{column - 1}} # {text}" if len(last) < column - 1 else f"{last}  # {text}"
    return "\n".join(lines)


def _wrap(stmt: str, wrap: int = WRAP) -> list[str]:
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
            constants: Mapping[str, str] = DIM_CONSTANTS) -> Methods:
    """``__init__`` and ``forward`` of the class running ``ops`` (one layer's, graph order).

    ``prefix`` is what the op names start with inside the class (``layers.3.mlp.``; its
    modules are ``self.<rest of the name>``); ``subs`` maps an attribute (``attn``) to the
    sub-module running the ops named ``<prefix><attr>.*``; ``every`` is every op by name
    (an input from outside ``ops``: its shape for the signature's comment); ``tables``: the
    program's expression in ``__init__`` for an attribute that differs between layers
    (``window``: ``LAYER_WINDOWS[i]``).

    Raises:
        ValueError: an op with no Code row, a conversion the runtime has no call for, or
            not exactly one value leaving the ops (the forward's return).
    """
    subs = dict(subs or {})
    tables = dict(tables or {})
    units: list[tuple[str, OpData | Submodule, tuple[str, ...], OpData]] = []   # (name, op, inputs, shown)
    group_of: dict[str, str] = {}
    names = {o.name for o in ops}
    for o in ops:
        rest = o.name.removeprefix(prefix)
        for attr, sub in subs.items():
            if (rest in sub.members) if sub.members else rest.startswith(attr + "."):
                group_of[o.name] = prefix + attr
    for o in ops:   # a conversion into (or out of) a sub-module alone is the sub-module's
        if o.kind == "redistribute" and o.name not in group_of:
            readers = {group_of.get(r.name) for r in ops if o.name in r.inputs}
            if len(readers) == 1 and None not in readers:
                group_of[o.name] = readers.pop()
            elif o.inputs and o.inputs[0] in group_of:
                group_of[o.name] = group_of[o.inputs[0]]
    grouped: dict[str, list[OpData]] = {}
    for o in ops:
        if o.name in group_of:
            grouped.setdefault(group_of[o.name], []).append(o)
    done: set[str] = set()
    group_ops: dict[str, list[OpData]] = {}
    for o in ops:
        g = group_of.get(o.name)
        if g is None:
            units.append((o.name, o, o.inputs, o))
        elif g not in done:
            done.add(g)
            members = {m.name for m in grouped[g]}
            ins = tuple(dict.fromkeys(u for m in grouped[g] for u in m.inputs if u not in members))
            leaving = [m for m in grouped[g] if _used_outside(m.name, members, ops)]
            if len(leaving) != 1:
                raise ValueError(f"{g}: {len(leaving)} values leave the module, the program expects one")
            units.append((leaving[0].name, subs[g.removeprefix(prefix)], ins, leaving[0]))
            group_ops[leaving[0].name] = grouped[g]
    # where a unit's value goes: aliases for conversions an op runs itself
    alias: dict[str, str] = {}
    shown: dict[str, OpData] = {}
    reduce: dict[str, str | None] = {}
    codes: dict[str, Code] = {}
    by_name = {o.name: o for o in ops}
    for name, op, _, _ in units:
        if isinstance(op, OpData):
            code = code_of(op.kind, dict(op.attrs))
            if code is None:
                raise ValueError(f"{op.name}: no program code for ops of kind {op.kind!r}")
            codes[name] = code
    for name, op, ins, _ in units:
        if isinstance(op, OpData) and op.kind == "redistribute" and ins and ins[0] in codes \
                and codes[ins[0]].fold_after:
            alias[name] = ins[0]
            kinds = [k for k, _ in dict(op.attrs)["fwd"] if k in ("all_reduce", "reduce_scatter")]
            reduce[ins[0]] = kinds[0] if kinds else None
            shown[ins[0]] = op
    consumers: dict[str, list[str]] = {}
    unit_names = [u[0] for u in units]
    for name, op, ins, _ in units:
        if name in alias:
            continue
        for u in ins:
            consumers.setdefault(alias.get(u, u), []).append(name)
    outputs = [n for n in unit_names if n not in alias and not consumers.get(n) and
               (_used_outside(shown[n].name if n in shown else n, names, ops) or n == unit_names[-1])]
    external = [u for _, _, ins, _ in units for u in ins if u not in names and alias.get(u, u) not in unit_names]
    external = list(dict.fromkeys(external))
    if len(outputs) != 1:
        raise ValueError(f"{prefix}*: {len(outputs)} values leave the ops, the program expects one")
    values: dict[str, _Value] = {u: _Value("x" if k == 0 else f"x{k}", False) for k, u in enumerate(external)}
    remaining = {n: len(c) for n, c in consumers.items()}
    bound: dict[str, str] = {v.text: u for u, v in values.items()}   # variable -> value it holds
    init: list[str] = []
    once: list[str] = []
    per_head: set[str] = set()   # values in (B, T, heads, head_dim) layout
    body: list[str] = []
    needs_pos = False
    with_ops: set[str] = set()
    indent = ""

    unit_inputs = {u[0]: u[2] for u in units}

    def preferred(name: str, base: str) -> str:
        """The consumer's name for this value (``gate``, ``q``), through ops that keep
        their operand's name (RoPE, qk-norm); else ``base``."""
        users = consumers.get(name, [])
        if not users or any(u not in codes for u in users):
            return base
        named = {codes[u].operands[list(unit_inputs[u]).index(name)] for u in users
                 if codes[u].operands and name in unit_inputs[u]}
        if len(named) == 1 and all(codes[u].operands for u in users):   # every reader calls it alike
            return named.pop()
        if len(users) == 1 and codes[users[0]].var == "":
            return preferred(users[0], base)
        return base

    def free(var: str, reading: frozenset[str]) -> bool:
        held = bound.get(var)
        if held is not None and remaining.get(held, 0) > 0:
            return False
        return not any(var in v.refs for v in values.values() if v.pending)

    def fresh(base: str, reading: frozenset[str]) -> str:
        k = 0
        while True:
            var = base if k == 0 else f"{base}{k}"
            if free(var, reading):
                return var
            k += 1

    for name, op, ins, out_op in units:
        if name in alias:
            continue
        texts, notes, refs = [], [], set()
        for u in ins:
            v = values[alias.get(u, u)]
            texts.append(v.text)
            notes += v.notes
            refs |= v.refs if v.pending else {v.text}
            if v.pending:
                v.pending = False   # consumed: written into this expression
                v.refs = frozenset()
            src = alias.get(u, u)
            remaining[src] = remaining.get(src, 1) - 1
        show = shown.get(name, out_op)
        if isinstance(op, Submodule):
            attr = op.attr
            init.append("\n".join(_wrap(f"self.{attr} = {op.build}", INIT_WRAP)))
            text = f"self.{attr}({', '.join(texts)}{op.extra})"
            if op.show_calls:
                notes += [calls_comment(m, layer) for m in group_ops[name] if m.collectives]
            needs_pos = needs_pos or "pos" in op.extra
            code = Code(var="h")
        else:
            code = codes[name]
            attr = name.removeprefix(prefix)
            facts = _facts(op, layer, reduce.get(name), constants)
            attrs = {**dict(op.attrs), "_gathers": tuple(sorted({c.axis for c in op.collectives
                                                                 if c.op == "all_gather" and c.phase == "forward"}))}
            more = dict(code.facts(attrs)) if code.facts is not None else {}
            build = code.build
            if build is None and code.module is not None:   # rt.<module>(name, <arg>=<attr>, ..., seed=SEED, tp=tp)
                args = "".join(f", {k}={op.attr(k)!r}" for k in code.args if op.attr(k, None) is not None)
                build = f"rt.{code.module}({{name}}{args}, seed=SEED, tp=tp)"
            if build is not None:
                if any("tp" in axes for axes in op.grad_partial):
                    # the plan's name for that step all-reduce: sequence parallelism's norm
                    # gradients when the module's input is split over tp, else tp-partial ones
                    sp = any("tp" in axes for u in external if u in every for axes in every[u].splits)
                    init.append("# replicated weight; each rank sums its own heads' gradient, all-reduced over tp "
                                f"with the step ({'sp_norm_grads' if sp else 'tp_partial_grads'})")
                init.append("\n".join(_wrap(f"self.{attr} = " + build.format(**facts), INIT_WRAP)))
            for line in (*code.init, *more.pop("init", ())):
                line = line.format(t=tables, **facts)
                if line not in once:
                    once.append(line)
            notes_more = more.pop("notes", ())
            text = code.call.format(*texts, x=texts[0] if texts else "", self=f"self.{attr}", a=attrs, **more)
            needs_pos = needs_pos or re.search(r"\bpos\b", code.call) is not None
            if code.comment:
                notes.append(code.comment)
            notes += notes_more
            if show.collectives:
                notes.append(calls_comment(show, layer))
            users = consumers.get(name, [])
            if code.heads_out or (op.kind == "redistribute" and alias.get(ins[0], ins[0]) in per_head):
                per_head.add(name)
            elif users and all(codes.get(u) is not None and codes[u].heads_in for u in users):
                # a flat projection read per head: (B, T, heads * d) -> (B, T, heads, d), d the dim's unit
                unit = dict(op.attrs)["out_dim"].unit
                n = op.local_shape[-1] // unit
                text += f".unflatten(-1, ({n}, {unit}))"
                notes.append(f"{n} head{'s' if n != 1 else ''} of {unit}")
        users = consumers.get(name, [])
        is_out = name in outputs
        in_with = name in with_ops
        if (code.inline and len(users) == 1 and not is_out and not in_with and users[0] not in with_ops
                and not (users[0] in codes and codes[users[0]].heads_in)):
            values[name] = _Value(text, True, notes, frozenset(refs))
            continue
        if isinstance(op, OpData) and dict(op.attrs).get("regather"):
            # sequence parallelism: the column-parallel layers after it keep the split input
            # and all-gather it again in backward (insert-collectives' regather)
            if not all(codes.get(c) is not None and codes[c].keep_split for c in users):
                raise ValueError(f"{op.name}: a regathered input read by ops that cannot keep it split")
            src = texts[0]
            var = fresh("x", frozenset())
            if var == src:   # the gathered input takes the split one's name: keep the split one as xs
                split = fresh(src + "s", frozenset())
                body.append(_comment(f"{split}, {var} = {src}, {text}", show.shape_comment(), notes))
            else:
                split = src
                body.append(_comment(f"{var} = {text}", show.shape_comment(), notes))
            body.append(_comment(f"with rt.keep_split_input({split}, {var}, self.tp):",
                                 f"backward keeps {split} and all-gathers it again", []))
            with_ops = set(users)
            indent = "    "
            values[name] = _Value(var, False)
            bound[var] = name
            continue
        if is_out:
            body.append(_comment(f"{indent}return {text}", show.shape_comment(), notes))
            continue
        base = code.var or (texts[0] if texts and texts[0].isidentifier() else "h")
        var = fresh(preferred(name, base), frozenset(refs))
        body.append(_comment(f"{indent}{var} = {text}", show.shape_comment(), notes))
        values[name] = _Value(var, False)
        bound[var] = name
        if in_with:
            with_ops.discard(name)
            if not with_ops:
                indent = ""
    axes = [a for a in ("tp", "cp") if any(f"self.{a}" in ln for ln in body + init + once)]
    if axes:
        init.insert(0, f"self.{', self.'.join(axes)} = {', '.join(axes)}")
    params = ", ".join(f"x{k}" if k else "x" for k in range(len(external)))
    first = every.get(external[0]) if external else None
    sig = f"def forward(self, {params}{', pos: rt.Positions' if needs_pos else ''}):"
    sig = _comment(sig, f"x: {first.shape_comment()}" if first is not None else "", [], COMMENT_COLUMN + 4)
    return Methods(tuple(init + once), sig.rstrip(), tuple(body))


def _used_outside(name: str, members: set[str], ops: tuple[OpData, ...]) -> bool:
    """``name`` is read by an op of ``ops`` outside ``members``, or by none of ``ops`` (it
    leaves the layer)."""
    readers = [o.name for o in ops if name in o.inputs]
    return not readers or any(r not in members for r in readers)


def module_methods(layer: LayerData, prefix: str, every: Mapping[str, OpData],
                   tables: Mapping[str, str] | None = None, constants: Mapping[str, str] = DIM_CONSTANTS) -> Methods:
    """The methods of the module run by ``layer``'s ops named ``layers.<i>.<prefix>.*``
    (``attn``, ``mlp``, a MoE layer's shared experts ``mlp.shared``), with the conversions
    into and out of it (:func:`methods`)."""
    full = f"layers.{layer.index}.{prefix}."
    inside = {o.name for o in layer.ops if o.name.startswith(full) and o.kind != "redistribute"}
    ops = [o for o in layer.ops if o.name in inside
           or (o.kind == "redistribute" and (set(o.inputs) & inside or _feeds_only(o, inside, layer)))]
    return methods(tuple(ops), layer.index, full, every, tables=tables, constants=constants)


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


__all__ = ["DIM_CONSTANTS", "MLA_CONSTANTS", "Methods", "Submodule", "calls_comment", "describe", "methods", "mlp_doc", "module_methods"]
