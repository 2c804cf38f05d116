"""Stored responses of `/v1/responses` (`store: true`): what `previous_response_id` continues and
`GET /v1/responses/{id}` returns, kept in memory, least recently used first out, at most `capacity` of them."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object as it was answered
    messages: list[dict[str, Any]]  # the conversation so far as template messages (without instructions)
    input_items: list[dict[str, Any]] = field(default_factory=list)  # this request's input, as listed back
    events: list[dict[str, Any]] | None = None  # a background response's stream events, for replays


class ResponseStore:
    """An LRU map from response ID to `StoredResponse`; capacity 0 stores nothing."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, item: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
