"""`parcompile verify`: run a miniature of a plan on CPU and compare it with a
single-process reference.

The miniature keeps what decides the parallel structure (every degree, the schedule,
virtual stages, the stage layout's shape, tied embeddings, GQA, vocabulary padding, the
layer kinds) and shrinks the widths, the sequence and the number of micro-batches. Its
program runs under torchrun with gloo; the same miniature with every degree 1 runs
in-process as the reference. They are compared on:

- the loss at every step (the reference sees the same global batches);
- every parameter's gradient at the first step (after the data-parallel reduction);
- every parameter after the last step (padded vocabulary rows must still be zero);
- what the plan predicts: parameters per rank, and each collective (op, axis, bytes,
  count) that one training step of each rank runs; MoE token traffic, whose size the
  router decides, at the plan's bytes per row for the rows actually routed, and summed over
  the ranks, at the plan's balanced estimate (:func:`check_routed`).

A `serve` spec's miniature (:func:`serve_miniature`: the same model and layout rule, a few
greedy requests) runs its generated serve program instead, compared with the same program
in one process (:func:`compare_serve`) on the greedy tokens, the logits of the prefill and
of every decode step, the KV cache bytes each rank holds and the parameters per rank.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Hashable

import torch

from parcompile.ir.fp8 import enabled as fp8_enabled
from parcompile.config.schema import SpecConfig
from parcompile.diagnostics import SpecError
# the miniature a run verifies (re-exported: callers import them from here)
from parcompile.miniature import (MAX_WORLD, MINI_BUCKET_SIZE, MINIATURE_KEYS, SERVE_BATCH_PER_REPLICA,  # noqa: F401
                                  SERVE_NEW_TOKENS, SERVE_PROMPT_LEN, VERIFY_ADAM_EPS, miniature, reference,
                                  serve_miniature, tokenizer_vocab)


@dataclass(frozen=True)
class Tolerances:
    """Absolute + relative tolerances (|a - b| <= atol + rtol * |b|), fp32 miniature.

    Adam's epsilon is raised to 1e-5 in the miniature: with the usual 1e-8, a gradient
    element whose true value is at rounding level (|g| ~ 1e-9) moves by +-lr in either
    run depending on summation order, which says nothing about the layout. With 1e-5,
    a rounding-level gradient difference dg moves a weight by at most lr * dg / 1e-5 per
    step (1e-2 * 2e-8 / 1e-5 = 2e-5), hence 1e-4 on parameters after a few steps; a wrong
    layout moves weights by about lr (1e-2).
    """

    loss_atol: float = 1e-5
    loss_rtol: float = 1e-5
    grad_atol: float = 1e-6
    grad_rtol: float = 1e-4
    param_atol: float = 1e-4
    param_rtol: float = 1e-4
    #: serving: logits (a serve miniature's are O(1e-1)) differ by summation order only, a few
    #: fp32 ulps through a few layers (measured: at most 1.8e-7); a wrong layout moves them by
    #: their own size
    logits_atol: float = 1e-5
    logits_rtol: float = 1e-4

    @classmethod
    def for_dtype(cls, dtype: str, fp8: bool = False) -> "Tolerances":
        """fp32: the defaults. bf16/fp16 compute (8 or 11 mantissa bits): both runs round
        every matmul output and every activation to 16 bits, in a different order per
        layout, so they agree to about 1e-2 relative on losses, and to a few 1e-3 on
        gradients; parameters (fp32 masters) move by lr-sized Adam steps whose sign can flip
        where a gradient is near zero, so after 3 steps at the miniature's lr of 1e-2 an
        element may differ by up to 3e-2: 4e-2 on parameters (measured: 2.7e-2 at
        dp 2 x tp 2 x pp 2). See :data:`BF16_TOLERANCES`.

        ``fp8`` (``train.precision = fp8``, runtime/model/fp8.py): the run and the reference cast the
        same tensors with the same scales (a tp-sharded tensor's amax is all-reduced over tp,
        so its scale is the whole tensor's; the micro-batches are the same). What differs is
        the summation order of a tp-split GEMM's partial sums (and of dp's gradient sums), at
        fp32 rounding level; an element that sits that close to an E4M3 rounding boundary (3
        mantissa bits) rounds to the other neighbour, a jump of 2^-4 to 2^-3 of its value,
        where bf16 moves every element by up to 2^-8. Such flips are rare (a rounding-level
        difference over an E4M3 step: about 1e-7 / 2^-4 per element) but each moves its
        products by a few %: measured at fp32, dp 2 x tp 2 x pp 2 zero 1, 8.1e-4 on losses
        (1.5e-4 relative) and 5.5e-5 on the first step's gradients, and in a run without a
        flip 2.9e-6 and 1.8e-8. What the tolerances must still catch besides a wrong layout
        (which moves gradients by their own size): a scale taken on a tp shard instead of the
        whole tensor (every element of that tensor re-rounded, 2^-4 relative noise), measured
        at the same layout as 1.3e-2 on losses and 9.9e-4 on the first step's gradients. So
        :data:`FP8_TOLERANCES`: losses 4e-3 (5x the flip, 3x under the shard scale),
        gradients 2.5e-4 (4.5x the flip, 4x under the shard scale). Parameters: from the
        second step the weights differ at rounding level, and through Adam a gradient element
        that is a cancellation of flipped terms can change sign and move its weight by up to
        2 lr per step, as under bf16: 4e-2 + 2e-2 |ref| (3 steps at lr 1e-2; measured 1.8e-2).

        ``mxfp8`` takes the same tolerances by the same argument: its block scales are local
        (no amax crosses a rank), and the miniature's tp-local reduction dimensions hold whole
        32-element blocks (:func:`_mini_head_dim`), so run and reference cast the same blocks
        with the same scales and differ by summation order only, where an E4M3 flip (or a
        block amax crossing a power of two, which rescales its 32 elements by 2) is as rare
        as above. Measured at fp32, dp 2 x tp 2 zero 1 with sequence parallelism: 2.8e-5 on
        losses, 1.5e-8 on the first step's gradients. What they must catch: blocks cut at
        other boundaries than the reference's (a tp shard whose local reduction is not a
        multiple of 32; stood in for by 16-element blocks in the run,
        tests/test_verify.py): 8.1e-3 on losses (2x the tolerance) and 3.4e-3 on gradients
        (13x)."""
        if fp8:
            return FP8_TOLERANCES if dtype == "fp32" else BF16_TOLERANCES
        return cls() if dtype == "fp32" else BF16_TOLERANCES


BF16_TOLERANCES = Tolerances(loss_atol=2e-2, loss_rtol=1e-2, grad_atol=2e-3, grad_rtol=5e-2,
                             param_atol=4e-2, param_rtol=2e-2)
#: FP8 GEMMs in an fp32 miniature (Tolerances.for_dtype; a 16-bit one keeps BF16_TOLERANCES,
#: whose rounding of every element is already wider)
FP8_TOLERANCES = Tolerances(loss_atol=4e-3, loss_rtol=0.0, grad_atol=2.5e-4, grad_rtol=0.0,
                            param_atol=4e-2, param_rtol=2e-2)


@dataclass
class Check:
    """One row of the verify table."""

    what: str
    max_abs: float
    tol: float
    ok: bool
    detail: str = ""
    rtol: float = 0.0


@dataclass
class VerifyResult:
    """All checks of one verify run; ``ok`` when every check passed. ``plan`` is the
    miniature's plan.json and ``records`` the run's per-rank records (rank order)."""

    checks: list[Check] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    ref_losses: list[float] = field(default_factory=list)
    mini: SpecConfig | None = None
    plan: dict = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)
    #: a serve miniature's greedy tokens per sequence, and the reference's
    tokens: list[list[int]] = field(default_factory=list)
    ref_tokens: list[list[int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def table(self) -> str:
        """A fixed-width table of the checks, worst first within each kind."""
        rows = [("check", "max |diff|", "tolerance", "result")]
        for c in self.checks:
            tol = "exact" if not c.tol else f"{c.tol:.0e}" + (f" + {c.rtol:.0e}|ref|" if c.rtol else "")
            rows.append((c.what, f"{c.max_abs:.3e}", tol,
                         ("ok" if c.ok else "MISMATCH") + (f"  {c.detail}" if c.detail else "")))
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join(f"{r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}  {r[3]}" for r in rows)


def serve_prompts(plan: dict) -> list[list[int]]:
    """The serve miniature's prompts, from its plan.json: ``serve.batch`` sequences of token
    ids drawn from seed 0 below the vocabulary, even ones ``serve.prompt_len`` long and odd
    ones 2 shorter (left padding in every replica, whose longest prompt sizes the cache as
    the plan does)."""
    sv, vocab = plan["serve"], plan["model"]["vocab"]
    g = torch.Generator().manual_seed(0)
    lens = [sv["prompt_len"] - (2 if b % 2 else 0) for b in range(sv["batch"])]
    return [torch.randint(0, vocab, (max(n, 1),), generator=g).tolist() for n in lens]


def _emit(cfg: SpecConfig, out: Path) -> dict:
    from parcompile.codegen.emit import program_name, render_program, render_serve, write_files
    from parcompile.driver import compile_config

    plan = compile_config(cfg)
    render = render_serve if cfg.workload == "serve" else render_program
    write_files(out, {"plan.json": plan.to_json(), program_name(cfg): render(cfg, plan, out)})
    return plan.data


def _run_reference(out: Path, metrics: Path, steps: int) -> None:
    """Run the reference program in ``out`` in this process (no torchrun, world of one),
    its records written to ``metrics``; on one intra-op thread, as :func:`_torchrun` runs
    each rank (a miniature's matrices are far too small to gain from threads, and on a busy
    machine spinning threads made a serve reference 10x slower)."""
    job = _job(out, steps, metrics)
    spec = importlib.util.spec_from_file_location("parcompile_reference_program", job["program"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if k in os.environ}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the reference's step log is not the user's
            module.main(["--plan", str(out / "plan.json"), *job["argv"]])
    finally:
        torch.set_num_threads(threads)
        os.environ.update(saved)


def _torchrun(world: int, args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node world ARGS`` on this machine's CPUs (gloo,
    one thread per rank); its output captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PARCOMPILE_DEVICE="cpu")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)


def _run_torchrun(out: Path, metrics: Path, world: int, steps: int, timeout_s: float, log) -> None:
    job = _job(out, steps, metrics)
    proc = _torchrun(world, [job["program"], *job["argv"]], timeout_s)
    if log:
        log(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited with {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


def load_global(metrics: Path, kind: str) -> dict[str, list[torch.Tensor]]:
    """Reassemble global tensors from ``rank*.pt`` shards: global name -> one tensor per
    holder (a tied LM head copy is a second holder of ``embedding.weight``)."""
    parts: dict[tuple[str, str], list[dict]] = {}
    for f in sorted(metrics.glob("rank*.pt")):
        state = torch.load(f, weights_only=True)   # tensors, numbers and names only: never unpickle code
        for name, e in state.get(kind, {}).items():
            parts.setdefault((e["global_name"], name), []).append(e)
    out: dict[str, list[torch.Tensor]] = {}
    for (gname, _), es in sorted(parts.items()):
        es.sort(key=lambda e: e["tp_index"])
        es = [e for k, e in enumerate(es) if k == 0 or e["tp_index"] != es[k - 1]["tp_index"]]  # replicas: once
        if es[0]["shard_dim"] is None:
            t = es[0]["tensor"]
        else:
            t = torch.cat([e["tensor"] for e in es], dim=es[0]["shard_dim"])
        out.setdefault(gname, []).append(t)
    return out


def _compare_tensors(what: str, ref: dict, got: dict, vocab: int, atol: float, rtol: float) -> list[Check]:
    checks = []
    worst, worst_name, bad = 0.0, "", []
    for name, (r,) in ref.items():
        if name not in got:
            bad.append(f"{name} missing")
            continue
        for g in got[name]:
            a, b = r, g
            if name in ("embedding.weight", "lm_head.weight"):
                if b[vocab:].abs().max().item() if b.shape[0] > vocab else 0.0:
                    bad.append(f"{name}: padded vocabulary rows are not zero")
                a, b = a[:vocab], b[:vocab]
            if a.shape != b.shape:
                bad.append(f"{name}: shape {tuple(b.shape)} != reference {tuple(a.shape)}")
                continue
            d = (a - b).abs()
            excess = (d - (atol + rtol * a.abs())).max().item()
            if d.max().item() > worst:
                worst, worst_name = d.max().item(), name
            if excess > 0:
                bad.append(name)
    extra = sorted(set(got) - set(ref))
    bad += [f"{n} not in reference" for n in extra]
    checks.append(Check(f"{what} ({len(ref)} tensors)", worst, atol, not bad,
                        ("worst " + worst_name) if not bad else "; ".join(bad[:4]), rtol))
    return checks


def compare(ref_dir: Path, run_dir: Path, plan: dict, mini: SpecConfig, tol: Tolerances) -> VerifyResult:
    """Compare a run's metrics directory with the reference's (see module docstring); a
    serve miniature's with :func:`compare_serve`."""
    if mini.workload == "serve":
        return compare_serve(ref_dir, run_dir, plan, mini, tol)
    ref_rec = json.loads((ref_dir / "rank0.json").read_text())
    recs = [json.loads(f.read_text()) for f in sorted(run_dir.glob("rank*.json"), key=lambda f: int(f.stem[4:]))]
    res = VerifyResult(mini=mini, plan=plan, records=recs)
    speakers = [r for r in recs if r["losses"] and r["losses"][0] is not None]
    res.ref_losses = ref_rec["losses"]
    res.losses = speakers[0]["losses"] if speakers else []
    if len(res.losses) != len(res.ref_losses):
        res.checks.append(Check("loss per step", math.inf, tol.loss_atol, False,
                                f"{len(res.losses)} losses vs {len(res.ref_losses)} in the reference"))
    else:
        diffs = [abs(a - b) for a, b in zip(res.losses, res.ref_losses)]
        ok = all(d <= tol.loss_atol + tol.loss_rtol * abs(b) for d, b in zip(diffs, res.ref_losses))
        res.checks.append(Check(f"loss, {len(diffs)} steps", max(diffs, default=0.0), tol.loss_atol, ok,
                                rtol=tol.loss_rtol))
    if res.ref_losses and all(x == 0 for x in res.ref_losses):   # every target masked: nothing compared
        res.checks.append(Check("unmasked targets in the miniature's samples", 0.0, 0.0, False,
                                "every target is masked (prompts longer than the miniature's seq_len?)"))
    vocab = mini.model.vocab
    res.checks += _compare_tensors("gradients, step 1", load_global(ref_dir, "grads"), load_global(run_dir, "grads"),
                                   vocab, tol.grad_atol, tol.grad_rtol)
    res.checks += _compare_tensors(f"parameters, step {len(res.ref_losses)}", load_global(ref_dir, "params"),
                                   load_global(run_dir, "params"), vocab, tol.param_atol, tol.param_rtol)
    res.checks += compare_with_plan(recs, plan)
    act = compare_activations(recs, plan, mini)
    if act is not None:
        res.checks.append(act)
    return res


