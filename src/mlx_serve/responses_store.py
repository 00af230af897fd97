"""Stored Responses: what ``previous_response_id``, ``GET``/``DELETE
/v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` need, in memory, least
recently used first out under a byte budget.

A stored response keeps its Response object and the conversation it ended as input
items (the earlier responses' items, this request's input, its output as an assistant
message and function calls), so that a follow-up names it instead of sending the
history again. As at OpenAI, a follow-up does not inherit ``instructions`` or ``tools``.
Every item is kept in the shape OpenAI lists input items in, with an id of its own
(the client's, or one given here), so that a listing pages by item id. Nothing survives
a restart.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import QueryParams

from mlx_serve.errors import MLXServeError, RequestError, UnsupportedParameterError
from mlx_serve.protocol_responses import OUTPUT_LOGPROBS, ItemReference, ResponsesRequest
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
    inputs: int  # how many of those items went into this response (its output follows)
    item_ids: tuple[str, ...]  # the items' ids, for ``item_reference`` inputs

    @property
    def nbytes(self) -> int:
        return (len(self.response_json) + len(self.items_json)
                + sum(len(item_id) for item_id in self.item_ids))


class ResponseStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        # Item id -> the stored responses whose conversations hold the item, oldest first
        # (a conversation's earlier items are in every later response of it).
        self._holders: dict[str, list[str]] = {}
        self._making: set[str] = set()  # streamed responses begun and not yet ended

    def __len__(self) -> int:
        return len(self._entries)

    def keeper(self, conversation: list[dict[str, Any]]) -> StreamKeeper:
        """What keeps a streamed response: in progress at once, then as it ended."""
        return StreamKeeper(self, conversation)

    def in_progress(self, response_id: str) -> bool:
        return response_id in self._making

    def begin(self, snapshot: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep a streamed response in progress (its client has its id already)."""
        self.put(snapshot, conversation)
        self._making.add(snapshot["id"])

    def finish(self, final: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep a begun response as it ended, unless it was deleted meanwhile or has
        ended already."""
        if final["id"] in self._making:
            self._making.discard(final["id"])
            self.put(final, conversation)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep a finished response after the ``conversation`` that generated it; the
        least recently used go when over budget (one larger than the whole budget is not
        kept)."""
        items = [*conversation, *output_as_items(response)]
        entry = StoredResponse(json.dumps(response).encode(), json.dumps(items).encode(),
                               len(conversation), tuple(item["id"] for item in items))
        if entry.nbytes > self.max_bytes:
            return
        self.delete(response["id"])
        self._entries[response["id"]] = entry
        self.nbytes += entry.nbytes
        for item_id in entry.item_ids:
            self._holders.setdefault(item_id, []).append(response["id"])
        while self.nbytes > self.max_bytes:
            self._forget(*self._entries.popitem(last=False))

    def get(self, response_id: str) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            raise ResponseNotFoundError(f"Response with id '{response_id}' not found.",
                                        param="response_id")
        self._entries.move_to_end(response_id)
        return entry

    def holder(self, item_id: str) -> tuple[str, StoredResponse]:
        """The latest stored response whose conversation holds the item ``item_id``."""
        holders = self._holders.get(item_id)
        if not holders:
            raise ResponseNotFoundError(f"Item with id '{item_id}' not found.", param="input")
        return holders[-1], self.get(holders[-1])

    def delete(self, response_id: str) -> bool:
        self._making.discard(response_id)  # deleted while made: not kept when it ends
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._forget(response_id, entry)
        return entry is not None

    def _forget(self, response_id: str, entry: StoredResponse) -> None:
        self.nbytes -= entry.nbytes
        for item_id in entry.item_ids:
            holders = self._holders[item_id]
            holders.remove(response_id)
            if not holders:
                del self._holders[item_id]


@dataclass(frozen=True)
class StreamKeeper:
    """A streamed response's place in the store: its snapshot in progress from its first
    event (its client has the id), replaced by the final one unless deleted meanwhile."""

    store: ResponseStore
    conversation: list[dict[str, Any]]

    def begin(self, snapshot: dict[str, Any]) -> None:
        self.store.begin(snapshot, self.conversation)

    def end(self, final: dict[str, Any]) -> None:
        self.store.finish(final, self.conversation)


def check_retrieval(query: QueryParams) -> None:
    """OpenAI's ``GET /v1/responses/{id}`` may replay a response's events (``stream``,
    from ``starting_after``) and add to it (``include``): here a stored response is
    returned whole, as it was made, so those that would change that are a 400."""
    if query.get("stream", "false").lower() not in ("false", "0", ""):
        raise UnsupportedParameterError("a stored response is returned whole; its events "
                                        "are not replayed ('stream')", param="stream")
    if "starting_after" in query:
        raise UnsupportedParameterError("'starting_after' goes with 'stream', which is not "
                                        "supported here", param="starting_after")
    extra = set(query.getlist("include") + query.getlist("include[]")) - {OUTPUT_LOGPROBS}
    if extra:
        raise UnsupportedParameterError(
            f"'include' of {sorted(extra)} is not supported (a stored response holds the "
            f"logprobs its request asked for)", param="include")


def input_items_page(entry: StoredResponse, query: Mapping[str, str]) -> dict[str, Any]:
    """One page of the items that went into a stored response, as OpenAI's ``GET
    /v1/responses/{id}/input_items`` lists them: ``order`` (``desc``, newest first, by
    default), ``limit`` (1-100, 20 by default), and the cursors ``after`` (the page
    after an item id of the listing) and ``before`` (the page before one). ``include``
    adds nothing to text items, so it is a 400."""
    if "include" in query or "include[]" in query:
        raise UnsupportedParameterError("'include' is not supported for input items "
                                        "(they are text only)", param="include")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise RequestError("'order' must be 'asc' or 'desc'", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise RequestError("'limit' must be an integer from 1 to 100", param="limit")
    items = json.loads(entry.items_json)[:entry.inputs]
    if order == "desc":
        items.reverse()
    ids = [item["id"] for item in items]
    start, end = 0, len(items)
    for cursor, at_start in (("after", True), ("before", False)):
        if (item_id := query.get(cursor)) is None:
            continue
        if item_id not in ids:
            raise RequestError(f"'{cursor}': no input item '{item_id}' in this response",
                               param=cursor)
        if at_start:
            start = ids.index(item_id) + 1
        else:
            end = ids.index(item_id)
    # ``before`` pages back: the ``limit`` items right before it (has_more: more before).
    window = items[start:end]
    page = window[-limit:] if "before" in query and "after" not in query else window[:limit]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(window) > limit}


# Id prefixes of the items given one here, by type (OpenAI's, where it has one).
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}


