"""The CPU attention path: the portable pool, written in place from the host, decodes through a numba kernel.

Each layer evaluates its q, k and v, writes k and v into the pool through a NumPy view of the pool's
own MLX buffer (MLX documents that such a view shares memory), attends the leading single-query rows with
`cpu_decode.decode_attention`, and leaves prefill chunks to the portable MLX path, which reads the same
pool. Both writes and reads of a layer happen before its output is returned, so MLX never sees a pool
that changes under a pending op of the same layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from metalserve.kernels import cpu_decode
from metalserve.kernels.reference import AttentionOptions, AttentionPlan, paged_attention_planned


@dataclass(frozen=True)
class CpuStepPlan:
    """The host arrays of one step: where each token's K/V goes, and the single-query rows' pages."""

    slot_mapping: np.ndarray  # [T]
    num_decodes: int  # the leading requests (one query row each) the kernel attends
    block_tables: np.ndarray  # [num_decodes, width] int32
    seq_lens: np.ndarray  # [num_decodes] int32
    block_size: int


def build_cpu_plan(
    block_rows: Sequence[np.ndarray],
    cu_seqlens_q: np.ndarray,
    seq_lens: np.ndarray,
    slot_mapping: np.ndarray,
    block_size: int,
) -> CpuStepPlan:
    q_lens = np.diff(cu_seqlens_q)
    n = 0
    while n < len(q_lens) and q_lens[n] == 1:
        n += 1
    width = max((len(block_rows[i]) for i in range(n)), default=1)
    tables = np.zeros((n, width), np.int32)
    for i in range(n):
        tables[i, : len(block_rows[i])] = block_rows[i]
    return CpuStepPlan(np.asarray(slot_mapping), n, tables, np.asarray(seq_lens[:n], np.int32), block_size)


def host_view(pool: mx.array) -> np.ndarray:
    """A writable NumPy array over the pool's own buffer (no copy)."""
    mx.eval(pool)
    view = np.asarray(pool)
    if not view.flags.writeable or view.dtype != np.float32:
        writeable = view.flags.writeable
        raise RuntimeError(f"the CPU path needs a writable float32 pool, got {view.dtype} (writeable={writeable})")
    return view


def cpu_paged_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    pool: mx.array,
    view: np.ndarray,
    step: CpuStepPlan,
    prefills: AttentionPlan,
    opts: AttentionOptions,
) -> mx.array:
    """Write this step's K/V and attend every query row: `[T, Hq, D]` like the portable path."""
    mx.eval(q, k, v)
    cpu_decode.write_kv(view, np.asarray(k), np.asarray(v), step.slot_mapping)
    parts = []
    n = step.num_decodes
    if n:
        sinks = None if opts.sinks is None else np.asarray(opts.sinks.astype(mx.float32))
        out = cpu_decode.decode_attention(
            np.asarray(q)[:n], view, step.block_tables, step.seq_lens, block_size=step.block_size,
            scale=opts.scale, sliding_window=opts.sliding_window, softcap=opts.softcap, sinks=sinks,
        )  # fmt: skip
        parts.append(mx.array(out))
    if prefills.prefills:
        parts.append(paged_attention_planned(q, pool, prefills, opts))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
