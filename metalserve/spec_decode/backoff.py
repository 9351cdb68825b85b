"""Back-off: a request whose drafts keep failing stops drafting for a while, so speculation costs little.

Each verified window updates the request's per-token acceptance (an exponential average of accepted
drafts over the drafts tested: the accepted ones and the first refused one).
Below `MIN_ACCEPTANCE` the request pauses drafting for a cool-down that doubles each time it happens
again (up to `MAX_COOLDOWN` steps), then tries again from a neutral average. A new request starts from
the acceptance of recent windows of all requests: on a workload whose drafts fail (random chat), its
first windows are short or none, instead of k drafts that fail in a compute-bound batch.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_ACCEPTANCE = 0.3
EMA_WEIGHT = 0.35  # weight of the newest window
PRIOR_WEIGHT = 0.05  # weight of the newest window in the all-requests average a new request starts from
FIRST_COOLDOWN = 4
MAX_COOLDOWN = 128
RESTART_ACCEPTANCE = 0.5


@dataclass
class _Track:
    acceptance: float  # starts from all requests' average (BackOff.prior)
    cooldown: int = FIRST_COOLDOWN
    paused_for: int = 0


class BackOff:
    """Per-request acceptance tracking; `may_draft` is asked once per sampled step."""

    def __init__(self) -> None:
        self._tracks: dict[str, _Track] = {}
        self.prior = 1.0  # optimistic until windows are seen: the first ones decide

    def may_draft(self, request_id: str) -> bool:
        track = self._tracks.get(request_id)
        if track is None or track.paused_for == 0:
            return True
        track.paused_for -= 1
        return False

    def acceptance(self, request_id: str) -> float:
        """The request's recent per-token acceptance (before its first window: all requests')."""
        track = self._tracks.get(request_id)
        return self.prior if track is None else track.acceptance

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        if num_drafted < 1:
            return
        track = self._tracks.setdefault(request_id, _Track(acceptance=self.prior))
        # Per-token acceptance: the accepted drafts out of those tested (the first refused one ends a window).
        rate = num_accepted / (num_accepted + (num_accepted < num_drafted))
        self.prior = (1 - PRIOR_WEIGHT) * self.prior + PRIOR_WEIGHT * rate
        track.acceptance = (1 - EMA_WEIGHT) * track.acceptance + EMA_WEIGHT * rate
        if track.acceptance < MIN_ACCEPTANCE:
            track.paused_for = track.cooldown
            track.cooldown = min(2 * track.cooldown, MAX_COOLDOWN)
            track.acceptance = RESTART_ACCEPTANCE

    def forget(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)
