"""What every pass shares: the context it runs in and the error a crash becomes.

A pass (xDSL's shape) is a small frozen class with a kebab-case ``name`` and one
``apply(graph, ctx)``; it edits the graph through :class:`parcompile.ir.graph.Graph`'s
methods and returns what later passes and the analyses read of it (a frozen result of
:mod:`parcompile.passes.results`, or None). The pass manager records the results in
``ctx.results`` and verifies the graph after every pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Protocol

from parcompile.config.schema import ParallelConfig, SpecConfig
from parcompile.diagnostics import Diagnostic
from parcompile.ir.graph import Graph
from parcompile.passes.results import PassResults


def parallel_degrees(p: ParallelConfig) -> dict[str, int]:
    """Mesh axis -> group size of layout ``p`` (``dp tp pp cp ep expert_tp expert_dp``, and
    the derived groups ``dp_cp`` and ``embedding``: the two ranks holding the embedding and
    a tied head's copy when ``pp > 1``; HSDP's ``dp_shard`` (``dp_shard * cp``, the ranks
    states are sharded over) and ``dp_replicate``)."""
    return {"dp": p.dp, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep,
            "expert_tp": p.expert_tp, "expert_dp": p.expert_dp,
            "dp_cp": p.dp * p.cp, "embedding": 2 if p.pp > 1 else 1,
            "dp_shard": p.dp_shard * p.cp, "dp_replicate": p.dp_replicate}


def degrees_of(cfg: SpecConfig) -> dict[str, int]:
    """:func:`parallel_degrees` of ``cfg``'s layout."""
    return parallel_degrees(cfg.parallel)


@dataclass
class PassContext:
    """What passes read besides the graph: the config, the mesh degrees, where they put
    warnings, and the results of the passes run so far (``results``, recorded by
    :func:`parcompile.passes.manager.run_pass`). ``current_op`` is the op a pass is working
    on (for crash reports)."""

    cfg: SpecConfig
    degrees: dict[str, int]
    warnings: list[Diagnostic] = field(default_factory=list)
    current_op: str | None = None
    results: PassResults = field(default_factory=PassResults)

    @classmethod
    def of(cls, cfg: SpecConfig) -> "PassContext":
        return cls(cfg, degrees_of(cfg))

    def visit(self, names: Iterable[str]) -> Iterator[str]:
        """Iterate op names, remembering the current one for error messages."""
        for n in names:
            self.current_op = n
            yield n
        self.current_op = None


class Pass(Protocol):
    """A graph pass: ``name`` (kebab-case) and ``apply(graph, ctx)``, which returns the
    pass's result (:mod:`parcompile.passes.results`) or None."""

    name: str

    def apply(self, graph: Graph, ctx: PassContext) -> object | None: ...


class PassError(RuntimeError):
    """An internal failure inside a pass; says which pass and which op."""

    def __init__(self, pass_name: str, op: str | None, cause: BaseException):
        where = f" at op {op}" if op else ""
        super().__init__(f"pass {pass_name} failed{where}: {type(cause).__name__}: {cause}")
        self.pass_name = pass_name
        self.op = op
        self.cause = cause
