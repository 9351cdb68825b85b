"""The encoder cache's bookkeeping (after vLLM V1's EncoderCacheManager): ids and token counts, no arrays.

A vision tower's output for one image is kept in the executor (executor/encoders/cache.py) under the
image's content hash from the step that encodes it until every request using it has computed the
image's placeholder tokens, so an image whose tokens span several prefill chunks is encoded once. An
entry no request uses any more stays (a later request with the same image reuses it) until its room
is needed; then the scheduler tells the runner to drop it (`SchedulerOutput.free_encoder_mm_hashes`).
Capacity is counted in placeholder tokens, the size of the tower's output.
"""

from __future__ import annotations

from collections import OrderedDict

from metalserve.multimodal.inputs import MultiModalInput


class EncoderCacheManager:
    def __init__(self, capacity: int) -> None:
        """`capacity`: the placeholder tokens whose encoder outputs may be held at once."""
        self.capacity = capacity
        self.num_free = capacity  # not held by an entry in use or kept for reuse
        self._users: dict[bytes, set[str]] = {}  # mm_hash -> the requests that still need it
        self._unused: OrderedDict[bytes, int] = OrderedDict()  # kept for reuse, oldest first: hash -> tokens
        self._freed: list[bytes] = []  # evicted since the last step: the runner drops their arrays

    @property
    def in_use(self) -> bool:
        """Whether some request holds an entry."""
        return bool(self._users)

    def is_cached(self, mm_hash: bytes) -> bool:
        return mm_hash in self._users or mm_hash in self._unused

    def reuse(self, request_id: str, mm: MultiModalInput) -> bool:
        """If the image's output is held (or kept for reuse), take a reference for the request: True."""
        if mm.mm_hash in self._unused:
            self._unused.pop(mm.mm_hash)
            self._users[mm.mm_hash] = set()
        users = self._users.get(mm.mm_hash)
        if users is None:
            return False
        users.add(request_id)
        return True

    def can_allocate_tokens(self, num_tokens: int) -> bool:
        """Whether outputs of `num_tokens` placeholder tokens fit, counting what evicting unused entries
        would free."""
        return num_tokens <= self.num_free + sum(self._unused.values())

    def allocate(self, request_id: str, mm: MultiModalInput) -> None:
        """Reserve room for the image's output (the runner encodes it this step), evicting unused entries
        oldest first as needed."""
        while self.num_free < mm.length:
            if not self._unused:
                raise RuntimeError(f"the encoder cache cannot hold {mm.length} tokens: check can_allocate_tokens first")
            evicted, tokens = self._unused.popitem(last=False)
            self.num_free += tokens
            self._freed.append(evicted)
        self.num_free -= mm.length
        self._users[mm.mm_hash] = {request_id}

    def release(self, request_id: str, mm: MultiModalInput) -> None:
        """The request needs the image's output no more; unused, the entry is kept for reuse."""
        users = self._users.get(mm.mm_hash)
        if users is None or request_id not in users:
            return
        users.discard(request_id)
        if not users:
            del self._users[mm.mm_hash]
            self._unused[mm.mm_hash] = mm.length

    def release_all(self, request_id: str, inputs: list[MultiModalInput]) -> None:
        for mm in inputs:
            self.release(request_id, mm)

    def take_freed(self) -> list[bytes]:
        """The hashes evicted since the last call (each once)."""
        freed, self._freed = self._freed, []
        return freed


class EncoderPlan:
    """Which images a prefill chunk needs encoded, and how far the chunk may go (vLLM's
    `_try_schedule_encoder_inputs`): an image is encoded in the step whose chunk first reaches one of
    its placeholder tokens, within the step's encoder budget and the cache's room; a chunk stops before
    an image that does not fit, and for a model that cannot split an image (`splittable=False`: e.g.
    bidirectional attention among its tokens) before an image it would end inside."""

    def __init__(self, cache: EncoderCacheManager, splittable: bool = True) -> None:
        self.cache = cache
        self.splittable = splittable

    def plan(self, mm_inputs: list[MultiModalInput], start: int, n: int, budget: int) -> tuple[int, list[int]]:
        """For the chunk `[start, start + n)`: the tokens it may take, and the images to encode now."""
        end, need, room = start + n, 0, 0
        to_encode: list[int] = []
        planned: set[bytes] = set()
        for i, mm in enumerate(mm_inputs):
            if mm.offset >= end:
                break
            if mm.end <= start:
                continue
            if not self.splittable and mm.offset >= start and end < mm.end:
                return mm.offset - start, to_encode  # the whole image in a later chunk
            if self.cache.is_cached(mm.mm_hash) or mm.mm_hash in planned:
                continue
            room = need + mm.length
            if room > budget or not self.cache.can_allocate_tokens(room):
                return max(mm.offset - start, 0), to_encode
            to_encode.append(i)
            planned.add(mm.mm_hash)
            need = room
        return n, to_encode

    def commit(self, request_id: str, mm_inputs: list[MultiModalInput], start: int, end: int) -> None:
        """Take the chunk's images: a reference to those held, room for the ones encoded now."""
        for mm in mm_inputs:
            if mm.overlaps(start, end) and not self.cache.reuse(request_id, mm):
                self.cache.allocate(request_id, mm)

    def release_done(self, request_id: str, mm_inputs: list[MultiModalInput], num_computed: int) -> None:
        """Release the images whose placeholder tokens are all computed."""
        for mm in mm_inputs:
            if mm.end <= num_computed:
                self.cache.release(request_id, mm)
