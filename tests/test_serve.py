"""Serving: the plan's serve section (KV bytes, memory, time, errors) and the generated
serve program (greedy tokens equal across layouts and to Hugging Face's `generate`, the
KV cache holds the planned bytes, weights from seed, a training checkpoint or safetensors).

The torchrun tests group several layouts of one world size per launch (about 10 s each).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch

import parcompile
from parcompile.diagnostics import SpecError
from tests.serve_utils import (build_serve, measured_collectives, planned_collectives, records, replica_tokens,
                               run_in_process, run_torchrun, serve_config)

PROMPTS = ["--prompt-ids", "5,17,99,3,250,42", "--prompt-ids", "7,7,120,9,31,200"]


# ---- plan ----------------------------------------------------------------------------

def _serve_spec(model: str, tp: int, extra: str = "", serve: str = "") -> str:
    return (f'model m from "{model}" {{ {extra} }}\ncluster c from "h100-sxm" {{ gpus_per_node = {max(tp, 1)} }}\n'
            f"parallel {{ tp = {tp} }}\nserve {{\n    batch = 1\n    prompt_len = 1024\n    max_new_tokens = 1024\n{serve}}}\n")


@pytest.mark.parametrize("model,tp,want", [("llama3-8b", 1, 131_072), ("llama3-70b", 1, 327_680),
                                           ("llama3-70b", 8, 40_960)])
def test_known_kv_bytes_per_token(model, tp, want):
    if tp == 1 and model == "llama3-70b":   # 141 GB of weights: only the per-token figure is asked
        src = _serve_spec(model, tp).replace('"h100-sxm" {', '"h100-sxm" { memory = 400 GiB,')
    else:
        src = _serve_spec(model, tp)
    d = parcompile.compile(src, filename="s.par").data
    assert d["serve"]["kv_bytes_per_token"] == want


def test_kv_replication_counts_one_kv_head_per_rank():
    cfg = serve_config(tp=4, model=dict(heads=8, kv_heads=2))
    d = parcompile.driver.compile_config(cfg).data
    m = cfg.model
    assert d["model"]["kv_heads_per_rank"] == 1 and d["model"]["kv_head_replicas"] == 2
    per_layer = (m.hidden * 8 * 8 // 4 * 2            # wq, wo: 2 query heads of 8 dims per rank
                 + 2 * m.hidden * 1 * 8                # wk, wv: one (replicated) kv head
                 + 3 * m.hidden * m.ffn_hidden // 4    # w1, w3, w2
                 + 2 * m.hidden)                       # norms
    padded = m.padded_vocab(4)
    want = m.layers * per_layer + 2 * padded // 4 * m.hidden + m.hidden
    assert d["stages"][0]["params_per_rank"] == want


def test_serve_memory_and_time_70b_tp8():
    d = parcompile.compile(Path("examples/llama3_70b_serve_8x_h100.par")).data
    sv, mem = d["serve"], d["memory"]["per_stage"][0]
    assert sv["kv_bytes_per_token"] == 40_960
    assert mem["params"] == sv["weights_bytes_per_rank"] == d["stages"][0]["params_per_rank"] * 2
    ctx = sv["prompt_len"] + sv["max_new_tokens"]
    assert mem["kv_cache"] == sv["batch"] * ctx * 40_960
    assert sv["max_concurrent_tokens"] == (d["memory"]["capacity"] - mem["params"] - mem["activations"]) // 40_960
    # decode is memory-bound: reading ~17.6 GB of weights per token at 0.8 * 3.35 TB/s
    assert 6e-3 < sv["breakdown"]["decode_weights"] < 7.5e-3
    assert sv["ttft"] > sv["tpot"] > 0 and sv["tokens_per_s"] > 0
    # 32 closed-loop clients, batch 32: all run, none queues; TPOT is a decode step of the 32 plus what
    # other requests' prompts add, and each client's requests come at 1 / (ttft + 511 tpot)
    br = sv["breakdown"]
    assert sv["workload"] == {"kind": "closed_loop", "concurrency": 32} and sv["running"] == 32
    decode_step = sum(v for k, v in br.items() if k.startswith("decode_") and k != "decode_prefill_share")
    assert sv["tpot"] == pytest.approx(decode_step + br["decode_prefill_share"]) and br["decode_prefill_share"] > 0
    assert sv["decode_tokens_per_s"] == pytest.approx(32 / decode_step)
    assert sv["e2e_latency"] == pytest.approx(sv["ttft"] + 511 * sv["tpot"]) and br["queue"] == 0
    assert sv["tokens_per_s"] == pytest.approx(32 * 512 / sv["e2e_latency"])
    assert sv["tokens_per_s_per_user"] == pytest.approx(1 / sv["tpot"])


def test_step_collectives_counted_by_hand():
    """The tp 2 x pp 2 tiny spec (b = 2 sequences, prompt 6, h = 64, fp32, 4 layers, 2 per
    stage): a decode step all-reduces (b, 1, h) over tp after the embedding (stage 0) and
    after each layer's attention and MLP, sends (b, 1, h) to the next stage, all-gathers the
    last position's fp32 logits (b x 256 padded vocab) over tp on the last stage and
    broadcasts the b int64 tokens over pp; a prefill the same with (b, 6, h)."""
    from parcompile.analysis.serve import step_collective_counts, step_costs
    from parcompile.passes.manager import compile_graph

    cfg = serve_config(tp=2, pp=2)
    c = compile_graph(cfg)
    for tokens in (6, 1):
        first, last = step_costs(cfg, c.graph, c.ctx.degrees, 2, tokens, 12 if tokens == 1 else 6)
        act = 2 * tokens * 64 * 4
        assert step_collective_counts(first) == {("all_reduce", "tp", act): 1 + 2 * 2, ("send", "pp", act): 1,
                                                 ("broadcast", "pp", 16): 1}
        assert step_collective_counts(last) == {("recv", "pp", act): 1, ("all_reduce", "tp", act): 2 * 2,
                                                ("all_gather", "tp", 2 * 256 * 4): 1, ("broadcast", "pp", 16): 1}


def test_one_sequence_that_does_not_fit_is_an_error_with_what_would():
    src = _serve_spec("llama3-70b", 1)
    with pytest.raises(SpecError) as e:
        parcompile.compile(src, filename="s.par")
    d = e.value.diagnostics[0]
    assert "one sequence of 2,048 tokens does not fit" in d.message
    assert "tp = 2" in d.help and "pp = 2" in d.help


def test_batch_that_does_not_fit_warns():
    src = _serve_spec("llama3-8b", 1).replace("batch = 1", "batch = 512")
    plan = parcompile.compile(src, filename="s.par")
    assert any(w.code == "does-not-fit" and "at most" in w.help for w in plan.warnings)
    assert plan.data["serve"]["fits"] is False and plan.data["memory"]["fits"] is False


def test_serve_rejects_cp_and_virtual_stages():
    src = _serve_spec("llama3-8b", 2).replace("tp = 2", "tp = 1, cp = 2")
    with pytest.raises(SpecError) as e:
        parcompile.compile(src, filename="s.par")
    assert "serving with cp = 2 is not supported" in e.value.diagnostics[0].message


# ---- the program, in one process --------------------------------------------------------

def test_single_process_generation_is_deterministic_and_cache_is_planned(tmp_path):
    cfg = serve_config()
    plan = build_serve(cfg, tmp_path / "ref")
    a = run_in_process(tmp_path / "ref", PROMPTS)
    b = run_in_process(tmp_path / "ref", PROMPTS)
    assert a["tokens"] == b["tokens"] and [len(t) for t in a["tokens"]] == [6, 6]
    assert a["cache_bytes"] == plan["serve"]["kv_cache_bytes_per_rank"] == 2 * 12 * 4 * 2 * 2 * 16 * 4
    # an end token stops its sequence; sampling follows the seed
    eos = a["tokens"][0][2]
    c = run_in_process(tmp_path / "ref", PROMPTS + ["--eos", str(eos)])
    assert c["tokens"][0] == a["tokens"][0][:a["tokens"][0].index(eos) + 1]
    s1 = run_in_process(tmp_path / "ref", PROMPTS + ["--temperature", "1.0", "--top-k", "20", "--seed", "5"])
    s2 = run_in_process(tmp_path / "ref", PROMPTS + ["--temperature", "1.0", "--top-k", "20", "--seed", "5"])
    assert s1["tokens"] == s2["tokens"]


def test_left_padded_prompts_generate_as_alone(tmp_path):
    build_serve(serve_config(), tmp_path / "ref")
    both = run_in_process(tmp_path / "ref", ["--prompt-ids", "5,17,99,3,250,42", "--prompt-ids", "9,31,200"])
    alone = run_in_process(tmp_path / "ref", ["--prompt-ids", "9,31,200"])
    assert both["tokens"][1] == alone["tokens"][0]


def test_tokenizer_json_and_bytes(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from parcompile.runtime.serve.generate import ByteTokenizer, load_tokenizer

    words = {f"w{i}": i for i in range(300)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    t = load_tokenizer(None, str(tmp_path), 300)
    assert t.encode("w5 w17") == [5, 17] and t.kind == "tokenizer.json"
    b = load_tokenizer(None, None, 256)
    assert isinstance(b, ByteTokenizer) and b.decode(b.encode("héllo")) == "héllo"


def test_serve_program_errors_are_one_line(tmp_path):
    build_serve(serve_config(), tmp_path / "ref")
    from parcompile.runtime.serve.generate import ServeError

    with pytest.raises(ServeError, match="does not exist"):
        run_in_process(tmp_path / "ref", PROMPTS + ["--weights", str(tmp_path / "nowhere")])
    with pytest.raises(ServeError, match="exceeds seq_len"):
        run_in_process(tmp_path / "ref", PROMPTS + ["--max-new-tokens", "40"])


# ---- the program under torchrun -------------------------------------------------------------

def _hf_llama(tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    hcfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(7)
    hf = transformers.LlamaForCausalLM(hcfg).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    return hf


def _hf_spec(tmp_path: Path, tp: int, pp: int) -> SpecConfig:
    src = (f'model m from "hf/config.json" {{ dtype = fp32 }}\ncluster c from "cpu" {{ gpus_per_node = {tp * pp} }}\n'
           f'parallel {{ tp = {tp}, pp = {pp} }}\nserve {{ batch = 2, prompt_len = 6, max_new_tokens = 8, weights = "hf" }}\n')
    (tmp_path / f"hf_{tp}_{pp}.par").write_text(src)
    from parcompile.frontend import load_spec

    cfg, _ = load_spec(tmp_path / f"hf_{tp}_{pp}.par")
    return cfg


from parcompile.config.schema import SpecConfig  # noqa: E402


def test_qwen3_checkpoint_serves_as_transformers_generates(tmp_path):
    """qk-norm through the whole Hugging Face path, one process: a tiny Qwen3 saved with
    save_pretrained, imported with `from "config.json"` (model_type qwen3: qk_norm, its own
    head_dim), its weights loaded by serve's `weights`; greedy tokens equal transformers'
    `generate`. The start-up line names the weights directory absolute (was
    ``prog/../hf``: ``--weights``' default joined to the program's folder, not normalised)."""
    pytest.importorskip("transformers")
    from tests.family_utils import tiny_qwen3

    hf = tiny_qwen3()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    cfg = _hf_spec(tmp_path, 1, 1)
    assert cfg.model.qk_norm and cfg.model.head_dim == 32 and not cfg.model.qkv_bias
    build_serve(cfg, tmp_path / "prog")
    prompts = [[5, 17, 99, 3, 250, 42], [7, 7, 120, 9, 31, 299]]
    with torch.no_grad():
        want = hf.generate(torch.tensor(prompts), max_new_tokens=8, do_sample=False,
                           attention_mask=torch.ones(2, 6, dtype=torch.long))[:, 6:].tolist()
    said = io.StringIO()
    got = run_in_process(tmp_path / "prog", sum((["--prompt-ids", ",".join(map(str, p))] for p in prompts), []), said)
    assert got["weights"] == "hf"
    assert f"weights loaded from {(tmp_path / 'hf').resolve()} (hf)" in said.getvalue(), said.getvalue()
    assert got["tokens"] == want


@pytest.mark.torchrun
def test_two_rank_layouts_match_single_process(tmp_path):
    """tp = 2 and pp = 2 (one launch): the same greedy tokens as one process, and each
    rank's KV cache holds exactly the planned bytes."""
    ref_plan = build_serve(serve_config(), tmp_path / "ref")
    ref = run_in_process(tmp_path / "ref", PROMPTS)["tokens"]
    jobs, plans, cfgs = [], {}, {}
    for name, kw in (("tp2", dict(tp=2)), ("pp2", dict(pp=2))):
        cfgs[name] = serve_config(**kw)
        plans[name] = build_serve(cfgs[name], tmp_path / name)
        jobs.append((tmp_path / name, PROMPTS, tmp_path / name / "out"))
    run_torchrun(2, jobs)
    for name, plan in plans.items():
        recs = records(tmp_path / name / "out")
        assert replica_tokens(recs) == ref, name
        planned = planned_collectives(cfgs[name], 6)
        for r in recs:   # what the serving estimate costs is what each rank ran
            assert measured_collectives(r) == planned[r["stage"]], (name, r["rank"])
        for r in recs:
            want = plan["serve"]["kv_bytes_per_token_per_stage"][r["stage"]] * 2 * 12
            assert r["cache_bytes"] == want, (name, r["rank"])
            assert r["params"] == plan["stages"][r["stage"]]["params_per_rank"], (name, r["rank"])
    assert ref_plan["serve"]["kv_cache_bytes_per_rank"] == 2 * 12 * plans["tp2"]["serve"]["kv_bytes_per_token"] * 2


