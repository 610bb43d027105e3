"""The training exports run through the engines' own code, in-process and without a GPU:

- torchtitan 0.3.0 (what pip installs): its ``ConfigManager`` loads the exported config
  registry module with ``--module``/``--config`` as the launch line gives them (plus a
  command-line override), ``ParallelDims.from_config`` takes the launch line's world, and its
  pipeline split (``_get_pipeline_metadata``, ``_generate_llm_fqn_per_model_part``,
  ``_get_pp_rank_to_stage_indices_mapping``) cuts the model into the chunks it would build.
- DeepSpeed 0.19.8: ``DeepSpeedConfig`` validates the JSON with the data-parallel size
  DeepSpeed's own pipeline topology (``PipeModelDataParallelTopology``) gives for the launch
  line's world and the stages and tensor-parallel size the export names, as
  ``PipelineParallelGrid`` would hand it (``mpu.get_data_parallel_world_size``).

For every example and the variants of ``tests/test_export.py`` (every schedule, ZeRO stage,
recompute mode, virtual stages, cp, fp16/bf16) each engine either accepts the export and
derives the plan's world, dp, tp, pp, cp, ep, micro-batch, micro-batches per step, global
batch, layers per chunk and per rank, ZeRO/FSDP stage, recompute and dtype, or the export
was refused with its reasons (``Export.errors``: a model or layout the engine cannot run).
Megatron-LM (not installable with its argument parser here: megatron-core 0.19 needs
Python 3.12 and its wheel has no megatron/training) is pinned in tests/test_export.py.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import types

import pytest

from parcompile.core.buckets import reshard_after_forward
from parcompile.exporters import export
from tests.test_export import REPO, _plans

ACCEPTED: dict[str, list[str]] = {"torchtitan": [], "deepspeed": []}


@pytest.fixture(scope="module")
def plans():
    import os

    old = os.getcwd()
    os.chdir(REPO)
    try:
        return _plans()
    finally:
        os.chdir(old)


def _launch_world(words: list[str], nodes_flag: str, gpus_flag: str) -> int:
    return int(words[words.index(nodes_flag) + 1]) * int(words[words.index(gpus_flag) + 1])


@pytest.fixture(scope="module")
def torchtitan():
    """torchtitan 0.3.0's config code. Its trainer module imports the Triton kernels of its
    MinimalAsyncEP token dispatcher (torchtitan/distributed/minimal_async_ep/kernels.py),
    GPU-only code that no config path runs; that one module is stubbed so that the CPU torch
    wheel (no triton) can import the trainer's config."""
    name = "torchtitan.distributed.minimal_async_ep.kernels"

    class _Kernels(types.ModuleType):
        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def kernel(*args, **kwargs):
                raise RuntimeError("a Triton kernel; not available on CPU")
            return kernel

    added = name not in sys.modules
    sys.modules.setdefault(name, _Kernels(name))
    import torchtitan
    from torchtitan.config import ConfigManager

    assert torchtitan.__version__.startswith("0.3"), torchtitan.__version__
    yield ConfigManager
    if added:
        sys.modules.pop(name, None)


