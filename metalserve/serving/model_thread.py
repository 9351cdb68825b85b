"""A model's engine thread (engine/engine_thread.py): it loads the model, runs the engine's step loop and,
once stopped, drops the model, so every MLX array of that model is made, used and freed on this one thread."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from metalserve.engine.async_engine import AsyncEngine
from metalserve.engine.engine_thread import EngineThread
from metalserve.serving.model_spec import ModelSpec


@dataclass
class LoadedEngine:
    """A model's engine, what it takes of the memory budget, and how its thread lets go of it."""

    engine: AsyncEngine
    weight_bytes: int = 0  # parameters (and the CPU path's stored codes)
    kv_bytes: int = 0  # the KV pool at its largest
    release: Callable[[], None] | None = None  # runs on the engine thread after its loop ended
    thread: EngineThread | None = None  # the model's own thread (None: the engine made its own)

    @property
    def footprint(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def close(self) -> Future[None]:
        """After the engine's loop stopped: `release` on the model's thread, then the thread ends."""
        done: Future[None] = Future()
        if self.thread is None:
            done.set_result(None)
            return done
        thread = self.thread
        future = thread.submit(self.release or (lambda: None))
        thread.close()
        return future


# Called on the model's new engine thread with that thread; builds the engine there (not yet started).
EngineLoader = Callable[[ModelSpec, EngineThread], LoadedEngine]


def start_engine_thread(spec: ModelSpec, loader: EngineLoader) -> Future[LoadedEngine]:
    """Start the model's thread and load it there; the future resolves once the engine is built."""
    thread = EngineThread(name=f"metalserve-engine-{spec.name}")
    future = thread.submit(loader, spec, thread)
    future.add_done_callback(lambda f: thread.close() if f.exception() is not None else None)
    return future
