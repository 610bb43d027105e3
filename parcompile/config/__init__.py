"""The resolved configuration of a spec, as data: schema, units, presets, text helpers and
the Hugging Face tables.

``schema`` defines :class:`SpecConfig`. Building one from a parsed spec and checking it are
the front end's (:mod:`parcompile.frontend.build`, :mod:`parcompile.frontend.checks`), which
sits above this package and above ``ir``.
"""

from parcompile.config.schema import (
    ClusterConfig,
    ModelConfig,
    ParallelConfig,
    ServeConfig,
    SpecConfig,
    TrainConfig,
)

__all__ = ["ClusterConfig", "ModelConfig", "ParallelConfig", "ServeConfig", "SpecConfig", "TrainConfig"]
