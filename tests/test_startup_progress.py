"""Start-up progress (issue 47): `parcompile run` printed nothing between `running: torchrun
...` and the first step, and `parcompile serve` nothing between "starting" and "serving";
now rank 0 says each stage as it ends (parcompile/runtime/progress.py Startup), a tqdm bar
where a terminal watches, plain flushed lines in a pipe.

The launches read the front's stdout line by line as it comes, each line stamped with the
time it arrived: the stage lines must come in order and before the first step / before the
server answers /health, not all at once at the end."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import time

import pytest

from parcompile.runtime.progress import Startup
from tests.serve_utils import free_port, stop_server, tiny_serve_spec

SPEC = """
model small {
    layers = 2
    hidden = 64
    heads = 4
    ffn_hidden = 128
    vocab = 256
    seq_len = 32
    dtype = fp32
}
cluster local from "cpu" {
    gpus_per_node = 2
}
parallel {
    dp = 2
    micro_batch = 1
    global_batch = 2
}
train {
    lr = 1e-3
    steps = 3
    data = "synthetic"
    log_every = 1
}
"""


class _Lines:
    """The lines of ``proc.stdout``, each with the monotonic time it was read, read by a thread."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, needle: str) -> tuple[int, float]:
        """(index, arrival time) of the first line containing ``needle``."""
        for i, (t, line) in enumerate(self.lines):
            if needle in line:
                return i, t
        raise AssertionError(f"no line with {needle!r} in:\n" + self.text())

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _in_order(lines: _Lines, needles: list[str]) -> list[float]:
    """The arrival times of the first line with each of ``needles``, which must come in that order."""
    found = [lines.first(n) for n in needles]
    assert [i for i, _ in found] == sorted(i for i, _ in found), lines.text()
    return [t for _, t in found]


@pytest.mark.torchrun
def test_run_prints_each_start_up_stage_as_it_ends_before_the_first_step(tmp_path):
    spec = tmp_path / "small.par"
    spec.write_text(SPEC)
    proc = subprocess.Popen([sys.executable, "-m", "parcompile", "run", str(spec), "-o", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = _Lines(proc)
    assert proc.wait(300) == 0
    lines.thread.join(10)
    times = _in_order(lines, ["running: torchrun", "process group up: 2 ranks (gloo)", "data ready: synthetic",
                              "model built: ", "training steps 1..3", "step 1/3", "done: 3 steps"])
    for needle in ("process group up", "data ready", "model built", "training steps"):   # rank 0 only: once
        assert sum(needle in line for _, line in lines.lines) == 1, lines.text()
    assert times[1] < times[5] and times[3] < times[5]     # read before the first step's line arrived


@pytest.mark.torchrun
def test_serve_prints_each_start_up_stage_before_it_answers(tmp_path):
    import httpx

    spec = tmp_path / "s.par"
    spec.write_text(tiny_serve_spec(batch=2, prompt_len=8, max_new_tokens=8, kv_cache_tokens=256))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "parcompile", "serve", str(spec), "-o", str(tmp_path / "out"),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = _Lines(proc)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, lines.text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    healthy = time.monotonic()
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        time.sleep(0.5)    # the "serving" line is printed just before uvicorn answers
        times = _in_order(lines, ["starting 1 rank(s)", "start-up ", "model built: ", "weights drawn from seed",
                                  "KV cache allocated: 16 blocks of 16 tokens", "engine ready", "serving `tiny` on"])
        assert all(t < healthy for t in times[:-1]), lines.text()   # each stage arrived before /health answered
    finally:
        stop_server(proc)


def test_plain_lines_in_a_pipe_and_a_bar_on_a_terminal():
    pipe = io.StringIO()
    s = Startup(2, enabled=True, stream=pipe)
    assert s.bar is None
    s.done("first")
    s.done("second")
    s.close()
    lines = pipe.getvalue().splitlines()
    assert [line.split(" | ", 1)[1] for line in lines] == ["first", "second"]
    assert all(line.startswith("start-up ") and line.split()[2] == "s" for line in lines)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    tty = Terminal()
    s = Startup(2, enabled=True, stream=tty)
    assert s.bar is not None                                       # tqdm's
    s.done("first")
    assert s.bar.n == 1 and "first" in tty.getvalue()
    s.close()
    assert s.bar is None


def test_only_rank_0_speaks_and_the_time_counts_from_the_process_start(monkeypatch):
    pipe = io.StringIO()
    monkeypatch.setenv("RANK", "1")
    s = Startup(1, stream=pipe)
    s.done("quiet")
    assert pipe.getvalue() == "" and not s.enabled
    monkeypatch.setenv("RANK", "0")
    assert Startup(1, stream=pipe).enabled
    if sys.platform.startswith("linux"):                          # importing torch counts: the process's age
        out = subprocess.run([sys.executable, "-c", "import time; time.sleep(1.0); "
                              "from parcompile.runtime.progress import process_age_s; print(process_age_s())"],
                             capture_output=True, text=True, check=True).stdout
        assert 1.0 <= float(out) < 60


@pytest.mark.torchrun
def test_run_says_the_weights_path_as_the_spec_names_it(tmp_path, monkeypatch):
    """`init_from = "."` in a spec beside its model, the program written elsewhere (``-o``):
    the start-up line names the model directory absolute (was ``../tiny_hf``, the path as the
    generated program opens it, relative to the program's folder), and the data line the
    data and evaluation files absolute (was ``<program's folder>/../tiny_hf/train.jsonl``:
    the ``--data`` default joined, not normalised)."""
    from tests.test_training_jobs import _load_make_tiny

    monkeypatch.setenv("PARCOMPILE_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "tiny_hf"
    _load_make_tiny().main([str(model)])
    text = (model / "finetune.par").read_text().replace("gpus_per_node = 8", "gpus_per_node = 1")
    for old, new in (("dp = 2", "dp = 1"), ("tp = 2", "tp = 1"), ("pp = 2", "pp = 1"), ("global_batch = 16", "global_batch = 2")):
        text = text.replace(old, new)
    (model / "one.par").write_text(text)
    run = subprocess.run([sys.executable, "-m", "parcompile", "run", str(model / "one.par"), "-o", str(tmp_path / "prog"),
                          "--steps", "1"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    built = [line for line in run.stdout.splitlines() if "model built: " in line]
    assert len(built) == 1 and built[0].endswith(f", weights loaded from {model.resolve()}"), built
    data = [line for line in run.stdout.splitlines() if "data ready: " in line]
    want = f"data ready: {model.resolve() / 'train.jsonl'}, evaluation {model.resolve() / 'eval.jsonl'}"
    assert len(data) == 1 and data[0].endswith(want), data
