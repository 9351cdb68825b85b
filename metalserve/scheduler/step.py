"""What one schedule() call has decided so far, built up request by request."""

from __future__ import annotations

from dataclasses import dataclass, field

from metalserve.kvcache.manager import BlockIds
from metalserve.request import Request
from metalserve.scheduler.output import CachedRequestData, NewRequestData


@dataclass
class StepBuilder:
    """The step's scheduled requests, their output records and the budget left.

    A request's `num_computed_tokens` is advanced as soon as it is scheduled (the next step assumes
    this one ran); `undo` takes that back for a request preempted later in the same step.
    """

    budget: int
    num_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # drafts scheduled after the last token
    encoder_budget: int = 0  # placeholder tokens the vision tower may still encode this step
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)  # request -> its images encoded now

    def add_new(self, request: Request, n: int, block_ids: BlockIds) -> None:
        self.num_tokens[request.request_id] = n
        self.new_reqs.append(
            NewRequestData(
                request_id=request.request_id,
                token_ids=request.all_token_ids,
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params,
                block_ids=block_ids,
                num_computed_tokens=request.num_computed_tokens,
                structured=request.structured,
                mm_inputs=request.mm_inputs,
                lora=request.lora,
            )
        )
        self.budget -= n
        request.num_computed_tokens += n

    def undo(self, request: Request) -> None:
        """Take back a running request scheduled earlier in this step (it is being preempted)."""
        n = self.num_tokens.pop(request.request_id, None)
        if n is None:
            return
        self.spec_tokens.pop(request.request_id, None)
        self.undo_encoder(request)
        self.budget += n
        request.num_computed_tokens -= n
        # In place: the scheduler loop holds a reference to this list.
        self.cached_reqs[:] = [c for c in self.cached_reqs if c.request_id != request.request_id]

    def undo_encoder(self, request: Request) -> None:
        """Give back the encoder budget of the request's images planned this step."""
        for index in self.encoder_inputs.pop(request.request_id, []):
            self.encoder_budget += request.mm_inputs[index].length