@pytest.mark.torchrun
def test_four_rank_layouts_match_single_process_and_hf(tmp_path):
    """One launch of 4 ranks: tp 2 x pp 2, kv-head replication (kv_heads 2, tp 4), and a
    Hugging Face Llama saved with save_pretrained under tp 2 x pp 2 against HF's greedy
    `generate`."""
    ref = run_in_process(*_ref(tmp_path))
    rep_model = dict(heads=8, kv_heads=2)
    build_serve(serve_config(model=rep_model), tmp_path / "ref_rep")
    ref_rep = run_in_process(tmp_path / "ref_rep", PROMPTS)["tokens"]
    hf = _hf_llama(tmp_path)
    prompts = [[5, 17, 99, 3, 250, 42], [7, 7, 120, 9, 31, 299]]
    with torch.no_grad():
        want = hf.generate(torch.tensor(prompts), max_new_tokens=8, do_sample=False,
                           attention_mask=torch.ones(2, 6, dtype=torch.long))[:, 6:].tolist()
    hf_args = sum((["--prompt-ids", ",".join(map(str, p))] for p in prompts), [])
    plans = {"tp2pp2": build_serve(serve_config(tp=2, pp=2), tmp_path / "tp2pp2"),
             "kvrep": build_serve(serve_config(tp=4, model=rep_model), tmp_path / "kvrep")}
    hf_plan = build_serve(_hf_spec(tmp_path, 2, 2), tmp_path / "hfprog")
    run_torchrun(4, [(tmp_path / "tp2pp2", PROMPTS, tmp_path / "tp2pp2" / "out"),
                     (tmp_path / "kvrep", PROMPTS, tmp_path / "kvrep" / "out"),
                     (tmp_path / "hfprog", hf_args, tmp_path / "hfprog" / "out")])
    cfgs = {"tp2pp2": serve_config(tp=2, pp=2), "kvrep": serve_config(tp=4, model=rep_model)}
    for name, expected in (("tp2pp2", ref["tokens"]), ("kvrep", ref_rep)):
        recs = records(tmp_path / name / "out")
        assert replica_tokens(recs) == expected, name
        planned = planned_collectives(cfgs[name], 6)
        for r in recs:   # the serving estimate's collectives per rank: those the program ran
            assert measured_collectives(r) == planned[r["stage"]], (name, r["rank"])
        for r in recs:
            assert r["cache_bytes"] == plans[name]["serve"]["kv_bytes_per_token_per_stage"][r["stage"]] * 2 * 12
            assert r["params"] == plans[name]["stages"][r["stage"]]["params_per_rank"], (name, r["rank"])
    assert plans["kvrep"]["model"]["kv_head_replicas"] == 2
    hf_recs = records(tmp_path / "hfprog" / "out")
    assert all(r["weights"] == "hf" for r in hf_recs)
    assert replica_tokens(hf_recs) == want
    assert hf_plan["model"]["padded_vocab"] == 512   # 300 padded for tp = 2


