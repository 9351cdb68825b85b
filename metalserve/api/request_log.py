"""The status page's requests: each finished engine request's sizes and latencies, kept in a short ring,
and the running ones with their prefill progress (the page shows it while the first token is awaited)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import AsyncIterator, Callable
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
    kind: str = "generate"  # or "pooling": an embedding, score or rerank input (one vector, no tokens out)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# The engine's (prompt tokens prefilled, prompt tokens) of a running request, None once it ended.
ProgressReader = Callable[[str], "tuple[int, int] | None"]


@dataclass
class RunningRequest:
    request_id: str
    model: str
    prompt_tokens: int
    started: float  # monotonic
    progress: ProgressReader | None
    output_tokens: int = 0
    kind: str = "generate"

    def to_dict(self, now: float) -> dict[str, Any]:
        got = self.progress(self.request_id) if self.progress is not None else None
        done = got[0] if got is not None else (self.prompt_tokens if self.output_tokens else 0)
        return {
            "request_id": self.request_id,
            "model": self.model,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_done": done,
            "output_tokens": self.output_tokens,
            "elapsed_s": round(now - self.started, 2),
            "kind": self.kind,
        }


class RequestRecorder:
    """The last `RECENT_REQUESTS` finished requests of every model, newest first, and the running ones."""

    def __init__(self, size: int = RECENT_REQUESTS) -> None:
        self._records: collections.deque[RequestRecord] = collections.deque(maxlen=size)
        self._running: dict[str, RunningRequest] = {}  # event loop only
        self._lock = threading.Lock()
        self.total = 0
        self.pooling_total = 0  # of `total`

    def running(self, response_id: str | None = None) -> list[dict[str, Any]]:
        """The running requests, oldest first; with `response_id`, that response's (its one request, or
        `<id>-<i>` for each of several samples)."""
        now = time.monotonic()
        items = list(self._running.items())
        if response_id is not None:
            items = [(rid, r) for rid, r in items if rid == response_id or rid.startswith(response_id + "-")]
        return [r.to_dict(now) for _, r in items]

    def add(self, record: RequestRecord) -> None:
        with self._lock:
            self._records.appendleft(record)
            self.total += 1
            self.pooling_total += record.kind == "pooling"

    def recent(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._records)

    async def recorded(
        self,
        stream: AsyncIterator[RequestOutput],
        model: str,
        request_id: str,
        prompt_tokens: int = 0,
        progress: ProgressReader | None = None,
        kind: str = "generate",
    ) -> AsyncIterator[RequestOutput]:
        """`stream` as it is, listed as running until it ends and then recorded (closing this closes, so
        aborts, it). `prompt_tokens`: the prompt's length, which a request aborted before its first output
        reports too; `progress`: the engine's prefill progress (AsyncEngine.prompt_progress); `kind`: "generate"
        or "pooling"."""
        started = time.monotonic()
        first: float | None = None
        last: RequestOutput | None = None
        status = "aborted"
        running = RunningRequest(request_id, model, prompt_tokens, started, progress, kind=kind)
        self._running[request_id] = running
        try:
            async for out in stream:
                if first is None and out.num_output_tokens:
                    first = time.monotonic()
                last = out
                running.output_tokens = out.num_output_tokens
                if out.finished:
                    status = out.finish_reason or "stop"
                yield out
        except Exception:
            status = "error"
            raise
        finally:
            self._running.pop(request_id, None)
            await stream.aclose()  # type: ignore[attr-defined]
            self.add(_record(request_id, model, status, last, started, first, prompt_tokens, kind))


def _record(
    request_id: str,
    model: str,
    status: str,
    last: RequestOutput | None,
    started: float,
    first: float | None,
    prompt_tokens: int,
    kind: str,
) -> RequestRecord:
    ended = time.monotonic()
    outputs = last.num_output_tokens if last else 0
    tpot = (ended - first) / (outputs - 1) if first is not None and outputs > 1 else None
    return RequestRecord(
        request_id=request_id,
        model=model,
        status=status,
        prompt_tokens=last.num_prompt_tokens if last else prompt_tokens,
        cached_tokens=last.num_cached_tokens if last else 0,
        output_tokens=outputs,
        ttft_s=None if first is None else first - started,
        tpot_s=tpot,
        e2e_s=ended - started,
        ended_at=time.time(),
        kind=kind,
    )
