"""The launch of the tiled kernel (paged_attention_tiled.metal) and its tile sizes.

A query tile is `tile_q` tokens of one request times the `G` query heads of one KV head, `M` rows in
all (a multiple of 8: one simdgroup per 8 rows). Every K/V byte a tile needs is read once per tile, so a
prefill reads the cached K/V `tile_q` times less often than the one-token-per-threadgroup kernel. The
sizes depend on shapes only (G, head dim), never on the data, so choosing them needs no sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from metalserve.kernels.metal.launch import KernelLaunch, metal_source

if TYPE_CHECKING:
    from metalserve.kernels.metal.args import PagedArgs

THREADGROUP_MEMORY = 32 * 1024
KEY_TILES = (32, 16, 8)  # the largest that fits the threadgroup memory is used
TARGET_TOKENS = 32  # tokens per tile when the rows allow it
ALIGN = 16  # the emulator (and Metal) align each threadgroup array to 16 bytes
# Apple GPUs run 512 threads per threadgroup only while each thread stays within about 104 32-bit
# registers (Asahi's occupancy tables): the registers one threadgroup may hold.
REGISTER_BUDGET = 512 * 104
# The estimate below leaves the compiler's own temporaries out: plan within this share of the budget.
BUDGET_SHARE = 0.85
SCALAR_REGISTERS = 32  # indices, softmax state, the float4s that stage K/V (counted off the .metal)
MAX_THREADS = 512


@dataclass(frozen=True)
class Tiling:
    tile_q: int  # query tokens per tile
    rows: int  # M: tile_q * G rounded up to 8
    key_tile: int  # BK: keys staged per step

    @property
    def threads(self) -> int:
        return self.rows * 4


def registers_per_thread(head_dim: int, key_tile: int) -> int:
    """An estimate: the query and output fragments (D/8 8x8 matrices each, two floats per lane: D/2 in
    all), the row's scores (BK/4) and the scalars."""
    return head_dim // 2 + key_tile // 4 + SCALAR_REGISTERS


def max_threads(head_dim: int) -> int:
    """The largest power-of-two threadgroup whose registers stay within the planned share of the budget,
    counted at the largest key tile: 512 below head dim 128, 256 at 128 and at 256."""
    registers = registers_per_thread(head_dim, KEY_TILES[0])
    threads = MAX_THREADS
    while threads > 32 and threads * registers > REGISTER_BUDGET * BUDGET_SHARE:
        threads //= 2
    return threads


def max_rows(head_dim: int) -> int:
    """Query rows per tile: four threads per row (one simdgroup of 32 per 8 rows)."""
    return max_threads(head_dim) // 4


def threadgroup_bytes(head_dim: int, rows: int, key_tile: int) -> int:
    """sk + sv (BK x D floats each), ss (M x BK floats), sc (M floats), each 16-byte aligned."""
    arrays = (key_tile * head_dim * 4, key_tile * head_dim * 4, rows * key_tile * 4, rows * 4)
    return sum(-(-a // ALIGN) * ALIGN for a in arrays)


def tiling(group: int, head_dim: int, row_limit: int | None = None) -> Tiling | None:
    """Tile sizes for G query heads per KV head, or None where no tile fits (G beyond the row limit).
    `row_limit`: fewer rows than the head dim allows (the fallback's smaller tile)."""
    limit = max_rows(head_dim) if row_limit is None else row_limit
    tile_q = max(1, min(limit // group, max(TARGET_TOKENS, 64 // group)))
    rows = -(-tile_q * group // 8) * 8
    if rows > limit:
        return None
    for key_tile in KEY_TILES:
        if threadgroup_bytes(head_dim, rows, key_tile) <= THREADGROUP_MEMORY:
            return Tiling(tile_q, rows, key_tile)
    return None


def tile_ladder(group: int, head_dim: int) -> list[Tiling]:
    """The tiling to launch, then ever smaller ones for a device that refuses the larger: each rung at
    most half the rows of the one before (a multiple of 8), down to the smallest tile that still holds
    one token's G rows. After the last rung the caller tries the decode kernel (paged.py)."""
    first = tiling(group, head_dim)
    if first is None:
        return []
    ladder = [first]
    one_token = -(-group // 8) * 8  # the rows of a one-token tile
    while ladder[-1].rows > one_token:
        smaller = tiling(group, head_dim, max(one_token, ladder[-1].rows // 16 * 8))
        if smaller is None or smaller.rows >= ladder[-1].rows:
            break
        ladder.append(smaller)
    return ladder


def num_tiles(total_q: int, num_reqs: int, tile_q: int) -> int:
    """Grid size: an upper bound on the tiles of all requests, from shapes only (as vLLM's)."""
    return total_q // tile_q + num_reqs


def tiled_launch(a: PagedArgs, t: Tiling) -> KernelLaunch:
    """One threadgroup per (query tile, KV head)."""
    total_q, hq, d = a.q.shape
    hkv = a.k_pool.shape[1]
    dtype = a.compute_dtype
    k_scales, v_scales, k_biases, v_biases = a.scale_arrays()
    num_reqs = int(a.seq_lens.shape[0])
    sinks = a.sinks.astype(mx.float32) if a.sinks is not None else mx.zeros((1,), mx.float32)
    tiles = num_tiles(total_q, num_reqs, t.tile_q)
    return KernelLaunch(
        name="paged_attention_tiled",
        source=metal_source("paged_attention_tiled"),
        header=metal_source("vector_load"),
        input_names=(
            "q",
            "k_pool",
            "v_pool",
            "block_tables",
            "cu_seqlens_q",
            "seq_lens",
            "sinks",
            "k_scales",
            "v_scales",
            "k_biases",
            "v_biases",
            "num_reqs",
            "max_blocks",
            "block_size",
            "group",
            "tile_q",
            "window",
            "scale",
            "softcap",
            "use_sinks",
        ),
        output_names=("out",),
        inputs=(
            a.q.astype(dtype),
            a.k_pool,
            a.v_pool,
            a.block_tables.astype(mx.int32),
            a.cu_seqlens_q.astype(mx.int32),
            a.seq_lens.astype(mx.int32),
            sinks,
            k_scales,
            v_scales,
            k_biases,
            v_biases,
            num_reqs,
            int(a.block_tables.shape[1]),
            a.block_size,
            hq // hkv,
            t.tile_q,
            int(a.sliding_window or 0),
            float(a.scale),
            float(a.softcap or 0.0),
            a.sinks is not None,
        ),
        output_shapes=((total_q, hq, d),),
        output_dtypes=(dtype,),
        template=(
            ("T", dtype),
            ("D", d),
            ("BK", t.key_tile),
            ("M", t.rows),
            ("INT8", a.storage == "int8"),
            ("Q4", a.storage == "q4"),
            ("GS", max(a.group_size, 1)),
        ),
        grid=(tiles * t.threads, hkv, 1),
        threadgroup=(t.threads, 1, 1),
    )
