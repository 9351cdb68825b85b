"""The asyncio front of the engine: requests in through a command queue, outputs back through queues.

The core is synchronous and slow (a forward takes tens of milliseconds or more), so it runs on the
engine thread (engine_thread.py), the one that loaded the model and built the core; the event loop only
enqueues commands and awaits per-request queues, so HTTP stays responsive during a forward. Only the
engine thread touches the core.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from metalserve.engine.commands import Abort, Add, Call, Command, Crash, FailAll, Stop
from metalserve.engine.detokenizer import IncrementalDetokenizer
from metalserve.engine.engine_thread import EngineThread
from metalserve.engine.errors import ClientTooSlowError, EngineDeadError, EngineDrainingError, GrammarFailedError
from metalserve.engine.protocol import EngineCoreProtocol
from metalserve.engine.request_output import EngineObserver, IterationStats, RequestOutput
from metalserve.engine.request_state import RequestState, count_prefill, hand_over, make_output
from metalserve.lora.files import AdapterError
from metalserve.lora.request import LoraRequest
from metalserve.multimodal.inputs import MultiModalInput
from metalserve.outputs import EngineCoreOutput
from metalserve.pooling_params import PoolingModel
from metalserve.request import Request
from metalserve.sampling_params import SamplingParams
from metalserve.structured.compiler import GrammarCompiler, GrammarError
from metalserve.structured.limits import GrammarLimits
from metalserve.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from metalserve.multimodal.processor import ImageProcessor

__all__ = [
    "AsyncEngine",
    "ClientTooSlowError",
    "EngineDeadError",
    "EngineDrainingError",
    "EngineObserver",
    "IterationStats",
    "RequestOutput",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Idle this long after the last request ended, the engine hands MLX's buffer cache and the freed heap
# back (core.release_idle_memory); a client sending one request after another keeps its warm buffers.
IDLE_RELEASE_S = 2.0
# Idle this long after the last step, it cuts the KV pool back to what it started with (core.shrink_kv_pool): a pool
# grows by doubling in a burst, and a server that idles between bursts a minute apart should not hold
# the largest one for ever, nor copy the pool back and forth between requests seconds apart.
KV_SHRINK_IDLE_S = 30.0
DEAD_MESSAGE = "the engine stopped after an internal error (the server log has the details)"


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
        thread: EngineThread | None = None,
        image_processor: ImageProcessor | None = None,
        grammar_limits: GrammarLimits | None = None,
    ) -> None:
        """`thread`: the thread that built `core` (EngineThread.call), where its steps run; None: a new
        one (for a core that holds no MLX arrays, or whose every array is already evaluated);
        `image_processor`: a vision-language model's (multimodal/processor.py), None for a text model;
        `grammar_limits`: the server's limits on structured-output grammars (None: the defaults)."""
        self.core = core
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chat_template = chat_template
        self.image_processor = image_processor
        self.observer = observer
        self.dead_error: BaseException | None = None
        self.on_dead: Callable[[], None] | None = None  # called on the worker thread once the core failed
        self.draining = False
        self._commands: queue.Queue[Command] = queue.Queue()
        self._states: dict[str, RequestState] = {}  # worker thread only
        self._active_ids: set[str] = set()  # event loop only
        self._engine_thread = thread
        self._owns_thread = thread is None
        self._loop: Future[None] | None = None  # the step loop's run on the engine thread
        self._grammar: GrammarCompiler | None = None
        self.grammar_limits = GrammarLimits() if grammar_limits is None else grammar_limits

    @property
    def is_running(self) -> bool:
        return self._loop is not None and not self._loop.done() and self.dead_error is None

    @property
    def num_active_requests(self) -> int:
        return len(self._active_ids)

    def start(self) -> None:
        """Start the step loop on the engine thread (idempotent)."""
        if self._loop is not None:
            return
        if self._engine_thread is None:
            self._engine_thread = EngineThread()
        self._loop = self._engine_thread.submit(self._run)

    def begin_drain(self) -> None:
        """Refuse new requests from now on; running ones go on (graceful shutdown)."""
        self.draining = True

    def fail_open_requests(self, message: str) -> None:
        """End every open request with an error (the grace period of a shutdown ran out)."""
        self._commands.put(FailAll(EngineDrainingError(message)))

    def crash(self, error: BaseException) -> None:
        """Fail the engine from another thread (a pipeline watchdog): as if the core had raised `error`."""
        self._commands.put(Crash(error))
        self.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the worker after its current step; pending requests end with EngineDeadError.

        A step that does not end within `timeout` seconds is left behind (the thread is a daemon)."""
        if self._loop is None:
            return
        self._commands.put(Stop())
        loop, self._loop = self._loop, None
        try:
            await asyncio.wait_for(asyncio.wrap_future(loop), timeout)
            if self._owns_thread and self._engine_thread is not None:
                self._engine_thread.close()
                self._engine_thread = None
        except asyncio.TimeoutError:
            logger.error("the engine's step did not end within %.0f s of shutdown; leaving it", timeout)

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        mm_inputs: list[MultiModalInput] | None = None,
        lora: LoraRequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its deltas; closing the iterator early aborts the request.
        `mm_inputs`: its images (placeholders in the prompt; a vision-language model's).

        Deltas that queued up while the reader was busy come merged into one."""
        state = self._submit(prompt_token_ids, sampling_params, request_id, priority, cache_salt, mm_inputs or [], lora)
        finished = False
        pending: RequestOutput | BaseException | None = None
        try:
            while True:
                item = pending if pending is not None else await state.loop_queue.get()
                pending = None
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                while not item.finished and not state.loop_queue.empty():
                    later = state.loop_queue.get_nowait()
                    if isinstance(later, BaseException):
                        pending = later
                        break
                    item = item.merged_with(later)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._active_ids.discard(request_id)
            if not finished:
                self._commands.put(Abort([request_id]))

    def _submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int,
        cache_salt: str | None,
        mm_inputs: list[MultiModalInput],
        lora: LoraRequest | None = None,
    ) -> RequestState:
        if self.dead_error is not None:
            raise EngineDeadError(DEAD_MESSAGE)
        if self.draining:
            raise EngineDrainingError("the server is shutting down")
        if request_id in self._active_ids:
            raise ValueError(f"request id {request_id!r} is already running")
        self.start()
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            cache_salt=cache_salt,
            mm_inputs=list(mm_inputs),
            lora=lora,
        )
        if params.structured_outputs is not None:
            request.structured = self.grammar.make_state(params.structured_outputs)
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params)

        def on_overflow() -> None:
            self._commands.put(Abort([request_id]))

        loop = asyncio.get_running_loop()
        state = RequestState(loop, asyncio.Queue(), detok, len(request.prompt_token_ids), on_overflow, request=request)
        self._active_ids.add(request_id)
        self._commands.put(Add(request, state))
        return state

    @property
    def pooling(self) -> PoolingModel | None:
        """A pooling model's defaults (embeddings, score, rerank); None: a generating model."""
        pooling = getattr(self.core, "pooling", None)  # pipeline stages and stand-ins have none
        return pooling if isinstance(pooling, PoolingModel) else None

    @property
    def grammar(self) -> GrammarCompiler:
        """The grammar compile cache for this tokenizer (made on first use)."""
        if self._grammar is None:
            self._grammar = GrammarCompiler(self.tokenizer, limits=self.grammar_limits)
        return self._grammar

    async def check_structured(self, params: StructuredOutputsParams, *, keep_on_timeout: bool = False) -> None:
        """Compile the spec (off the event loop and the engine thread); GrammarError when it is invalid
        or takes longer than the limit to compile. The limit times the spec's own compile: the one-off
        build of the grammar engine's vocabulary comes first, untimed. A spec past the limit is dropped
        from the cache when it ends, unless `keep_on_timeout` (a server-made grammar, such as the tool-call
        grammar agents send again every turn: it finishes in the background for the next request)."""
        await asyncio.wrap_future(self.grammar.tokenizer_ready())
        future = self.grammar.submit(params)
        timeout = self.grammar.limits.grammar_compile_timeout
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)
        except TimeoutError:
            if not keep_on_timeout:
                self.grammar.forget(params)
            raise GrammarError(
                params.kind, f"the grammar did not compile within {timeout:g} s (--grammar-compile-timeout)"
            ) from None

    def lora_requests(self) -> dict[str, LoraRequest]:
        """The LoRA adapters loaded now, by name (a snapshot of the engine thread's table)."""
        lookup = getattr(self.core, "lora_requests", None)
        return lookup() if lookup is not None else {}

    async def between_steps(self, fn: Callable[[], T]) -> T:
        """`fn()` on the engine thread between two steps (it may touch the model's MLX arrays)."""
        if self.dead_error is not None:
            raise EngineDeadError(DEAD_MESSAGE)
        self.start()
        future: Future[T] = Future()
        self._commands.put(Call(fn, future))
        return await asyncio.wrap_future(future)

    async def load_lora(self, name: str, path: str) -> None:
        """Load a LoRA adapter between steps; AdapterError (a ValueError) says why it cannot be."""
        load = getattr(self.core, "load_lora", None)
        if load is None:
            raise AdapterError("this engine serves no LoRA adapters")
        await self.between_steps(lambda: load(name, path))

    async def unload_lora(self, name: str) -> None:
        unload = getattr(self.core, "unload_lora", None)
        if unload is None:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded")
        await self.between_steps(lambda: unload(name))

    def prompt_progress(self, request_id: str) -> tuple[int, int] | None:
        """(prompt tokens prefilled so far, prompt tokens) of a running request; None once it ended.
        Read on the event loop while the worker thread advances it: a snapshot."""
        state = self._states.get(request_id)
        return None if state is None else (state.prompt_done, state.num_prompt_tokens)

    async def abort(self, request_id: str) -> None:
        """Abort a request (a client went away); its blocks are freed before the next step."""
        self._commands.put(Abort([request_id]))

    # ---- worker thread ----

    def _run(self) -> None:
        held = False  # a busy period's buffers not yet handed back
        grown = False  # the KV pool not yet cut back after a busy period
        last_step = time.monotonic()
        try:
            while True:
                idle = not self.core.has_unfinished_requests()
                if idle and held and not self._next_command_within(IDLE_RELEASE_S):
                    self._release_idle_memory()  # idle a while: give back what the burst held, once
                    held = False
                    grown = True
                    continue  # on to the pool's longer wait
                if idle and grown:
                    left = KV_SHRINK_IDLE_S - (time.monotonic() - last_step)  # commands do not restart it
                    if left <= 0 or not self._next_command_within(left):
                        self._call_core("shrink_kv_pool")  # idle a good while longer: the KV pool too
                        grown = False
                if not self._apply_commands(block=idle):
                    break
                if self.core.has_unfinished_requests():
                    held = True
                    self._process(self.core.step())
                    last_step = time.monotonic()
        except BaseException as exc:  # the core is broken: fail everyone, refuse new work
            logger.exception("engine core failed")
            self.dead_error = exc
            self._fail_all(EngineDeadError(DEAD_MESSAGE))
            if self.on_dead is not None:
                self.on_dead()
            return
        self._fail_all(EngineDeadError("engine is shutting down"))
        close = getattr(self.core, "close", None)
        if close is not None:  # e.g. the KV disk tier finishes its queued saves
            close()

    def _next_command_within(self, seconds: float) -> bool:
        """Wait up to `seconds` for a command to arrive (without taking it)."""
        with self._commands.not_empty:
            return self._commands.not_empty.wait_for(lambda: len(self._commands.queue) > 0, seconds)

    def _release_idle_memory(self) -> None:
        self._call_core("release_idle_memory")

    def _call_core(self, name: str) -> None:
        """A core's optional idle hook (fakes and pipeline cores may lack it)."""
        hook = getattr(self.core, name, None)
        if callable(hook):
            hook()

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands; False once a stop command arrives."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if isinstance(command, Stop):
                return False
            if isinstance(command, Crash):
                raise command.error
            if isinstance(command, Add):
                self._add(command.request, command.state)
            elif isinstance(command, Call):
                _run_call(command)
            elif isinstance(command, Abort):
                ids = [rid for rid in command.request_ids if self._states.pop(rid, None) is not None]
                if ids:
                    self.core.abort_requests(ids)
                    if self.observer is not None:  # the gauges must not show aborted requests running
                        self.observer.on_step(self.core.make_stats(), IterationStats())
            else:
                if self._states:
                    self.core.abort_requests(list(self._states))
                self._fail_all(command.error)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request: Request, state: RequestState) -> None:
        try:
            self.core.add_request(request)
        except Exception as exc:  # a request the core refuses (or cannot hash) fails alone
            hand_over([(state, exc)])
            return
        self._states[request.request_id] = state

    def _process(self, outputs: list[EngineCoreOutput]) -> None:
        """Detokenize this step's outputs, finish requests that hit a stop string, hand results over."""
        now = time.monotonic()
        iteration = IterationStats()
        deliveries: list[tuple[RequestState, RequestOutput | BaseException]] = []
        stopped: list[str] = []
        count_prefill(self._states.values(), iteration)
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:
                continue  # aborted or already finished by a stop string
            result: RequestOutput | BaseException
            try:
                result = make_output(out, state, now, iteration)
                if out.finish_reason == "error":
                    result = GrammarFailedError(f"the output could not follow its grammar: {out.stop_reason}")
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
        hand_over(deliveries)
        if self.observer is not None:
            self.observer.on_step(self.core.make_stats(), iteration)

    def _fail_all(self, error: BaseException) -> None:
        deliveries: list[tuple[RequestState, RequestOutput | BaseException]] = [
            (state, error) for state in self._states.values()
        ]
        self._states.clear()
        hand_over(deliveries)


def _run_call(call: Call) -> None:
    try:
        call.future.set_result(call.fn())
    except Exception as exc:  # the caller's error (a bad adapter), not the engine's
        call.future.set_exception(exc)
