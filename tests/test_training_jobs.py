"""Real training jobs end to end (issue 15): a Hugging Face model and tokenizer made here
with transformers and tokenizers (nothing from a hub), jsonl data, `init_from`, evaluation,
`hf_output`, resume, the fine-tuning formats and the diagnostics of bad input.

Each distributed run is the generated program under torchrun (gloo); its reference is the
same spec at world 1 run in this process, compared as `parcompile verify` compares
(losses, first-step gradients, updated weights, collectives and bytes per rank against
the plan). transformers' own classes are the reference for the losses and the weights
written out.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import parcompile
from parcompile.api import prepare_data
from parcompile.verification import Tolerances, _run_reference, _run_torchrun, compare, reference, run_batched
from tests.program_utils import run_in_one_launch

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (pip install -e .[test])")
pytest.importorskip("tokenizers", reason="tokenizers is a test dependency")

REPO = Path(__file__).resolve().parent.parent
SEQ = 32


def _load_make_tiny():
    spec = importlib.util.spec_from_file_location("make_tiny_hf", REPO / "examples" / "make_tiny_hf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """One tokenizer and dataset, and a tiny random model per family, made by the shipped
    script's functions (examples/make_tiny_hf.py)."""
    root = tmp_path_factory.mktemp("hf_assets")
    os.environ["PARCOMPILE_CACHE"] = str(root / "token_cache")
    mk = _load_make_tiny()
    texts = mk.corpus()
    vocab = mk.make_tokenizer(root / "tok", 400, texts)
    mk.write_data(root, texts)
    for family in ("llama", "qwen2", "gpt2"):
        mk.make_model(root / family, family, vocab, layers=4, hidden=32, heads=4, kv_heads=2, ffn=64,
                      max_positions=64, seed=11)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(root / "tok" / f, root / family / f)
    return root


def _spec(root: Path, name: str, family: str, *, dp=2, tp=2, pp=2, cp=1, parallel="", train="", dtype="fp32",
          data="train.jsonl", eval_data='"eval.jsonl"', steps=5, seq=SEQ) -> Path:
    world = dp * tp * pp * cp
    text = f"""model m from "{family}/config.json" {{
    seq_len = {seq}
    dtype = {dtype}
}}
cluster c from "cpu" {{ gpus_per_node = {world} }}
parallel {{
    dp = {dp}, tp = {tp}, pp = {pp}, cp = {cp}, micro_batch = 1, global_batch = 8
    {parallel}
}}
train {{
    init_from = "{family}"
    data = "{data}"
    {"eval_data = " + eval_data if eval_data else ""}
    eval_batches = 2
    steps = {steps}, lr = 2e-3, seed = 3, log_every = 1
    hf_output = "out_{name}"
    {train}
}}
"""
    path = root / f"{name}.par"
    path.write_text(text)
    return path


def _write(plan, out: Path) -> None:
    plan.write(out)


def _prepared(spec: Path, out: Path):
    """Compile ``spec``, prepare its data, write the program to out/prog and run its world-1
    reference in this process (metrics in out/ref_metrics). Returns the plan."""
    plan = parcompile.compile(spec)
    cfg = plan.config
    assert not [d for d in prepare_data(cfg) if d.severity == "error"]
    _write(plan, out / "prog")
    ref_cfg = reference(cfg)
    ref_cfg = ref_cfg.model_copy(update=dict(train=cfg.train.model_copy(update=dict(
        hf_output=str(out / "ref_hf")))))
    ref_plan = parcompile.driver.compile_config(ref_cfg)
    _write(ref_plan, out / "ref")
    _run_reference(out / "ref", out / "ref_metrics", cfg.train.steps)
    return plan


def _compared(plan, out: Path):
    """The run in out/prog/metrics against its reference, as `parcompile verify` compares."""
    cfg = plan.config
    return compare(out / "ref_metrics", out / "prog" / "metrics", plan.data, cfg, Tolerances.for_dtype(cfg.model.dtype))


def _job(spec: Path, out: Path):
    """Compile ``spec``, prepare its data, run it under torchrun (metrics in out/prog/metrics)
    and its world-1 reference in this process (out/ref). Returns (plan, verify result)."""
    plan = _prepared(spec, out)
    _run_torchrun(out / "prog", out / "prog" / "metrics", plan.config.parallel.world_size, plan.config.train.steps,
                  600, None)
    return plan, _compared(plan, out)


