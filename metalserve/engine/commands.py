"""The async engine's commands to its worker thread (engine/async_engine.py)."""

from __future__ import annotations

from dataclasses import dataclass

from metalserve.engine.request_state import RequestState
from metalserve.request import Request


# The worker's commands: typed, so the loop that applies them is a match over five shapes.
@dataclass(frozen=True)
class Add:
    request: Request
    state: RequestState


@dataclass(frozen=True)
class Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class FailAll:
    error: BaseException


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Crash:
    error: BaseException


Command = Add | Abort | FailAll | Stop | Crash
