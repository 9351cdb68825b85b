"""The KV cache spec family (after vLLM's kv_cache_interface): what a layer group keeps and what it costs.

Every layer group of a model has one frozen spec: full attention, a sliding window, an MLA latent, or a
recurrent state. An attention spec knows its shape (KV heads, head dim) and its page dtype: the model's
float dtype (`auto`) or a quantized storage (`int8`, `q4`) with its scales. `KVCacheSpec` is the whole
model: its groups, the pool tensors the groups share and the block size; its `bytes_per_block` is the
one place where the cost of a block id is computed (the memory plan, the runner, pipeline stages, the
draft model and `generate` all read it). No MLX here: dtypes are names plus an item size, so the KV
manager and the scheduler stay testable anywhere, and a disk tier can key pages by `PageDtype.key`.

All groups share one block pool and one block size; each keeps its own block table per request.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import ClassVar, Self

from metalserve.kvcache.hashing import BlockHash

# The block sizes (tokens per block) every attention backend supports: the Metal kernels are compiled
# for these, and --block-size offers them.
BLOCK_SIZES = (8, 16, 32)


class KVCacheDtype(StrEnum):
    """How K/V pages are stored (--kv-cache-dtype): the model's float dtype, or quantized codes."""

    AUTO = "auto"
    INT8 = "int8"
    Q4 = "q4"
    K8V4 = "k8v4"  # keys int8, values q4 (llama.cpp's -ctk q8_0 -ctv q4_0): keys are where the outliers live


# Scales (and q4's biases) are kept in float16 whatever the model's dtype: an int8 page of head dim 64
# then costs 66 bytes per head and token against fp16's 128 (1.94x the tokens), a q4 one 40 (3.2x).
SCALE_DTYPE = "float16"
SCALE_ITEMSIZE = 2
# q4 groups of 32 channels: on the default model, perplexity +7% against +14% with groups of 64
# (bench/kv_quant.py), for 40 bytes per vector of 64 instead of 36.
Q4_GROUP_SIZES = (32,)


@dataclass(frozen=True)
class PageDtype:
    """How one K or V vector of a token and KV head is stored.

    `dtype`/`itemsize`: the model's float dtype (what `auto` stores and what attention computes in);
    `storage`: `auto`, `int8` (symmetric, one scale per token and head) or `q4` (4-bit affine groups of
    `group_size` channels along the head dim, a scale and a bias per group, as `mx.quantize`)."""

    dtype: str = "float32"
    itemsize: int = 4
    storage: KVCacheDtype = KVCacheDtype.AUTO
    group_size: int = 32

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "storage", KVCacheDtype(self.storage))  # a plain string names one too
        except ValueError:
            names = tuple(s.value for s in KVCacheDtype)
            raise ValueError(f"KV cache dtype must be one of {names}, got {self.storage!r}") from None
        if self.itemsize < 1:
            raise ValueError(f"itemsize must be at least 1, got {self.itemsize}")

    @property
    def quantized(self) -> bool:
        return self.storage != "auto"

    def plane(self, index: int) -> PageDtype:
        """How plane `index` (0: K, 1: V) is stored: k8v4 is int8 keys and q4 values; others are uniform."""
        if self.storage != "k8v4":
            return self
        return replace(self, storage=KVCacheDtype.INT8 if index == 0 else KVCacheDtype.Q4)

    @property
    def key(self) -> str:
        """A name that tells pages of different storage apart (e.g. `q4g64-h`, `int8-h`, `float16`). `-h`:
        quantized pages hold K and V in the Hadamard-rotated basis (executor/attention/rotation.py), so
        pages written before the rotation (keyed without it) are never read as rotated ones."""
        if self.storage in ("q4", "k8v4"):
            return f"{self.storage}g{self.group_size}-h"
        return f"{self.storage}-h" if self.quantized else self.dtype

    def group_for(self, head_dim: int) -> int:
        """The q4 group size for vectors of `head_dim` channels."""
        for size in (self.group_size, *Q4_GROUP_SIZES):
            if head_dim % size == 0:
                return size
        raise ValueError(f"q4 KV pages need a head dim that is a multiple of 32, got {head_dim}")

    def data_bytes(self, head_dim: int) -> int:
        if self.storage == "int8":
            return head_dim
        if self.storage == "q4":
            return head_dim // 2
        return head_dim * self.itemsize

    def num_scales(self, head_dim: int) -> int:
        """Float16 numbers kept beside one vector: int8 one scale, q4 a scale and a bias per group."""
        if self.storage == "int8":
            return 1
        if self.storage == "q4":
            return 2 * (head_dim // self.group_for(head_dim))
        return 0

    def vector_bytes(self, head_dim: int) -> int:
        """Bytes of one vector of `head_dim` channels: data plus scales (k8v4: a key and a value, halved)."""
        if self.storage == "k8v4":
            return (self.plane(0).vector_bytes(head_dim) + self.plane(1).vector_bytes(head_dim)) // 2
        return self.data_bytes(head_dim) + self.num_scales(head_dim) * SCALE_ITEMSIZE

    def describe(self) -> str:
        if self.storage == "int8":
            return f"int8 (a {SCALE_DTYPE} scale per token and head; {self.dtype} in attention)"
        if self.storage == "q4":
            return f"q4 (groups of {self.group_size}, {SCALE_DTYPE} scale and bias; {self.dtype} in attention)"
        if self.storage == "k8v4":
            return f"k8v4 (keys int8, values q4 in groups of {self.group_size}; {self.dtype} in attention)"
        return f"auto ({self.dtype})"


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """A group of attention layers that keeps K and V pages of `num_kv_heads` x `head_dim` per token."""

    layers: tuple[int, ...] = ()
    num_kv_heads: int = 1
    head_dim: int = 1
    page: PageDtype = PageDtype()

    kind: ClassVar[str] = "full"
    planes: ClassVar[int] = 2  # K and V
    quantizable: ClassVar[bool] = True

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_kv_heads, self.head_dim

    @property
    def sliding_window(self) -> int | None:
        return None

    def page_bytes(self, block_size: int) -> int:
        """One layer's page of `block_size` tokens: every plane, head and token, data and scales."""
        per_token = sum(self.page.plane(i).vector_bytes(self.head_dim) for i in range(self.planes))
        return block_size * self.num_kv_heads * per_token

    def with_storage(self, storage: KVCacheDtype) -> Self:
        """This spec with pages stored as `storage` (unchanged where the kind cannot be quantized)."""
        if not self.quantizable or storage == self.page.storage:
            return self
        page = replace(self.page, storage=storage)
        if storage in ("q4", "k8v4"):
            page = replace(page, group_size=page.group_for(self.head_dim))
        return replace(self, page=page)


@dataclass(frozen=True, kw_only=True)
class FullAttention(AttentionSpec):
    """K/V for every token: a request holds one block per `block_size` tokens."""


@dataclass(frozen=True)
class SlidingWindow(AttentionSpec):
    """K/V for the last `window` tokens (the token itself included); older blocks go back to the pool."""

    window: int
    kind: ClassVar[str] = "window"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"a sliding window must be at least 1 token, got {self.window}")

    @property
    def sliding_window(self) -> int | None:
        return self.window


