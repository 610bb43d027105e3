"""Files and checkpoints (issue 30, items 6-10): no output deletes what parcompile did not
write, no checkpoint runs code, an untied head is never the embedding by accident, an
unusable checkpoint_dir is found before training, a failed save keeps the previous
checkpoint, a NaN loss ends the run naming its step, and a seed is a 63-bit number.

Everything runs in this process (spec checks, the writers, the generated program's
``main`` at world 1) except one torchrun launch of 2 ranks that shows the run-time stops
agree across ranks (a NaN loss on the last pipeline stage, a save that fails on rank 1).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch

import parcompile
from parcompile.cli import EXIT_SPEC, main
from parcompile.core.outputs import HF_MARKER
from parcompile.diagnostics import SpecError
from parcompile.runtime.train.step import TrainError
from parcompile.runtime.state.weights import WeightsError

REPO = Path(__file__).resolve().parent.parent

SPEC = """model m {{
    layers = 2
    hidden = 32
    heads = 4
    kv_heads = 2
    ffn_hidden = 64
    vocab = 256
    seq_len = 16
    dtype = fp32
}}
cluster c from "cpu" {{ gpus_per_node = {world} }}
parallel {{ pp = {pp}, micro_batch = 2, global_batch = {batch} }}
train {{
    steps = {steps}, lr = {lr}, seed = 3, log_every = 1
{extra}
}}
"""


def _spec(tmp: Path, extra: str = "", *, name="s", steps=3, lr="1e-2", pp=1) -> Path:
    path = tmp / f"{name}.par"
    path.write_text(SPEC.format(extra=extra, steps=steps, lr=lr, pp=pp, world=pp, batch=2 * pp))
    return path


def _check(spec: Path, capsys) -> tuple[int, str]:
    rc = main(["check", str(spec)])
    out = capsys.readouterr()
    return rc, out.err + out.out


def _at(spec: Path, key: str) -> str:
    """``file:line:col`` of ``key``'s value in ``spec``."""
    for i, line in enumerate(spec.read_text().splitlines(), 1):
        m = re.search(rf"\b{key} = ", line)
        if m:
            return f"{spec}:{i}:{m.end() + 1}"
    raise AssertionError(key)


def _program(tmp: Path, spec: Path):
    """Compile ``spec`` into tmp/<stem> and import its program.py."""
    assert main(["compile", str(spec), "-o", str(tmp / spec.stem)]) == 0
    s = importlib.util.spec_from_file_location(f"files_{spec.stem}_{id(tmp)}", tmp / spec.stem / "program.py")
    module = importlib.util.module_from_spec(s)
    s.loader.exec_module(module)
    return module


def _run(module, tmp: Path, *argv) -> dict:
    cwd = os.getcwd()
    try:
        os.chdir(tmp)
        with contextlib.redirect_stdout(io.StringIO()):
            return module.main([str(a) for a in argv])
    finally:
        os.chdir(cwd)


def _tiny_model():
    from parcompile.core.model import ModelKeys

    return ModelKeys(layers=1, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab=256, seq_len=16, dtype="fp32")


def _zeros(model) -> dict[str, torch.Tensor]:
    from parcompile.core.hf_weights import expected_shapes

    return {k: torch.zeros(v) for k, v in expected_shapes(model, buffers=True).items()}


def _dcp_checkpoint(root: Path, state: dict[str, torch.Tensor], step: int = 1) -> Path:
    import torch.distributed.checkpoint as dcp

    path = root / f"step_{step:08d}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({**state, "train/step": torch.tensor(step)}, checkpoint_id=str(path), no_dist=True)
    return path


# ------------------------------------------------------------------ 6. hf_output / export-weights -o