def _rank_records(metrics: Path) -> list[dict]:
    """The ``rank<r>.json`` records of a run, in rank order."""
    return [json.loads(f.read_text()) for f in sorted(metrics.glob("rank*.json"), key=lambda f: int(f.stem[4:]))]


def serve_outputs(records: list[dict], metrics: Path) -> tuple[list[list[int]], torch.Tensor | None]:
    """A serve run's greedy tokens and logits, replica after replica (each replica's last
    stage, tp rank 0; its ``rank<r>.pt``): ``(tokens per sequence, logits (steps, B, vocab))``,
    logits None when not recorded."""
    last = max(r["stage"] for r in records)
    speakers = sorted((r for r in records if r["stage"] == last and r["tp_index"] == 0), key=lambda r: r["dp_index"])
    tokens = [t for r in speakers for t in r["tokens"]]
    parts = [metrics / f"rank{r['rank']}.pt" for r in speakers]
    if not parts or not all(f.is_file() for f in parts):
        return tokens, None
    return tokens, torch.cat([torch.load(f, weights_only=True)["logits"] for f in parts], dim=1)


def compare_serve(ref_dir: Path, run_dir: Path, plan: dict, mini: SpecConfig, tol: Tolerances) -> VerifyResult:
    """A serve miniature's run against its one-process reference (the same prompts, greedy):

    - the new tokens of every sequence, exactly;
    - the prefill's logits (the last prompt position's, which pick the first token) and each
      decode step's, within ``tol.logits_atol + tol.logits_rtol * |ref|`` (decode steps
      compared only when the tokens agree: they are their inputs);
    - the KV cache bytes each rank allocated, exactly the plan's
      ``memory.per_stage[s].kv_cache`` (:mod:`parcompile.analysis.kv`: the replica's
      sequences x the cached tokens x ``serve.kv_bytes_per_token_per_stage[s]``);
    - the parameters each rank holds, the plan's ``params_per_rank``.
    """
    recs = _rank_records(run_dir)
    ref_tokens, ref_logits = serve_outputs(_rank_records(ref_dir), ref_dir)
    tokens, logits = serve_outputs(recs, run_dir)
    res = VerifyResult(mini=mini, plan=plan, records=recs)
    res.tokens, res.ref_tokens = tokens, ref_tokens
    n_seq, n_new = len(ref_tokens), max((len(t) for t in ref_tokens), default=0)
    wrong = [(b, next((i for i, (x, y) in enumerate(zip(a, r)) if x != y), min(len(a), len(r))))
             for b, (a, r) in enumerate(zip(tokens, ref_tokens)) if a != r]
    differing = sum(x != y for a, r in zip(tokens, ref_tokens) for x, y in zip(a, r)) \
        + sum(abs(len(a) - len(r)) for a, r in zip(tokens, ref_tokens)) + abs(len(tokens) - len(ref_tokens)) * n_new
    detail = "; ".join(f"sequence {b} from new token {i}: {tokens[b][i:i + 4]} vs reference {ref_tokens[b][i:i + 4]}"
                       for b, i in wrong[:2])
    if len(tokens) != len(ref_tokens):
        detail = f"{len(tokens)} sequences vs {len(ref_tokens)} in the reference"
    res.checks.append(Check(f"greedy tokens ({n_seq} sequences x {n_new} new; differing)", float(differing), 0.0,
                            not differing and bool(ref_tokens), detail))
    for what, rows in (("prefill logits", slice(0, 1)), ("decode logits", slice(1, None))):
        if logits is None or ref_logits is None:
            res.checks.append(Check(what, math.inf, tol.logits_atol, False, "no logits recorded", tol.logits_rtol))
            continue
        a, b = logits[rows], ref_logits[rows]
        if a.shape != b.shape:
            res.checks.append(Check(what, math.inf, tol.logits_atol, False,
                                    f"shape {tuple(a.shape)} != reference {tuple(b.shape)}", tol.logits_rtol))
            continue
        if what == "decode logits" and differing:
            res.checks.append(Check(what, math.inf, tol.logits_atol, False, "not compared: the tokens differ",
                                    tol.logits_rtol))
            continue
        d = (a - b).abs()
        ok = bool((d <= tol.logits_atol + tol.logits_rtol * b.abs()).all())
        shape = " x ".join(map(str, (a.shape[1], a.shape[2]) if what == "prefill logits" else tuple(a.shape)))
        res.checks.append(Check(f"{what} ({shape})", d.max().item() if d.numel() else 0.0, tol.logits_atol, ok,
                                f"max |ref| {b.abs().max().item():.2e}", tol.logits_rtol))
    res.checks.append(kv_cache_check(recs, plan))
    res.checks.append(params_check(recs, plan))
    return res


