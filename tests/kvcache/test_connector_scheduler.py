"""The KV connector's scheduler half with the disk connector over an in-memory index: exact block ids
for a disk hit after RAM eviction, partial loads, aborts while loading, salts and models apart."""

from __future__ import annotations

import pytest

from metalserve.config import EngineConfig
from metalserve.kvcache.connector.base import ConnectorOutput
from metalserve.kvcache.connector.disk_keys import StoreNamespace
from metalserve.kvcache.connector.disk_scheduler import DiskConnectorScheduler, group_needs
from metalserve.kvcache.specs import FullAttention, RecurrentState
from metalserve.multimodal.inputs import MultiModalInput
from metalserve.request import Request, RequestStatus
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.output import ModelRunnerOutput, SchedulerOutput
from metalserve.scheduler.scheduler import Scheduler
from tests.kvcache.connector_helpers import MemoryIndex

BS = 8
PROMPT_A = list(range(100, 125))  # 25 tokens: 3 full blocks and one token
PROMPT_B = list(range(200, 263))  # 63 tokens: 8 blocks, enough to evict A's blocks


def make_scheduler(fingerprint: str = "model-a", index: MemoryIndex | None = None) -> tuple[Scheduler, MemoryIndex]:
    cfg = EngineConfig(block_size=BS, max_num_batched_tokens=64, max_num_seqs=4)
    s = Scheduler(cfg, num_blocks=10, max_model_len=64)
    index = MemoryIndex() if index is None else index
    s.set_connector(DiskConnectorScheduler(index, StoreNamespace(fingerprint, block_size=BS), s.kv.chain_hashes))
    return s, index


def request(rid: str, prompt: list[int], salt: str | None = None, max_tokens: int = 1) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), cache_salt=salt)


def step(s: Scheduler, index: MemoryIndex, finished_loads: dict[str, int] | None = None) -> SchedulerOutput:
    """One schedule + update: a sampled token for every request that finished its prompt, the step's
    saves committed, and the worker's report of finished loads."""
    out = s.schedule()
    index.commit(out.kv_connector_metadata)
    sampled = {
        rid: [7]
        for rid in out.num_scheduled_tokens
        if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens
    }
    report = ConnectorOutput(finished_loads) if finished_loads else None
    s.update_from_output(out, ModelRunnerOutput(sampled, kv_connector_output=report))
    return out


def run_to_end(s: Scheduler, index: MemoryIndex) -> None:
    while s.requests:
        step(s, index)


