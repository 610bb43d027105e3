"""The rows of the HTML report (:mod:`parcompile.report`), read from the plan: ``plan.json``
(``plan.data``) for every number, the plan's graph for how one layer's tensors are split.

Nothing here recomputes what the analyses computed: each row holds a plan.json value
(exact, for the ``data-value`` attributes the report's test reads) and its text.
"""

from __future__ import annotations

from dataclasses import dataclass

from parcompile.core.units import bytes_text, seconds_text

#: the memory terms of ``memory.per_stage[]``, bottom up, with their names in the report
#: (``allocator`` is not part of ``total``: what PyTorch's caching allocator reserves beyond it)
TRAIN_MEMORY = (("params", "weights"), ("grads", "gradients"), ("optimizer", "optimizer states"),
                ("activations", "activations"), ("buffers", "buffers"), ("kv_cache", "KV cache"),
                ("allocator", "allocator (reserved)"))
#: a serve plan's terms: its activations are the forward's workspace
SERVE_MEMORY = (("params", "weights"), ("kv_cache", "KV cache"), ("activations", "workspace"),
                ("buffers", "buffers"))


@dataclass(frozen=True)
class Cell:
    """One number of the report: ``key`` (a plan.json path, dotted), ``value`` as plan.json
    holds it and ``text``, how it reads."""

    key: str
    value: float | int | str | bool | list[str]
    text: str


def memory_terms(data: dict) -> tuple[tuple[str, str], ...]:
    """The memory terms a plan's bars stack (:data:`TRAIN_MEMORY` or :data:`SERVE_MEMORY`),
    those that are non-zero on some stage."""
    terms = SERVE_MEMORY if data.get("workload") == "serve" else TRAIN_MEMORY
    stages = data["memory"]["per_stage"]
    return tuple((k, name) for k, name in terms if any(s.get(k) or 0 for s in stages))


def memory_rows(data: dict) -> list[list[Cell]]:
    """Per pipeline stage: its index, each term of :func:`memory_terms` and ``total``, bytes per rank."""
    terms = memory_terms(data)
    rows = []
    for s in data["memory"]["per_stage"]:
        i = s["stage"]
        row = [Cell(f"memory.per_stage.{i}.stage", i, str(i))]
        row += [Cell(f"memory.per_stage.{i}.{k}", s.get(k) or 0, bytes_text(s.get(k) or 0)) for k, _ in terms]
        row.append(Cell(f"memory.per_stage.{i}.total", s["total"], bytes_text(s["total"])))
        rows.append(row)
    return rows


def memory_limits(data: dict) -> list[Cell]:
    """``memory.peak``, ``capacity`` (what may be used), ``device_memory`` and ``fits``."""
    mem = data["memory"]
    out = [Cell("memory.peak", mem["peak"], bytes_text(mem["peak"])),
           Cell("memory.capacity", mem["capacity"], bytes_text(mem["capacity"]))]
    if mem.get("reserved_peak") is not None:
        out.append(Cell("memory.reserved_peak", mem["reserved_peak"], bytes_text(mem["reserved_peak"])))
    if mem.get("device_memory") is not None:
        out.append(Cell("memory.device_memory", mem["device_memory"], bytes_text(mem["device_memory"])))
    out.append(Cell("memory.fits", mem["fits"], "yes" if mem["fits"] else "NO"))
    return out


def axis_link(data: dict, axis: str) -> str:
    """Where an axis's groups sit (``estimate.assumptions.links``: "intra-node" or
    "inter-node"); the data-parallel axes are costed as one (``dp_cp``). "" when the axis
    has one rank."""
    links = data["estimate"]["assumptions"].get("links", {})
    if axis in links:
        return links[axis]
    return next((v for k, v in sorted(links.items()) if axis in k.split("_")), "")


def breakdown_rows(data: dict) -> list[Cell]:
    """``estimate.breakdown``, seconds per step by cause, in plan.json's order; a
    communication term (``tp_comm``) names its axis's link ("tp, intra-node")."""
    rows = []
    for k, v in data["estimate"]["breakdown"].items():
        text = k
        if k.endswith("_comm"):
            axis = k[:-len("_comm")]
            link = axis_link(data, axis)
            text = f"exposed {axis} communication" + (f" ({link})" if link else "")
        rows.append(Cell(f"estimate.breakdown.{k}", v, text))
    return rows


