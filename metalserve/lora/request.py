"""An adapter's identity as the engine's host side sees it: the request's tag and the prefix cache key."""

from __future__ import annotations

from dataclasses import dataclass

# A request's `lora_scale` (llama.cpp's per-request scale): 0 turns the adapter off, 1 is the adapter as
# trained; larger values push further along its direction until the model comes apart.
MAX_LORA_SCALE = 8.0


@dataclass(frozen=True)
class LoraRequest:
    """The adapter a request runs under (vLLM's LoRARequest): `name` as clients send it in `model`;
    `key`: the name and its weights' content hash, so a block computed under one adapter is never served
    to another, nor to a different adapter loaded later under the same name (the disk tier outlives us).
    `scale`: the request's multiplier of the adapter's delta (the adapter's own alpha / r stays applied)."""

    name: str
    key: str
    path: str = ""  # the directory it was read from (/v1/models shows it as the adapter's `root`)
    scale: float = 1.0

    @property
    def cache_key(self) -> str:
        """What keys the request's blocks: another scale computes other K/V from the same tokens."""
        return self.key if self.scale == 1.0 else f"{self.key}*{self.scale!r}"
