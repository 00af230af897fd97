"""Stored Responses: ``previous_response_id`` continues a conversation exactly as sending
its whole history would, and ``GET``/``DELETE /v1/responses/{id}`` and ``GET
/v1/responses/{id}/input_items`` see what is kept."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_serve.responses_store import ResponseNotFoundError, ResponseStore
from tests.http_helpers import MODEL, client_fixture, server_fixture
from tests.server_process import ServerProcess

server = server_fixture("responses-store")
client = client_fixture()
FIRST, SECOND, THIRD = "Tell me a story.", "And then?", "How does it end?"


def create(client, **kw):
    kw.setdefault("max_output_tokens", 6)
    return client.responses.create(model=MODEL, temperature=0, **kw)


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "output_text", "text": text}]}


@pytest.mark.parametrize("stream", [False, True])
def test_a_follow_up_is_what_sending_the_whole_history_generates(client, stream):
    """Three turns chained by id give the text and the input tokens of three stateless
    requests that each carry the conversation so far."""
    def turn(**kw):
        if not stream:
            return create(client, **kw)
        events = list(create(client, stream=True, **kw))
        assert events[-1].type == "response.incomplete"  # 6 tokens: the tiny model runs on
        return events[-1].response

    first = turn(input=FIRST, instructions="Be brief.")
    second = turn(input=SECOND, previous_response_id=first.id)
    third = turn(input=[{"role": "user", "content": THIRD}], previous_response_id=second.id)
    # Instructions are not inherited (as at OpenAI): the history is the messages alone.
    history = [{"role": "user", "content": FIRST}, assistant(first.output_text),
               {"role": "user", "content": SECOND}]
    stateless_second = create(client, input=history, store=False)
    stateless_third = create(client, input=[*history, assistant(second.output_text),
                                            {"role": "user", "content": THIRD}], store=False)
    for chained, stateless in ((second, stateless_second), (third, stateless_third)):
        assert chained.output_text == stateless.output_text
        assert chained.usage.input_tokens == stateless.usage.input_tokens
    assert (second.previous_response_id, third.previous_response_id) == (first.id, second.id)
    assert first.store and not stateless_second.store


def stored(server) -> tuple[float, float]:
    """What /metrics says the store holds: responses, bytes."""
    samples = {s.name: s.value for f in text_string_to_metric_families(
        httpx.get(server.base_url + "/metrics", timeout=10).text) for s in f.samples}
    return samples["mlx_serve_responses_stored"], samples["mlx_serve_responses_stored_bytes"]


def test_a_stored_response_can_be_retrieved_and_deleted(server, client):
    made = create(client, input=FIRST)
    kept = client.responses.retrieve(made.id)
    assert kept.model_dump() == made.model_dump()
    count, size = stored(server)
    assert count >= 1 and size > 0
    client.responses.delete(made.id)
    assert stored(server)[0] == count - 1 and stored(server)[1] < size
    for call in (lambda: client.responses.retrieve(made.id),
                 lambda: client.responses.delete(made.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError) as info:  # OpenAI's answer, not a 404
        create(client, input=SECOND, previous_response_id=made.id)
    assert info.value.param == "previous_response_id"
    assert info.value.code == "previous_response_not_found"


def test_input_items_are_the_conversation_that_generated_a_response(client):
    """Newest first by default, each item with an id that stays the same in every later
    response of the conversation; the assistant's turn is the earlier output message."""
    first = create(client, input=[{"type": "message", "id": "msg_mine", "role": "user",
                                   "content": FIRST}])
    second = create(client, input=SECOND, previous_response_id=first.id)
    listed = client.responses.input_items.list(second.id).data
    assert [(i.type, i.role, i.content[0].type, i.content[0].text) for i in listed] == [
        ("message", "user", "input_text", SECOND),
        ("message", "assistant", "output_text", first.output_text),
        ("message", "user", "input_text", FIRST)]
    assert listed[-1].id == "msg_mine"  # the client's own id is kept
    assert listed[1].id == first.output[0].id  # the earlier output, by its own id
    assert len({i.id for i in listed}) == 3
    # Six tokens cut the first reply short: its message keeps the status it had.
    assert [i.status for i in listed] == ["completed", first.output[0].status, "completed"]
    (only,) = client.responses.input_items.list(first.id).data
    assert only.model_dump() == listed[-1].model_dump()
    ascending = client.responses.input_items.list(second.id, order="asc").data
    assert [i.id for i in ascending] == [i.id for i in reversed(listed)]


