"""The serving estimate against the published GPU serving runs it was calibrated on
(issue 45; parcompile/analysis/serve_calibration.py gives each row's source, configuration
and assumptions; benchmarks/serve_gpu.py prints them): each within 10% of its published
time per output token and, where published, time to first token. A change to the serving
model, an engine constant or a preset that moves a row past 10% fails here."""

from __future__ import annotations

import pytest

import parcompile
from parcompile.analysis.serve_calibration import SERVE_ROWS


@pytest.mark.parametrize("row", SERVE_ROWS, ids=lambda r: r.name)
def test_published_serving_rows_within_10_percent(row):
    sv = parcompile.compile(row.spec, filename="row.par").data["serve"]
    got = row.planned(sv)
    for key, published in row.published.items():
        assert got[key] == pytest.approx(published, rel=0.10), (row.name, key, got[key], published)


def test_rows_name_their_sources_and_what_was_assumed():
    for row in SERVE_ROWS:
        assert row.source and "@" in row.commit and row.assumed and row.configuration
        assert row.published and all(v > 0 for v in row.published.values())
