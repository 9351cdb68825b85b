"""The encoder cache's arrays: each image's vision-tower output, under its content hash, until the
scheduler evicts it (scheduler/encoder_cache.py keeps the bookkeeping; this keeps the arrays).

An image is encoded the first time a step reaches its placeholder tokens and read from here by every
later chunk (and every request with the same image) until evicted, so it is encoded once however its
tokens are chunked. A step's image embeddings are gathered here into one `[rows, features]` pair the
language model scatters over its token embeddings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from metalserve.multimodal.inputs import MultiModalInput


class StepImages(NamedTuple):
    """The step's image embeddings: packed rows and the features that replace their token embeddings."""

    rows: mx.array  # [N] int32 rows of the packed step
    features: mx.array  # [N, hidden]


class RequestSpan(NamedTuple):
    """One request's scheduled tokens: its images and its slice of the packed axis."""

    images: Sequence[MultiModalInput]
    start: int  # the first scheduled token's index in the request
    end: int
    row: int  # the first scheduled token's row in the packed step


class EncoderOutputs:
    def __init__(self, encode: Callable[[MultiModalInput], mx.array]) -> None:
        """`encode`: one image's `[length, hidden]` output (the model's vision tower, executor/encoders/)."""
        self._encode = encode
        self.outputs: dict[bytes, mx.array] = {}
        self.num_encoded = 0  # images run through the tower (a test's count of "encoded once")
        self.encode_seconds = 0.0  # the tower's time over those images (bench/vision.py reads it)

    def free(self, mm_hashes: Sequence[bytes]) -> None:
        for mm_hash in mm_hashes:
            self.outputs.pop(mm_hash, None)

    def get(self, mm: MultiModalInput) -> mx.array:
        """The image's output, encoding it now if the cache lacks it."""
        out = self.outputs.get(mm.mm_hash)
        if out is None:
            started = time.perf_counter()
            out = self._encode(mm)
            if out.shape[0] != mm.length:
                raise ValueError(f"the vision tower gave {out.shape[0]} embeddings for {mm.length} placeholders")
            mx.eval(out)
            self.encode_seconds += time.perf_counter() - started
            self.outputs[mm.mm_hash] = out
            self.num_encoded += 1
        return out

    def gather(self, spans: Sequence[RequestSpan]) -> StepImages | None:
        """The embeddings of every image token in the step, or None when the step has none."""
        rows: list[np.ndarray] = []
        features: list[mx.array] = []
        for span in spans:
            for mm in span.images:
                lo, hi = max(mm.offset, span.start), min(mm.end, span.end)
                if lo >= hi:
                    continue
                out = self.get(mm)
                features.append(out[lo - mm.offset : hi - mm.offset])
                rows.append(np.arange(lo, hi) - span.start + span.row)
        if not rows:
            return None
        return StepImages(mx.array(np.concatenate(rows).astype(np.int32)), mx.concatenate(features, axis=0))