def network_rows(data: dict) -> list[list[Cell]]:
    """Per axis and collective op, the network model's algorithm and bus bandwidth
    (``estimate.assumptions.network``) and the axis's link; the axis and op are labels
    (``key`` empty)."""
    net = data["estimate"]["assumptions"].get("network") or {}
    links = data["estimate"]["assumptions"].get("links", {})
    rows = []
    for axis, a in sorted(net.items()):
        link = Cell(f"estimate.assumptions.links.{axis}" if axis in links else "", axis_link(data, axis),
                    axis_link(data, axis))
        for op, c in sorted(a["collectives"].items()):
            p = f"estimate.assumptions.network.{axis}.collectives.{op}"
            rows.append([Cell("", axis, axis), link, Cell("", op, op),
                         Cell(f"{p}.algorithm", c["algorithm"], c["algorithm"]),
                         Cell(f"{p}.bus_bw", c["bus_bw"], f"{c['bus_bw'] / 1e9:,.0f} GB/s")])
    return rows


def per_step_rows(data: dict) -> list[Cell]:
    """``comm.per_step``: bytes the busiest rank of each axis sends per step."""
    return [Cell(f"comm.per_step.{k}", v, bytes_text(v)) for k, v in data["comm"]["per_step"].items()]


def summary_cells(data: dict) -> list[Cell]:
    """The headline numbers: degrees, world size, step time, throughput (training) or
    TTFT / TPOT / tokens/s (serving)."""
    out = [Cell("world_size", data["world_size"], f"{data['world_size']:,}")]
    out += [Cell(f"degrees.{k}", v, str(v)) for k, v in data["degrees"].items() if v != 1 or k in ("dp", "tp", "pp")]
    if data.get("serve"):
        sv = data["serve"]
        out += [Cell("serve.ttft", sv["ttft"], seconds_text(sv["ttft"])),
                Cell("serve.tpot", sv["tpot"], seconds_text(sv["tpot"])),
                Cell("serve.tokens_per_s", sv["tokens_per_s"], f"{sv['tokens_per_s']:,.0f}"),
                Cell("serve.tokens_per_s_per_user", sv["tokens_per_s_per_user"], f"{sv['tokens_per_s_per_user']:,.1f}"),
                Cell("serve.gpus", sv["gpus"], str(sv["gpus"]))]
    else:
        est = data["estimate"]
        out += [Cell("estimate.step_time", est["step_time"], seconds_text(est["step_time"])),
                Cell("estimate.tokens_per_s", est["tokens_per_s"], f"{est['tokens_per_s']:,.0f}"),
                Cell("estimate.mfu", est["mfu"], f"{est['mfu']:.1%}"),
                Cell("schedule.bubble_fraction", data["schedule"]["bubble_fraction"],
                     f"{data['schedule']['bubble_fraction']:.2%}")]
        out += train_cells(data)
    return out


def train_cells(data: dict) -> list[Cell]:
    """What a training plan trains (``train.*``): the method and, under LoRA, the adapters'
    rank, alpha and targets and the trainable (adapter) against frozen parameters."""
    tr = data.get("train")
    if not tr:
        return []
    out = [Cell("train.method", tr["method"], "LoRA" if tr["method"] == "lora" else "full")]
    if tr["method"] == "lora":
        lo = tr["lora"]
        out += [Cell("train.lora.rank", lo["rank"], str(lo["rank"])),
                Cell("train.lora.alpha", lo["alpha"], f"{lo['alpha']:g}"),
                Cell("train.lora.targets", lo["targets"], ", ".join(lo["targets"])),
                Cell("train.trainable_params", tr["trainable_params"], f"{tr['trainable_params']:,}"),
                Cell("train.frozen_params", tr["frozen_params"], f"{tr['frozen_params']:,}")]
    return out


def serve_cells(data: dict) -> list[Cell]:
    """A serve plan's memory per GPU (weights, KV cache, workspace) and KV cache figures
    (``serve.*``)."""
    sv = data["serve"]
    out = [Cell(f"serve.{k}", sv[k], bytes_text(sv[k]))
           for k in ("weights_bytes_per_rank", "kv_cache_bytes_per_rank", "workspace_bytes_per_rank",
                     "kv_bytes_per_token")]
    out += [Cell(f"serve.{k}", sv[k], f"{sv[k]:,}") for k in ("max_concurrent_tokens", "max_concurrent_sequences",
                                                              "batch", "replicas")]
    out += [Cell(f"serve.{k}", sv[k], str(sv[k])) for k in ("engine", "weight_dtype", "kv_dtype")]
    return out


def serve_breakdown_rows(data: dict) -> list[Cell]:
    """``serve.breakdown``: seconds by cause of the first token (``prefill_*``, ``queue``,
    ``request_overhead``) and of each later one (``decode_*``)."""
    return [Cell(f"serve.breakdown.{k}", v, seconds_text(v)) for k, v in data["serve"]["breakdown"].items()]
