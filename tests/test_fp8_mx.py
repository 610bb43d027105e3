"""MXFP8 in the program (issue 32, runtime/model/fp8.py ``mx_cast`` / ``mx_mm`` / ``fp8_linear(...,
"mxfp8")``) against a reference written from the specifications, not from the code under test:

- E4M3 (OCP 8-bit Floating Point Specification (OFP8) rev 1.0, section 5.1, table 1): sign,
  4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal ``(m / 8) * 2^-6``;
  ``S.1111.111`` is NaN, no infinities; largest normal 1.75 * 2^8 = 448. Conversion rounds to
  nearest, ties to even (the value whose code's last mantissa bit is 0).
- MX (OCP Microscaling Formats (MX) v1.0, section 6.3, "Conversion from vectors of scalar
  elements"): per block of k = 32 elements, ``shared_exp = floor(log2(max |V_i|)) -
  emax_elem`` (emax_elem = 8 for E4M3), ``X = 2^shared_exp`` (an E8M0 value, 2^-127 .. 2^127),
  ``P_i = quantize(V_i / X)`` clamped to the element format's largest normal. A dot product of
  two MX vectors is ``sum over blocks X_a X_b sum_i P_a,i P_b,i`` (section 6.4).
"""

from __future__ import annotations

import math

import pytest
import torch

from parcompile.runtime.model.fp8 import _swizzled, fp8_linear, mx_cast, mx_mm


