"""`parcompile export`: each target's output, parsed back (shell words, TOML, JSON), names
the plan's degrees, batch sizes, schedule, recompute and ZeRO stage; every example
exports (serve specs are refused with a diagnostic); the output is deterministic."""

from __future__ import annotations

import functools
import json
import shlex
import tomllib
from pathlib import Path

import pytest

import parcompile
from parcompile.cli import main
from parcompile.diagnostics import SpecError
from parcompile.exporters import SERVE_TARGETS, TARGETS, TORCHTITAN_SCHEDULE, TRAIN_TARGETS, export

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.par"))
TINY = (REPO / "examples" / "tiny.par").read_text()
TINY_PARALLEL = """parallel {
    dp = 2
    tp = 2
    pp = 2
    schedule     = 1f1b
    micro_batch  = 2
    global_batch = 16      # m = 16 / (2 * 2) = 4 micro-batches
}"""


def _variant(parallel: str, dtype: str = "fp32"):
    """tiny.par with another `parallel` block (and model dtype)."""
    assert TINY_PARALLEL in TINY
    src = TINY.replace(TINY_PARALLEL, parallel).replace("dtype      = fp32", f"dtype      = {dtype}")
    return parcompile.compile(src, "variant.par")


VARIANTS = {
    "interleaved_zero2_selective": ("parallel {\n dp = 2\n tp = 2\n pp = 2\n schedule = interleaved_1f1b\n"
                                    " virtual_stages = 2\n zero = 2\n recompute = selective\n micro_batch = 1\n"
                                    " global_batch = 8\n}", "bf16"),
    # interleaved rounds of 3 micro-batches on pp 2 (m = 5): Megatron-Core's own example
    # (ModelParallelConfig.microbatch_group_size_per_vp_stage's docstring)
    "interleaved_group3_zero1": ("parallel {\n dp = 2\n tp = 2\n pp = 2\n schedule = interleaved_1f1b\n"
                                 " virtual_stages = 2\n microbatch_group_size = 3\n zero = 1\n micro_batch = 1\n"
                                 " global_batch = 10\n}", "bf16"),
    "gpipe_zero3_full": ("parallel {\n dp = 4\n tp = 1\n pp = 2\n schedule = gpipe\n zero = 3\n"
                         " recompute = full\n micro_batch = 1\n global_batch = 16\n}", "bf16"),
    "cp_zero1": ("parallel {\n dp = 2\n tp = 2\n pp = 1\n cp = 2\n zero = 1\n micro_batch = 2\n"
                 " global_batch = 8\n}", "fp16"),
    "zero_bubble_sp": ("parallel {\n dp = 1\n tp = 2\n pp = 4\n schedule = zero_bubble\n"
                       " sequence_parallel = true\n micro_batch = 1\n global_batch = 8\n}", "bf16"),
    "interleaved_zero1_full": ("parallel {\n dp = 2\n tp = 2\n pp = 2\n schedule = interleaved_1f1b\n"
                               " virtual_stages = 2\n zero = 1\n recompute = full\n micro_batch = 1\n"
                               " global_batch = 8\n}", "bf16"),
    "zero3_tp_no_pp": ("parallel {\n dp = 4\n tp = 2\n pp = 1\n zero = 3\n recompute = selective\n"
                       " micro_batch = 2\n global_batch = 16\n}", "bf16"),
    "uneven_stages_zero2": ("parallel {\n dp = 2\n tp = 2\n pp = 2\n stage_layers = [3, 1]\n zero = 2\n"
                            " micro_batch = 1\n global_batch = 8\n}", "fp32"),
    "zero0_cp_pp": ("parallel {\n dp = 2\n tp = 1\n pp = 2\n cp = 2\n micro_batch = 1\n global_batch = 8\n}",
                    "bf16"),
    # pipeline without tensor parallelism: what DeepSpeed's PipelineModule runs from its config
    "pp_zero1": ("parallel {\n dp = 4\n tp = 1\n pp = 2\n zero = 1\n micro_batch = 1\n global_batch = 16\n}",
                 "bf16"),
}
LLAMA3_70B = (REPO / "examples" / "llama3_70b_8x8_h100.par").read_text()
#: the 70B example's layout with other models: Llama 2 70B (the 70B shape, vocabulary 32,000 and
#: RoPE theta 10,000: not torchtitan 0.2's llama3 70B) and Llama 3.1 70B (Llama 3 70B with its
#: RoPE scaling: meta-llama/Llama-3.1-70B config.json rope_scaling, torchtitan 0.2's 70B flavor)
MODEL_VARIANTS = {
    "llama2_70b_8x8": LLAMA3_70B.replace('from "llama3-70b" { }', 'from "llama2-70b" { }'),
    "llama31_70b_8x8": LLAMA3_70B.replace('from "llama3-70b" { }', 'from "llama3-70b" {\n    rope_type = llama3\n'
                                          '    rope_scaling_factor = 8\n    rope_low_freq_factor = 1\n'
                                          '    rope_high_freq_factor = 4\n    rope_original_max_positions = 8192\n}'),
}


@functools.lru_cache(maxsize=None)
def _plans():
    out = [(p.stem, parcompile.compile(p.relative_to(REPO))) for p in EXAMPLES]
    out += [(name, _variant(*v)) for name, v in VARIANTS.items()]
    for name, src in MODEL_VARIANTS.items():
        assert src != LLAMA3_70B, name
        out.append((name, parcompile.compile(src, f"{name}.par")))
    return tuple((n, p) for n, p in out if p.config.workload == "train")


@pytest.fixture(scope="module")
def plans(request):
    import os

    old = os.getcwd()
    os.chdir(REPO)   # plans name files relative to where parcompile runs
    try:
        return _plans()
    finally:
        os.chdir(old)


def parse_command(text: str, program: str) -> tuple[dict[str, str], list[str], dict[str, object]]:
    """(environment, launcher words, {flag: value (several joined by a space) or True}) from an
    exported shell command whose arguments follow the word ``program``."""
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    words = shlex.split(body.replace("\\\n", " "))
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    i = words.index(program)
    launcher, rest = words[: i + 1], words[i + 1:]
    flags: dict[str, object] = {}
    k = 0
    while k < len(rest):
        flag = rest[k]
        assert flag.startswith("--"), f"expected a flag, got {flag!r}"
        assert flag not in flags, f"{flag} given twice"
        values = []
        k += 1
        while k < len(rest) and not rest[k].startswith("--"):   # nargs='+' (--recompute-modules)
            values.append(rest[k])
            k += 1
        flags[flag] = " ".join(values) if values else True
    return env, launcher, flags


def serve_commands(text: str) -> list[str]:
    """The server commands of a vLLM / SGLang export, each on one line: one, or a disaggregated
    export's two (prefill pool, decode pool), each started in the background (`&`) before the
    script's closing `wait`."""
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#")).replace("\\\n", " ")
    lines = [line.strip() for line in body.splitlines() if line.strip()]
    if len(lines) > 1:
        assert lines[-1] == "wait" and all(line.endswith(" &") for line in lines[:-1]), lines
        return [line[:-2] for line in lines[:-1]]
    return lines


def serve_flags(command: str) -> tuple[list[str], dict[str, object]]:
    """(launcher words, {flag: value or True}) of one server command (:func:`serve_commands`):
    ``vllm serve MODEL ...`` or ``python -m sglang.launch_server ...``."""
    words = shlex.split(command)
    return parse_command(command, words[2] if words[:2] == ["vllm", "serve"] else "sglang.launch_server")[1:]


def parse_megatron(text: str) -> tuple[list[str], dict[str, object]]:
    """(launcher words, {flag: value or True}) from a Megatron export."""
    return parse_command(text, "pretrain_gpt.py")[1:]


def _expect(plan):
    d, par = plan.data, plan.config.parallel
    return d["degrees"], d["schedule"]["name"], d["schedule"]["num_microbatches"], par


