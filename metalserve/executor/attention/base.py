"""The attention-backend seam: a backend allocates a layer's cache, plans a step once, and attends a layer.

The runner and the attention layer only talk to this interface; which kernel runs (the Metal kernel,
MLX ops, the numba CPU kernel) is decided once, at start-up (`select.py`).

The contract every attention backend (MLX ops, the Metal kernel, the numba CPU kernel) honours:

- `q`: `[total_q, Hq, D]`, the queries of all requests packed on one token axis, request by request.
- `k_pool`, `v_pool`: `[num_slots, Hkv, D]` with `num_slots = num_blocks * block_size`; slot
  `block_id * block_size + offset` holds one token's K (or V). Hq is a multiple of Hkv (GQA).
- `block_tables`: `[num_reqs, max_blocks]` int32, row i lists request i's blocks in order (padding: any id).
- `cu_seqlens_q`: `[num_reqs + 1]` int32, request i owns query rows `cu[i]:cu[i+1]`.
- `seq_lens`: `[num_reqs]` int32, request i's total KV length *including* this step's new tokens, so its
  queries sit at positions `seq_len - q_len ... seq_len - 1` and query at position p sees keys `0..p`.
- options: `sliding_window` (a query at p sees keys `> p - window`), `softcap` (scores become
  `softcap * tanh(scores / softcap)`), `sinks` (`[Hq]` logits of a virtual key with zero value);
  `AttentionOptions` below.

Layouts: each backend keeps its pools in its own layout (`LayerCache`). The MLX-ops and CPU backends use
the portable pool `[2, Hkv, num_slots, D]` (K and V in one array, KV heads outermost); MLA's latent layout
is `[1, Hkv, num_slots, D]`, K alone, V being K's first `value_dim` channels.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar

import mlx.core as mx

from metalserve.executor.step_inputs import StepInputs
from metalserve.kvcache.specs import AttentionSpec, FullAttention, KVCacheDtype, MLALatent, PageDtype


@dataclass(frozen=True)
class AttentionOptions:
    """A layer's attention options, fixed when the layer is built and read by every backend."""

    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: mx.array | None = None  # [Hq]
    # MLA's latent layout: V is K's first `value_dim` channels, the pool holds K alone ([1, Hkv, slots, D]).
    value_dim: int | None = None


@dataclass(frozen=True)
class LayerCacheSpec:
    """One attention layer's paged cache: `num_blocks` blocks of `block_size` tokens of the pages `attn`
    describes (kvcache/specs.py: shape, page dtype, and the group's window or MLA latent).

    A backend whose plan holds the mask (MLX ops) masks by `sliding_window`, the others read
    `AttentionOptions`. `value_dim`: None for separate K and V of `head_dim` each; an int for MLA's
    latent layout, where the cache holds K alone and V is K's first `value_dim` channels."""

    attn: AttentionSpec
    block_size: int
    num_blocks: int

    @classmethod
    def dense(
        cls,
        num_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype,
        block_size: int,
        num_blocks: int,
        storage: KVCacheDtype = KVCacheDtype.AUTO,
    ) -> LayerCacheSpec:
        """A full-attention layer's cache (tests and benchmarks)."""
        page = PageDtype(dtype_name(dtype), dtype.size)
        attn = FullAttention(num_kv_heads=num_kv_heads, head_dim=head_dim, page=page).with_storage(storage)
        return cls(attn, block_size, num_blocks)

    @property
    def num_kv_heads(self) -> int:
        return self.attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.attn.head_dim

    @property
    def page(self) -> PageDtype:
        return self.attn.page

    @property
    def dtype(self) -> mx.Dtype:
        """What attention computes in: the model's dtype (also what `auto` pages store)."""
        dtype: mx.Dtype = getattr(mx, self.attn.page.dtype)
        return dtype

    @property
    def sliding_window(self) -> int | None:
        return self.attn.sliding_window

    @property
    def value_dim(self) -> int | None:
        return self.attn.value_dim if isinstance(self.attn, MLALatent) else None

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_planes(self) -> int:
        """Arrays of `head_dim` per token and KV head: 2 (K and V) or 1 (the latent, V inside K)."""
        return self.attn.planes


def dtype_name(dtype: mx.Dtype) -> str:
    """`mx.float16` -> "float16" (the kvcache specs name dtypes without importing MLX)."""
    return str(dtype).removeprefix("mlx.core.")


class LayerCache(Protocol):
    """A layer's K/V in a backend's own layout."""

    def arrays(self) -> list[mx.array]: ...


CacheT = TypeVar("CacheT", bound=LayerCache)
MetaT = TypeVar("MetaT")


class AttentionCall(NamedTuple, Generic[CacheT, MetaT]):
    """Everything one layer's attention needs, as one object.

    `q` `[T, Hq, D]`, `k` and `v` `[T, Hkv, D]`: this step's packed tokens (RoPE applied); `slot_mapping`
    `[T]`: where each token's K/V goes; `meta`: the step's metadata from `build_metadata`. A NamedTuple:
    one is made per layer and step, so it should cost next to nothing. MLA's latent layout
    (`options.value_dim` set): `v` is None, V being K's first `value_dim` channels, and the output is
    `[T, Hq, value_dim]`."""

    q: mx.array
    k: mx.array
    v: mx.array | None
    slot_mapping: mx.array
    cache: CacheT
    meta: MetaT
    options: AttentionOptions


class AttentionBackend(ABC, Generic[CacheT, MetaT]):
    """One way of attending; see `mlx.py`, `metal.py` and `cpu.py`."""

    name: str
    description: str

    @abstractmethod
    def allocate(self, spec: LayerCacheSpec) -> CacheT:
        """A zeroed, materialised cache for one layer."""

    @abstractmethod
    def extend(self, cache: CacheT, spec: LayerCacheSpec) -> CacheT:
        """`cache` followed by `spec.num_blocks` more zeroed blocks (a grown pool), keeping its contents."""

    @abstractmethod
    def truncate(self, cache: CacheT, spec: LayerCacheSpec) -> CacheT:
        """`cache`'s first `spec.num_blocks` blocks in buffers of that size (a pool cut back at idle): the old
        buffers are not referenced afterwards, so dropping `cache` frees them."""

    @abstractmethod
    def build_metadata(self, step: StepInputs, spec: LayerCacheSpec) -> MetaT:
        """The step's metadata for one layer group (its block table in `step`), built once per step and
        shared by the group's layers."""

    @abstractmethod
    def forward(self, call: AttentionCall[CacheT, MetaT]) -> mx.array:
        """Write this step's K/V into `call.cache` and attend every query row: `[T, Hq, D]`."""

    def warm_up(self) -> None:
        """Load what the first `forward` would (compiled kernels), so that a step does not pay for it.
        Pipeline and tensor-parallel ranks call this at set-up, all at once: they run no warm-up step,
        and otherwise each rank paid on the first request in turn (stage after stage)."""