# The 4-rank jobs: (test, spec keywords). They run one after another in ONE torchrun launch
# (runtime.batch, through verify.run_batched: a failing job is its own failure and the rest
# still run); starting torchrun costs more than each of these runs on CI's 2 cores.
FOUR_RANK = {
    "qwen2": ("test_qwen2_qkv_bias_tied_zero1",
              dict(family="qwen2", dp=2, tp=2, pp=1, parallel="zero = 1", steps=3)),
    "gpt2": ("test_gpt2_bias_tied_learned_positions_zero3",
             dict(family="gpt2", dp=2, tp=1, pp=2, parallel="zero = 3", steps=3)),
    "zero3_pp1": ("test_llama_zero3_pp1_evaluates",   # the output layer gathered per micro-batch
                  dict(family="llama", dp=4, tp=1, pp=1, parallel="zero = 3", steps=3)),
    "llama_bf16": ("test_llama_bf16", dict(family="llama", dp=2, tp=2, pp=1, dtype="bf16", steps=3)),
    "sft": ("test_prompt_completion_loss_and_gradients_dp2_pp2_four_microbatches",
            dict(family="llama", dp=2, tp=1, pp=2, data="sft.jsonl", eval_data=None, steps=3,
                 train="data_format = prompt_completion", seq=48)),
    "chat": ("test_chat_loss_and_gradients_dp2_pp2_four_microbatches",
             dict(family="llama", dp=2, tp=1, pp=2, data="chat.jsonl", eval_data=None, steps=3,
                  train="data_format = chat", seq=48)),
}


@pytest.fixture(scope="module")
def four_rank(assets, request):
    """name -> (plan, verify result, or the exception its run raised) of the FOUR_RANK jobs
    whose tests are selected in this session, run in one launch."""
    selected = {item.originalname for item in request.session.items
                if getattr(item, "module", None) is request.module}
    names = [n for n, (test, _) in FOUR_RANK.items() if test in selected]
    plans = {n: _prepared(_spec(assets, n, **FOUR_RANK[n][1]), assets / f"run_{n}") for n in names}
    failures = run_batched([assets / f"run_{n}" / "prog" for n in names], 4, 3, 600, assets) if names else []
    out = {}
    for n, failure in zip(names, failures):
        try:
            out[n] = (plans[n], failure or _compared(plans[n], assets / f"run_{n}"))
        except (OSError, ValueError, KeyError) as e:   # a run that wrote incomplete metrics
            out[n] = (plans[n], RuntimeError(f"comparing {n}: {e!r}"))
    return out


def _batched(four_rank, name: str):
    plan, result = four_rank[name]
    if isinstance(result, Exception):
        raise result
    return plan, result


def _metrics(prog: Path) -> list[dict]:
    return [json.loads(line) for line in (prog / "metrics.jsonl").read_text().splitlines()]


def _hf_eval_loss(model_dir: Path, cfg) -> float:
    """transformers' own cross-entropy over the spec's eval samples (the same cut) of the
    checkpoint in ``model_dir``."""
    return model_eval_loss(transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval(),
                           cfg)


def model_eval_loss(hf, cfg) -> float:
    """The cross-entropy of ``hf`` (a transformers causal LM, or peft's model over one) over
    the spec's eval samples (the same cut)."""
    from parcompile.runtime.data import dataset

    t = cfg.train
    cache = dataset.prepare(t.eval_data, tokenizer=t.tokenizer, data_format=t.data_format, text_field=t.text_field)
    batches = dataset.EvalBatches(cache, cfg.model.seq_len, cfg.parallel.global_batch, t.eval_batches)
    total, count = 0.0, 0
    with torch.no_grad():
        for b in range(len(batches)):
            x, y = batches.batch(b)
            logits = hf(input_ids=x[:, :-1]).logits
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), y.reshape(-1),
                                     ignore_index=-100, reduction="sum").item()
            count += int((y != -100).sum())
    return total / count


def _same_weights(a: Path, b: Path, atol: float, rtol: float) -> None:
    from safetensors.torch import load_file

    sa = {k: v for f in sorted(a.glob("*.safetensors")) for k, v in load_file(f).items()}
    sb = {k: v for f in sorted(b.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k].float(), sb[k].float(), atol=atol, rtol=rtol, msg=k)


