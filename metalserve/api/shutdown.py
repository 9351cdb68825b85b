"""Graceful shutdown: on SIGTERM/SIGINT stop accepting, let running requests finish, then end the rest.

uvicorn alone would cut every stream at once (sse-starlette ends them on the signal) and re-raise the
signal after shutdown, so a supervisor saw exit status -15 for an orderly stop.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn
from sse_starlette.sse import AppStatus

from metalserve.serving.registry import ModelRegistry

logger = logging.getLogger("metalserve.server")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Seconds uvicorn waits beyond our grace period: time for the error events of cut requests to go out.
_FLUSH_MARGIN_S = 5.0


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose signals drain every served model's engine; the first signal starts a graceful
    stop, a second one ends open requests at once. A signal is an orderly end: exit status 0."""

    def __init__(self, config: uvicorn.Config, registry: ModelRegistry[Any] | None, grace_s: float) -> None:
        config.timeout_graceful_shutdown = int(grace_s + _FLUSH_MARGIN_S)
        super().__init__(config)
        self.registry: ModelRegistry[Any] | None = None
        self.grace_s = grace_s
        self.engine_failed = False
        if registry is not None:
            self.attach(registry)
        AppStatus.disable_automatic_graceful_drain()  # we end streams ourselves, with an error event

    def attach(self, registry: ModelRegistry[Any]) -> None:
        """The engines whose requests a signal drains (None while the model still loads: a signal then
        just stops the server)."""
        self.registry = registry
        registry.on_dead = self.exit_after_engine_failure

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.registry is None:
            logger.info("shutting down while the model loads")
            self.should_exit = True
            return
        if self.should_exit:
            logger.info("second signal: ending %d open request(s) now", self.registry.num_active_requests)
            self.registry.fail_open_requests("the server is shutting down")
            return
        logger.info(
            "shutting down: no new requests; %d running get %.0f s to finish",
            self.registry.num_active_requests,
            self.grace_s,
        )
        self.registry.begin_drain()
        self.should_exit = True
        timer = threading.Timer(self.grace_s, self.registry.fail_open_requests, ("the server is shutting down",))
        timer.daemon = True
        timer.start()

    def exit_after_engine_failure(self) -> None:
        """The engine thread died (its requests were failed): stop serving, so the process exits non-zero
        and a supervisor restarts it."""
        self.engine_failed = True
        self.should_exit = True
