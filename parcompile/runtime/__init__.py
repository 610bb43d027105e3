"""What every generated program imports: process groups, counted and differentiable
collectives, tensor-parallel layers, the pipeline schedule executor, data, and the
optimizer step. Generated programs use it as ``from parcompile import runtime as rt``.

The code lives in one subpackage per concern: :mod:`~parcompile.runtime.distributed`,
:mod:`~parcompile.runtime.machine`, :mod:`~parcompile.runtime.model`,
:mod:`~parcompile.runtime.train.step`, :mod:`~parcompile.runtime.serve`,
:mod:`~parcompile.runtime.data.loader` and :mod:`~parcompile.runtime.state`; this module names
what the programs call.
"""

from parcompile.core.data_parallel import DataParallelSharding
from parcompile.runtime.state import checkpoint
from parcompile.runtime.distributed.comm import (COUNTER, all_reduce, copy_to_tp, enter_tp, gather_replicated, keep_split_input,
                                     leave_tp, reduce_from_tp)
from parcompile.runtime.distributed.context import Axis, ParallelContext, init_parallel, shutdown
from parcompile.runtime.distributed.failure import run_main
from parcompile.runtime.distributed.context_parallel import Positions, chunk_positions, gather_kv, gathered_positions, split_microbatch
from parcompile.runtime.data.files import DataError
from parcompile.runtime.data.loader import SyntheticBatches, batch_digest, eval_data, local_rows, resolve_source, training_data
# the layers and MLA's functions the op table's program rows call (parcompile/ir/ops/):
# every name of each module's __all__, so a new runtime function is one module's edit
from parcompile.runtime.model.layers import *  # noqa: F403
from parcompile.runtime.model.core_attention import *  # noqa: F403
from parcompile.runtime.machine.device import device_count, synchronize
from parcompile.runtime.machine.memory import METER
from parcompile.runtime.model.mla import *  # noqa: F403
from parcompile.runtime.model.llama4 import *  # noqa: F403
from parcompile.runtime.model.lora import Adapters, add_lora, lora_state_bytes
from parcompile.runtime.model.moe import ExpertAxes, GroupedExperts, Router, combine, dispatch
from parcompile.runtime.train.metrics import RunLog, allocator_peaks, peak_memory
from parcompile.runtime.progress import Startup, group_text
from parcompile.runtime.train.pipeline import evaluate, loss_normaliser, run_schedule
from parcompile.runtime.state.weights import load_weights
from parcompile.runtime.train.wgrad import STORE as WEIGHT_GRADS
from parcompile.runtime.train.wgrad import linear
from parcompile.runtime.train.optimizers import step_optimizer, zero_records
from parcompile.runtime.train.grads import set_grad_dtype
from parcompile.runtime.model.discard import discard_between, discarding
from parcompile.runtime.train.optim import (
    ReplicatedOptimizer,
    build_optimizer,
    clip_gradients,
    grad_norm,
    set_lr,
    shards,
    sync_gradients,
)
from parcompile.runtime.train.step import (TrainError, check_grad_norm, check_loss, fail_together, local_param_count, lr_at, reduce_loss,
                                     write_metrics, write_state)