def stored_item(item: dict[str, Any]) -> dict[str, Any]:
    """An input item in the shape OpenAI lists it in: with an id and a status, and a
    message's content as a list of text parts (``input_text``, or ``output_text`` with
    its annotations for the assistant's). A follow-up reads the same text from it."""
    item = {"id": f"{_ID_PREFIX[item['type']]}_{uuid.uuid4().hex}", "status": "completed",
            **item}
    if item["type"] == "message":
        kind = "output_text" if item["role"] == "assistant" else "input_text"
        parts = [{"type": kind, "text": item["content"]}] \
            if isinstance(item["content"], str) else item["content"]
        item["content"] = [{**part, "annotations": []} if part["type"] == "output_text"
                           else part for part in parts]
    return item


async def continued(body: ResponsesRequest, store: ResponseStore
                    ) -> tuple[ResponsesRequest, list[dict[str, Any]]]:
    """The request with the conversation of its ``previous_response_id`` before its own
    input and its ``item_reference`` inputs replaced by the stored items they name, and
    that whole conversation as stored items (what storing this response starts from).
    The store is read on the event loop; long conversations are decoded and validated
    in a worker thread."""
    earlier = b"[]"
    if body.previous_response_id is not None:
        try:
            earlier = store.get(body.previous_response_id).items_json
        except ResponseNotFoundError:  # a 400 with OpenAI's code, which clients match on
            raise RequestError(
                f"Previous response with id '{body.previous_response_id}' not found.",
                param="previous_response_id", code="previous_response_not_found") from None
        if store.in_progress(body.previous_response_id):  # it has no output yet
            raise RequestError(
                f"Previous response with id '{body.previous_response_id}' is still in "
                f"progress; a follow-up can name it once it has ended.",
                param="previous_response_id")
    holders = {item.id: store.holder(item.id) for item in body.input
               if isinstance(item, ItemReference)} if not isinstance(body.input, str) else {}
    if body.previous_response_id is None and not holders:
        return body, _unique(_own_items(body, {}))
    sources = {response_id: entry.items_json for response_id, entry in holders.values()}
    size = len(earlier) + sum(len(blob) for blob in sources.values())
    return await off_loop_if_long(size, _assemble, body, earlier, holders, sources)


def _assemble(body: ResponsesRequest, earlier: bytes,
              holders: dict[str, tuple[str, StoredResponse]], sources: dict[str, bytes]
              ) -> tuple[ResponsesRequest, list[dict[str, Any]]]:
    stored = {response_id: {item["id"]: item for item in json.loads(blob)}
              for response_id, blob in sources.items()}
    referenced = {item_id: stored[response_id][item_id]
                  for item_id, (response_id, _) in holders.items()}
    items = _unique([*json.loads(earlier), *_own_items(body, referenced)])
    return body.model_copy(update={"input": ResponsesRequest.model_validate(
        {"input": items}).input}), items


def _unique(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items, if no id is there twice: an item twice would be in the prompt twice,
    and a listing pages by id (OpenAI: a 400)."""
    seen: set[str] = set()
    for item in items:
        if item["id"] in seen:
            raise RequestError(f"Duplicate item found with id '{item['id']}'.", param="input")
        seen.add(item["id"])
    return items


def _own_items(body: ResponsesRequest, referenced: dict[str, dict[str, Any]]
               ) -> list[dict[str, Any]]:
    """A request's ``input`` as stored items (see ``stored_item``), references as the
    items they name."""
    if isinstance(body.input, str):
        return [stored_item({"type": "message", "role": "user", "content": body.input})]
    return [referenced[item.id] if isinstance(item, ItemReference)
            else stored_item(item.model_dump(by_alias=True, exclude_none=True))
            for item in body.input]


def output_as_items(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output as the input items a follow-up would send back, with their
    ids: its text as an assistant message, its reasoning and function calls as they
    are."""
    items: list[dict[str, Any]] = []
    for item in response["output"]:
        if item["type"] == "message" and item["content"]:
            items.append({"id": item["id"], "type": "message", "role": "assistant",
                          "status": item["status"], "content": [
                              {"type": "output_text", "text": part["text"], "annotations": []}
                              for part in item["content"]]})
        elif item["type"] in ("function_call", "reasoning"):
            items.append(dict(item))
    return items