def _ref(tmp_path: Path):
    build_serve(serve_config(), tmp_path / "ref")
    return tmp_path / "ref", PROMPTS


@pytest.mark.torchrun
def test_readme_train_then_serve(tmp_path):
    """The README's two commands, verbatim (in a copy of examples/, with fewer steps): a
    dp 2 x tp 2 x pp 2 training run saves a DCP checkpoint; tp 2 x pp 2 serves it; the
    same spec at tp = 1 in one process, loading the same checkpoint, writes the same text."""
    import re
    import shutil
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    readme = (repo / "README.md").read_text()
    section = readme[readme.index("## Train, then serve"):readme.index("## Use")]
    commands = re.search(r"```\n(.*?)```", section, re.S).group(1).strip().splitlines()
    assert commands == ["parcompile run examples/tiny.par --checkpoint-dir build/tiny_ckpt",
                        "parcompile run examples/tiny_serve.par"]
    (tmp_path / "examples").mkdir()
    for name in ("tiny.par", "tiny_serve.par"):
        shutil.copy(repo / "examples" / name, tmp_path / "examples" / name)
    env = dict(__import__("os").environ, OMP_NUM_THREADS="1", PARCOMPILE_DEVICE="cpu")
    outs = []
    for cmd, extra in zip(commands, (["--steps", "8"], [])):
        argv = [sys.executable, "-m", "parcompile"] + cmd.split()[1:] + extra
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        outs.append(proc.stdout)
    from parcompile.runtime.state.checkpoint import newest

    assert newest(tmp_path / "build" / "tiny_ckpt")[1] == 8   # step_00000008, complete
    served = outs[1]
    assert "[0] The " in served and "(weights: dcp)" in served
    if "\n[1] " in served:    # sequence 0 of the batch: up to the newline print adds
        text = served[served.index("[0] "):served.index("\n[1] ")]
    else:
        text = served[served.index("[0] "):served.index("replica 0:")].rstrip("\n")
    # the same spec in one process (tp = 1, pp = 1) from the same checkpoint
    cfg, _ = __import__("parcompile.frontend", fromlist=["load_spec"]).load_spec(tmp_path / "examples" / "tiny_serve.par")
    from parcompile.config.schema import ClusterConfig, ParallelConfig

    one = cfg.model_copy(update=dict(parallel=ParallelConfig(),
                                     cluster=ClusterConfig(name="cpu", preset="cpu", nodes=1, gpus_per_node=1)))
    build_serve(one, tmp_path / "one")
    rec = run_in_process(tmp_path / "one", [])
    from parcompile.runtime.serve.generate import ByteTokenizer

    assert rec["weights"] == "dcp"
    assert "[0] " + ByteTokenizer().decode(list(b"The ")) + ByteTokenizer().decode(rec["tokens"][0]) == text