def test_torchtitan_accepts_and_derives_the_plan(plans, torchtitan, tmp_path, monkeypatch):
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class
    from torchtitan.distributed import pipeline_parallel as tt_pp
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy
    from torchtitan.distributed.parallel_dims import ParallelDims

    monkeypatch.syspath_prepend(str(tmp_path))
    refused = []
    for name, plan in plans:
        deg, par = plan.data["degrees"], plan.config.parallel
        m = plan.data["schedule"]["num_microbatches"]
        ex = export(plan, "torchtitan")
        if ex.errors:   # another model (torchtitan's llama3 cannot express it) or another dtype
            refused.append(name)
            mdl = plan.config.model
            assert mdl.experts or mdl.norm != "rmsnorm" or mdl.dtype == "fp16" or par.offload == "optimizer", \
                (name, ex.errors)   # offload optimizer: torchtitan offloads all states or none (exporters/offload_hsdp.py)
            continue
        (tmp_path / ex.filename).write_text(ex.text)
        words = shlex.split(ex.launch)
        args = words[words.index("--module"):] + ["--training.steps", "3"]   # plus an override
        cfg = torchtitan().parse_args(args)
        world = _launch_world(words, "--nnodes", "--nproc-per-node")
        dims = ParallelDims.from_config(cfg.parallelism, world)
        assert world == plan.data["world_size"], name
        assert (dims.dp_replicate * dims.dp_shard, dims.tp, dims.pp, dims.cp) == \
            (deg["dp"], deg["tp"], deg["pp"], deg["cp"]), name
        assert cfg.parallelism.expert_parallel_degree == deg["ep"] and cfg.training.steps == 3
        # torchtitan splits norms along the sequence under tp exactly when the plan does
        assert cfg.parallelism.enable_sequence_parallel == (par.sequence_parallel or deg["tp"] == 1), name
        # batch: the Trainer's own arithmetic (trainer.py: batch degree = dp_replicate * dp_shard)
        tr, pa = cfg.training, cfg.parallelism
        accumulation = tr.global_batch_size // (tr.local_batch_size * deg["dp"])
        assert tr.global_batch_size % (tr.local_batch_size * deg["dp"]) == 0
        assert tr.global_batch_size == par.global_batch and pa.pipeline_parallel_microbatch_size == par.micro_batch
        if dims.pp > 1:
            assert (tr.local_batch_size // pa.pipeline_parallel_microbatch_size, accumulation) == (m, 1), name
        else:
            assert (tr.local_batch_size, accumulation) == (par.micro_batch, m), name
        # layers per chunk and per rank, through torchtitan's pipeline split
        model = cfg.model_spec.model
        assert (len(model.layers), model.dim, model.vocab_size) == \
            (plan.data["model"]["layers"], plan.data["model"]["hidden"], plan.data["model"]["vocab"])
        if dims.pp > 1:
            stages, layers, first, last = tt_pp._get_pipeline_metadata(dims, pa, model)
            parts = pa.module_fqns_per_model_part or tt_pp._generate_llm_fqn_per_model_part(
                stages, layers, first, last)
            per_chunk = [sum(mod.startswith("layers.") for mod in part) for part in parts]
            assert per_chunk == list(par.layers_per_chunk(plan.config.model.layers)), name
            assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "lm_head"]
            looped = issubclass(get_schedule_class(pa.pipeline_parallel_schedule), PipelineScheduleMulti)
            assert looped == (deg["virtual_stages"] > 1) and len(parts) == dims.pp * deg["virtual_stages"], name
            for rank in range(dims.pp):
                chunks = tt_pp._get_pp_rank_to_stage_indices_mapping(rank, dims.pp, pa.pipeline_parallel_schedule,
                                                                     len(parts))
                assert chunks == tuple(rank + k * dims.pp for k in range(deg["virtual_stages"]))
        # ZeRO: FSDP shards over dp for zero >= 1; the reshard policy torchtitan resolves
        assert dims.dp_shard == (1 if par.zero == 0 else deg["dp"]), name
        reshard = get_fsdp_reshard_after_forward_policy(pa.fsdp_reshard_after_forward, dims.pp > 1)
        if par.zero == 3:
            assert reshard == reshard_after_forward(deg["pp"]), name
        elif par.zero in (1, 2):
            assert reshard is False
        ac = {"none": type(None), "full": FullAC.Config, "selective": SelectiveAC.Config}[par.recompute]
        assert type(cfg.activation_checkpoint) is ac, name
        # dtype: mixed precision at the plan's dtype over float32 master weights (0.3 installs
        # FSDP's MixedPrecisionPolicy at any degree: models/llama3/parallelize.py)
        dtype = {"bf16": "bfloat16", "fp32": "float32"}[plan.data["model"]["dtype"]]
        assert tr.mixed_precision_param == dtype and tr.dtype == "float32"
        assert cfg.model_spec.model.vocab_size == plan.data["model"]["vocab"], name
        sys.modules.pop(ex.filename[:-3], None)
        ACCEPTED["torchtitan"].append(name)
    assert len(ACCEPTED["torchtitan"]) + len(refused) == len(plans)
    # gpt3 (LayerNorm/GeLU, fp16), the two MoE, cp_zero1 (fp16: torchtitan takes bf16 or fp32), the 70B
    # fine-tune's offload = optimizer (torchtitan offloads every state or none)
    assert refused == ["deepseek_moe_16b_1x8_h100", "gpt3_175b_megatron", "llama31_70b_offload_1x8_h100",
                       "mixtral_8x7b_8x8_h100", "cp_zero1"]




