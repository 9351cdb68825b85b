"""A model's engine thread: it loads the model, runs the engine's step loop and, once stopped, drops the
model, so every MLX array of that model is made, used and freed on this one thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from metalserve.engine.async_engine import AsyncEngine
from metalserve.engine.model_spec import ModelSpec

logger = logging.getLogger("metalserve.registry")


@dataclass
class LoadedEngine:
    """A model's engine, what it takes of the memory budget, and how its thread lets go of it."""

    engine: AsyncEngine
    weight_bytes: int = 0  # parameters (and the CPU path's stored codes)
    kv_bytes: int = 0  # the KV pool at its largest
    release: Callable[[], None] | None = None  # runs on the engine thread after its loop ended
    closed: threading.Event = field(default_factory=threading.Event)

    @property
    def footprint(self) -> int:
        return self.weight_bytes + self.kv_bytes


# Called on the new engine thread; returns the engine it built there (not yet running).
EngineLoader = Callable[[ModelSpec], LoadedEngine]


def start_engine_thread(spec: ModelSpec, loader: EngineLoader) -> Future[LoadedEngine]:
    """Start the model's thread; the future resolves once the engine is loaded and takes requests."""
    future: Future[LoadedEngine] = Future()

    def body() -> None:
        try:
            loaded = loader(spec)
        except BaseException as exc:  # reported to every request waiting for this load
            logger.exception("loading %s failed", spec.name)
            future.set_exception(exc)
            return
        try:
            loaded.engine.run_here(lambda: future.set_result(loaded))
        finally:
            try:
                if loaded.release is not None:
                    loaded.release()
            finally:
                loaded.closed.set()

    threading.Thread(target=body, name=f"metalserve-engine-{spec.name}", daemon=True).start()
    return future
