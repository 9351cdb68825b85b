"""Images in the scheduler: an encoder budget per step, an encoder cache (an image encoded once per
request however its tokens are chunked, and once for requests sharing it), chunks that stop before an
image that does not fit, and never inside one for a model that cannot split it. No MLX."""

from __future__ import annotations

import pytest

from metalserve.multimodal.inputs import MultiModalInput
from metalserve.scheduler.scheduler import Scheduler
from tests.scheduler.sched_helpers import make_request, make_scheduler, step


def image(name: str, offset: int, length: int) -> MultiModalInput:
    return MultiModalInput(name.encode(), offset, length, {})


def with_images(request_id: str, prompt: int, *images: MultiModalInput, **params: object):  # type: ignore[no-untyped-def]
    request = make_request(request_id, prompt, **params)  # type: ignore[arg-type]
    request.mm_inputs = list(images)
    return request


def run(s: Scheduler, steps: int) -> list[tuple[dict[str, int], dict[str, list[int]], list[bytes]]]:
    """Each step's scheduled tokens, encoder inputs and freed encoder hashes."""
    out = []
    for _ in range(steps):
        so, _ = step(s)
        out.append((so.num_scheduled_tokens, so.scheduled_encoder_inputs, so.free_encoder_mm_hashes))
    return out


def test_an_image_spanning_chunks_is_encoded_once_and_released_when_computed() -> None:
    s = make_scheduler(max_num_batched_tokens=16, max_num_encoder_input_tokens=32, encoder_cache_size=32)
    s.add_request(with_images("a", 40, image("x", 4, 24), max_tokens=1))
    steps = run(s, 3)
    assert [t for t, _, _ in steps] == [{"a": 16}, {"a": 16}, {"a": 8}]
    assert [e for _, e, _ in steps] == [{"a": [0]}, {}, {}]  # encoded in the first chunk only
    assert s.encoder_cache.in_use is False  # its 24 tokens were all computed by step 2
    assert s.encoder_cache.is_cached(b"x")  # kept for reuse until its room is needed


def test_encoder_budget_stops_a_chunk_before_the_image_that_does_not_fit() -> None:
    s = make_scheduler(max_num_batched_tokens=64, max_num_encoder_input_tokens=20, encoder_cache_size=64)
    s.add_request(with_images("a", 60, image("x", 2, 12), image("y", 20, 16), max_tokens=1))
    steps = run(s, 3)
    # x (12) fits the step's 20 encoder tokens, y (16) does not: the chunk stops at y's first token.
    assert steps[0][:2] == ({"a": 20}, {"a": [0]})
    assert steps[1][:2] == ({"a": 40}, {"a": [1]})


def test_a_shared_image_is_encoded_once_and_evicted_when_room_is_needed() -> None:
    s = make_scheduler(max_num_batched_tokens=64, max_num_encoder_input_tokens=64, encoder_cache_size=24)
    s.add_request(with_images("a", 30, image("x", 2, 16), max_tokens=1))
    s.add_request(with_images("b", 30, image("x", 4, 16), max_tokens=1))
    so, _ = step(s)
    assert so.scheduled_encoder_inputs == {"a": [0]}  # b reuses a's entry in the same step
    s.add_request(with_images("c", 30, image("z", 2, 16), max_tokens=1))
    # x (unused now) makes room for z; the runner drops x's array before it encodes z in that step.
    assert run(s, 1) == [({"c": 30}, {"c": [0]}, [b"x"])]


def test_a_model_that_cannot_split_an_image_gets_it_in_one_chunk() -> None:
    s = Scheduler(
        make_scheduler().config.__class__(block_size=8, max_num_batched_tokens=16, max_num_seqs=8),
        64,
        256,
        mm_splittable=False,
    )
    s.add_request(with_images("a", 40, image("x", 10, 12), max_tokens=1))
    steps = run(s, 3)
    assert [t for t, _, _ in steps] == [{"a": 10}, {"a": 16}, {"a": 14}]  # 10 | 12 image + 4 | 14
    assert steps[1][1] == {"a": [0]}


def test_an_image_larger_than_the_encoder_budget_is_refused_at_admission() -> None:
    s = make_scheduler(max_num_encoder_input_tokens=8, encoder_cache_size=8)
    with pytest.raises(ValueError, match="larger than the encoder budget"):
        s.add_request(with_images("a", 40, image("x", 4, 12)))


def test_prefix_hashes_of_blocks_holding_an_image_include_its_content_hash() -> None:
    """Same tokens, other pixels: the text-only first block hits, the image's blocks do not (block ids)."""
    s = make_scheduler(max_num_batched_tokens=64, block_size=8)
    s.add_request(with_images("a", 33, image("x", 10, 12), max_tokens=1))
    run(s, 2)
    s.add_request(with_images("b", 33, image("y", 10, 12), max_tokens=1))
    s.add_request(with_images("c", 33, image("x", 10, 12), max_tokens=1))
    so, _ = step(s)
    hits = {new.request_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
    assert hits == {"b": 8, "c": 32}
    blocks = {new.request_id: new.block_ids[0] for new in so.scheduled_new_reqs}  # the one group's table
    assert blocks == {"b": [1, 6, 7, 8, 9], "c": [1, 2, 3, 4, 10]}  # b shares the text block only


def test_cache_salt_still_separates_requests_with_the_same_image() -> None:
    s = make_scheduler(max_num_batched_tokens=64, block_size=8)
    first = with_images("a", 33, image("x", 10, 12), max_tokens=1)
    first.cache_salt = "tenant-1"
    s.add_request(first)
    run(s, 2)
    other_tenant = with_images("b", 33, image("x", 10, 12), max_tokens=1)
    other_tenant.cache_salt = "tenant-2"
    same_tenant = with_images("c", 33, image("x", 10, 12), max_tokens=1)
    same_tenant.cache_salt = "tenant-1"
    s.add_request(other_tenant)
    s.add_request(same_tenant)
    so, _ = step(s)
    assert {new.request_id: new.num_computed_tokens for new in so.scheduled_new_reqs} == {"b": 0, "c": 32}
