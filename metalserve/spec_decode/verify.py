"""Verifying drafts: the target samples every window position, and drafts are kept while they agree.

A window is a request's last known token plus its drafts d1..dk; the forward gives logits at each of
its k + 1 positions. Position j is sampled by the ordinary sampler as if d1..dj were already output
(`WindowRow`), so logit bias, min_tokens, penalties, temperature, top-k / top-p / min-p, logprobs and
per-request seeds apply exactly as without speculation. Draft d(j+1) is accepted iff it equals the
token t_j drawn at position j; the first t_j that differs (or t_k after k accepted drafts) ends the
window. For a deterministic draft this is rejection sampling: d is kept with probability p_j(d), and
on rejection t_j is a draw from p_j without d, renormalised; every output token is a draw from the
target distribution given the tokens before it. A seeded request draws the same uniforms at the same
output positions with or without speculation, so its text does not depend on the drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from metalserve.outputs import TokenLogprob
from metalserve.sampling_params import SamplingRequest
from metalserve.spec_decode.grammar import window_masks


class WindowRow:
    """One window position as the sampler sees it: the request with the first `j` drafts as output,
    and (a grammar-constrained request) the grammar's mask after those drafts."""

    def __init__(self, request: SamplingRequest, drafts: Sequence[int], structured: Any = None) -> None:
        self.structured = structured
        self._request = request
        self._drafts = list(drafts)
        self.sampling_params = request.sampling_params
        self.eos_token_ids = request.eos_token_ids
        self.num_output_tokens = request.num_output_tokens + len(self._drafts)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self._request.output_token_ids + self._drafts


class Window(NamedTuple):
    """A verified window: the tokens to append (1..k+1) and their logprobs where asked for."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None


class SampleResult(Protocol):
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def window_rows(requests: Sequence[SamplingRequest], drafts: Sequence[Sequence[int]], vocab: int = 0) -> list[Any]:
    """The sampler's rows, in logits order: each request's positions 0..k (a draft-less request: itself).
    `vocab`: the logits' width, for the grammar masks of constrained windows."""
    rows: list[Any] = []
    for request, spec in zip(requests, drafts, strict=True):
        if not spec:
            rows.append(request)
            continue
        state = getattr(request, "structured", None)
        if state is not None:
            masks = window_masks(state, request.output_token_ids, spec, vocab)
            rows.extend(WindowRow(request, spec[:j], masks[j]) for j in range(len(spec) + 1))
        else:
            rows.extend(WindowRow(request, spec[:j]) for j in range(len(spec) + 1))
    return rows


def accept(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading drafts equal the target's tokens at their positions."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n


def verify_windows(
    sample: Callable[[Any, list[Any]], SampleResult],
    logits: Any,
    requests: Sequence[SamplingRequest],
    drafts: Sequence[Sequence[int]],
) -> list[Window]:
    """Sample every window position in one batched call and keep each request's agreeing prefix."""
    result = sample(logits, window_rows(requests, drafts, int(logits.shape[-1]) if logits is not None else 0))
    out: list[Window] = []
    offset = 0
    for spec in drafts:
        width = len(spec) + 1
        targets = result.token_ids[offset : offset + width]
        n = accept(spec, targets) + 1
        lps = result.logprobs[offset : offset + n]
        offset += width
        logprobs = None if lps[0] is None else [lp for lp in lps if lp is not None]
        out.append(Window(list(targets[:n]), logprobs))
    return out
