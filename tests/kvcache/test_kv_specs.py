"""The KV cache spec family: kinds, shapes, page dtypes and what a page costs (the one place bytes are counted)."""

from __future__ import annotations

import pytest

from metalserve.kvcache.specs import (
    FullAttention,
    KVCacheSpec,
    MLALatent,
    PageDtype,
    RecurrentState,
    SlidingWindow,
)

FP16 = PageDtype("float16", 2)


def test_each_kind_knows_its_name_and_window() -> None:
    full = FullAttention(layers=(0,), num_kv_heads=3, head_dim=64, page=FP16)
    window = SlidingWindow(128, layers=(1,), num_kv_heads=3, head_dim=64, page=FP16)
    latent = MLALatent(layers=(0,), num_kv_heads=1, head_dim=576, value_dim=512, page=FP16)
    state = RecurrentState(layers=(2,), state_bytes=4096)
    assert [s.kind for s in (full, window, latent, state)] == ["full", "window", "mla", "state"]
    assert (full.sliding_window, window.sliding_window, latent.sliding_window) == (None, 128, None)
    assert full.shape == (3, 64) and latent.planes == 1 and full.planes == 2
    with pytest.raises(ValueError, match="at least 1 token"):
        SlidingWindow(0)
    with pytest.raises(ValueError, match="one of"):
        PageDtype("float16", 2, "fp8")  # type: ignore[arg-type]


def test_page_bytes_count_data_and_scales_per_storage() -> None:
    full = FullAttention(num_kv_heads=3, head_dim=64, page=FP16)
    assert full.page_bytes(16) == 2 * 16 * 3 * 64 * 2  # K and V, fp16
    int8 = full.with_storage("int8")
    assert int8.page == PageDtype("float16", 2, "int8") and int8.page.key == "int8-h"
    assert int8.page_bytes(16) == 2 * 16 * 3 * (64 + 2)  # int8 data + one fp16 scale per token and head
    q4 = full.with_storage("q4")
    assert q4.page.group_size == 32 and q4.page.key == "q4g32-h"
    assert q4.page_bytes(16) == 2 * 16 * 3 * (32 + 2 * 2 * 2)  # nibbles + a fp16 scale and bias per group
    # Groups of 64 where asked for; a head dim of no multiple of 32 cannot be q4.
    wide = FullAttention(head_dim=64, page=PageDtype("float16", 2, group_size=64)).with_storage("q4")
    assert wide.page.key == "q4g64-h" and wide.page_bytes(16) == 2 * 16 * (32 + 2 * 2)
    with pytest.raises(ValueError, match="multiple of 32"):
        FullAttention(head_dim=80, page=FP16).with_storage("q4")
    # k8v4: an int8 key and a q4 value per token and head.
    mixed = full.with_storage("k8v4")
    assert mixed.page.key == "k8v4g32-h" and mixed.page.group_size == 32
    assert [mixed.page.plane(i).storage for i in (0, 1)] == ["int8", "q4"]
    assert mixed.page_bytes(16) == 16 * 3 * ((64 + 2) + (32 + 2 * 2 * 2))
    assert mixed.page.vector_bytes(64) == 53  # the two planes' mean, what one vector costs on average


def test_tokens_per_byte_beat_fp16_by_the_issue_s_ratios() -> None:
    """int8 holds at least 1.9x and q4 at least 3.2x the tokens of fp16 pages in the same memory."""
    for head_dim in (64, 128):
        fp16 = KVCacheSpec.uniform(30, 3, head_dim, "float16", 2, 16)
        for storage, ratio in (("int8", 1.9), ("q4", 3.2)):
            quantized = KVCacheSpec.uniform(30, 3, head_dim, "float16", 2, 16, storage=storage)  # type: ignore[arg-type]
            assert fp16.bytes_per_block / quantized.bytes_per_block >= ratio


def test_latents_and_states_keep_their_dtype_and_say_so() -> None:
    latent = MLALatent(num_kv_heads=1, head_dim=40, value_dim=32, page=FP16)
    assert latent.with_storage("int8") is latent
    state = RecurrentState(layers=(1,), state_bytes=1000)
    spec = KVCacheSpec((latent, state), (latent,), 16)
    assert spec.bytes_per_block == 16 * 40 * 2 + 1000
    note = "--kv-cache-dtype int8: mla and state pages keep the model's dtype (not quantizable)"
    assert spec.kept_dtype_note("int8") == note
    assert spec.kept_dtype_note("auto") is None
    plain = KVCacheSpec.uniform(2, 2, 32, "float16", 2, 16, storage="int8")
    assert plain.kept_dtype_note("int8") is None and plain.page.storage == "int8"


def test_pool_tensors_are_shared_by_groups_so_a_block_costs_one_page_per_tensor() -> None:
    """gemma-style: two groups of two layers share two tensors, so a block id costs two pages, not four."""
    full = FullAttention(layers=(1, 3), num_kv_heads=2, head_dim=16, page=FP16)
    window = SlidingWindow(64, layers=(0, 2), num_kv_heads=2, head_dim=16, page=FP16)
    tensor = FullAttention(num_kv_heads=2, head_dim=16, page=FP16)
    spec = KVCacheSpec((full, window), (tensor, tensor), 16, num_blocks=10)
    assert spec.bytes_per_block == 2 * tensor.page_bytes(16)
    assert spec.num_slots == 160 and spec.with_blocks(20).num_slots == 320
