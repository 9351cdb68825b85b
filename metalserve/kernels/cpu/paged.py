"""The CPU attention path: the portable pool, written in place from the host, attended by a numba kernel.

Each layer evaluates its q, k and v, writes k and v into the pool through a NumPy view of the pool's
own MLX buffer (MLX documents that such a view shares memory) and attends every query row, decode or
prefill, with `attention.attend_rows`. MLX itself never reads the pool on this path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

import mlx.core as mx
import numpy as np

from metalserve.kernels.cpu import attention as cpu_attention
from metalserve.kernels.cpu import kv_quant
from metalserve.kernels.cpu.numba_lock import launch_lock
from metalserve.kernels.cpu.quantized_attention import attend_quantized_rows

if TYPE_CHECKING:
    from metalserve.kernels.cpu.decoder_weights import QuantPages


class KernelOptions(Protocol):
    """What these kernels read of a layer's options (the executor's `AttentionOptions` has them): declared
    here so that the kernels import nothing from the executor above them."""

    @property
    def scale(self) -> float: ...
    @property
    def sliding_window(self) -> int | None: ...
    @property
    def softcap(self) -> float | None: ...
    @property
    def sinks(self) -> mx.array | None: ...
    @property
    def value_dim(self) -> int | None: ...


class CpuStepPlan(NamedTuple):
    """The host arrays of one step: where each token's K/V goes, and each query row's request and position.
    A NamedTuple, so the one-call host decoder (decoder.py) takes it as it is."""

    slot_mapping: np.ndarray  # [T]
    block_tables: np.ndarray  # [R, width] int32
    row_req: np.ndarray  # [T] int32
    row_pos: np.ndarray  # [T] int32
    block_size: int


def build_cpu_plan(
    block_tables: np.ndarray,
    cu_seqlens_q: np.ndarray,
    seq_lens: np.ndarray,
    slot_mapping: np.ndarray,
    block_size: int,
) -> CpuStepPlan:
    """`block_tables`: `[R, width]`, each request's block ids padded (StepInputs.padded_block_tables)."""
    row_req, row_pos = cpu_attention.query_rows(cu_seqlens_q, seq_lens)
    return CpuStepPlan(np.asarray(slot_mapping), np.asarray(block_tables, np.int32), row_req, row_pos, block_size)


def host_view(pool: mx.array) -> np.ndarray:
    """A writable NumPy array over the pool's own buffer (no copy)."""
    mx.eval(pool)
    view = np.asarray(pool)
    if not view.flags.writeable or view.dtype != np.float32:
        writeable = view.flags.writeable
        raise RuntimeError(f"the CPU path needs a writable float32 pool, got {view.dtype} (writeable={writeable})")
    return view


def host_views(arrays: list[mx.array]) -> list[np.ndarray]:
    """Writable NumPy arrays over quantized pages' own buffers (codes, float16 scales, biases; no copy)."""
    mx.eval(arrays)
    views = [np.asarray(a) for a in arrays]
    if not all(v.flags.writeable for v in views):
        raise RuntimeError("the CPU path needs writable quantized pages")
    return views


def write_quantized(
    views: list[np.ndarray],
    k: np.ndarray,
    v: np.ndarray,
    slot_mapping: np.ndarray,
    v_views: list[np.ndarray] | None = None,
) -> None:
    """Quantize new K/V `[T, Hkv, D]` (kv_quant.py's formats) into the pages' host views at `slot_mapping`;
    `v_views`: V's own single-plane arrays where K and V are stored apart (k8v4), `views` then K's."""
    planes = ((views, 0, k), (views, 1, v)) if v_views is None else ((views, 0, k), (v_views, 0, v))
    for plane_views, plane, x in planes:
        storage = "int8" if plane_views[0].dtype == np.int8 else "q4"
        group = 2 * plane_views[0].shape[-1] // plane_views[1].shape[-1]
        codes, scales, biases = kv_quant.quantize(x, storage, group)
        plane_views[0][plane][:, slot_mapping] = codes.transpose(1, 0, 2)
        plane_views[1][plane][:, slot_mapping] = scales.reshape(*scales.shape[:2], -1).transpose(1, 0, 2)
        if biases is not None:
            plane_views[2][plane][:, slot_mapping] = biases.transpose(1, 0, 2)


def cpu_split_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    planes: tuple[list[np.ndarray], list[np.ndarray]],
    pages: QuantPages,
    step: CpuStepPlan,
    opts: KernelOptions,
) -> mx.array:
    """`cpu_quantized_attention` over K and V pages of formats of their own (k8v4): the host decoder's
    attention (page_codes.attend_pages), called for one layer."""
    from metalserve.kernels.cpu.page_codes import attend_pages  # compiles on first use, as the decoder does

    if opts.sinks is not None:
        raise ValueError("attention sinks over K and V pages of different formats (k8v4) are not supported")
    mx.eval(q, k, v)
    write_quantized(planes[0], np.asarray(k), np.asarray(v), step.slot_mapping, planes[1])
    qs = np.ascontiguousarray(np.asarray(q), np.float32)
    out = np.empty(qs.shape, np.float32)
    window, softcap = opts.sliding_window or 0, np.float32(opts.softcap or 0.0)
    with launch_lock:
        attend_pages(
            qs, pages, step.block_tables, step.row_req, step.row_pos, step.block_size, np.float32(opts.scale),
            window, softcap, out,
        )  # fmt: skip
    return mx.array(out)


def cpu_quantized_attention(
    q: mx.array, k: mx.array, v: mx.array, views: list[np.ndarray], step: CpuStepPlan, opts: KernelOptions
) -> mx.array:
    """`cpu_paged_attention` over int8 or q4 pages: quantize this step's K/V as they are written; the
    kernel dequantizes each request's pages once and attends its rows over them."""
    mx.eval(q, k, v)
    write_quantized(views, np.asarray(k), np.asarray(v), step.slot_mapping)
    sinks = None if opts.sinks is None else np.asarray(opts.sinks.astype(mx.float32))
    out = attend_quantized_rows(
        np.asarray(q),
        views[0],
        views[1],
        views[2] if len(views) > 2 else None,
        step.block_tables,
        step.row_req,
        step.row_pos,
        block_size=step.block_size,
        scale=opts.scale,
        sliding_window=opts.sliding_window,
        softcap=opts.softcap,
        sinks=sinks,
    )
    return mx.array(out)


def cpu_paged_attention(
    q: mx.array, k: mx.array, v: mx.array | None, view: np.ndarray, step: CpuStepPlan, opts: KernelOptions
) -> mx.array:
    """Write this step's K/V and attend every query row: `[T, Hq, D]` like the portable path (`v` None:
    MLA's latent pool, `[T, Hq, opts.value_dim]`)."""
    mx.eval(q, k, *([] if v is None else [v]))
    cpu_attention.write_kv(view, np.asarray(k), None if v is None else np.asarray(v), step.slot_mapping)
    sinks = None if opts.sinks is None else np.asarray(opts.sinks.astype(mx.float32))
    out = cpu_attention.attend_rows(
        np.asarray(q),
        view,
        step.block_tables,
        step.row_req,
        step.row_pos,
        block_size=step.block_size,
        scale=opts.scale,
        sliding_window=opts.sliding_window,
        softcap=opts.softcap,
        sinks=sinks,
        value_dim=opts.value_dim,
    )
    return mx.array(out)
