"""Stored Responses: what ``previous_response_id`` and ``GET``/``DELETE
/v1/responses/{id}`` need, in memory, least recently used first out under a byte budget.

A stored response keeps its Response object and the conversation it ended as input
items (the earlier responses' items, this request's input, its output as an assistant
message and function calls), so that a follow-up names it instead of sending the
history again. As at OpenAI, a follow-up does not inherit ``instructions`` or ``tools``.
Nothing survives a restart.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from mlx_serve.errors import MLXServeError
from mlx_serve.protocol import ResponsesRequest
from mlx_serve.request_building import off_loop_if_long


class ResponseNotFoundError(MLXServeError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "not_found"


@dataclass(frozen=True)
class StoredResponse:
    """Kept as JSON: the budget then counts what the store really holds (as Python
    objects the same data would take several times its JSON size)."""

    response_json: bytes
    items_json: bytes  # the conversation so far, as Responses input items

    @property
    def nbytes(self) -> int:
        return len(self.response_json) + len(self.items_json)


class ResponseStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Keep a finished response; the least recently used go when over budget (one
        larger than the whole budget is not kept)."""
        entry = StoredResponse(json.dumps(response).encode(), json.dumps(items).encode())
        if entry.nbytes > self.max_bytes:
            return
        self.delete(response["id"])
        self._entries[response["id"]] = entry
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes

    def get(self, response_id: str) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            raise ResponseNotFoundError(f"Response with id '{response_id}' not found.",
                                        param="response_id")
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
        return entry is not None


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """A request's ``input`` as a list of item dicts."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return [item.model_dump(by_alias=True, exclude_none=True) for item in body.input]


async def continued(body: ResponsesRequest, store: ResponseStore
                    ) -> tuple[ResponsesRequest, list[dict[str, Any]]]:
    """The request with the conversation of its ``previous_response_id`` before its own
    input, and that whole conversation as items (what storing this response starts
    from). A request without one is returned as it is. The store is read on the event
    loop; a long conversation is decoded and validated in a worker thread."""
    own = input_items(body)
    if body.previous_response_id is None:
        return body, own
    try:
        earlier = store.get(body.previous_response_id).items_json
    except ResponseNotFoundError:
        raise ResponseNotFoundError(
            f"Previous response with id '{body.previous_response_id}' not found.",
            param="previous_response_id") from None
    return await off_loop_if_long(len(earlier), _prepend, body, earlier, own)


def _prepend(body: ResponsesRequest, earlier: bytes, own: list[dict[str, Any]]
             ) -> tuple[ResponsesRequest, list[dict[str, Any]]]:
    items = [*json.loads(earlier), *own]
    return body.model_copy(update={"input": ResponsesRequest.model_validate(
        {"input": items}).input}), items


def output_as_items(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output as the input items a follow-up would send back: its text as
    an assistant message, its function calls as they are (reasoning is left out)."""
    items: list[dict[str, Any]] = []
    for item in response["output"]:
        if item["type"] == "message" and item["content"]:
            items.append({"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": part["text"]} for part in item["content"]]})
        elif item["type"] == "function_call":
            items.append({"type": "function_call", "call_id": item["call_id"],
                          "name": item["name"], "arguments": item["arguments"]})
    return items
