"""A recording HTTP proxy between a coding agent and the server: every exchange (request body, status,
response text, SSE included) is kept, so a test can count requests and read usage and tool traffic.

Plain stdlib threads plus httpx, streamed through chunk by chunk so the agent sees SSE as it comes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


@dataclass
class Exchange:
    method: str
    path: str
    request: Any  # the parsed JSON body, or None
    status: int = 0
    response: str = ""
    seconds: float = 0.0

    def events(self) -> list[dict[str, Any]]:
        """The JSON payloads of an SSE response (empty for a plain JSON one)."""
        out = []
        for line in self.response.splitlines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
        return out

    def body(self) -> Any:
        try:
            return json.loads(self.response)
        except ValueError:
            return None


@dataclass
class Recorder:
    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _handler(recorder: Recorder) -> type[BaseHTTPRequestHandler]:
    client = httpx.Client(base_url=recorder.upstream, timeout=None)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _forward(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                parsed = json.loads(raw) if raw else None
            except ValueError:
                parsed = None
            exchange = Exchange(self.command, self.path, parsed)
            with recorder.lock:
                recorder.exchanges.append(exchange)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
            start = time.monotonic()
            with client.stream(self.command, self.path, content=raw, headers=headers) as upstream:
                exchange.status = upstream.status_code
                self.send_response(upstream.status_code)
                for key, value in upstream.headers.items():
                    if key.lower() not in _HOP_HEADERS and key.lower() != "content-encoding":
                        self.send_header(key, value)
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                chunks = []
                for chunk in upstream.iter_raw():
                    chunks.append(chunk)
                    self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                exchange.response = b"".join(chunks).decode("utf-8", "replace")
            exchange.seconds = time.monotonic() - start

        do_GET = do_POST = do_DELETE = do_HEAD = _forward

    return Handler


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # an agent closing its keep-alive connection is not news


@contextmanager
def recording_proxy(upstream: str) -> Iterator[tuple[str, Recorder]]:
    """(the proxy's base URL, its recorder) for as long as the block runs."""
    recorder = Recorder(upstream)
    server = _QuietServer(("127.0.0.1", 0), _handler(recorder))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", recorder
    finally:
        server.shutdown()
        server.server_close()