@dataclass(frozen=True, kw_only=True)
class MLALatent(FullAttention):
    """MLA's compressed latent: one "KV head" of `head_dim` channels holding K, whose first `value_dim`
    channels are V. Its pages keep the model's dtype: the latent is already a low-rank compression."""

    value_dim: int = 0
    kind: ClassVar[str] = "mla"
    planes: ClassVar[int] = 1
    quantizable: ClassVar[bool] = False


@dataclass(frozen=True, kw_only=True)
class RecurrentState:
    """A fixed-size state per request (conv / SSM / gated delta).

    The state after `t` computed tokens lives in table entry `(t - 1) // block_size`. With
    `snapshots`, a state that lands exactly on a block boundary is published to the prefix cache,
    so a hit resumes from it (vLLM's "align" mode); without, prefix caching is off for the model.
    `state_bytes`: the state slot each block id owns over the group's layers (executor/state_cache.py).
    """

    layers: tuple[int, ...] = ()
    snapshots: bool = True
    state_bytes: int = 0

    kind: ClassVar[str] = "state"
    quantizable: ClassVar[bool] = False

    def page_bytes(self, block_size: int) -> int:
        return self.state_bytes


LayerGroupSpec = FullAttention | SlidingWindow | MLALatent | RecurrentState


@dataclass(frozen=True)
class KVCacheSpec:
    """The model's whole KV cache: its layer groups, the pool tensors they share, and the pool's size.

    vLLM's layout: layer j of every attention group reads and writes pool tensor j, indexed by the
    group's own block ids, so a block id costs one page in every tensor (not one per layer), plus the
    state slot of every recurrent group."""

    groups: tuple[LayerGroupSpec, ...]
    tensors: tuple[AttentionSpec, ...]  # pool tensor j: its shape and page dtype
    block_size: int
    num_blocks: int = 0

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_block(self) -> int:
        """What one block id costs, over every pool tensor and state slot: the only place it is computed."""
        pages = sum(t.page_bytes(self.block_size) for t in self.tensors)
        return pages + sum(g.page_bytes(self.block_size) for g in self.groups if isinstance(g, RecurrentState))

    @property
    def page(self) -> PageDtype:
        """The page dtype of the attention pages (of the first tensor: all tensors share the storage)."""
        return self.tensors[0].page if self.tensors else PageDtype()

    def with_blocks(self, num_blocks: int) -> KVCacheSpec:
        return replace(self, num_blocks=num_blocks)

    def kept_dtype_note(self, storage: KVCacheDtype) -> str | None:
        """A start-up line naming the groups whose pages keep the model's dtype under `storage`."""
        kept = sorted({g.kind for g in self.groups if not g.quantizable})
        if storage == "auto" or not kept:
            return None
        return f"--kv-cache-dtype {storage}: {' and '.join(kept)} pages keep the model's dtype (not quantizable)"

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
        itemsize: int,
        block_size: int,
        num_blocks: int = 0,
        storage: KVCacheDtype = KVCacheDtype.AUTO,
    ) -> KVCacheSpec:
        """One full-attention group of `num_layers` alike layers (a plain model, or a pipeline stage's)."""
        page = PageDtype(dtype, itemsize)
        layer = FullAttention(num_kv_heads=num_kv_heads, head_dim=head_dim, page=page).with_storage(storage)
        group = replace(layer, layers=tuple(range(num_layers)))
        return cls((group,), (layer,) * num_layers, block_size, num_blocks)


def prefix_caching_problem(specs: list[LayerGroupSpec] | tuple[LayerGroupSpec, ...]) -> str | None:
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