def kv_cache_check(records: list[dict], plan: dict) -> Check:
    """The KV cache bytes each rank of a serve run allocated (``cache_bytes``) against the
    plan's ``memory.per_stage[stage].kv_cache``, exactly; max |diff| in bytes. The detail
    shows the plan's figure per stage as ``sequences x tokens x kv_bytes_per_token`` (less
    where sliding-window layers keep only their window)."""
    sv = plan["serve"]
    b, tokens = sv["batch_per_replica"], sv["prompt_len"] + sv["max_new_tokens"]
    worst, bad, shown = 0, [], {}
    for r in records:
        want = plan["memory"]["per_stage"][r["stage"]]["kv_cache"]
        got = r.get("cache_bytes", 0)
        worst = max(worst, abs(got - want))
        if got != want:
            bad.append(f"rank {r['rank']}: {got:,} B != plan {want:,} B")
        per_token = sv["kv_bytes_per_token_per_stage"][r["stage"]]
        full = b * tokens * per_token
        formula = f"{b} seq x {tokens} tok x {per_token:,} B/tok" + (
            "" if want == full else f" ({full:,} B) less what sliding windows drop")
        shown.setdefault(r["stage"], f"stage {r['stage']}: plan {want:,} B = {formula}")
    measured = sorted({r.get("cache_bytes", 0) for r in records})
    detail = "; ".join(bad[:2]) if bad else (
        "; ".join(shown[s] for s in sorted(shown)) + f"; measured {', '.join(f'{x:,}' for x in measured)} B")
    return Check(f"KV cache bytes per rank ({len(records)} ranks)", float(worst), 0.0, not bad, detail)