def test_megatron_names_the_plan(plans):
    for name, plan in plans:
        deg, sched, m, par = _expect(plan)
        ex = export(plan, "megatron")
        env, launcher, f = parse_command(ex.text, "pretrain_gpt.py")
        # Megatron-LM core_v0.19.0 megatron/training/arguments.py validate_args: tp > 1 or cp > 1
        # asserts CUDA_DEVICE_MAX_CONNECTIONS == "1" before Blackwell (H100, A100 here) unless
        # --use-torch-fsdp2, which asserts it is not "1" and needs --no-gradient-accumulation-fusion
        fsdp2 = "--use-torch-fsdp2" in f
        if (deg["tp"] > 1 or deg["cp"] > 1) and not fsdp2:
            assert env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1", name
        if fsdp2:
            assert env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1"
            assert "--no-gradient-accumulation-fusion" in f
            # the rest of the `if args.use_torch_fsdp2:` block: refused with errors otherwise
            # (and --optimizer-cpu-offload wraps the distributed optimizer only: exporters/offload_hsdp.py)
            assert bool(ex.errors) == (deg["pp"] > 1 or deg["ep"] > 1 or plan.data["model"]["dtype"] == "fp16"
                                       or plan.data["model"]["tie_embeddings"]
                                       or plan.config.parallel.offload != "none"), name
        else:
            assert not ex.errors, name
        assert launcher[:5] == ["torchrun", "--nnodes", str(plan.config.cluster.nodes), "--nproc-per-node",
                                str(plan.config.cluster.gpus_per_node)], name
        assert int(f["--tensor-model-parallel-size"]) == deg["tp"]
        assert int(f["--pipeline-model-parallel-size"]) == deg["pp"]
        assert int(f["--context-parallel-size"]) == deg["cp"]
        # dp is what is left of the world
        assert plan.data["world_size"] // (deg["tp"] * deg["pp"] * deg["cp"]) == deg["dp"]
        assert int(f["--micro-batch-size"]) == par.micro_batch
        assert int(f["--global-batch-size"]) == par.global_batch
        assert par.global_batch // (par.micro_batch * deg["dp"]) == m
        assert ("--sequence-parallel" in f) == par.sequence_parallel
        # schedule: interleaved iff virtual stages; gpipe / zero_bubble become 1F1B with a note
        if deg["virtual_stages"] > 1:
            assert int(f["--num-virtual-stages-per-pipeline-rank"]) == deg["virtual_stages"]
        else:
            assert "--num-virtual-stages-per-pipeline-rank" not in f
        # interleaved rounds: written when the spec sets them (Megatron-Core's default is pp)
        group = f.get("--microbatch-group-size-per-virtual-pipeline-stage")
        assert group == (None if par.microbatch_group_size is None else str(par.microbatch_group_size)), name
        if group is not None:
            assert int(group) == plan.data["schedule"]["microbatch_group_size"] != deg["pp"], name
        if sched in ("gpipe", "zero_bubble"):
            assert any(n.startswith(f"schedule {sched}:") for n in ex.notes), name
            assert f"# note: schedule {sched}:" in ex.text
        # recompute
        gran = {"none": None, "selective": "selective", "full": "full"}[par.recompute]
        assert f.get("--recompute-granularity") == gran
        if par.recompute == "full":
            assert f["--recompute-method"] == "uniform" and f["--recompute-num-layers"] == "1"
        # ZeRO
        assert ("--use-distributed-optimizer" in f) == (par.zero in (1, 2)), name
        assert ("--use-torch-fsdp2" in f) == (par.zero == 3)
        if par.zero >= 2:
            assert any(n.startswith(f"zero {par.zero}:") for n in ex.notes)
        # model and precision
        mdl = plan.data["model"]
        assert int(f["--num-layers"]) == mdl["layers"] and int(f["--hidden-size"]) == mdl["hidden"]
        assert int(f["--ffn-hidden-size"]) == mdl["ffn_hidden"] and int(f["--num-attention-heads"]) == mdl["heads"]
        assert int(f["--seq-length"]) == mdl["seq_len"]
        if mdl["kv_heads"] != mdl["heads"]:
            assert f["--group-query-attention"] is True and int(f["--num-query-groups"]) == mdl["kv_heads"]
        assert ("--bf16" in f) == (mdl["dtype"] == "bf16") and ("--fp16" in f) == (mdl["dtype"] == "fp16")
        assert ("--untie-embeddings-and-output-weights" in f) == (not mdl["tie_embeddings"])
        assert float(f["--lr"]) == plan.config.train.lr and int(f["--train-iters"]) == plan.config.train.steps


def test_torchtitan_names_the_plan(plans):
    for name, plan in plans:
        deg, sched, m, par = _expect(plan)
        ex = export(plan, "torchtitan", torchtitan_version="0.2")
        t = tomllib.loads(ex.text)
        p, tr = t["parallelism"], t["training"]
        assert p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"] == deg["dp"], name
        assert p["tensor_parallel_degree"] == deg["tp"] and p["pipeline_parallel_degree"] == deg["pp"]
        assert p["context_parallel_degree"] == deg["cp"] and p["expert_parallel_degree"] == deg["ep"]
        # ZeRO 0 replicates (DDP); ZeRO >= 1 shards with FSDP2, with a note for 1 and 2
        if par.zero == 0 and deg["tp"] == deg["pp"] == deg["cp"] == 1:
            assert p["data_parallel_shard_degree"] == 1
        elif par.zero == 0:   # 0.2's DDP takes no other parallelism: FSDP over dp, with a note
            assert p["data_parallel_shard_degree"] == deg["dp"] and any(n.startswith("zero 0 with") for n in ex.notes)
        else:
            assert p["data_parallel_replicate_degree"] == 1 and p["data_parallel_shard_degree"] == deg["dp"]
            # zero 3: torchtitan's "default" is the program's own policy (reshard after forward
            # without PP, keep across micro-batches with PP); zero 1, 2: keep gathered
            assert p["fsdp_reshard_after_forward"] == ("default" if par.zero == 3 else "never")
        if par.zero in (1, 2):
            assert any(n.startswith(f"zero {par.zero}:") for n in ex.notes)
        # schedule
        assert p["pipeline_parallel_schedule"] == TORCHTITAN_SCHEDULE[(sched, deg["virtual_stages"] > 1)]
        assert p["pipeline_parallel_schedule"] in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS",
                                                   "InterleavedZeroBubble", "ZBVZeroBubble")
        if sched == "zero_bubble" and deg["virtual_stages"] == 1:
            assert any(n.startswith("schedule zero_bubble") for n in ex.notes)
        if deg["pp"] > 1 and par.stage_layers is None:
            chunks = deg["pp"] * deg["virtual_stages"]
            assert p["pipeline_parallel_layers_per_stage"] * chunks == plan.data["model"]["layers"]
            # torchtitan would count the embedding and the output as layers: both 0
            assert p["pipeline_parallel_first_stage_less_layers"] == p["pipeline_parallel_last_stage_less_layers"] == 0
        # batch: the global batch, the micro-batch and the micro-batches per step
        assert tr["global_batch_size"] == par.global_batch
        assert p["pipeline_parallel_microbatch_size"] == par.micro_batch
        if deg["pp"] > 1:   # pipeline micro-batches of one local batch
            assert tr["local_batch_size"] // p["pipeline_parallel_microbatch_size"] == m
            assert tr["local_batch_size"] * deg["dp"] == par.global_batch
        else:               # gradient accumulation
            assert tr["local_batch_size"] == par.micro_batch
            assert tr["global_batch_size"] // (tr["local_batch_size"] * deg["dp"]) == m
        assert tr["seq_len"] == plan.data["model"]["seq_len"] and tr["steps"] == plan.config.train.steps
        assert t["activation_checkpoint"]["mode"] == par.recompute
        assert t["optimizer"]["lr"] == plan.config.train.lr


#: Llama 3.1 as published (meta-llama/Llama-3.1-8B, -70B, -405B config.json): layers, hidden,
#: heads, kv heads, intermediate size; all: vocab 128,256, rope_theta 500,000, rms_norm_eps
#: 1e-5, rope_scaling llama3 (factor 8, low 1, high 4, original 8192), untied embeddings
LLAMA31 = {"8B": (32, 4096, 32, 8, 14336), "70B": (80, 8192, 64, 8, 28672), "405B": (126, 16384, 128, 8, 53248)}


def test_torchtitan02_exports_only_its_flavors(plans):
    """torchtitan 0.2's TOML names a llama3 flavor and no field of it: an export is accepted
    only when the flavor (parcompile.exporters.TORCHTITAN02_FLAVORS, read from torchtitan v0.2.2)
    is the spec's model field by field, and its bf16 is bf16 as torchtitan 0.2 runs it (FSDP
    with dp_shard > 1 or cp > 1, or autocast without tp and pp); else refused with the fields."""
    from parcompile.exporters import TORCHTITAN02_FLAVORS

    for flavor, (layers, dim, heads, kv, ffn) in LLAMA31.items():   # the table is Llama 3.1
        assert TORCHTITAN02_FLAVORS[flavor] == {
            "n_layers": layers, "dim": dim, "n_heads": heads, "n_kv_heads": kv, "hidden_dim": ffn,
            "vocab_size": 128256, "rope_theta": 500000.0, "norm_eps": 1e-5,
            "rope_scaling": ("llama3", 8.0, 1.0, 4.0, 8192), "tie_embeddings": False}, flavor
    accepted = []
    for name, plan in plans:
        ex = export(plan, "torchtitan", torchtitan_version="0.2")
        t, m, deg = tomllib.loads(ex.text), plan.config.model, plan.data["degrees"]
        if ex.errors:
            continue
        accepted.append(name)
        layers, dim, heads, kv, ffn = LLAMA31[t["model"]["flavor"]]
        assert t["model"]["name"] == "llama3"
        assert (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn_hidden, m.vocab, m.rope_theta, m.norm_eps) == \
            (layers, dim, heads, kv, ffn, 128256, 500000.0, 1e-5), name
        assert (m.rope_type, m.rope_scaling_factor, m.rope_low_freq_factor, m.rope_high_freq_factor,
                m.rope_original_max_positions, m.tie_embeddings) == ("llama3", 8, 1, 4, 8192, False), name
        p, tr = t["parallelism"], t["training"]
        assert tr["mixed_precision_param"] == {"bf16": "bfloat16", "fp32": "float32"}[m.dtype], name
        assert tr["mixed_precision_reduce"] == "float32"   # 0.2.2: Literal["float32"]
        if m.dtype == "bf16":   # torchtitan 0.2.2 distributed/utils.py maybe_enable_amp
            assert p["data_parallel_shard_degree"] > 1 or p["context_parallel_degree"] > 1 or \
                deg["tp"] == deg["pp"] == 1, name
    assert accepted == ["llama31_70b_8x8"]
    llama2 = dict(plans)["llama2_70b_8x8"]
    (error,) = export(llama2, "torchtitan", torchtitan_version="0.2").errors
    assert "flavor 70B" in error and "vocab_size 128256 (the spec: 32000)" in error
    assert "rope_theta 500000 (the spec: 10000)" in error
    fp32 = dict(plans)["llama3_8b_2x8_h100"]   # dp 1, tp 8, pp 2: no FSDP, so no mixed precision
    assert any(e.startswith("dtype bf16 with dp 1 and tp 8 x pp 2:") and "float32" in e
               for e in export(fp32, "torchtitan", torchtitan_version="0.2").errors)


