#!/usr/bin/env python3
"""Load test of `parcompile serve` (SPEC 4): N concurrent streaming clients for T seconds,
then the same workload one request at a time; prints requests/s, output tokens/s, p50 and
p99 time to first token (TTFT) and per output token (TPOT) of both, and the ratio of
output tokens/s; beside each phase, the plan's predicted TTFT and TPOT for that load (the
spec compiled with ``serve.batch`` = the clients, ``prompt_len`` and ``max_new_tokens`` =
the requests': :mod:`parcompile.analysis.serve`) and measured / predicted.

    python benchmarks/serve_load.py examples/tiny_serve.par --clients 16 --seconds 20
    python benchmarks/serve_load.py --transformers --clients 32

launches the server on a free port (or give ``--url`` of a running one), waits for
/health, runs both phases and stops it. Each client sends streamed completions of
``--prompt-tokens`` random token ids and ``--max-tokens`` new tokens (greedy, so a request
always generates them all) back to back until the phase's time is up; a request in flight
then finishes (the phase is bounded by T plus one request). Timings on a shared machine
are noisy: run it when the machine is quiet.

``--shared-prefix N`` starts every prompt with the same N tokens (a system prompt or
few-shot prefix) and prints the server's prefix cache hit rate and prefilled tokens
(/metrics) after the phases; compare with ``prefix_caching = false`` in the spec's serve
block.

``--transformers``: both servers serve the same weights, a Hugging Face Llama checkpoint of
the spec's model drawn from a seed (random weights; a byte-level tokenizer, token id =
byte) written with ``save_pretrained``: `parcompile serve` with the spec's layout on it,
then ``transformers serve --continuous-batching`` (one process, its default threads) under
the same N clients with the same prompts (as text: lowercase letters, one token each), and
the ratio of their output tokens/s. transformers streams text, so its tokens are counted
from the final chunk's ``usage`` (else one per text chunk).

``--rounds R`` (with ``--transformers``; default 1) takes the two servers' N-client phases
in turn R times (parcompile's server stays up, idle during the other's phase, and says what
that cost; a fresh `transformers serve` each round, which kept up grows without bound under
this load), printing each round's ratio and the median: on a
machine whose speed drifts by itself (a shared host: the same phase here gave 1,662 to
2,655 tok/s for `transformers serve` in one night) one round's two phases see about the
same machine.
``--stream-interval N`` serves with ``stream_interval = N`` (the spec's serve key: a
request's tokens sent in groups of N, its first and last at once).

Cost and clocks. With a launched server, each phase also prints the server's CPU time per
output token (its process tree: front, torchrun, ranks; psutil), a figure that other work
on a shared machine does not inflate as it inflates wall time, beside the client's own
(this process's ``time.process_time``: the clients are coroutines on one asyncio event loop
over aiohttp, which parses HTTP in C, as vLLM's benchmark_serving.py does, so that the load
generator costs a small fraction of the server and does not cap what is measured), and
for `parcompile serve` the server's own mean TTFT and TPOT (/metrics: from a request's submission to each token's
arrival from the engine) beside the plan's. A client's TTFT is the time to the first chunk
that carries text: a byte-level model with random weights often begins with bytes that are
no whole UTF-8 character, which the server holds back until the character is whole, so the
client's TTFT can span several steps where the server's is one. The layout line says how
many rank processes share the cores: a tp 2 x pp 2 program runs 4 ranks, and on a 2-core
machine every collective then waits for a descheduled peer, so the fair comparison with
one-process `transformers serve` there is tp 1 (``--tp 1 --pp 1``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int] | str,
                      max_tokens: int) -> tuple[float | None, float | None, int]:
    """One streamed completion: (TTFT s (None when no chunk carried text), TPOT s (None for
    one token), output tokens). The tokens are counted from the chunks' ``token_ids`` (a
    chunk may carry several: the text of an unfinished UTF-8 character waits); TPOT is
    ``(last - first) / (tokens - 1)``, as vLLM's benchmark_serving.py computes it. A chunk's
    time is that of the read that completed its ``data:`` line (one clock reading per read:
    the lines of one read arrived together). Raises ``aiohttp.ClientResponseError`` on an
    HTTP error status."""
    text = isinstance(prompt, str)    # transformers serve: a text prompt, text chunks, usage at the end
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if not text:
        body["return_token_ids"] = True
    t0 = time.perf_counter()
    first = last = None
    n, usage, rest = 0, None, b""
    async with session.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for data in r.content.iter_any():     # whatever arrived: parts of lines, or several
            now = time.perf_counter()
            *lines, rest = (rest + data).split(b"\n")
            for line in lines:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                choice = (chunk.get("choices") or [{}])[0]
                got = (1 if choice.get("text") else 0) if text else len(choice.get("token_ids") or [])
                if got:
                    first = now if first is None else first
                    last, n = now, n + got
    if text and usage and usage.get("completion_tokens"):
        n = usage["completion_tokens"]
    if first is None:   # no chunk carried text (transformers: bytes that are no whole UTF-8 character)
        return None, None, n
    return first - t0, ((last - first) / (n - 1) if n > 1 else None), n


def _session(clients: int) -> aiohttp.ClientSession:
    """One HTTP session for ``clients`` concurrent streams: a connection each, kept alive
    between a client's requests; a request may take up to 300 s."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients),
                                 timeout=aiohttp.ClientTimeout(total=300))


