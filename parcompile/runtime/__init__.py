"""What every generated program imports: process groups, counted and differentiable
collectives, tensor-parallel layers, the pipeline schedule executor, data, and the
optimizer step. Generated programs use it as ``from parcompile import runtime as rt``.
"""

from parcompile.runtime import checkpoint
from parcompile.runtime.comm import (COUNTER, all_reduce, copy_to_tp, enter_tp, gather_replicated, keep_split_input,
                                     leave_tp, reduce_from_tp)
from parcompile.runtime.context import Axis, ParallelContext, init_parallel, shutdown
from parcompile.runtime.context_parallel import Positions, chunk_positions, gather_kv, gathered_positions, split_microbatch
from parcompile.runtime.data import SyntheticBatches, batch_digest, eval_data, local_rows, resolve_source, training_data
# the layers and MLA's functions the op table's program rows call (parcompile/ir/ops/):
# every name of each module's __all__, so a new runtime function is one module's edit
from parcompile.runtime.layers import *  # noqa: F403
from parcompile.runtime.core_attention import *  # noqa: F403
from parcompile.runtime.device import device_count, synchronize
from parcompile.runtime.memory import METER
from parcompile.runtime.mla import *  # noqa: F403
from parcompile.runtime.moe import ExpertAxes, GroupedExperts, Router, combine, dispatch
from parcompile.runtime.metrics import RunLog, allocator_peaks, peak_memory
from parcompile.runtime.pipeline import evaluate, loss_normaliser, run_schedule
from parcompile.runtime.weights import load_weights
from parcompile.runtime.wgrad import STORE as WEIGHT_GRADS
from parcompile.runtime.wgrad import linear
from parcompile.runtime.optim import (
    ReplicatedOptimizer,
    step_optimizer,
    zero_records,
    build_optimizer,
    clip_gradients,
    grad_norm,
    set_lr,
    shards,
    sync_gradients,
)
from parcompile.runtime.train import (TrainError, check_grad_norm, check_loss, fail_together, local_param_count, lr_at, reduce_loss,
                                     write_metrics, write_state)