def _check_job(assets: Path, name: str, family: str | None = None, four_rank=None, **kw):
    """A job's run against its reference, transformers' eval losses and the written
    checkpoint; a FOUR_RANK job's run comes from the shared launch (``four_rank``)."""
    if four_rank is not None:
        plan, result = _batched(four_rank, name)
        family = FOUR_RANK[name][1]["family"]
    else:
        plan, result = _job(_spec(assets, name, family, **kw), assets / f"run_{name}")
    assert result.ok, result.table()
    cfg = plan.config
    evals = [r for r in _metrics(assets / f"run_{name}" / "prog") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, cfg.train.steps]
    fp32 = cfg.model.dtype == "fp32"
    # step 0: the program's eval loss is transformers' loss on the same samples, same weights
    want0 = _hf_eval_loss(assets / family, cfg)
    assert evals[0]["eval_loss"] == pytest.approx(want0, rel=1e-5 if fp32 else 2e-2)
    # the Hugging Face checkpoint written after the last step holds the trained model
    out = assets / f"out_{name}"
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert evals[1]["eval_loss"] == pytest.approx(_hf_eval_loss(out, cfg), rel=1e-5 if fp32 else 2e-2)
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]          # it trained
    _same_weights(out, assets / f"run_{name}" / "ref_hf", *((1e-4, 1e-4) if fp32 else (4e-2, 2e-2)))
    return plan, result, out


@pytest.mark.torchrun
def test_llama_fine_tune_dp2_tp2_pp2_matches_one_process_and_transformers(assets):
    plan, result, out = _check_job(assets, "llama", "llama")
    steps = [r for r in _metrics(assets / "run_llama" / "prog") if "loss" in r]
    assert len(steps) == 5
    for r in steps:   # every logged step reports these (SPEC)
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "mfu", "step_time",
                    "predicted_step_time"):
            assert isinstance(r[key], float), key
        assert len(r["peak_rss"]) == 8
        assert r["tflops_per_gpu"] == pytest.approx(
            plan.data["compute"]["model_flops_per_step"] / (r["step_time"] * 8) / 1e12)
    # a serve spec reads hf_output and generates transformers' greedy tokens under tp 2
    from tests.serve_utils import build_serve, records, replica_tokens, run_torchrun

    src = (f'model m from "{out}/config.json" {{ dtype = fp32 }}\ncluster c from "cpu" {{ gpus_per_node = 2 }}\n'
           f'parallel {{ tp = 2 }}\nserve {{ batch = 2, prompt_len = 6, max_new_tokens = 8, weights = "{out}" }}\n')
    serve_spec = assets / "serve_llama.par"
    serve_spec.write_text(src)
    cfg = parcompile.compile(serve_spec).config
    build_serve(cfg, assets / "serve_prog")
    prompts = [[5, 17, 42, 99, 7, 3], [250, 8, 61, 120, 33, 2]]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor(prompts), max_new_tokens=8, do_sample=False,
                           attention_mask=torch.ones(2, 6, dtype=torch.long), pad_token_id=0)[:, 6:].tolist()
    args = sum((["--prompt-ids", ",".join(map(str, p))] for p in prompts), [])
    run_torchrun(2, [(assets / "serve_prog", args, assets / "serve_prog" / "out")])
    assert replica_tokens(records(assets / "serve_prog" / "out")) == want


# the other families and settings on 4 ranks each (an 8-rank launch costs twice as much on
# CI's 2 cores); together with the test above they split every kind of layer over tp and pp

@pytest.mark.torchrun
def test_qwen2_qkv_bias_tied_zero1(assets, four_rank):
    _check_job(assets, "qwen2", four_rank=four_rank)


@pytest.mark.torchrun
def test_gpt2_bias_tied_learned_positions_zero3(assets, four_rank):
    _check_job(assets, "gpt2", four_rank=four_rank)


@pytest.mark.torchrun
def test_llama_zero3_pp1_evaluates(assets, four_rank):
    # zero 3 with pp = 1 gathers the output layer per micro-batch; evaluation (no backward)
    # used to free it after final_norm's forward, before the LM head read its weight
    _check_job(assets, "zero3_pp1", four_rank=four_rank)


