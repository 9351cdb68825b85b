"""The numba kernel over int8 / q4 pages (kernels/cpu/quantized_attention.py): every contract case, and
steps split into several scratch batches, against the float64 reference attending the dequantized pools."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from metalserve.executor.attention import mlx_ops
from metalserve.kernels.cpu import kv_quant
from metalserve.kernels.cpu.attention import query_rows
from metalserve.kernels.cpu.quantized_attention import _half, attend_quantized_rows, row_tiles
from tests.kernels.cases import CASES, Case, make_inputs, reference_f64

STORAGES = ("int8", "q4")
PAIRS = [(s, c) for s in STORAGES for c in CASES]
BY_NAME = {c.name: c for c in CASES}


def attend_case(case: Case, storage: str, tile_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(the kernel's output on the case's pools quantized, the float64 reference on them dequantized)."""
    x = make_inputs(case)
    pool = np.array(mlx_ops.portable_pool(x.k_pool, x.v_pool).astype(mx.float32))
    group = 32 if case.head_dim % 32 == 0 else 16  # q4's groups must divide the head dim (80)
    codes, scales, biases = kv_quant.quantize(pool, storage, group)
    scales = scales.reshape(*scales.shape[:3], -1)
    dense = kv_quant.dequantize(codes, scales, biases, storage)  # [2, Hkv, slots, D]
    row_req, row_pos = query_rows(np.array(x.cu_seqlens_q), np.array(x.seq_lens))
    tiles = {} if tile_rows is None else {"tile_rows": tile_rows}
    got = attend_quantized_rows(
        np.array(x.q.astype(mx.float32)),
        codes,
        scales,
        biases,
        np.array(x.block_tables),
        row_req,
        row_pos,
        block_size=case.block_size,
        scale=x.scale,
        sliding_window=case.sliding_window,
        softcap=case.softcap,
        sinks=None if x.sinks is None else np.array(x.sinks.astype(mx.float32)),
        **tiles,
    )
    dequantized = replace(x, k_pool=mx.array(dense[0].transpose(1, 0, 2)), v_pool=mx.array(dense[1].transpose(1, 0, 2)))
    return got, reference_f64(case, dequantized)


@pytest.mark.parametrize(("storage", "case"), PAIRS, ids=[f"{s}-{c.name}" for s, c in PAIRS])
def test_kernel_attends_quantized_pages_like_the_reference_attends_them_dequantized(storage: str, case: Case) -> None:
    got, want = attend_case(case, storage)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("tile_rows", [1, 4])
@pytest.mark.parametrize("name", ["split_all_options", "tiles_all_options", "model_heads_step"])
def test_rows_tiled_finer_attend_the_same(storage: str, tile_rows: int, name: str) -> None:
    """Multi-request steps (windows, softcap and sinks in the first two) cut into tiles of 1 or 4 rows
    (tiles ending inside a chunk, windows that slide within a tile) give the rows of the default tiling."""
    case = BY_NAME[name]
    got, want = attend_case(case, storage, tile_rows)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    default, _ = attend_case(case, storage)
    np.testing.assert_allclose(got, default, atol=1e-6, rtol=0)


def test_row_tiles_keep_each_tile_inside_one_request() -> None:
    # request 2's rows come first here, then request 0's, then request 2's again
    row_req = np.array([2, 2, 0, 0, 0, 0, 0, 2], np.int32)
    order, starts = row_tiles(row_req, 2)
    assert order.tolist() == [2, 3, 4, 5, 6, 0, 1, 7]
    assert starts.tolist() == [0, 2, 4, 5, 7, 8]
    order, starts = row_tiles(row_req[:0], 16)
    assert order.tolist() == [] and starts.tolist() == [0]


def test_the_kernel_reads_every_finite_float16_scale_exactly() -> None:
    bits = np.arange(1 << 16, dtype=np.uint16)
    want = bits.view(np.float16).astype(np.float32)
    got = np.array([_half(b) for b in bits], np.float32)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[finite], want[finite])  # subnormals, zeros of both signs included
    assert np.isinf(got[~finite]).all()
