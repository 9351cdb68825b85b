"""How many drafts each request gets next step: per-request back-off, then the batch's step cost.

One controller serves every proposer (n-gram, draft model): the runner tells it each verified window
and each decode step's time, and asks it for the next step's limits before the proposer drafts. A
request planned no drafts for `PROBE_EVERY` steps in a row may draft one, so a workload that turns
predictable (or a batch that shrinks) is noticed even where the estimates said drafting would not pay;
not where even a sure draft could not pay (a draft model as slow as the target).
"""

from __future__ import annotations

from collections.abc import Sequence

from metalserve.spec_decode.backoff import BackOff
from metalserve.spec_decode.cost import StepCostModel, drafts_can_pay, plan_drafts

PROBE_EVERY = 32
DEPTH_WEIGHT = 0.2  # weight of the newest proposal in the average cost of one draft position


class DraftController:
    def __init__(self) -> None:
        self.backoff = BackOff()
        self.cost = StepCostModel()
        self._idle: dict[str, int] = {}  # steps in a row a request was planned no drafts
        self.depth_cost = 0.0  # seconds the proposer takes per draft position of its deepest window

    def record_window(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        self.backoff.record(request_id, num_drafted, num_accepted)

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """A step of decode and draft tokens only (no prefill chunk) took `seconds`."""
        self.cost.record(num_tokens, seconds)

    def record_proposal(self, depth: int, seconds: float) -> None:
        """The proposer took `seconds` to draft windows of at most `depth` tokens."""
        if depth > 0:
            self.depth_cost = (1 - DEPTH_WEIGHT) * self.depth_cost + DEPTH_WEIGHT * seconds / depth

    def limits(self, request_ids: Sequence[str], base_tokens: int, k: int) -> dict[str, int]:
        """The most drafts (up to `k`) each request may get in a step of `base_tokens` tokens besides
        the drafts; requests in back-off get none."""
        drafting = [rid for rid in request_ids if self.backoff.may_draft(rid)]
        acceptance = {rid: self.backoff.acceptance(rid) for rid in drafting}
        fit = self.cost.fit()
        limits = plan_drafts(acceptance, k, fit, base_tokens, self.depth_cost)
        probe = k > 0 and drafts_can_pay(fit, base_tokens, len(request_ids), self.depth_cost)
        for rid, n in limits.items():
            idle = 0 if n else self._idle.get(rid, 0) + 1
            if idle >= PROBE_EVERY and probe:
                limits[rid], idle = 1, 0
            self._idle[rid] = idle
        return limits

    def forget(self, request_id: str) -> None:
        self.backoff.forget(request_id)
        self._idle.pop(request_id, None)
