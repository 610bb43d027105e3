"""Process groups: moved to :mod:`parcompile.core.groups` (the ground floor, issue 17).

Re-exported here so that existing importers (the driver, the search, tests) keep working;
new code imports :mod:`parcompile.core.groups`.
"""

from __future__ import annotations

from parcompile.core.groups import (Layout, RankGenerator, axis_placement, groups_placement, masked_groups,
                                    rank_groups, stage_ranks)

__all__ = ["Layout", "RankGenerator", "axis_placement", "groups_placement", "masked_groups", "rank_groups",
           "stage_ranks"]
