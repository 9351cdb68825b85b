"""A recurrent token mixer (gated delta net, short conv, Mamba2) on the packed token axis.

It wraps the mlx-lm module itself, which already takes its state from an mlx-lm `ArraysCache`
(conv state: the last kernel-1 inputs; recurrent / SSM state): each run of the step fills a cache from
the state pool, calls the module on its rows, and writes the cache back. A prefill segment is one run
(batch 1); neighbouring decode rows form one run of batch B with their gathered states.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from metalserve.executor.context import current_context
from metalserve.executor.state_cache import StateLayout, StateRun, StateSlot, StateStep


class StateMixer(nn.Module):
    """Replaces one layer's recurrent mixer; the layer's `mask` and `cache` are ignored."""

    def __init__(self, inner: nn.Module, state_idx: int, cache_size: int) -> None:
        super().__init__()
        self.inner = inner
        self.state_idx = state_idx  # this layer's place among the model's recurrent layers
        self.cache_size = cache_size

    def _run(self, x: mx.array, run: StateRun, states: StateStep) -> mx.array:
        cache = ArraysCache(self.cache_size)
        if run.read_ids is not None:
            for i, a in states.pool.read(self.state_idx, run.read_ids).items():
                cache[i] = a
        rows = x[:, run.start : run.stop]
        if run.batched:
            rows = rows.transpose(1, 0, 2)  # [B, 1, hidden]: one row per request
        out = self.inner(rows, None, cache)
        written = {i: cache[i] for i in range(self.cache_size) if cache[i] is not None}
        states.pool.write(self.state_idx, run.write_ids, written)
        return out.transpose(1, 0, 2) if run.batched else out

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        states = current_context().states
        if states is None:
            raise RuntimeError("a recurrent layer ran without the step's state plan")
        outs = [self._run(x, run, states) for run in states.runs]
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)


def probe_layout(mixers: list[nn.Module], hidden: int, dtype: mx.Dtype, cache_size: int = 2) -> StateLayout:
    """Each recurrent layer's state arrays, read off one token through its own mlx-lm module."""
    layers = []
    for m in mixers:
        cache = ArraysCache(cache_size)
        m(mx.zeros((1, 1, hidden), dtype), None, cache)
        found = [(i, cache[i]) for i in range(cache_size) if cache[i] is not None]
        slots = [StateSlot(i, tuple(a.shape[1:]), a.dtype) for i, a in found]
        if not slots:
            raise ValueError(f"{type(m).__name__} keeps no state in its cache: not a recurrent mixer")
        layers.append(tuple(slots))
    # A pipeline stage may hold no recurrent layer: an empty layout, of the default cache size.
    used = max((s.index for layer in layers for s in layer), default=cache_size - 1) + 1
    return StateLayout(tuple(layers), used)
