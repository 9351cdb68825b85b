"""The runner's drafting side: after a step, propose the next drafts of every request that sampled."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from metalserve.spec_decode.ngram import propose_ngram
from metalserve.speculative_config import SpeculativeConfig


class DraftedRequest(Protocol):
    request_id: str
    token_ids: list[int]  # prompt + output so far
    structured: Any  # a grammar: its masks follow the drafts (spec_decode/grammar.py)

    @property
    def block_ids(self) -> list[int]:
        """The KV slots it holds (a draft model writes its own KV there)."""

    @property
    def block_array(self) -> Any: ...


class Proposer(Protocol):
    k: int  # num_speculative_tokens: the most drafts one request gets

    def propose(self, requests: Sequence[DraftedRequest], limits: Mapping[str, int]) -> dict[str, list[int]]:
        """Drafts per request id, at most `limits[request_id]` (spec_decode/controller.py; absent: 0)."""
        ...

    def forget(self, request_id: str) -> None: ...

    def grow(self, num_blocks: int) -> None:
        """The KV pool grew to `num_blocks` blocks (a draft model grows its own pools to match)."""
        ...

    def truncate(self, num_blocks: int) -> None:
        """The KV pool was cut back to `num_blocks` blocks at idle (a draft model cuts its own pools)."""
        ...


class NgramProposer:
    """Prompt-lookup drafts (spec_decode/ngram.py)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, requests: Sequence[DraftedRequest], limits: Mapping[str, int]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for request in requests:
            k = limits.get(request.request_id, 0)
            drafts = propose_ngram(request.token_ids, k, self.min_n, self.max_n) if k else []
            if drafts:
                out[request.request_id] = drafts
        return out

    def forget(self, request_id: str) -> None:
        return None

    def grow(self, num_blocks: int) -> None:
        return None

    def truncate(self, num_blocks: int) -> None:
        return None


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config)
    raise ValueError(f"method {config.method!r} needs its model: see executor/draft_model.py")
