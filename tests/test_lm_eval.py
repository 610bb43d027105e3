"""lm-evaluation-harness against `parcompile serve` (issue 33): `lm-eval --model
local-completions --batch_size 4` runs a multiple-choice task (loglikelihoods: echo +
logprobs over batches of token-id prompts) and a generate_until task against the server
(tp 2, a tiny Hugging Face Llama with a byte-level tokenizer), and its accuracy and every
choice's loglikelihood equal the same harness run with `--model hf` on the same
checkpoint (transformers in this process's install: the truth). The checkpoint is trained
so that its greedy token after every choice is its end token (issue 47: the server left
that token and its logprob out, and lm-eval then dropped each choice's last token).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")

from tests.serve_utils import serving, write_byte_llama  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

MC = [("The sky is", ["blue", "green", "loud"], 0), ("Two plus two is", ["four", "five"], 0),
      ("Fire is", ["cold", "hot", "wet"], 1), ("Cats say", ["woof", "meow"], 1),
      ("Water is", ["dry", "wet"], 1), ("The sun rises in the", ["west", "east", "north"], 1),
      ("Ice is", ["warm", "cold"], 1), ("Grass is", ["green", "red", "blue", "pink"], 0)]
GEN = [("Say hi:", "hi"), ("Count: 1 2 3", "4"), ("Colour of milk:", "white"), ("Opposite of up:", "down")]


def _write_checkpoint(d: Path) -> None:
    """The tiny byte-level Llama (:func:`tests.serve_utils.write_byte_llama`) trained until
    its greedy next token after every choice's full text (question, space, choice: what a
    loglikelihood request of lm-eval sends) is its end token; checked here with
    transformers. Issue 47: the server dropped that end token and its logprob, so lm-eval
    (``token_logprobs[ctxlen:-1]``) lost the choice's last token; random weights, where the
    end token is never the argmax, could not see it."""
    texts = [f"{q} {c}" for q, choices, _ in MC for c in choices]
    eot = write_byte_llama(d, ending=texts)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        for t in texts:
            assert int(model(**tok(t, return_tensors="pt")).logits[0, -1].argmax()) == eot, t


def _write_tasks(d: Path) -> None:
    d.mkdir()
    with open(d / "mc.jsonl", "w") as f:
        for q, choices, a in MC:
            f.write(json.dumps({"question": q, "choices": choices, "answer": a}) + "\n")
    with open(d / "gen.jsonl", "w") as f:
        for q, a in GEN:
            f.write(json.dumps({"question": q, "answer": a}) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    (d / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {d / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
    (d / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {d / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


def _lm_eval(args: list[str], out: Path, tasks: Path, env: dict) -> subprocess.Popen:
    """Start lm-eval on both tasks (:func:`_results` reads what it wrote)."""
    cmd = [sys.executable, "-m", "lm_eval", "run", *args, "--tasks", "tiny_mc", "tiny_gen", "--include_path",
           str(tasks), "--batch_size", "4", "--output_path", str(out), "--log_samples"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _results(p: subprocess.Popen, out: Path) -> tuple[dict, dict]:
    """Wait for lm-eval; returns (results per task, per-doc samples per task)."""
    try:
        log, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, log[-6000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    samples = {}
    for task in ("tiny_mc", "tiny_gen"):
        f = next(out.rglob(f"samples_{task}_*.jsonl"))
        samples[task] = sorted((json.loads(line) for line in f.read_text().splitlines()), key=lambda s: s["doc_id"])
    return results, samples


@pytest.mark.torchrun
def test_lm_eval_local_completions_equals_hf_on_the_same_checkpoint(tmp_path):
    _write_checkpoint(tmp_path / "hf")
    _write_tasks(tmp_path / "tasks")
    (tmp_path / "s.par").write_text(
        'model m from "hf/config.json" { dtype = fp32 }\ncluster c from "cpu" { gpus_per_node = 2 }\n'
        'parallel { tp = 2 }\nserve {\n    batch = 4\n    prompt_len = 48\n    max_new_tokens = 16\n'
        '    weights = "hf"\n    kv_cache_tokens = 1024\n}\n')
    env = dict(os.environ, OMP_NUM_THREADS="1", PARCOMPILE_DEVICE="cpu", PYTHONPATH=str(REPO),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_CACHE=str(tmp_path / "ds_cache"))
    # the truth, beside the server (most of a run is lm-eval's imports)
    hf_run = _lm_eval(["--model", "hf", "--model_args", f"pretrained={tmp_path / 'hf'},dtype=float32", "--device",
                       "cpu"], tmp_path / "hf_out", tmp_path / "tasks", env)
    try:
        with serving(tmp_path / "s.par", tmp_path / "out", env, timeout_s=120) as (_, base):
            served, served_samples = _results(_lm_eval(
                ["--model", "local-completions", "--model_args",
                 f"base_url={base}/v1/completions,model=m,tokenizer_backend=huggingface,tokenizer={tmp_path / 'hf'},"
                 f"tokenized_requests=True,max_length=64,num_concurrent=1,max_retries=1"],
                tmp_path / "served", tmp_path / "tasks", env), tmp_path / "served")
            metrics = httpx.get(base + "/metrics", timeout=10).text
    except BaseException:
        if hf_run.poll() is None:
            hf_run.kill()
        raise
    hf, hf_samples = _results(hf_run, tmp_path / "hf_out")
    assert served["tiny_mc"]["acc,none"] == hf["tiny_mc"]["acc,none"]
    assert len(served_samples["tiny_mc"]) == len(MC) and len(served_samples["tiny_gen"]) == len(GEN)
    for a, b in zip(served_samples["tiny_mc"], hf_samples["tiny_mc"]):
        got = [float(r[0][0]) for r in a["resps"]]        # each choice's (loglikelihood, is_greedy)
        want = [float(r[0][0]) for r in b["resps"]]
        assert got == pytest.approx(want, abs=1e-3), a["doc"]
        assert all(x < 0 for x in got) and len(set(got)) == len(got)
        assert [str(r[0][1]) for r in a["resps"]] == [str(r[0][1]) for r in b["resps"]]     # is_greedy: top_logprobs
    # the generate task: the same greedy text (up to the stop string) as transformers'
    assert [s["filtered_resps"] for s in served_samples["tiny_gen"]] == [s["filtered_resps"] for s in
                                                                         hf_samples["tiny_gen"]]
    assert 'parcompile_requests_total{finish_reason="length",model="m"}' in metrics
    assert 'parcompile_requests_total{finish_reason="stop",model="m"}' in metrics       # the end token
