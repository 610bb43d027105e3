"""Property-based tests: random and mutated specs give a plan or diagnostics, nothing else.

No traceback (any exception other than :class:`SpecError` fails), no hang (each example
runs under a wall-clock alarm), and every diagnostic renders. CI runs a few hundred
examples (310 in all); set ``PARCOMPILE_FUZZ_EXAMPLES`` for more, e.g.::

    PARCOMPILE_FUZZ_EXAMPLES=5000 python -m pytest tests/test_fuzz.py -q

(the number is per test). ``PARCOMPILE_FUZZ_TIMEOUT`` sets the seconds one example may take
(default 20).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import parcompile
from parcompile.diagnostics import SpecError

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"

_ENV = os.environ.get("PARCOMPILE_FUZZ_EXAMPLES", "").strip()
TIMEOUT_S = float(os.environ.get("PARCOMPILE_FUZZ_TIMEOUT", "20"))


def fuzz(ci_examples: int):
    """Hypothesis settings: ``ci_examples`` (derandomized, so CI is repeatable) unless
    ``PARCOMPILE_FUZZ_EXAMPLES`` asks for more (then random, a new sample each run)."""
    return settings(max_examples=int(_ENV) if _ENV else ci_examples, deadline=None, database=None,
                    derandomize=not _ENV, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

PIECES = ["model", "cluster", "parallel", "train", "serve", "from", '"cpu"', '"llama3-8b"', '"h100-sxm"',
          '"mixtral-8x7b"', '"x.json"', "{", "}", "=", ",", "\n", " ", "[", "]", "tp", "dp", "pp", "cp", "ep",
          "expert_tp", "auto", "0", "-1", "1", "2", "3", "7", "8", "16", "1e999", "nan", "0.5", "1e-300", "GiB",
          "Gb/s", "TFLOPS", "ms", "%", "true", "false", "heads", "kv_heads", "layers", "hidden", "vocab",
          "seq_len", "global_batch", "micro_batch", "stage_layers", "virtual_stages", "schedule",
          "interleaved_1f1b", "zero_bubble", "gpipe", "sequence_parallel", "zero", "recompute", "order",
          '"tp-cp-ep-dp-pp"', '"x"', "#", "\\", '"', "@", "1f1b", "experts", "top_k", "99999999999999999999",
          "1" * 400, "\t", "\r\n", "\u00e9", "\u2028", "\x00", "[8, 8, 7, 7]", "[]", "[[1]]", "batch",
          "prompt_len", "max_new_tokens", "data", '"synthetic"', '"/etc/passwd"', "checkpoint_every"]
SEEDS = [p.read_text() for p in sorted(EXAMPLES.glob("*.par"))] + [
    (REPO / "tests" / "data" / "spec_example.par").read_text()]
# Values that are valid one by one but stress the compiler together (huge or odd sizes).
VALUES = ["1", "2", "3", "4", "8", "16", "64", "1024", "65536", "1_000_000", "2147483648", "10**9",
          "auto", "0", "-4", "1.5", "true", '"s"', "[1, 2]", "4 GiB", "1e30", "100 %"]
KEYS = {
    "model": ["layers", "hidden", "heads", "kv_heads", "head_dim", "ffn_hidden", "vocab", "seq_len",
              "experts", "top_k", "sliding_window", "rotary_fraction", "vocab_multiple", "dense_layers"],
    "parallel": ["dp", "tp", "pp", "cp", "ep", "expert_tp", "micro_batch", "global_batch", "virtual_stages",
                 "zero", "stage_layers"],
    "cluster": ["nodes", "gpus_per_node", "memory", "memory_reserve"],
    "train": ["steps", "lr", "log_every", "warmup_steps"],
}


class Hang(Exception):
    """An example ran past the fuzz timeout."""


@contextlib.contextmanager
def time_limit(seconds: float, text: str):
    """Raise :class:`Hang` (naming the spec) when the block runs longer than ``seconds``."""
    def on_alarm(signum, frame):
        raise Hang(f"no result after {seconds:g} s for the spec:\n{text}")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def plan_or_diagnostics(text: str) -> None:
    """Compile ``text`` all the way to a plan; only a plan or a SpecError may come out."""
    with time_limit(TIMEOUT_S, text):
        try:
            plan = parcompile.compile(text, filename="fuzz.par")
        except SpecError as e:
            assert e.diagnostics, "SpecError without diagnostics"
            assert any(d.severity == "error" for d in e.diagnostics)
            for d in e.diagnostics:
                assert d.render(text) and d.span.line >= 1 and d.span.column >= 1
            return
        assert plan.to_json().startswith("{")


@fuzz(150)
@given(st.lists(st.sampled_from(PIECES), max_size=40).map(" ".join) | st.text(max_size=200))
def test_fuzz_random_text(text):
    plan_or_diagnostics(text)


@fuzz(80)
@given(st.sampled_from(SEEDS), st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 12),
                                                  st.sampled_from(PIECES + [""])), min_size=1, max_size=4))
def test_fuzz_mutated_specs(seed, edits):
    text = seed
    for at, cut, piece in edits:
        at %= len(text) + 1
        text = text[:at] + piece + text[at + cut:]
    plan_or_diagnostics(text)


@fuzz(80)
@given(st.sampled_from(SEEDS[-1:] + [s for s in SEEDS if "tiny" in s.lower()]),
       st.lists(st.tuples(st.sampled_from(sorted(KEYS)), st.data()), min_size=1, max_size=4))
def test_fuzz_values_of_valid_keys(seed, changes):
    """Well-formed specs with extreme or odd values for real keys (sizes, degrees, batches)."""
    text = seed
    for block, data in changes:
        key = data.draw(st.sampled_from(KEYS[block]))
        value = data.draw(st.sampled_from(VALUES))
        head = text.find(block + " ") if block != "parallel" else text.find("parallel {")
        if head < 0:
            continue
        brace = text.index("{", head) + 1
        lines = text[brace:].split("\n")
        kept = [ln for ln in lines if ln.split("=")[0].strip() != key]
        text = text[:brace] + f"\n    {key} = {value}" + "\n".join(kept)
    plan_or_diagnostics(text)
