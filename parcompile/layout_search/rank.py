"""Ranking the valid layouts best first by branch and bound (:func:`rank_rows`), and the
search's result (:class:`SearchResult`)."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable

from parcompile.analysis.memory import usable_memory
from parcompile.config.schema import SpecConfig
from parcompile.layout_search.bounds import first_rank_layers
from parcompile.layout_search.candidate import Candidate
from parcompile.layout_search.coster import Coster
from parcompile.layout_search.space import Row, RowLayout, check_key, row_parallel, with_parallel


#: candidates re-timed with their simulated schedule
RETIME = 24


@dataclass
class SearchResult:
    """The ranked, fitting, checker-approved candidates (best first) and the counts."""

    cfg: SpecConfig
    candidates: list[Candidate]
    enumerated: int
    valid: int
    fitting: int
    seconds: float
    #: the smallest memory peak among valid layouts that do not fit (for the message when none fits)
    closest: Candidate | None = None
    #: the user's own layout, when the spec gives every degree
    user: Candidate | None = None
    #: valid layouts not costed: the same layout fits with less recomputation (dominated)
    pruned: int = 0
    #: valid layouts not costed: their model states alone exceed the memory (they do not fit)
    unfit: int = 0
    #: valid layouts not costed: provably slower than the best ``max(RETIME, top)``
    #: (:func:`rank_rows`); ``candidates`` past those holds only the layouts costed
    bounded: int = 0
    #: valid layouts costed (:meth:`Coster.cost`; a bound may still have dropped them there)
    costed: int = 0
    #: probe graphs built (module docstring)
    probes: int = 0

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def config(self, i: int = 0) -> SpecConfig:
        """The spec with candidate ``i``'s layout."""
        return with_parallel(self.cfg, self.candidates[i].parallel)


def family_key(r: Row) -> tuple:
    """The probe a row is costed from (:meth:`Coster.probe`'s key)."""
    _dp, tp, _pp, cp, ep, etp, sp, _z, mb, _gb, _sched, _v, _rc, _dpr = r
    return (tp, cp, sp, mb, ep, etp)


@dataclass
class Ranked:
    """What :func:`rank_rows` found: the fitting candidates costed (with their row index), the
    closest one that does not fit (``(peak, row)``, candidate) and the counts."""

    scored: list = field(default_factory=list)
    closest: tuple | None = None
    pruned: int = 0
    unfit: int = 0
    bounded: int = 0
    costed: int = 0


def rank_rows(cfg: SpecConfig, coster: Coster, rows: list, families: dict[tuple, list[int]], keep: int,
          bounds: bool, progress: Callable[[int, int], None] | None, total: int) -> Ranked:
    """Cost the valid rows (``families``: probe key -> row indices), best first, by branch
    and bound.

    Every row the unbounded search would cost is costed but for these, each proven not to
    change the ``keep`` best candidates nor their order:

    * ``pruned`` (dominated): the same layout with less recomputation fits, as before;
    * ``unfit``: its model states alone exceed the memory (:meth:`Coster.state_floor`);
    * ``bounded``: once ``keep`` candidates fit, a row whose step time is provably above
      the ``keep``-th smallest cannot be among the ``keep`` best, and is not costed (the
      ranking past the ``keep`` best holds the rows costed only).

    With ``bounds``, a priority queue holds the families (keyed by
    :meth:`Coster.family_floor`, no probe of their own needed) and the rows of the families
    opened so far, each keyed by the largest bound worked out for it so far: its group's
    family floor, then :meth:`Coster.family_layout_floor` (with what the step adds; still no
    probe of its own), then :meth:`Coster.layout_floor` (its own probe). A row the
    family's probes already show not to fit (:meth:`Coster.memory_floor` with ``base``) is
    dropped before its first bound of its own. The lowest comes out first: a family opens into its rows, a row gets its next
    bound and goes back, or, with all of them, is costed (with the bound of the moment,
    :meth:`Coster.cost`). Once the lowest key exceeds the bound, every entry
    left is bounded. The dominance rule reads whether the rows with less recomputation fit,
    working it out (:meth:`Coster.fits`) for those not costed yet. Ties are broken by
    enumeration order, as before. Without ``bounds`` (a spec costed from its whole graph,
    serving, or when no layout fits and the closest is wanted) every row is costed."""
    return _BranchAndBound(cfg, coster, rows, families, keep, bounds, progress, total).run()