def test_deepspeed_names_the_plan(plans):
    for name, plan in plans:
        deg, sched, m, par = _expect(plan)
        ex = export(plan, "deepspeed")
        c = json.loads(ex.text)
        assert bool(ex.errors) == (deg["cp"] > 1 or (deg["pp"] > 1 and (par.zero >= 2 or deg["tp"] > 1))), name
        if deg["tp"] > 1 and deg["pp"] > 1:   # AutoTP has no pipeline axis: the model code's mpu is needed
            assert any(e.startswith(f"tp {deg['tp']} with pp {deg['pp']}:") and "mpu" in e for e in ex.errors), name
        assert c["train_batch_size"] == par.global_batch, name
        assert c["train_micro_batch_size_per_gpu"] == par.micro_batch
        assert c["gradient_accumulation_steps"] == m
        # DeepSpeed's invariant: train_batch_size = micro * accumulation * data-parallel size
        assert c["train_batch_size"] == c["train_micro_batch_size_per_gpu"] * c["gradient_accumulation_steps"] * deg["dp"]
        assert c["zero_optimization"]["stage"] == par.zero
        assert c["bf16"]["enabled"] == (plan.data["model"]["dtype"] == "bf16")
        assert c["fp16"]["enabled"] == (plan.data["model"]["dtype"] == "fp16")
        assert c["gradient_clipping"] == plan.config.train.grad_clip
        if deg["pp"] > 1:
            assert c["pipeline"]["stages"] == deg["pp"]
            assert c["pipeline"]["activation_checkpoint_interval"] == (1 if par.recompute == "full" else 0)
            if sched != "1f1b":
                assert any(n.startswith(f"schedule {sched}:") for n in ex.notes)
            if par.zero >= 2:
                assert any(e.startswith(f"zero {par.zero} with pp") for e in ex.errors)
        else:
            assert "pipeline" not in c
        assert c.get("tensor_parallel", {}).get("autotp_size", 1) == (deg["tp"] if deg["pp"] == 1 else 1)
        assert ("activation_checkpointing" in c) == (par.recompute != "none")
        if deg["cp"] > 1:
            assert any(e.startswith("cp ") for e in ex.errors)
        words = shlex.split(ex.launch)
        assert words[:5] == ["deepspeed", "--num_nodes", str(plan.config.cluster.nodes), "--num_gpus",
                             str(plan.config.cluster.gpus_per_node)]
        assert words[-1] == ex.filename


def test_variants_cover_every_mapping(plans):
    """The synthetic variants reach what the examples do not: interleaved, gpipe, zero 2/3,
    selective recompute, cp, fp16."""
    seen = {(p.config.parallel.schedule, p.config.parallel.zero, p.config.parallel.recompute) for _, p in plans}
    assert {s for s, _, _ in seen} == {"gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"}
    assert {z for _, z, _ in seen} == {0, 1, 2, 3}
    assert {r for _, _, r in seen} == {"none", "selective", "full"}
    assert any(p.data["degrees"]["cp"] > 1 for _, p in plans)


@functools.lru_cache(maxsize=None)
def _compiled(stem: str):
    return parcompile.compile(Path("examples") / f"{stem}.par")


def _example_targets():
    """Every example with every target of its kind; the other kind's targets (refused) on the
    two tiny examples only (each CLI call compiles its spec)."""
    out = []
    for spec in EXAMPLES:
        serving = spec.stem.endswith("_serve") or "_serve_" in spec.stem
        for target in TARGETS:
            if (target in SERVE_TARGETS) == serving or spec.stem in ("tiny", "tiny_serve"):
                out.append(pytest.param(spec, target, id=f"{target}-{spec.stem}"))
    return out


@pytest.mark.parametrize("spec, target", _example_targets())
def test_every_example_exports(spec, target, monkeypatch, capsys):
    """Through the CLI: a spec of the target's kind (training for Megatron-LM, torchtitan,
    DeepSpeed; serving for vLLM, SGLang) exports, the same bytes as the API from another
    compile (deterministic), and parses; exit 1 with `error:` lines exactly when the export
    has errors (another model or layout); a spec of the other kind is refused with exit 1
    and a diagnostic at its `serve` / `train` block."""
    monkeypatch.chdir(REPO)
    rel = str(spec.relative_to(REPO))
    plan = _compiled(spec.stem)
    rc = main(["export", rel, "--to", target])
    out, err = capsys.readouterr()
    serving = target in SERVE_TARGETS
    if (plan.config.workload == "serve") != serving:
        block, kind = ("train", "serve") if serving else ("serve", "training")
        assert rc == 1 and out == ""
        assert f"error: `export --to {target}` needs a {kind} spec; this spec has a `{block}` block" in err
        assert f"{rel}:" in err and "help:" in err
        return
    ex = export(plan, target)
    assert rc == (1 if ex.errors else 0), err
    assert all(f"error: {e}" in err for e in ex.errors)
    if ex.errors:   # refused: nothing but the errors, nothing on stdout
        assert out == "" and "note: " not in err and f"error: `export --to {target}` refused: nothing written" in err
        return
    assert out == ex.text
    if target in ("torchtitan", "megatron-bridge"):
        compile(out, ex.filename, "exec")   # a Python module
    elif target in ("megatron", "vllm", "sglang"):
        if target == "megatron":
            parse_command(out, "pretrain_gpt.py")
        else:
            [serve_flags(command) for command in serve_commands(out)]
    else:
        json.loads(out)
    if target == "deepspeed":   # JSON has no comments: notes and the launcher line go to stderr
        assert "launch: deepspeed --num_nodes" in err and "note: " in err
    else:   # the export's notes are comments in it; on stderr only what the compile of `auto` chose
        assert [line for line in err.splitlines() if "note: " in line and not line.startswith("note: auto: chose ")] == []


#: tiny.par with pipeline and no tensor parallelism: a layout every training engine runs
TINY_PP = TINY.replace(TINY_PARALLEL, "parallel {\n    dp = 4\n    tp = 1\n    pp = 2\n    micro_batch  = 2\n"
                       "    global_batch = 16\n}")


