"""One costed layout (:class:`Candidate`) and how a split prints (:func:`split_text`)."""

from __future__ import annotations

from dataclasses import dataclass

from parcompile.core.recompute import recompute_words
from parcompile.analysis.memory import MemoryReport
from parcompile.config.schema import ParallelConfig
from parcompile.layout_search.space import SCHEDULE_ORDER


#: the order ties are broken in (simpler first: :data:`~parcompile.layout_search.space.SCHEDULE_ORDER`)
_SCHEDULE_RANK = {s.name: i for i, s in enumerate(SCHEDULE_ORDER)}


_RECOMPUTE_RANK = {"none": 0, "selective": 1, "full": 2}   # a module list (core/recompute.py) ranks as selective


@dataclass(frozen=True)
class Candidate:
    """One costed layout: its :class:`ParallelConfig` and what the cost model says."""

    parallel: ParallelConfig
    step_time: float
    mfu: float
    tflops_per_gpu: float
    peak: int
    capacity: int
    bubble_fraction: float
    breakdown: dict
    memory: MemoryReport | None = None
    simulated: bool = False

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    def degrees_text(self) -> str:
        """``tp=8 pp=4 dp=32 ...``: the layout in one line (only what differs from defaults; an
        uneven split as :func:`split_text`'s compact form, ``split=7/8x14/7``)."""
        p = self.parallel
        parts = [f"tp={p.tp}", f"pp={p.pp}", f"dp={p.dp}"]
        if p.cp > 1:
            parts.append(f"cp={p.cp}")
        if p.ep > 1:
            parts.append(f"ep={p.ep}")
        if p.virtual_stages > 1:
            parts.append(f"v={p.virtual_stages}")
        parts += [f"mb={p.micro_batch}", f"zero={p.zero}", f"recompute={recompute_words(p.recompute)}"]
        if p.pp > 1:
            parts.append(f"schedule={p.schedule}")
        if p.microbatch_group_size is not None:
            parts.append(f"group={p.microbatch_group_size}")
        if p.sequence_parallel:
            parts.append("sp")
        elif p.tp > 1:   # said either way where it applies: the search may have chosen it
            parts.append("no-sp")
        if p.dp_replicate > 1:   # HSDP
            parts.append(f"dp_replicate={p.dp_replicate}")
        if p.offload != "none":
            parts.append(f"offload={p.offload}")
        if p.stage_layers is not None and len(set(p.stage_layers)) > 1:
            parts.append("split=" + split_text(p.stage_layers, compact=True))
        return " ".join(parts)

    def key(self) -> tuple:
        """Ranking key: step time, then the simpler layout."""
        p = self.parallel
        return (round(self.step_time, 9), _SCHEDULE_RANK[p.schedule], p.virtual_stages, p.zero,
                _RECOMPUTE_RANK.get(p.recompute, 1), p.tp, p.pp, p.cp, -p.micro_batch, int(p.sequence_parallel),
                p.dp_replicate)


def split_text(counts, compact: bool = False) -> str:
    """Layers per model chunk, a run of more than three equal counts shortened:
    ``(7, 8, 8, 8, 8, 7)`` -> ``"7, 8 (4 chunks), 7"``, ``(2, 2, 2, 1)`` -> ``"2, 2, 2, 1"``;
    ``compact`` (one word, :meth:`Candidate.degrees_text`): ``"7/8x4/7"``, ``"2/2/2/1"``."""
    runs: list[list[int]] = []
    for c in counts:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    sep, run = ("/", "{c}x{n}") if compact else (", ", "{c} ({n} chunks)")
    return sep.join(run.format(c=c, n=n) if n > 3 else sep.join([str(c)] * n) for c, n in runs)
