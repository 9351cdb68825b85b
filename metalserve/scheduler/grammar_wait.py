"""Requests whose grammar still compiles wait in the queue without holding it (vLLM's WAITING_FOR_FSM)."""

from __future__ import annotations

from typing import Literal

from metalserve.request import Request


def grammar_verdict(request: Request) -> Literal["ready", "compiling", "failed"]:
    """May the scheduler admit this request now, as far as its grammar goes?"""
    structured = request.structured
    if structured is None:
        return "ready"
    if not structured.is_ready():
        return "compiling"
    return "failed" if structured.error is not None else "ready"
