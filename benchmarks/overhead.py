"""The generated program's overhead at world 1 against a plain PyTorch loop (issue 15).

A world-1 ``cpu`` spec (Llama-shaped: RMSNorm, RoPE, SwiGLU, untied head, fp32) is compiled
and its ``program.py`` imported in-process; its ``main()`` trains for ``--steps`` steps
while the start of every step is timed (the program resets its collective counter once
per step, first thing). A plain PyTorch model of the same architecture (``nn.Linear``,
``nn.RMSNorm``, ``F.scaled_dot_product_attention``, ``F.cross_entropy``,
``torch.optim.AdamW(foreach=True)``, ``torch.nn.utils.clip_grad_norm_``) starts from the
program's initial weights (the same global initialisation, copied) and trains on the same
batches with the same learning rate schedule. Runs alternate (program, plain) ``--repeats``
times; the first ``--warmup`` steps of each run are dropped.

It prints the median step times and their ratio (the target is <= 1.05), and checks that
the two loss curves agree (so both did the same work); ``--profile`` adds a
``torch.profiler`` table of self CPU time per op and step, the program's next to the
plain loop's, largest differences first.

Run: ``python benchmarks/overhead.py [--threads 1] [--steps 12] [--repeats 3] [--clock cpu] [--profile]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from _program import build as build_program

SPEC = """
model bench {{
    layers     = {layers}
    hidden     = {hidden}
    heads      = {heads}
    kv_heads   = {kv_heads}
    ffn_hidden = {ffn}
    vocab      = {vocab}
    seq_len    = {seq}
    dtype      = fp32
    norm       = rmsnorm
    activation = swiglu
    position   = rope
}}

cluster local from "cpu" {{
    nodes         = 1
    gpus_per_node = 1
}}

parallel {{
    dp = 1
    tp = 1
    pp = 1
    micro_batch  = {batch}
    global_batch = {batch}
}}

train {{
    optimizer = adamw
    lr        = 1e-3
    steps     = {steps}
    seed      = 1
    data      = "synthetic"
    log_every = 100000
}}
"""


def build(args, out: Path):
    """Compile the spec, write plan.json and program.py into ``out``, import the program.

    Returns (module, plan dict)."""
    text = SPEC.format(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                       ffn=args.ffn, vocab=args.vocab, seq=args.seq, batch=args.batch, steps=args.steps)
    _, plan, module = build_program(text, out, "overhead")
    return module, plan


# ---- the plain PyTorch model ------------------------------------------------------------

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PlainAttention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.wq = nn.Linear(hidden, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads < self.heads)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class PlainMLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PlainBlock(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, ffn, eps):
        super().__init__()
        self.attn_norm = nn.RMSNorm(hidden, eps=eps)
        self.attn = PlainAttention(hidden, heads, kv_heads, head_dim)
        self.mlp_norm = nn.RMSNorm(hidden, eps=eps)
        self.mlp = PlainMLP(hidden, ffn)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class PlainLlama(nn.Module):
    """The plain model of the program module ``m``'s widths (its constants) with ``layers``
    blocks (plan.json ``model.layers``: the program holds no layer count of its own)."""

    def __init__(self, m, layers: int):
        super().__init__()
        self.vocab = m.VOCAB
        self.embedding = nn.Embedding(m.VOCAB, m.HIDDEN)
        self.layers = nn.ModuleList(PlainBlock(m.HIDDEN, m.HEADS, m.KV_HEADS, m.HEAD_DIM, m.FFN_HIDDEN, m.NORM_EPS)
                                    for _ in range(layers))
        self.final_norm = nn.RMSNorm(m.HIDDEN, eps=m.NORM_EPS)
        self.lm_head = nn.Linear(m.HIDDEN, m.VOCAB, bias=False)
        inv = 1.0 / (m.ROPE_THETA ** (torch.arange(0, m.HEAD_DIM, 2, dtype=torch.float32) / m.HEAD_DIM))
        freqs = torch.outer(torch.arange(m.SEQ_LEN, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, ids):
        x = self.embedding(ids)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.lm_head(self.final_norm(x))


def copy_weights(plain: PlainLlama, stage: nn.Module, vocab: int) -> None:
    """The program's initial weights into the plain model (padded vocabulary rows dropped)."""
    src = dict(stage.named_parameters())
    with torch.no_grad():
        for name, p in plain.named_parameters():
            w = src[name]                    # the same names: embedding, layers.{i}.attn.wq, ...  lm_head
            p.copy_(w[:vocab] if name in ("embedding.weight", "lm_head.weight") else w)
    assert len(src) == len(list(plain.parameters())), (sorted(src), [n for n, _ in plain.named_parameters()])