@pytest.fixture
def workdir(tmp_path):
    """A spec's directory as a user has it: training data in data/, a tokenizer.json."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.txt").write_text("hello world " * 200)
    (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize("target, says", [
    ("data", "holding train.txt, which parcompile did not write"),
    ("tokenizer.json", "is a file"),
    (".", "which parcompile did not write"),
    ("tokenizer.json/out", "is a file"),
    ("ck", "overlap"),
])
def test_hf_output_over_what_parcompile_did_not_write_is_a_check_error(workdir, capsys, target, says):
    """Before: `check` passed, and the run replaced the directory (the training data gone),
    the tokenizer by a folder, or crashed every rank (`.`). Now an error at the key."""
    spec = _spec(workdir, f'    data = "data/train.txt"\n    checkpoint_dir = "ck", checkpoint_every = 1\n'
                          f'    hf_output = "{target}"')
    rc, said = _check(spec, capsys)
    assert rc == EXIT_SPEC, said
    assert f"{_at(spec, 'hf_output')}: error: hf_output: " in said and says in said, said
    assert "help: give a new directory" in said
    assert (workdir / "data" / "train.txt").is_file() and (workdir / "tokenizer.json").read_text() == "{}"


def test_hf_output_and_a_checkpoint_dir_symlinked_into_it_overlap(workdir, capsys):
    """Before: the overlap of hf_output and checkpoint_dir compared the paths as written, so
    a checkpoint_dir that is a symbolic link into hf_output passed `check`; the run trained,
    saved its checkpoints there and then could not write hf_output (a directory of other
    files). Now the check sees through the link."""
    (workdir / "out").mkdir()   # an earlier output of parcompile (its marker), to be replaced
    (workdir / "out" / HF_MARKER).write_text(json.dumps({"written_by": "parcompile", "files": []}))
    (workdir / "ck").symlink_to(workdir / "out")
    spec = _spec(workdir, '    checkpoint_dir = "ck", checkpoint_every = 1\n    hf_output = "out"')
    rc, said = _check(spec, capsys)
    assert rc == EXIT_SPEC and f"{_at(spec, 'hf_output')}: error: hf_output: " in said and "overlap" in said, said


def test_preflight_refuses_a_checkpoint_dir_inside_hf_output(tmp_path):
    """Before: `run --checkpoint-dir out/ckpt` with `hf_output = "out"` (the spec's checks never
    see --checkpoint-dir) trained every step, saved into out/ckpt, and failed only when
    hf_output was written. Now preflight refuses it before the first step."""
    from parcompile.runtime import ParallelContext
    from parcompile.runtime.state.checkpoint import preflight

    ctx = ParallelContext(0, 1, {}, torch.device("cpu"), None, distributed=False)
    plan = {"model": {"params": 10, "dtype": "fp32"}}
    preflight(tmp_path / "ck", tmp_path / "out", plan, "adamw", ctx)   # apart: fine
    for ck, out in ((tmp_path / "out" / "ckpt", tmp_path / "out"), (tmp_path / "ck", tmp_path / "ck" / "hf")):
        with pytest.raises(TrainError, match="overlap"):
            preflight(ck, out, plan, "adamw", ctx)
    assert not (tmp_path / "out").exists() and not (tmp_path / "ck").exists()


def test_hf_writer_replaces_only_its_own_output(tmp_path):
    """An output parcompile wrote (its marker lists the files) is replaced; one holding
    anything else, or a file, is refused before anything is written."""
    from parcompile.runtime.state.hf_export import write_hf_checkpoint

    m, out = _tiny_model(), tmp_path / "out"
    write_hf_checkpoint(_zeros(m), m, out)
    marker = json.loads((out / HF_MARKER).read_text())
    assert marker["written_by"] == "parcompile" and set(marker["files"]) == {"config.json", "model.safetensors"}
    write_hf_checkpoint(_zeros(m), m, out)   # again: its own output
    (out / "notes.txt").write_text("mine")
    with pytest.raises(WeightsError, match="holding notes.txt, which parcompile did not write"):
        write_hf_checkpoint(_zeros(m), m, out)
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(WeightsError, match="is a file"):
        write_hf_checkpoint(_zeros(m), m, tmp_path / "file")
    assert (tmp_path / "file").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "out"]   # no temporary left


def _marker_dir(out: Path) -> None:
    (out / HF_MARKER).mkdir()
    (out / HF_MARKER / "notes.txt").write_text("mine")


def _marker_link(out: Path) -> None:   # to the marker of another directory, which lists config.json
    other = out.parent / "other"
    other.mkdir()
    (other / HF_MARKER).write_text(json.dumps({"written_by": "parcompile", "files": ["config.json"]}))
    (out / HF_MARKER).symlink_to(other / HF_MARKER)


def _marker(text: str):
    return lambda out: (out / HF_MARKER).write_text(text)


RUN = {"plan": "a", "plan_digest": "0123456789abcdef", "checkpoint_dir": None, "step": 2}


@pytest.mark.parametrize("marker, says", [
    (_marker("{not json"), "holding .parcompile-output.json, config.json, which parcompile did not write"),
    (_marker("[1, 2]"), "holding .parcompile-output.json, config.json, which parcompile did not write"),
    (_marker('{"written_by": "parcompile", "files": "config.json"}'), "which parcompile did not write"),
    (_marker(json.dumps({"written_by": "parcompile", "files": ["config.json"], "pad": "x" * 2**21})),
     "which parcompile did not write"),   # over MAX_MARKER_BYTES: not read
    (_marker_dir, "holding .parcompile-output.json, config.json, which parcompile did not write"),
    (_marker_link, "holding .parcompile-output.json, config.json, which parcompile did not write"),
    (lambda out: os.mkfifo(out / HF_MARKER), "holding .parcompile-output.json, config.json"),
    (lambda out: (out / HF_MARKER).symlink_to("/dev/zero"), "holding .parcompile-output.json, config.json"),
    (_marker(json.dumps({"written_by": "parcompile", "files": ["config.json"],
                         "run": {**RUN, "plan_digest": 5, "step": "2"}})),
     "another run (a run its .parcompile-output.json does not record readably); pass --force"),
    (_marker(json.dumps({"written_by": "parcompile", "files": ["config.json"],
                         "run": {**RUN, "plan": "x\nerror: forged\u001b[31m" + "A" * 10**5}})),
     "another run (plan `x?error: forged?[31mAAA"),
], ids=["not_json", "a_list", "files_a_string", "over_1_MiB", "a_directory", "a_link_to_another", "a_fifo",
        "dev_zero", "run_of_other_types", "run_name_of_lines"])
def test_a_hostile_or_corrupt_marker_is_refused_in_one_line(tmp_path, marker, says):
    """Issue 47 review: before, a marker that was a directory (of the user's files), a
    symbolic link to another directory's marker, or a bad marker alone let the output be
    replaced (deleting them); a FIFO marker blocked the writer forever, /dev/zero read until
    memory ran out; a run with a digest of another type was replaced without --force; a plan
    name with line breaks or 100,000 characters made the error that many lines or characters.
    Now the marker counts only as a regular file of at most MAX_MARKER_BYTES that parcompile
    wrote, a run of other types is another run's, and the error is one line of < 400 chars;
    the writer refuses before anything is written, removing nothing."""
    from parcompile.core.outputs import hf_output_problem
    from parcompile.runtime.state.hf_export import write_hf_checkpoint

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    marker(out)
    before = sorted(p.name for p in out.iterdir())
    said = hf_output_problem(out, run={**RUN, "plan_digest": "fedcba9876543210"})
    assert said is not None and says in said and "\n" not in said and len(said) < 400, said
    (out / "config.json").unlink()   # the marker alone (no other file) is still refused
    assert hf_output_problem(out, run={**RUN, "plan_digest": "fedcba9876543210"}) is not None
    m = _tiny_model()
    with pytest.raises(WeightsError):
        write_hf_checkpoint(_zeros(m), m, out, run={**RUN, "plan_digest": "fedcba9876543210"})
    assert sorted(p.name for p in out.iterdir()) == [n for n in before if n != "config.json"]
    if (out / HF_MARKER).is_dir():
        assert (out / HF_MARKER / "notes.txt").read_text() == "mine"


def test_export_weights_into_a_directory_of_other_files_is_refused(workdir, capsys):
    """Before: `export-weights -o data` deleted the data directory, exit 0."""
    spec = _spec(workdir)
    cfg = parcompile.compile(spec).config
    from parcompile.frontend.checks import expected_shapes

    _dcp_checkpoint(workdir / "ck", {k: torch.ones(v) for k, v in expected_shapes(cfg.model).items()})
    rc = main(["export-weights", str(spec), str(workdir / "ck"), "-o", str(workdir / "data")])
    said = capsys.readouterr().err
    assert rc == EXIT_SPEC and "which parcompile did not write" in said, said
    assert (workdir / "data" / "train.txt").is_file()
    assert main(["export-weights", str(spec), str(workdir / "ck"), "-o", str(workdir / "hf")]) == 0
    assert main(["export-weights", str(spec), str(workdir / "ck"), "-o", str(workdir / "hf")]) == 0  # its own


@pytest.mark.parametrize("ckpt, says", [("missing", "does not exist"), ("tokenizer.json", "is a file"),
                                         ("fifo", "is a FIFO (named pipe)")])
def test_export_weights_says_what_its_checkpoint_path_is(workdir, capsys, ckpt, says):
    """`export-weights SPEC FILE -o DIR` said "cannot read FILE: no such directory" of a file
    that exists (and of a FIFO); now it says what the path is, as the spec's paths do."""
    os.mkfifo(workdir / "fifo")
    assert main(["export-weights", str(_spec(workdir)), str(workdir / ckpt), "-o", str(workdir / "hf")]) == 2
    said = capsys.readouterr().err
    assert f"cannot read {workdir / ckpt}: it {says}" in said and "no such directory" not in said, said
    assert not (workdir / "hf").exists()


def test_export_weights_refuses_the_output_of_another_run_unless_forced(workdir, capsys):
    """Issue 47: before, `export-weights ... -o hf` replaced the output another run (another
    spec, another checkpoint_dir) had written there, without a word. Now the marker records the
    run (plan name and digest, checkpoint_dir, step); another run's output is refused in one
    line naming it and --force; the same run (a later step) replaces its own."""
    from parcompile.frontend.checks import expected_shapes

    a, b = _spec(workdir, name="a"), _spec(workdir, name="b", lr="2e-2")
    shapes = expected_shapes(parcompile.compile(a).config.model)
    _dcp_checkpoint(workdir / "ck_a", {k: torch.ones(v) for k, v in shapes.items()}, step=2)
    _dcp_checkpoint(workdir / "ck_b", {k: torch.zeros(v) for k, v in shapes.items()}, step=5)
    assert main(["export-weights", str(a), str(workdir / "ck_a"), "-o", str(workdir / "hf")]) == 0
    run = json.loads((workdir / "hf" / HF_MARKER).read_text())["run"]
    assert run["plan"] == "a" and run["step"] == 2 and run["checkpoint_dir"] == os.path.realpath(workdir / "ck_a")
    capsys.readouterr()
    for spec, ckpt in ((b, "ck_b"), (a, "ck_b"), (b, "ck_a")):   # another spec, another checkpoint_dir, both
        rc = main(["export-weights", str(spec), str(workdir / ckpt), "-o", str(workdir / "hf")])
        said = capsys.readouterr().err.strip()
        assert rc == EXIT_SPEC and len(said.splitlines()) == 1, said
        assert "holds the Hugging Face output of another run (plan `a`" in said and "step 2" in said, said
        assert "--force" in said, said
    assert json.loads((workdir / "hf" / HF_MARKER).read_text())["run"] == run   # untouched
    _dcp_checkpoint(workdir / "ck_a", {k: torch.ones(v) for k, v in shapes.items()}, step=3)
    assert main(["export-weights", str(a), str(workdir / "ck_a"), "-o", str(workdir / "hf")]) == 0  # same run
    assert json.loads((workdir / "hf" / HF_MARKER).read_text())["run"]["step"] == 3
    assert main(["export-weights", str(b), str(workdir / "ck_b"), "-o", str(workdir / "hf"), "--force"]) == 0
    assert json.loads((workdir / "hf" / HF_MARKER).read_text())["run"]["plan"] == "b"


def test_hf_output_of_another_run_is_refused_before_training_unless_forced(workdir):
    """Issue 47: before, a training program whose hf_output held another run's output trained
    and replaced it at the end. Now preflight refuses it before the first step, naming the
    run and --force (`parcompile run --force` passes it on); with --force the run writes it."""
    a = _program(workdir, _spec(workdir, '    hf_output = "out"', name="a", steps=1))
    b = _program(workdir, _spec(workdir, '    hf_output = "out"', name="b", steps=1, lr="2e-2"))
    _run(a, workdir)
    run = json.loads((workdir / "out" / HF_MARKER).read_text())["run"]
    assert run["plan"] == "a" and run["step"] == 1 and run["checkpoint_dir"] is None
    _run(a, workdir)   # the same spec again: its own output
    metrics = workdir / "b.jsonl"
    with pytest.raises(TrainError, match=r"another run \(plan `a` .*--force"):
        _run(b, workdir, "--metrics", metrics)
    assert not metrics.exists() or "loss" not in metrics.read_text()   # refused before the first step
    assert json.loads((workdir / "out" / HF_MARKER).read_text())["run"] == run
    _run(b, workdir, "--force")
    assert json.loads((workdir / "out" / HF_MARKER).read_text())["run"]["plan"] == "b"
    assert main(["run", str(_spec(workdir, name="c")), "--force"]) == 2   # no hf_output to force: usage


# ------------------------------------------------------------------ 7. no checkpoint runs code


class _Evil:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _poisoned(tmp_path: Path, spec: Path) -> tuple[Path, Path]:
    """A DCP checkpoint of the spec's model whose .metadata makes a directory when unpickled."""
    from parcompile.frontend.checks import expected_shapes

    cfg = parcompile.compile(spec).config
    step = _dcp_checkpoint(tmp_path / "ck", {k: torch.ones(v) for k, v in expected_shapes(cfg.model).items()})
    canary = tmp_path / "PWNED"
    (step / ".metadata").write_bytes(pickle.dumps(_Evil(str(canary))))
    return tmp_path / "ck", canary


def test_check_and_loads_never_unpickle_a_dcp_metadata(tmp_path, capsys):
    """Before: `check` with init_from a DCP checkpoint ran the pickle in .metadata (torch
    reads it with pickle.load). Now check, export-weights and every loader refuse it,
    naming the function it calls, and nothing runs."""
    base = _spec(tmp_path, name="base")
    ckpt, canary = _poisoned(tmp_path, base)
    spec = _spec(tmp_path, f'    init_from = "{ckpt}"')
    rc, said = _check(spec, capsys)
    assert rc == EXIT_SPEC and "refers to `posix.mkdir`" in said and "refusing to read it" in said, said
    assert f"{_at(spec, 'init_from')}: error: init_from:" in said
    from parcompile.runtime.state import checkpoint
    from parcompile.runtime.state.hf_export import read_dcp_global
    from parcompile.runtime.state.weights import load_dcp

    for load in (lambda: read_dcp_global(ckpt), lambda: load_dcp(torch.nn.Linear(1, 1), str(ckpt / "step_00000001"), None),
                 lambda: checkpoint.load(ckpt, torch.nn.Linear(1, 1), None, None)):
        with pytest.raises(WeightsError, match="posix.mkdir"):
            load()
    assert main(["export-weights", str(base), str(ckpt), "-o", str(tmp_path / "hf")]) == EXIT_SPEC
    assert "posix.mkdir" in capsys.readouterr().err
    assert not canary.exists()


def test_a_tensor_stored_as_a_pickled_object_is_refused(tmp_path):
    """torch reads a BytesStorageMetadata entry with torch.load(weights_only=False): a
    metadata that calls a weight "bytes" is refused before torch reads it."""
    import torch.distributed.checkpoint as dcp

    from parcompile.runtime.state.weights import load_dcp_tensors, read_dcp_metadata

    path = tmp_path / "step_00000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "obj": io.BytesIO(b"x")}, checkpoint_id=str(path), no_dist=True)
    meta = read_dcp_metadata(path)   # a real checkpoint reads
    assert tuple(meta.state_dict_metadata["w"].size) == (2,)
    with pytest.raises(WeightsError, match="stores `obj` as a pickled object"):
        load_dcp_tensors({"obj": torch.empty(1)}, path, True)
    state = {"w": torch.zeros(2)}
    load_dcp_tensors(state, path, True)
    assert state["w"].tolist() == [1.0, 1.0]
    (path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(WeightsError, match="is damaged"):
        read_dcp_metadata(path)


UNSAFE = re.compile(r"\bpickle\.loads?\(|\bUnpickler\(|\bdcp\.load\(|\bFileSystemReader\(|\.read_metadata\(|"
                    r"\btorch\.load\((?![^)]*weights_only=True)")


def test_nothing_in_the_package_unpickles_a_users_file():
    """Every torch.load passes weights_only=True; pickle, DCP's reader and dcp.load are
    used only in parcompile/runtime/state/dcp_safe.py, through weights.read_dcp_metadata and
    weights.load_dcp_tensors (a new unsafe call fails here)."""
    found = []
    for f in sorted((REPO / "parcompile").rglob("*")):
        if f.suffix not in (".py", ".j2") or f.name == "dcp_safe.py":
            continue
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if UNSAFE.search(line.split("#")[0]):
                found.append(f"{f.relative_to(REPO)}:{i}: {line.strip()}")
    assert found == []
    assert UNSAFE.search("torch.load(f)") and UNSAFE.search("torch.load(f, weights_only=False)")
    assert not UNSAFE.search("torch.load(f, weights_only=True)")


# ------------------------------------------------------------------ 8. an untied head is never the embedding


def _untied_without_head(tmp_path: Path, family: str, tied: bool = False):
    """A Hugging Face checkpoint of ``family`` (config from tests/test_hf_weights.py) with
    ``tie_word_embeddings: tied`` and no head tensor; returns (dir, its ModelKeys)."""
    from safetensors.torch import load_file, save_file

    from parcompile.core.hf_weights import model_from_checkpoint_config
    from parcompile.runtime.state.hf_export import write_hf_checkpoint
    from tests.test_hf_weights import _hf_config

    cfg = _hf_config(family).to_dict()
    cfg["tie_word_embeddings"] = False
    m = model_from_checkpoint_config(cfg, seq_len=16, dtype="fp32")
    d = tmp_path / family
    write_hf_checkpoint(_zeros(m), m, d)
    tensors = load_file(str(d / "model.safetensors"))
    head = [k for k in tensors if k in ("lm_head.weight", "embed_out.weight")]
    assert len(head) == 1
    save_file({k: v for k, v in tensors.items() if k not in head}, str(d / "model.safetensors"))
    written = json.loads((d / "config.json").read_text())
    written["tie_word_embeddings"] = tied
    (d / "config.json").write_text(json.dumps(written))
    return d, m, head[0]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "mistral", "gpt_neox", "mixtral", "qwen3", "qwen3_moe"])