#: measured bytes saved for backward per layer may differ from the plan's by this fraction
#: (the plan leaves out the norms' fp32 statistics, 4-8 bytes per token and norm)
ACTIVATION_RTOL = 0.05


def activation_check_gap(cfg: SpecConfig) -> str | None:
    """Why the saved-activation bytes of ``cfg``'s program are not held to the plan's
    within :data:`ACTIVATION_RTOL` (None: they are)."""
    m = cfg.model
    if m.experts and cfg.parallel.ep > 1:
        return ("MoE layers with ep > 1: the rows each rank's experts receive follow the router "
                "(the plan assumes balanced routing)")
    return None


def compare_activations(records: list[dict], plan: dict, cfg: SpecConfig) -> Check | None:
    """Bytes each rank saved for backward per decoder layer (one micro-batch, measured with
    saved-tensor hooks; :mod:`parcompile.runtime.machine.memory`) against the plan's
    ``activations_per_layer``: relative difference within :data:`ACTIVATION_RTOL`.
    Returns None for a program without measurements; a passing informational row where
    :func:`activation_check_gap` names a known difference."""
    worst, bad, n = 0.0, [], 0
    for r in records:
        got = r.get("saved_per_layer")
        if got is None:
            return None
        for layer, want in plan["memory"]["per_stage"][r["stage"]].get("activations_per_layer", []):
            g = got.get(str(layer))
            n += 1
            dev = math.inf if g is None else abs(g - want) / max(want, 1)
            worst = max(worst, dev)
            if dev > ACTIVATION_RTOL:
                bad.append(f"rank {r['rank']} layer {layer}: {g} B measured, {want} B planned")
    gap = activation_check_gap(cfg)
    what = f"saved activations per layer, relative ({n} layer-ranks)"
    if gap:
        return Check(what, worst, ACTIVATION_RTOL, True, f"not checked: {gap}")
    return Check(what, worst, ACTIVATION_RTOL, not bad, "; ".join(bad[:2]))


