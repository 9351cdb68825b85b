"""Small builders shared by the KV cache tests."""

from __future__ import annotations

from metalserve.kvcache.manager import BlockIds, KVCacheManager
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=8), cache_salt=salt)


def admit(kv: KVCacheManager, request: Request) -> BlockIds | None:
    """What the scheduler does for a waiting request: look up its prefix, then allocate the rest."""
    hit = kv.get_computed_blocks(request)
    ids = kv.allocate_slots(request, request.num_tokens - hit.num_tokens, hit)
    if ids is not None:
        request.num_computed_tokens = request.num_tokens  # as if the step ran
    return ids
