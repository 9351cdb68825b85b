"""Several models behind one server: served names to engines, loaded on first use, unloaded when idle or
when memory is needed (least recently used first, pinned never), within one memory budget.

Each loaded model has its own engine core (scheduler, KV pool, runner) on its own engine thread, and that
thread loads the model too (serving/model_thread.py): every MLX array of a model is made, stepped and freed
on one thread. Everything here runs on the event loop; a lease keeps a model loaded while a request
(streamed answers included) is using it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, TypeVar

from metalserve.engine.async_engine import AsyncEngine
from metalserve.engine.engine_thread import EngineThread
from metalserve.engine.errors import shown_name
from metalserve.serving.model_spec import ModelSpec
from metalserve.serving.model_thread import EngineLoader, LoadedEngine, start_engine_thread
from metalserve.units import format_bytes

logger = logging.getLogger("metalserve.registry")

S = TypeVar("S")  # what the frontend builds per loaded model (its serving classes)
BUSY_POLL_S = 0.05  # how often a load waiting for room checks whether a busy model went idle


class ModelState(str, Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


class ModelRegistryError(Exception):
    """A request the registry cannot serve: `status` is the HTTP status (404 unknown, 503 no room)."""

    def __init__(self, message: str, status: int, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class ModelSlot(Generic[S]):
    """One served model and, while loaded, its engine and serving classes."""

    spec: ModelSpec
    estimate: int  # bytes expected before the first load (weights files + KV given); then the measured
    state: ModelState = ModelState.UNLOADED
    loaded: LoadedEngine | None = None
    serving: S | None = None
    footprint: int | None = None  # measured at the last load: weights + the KV pool's full size
    max_model_len: int | None = None  # known once loaded
    leases: int = 0  # requests using it, or waiting for its load
    last_used: float = field(default_factory=time.monotonic)
    load_task: asyncio.Task[None] | None = None
    loads: int = 0

    @property
    def engine(self) -> AsyncEngine | None:
        return self.loaded.engine if self.loaded is not None else None

    @property
    def bytes_needed(self) -> int:
        return self.footprint if self.footprint is not None else self.estimate

    @property
    def idle(self) -> bool:
        engine = self.engine
        return self.leases == 0 and (engine is None or engine.num_active_requests == 0)


class Lease(Generic[S]):
    """A request's hold on a loaded model; `release` (idempotent) lets it unload again."""

    def __init__(self, slot: ModelSlot[S], serving: S) -> None:
        self.slot = slot
        self.serving = serving
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.slot.leases -= 1
            self.slot.last_used = time.monotonic()


