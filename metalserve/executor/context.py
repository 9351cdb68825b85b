"""The per-step attention metadata, set around one forward by the runner and read by attention layers.

It is passed through a context manager that refuses nesting, not through patched globals: exactly one
forward is in flight per process, and a layer called outside a forward fails loudly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from metalserve.kernels.reference import AttentionPlan

if TYPE_CHECKING:  # the CPU path imports numba; only runners that use it load it
    from metalserve.kernels.cpu import CpuStepPlan

# A backend with the contract of metalserve.kernels.reference.paged_attention.
AttentionFn = Callable[..., mx.array]


@dataclass
class LayerKV:
    """One layer's K and V pools for a kernel backend, `[num_slots, Hkv, D]` each (the kernel contract).

    Each step's write replaces the arrays with the scatter's outputs, which reuse the same buffers.
    """

    k: mx.array
    v: mx.array

    def arrays(self) -> list[mx.array]:
        return [self.k, self.v]

    def extended(self, more: LayerKV) -> LayerKV:
        """These pools followed by `more`'s slots (a grown pool)."""
        return LayerKV(mx.concatenate([self.k, more.k]), mx.concatenate([self.v, more.v]))


@dataclass
class PortableKV:
    """One layer's K and V for the portable path, one array `[2, Hkv, num_slots, D]`; written in place."""

    pool: mx.array
    host: np.ndarray | None = None  # the CPU path's NumPy view of `pool`'s buffer, through which it writes

    def arrays(self) -> list[mx.array]:
        return [self.pool]

    def extended(self, more: PortableKV) -> PortableKV:
        """This pool followed by `more`'s slots (a grown pool); the host view is made anew."""
        return PortableKV(mx.concatenate([self.pool, more.pool], axis=2))


@dataclass(frozen=True)
class ForwardContext:
    positions: mx.array  # [T] int32, each token's position in its request
    slot_mapping: mx.array  # [T] int32, where each token's K/V is written
    kv: list[LayerKV] | list[PortableKV]  # PortableKV exactly when attention_fn is None
    block_size: int
    plan: AttentionPlan | None  # the portable path's plan; None when a kernel backend runs
    cpu: CpuStepPlan | None = None  # set when the CPU path attends (then `plan` is None)
    # What a kernel backend needs (see the contract in metalserve/kernels/reference.py).
    block_tables: mx.array | None = None
    cu_seqlens_q: mx.array | None = None
    seq_lens: mx.array | None = None
    attention_fn: AttentionFn | None = None


_local = threading.local()


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    if getattr(_local, "ctx", None) is not None:
        raise RuntimeError("a forward is already in flight: forward contexts do not nest")
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = None


def current_context() -> ForwardContext:
    ctx: ForwardContext | None = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("paged attention was called outside a forward_context")
    return ctx
