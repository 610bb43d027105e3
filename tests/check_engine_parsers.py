"""Run the exports through engines' own argument parsers that do not install on this CPU box
(not collected by pytest; the flag sets in tests/test_export.py were taken from this run):

    python tests/check_engine_parsers.py megatron /path/to/Megatron-LM   # core_v0.19.0 checkout
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=/path/to/vllm-0.33.0-sdist:DEPS python tests/check_engine_parsers.py vllm
    PYTHONPATH=/path/to/sglang-0.5.23-wheel:DEPS python tests/check_engine_parsers.py sglang
    python tests/check_engine_parsers.py torchtitan0.2 /path/to/torchtitan-0.2.2-wheel   # unpacked
    /path/to/bridge-venv/bin/python tests/check_engine_parsers.py megatron-bridge   # see megatron_bridge()

- Megatron-LM: ``megatron.training.arguments.parse_args`` and ``validate_args`` with each
  export's arguments and environment, WORLD_SIZE from the plan, an H100 (Hopper) device
  architecture; prints the world, dp, tp, pp, cp, micro-batch, global batch, layers and virtual
  stages Megatron derives and whether they are the plan's. Python 3.11 needs
  ``typing.override`` (3.12) and the CPU torch has no Triton, so the one Triton kernel module
  on the import path (``megatron.core.transformer.moe.ops.paged_stash``) is stubbed.
- vLLM: the ``vllm serve`` subparser (``ServeSubcommand().subparser_init``) and
  ``validate_parsed_serve_args``, then SchedulerConfig (the budget against the sequences),
  ``get_quantization_config`` / ``resolve_quantization_config`` (``--quantization`` has no
  argparse choices) and the ``--kv-transfer-config`` KVTransferConfig; DEPS are its
  pure-Python imports (cbor2, pyzmq, openai-harmony, msgspec, pybase64, cachetools, uvloop,
  xgrammar, apache-tvm-ffi, partial-json-parser, llguidance, watchfiles), ``pip install
  --no-deps --target DEPS`` (with their dependencies pip brings torch 2.14 onto the path). The
  sdist: ``pip download --no-binary :all: vllm==0.33.0`` refuses it (its metadata built here
  says 0.33.0+cpu); ``pip download --no-deps --no-build-isolation`` of its PyPI file's URL
  with VLLM_TARGET_DEVICE=cpu and setuptools-rust, setuptools-scm on PYTHONPATH saves it.
- LoRA (issue 49): tests/test_export_lora.py's LORA_SPECS, their ``--to vllm`` through the
  same ``vllm serve`` parser and vLLM's ``LoRAConfig`` (``--max-lora-rank`` one of its
  MaxLoRARanks), their ``--to megatron-bridge`` built by Megatron-Bridge (``cfg.peft`` a
  ``CanonicalLoRA`` whose ``canonical_mapping`` names the projections parcompile adapts).
- SGLang: ``ServerArgs.add_cli_args``; DEPS are pybase64, msgspec, pyzmq and triton.
- Both: every serve example and tests/test_export.py's SERVE_VARIANTS (a budget, FP8 weights
  quantized on load with and without an FP8 KV cache, a disaggregated plan's two servers,
  each parsed alone: tp/dp prefill_tp/prefill_replicas, then the plan's; role and port); a
  command the parser refuses must be one the export says an error for.
- torchtitan 0.2.2 (the ``--torchtitan-version 0.2`` TOML; pytorch/torchtitan tag v0.2.2,
  commit 73a0e6979dd10b6b1904098eb3c8f62c18ab87ce: ``git archive v0.2.2 torchtitan`` unpacked
  does as well as the wheel): for each export it does not refuse, its ``ConfigManager`` with
  ``--job.config_file``, the flavor's model built on the meta device (layers, dim, heads, kv
  heads, SwiGLU width, vocabulary, RoPE theta and scaling, norm eps against the spec's), the
  dtype as 0.2 trains it (mixed_precision_param under FSDP, or autocast without tp/pp), the
  batch sizes, ``ParallelDims`` and ``generate_llm_fqn_per_model_part``; its MoE Triton
  kernels module is stubbed.
"""

