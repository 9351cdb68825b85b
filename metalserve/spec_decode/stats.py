"""Cumulative draft counters, as vLLM reports them (drafts, draft tokens, accepted, accepted per position)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingCounter:
    num_drafts: int = 0  # windows verified (request-steps with at least one draft)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: windows whose draft i was accepted

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos.extend([0] * (num_drafted - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
