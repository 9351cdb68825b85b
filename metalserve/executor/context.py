"""The per-step forward context, set around one forward by the runner and read by attention layers.

It is passed through a context manager that refuses nesting, not through patched globals: exactly one
forward is in flight per process, and a layer called outside a forward fails loudly.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from metalserve.executor.attention.base import AttentionBackend
from metalserve.executor.state_cache import StateStep


@dataclass(frozen=True)
class ForwardContext:
    positions: mx.array  # [T] int32, each token's position in its request
    slot_mapping: mx.array  # [T] int32, where each token's K/V is written
    backend: AttentionBackend[Any, Any]  # the one attention backend of this runner
    metadata: Any  # what `backend.build_metadata` built for this step
    kv: Sequence[Any]  # each layer's cache, in the backend's layout
    states: StateStep | None = None  # the recurrent layers' state plan (hybrid models only)


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
