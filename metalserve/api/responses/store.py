"""A bounded in-memory LRU of stored responses, for GET /v1/responses/{id} and previous_response_id.

Bounded twice: by count and by bytes (each response's JSON, its conversation included, which grows
with every turn of a chain), so a client cannot grow the server's memory through `store`."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as it was returned
    conversation: list[dict[str, Any]]  # every input item up to this response (earlier turns included)
    num_bytes: int = field(default=0, compare=False)  # filled in by the store

    def history(self) -> list[dict[str, Any]]:
        """What a follow-up continues from: the conversation plus this response's output items."""
        return self.conversation + list(self.body["output"])


def stored_size(stored: StoredResponse) -> int:
    """The bytes a stored response is charged: its JSON text (a fair proxy for the objects' size)."""
    return len(json.dumps([stored.body, stored.conversation], ensure_ascii=False, default=str).encode())


class ResponseStore:
    """Keeps the most recently stored or read responses within `max_size` entries and `max_bytes`
    (0: stores nothing). A response larger than `max_bytes` on its own is not kept."""

    def __init__(self, max_size: int, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.max_size <= 0:
            return
        size = stored_size(stored)
        if size > self.max_bytes:
            return
        self.delete(response_id)
        self._items[response_id] = StoredResponse(stored.body, stored.conversation, size)
        self.num_bytes += size
        while len(self._items) > self.max_size or self.num_bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.num_bytes -= old.num_bytes

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        old = self._items.pop(response_id, None)
        if old is None:
            return False
        self.num_bytes -= old.num_bytes
        return True

    def __len__(self) -> int:
        return len(self._items)
