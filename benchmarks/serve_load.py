#!/usr/bin/env python3
"""Load test of `parcompile serve` (SPEC 4): N concurrent streaming clients for T seconds,
then the same workload one request at a time; prints requests/s, output tokens/s, p50 and
p99 time to first token (TTFT) and per output token (TPOT) of both, and the ratio of
output tokens/s.

    python benchmarks/serve_load.py examples/tiny_serve.par --clients 16 --seconds 20

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
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_request(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> tuple[float, float | None, int]:
    """One streamed completion: (TTFT s, TPOT s (None for one token), output tokens). The
    tokens are counted from the chunks' ``token_ids`` (a chunk may carry several: the text
    of an unfinished UTF-8 character waits); TPOT is ``(last - first) / (tokens - 1)``, as
    vLLM's benchmark_serving.py computes it."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "return_token_ids": True}
    t0 = time.perf_counter()
    first = last = None
    n = 0
    with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                got = len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                if got:
                    now = time.perf_counter()
                    first = now if first is None else first
                    last, n = now, n + got
    return first - t0, ((last - first) / (n - 1) if n > 1 else None), n


def phase(url: str, clients: int, seconds: float, prompt_tokens: int, max_tokens: int, seed: int,
          prefix: list[int] = ()) -> dict:
    """``clients`` threads sending requests back to back for ``seconds`` (each prompt
    ``prefix`` then ``prompt_tokens`` random ids)."""
    stats = {"ttft": [], "tpot": [], "tokens": 0, "requests": 0}
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with httpx.Client() as c:
            while time.perf_counter() < stop_at:
                prompt = list(prefix) + [rng.randrange(256) for _ in range(prompt_tokens)]
                ttft, tpot, n = one_request(c, url, prompt, max_tokens)
                with lock:
                    stats["ttft"].append(ttft)
                    if tpot is not None:
                        stats["tpot"].append(tpot)
                    stats["tokens"] += n
                    stats["requests"] += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats["wall"] = time.perf_counter() - t0
    return stats


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q / 100 * len(xs)), len(xs) - 1)] if xs else float("nan")


def report(name: str, s: dict) -> float:
    tps = s["tokens"] / s["wall"]
    print(f"{name:<12} {s['requests']:5d} requests in {s['wall']:5.1f} s: {s['requests'] / s['wall']:6.2f} req/s, "
          f"{tps:7.1f} output tok/s; TTFT p50 {pct(s['ttft'], 50) * 1e3:6.1f} ms p99 {pct(s['ttft'], 99) * 1e3:6.1f} ms; "
          f"TPOT p50 {pct(s['tpot'], 50) * 1e3:6.1f} ms p99 {pct(s['tpot'], 99) * 1e3:6.1f} ms", flush=True)
    return tps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default=str(REPO / "examples" / "tiny_serve.par"))
    ap.add_argument("--url", default=None, help="a running server (default: launch one for SPEC)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                    help="every prompt starts with the same N tokens (prefix caching)")
    args = ap.parse_args(argv)
    proc = None
    url = args.url
    if url is None:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, OMP_NUM_THREADS="1", PARCOMPILE_DEVICE="cpu", PYTHONPATH=str(REPO))
        spec = Path(args.spec)
        if "tiny_serve" in spec.name and not (REPO / "build" / "tiny_ckpt").exists():
            # the example's weights come from training tiny.par; without them, drawn from the seed
            text = spec.read_text().replace('weights        = "../build/tiny_ckpt"', "")
            spec = Path(os.environ.get("TMPDIR", "/tmp")) / "serve_load.par"
            spec.write_text(text)
        proc = subprocess.Popen([sys.executable, "-m", "parcompile", "serve", str(spec), "--port", str(port),
                                 "-o", str(Path(os.environ.get("TMPDIR", "/tmp")) / "serve_load_build")], env=env)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc is not None and proc.poll() is not None:
                print("the server exited", file=sys.stderr)
                return 1
            if time.monotonic() > deadline:
                print("the server did not start", file=sys.stderr)
                return 1
            time.sleep(0.5)
        one_request(httpx.Client(), url, [1, 2, 3], 2)          # warm up
        print(f"{args.clients} concurrent clients vs one at a time, {args.seconds:.0f} s each; prompts of "
              f"{args.prompt_tokens} tokens, {args.max_tokens} output tokens (greedy)")
        prefix = [random.Random(0).randrange(256) for _ in range(args.shared_prefix)]
        batched = report(f"{args.clients} clients", phase(url, args.clients, args.seconds, args.prompt_tokens,
                                                           args.max_tokens, 1, prefix))
        single = report("sequential", phase(url, 1, args.seconds, args.prompt_tokens, args.max_tokens, 2, prefix))
        print(f"continuous batching: {batched / single:.1f}x the output tokens/s of sequential requests")
        if args.shared_prefix:
            m = {}
            for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
                if line.startswith("parcompile_") and "_total{" in line:
                    m[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
            q, h = m.get("parcompile_prefix_cache_queries_total", 0), m.get("parcompile_prefix_cache_hits_total", 0)
            print(f"prefix cache: {h:,.0f} of {q:,.0f} prompt tokens hit ({h / q if q else 0:.0%}); "
                  f"{m.get('parcompile_prefill_tokens_total', 0):,.0f} prompt tokens prefilled")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
