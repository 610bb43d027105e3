"""Codegen from the sharded graph (issue 17): the program's collectives per layer are the
plan's, its local sizes come from the graph, and it defines nothing it does not read.

The property test runs each pipeline stage of a generated program in this process, on
one rank of every axis, with ``torch.distributed``'s collectives replaced by shape-true
stand-ins (the runtime still counts every call in ``rt.COUNTER``). Forward and backward
hooks on every decoder layer attribute each counted collective to its layer; the plan's
``comm.collectives`` entries of that layer (``where = layers.<i>...``), divided by the
micro-batches, must be exactly what the program called: same ops, axes, bytes and counts,
forward and backward (with recomputation) apart. It covers every layout of
tests/test_verify*.py and the miniature of every example (examples/*.par: the same
parallel layout, a small model; verify's :func:`miniature`).
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import parcompile
import parcompile.verify as verify_mod
from parcompile import runtime as rt
from parcompile.codegen.emit import render_program, render_serve, write_files
from parcompile.codegen.program_data import program_data
from parcompile.core.axes import GROUP_AXES
from parcompile.driver import compile_config
from parcompile.ir.types import Dim
from parcompile.runtime import comm, moe
from tests.program_utils import tiny_config
from tests.test_verify import CASES, MIXED_CASES
from tests.test_verify_buckets import BUCKET
from tests.test_verify_buckets import CASES as BUCKET_CASES

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.par"))
CODEGEN = REPO / "parcompile" / "codegen"
_counter = itertools.count()

# --------------------------------------------------------------------------- layouts


def _verify_layouts() -> dict[str, tuple]:
    """name -> (config, dtype) of every layout tests/test_verify*.py launches."""
    out = {}
    for name, kw in CASES.items():
        kw = dict(kw)
        out[f"verify:{name}"] = (tiny_config(kw.pop("dp", 1), kw.pop("tp", 1), kw.pop("pp", 1), **kw), "fp32")
    for name, kw in MIXED_CASES.items():
        kw = dict(kw)
        dtype = kw.pop("dtype")
        out[f"mixed:{name}"] = (tiny_config(kw.pop("dp", 1), kw.pop("tp", 1), kw.pop("pp", 1), **kw), dtype)
    for name, kw in BUCKET_CASES.items():
        kw = dict(kw)
        par = dict(kw.pop("parallel", {}), bucket_size=BUCKET)
        out[f"buckets:{name}"] = (tiny_config(kw.pop("dp", 1), kw.pop("tp", 1), kw.pop("pp", 1),
                                              parallel=par, **kw), "fp32")
    return out


LAYOUTS = _verify_layouts()


# --------------------------------------------------------------------------- stand-in collectives


class _Done:
    def wait(self) -> None:
        return None


def _all_reduce(t, op=None, group=None, async_op=False):
    return _Done() if async_op else None


def _all_gather(out, x, group=None, async_op=False):
    out.view((out.shape[0] // x.shape[0],) + tuple(x.shape)).copy_(x)   # every rank sent x
    return _Done() if async_op else None


def _reduce_scatter(out, x, group=None, async_op=False):
    out.copy_(x[:out.shape[0]])
    return _Done() if async_op else None


def _all_to_all(out, x, out_splits=None, in_splits=None, group=None, async_op=False):
    out.copy_(x.reshape(out.shape))   # every rank sends what it receives (balanced)
    return _Done() if async_op else None


@pytest.fixture
def fake_dist(monkeypatch):
    """Collectives that keep shapes and are still counted by the runtime."""
    monkeypatch.setattr(dist, "all_reduce", _all_reduce)
    monkeypatch.setattr(dist, "all_to_all_single", _all_to_all)
    for mod in (comm, moe):
        if hasattr(mod, "all_gather_single"):
            monkeypatch.setattr(mod, "all_gather_single", _all_gather)
        if hasattr(mod, "reduce_scatter_single"):
            monkeypatch.setattr(mod, "reduce_scatter_single", _reduce_scatter)
    yield


def _context(plan: dict, stage: int) -> rt.ParallelContext:
    """Rank 0 of every axis but pp (this stage), each with a stand-in group."""
    deg = plan["degrees"]
    axes = {}
    for name in GROUP_AXES:
        size = len(plan["groups"][name][0]) if name in plan["groups"] else deg.get(name, 1)
        index = stage if name == "pp" else 0
        axes[name] = rt.Axis(name, list(range(size)), index, object() if size > 1 else None)
    return rt.ParallelContext(0, plan["world_size"], axes, torch.device("cpu"), None)


def _import(cfg, plan_obj, out: Path):
    write_files(out, {"plan.json": plan_obj.to_json(), "program.py": render_program(cfg, plan_obj, out)})
    spec = importlib.util.spec_from_file_location(f"parcompile_codegen_test_{next(_counter)}", out / "program.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- measuring


def _key(e: dict) -> tuple:
    """(op, axis, bytes); MoE token traffic (whose size the router decides) without bytes."""
    routed = e.get("routed") or e.get("rows", -1) >= 0
    return e["op"], e["axis"], None if routed else e["bytes"]


def _counts() -> Counter:
    return Counter({_key({"op": op, "axis": ax, "bytes": b, "rows": r}): n
                    for (op, ax, b, r), n in rt.COUNTER.counts.items()})


def measured_per_layer(module, plan: dict, cfg) -> dict[int, dict[str, Counter]]:
    """Run every stage's chunks forward and backward once (one micro-batch); per decoder
    layer, the collectives counted inside its forward and inside its backward (recomputation
    included)."""
    m, p = cfg.model, cfg.parallel
    out: dict[int, dict[str, Counter]] = {}
    for s in range(p.pp):
        ctx = _context(plan, s)
        torch.manual_seed(0)
        model = module.Stage(plan, ctx).to(dtype=module.ACT_DTYPE)
        model.train()
        phase = {"now": "forward"}

        def hooks(i: int, block) -> None:
            rec = out.setdefault(i, {"forward": Counter(), "backward": Counter()})
            mark = {}

            def pre(_mod, args):
                if phase["now"] == "forward":
                    mark["fwd"] = _counts()

            def post(_mod, args, y):
                if phase["now"] != "forward":
                    return
                rec["forward"] += _counts() - mark["fwd"]
                y.register_hook(lambda g: mark.__setitem__("bwd", _counts()))
                args[0].register_hook(lambda g: rec["backward"].update(_counts() - mark["bwd"]))

            block.register_forward_pre_hook(pre)
            block.register_forward_hook(post)

        for name, block in model.layers.items():
            hooks(int(name), block)
        seq = m.seq_len // p.cp                                  # tokens per cp rank
        resid = seq // (p.tp if p.sequence_parallel and p.tp > 1 else 1)
        for c in range(len(model.chunks)):
            k = c * model.num_stages + model.stage
            phase["now"] = "forward"
            rt.COUNTER.reset()
            if k == 0:
                x = torch.randint(0, m.vocab, (p.micro_batch, seq))
            else:
                x = torch.randn(p.micro_batch, resid, m.hidden, dtype=module.ACT_DTYPE, requires_grad=True)
            y = model.forward_chunk(c, x)
            if k == model.num_model_chunks - 1:
                loss = model.loss(y, torch.randint(0, m.vocab, (p.micro_batch, seq)))
            else:
                loss = y.float().sum()
            phase["now"] = "backward"
            loss.backward()
    return out


def planned_per_layer(plan: dict) -> dict[int, dict[str, Counter]]:
    """The plan's collectives of each decoder layer per micro-batch: forward, and backward
    with recomputation."""
    m = plan["schedule"]["num_microbatches"]
    out: dict[int, dict[str, Counter]] = {}
    for e in plan["comm"]["collectives"]:
        got = re.match(r"layers\.(\d+)\.", e["where"])
        if not got or e["phase"] == "step":
            continue
        assert e["count"] % m == 0, e
        window = "forward" if e["phase"] == "forward" else "backward"
        rec = out.setdefault(int(got.group(1)), {"forward": Counter(), "backward": Counter()})
        rec[window][_key(e)] += e["count"] // m
    return out


def _add_fp8_amax(planned: dict, plan_obj, recompute: str) -> None:
    """The plan lists the FP8 amax all-reduces per step under ``where`` ``fp8_amax_tp``, not per
    layer: attribute them to their layers by the ops that run them
    (:func:`parcompile.analysis.fp8.amax_collectives`, the rows' source), and hold the sum to
    the plan's rows (a recomputed forward runs its amaxes again, in the backward)."""
    from parcompile.analysis.fp8 import amax_collectives
    plan = plan_obj.data
    m = plan["schedule"]["num_microbatches"]
    listed = Counter()
    for e in plan["comm"]["collectives"]:
        if e["where"] == "fp8_amax_tp":
            listed["forward" if e["phase"] == "forward" else "backward", _key(e)] += e["count"]
    got = Counter()
    for nd in plan_obj.graph.nodes():
        for op, axis, nbytes, phase in amax_collectives(plan_obj.graph, nd, plan_obj.degrees):
            rec = planned.setdefault(nd.op.layer, {"forward": Counter(), "backward": Counter()})
            for window in ("forward", "backward") if phase == "forward" and recompute == "full" else (
                    "forward" if phase == "forward" else "backward",):
                rec[window][(op, axis, nbytes)] += 1
                got[window, (op, axis, nbytes)] += m * (nd.stage is not None)
    assert +listed == +Counter({k: v for k, v in got.items()}) or not listed, (listed, got)


def _check(cfg, dtype: str, tmp_path: Path) -> None:
    mini = verify_mod.miniature(cfg, dtype=dtype)
    plan_obj = compile_config(mini)
    module = _import(mini, plan_obj, tmp_path)
    plan = plan_obj.data
    measured = measured_per_layer(module, plan, mini)
    planned = planned_per_layer(plan)
    _add_fp8_amax(planned, plan_obj, mini.parallel.recompute)
    assert sorted(measured) == list(range(mini.model.layers))
    for i in range(mini.model.layers):
        want = planned.get(i, {"forward": Counter(), "backward": Counter()})
        for window in ("forward", "backward"):
            assert +measured[i][window] == +want[window], (
                f"layer {i} {window}: the program called {dict(+measured[i][window])}, "
                f"the plan has {dict(+want[window])}")


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_program_calls_the_plans_collectives_per_layer(name, tmp_path, fake_dist):
    cfg, dtype = LAYOUTS[name]
    _check(cfg, dtype, tmp_path)


@pytest.mark.parametrize("spec", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_programs_call_the_plans_collectives_per_layer(spec, tmp_path, fake_dist, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = parcompile.compile(spec.relative_to(REPO)).config
    if cfg.workload != "train":
        pytest.skip("serving programs: no backward, no per-layer training collectives")
    monkeypatch.setattr(verify_mod, "MAX_WORLD", 1 << 20)   # the layout is all this test keeps
    _check(cfg, "fp32", tmp_path)


def test_a_missing_collective_fails(tmp_path, fake_dist, monkeypatch):
    """The property can fail: a program whose row-parallel layers skip their all-reduce
    calls fewer collectives than the plan."""
    cfg = verify_mod.miniature(tiny_config(1, 2, 1))
    plan_obj = compile_config(cfg)
    module = _import(cfg, plan_obj, tmp_path)
    planned = planned_per_layer(plan_obj.data)
    assert measured_per_layer(module, plan_obj.data, cfg)[0]["forward"] == planned[0]["forward"]
    monkeypatch.setattr(rt.RowParallelLinear, "forward", lambda self, x: rt.linear(x, self.weight))
    assert measured_per_layer(module, plan_obj.data, cfg)[0]["forward"] != planned[0]["forward"]


# --------------------------------------------------------------------------- static checks


def _unread_constants(text: str) -> list[str]:
    """Module-level names a program assigns and never reads."""
    tree = ast.parse(text)
    assigned = [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]
    loads = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return [a for a in assigned if a not in loads]


@pytest.mark.parametrize("spec", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_programs_define_nothing_unread(spec, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    plan = parcompile.compile(spec.relative_to(REPO))
    render = render_program if plan.config.workload == "train" else render_serve
    assert _unread_constants(render(plan.config, plan, tmp_path)) == []


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_programs_define_nothing_unread(name, tmp_path):
    cfg, dtype = LAYOUTS[name]
    mini = verify_mod.miniature(cfg, dtype=dtype)
    assert _unread_constants(render_program(mini, compile_config(mini), tmp_path)) == []


MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
SERVE_LAYOUTS = {
    "gqa_tp2": (2, {}),
    "kv_head_replicated_tp4": (4, {}),      # 2 kv heads on 4 ranks: KV_REPLICAS reads them
    "qk_norm_kv_head_replicated_tp4": (4, {"qk_norm": True}),   # Qwen3-30B-A3B at tp 8: k_norm of a replicated head
    "mla_tp2": (2, MLA),                     # the latent cache: no kv heads
    "mla_moe_tp2": (2, {**MLA, "experts": 4, "top_k": 2, "expert_ffn_hidden": 32, "dense_layers": 1}),
}


@pytest.mark.parametrize("name", sorted(SERVE_LAYOUTS))
def test_serving_programs_define_nothing_unread(name, tmp_path):
    from tests.serve_utils import serve_config
    tp, model = SERVE_LAYOUTS[name]
    cfg = serve_config(1, tp, 1, model=model)
    assert _unread_constants(render_serve(cfg, compile_config(cfg), tmp_path)) == []


@pytest.mark.parametrize("spec", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_programs_have_no_empty_comments(spec, monkeypatch, tmp_path):
    """A comment says something: no line of a generated program ends in a bare ``#`` (was:
    ``opt.step()  # `` at ZeRO 0 and 3, whose note is ZeRO 1 and 2's)."""
    monkeypatch.chdir(REPO)
    plan = parcompile.compile(spec.relative_to(REPO))
    render = render_program if plan.config.workload == "train" else render_serve
    assert [ln for ln in render(plan.config, plan, tmp_path).splitlines() if re.search(r"#\s*$", ln)] == []


def test_a_replicated_kv_heads_comments_give_its_rank_one_head(tmp_path):
    """Serving 2 kv heads of 16 on tp 4 (each head on 2 ranks): a rank's k and v are one head,
    (B, T, kv=16) in every comment, k_norm's and RoPE's too (was: kv=32, the whole
    projection the graph leaves unsplit)."""
    from tests.serve_utils import serve_config
    cfg = serve_config(1, 4, 1, model={"qk_norm": True})
    text = render_serve(cfg, compile_config(cfg), tmp_path)
    kv_lines = [ln for ln in text.splitlines() if re.search(r"\bk = |\bv = ", ln) and "#" in ln]
    assert len(kv_lines) == 4, kv_lines          # wk, wv, k_norm, RoPE
    assert all("(B, T, kv=16)" in ln for ln in kv_lines), kv_lines


def test_unread_constant_check_can_fail():
    assert _unread_constants("A = 1\nB = 2\nprint(A)\n") == ["B"]


DEGREE_ARITHMETIC = re.compile(r"//\s*\(?\s*(?:p\.|par\.|parallel\.|cfg\.parallel\.)?"
                               r"(?:tp|pp|cp|dp|ep|expert_tp|expert_dp|world_size|num_shards)\b")


def test_no_degree_arithmetic_in_codegen():
    hits = []
    for path in sorted(CODEGEN.rglob("*")):
        if path.suffix in (".py", ".j2"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if DEGREE_ARITHMETIC.search(line):
                    hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert hits == []
    assert DEGREE_ARITHMETIC.search("heads_local = m.heads // p.tp")
    assert DEGREE_ARITHMETIC.search("x // tp")


# --------------------------------------------------------------------------- the data


def test_local_sizes_come_from_the_graph():
    """Sizes of a layout whose numbers are all different: read off the graph, they equal
    the ones derived here from the spec (independently of codegen)."""
    cfg = tiny_config(2, 2, 2, model=dict(heads=8, kv_heads=4, head_dim=8, hidden=64, ffn_hidden=192, vocab=300),
                      parallel=dict(sequence_parallel=True, cp=2))
    plan = compile_config(cfg)
    z = program_data(plan.graph, plan.degrees).sizes
    assert (z.heads, z.kv_heads, z.ffn) == (8 // 2, 4 // 2, 192 // 2)
    assert (z.t_attn, z.t_residual) == (16 // 2, 16 // 2 // 2)
    padded = -(-300 // (128 * 2)) * 128 * 2
    assert z.vocab == padded // 2 and z.boundary == (2, 4, 64)


def test_layers_that_differ_are_refused():
    plan = compile_config(tiny_config(1, 2, 1))
    g = plan.graph
    nd = g.node("layers.2.mlp.w1")
    g.retype("layers.2.mlp.w1", nd.type.replace_dim("ffn", Dim("ffn", 256)))
    with pytest.raises(ValueError, match="layer 2 of the sharded graph differs from layer 0"):
        program_data(g, plan.degrees)


@pytest.mark.parametrize("spec", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_full_size_example_programs_import(spec, monkeypatch, tmp_path):
    """Each example's own program (full size) defines its classes and main without error."""
    monkeypatch.chdir(REPO)
    plan = parcompile.compile(spec.relative_to(REPO))
    render = render_program if plan.config.workload == "train" else render_serve
    path = tmp_path / "program.py"
    path.write_text(render(plan.config, plan, tmp_path))
    sp = importlib.util.spec_from_file_location(f"parcompile_codegen_full_{next(_counter)}", path)
    module = importlib.util.module_from_spec(sp)
    sp.loader.exec_module(module)
    assert callable(module.main)
