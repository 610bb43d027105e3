"""`GET /metrics` of `parcompile serve`: Prometheus text from ``prometheus_client`` (vLLM's
metric set under the ``parcompile_`` prefix): requests by finish reason, prompt and
generated tokens, time to first token and per output token (histograms, seconds), KV cache
blocks used and free, requests waiting and running, and the prefix cache's queries and hits
(prompt tokens looked up, found cached: vLLM's ``prefix_cache_queries`` / ``_hits``; the hit
rate is hits / queries), the prompt tokens prefilled and the preemptions (running requests whose
KV blocks were taken back for another's, to be recomputed: vLLM's ``num_preemptions``), summed
over the dp replicas."""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class Latency:
    """A latency histogram (seconds) of one model, kept as plain counts by the event loop's
    thread: a token costs a bisect and two additions instead of prometheus_client's locked
    bucket walk (issue 33: the front's CPU per token); :meth:`family` gives it in
    Prometheus's histogram form (``_bucket`` by ``le``, cumulative; ``_count``; ``_sum``).
    A value equal to a bound falls in that bound's bucket (``le``: less or equal)."""

    def __init__(self, name: str, doc: str, buckets: tuple):
        self.name, self.doc, self.bounds = name, doc, tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)      # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def family(self, model: str) -> HistogramMetricFamily:
        f = HistogramMetricFamily(self.name, self.doc, labels=["model"])
        cum, buckets = 0, []
        for bound, n in zip(self.bounds + (float("inf"),), self.counts):
            cum += n
            buckets.append((floatToGoString(bound), cum))
        f.add_metric([model], buckets, self.sum)
        return f


class Metrics:
    """The server's counters, histograms and gauges, in a registry of their own."""

    def __init__(self, model: str):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("parcompile_requests", "finished requests, by finish reason",
                                ["model", "finish_reason"], registry=r)
        self.running_requests = Gauge("parcompile_requests_in_flight", "requests the front is answering",
                                      ["model"], registry=r)
        self.prompt_tokens = Counter("parcompile_prompt_tokens", "prompt tokens of admitted requests", ["model"],
                                     registry=r)
        self.generation_tokens = Counter("parcompile_generation_tokens", "generated tokens", ["model"], registry=r)
        self.ttft = Latency("parcompile_time_to_first_token_seconds", "time from a request to its first token",
                            _TTFT_BUCKETS)
        self.tpot = Latency("parcompile_time_per_output_token_seconds", "time between two output tokens",
                            _TPOT_BUCKETS)
        self.blocks_used = Gauge("parcompile_kv_cache_blocks_used", "KV cache blocks held by requests", ["model"],
                                 registry=r)
        self.blocks_free = Gauge("parcompile_kv_cache_blocks_free", "KV cache blocks free", ["model"], registry=r)
        self.waiting = Gauge("parcompile_requests_waiting", "requests queued for KV cache blocks or a batch slot",
                             ["model"], registry=r)
        self.running = Gauge("parcompile_requests_running", "sequences in the running batch", ["model"], registry=r)
        self.prefix_queries = Counter("parcompile_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                      ["model"], registry=r)
        self.prefix_hits = Counter("parcompile_prefix_cache_hits", "prompt tokens found in the prefix cache (not "
                                   "prefilled)", ["model"], registry=r)
        self.prefill_tokens = Counter("parcompile_prefill_tokens", "prompt tokens prefilled (computed)", ["model"],
                                      registry=r)
        self.preemptions = Counter("parcompile_num_preemptions", "running requests preempted (their KV blocks taken "
                                   "back when the cache was full; recomputed later)", ["model"], registry=r)
        self._seen = {}       # the engines' counters at the last render
        self.model = model
        self._generated = self.generation_tokens.labels(model)
        self.generated = 0    # output tokens, a plain count per token: added to the counter at each render
        self._generated_seen = 0
        r.register(self)      # the latency histograms (:meth:`collect`)

    def request_started(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        self.running_requests.labels(self.model).inc()

    def token(self, seconds: float, first: bool) -> None:
        """One output token, ``seconds`` after the request (first) or the previous token."""
        (self.ttft if first else self.tpot).observe(seconds)
        self.generated += 1

    def tokens(self, n: int, seconds: float, first: bool) -> None:
        """``n`` output tokens that arrived together (one engine step, or steps the reader
        fell behind on), the first ``seconds`` after the request (``first``) or the previous
        token, the others 0 s after it: :meth:`token` ``n`` times with one clock read."""
        (self.ttft if first else self.tpot).observe(seconds)
        if n > 1:
            self.tpot.counts[0] += n - 1         # 0 s: the first bucket (every bound is > 0)
        self.generated += n

    def request_finished(self, reason: str, tokens: int) -> None:
        self.requests.labels(self.model, reason).inc()
        self.running_requests.labels(self.model).dec()

    def collect(self):
        """The latency histograms, for the registry (prometheus_client's collector protocol)."""
        return [self.ttft.family(self.model), self.tpot.family(self.model)]

    def render(self, totals: dict) -> tuple[bytes, str]:
        """The Prometheus text, with the engines' ``totals`` (blocks_used, blocks_free,
        waiting, running) as the gauges and their counters (prefix_cache_queries,
        prefix_cache_hits, prefill_tokens, preemptions) as counters."""
        self.blocks_used.labels(self.model).set(totals["blocks_used"])
        self.blocks_free.labels(self.model).set(totals["blocks_free"])
        self.waiting.labels(self.model).set(totals["waiting"])
        self.running.labels(self.model).set(totals["running"])
        for key, counter in (("prefix_cache_queries", self.prefix_queries), ("prefix_cache_hits", self.prefix_hits),
                             ("prefill_tokens", self.prefill_tokens), ("preemptions", self.preemptions)):
            now = totals.get(key, 0)        # the engines count from their start: add what is new
            if now > self._seen.get(key, 0):
                counter.labels(self.model).inc(now - self._seen.get(key, 0))
                self._seen[key] = now
        if self.generated > self._generated_seen:
            self._generated.inc(self.generated - self._generated_seen)
            self._generated_seen = self.generated
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