@pytest.mark.torchrun
def test_llama_bf16(assets, four_rank):
    # bf16 tolerances (Tolerances.for_dtype("bf16")): loss 2e-2 + 1e-2|ref|, grads
    # 2e-3 + 5e-2|ref|, params 4e-2 + 2e-2|ref|; eval losses within 2% of transformers'
    _check_job(assets, "llama_bf16", four_rank=four_rank)


@pytest.mark.torchrun
def test_resume_after_step_3_sees_the_same_samples_and_losses(assets):
    from parcompile.runtime.data import dataset

    ckpt = assets / "resume_ckpt"                # checkpoint_dir is relative to the spec, as data is
    spec = _spec(assets, "resume", "llama", dp=1, tp=1, pp=1, cp=2, eval_data=None, steps=6,
                 train='checkpoint_dir = "resume_ckpt"\n    checkpoint_every = 3')
    plan = parcompile.compile(spec)
    out = assets / "run_resume"
    _write(plan, out)
    # three runs in one launch, in order: uninterrupted (--checkpoint-dir "": no checkpoints),
    # stopped after step 3 (checkpoint step_3), and again to step 6 (continues at step 4)
    log = run_in_one_launch(2, [(out / "program.py", ["--metrics-dir", out / "full", "--checkpoint-dir", ""]),
                                (out / "program.py", ["--steps", 3, "--metrics-dir", out / "first"]),
                                (out / "program.py", ["--steps", 6, "--metrics-dir", out / "second"])],
                            out / "jobs.json")
    assert re.search(r"^resumed from \S+ after step 3$", log, re.M), log
    rec = lambda d: json.loads((d / "rank0.json").read_text())
    full, first, second = rec(out / "full"), rec(out / "first"), rec(out / "second")
    assert first["batches"] + second["batches"] == full["batches"]
    assert len(set(full["batches"])) == 6
    torch.testing.assert_close(torch.tensor(first["losses"] + second["losses"]), torch.tensor(full["losses"]),
                               atol=1e-6, rtol=1e-6)
    # one reporting rank under cp = 2: one metrics line per step of the three runs
    assert len(_metrics(out)) == 6 + 3 + 3
    # the checkpoint keeps the run's tokenizer, so init_from = the checkpoint finds it
    assert (ckpt / "step_00000006" / ".metadata").is_file() and (ckpt / "tokenizer.json").is_file()
    again = _spec(assets, "from_ckpt", "llama", dp=1, tp=1, pp=1, eval_data=None)
    again.write_text(again.read_text().replace('init_from = "llama"', 'init_from = "resume_ckpt"'))
    assert parcompile.compile(again).config.train.tokenizer == str(ckpt)
    # `parcompile export-weights` turns the checkpoint into the same Hugging Face checkpoint
    # that hf_output wrote at the end of the run
    from parcompile.cli import main

    assert main(["export-weights", str(spec), str(ckpt), "-o", str(assets / "exported")]) == 0
    _same_weights(assets / "exported", assets / "out_resume", 0.0, 0.0)
    assert json.loads((assets / "exported" / "config.json").read_text())["eos_token_id"] == 0
    # within an epoch no sample repeats: the six steps' 48 samples are distinct
    cfg = plan.config
    cache = dataset.prepare(cfg.train.data, tokenizer=cfg.train.tokenizer)
    order = dataset.TrainBatches(cache, SEQ, 8, cfg.train.seed)
    seen = [i for k in range(6) for i in order.indices(k)]
    assert len(seen) == len(set(seen)) == 48


def _masked_job(assets, four_rank, name: str, data_format: str):
    plan, result = _batched(four_rank, name)
    assert result.ok, result.table()
    assert plan.config.parallel.num_microbatches == 4
    # the first step's loss is transformers' cross-entropy over the unmasked targets of the
    # global batch (sum / count): examples of unequal length, masks from the format
    from parcompile.runtime.data import dataset

    cfg = plan.config
    cache = dataset.prepare(cfg.train.data, tokenizer=cfg.train.tokenizer, data_format=data_format)
    tokens, targets = dataset.TrainBatches(cache, cfg.model.seq_len, 8, cfg.train.seed).batch(0)
    masked = (targets == -100).sum(1)
    assert 0 < int(masked.min()) and len(set(masked.tolist())) > 1       # prompts/turns of unequal length
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(assets / "llama"), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=tokens[:, :-1]).logits
    flat = logits.reshape(-1, logits.shape[-1]).double()
    want = F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100)
    assert result.ref_losses[0] == pytest.approx(float(want), rel=1e-5)
    # the masked targets do not count: the loss over every target is outside the tolerance
    every = F.cross_entropy(flat, tokens[:, 1:].reshape(-1))
    assert result.ref_losses[0] != pytest.approx(float(every), rel=1e-5)


