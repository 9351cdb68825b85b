"""The traffic model (kernels/metal/traffic.py) against the emulator's exact byte counts, on small shapes."""

from __future__ import annotations

import mlx.core as mx
import pytest

from metalserve.kernels.metal.launch import KernelLaunch
from metalserve.kernels.metal.paged import PagedArgs, run_paged_attention
from metalserve.kernels.metal.traffic import Heads, kv_bytes, scale_loads
from tests.kernels.cases import CASES, Case, make_inputs
from tests.kernels.test_int8_pages import STORAGES
from tools.msl_emulator import LaunchCounts, emulate_counted

# Cases of the kernel tests (their builds are shared): options, prefixes, split-KV, tile edges.
TRAFFIC_CASES = tuple(
    (c, k)
    for c in CASES
    for k in c.kernels
    if c.name in ("chunked_prefix", "window", "split_boundaries", "tiles_gqa4", "tiles_all_options")
)


def counted(case: Case, kernel: str) -> list[LaunchCounts]:
    x = make_inputs(case)
    return counted_args(
        PagedArgs(
            x.q,
            x.k_pool,
            x.v_pool,
            x.block_tables,
            x.cu_seqlens_q,
            x.seq_lens,
            case.block_size,
            x.scale,
            case.sliding_window,
            case.softcap,
            x.sinks,
        ),
        case,
        kernel,
    )


def counted_args(args: PagedArgs, case: Case, kernel: str) -> list[LaunchCounts]:
    """The emulator's exact byte counts of each launch that `args` makes."""
    seen: list[LaunchCounts] = []

    def execute(launch: KernelLaunch) -> list[mx.array]:
        outputs, counts = emulate_counted(launch)
        seen.append(counts)
        return outputs

    run_paged_attention(args, execute, None if kernel == "tiled" else case.partition_size, kernel)
    return seen


@pytest.mark.parametrize(("case", "kernel"), TRAFFIC_CASES, ids=[f"{c.name}-{k}" for c, k in TRAFFIC_CASES])
def test_model_equals_emulated_kv_bytes(case: Case, kernel: str) -> None:
    heads = Heads(case.num_q_heads, case.num_kv_heads, case.head_dim, 4 if case.dtype == "float32" else 2)
    counts = counted(case, kernel)
    emulated = sum(c.bytes_read.get("k_pool", 0) + c.bytes_read.get("v_pool", 0) for c in counts)
    assert emulated == kv_bytes(case.reqs, heads, kernel, case.sliding_window)
    assert counts[0].bytes_read["k_pool"] == counts[0].bytes_read["v_pool"]


def test_tiled_kernel_reads_each_key_once_per_tile_and_uses_mma() -> None:
    """One request of 64 tokens in one tile (G=1, 64 tokens per tile): K/V read once, tile_q x fewer
    times than the one-token kernel, with barriers and matrix multiply-accumulates counted."""
    case = Case("one_tile", ((64, 100),), dtype="float16", head_dim=128, num_q_heads=2, num_kv_heads=2)
    heads = Heads(2, 2, 128, 2)
    (tiled,) = counted(case, "tiled")
    assert tiled.bytes_read["k_pool"] + tiled.bytes_read["v_pool"] == 100 * heads.per_key()
    (decode,) = counted(case, "decode")
    assert decode.bytes_read["k_pool"] == sum(range(37, 101)) * heads.per_key() // 2
    key_tiles = -(-100 // 16)  # BK = 16 for D = 128 with 64 rows
    assert tiled.barriers == 2 * key_tiles * 2  # two per key tile, per KV head
    # Simdgroup s holds tokens 8s..8s+7 (positions 36+8s..43+8s): it multiplies only the 8-key fragments
    # below 44 + 8s, each (D/8) times for QK^T and as many for PV; 2 KV heads.
    fragments = sum(-(-(44 + 8 * s) // 8) for s in range(8))
    assert tiled.simd_mma == fragments * 2 * (128 // 8) * 2
    assert decode.simd_mma == 0 and decode.simd_ops > 0


QUANT_TRAFFIC = tuple(
    (storage, c, k) for storage in ("int8", "q4") for c, k in TRAFFIC_CASES if c.name in ("window", "tiles_gqa4")
)


@pytest.mark.parametrize(
    ("storage", "case", "kernel"), QUANT_TRAFFIC, ids=[f"{s}-{c.name}-{k}" for s, c, k in QUANT_TRAFFIC]
)
def test_quantized_pages_cut_the_kv_bytes_read_by_the_storage_ratio(storage: str, case: Case, kernel: str) -> None:
    """The same launch on int8 / q4 pools reads the storage ratio fewer pool bytes (int8: 4x float32's,
    2x float16's; q4 on the tiled kernel twice that again), as the model says, plus the scales' loads
    the model counts."""
    itemsize = 4 if case.dtype == "float32" else 2
    args, _ = STORAGES[storage](case, make_inputs(case))
    counts = counted_args(args, case, kernel)
    pools = sum(c.bytes_read.get("k_pool", 0) + c.bytes_read.get("v_pool", 0) for c in counts)
    float_heads = Heads(case.num_q_heads, case.num_kv_heads, case.head_dim, itemsize)
    float_pools = kv_bytes(case.reqs, float_heads, kernel, case.sliding_window)
    heads = Heads(case.num_q_heads, case.num_kv_heads, case.head_dim, itemsize, storage)
    assert pools == kv_bytes(case.reqs, heads, kernel, case.sliding_window)
    ratio = itemsize * (2 if storage == "q4" and kernel == "tiled" else 1)
    assert pools * ratio == float_pools
    scales = sum(c.bytes_read.get(name, 0) for c in counts for name in ("k_scales", "v_scales", "k_biases", "v_biases"))
    assert scales == scale_loads(case.reqs, heads, kernel, case.sliding_window) > 0