def test_untied_checkpoint_without_its_head_is_an_error(tmp_path, family):
    """Before: the embedding silently became the head. Now the check and the loader name
    the missing tensor; a tied checkpoint still reads its head from the embedding."""
    from parcompile.core.hf_weights import check_checkpoint, expected_shapes
    from parcompile.runtime.state.weights import load_hf

    d, m, head = _untied_without_head(tmp_path, family)
    problems = check_checkpoint(d, expected_shapes(m), m)
    assert any(f"no tensor `{head}`" in p.message and "lm_head.weight" in p.message
               and "tie_word_embeddings" in p.help for p in problems), [p.message for p in problems]
    p = torch.nn.Parameter(torch.empty(m.vocab, m.hidden))
    p.global_name, p.global_shape, p.shard_dim, p.valid_rows = "lm_head.weight", (m.vocab, m.hidden), None, None
    holder = torch.nn.Module()
    holder.head = p
    with pytest.raises(WeightsError, match=f"no tensor `{head}` for `lm_head.weight`"):
        load_hf(holder, str(d))
    tied, _, _ = _untied_without_head(tmp_path / "tied", family, tied=True)
    assert check_checkpoint(tied, expected_shapes(m), m) == []
    load_hf(holder, str(tied))


# ------------------------------------------------------------------ 9. checkpoint_dir


