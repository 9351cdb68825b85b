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
class GroupStep:
    """One layer group's view of the step: its block table decides where K/V goes and is read."""

    slot_mapping: mx.array  # [T] int32, where each token's K/V is written in this group's blocks
    metadata: Any  # what `backend.build_metadata` built for this group this step


@dataclass(frozen=True)
class ForwardContext:
    positions: mx.array  # [T] int32, each token's position in its request; [3, T] for M-RoPE models
    backend: AttentionBackend[Any, Any]  # the one attention backend of this runner
    kv: Sequence[Any]  # each pool tensor's cache, in the backend's layout (see models/kv_layout.py)
    groups: Sequence[GroupStep]  # per attention layer group; group 0 first
    states: StateStep | None = None  # the recurrent layers' state plan (hybrid models only)
    images: Any = None  # the step's image embeddings (executor/encoders/cache.py: StepImages), if any
    lora: Any = None  # the step's token rows per LoRA adapter (lora/layers.py: LoraStep); None: base only

    @property
    def slot_mapping(self) -> mx.array:
        return self.groups[0].slot_mapping

    @property
    def metadata(self) -> Any:
        """Group 0's metadata (a model of one group has only this one)."""
        return self.groups[0].metadata


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
