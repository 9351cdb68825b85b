"""How the layers are split across ranks: contiguous slices, balanced by weight bytes (no MLX here).

A decode step on a Mac is bound by reading weights, so a layer's bytes stand for both its cost and its
memory. Rank 0 also holds the embedding, the final norm and the vocabulary projection (it samples), so
it gets fewer layers.
"""

from __future__ import annotations

from collections.abc import Sequence


class PartitionError(ValueError):
    """A layer split that cannot work; the message names the flag."""


def split_layers(
    layer_bytes: Sequence[int], num_ranks: int, rank0_extra_bytes: int = 0, override: Sequence[int] | None = None
) -> list[range]:
    """One contiguous range of layer indices per rank; every rank gets at least one layer."""
    n = len(layer_bytes)
    if num_ranks < 1:
        raise PartitionError("--pipeline-parallel-size must be at least 1")
    if n < num_ranks:
        raise PartitionError(f"--pipeline-parallel-size {num_ranks} is more than the model's {n} layers")
    counts = list(override) if override is not None else _balanced_counts(layer_bytes, num_ranks, rank0_extra_bytes)
    if len(counts) != num_ranks or sum(counts) != n or min(counts) < 1:
        raise PartitionError(
            f"--pipeline-layer-partition {','.join(map(str, counts))}: needs {num_ranks} counts of at least 1 "
            f"that sum to the model's {n} layers"
        )
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def _balanced_counts(layer_bytes: Sequence[int], num_ranks: int, rank0_extra: int) -> list[int]:
    """Greedy cut: each rank takes layers until it reaches an equal share of all bytes (rank 0's extra
    counted), leaving at least one layer for every later rank."""
    n = len(layer_bytes)
    share = (sum(layer_bytes) + rank0_extra) / num_ranks
    counts, i = [], 0
    for rank in range(num_ranks):
        if rank == num_ranks - 1:
            counts.append(n - i)
            break
        held = rank0_extra if rank == 0 else 0
        start = i
        while i < n - (num_ranks - rank - 1) and (i == start or held + layer_bytes[i] / 2 <= share):
            held += layer_bytes[i]
            i += 1
        counts.append(i - start)
    return counts
