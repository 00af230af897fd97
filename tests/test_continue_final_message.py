"""vLLM's ``add_generation_prompt`` and ``continue_final_message``: a chat prompt without
the template's generation prompt, and an assistant prefill the reply continues."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from mlx_serve.errors import RequestError
from mlx_serve.prompts import open_final_message
from tests.http_helpers import HI, MODEL, TIMEOUT, server_fixture

server = server_fixture("prefill")
PREFILLED = [*HI, {"role": "assistant", "content": "The answer is"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as client:
        yield client


def prompt_of(http: httpx.Client, messages: list[dict], **options: Any) -> tuple[int, str]:
    """The prompt a chat request gets: its usage's count, and /tokenize's text of it."""
    chat = http.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 3, "temperature": 0, **options})
    assert chat.status_code == 200, chat.text
    tokens = http.post("/tokenize", json={"model": MODEL, "messages": messages, **options})
    assert tokens.status_code == 200, tokens.text
    assert tokens.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    text = http.post("/detokenize", json={"model": MODEL, "tokens": tokens.json()["tokens"]})
    return tokens.json()["count"], text.json()["prompt"]


def test_the_final_message_is_left_open_for_the_reply(http):
    count, text = prompt_of(http, PREFILLED, **CONTINUE)
    closed, closed_text = prompt_of(http, PREFILLED)  # a new assistant turn after it
    assert text.endswith("The answer is")
    assert closed_text.startswith(text) and closed > count


def test_without_the_generation_prompt_the_prompt_ends_with_the_last_turn(http):
    with_prompt, text = prompt_of(http, HI)
    without, bare = prompt_of(http, HI, add_generation_prompt=False)
    assert without < with_prompt and text.startswith(bare)


@pytest.mark.parametrize(("messages", "options"), [
    (PREFILLED, {"continue_final_message": True}),  # the generation prompt still on
    ([*HI, {"role": "assistant", "content": ""}], CONTINUE),  # no text to continue
])
def test_continuing_needs_the_generation_prompt_off_and_text_to_continue(http, messages,
                                                                        options):
    reply = http.post("/v1/chat/completions", json={"messages": messages, **options})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize(("rendered", "content", "expected"), [
    ("<u>hi</u><a>The answer is</a>", "The answer is", "<u>hi</u><a>The answer is"),
    # a template that trims the message: the cut follows the trimmed text
    ("<u>hi</u><a>The answer is</a>", "  The answer is \n", "<u>hi</u><a>The answer is"),
    # a template that keeps it: so does the cut
    ("<a>The answer is </a>", "The answer is ", "<a>The answer is "),
    # the last occurrence is the final message's
    ("<a>is</a><u>x</u><a>is</a>", "is", "<a>is</a><u>x</u><a>is"),
])
def test_the_cut_follows_the_final_message_as_rendered(rendered, content, expected):
    assert open_final_message(rendered, content) == expected


def test_a_template_that_rewrites_the_final_message_cannot_continue_it():
    with pytest.raises(RequestError):
        open_final_message("<a>THE ANSWER IS</a>", "The answer is")