@pytest.mark.parametrize("target", TRAIN_TARGETS)
def test_export_to_file(target, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.par").write_text(TINY_PP)
    dest = tmp_path / "out"
    assert main(["export", "tiny.par", "--to", target, "-o", str(dest)]) == 0
    out, err = capsys.readouterr()
    assert out == "" and dest.read_text() == export(parcompile.compile(TINY_PP, "tiny.par"), target).text
    assert f"wrote {dest} ({target})" in err and "note: " in err


@pytest.mark.parametrize("target, version", [("megatron", None), ("megatron-bridge", None), ("deepspeed", None),
                                             ("torchtitan", "0.2")])
def test_refused_export_writes_nothing(target, version, monkeypatch, capsys, tmp_path):
    """An export the engine would run as another model or layout (Megatron-LM and
    Megatron-Bridge: zero 3 with pp; DeepSpeed: tp with pp; torchtitan 0.2: a shape that is no flavor) writes no file and
    prints nothing on stdout: only its `error:` lines, exit 1; a file already at -o is left
    as it was."""
    monkeypatch.chdir(tmp_path)
    spec = TINY if not target.startswith("megatron") else TINY.replace(TINY_PARALLEL, VARIANTS["gpipe_zero3_full"][0])
    (tmp_path / "tiny.par").write_text(spec)
    errors = export(parcompile.compile(spec, "tiny.par"), target, torchtitan_version=version or "0.3").errors
    assert errors
    extra = ["--torchtitan-version", version] if version else []
    assert main(["export", "tiny.par", "--to", target, *extra]) == 1
    out, err = capsys.readouterr()
    assert out == "" and [line for line in err.splitlines() if line.startswith("error: ")] == \
        [f"error: {e}" for e in errors] + [f"error: `export --to {target}` refused: nothing written"]
    assert main(["export", "tiny.par", "--to", target, *extra, "-o", "new.out"]) == 1
    assert not (tmp_path / "new.out").exists() and "(new.out untouched)" in capsys.readouterr().err
    (tmp_path / "old.out").write_text("mine")
    assert main(["export", "tiny.par", "--to", target, *extra, "-o", "old.out"]) == 1
    assert (tmp_path / "old.out").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.out", "tiny.par"]   # no temporary left



def test_export_to_another_name_launches_that_file(monkeypatch, capsys, tmp_path):
    """``-o`` under a name other than the export's own: DeepSpeed's launch line names the file
    written (quoted for the shell), torchtitan 0.3 says which ``--module`` imports it (or that
    the name cannot be imported); the file is written whole, with a plain write's mode."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.par").write_text(TINY_PP)   # (tiny.par's tp 2 with pp 2: DeepSpeed refuses it)
    import os
    umask = os.umask(0o022)
    try:
        assert main(["export", "tiny.par", "--to", "deepspeed", "-o", "my config.json"]) == 0
        err = capsys.readouterr().err
        launch = next(line for line in err.splitlines() if line.startswith("launch: "))
        assert shlex.split(launch)[-2:] == ["--deepspeed_config", "my config.json"], launch
        assert (tmp_path / "my config.json").stat().st_mode & 0o777 == 0o644
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []   # no temporary left
        assert main(["export", "tiny.par", "--to", "torchtitan", "-o", "mine.py"]) == 0
        assert "note: torchtitan imports the config module by its file name: launch this file with --module mine " \
            in capsys.readouterr().err
        assert main(["export", "tiny.par", "--to", "torchtitan", "-o", "my-cfg.py"]) == 0
        assert "`my-cfg.py` is no importable module name: write it as tiny_torchtitan.py" in capsys.readouterr().err
        assert main(["export", "tiny.par", "--to", "deepspeed", "-o", "tiny_deepspeed.json"]) == 0
        assert "--deepspeed_config tiny_deepspeed.json" in capsys.readouterr().err
    finally:
        os.umask(umask)


def test_export_api_refuses_serve_and_unknown_target(monkeypatch):
    monkeypatch.chdir(REPO)
    plan = parcompile.compile(Path("examples/tiny_serve.par"))
    with pytest.raises(SpecError) as e:
        export(plan, "megatron")
    assert e.value.diagnostics[0].code == "export-serve"
    with pytest.raises(SpecError) as e:
        export(parcompile.compile(Path("examples/tiny.par")), "vllm")
    assert e.value.diagnostics[0].code == "export-train"
    with pytest.raises(ValueError, match="unknown torchtitan version"):
        export(parcompile.compile(Path("examples/tiny.par")), "torchtitan", torchtitan_version="0.1")
    with pytest.raises(ValueError, match="unknown export target"):
        export(parcompile.compile(Path("examples/tiny.par")), "colossalai")


def test_export_usage_errors(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert main(["export", "examples/tiny.par"]) == 2                      # --to is required
    assert main(["export", "examples/tiny.par", "--to", "jax"]) == 2       # not a target
    assert main(["export", "examples/tiny.par", "--to", "megatron", "-o", " "]) == 2
    capsys.readouterr()
    assert main(["export", "examples/tiny.par", "--to", "megatron", "--torchtitan-version", "0.2"]) == 2
    assert "--torchtitan-version applies to --to torchtitan, not --to megatron" in capsys.readouterr().err
    assert main(["export", "examples/missing.par", "--to", "megatron"]) == 2
    capsys.readouterr()


# Flags read from the engines' own argument parsers, which run on this CPU box only with
# their sources at hand (not installable here: megatron-core 0.19 wants Python 3.12 and its
# wheel has no megatron/training; vLLM ships CUDA wheels and an sdist that does not build on
# CPU; SGLang's parser imports Triton). Each set was produced by parsing (and validating)
# these exports with the release's real parser: Megatron-LM core_v0.19.0 (NVIDIA/Megatron-LM
# tag core_v0.19.0, commit 5be9626709af2722333bf54797c954c09edeada3),
# megatron/training/arguments.py parse_args + validate_args, run by
# `python tests/check_engine_parsers.py megatron CHECKOUT` on that commit's tree (18 plans,
# 17 accepted with the plan's world, dp, tp, pp, cp, batch sizes, layers per stage, virtual
# stages, vocabulary and dtype; the zero-3-with-pp one refused as the export's error says;
# --use-rope-scaling and --rope-scaling-factor: arguments.py lines 2341-2344 there); vLLM 0.33.0 `vllm serve`
# (vllm/entrypoints/cli/serve.py subparser_init + validate_parsed_serve_args, option
# strings from vllm/engine/arg_utils.py); SGLang 0.5.23 sglang/srt/server_args.py
# ServerArgs.add_cli_args. The --account-for-*-in-pipeline-split pair (issue 29): TransformerConfig
# fields (transformer_config.py lines 130 and 134 at core_v0.19.0,
# 5be9626709af2722333bf54797c954c09edeada3) made flags by ArgumentGroupFactory (arguments.py line
# 2290 there), not run through check_engine_parsers.py; --microbatch-group-size-per-virtual-pipeline-stage
# the same way (ModelParallelConfig.microbatch_group_size_per_vp_stage, model_parallel_config.py line
# 431 at 5be9626709af2722333bf54797c954c09edeada3, a field of TransformerConfig's base; not excluded).
# FP8 (issue 32): --fp8-format and --fp8-recipe are TransformerConfig fields fp8 and fp8_recipe
# (transformer_config.py lines 566 and 573 at core_v0.19.0, 5be9626), --fp8-param-gather
# arguments.py line 1935 there; not run through check_engine_parsers.py
MEGATRON_CORE_V0_19_0_FP8_FLAGS = frozenset({"--fp8-format", "--fp8-recipe", "--fp8-param-gather"})
# The overlaps (cluster.tp_comm_overlap, overlap_p2p_comm): --tp-comm-overlap is ModelParallelConfig's
# tp_comm_overlap (model_parallel_config.py line 265 at core_v0.19.0, 5be9626; not excluded, a flag through
# ArgumentGroupFactory, arguments.py line 2290; asserted with sequence parallelism, line 1401),
# --no-overlap-p2p-communication arguments.py line 2965 there (dest overlap_p2p_comm, default on with
# virtual stages; off needs pp > 2, line 973); not run through check_engine_parsers.py
MEGATRON_CORE_V0_19_0_OVERLAP_FLAGS = frozenset({"--tp-comm-overlap", "--no-overlap-p2p-communication"})
# Gradient and layer precision: --grad-reduce-in-bf16 arguments.py line 2905 at core_v0.19.0 (5be9626;
# validate_args line 1190 turns accumulate_allreduce_grads_in_fp32 off); --first-last-layers-bf16,
# --num-layers-at-start-in-bf16 and --num-layers-at-end-in-bf16 are TransformerConfig fields
# (transformer_config.py lines 628, 631 and 635 there, not in the exclude list of arguments.py line 2196,
# made flags by ArgumentGroupFactory, line 2290); not run through check_engine_parsers.py, but
# --grad-reduce-in-bf16 is, with the recompute module list (below)
MEGATRON_CORE_V0_19_0_PRECISION_FLAGS = frozenset({"--grad-reduce-in-bf16", "--first-last-layers-bf16",
                                                   "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16"})
# The recompute module list (parallel.recompute = [...]): --recompute-modules is TransformerConfig's
# recompute_modules (transformer_config.py line 546 at core_v0.19.0, 5be9626; made a flag by
# ArgumentGroupFactory, arguments.py line 2290). Run through `python tests/check_engine_parsers.py
# megatron CHECKOUT` on that tree (its _megatron_module_plans: [layernorm, moe_act] and [core_attn, moe],
# both with grad_dtype = bf16): accepted with the plan's layout, recompute_granularity 'selective',
# recompute_modules the list and accumulate_allreduce_grads_in_fp32 False
MEGATRON_CORE_V0_19_0_RECOMPUTE_FLAGS = frozenset({"--recompute-modules"})
MEGATRON_CORE_V0_19_0_FLAGS = frozenset("""
--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split --adam-beta1 --adam-beta2 --adam-eps --attention-backend --attention-dropout --bf16 --clip-grad --context-parallel-size
--ddp-bucket-size --decoder-first-pipeline-num-layers --decoder-last-pipeline-num-layers --disable-bias-linear
--expert-model-parallel-size --expert-tensor-parallel-size --ffn-hidden-size
--fp16 --global-batch-size --group-query-attention --hidden-dropout --hidden-size --log-interval --lr --lr-decay-style
--lr-warmup-iters --make-vocab-size-divisible-by --max-position-embeddings --micro-batch-size
--microbatch-group-size-per-virtual-pipeline-stage --min-lr --mock-data
--moe-aux-loss-coeff --moe-ffn-hidden-size --moe-layer-freq --moe-router-topk --moe-shared-expert-intermediate-size
--no-gradient-accumulation-fusion --norm-epsilon --normalization --num-attention-heads --num-experts --num-layers
--num-query-groups --num-virtual-stages-per-pipeline-rank --optimizer --overlap-grad-reduce
--pipeline-model-parallel-size --position-embedding-type --recompute-granularity --recompute-method
--recompute-num-layers --rope-scaling-factor --rotary-base --seed
--seq-length --sequence-parallel --swiglu --tensor-model-parallel-size
--tokenizer-type --train-iters --untie-embeddings-and-output-weights --use-distributed-optimizer --use-rope-scaling
--use-torch-fsdp2 --vocab-size --weight-decay""".split())
VLLM_0_33_0_FLAGS = frozenset("""--tensor-parallel-size --pipeline-parallel-size --data-parallel-size
--enable-expert-parallel --max-model-len --max-num-seqs --kv-cache-dtype --gpu-memory-utilization --dtype
--seed""".split()) | frozenset(
    # the budget, weights quantized on load and the disaggregated pools' flags: accepted by vLLM
    # 0.33.0's own `vllm serve` parser (the PyPI sdist: vllm/engine/arg_utils.py EngineArgs.add_cli_args,
    # --port vllm/entrypoints/common/cli_args.py) and validate_parsed_serve_args, the budget by
    # SchedulerConfig (vllm/config/scheduler.py: at least --max-num-seqs), --quantization's value
    # by get_quantization_config, --kv-transfer-config's JSON as a KVTransferConfig
    # (vllm/config/kv_transfer.py): `tests/check_engine_parsers.py vllm` over SERVE_VARIANTS
    "--max-num-batched-tokens --quantization --kv-transfer-config --port".split())
#: vllm/config/cache.py CacheDType (0.33.0), the part parcompile writes
VLLM_0_33_0_KV_CACHE_DTYPES = frozenset({"auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"})
VLLM_0_33_0_DTYPES = frozenset({"auto", "bfloat16", "float", "float16", "float32", "half"})
#: vLLM 0.33.0's --quantization schemes for a 16-bit checkpoint quantized on load, by the plan's
#: format (vllm/config/quantization.py _ONLINE_SHORTHANDS; its plain `fp8` is deprecated there)
VLLM_0_33_0_ONLINE_FP8 = {"fp8-block": "fp8_per_block", "fp8-tensor": "fp8_per_tensor",
                          "fp8-channel": "fp8_per_channel"}
#: vllm/config/kv_transfer.py KVRole (0.33.0): NixlConnector's prefill and decode roles
#: (vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py: kv_both deprecated)
VLLM_0_33_0_KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
SGLANG_0_5_23_FLAGS = frozenset("""--model-path --tp-size --pp-size --dp-size --ep-size --context-length
--max-running-requests --kv-cache-dtype --mem-fraction-static --dtype --random-seed""".split()) | frozenset(
    # accepted by SGLang 0.5.23's own parser (the wheel: ServerArgs.add_cli_args over
    # sglang/srt/arg_groups/fields/schedule.py --chunked-prefill-size --max-prefill-tokens,
    # model.py --quantization, disagg.py --disaggregation-mode, serving.py --port):
    # `tests/check_engine_parsers.py sglang` over SERVE_VARIANTS
    "--chunked-prefill-size --max-prefill-tokens --quantization --disaggregation-mode --port".split())
#: sglang/srt/arg_groups/choices.py QUANTIZATION_CHOICES (0.5.23): `fp8` quantizes a 16-bit
#: checkpoint on load; disagg.py --disaggregation-mode choices; schedule.py --max-prefill-tokens
#: default (a prefill batch's prompt tokens are at most it and --chunked-prefill-size)
SGLANG_0_5_23_DISAGGREGATION_MODES = frozenset({"null", "prefill", "decode"})
SGLANG_0_5_23_MAX_PREFILL_TOKENS = 16384
SGLANG_0_5_23_KV_CACHE_DTYPES = frozenset({"auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4",
                                           "fp4_mx_block16"})
SGLANG_0_5_23_DTYPES = frozenset({"auto", "half", "float16", "bfloat16", "float", "float32"})

LLAMA3_70B_SERVE = (REPO / "examples" / "llama3_70b_serve_8x_h100.par").read_text()
_KV_BF16 = "    kv_dtype       = bf16\n"
#: Llama-3 70B on 2 nodes: a prefill pool of 2 x tp 4 beside the decode pool's tp 8
DISAGGREGATED = """model m from "llama3-70b" { seq_len = 8192 }
cluster c from "h100-sxm" { nodes = 2, gpus_per_node = 8 }
parallel { tp = 8, dp = 1 }
serve {
    prompt_len = 2048
    max_new_tokens = 512
    concurrency = 64
    disaggregated = true
    prefill_replicas = 2
    prefill_tp = 4
}"""
#: serve specs whose exports write the deployment's other flags (the budget, weights quantized
#: on load, two disaggregated pools); `tests/check_engine_parsers.py vllm|sglang` parses them too
SERVE_VARIANTS = {
    "serve_budget": LLAMA3_70B_SERVE.replace(_KV_BF16, _KV_BF16 + "    max_prefill_tokens = 4096\n"),
    "serve_fp8_weights": LLAMA3_70B_SERVE.replace(_KV_BF16, _KV_BF16 + "    weight_dtype   = fp8\n"),
    "serve_fp8_weights_fp8_kv": LLAMA3_70B_SERVE.replace(_KV_BF16, "    kv_dtype       = fp8\n"
                                                         "    weight_dtype   = fp8\n"),
    "serve_budget_32k": LLAMA3_70B_SERVE.replace(_KV_BF16, _KV_BF16 + "    max_prefill_tokens = 32768\n"),
    # fewer tokens a step than sequences: vLLM refuses the budget (the export says so), SGLang takes it
    "serve_budget_below_seqs": LLAMA3_70B_SERVE.replace(_KV_BF16, _KV_BF16 + "    max_prefill_tokens = 16\n"),
    "serve_disaggregated": DISAGGREGATED,
    "serve_disaggregated_fp8_budget": DISAGGREGATED.replace("    prefill_tp = 4\n", "    prefill_tp = 4\n"
                                                            "    weight_dtype = fp8\n    max_prefill_tokens = 8192\n"),
}


@functools.lru_cache(maxsize=None)
def _serve_variant(name: str):
    assert SERVE_VARIANTS[name] != LLAMA3_70B_SERVE, name
    return parcompile.compile(SERVE_VARIANTS[name], f"{name}.par")


#: Megatron-Bridge 0.3.1 (with megatron-core 0.16.1, its pin) ConfigContainer fields the exports
#: set, each read from its dataclass (GPTModelProvider, TrainingConfig, OptimizerConfig,
#: SchedulerConfig, DistributedDataParallelConfig, DistributedInitConfig, MockGPTDatasetConfig
#: (seq_length: an init argument), TokenizerConfig, LoggerConfig, CheckpointConfig, RNGConfig,
#: ConfigContainer) and every export built and passed through Bridge's own
#: runtime_config_update + ConfigContainer.validate by `tests/check_engine_parsers.py
#: megatron-bridge` (18 plans: 17 accepted with the plan's dp, tp, pp, cp, ep, batch sizes,
#: layers per stage, virtual stages, vocabulary and params dtype; zero 3 with pp refused).
#: microbatch_group_size_per_vp_stage: ModelParallelConfig's field at megatron-core 0.16.1
#: (model_parallel_config.py line 343, tag core_v0.16.1), not run through check_engine_parsers.py;
#: tp_comm_overlap, overlap_p2p_comm and batch_p2p_comm likewise (lines 186, 297 and 302 there).
MEGATRON_BRIDGE_0_3_1_FIELDS = {
    "model": frozenset("""activation_func add_bias_linear add_qkv_bias attention_backend attention_dropout
        context_parallel_size expert_model_parallel_size expert_tensor_parallel_size ffn_hidden_size gated_linear_unit
        gradient_accumulation_fusion hidden_dropout hidden_size kv_channels layernorm_epsilon
        make_vocab_size_divisible_by moe_aux_loss_coeff moe_ffn_hidden_size moe_layer_freq moe_router_topk
        moe_shared_expert_intermediate_size normalization num_attention_heads num_layers
        num_layers_in_first_pipeline_stage num_layers_in_last_pipeline_stage num_moe_experts num_query_groups
        account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split
        pipeline_model_parallel_size position_embedding_type qk_layernorm recompute_granularity recompute_method
        recompute_num_layers rope_scaling rope_scaling_factor rotary_base seq_length sequence_parallel
        share_embeddings_and_output_weights should_pad_vocab tensor_model_parallel_size
        virtual_pipeline_model_parallel_size microbatch_group_size_per_vp_stage
        tp_comm_overlap overlap_p2p_comm batch_p2p_comm
        vocab_size""".split()),
    "train": frozenset({"global_batch_size", "micro_batch_size", "train_iters"}),
    # optimizer_cpu_offload, use_precision_aware_optimizer (OptimizerConfig, megatron-core 0.16.1
    # optimizer_config.py lines 304, 187) and num_distributed_optimizer_instances
    # (distributed_data_parallel_config.py line 30): offload and HSDP (issue 49), run through
    # `check_engine_parsers.py megatron-bridge` (tests/test_offload.py's OFFLOAD_HSDP)
    "optimizer": frozenset({"adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "lr", "min_lr", "optimizer",
                            "use_distributed_optimizer", "weight_decay", "optimizer_cpu_offload",
                            "use_precision_aware_optimizer"}),
    "scheduler": frozenset({"lr_decay_iters", "lr_decay_style", "lr_warmup_iters"}),
    "ddp": frozenset({"bucket_size", "overlap_grad_reduce", "use_distributed_optimizer", "grad_reduce_in_fp32",
                      "num_distributed_optimizer_instances"}),
    "dist": frozenset({"use_torch_fsdp2"}),
    "dataset": frozenset({"eod_mask_loss", "random_seed", "reset_attention_mask", "reset_position_ids",
                          "seq_length"}),
    "tokenizer": frozenset({"tokenizer_type", "vocab_size"}),
    "logger": frozenset({"log_interval"}),
    "checkpoint": frozenset({"save", "save_interval"}),
    "rng": frozenset({"seed"}),
    "mixed_precision": frozenset(),
    # LoRA (issue 49): CanonicalLoRA's keywords, checked in tests/test_export_lora.py
    "peft": frozenset({"target_modules", "dim", "alpha", "dropout", "dropout_position"}),
}


def _bridge_container(text: str) -> dict[str, object]:
    """The keyword arguments of the ConfigContainer an exported Megatron-Bridge module's
    ``config()`` returns: ``{section: {field: value}}`` (literals; expressions as source)."""
    import ast

    fn = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "config")
    call = fn.body[-1].value
    assert isinstance(call, ast.Call) and call.func.id == "ConfigContainer"

    def lit(node):
        try:
            return ast.literal_eval(node)
        except ValueError:
            return ast.unparse(node)

    return {kw.arg: ({k.arg: lit(k.value) for k in kw.value.keywords} if isinstance(kw.value, ast.Call)
                     else lit(kw.value)) for kw in call.keywords}


def test_megatron_bridge_names_the_plan(plans):
    """`--to megatron-bridge`: a Python module whose ConfigContainer holds the plan's sizes in
    Megatron-Bridge 0.3.1's fields (pinned above); dp is what Bridge derives
    (ConfigContainer.get_data_parallel_size: world / (tp * pp * cp)); refused exactly where
    Megatron-LM's are."""
    for name, plan in plans:
        ex = export(plan, "megatron-bridge")
        assert ex.errors == export(plan, "megatron").errors, name
        compile(ex.text, ex.filename, "exec")
        c = _bridge_container(ex.text)
        for section, fields in c.items():
            got = set(fields) if isinstance(fields, dict) else set()
            known = MEGATRON_BRIDGE_0_3_1_FIELDS[section]
            assert got <= known, (name, section, got - known)
        deg, par, mdl, md = plan.data["degrees"], plan.config.parallel, plan.data["model"], c["model"]
        assert (md["tensor_model_parallel_size"], md["pipeline_model_parallel_size"], md["context_parallel_size"]) == \
            (deg["tp"], deg["pp"], deg["cp"]), name
        assert plan.data["world_size"] // (deg["tp"] * deg["pp"] * deg["cp"]) == deg["dp"]
        assert md.get("expert_model_parallel_size", 1) == deg["ep"]
        assert (c["train"]["micro_batch_size"], c["train"]["global_batch_size"]) == (par.micro_batch, par.global_batch)
        assert md["num_layers"] == mdl["layers"] and md["vocab_size"] == c["tokenizer"]["vocab_size"] == mdl["vocab"]
        assert md.get("virtual_pipeline_model_parallel_size", 1) == deg["virtual_stages"], name
        chunks = list(par.layers_per_chunk(mdl["layers"]))
        stages = [sum(chunks[r::deg["pp"]]) for r in range(deg["pp"])]
        e, l = (bool(md.get(f"account_for_{x}_in_pipeline_split")) for x in ("embedding", "loss"))
        if e or l:
            # Megatron-Core's get_num_layers_to_build: the embedding / loss count as a layer
            # of the even split; the first / last model chunk builds one decoder layer fewer
            q, rest = divmod(mdl["layers"] + e + l, len(chunks))
            assert rest == 0 and [q - e] + [q] * (len(chunks) - 2) + [q - l] == chunks, name
        elif len(set(stages)) > 1:
            assert (md["num_layers_in_first_pipeline_stage"], md["num_layers_in_last_pipeline_stage"]) == \
                (stages[0], stages[-1]), name
        assert c["mixed_precision"] == {"bf16": "bf16_mixed", "fp16": "fp16_mixed", "fp32": None}[mdl["dtype"]], name
        assert md["share_embeddings_and_output_weights"] == mdl["tie_embeddings"], name
        # padded as Megatron-LM pads (and the plan counts): to make_vocab_size_divisible_by x tp
        multiple = md["make_vocab_size_divisible_by"] * deg["tp"]
        assert md["should_pad_vocab"] and -(-mdl["vocab"] // multiple) * multiple == mdl["padded_vocab"], name
        assert c["optimizer"].get("use_distributed_optimizer", False) == (par.zero in (1, 2))
        assert c["dist"].get("use_torch_fsdp2", False) == (par.zero == 3)


def test_megatron_flags_are_core_v0_19_flags(plans):
    for name, plan in plans:
        _, _, f = parse_command(export(plan, "megatron").text, "pretrain_gpt.py")
        known = MEGATRON_CORE_V0_19_0_FLAGS | MEGATRON_CORE_V0_19_0_OVERLAP_FLAGS
        assert set(f) <= known, (name, set(f) - known)


# --attention-backend's values: Megatron-Core's AttnBackend members (megatron/core/transformer/enums.py
# lines 51-58 at core_v0.19.0, 5be9626709af2722333bf54797c954c09edeada3); the flag is a TransformerConfig
# field whose value ArgumentGroupFactory looks up by member name (megatron/training/argument_utils.py
# _get_enum_kwargs there: AttnBackend[cli_arg], any other word an argparse error). check_engine_parsers.py
# megatron on that tree parsed these exports' `fused` and `unfused` as AttnBackend.fused / .unfused.
MEGATRON_CORE_V0_19_0_ATTN_BACKENDS = frozenset({"flash", "fused", "unfused", "local", "auto"})


def test_megatron_attention_backends_are_attn_backend_members(plans):
    """Every kernel the plan can price for Megatron-LM maps to an AttnBackend member, and every
    example's export names one (a kernel name such as `cudnn` would stop Megatron's parser)."""
    from parcompile.core.attention import ATTENTION_KERNELS
    from parcompile.exporters.megatron import MEGATRON_ATTN_BACKENDS

    priced = {choice.kernel for (engine, _), choice in ATTENTION_KERNELS.items() if engine == "megatron"}
    assert priced | {"unfused"} <= MEGATRON_ATTN_BACKENDS.keys()   # attention = unfused: the spelled-out core
    assert set(MEGATRON_ATTN_BACKENDS.values()) <= MEGATRON_CORE_V0_19_0_ATTN_BACKENDS
    for name, plan in plans:
        words = export(plan, "megatron").text.split()
        assert words[words.index("--attention-backend") + 1] in MEGATRON_CORE_V0_19_0_ATTN_BACKENDS, name


def test_megatron_exports_write_the_overlaps(monkeypatch):
    """cluster.tp_comm_overlap -> --tp-comm-overlap (with sequence parallelism; without it a note:
    Megatron-LM asserts it); with virtual stages and pp > 2 the blocking transfers the estimate
    assumed (overlap_p2p_comm false) -> --no-overlap-p2p-communication, Megatron-LM's default
    (overlap_p2p_comm true) -> no flag; Megatron-Bridge's provider fields the same."""
    monkeypatch.chdir(REPO)
    base = MODEL_VARIANTS["llama31_70b_8x8"]

    def plan(cluster: str, sp: bool = True, interleaved: bool = False):
        text = base.replace("nodes = 8\n", "nodes = 8\n    " + cluster + "\n", 1)
        text = text.replace("sequence_parallel = true", f"sequence_parallel = {str(sp).lower()}", 1)
        if interleaved:   # pp 4 x 2 virtual stages
            text = text.replace("schedule     = 1f1b", "schedule = interleaved_1f1b\n    virtual_stages = 2", 1)
        return parcompile.compile(text, "ov.par")

    def bridge_model(p):
        return _bridge_container(export(p, "megatron-bridge").text)["model"]

    for sp in (True, False):
        p = plan("tp_comm_overlap = true", sp=sp)
        ex = export(p, "megatron")
        _l, f = parse_megatron(ex.text)
        assert p.config.parallel.tp == 8 and ("--tp-comm-overlap" in f) == sp
        assert sp or any(n.startswith("tp_comm_overlap: off") for n in ex.notes)
        assert bridge_model(p).get("tp_comm_overlap", False) == sp
    _l, f = parse_megatron(export(plan(""), "megatron").text)
    assert "--tp-comm-overlap" not in f and "--no-overlap-p2p-communication" not in f   # 1F1B: nothing to say
    for on in (False, True):
        p = plan(f"overlap_p2p_comm = {str(on).lower()}", interleaved=True)
        _l, f = parse_megatron(export(p, "megatron").text)
        assert p.config.parallel.pp == 4 and ("--no-overlap-p2p-communication" in f) == (not on)
        md = bridge_model(p)
        assert (md["overlap_p2p_comm"], md["batch_p2p_comm"]) == (on, not on)


def _online_fp8(plan, target: str) -> str | None:
    """The --quantization a serve plan's export must write: fp8 weights over a 16-bit (or no)
    checkpoint are quantized as the server loads them, in the plan's format (fp8-block unless
    the checkpoint says otherwise: core/quant.py DEFAULT_FORMAT); none otherwise."""
    sv = plan.config.serve
    if sv.weight_dtype != "fp8" or sv.quantized_checkpoint:
        return None
    return VLLM_0_33_0_ONLINE_FP8[sv.weight_format or "fp8-block"] if target == "vllm" else "fp8"


#: SERVE_VARIANTS of one server that every engine takes (serve_budget_below_seqs: vLLM refuses it)
ONE_SERVER_VARIANTS = ("serve_budget", "serve_fp8_weights", "serve_fp8_weights_fp8_kv", "serve_budget_32k")


@pytest.mark.parametrize("target", list(SERVE_TARGETS))
def test_serve_exports_name_the_plan(target, monkeypatch):
    """vLLM 0.33.0 / SGLang 0.5.23 flags (pinned above) carrying the plan's tp, pp, dp,
    context, concurrent sequences, KV dtype and memory fraction, the token budget
    (max_prefill_tokens) and the weights' quantization on load, for the serve examples and the
    one-server SERVE_VARIANTS."""
    monkeypatch.chdir(REPO)
    plans = [(spec.stem, _compiled(spec.stem)) for spec in EXAMPLES]
    plans += [(name, _serve_variant(name)) for name in ONE_SERVER_VARIANTS]
    seen = set()
    for name, plan in plans:
        if plan.config.workload != "serve":
            continue
        ex = export(plan, target)
        sv, s, deg = plan.config.serve, plan.data["serve"], plan.data["degrees"]
        words = ["--model-path"] if target == "sglang" else []
        assert len(serve_commands(ex.text)) == 1, name
        model = sv.weights or "MODEL"   # no checkpoint named: the user's to put in
        env, launcher, f = parse_command(ex.text, "sglang.launch_server" if target == "sglang" else model)
        assert not env and not ex.errors
        if target == "vllm":
            assert launcher == ["vllm", "serve", model] and set(f) <= VLLM_0_33_0_FLAGS
            tp, pp, ctx, seqs = "--tensor-parallel-size", "--pipeline-parallel-size", "--max-model-len", "--max-num-seqs"
            kvs, dts, frac = VLLM_0_33_0_KV_CACHE_DTYPES, VLLM_0_33_0_DTYPES, "--gpu-memory-utilization"
            budget = "--max-num-batched-tokens"
            used = s["weights_bytes_per_rank"] + s["kv_cache_bytes_per_rank"] + s["workspace_bytes_per_rank"]
        else:
            assert launcher == ["python", "-m", "sglang.launch_server"] and set(f) <= SGLANG_0_5_23_FLAGS
            assert f[words[0]] == model
            tp, pp, ctx, seqs = "--tp-size", "--pp-size", "--context-length", "--max-running-requests"
            kvs, dts, frac = SGLANG_0_5_23_KV_CACHE_DTYPES, SGLANG_0_5_23_DTYPES, "--mem-fraction-static"
            budget = "--chunked-prefill-size"
            used = s["weights_bytes_per_rank"] + s["kv_cache_bytes_per_rank"]
        assert (int(f[tp]), int(f[pp])) == (deg["tp"], deg["pp"]), name
        assert int(f.get("--data-parallel-size", f.get("--dp-size", 1))) == deg["dp"] == s["replicas"]
        assert int(f[ctx]) == sv.prompt_len + sv.max_new_tokens
        assert int(f[seqs]) == s["batch_per_replica"]
        assert f["--kv-cache-dtype"] in kvs and (f["--kv-cache-dtype"] == "auto") == (sv.kv_dtype == plan.config.model.dtype)
        assert f["--dtype"] in dts
        # the token budget: the server's default (which the plan assumes) unless max_prefill_tokens
        # gives one; SGLang's prefill batch holds at most --chunked-prefill-size and
        # --max-prefill-tokens prompt tokens (raised past its default for a larger budget)
        assert f.get(budget) == (str(sv.max_prefill_tokens) if sv.max_prefill_tokens else None), name
        if target == "sglang":
            bound = int(f.get("--max-prefill-tokens", SGLANG_0_5_23_MAX_PREFILL_TOKENS))
            assert ("--max-prefill-tokens" in f) == ((sv.max_prefill_tokens or 0) > SGLANG_0_5_23_MAX_PREFILL_TOKENS)
            assert not sv.max_prefill_tokens or min(int(f[budget]), bound) == sv.max_prefill_tokens, name
        # weights quantized on load: the plan's format; none for the model's dtype or a quantized checkpoint
        assert f.get("--quantization") == _online_fp8(plan, target), name
        assert not {"--port", "--kv-transfer-config", "--disaggregation-mode"} & set(f), name
        seen |= {"budget"} if sv.max_prefill_tokens else set()
        seen |= {f"quantization {f['--quantization']}"} if "--quantization" in f else set()
        # the memory fraction covers what the plan's memory model puts on a GPU, rounded up to 0.01
        fraction = float(f[frac])
        assert used <= fraction * plan.config.cluster.memory < used + 0.01 * plan.config.cluster.memory, name
        # the note on the KV cache says what that fraction holds, not what the whole GPU would
        per_sequence = s["kv_cache_bytes_per_rank"] / s["batch_per_replica"]
        held = int((fraction * plan.config.cluster.memory - used + s["kv_cache_bytes_per_rank"]) // per_sequence)
        assert s["batch_per_replica"] <= held < s["max_concurrent_sequences"], name
        note = next(n for n in ex.notes if "sequences of" in n)
        assert note.startswith(f"{frac} {f[frac]} sizes the KV cache for about {held} sequences of "
                               f"{sv.prompt_len + sv.max_new_tokens} tokens (the plan's {s['batch_per_replica']} "
                               "per replica"), note
        assert f"the GPU's free memory would hold {s['max_concurrent_sequences']}: raise {frac}" in note, note
    assert seen == {"budget", f"quantization {'fp8_per_block' if target == 'vllm' else 'fp8'}"}, seen


def _one_server(ex, target: str) -> dict[str, object]:
    """The flags of a one-server vLLM / SGLang export."""
    (command,) = serve_commands(ex.text)
    launcher, flags = serve_flags(command)
    assert launcher[:2] == (["vllm", "serve"] if target == "vllm" else ["python", "-m"])
    return flags


@pytest.mark.parametrize("target", list(SERVE_TARGETS))
def test_serve_export_budget(target, monkeypatch):
    """max_prefill_tokens is vLLM's --max-num-batched-tokens and SGLang's --chunked-prefill-size
    (with --max-prefill-tokens past SGLang's default of 16,384); none: the server's default. A
    budget below the sequences of a step is refused for vLLM (its SchedulerConfig does: every
    decoding sequence's token counts in the budget) and taken by SGLang."""
    monkeypatch.chdir(REPO)
    flag = "--max-num-batched-tokens" if target == "vllm" else "--chunked-prefill-size"
    assert flag not in _one_server(export(_compiled("llama3_70b_serve_8x_h100"), target), target)
    for name, tokens in (("serve_budget", 4096), ("serve_budget_32k", 32768), ("serve_budget_below_seqs", 16)):
        plan = _serve_variant(name)
        assert plan.config.serve.max_prefill_tokens == tokens
        ex = export(plan, target)
        f = _one_server(ex, target)
        assert f[flag] == str(tokens), name
        assert f.get("--max-prefill-tokens") == ("32768" if target == "sglang" and tokens == 32768 else None), name
        refused = target == "vllm" and tokens < plan.data["serve"]["batch_per_replica"]
        assert [e for e in ex.errors if e.startswith(f"max_prefill_tokens {tokens}:")] == (
            [f"max_prefill_tokens {tokens}: vLLM's --max-num-batched-tokens must be at least --max-num-seqs "
             f"({plan.data['serve']['batch_per_replica']}): every decoding sequence's token counts in the budget"]
            if refused else []), name
        assert ex.errors == [] or refused


@pytest.mark.parametrize("target", list(SERVE_TARGETS))
def test_serve_export_weights_quantization(target, monkeypatch, tmp_path):
    """--quantization exactly for fp8 weights over a 16-bit or no checkpoint, in the plan's
    format (vLLM 0.33.0: fp8_per_block for the plan's fp8-block, fp8_per_tensor for the
    fp8-tensor a 16-bit checkpoint plans; SGLang 0.5.23: fp8); none for the model's dtype, an
    FP8 checkpoint or a 4-bit one (read as published, a note says so); int4 over a 16-bit
    checkpoint is an error (the spec's), int4 with no checkpoint yet a note that it must be
    AWQ / GPTQ."""
    monkeypatch.chdir(REPO)

    def plan(weight_dtype: str | None, config: dict | None = None):
        src = LLAMA3_70B_SERVE
        if weight_dtype is not None:
            src = src.replace(_KV_BF16, _KV_BF16 + f"    weight_dtype   = {weight_dtype}\n")
        if config is not None:   # a checkpoint directory of just its config.json
            ckpt = tmp_path / f"ckpt{len(list(tmp_path.iterdir()))}"
            ckpt.mkdir()
            (ckpt / "config.json").write_text(json.dumps(config))
            src = src.replace('"Meta-Llama-3-70B"', json.dumps(str(ckpt)))
        assert src != LLAMA3_70B_SERVE or (weight_dtype, config) == (None, None)
        return parcompile.compile(src, "q.par")

    fp8 = {"vllm": "fp8_per_block", "sglang": "fp8"}[target]
    fp8_tensor = {"vllm": "fp8_per_tensor", "sglang": "fp8"}[target]
    bf16 = {"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}
    fp8_block = {**bf16, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                 "weight_block_size": [128, 128]}}
    awq = {**bf16, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                           "zero_point": True, "version": "gemm"}}
    cases = [(None, None, None, None), ("model", None, None, None), ("fp8", None, fp8, "fp8-block"),
             ("fp8", bf16, fp8_tensor, "fp8-tensor"), ("fp8", fp8_block, None, "the checkpoint's own fp8-block"),
             ("int4", awq, None, "the checkpoint's own int4-awq"),
             ("int4", None, None, "the model directory must be a 4-bit AWQ or GPTQ checkpoint")]
    for weight_dtype, config, want, says in cases:
        p = plan(weight_dtype, config)
        ex = export(p, target)
        f = _one_server(ex, target)
        case = (weight_dtype, config and config.get("quantization_config"))
        assert not ex.errors and f.get("--quantization") == want, case
        assert (want is not None) == (p.config.serve.weight_dtype == "fp8" and not p.config.serve.quantized_checkpoint)
        weights = [n for n in ex.notes if n.startswith("weights: ") and "names no checkpoint" not in n]
        assert (weights == []) == (says is None), (case, weights)
        assert says is None or says in weights[0], (case, weights)
        assert want is None or weights[0].startswith(f"weights: quantized to FP8 as {SERVE_TARGETS[target]} loads them")
    with pytest.raises(SpecError, match="weight_dtype = int4 needs a checkpoint quantized so"):
        plan("int4", bf16)


@pytest.mark.parametrize("target", list(SERVE_TARGETS))
@pytest.mark.parametrize("name", ["serve_disaggregated", "serve_disaggregated_fp8_budget"])
def test_disaggregated_serve_export_two_servers(target, name, monkeypatch):
    """A disaggregated plan exports two servers in one script, started in the background:
    the prefill pool's (tp prefill_tp, dp prefill_replicas, pp 1, the server's own memory
    fraction) and the decode pool's (the plan's degrees and memory fraction), each with its
    role (vLLM: NixlConnector, kv_producer / kv_consumer; SGLang: --disaggregation-mode
    prefill / decode) and its own port; the budget, the weights' quantization, the context and
    the sequences on both; every flag one the release's parser took (pinned above)."""
    monkeypatch.chdir(REPO)
    plan = _serve_variant(name)
    ex = export(plan, target)
    sv, s, deg = plan.config.serve, plan.data["serve"], plan.data["degrees"]
    assert sv.disaggregated and not ex.errors
    assert (s["prefill_pool"]["tp"], s["prefill_pool"]["replicas"]) == (sv.prefill_tp, sv.prefill_replicas) == (4, 2)
    commands = serve_commands(ex.text)
    assert len(commands) == 2 and ex.text.index("# the prefill pool") < ex.text.index("# the decode pool")
    if target == "vllm":
        names, flags, frac = ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size"), \
            VLLM_0_33_0_FLAGS, "--gpu-memory-utilization"
        budget, ctx, seqs = "--max-num-batched-tokens", "--max-model-len", "--max-num-seqs"
    else:
        names, flags, frac = ("--tp-size", "--pp-size", "--dp-size"), SGLANG_0_5_23_FLAGS, "--mem-fraction-static"
        budget, ctx, seqs = "--chunked-prefill-size", "--context-length", "--max-running-requests"
    pools = {"prefill": (sv.prefill_tp, 1, sv.prefill_replicas), "decode": (deg["tp"], deg["pp"], deg["dp"])}
    ports = []
    for (role, (tp, pp, dp)), command in zip(pools.items(), commands):
        launcher, f = serve_flags(command)
        assert set(f) <= flags, (role, set(f) - flags)
        assert launcher == (["vllm", "serve", "MODEL"] if target == "vllm" else ["python", "-m", "sglang.launch_server"])
        assert target == "vllm" or f["--model-path"] == "MODEL"
        assert (int(f[names[0]]), int(f[names[1]]), int(f.get(names[2], 1))) == (tp, pp, dp), role
        if target == "vllm":
            assert json.loads(f["--kv-transfer-config"]) == {"kv_connector": "NixlConnector",
                                                             "kv_role": VLLM_0_33_0_KV_ROLES[role]}, role
        else:
            assert f["--disaggregation-mode"] == role and role in SGLANG_0_5_23_DISAGGREGATION_MODES
        assert f.get(budget) == (str(sv.max_prefill_tokens) if sv.max_prefill_tokens else None), role
        assert f.get("--quantization") == _online_fp8(plan, target), role
        assert (int(f[ctx]), int(f[seqs])) == (sv.prompt_len + sv.max_new_tokens, s["batch_per_replica"]), role
        assert (frac in f) == (role == "decode"), role   # the plan's memory model is the decode pool's
        ports.append(int(f["--port"]))
    assert len(set(ports)) == 2 and not {8000, 30000} & set(ports), ports   # neither server's default
    # the two pools hold the cluster's GPUs
    assert sv.prefill_tp * sv.prefill_replicas + deg["tp"] * deg["pp"] * deg["dp"] == s["gpus"] == 16
    assert ("--quantization" in ex.text) == (name == "serve_disaggregated_fp8_budget")


def test_megatron_layer_less_end_chunks():
    """A layer-less first / last model chunk (Llama 3 paper section 3.3.2) exports as
    Megatron-Core's --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split
    where those flags give the split (get_num_layers_to_build, core_v0.16.1), else as a note
    with the --pipeline-model-parallel-layout string; torchtitan gets the embedding alone and
    the output alone as model parts."""
    from parcompile.driver import compile_config
    from parcompile.exporters import megatron_accounted_split, megatron_args, megatron_layout, torchtitan_model_parts
    from tests.program_utils import tiny_config
    meta = [0] + [1] * 126 + [0]
    assert megatron_accounted_split(meta, 16) == (True, True)
    assert megatron_accounted_split([1, 2, 2, 2], 2) == (True, False)   # 7 + 1 = 4 x 2
    assert megatron_accounted_split([0, 2, 2, 2], 2) is None
    assert megatron_accounted_split([7, 8, 8, 7], 4) == (True, True)      # 30 + 2 = 4 x 8
    assert megatron_accounted_split([0, 2, 1, 0], 2) is None             # 3 + 2 slots do not split in 4
    assert megatron_layout([0, 2, 1, 0]) == "E|tt|t|L"
    assert torchtitan_model_parts([0, 2, 1, 0], "output") == [
        ["tok_embeddings"], ["layers.0", "layers.1"], ["layers.2"], ["norm", "output"]]
    cfg = tiny_config(1, 1, 2, model=dict(layers=3), parallel=dict(
        schedule="interleaved_1f1b", virtual_stages=2, stage_layers=(0, 1, 1, 1), global_batch=8))
    args, _ = megatron_args(compile_config(cfg))
    flags = [f for f, _ in args]
    assert "--account-for-embedding-in-pipeline-split" in flags
    assert "--account-for-loss-in-pipeline-split" not in flags
    assert "--decoder-first-pipeline-num-layers" not in flags
    cfg = tiny_config(1, 1, 2, model=dict(layers=3), parallel=dict(
        schedule="interleaved_1f1b", virtual_stages=2, stage_layers=(0, 2, 1, 0), global_batch=8))
    args, notes = megatron_args(compile_config(cfg))
    assert not any("account-for" in f or "decoder-first" in f for f, _ in args)
    assert any("--pipeline-model-parallel-layout 'E|tt|t|L'" in n for n in notes)
def test_export_never_writes_over_the_files_it_reads(monkeypatch, capsys, tmp_path):
    """Before: `export tiny.par --to megatron -o tiny.par` replaced the spec with Megatron's
    arguments (exit 0), and `-o` the training data replaced the data. Now a usage error, as
    gcc's "input file is the same as output file": nothing is written, the files keep their
    bytes (through a symbolic link too)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.txt").write_text("hello world " * 50)
    spec = TINY.replace('"builtin:pydoc"', '"train.txt"')
    assert '"train.txt"' in spec
    (tmp_path / "tiny.par").write_text(spec)
    (tmp_path / "link.par").symlink_to(tmp_path / "tiny.par")
    for out in ("tiny.par", "./tiny.par", str(tmp_path / "tiny.par"), "link.par", "train.txt"):
        assert main(["export", "tiny.par", "--to", "megatron", "-o", out]) == 2
        assert "is an input of this export" in capsys.readouterr().err
    assert (tmp_path / "tiny.par").read_text() == spec and (tmp_path / "link.par").is_symlink()
    assert (tmp_path / "train.txt").read_text() == "hello world " * 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.par", "tiny.par", "train.txt"]


@pytest.mark.parametrize("name", ['a\ntouch PWNED\nb.txt', 'a"""\nimport os; os.mkdir("PWNED")\n""".txt'])
def test_a_data_path_cannot_break_out_of_an_exports_comments(monkeypatch, tmp_path, name):
    """Before: the data note quoted the path as written, so a file name with a line break
    put `touch PWNED` on a line of its own in the Megatron-LM script (a command that runs)
    and `\"\"\"` closed the docstring of the Megatron-Bridge and torchtitan modules (code that
    runs on import). Now the path is quoted (escapes): comments stay comments."""
    import ast

    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text("hello world " * 300)
    escaped = json.dumps(name)[1:-1]
    spec = TINY_PP.replace('"builtin:pydoc"', f'"{escaped}"')
    assert escaped in spec
    plan = parcompile.compile(spec, "tiny.par")
    sh = export(plan, "megatron").text
    head = sh[:sh.index("torchrun")].splitlines()
    assert all(line.startswith("#") for line in head[:-1]), head
    assert not any(line.lstrip().startswith(("touch", "b.txt", "import os")) for line in sh.splitlines())
    for target in ("megatron-bridge", "torchtitan"):
        tree = ast.parse(export(plan, target).text)
        doc = ast.get_docstring(tree)
        assert "PWNED" in doc, target
        assert not any("PWNED" in ast.unparse(node) for node in tree.body[1:]), target


def test_export_to_a_pipe_or_device_writes_through_it(monkeypatch, tmp_path):
    """Before: `-o /dev/stdout` (or a FIFO, or bash's `-o >(cmd)`) wrote a temporary file
    beside it and renamed it over the path: the FIFO (as root: /dev/stdout itself) was
    replaced by a regular file and the reader got nothing. Now what is not a regular file
    is written through, as a shell redirection would, and stays what it was."""
    import os
    import stat
    import threading

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.par").write_text(TINY)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []

    def reader():
        with open(fifo) as f:
            got.append(f.read())

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    rc = main(["export", "tiny.par", "--to", "megatron", "-o", str(fifo)])
    t.join(10)
    if t.is_alive():   # nothing was written into the FIFO: unblock the reader
        with open(fifo, "w"):
            pass
    assert rc == 0 and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert got and got[0].startswith("# Megatron-LM"), got
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe", "tiny.par"]


def test_fp8_exports_pass_the_engines_fp8_settings(monkeypatch):
    """precision = fp8 (issue 32): Megatron-LM gets --fp8-format e4m3, --fp8-recipe (tensorwise is
    Transformer Engine's current scaling) and --fp8-param-gather with FP8 all-gather, each a
    core_v0.19 flag; rowwise, which Megatron has not, is refused; torchtitan 0.2's TOML names
    its float8 converter and table (v0.2.2 job_config.py Quantize) with the LM head kept out;
    DeepSpeed refuses FP8."""
    monkeypatch.chdir(REPO)
    base = MODEL_VARIANTS["llama31_70b_8x8"]
    assert "train {" in base

    def plan(train: str):
        return parcompile.compile(base.replace("train {", "train {\n    precision = fp8\n" + train, 1), "fp8.par")

    tw = plan("")
    _launcher, flags = parse_megatron(export(tw, "megatron").text)
    assert flags["--fp8-format"] == "e4m3" and flags["--fp8-recipe"] == "tensorwise"
    assert "--fp8-param-gather" not in flags
    assert set(flags) <= MEGATRON_CORE_V0_19_0_FLAGS | MEGATRON_CORE_V0_19_0_FP8_FLAGS | MEGATRON_CORE_V0_19_0_PRECISION_FLAGS
    rw = plan("    fp8_recipe = rowwise\n")
    assert any(e.startswith("fp8_recipe rowwise:") for e in export(rw, "megatron").errors)
    t = tomllib.loads(export(rw, "torchtitan", torchtitan_version="0.2").text)
    assert t["model"]["converters"] == ["quantize.linear.float8"]
    assert t["quantize"]["linear"]["float8"] == {"filter_fqns": ["output"], "recipe_name": "rowwise"}
    assert export(tw, "deepspeed").errors and export(tw, "torchtitan").errors   # 0.3: not yet
    # DeepSpeed's refusal names an export that takes FP8 (issue 47: it named torchtitan, whose
    # default version refuses FP8): each target it suggests exports this plan without an error
    (refusal,) = [e for e in export(tw, "deepspeed").errors if e.startswith("precision fp8")]
    assert "--to megatron" in refusal and "--to torchtitan --torchtitan-version 0.2" in refusal
    assert not export(tw, "megatron").errors and not export(tw, "torchtitan", torchtitan_version="0.2").errors


def test_megatron_export_reduces_in_bf16_at_every_zero_level():
    """reduce_dtype bf16 is Megatron-LM's --grad-reduce-in-bf16 whatever the ZeRO level: its grad
    buffer is in the parameters' dtype unless grad_reduce_in_fp32 (Megatron-LM d98e8a6
    param_and_grad_buffer.py group_params_for_buffers), which the plan of engine megatron counts
    (analysis/estimate.py grad_element_bytes); fp32 exports no flag."""
    par = "parallel {\n dp = 4\n tp = 1\n pp = 2\n zero = 1\n micro_batch = 1\n global_batch = 16\n%s}"
    for rd, want in (("", False), (" reduce_dtype = bf16\n", True)):
        plan = _variant(par % rd, "bf16")
        _launcher, flags = parse_megatron(export(plan, "megatron").text)
        assert ("--grad-reduce-in-bf16" in flags) == want, rd
        assert set(flags) <= MEGATRON_CORE_V0_19_0_FLAGS | MEGATRON_CORE_V0_19_0_PRECISION_FLAGS, rd