def routed_collectives(plan: dict, stage: int) -> dict[tuple[str, str], dict]:
    """The plan's MoE token collectives of one rank of ``stage`` (entries marked ``routed``),
    by (op, axis): ``count`` per step, ``bytes_per_row`` and the ``balanced`` bytes per step."""
    out: dict[tuple[str, str], dict] = {}
    for c in plan["comm"]["collectives"]:
        if c.get("stage", stage) != stage or not c.get("routed") or c["count"] == 0:
            continue
        e = out.setdefault((c["op"], c["axis"]), {"count": 0, "bytes_per_row": c["bytes_per_row"], "balanced": 0})
        assert e["bytes_per_row"] == c["bytes_per_row"], (c, e)
        e["count"] += int(c["count"])
        e["balanced"] += int(c["count"]) * int(c["bytes"])
    return out


def check_routed(records: list[dict], plan: dict) -> tuple[list[str], Check | None]:
    """MoE token traffic, whose size the router decides (docs/internals.md):

    - per rank: the runtime records each such collective with the ``rows`` it produced;
      each must be ``rows * bytes_per_row`` of the plan (the plan's formula at the tokens
      the router actually sent), and their number per (op, axis) the plan's count;
    - per stage: the bytes summed over the stage's ranks equal the plan's balanced estimate
      summed over them (every row sent is received once: balance holds on average).

    Returns the per-rank mismatches, and one Check showing the balanced estimate and the
    measured bytes per rank (None when the plan has no MoE traffic).
    """
    bad: list[str] = []
    per_stage: dict[tuple[int, str, str], list] = {}
    for r in records:
        plan_r = routed_collectives(plan, r["stage"])
        got: dict[tuple[str, str], list[int]] = {}
        for c in r["comm"]:
            if "rows" not in c:
                continue
            key = (c["op"], c["axis"])
            want = plan_r.get(key)
            if want is None:
                bad.append(f"rank {r['rank']}: {c['op']} {c['axis']} of {c['rows']} routed rows, not in the plan")
                continue
            if c["bytes"] != c["rows"] * want["bytes_per_row"]:
                bad.append(f"rank {r['rank']}: {c['op']} {c['axis']} {c['bytes']} B for {c['rows']} rows "
                           f"!= {c['rows']} x {want['bytes_per_row']} B")
            got.setdefault(key, []).extend([c["bytes"]] * c["count"])
        for key, want in plan_r.items():
            calls = got.get(key, [])
            if len(calls) != want["count"]:
                bad.append(f"rank {r['rank']}: {len(calls)} routed {key[0]} over {key[1]}, plan {want['count']}")
            acc = per_stage.setdefault((r["stage"], *key), [0, 0, []])
            acc[0] += want["balanced"]
            acc[1] += sum(calls)
            acc[2].append(sum(calls))
    if not per_stage:
        return bad, None
    shown, sums_bad = [], []
    for (stage, op, axis), (balanced, measured, ranks) in sorted(per_stage.items()):
        per_rank = balanced // len(ranks)
        shown.append(f"stage {stage} {op} {axis}: plan (balanced) {per_rank:,} B/rank, "
                     f"measured {min(ranks):,}..{max(ranks):,} B/rank")
        if balanced != measured:
            sums_bad.append(f"stage {stage} {op} {axis}: {measured:,} B over the ranks != plan {balanced:,} B")
    return bad, Check("MoE routed bytes: sum over ranks = plan's balanced sum", 0.0 if not sums_bad else math.inf,
                      0.0, not sums_bad, "; ".join(sums_bad[:2] or shown))


