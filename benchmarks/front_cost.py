#!/usr/bin/env python3
"""CPU cost of `parcompile serve`'s HTTP front alone (:mod:`parcompile.server`: FastAPI on
`serve`'s own uvicorn configuration), per output token, with no ranks: the front runs in a
child process over a stand-in for :class:`parcompile.server.engines.Engines` that delivers
one token to every running request each ``--step-ms`` from a thread, one event-loop wake-up
per step, as the real one does (``Engines._read``); N clients stream completions of
``--max-tokens`` tokens back to back. Prints the front process's CPU seconds (user +
system, ``/proc/PID/stat``) per output token and per request, and the machine's load.

    python benchmarks/front_cost.py --clients 32 --requests 8 --max-tokens 32
    python benchmarks/front_cost.py --plain            # non-streamed requests
    python benchmarks/front_cost.py --profile out.pstats  # cProfile of the front's event loop
    python benchmarks/front_cost.py --http h11 --loop asyncio  # serve's fallback stack
    python benchmarks/front_cost.py --asgi --stop zz   # the ASGI application alone (no sockets)

``--asgi`` runs the application (:func:`parcompile.server.api.build_app`) in this process,
without uvicorn, sockets or threads: ``--clients`` streams at once, their tokens put by a
task one per stream per loop pass, the body messages dropped; it prints this process's CPU
per token (best and median of ``--requests`` rounds): the front's own code and Starlette's,
steadier than the whole front on a loaded machine.

The tokens are byte-level letters (the byte tokenizer of a model without tokenizer.json):
the same text path as ``benchmarks/serve_load.py --transformers``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class StepEngines:
    """The front's engine interface (``submit``, ``abort``, ``totals``, ``failed``) over a
    thread that, every ``step_s`` seconds, gives each running request its next token
    (a letter; ``"length"`` at its ``max_tokens``) and wakes each event loop once, onto the
    real one's queues (:class:`parcompile.server.engines.TokenQueue`)."""

    def __init__(self, step_s: float):
        from parcompile.server.engines import TokenQueue, _put_all

        self.step_s, self.failed, self._put_all, self.queue = step_s, None, _put_all, TokenQueue
        self.running: dict = {}          # rid -> [loop, queue, tokens sent, max_tokens, logprobs k]
        self.lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, rid, prompt, params):
        q = self.queue()
        with self.lock:
            self.running[rid] = [asyncio.get_running_loop(), q, 0, params["max_tokens"], params.get("logprobs")]
        return q

    def abort(self, rid):
        with self.lock:
            self.running.pop(rid, None)

    def totals(self):
        return {"blocks_used": 0, "blocks_free": 1, "waiting": 0, "running": len(self.running)}

    def _run(self):
        while True:
            time.sleep(self.step_s)
            deliver: dict = {}
            with self.lock:
                for rid, r in list(self.running.items()):
                    loop, q, i, most, k = r
                    r[2] = i + 1
                    reason = "length" if i + 1 == most else None
                    lp = None if k is None else {"lp": -0.5, "top": [(97, -0.5), (98, -1.5)][:k]}
                    deliver.setdefault(loop, []).append((q, (97 + i % 26, reason, lp)))
                    if reason:
                        del self.running[rid]
            for loop, items in deliver.items():
                loop.call_soon_threadsafe(self._put_all, items)


def serve_front(port: int, step_s: float, profile: str | None, http: str = "auto", loop: str = "auto") -> None:
    """Run the front on 127.0.0.1:``port`` over :class:`StepEngines` (the child process);
    with ``profile``, cProfile its event loop's thread (CPU clock) and write the stats there
    on SIGUSR1. ``http`` and ``loop``: :func:`parcompile.server.http.uvicorn_config`'s."""
    import signal

    import uvicorn

    from parcompile.runtime.serve import generate as gen
    from parcompile.server.api import PLAIN_CHAT_TEMPLATE, ModelInfo, build_app
    from parcompile.server.http import uvicorn_config
    from parcompile.server.metrics import Metrics

    info = ModelInfo(name="tiny", vocab=256, context=4096, temperature=0.0, top_k=0, eos=[],
                     tokenizer=gen.load_tokenizer(None, None, 256), chat_template=PLAIN_CHAT_TEMPLATE, special={})
    app = build_app(info, StepEngines(step_s), Metrics(info.name))
    if profile:
        import cProfile

        prof = cProfile.Profile(time.thread_time)
        signal.signal(signal.SIGUSR1, lambda *_: (prof.disable(), prof.dump_stats(profile)))
        signal.signal(signal.SIGUSR2, lambda *_: prof.enable())
    stack = {} if http == loop == "auto" else {"http": http, "loop": loop}
    uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, **stack)).run()


class LoopEngines(StepEngines):
    """:class:`StepEngines` without its thread: :meth:`drive` (a task) gives each running
    request its next token at every pass of the event loop."""

    def __init__(self):
        from parcompile.server.engines import TokenQueue, _put_all

        self.failed, self._put_all, self.queue = None, _put_all, TokenQueue
        self.running: dict = {}
        self.lock = threading.Lock()

    async def drive(self) -> None:
        while True:
            await asyncio.sleep(0)
            for rid, r in list(self.running.items()):
                _, q, i, most, _ = r
                r[2] = i + 1
                q.put_nowait((97 + i % 26, "length" if i + 1 == most else None, None))
                if i + 1 == most:
                    del self.running[rid]


