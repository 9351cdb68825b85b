"""The paged-attention test cases, their inputs and a float64 NumPy reference.

Shared by the kernel tests and tools/record_metal_outputs.py, so a Mac records exactly these inputs.
Sizes stay small: every distinct template instance is one g++ build under the emulator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# Absolute tolerance on outputs of O(1) (values are unit normals); inputs are rounded to the dtype first.
TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}
TILED = ("tiled",)


@dataclass(frozen=True)
class Case:
    """One launch: requests as (q_len, kv_len) pairs, packed in order, plus the options."""

    name: str
    reqs: tuple[tuple[int, int], ...]
    dtype: str = "float32"
    head_dim: int = 64
    block_size: int = 16
    num_q_heads: int = 8
    num_kv_heads: int = 2
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    partition_size: int | None = None
    shuffled: bool = True
    seed: int = 0
    extra_blocks: int = field(default=3)
    kernels: tuple[str, ...] = ("tiled", "decode")  # the Metal kernels this case runs on


CASES: tuple[Case, ...] = (
    Case("decode", ((1, 17), (1, 5), (1, 48), (1, 33)), num_q_heads=8, num_kv_heads=2, shuffled=False),
    Case("prefill", ((9, 9), (16, 16)), dtype="float16", head_dim=128, num_q_heads=2, num_kv_heads=2),
    Case("mixed", ((1, 20), (1, 9), (7, 7), (5, 30)), dtype="bfloat16", block_size=8, num_q_heads=6, num_kv_heads=2),
    Case("chunked_prefix", ((6, 45), (3, 70)), head_dim=80, block_size=32, num_q_heads=8, num_kv_heads=1),
    Case("window", ((1, 40), (6, 26)), dtype="float16", head_dim=96, sliding_window=5),
    Case("softcap", ((1, 23), (4, 19)), softcap=2.0),
    Case("sinks", ((1, 12), (5, 21)), dtype="bfloat16", sinks=True),
    Case("split_boundaries", ((1, 31), (1, 32), (1, 33), (1, 64), (1, 65), (2, 3)), partition_size=32),
    Case(
        "split_all_options",
        ((1, 70), (3, 50)),
        dtype="float16",
        partition_size=32,
        sliding_window=40,
        softcap=4.0,
        sinks=True,
    ),
    Case("head_dim_256", ((1, 18), (4, 12)), head_dim=256, block_size=8, num_q_heads=4, num_kv_heads=2),
    # For the tiled kernel: query tiles that end inside a request and requests that start inside the
    # packed tile grid, partial key tiles, GQA 1, 4 and 8 packed into the tile, options across tiles;
    # the default model's heads (9 / 3) in a step like the runner's.
    Case("tiles_gqa4", ((40, 40), (33, 70), (1, 9), (31, 31)), num_q_heads=8, num_kv_heads=2, kernels=TILED),
    Case(
        "tiles_gqa1", ((70, 100), (5, 5)), dtype="float16", head_dim=128, num_q_heads=2, num_kv_heads=2, kernels=TILED
    ),
    Case("tiles_gqa8", ((20, 37), (17, 17)), dtype="bfloat16", num_q_heads=8, num_kv_heads=1, kernels=TILED),
    Case(
        "tiles_all_options",
        ((45, 60), (3, 3)),
        dtype="float16",
        head_dim=80,
        block_size=8,
        num_q_heads=6,
        num_kv_heads=2,
        sliding_window=20,
        softcap=3.0,
        sinks=True,
        kernels=TILED,
    ),
    Case("model_heads_step", ((12, 30), (12, 20), (1, 40), (11, 11)), num_q_heads=9, num_kv_heads=3),
    # Fewer than 8 table entries: MLX passes the table in constant memory (another kernel instance).
    Case("model_heads_small_table", ((12, 30), (1, 9)), num_q_heads=9, num_kv_heads=3, extra_blocks=1),
)


@dataclass(frozen=True)
class Inputs:
    """The contract's arguments for one case (MLX arrays in the case's dtype)."""

    q: mx.array
    k_pool: mx.array
    v_pool: mx.array
    block_tables: mx.array
    cu_seqlens_q: mx.array
    seq_lens: mx.array
    sinks: mx.array | None
    scale: float


def make_inputs(case: Case) -> Inputs:
    rng = np.random.default_rng(case.seed)
    bs, d = case.block_size, case.head_dim
    blocks_per_req = [-(-kv // bs) for _, kv in case.reqs]
    width = max(blocks_per_req)
    num_blocks = sum(blocks_per_req) + case.extra_blocks
    ids = rng.permutation(num_blocks) if case.shuffled else np.arange(num_blocks)
    # Padding: a valid id that a correct kernel never reads.
    table = np.full((len(case.reqs), width), num_blocks - 1, np.int32)
    start = 0
    for i, n in enumerate(blocks_per_req):
        table[i, :n] = ids[start : start + n]
        start += n
    total_q = sum(q for q, _ in case.reqs)
    dtype = DTYPES[case.dtype]
    pool_shape = (num_blocks * bs, case.num_kv_heads, d)
    return Inputs(
        q=mx.array(rng.standard_normal((total_q, case.num_q_heads, d)).astype(np.float32)).astype(dtype),
        k_pool=mx.array(rng.standard_normal(pool_shape).astype(np.float32)).astype(dtype),
        v_pool=mx.array(rng.standard_normal(pool_shape).astype(np.float32)).astype(dtype),
        block_tables=mx.array(table),
        cu_seqlens_q=mx.array(np.cumsum([0] + [q for q, _ in case.reqs]).astype(np.int32)),
        seq_lens=mx.array(np.array([kv for _, kv in case.reqs], np.int32)),
        sinks=mx.array(rng.standard_normal(case.num_q_heads).astype(np.float32)) if case.sinks else None,
        scale=1.0 / float(np.sqrt(d)),
    )


def as_f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def reference_f64(case: Case, x: Inputs) -> np.ndarray:
    """Plain float64 attention, request by request, written from the contract's text."""
    q, k, v = as_f64(x.q), as_f64(x.k_pool), as_f64(x.v_pool)
    table, cu, lens = np.array(x.block_tables), np.array(x.cu_seqlens_q), np.array(x.seq_lens)
    group = case.num_q_heads // case.num_kv_heads
    out = np.zeros_like(q)
    for r in range(len(lens)):
        keys = np.arange(lens[r])
        slots = table[r][keys // case.block_size] * case.block_size + keys % case.block_size
        for row in range(cu[r], cu[r + 1]):
            pos = lens[r] - (cu[r + 1] - cu[r]) + (row - cu[r])
            visible = keys <= pos
            if case.sliding_window is not None:
                visible &= keys > pos - case.sliding_window
            for h in range(case.num_q_heads):
                kh, vh = k[slots, h // group], v[slots, h // group]
                s = kh @ q[row, h] * x.scale
                if case.softcap is not None:
                    s = case.softcap * np.tanh(s / case.softcap)
                s = np.where(visible, s, -np.inf)
                top = s.max()
                if x.sinks is not None:
                    top = max(top, float(np.array(x.sinks)[h]))
                w = np.exp(s - top)
                denom = w.sum() + (np.exp(float(np.array(x.sinks)[h]) - top) if x.sinks is not None else 0.0)
                out[row, h] = (w @ vh) / denom
    return out
