"""Graph passes, one per module (xDSL's shape): a frozen class with a kebab-case ``name``
and ``apply(graph, ctx)``. :data:`parcompile.passes.manager.PASSES` lists them in order."""

from parcompile.passes.base import Pass, PassContext, PassError, degrees_of
from parcompile.passes.insert_collectives import InsertCollectives
from parcompile.passes.schedule_pipeline import SchedulePipeline
from parcompile.passes.shard_data_parallel import ShardDataParallel
from parcompile.passes.shard_experts import ShardExperts
from parcompile.passes.shard_tensor_parallel import ShardTensorParallel
from parcompile.passes.split_pipeline_stages import SplitPipelineStages

__all__ = ["Pass", "PassContext", "PassError", "degrees_of", "InsertCollectives", "SchedulePipeline",
           "ShardDataParallel", "ShardExperts", "ShardTensorParallel", "SplitPipelineStages"]
