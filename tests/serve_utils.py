"""Helpers for serve tests: tiny serve specs, generated serve programs, running them
in-process (the single-process reference) or several in one torchrun launch."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from parcompile.codegen.emit import render_serve, write_files
from parcompile.config.schema import ClusterConfig, ModelConfig, ParallelConfig, ServeConfig, SpecConfig
from parcompile.driver import compile_config

HERE = Path(__file__).resolve().parent
MULTI = HERE / "serve_multi.py"
_counter = itertools.count()


def serve_config(dp=1, tp=1, pp=1, *, model=None, serve=None, name="s", parallel=None) -> SpecConfig:
    """A small serve spec on the `cpu` cluster (world = dp * tp * pp); ``parallel``: more
    parallel keys (``ep``, ``expert_tp``)."""
    mk = dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256, seq_len=32, dtype="fp32")
    mk.update(model or {})
    sk = dict(batch=2, prompt_len=6, max_new_tokens=6, seed=3)
    sk.update(serve or {})
    world = dp * tp * pp
    return SpecConfig(name=name, model=ModelConfig(**mk),
                      cluster=ClusterConfig(name="cpu", preset="cpu", nodes=1, gpus_per_node=world),
                      parallel=ParallelConfig(dp=dp, tp=tp, pp=pp, **(parallel or {})), workload="serve", serve=ServeConfig(**sk))


def tiny_serve_spec(**serve) -> str:
    """A `serve` spec's text, for tests that need a spec file (file:line:col diagnostics,
    `parcompile serve` itself): a 2-layer Llama of hidden 64 (vocab 256, context 64, fp32) on
    one `cpu` rank, the serve block's keys ``serve`` one a line in their order from line 7
    (``    key = value``)."""
    lines = "".join(f"    {k} = {v}\n" for k, v in serve.items())
    return ("model tiny {\n"
            "    layers = 2, hidden = 64, heads = 4, kv_heads = 2, ffn_hidden = 128\n"
            "    vocab = 256, seq_len = 64, dtype = fp32\n"
            "}\n"
            'cluster local from "cpu" { gpus_per_node = 1 }\n'
            "serve {\n" + lines + "}\n")


def build_serve(cfg: SpecConfig, out: Path) -> dict:
    """Compile ``cfg`` and write plan.json and serve.py into ``out``; returns the plan dict."""
    plan = compile_config(cfg)
    write_files(out, {"plan.json": plan.to_json(), "serve.py": render_serve(cfg, plan, out)})
    return plan.data


def run_in_process(out: Path, argv: list[str], stdout: io.StringIO | None = None) -> dict:
    """Run ``out/serve.py`` in this process (world of one); returns its record. What it
    prints goes to ``stdout`` (None: dropped)."""
    spec = importlib.util.spec_from_file_location(f"parcompile_serve_{next(_counter)}", out / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if k in os.environ}
    try:
        with contextlib.redirect_stdout(stdout if stdout is not None else io.StringIO()):
            return module.main(["--plan", str(out / "plan.json")] + argv)
    finally:
        os.environ.update(saved)


def run_torchrun(world: int, jobs: list[tuple[Path, list[str], Path]], timeout_s: float = 600) -> str:
    """Run several serve programs one after another in one torchrun launch of ``world``
    processes: each job is (program dir, argv, records dir). Returns stdout."""
    spec = [{"program": str(d / "serve.py"), "argv": ["--plan", str(d / "plan.json"), "--out", str(o)] + a}
            for d, a, o in jobs]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(MULTI), json.dumps(spec)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PARCOMPILE_DEVICE="cpu", PYTHONPATH=str(HERE.parent))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited with {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc.stdout


def serve_cases_in_one_launch(tmp_path_factory, name: str, keys, save, spec, prompts, tp: int = 2) -> dict:
    """Serve every case of a family test under ``tp`` ranks in one torchrun launch (a launch
    costs more than the runs on CI's 2 cores): for each key, ``save(key, dir)`` writes its
    Hugging Face checkpoint and ``spec(root, tp)`` its serve spec; greedy tokens for
    ``prompts``. Returns key -> (plan.json dict, each rank's record)."""
    args = sum((["--prompt-ids", ",".join(map(str, p))] for p in prompts), [])
    plans, dirs = {}, {}
    for key in keys:   # the params of the test's `case`, built the same way (the same seed)
        tmp = tmp_path_factory.mktemp(name)
        save(key, tmp / "hf")
        plans[key], dirs[key] = build_serve(spec(tmp, tp), tmp / f"tp{tp}"), tmp / f"tp{tp}"
    run_torchrun(tp, [(d, args, d / "out") for d in dirs.values()])
    return {key: (plans[key], records(dirs[key] / "out")) for key in dirs}


def records(out: Path) -> list[dict]:
    """The rank<r>.json records a run wrote, by rank."""
    return [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"), key=lambda f: int(f.stem[4:]))]


def replica_tokens(recs: list[dict]) -> list[list[int]]:
    """The generated tokens of all sequences, replica by replica (from each replica's last
    stage, tp rank 0), in prompt order."""
    last = max(r["stage"] for r in recs)
    out = []
    for r in sorted((r for r in recs if r["stage"] == last and r["tp_index"] == 0), key=lambda r: r["dp_index"]):
        out += r["tokens"]
    return out


def planned_collectives(cfg: SpecConfig, steps: int) -> list[dict]:
    """Per pipeline stage, ``(op, axis, bytes) -> count`` of the collectives the serving
    estimate costs for one generation of ``steps`` tokens (a prefill of ``prompt_len``, then
    ``steps - 1`` decode steps), from the compiled graph
    (:func:`parcompile.analysis.serve.step_costs`)."""
    from parcompile.analysis.serve import step_collective_counts, step_costs
    from parcompile.passes.manager import compile_graph

    c = compile_graph(cfg)
    sv, b = cfg.serve, -(-cfg.serve.batch // cfg.parallel.dp)
    prefill = step_costs(cfg, c.graph, c.ctx.degrees, b, sv.prompt_len, sv.prompt_len)
    decode = step_costs(cfg, c.graph, c.ctx.degrees, b, 1, sv.prompt_len + sv.max_new_tokens)
    out = []
    for pf, dc in zip(prefill, decode):
        counts = step_collective_counts(pf)
        for k, n in step_collective_counts(dc).items():
            counts[k] = counts.get(k, 0) + (steps - 1) * n
        out.append(counts)
    return out


def paged_generate(out: Path, prompts: list[list[int]], n: int, max_seqs: int, blocks: int, block_size: int,
                   weights: str | None = None, prefix_caching: bool = True, max_prefill_tokens: int | None = None):
    """The engine's scheduler and step (runtime/serve/paged.py) in this process (a world of one),
    on the program ``out/serve.py``'s own Stage (``weights``: a checkpoint to load; None: the
    seeded initialisation): requests arrive one per step and join the running batch, ``n``
    greedy tokens each, a chunk's token drawn as the engine draws it (``partial``).
    Returns (each prompt's tokens, the most rows of one step, the scheduler's stats); the
    cache's blocks are all free again at the end. A program of quantized weights holds them
    as its main() does."""
    import torch

    from parcompile import runtime as rt
    from parcompile.runtime.serve import paged
    from parcompile.runtime.state.weights import load_weights

    spec = importlib.util.spec_from_file_location(f"paged_prog_{next(_counter)}", out / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    plan = json.loads((out / "plan.json").read_text())
    saved = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if k in os.environ}
    try:
        ctx = rt.init_parallel(plan, force_cpu=True)
    finally:
        os.environ.update(saved)
    model = mod.Stage(plan, ctx)
    quant = {"weight_format": mod.WEIGHT_FORMAT, "quantized": mod.QUANTIZED_WEIGHTS, "dtype": mod.DTYPE} \
        if hasattr(mod, "WEIGHT_FORMAT") else {}   # a program of quantized weights (runtime/model/quant.py) loads as main()
    load_weights(model, weights, ctx, **quant)
    model.eval()
    cache = model.new_paged_cache(blocks, block_size, ctx.device)
    windows = getattr(mod, "ATTN_CORE_WINDOW", None) or mod.WINDOW
    sched = paged.Scheduler(blocks, block_size, max_seqs, prefix_caching=prefix_caching,
                            max_prefill_tokens=max_prefill_tokens)
    params = {"max_tokens": n, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0, "eos": []}
    pending = list(enumerate(prompts))
    got = {i: [] for i in range(len(prompts))}
    peak = 0
    for _ in itertools.count():
        if pending:
            i, p = pending.pop(0)
            sched.add(str(i), p, params)
        step = sched.next_step()
        rows = [paged.Row(*r) for r in step["rows"]]
        if not rows and not pending and not sched.waiting:
            break
        peak = max(peak, len(rows))
        gens = [torch.Generator() for _ in rows]
        tokens, _ = paged.run_step(model, ctx, cache, rows, [params] * len(rows), gens, mod.VOCAB, mod.HIDDEN,
                                   mod.DTYPE, windows, partial_next=[step["partial"].get(r.rid) for r in rows])
        for rid, tok, _, _ in sched.collect(rows, tokens):
            got[int(rid)].append(tok)
    assert sched.stats()["blocks_free"] == blocks
    return [got[i] for i in range(len(prompts))], peak, sched.stats()


def measured_collectives(rec: dict) -> dict:
    """``(op, axis, bytes) -> count`` of a serve rank's record (its ``rt.COUNTER`` snapshot)."""
    return {(e["op"], e["axis"], e["bytes"]): e["count"] for e in rec["comm"]}


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(spec: Path, out: Path, env: dict, timeout_s: float = 300):
    """`parcompile serve SPEC -o OUT` (environment ``env``) on a free loopback port, once
    /health answers 200 (within ``timeout_s``), until the block ends (then Ctrl-C, and a
    kill after 60 s): yields ``(process, base URL)``."""
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "parcompile", "serve", str(spec), "-o", str(out), "--port",
                             str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield proc, base
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """Ctrl-C a `parcompile serve` process still running, and kill it after 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


#: the end-of-text token of :func:`write_byte_llama`'s tokenizer
EOT = "<|endoftext|>"


def write_byte_tokenizer(d: Path) -> int:
    """A byte-level tokenizer (one token per byte, no merges; the `tokenizers` library) with
    the special end token :data:`EOT` after the 256 bytes, written into ``d`` (made) as
    ``tokenizer.json`` and a ``tokenizer_config.json`` naming it the ``eos_token``, as
    transformers reads them. Returns the end token's id (256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    eot = vocab[EOT] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "eos_token": EOT, "model_max_length": 128}))
    return eot


def write_byte_llama(d: Path, ending: list[str] = (), steps: int = 20) -> int:
    """A tiny Hugging Face Llama (seed 0, weights 10x the init's: choices' loglikelihoods
    differ clearly) with :func:`write_byte_tokenizer`'s tokenizer, written into ``d`` with
    ``save_pretrained``, readable by transformers and by `serve`. ``ending``: texts it is
    then trained on, each followed by the end token (``steps`` Adam steps of the causal LM
    loss, transformers' own), so that its greedy next token after each of them is the end
    token (the caller checks that with transformers). Returns the end token's id."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    eot = write_byte_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    cfg = transformers.LlamaConfig(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                                   eos_token_id=eot, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    if ending:
        seqs = [tok.encode(t).ids + [eot] for t in ending]
        n = max(map(len, seqs))
        ids = torch.tensor([s + [eot] * (n - len(s)) for s in seqs])
        labels = torch.tensor([s + [-100] * (n - len(s)) for s in seqs])     # padding: no loss
        mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs])
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model.train()
        for _ in range(steps):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
    model.save_pretrained(d, safe_serialization=True)
    return eot