def test_a_disk_hit_after_ram_eviction_loads_into_fresh_blocks_with_exact_ids() -> None:
    s, index = make_scheduler()
    s.add_request(request("a", PROMPT_A))
    out = step(s, index)
    assert out.scheduled_new_reqs[0].block_ids == ([1, 2, 3, 4],)
    meta = out.kv_connector_metadata
    assert meta is not None and [t.block_id for t in meta.saves] == [1, 2, 3]  # the computed full blocks
    assert not s.requests  # one token: finished, blocks freed (cached in RAM)
    s.add_request(request("b", PROMPT_B))
    assert step(s, index).scheduled_new_reqs[0].block_ids == ([5, 6, 7, 8, 9, 4, 3, 2],)  # evicts A's 2 and 3
    run_to_end(s, index)

    s.add_request(request("a2", PROMPT_A))
    s.add_request(request("c", [900, 901]))
    out = step(s, index)
    # a2: RAM hit on block 1, A's blocks 2 and 3 from disk into fresh blocks 2 and 3; it waits while they
    # load, and c behind it is admitted in the same step.
    meta = out.kv_connector_metadata
    assert meta is not None and [t.block_id for t in meta.loads["a2"]] == [2, 3]
    assert [n.request_id for n in out.scheduled_new_reqs] == ["c"]
    assert s.requests["a2"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert s.make_stats().num_waiting == 1
    out = step(s, index, finished_loads={"a2": 2})
    assert out.scheduled_new_reqs == []  # the report arrives with this step's results
    out = step(s, index)
    new = out.scheduled_new_reqs[0]
    assert (new.request_id, new.block_ids, new.num_computed_tokens) == ("a2", ([1, 2, 3, 9],), 24)
    assert out.num_scheduled_tokens["a2"] == 1  # prefill starts after the last loaded block
    run_to_end(s, index)
    stats = s.make_stats().connector
    assert stats is not None and stats.hits == 16
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def test_a_failed_block_and_what_follows_it_are_recomputed() -> None:
    s, index = make_scheduler()
    s.add_request(request("a", PROMPT_A))
    run_to_end(s, index)
    s.kv.pool.cached.clear()  # forget the RAM cache: the whole prefix comes from disk
    for block in s.kv.pool.blocks:
        block.block_hash = None
    s.kv.pool._num_free_cached = 0
    s.add_request(request("a2", PROMPT_A))
    meta = step(s, index).kv_connector_metadata
    assert meta is not None and len(meta.loads["a2"]) == 3
    step(s, index, finished_loads={"a2": 1})  # the second block was corrupt
    out = step(s, index)
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens["a2"] == 17
    assert len(new.block_ids[0]) == 4  # the blocks of the failed loads are reused for the recompute
    run_to_end(s, index)
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks


def test_an_abort_while_loading_frees_the_blocks_only_after_the_loads_end() -> None:
    s, index = make_scheduler()
    s.add_request(request("a", PROMPT_A))
    run_to_end(s, index)
    s.kv.pool.cached.clear()
    for block in s.kv.pool.blocks:
        block.block_hash = None
    s.kv.pool._num_free_cached = 0
    s.add_request(request("a2", PROMPT_A))
    step(s, index)
    held = s.kv.get_block_ids("a2")
    assert len(held[0]) == 3
    s.abort_requests(["a2"])
    step(s, index)
    assert "a2" not in s.requests and s.kv.get_block_ids("a2") == held  # the worker may still write them
    assert s.has_unfinished_requests()
    step(s, index, finished_loads={"a2": 3})
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks and not s.has_unfinished_requests()


@pytest.mark.parametrize(("salt", "fingerprint"), [("tenant-2", "model-a"), (None, "model-b")])
def test_salts_and_models_never_share_stored_blocks(salt: str | None, fingerprint: str) -> None:
    s, index = make_scheduler()
    s.add_request(request("a", PROMPT_A, salt="tenant-1"))
    run_to_end(s, index)
    assert len(index.stored) == 3
    other, _ = make_scheduler(fingerprint, index)  # a fresh engine on the same store
    other.add_request(request("x", PROMPT_A, salt=salt))
    out = step(other, index)
    assert out.kv_connector_metadata is None or not out.kv_connector_metadata.loads
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    same, _ = make_scheduler("model-a", index)
    same.add_request(request("y", PROMPT_A, salt="tenant-1"))
    meta = step(same, index).kv_connector_metadata
    assert meta is not None and len(meta.loads["y"]) == 3


def test_keys_change_with_everything_that_changes_the_bytes() -> None:
    h = b"\x01" * 32
    base = StoreNamespace("fp", 0, "auto", 16)
    keys = {
        base.key(h),
        base.key(h, ""),
        base.key(h, "salt"),
        StoreNamespace("fp2", 0, "auto", 16).key(h),
        StoreNamespace("fp", 1, "auto", 16).key(h),
        StoreNamespace("fp", 0, "int8", 16).key(h),
        StoreNamespace("fp", 0, "auto", 32).key(h),
        base.key(b"\x02" * 32),
    }
    assert len(keys) == 8 and all(len(k) == 64 for k in keys)


def with_image(rid: str, pixels: bytes) -> Request:
    """PROMPT_C with one image whose placeholders are tokens 10..29 (blocks 1-3; block 0 is text)."""
    r = request(rid, PROMPT_C)
    r.mm_inputs = [MultiModalInput(pixels, 10, 20, {})]
    return r


PROMPT_C = list(range(400, 433))  # 33 tokens: 4 loadable blocks


@pytest.mark.parametrize(
    ("intact", "computed", "encoded"),
    [(4, 32, {}), (2, 16, {"a2": [0]}), (1, 8, {"a2": [0]})],  # whole image loaded / partly / not at all
)
def test_an_image_prompt_loads_from_disk_and_encodes_only_images_not_wholly_loaded(
    intact: int, computed: int, encoded: dict[str, list[int]]
) -> None:
    first, index = make_scheduler()
    first.add_request(with_image("a", b"cat"))
    out = step(first, index)
    assert out.scheduled_encoder_inputs == {"a": [0]}
    run_to_end(first, index)
    s, _ = make_scheduler(index=index)  # a restart: empty RAM prefix cache and encoder cache
    s.add_request(with_image("a2", b"cat"))
    meta = step(s, index).kv_connector_metadata
    assert meta is not None and [t.block_id for t in meta.loads["a2"]] == [1, 2, 3, 4]
    step(s, index, finished_loads={"a2": intact})
    out = step(s, index)
    new = out.scheduled_new_reqs[0]
    assert (new.request_id, new.num_computed_tokens) == ("a2", computed)
    assert out.num_scheduled_tokens == {"a2": 33 - computed}
    # The image's placeholders (10..29) wholly inside the loaded prefix need no encoder run; partly or
    # not inside, it is encoded (the chunk reads its features from the first token after the prefix).
    assert out.scheduled_encoder_inputs == encoded
    run_to_end(s, index)
    assert s.kv.num_free_blocks == s.kv.pool.num_usable_blocks and not s.encoder_cache.in_use


def test_another_image_with_the_same_tokens_hits_only_the_text_block_before_it() -> None:
    first, index = make_scheduler()
    first.add_request(with_image("a", b"cat"))
    run_to_end(first, index)
    assert len(index.stored) == 4
    s, _ = make_scheduler(index=index)
    s.add_request(with_image("b", b"dog"))  # same token ids, other pixels
    meta = step(s, index).kv_connector_metadata
    assert meta is not None and [t.block_id for t in meta.loads["b"]] == [1]  # block 0 (tokens 0..7) only
    step(s, index, finished_loads={"b": 1})
    out = step(s, index)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8 and out.scheduled_encoder_inputs == {"b": [0]}
    run_to_end(s, index)
    assert len(index.stored) == 7  # dog's blocks 1-3 written beside cat's


def test_under_async_scheduling_a_block_completed_by_a_placeholder_is_saved_with_the_next_step() -> None:
    """Lookahead: step k+1 is scheduled before step k's token is known. The step whose placeholder
    completes a block cannot key it (its last token is unknown); the next step's saves carry it, and the
    worker reads saves out after that step's forward, so after the one that computed the block."""
    s, index = make_scheduler()
    s.lookahead = True
    s.add_request(request("a", list(range(100, 107)), max_tokens=4))  # 7 tokens: block 0 ends at the 8th
    out1 = s.schedule()
    assert out1.num_scheduled_tokens == {"a": 7} and out1.kv_connector_metadata is None
    out2 = s.schedule()  # before step 1's token is in: position 7 is a placeholder, block 0 is full
    assert out2.num_scheduled_tokens == {"a": 1} and out2.kv_connector_metadata is None
    s.update_from_output(out1, ModelRunnerOutput({"a": [7]}))
    out3 = s.schedule()  # token 7 is known now: block 0 can be keyed
    meta = out3.kv_connector_metadata
    assert meta is not None and [t.block_id for t in meta.saves] == [1]
    index.commit(meta)
    s.update_from_output(out2, ModelRunnerOutput({"a": [8]}))
    out4 = s.schedule()
    assert out4.kv_connector_metadata is None  # offered once
    s.update_from_output(out3, ModelRunnerOutput({"a": [9]}))
    s.update_from_output(out4, ModelRunnerOutput({"a": [10]}))
    assert not s.requests and len(index.stored) == 1


def test_under_async_scheduling_a_snapshot_reached_by_a_placeholder_is_saved_with_the_next_step() -> None:
    """A hybrid model (a full-attention and a recurrent-state group): the placeholder step that ends block
    0 writes the state snapshot into the state group's entry 0; the next step reads that entry (and writes
    entry 1), and its saves carry block 0 of both groups."""
    specs = [FullAttention(), RecurrentState()]
    s = Scheduler(EngineConfig(block_size=BS, max_num_batched_tokens=64, max_num_seqs=4), 20, 64, kv_groups=specs)
    index = MemoryIndex()
    namespace = StoreNamespace("model-a", block_size=BS)
    s.set_connector(DiskConnectorScheduler(index, namespace, s.kv.chain_hashes, group_needs(specs)))
    s.lookahead = True
    s.add_request(request("a", list(range(100, 107)), max_tokens=4))
    out1 = s.schedule()
    assert out1.scheduled_new_reqs[0].block_ids == ([1], [2])
    out2 = s.schedule()  # the placeholder at position 7 ends block 0: state entry 0 holds the snapshot
    assert out2.kv_connector_metadata is None
    s.update_from_output(out1, ModelRunnerOutput({"a": [7]}))
    out3 = s.schedule()
    assert out3.scheduled_cached_reqs[0].new_block_ids == ([3], [4])  # the step writes state entry 1
    assert s.kv.get_block_ids("a") == ([1, 3], [2, 4])  # and reads entry 0 (block 2), not freed yet
    meta = out3.kv_connector_metadata
    assert meta is not None and [(t.block_id, t.group) for t in meta.saves] == [(1, 0), (2, 1)]
