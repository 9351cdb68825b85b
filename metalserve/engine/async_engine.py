"""The asyncio front of the engine: requests in through a command queue, outputs back through queues.

The core is synchronous and slow (a forward takes tens of milliseconds or more), so it runs in a
worker thread that we own; the event loop only enqueues commands and awaits per-request queues, so
HTTP stays responsive during a forward. Only the worker thread touches the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from metalserve.engine.detokenizer import IncrementalDetokenizer
from metalserve.engine.protocol import EngineCoreProtocol, SchedulerStatsLike
from metalserve.outputs import EngineCoreOutput, TokenLogprob
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.structured.compiler import GrammarCompiler
from metalserve.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core raised; no request can be served any more."""


@dataclass
class RequestOutput:
    """A delta for one request as the serving layer sees it: new text, new tokens, and the end."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int  # cumulative

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class IterationStats:
    """What one step produced, for the metrics: token counts and latencies in seconds."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[tuple[str, float]] = field(default_factory=list)  # (finish_reason, e2e latency)


class EngineObserver(Protocol):
    """Receives the scheduler snapshot and the iteration stats after every step (worker thread)."""

    def on_step(self, scheduler_stats: SchedulerStatsLike, iteration: IterationStats) -> None: ...


@dataclass
class _RequestState:
    loop: asyncio.AbstractEventLoop  # the caller's loop: results are handed over on it
    loop_queue: asyncio.Queue[RequestOutput | BaseException]
    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    last_token_time: float = 0.0
    num_output_tokens: int = 0


_Command = tuple[str, Any, Any]