class ModelRegistry(Generic[S]):
    """Maps served names and aliases to model slots; loads, leases and unloads them."""

    def __init__(
        self,
        specs: list[ModelSpec],
        loader: EngineLoader,
        make_serving: Callable[[ModelSpec, AsyncEngine], S],
        *,
        on_unload: Callable[[ModelSpec], None] | None = None,
        memory_budget: int | None,
        idle_timeout: float = 0.0,
        load_timeout: float = 600.0,
        estimate: Callable[[ModelSpec], int] = lambda spec: 0,
    ) -> None:
        self.slots: list[ModelSlot[S]] = [ModelSlot(spec, estimate(spec)) for spec in specs]
        self._by_name = {name: slot for slot in self.slots for name in slot.spec.names}
        self.loader = loader
        self.make_serving = make_serving  # the frontend's serving classes for a loaded model
        self.memory_budget = memory_budget  # None: no limit (one model, sized as it always was)
        self.idle_timeout = idle_timeout  # seconds; 0: idle models stay loaded
        self.load_timeout = load_timeout
        self.on_unload = on_unload
        self.on_dead: Callable[[], None] | None = None
        self.draining = False
        self._load_lock: asyncio.Lock | None = None  # made on the event loop
        self._sweeper: asyncio.Task[None] | None = None

    @classmethod
    def of_one(
        cls,
        spec: ModelSpec,
        engine: AsyncEngine,
        make_serving: Callable[[ModelSpec, AsyncEngine], S],
        on_unload: Callable[[ModelSpec], None] | None = None,
    ) -> ModelRegistry[S]:
        """One model, loaded already (at start-up) and never unloaded: a registry of one."""

        def no_loader(_: ModelSpec, __: EngineThread) -> LoadedEngine:
            raise RuntimeError("a single-model server does not load models on demand")

        registry: ModelRegistry[S] = cls([spec], no_loader, make_serving, on_unload=on_unload, memory_budget=None)
        slot = registry.slots[0]
        slot.loaded, slot.state = LoadedEngine(engine, 0), ModelState.LOADED
        slot.serving = make_serving(spec, engine)
        slot.footprint, slot.max_model_len = 0, engine.max_model_len
        return registry

    # ---- names ----

    @property
    def names(self) -> list[str]:
        return [slot.spec.name for slot in self.slots]

    def resolve(self, model: str | None) -> ModelSlot[S]:
        """The slot a request's `model` names (absent: the first model); unknown names are a 404."""
        if model is None or model == "":
            return self.slots[0]
        slot = self._by_name.get(model)
        if slot is None:
            served = ", ".join(n for s in self.slots for n in s.spec.names)
            raise ModelRegistryError(
                f"The model `{shown_name(model)}` does not exist. Served models: {served}.", 404, "model_not_found"
            )
        return slot

    # ---- leases and loading ----

    async def acquire(self, model: str | None) -> Lease[S]:
        """The model's serving classes, loading it first if needed; hold the lease until the answer ends."""
        slot = self.resolve(model)
        if self.draining:
            raise ModelRegistryError("the server is shutting down", 503)
        slot.leases += 1  # from now on it is not unloaded under us, nor while we wait for its load
        try:
            deadline = time.monotonic() + self.load_timeout
            while slot.state is not ModelState.LOADED or slot.serving is None:
                if slot.load_task is None:
                    slot.load_task = asyncio.create_task(self._load(slot))
                    slot.load_task.add_done_callback(_retrieved)  # a waiter may have timed out: _load logged it
                left = deadline - time.monotonic()
                try:
                    await asyncio.wait_for(asyncio.shield(slot.load_task), max(left, 0.0))
                except asyncio.TimeoutError:
                    raise ModelRegistryError(
                        f"the model `{slot.spec.name}` is not loaded after {self.load_timeout:.0f} s (it is "
                        "loading, or waiting for other models' requests to end to make room); try again later",
                        503,
                    ) from None
        except BaseException:
            slot.leases -= 1
            raise
        slot.last_used = time.monotonic()
        return Lease(slot, slot.serving)

    def _lock(self) -> asyncio.Lock:
        if self._load_lock is None:
            self._load_lock = asyncio.Lock()
        return self._load_lock

    async def _load(self, slot: ModelSlot[S]) -> None:
        """Make room, load on a new engine thread, then check the measured size still fits."""
        try:
            async with self._lock():
                if slot.state is ModelState.LOADED:
                    return
                await self._make_room(slot, slot.bytes_needed)
                slot.state = ModelState.LOADING
                logger.info("loading model %s", slot.spec.name)
                started = time.monotonic()
                try:
                    loaded = await asyncio.wrap_future(start_engine_thread(slot.spec, self.loader))
                except BaseException as exc:
                    slot.state = ModelState.UNLOADED
                    logger.error("model %s failed to load: %s", slot.spec.name, exc)
                    raise ModelRegistryError(f"the model `{slot.spec.name}` could not be loaded: {exc}", 503) from exc
                self._install(slot, loaded)
                logger.info(
                    "model %s loaded in %.1f s (%s: weights %s + KV pool %s)",
                    slot.spec.name,
                    time.monotonic() - started,
                    format_bytes(loaded.footprint),
                    format_bytes(loaded.weight_bytes),
                    format_bytes(loaded.kv_bytes),
                )
                if self.memory_budget is not None and self.used_bytes() > self.memory_budget:
                    try:  # the estimate was low: the measured size must fit too, else undo
                        await self._make_room(slot, 0)
                    except ModelRegistryError:
                        await self._unload(slot)
                        raise
        finally:
            slot.load_task = None

    def _install(self, slot: ModelSlot[S], loaded: LoadedEngine) -> None:
        engine = loaded.engine
        engine.on_dead = self.on_dead
        engine.start()  # its step loop, on the thread that loaded it
        slot.loaded, slot.footprint, slot.max_model_len = loaded, loaded.footprint, engine.max_model_len
        slot.serving = self.make_serving(slot.spec, engine)
        slot.state = ModelState.LOADED
        slot.loads += 1
        if self.draining:
            engine.begin_drain()

    def used_bytes(self) -> int:
        """What the loaded and loading models take of the budget."""
        busy = (ModelState.LOADED, ModelState.LOADING, ModelState.UNLOADING)
        return sum(s.bytes_needed for s in self.slots if s.state in busy)

    async def _make_room(self, slot: ModelSlot[S], needed: int) -> None:
        """Unload idle models, least recently used first, until `needed` more bytes fit in the budget. A
        model still answering is unloaded once its requests end (waiting up to the load timeout); a pinned
        one never."""
        budget = self.memory_budget
        if budget is None:
            return
        if slot.bytes_needed > budget:
            raise self._no_room(slot, f"it needs {format_bytes(slot.bytes_needed)}, more than the whole budget")
        deadline = time.monotonic() + self.load_timeout
        while self.used_bytes() + needed > budget:
            candidates = [s for s in self.slots if s is not slot and s.state is ModelState.LOADED and not s.spec.pinned]
            idle = [s for s in candidates if s.idle]
            if idle:
                victim = min(idle, key=lambda s: s.last_used)
                logger.info("unloading %s (least recently used) to make room for %s", victim.spec.name, slot.spec.name)
                await self._unload(victim)
            elif candidates and time.monotonic() < deadline:
                await asyncio.sleep(BUSY_POLL_S)  # their running requests finish first
            else:
                raise self._no_room(slot, f"it needs {format_bytes(slot.bytes_needed)}")

    def _no_room(self, slot: ModelSlot[S], why: str) -> ModelRegistryError:
        loaded = [
            f"{s.spec.name} ({format_bytes(s.bytes_needed)}, "
            f"{'pinned' if s.spec.pinned else 'in use' if not s.idle else s.state.value})"
            for s in self.slots
            if s is not slot and s.state is not ModelState.UNLOADED
        ]
        return ModelRegistryError(
            f"cannot load the model `{slot.spec.name}`: {why} and the memory budget is "
            f"{format_bytes(self.memory_budget or 0)}; loaded: {', '.join(loaded) or 'nothing'}; "
            "none of them can be unloaded (pinned, or still answering)",
            503,
        )

    async def _unload(self, slot: ModelSlot[S]) -> None:
        """Stop the model's engine thread (which frees its arrays) once it has no request left."""
        loaded = slot.loaded
        if loaded is None:
            return
        slot.state = ModelState.UNLOADING
        await loaded.engine.shutdown(30.0)
        try:
            await asyncio.wait_for(asyncio.wrap_future(loaded.close()), 30.0)
        except asyncio.TimeoutError:
            logger.error("model %s: its thread did not let go of the model within 30 s", slot.spec.name)
        close = getattr(slot.serving, "close", None)
        if close is not None:
            close()
        slot.loaded = slot.serving = None
        slot.state = ModelState.UNLOADED
        logger.info("unloaded model %s", slot.spec.name)
        if self.on_unload is not None:
            self.on_unload(slot.spec)

    async def unload_idle(self, now: float | None = None) -> list[str]:
        """Unload models idle for longer than the idle timeout; the names unloaded."""
        now = time.monotonic() if now is None else now
        done = []
        async with self._lock():
            for slot in self.slots:
                expired = now - slot.last_used >= self.idle_timeout
                if slot.state is ModelState.LOADED and not slot.spec.pinned and slot.idle and expired:
                    logger.info("unloading %s: idle for %.0f s", slot.spec.name, now - slot.last_used)
                    await self._unload(slot)
                    done.append(slot.spec.name)
        return done

    async def _sweep(self) -> None:
        period = min(max(self.idle_timeout / 4, 0.05), 5.0)
        while True:
            await asyncio.sleep(period)
            try:
                await self.unload_idle()
            except Exception:
                logger.exception("idle unload failed")

    # ---- the server's life ----

    def start(self) -> None:
        for slot in self.slots:
            if slot.engine is not None:
                slot.engine.on_dead = self.on_dead if slot.engine.on_dead is None else slot.engine.on_dead
                slot.engine.start()
        if self.idle_timeout > 0 and self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep())

    async def preload(self, names: list[str]) -> None:
        """Load these models now (pinned ones at start-up), one after the other."""
        for name in names:
            (await self.acquire(name)).release()

    async def shutdown(self, timeout: float) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for slot in self.slots:
            if slot.loaded is not None:
                await slot.loaded.engine.shutdown(timeout)
                slot.loaded.close()

    def engines(self) -> Iterator[AsyncEngine]:
        for slot in self.slots:
            if slot.engine is not None:
                yield slot.engine

    # The GracefulServer's view: the same calls as one AsyncEngine's, over every loaded model.
    @property
    def num_active_requests(self) -> int:
        return sum(e.num_active_requests for e in self.engines())

    def begin_drain(self) -> None:
        self.draining = True
        for engine in self.engines():
            engine.begin_drain()

    def fail_open_requests(self, message: str) -> None:
        for engine in self.engines():
            engine.fail_open_requests(message)

    @property
    def dead_error(self) -> BaseException | None:
        return next((e.dead_error for e in self.engines() if e.dead_error is not None), None)

    def describe(self) -> list[dict[str, Any]]:
        """Every model's names, state and sizes (for /v1/models and the status page)."""
        return [
            {
                "id": s.spec.name,
                "aliases": list(s.spec.aliases),
                "state": s.state.value,
                "pinned": s.spec.pinned,
                "max_model_len": s.max_model_len or s.spec.config.max_model_len,
                "memory_bytes": s.bytes_needed,
                "loads": s.loads,
                "requests_in_use": s.leases,
                "idle_s": round(time.monotonic() - s.last_used, 1),
            }
            for s in self.slots
        ]


def _retrieved(task: asyncio.Task[None]) -> None:
    """Mark a load task's error as seen: every waiter may have given up on it, and _load logged it."""
    if not task.cancelled():
        task.exception()
