"""The resolved configuration of a spec: schema, units, presets, building and checks.

``schema`` defines :class:`SpecConfig`; ``build`` turns a parsed spec into one (with
``presets`` and ``hf`` imports and ``units`` conversion); ``checks`` holds the
cross-field checks.
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