def predicted_collectives(plan: dict, stage: int, routed: bool = True) -> dict[tuple[str, str, int], int]:
    """The plan's collectives for one rank of ``stage``: (op, axis, bytes) -> count per step
    (``routed=False``: without the MoE token traffic sized by the router), at the size the
    generated program moves (``program_bytes`` where the plan lists it: FP8 tp all-gathers
    the program runs in 16 bits)."""
    out: dict[tuple[str, str, int], int] = {}
    for c in plan["comm"]["collectives"]:
        if c.get("stage", stage) != stage or c["count"] == 0 or (c.get("routed") and not routed):
            continue
        key = (c["op"], c["axis"], int(c.get("program_bytes") or c["bytes"]))
        out[key] = out.get(key, 0) + int(c["count"])
    return out


def _buffer_check(records: list[dict], plan: dict, key: str, part: str | tuple[str, ...], what: str) -> Check | None:
    """The bytes each rank recorded under ``key`` against its stage's plan buffer
    ``buffer_parts[part]`` (the sum of the parts, for a tuple), exactly; None when no rank
    recorded it (not that kind of program)."""
    parts = (part,) if isinstance(part, str) else part
    measured = [r for r in records if key in r]
    bad = [f"rank {r['rank']}: {r[key]:,} B != plan {want:,} B"
           for r in measured
           for want in [sum(plan["memory"]["per_stage"][r["stage"]]["buffer_parts"].get(k, 0) for k in parts)]
           if r[key] != want]
    if not measured:
        return None
    return Check(f"{what} ({len(measured)} ranks)", 0.0 if not bad else math.inf, 0.0, not bad, "; ".join(bad[:2]))


def params_check(records: list[dict], plan: dict) -> Check:
    """The parameters each rank holds (``params``) against its stage's ``params_per_rank``."""
    bad = [f"rank {r['rank']}: {r['params']} != plan {want}" for r in records
           for want in [plan["stages"][r["stage"]]["params_per_rank"]] if r["params"] != want]
    return Check(f"parameters per rank ({len(records)} ranks)", 0.0 if not bad else math.inf, 0.0, not bad,
                 "; ".join(bad[:3]))