def test_fp8_cache_holds_the_planned_bytes(tmp_path):
    plan = build_serve(serve_config(serve=dict(kv_dtype="fp8")), tmp_path / "p")
    rec = run_in_process(tmp_path / "p", PROMPTS)
    assert rec["cache_bytes"] == plan["serve"]["kv_cache_bytes_per_rank"] == 2 * 12 * 4 * 2 * 2 * 16 * 1
    assert [len(t) for t in rec["tokens"]] == [6, 6]


def test_cli_compile_and_run_serve_spec(tmp_path, monkeypatch, capsys):
    from parcompile.cli import main

    spec = tmp_path / "s.par"
    spec.write_text('model m { layers = 2, hidden = 32, heads = 4, vocab = 256, seq_len = 32, dtype = fp32 }\n'
                    'cluster c from "cpu" { gpus_per_node = 1 }\nserve { weights = "nowhere" }\n'
                    .replace("serve { weights", "serve {\n prompt_len = 8\n max_new_tokens = 8\n weights"))
    assert main(["compile", str(spec), "-o", str(tmp_path / "out")]) == 0
    assert {"serve.py", "launch.sh", "plan.json"} <= {p.name for p in (tmp_path / "out").iterdir()}
    assert "serve.py" in (tmp_path / "out" / "launch.sh").read_text()
    capsys.readouterr()
    assert main(["run", str(spec), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "weights directory" in err and "does not exist" in err and "Traceback" not in err
    # the spec named by a relative path: the error names the directory absolute (was `nowhere`)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "s.par", "-o", "out"]) == 1
    err = capsys.readouterr().err
    assert f"weights directory `{os.path.join(os.getcwd(), 'nowhere')}` does not exist" in err, err


@pytest.mark.parametrize("batch, dp, words", [
    (1, 8, "1 sequence (1 per replica on 1 of 8 replicas; the others idle)"),
    (3, 8, "3 sequences (1 per replica on 3 of 8 replicas; the others idle)"),
    (10, 4, "10 sequences (2 to 3 per replica, 4 replicas)"),
    (16, 8, "16 sequences (2 per replica, 8 replicas)"),
])
def test_serve_batch_is_global_and_the_report_says_how_the_replicas_share_it(batch, dp, words):
    """Tester: batch = 1 with dp 8 reported "1 sequence (1 per replica, 8 replicas)", as if 8
    were served. SPEC 1's serve `batch` is the concurrent sequences of the whole plan; the
    program gives the replicas contiguous shares, the first ones one more
    (runtime/generate.replica_slice): the report says so, and the throughput counts the
    `batch` sequences, not replicas x the largest share."""
    import parcompile

    path = Path(__file__).resolve().parents[1] / "examples" / "tiny_serve.par"
    plan = parcompile.compile(path, overrides={"serve.batch": batch, "parallel.tp": 1, "parallel.pp": 1,
                                               "cluster.gpus_per_node": dp})
    sv = plan.data["serve"]
    assert (sv["batch"], sv["replicas"], sv["batch_per_replica"]) == (batch, dp, -(-batch // dp))
    assert f"\n{words} of 16 prompt + 48 new tokens;" in plan.report_md()
    # the closed loop's `batch` clients (concurrency's default), shared by the replicas: `batch` run
    assert sv["running"] == pytest.approx(batch)                               # not dp x the largest share
    assert sv["tokens_per_s"] == pytest.approx(batch * 48 / sv["e2e_latency"])


def test_engine_overhead_on_the_cpu_preset_counts_the_engines_host_work_per_step():
    """Issue 33: on the `cpu` preset (fixed figures: 20 us per op, 50 us per message) each
    step of the parcompile engine holds its host work beyond the graph's ops: on the first
    stage the step plan's broadcast (one message) and the step's layout, on every stage
    the paged cache's work per layer, on the last the sampling, in units of the per-op
    figure, beside the graph's ops at the per-op figure; a GPU engine (vLLM) has its own
    per-step time instead (analysis/serve_engines.py)."""
    from parcompile.analysis import serve_steps as S
    from parcompile.analysis.serve_engines import SERVE_ENGINES
    from parcompile.core.model import STEP_PLAN_BYTES
    from parcompile.passes.manager import compile_graph

    per_op, alpha = 20e-6, 50e-6
    for tp, pp, want in ((1, 1, (S.STEP_LAYOUT_OPS + 4 * S.PAGED_CACHE_OPS + S.SAMPLE_OPS) * per_op),
                         (2, 2, alpha + STEP_PLAN_BYTES / 2e9
                          + (S.STEP_LAYOUT_OPS + 2 * S.PAGED_CACHE_OPS) * per_op        # stage 0
                          + (2 * S.PAGED_CACHE_OPS + S.SAMPLE_OPS) * per_op)):          # stage 1
        src = (f'model m {{ layers = 4, hidden = 64, heads = 4, kv_heads = 2, ffn_hidden = 128, vocab = 256, '
               f'seq_len = 32, dtype = fp32 }}\ncluster c from "cpu" {{ gpus_per_node = {tp * pp} }}\n'
               f'parallel {{ tp = {tp}, pp = {pp} }}\nserve {{ batch = 2, prompt_len = 6, max_new_tokens = 6 }}\n')
        plan = parcompile.compile(src, filename="s.par")
        sv = plan.data["serve"]
        assert sv["engine"] == "parcompile"
        c = compile_graph(plan.config)
        ops = sum(st.ops for st in S.stage_steps(plan.config, c.graph, c.ctx.degrees))
        br = sv["breakdown"]
        assert br["decode_overhead"] == pytest.approx(ops * per_op + want, rel=0.05)
        assert br["prefill_overhead"] == pytest.approx(ops * per_op + want, rel=0.05)   # one prefill step
    gpu = parcompile.compile(Path("examples/llama3_70b_serve_8x_h100.par")).data["serve"]
    assert gpu["engine"] == "vllm"
    assert gpu["breakdown"]["decode_overhead"] == SERVE_ENGINES["vllm"].step_overhead
