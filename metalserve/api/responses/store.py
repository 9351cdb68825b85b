"""A bounded in-memory LRU of stored responses, for GET /v1/responses/{id} and previous_response_id."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as it was returned
    conversation: list[dict[str, Any]]  # every input item up to this response (earlier turns included)

    def history(self) -> list[dict[str, Any]]:
        """What a follow-up continues from: the conversation plus this response's output items."""
        return self.conversation + list(self.body["output"])


class ResponseStore:
    """Keeps the `max_size` most recently stored or read responses (0: stores nothing)."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.max_size <= 0:
            return
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
