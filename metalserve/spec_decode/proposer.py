"""The runner's drafting side: after a step, propose the next drafts of every request that sampled."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from metalserve.spec_decode.backoff import BackOff
from metalserve.spec_decode.config import SpeculativeConfig
from metalserve.spec_decode.cost import drafts_worth
from metalserve.spec_decode.ngram import propose_ngram


class DraftedRequest(Protocol):
    request_id: str
    token_ids: list[int]  # prompt + output so far
    structured: Any  # a grammar: its masks follow the drafts (spec_decode/grammar.py)
    block_ids: list[int]  # the KV slots it holds (a draft model writes its own KV there)

    @property
    def block_array(self) -> Any: ...


class Proposer(Protocol):
    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None: ...

    def propose(self, requests: Sequence[DraftedRequest], threshold: float = 0.0) -> dict[str, list[int]]:
        """Drafts per request id; a draft position is proposed only while its chance of acceptance
        beats `threshold` (spec_decode/cost.py)."""
        ...

    def forget(self, request_id: str) -> None: ...

    def grow(self, num_blocks: int) -> None:
        """The KV pool grew to `num_blocks` blocks (a draft model grows its own pools to match)."""
        ...


class NgramProposer:
    """Prompt-lookup drafts, with per-request back-off (spec_decode/backoff.py)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.backoff = BackOff()

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        self.backoff.record(request_id, num_drafted, num_accepted)

    def propose(self, requests: Sequence[DraftedRequest], threshold: float = 0.0) -> dict[str, list[int]]:
        """Drafts per request id; requests in back-off get none."""
        out: dict[str, list[int]] = {}
        for request in requests:
            rid = request.request_id
            k = drafts_worth(self.backoff.acceptance(rid), self.k, threshold)
            if not k or not self.backoff.may_draft(rid):
                continue
            drafts = propose_ngram(request.token_ids, k, self.min_n, self.max_n)
            if drafts:
                out[request.request_id] = drafts
        return out

    def forget(self, request_id: str) -> None:
        self.backoff.forget(request_id)

    def grow(self, num_blocks: int) -> None:
        return None


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config)
    raise ValueError(f"method {config.method!r} needs its model: see spec_decode/draft_model.py")