def request_once(url: str, prompt: list[int] | str, max_tokens: int) -> tuple[float | None, float | None, int]:
    """:func:`one_request` on its own event loop and connection (a warm-up)."""
    async def go():
        async with _session(1) as session:
            return await one_request(session, url, prompt, max_tokens)
    return asyncio.run(go())


def tree_cpu(pid: int | None) -> float | None:
    """CPU seconds (user + system) spent so far by process ``pid`` and every process below it
    (the front, torchrun and its ranks; psutil), None without a pid. On a machine shared
    with other work this is the server's cost, where wall time also counts the others'."""
    if pid is None:
        return None
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def server_times(url: str) -> dict | None:
    """The server's own time-to-first-token and time-per-output-token histograms' sums and
    counts (/metrics: ``parcompile_time_to_first_token_seconds``, ``..._time_per_output_token_seconds``;
    the front's clock from a request's submission to each token's arrival from the engine),
    None when there are none (another server)."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    out = {}
    for line in text.splitlines():
        for key, name in (("ttft", "parcompile_time_to_first_token_seconds"),
                          ("tpot", "parcompile_time_per_output_token_seconds")):
            for part in ("sum", "count"):
                if line.startswith(f"{name}_{part}{{"):
                    out[f"{key}_{part}"] = float(line.rsplit(" ", 1)[1])
    return out if len(out) == 4 else None


def phase(url: str, clients: int, seconds: float, prompt_tokens: int, max_tokens: int, seed: int,
          prefix: list[int] = (), letters: bool = False, text: bool = False, pid: int | None = None) -> dict:
    """``clients`` coroutines on one event loop (aiohttp: HTTP parsed in C, so that the
    client costs little beside the server) sending requests back to back for ``seconds``
    (each at least one; the last one in flight finishes): prompts of ``prefix`` then
    ``prompt_tokens`` random token ids below 256, or with ``letters`` of lowercase letters
    (bytes 97-122: the same tokens under a byte-level tokenizer), sent as text with ``text``.
    ``client_cpu``: the CPU seconds this process spent during the phase (``time.process_time``:
    the load generator's own cost); with the server's ``pid``, ``cpu``: the CPU seconds its
    process tree spent (:func:`tree_cpu`)."""
    stats = {"ttft": [], "tpot": [], "tokens": 0, "requests": 0}
    cpu0 = tree_cpu(pid)
    srv0 = server_times(url) if pid is not None and not text else None

    async def client(session: aiohttp.ClientSession, i: int, stop_at: float) -> None:
        rng = random.Random(seed * 1000 + i)
        while True:
            ids = [rng.randrange(97, 123) if letters else rng.randrange(256) for _ in range(prompt_tokens)]
            ids = list(prefix) + ids
            prompt = "".join(map(chr, ids)) if text else ids
            ttft, tpot, n = await one_request(session, url, prompt, max_tokens)
            if ttft is not None:
                stats["ttft"].append(ttft)
            if tpot is not None:
                stats["tpot"].append(tpot)
            stats["tokens"] += n
            stats["requests"] += 1
            if time.perf_counter() >= stop_at:   # at least one request each, however late the loop started
                return

    async def run() -> None:
        async with _session(clients) as session:
            stop_at = time.perf_counter() + seconds
            await asyncio.gather(*(client(session, i, stop_at) for i in range(clients)))

    t0, client0 = time.perf_counter(), time.process_time()
    asyncio.run(run())
    stats["wall"] = time.perf_counter() - t0
    stats["client_cpu"] = time.process_time() - client0
    cpu1 = tree_cpu(pid)
    stats["cpu"] = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    srv1 = server_times(url) if srv0 is not None else None
    if srv1 is not None and srv1["ttft_count"] > srv0["ttft_count"] and srv1["tpot_count"] > srv0["tpot_count"]:
        stats["server"] = {k: (srv1[f"{k}_sum"] - srv0[f"{k}_sum"]) / (srv1[f"{k}_count"] - srv0[f"{k}_count"])
                           for k in ("ttft", "tpot")}
    stats["load"] = os.getloadavg()[0]
    return stats


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q / 100 * len(xs)), len(xs) - 1)] if xs else float("nan")


def report(name: str, s: dict, predicted: dict | None = None) -> float:
    """Print one phase's figures (and, given the plan's ``serve`` section for this load, its
    predicted TTFT and TPOT with measured p50 / predicted); returns output tokens/s."""
    tps = s["tokens"] / s["wall"]
    print(f"{name:<12} {s['requests']:5d} requests in {s['wall']:5.1f} s: {s['requests'] / s['wall']:6.2f} req/s, "
          f"{tps:7.1f} output tok/s; TTFT p50 {pct(s['ttft'], 50) * 1e3:6.1f} ms p99 {pct(s['ttft'], 99) * 1e3:6.1f} ms; "
          f"TPOT p50 {pct(s['tpot'], 50) * 1e3:6.1f} ms p99 {pct(s['tpot'], 99) * 1e3:6.1f} ms", flush=True)
    if s.get("cpu") is not None and s["tokens"]:
        print(f"{'':<12} server CPU {s['cpu']:6.1f} s: {s['cpu'] / s['tokens'] * 1e3:6.2f} CPU-ms per output token "
              f"({s['cpu'] / s['wall']:.2f} cores busy; load average {s['load']:.1f})", flush=True)
    if s["tokens"]:
        c = s["client_cpu"]
        print(f"{'':<12} client CPU {c:6.1f} s: {c / s['tokens'] * 1e3:6.2f} CPU-ms per output token "
              f"({c / s['wall']:.2f} cores busy"
              + (f"; {c / s['cpu']:.0%} of the server's" if s.get("cpu") else "") + ")", flush=True)
    srv = s.get("server")
    if srv is not None:
        print(f"{'':<12} server's clock (/metrics, submission to each token from the engine): TTFT mean "
              f"{srv['ttft'] * 1e3:6.1f} ms, TPOT mean {srv['tpot'] * 1e3:6.1f} ms", flush=True)
    if predicted is not None:
        ttft, tpot = pct(s["ttft"], 50), pct(s["tpot"], 50)
        print(f"{'':<12} plan (batch {predicted['batch']}): TTFT {predicted['ttft'] * 1e3:6.1f} ms, TPOT "
              f"{predicted['tpot'] * 1e3:6.1f} ms, {predicted['tokens_per_s']:7.1f} output tok/s; measured / plan: "
              f"TTFT {ttft / predicted['ttft']:.2f}x, TPOT {tpot / predicted['tpot']:.2f}x, "
              f"tok/s {tps / predicted['tokens_per_s']:.2f}x"
              + (f"; server's clock / plan: TTFT {srv['ttft'] / predicted['ttft']:.2f}x, "
                 f"TPOT {srv['tpot'] / predicted['tpot']:.2f}x" if srv is not None else ""), flush=True)
    return tps


def predicted(spec: Path, batch: int, prompt_tokens: int, max_tokens: int) -> dict | None:
    """The plan's ``serve`` section for ``batch`` sequences of ``prompt_tokens`` + ``max_tokens``
    (the spec compiled with those overrides; None when it does not compile)."""
    from parcompile.diagnostics import SpecError
    from parcompile.driver import compile_source

    try:
        d = compile_source(spec, overrides={"serve.batch": batch, "serve.prompt_len": prompt_tokens,
                                            "serve.max_new_tokens": max_tokens}).data
        return {**d["serve"], "world": d["world_size"], "degrees": d["degrees"]}
    except SpecError as e:
        print(f"no prediction: {e}", file=sys.stderr)
        return None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as one printable character (the table of
    ``tokenizers.pre_tokenizers.ByteLevel``; Radford et al. 2019, openai/gpt-2 encoder.py)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def hf_checkpoint(spec: Path, root: Path, streams: int, tp: int | None = None, pp: int | None = None,
                  compile_: bool = False, stream_interval: int | None = None) -> Path:
    """A Hugging Face Llama checkpoint of ``spec``'s (dense, RoPE, RMSNorm, SwiGLU) model with
    weights drawn from seed 0 and a byte-level tokenizer (token id = byte), saved with
    ``save_pretrained`` into ``root/hf``; and ``root/serve.par``: the spec's cluster and
    layout serving it, decoding up to ``streams`` sequences at once (``serve.batch``, at
    least the spec's), with ``tp``, ``pp`` and ``stream_interval`` in place of the spec's
    when given, and ``compile = true`` when ``compile_`` (the engine's torch.compile).
    Returns the new spec."""
    import torch

    from parcompile.runtime.machine.device import quiet_deepspeed_on_cpu

    quiet_deepspeed_on_cpu()   # before transformers imports DeepSpeed (and for `transformers serve`): no warning
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from parcompile.frontend import load_spec

    cfg, _ = load_spec(spec)
    m, par = cfg.model, cfg.parallel
    tp, pp = tp or par.tp, pp or par.pp
    if m.vocab != 256:
        raise SystemExit("--transformers needs a byte-level model (vocab = 256)")
    hf = root / "hf"
    hcfg = transformers.LlamaConfig(
        vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.ffn_hidden, num_hidden_layers=m.layers,
        num_attention_heads=m.heads, num_key_value_heads=m.kv_heads, max_position_embeddings=m.seq_len,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hcfg).float().save_pretrained(hf, safe_serialization=True)
    table = _bytes_to_unicode()
    tok = Tokenizer(models.BPE({table[b]: b for b in range(256)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(hf)
    out = root / "serve.par"
    out.write_text(f'model m from "hf/config.json" {{ dtype = {m.dtype} }}\n'
                   f'cluster local from "cpu" {{ nodes = 1, gpus_per_node = {tp * pp * par.dp} }}\n'
                   f"parallel {{ tp = {tp}, pp = {pp}, dp = {par.dp} }}\n"
                   f'serve {{ batch = {max(cfg.serve.batch, streams)}, prompt_len = {cfg.serve.prompt_len}, max_new_tokens = '
                   f'{cfg.serve.max_new_tokens}, block_size = {cfg.serve.block_size}, kv_cache_tokens = 4096, '
                   f'weights = "hf"{", compile = true" if compile_ else ""}, '
                   f'stream_interval = {stream_interval or cfg.serve.stream_interval} }}\n')
    return out


def wait_healthy(url: str, proc: subprocess.Popen | None, what: str) -> bool:
    """Wait (up to 30 minutes: a compiled engine warms up first) for ``url``/health to answer 200."""
    deadline = time.monotonic() + 1800
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if proc is not None and proc.poll() is not None:
            print(f"{what} exited", file=sys.stderr)
            return False
        if time.monotonic() > deadline:
            print(f"{what} did not start", file=sys.stderr)
            return False
        time.sleep(0.5)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def start_transformers(spec: Path) -> tuple[subprocess.Popen, str] | None:
    """``transformers serve --continuous-batching`` of ``spec``'s checkpoint (``hf`` beside it) on
    a free port, warmed up (the model loaded); None when it did not become healthy."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(["transformers", "serve", "--continuous-batching", "--device", "cpu", "--port",
                             str(port), str(spec.parent / "hf")], env=dict(os.environ), stdout=subprocess.DEVNULL)
    if not wait_healthy(url, proc, "transformers serve"):
        stop(proc)
        return None
    request_once(url, "abc", 2)       # warm up (loads the model)
    return proc, url


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("spec", nargs="?", default=str(REPO / "examples" / "tiny_serve.par"),
                    help="the serve spec to launch (default examples/tiny_serve.par)")
    ap.add_argument("--url", default=None, help="a running server (default: launch one for SPEC)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent streaming clients (default 16)")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    ap.add_argument("--prompt-tokens", type=int, default=8, help="prompt length of each request, tokens (default 8)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens each request generates (default 32)")
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                    help="every prompt starts with the same N tokens (prefix caching)")
    ap.add_argument("--transformers", action="store_true",
                    help="serve a seeded Hugging Face checkpoint of SPEC's model and compare with `transformers serve`")
    ap.add_argument("--tp", type=int, default=None, help="with --transformers: serve with this tp (default the spec's)")
    ap.add_argument("--pp", type=int, default=None, help="with --transformers: serve with this pp (default the spec's)")
    ap.add_argument("--compile", action="store_true",
                    help="with --transformers: serve with `compile = true` (the engine's torch.compile, warmed up "
                         "before the server is ready: minutes on a CPU)")
    ap.add_argument("--stream-interval", type=int, default=None, metavar="N",
                    help="with --transformers: serve with `stream_interval = N` (a request's tokens sent in groups "
                         "of N; default the spec's)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --transformers: the two servers' N-client phases taken in turn this many times "
                         "(parcompile, a fresh transformers serve, parcompile, ...): each round's ratio and their "
                         "median, so that a machine whose speed drifts judges both alike")
    args = ap.parse_args(argv)
    for flag, given in (("--compile", args.compile), ("--stream-interval", args.stream_interval is not None),
                        ("--rounds", args.rounds != 1)):
        if given and not args.transformers:
            ap.error(f"{flag} goes with --transformers (for a spec of your own, write the key in its serve block)")
    if args.rounds < 1 or (args.stream_interval is not None and args.stream_interval < 1):
        ap.error("--rounds and --stream-interval take 1 or more")
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PARCOMPILE_DEVICE="cpu", PYTHONPATH=str(REPO))
    spec = Path(args.spec)
    if args.transformers:
        spec = hf_checkpoint(spec, tmp / "serve_load_hf", args.clients, args.tp, args.pp, args.compile,
                             args.stream_interval)
    elif "tiny_serve" in spec.name and not (REPO / "build" / "tiny_ckpt").exists():
        # the example's weights come from training tiny.par; without them, drawn from the seed
        text = spec.read_text().replace('weights        = "../build/tiny_ckpt"', "")
        spec = tmp / "serve_load.par"
        spec.write_text(text)
    plan = {n: predicted(spec, n, args.prompt_tokens, args.max_tokens) for n in (args.clients, 1)}
    proc = None
    url = args.url
    if url is None:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-m", "parcompile", "serve", str(spec), "--port", str(port),
                                 "-o", str(tmp / "serve_load_build")], env=env)
    deg = (plan.get(args.clients) or {}).get("degrees", {})
    ours = []       # output tokens/s of each of parcompile's N-client phases
    try:
        if not wait_healthy(url, proc, "the server"):
            return 1
        request_once(url, [1, 2, 3], 2)          # warm up
        print(f"{args.clients} concurrent clients vs one at a time, {args.seconds:.0f} s each; prompts of "
              f"{args.prompt_tokens} tokens, {args.max_tokens} output tokens (greedy); load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        p = plan.get(args.clients) or plan.get(1)
        if p is not None:
            print(f"layout dp {deg.get('dp', 1)} x tp {deg.get('tp', 1)} x pp {deg.get('pp', 1)}"
                  f"{', compiled engine' if p.get('compile') else ''}"
                  f"{', stream interval ' + str(p['stream_interval']) if p.get('stream_interval') else ''}"
                  f": {p['world']} rank process(es) beside the front process on {os.cpu_count()} cores"
                  + (" (more ranks than cores: every collective waits for its peers to be scheduled, so this layout "
                     "is slower here than tp 1; `transformers serve` is one process)" if p["world"] > (os.cpu_count() or 1)
                     else ""))
        prefix = [random.Random(0).randrange(97, 123) if args.transformers else random.Random(0).randrange(256)
                  for _ in range(args.shared_prefix)]
        ratios = []
        for i in range(args.rounds):
            tag = f" ({i + 1}/{args.rounds})" if args.rounds > 1 else ""
            ours.append(report(f"{args.clients} clients{tag}", phase(url, args.clients, args.seconds,
                                                                     args.prompt_tokens, args.max_tokens, 1, prefix,
                                                                     args.transformers, pid=proc.pid if proc else None),
                               plan[args.clients]))
            if args.transformers:
                # a fresh `transformers serve` each round: one kept up grew to 11.7 GB resident over
                # three phases here and slowed by a third (1,567 -> 952 tok/s)
                hf = start_transformers(spec)
                if hf is None:
                    return 1
                idle0 = tree_cpu(proc.pid if proc else None)
                try:
                    theirs = report(f"transformers{tag}", phase(hf[1], args.clients, args.seconds,
                                                                args.prompt_tokens, args.max_tokens, 1, prefix,
                                                                letters=True, text=True, pid=hf[0].pid))
                finally:
                    stop(hf[0])
                idle1 = tree_cpu(proc.pid if proc else None)
                ratios.append(ours[-1] / theirs)
                print(f"round {i + 1}: {ratios[-1]:.2f}x"
                      + (f" (parcompile serve, idle meanwhile, used {idle1 - idle0:.2f} CPU-s)"
                         if idle0 is not None and idle1 is not None else ""), flush=True)
        single = report("sequential", phase(url, 1, args.seconds, args.prompt_tokens, args.max_tokens, 2,
                                            prefix, args.transformers, pid=proc.pid if proc else None), plan[1])
        print(f"continuous batching: {ours[-1] / single:.1f}x the output tokens/s of sequential requests")
        if ratios:
            print(f"parcompile serve (tp {deg.get('tp', '?')} x pp {deg.get('pp', '?')}): "
                  f"{statistics.median(ratios):.2f}x (median of "
                  f"{len(ratios)} rounds: {', '.join(f'{r:.2f}' for r in ratios)}) the output tokens/s of "
                  f"`transformers serve --continuous-batching` at {args.clients} streams (same weights, phases in "
                  f"turn; load average {os.getloadavg()[0]:.1f})")
        if args.shared_prefix:
            m = {}
            for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
                if line.startswith("parcompile_") and "_total{" in line:
                    m[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
            q, h = m.get("parcompile_prefix_cache_queries_total", 0), m.get("parcompile_prefix_cache_hits_total", 0)
            print(f"prefix cache: {h:,.0f} of {q:,.0f} prompt tokens hit ({h / q if q else 0:.0%}); "
                  f"{m.get('parcompile_prefill_tokens_total', 0):,.0f} prompt tokens prefilled")
    finally:
        stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
