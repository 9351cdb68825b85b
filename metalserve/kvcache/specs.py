"""Per-layer cache specs: which kind of cache a group of layers keeps (vLLM's KV cache spec family).

All groups share one block pool and one block size; each keeps its own block table per request.
"""

from __future__ import annotations

from dataclasses import dataclass

from metalserve.kvcache.hashing import BlockHash


@dataclass(frozen=True)
class FullAttention:
    """K/V for every token: a request holds one block per `block_size` tokens, none freed before it ends."""

    layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class SlidingWindow:
    """K/V for the last `window` tokens (the token itself included); older blocks go back to the pool."""

    window: int
    layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"a sliding window must be at least 1 token, got {self.window}")


@dataclass(frozen=True)
class RecurrentState:
    """A fixed-size state per request (conv / SSM / gated delta).

    The state after `t` computed tokens lives in table entry `(t - 1) // block_size`. With
    `snapshots`, a state that lands exactly on a block boundary is published to the prefix cache,
    so a hit resumes from it (vLLM's "align" mode); without, prefix caching is off for the model.
    """

    layers: tuple[int, ...] = ()
    snapshots: bool = True


LayerGroupSpec = FullAttention | SlidingWindow | RecurrentState


def prefix_caching_problem(specs: list[LayerGroupSpec]) -> str | None:
    """Why prefix caching cannot work for these groups (a line for the start-up log), or None."""
    for i, spec in enumerate(specs):
        if isinstance(spec, RecurrentState) and not spec.snapshots:
            return f"layer group {i} keeps a recurrent state that cannot be snapshotted: prefix caching is off"
    return None


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of a block in `group`: the same tokens give different blocks per group.
    Group 0 keeps the bare hash, so a single-group model's keys are the plain chain hashes."""
    if group == 0:
        return block_hash
    return BlockHash(block_hash + group.to_bytes(2, "little"))