def test_input_items_page_by_item_id(client):
    made = create(client, input=[{"role": "user", "content": f"Turn {i}."} for i in range(5)])
    whole = client.responses.input_items.list(made.id, order="asc")
    assert [i.content[0].text for i in whole.data] == [f"Turn {i}." for i in range(5)]
    assert (whole.first_id, whole.last_id, whole.has_more) == (
        whole.data[0].id, whole.data[-1].id, False)
    page = client.responses.input_items.list(made.id, order="asc", limit=2)
    assert [i.id for i in page.data] == [i.id for i in whole.data[:2]] and page.has_more
    # The SDK's own paging (after= the last id of each page) walks every item once.
    assert [i.id for i in page] == [i.id for i in whole.data]
    # ``before`` (not in the SDK's signature) pages back: the items right before it.
    before = client.responses.input_items.list(made.id, order="asc", limit=2,
                                               extra_query={"before": whole.data[3].id})
    assert [i.id for i in before.data] == [i.id for i in whole.data[1:3]] and before.has_more
    newest = client.responses.input_items.list(made.id, limit=2, after=whole.data[1].id)
    assert [i.id for i in newest.data] == [whole.data[0].id] and not newest.has_more
    last = client.responses.input_items.list(made.id, order="asc", after=whole.data[-1].id)
    assert (last.data, last.has_more) == ([], False)


@pytest.mark.parametrize(("query", "param"), [
    ({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "many"}, "limit"),
    ({"order": "sideways"}, "order"), ({"after": "msg_unknown"}, "after"),
    ({"before": "msg_unknown"}, "before"), ({"include[]": "message.input_image.image_url"},
                                            "include"),
])
def test_input_items_reject_what_they_cannot_list(server, client, query, param):
    made = create(client, input=FIRST)
    reply = httpx.get(f"{server.base_url}/v1/responses/{made.id}/input_items", params=query,
                      timeout=10)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")


def test_item_references_stand_for_the_stored_items_they_name(client):
    """A stateless request that names earlier items by id (as the Vercel AI SDK sends
    them) generates what the same conversation continued by response id does; an item
    twice is a 400, an unknown one a 404."""
    first = create(client, input=FIRST)
    (asked,) = client.responses.input_items.list(first.id).data
    chained = create(client, input=SECOND, previous_response_id=first.id)
    referenced = create(client, store=False, input=[
        {"type": "item_reference", "id": asked.id},
        {"type": "item_reference", "id": first.output[0].id},
        {"role": "user", "content": SECOND}])
    assert referenced.output_text == chained.output_text
    assert referenced.usage.input_tokens == chained.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as info:
        create(client, input=[{"type": "item_reference", "id": asked.id}, SECOND_TURN],
               previous_response_id=first.id)
    assert "Duplicate item" in info.value.message and info.value.param == "input"
    mine = {"type": "message", "id": "msg_twice", "role": "user", "content": FIRST}
    with pytest.raises(openai.BadRequestError, match="Duplicate item"):
        create(client, input=[mine, mine])
    client.responses.delete(chained.id)  # its items are still in the first response
    again = create(client, store=False, input=[
        {"type": "item_reference", "id": asked.id},
        {"type": "item_reference", "id": first.output[0].id}, SECOND_TURN])
    assert again.usage.input_tokens == chained.usage.input_tokens
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        create(client, input=[{"type": "item_reference", "id": asked.id}, SECOND_TURN])
    assert info.value.param == "input"


SECOND_TURN = {"role": "user", "content": SECOND}


def test_store_false_keeps_nothing(client):
    made = create(client, input=FIRST, store=False)
    assert made.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)


def test_without_a_store_every_response_says_so(tiny_model_dir, tmp_path):
    with ServerProcess(tiny_model_dir, tmp_path / "server.log",
                       args=["--responses-store-bytes", "0"]) as proc, \
            openai.OpenAI(base_url=proc.base_url + "/v1", api_key="x",
                          max_retries=0) as sdk:
        made = create(sdk, input=FIRST)
        assert made.store is False
        with pytest.raises(openai.BadRequestError) as info:
            create(sdk, input=SECOND, previous_response_id=made.id)
        assert info.value.code == "previous_response_not_found"


def response(response_id: str, text: str = "") -> dict:
    return {"id": response_id, "output": [], "text": text}


