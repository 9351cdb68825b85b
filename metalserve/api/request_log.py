"""The status page's recent requests: each engine request's sizes and latencies, kept in a short ring."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

from metalserve.engine.request_output import RequestOutput

RECENT_REQUESTS = 50


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    model: str
    status: str  # the finish reason, "aborted" (the client left or pressed stop) or "error"
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None  # mean time per output token after the first
    e2e_s: float
    ended_at: float  # wall-clock seconds

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RequestRecorder:
    """The last `RECENT_REQUESTS` finished requests of every model, newest first."""

    def __init__(self, size: int = RECENT_REQUESTS) -> None:
        self._records: collections.deque[RequestRecord] = collections.deque(maxlen=size)
        self._lock = threading.Lock()
        self.total = 0

    def add(self, record: RequestRecord) -> None:
        with self._lock:
            self._records.appendleft(record)
            self.total += 1

    def recent(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._records)

    async def recorded(
        self, stream: AsyncIterator[RequestOutput], model: str, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """`stream` as it is, recording the request when it ends (closing this closes, so aborts, it)."""
        started = time.monotonic()
        first: float | None = None
        last: RequestOutput | None = None
        status = "aborted"
        try:
            async for out in stream:
                if first is None and out.num_output_tokens:
                    first = time.monotonic()
                last = out
                if out.finished:
                    status = out.finish_reason or "stop"
                yield out
        except Exception:
            status = "error"
            raise
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
            self.add(_record(request_id, model, status, last, started, first))


def _record(
    request_id: str, model: str, status: str, last: RequestOutput | None, started: float, first: float | None
) -> RequestRecord:
    ended = time.monotonic()
    outputs = last.num_output_tokens if last else 0
    tpot = (ended - first) / (outputs - 1) if first is not None and outputs > 1 else None
    return RequestRecord(
        request_id=request_id,
        model=model,
        status=status,
        prompt_tokens=last.num_prompt_tokens if last else 0,
        cached_tokens=last.num_cached_tokens if last else 0,
        output_tokens=outputs,
        ttft_s=None if first is None else first - started,
        tpot_s=tpot,
        e2e_s=ended - started,
        ended_at=time.time(),
    )
