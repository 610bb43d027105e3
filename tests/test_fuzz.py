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

import pytest
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


# -- config.json imports (issue 30's fuzz): every value a config.json may hold ----------------

HF_BASE = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "hidden_act": "silu",
           "rope_scaling": {"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 32,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0}}
HF_VALUES = [None, True, 0, -1, 2**70, 10**400, 1e308, float("nan"), 0.5, "", "x", [], {}, [1, 2], "9" * 50]
HF_SPEC = """model m from "{path}" {{
}}
cluster c from "cpu" {{
    gpus_per_node = 1
}}
parallel {{
    micro_batch = 1
    global_batch = 1
}}
train {{
    lr = 1e-3
}}
"""


def import_or_diagnostics(config: dict | str) -> list:
    """Check a spec importing ``config`` (a dict, or the file's text); only a plan or a
    SpecError may come out. Returns the error diagnostics."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(config if isinstance(config, str) else json.dumps(config))
        text = HF_SPEC.format(path=path)
        with time_limit(TIMEOUT_S, text + path.read_text()[:2000]):
            try:
                parcompile.compile(text, filename="fuzz.par")
            except SpecError as e:
                for d in e.diagnostics:
                    assert d.render(text) and d.span.line >= 1
                return [d for d in e.diagnostics if d.severity == "error"]
    return []


def _qwen3(**kw):
    return {**{k: v for k, v in HF_BASE.items() if k != "rope_scaling"}, "model_type": "qwen3", "head_dim": 16, **kw}


@pytest.mark.parametrize("config, message", [
    # each was a traceback (or a hang) found by the fuzz of issue 30
    ({**HF_BASE, "vocab_size": 10**400}, "`{path}` gives vocab an integer of 401 digits"),
    ({**HF_BASE, "num_attention_heads": -1}, "`{path}` gives an invalid heads: heads must be at least 1, got `-1`"),
    ({**HF_BASE, "max_position_embeddings": -1}, "gives an invalid seq_len: seq_len must be at least 1, got `-1`"),
    ({**HF_BASE, "rope_scaling": {"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": []}},
     "`original_max_position_embeddings` in the config.json should be an integer, got []"),
    ({**HF_BASE, "rope_scaling": {"rope_type": "yarn", "factor": "", "original_max_position_embeddings": 32}},
     '`factor` in the config.json should be a number, got ""'),
    ({**HF_BASE, "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": "silu"}},
     '`original_max_position_embeddings` in the config.json should be an integer, got "silu"'),
    ({**HF_BASE, "rope_scaling": {"rope_type": "llama3", "factor": [1, 2], "original_max_position_embeddings": 32}},
     "`factor` in the config.json should be a number, got [1, 2]"),
    ({**HF_BASE, "rms_norm_eps": 10**400}, "`rms_norm_eps` in the config.json should be a number a float can hold"),
    (_qwen3(num_hidden_layers=10**400),      # built a per-layer list of 10**400 entries: never finished
     "`num_hidden_layers` in the config.json is an integer of 401 digits: more layers than parcompile plans"),
])
def test_config_json_values_that_crashed_are_diagnostics(config, message):
    errors = import_or_diagnostics(config)
    assert errors, "no error"
    assert any(message.split("{path}")[-1] in d.message for d in errors), [d.message for d in errors]
    assert all((d.span.line, d.span.column) == (1, 14) for d in errors)   # at the `from` source


@fuzz(40)
@given(st.sampled_from([HF_BASE, _qwen3()]),
       st.lists(st.tuples(st.sampled_from(sorted(set(HF_BASE) | {"head_dim", "rope_scaling.factor",
                                                                  "rope_scaling.original_max_position_embeddings"})),
                          st.sampled_from(HF_VALUES)), min_size=1, max_size=3))
def test_fuzz_config_json_values(base, changes):
    config = {**base, "rope_scaling": dict(base.get("rope_scaling") or {"rope_type": "yarn"})}
    for key, value in changes:
        if key.startswith("rope_scaling."):
            if not isinstance(config["rope_scaling"], dict):
                config["rope_scaling"] = {"rope_type": "yarn"}
            config["rope_scaling"][key.split(".", 1)[1]] = value
        else:
            config[key] = value
    import_or_diagnostics(config)