@pytest.mark.torchrun
def test_prompt_completion_loss_and_gradients_dp2_pp2_four_microbatches(assets, four_rank):
    _masked_job(assets, four_rank, "sft", "prompt_completion")


@pytest.mark.torchrun
def test_chat_loss_and_gradients_dp2_pp2_four_microbatches(assets, four_rank):
    _masked_job(assets, four_rank, "chat", "chat")


# ---- bad input: a diagnostic before any rank starts, nothing written ---------------------

def _run_cli(spec: Path, capsys) -> tuple[int, str]:
    from parcompile.cli import main

    code = main(["run", str(spec), "-o", str(spec.parent / ("never_" + spec.stem))])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert not (spec.parent / ("never_" + spec.stem)).exists()       # nothing written
    return code, err


def _bad(assets: Path, name: str, **kw) -> Path:
    return _spec(assets, name, "llama", dp=1, tp=1, pp=1, eval_data=None, **kw)


def test_missing_tokenizer(assets, capsys):
    spec = _bad(assets, "bad_tok", train='tokenizer = "nope/tokenizer.json"')
    code, err = _run_cli(spec, capsys)
    assert code == 1 and "bad_tok.par:17:17: error: tokenizer `" in err and "tokenizer not found" in err


@pytest.mark.parametrize("lines, want", [
    (['{"text": "a fine line of text"}', '{"text": "another"}', '{"text": broken'], ":3:1: error: "),
    (['{"text": "a fine line of text"}', '{"body": "no text here"}'], ":2:1: error: "),
])
def test_bad_jsonl_lines_name_the_file_and_line(assets, capsys, lines, want):
    data = assets / f"bad_{len(lines)}.jsonl"
    data.write_text("\n".join(lines) + "\n")
    code, err = _run_cli(_bad(assets, f"bad_lines_{len(lines)}", data=data.name), capsys)
    assert code == 1 and f"{data}{want}" in err, err
    assert "note: reading `data`" in err
    if len(lines) == 2:
        assert "no field" in err and "text" in err and "body" in err      # the missing field, the ones it has


def test_empty_dataset_and_too_few_samples(assets, capsys):
    (assets / "empty.jsonl").write_text("")
    code, err = _run_cli(_bad(assets, "bad_empty", data="empty.jsonl"), capsys)
    assert code == 1 and "empty.jsonl" in err and "error:" in err
    (assets / "small.jsonl").write_text('{"text": "just a few words of text"}\n' * 3)
    code, err = _run_cli(_bad(assets, "bad_small", data="small.jsonl"), capsys)
    assert code == 1 and "small.jsonl" in err and "8" in err, err     # one global batch is 8 samples


def test_tokenizer_larger_than_vocab(assets, capsys):
    spec = assets / "bad_vocab.par"
    spec.write_text('model m { layers = 2, hidden = 32, heads = 4, vocab = 300, seq_len = 32, dtype = fp32 }\n'
                    'cluster c from "cpu" { gpus_per_node = 1 }\nparallel { global_batch = 8 }\n'
                    'train { tokenizer = "tok", data = "train.jsonl" }\n')
    code, err = _run_cli(spec, capsys)
    assert code == 1 and "bad_vocab.par:4:21: error: the tokenizer has 400 tokens, more than the model's vocab = 300" in err
    assert "help: set `vocab = 400`" in err


def test_checkpoint_of_another_shape_and_truncated_file(assets, capsys):
    spec = _bad(assets, "bad_shape", train="")
    text = spec.read_text().replace("seq_len = 32", "seq_len = 32\n    ffn_hidden = 96")
    spec.write_text(text)
    code, err = _run_cli(spec, capsys)
    assert code == 1 and "bad_shape.par" in err and "init_from" in err, err
    assert "gate_proj" in err and "(96, 32)" in err and "(64, 32)" in err   # the tensor and both shapes
    cut = assets / "cut"
    shutil.copytree(assets / "llama", cut, dirs_exist_ok=True)
    st = cut / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    spec = _bad(assets, "bad_cut")
    spec.write_text(spec.read_text().replace('init_from = "llama"', 'init_from = "cut"'))
    code, err = _run_cli(spec, capsys)
    assert code == 1 and "model.safetensors" in err and "truncated" in err, err