def compare_with_plan(records: list[dict], plan: dict) -> list[Check]:
    """Measured parameters per rank, the bytes of parameters, gradients and optimizer
    states each rank holds between steps, collectives per step, the executed pipeline
    actions, under ZeRO 2 and 3 the most full gradient buffers held at once during the step
    (the plan's ``grad_buckets_in_flight``, or ``full_grads`` when reduced once per step) and under ZeRO-3 the most gathered parameter bytes held at once (the
    plan's ``zero3_gather`` buffer), against the plan."""
    bad_comm = []
    for r in records:
        stage = r["stage"]
        measured: dict[tuple[str, str, int], int] = {}
        for c in r["comm"]:
            if "rows" not in c:   # MoE token traffic sized by the router: check_routed
                measured[(c["op"], c["axis"], c["bytes"])] = measured.get((c["op"], c["axis"], c["bytes"]), 0) + c["count"]
        predicted = predicted_collectives(plan, stage, routed=False)
        if measured != predicted:
            diff = sorted(set(measured.items()) ^ set(predicted.items()))
            bad_comm.append(f"rank {r['rank']}: " + ", ".join(
                f"{op} {axis} {b} B x{n} ({'measured' if measured.get((op, axis, b)) == n else 'planned'})"
                for (op, axis, b), n in diff[:4]))
    bad_bytes = []
    for r in records:
        want = plan["memory"]["per_stage"][r["stage"]]
        got = r.get("state_bytes") or {}
        diff = [f"{k} {got.get(k)} != plan {want[k]}" for k in ("params", "grads", "optimizer", "host")
                if k in want and got.get(k) != want[k]]   # host: parallel.offload
        if diff:
            bad_bytes.append(f"rank {r['rank']}: " + ", ".join(diff))
    bad_order = []
    for r in records:
        planned = [[a["op"], a["microbatch"], a["chunk"]] for a in plan["schedule"]["actions"][r["stage"]]]
        ran = [list(a) for a in r.get("actions", [])]
        if ran != planned:
            first = next((i for i, (x, y) in enumerate(zip(ran, planned)) if x != y), min(len(ran), len(planned)))
            bad_order.append(f"rank {r['rank']}: action {first} ran {ran[first:first + 1]} "
                             f"where the plan has {planned[first:first + 1]}")
    # ZeRO 2, 3: full gradient buffers during the step; ZeRO-3: gathered parameters at once
    full_check = _buffer_check(records, plan, "grad_buckets_in_flight", ("grad_buckets_in_flight", "full_grads"),
                               "full gradient buffers at most at once during the step")
    gather_check = _buffer_check(records, plan, "zero3_gathered", "zero3_gather",
                                 "ZeRO-3 gathered parameters at most at once")
    routed_bad, routed_check = check_routed(records, plan)
    bad_comm += routed_bad
    total_calls = sum(c["count"] for r in records for c in r["comm"])
    return [c for c in [routed_check, gather_check, full_check] if c is not None] + [
        params_check(records, plan),
        Check(f"collectives per step ({total_calls} calls)", 0.0 if not bad_comm else math.inf, 0.0,
              not bad_comm, "; ".join(bad_comm[:2])),
        Check("parameter, gradient, optimizer (and host) bytes per rank", 0.0 if not bad_bytes else math.inf, 0.0,
              not bad_bytes, "; ".join(bad_bytes[:2])),
        Check(f"pipeline actions as planned ({sum(len(r.get('actions', [])) for r in records)})",
              0.0 if not bad_order else math.inf, 0.0, not bad_order, "; ".join(bad_order[:2])),
    ]


def measure(cfg: SpecConfig, workdir: str | os.PathLike, steps: int = 1, timeout_s: float = 900.0,
            log=None) -> tuple[dict, list[dict]]:
    """Compile ``cfg`` as it is (no miniature), run its program for ``steps`` steps under
    torchrun on this machine and return ``(plan.json dict, per-rank records)``: each record
    holds the measured ``state_bytes`` (parameters, gradients, optimizer states),
    ``saved_per_layer`` (bytes saved for backward per layer, one micro-batch), the
    collectives of one step and, on an accelerator, ``allocator_peak`` (its caching allocator's peaks).

    Raises:
        RuntimeError: the torchrun job failed (its output is in the message).
    """
    out = Path(workdir)
    plan = _emit(cfg, out)
    _run_torchrun(out, out / "metrics", cfg.parallel.world_size, steps, timeout_s, log)
    recs = [json.loads(f.read_text()) for f in sorted((out / "metrics").glob("rank*.json"),
                                                      key=lambda f: int(f.stem[4:]))]
    return plan, recs


def _prepare(cfg: SpecConfig, steps: int, dtype: str, root: Path) -> tuple[SpecConfig, dict]:
    """Check ``cfg`` can be verified, emit its miniature under ``root/mini`` and the
    reference under ``root/reference``, and run the reference in this process.

    Returns ``(miniature, its plan.json dict)``.

    Raises:
        SpecError: as :func:`verify`.
    """
    from parcompile.codegen.emit import program_gaps

    gaps = program_gaps(cfg, "error")
    if gaps:
        raise SpecError(gaps)
    mini = serve_miniature(cfg, dtype) if cfg.workload == "serve" else miniature(cfg, steps, dtype)
    _emit(reference(mini), root / "reference")
    plan = _emit(mini, root / "mini")
    _run_reference(root / "reference", root / "reference" / "metrics", steps)
    return mini, plan


def _job(out: Path, steps: int, metrics: Path | None = None) -> dict:
    """How to run the program generated in ``out`` for verify: ``{"program": path, "argv":
    [...]}``, its records written to ``metrics`` (default ``out/metrics``); a training
    program for ``steps`` steps, a serve program on :func:`serve_prompts` with its logits
    recorded."""
    metrics = out / "metrics" if metrics is None else metrics
    if (out / "serve.py").is_file():
        prompts = serve_prompts(json.loads((out / "plan.json").read_text()))
        return {"program": str(out / "serve.py"),
                "argv": ["--out", str(metrics), "--record-logits", "--temperature", "0",
                         *[a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]]}
    return {"program": str(out / "program.py"),
            "argv": ["--metrics-dir", str(metrics), "--steps", str(steps), "--checkpoint-dir", ""]}


def verify(cfg: SpecConfig, steps: int = 3, workdir: str | os.PathLike | None = None,
           tol: Tolerances | None = None, timeout_s: float = 900.0, log=None, dtype: str = "fp32") -> VerifyResult:
    """Build the miniature of ``cfg``, run it under torchrun and in-process, compare.

    A `serve` spec runs its serve miniature (:func:`serve_miniature`; ``steps`` unused).

    Raises:
        SpecError: the spec cannot be verified here (too many ranks, a feature the
            generated program does not run yet, a serve spec in 16-bit).
        RuntimeError: the torchrun job failed (its output is in the message).
    """
    tol = tol or Tolerances.for_dtype(dtype, fp8_enabled(cfg))
    with tempfile.TemporaryDirectory(prefix="parcompile-verify-", dir=workdir) as tmp:
        root = Path(tmp)
        mini, plan = _prepare(cfg, steps, dtype, root)
        _run_torchrun(root / "mini", root / "mini" / "metrics", mini.parallel.world_size, steps, timeout_s, log)
        return compare(root / "reference" / "metrics", root / "mini" / "metrics", plan, mini, tol)