def _e4m3_table() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite non-negative E4M3 value (float64, ascending) and its mantissa's last bit."""
    vals, lsb = [], []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue   # NaN
            vals.append((m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
            lsb.append(m & 1)
    return torch.tensor(vals, dtype=torch.float64), torch.tensor(lsb)


E4M3_VALUES, E4M3_LSB = _e4m3_table()


def _quantize_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto E4M3 (float64 in, float64 out), saturating at the largest
    normal."""
    mag = v.abs().clamp(max=E4M3_VALUES[-1].item())
    d = (mag.unsqueeze(-1) - E4M3_VALUES).abs()
    best = d.min(dim=-1, keepdim=True).values
    tied = d == best
    # among the nearest (one, or two at a tie) take the even code
    pick = torch.where(tied & (E4M3_LSB == 0), 1, 0) + tied.int()
    idx = pick.argmax(dim=-1)
    return torch.sign(v) * E4M3_VALUES[idx]


def _mx_vector(v: torch.Tensor) -> list[tuple[float, torch.Tensor]]:
    """One row (float64) as MX blocks of 32: ``[(X, P), ...]``; a last partial block as is."""
    out = []
    for lo in range(0, v.numel(), 32):
        blk = v[lo:lo + 32]
        amax = blk.abs().max().item()
        if amax == 0:
            shared = -127
        else:
            m, e = math.frexp(amax)       # amax = m 2^e, 0.5 <= m < 1: floor(log2 amax) = e - 1
            shared = max(-127, min(127, (e - 1) - 8))
        x = 2.0 ** shared
        out.append((x, _quantize_e4m3(blk / x)))
    return out


def _reference_mx_gemm(a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """``a @ bt^T`` (M x K, N x K) as MX dot products of rows, in float64."""
    a, bt = a.double(), bt.double()
    ra = [_mx_vector(r) for r in a]
    rb = [_mx_vector(r) for r in bt]
    out = torch.zeros(a.shape[0], bt.shape[0], dtype=torch.float64)
    for i, va in enumerate(ra):
        for j, vb in enumerate(rb):
            out[i, j] = sum(xa * xb * float((pa * pb).sum()) for (xa, pa), (xb, pb) in zip(va, vb))
    return out


def _operand(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random rows with the cases the spec singles out: a zero block, a saturating block
    (amax 1.9 * 2^k: 1.9 * 2^8 > 448 after scaling), tiny (E4M3-subnormal after scaling)
    elements, a partial last block when k % 32."""
    t = torch.randn(rows, k, generator=g) * torch.logspace(-3, 2, rows).unsqueeze(1)
    t[0, :32] = 0.0
    t[1, 5] = 1.9 * 4.0
    t[2, 33] = 3e-4 * t[2, 32:64].abs().max()
    return t


@pytest.mark.parametrize("m, n, k", [(6, 5, 64), (4, 3, 70)])
def test_mx_gemm_equals_the_specs_block_dot_products(m, n, k):
    g = torch.Generator().manual_seed(7)
    a, bt = _operand(m, k, g), _operand(n, k, g)
    want = _reference_mx_gemm(a, bt)
    got = mx_mm(a, bt, torch.float32).double()
    # exact products, fp32 sums of at most 70 terms: a few fp32 ulps of the largest term
    scale = (a.abs().max(dim=1).values.double().unsqueeze(1) * bt.abs().max(dim=1).values.double()) * k
    assert torch.all((got - want).abs() <= 1e-6 * scale), (got - want).abs().max()
    # and not the unquantized GEMM (MX rounding is visible)
    assert not torch.allclose(got, (a.double() @ bt.double().t()), rtol=1e-4, atol=0)


def test_mx_cast_scales_are_e8m0_powers_of_two_per_32_block():
    g = torch.Generator().manual_seed(3)
    t = _operand(4, 70, g)
    q, s = mx_cast(t)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (4, 96) and s.shape == (4, 3)
    assert torch.all(q[:, 70:].float() == 0)
    for r in range(4):
        for b, (x, p) in enumerate(_mx_vector(t[r].double())):
            assert s[r, b].item() == x
            assert torch.equal(q[r, 32 * b:32 * b + p.numel()].double(), p)
    assert torch.equal(s.to(torch.float8_e8m0fnu).float(), s)


def test_fp8_linear_mxfp8_quantizes_each_gemm_along_its_own_reduction_dim():
    """Forward ``x W^T`` along K, input gradient ``g W`` along N, weight gradient ``g^T x``
    along M (torchao's MXLinear): each against the spec's block GEMM of those operands."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 20, 64, generator=g, requires_grad=True)      # M = 40: a partial block along M
    w = (torch.randn(48, 64, generator=g) * 0.05).requires_grad_()
    y = fp8_linear(x, w, None, "mxfp8")
    gy = torch.randn(y.shape, generator=g)
    y.backward(gy)
    x2, g2 = x.detach().reshape(-1, 64), gy.reshape(-1, 48)
    tol = 2e-5
    want_y = _reference_mx_gemm(x2, w.detach())
    assert torch.allclose(y.detach().reshape(-1, 48).double(), want_y, rtol=tol, atol=tol * want_y.abs().max())
    want_gx = _reference_mx_gemm(g2, w.detach().t())
    assert torch.allclose(x.grad.reshape(-1, 64).double(), want_gx, rtol=tol, atol=tol * want_gx.abs().max())
    want_gw = _reference_mx_gemm(g2.t(), x2.t())
    assert torch.allclose(w.grad.double(), want_gw, rtol=tol, atol=tol * want_gw.abs().max())


def test_a_tp_split_reduction_of_whole_blocks_sums_to_the_whole_gemm():
    """A row-parallel layer splits K over tp; with a local K that is a multiple of 32 each
    block sits on one rank, so the partial GEMMs sum (the all-reduce) to the one-process GEMM
    up to fp32 summation order; a split inside a block does not."""
    g = torch.Generator().manual_seed(5)
    a, bt = torch.randn(8, 128, generator=g), torch.randn(6, 128, generator=g)
    whole = mx_mm(a, bt, torch.float32)
    halves = mx_mm(a[:, :64], bt[:, :64], torch.float32) + mx_mm(a[:, 64:], bt[:, 64:], torch.float32)
    assert torch.allclose(halves, whole, rtol=1e-5, atol=1e-5 * whole.abs().max())
    odd = mx_mm(a[:, :48], bt[:, :48], torch.float32) + mx_mm(a[:, 48:], bt[:, 48:], torch.float32)
    assert not torch.allclose(odd, whole, rtol=1e-5, atol=1e-5 * whole.abs().max())


def test_block_scales_in_cublas_swizzled_layout():
    """runtime/fp8._swizzled against the cuBLAS documentation's layout of 1-D block scaling
    factors (cuBLAS "1D Block Scaling Factors Layout"): 128 x 4 tiles, row-tile major, each
    tile 512 bytes with element (i, j) at ``(i % 32) * 16 + (i // 32) * 4 + j``."""
    r, kb = 130, 5
    s = torch.ldexp(torch.ones(r, kb), torch.arange(r * kb).view(r, kb) % 40 - 20)
    out = _swizzled(s).float()
    assert out.numel() == 256 * 8
    col_tiles = 2
    for i in range(r):
        for j in range(kb):
            tile = (i // 128) * col_tiles + j // 4
            off = tile * 512 + (i % 128 % 32) * 16 + (i % 128 // 32) * 4 + j % 4
            assert out[off].item() == s[i, j].item(), (i, j)


# -- layers kept in 16 bits (train.fp8_bf16_layers_start / _end) ------------------------------

SPEC = """model llama from "llama3-8b" {{ layers = 6 }}
cluster gpus from "h100-sxm" {{ nodes = 2 }}
parallel {{ tp = 4, dp = 2, pp = 2, micro_batch = 1, global_batch = 8 }}
train {{
  steps = 2
{train}}}
"""


def _compile_or_diags(tmp_path, train: str, name: str = "l.par"):
    import parcompile
    from parcompile.diagnostics import SpecError
    path = tmp_path / name
    path.write_text(SPEC.format(train=train))
    try:
        plan = parcompile.compile(path.read_text(), filename=name)
    except SpecError as e:
        return path, None, e.diagnostics
    return path, plan, plan.warnings


def _at(path, key: str) -> tuple[int, int]:
    import re
    for i, line in enumerate(path.read_text().splitlines(), 1):
        m = re.search(rf"\b{key}\s*=\s*", line)
        if m:
            return i, m.end() + 1
    raise AssertionError(key)


def test_bf16_layer_keys_are_checked_where_they_are_written(tmp_path):
    path, plan, d = _compile_or_diags(tmp_path, "  precision = fp8\n  fp8_bf16_layers_end = 7\n")
    [err] = [x for x in d if x.severity == "error"]
    assert err.message == "fp8_bf16_layers_end = 7 exceeds the model's 6 layers"
    assert (err.span.line, err.span.column) == _at(path, "fp8_bf16_layers_end") and "at most 6" in err.help
    path, plan, d = _compile_or_diags(tmp_path, "  precision = fp8\n  fp8_bf16_layers_start = 3\n"
                                      "  fp8_bf16_layers_end = 3\n", "w.par")
    assert plan is not None and [x.message for x in d if x.severity == "warning"] == [
        "fp8_bf16_layers_start + fp8_bf16_layers_end = 6 keeps all 6 layers in 16 bits: no GEMM runs in FP8"]
    path, plan, d = _compile_or_diags(tmp_path, "  fp8_bf16_layers_start = 1\n", "n.par")
    assert [x.message for x in d] == ["fp8_bf16_layers_start has no effect with precision = model"]
    assert (d[0].span.line, d[0].span.column) == _at(path, "fp8_bf16_layers_start")
    path, plan, d = _compile_or_diags(tmp_path, "  precision = fp8\n  fp8_bf16_layers_start = -1\n", "m.par")
    [err] = [x for x in d if x.severity == "error"]
    assert plan is None and err.message == "fp8_bf16_layers_start must not be negative, got `-1`"
    assert (err.span.line, err.span.column) == _at(path, "fp8_bf16_layers_start")
    for value, what in (('"two"', "expected an integer"), ("2.5", "expected an integer"),
                        ("true", "expected an integer"),
                        ("100000000000000000000000000000", "exceeds the model's 6 layers")):
        path, plan, d = _compile_or_diags(tmp_path, f"  precision = fp8\n  fp8_bf16_layers_end = {value}\n", "v.par")
        errs = [x for x in d if x.severity == "error"]
        assert plan is None and errs and (errs[0].span.line, errs[0].span.column) == _at(path, "fp8_bf16_layers_end"), (value, errs)
        assert what in errs[0].message, (value, errs[0].message)


def test_bf16_layers_leave_the_fp8_gemms_casts_and_copies_of_those_layers(tmp_path):
    """Layers 0 and 5 of 6 (one at each end of the two stages) in 16 bits: stage 0 loses a
    third of its FP8 GEMM FLOPs and FP8 weights, so do the amax collectives the program runs;
    the step sits between all-FP8 and bf16."""
    _, every, _ = _compile_or_diags(tmp_path, "  precision = fp8\n", "a.par")
    _, kept, _ = _compile_or_diags(tmp_path, "  precision = fp8\n  fp8_bf16_layers_start = 1\n"
                                   "  fp8_bf16_layers_end = 1\n", "k.par")
    _, bf16, _ = _compile_or_diags(tmp_path, "", "b.par")
    fa = kept.data["estimate"]["assumptions"]["fp8"]
    assert fa["bf16_layers"] == [0, 5] and "first 1 and last 1 decoder layers" in fa["bf16_gemms"]
    assert every.data["estimate"]["assumptions"]["fp8"]["bf16_layers"] == []
    t = [p.data["estimate"]["step_time"] for p in (every, kept, bf16)]
    assert t[0] < t[1] < t[2], t
    from parcompile.ir.fp8 import is_fp8_gemm
    g = kept.graph
    per_layer = {}
    for nd in g.nodes():
        if nd.op.layer is not None and nd.kind == "linear":
            per_layer.setdefault(nd.op.layer, set()).add(is_fp8_gemm(nd, g))
    assert per_layer == {0: {False}, 1: {True}, 2: {True}, 3: {True}, 4: {True}, 5: {False}}

    def amax(plan):
        return sum(c["count"] for c in plan.data["comm"]["collectives"] if c["where"] == "fp8_amax_tp")

    # 7 linears per layer (q, k, v, o; gate, up, down): 5 column + 2 row, each 4 + 4 per
    # micro-batch under tensorwise (column 1 + 3, row 2 + 2), 4 micro-batches per stage
    m = every.config.parallel.num_microbatches
    assert amax(every) == 6 * 7 * 4 * m and amax(kept) == 4 * 7 * 4 * m and amax(bf16) == 0


def test_compile_writes_the_fp8_recipe_per_layer_and_megatron_gets_the_flags(tmp_path):
    from parcompile.exporters import export
    from tests.program_utils import build_program, tiny_config
    cfg = tiny_config(1, 2, 2, train=dict(precision="fp8", fp8_bf16_layers_start=1, fp8_bf16_layers_end=1))
    module, _plan = build_program(cfg, tmp_path / "p")
    assert module.LAYER_FP8 == (None, "tensorwise", "tensorwise", None)
    text = (tmp_path / "p" / "program.py").read_text()
    assert 'fp8="tensorwise"' not in text and text.count("fp8=LAYER_FP8[i]") == 7
    _, plan, _ = _compile_or_diags(tmp_path, "  precision = fp8\n  fp8_bf16_layers_start = 2\n", "e.par")
    out = export(plan, "megatron")
    assert not out.errors
    assert "--first-last-layers-bf16 --num-layers-at-start-in-bf16 2 --num-layers-at-end-in-bf16 0" in \
        " ".join(out.text.replace("\\\n", " ").split())
    from tests.test_export import (MEGATRON_CORE_V0_19_0_FLAGS, MEGATRON_CORE_V0_19_0_FP8_FLAGS,
                                   MEGATRON_CORE_V0_19_0_PRECISION_FLAGS, parse_megatron)
    _launcher, flags = parse_megatron(out.text)   # each flag one Megatron-LM core_v0.19.0 has (pinned there)
    assert set(flags) <= MEGATRON_CORE_V0_19_0_FLAGS | MEGATRON_CORE_V0_19_0_FP8_FLAGS | \
        MEGATRON_CORE_V0_19_0_PRECISION_FLAGS
    assert flags["--num-layers-at-start-in-bf16"] == "2" and flags["--num-layers-at-end-in-bf16"] == "0"
    _, plain, _ = _compile_or_diags(tmp_path, "  precision = fp8\n", "p.par")
    assert "    --first-last-layers-bf16" not in export(plain, "megatron").text   # a note says it is off
    # torchtitan 0.2: the kept layers filtered out of the float8 conversion by FQN
    import tomllib
    t = tomllib.loads(export(plan, "torchtitan", torchtitan_version="0.2").text)
    assert t["quantize"]["linear"]["float8"]["filter_fqns"] == ["output", "layers.0.", "layers.1."]
    # Megatron-Core allows at most layers // pp = 3 per end
    _, over, _ = _compile_or_diags(tmp_path, "  precision = fp8\n  fp8_bf16_layers_start = 4\n", "o.par")
    assert any(e.startswith("fp8_bf16_layers_start 4: Megatron-Core allows") for e in export(over, "megatron").errors)


def test_the_miniature_keeps_a_bf16_layer_and_an_fp8_one():
    from parcompile.verification import miniature
    from tests.program_utils import tiny_config
    mini = miniature(tiny_config(2, 2, 2, train=dict(precision="fp8", fp8_bf16_layers_start=2,
                                                     fp8_bf16_layers_end=2)))
    assert mini.model.layers == 4
    assert (mini.train.fp8_bf16_layers_start, mini.train.fp8_bf16_layers_end) == (1, 1)
    one = miniature(tiny_config(1, 1, 1, model=dict(layers=1), train=dict(precision="fp8", fp8_bf16_layers_end=1)))
    assert one.model.layers == 2 and (one.train.fp8_bf16_layers_start, one.train.fp8_bf16_layers_end) == (0, 1)
    few = miniature(tiny_config(2, 1, 1, parallel=dict(zero=3), train=dict(precision="fp8", fp8_bf16_layers_start=4,
                                                                          fp8_bf16_layers_end=4)))
    assert few.model.layers == 3 and (few.train.fp8_bf16_layers_start, few.train.fp8_bf16_layers_end) == (1, 1)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_plan_lists_the_experts_amax_all_reduces_over_expert_tp(recipe):
    # FP8 routed experts with expert_tp 2 (runtime/model/moe.py expert_linear; analysis/fp8.py
    # amax_collectives): per local expert and micro-batch, w1 and w3 column-, w2 row-parallel
    from parcompile.passes.manager import compile_graph
    from tests.program_utils import tiny_config
    cfg = tiny_config(4, 1, 1, model=dict(experts=4, top_k=2), parallel=dict(ep=2, expert_tp=2),
                      train=dict(precision="fp8", fp8_recipe=recipe))
    c = compile_graph(cfg)
    amax = [e for e in c.cost.comm.collectives if e.where == "fp8_amax_tp"]
    assert {(e.op, e.axis) for e in amax} == {("all_reduce", "expert_tp")}
    m, p, mod = cfg.parallel.num_microbatches, cfg.parallel, cfg.model
    local, h = mod.experts // p.ep, mod.hidden
    per_expert = m * mod.layers * local   # expert GEMM runs of one matrix per step
    fixed = [e for e in amax if not e.bytes_per_row]
    routed = [e for e in amax if e.bytes_per_row]
    if recipe == "tensorwise":   # scalars: w1, w3: W forward; g, W, g backward; w2: W, x forward, W, x backward
        assert not routed and {e.bytes for e in fixed} == {4} and sum(e.count for e in fixed) == 12 * per_expert
        return
    # rowwise: the weights' h rows / columns (w2 forward, w1 and w3 backward), and as many
    # all-reduces of the groups' routed rows, 4 bytes a row, balanced: the expert_tp * A rows
    # (A = micro_batch * seq * top_k sent per rank) over the local experts
    assert {e.bytes for e in fixed} == {4 * h} and sum(e.count for e in fixed) == 3 * per_expert
    assert {e.bytes_per_row for e in routed} == {4} and sum(e.count for e in routed) == 3 * per_expert
    a = p.micro_batch * mod.seq_len * mod.top_k
    assert sum(e.count * e.bytes for e in routed) == 3 * m * mod.layers * 4 * p.expert_tp * a
    assert [e.to_dict()["routed"] for e in routed] == [True] * len(routed)


@pytest.mark.parametrize("keys", [dict(fp8_bf16_layers_end=1), dict(fp8_bf16_layers_start=1)])
def test_routed_experts_of_a_bf16_layer_stay_in_16_bits(keys, tmp_path):
    """The routed experts' GEMMs follow the layer's recipe as the dense linears do: a MoE
    layer kept in 16 bits (fp8_bf16_layers_*) runs its experts in 16 bits, an FP8 layer in FP8,
    wherever ir/fp8.is_fp8_gemm marks the plan's ``experts`` op (was: the recipe of the
    first MoE layer written into every MoE layer)."""
    from parcompile import runtime as rt
    from parcompile.ir.fp8 import is_fp8_gemm
    from parcompile.driver import compile_config
    from parcompile.runtime.distributed.context import init_parallel
    from tests.program_utils import build_program, tiny_config
    cfg = tiny_config(model=dict(experts=4, top_k=2, expert_ffn_hidden=32),
                      train=dict(precision="fp8", fp8_recipe="rowwise", **keys))
    graph = compile_config(cfg).graph
    want = {i: "rowwise" if is_fp8_gemm(graph.node(f"layers.{i}.mlp.experts"), graph) else None for i in range(4)}
    assert sorted(want.values(), key=str) == [None, "rowwise", "rowwise", "rowwise"]
    module, plan = build_program(cfg, tmp_path)
    stage = module.Stage(plan, init_parallel(plan))
    got = {int(name.split(".")[1]): mod.fp8 for name, mod in stage.named_modules() if isinstance(mod, rt.GroupedExperts)}
    assert got == want
