"""Measuring the activations a program keeps for backward, per decoder layer.

:data:`METER` counts, while it is active, every tensor autograd saves for backward inside
a decoder layer (``torch.autograd.graph.saved_tensors_hooks``), once per storage (views
of one tensor share it) and without parameters and module buffers (weights are model
states, not activations; the rotary tables are shared by every layer). Tensors that
activation recomputation keeps alive without going through the hooks (the inputs
``torch.utils.checkpoint`` holds on to) are reported by :func:`parcompile.runtime.model.layers.recompute`
through :meth:`SavedTensorMeter.hold`. What it measures is compared with the plan's
``memory.per_stage[].activations_per_layer`` by ``parcompile verify`` and the tests.

One micro-batch is measured: the first forward of each layer while the meter is active;
later micro-batches through the same layer are not counted again.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of the storage under ``t``."""
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


class SavedTensorMeter:
    """Bytes saved for backward per decoder layer (module docstring).

    ``per_layer[layer]`` is the sum of the sizes of the distinct storages saved while that
    layer's forward ran, in bytes.
    """

    def __init__(self) -> None:
        self.active = False
        self.per_layer: dict[int, int] = {}
        self._seen: dict[int, set[int]] = {}
        self._layer: int | None = None
        self._exclude: set[int] = set()
        self._model: nn.Module | None = None

    @contextlib.contextmanager
    def measuring(self, model: nn.Module):
        """Count saved tensors within this block (parameters and buffers of ``model`` excluded)."""
        self.reset()
        self._model = model
        self._exclude = self._state_storages()
        self.active = True
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            try:
                yield self
            finally:
                self.active = False
                self._layer = None
                self._model = None

    @contextlib.contextmanager
    def layer(self, index: int):
        """Attribute what is saved within this block to decoder layer ``index`` (a no-op
        unless measuring, and for a layer already measured)."""
        if not self.active or index in self.per_layer:   # off, or a later micro-batch
            yield
            return
        self._layer = index
        self._seen[index] = set()
        self.per_layer[index] = 0
        try:
            yield
        finally:
            self._layer = None
            del self._seen[index]

    def _state_storages(self) -> set[int]:
        """Data pointers of the model's parameters and buffers now."""
        model = self._model
        return {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}

    def hold(self, *tensors) -> None:
        """Count tensors kept alive for backward outside the hooks (checkpoint inputs)."""
        for t in tensors:
            if torch.is_tensor(t) and t.is_floating_point():
                self._record(t)

    def _record(self, t: torch.Tensor) -> None:
        if self._layer is None:
            return
        ptr, nbytes = _storage(t)
        if ptr in self._seen[self._layer]:
            return
        if ptr in self._exclude or (self._model is not None and ptr in self._state_storages()):
            return   # a weight (ZeRO-3 gathers them during the step, into new storages)
        self._seen[self._layer].add(ptr)
        self.per_layer[self._layer] += nbytes

    def release(self, t: torch.Tensor) -> None:
        """Uncount ``t``'s storage, saved in the current layer and freed before its backward
        (an output-discarding recomputation: :mod:`parcompile.runtime.model.discard`)."""
        if self._layer is None:
            return
        ptr, nbytes = _storage(t)
        if ptr in self._seen[self._layer]:
            self._seen[self._layer].discard(ptr)
            self.per_layer[self._layer] -= nbytes

    def saved(self, t: torch.Tensor) -> None:
        """Count ``t`` as saved for backward (for saved-tensor hooks nested inside the
        meter's, which take over; :func:`parcompile.runtime.distributed.comm.keep_split_input`)."""
        self._record(t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._layer is not None:
            self._record(t)
        return t

    def snapshot(self) -> dict[str, int]:
        """``{layer id (str): bytes}`` measured so far (JSON-ready)."""
        return {str(k): v for k, v in sorted(self.per_layer.items())}

    def reset(self) -> None:
        self.per_layer.clear()
        self._seen.clear()


#: the program's meter (one per process)
METER = SavedTensorMeter()

__all__ = ["SavedTensorMeter", "METER"]