from __future__ import annotations

import os
import shlex
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _words(text: str) -> list[str]:
    return shlex.split("\n".join(line for line in text.splitlines() if not line.startswith("#")).replace("\\\n", " "))


def megatron(checkout: str) -> int:
    import typing

    import typing_extensions

    typing.override = typing_extensions.override

    class _Kernels(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return lambda *a, **k: None

    stub = "megatron.core.transformer.moe.ops.paged_stash"
    sys.modules[stub] = _Kernels(stub)
    sys.path.insert(0, checkout)
    import megatron.training.arguments as arguments

    from parcompile.exporters import export, megatron_env
    from tests.test_export import _plans

    arguments.get_device_arch_version = lambda: 9   # H100 (Hopper), as the examples
    bad = 0
    for name, plan in _plans() + _megatron_module_plans():
        ex = export(plan, "megatron")
        words = _words(ex.text)
        saved = dict(os.environ)
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        os.environ.update(megatron_env(plan), WORLD_SIZE=str(plan.data["world_size"]), RANK="0")
        try:
            sys.argv = ["pretrain_gpt.py"] + words[words.index("pretrain_gpt.py") + 1:]
            a = arguments.validate_args(arguments.parse_args())
            deg, par = plan.data["degrees"], plan.config.parallel
            # layers per pipeline stage as Megatron-Core splits them (first/last stage flags, the
            # rest even), virtual stages, vocabulary and dtype (params_dtype from --bf16/--fp16)
            pp, L = a.pipeline_model_parallel_size, a.num_layers
            first, last = a.decoder_first_pipeline_num_layers, a.decoder_last_pipeline_num_layers
            if first is None and last is None:
                stages = [L // pp] * pp
            else:
                middle = L - (first or 0) - (last or 0)
                inner = pp - (first is not None) - (last is not None)
                stages = ([first] if first is not None else []) + [middle // max(inner, 1)] * inner + (
                    [last] if last is not None else [])
            from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

            got = (a.world_size, a.data_parallel_size, a.tensor_model_parallel_size, pp,
                   a.context_parallel_size, a.micro_batch_size, a.global_batch_size, stages,
                   a.virtual_pipeline_model_parallel_size, a.vocab_size, str(a.params_dtype),
                   vocab_size_with_padding(a.vocab_size, a, logging_enabled=False))
            chunks = list(par.layers_per_chunk(plan.config.model.layers))
            want = (plan.data["world_size"], deg["dp"], deg["tp"], deg["pp"], deg["cp"], par.micro_batch,
                    par.global_batch, [sum(chunks[r::deg["pp"]]) for r in range(deg["pp"])],
                    deg["virtual_stages"] if deg["virtual_stages"] > 1 else None, plan.config.model.vocab,
                    {"bf16": "torch.bfloat16", "fp16": "torch.float16",
                     "fp32": "torch.float32"}[plan.config.model.dtype],
                    plan.data["model"]["padded_vocab"])
            ok = got == want and not ex.errors
            if isinstance(par.recompute, tuple) or par.grad_dtype != "fp32":
                # a module list and bf16 gradients: the fields Megatron-Core reads them into
                mods = (a.recompute_granularity, a.recompute_modules, a.accumulate_allreduce_grads_in_fp32)
                want_mods = ("selective", list(par.recompute), par.grad_dtype == "fp32")
                print(f"{name}: recompute_granularity, recompute_modules, accumulate_allreduce_grads_in_fp32 "
                      f"{mods} (the plan's {want_mods})")
                ok = ok and mods == want_mods
            print(f"{name}: {'accepted, the plan' if ok else f'DIFFERS {got} != {want}'}")
            bad += not ok
        except BaseException as e:   # validate_args asserts
            refused = bool(ex.errors)
            print(f"{name}: rejected ({e}); export {'refused it too' if refused else 'DID NOT refuse it'}")
            bad += not refused
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return bad


def _megatron_module_plans():
    """The Megatron-Bridge GPT-OSS recipe's settings on tests/test_recompute_modules.py's MoE
    spec: recompute = [layernorm, moe_act] and grad_dtype = bf16 (--recompute-modules,
    --grad-reduce-in-bf16), on the H100 and at ZeRO 1."""
    import parcompile
    from tests.test_recompute_modules import spec

    return tuple((f"recompute_{'_'.join(m)}_bf16_grads", parcompile.compile(spec(f"[{', '.join(m)}]",
                                                                                   grad="grad_dtype = bf16")))
                 for m in (("layernorm", "moe_act"), ("core_attn", "moe")))


def _serve_plans():
    """The serve examples and tests/test_export.py's SERVE_VARIANTS (the budget, FP8 weights
    quantized on load with and without an FP8 KV cache, disaggregated prefill/decode pools)."""
    import parcompile

    from tests.test_export import SERVE_VARIANTS, _serve_variant

    for spec in sorted((REPO / "examples").glob("*.par")):
        plan = parcompile.compile(spec.relative_to(REPO))
        if plan.config.workload == "serve":
            yield spec.stem, plan
    for name in SERVE_VARIANTS:
        yield name, _serve_variant(name)


def _serve_servers(plan, target):
    """(name, the command's words, what it must carry) for each server command of the export:
    one, or a disaggregated export's prefill pool (tp prefill_tp, dp prefill_replicas, port
    8100) and decode pool (the plan's degrees, port 8200); what it must carry: (tp, pp, dp,
    context, sequences, budget, quantization, role, port)."""
    from parcompile.exporters import export
    from tests.test_export import serve_commands

    ex = export(plan, target)
    sv, deg, s = plan.config.serve, plan.data["degrees"], plan.data["serve"]
    quant = {"vllm": {"fp8-block": "fp8_per_block", "fp8-tensor": "fp8_per_tensor"},
             "sglang": {"fp8-block": "fp8", "fp8-tensor": "fp8"}}[target].get(sv.weight_format or "fp8-block") \
        if sv.weight_dtype == "fp8" and not sv.quantized_checkpoint else None
    common = (sv.prompt_len + sv.max_new_tokens, s["batch_per_replica"], sv.max_prefill_tokens, quant)
    commands = serve_commands(ex.text)
    if not sv.disaggregated:
        assert len(commands) == 1
        return ex, [("", shlex.split(commands[0]), (deg["tp"], deg["pp"], deg["dp"]) + common + (None, None))]
    p = s["prefill_pool"]
    assert len(commands) == 2
    roles = {"vllm": ("kv_producer", "kv_consumer"), "sglang": ("prefill", "decode")}[target]
    return ex, [(" prefill", shlex.split(commands[0]), (p["tp"], 1, p["replicas"]) + common + (roles[0], 8100)),
                (" decode", shlex.split(commands[1]), (deg["tp"], deg["pp"], deg["dp"]) + common + (roles[1], 8200))]


def vllm() -> int:
    """Each server command through the ``vllm serve`` parser and validate_parsed_serve_args,
    then its budget and sequences through SchedulerConfig (vllm/config/scheduler.py
    verify_max_model_len: max_num_batched_tokens >= max_num_seqs, and >= max_model_len
    without chunked prefill) and ``--quantization`` through resolve_quantization_config
    (vllm/config/quantization.py: an online scheme's weight format); a command refused is
    right where the export says an error."""
    from vllm.config.quantization import resolve_quantization_config
    from vllm.config.scheduler import SchedulerConfig
    from vllm.entrypoints.cli.serve import ServeSubcommand, validate_parsed_serve_args
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = ServeSubcommand().subparser_init(FlexibleArgumentParser().add_subparsers())
    bad = 0
    for name, plan in _serve_plans():
        ex, servers = _serve_servers(plan, "vllm")
        for role, words, want in servers:
            assert words[:2] == ["vllm", "serve"], words
            try:
                ns = parser.parse_args(words[2:])
                validate_parsed_serve_args(ns)
                sched = SchedulerConfig(max_model_len=ns.max_model_len, is_encoder_decoder=False,
                                        max_num_seqs=ns.max_num_seqs,
                                        **({"max_num_batched_tokens": ns.max_num_batched_tokens}
                                           if ns.max_num_batched_tokens else {}),
                                        **({"enable_chunked_prefill": ns.enable_chunked_prefill}
                                           if ns.enable_chunked_prefill is not None else {}))
                # --quantization has no argparse choices: ModelConfig._verify_quantization checks the name
                # against QUANTIZATION_METHODS, get_quant_config resolves an online scheme
                method = get_quantization_config(ns.quantization).__name__ if ns.quantization else None
                online = resolve_quantization_config(ns.quantization, ns.quantization_config)
            except BaseException as e:   # argparse exits; the validators raise
                print(f"{name}{role}: rejected ({type(e).__name__}: {e}); export "
                      f"{'refused it too' if ex.errors else 'DID NOT refuse it'}: {ex.errors}")
                bad += not ex.errors
                continue
            kvt = ns.kv_transfer_config
            got = (ns.tensor_parallel_size, ns.pipeline_parallel_size, ns.data_parallel_size, ns.max_model_len,
                   ns.max_num_seqs, ns.max_num_batched_tokens, ns.quantization,
                   kvt.kv_role if kvt is not None else None, None if ns.port == parser.get_default("port") else ns.port)
            ok = got == want and (kvt is None or kvt.kv_connector == "NixlConnector")
            print(f"{name}{role}: {got} {'the plan' if ok else f'DIFFERS from {want}'}; kv {ns.kv_cache_dtype}, "
                  f"memory {ns.gpu_memory_utilization}"
                  + (f", SchedulerConfig budget {sched.max_num_batched_tokens}" if ns.max_num_batched_tokens else "")
                  + (f", kv transfer {kvt.kv_connector} {kvt.kv_role}" if kvt is not None else "")
                  + (f", weights {method}" + (f" quantized on load: linear {online.linear}" if online else "")
                     if method else "")
                  + (f"; export errors: {ex.errors}" if ex.errors else ""))
            bad += not ok
    return bad + _vllm_lora(parser, validate_parsed_serve_args)


def _vllm_lora(parser, validate) -> int:
    """Each LoRA training spec's ``--to vllm`` (the fine-tune's adapter on its base model,
    issue 49) through the same parser, then ``--max-lora-rank`` through vLLM's LoRAConfig
    (vllm/config/lora.py: MaxLoRARanks): the adapter named as the spec, at hf_output, a rank
    allowed and at least the plan's."""
    from vllm.config.lora import LoRAConfig

    from parcompile.exporters import export
    from tests.test_export import serve_commands

    bad = 0
    for name, plan in _lora_plans():
        ex = export(plan, "vllm")
        (command,) = serve_commands(ex.text)
        words = shlex.split(command)
        try:
            ns = parser.parse_args(words[2:])
            validate(ns)
            lora = LoRAConfig(max_lora_rank=ns.max_lora_rank, max_loras=ns.max_loras)
        except BaseException as e:
            print(f"{name} lora: rejected ({type(e).__name__}: {e}); export errors: {ex.errors}")
            bad += not ex.errors
            continue
        (module,) = ns.lora_modules
        got = (ns.enable_lora, module.name, module.path, lora.max_lora_rank >= plan.config.train.lora_rank)
        want = (True, name, "HF_OUTPUT", True)
        print(f"{name} lora: {got} {'the plan' if got == want else f'DIFFERS from {want}'}; max_lora_rank "
              f"{lora.max_lora_rank} for lora_rank {plan.config.train.lora_rank}")
        bad += got != want
    return bad


def sglang() -> int:
    """Each server command through ``ServerArgs.add_cli_args``'s parser (the namespace's
    fields: ServerArgs itself resolves the model's config at construction)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    bad = 0
    for name, plan in _serve_plans():
        ex, servers = _serve_servers(plan, "sglang")
        for role, words, want in servers:
            try:
                ns = parser.parse_args(words[words.index("sglang.launch_server") + 1:])
            except BaseException as e:   # argparse exits
                print(f"{name}{role}: rejected ({type(e).__name__}: {e}); export "
                      f"{'refused it too' if ex.errors else 'DID NOT refuse it'}: {ex.errors}")
                bad += not ex.errors
                continue
            default_port = parser.get_default("port")
            got = (ns.tp_size, ns.pp_size, ns.dp_size, ns.context_length, ns.max_running_requests,
                   ns.chunked_prefill_size, ns.quantization,
                   None if ns.disaggregation_mode == "null" else ns.disaggregation_mode,
                   None if ns.port == default_port else ns.port)
            # a prefill batch's prompt tokens: at most --chunked-prefill-size and --max-prefill-tokens
            # (PrefillAdder's rem_chunk_tokens and rem_input_tokens, sglang/srt/managers/schedule_policy.py)
            prefill = min(ns.chunked_prefill_size, ns.max_prefill_tokens) if ns.chunked_prefill_size else None
            ok = got == want and prefill == want[5]
            print(f"{name}{role}: {got} {'the plan' if ok else f'DIFFERS from {want}'}; "
                  f"kv {ns.kv_cache_dtype}, memory {ns.mem_fraction_static}, prefill batch tokens {prefill}"
                  + (f", transfer backend {ns.disaggregation_transfer_backend}" if got[7] else "")
                  + (f"; export errors: {ex.errors}" if ex.errors else ""))
            bad += not ok
    return bad


def torchtitan02(wheel_dir: str) -> int:
    import math
    import tempfile

    class _Kernels(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return lambda *a, **k: None

    sys.modules["torchtitan.models.moe.kernels"] = _Kernels("torchtitan.models.moe.kernels")
    sys.path.insert(0, wheel_dir)
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import pipeline_parallel as tt_pp
    from torchtitan.distributed.parallel_dims import ParallelDims

    from parcompile.exporters import export
    from tests.test_export import _plans

    import torch
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.model import Transformer

    bad, out = 0, tempfile.mkdtemp()
    for name, plan in _plans():
        ex = export(plan, "torchtitan", torchtitan_version="0.2")
        if ex.errors:   # refused: the CLI writes nothing
            print(f"{name}: refused: {ex.errors}")
            continue
        path = os.path.join(out, ex.filename)
        Path(path).write_text(ex.text)
        job = ConfigManager().parse_args(["--job.config_file", path])
        p = job.parallelism
        # the model the flavor builds (on the meta device), against the spec's
        args = llama3_args[job.model.flavor]
        with torch.device("meta"):
            model = Transformer(args)
        mdl = plan.config.model
        block = model.layers["0"]
        built = (len(model.layers), args.dim, args.n_heads, args.n_kv_heads, block.feed_forward.w1.out_features,
                 model.tok_embeddings.num_embeddings, float(args.rope_theta), args.norm_eps)
        spec = (mdl.layers, mdl.hidden, mdl.heads, mdl.kv_heads, mdl.ffn_hidden, mdl.vocab, float(mdl.rope_theta),
                mdl.norm_eps)
        rope = args.rope_scaling_args
        scaling = (rope.scaling_factor, rope.low_freq_factor, rope.high_freq_factor,
                   rope.original_max_position_embeddings)
        spec_scaling = (mdl.rope_scaling_factor, mdl.rope_low_freq_factor, mdl.rope_high_freq_factor,
                        mdl.rope_original_max_positions) if mdl.rope_type == "llama3" else None
        tr = job.training
        dtype_ok = tr.mixed_precision_param == {"bf16": "bfloat16", "fp32": "float32"}[mdl.dtype] and (
            mdl.dtype != "bf16" or p.data_parallel_shard_degree > 1 or p.context_parallel_degree > 1
            or p.tensor_parallel_degree == p.pipeline_parallel_degree == 1)
        batch = (tr.global_batch_size, p.pipeline_parallel_microbatch_size)
        if built != spec or scaling != spec_scaling or not dtype_ok or batch != (plan.config.parallel.global_batch,
                                                                               plan.config.parallel.micro_batch):
            print(f"{name}: ANOTHER MODEL/DTYPE/BATCH {built} {scaling} {tr.mixed_precision_param} {batch} != "
                  f"{spec} {spec_scaling} {mdl.dtype}")
            bad += 1
        dims = ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                            cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                            ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree,
                            world_size=plan.data["world_size"])
        deg, layers = plan.data["degrees"], plan.config.model.layers
        got = [dims.dp_replicate * dims.dp_shard, dims.tp, dims.pp, dims.cp]
        if dims.pp > 1:
            first, last = p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers
            parts = p.module_fqns_per_model_part or tt_pp.generate_llm_fqn_per_model_part(
                math.ceil((layers + first + last) / p.pipeline_parallel_layers_per_stage), layers, first, last)
            got.append([sum(m.startswith("layers.") for m in part) for part in parts])
        want = [deg["dp"], deg["tp"], deg["pp"], deg["cp"]]
        if dims.pp > 1:
            want.append(list(plan.config.parallel.layers_per_chunk(layers)))
        print(f"{name}: {'the plan' if got == want else f'DIFFERS {got} != {want}'}; export errors: {ex.errors}")
        bad += got != want
    return bad


def megatron_bridge() -> int:
    """Megatron-Bridge 0.3.1 (megatron-core 0.16.1, its pin), in a separate virtual environment
    (it pins transformers < 5 and a CUDA Transformer Engine; neither is needed to build and
    validate a config): ``pip install --no-deps megatron-bridge==0.3.1 'megatron-core>=0.16,<0.17'
    omegaconf`` into a venv made with ``--system-site-packages`` (torch, transformers); the
    ``transformer_engine``, ``triton`` and ``modelopt`` (NVIDIA ModelOpt, imported by gpt_step) imports
    are stubbed. Each export not refused is
    imported, its ``config()`` built and passed through ``runtime_config_update`` (what
    ``pretrain`` runs first: the mixed-precision recipe, the data-parallel size from WORLD_SIZE,
    ``ConfigContainer.validate``)."""
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import tempfile

    class _Any(type):   # any attribute of a stand-in class is a stand-in class
        def __getattr__(cls, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Stub

    class _Stub(metaclass=_Any):
        def __init__(self, *a, **k):
            pass

        def __call__(self, *a, **k):
            return _Stub()

    class _Module(types.ModuleType):
        __path__: list = []
        __version__ = "2.12.0"

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Stub

    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("transformer_engine", "triton", "modelopt", "nvidia_resiliency_ext"):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)

        def create_module(self, spec):
            return _Module(spec.name)

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, _Finder())
    import torch
    from megatron.bridge.training.config import runtime_config_update
    from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size

    from parcompile.exporters import export
    from tests.test_export import _plans

    bad, out = 0, tempfile.mkdtemp()
    for name, plan in _plans() + _lora_plans() + _offload_hsdp_plans():
        ex = export(plan, "megatron-bridge")
        if ex.errors:
            print(f"{name}: refused: {ex.errors}")
            continue
        path = os.path.join(out, ex.filename)
        Path(path).write_text(ex.text)
        spec = importlib.util.spec_from_file_location(ex.filename[:-3], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cfg = module.config()
        os.environ["WORLD_SIZE"] = str(plan.data["world_size"])
        try:
            runtime_config_update(cfg)
        except BaseException as e:
            print(f"{name}: REJECTED by Megatron-Bridge ({type(e).__name__}: {e})")
            bad += 1
            continue
        md, deg, par = cfg.model, plan.data["degrees"], plan.config.parallel
        pp, L = md.pipeline_model_parallel_size, md.num_layers
        first, last = md.num_layers_in_first_pipeline_stage, md.num_layers_in_last_pipeline_stage
        inner = pp - (first is not None) - (last is not None)
        middle = (L - (first or 0) - (last or 0)) // max(inner, 1)
        stages = ([first] if first is not None else []) + [middle] * inner + ([last] if last is not None else [])
        chunks = list(par.layers_per_chunk(plan.config.model.layers))
        got = (cfg.data_parallel_size, md.tensor_model_parallel_size, pp, md.context_parallel_size,
               md.expert_model_parallel_size, cfg.train.micro_batch_size, cfg.train.global_batch_size, stages,
               md.virtual_pipeline_model_parallel_size, md.vocab_size, cfg.tokenizer.vocab_size, md.params_dtype,
               calculate_padded_vocab_size(md.vocab_size, md.make_vocab_size_divisible_by,
                                           md.tensor_model_parallel_size) if md.should_pad_vocab else md.vocab_size)
        want = (deg["dp"], deg["tp"], deg["pp"], deg["cp"], deg["ep"], par.micro_batch, par.global_batch,
                [sum(chunks[r::deg["pp"]]) for r in range(deg["pp"])],
                deg["virtual_stages"] if deg["virtual_stages"] > 1 else None, plan.config.model.vocab,
                plan.config.model.vocab,
                {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[plan.config.model.dtype],
                plan.data["model"]["padded_vocab"])
        print(f"{name}: {'accepted, the plan' if got == want else f'DIFFERS {got} != {want}'}")
        bad += got != want
        if plan.config.train.method == "lora":
            bad += _bridge_lora(name, plan, cfg)
        if plan.config.parallel.offload != "none":   # megatron-core's own OptimizerConfig / DDP config
            dps = plan.passes.data_parallel
            got = (cfg.optimizer.optimizer_cpu_offload, cfg.optimizer.use_precision_aware_optimizer,
                   cfg.ddp.num_distributed_optimizer_instances)
            print(f"{name} offload, HSDP: {got} {'the plan' if got == (True, True, dps.replicate) else 'DIFFERS'}")
            bad += got != (True, True, dps.replicate)
    return bad


def _offload_hsdp_plans() -> tuple:
    """tests/test_offload.py's OFFLOAD_HSDP (optimizer offload, dp_replicate 2, zero 1)."""
    import parcompile
    from tests.test_offload import OFFLOAD_HSDP

    return (("offload_hsdp_zero1", parcompile.compile(OFFLOAD_HSDP, "offload_hsdp.par")),)


def _lora_plans() -> tuple:
    """tests/test_export_lora.py's LoRA specs (issue 49)."""
    from tests.test_export_lora import LORA_SPECS, lora_plan

    return tuple((name, lora_plan(name)) for name in LORA_SPECS)


def _bridge_lora(name, plan, cfg) -> int:
    """A LoRA export's ``peft`` as Megatron-Bridge built it: a CanonicalLoRA whose own
    ``canonical_mapping`` (its __post_init__: fused module -> the projections adapted) names the
    Hugging Face projections parcompile adapts, with the plan's rank, alpha and dropout."""
    from megatron.bridge.peft.canonical_lora import CanonicalLoRA

    from parcompile.core.lora import targeted

    hf = {"linear_q": "q_proj", "linear_k": "k_proj", "linear_v": "v_proj", "linear_proj": "o_proj",
          "linear_fc1_up": "up_proj", "linear_fc1_gate": "gate_proj", "linear_fc2": "down_proj"}
    p, t = cfg.peft, plan.config.train
    got = (type(p) is CanonicalLoRA, {hf[s] for subs in p.canonical_mapping.values() for s in subs},
           p.dim, p.alpha, p.dropout, p.dropout_position, cfg.checkpoint.pretrained_checkpoint is not None)
    want = (True, {lin.hf_leaf for lin in targeted(plan.config.model, t.lora_targets)}, t.lora_rank, t.lora_alpha,
            t.lora_dropout, "pre", True)
    print(f"{name} peft: {'CanonicalLoRA ' + str(dict(p.canonical_mapping)) if got == want else f'DIFFERS {got} != {want}'}")
    return got != want


if __name__ == "__main__":
    os.chdir(REPO)
    engine = sys.argv[1]
    checks = {"megatron": lambda: megatron(sys.argv[2]), "vllm": vllm, "sglang": sglang,
              "torchtitan0.2": lambda: torchtitan02(sys.argv[2]), "megatron-bridge": megatron_bridge}
    sys.exit(1 if checks[engine]() else 0)
