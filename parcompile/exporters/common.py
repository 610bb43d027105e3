"""What every export target shares: the target names, :class:`Export`, the plan's degrees,
the notes every target writes, the gradient-reduction facts and the layout line."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from parcompile.core.data_parallel import DataParallelSharding
from parcompile.core.dtypes import GRAD_BYTES
from parcompile.plan import Plan

#: training engines
TRAIN_TARGETS = ("megatron", "megatron-bridge", "torchtitan", "deepspeed")
#: serving engines, and their names for messages
SERVE_TARGETS = {"vllm": "vLLM", "sglang": "SGLang"}
TARGETS = TRAIN_TARGETS + tuple(SERVE_TARGETS)
#: torchtitan releases the export writes for: 0.3 (config registry, what pip installs), 0.2 (TOML)
TORCHTITAN_VERSIONS = ("0.3", "0.2")


def placement_errors(plan: Plan, engine: str, styles: tuple[str, ...] = ("loop",)) -> list[str]:
    """An error when the plan's schedule places its model chunks on the pipeline ranks in a
    way ``engine`` cannot (:class:`parcompile.core.schedule.Placement`; ``styles``: the
    placements it runs, Megatron-Core's and DeepSpeed's only ``loop``: model chunk ``k`` on
    rank ``k % pp``)."""
    sched = plan.config.parallel.pipeline_schedule
    if plan.config.parallel.pp == 1 or sched.placement.name in styles:
        return []
    return [f"schedule {sched.name}: its {sched.placement.name} placement of the model chunks on the pipeline "
            f"ranks is not one {engine} runs ({', '.join(styles)}); use a schedule with the loop placement"]


@dataclass
class Export:
    """One export: ``text`` (the file), ``notes`` (what the target cannot express or
    expresses differently, one sentence each), ``launch`` (the command that runs it),
    ``filename`` (a conventional name for the file), ``errors`` (what the target cannot
    express without training a different model or layout: the export is then refused)."""

    target: str
    text: str
    notes: list[str] = field(default_factory=list)
    launch: str = ""
    filename: str = ""
    #: what would make the export train a different model or layout than the plan (the CLI
    #: prints them as ``error:`` lines, writes nothing and exits 1; ``text`` stays here, from
    #: Python, as a starting point)
    errors: list[str] = field(default_factory=list)


def degrees(plan: Plan) -> dict:
    """plan.json's ``degrees`` (``dp``, ``tp``, ``pp``, ``cp``, ``ep``, ``expert_tp``, ``virtual_stages``, ...)."""
    return plan.data["degrees"]


def common_notes(plan: Plan, target: str) -> list[str]:
    """Notes every target shares: data and the model code are the engine's own. A path is
    quoted with JSON's escapes: a line break or quotes in a file name cannot end the comment
    or docstring the note becomes (a command in a shell script, code in a module)."""
    cfg = plan.config
    notes = []
    if cfg.train.data != "synthetic":
        notes.append(f"data: the spec reads {json.dumps(cfg.train.data)}; point the {target} run at your own "
                     "tokenized dataset")
    group = cfg.parallel.microbatch_group_size
    if group is not None and target != "Megatron-LM":
        notes.append(f"microbatch_group_size {group}: {target} has no round size for its interleaved schedule "
                     "(Megatron-Core's --microbatch-group-size-per-virtual-pipeline-stage); not expressible")
    return notes


def dp_sharding(plan: Plan) -> DataParallelSharding:
    """The plan's data-parallel sharding (what ``shard-data-parallel`` set:
    :class:`~parcompile.core.data_parallel.DataParallelSharding`), which each engine's
    optimizer flags are read from."""
    return plan.passes.data_parallel


def reduces_over_dp(plan: Plan) -> bool:
    """Whether some gradient is reduced over data parallelism (dp * cp or expert_dp > 1)."""
    deg = plan.data["degrees"]
    return deg["dp"] * deg["cp"] > 1 or deg.get("expert_dp", 1) > 1


def grad_reduce_dtype(plan: Plan) -> str:
    """The dtype the plan reduce-scatters gradient buckets in: ``parallel.reduce_dtype`` where
    it applies (zero 2, 3 reducing per micro-batch), else fp32
    (:func:`parcompile.analysis.buckets.bucket_element_bytes`)."""
    from parcompile.analysis.buckets import bucket_element_bytes

    par = plan.config.parallel
    if par.grad_dtype == "bf16":   # bf16 gradient buffers, reduced as they are
        return "bf16"
    return "fp32" if bucket_element_bytes(dp_sharding(plan), par.reduce_dtype) == GRAD_BYTES else par.reduce_dtype

def stage_split(plan: Plan) -> list[int]:
    """Layers per model chunk in model order (``pp * virtual_stages`` entries)."""
    par = plan.config.parallel
    return list(par.layers_per_chunk(plan.config.model.layers))


def fmt_num(x: float) -> str:
    """A float without a trailing ``.0`` when it is whole (``500000``, ``0.5``)."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def layout_line(plan: Plan) -> str:
    """The plan's layout in one line for the exported file's header: ranks, degrees, then the
    schedule and micro-batches (training) or the concurrent sequences (serving)."""
    d = degrees(plan)
    s = plan.data["schedule"]
    ep = f" x ep {d['ep']}" if d["ep"] > 1 else ""
    if plan.config.workload == "serve":
        sv = plan.data["serve"]
        return (f"{plan.data['world_size']} ranks, dp {d['dp']} x tp {d['tp']} x pp {d['pp']} x cp {d['cp']}{ep}, "
                f"{sv['replicas']} x {sv['batch_per_replica']} concurrent sequences")
    return (f"{plan.data['world_size']} ranks, dp {d['dp']} x tp {d['tp']} x pp {d['pp']} x cp {d['cp']}{ep}, "
            f"{s['name']}, {s['num_microbatches']} micro-batches")


def comments(kind: str, texts: list[str]) -> list[str]:
    """The exported file's ``# KIND: TEXT`` lines (``kind`` ``error`` or ``note``), one per text,
    every line of a text commented: a spec string holding a newline (``hf_output``,
    ``weights``, a data path) stays inside the comment, never a line of its own that the
    shell (or a TOML reader) would run (or parse)."""
    return ["# " + f"{kind}: {t}".replace("\r", "").replace("\n", "\n# ") for t in texts]


def py_name(name: str) -> str:
    """A Python identifier from a spec name (``llama3-8b`` -> ``llama3_8b``)."""
    out = "".join(c if c.isalnum() else "_" for c in name)
    return out if out and not out[0].isdigit() else f"spec_{out}"


def py_kwargs(kw: dict) -> str:
    """Keyword arguments as Python source, in ``kw``'s order (``rank=8, alpha=16.0``): what
    the exported modules write inside a config class's call."""
    return ", ".join(f"{k}={v!r}" for k, v in kw.items())