def test_torchtitan_launch_says_where_its_assets_are(plans, torchtitan, tmp_path, monkeypatch):
    """The exported module trains on torchtitan's c4_test sample with its test tokenizer,
    which torchtitan 0.3.0 reads relative to the working directory (``tests/assets``, absent
    from its pip wheel): the docstring's launch says to run from a torchtitan checkout, or
    names the overrides for one's own data, and those overrides parse."""
    from torchtitan.hf_datasets.text_datasets import DATASETS
    from torchtitan.trainer import Trainer

    name, plan = next((n, p) for n, p in plans if not export(p, "torchtitan").errors)
    ex = export(plan, "torchtitan")
    doc = ex.text.split('"""')[1]
    import dataclasses
    default = next(f.default for f in dataclasses.fields(Trainer.Config) if f.name == "hf_assets_path")
    assert default.startswith("./tests/assets/")   # torchtitan's own defaults
    assert DATASETS["c4_test"].path.startswith("tests/assets/") and 'dataset="c4_test"' in ex.text
    assert "root of a torchtitan source checkout" in doc and "./tests/assets" in doc, doc
    assert f"--hf-assets-path and --dataloader.dataset): {ex.launch}" in " ".join(doc.split()), doc
    (tmp_path / ex.filename).write_text(ex.text)
    monkeypatch.syspath_prepend(str(tmp_path))
    words = shlex.split(ex.launch)
    cfg = torchtitan().parse_args(words[words.index("--module"):] + ["--hf-assets-path", str(tmp_path),
                                                                      "--dataloader.dataset", "c4"])
    assert (cfg.hf_assets_path, cfg.dataloader.dataset) == (str(tmp_path), "c4"), name
    sys.modules.pop(ex.filename[:-3], None)

def _deepspeed_blocks_per_stage(note: str, blocks: int, stages: int) -> list[int]:
    """Transformer blocks per pipeline stage, as DeepSpeed 0.19.8's own
    ``PipelineModule._partition_layers`` splits the layer list the note describes
    ([embedding, blocks, final norm, output head]) with the ``partition_method`` it names."""
    from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule
    from torch import nn

    method = re.search(r'partition_method="([^"]+)"', note).group(1).replace("<your block class>", "Block")
    assert re.search(rf"layers = \[embedding, {blocks} blocks, final norm, output head\]", note), note
    Block, Embedding, Norm, Head = (type(n, (nn.Module,), {}) for n in ("Block", "Embedding", "Norm", "Head"))

    class Module:   # the attributes _partition_layers reads, without a process group
        _layer_specs = [LayerSpec(Embedding), *(LayerSpec(Block) for _ in range(blocks)), LayerSpec(Norm),
                        LayerSpec(Head)]
        num_stages, global_rank = stages, 1
        _topo = types.SimpleNamespace(get_coord=lambda rank: types.SimpleNamespace(pipe=0))
        _find_layer_type = PipelineModule._find_layer_type
        _set_bounds = PipelineModule._set_bounds

    m = Module()
    PipelineModule._partition_layers(m, method=method)
    return [sum(isinstance(s, LayerSpec) and s.typename is Block for s in Module._layer_specs[a:b])
            for a, b in zip(m.parts, m.parts[1:])]

class _Mesh:
    """The device mesh deepspeed.comm.initialize_mesh_device would build: each named
    dimension's group is its size (all DeepSpeed asks of it here)."""

    def __init__(self, shape, names):
        self.shape, self.names = tuple(shape), tuple(names)

    def get_group(self, mesh_dim):
        return types.SimpleNamespace(size=self.shape[self.names.index(mesh_dim)])


def _autotp_groups(monkeypatch, world: int, tp: int):
    """deepspeed.utils.groups after DeepSpeed 0.19.8's own ``_init_tp_mesh_device(tp)`` (what
    the engine runs for ``tensor_parallel.autotp_size`` and the export's note tells train.py to
    run), on ``world`` ranks of a stand-in communicator: the mpu AutoTP hands DeepSpeedConfig."""
    from deepspeed.utils import groups

    for g in ("_TENSOR_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP"):
        monkeypatch.setattr(groups, g, None)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    monkeypatch.setattr(groups.dist, "initialize_mesh_device", _Mesh)
    monkeypatch.setattr(groups.dist, "get_world_size", lambda group=None: world if group is None else group.size)
    groups._init_tp_mesh_device(tensor_model_parallel_size=tp)
    return groups