#: what a step is timed with: wall-clock, or this process's CPU time (``--clock cpu``: steadier
#: on a shared machine; with one thread it is the step's compute)
CLOCK = time.perf_counter


# ---- runs -------------------------------------------------------------------------------

def run_program(module, steps: int, on_step=None) -> tuple[list[float], list[float]]:
    """``module.main()`` for ``steps`` steps: (step times, losses). A step is timed from one
    collective-counter reset (the first thing a step does) to the next; the last step ends
    when ``main`` returns. ``on_step(i)`` is called as step ``i`` starts (and with ``steps``
    at the end)."""
    from parcompile import runtime as rt

    marks: list[float] = []
    original = rt.COUNTER.reset

    def mark():
        if on_step is not None:
            on_step(len(marks))
        marks.append(CLOCK())
        original()

    rt.COUNTER.reset = mark
    try:
        record = module.main(["--steps", str(steps), "--no-resume"])
    finally:
        rt.COUNTER.reset = original
    if on_step is not None:
        on_step(steps)
    marks.append(CLOCK())
    return [b - a for a, b in zip(marks, marks[1:])], list(record["losses"])


def run_plain(module, plan, steps: int, on_step=None) -> tuple[list[float], list[float]]:
    """The same training in plain PyTorch: (step times, losses); ``on_step`` as for
    :func:`run_program`."""
    from parcompile import runtime as rt

    ctx = rt.init_parallel(plan, device="cpu")
    stage = module.Stage(plan, ctx)
    model = PlainLlama(module, plan["model"]["layers"])
    copy_weights(model, stage, module.VOCAB)
    del stage
    train = module.TRAIN
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": train["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=train["lr"], betas=tuple(train["betas"]), eps=train["eps"], foreach=True)
    data = rt.training_data(module.DATA, module.DATA_FORMAT, module.VOCAB, module.SEQ_LEN, module.GLOBAL_BATCH,
                            module.SEED)           # batch(step) -> (tokens, targets with -100 where masked)
    times, losses = [], []
    for step in range(steps):
        if on_step is not None:
            on_step(step)
        t0 = CLOCK()
        tokens, targets = data.batch(step)   # targets: -100 where ignored
        x = tokens[:, :-1]
        opt.zero_grad(set_to_none=True)
        for g in opt.param_groups:
            g["lr"] = rt.lr_at(step, train)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100)
        loss.backward()
        if train["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train["grad_clip"], foreach=True)
        opt.step()
        losses.append(loss.item())
        times.append(CLOCK() - t0)
    if on_step is not None:
        on_step(steps)
    return times, losses


def profile_steps(run, steps: int, first: int) -> tuple[dict[str, float], dict[str, int]]:
    """Self CPU milliseconds and calls per step of each op over steps ``first..steps-1`` of
    ``run(steps, on_step)`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])

    def on_step(i):
        if i == first:
            prof.__enter__()
        elif i == steps:
            prof.__exit__(None, None, None)

    run(steps, on_step)
    n = steps - first
    ms, calls = {}, {}
    for e in prof.key_averages():
        ms[e.key] = ms.get(e.key, 0.0) + e.self_cpu_time_total / 1000 / n
        calls[e.key] = calls.get(e.key, 0) + e.count // n
    return ms, calls


def print_profile(module, plan, steps: int, first: int, rows: int) -> None:
    """Per op: self CPU ms per step in the program and in the plain loop, largest
    differences first."""
    pm, pc = profile_steps(lambda n, cb: run_program(module, n, cb), steps, first)
    qm, qc = profile_steps(lambda n, cb: run_plain(module, plan, n, cb), steps, first)
    keys = sorted(set(pm) | set(qm), key=lambda k: -abs(pm.get(k, 0) - qm.get(k, 0)))
    print(f"profile, steps {first}..{steps - 1}: self CPU ms per step (largest differences first)")
    print(f"{'op':58} {'program':>9} {'plain':>9} {'diff':>8} {'calls':>11}")
    print(f"{'(all ops)':58} {sum(pm.values()):9.2f} {sum(qm.values()):9.2f} "
          f"{sum(pm.values()) - sum(qm.values()):8.2f}")
    for k in keys[:rows]:
        a, b = pm.get(k, 0.0), qm.get(k, 0.0)
        print(f"{k[:58]:58} {a:9.2f} {b:9.2f} {a - b:8.2f} {pc.get(k, 0):>5}/{qc.get(k, 0):<5}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=688, help="SwiGLU inner width (Llama: about 8/3 hidden)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (one micro-batch)")
    ap.add_argument("--steps", type=int, default=12, help="steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of each run")
    ap.add_argument("--repeats", type=int, default=3, help="alternating (program, plain) runs")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--target", type=float, default=1.05, help="exit 1 when the ratio exceeds this (0: never)")
    ap.add_argument("--loss-rtol", type=float, default=2e-3, help="relative loss agreement required per step")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time steps by wall clock or by this process's CPU time (steadier on a busy machine)")
    ap.add_argument("--profile", action="store_true", help="also print a torch.profiler table of the program")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time

    with tempfile.TemporaryDirectory() as tmp:
        module, plan = build(args, Path(tmp))
        prog_t, plain_t = [], []
        prog_losses = plain_losses = None
        for _ in range(args.repeats):
            t, prog_losses = run_program(module, args.steps)
            prog_t += t[args.warmup:]
            t, plain_losses = run_plain(module, plan, args.steps)
            plain_t += t[args.warmup:]
        if args.profile:
            print_profile(module, plan, args.steps, args.warmup, 30)

    worst = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(prog_losses, plain_losses))
    print(f"model: {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, ffn {args.ffn}, "
          f"vocab {args.vocab}, seq {args.seq}, batch {args.batch}, fp32; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"losses: program {prog_losses[0]:.5f} -> {prog_losses[-1]:.5f}, plain {plain_losses[0]:.5f} -> "
          f"{plain_losses[-1]:.5f}; worst relative difference {worst:.2e}")
    mp, mq = statistics.median(prog_t), statistics.median(plain_t)
    ratio = mp / mq
    print(f"{args.clock} clock")
    print(f"{'':10} {'median s/step':>14} {'min s/step':>11} {'steps':>6}")
    print(f"{'program':10} {mp:>14.4f} {min(prog_t):>11.4f} {len(prog_t):>6}")
    print(f"{'plain':10} {mq:>14.4f} {min(plain_t):>11.4f} {len(plain_t):>6}")
    print(f"ratio program / plain: {ratio:.3f} (median), {min(prog_t) / min(plain_t):.3f} (min); target <= {args.target}")
    if worst > args.loss_rtol:
        print(f"FAIL: the losses differ by {worst:.2e} (> {args.loss_rtol}): the runs did not do the same work")
        return 2
    if args.target and ratio > args.target:
        print(f"ratio {ratio:.3f} is above the target {args.target}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
