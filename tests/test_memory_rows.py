"""Megatron-Bridge's published GPT-OSS 120B BF16 layouts (parcompile/analysis/memory_rows.py)
plan as fitting: they ran on those GPUs."""

from __future__ import annotations

import pytest

from parcompile.analysis.memory_rows import MEMORY_ROWS, memory_row_config
from parcompile.passes.manager import cost_without_schedule


@pytest.mark.parametrize("row", MEMORY_ROWS, ids=lambda r: r.name)
def test_published_layout_fits(row):
    mem = cost_without_schedule(memory_row_config(row)).memory
    assert mem.fits, f"{row.name}: peak {mem.peak / 2**30:.1f} GiB of {mem.capacity / 2**30:.1f} usable"


def test_every_h100_and_b200_container_is_held():
    got = {(r.cluster, r.container) for r in MEMORY_ROWS}
    assert got == {(c, v) for c in ("h100-sxm", "b200") for v in ("25.11", "26.02", "26.02.01", "26.04", "26.04.01")}
