"""The ground floor of parcompile: the rules every layer uses, written once.

This package may import only the standard library (``tests/test_layers_import.py``
enforces it): no torch, pydantic, networkx, lark or jinja2, and nothing from parcompile
outside ``parcompile.core``. The config, the IR, the passes, the analyses, the search,
export, codegen and the runtime import it; none of them re-derives what it decides.

- :mod:`parcompile.core.axes`: the mesh axes and process-group names (:data:`GROUP_AXES`).
- :mod:`parcompile.core.buckets`: gradient buckets (units, partition, ZeRO-3's gathers, reductions).
- :mod:`parcompile.core.data_parallel`: what the step shards over which data-parallel group
  (ZeRO's stage, HSDP's replicate x shard: :class:`DataParallelSharding`).
- :mod:`parcompile.core.dtypes`: bytes per element, gradient bytes, torch's dtype names.
- :mod:`parcompile.core.groups`: process groups (Megatron-Core's rank generators).
- :mod:`parcompile.core.heads`: how tensor parallelism splits or replicates kv heads.
- :mod:`parcompile.core.model`: the model block as plain data (:class:`ModelKeys`), its derived
  defaults and the padded vocabulary.
- :mod:`parcompile.core.hf`, :mod:`parcompile.core.hf_weights`: Hugging Face config.json keys
  and where our tensors live in a checkpoint.
- :mod:`parcompile.core.sources`: the built-in training texts.
- :mod:`parcompile.core.schedule`: pipeline schedules (action lists) and their simulator.
- :mod:`parcompile.core.version`: the compiler's version.
"""