def test_unusable_checkpoint_dir_is_a_check_error(tmp_path, capsys, monkeypatch):
    """Before: found after every step had run, with a traceback. Now `check` says so at
    the key: a path under a file, a file, a file system without room for one checkpoint."""
    (tmp_path / "afile").write_text("x")
    for target, says in (("afile/ck", "is a file, so"), ("afile", "is a file, not a directory")):
        spec = _spec(tmp_path, f'    checkpoint_dir = "{target}", checkpoint_every = 1')
        rc, said = _check(spec, capsys)
        assert rc == EXIT_SPEC and f"{_at(spec, 'checkpoint_dir')}: error: checkpoint_dir: " in said, said
        assert says in said, said
    import shutil

    from parcompile.core import outputs

    spec = _spec(tmp_path, '    checkpoint_dir = "ck", checkpoint_every = 1')
    need = outputs.checkpoint_bytes(parcompile.compile(spec).data["model"]["params"], "fp32", "adamw")
    real = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda p: real._replace(free=need - 1))
    with pytest.raises(SpecError) as e:
        parcompile.compile(spec)
    d = e.value.diagnostics[0]
    assert f"{d.span.file}:{d.span.line}:{d.span.column}" == _at(spec, "checkpoint_dir")
    assert "one checkpoint of this plan needs" in d.message and "free on its file system" in d.message


