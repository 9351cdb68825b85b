"""The one thread that touches MLX for an engine: it loads the model, builds the core and runs every step.

MLX streams belong to threads: an array that one thread left lazy (a RoPE table, a pool not yet
evaluated) cannot be evaluated by another ("There is no Stream(cpu, 0) in current thread"). So the
server does all its MLX work here, from loading to the last step, and no array crosses threads.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple["Future[Any]", Callable[[], Any]]


class EngineThread:
    """A daemon thread running submitted calls in order (a stuck step cannot hold the process at exit)."""

    def __init__(self, name: str = "metalserve-engine-core") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        self.ident: int = self._thread.ident or 0

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run `fn(*args, **kwargs)` on the thread after the calls before it; its result comes in the future."""
        future: Future[T] = Future()
        self._jobs.put((future, lambda: fn(*args, **kwargs)))
        return future

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`submit` and wait: the result, or the call's exception raised here (SystemExit included)."""
        if self.is_current():
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def is_current(self) -> bool:
        return threading.get_ident() == self.ident

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """End the thread once the calls already submitted have run."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller (a rank's sys.exit, a load error)
                future.set_exception(exc)
