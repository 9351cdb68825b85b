"""Start-up: the port answers from the first second, `/health` says "starting" until the model can serve.

Loading a model and its warm-up step take seconds (16 s at load 10 on the default model); until now the
port stayed closed meanwhile, and a supervisor could not tell a slow start from a hung one. uvicorn now
serves `StartupGate` at once: until the loaded app is handed to it, `/health` is a 503 with
{"status": "starting", "reason": ...} and every other route a 503 in the OpenAI error format with
`Retry-After`. Then every request goes to the app, whose lifespan (engine start, stats, shutdown) the
gate runs as uvicorn would have.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("metalserve.server")

RETRY_AFTER_S = 2


class StartupGate:
    """The ASGI app uvicorn serves while the model loads; `open(app)` hands over to the loaded app."""

    def __init__(self, reason: str = "loading the model") -> None:
        self.app: ASGIApp | None = None
        self.reason = reason
        self.loop: asyncio.AbstractEventLoop | None = None
        self.running = threading.Event()  # uvicorn's lifespan started: the loop is known
        self._app_lifespan: tuple[asyncio.Queue[Message], asyncio.Queue[Message], asyncio.Task[None]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._starting(scope, send)

    async def open(self, app: ASGIApp) -> None:
        """Run `app`'s lifespan start-up, then route every request to it."""
        inbox: asyncio.Queue[Message] = asyncio.Queue()
        outbox: asyncio.Queue[Message] = asyncio.Queue()
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}}
        task = asyncio.ensure_future(app(scope, inbox.get, outbox.put))
        self._app_lifespan = (inbox, outbox, task)
        await inbox.put({"type": "lifespan.startup"})
        reply = await outbox.get()
        if reply["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app did not start: {reply.get('message', reply['type'])}")
        self.app = app

    def open_from_thread(self, app: ASGIApp) -> None:
        """`open` from the loading thread, on uvicorn's loop; returns once the app serves."""
        self.running.wait()
        assert self.loop is not None
        asyncio.run_coroutine_threadsafe(self.open(app), self.loop).result()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        self.loop = asyncio.get_running_loop()
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
                self.running.set()
            elif message["type"] == "lifespan.shutdown":
                await self._shut_app_down()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _shut_app_down(self) -> None:
        if self._app_lifespan is None:
            return
        inbox, outbox, task = self._app_lifespan
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await task

    async def _starting(self, scope: Scope, send: Send) -> None:
        headers = [(b"content-type", b"application/json"), (b"retry-after", str(RETRY_AFTER_S).encode())]
        if scope["path"] == "/health":
            body: dict[str, Any] = {"status": "starting", "reason": self.reason}
        else:
            message = f"the server is starting ({self.reason}); try again in a few seconds"
            body = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": "503"}}
        data = b"" if scope["method"] == "HEAD" else json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": data})


def load_behind(gate: StartupGate, load: Callable[[], ASGIApp], on_error: Callable[[BaseException], None]) -> None:
    """In the loading thread: build the app with `load`, then open the gate; `on_error` on failure."""
    try:
        app = load()
        gate.open_from_thread(app)
    except BaseException as exc:  # reported to the main thread, which exits with it
        on_error(exc)


def serve_while_loading(load: Callable[[], Any], settings: Any) -> None:
    """Serve the gate at once and `load` (-> the app; its `state.registry` the registry) on a thread of its
    own; the app serves once loaded. A load that fails stops the server and is raised here."""
    import time

    import uvicorn

    from metalserve.api.header_timeout import HeaderTimeoutProtocol
    from metalserve.api.shutdown import GracefulServer

    started = time.monotonic()
    gate = StartupGate()
    config = uvicorn.Config(gate, host=settings.host, port=settings.port, log_level="info", http=HeaderTimeoutProtocol)
    server = GracefulServer(config, None, settings.graceful_shutdown_timeout)
    failures: list[BaseException] = []

    def loaded_app() -> ASGIApp:
        app = load()
        server.attach(app.state.registry)
        return app

    def failed(exc: BaseException) -> None:
        failures.append(exc)
        server.should_exit = True

    def ready() -> None:
        load_behind(gate, loaded_app, failed)
        if not failures:
            logger.info("ready: /health answers 200 after %.1f s (model load and warm-up)", time.monotonic() - started)

    threading.Thread(target=ready, name="metalserve-load", daemon=True).start()
    logger.info(
        'serving on http://%s:%d/v1 (/health answers 503 "starting" until the model is loaded)',
        settings.host,
        settings.port,
    )
    server.run()
    if failures:
        raise failures[0]
    if server.engine_failed:
        logger.error("exiting after the engine failed, so a supervisor can restart the server")
        raise SystemExit(1)
    logger.info("stopped")