def test_deepspeed_accepts_and_derives_the_plan(plans, monkeypatch):
    import deepspeed
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from deepspeed.runtime.tensor_parallel import get_tensor_parallel_config

    assert deepspeed.__version__ == "0.19.8", deepspeed.__version__
    # DeepSpeedConfig asks deepspeed.comm for this rank only; the world comes through the mpu
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    refused = []
    for name, plan in plans:
        deg, par = plan.data["degrees"], plan.config.parallel
        ex = export(plan, "deepspeed")
        if ex.errors:   # cp; ZeRO-2/3 with pp, which DeepSpeed's PipelineEngine asserts against;
            # tp with pp, which DeepSpeed's config cannot state (AutoTP has no pipeline axis)
            refused.append(name)
            assert deg["cp"] > 1 or (deg["pp"] > 1 and (par.zero >= 2 or deg["tp"] > 1)), (name, ex.errors)
            continue
        c = json.loads(ex.text)
        world = _launch_world(shlex.split(ex.launch), "--num_nodes", "--num_gpus")
        nodes = plan.config.cluster.nodes
        if nodes > 1:   # the hostfile the note describes, read by DeepSpeed's runner's own parser
            from deepspeed.launcher.runner import _parse_hostfile
            assert "--hostfile hostfile" in ex.launch, name
            line = re.search(r"`(<hostname> slots=\d+)`", next(n for n in ex.notes if n.startswith("hostfile:")))
            pool = _parse_hostfile([line.group(1).replace("<hostname>", f"node{i}") for i in range(nodes)])
            assert list(pool.values()) == [plan.config.cluster.gpus_per_node] * nodes, name
        pp = c.get("pipeline", {}).get("stages", 1)
        autotp = get_tensor_parallel_config(c).autotp_size   # DeepSpeed's reading of the config
        if pp > 1:   # the topology the note tells train.py to give PipelineModule
            note = next(n for n in ex.notes if "PipeModelDataParallelTopology(" in n)
            tp = int(re.search(r"num_mp=(\d+)", note).group(1))
            assert autotp == 0 and tp == 1, name   # tensor parallelism a pipeline config can state: none
            chunks = list(par.layers_per_chunk(plan.config.model.layers))
            if len(set(chunks)) == 1:   # blocks per stage (DeepSpeed's stages hold contiguous blocks)
                assert _deepspeed_blocks_per_stage(note, plan.config.model.layers, pp) == \
                    [sum(chunks[r::pp]) for r in range(pp)], name
            else:   # uneven: DeepSpeed has no method for given boundaries; the note says how
                assert any("override _partition_layers" in n for n in ex.notes), name
            topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (pp * tp))
            assert topo.world_size() == world, name

            class Grid:   # what PipelineParallelGrid answers DeepSpeedConfig
                def get_data_parallel_world_size(self):
                    return max(topo.get_dim("data"), 1)

            mpu = Grid()
        else:        # AutoTP: the mpu is deepspeed.utils.groups after _init_tp_mesh_device(autotp_size)
            tp = max(autotp, 1)
            mpu = _autotp_groups(monkeypatch, world, tp) if autotp > 1 else None
            if mpu is not None:
                assert mpu.get_tensor_model_parallel_world_size() == tp, name
        if mpu is None:   # no mpu: DeepSpeedConfig counts every rank
            monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: world)
        ds = ds_config.DeepSpeedConfig(c, mpu=mpu)
        assert world == plan.data["world_size"], name
        assert (ds.world_size, tp, pp) == (deg["dp"], deg["tp"], deg["pp"]), name
        assert ds.train_batch_size == par.global_batch and ds.train_micro_batch_size_per_gpu == par.micro_batch
        assert ds.gradient_accumulation_steps == plan.data["schedule"]["num_microbatches"], name
        assert ds.zero_optimization_stage == par.zero, name
        if par.offload != "none":   # DeepSpeed's own reading of offload_optimizer / offload_param (issue 49)
            assert ds.zero_config.offload_optimizer.device == "cpu", name
            assert (ds.zero_config.offload_param is not None) == (par.offload == "params"), name
        assert ds.bfloat16_config.enabled == (plan.data["model"]["dtype"] == "bf16"), name
        assert ds.float16_config.enabled == (plan.data["model"]["dtype"] == "fp16"), name
        if pp > 1:
            assert ds.pipeline["activation_checkpoint_interval"] == (1 if par.recompute == "full" else 0)
        assert ("activation_checkpointing" in c) == (par.recompute != "none")
        ACCEPTED["deepspeed"].append(name)
    assert len(ACCEPTED["deepspeed"]) + len(refused) == len(plans)
    assert ACCEPTED["deepspeed"] == ["deepseek_moe_16b_1x8_h100", "llama31_70b_offload_1x8_h100", "zero3_tp_no_pp",
                                     "pp_zero1"]
