"""The engine's view of one request: its tokens, its progress and its state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from metalserve.kvcache.hashing import BlockHash
from metalserve.multimodal.inputs import MultiModalInput, mm_hashes_in_block
from metalserve.outputs import TokenLogprob
from metalserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # its prefix blocks are loading from a KV connector
    FINISHED_STOPPED = enum.auto()  # EOS or a stop token id
    FINISHED_LENGTH = enum.auto()  # max_tokens or the context limit
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # the output broke its grammar (never reported as "stop")

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class StructuredState(Protocol):
    """A request's grammar as the scheduler sees it (metalserve/structured/state.py implements it)."""

    error: str | None

    def is_ready(self) -> bool:
        """False while the grammar compiles; the scheduler skips the request until then."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance by one output token; True when the output completed the grammar (the request ends)."""
        ...


@dataclass(eq=False)
class Request:
    """One sequence. `num_computed_tokens` catches up to `num_tokens`; there is no prefill or decode phase."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens found in the prefix cache when the request was first scheduled (reported as cached_tokens);
    # None until then.
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Hash chain of this request's full blocks, extended lazily by the KV cache manager. Tokens never
    # change once appended, so the hashes stay valid across preemption.
    block_hashes: list[BlockHash] = field(default_factory=list, repr=False)
    # Grammar-constrained decoding: set by the engine when sampling_params.structured_outputs is.
    structured: StructuredState | None = field(default=None, repr=False)
    # Speculative decoding: drafts the runner proposed after the last step, to verify in the next one.
    spec_token_ids: list[int] = field(default_factory=list, repr=False)
    # Images, in prompt order: their placeholder tokens are prompt tokens (multimodal/inputs.py).
    mm_inputs: list[MultiModalInput] = field(default_factory=list, repr=False)
    # sampling_params.prompt_logprobs: the prompt tokens' logprobs so far (entry i: token i; the first
    # None), handed out with the first output; None when not asked for, or once handed out.
    prompt_logprobs: list[TokenLogprob | None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole concatenation."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    def mm_hashes_between(self, start: int, end: int) -> tuple[bytes, ...]:
        """The content hashes of the images with placeholder tokens in `[start, end)` (the prefix cache's
        extra keys for a block there)."""
        return mm_hashes_in_block(self.mm_inputs, start, end) if self.mm_inputs else ()
