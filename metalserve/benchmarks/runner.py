"""Drive sessions against the server: Poisson arrivals, a cap on requests in flight, a progress bar."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from metalserve.benchmarks.arrivals import arrival_offsets
from metalserve.benchmarks.client import Message, RequestOutcome, RequestSettings, send_request
from metalserve.benchmarks.samples import Session
from metalserve.benchmarks.tokenizer import TokenCounter


@dataclass
class RequestRecord:
    """One measured request: the outcome plus where it sits and how many tokens it moved."""

    session: int
    turn: int
    prompt_len: int  # the server's count when it sent usage, else our estimate
    output_len: int  # asked for
    output_tokens: int  # the server's usage when present, else our tokenizer's count of the text
    outcome: RequestOutcome
    arrival_s: float = 0.0  # when its session was due, from the run's start (Poisson schedule)
    start_s: float = 0.0  # when this request was actually sent, from the run's start


@dataclass(frozen=True)
class RunOptions:
    """How to send: the rate of session arrivals, the cap on concurrent requests, the seed."""

    request_rate: float = float("inf")
    max_concurrency: int | None = None
    seed: int = 0
    timeout: float = 3600.0
    show_progress: bool = True


class _Run:
    """Shared state of one run: the HTTP client, the concurrency gate, the records and the bar."""

    def __init__(self, client: httpx.AsyncClient, settings: RequestSettings, tok: TokenCounter, bar: tqdm) -> None:
        self.client, self.settings, self.tok, self.bar = client, settings, tok, bar
        self.records: list[RequestRecord] = []
        self.gate: asyncio.Semaphore | None = None
        self.t0 = time.perf_counter()

    async def one(self, messages: list[Message], max_tokens: int) -> RequestOutcome:
        if self.gate is None:
            return await send_request(self.client, self.settings, messages, max_tokens)
        async with self.gate:
            return await send_request(self.client, self.settings, messages, max_tokens)

    async def session(self, index: int, session: Session, delay: float) -> None:
        await asyncio.sleep(delay)
        history: list[Message] = [{"role": "system", "content": session.system}] if session.system else []
        history_len = session.system_len
        for t, turn in enumerate(session.turns):
            messages = [*history, {"role": "user", "content": turn.text}]
            out = await self.one(messages, turn.output_len)
            est_prompt = history_len + turn.prompt_len
            produced = out.completion_tokens
            if produced is None:
                produced = len(self.tok.encode(out.text)) if out.success else 0
            self.records.append(
                RequestRecord(
                    index,
                    t,
                    out.prompt_tokens or est_prompt,
                    turn.output_len,
                    produced,
                    out,
                    arrival_s=delay,
                    start_s=out.start - self.t0,
                )
            )
            self.bar.update(1)
            if not out.success:
                return  # the rest of a conversation depends on this answer
            history = [*messages, {"role": "assistant", "content": out.text}]
            history_len = est_prompt + produced


def _client(base_url: str, timeout: float, concurrency: int | None) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency or 1000, max_keepalive_connections=concurrency or 1000)
    return httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=httpx.Timeout(timeout), limits=limits)


async def run_sessions(
    base_url: str, settings: RequestSettings, sessions: list[Session], tok: TokenCounter, opts: RunOptions
) -> tuple[list[RequestRecord], float]:
    """Send every session; returns the records (in completion order) and the wall time of the run."""
    if opts.max_concurrency is not None and opts.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    total = sum(s.num_requests for s in sessions)
    offsets = arrival_offsets(len(sessions), opts.request_rate, opts.seed)
    with tqdm(total=total, disable=not opts.show_progress, unit="req") as bar:
        async with _client(base_url, opts.timeout, opts.max_concurrency) as client:
            run = _Run(client, settings, tok, bar)
            if opts.max_concurrency:
                run.gate = asyncio.Semaphore(opts.max_concurrency)
            start = run.t0 = time.perf_counter()
            await asyncio.gather(
                *(run.session(i, s, d) for i, (s, d) in enumerate(zip(sessions, offsets, strict=True)))
            )
            duration = time.perf_counter() - start
    return run.records, duration


async def warm_up(base_url: str, settings: RequestSettings, sessions: list[Session], timeout: float) -> int:
    """Send the warm-up sessions' first turns one by one; returns how many failed (not measured)."""
    failed = 0
    async with _client(base_url, timeout, 1) as client:
        for s in sessions:
            messages: list[Message] = [{"role": "system", "content": s.system}] if s.system else []
            messages.append({"role": "user", "content": s.turns[0].text})
            out = await send_request(client, settings, messages, s.turns[0].output_len)
            failed += not out.success
    return failed