def test_program_checks_its_checkpoint_dir_before_training(tmp_path, monkeypatch):
    """--checkpoint-dir may name another directory: the program looks before step 1."""
    module = _program(tmp_path, _spec(tmp_path, '    checkpoint_dir = "ck", checkpoint_every = 1'))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(TrainError, match=r"checkpoint_dir: `\S+/afile` is a file, so"):
        _run(module, tmp_path, "--checkpoint-dir", tmp_path / "afile" / "ck")
    assert not (tmp_path / "metrics.jsonl").exists() or "step" not in (tmp_path / "metrics.jsonl").read_text()


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """Before: an OSError traceback and a step_N.partial left. Now one TrainError line
    naming the step, why, and the checkpoint kept; the partial step is removed."""
    module = _program(tmp_path, _spec(tmp_path, '    checkpoint_dir = "ck", checkpoint_every = 1', steps=3))
    monkeypatch.setenv("PARCOMPILE_FAIL_SAVE", "0:2")
    with pytest.raises(TrainError) as e:
        _run(module, tmp_path)
    assert re.fullmatch(r"cannot save the checkpoint of step 2 in \S+/ck: No space left on device: \S+; the newest "
                        r"complete checkpoint, \S+/ck/step_00000001, is kept", e.value.message), e.value.message
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_00000001"]