def test_chat_without_assistant_turn_is_counted_in_a_warning(assets):
    rows = [{"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi " * k}]}
            for k in range(1, 12)] + [{"messages": [{"role": "user", "content": "no answer"}]}] * 2
    (assets / "chat_mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = _bad(assets, "chat_mixed", data="chat_mixed.jsonl", train="data_format = chat")
    diags = prepare_data(parcompile.compile(spec).config)
    warnings = [d.message for d in diags if d.severity == "warning"]
    assert not [d for d in diags if d.severity == "error"]
    assert "2 chat examples have no assistant turn and were skipped" in warnings, warnings


@pytest.mark.torchrun
def test_readme_fine_tuning_workflow(tmp_path, monkeypatch):
    """README: `python examples/make_tiny_hf.py DIR` then `parcompile run DIR/finetune.par`
    (the script's `main` run here: a second Python importing torch and transformers proves
    nothing more)."""
    import subprocess

    monkeypatch.setenv("PARCOMPILE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "tiny_hf"
    _load_make_tiny().main([str(out)])   # the script's main, in this process (torch and transformers loaded)
    run = subprocess.run([sys.executable, "-m", "parcompile", "run", str(out / "finetune.par"), "--steps", "2"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "eval after step 0" in run.stdout and "eval after step 2" in run.stdout
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out / "finetuned"))
    tok = transformers.AutoTokenizer.from_pretrained(str(out / "finetuned"))
    ids = tok("The for statement", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size == len(tok)
    # README's next step: `parcompile serve DIR/serve.par` on the fine-tuned weights; its
    # checks read the checkpoint's tensors against the model (the server itself: test_lm_eval)
    plan = parcompile.compile(out / "serve.par")
    assert plan.config.serve.weights == str(out / "finetuned") and not plan.warnings


def test_dcp_checkpoint_of_another_model_at_init_from(assets, tmp_path, capsys):
    """A training program's checkpoint (DCP) as init_from: its shapes are checked at the key."""
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "ckpt" / "step_00000004"
    state = {"embedding.weight": torch.zeros(512, 32), "layers.0.attn.wq.weight": torch.zeros(48, 32)}
    dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    spec = tmp_path / "dcp.par"
    spec.write_text('model m { layers = 1, hidden = 32, heads = 4, vocab = 400, seq_len = 32, dtype = fp32 }\n'
                    'cluster c from "cpu" { gpus_per_node = 1 }\nparallel { global_batch = 8 }\n'
                    f'train {{ init_from = "{tmp_path / "ckpt"}" }}\n')
    code, err = _run_cli(spec, capsys)
    assert code == 1 and "dcp.par:4:21: error: init_from: `layers.0.attn.wq.weight`" in err, err
    assert "(48, 32)" in err and "(32, 32)" in err                    # both shapes
    assert "has no `layers.0.mlp.w1.weight`" in err                   # and what it lacks
    assert "embedding.weight" not in err                             # padded vocabulary rows are fine


def test_dcp_checkpoint_without_tokenizer_warns_that_data_is_read_as_bytes(assets, tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"x": torch.zeros(2)}, checkpoint_id=str(tmp_path / "ck" / "step_00000001"), no_dist=True)
    spec = tmp_path / "bytes.par"
    spec.write_text('model m { layers = 1, hidden = 32, heads = 4, vocab = 400, seq_len = 32, dtype = fp32 }\n'
                    'cluster c from "cpu" { gpus_per_node = 1 }\nparallel { global_batch = 8 }\n'
                    f'train {{ init_from = "{tmp_path / "ck"}", data = "{assets / "train.jsonl"}" }}\n')
    with pytest.raises(parcompile.SpecError) as e:     # the checkpoint lacks this model's tensors
        parcompile.compile(spec)
    [w] = [d for d in e.value.diagnostics if d.severity == "warning"]
    assert w.message.endswith("holds no tokenizer.json: the data is read as bytes") and "tokenizer =" in w.help
