"""The dataflow graph: the only mutable object of the IR.

:class:`Graph` owns an ``nx.MultiDiGraph`` whose nodes are op names and whose edges
run producer -> consumer, keyed by the consumer's operand index (so one tensor may
feed one op twice). Each node carries a frozen :class:`Node` record; passes change the
graph only through the methods here (``add_op``, ``insert_between``, ``set_sharding``,
``set_stage``, ``set_params``, ``retype``), never through networkx directly.

Every op produces one tensor; its global type never changes with sharding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Iterator, Mapping, Sequence

import networkx as nx

from parcompile.ir.ops import Op, Param, Trait, spec
from parcompile.ir.types import REPLICATED, Sharding, TensorType


@dataclass(frozen=True)
class Node:
    """An op with its current layout.

    ``type``: global output type. ``sharding``: output layout. ``requires[i]``: the layout
    the op needs operand i in. ``grads[i]``: the layout of the gradient it returns for
    operand i. ``stage``: pipeline rank; ``chunk``: model chunk (virtual stage in model
    order; equals ``stage`` without interleaving). ``index``: creation order (ties in
    topological order are broken by it, so the order is deterministic).
    """

    op: Op
    type: TensorType
    sharding: Sharding = REPLICATED
    requires: tuple[Sharding, ...] = ()
    grads: tuple[Sharding, ...] = ()
    params: tuple[Param, ...] = ()
    stage: int | None = None
    chunk: int | None = None
    index: int = 0

    @property
    def name(self) -> str:
        return self.op.name

    @property
    def kind(self) -> str:
        return self.op.kind

    def has_trait(self, trait: Trait) -> bool:
        """Whether the node's op kind declares ``trait`` (:class:`parcompile.ir.ops.Trait`)."""
        return trait in spec(self.op.kind).traits


class GraphError(ValueError):
    """A structural misuse of the graph (duplicate name, unknown op, bad operand)."""