# ------------------------------------------------------------------ 10. NaN loss, seed


def test_nan_loss_stops_the_run_naming_the_step(tmp_path):
    """Before: training went on and wrote NaN weights, exit 0. Now the step whose loss or
    gradient norm is not finite ends the run before anything of it is saved; the
    checkpoints before it hold finite weights; hf_output is not written."""
    from parcompile.runtime.state.hf_export import read_dcp_global

    module = _program(tmp_path, _spec(tmp_path, '    checkpoint_dir = "ck", checkpoint_every = 1\n'
                                                '    hf_output = "hf", grad_clip = 0', steps=8, lr="1e30"))
    with pytest.raises(TrainError) as e:
        _run(module, tmp_path)
    m = re.match(r"step (\d+): the (loss|gradient norm) is (nan|inf); training stopped before saving anything of "
                 r"this step \((the newest checkpoint, \S+, is kept|no checkpoint was saved)\)", e.value.message)
    assert m, e.value.message
    step = int(m.group(1))
    assert 1 < step <= 8
    kept = sorted(int(p.name[5:]) for p in (tmp_path / "ck").glob("step_*"))
    assert kept == list(range(1, step))
    for t in read_dcp_global(tmp_path / "ck").values():
        assert torch.isfinite(t).all()
    assert not (tmp_path / "hf").exists()


