"""The IR: named-dim tensor types, shardings, the op table, the graph, verify and printer."""

from parcompile.ir.graph import Graph, GraphError, Node
from parcompile.ir.ops import OPS, Collective, Op, Param, convert, dual
from parcompile.ir.types import REPLICATED, Dim, Sharding, ShardingError, TensorType

__all__ = ["Graph", "GraphError", "Node", "OPS", "Collective", "Op", "Param", "convert", "dual",
           "REPLICATED", "Dim", "Sharding", "ShardingError", "TensorType"]
