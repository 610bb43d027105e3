"""The front's side of the engines: launch the serve program under torchrun with
``--engine HOST:PORT``, accept one connection per data-parallel replica (its leader rank,
:mod:`parcompile.runtime.serve.paged`), send requests to the least loaded replica and route the
tokens that come back to the waiting HTTP handlers.

A replica that goes away (a rank died: torchrun ends the job, the leader's socket closes)
marks the whole server failed: every pending request is answered 503 and the front exits
non-zero (:attr:`Engines.failed`).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Listener
from pathlib import Path

from parcompile import jobs, torchrun
from parcompile.runtime.machine.host import engine_threads
from parcompile.runtime.serve.paged import IDLE_HEARTBEAT_S, KEY_ENV, tcp_nodelay

#: seconds a replica may stay silent (no step's tokens, no idle heartbeat) before the front
#: declares it hung and fails (a rank stuck in a collective): far above one step's time
SILENCE_TIMEOUT_S = 120.0


def _put_all(items: list) -> None:
    """Put each ``(queue, item)`` of ``items`` in order (on the queues' event loop)."""
    for q, item in items:
        q.put_nowait(item)


class TokenQueue:
    """One request's token queue: ``asyncio.Queue``'s ``put_nowait``, ``get``, ``get_nowait``
    and ``empty`` for one reader (the request's handler), unbounded, without its getter
    bookkeeping: a token is a deque append and, when the reader waits, one future's result
    (issue 33: the front's CPU per streamed token). Used on its event loop only."""

    __slots__ = ("items", "waiter")

    def __init__(self):
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self.items.append(item)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def empty(self) -> bool:
        return not self.items

    def get_nowait(self):
        """The oldest item; raises ``asyncio.QueueEmpty`` when there is none."""
        if not self.items:
            raise asyncio.QueueEmpty
        return self.items.popleft()

    async def get(self):
        """The oldest item, once there is one."""
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


class EngineFailed(Exception):
    """The engines are gone (a rank died, torchrun exited): the server answers 503."""


@dataclass
class Replica:
    """One replica's leader connection and what the front knows of its cache."""

    index: int
    conn: object
    info: dict
    stats: dict = field(default_factory=dict)
    outstanding: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Engines:
    """The torchrun job and its replicas' connections.

    ``program`` is the compiled ``serve.py``, ``world`` the ranks to launch and ``replicas``
    the plan's dp degree. Tokens come back as ``(token, finish_reason, logprobs)`` items
    on each request's :class:`TokenQueue` (``logprobs``: a
    :func:`parcompile.runtime.serve.paged.unpack_logprobs` entry, or None); a failure puts an
    :class:`EngineFailed` there.
    """

    def __init__(self, program: Path, world: int, replicas: int, startup_timeout_s: float = 600.0,
                 extra_env: dict | None = None, silence_timeout_s: float | None = None):
        self.program, self.world, self.replicas_wanted = program, world, replicas
        self.silence_timeout_s = max(SILENCE_TIMEOUT_S if silence_timeout_s is None else silence_timeout_s,
                                     5 * IDLE_HEARTBEAT_S)
        self.key = secrets.token_bytes(16)
        self.listener = Listener(("127.0.0.1", 0), authkey=self.key)
        self.replicas: list[Replica] = []
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, TokenQueue]] = {}
        self.owner: dict[str, Replica] = {}
        self.failed: str | None = None
        self.stopping = False        # stop() was called: the engines' going away is no failure
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_fail = None          # called once (from any thread) when the engines fail
        self.on_stats = None         # called with each replica's stats
        host, port = self.listener.address
        env = dict(os.environ, **(extra_env or {}))
        env[KEY_ENV] = self.key.hex()
        env.setdefault("OMP_NUM_THREADS", str(engine_threads(world)))   # the front keeps a core (unless set)
        log_dir = torchrun.run_dir(program)
        cmd = torchrun.command(world, program, ["--engine", f"{host}:{port}"], log_dir)   # a failed rank: one line
        self.proc = jobs.start(cmd, env)   # its own session; it and its ranks die with this process
        try:
            self._accept(startup_timeout_s)
        except BaseException:   # Ctrl-C (or a failure) while the ranks start: end them, leave no orphans
            # at once (SIGKILL to torchrun and each rank's group, jobs.end): nothing is served yet, and a
            # rank allocating its cache or loading weights would take seconds to reach a handler (issue 47)
            self.stopping = True
            jobs.end(self.proc, 0.0, ((signal.SIGKILL, None),))
            torchrun.remove(log_dir)
            self.listener.close()
            raise
        threading.Thread(target=self._watch, daemon=True).start()
        threading.Thread(target=self._watchdog, daemon=True).start()

    def _accept(self, timeout_s: float) -> None:
        """Wait for every replica's leader to connect and say ready (or the job to end)."""
        got: list = []
        err: list = []

        def accept():
            try:
                while len(got) < self.replicas_wanted:
                    conn = self.listener.accept()
                    tcp_nodelay(conn)      # a step's tokens are sent at once (Nagle would hold them)
                    msg = conn.recv()
                    got.append(Replica(msg[1]["replica"], conn, msg[1]))
            except Exception as e:   # the listener closed: startup failed
                err.append(e)

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        deadline = time.monotonic() + timeout_s
        while t.is_alive():
            if self.proc.poll() is not None:
                raise EngineFailed(f"the serve program exited with status {self.proc.returncode} while starting")
            if time.monotonic() > deadline:
                self.stop()
                raise EngineFailed(f"the serve program did not start within {timeout_s:.0f} s")
            t.join(0.1)
        if err:
            raise EngineFailed(f"the serve program did not connect: {err[0]}")
        self.replicas = sorted(got, key=lambda r: r.index)
        for r in self.replicas:
            r.last_seen = time.monotonic()
            r.stats = {"blocks_used": 0, "blocks_free": r.info["kv_blocks"], "waiting": 0, "running": 0}
            threading.Thread(target=self._read, args=(r,), daemon=True).start()

    # ---- failure ------------------------------------------------------------------------

    def _fail(self, reason: str) -> None:
        if self.failed or self.stopping:
            return
        self.failed = reason
        for rid, (loop, q) in list(self.queues.items()):
            loop.call_soon_threadsafe(q.put_nowait, EngineFailed(reason))
        if self.on_fail:
            self.on_fail(reason)

    def _watch(self) -> None:
        self.proc.wait()
        self._fail(f"the serve program exited with status {self.proc.returncode}")

    def _watchdog(self) -> None:
        """Fail when a replica has been silent too long: a rank hung in a collective (a dead
        one closes its sockets and torchrun ends the job; a hung one must be noticed)."""
        while not self.failed and not self.stopping:
            time.sleep(1.0)
            for r in self.replicas:
                silent = time.monotonic() - r.last_seen
                if silent > self.silence_timeout_s and not self.stopping:
                    self._fail(f"replica {r.index} has not answered for {silent:.0f} s (a rank hangs)")

    def _read(self, r: Replica) -> None:
        while True:
            try:
                msg = r.conn.recv()
            except (EOFError, OSError):
                self._fail(f"replica {r.index} disconnected (a rank died)")
                return
            r.last_seen = time.monotonic()
            if msg[0] == "out":
                # one wake-up of each event loop per step, not one per token (each is a write to
                # the loop's self-pipe and a pass of the loop: issue 33's per-token CPU)
                deliver: dict = {}
                for rid, tok, reason, lp in msg[1]:
                    target = self.queues.get(rid)
                    if target:
                        deliver.setdefault(target[0], []).append((target[1], (tok, reason, lp)))
                    if reason:
                        self._release(rid)
                for loop, items in deliver.items():
                    loop.call_soon_threadsafe(_put_all, items)
                r.stats = msg[2]
            elif msg[0] == "stats":
                r.stats = msg[1]
            elif msg[0] == "error":
                self._fail(f"replica {r.index}: {msg[1]}")
                return
            if self.on_stats:
                self.on_stats()

    # ---- requests -----------------------------------------------------------------------

    def submit(self, rid: str, prompt: list[int], params: dict) -> TokenQueue:
        """Send a request to the replica with the fewest outstanding ones; returns the queue
        (:class:`TokenQueue`) its ``(token, finish_reason, logprobs)`` items arrive on.

        Raises:
            EngineFailed: the engines are gone.
        """
        if self.failed:
            raise EngineFailed(self.failed)
        loop = asyncio.get_running_loop()
        q = TokenQueue()
        r = min(self.replicas, key=lambda x: (x.outstanding, x.index))
        self.queues[rid] = (loop, q)
        self.owner[rid] = r
        r.outstanding += 1
        self._send(r, ("add", rid, prompt, params))
        return q

    def abort(self, rid: str) -> None:
        """Cancel ``rid`` (its client went away, or a stop string ended it): its blocks are
        freed at the replica's next step."""
        r = self._release(rid)
        if r is not None and not self.failed:
            self._send(r, ("abort", rid))

    def _release(self, rid: str):
        self.queues.pop(rid, None)
        r = self.owner.pop(rid, None)
        if r is not None:
            r.outstanding -= 1
        return r

    def _send(self, r: Replica, msg) -> None:
        try:
            with r.lock:
                r.conn.send(msg)
        except (OSError, EOFError, ValueError):
            self._fail(f"replica {r.index} disconnected (a rank died)")
            raise EngineFailed(self.failed) from None

    def totals(self) -> dict:
        """The cache and queue, the prefix cache's counters and the preemptions, summed over the replicas."""
        keys = ("blocks_used", "blocks_free", "waiting", "running", "prefix_cache_queries", "prefix_cache_hits",
                "prefill_tokens", "preemptions")
        return {k: sum(r.stats.get(k, 0) for r in self.replicas) for k in keys}

    def stop(self, timeout_s: float = 20.0) -> int:
        """Tell the replicas to stop, wait for torchrun (terminate it after ``timeout_s``);
        returns its exit status."""
        self.stopping = True
        for r in self.replicas:
            try:
                with r.lock:
                    r.conn.send(("stop",))
            except (OSError, EOFError, ValueError):
                pass
        try:
            return self._end_job(2.0 if self.failed else timeout_s)   # a failed job is ended at once
        finally:
            self.listener.close()

    def _end_job(self, grace_s: float) -> int:
        """Wait ``grace_s`` for torchrun to exit, then SIGTERM its process group (torchrun
        stops the ranks), then SIGKILL it (:func:`parcompile.jobs.end`); returns torchrun's
        exit status."""
        return jobs.end(self.proc, grace_s)