def test_nan_help_names_a_checkpoint_only_when_one_was_kept():
    """Before: with no checkpoint saved the help still said "resume from the kept
    checkpoint" beside "(no checkpoint was saved)"."""
    from types import SimpleNamespace

    from parcompile.runtime.train.step import check_grad_norm

    ctx = SimpleNamespace(rank=0)
    with pytest.raises(TrainError) as e:
        check_grad_norm(float("nan"), 2, ctx, None)
    assert "no checkpoint was saved" in e.value.message and "kept checkpoint" not in e.value.help
    assert "checkpoint_dir" in e.value.help
    with pytest.raises(TrainError) as e:
        check_grad_norm(float("inf"), 3, ctx, "ck/step_00000002")
    assert "ck/step_00000002, is kept" in e.value.message and "resume from the kept checkpoint" in e.value.help


@pytest.mark.parametrize("value", ["9223372036854775808", "-1"])
def test_seed_outside_63_bits_is_a_spec_error(tmp_path, capsys, value):
    spec = _spec(tmp_path)
    spec.write_text(spec.read_text().replace("seed = 3", f"seed = {value}"))
    rc, said = _check(spec, capsys)
    assert rc == EXIT_SPEC and f"{_at(spec, 'seed')}: error: seed must " in said, said
    spec.write_text(spec.read_text().replace(f"seed = {value}", "seed = 9223372036854775807"))
    assert _check(spec, capsys)[0] == 0


# ------------------------------------------------------------------ ranks agree (one launch)


@pytest.mark.torchrun
def test_run_time_stops_agree_across_ranks(tmp_path):
    """pp 2 in one torchrun launch: a NaN loss (computed on the last stage only) and a save
    that fails on rank 1 only end the job on both ranks together, rank 0 saying why in
    one line, no rank left waiting; the checkpoint before the failed save is kept."""
    from tests.program_utils import run_in_one_launch

    nan = _program(tmp_path, _spec(tmp_path, "    grad_clip = 0", name="nan", steps=8, lr="1e30", pp=2))
    save = _program(tmp_path, _spec(tmp_path, f'    checkpoint_dir = "{tmp_path}/ck", checkpoint_every = 1',
                                    name="save", steps=3, pp=2))
    jobs = [(Path(nan.__file__), []), (Path(save.__file__), [])]
    os.environ["PARCOMPILE_FAIL_SAVE"] = "1:2"
    try:
        log = _launch_expecting_errors(jobs, tmp_path / "jobs.json")
    finally:
        del os.environ["PARCOMPILE_FAIL_SAVE"]
    assert re.search(r"^job 0: error: step \d+: the (loss|gradient norm) is (nan|inf)", log, re.M), log
    assert re.search(r"^job 1: error: cannot save the checkpoint of step 2 in \S+/ck: No space left on device",
                     log, re.M), log
    assert "Traceback" not in log
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_00000001"]


