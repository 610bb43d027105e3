"""``split-pipeline-stages``: place every op on a pipeline rank and model chunk.

The layers are cut into ``pp * virtual_stages`` model chunks in model order
(``stage_layers`` when given, else an even split). When ``layers`` does not divide
into the chunks and no ``stage_layers`` is given, the compiler chooses the split before
this pass (:func:`parcompile.layout_search.settle_split`, among :func:`candidate_splits`, by the
smallest estimated step time); this pass cuts a plain remainder-to-the-first-chunks split
(:func:`parcompile.config.text.even_split`) only for a config that skipped that step. Model
chunk ``k`` lives where the schedule's placement puts it
(:class:`parcompile.core.schedule.Placement`; ``loop``: on pipeline rank ``k % pp`` as its
local chunk ``k // pp``, Megatron-Core's interleaved assignment). The embedding is on chunk 0; the final norm, LM head
and loss on the last chunk. A tied LM head on another pipeline rank than the embedding
gets its own copy, ``lm_head.weight`` (``tied_to = "embedding.weight"``), kept equal by
an all-reduce over the ``embedding`` group.

Returns a :class:`~parcompile.passes.results.StageSplit` (layer ids per model chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parcompile.config.text import even_split
from parcompile.ir.graph import Graph
from parcompile.passes.base import PassContext
from parcompile.passes.results import StageSplit

FIRST_CHUNK_OPS = {"tokens", "embedding", "pos_embedding", "embedding.pos_add"}
LAST_CHUNK_OPS = {"final_norm", "lm_head", "labels", "loss"}


def chunk_layers(layers: int, pp: int, virtual_stages: int, stage_layers=None) -> list[list[int]]:
    """Layer ids of each model chunk, in model order (``pp * virtual_stages`` lists).

    Raises:
        ValueError: ``stage_layers`` has the wrong length, does not sum to ``layers``, or
            gives 0 layers (or fewer) to a model chunk other than the first and the last.

    The first chunk may hold no layers (only the embedding) and the last one none (only the
    final norm, the output layer and the loss), as Meta split Llama 3.1 405B (Llama 3 paper,
    section 3.3.2) and as Megatron-Core's ``--account-for-embedding-in-pipeline-split`` /
    ``--account-for-loss-in-pipeline-split`` place them.
    """
    n = pp * virtual_stages
    if stage_layers is not None:
        counts = list(stage_layers)
        if len(counts) != n:
            raise ValueError(f"stage_layers has {len(counts)} entries, pp * virtual_stages = {n}")
        if sum(counts) != layers:
            raise ValueError(f"stage_layers sum to {sum(counts)}, layers = {layers}")
        if any(c < 0 for c in counts) or 0 in counts[1:-1]:
            raise ValueError(f"stage_layers {counts}: a count is negative or a middle chunk holds no layers "
                             "(only the first and the last model chunk may hold 0)")
    else:
        counts = even_split(layers, n)
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


#: how many layers fewer than ``layers // chunks`` (and one more) the first and the last
#: chunk of a candidate split may hold
SPLIT_REACH = 2


def candidate_splits(layers: int, chunks: int) -> list[tuple[int, ...]]:
    """The uneven splits the compiler considers when ``layers`` does not divide into
    ``chunks`` model chunks (issue 16), in model order, every chunk but the first and the
    last holding at least one layer.

    The first chunk also holds the embedding and the last one the output layer and the
    loss, so the candidates vary those two: each holds ``q - SPLIT_REACH .. q + 1`` layers
    (``q = layers // chunks``), at least one, and the chunks between share the rest as evenly
    as possible, larger ones first (:func:`parcompile.config.text.even_split`). The first
    candidate is the plain even split of all chunks, so a tie keeps it. Meta's Llama 3.1
    405B split, 126 layers on 16 stages with one layer fewer on the first and the last
    (Llama 3 paper, section 3.3.2), is ``(7, 8, ..., 8, 7)``, one of them.

    Then Megatron-Core's splits that count the embedding, the loss or both as a layer
    (``--account-for-embedding-in-pipeline-split``, ``--account-for-loss-in-pipeline-split``:
    ``layers`` plus those a multiple of the chunks, ``q'`` each, the first chunk ``q' - 1``
    layers beside the embedding, the last ``q' - 1`` beside the loss; Megatron-LM
    ``megatron/core/transformer/transformer_layer.py`` ``get_transformer_layer_offset``:
    the layer count plus one for each, divided over the pipeline and virtual ranks). Those
    with ``q' >= 2`` are among the above; ``q' = 1`` gives a first chunk of the embedding
    only and a last of the output layer and the loss only, Meta's 405B split on 16 ranks of
    8 model chunks (126 layers in 128 chunks, section 3.3.2), possible with
    ``layers = chunks - 2`` or ``chunks - 1``.

    Returns:
        Distinct tuples of ``chunks`` counts summing to ``layers``; ``[]`` when ``layers <
        chunks - 2`` (or ``layers < chunks`` with one chunk).
    """
    out = [tuple(even_split(layers, chunks))] if layers >= chunks else []
    if chunks == 1:
        return out
    q = layers // chunks
    reach = range(max(1, q - SPLIT_REACH), q + 2)
    for first in reach:
        for last in reach:
            cand = _ends_split(layers, chunks, first, last)
            if cand is not None and cand not in out:
                out.append(cand)
    for emb, loss in ((1, 1), (1, 0), (0, 1)):   # Megatron-Core's accounted splits
        n = layers + emb + loss
        if n % chunks == 0:
            cand = _ends_split(layers, chunks, n // chunks - emb, n // chunks - loss)
            if cand is not None and cand not in out:
                out.append(cand)
    return out


def _ends_split(layers: int, chunks: int, first: int, last: int) -> tuple[int, ...] | None:
    """``(first, middle..., last)`` with the middle chunks sharing the rest as evenly as
    possible (larger first), each at least one layer; None when they cannot."""
    rest = layers - first - last
    if first < 0 or last < 0:
        return None
    if chunks == 2:
        return (first, last) if rest == 0 else None
    if rest < chunks - 2:
        return None
    return (first, *even_split(rest, chunks - 2), last)


@dataclass(frozen=True)
class SplitPipelineStages:
    """Assign stages and chunks (module docstring)."""

    name: str = "split-pipeline-stages"

    def apply(self, graph: Graph, ctx: PassContext) -> StageSplit:
        cfg = ctx.cfg
        par = cfg.parallel
        pp, v, place = par.pp, par.virtual_stages, par.pipeline_schedule.placement
        # a `stage_layers` of the wrong length or sum is a rule of the checks table
        # (frontend/checks.py: _check_layers); here it can only be a bug (a PassError)
        chunks = chunk_layers(cfg.model.layers, pp, v, par.stage_layers)
        layer_chunk = {layer: k for k, ls in enumerate(chunks) for layer in ls}
        last = pp * v - 1
        for n in ctx.visit(graph.topological()):
            nd = graph.node(n)
            if nd.op.layer is not None:
                k = layer_chunk[nd.op.layer]
            elif n in FIRST_CHUNK_OPS:
                k = 0
            elif nd.op.module in LAST_CHUNK_OPS:   # lm_head.softcap (Gemma 2) goes with its head
                k = last
            else:
                raise ValueError(f"op {n} belongs to no layer and no known chunk")
            graph.set_stage(n, place.rank(k, pp), k)
        if cfg.model.tie_embeddings and pp > 1 and "lm_head" in graph:
            head = graph.node("lm_head")
            graph.set_params("lm_head", [
                replace(p, name="lm_head.weight", tied_to="embedding.weight") if p.name == "embedding.weight" else p
                for p in head.params
            ])
        return StageSplit(tuple(tuple(c) for c in chunks))
