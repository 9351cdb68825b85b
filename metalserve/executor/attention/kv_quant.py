"""Quantized KV pages in MLX ops: quantize K/V as they are written, dequantize what attention reads.

Formats (kvcache/specs.PageDtype), along the head dim of one token and KV head:
- int8: symmetric, `x ~ q * scale` with q in [-127, 127] and one float16 scale per vector;
- q4: affine groups of `group_size` channels, `x ~ q * scale + bias` with q in [0, 15] and a float16
  scale and bias per group (mx.quantize's format); two channels per byte, the even one in the low nibble.
The scale is rounded to float16 before the codes are computed, so codes and stored scale agree.
kernels/cpu/kv_quant.py holds the same formats in NumPy (the reference the tests compare against).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from metalserve.kvcache.specs import PageDtype


def quantize(x: mx.array, page: PageDtype) -> tuple[mx.array, mx.array, mx.array | None]:
    """`x` `[..., D]` -> (codes, scales, biases): int8 `[..., D]` + float16 `[..., 1]`, or uint8 `[..., D/2]`
    + float16 `[..., D/group]` twice."""
    x = x.astype(mx.float32)
    if page.storage == "int8":
        scale = (mx.max(mx.abs(x), axis=-1, keepdims=True) / 127.0).astype(mx.float16)
        s = scale.astype(mx.float32)
        q = mx.clip(mx.round(x / mx.where(s > 0, s, 1.0)), -127, 127).astype(mx.int8)
        return q, scale, None
    if page.storage != "q4":
        raise ValueError(f"no quantized storage {page.storage!r}")
    d = x.shape[-1]
    g = page.group_for(d)
    xg = x.reshape(*x.shape[:-1], d // g, g)
    low, high = mx.min(xg, axis=-1, keepdims=True), mx.max(xg, axis=-1, keepdims=True)
    scale = ((high - low) / 15.0).astype(mx.float16)
    bias = low.astype(mx.float16)
    s = scale.astype(mx.float32)
    q = mx.clip(mx.round((xg - bias.astype(mx.float32)) / mx.where(s > 0, s, 1.0)), 0, 15).astype(mx.uint8)
    q = q.reshape(*x.shape[:-1], d // 2, 2)
    packed = q[..., 0] | (q[..., 1] << 4)
    return packed, scale[..., 0], bias[..., 0]


def dequantize(
    codes: mx.array, scales: mx.array, biases: mx.array | None, page: PageDtype, dtype: mx.Dtype
) -> mx.array:
    """The inverse of `quantize`, in `dtype`: `[..., D]`."""
    if page.storage == "int8":
        return (codes.astype(mx.float32) * scales.astype(mx.float32)).astype(dtype)
    if biases is None:
        raise ValueError("q4 pages need their biases")
    half = codes.shape[-1]
    d = 2 * half
    g = page.group_for(d)
    q = mx.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*codes.shape[:-1], d // g, g).astype(mx.float32)
    x = q * scales.astype(mx.float32)[..., None] + biases.astype(mx.float32)[..., None]
    return x.reshape(*codes.shape[:-1], d).astype(dtype)


@dataclass
class QuantPool:
    """K and V `[planes, Hkv, num_slots, D]` stored as codes plus float16 scales (and q4's biases); each
    step's scatter replaces the arrays with its outputs, which reuse the same buffers."""

    codes: mx.array
    scales: mx.array
    biases: mx.array | None
    page: PageDtype
    head_dim: int
    dtype: mx.Dtype  # what attention computes in

    @property
    def shape(self) -> tuple[int, int, int, int]:
        planes, heads, slots, _ = self.codes.shape
        return planes, heads, slots, self.head_dim

    def arrays(self) -> list[mx.array]:
        return [self.codes, self.scales] + ([self.biases] if self.biases is not None else [])

    @staticmethod
    def zeros(planes: int, heads: int, num_slots: int, head_dim: int, page: PageDtype, dtype: mx.Dtype) -> QuantPool:
        lead = (planes, heads, num_slots)
        if page.storage == "int8":
            return QuantPool(
                mx.zeros((*lead, head_dim), mx.int8), mx.zeros((*lead, 1), mx.float16), None, page, head_dim, dtype
            )
        groups = head_dim // page.group_for(head_dim)
        return QuantPool(
            mx.zeros((*lead, head_dim // 2), mx.uint8),
            mx.zeros((*lead, groups), mx.float16),
            mx.zeros((*lead, groups), mx.float16),
            page,
            head_dim,
            dtype,
        )

    def concatenate(self, more: QuantPool) -> QuantPool:
        """This pool followed by `more`'s slots (a grown pool)."""
        cat = [mx.concatenate([a, b], axis=2) for a, b in zip(self.arrays(), more.arrays(), strict=True)]
        return QuantPool(cat[0], cat[1], cat[2] if len(cat) > 2 else None, self.page, self.head_dim, self.dtype)

    def truncate(self, num_slots: int) -> QuantPool:
        """The first `num_slots` slots, copied into buffers of their own."""
        cut = [mx.contiguous(a[:, :, :num_slots]) for a in self.arrays()]
        return QuantPool(cut[0], cut[1], cut[2] if len(cut) > 2 else None, self.page, self.head_dim, self.dtype)

    def write(self, kv: mx.array, slot_mapping: mx.array) -> None:
        """Quantize `kv` `[planes, T, Hkv, D]` and scatter it to `slot_mapping` `[T]`."""
        codes, scales, biases = quantize(kv, self.page)
        self.codes[:, :, slot_mapping] = codes.transpose(0, 2, 1, 3)
        self.scales[:, :, slot_mapping] = scales.transpose(0, 2, 1, 3)
        if self.biases is not None and biases is not None:
            self.biases[:, :, slot_mapping] = biases.transpose(0, 2, 1, 3)

    def take(self, index: mx.array) -> mx.array:
        """The dequantized slots `index` (any shape) of every plane and head: `[planes, Hkv, *index.shape, D]`."""
        biases = self.biases[:, :, index] if self.biases is not None else None
        return dequantize(self.codes[:, :, index], self.scales[:, :, index], biases, self.page, self.dtype)


@dataclass
class SplitPool:
    """K and V in formats of their own (k8v4: int8 keys, q4 values), one single-plane QuantPool each;
    the same interface as QuantPool, over `[2, Hkv, num_slots, D]`."""

    k: QuantPool
    v: QuantPool

    @property
    def shape(self) -> tuple[int, int, int, int]:
        _, heads, slots, dim = self.k.shape
        return 2, heads, slots, dim

    def arrays(self) -> list[mx.array]:
        return self.k.arrays() + self.v.arrays()

    @staticmethod
    def zeros(heads: int, num_slots: int, head_dim: int, page: PageDtype, dtype: mx.Dtype) -> SplitPool:
        k, v = (QuantPool.zeros(1, heads, num_slots, head_dim, page.plane(i), dtype) for i in (0, 1))
        return SplitPool(k, v)

    def concatenate(self, more: SplitPool) -> SplitPool:
        return SplitPool(self.k.concatenate(more.k), self.v.concatenate(more.v))

    def truncate(self, num_slots: int) -> SplitPool:
        return SplitPool(self.k.truncate(num_slots), self.v.truncate(num_slots))

    def write(self, kv: mx.array, slot_mapping: mx.array) -> None:
        self.k.write(kv[:1], slot_mapping)
        self.v.write(kv[1:], slot_mapping)

    def take(self, index: mx.array) -> mx.array:
        return mx.concatenate([self.k.take(index), self.v.take(index)])


def quant_zeros(planes: int, heads: int, num_slots: int, head_dim: int, page: PageDtype, dtype: mx.Dtype) -> QuantPages:
    """A zeroed quantized pool for `page`'s storage: one QuantPool, or a SplitPool for k8v4."""
    if page.storage == "k8v4":
        if planes != 2:
            raise ValueError("k8v4 pages need separate K and V planes")
        return SplitPool.zeros(heads, num_slots, head_dim, page, dtype)
    return QuantPool.zeros(planes, heads, num_slots, head_dim, page, dtype)


QuantPages = QuantPool | SplitPool
KVPool = mx.array | QuantPool | SplitPool  # what the MLX-ops path attends: a float pool or a quantized one


def take_slots(pool: KVPool, index: mx.array) -> mx.array:
    """`pool[:, :, index]`, dequantized where the pool is quantized."""
    if isinstance(pool, QuantPool | SplitPool):
        return pool.take(index)
    return pool[:, :, index]
