"""The manager: exact block ids, reference counts and eviction order."""

from __future__ import annotations

from dataclasses import replace

import pytest

from metalserve.kvcache.manager import KVCacheManager
from metalserve.lora.request import LoraRequest
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from tests.kvcache.kv_helpers import admit, make_request

BS = 4


def ref_counts(kv: KVCacheManager, ids: list[int]) -> list[int]:
    return [kv.pool.blocks[i].ref_cnt for i in ids]


def test_allocation_and_free_order() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(10)))  # 2 full blocks + a tail of 2
    assert admit(kv, a) == ([1, 2, 3],)
    assert ref_counts(kv, [1, 2, 3]) == [1, 1, 1]
    assert kv.num_free_blocks == 4
    kv.free(a)
    # Freed tail first: the partial tail (3) is taken before the prefix (2, 1).
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 3, 2, 1]
    assert ref_counts(kv, [1, 2, 3]) == [0, 0, 0]
    assert kv.groups[0].tables == {}


def test_decode_growth_allocates_only_at_block_boundary() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(7)))
    assert admit(kv, a) == ([1, 2],)
    a.output_token_ids.append(100)  # token 8 fits the tail block
    assert kv.allocate_slots(a, 1) == ([],)
    a.num_computed_tokens += 1
    a.output_token_ids.append(101)  # token 9 needs a new block
    assert kv.allocate_slots(a, 1) == ([3],)
    assert kv.get_block_ids("a") == ([1, 2, 3],)


def test_prefix_hit_shares_full_blocks_and_recomputes_partial_tail() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    kv.free(a)  # publishes blocks 1 and 2; the partial tail 3 is never cached
    assert set(kv.pool.cached.values()) == {kv.pool.blocks[1], kv.pool.blocks[2]}
    b = make_request("b", list(range(8)) + [50, 51, 52])
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == ([1, 2],)
    assert hit.num_tokens == 8
    assert kv.allocate_slots(b, 3, hit) == ([1, 2, 4],)
    assert ref_counts(kv, [1, 2, 4]) == [1, 1, 1]
    # The hit blocks left the free queue without being evicted.
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 3]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 11, 8)  # a found nothing, b found 8 of 11


def test_live_sharing_counts_both_holders() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    a.output_token_ids.append(9)
    kv.allocate_slots(a, 1)  # publishes a's computed full blocks 1, 2
    b = make_request("b", list(range(8)) + [77])
    assert admit(kv, b) == ([1, 2, 4],)
    assert ref_counts(kv, [1, 2, 3, 4]) == [2, 2, 1, 1]
    kv.free(a)
    assert ref_counts(kv, [1, 2, 3]) == [1, 1, 0]
    assert kv.pool.free_queue.block_ids() == [5, 6, 7, 8, 9, 3]


def test_fully_cached_prompt_recomputes_last_token() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(8)))
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == ([1],)  # not [1, 2]: the last token must still run
    assert hit.num_tokens == 4
    assert kv.allocate_slots(b, 4, hit) == ([1, 3],)


def test_eviction_under_pressure_takes_lru_first() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_request("a", list(range(8)))
    b = make_request("b", list(range(100, 108)))
    admit(kv, a)
    kv.free(a)  # free queue: 3, 4, 2, 1 (1, 2 cached)
    assert kv.pool.free_queue.block_ids() == [3, 4, 2, 1]
    assert admit(kv, b) == ([3, 4],)
    kv.free(b)  # free queue: 2, 1, 4, 3
    c = make_request("c", list(range(200, 212)))
    assert admit(kv, c) == ([2, 1, 4],)  # evicts a's blocks first (LRU), then b's second block
    assert kv.get_computed_blocks(make_request("x", list(range(9)))).block_ids == ([],)
    assert kv.get_computed_blocks(make_request("y", list(range(100, 109)))).block_ids == ([3],)
    assert kv.pool.num_evictions == 3


def test_allocation_fails_without_side_effects() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    b = make_request("b", list(range(100, 108)))
    assert admit(kv, b) is None
    assert kv.num_free_blocks == 1
    assert "b" not in kv.groups[0].tables
    assert kv.prefix_cache_queries == 8  # only the successful admission counted


def test_free_hit_blocks_do_not_count_as_room() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)  # all three blocks free; 1, 2 cached
    b = make_request("b", list(range(8)) + [5, 6, 7, 8, 9, 10, 11, 12, 13])
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == ([1, 2],)
    assert kv.allocate_slots(b, 9, hit) is None  # needs 3 new blocks, only 1 besides the hits
    assert kv.allocate_slots(b, 1, hit) == ([1, 2, 3],)


def test_two_salts_never_share() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(9))
    a = make_request("a", prompt, salt="tenant-1")
    admit(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", prompt, salt="tenant-2")).block_ids == ([],)
    assert kv.get_computed_blocks(make_request("c", prompt)).block_ids == ([],)
    assert kv.get_computed_blocks(make_request("d", prompt, salt="tenant-1")).block_ids == ([1, 2],)


def test_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(make_request("b", list(range(9)))).num_tokens == 0


def test_bad_arguments() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    with pytest.raises(ValueError, match="at least 1"):
        kv.allocate_slots(make_request("a", [1]), 0)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=8, block_size=0)


def test_blocks_computed_under_one_lora_adapter_serve_only_that_adapter() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = list(range(9))
    sql = LoraRequest("sql", "sql@1111")

    def under(rid: str, lora: LoraRequest | None) -> Request:
        return Request(rid, list(prompt), SamplingParams(max_tokens=8), lora=lora)

    a = under("a", sql)
    admit(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(under("base", None)).block_ids == ([],)
    assert kv.get_computed_blocks(under("chat", LoraRequest("chat", "chat@2222"))).block_ids == ([],)
    # The same name over other weights (an adapter reloaded from another directory) does not hit either.
    assert kv.get_computed_blocks(under("sql-v2", LoraRequest("sql", "sql@3333"))).block_ids == ([],)
    assert kv.get_computed_blocks(under("again", sql)).block_ids == ([1, 2],)
    base = under("b", None)
    assert admit(kv, base) == ([4, 5, 6],)  # the base model's blocks are its own, not the adapter's 1 and 2
    kv.free(base)
    assert kv.get_computed_blocks(under("base2", None)).block_ids == ([4, 5],)
    assert kv.get_computed_blocks(under("sql2", sql)).block_ids == ([1, 2],)
    # The same adapter at another per-request scale computes other K/V: no hit either.
    assert kv.get_computed_blocks(under("sql-half", replace(sql, scale=0.5))).block_ids == ([],)
    assert kv.get_computed_blocks(under("sql-one", replace(sql, scale=1.0))).block_ids == ([1, 2],)
