"""uvicorn's HTTP/1.1 protocol with a deadline for a request's headers (nginx's client_header_timeout).

uvicorn times out idle keep-alive connections but not a request whose headers arrive a byte at a time:
a few such clients hold their connections (and file descriptors) forever. From a connection's first byte
of a new request (or from the connection itself) the headers must be complete within the deadline, else
the connection is closed."""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 30.0


class HeaderTimeoutProtocol(H11Protocol):
    """H11Protocol that closes a connection whose request headers take longer than HEADER_TIMEOUT_S."""

    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm()  # part of the next request's headers: the clock runs from its first byte
        else:
            self._disarm()  # headers complete (or nothing of a next request yet: keep-alive's own timer)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.warning("closing a connection whose request headers took over %.0f s", HEADER_TIMEOUT_S)
            self.transport.close()