class _BranchAndBound:
    """One run of :func:`rank_rows`: its queue's entries are ``(key, kind, row, family)``,
    kind 0 a family, 1 a row keyed by its family's bound for its group, 2 by its family's
    bound for the layout (:meth:`Coster.family_layout_floor`), 3 by its own probe's bound as
    well (:meth:`Coster.layout_floor`; then costed)."""

    def __init__(self, cfg: SpecConfig, coster: Coster, rows: list, families: dict[tuple, list[int]], keep: int,
                 bounds: bool, progress: Callable[[int, int], None] | None, total: int):
        self.cfg, self.coster, self.rows, self.families = cfg, coster, rows, families
        self.keep, self.bounds, self.progress, self.total = keep, bounds, progress, total
        self.out = Ranked()
        self.worst: list[float] = []   # max-heap (negated) of the `keep` smallest rounded step times
        self.fit_row: dict[int, bool] = {}       # row -> it fits (costed, or worked out for dominance)
        self.same: dict[tuple, list[int]] = {}   # (check key, zero) -> its rows, less recomputation first
        self.floors: dict[tuple, float] = {}
        self.states: dict[tuple, int] = {}
        self.firsts: dict[tuple, int] = {}
        self.cap = usable_memory(cfg.cluster)
        self.done = total - sum(len(v) for v in families.values())
        self.group_floors: dict[tuple, dict] = {}
        self.unfit_rows: set[int] = set()   # the model states alone exceed the memory

    def run(self) -> Ranked:
        """Take the lowest entry until none is left or the lowest exceeds the bound."""
        heap = self.family_entries()
        bounds, keep, worst = self.bounds, self.keep, self.worst
        while heap:
            floor, kind, i, fam = heapq.heappop(heap)
            tau = _bound(worst, keep) if bounds else None
            if tau is not None and floor > tau:   # so is every entry left
                heapq.heappush(heap, (floor, kind, i, fam))
                break
            if kind == 0:
                self.open_family(fam, heap)
            elif kind < 3 and bounds:
                self.refine(floor, kind, i, fam, heap)
            else:
                self.cost_row(i, tau)
        self.count_left(heap)
        return self.out

    def state_floor(self, fam: tuple, i: int) -> int:
        """:meth:`Coster.state_floor` of row ``i`` (of family ``fam``), cached by pp and zero; 0
        without bounds."""
        if not self.bounds:
            return 0
        r = self.rows[i]
        skey = (fam, r[2], r[7], r[13])   # pp, zero, dp_replicate
        sf = self.states.get(skey)
        if sf is None:
            sf = self.states[skey] = self.coster.state_floor(RowLayout._make(r))
        return sf

    def row_fits(self, j: int) -> bool:
        """Whether row ``j`` fits (costed, or worked out: :meth:`Coster.fits`)."""
        got = self.fit_row.get(j)
        if got is None:
            r, cfg = self.rows[j], self.cfg
            got = self.fit_row[j] = (self.state_floor(family_key(r), j) <= self.cap
                                     and self.coster.fits(with_parallel(cfg, row_parallel(cfg, r))))
        return got

    def first_layers(self, r: tuple) -> int:
        """The fewest layers a split of row ``r`` gives the first rank, cached by pp and v."""
        key = (r[2], r[11])   # pp, virtual_stages
        got = self.firsts.get(key)
        if got is None:
            cfg = self.cfg
            got = self.firsts[key] = first_rank_layers(self.coster.splits(with_parallel(cfg, row_parallel(cfg, r))),
                                                       r[2])
        return got

    def family_entries(self) -> list[tuple]:
        """The queue's first entries: one per family, keyed by its smallest group bound
        (:meth:`Coster.family_floor`: the family's own probe not needed; 0 without bounds).
        Rows whose model states alone exceed the memory are set aside."""
        heap: list[tuple] = []
        rows, cfg, cap = self.rows, self.cfg, self.cap
        for fam, idxs in self.families.items():
            floor = 0.0
            if self.bounds:
                groups, reps, fam_states = set(), {}, {}
                for i in idxs:
                    dp, _tp, pp, _cp, _ep, _etp, _sp, z, mb, gb, _sched, v, rc, _dpr = rows[i]
                    sf = fam_states.get((pp, z, _dpr))
                    if sf is None:
                        sf = fam_states[(pp, z, _dpr)] = self.state_floor(fam, i)
                    if sf > cap:
                        self.unfit_rows.add(i)
                        continue
                    groups.add((pp, v, gb // (mb * dp), rc))
                    reps.setdefault(pp, i)
                got = self.group_floors[fam] = self.coster.family_floor(
                    {pp: row_parallel(cfg, rows[i]) for pp, i in reps.items()}, sorted(groups)) if groups else {}
                floor = min(got.values(), default=math.inf)
            heapq.heappush(heap, (floor, 0, idxs[0], fam))
        return heap

    def open_family(self, fam: tuple, heap: list) -> None:
        """A family taken from the queue: its rows go in, each with its group's bound."""
        out, same, rows, unfit_rows = self.out, self.same, self.rows, self.unfit_rows
        group = self.group_floors.get(fam) if self.bounds else None
        for j in self.families[fam]:
            r = rows[j]
            dp, tp, pp, cp, ep, etp, sp, z, mb, gb, sched, v, rc, _dpr = r
            same.setdefault((check_key(r), z), []).append(j)
            if j in unfit_rows:
                self.fit_row[j] = False
                out.unfit += 1
                self.done += 1
                continue
            lb = group[(pp, v, gb // (mb * dp), rc)] if group is not None else 0.0
            heapq.heappush(heap, (lb, 1, j, fam))

    def refine(self, floor: float, kind: int, i: int, fam: tuple, heap: list) -> None:
        """Row ``i`` gets its next bound (kind 1: from the family's probe; 2: from its own)
        and goes back, unless shown not to fit without its own probe: before its first bound
        of its own with the probes built (kind 1), before building its own with one more
        (kind 2)."""
        r, coster = self.rows[i], self.coster
        if (kind == 1 or fam not in coster.probes) and coster.memory_floor(
                RowLayout._make(r), self.first_layers(r), base=True, build=kind == 2) > self.cap:
            self.fit_row[i] = False
            self.out.unfit += 1
            self.done += 1
            return
        # pp, v, global_batch, recompute, zero, schedule, dp_replicate
        fkey = (kind, fam, r[2], r[11], r[9], r[12], r[7], r[10], r[13])
        lb = self.floors.get(fkey)
        if lb is None:
            par = row_parallel(self.cfg, r)
            lb = self.floors[fkey] = coster.family_layout_floor(par) if kind == 1 else coster.layout_floor(par)
        heapq.heappush(heap, (max(floor, lb), kind + 1, i, fam))

    def cost_row(self, i: int, tau: float | None) -> None:
        """Row ``i`` with all its bounds: dominated, shown not to fit, bounded by ``tau``
        (:meth:`Coster.cost`), or costed and ranked."""
        out, cfg = self.out, self.cfg
        self.done += 1
        if self.progress is not None and self.done % 1024 == 0:
            self.progress(self.total // 2 + self.done // 2, self.total)
        r = self.rows[i]
        nr = (check_key(r), r[7])
        # dominance: the same layout with less recomputation fits
        if any(self.row_fits(j) for j in self.same[nr] if j < i):
            out.pruned += 1
            return
        rcfg = with_parallel(cfg, row_parallel(cfg, r))
        if self.bounds and self.coster.memory_floor(RowLayout._make(r), self.first_layers(r)) > self.cap:
            self.fit_row[i] = False
            out.unfit += 1
            return
        out.costed += 1
        c = self.coster.cost(rcfg, bound=tau)
        if c is None:   # its pipeline alone is slower than the bound
            out.bounded += 1
            return
        self.fit_row[i] = c.fits
        if c.fits:
            out.scored.append((c, i))
            t = round(c.step_time, 9)
            worst = self.worst
            if len(worst) < self.keep:
                heapq.heappush(worst, -t)
            elif t < -worst[0]:
                heapq.heapreplace(worst, -t)
        elif out.closest is None or (c.peak, i) < out.closest[0]:
            out.closest = ((c.peak, i), c)

    def count_left(self, heap: list) -> None:
        """The entries left in the queue: bounded, without being costed (a family's rows set
        aside as not fitting count as unfit)."""
        out = self.out
        for _floor, kind, _i, fam in heap:
            if kind > 0:
                out.bounded += 1
            else:
                for j in self.families[fam]:
                    if j in self.unfit_rows:
                        out.unfit += 1
                    else:
                        out.bounded += 1


def _bound(worst: list[float], keep: int) -> float | None:
    """With ``keep`` candidates costed, a step time above which a candidate cannot be among
    the ``keep`` best (its rounded key would exceed the ``keep``-th smallest); None before."""
    if len(worst) < keep:
        return None
    return -worst[0] + 1e-9