def _launch_expecting_errors(jobs, jobs_file: Path) -> str:
    from parcompile.verification import _torchrun

    jobs_file.write_text(json.dumps([{"program": str(p), "argv": a, "expect_error": True} for p, a in jobs]))
    proc = _torchrun(2, ["-m", "parcompile.runtime.distributed.batch", str(jobs_file)], 300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


# ------------------------------------------------------------------ what a fuzz of bad files found


def test_bad_files_found_by_fuzzing_are_diagnostics(tmp_path):
    """Each was a traceback: a tokenizer.json that loads but cannot encode (WordLevel
    without its [UNK]); a DCP data file cut short; a safetensors header that safetensors
    refuses (a gap between tensors, an unknown dtype) while the check passed; a
    config.json with vocab_size -1 (a pydantic error inside the plan)."""
    from safetensors.torch import save_file

    from parcompile.api import prepare_data
    from parcompile.core.hf_weights import read_header
    from parcompile.runtime.state.hf_export import read_dcp_global

    (tmp_path / "d.txt").write_text("hello world " * 100)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {
        "type": "WordLevel", "vocab": {"a": 0}, "unk_token": "b"}}))
    spec = _spec(tmp_path, '    data = "d.txt"\n    tokenizer = "tokenizer.json"')
    diags = prepare_data(parcompile.compile(spec).config)
    assert [d.severity for d in diags] == ["error"] and "cannot encode the data" in diags[0].message, diags

    step = _dcp_checkpoint(tmp_path / "ck", {"embedding.weight": torch.zeros(3, 3)})
    data = next(step.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:20])
    with pytest.raises(WeightsError, match="cannot read the checkpoint"):
        read_dcp_global(tmp_path / "ck")

    f = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(2), "b": torch.zeros(2)}, str(f))
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    for edit, says in ((lambda h: h["b"].update(data_offsets=[12, 20]), "gap or overlap"),
                       (lambda h: h["a"].update(dtype="x"), "dtype 'x'")):
        h = json.loads(json.dumps(header))
        edit(h)
        hb = json.dumps(h).encode()
        f.write_bytes(len(hb).to_bytes(8, "little") + hb + raw[8 + n:] + (b"\0" * 4 if "gap" in says else b""))
        _, problems = read_header(f)
        assert problems and says in problems[0].message, problems

    (tmp_path / "cfg").mkdir()
    cfg = json.loads((REPO / "tests" / "data" / "hf" / "llama-2-7b.json").read_text())
    cfg["vocab_size"] = -1
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "cfg" / "s.par").write_text('model m from "config.json" { seq_len = 16 }\n'
                                            'cluster c from "cpu" { gpus_per_node = 1 }\n')
    with pytest.raises(SpecError) as e:
        parcompile.compile(tmp_path / "cfg" / "s.par")
    assert any("gives an invalid vocab" in d.message and "`-1`" in d.message for d in e.value.diagnostics), e.value.diagnostics


# ------------------------------------------------------------------ JSON nested too deeply

DEEP = "[" * 100_000 + "]" * 100_000   # json's decoder recurses once per `[`: RecursionError


def test_json_files_nested_too_deeply_are_bad_files_not_tracebacks(tmp_path, capsys, monkeypatch):
    """Before: a config.json the spec imports, a damaged cpu-probe cache, an hf_output's
    marker or a safetensors header nested 100,000 deep was a RecursionError traceback out of
    `check` (the cache: out of every command). Now each reads as JSON that is not valid:
    the importer's diagnostic, a cache probed again, a marker that is not parcompile's, a
    damaged checkpoint file."""
    from parcompile.frontend import host
    from parcompile.core.hf_weights import read_header
    from parcompile.core.outputs import written_files

    (tmp_path / "cj").mkdir()
    (tmp_path / "cj" / "config.json").write_text(DEEP)
    spec = tmp_path / "cj.par"
    spec.write_text('model m from "cj/config.json" { }\ncluster c from "h100-sxm" { nodes = 1 }\n'
                    'parallel { tp = 1 }\ntrain { steps = 1 }\n')
    rc, said = _check(spec, capsys)
    assert rc == EXIT_SPEC and "is not valid JSON: nested too deeply" in said, said

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "xdg" / "parcompile").mkdir(parents=True)
    (tmp_path / "xdg" / "parcompile" / "cpu-probe.json").write_text(DEEP)
    monkeypatch.setattr(host, "probe", lambda: (2e9, 4e9, 2e-5))
    assert host.probed_rates()[:2] == (2e9, 4e9)

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / HF_MARKER).write_text(DEEP)
    assert written_files(tmp_path / "out") is None

    raw = DEEP.encode()
    (tmp_path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    _, problems = read_header(tmp_path / "model.safetensors")
    assert problems and "nested too deeply" in problems[0].message, problems