def test_the_store_keeps_the_most_recently_used_within_its_budget():
    one = len(json.dumps(response("r0"))) + len(json.dumps([]))  # what one entry costs
    store = ResponseStore(max_bytes=3 * one + one // 2)  # room for three, not four
    for i in range(3):
        store.put(response(f"r{i}"), [])
    store.get("r0")  # used: now the most recent
    store.put(response("r3"), [])
    assert {"r0", "r2", "r3"} == {r for r in ("r0", "r1", "r2", "r3") if _kept(store, r)}
    assert store.nbytes <= store.max_bytes
    store.put(response("huge", "x" * store.max_bytes), [])  # larger than the whole budget
    assert not _kept(store, "huge") and len(store) == 3


def _kept(store: ResponseStore, response_id: str) -> bool:
    try:
        store.get(response_id)
    except ResponseNotFoundError:
        return False
    return True


def test_a_streamed_response_is_kept_in_progress_then_as_it_first_ended():
    store = ResponseStore(max_bytes=1 << 20)
    keeper = store.keeper([])
    keeper.begin({**response("r0"), "status": "in_progress"})
    assert store.in_progress("r0") and json.loads(store.get("r0").response_json)[
        "status"] == "in_progress"
    keeper.end({**response("r0", "done"), "status": "completed"})
    keeper.end({**response("r0", "cut"), "status": "cancelled"})  # a departure after it
    assert not store.in_progress("r0")
    assert json.loads(store.get("r0").response_json)["status"] == "completed"


def test_a_response_deleted_while_made_is_not_kept_when_it_ends():
    store = ResponseStore(max_bytes=1 << 20)
    keeper = store.keeper([])
    keeper.begin(response("r0"))
    assert store.delete("r0") and not store.in_progress("r0")
    keeper.end(response("r0", "done"))
    assert not _kept(store, "r0") and store.nbytes == 0


def test_an_item_is_found_while_any_stored_response_holds_it():
    store = ResponseStore(max_bytes=1 << 20)
    item = {"id": "msg_a", "type": "message", "role": "user", "content": []}
    store.put(response("r0"), [item])
    store.put(response("r1"), [item, {**item, "id": "msg_b"}])  # r0's conversation, then more
    assert store.holder("msg_a")[0] == "r1"
    store.delete("r1")
    assert store.holder("msg_a")[0] == "r0"
    with pytest.raises(ResponseNotFoundError):
        store.holder("msg_b")
    big = response("r2", "x" * (store.max_bytes - 60))  # fits alone: r0 must go
    store.put(big, [])
    with pytest.raises(ResponseNotFoundError):
        store.holder("msg_a")
    assert len(store) == 1 and store.nbytes == len(json.dumps(big)) + len("[]")


def test_the_item_index_follows_every_put_delete_and_eviction():
    """Whatever is stored, dropped or pushed out, each item id leads to exactly the
    stored responses that hold it (an item in no stored response is not found)."""
    import random

    rng = random.Random(7)
    store = ResponseStore(max_bytes=4000)
    ids = [f"msg_{i}" for i in range(12)]
    for step in range(400):
        if rng.random() < 0.2 and len(store):
            store.delete(rng.choice(list(store._entries)))
            continue
        held = rng.sample(ids, rng.randint(1, 4))
        store.put(response(f"r{step}", "x" * rng.randint(0, 600)),
                  [{"id": i, "type": "message", "role": "user", "content": []} for i in held])
        assert store.nbytes == sum(e.nbytes for e in store._entries.values()) <= 4000
        for item_id in ids:
            holding = [r for r, e in store._entries.items() if item_id in e.item_ids]
            if holding:
                assert store._holders[item_id] and set(store._holders[item_id]) == set(holding)
            else:
                assert item_id not in store._holders


@pytest.mark.parametrize(("query", "param"), [
    ({"stream": "true"}, "stream"), ({"starting_after": "3"}, "starting_after"),
    ({"include[]": "reasoning.encrypted_content"}, "include"),
])
def test_retrieval_refuses_what_would_change_the_stored_response(server, client, query, param):
    """A stored response comes back whole, as made: no replayed events, nothing added."""
    made = create(client, input=FIRST)
    reply = httpx.get(f"{server.base_url}/v1/responses/{made.id}", params=query, timeout=10)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    same = client.responses.retrieve(made.id, include=["message.output_text.logprobs"],
                                     extra_query={"stream": "false"})
    assert same.model_dump() == made.model_dump()