class AsyncEngine:
    """Feeds requests to an `EngineCoreProtocol` in a worker thread and streams `RequestOutput`s back."""

    def __init__(
        self,
        core: EngineCoreProtocol,
        tokenizer: Any,
        *,
        model_name: str,
        max_model_len: int,
        eos_token_ids: frozenset[int] | set[int] | list[int],
        chat_template: str | None = None,
        observer: EngineObserver | None = None,
    ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chat_template = chat_template
        self.observer = observer
        self.dead_error: BaseException | None = None
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._states: dict[str, _RequestState] = {}  # worker thread only
        self._active_ids: set[str] = set()  # event loop only
        self._thread: threading.Thread | None = None
        self._grammar: GrammarCompiler | None = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="metalserve-engine-core", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the worker after its current step; pending requests end with EngineDeadError."""
        if self._thread is None:
            return
        self._commands.put(("stop", None, None))
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its deltas; closing the iterator early aborts the request."""
        if self.dead_error is not None:
            raise EngineDeadError(f"engine is dead: {self.dead_error!r}")
        if request_id in self._active_ids:
            raise ValueError(f"request id {request_id!r} is already running")
        self.start()
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            cache_salt=cache_salt,
        )
        if sampling_params.structured_outputs is not None:
            request.structured = self.grammar.make_state(sampling_params.structured_outputs)
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, sampling_params)
        state = _RequestState(asyncio.get_running_loop(), asyncio.Queue(), detok, len(request.prompt_token_ids))
        self._active_ids.add(request_id)
        self._commands.put(("add", request, state))
        finished = False
        try:
            while True:
                item = await state.loop_queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._active_ids.discard(request_id)
            if not finished:
                self._commands.put(("abort", [request_id], None))

    @property
    def grammar(self) -> GrammarCompiler:
        """The grammar compile cache for this tokenizer (made on first use)."""
        if self._grammar is None:
            self._grammar = GrammarCompiler(self.tokenizer)
        return self._grammar

    async def check_structured(self, params: StructuredOutputsParams) -> None:
        """Compile the spec (off the event loop and the engine thread); GrammarError when it is invalid."""
        await asyncio.wrap_future(self.grammar.submit(params))

    async def abort(self, request_id: str) -> None:
        """Abort a request (a client went away); its blocks are freed before the next step."""
        self._commands.put(("abort", [request_id], None))

    # ---- worker thread ----

    def _run(self) -> None:
        try:
            while self._apply_commands(block=not self.core.has_unfinished_requests()):
                if self.core.has_unfinished_requests():
                    self._process(self.core.step())
        except BaseException as exc:  # the core is broken: fail everyone, refuse new work
            logger.exception("engine core failed")
            self.dead_error = exc
            self._fail_all(EngineDeadError(f"engine core failed: {exc!r}"))
            return
        self._fail_all(EngineDeadError("engine is shutting down"))

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued adds and aborts; False once a stop command arrives."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            kind, payload, extra = command
            if kind == "stop":
                return False
            if kind == "add":
                self._add(payload, extra)
            elif kind == "abort":
                ids = [rid for rid in payload if self._states.pop(rid, None) is not None]
                if ids:
                    self.core.abort_requests(ids)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request: Request, state: _RequestState) -> None:
        try:
            self.core.add_request(request)
        except Exception as exc:  # a request the core refuses fails alone
            _hand_over([(state, exc)])
            return
        self._states[request.request_id] = state

    def _process(self, outputs: list[EngineCoreOutput]) -> None:
        """Detokenize this step's outputs, finish requests that hit a stop string, hand results over."""
        now = time.monotonic()
        iteration = IterationStats()
        deliveries: list[tuple[_RequestState, RequestOutput | BaseException]] = []
        stopped: list[str] = []
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:
                continue  # aborted or already finished by a stop string
            result: RequestOutput | BaseException
            try:
                result = self._make_output(out, state, now, iteration)
            except Exception as exc:  # a broken request must not take the engine down
                logger.exception("output processing failed for %s", out.request_id)
                result = exc
                if not out.finished:
                    self.core.abort_requests([out.request_id])
            if isinstance(result, BaseException) or result.finished:
                self._states.pop(out.request_id, None)
                if isinstance(result, RequestOutput) and not out.finished:
                    stopped.append(out.request_id)  # the detokenizer found a stop string
            deliveries.append((state, result))
        if stopped:
            self.core.finish_requests(stopped)
        _hand_over(deliveries)
        if self.observer is not None:
            self.observer.on_step(self.core.make_stats(), iteration)

    def _make_output(
        self, out: EngineCoreOutput, state: _RequestState, now: float, iteration: IterationStats
    ) -> RequestOutput:
        n_new = len(out.new_token_ids)
        if n_new:
            if state.num_output_tokens == 0:
                iteration.num_prompt_tokens += state.num_prompt_tokens
                iteration.time_to_first_tokens.append(now - state.arrival_time)
            else:
                iteration.inter_token_latencies.append((now - state.last_token_time) / n_new)
            state.last_token_time = now
            state.num_output_tokens += n_new
            iteration.num_generation_tokens += n_new
        detok = state.detokenizer
        text = detok.update(out.new_token_ids, finished=out.finished)
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if detok.stop_reason is not None:
            finish_reason, stop_reason = "stop", detok.stop_reason
        if finish_reason is not None:
            iteration.finished.append((finish_reason, now - state.arrival_time))
        return RequestOutput(
            request_id=out.request_id,
            text=text,
            token_ids=list(out.new_token_ids),
            logprobs=out.new_logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=out.num_prompt_tokens or state.num_prompt_tokens,
            num_cached_tokens=max(out.num_cached_tokens, 0),
            num_output_tokens=state.num_output_tokens,
        )

    def _fail_all(self, error: BaseException) -> None:
        deliveries: list[tuple[_RequestState, RequestOutput | BaseException]] = [
            (state, error) for state in self._states.values()
        ]
        self._states.clear()
        _hand_over(deliveries)


_Delivery = tuple[_RequestState, RequestOutput | BaseException]


def _hand_over(deliveries: list[_Delivery]) -> None:
    """Queue results on their callers' event loops, one call per loop (usually there is one loop)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Delivery]] = {}
    for delivery in deliveries:
        by_loop.setdefault(delivery[0].loop, []).append(delivery)
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is waiting any more
            loop.call_soon_threadsafe(_deliver, items)


def _deliver(deliveries: list[_Delivery]) -> None:
    for state, item in deliveries:
        state.loop_queue.put_nowait(item)