def asgi_cost(clients: int, rounds: int, max_tokens: int, stop: list[str]) -> None:
    """Print the CPU seconds of this process per token of ``clients`` streamed completions
    at once through the ASGI application (no server), best and median of ``rounds``."""
    from parcompile.runtime.serve import generate as gen
    from parcompile.server.api import PLAIN_CHAT_TEMPLATE, ModelInfo, build_app
    from parcompile.server.metrics import Metrics

    info = ModelInfo(name="tiny", vocab=256, context=max_tokens + 64, temperature=0.0, top_k=0, eos=[],
                     tokenizer=gen.load_tokenizer(None, None, 256), chat_template=PLAIN_CHAT_TEMPLATE, special={})
    engines = LoopEngines()
    app = build_app(info, engines, Metrics(info.name))
    body = json.dumps({"prompt": list(range(97, 105)), "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "return_token_ids": True, "stop": stop or None}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "scheme": "http", "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 8000)}

    async def one() -> None:
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if pending:
                return pending.pop(0)
            await asyncio.sleep(3600)

        async def send(message):
            pass

        await app(dict(scope), receive, send)

    async def run() -> list[float]:
        driver = asyncio.ensure_future(engines.drive())
        await asyncio.gather(*[one() for _ in range(clients)])       # warm up
        per_token = []
        for _ in range(rounds):
            c0 = time.process_time()
            await asyncio.gather(*[one() for _ in range(clients)])
            per_token.append((time.process_time() - c0) / (clients * max_tokens))
        driver.cancel()
        return sorted(per_token)

    t = asyncio.run(run())
    print(f"ASGI application alone: {clients} streams x {max_tokens} tokens, {rounds} rounds: "
          f"{1000 * t[0]:.4f} ms/token best, {1000 * t[len(t) // 2]:.4f} median (this process's CPU)")


def cpu_s(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid`` (``/proc/PID/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def client(base: str, body: dict, requests: int, out: list, chunks: list | None = None) -> None:
    """``requests`` completions one after another; appends the output tokens of each to
    ``out``, and a stream's chunks (events with choices) to ``chunks``."""
    import httpx

    with httpx.Client(timeout=120) as c:
        for _ in range(requests):
            if not body.get("stream"):
                r = c.post(base + "/v1/completions", json=body)
                r.raise_for_status()
                out.append(r.json()["usage"]["completion_tokens"])
                continue
            n = k = 0
            with c.stream("POST", base + "/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        choices = json.loads(line[6:])["choices"]
                        k += bool(choices)
                        for ch in choices:
                            n += len(ch.get("token_ids") or [])
            out.append(n)
            if chunks is not None:
                chunks.append(k)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=8, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=20.0, help="the stand-in engine's step")
    ap.add_argument("--plain", action="store_true", help="non-streamed requests")
    ap.add_argument("--logprobs", type=int, default=None, help="ask for this many logprobs")
    ap.add_argument("--profile", default=None, metavar="FILE", help="cProfile the front (CPU clock) into FILE")
    ap.add_argument("--http", default="auto", choices=("auto", "httptools", "h11"), help="the HTTP protocol")
    ap.add_argument("--loop", default="auto", choices=("auto", "uvloop", "asyncio"), help="the event loop")
    ap.add_argument("--asgi", action="store_true", help="the ASGI application alone, in this process")
    ap.add_argument("--stop", action="append", default=[], help="a stop string (--asgi; repeatable)")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)   # the child process
    a = ap.parse_args(argv)
    if a.serve is not None:
        serve_front(a.serve, a.step_ms / 1000, a.profile, a.http, a.loop)
        return 0
    if a.asgi:
        asgi_cost(a.clients, a.requests, a.max_tokens, a.stop)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--step-ms", str(a.step_ms),
                             "--http", a.http, "--loop", a.loop]
                            + (["--profile", str(Path(a.profile).resolve())] if a.profile else []), env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                print("the front did not start", file=sys.stderr)
                return 1
            time.sleep(0.1)
        body = {"prompt": list(range(97, 105)), "max_tokens": a.max_tokens, "temperature": 0,
                "stream": not a.plain, "return_token_ids": True}
        if a.logprobs is not None:
            body["logprobs"] = a.logprobs
        client(base, body, 2, [])                  # warm up
        if a.profile:
            proc.send_signal(signal.SIGUSR2)
        tokens: list = []
        chunks: list = []
        c0, t0 = cpu_s(proc.pid), time.perf_counter()
        threads = [threading.Thread(target=client, args=(base, body, a.requests, tokens, chunks)) for _ in range(a.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        (user, system), wall = [b - a for a, b in zip(c0, cpu_s(proc.pid))], time.perf_counter() - t0
        cpu = user + system
        if a.profile:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2.0)
        n = sum(tokens)
        print(f"{'plain' if a.plain else 'streamed'}: {a.clients} clients x {a.requests} requests x {a.max_tokens} "
              f"tokens = {n} tokens in {wall:.1f} s; front CPU {cpu:.2f} s = {1000 * cpu / max(n, 1):.3f} ms/token, "
              f"{1000 * cpu / max(len(tokens), 1):.2f} ms/request (user {1000 * user / max(n, 1):.3f}, system "
              f"{1000 * system / max(n, 1):.3f} ms/token); load {os.getloadavg()[0]:.1f}")
        if not a.plain:     # a front that falls behind sends several tokens per chunk: less CPU per token
            print(f"{sum(chunks)} chunks ({sum(chunks) / max(n, 1):.2f} per token): {1000 * cpu / max(sum(chunks), 1):.3f} "
                  f"ms/chunk")
    finally:
        proc.terminate()
        proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
