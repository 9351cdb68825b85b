"""Errors the async engine hands to the serving layer; their messages are safe to show a client."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core failed (the log has why); no request can be served any more."""


class EngineDrainingError(EngineDeadError):
    """The server is shutting down: running requests finish, new ones are refused."""


class GrammarFailedError(RuntimeError):
    """The output could not go on within its grammar (an engine limit hit mid-way); the partial output
    broke the constraint, so the request fails instead of ending as if it had stopped."""


class ClientTooSlowError(RuntimeError):
    """A stream's reader fell too far behind; the request was aborted to bound what it buffers."""


NAME_SHOWN = 200  # characters of a client's name an error repeats: a 100 KB `model` is not echoed whole


def shown_name(name: str) -> str:
    """`name` for an error message, cut to NAME_SHOWN characters with its full length said."""
    if len(name) <= NAME_SHOWN:
        return name
    return f"{name[:NAME_SHOWN]}... ({len(name)} characters)"