def verify_many(cfgs: dict[Hashable, SpecConfig], steps: int = 3, workdir: str | os.PathLike | None = None,
                tols: dict[Hashable, Tolerances] | None = None, dtypes: dict[Hashable, str] | None = None,
                timeout_s: float = 900.0, edits: dict[Hashable, Callable[[Path], None]] | None = None,
                ) -> dict[Hashable, VerifyResult | Exception]:
    """:func:`verify` for many specs with one torchrun launch per world size.

    Each miniature and its reference are built as :func:`verify` builds them; the
    miniatures of one world size run one after another in one launch
    (:mod:`parcompile.runtime.distributed.batch`), which saves a process start and a torch import per
    layout. A layout whose run fails gets its ``RuntimeError`` (the launch's output) as its
    result; the layouts after it in that launch are run again in a new launch, so one
    failure does not hide the others. Training and serve miniatures of one world size share
    a launch. ``edits``: name -> a function given the miniature's program directory after it
    is generated, before it runs (tests corrupt a program or plan to show verify catches it).

    Returns: name -> :class:`VerifyResult`, or the exception (``SpecError``,
    ``RuntimeError``) that layout raised.
    """
    dtypes = dtypes or {}
    tols = tols or {}
    results: dict[Hashable, VerifyResult | Exception] = {}
    with tempfile.TemporaryDirectory(prefix="parcompile-verify-", dir=workdir) as tmp:
        ready: dict[int, list[tuple[Hashable, Path, SpecConfig, dict]]] = {}
        for i, (name, cfg) in enumerate(cfgs.items()):
            root = Path(tmp) / f"{i:03d}"
            try:
                mini, plan = _prepare(cfg, steps, dtypes.get(name, "fp32"), root)
            except (SpecError, RuntimeError) as e:
                results[name] = e
                continue
            if name in (edits or {}):
                edits[name](root / "mini")
                plan = json.loads((root / "mini" / "plan.json").read_text())
            ready.setdefault(mini.parallel.world_size, []).append((name, root, mini, plan))
        for world, todo in sorted(ready.items()):
            failures = run_batched([root / "mini" for _, root, _, _ in todo], world, steps, timeout_s, Path(tmp))
            for (name, root, mini, plan), failure in zip(todo, failures):
                try:
                    results[name] = failure or compare(
                        root / "reference" / "metrics", root / "mini" / "metrics", plan, mini,
                        tols.get(name) or Tolerances.for_dtype(dtypes.get(name, "fp32"), fp8_enabled(mini)))
                except (OSError, ValueError, KeyError) as e:   # a run that wrote incomplete metrics
                    results[name] = RuntimeError(f"comparing {name}: {e!r}")
    return {name: results[name] for name in cfgs}


def run_batched(outs: list[Path], world: int, steps: int, timeout_s: float, tmp: Path) -> list[RuntimeError | None]:
    """Run the generated programs in the directories ``outs`` (plans of world size
    ``world``; metrics go to ``out/metrics``) in as few torchrun launches as they allow:
    one, unless a program fails; then the programs after it run in the next launch.

    Returns one entry per program: ``None`` when it completed, else the ``RuntimeError``
    holding its launch's output."""
    failures: list[RuntimeError | None] = [None] * len(outs)
    first, launch = 0, 0
    while first < len(outs):
        done, failure = _run_batch(outs[first:], world, steps, timeout_s, tmp / f"jobs_{world}_{launch}.json")
        launch += 1
        if failure is None or first + done >= len(outs):
            break
        failures[first + done] = failure
        first += done + 1
    return failures


def _run_batch(outs: list[Path], world: int, steps: int, timeout_s: float,
               jobs_file: Path) -> tuple[int, RuntimeError | None]:
    """One torchrun launch of the programs in ``outs`` (:mod:`parcompile.runtime.distributed.batch`).

    Returns ``(how many completed, the failure of the next one or None)``."""
    jobs_file.write_text(json.dumps([_job(out, steps) for out in outs]))
    try:
        proc = _torchrun(world, ["-m", "parcompile.runtime.distributed.batch", str(jobs_file)], timeout_s * len(outs))
        code, output = proc.returncode, proc.stdout[-4000:] + "\n" + proc.stderr[-4000:]
    except subprocess.TimeoutExpired as e:
        code, output = "a timeout", str(e)
    done_file = jobs_file.with_name(jobs_file.name + ".done")
    done = int(done_file.read_text()) if done_file.exists() else 0
    if code == 0 and done == len(outs):
        return done, None
    return done, RuntimeError(f"torchrun exited with {code} running {outs[min(done, len(outs) - 1)]}:\n{output}")
