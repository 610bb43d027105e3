"""What the passes tell later passes, the analyses and the driver: one frozen result per
pass that has something to say, gathered in :class:`PassResults` (read by attribute).

``shard-data-parallel`` returns the step's
:class:`~parcompile.core.data_parallel.DataParallelSharding`, ``split-pipeline-stages`` a
:class:`StageSplit`, ``insert-collectives`` a :class:`CollectivesInserted`,
``schedule-pipeline`` a :class:`ScheduleResult`; the other sharding passes return nothing. :func:`parcompile.passes.manager.run_pass` records each in the pass
context's :attr:`~parcompile.passes.base.PassContext.results`, and verifies the graph with
the invariants they switch on (:attr:`PassResults.staged`, :attr:`PassResults.inserted`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parcompile.analysis.comm import CommReport
from parcompile.analysis.compute import ComputeReport
from parcompile.analysis.params import StageParams
from parcompile.core.data_parallel import DataParallelSharding
from parcompile.core.schedule import ScheduleReport


@dataclass(frozen=True)
class StageSplit:
    """``split-pipeline-stages``: the layer ids of each model chunk, in model order
    (``pp * virtual_stages`` tuples; the first and the last may be empty)."""

    chunks: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class CollectivesInserted:
    """``insert-collectives``: per pipeline rank, the parameters its step collectives were
    sized from (:func:`parcompile.analysis.params.stage_params`)."""

    stage_params: tuple[StageParams, ...]


@dataclass(frozen=True)
class ScheduleResult:
    """``schedule-pipeline``: the simulated schedule, and the compute and communication
    reports its chunk times came from (:func:`parcompile.analysis.cost.analyze` reuses them:
    the same arguments)."""

    report: ScheduleReport
    compute: ComputeReport
    comm: CommReport


#: a pass's result type -> the :class:`PassResults` field that holds it
_FIELD = {DataParallelSharding: "data_parallel", StageSplit: "split", CollectivesInserted: "collectives",
          ScheduleResult: "schedule"}


@dataclass(frozen=True)
class PassResults:
    """The results of the passes run so far (None: that pass has not run)."""

    data_parallel: DataParallelSharding | None = None
    split: StageSplit | None = None
    collectives: CollectivesInserted | None = None
    schedule: ScheduleResult | None = None

    def add(self, result: DataParallelSharding | StageSplit | CollectivesInserted | ScheduleResult | None
            ) -> "PassResults":
        """These results with ``result`` recorded (itself when ``result`` is None).

        Raises:
            TypeError: ``result`` is not one of the result types above.
        """
        if result is None:
            return self
        name = _FIELD.get(type(result))
        if name is None:
            raise TypeError(f"a pass returned {type(result).__name__}, not one of "
                            f"{', '.join(t.__name__ for t in _FIELD)}")
        return replace(self, **{name: result})

    @property
    def staged(self) -> bool:
        """Every op has a pipeline stage (``split-pipeline-stages`` ran)."""
        return self.split is not None

    @property
    def inserted(self) -> bool:
        """Every edge's layouts agree (``insert-collectives`` ran)."""
        return self.collectives is not None

    @property
    def chunks(self) -> tuple[tuple[int, ...], ...]:
        """:attr:`StageSplit.chunks`.

        Raises:
            LookupError: ``split-pipeline-stages`` has not run.
        """
        if self.split is None:
            raise LookupError("split-pipeline-stages has not run: no model chunks yet")
        return self.split.chunks