class Graph:
    """A dataflow graph of ops (see module docstring)."""

    def __init__(self) -> None:
        self._g = nx.MultiDiGraph()
        self._counter = 0
        self._topo: list[str] | None = None
        #: operand producers per op (a cache; edits drop the entries they change)
        self._inputs: dict[str, list[str]] = {}
        #: ops added or changed since :func:`parcompile.ir.verify.verify` last ran (it
        #: checks only these and their consumers; see ``mark_verified``)
        self.dirty: set[str] = set()
        #: what the last full or incremental verification assumed (degrees, staged, inserted)
        self.verified_state: tuple | None = None
        #: FP8 training's marks (``parcompile.ir.fp8.GraphFp8``: recipe, the layers kept in
        #: 16 bits); None without ``precision = fp8``. Set by the pass manager from the spec
        self.fp8 = None

    # ------------------------------------------------------------------ reading

    def __contains__(self, name: str) -> bool:
        return name in self._g

    def __len__(self) -> int:
        return self._g.number_of_nodes()

    def node(self, name: str) -> Node:
        try:
            return self._g.nodes[name]["node"]
        except KeyError:
            raise GraphError(f"no op named {name!r}") from None

    def inputs(self, name: str) -> list[str]:
        """Producers of ``name``'s operands, in operand order."""
        got = self._inputs.get(name)
        if got is None:
            try:
                pred = self._g._pred[name]
            except KeyError:
                raise GraphError(f"no op named {name!r}") from None
            got = [u for _, u in sorted((k, u) for u, keys in pred.items() for k in keys)]
            self._inputs[name] = got
        return list(got)

    def users(self, name: str) -> list[tuple[str, int]]:
        """``(consumer, operand index)`` pairs that read ``name``'s output, in a stable order."""
        out = [(v, k) for _, v, k in self._g.out_edges(name, keys=True)]
        return sorted(out, key=lambda vk: (self.node(vk[0]).index, vk[1]))

    def edges(self) -> Iterator[tuple[str, str, int]]:
        """Every ``(producer, consumer, operand index)``, in topological order of consumers."""
        for v in self.topological():
            for i, u in enumerate(self.inputs(v)):
                yield u, v, i

    def topological(self) -> list[str]:
        """Op names in a deterministic topological order (ties broken by creation order)."""
        if self._topo is None:
            key = {n: d["node"].index for n, d in self._g.nodes(data=True)}
            self._topo = list(nx.lexicographical_topological_sort(self._g, key=lambda n: key[n]))
        return list(self._topo)

    def nodes(self) -> list[Node]:
        """Every node in topological order."""
        return [self.node(n) for n in self.topological()]

    def params(self) -> list[tuple[Node, Param]]:
        """Every ``(node, param)`` in topological order."""
        return [(nd, p) for nd in self.nodes() for p in nd.params]

    def input_types(self, name: str) -> list[TensorType]:
        return [self.node(u).type for u in self.inputs(name)]

    def is_dag(self) -> bool:
        return nx.is_directed_acyclic_graph(self._g)

    # ------------------------------------------------------------------ editing

    def _put(self, node: Node) -> None:
        self._g.nodes[node.name]["node"] = node
        self.dirty.add(node.name)

    def unique_name(self, base: str) -> str:
        """``base`` if free, else ``base.1``, ``base.2`` ... (deterministic)."""
        if base not in self._g:
            return base
        i = 1
        while f"{base}.{i}" in self._g:
            i += 1
        return f"{base}.{i}"

    def add_op(self, name: str, kind: str, inputs: Sequence[str] = (), attrs: Mapping[str, Any] | None = None,
               params: Iterable[Param] = (), layer: int | None = None, origin: Any = None,
               type: TensorType | None = None) -> str:
        """Add an op reading ``inputs`` (operand order); its output type is inferred by the
        op table unless ``type`` is given. Layout starts replicated. Returns ``name``.

        Raises:
            GraphError: ``name`` exists, an input is unknown, or the arity is wrong.
        """
        if name in self._g:
            raise GraphError(f"op {name!r} already exists")
        s = spec(kind)
        if s.arity is not None and len(inputs) != s.arity:
            raise GraphError(f"op {name!r} of kind {kind} takes {s.arity} operands, got {len(inputs)}")
        for u in inputs:
            if u not in self._g:
                raise GraphError(f"op {name!r} reads unknown op {u!r}")
        attrs = dict(attrs or {})
        in_types = [self.node(u).type for u in inputs]
        out_type = type if type is not None else s.infer(attrs, in_types)
        op = Op(name, kind, tuple(sorted(attrs.items())), layer, origin)
        n = len(inputs)
        node = Node(op, out_type, REPLICATED, (REPLICATED,) * n, (REPLICATED,) * n, tuple(params),
                    index=self._counter)
        self._counter += 1
        self._g.add_node(name, node=node)
        for i, u in enumerate(inputs):
            self._g.add_edge(u, name, key=i)
        self._topo = None
        self._inputs.pop(name, None)
        self.dirty.add(name)
        return name

    def insert_between(self, producer: str, consumers: Sequence[tuple[str, int]], name: str, kind: str,
                       attrs: Mapping[str, Any] | None = None, sharding: Sharding | None = None,
                       requires: Sharding | None = None, grad: Sharding | None = None,
                       stage: int | None = None, chunk: int | None = None, on_producer: bool = False) -> str:
        """Insert a one-operand op reading ``producer`` and rewire each ``(consumer,
        operand index)`` to read it instead. The new op has the producer's type; its layout
        defaults to the producer's; stage/chunk (and decoder layer) default to the first
        consumer's, or to the producer's with ``on_producer``.

        Raises:
            GraphError: a consumer operand does not read ``producer``.
        """
        for v, k in consumers:
            if not self._g.has_edge(producer, v, key=k):
                raise GraphError(f"op {v!r} operand {k} does not read {producer!r}")
        p = self.node(producer)
        first = self.node(consumers[0][0]) if consumers and not on_producer else p
        self.add_op(name, kind, [producer], attrs, layer=first.op.layer, origin=p.op.origin, type=p.type)
        nd = self.node(name)
        self._put(replace(
            nd,
            sharding=sharding if sharding is not None else p.sharding,
            requires=(requires if requires is not None else p.sharding,),
            grads=(grad if grad is not None else p.sharding.without_partial(),),
            stage=first.stage if stage is None else stage,
            chunk=first.chunk if chunk is None else chunk,
        ))
        for v, k in consumers:
            self._g.remove_edge(producer, v, key=k)
            self._g.add_edge(name, v, key=k)
            self._inputs.pop(v, None)
            self.dirty.add(v)
        self._topo = None
        return name

    def set_sharding(self, name: str, out: Sharding | None = None, requires: Sequence[Sharding] | None = None,
                     grads: Sequence[Sharding] | None = None) -> None:
        """Set the output layout and/or the layouts required of (and returned for) operands."""
        nd = self.node(name)
        n = len(nd.requires)
        if requires is not None and len(requires) != n:
            raise GraphError(f"op {name!r} has {n} operands, got {len(requires)} requirements")
        if grads is not None and len(grads) != n:
            raise GraphError(f"op {name!r} has {n} operands, got {len(grads)} gradient layouts")
        self._put(replace(
            nd,
            sharding=nd.sharding if out is None else out,
            requires=nd.requires if requires is None else tuple(requires),
            grads=nd.grads if grads is None else tuple(grads),
        ))

    def set_stage(self, name: str, stage: int, chunk: int | None = None) -> None:
        """Place an op on pipeline rank ``stage`` and model chunk ``chunk`` (default ``stage``)."""
        nd = self.node(name)
        self._put(replace(nd, stage=stage, chunk=stage if chunk is None else chunk))

    def set_attrs(self, name: str, **attrs: Any) -> None:
        """Add or change attributes of an op (an annotation a pass sets: ``recompute``)."""
        nd = self.node(name)
        merged = {**nd.op.attr_map, **attrs}
        self._put(replace(nd, op=replace(nd.op, attrs=tuple(sorted(merged.items())))))

    def set_params(self, name: str, params: Iterable[Param]) -> None:
        self._put(replace(self.node(name), params=tuple(params)))

    def retype(self, name: str, out_type: TensorType) -> None:
        """Change an op's global output type (vocabulary padding)."""
        self._put(replace(self.node(name), type=out_type))
