"""An adapter's identity as the engine's host side sees it: the request's tag and the prefix cache key."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoraRequest:
    """The adapter a request runs under (vLLM's LoRARequest): `name` as clients send it in `model`;
    `key`: the name and its weights' content hash, so a block computed under one adapter is never served
    to another, nor to a different adapter loaded later under the same name (the disk tier outlives us)."""

    name: str
    key: str
    path: str = ""  # the directory it was read from (/v1/models shows it as the adapter's `root`)
