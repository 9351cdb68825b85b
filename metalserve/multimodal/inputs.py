"""What a request carries for each image: where its placeholder tokens sit, its content hash, its pixels."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, eq=False)
class MultiModalInput:
    """One image of a request, after the model's processor.

    `offset`/`length`: the image's placeholder tokens in the prompt, `[offset, offset + length)`; they are
    prompt tokens like any other (the scheduler counts them in its token budget), whose embeddings the
    vision tower's output replaces. `mm_hash`: a hash of the decoded pixels (vLLM's multimodal hash): the
    encoder cache and the prefix cache key on it, so the same image is found again and a different one
    never is. `data`: what the executor's encoder reads (pixel arrays, the patch grid); opaque here.
    """

    mm_hash: bytes
    offset: int
    length: int
    data: dict[str, Any] = field(repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of its tokens fall in `[start, end)`."""
        return self.offset < end and start < self.end


def mm_hashes_in_block(inputs: list[MultiModalInput], start: int, end: int) -> tuple[bytes, ...]:
    """The hashes of the images with a placeholder token in `[start, end)`, in prompt order."""
    return tuple(mm.mm_hash for mm in inputs if mm.overlaps(start, end))
