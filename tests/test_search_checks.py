"""The search's checker shortcut held to the checker (design19: a shortcut copy needs a test
pinning it to the original rule).

:func:`parcompile.layout_search.search` does not run :func:`~parcompile.frontend.checks.check_config`
on every layout: it runs each check of :data:`~parcompile.frontend.checks.CHECKS` once per
distinct value of the layout fields the check reads (:data:`~parcompile.frontend.checks.LAYOUT_READS`,
``LayoutChecker`` in the search). That is the checker's verdict when

* each check reads no layout field beyond its entry (derived here from the checks' source,
  independently of the table: every ``p.x`` / ``cfg.parallel.x``, through the helpers the
  check passes ``cfg`` to and the properties of ``ParallelConfig`` it reads);
* a check run with a context of its own sees what it would see after the checks before it:
  no check marks a key bad (``ctx.bad``) that another check reads;

and the verdicts are compared directly, layout by layout, for several specs.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from parcompile.config.schema import ParallelConfig
from parcompile.frontend import checks as C
from parcompile.frontend import load_spec
from parcompile.layout_search import check_layout, with_parallel
from parcompile.layout_search.space import LayoutChecker, checked_parallel, layout_blocks

#: the module-level functions of the checks' modules (checks.py and the frontend modules
#: whose functions it imports: the checks and the helpers they call), by name
_CHECK_MODULES = sorted({inspect.getmodule(f) for f in vars(C).values()
                         if inspect.isfunction(f) and f.__module__.startswith("parcompile.frontend.")} | {C},
                        key=lambda m: m.__name__)
_MODULE_FUNCS = {n.name: n for m in _CHECK_MODULES for n in ast.parse(inspect.getsource(m)).body
                 if isinstance(n, ast.FunctionDef)}


class _Unknown(Exception):
    """The layout reaches code this reading does not follow (it may read any field)."""


def _property_reads(name: str, seen: frozenset = frozenset()) -> set[str]:
    """The fields a ``ParallelConfig`` property or method reads (``self.x``), properties
    expanded; a plain field reads itself."""
    if name in ParallelConfig.model_fields:
        return {name}
    member = getattr(ParallelConfig, name, None)
    if member is None or name in seen:
        raise _Unknown(name)
    fn = member.fget if isinstance(member, property) else member
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            out |= _property_reads(node.attr, seen | {name})
        elif isinstance(node, ast.Name) and node.id == "self" and not _is_attr_value(tree, node):
            raise _Unknown(f"self used whole in {name}")
    return out


def _is_attr_value(tree: ast.AST, target: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.value is target for n in ast.walk(tree))


def _function_reads(fn: ast.FunctionDef, cfg_pos: int, seen: frozenset) -> set[str]:
    """The ParallelConfig fields ``fn`` reads of its parameter ``cfg_pos`` (a SpecConfig)."""
    cfg = fn.args.args[cfg_pos].arg
    parents: dict[int, ast.AST] = {}
    for node in ast.walk(fn):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    aliases: set[str] = set()   # names bound to cfg.parallel
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            pairs = []
            for t in node.targets:
                if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += list(zip(t.elts, node.value.elts))
                else:
                    pairs.append((t, node.value))
            for t, v in pairs:
                if _is_cfg_parallel(v, cfg):
                    if not isinstance(t, ast.Name):
                        raise _Unknown(f"cfg.parallel bound to {ast.dump(t)}")
                    aliases.add(t.id)
    out: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and node.id in aliases and isinstance(node.ctx, ast.Load):
            up = parents[id(node)]
            if not (isinstance(up, ast.Attribute) and up.value is node):
                raise _Unknown(f"{fn.name}: {node.id} (cfg.parallel) used whole")
            out |= _property_reads(up.attr)
        elif isinstance(node, ast.Name) and node.id == cfg and isinstance(node.ctx, ast.Load):
            up = parents[id(node)]
            if isinstance(up, ast.Attribute) and up.value is node:
                if up.attr != "parallel":
                    continue   # cfg.model, cfg.cluster, cfg.workload, ...: the same for every layout
                upup = parents[id(up)]
                if isinstance(upup, ast.Attribute) and upup.value is up:
                    out |= _property_reads(upup.attr)
                elif not (isinstance(upup, ast.Assign) or isinstance(upup, ast.Tuple)):
                    raise _Unknown(f"{fn.name}: cfg.parallel used whole")
                continue
            # cfg passed on: follow a helper of the checks module, else give up
            if isinstance(up, ast.Call) and isinstance(up.func, ast.Name) and up.func.id in _MODULE_FUNCS \
                    and node in up.args:
                callee = up.func.id
                if (callee, up.args.index(node)) not in seen:
                    out |= _function_reads(_MODULE_FUNCS[callee], up.args.index(node),
                                           seen | {(callee, up.args.index(node))})
                continue
            raise _Unknown(f"{fn.name}: cfg used whole ({ast.dump(up)[:80]})")
    return out


def _is_cfg_parallel(node: ast.AST, cfg: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "parallel" and isinstance(node.value, ast.Name) \
        and node.value.id == cfg


def derived_reads(check) -> set[str] | None:
    """The layout fields ``check`` reads, from its source; None when it cannot be told."""
    try:
        return _function_reads(_MODULE_FUNCS[check.__name__], 0, frozenset({(check.__name__, 0)}))
    except _Unknown:
        return None


def _strings_in_calls(fn: ast.FunctionDef, method: str, seen: set[str]) -> set[str]:
    """String constants passed to ``<x>.<method>(...)`` in ``fn`` and the module helpers it calls."""
    out: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == method:
                out |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
            if isinstance(f, ast.Name) and f.id in _MODULE_FUNCS and f.id not in seen:
                seen.add(f.id)
                out |= _strings_in_calls(_MODULE_FUNCS[f.id], method, seen)
    return out


def test_layout_reads_derived_from_the_checks():
    """Each entry of LAYOUT_READS is what its check reads (properties spelled out); a check
    whose reads cannot be told from its source has no entry (the search then checks it on
    every layout)."""
    assert set(C.LAYOUT_READS) <= set(C.CHECKS)
    for check in C.CHECKS:
        got = derived_reads(check)
        if check in C.LAYOUT_READS:
            assert got is not None, f"{check.__name__}: reads cannot be told from its source; remove its entry"
            assert got == set(C.LAYOUT_READS[check]), (check.__name__, sorted(got))
    # the reading itself can fail: a property expands to its fields, a whole cfg.parallel is unknown
    assert _property_reads("expert_dp") == {"tp", "cp", "dp", "expert_tp", "ep"}
    assert _property_reads("num_microbatches") == {"global_batch", "micro_batch", "dp"}
    fake = ast.parse("def f(cfg, ctx):\n    p = cfg.parallel\n    g(p)\n").body[0]
    with pytest.raises(_Unknown):
        _function_reads(fake, 0, frozenset())
    fake = ast.parse("def f(cfg, ctx):\n    m, p = cfg.model, cfg.parallel\n    return p.tp * p.expert_dp\n").body[0]
    assert _function_reads(fake, 0, frozenset()) == {"tp", "cp", "dp", "expert_tp", "ep"}


def test_every_check_is_read():
    """Most checks have an entry (else the shortcut saves little): every check whose reads
    can be told."""
    told = {c for c in C.CHECKS if derived_reads(c) is not None}
    assert told == set(C.LAYOUT_READS), sorted(c.__name__ for c in told ^ set(C.LAYOUT_READS))


def test_no_check_reads_a_key_another_marks_bad():
    """A check run with a fresh context (the search's) sees what it sees after the checks
    before it in check_config: no key one check marks bad is read by another."""
    fns = {c: _MODULE_FUNCS[c.__name__] for c in C.CHECKS}
    for c, fn in fns.items():
        marked = _strings_in_calls(fn, "add", set())
        for other, ofn in fns.items():
            if other is not c:
                read = _strings_in_calls(ofn, "ok", set()) | _strings_in_calls(ofn, "given", set())
                assert not marked & read, (c.__name__, other.__name__, marked & read)


_SPECS = {
    "llama70b": """model m from "llama3-70b" { }
cluster c from "h100-sxm" { nodes = 16 }
parallel {
    tp = auto
    pp = auto
    cp = auto
    virtual_stages = auto
    micro_batch = auto
    zero = auto
    recompute = auto
    schedule = auto
    sequence_parallel = auto
    global_batch = 256
}
""",
    # seq_len 4100 = 4 * 1025: cp and sp rules that fail for most degrees
    "odd_seq": """model m from "llama3-8b" { seq_len = 4100 }
cluster c from "h100-sxm" { nodes = 2 }
parallel {
    tp = auto
    pp = auto
    cp = auto
    micro_batch = auto
    sequence_parallel = auto
    schedule = auto
    virtual_stages = auto
    global_batch = 96
}
""",
    "moe": """model m from "mixtral-8x7b" { }
cluster c from "h100-sxm" { nodes = 4 }
parallel {
    tp = auto
    pp = auto
    ep = auto
    micro_batch = auto
    sequence_parallel = auto
    global_batch = 64
}
""",
    "given_zero_bucket": """model m from "llama3-8b" { }
cluster c from "h100-sxm" { nodes = 1 }
parallel {
    tp = auto
    pp = auto
    zero = 1
    bucket_size = 40 MB
    micro_batch = auto
    schedule = interleaved_1f1b
    virtual_stages = 2
    global_batch = 8
}
""",
}


@pytest.mark.parametrize("name", sorted(_SPECS))
def test_layout_checker_is_the_checker(name):
    """The search's verdict on every enumerated layout (each block's first row, as the
    search checks it) equals check_layout's, for specs where many layouts fail."""
    cfg, _ = load_spec(_SPECS[name])
    checker = LayoutChecker(cfg)
    verdicts = []
    for block in layout_blocks(cfg):
        r = block[0]
        want = not any(d.severity == "error" for d in check_layout(with_parallel(cfg, checked_parallel(cfg, r))))
        assert checker.ok(r) == want, r
        verdicts.append(want)
    assert any(verdicts) and not all(verdicts)   # both verdicts occur
    assert checker.runs < len(verdicts) * len(C.CHECKS) / 4   # the shortcut saves most runs
