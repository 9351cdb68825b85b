"""The async engine's commands to its worker thread (engine/async_engine.py)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from metalserve.engine.request_state import RequestState
from metalserve.request import Request


# The worker's commands: typed, so the loop that applies them is a match over six shapes.
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


@dataclass(frozen=True)
class Call:
    """Run `fn` on the worker between steps (it may touch the model's MLX arrays: a LoRA adapter's load);
    its result or exception goes to `future`."""

    fn: Callable[[], Any]
    future: Future[Any]


Command = Add | Abort | FailAll | Stop | Crash | Call
