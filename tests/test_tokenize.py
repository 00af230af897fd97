"""vLLM's ``/tokenize`` and ``/detokenize`` on a real server: the same prompt tokens a
completion or chat request gets, and token ids back to text."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.http_helpers import HI, MODEL, TIMEOUT, server_fixture
from tests.server_process import ServerProcess

server = server_fixture("tokenize")
TEXT = "Once upon a time, in a land far away"


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as client:
        yield client


def tokenize(http: httpx.Client, **body: Any) -> dict[str, Any]:
    response = http.post("/tokenize", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_prompt_is_tokenized_as_its_completion_would_be(http, tiny_model_dir: Path):
    reply = tokenize(http, prompt=TEXT)
    expected = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).encode(TEXT).ids
    assert reply["tokens"] == expected and reply["count"] == len(expected)
    assert reply["token_strs"] is None and reply["max_model_len"] > len(expected)
    completion = http.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == reply["count"]


def test_messages_are_tokenized_through_the_chat_template(http):
    reply = tokenize(http, messages=HI)
    chat = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1}).json()
    assert reply["count"] == chat["usage"]["prompt_tokens"] == 17


def test_token_strings_and_the_way_back(http):
    reply = tokenize(http, prompt=TEXT, return_token_strs=True)
    assert len(reply["token_strs"]) == reply["count"]
    assert all(isinstance(s, str) and s for s in reply["token_strs"])
    back = http.post("/detokenize", json={"model": MODEL, "tokens": reply["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": TEXT, "messages": HI}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"messages": HI, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"messages": HI, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": TEXT, "model": "gpt-4o"}, 404, "model"),
    ("/tokenize", {"prompt": TEXT, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("/detokenize", {"tokens": [1, 100000]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_bad_requests_name_the_parameter(http, path, body, status, param):
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_unknown_fields_are_ignored_as_on_every_other_endpoint(http):
    # vLLM's clients send fields of its newer releases (``cache_salt``) or of their own.
    assert tokenize(http, prompt=TEXT, cache_salt="x", bogus=1)["count"] > 0
    back = http.post("/detokenize", json={"tokens": [1, 2], "bogus": 1})
    assert back.status_code == 200, back.text


def test_tokenizer_info_as_lm_eval_checks_for_it(http, tiny_model_dir: Path):
    """lm-evaluation-harness tokenizes on the server when ``/tokenizer_info`` has an
    ``eos_token`` and ``/tokenize`` answers its probe; it renders chats with the template."""
    import json

    info = http.get("/tokenizer_info")
    assert info.status_code == 200
    info = info.json()
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    for name in ("bos_token", "eos_token", "pad_token", "chat_template"):
        assert info[name] == config[name], name
    assert info["tokenizer_class"]  # the loaded class's name, as vLLM reports it
    assert info["model_max_length"] == tokenize(http, prompt="x")["max_model_len"]
    assert "tokenizer_file" not in info and "name_or_path" not in info  # no server paths
    probe = http.post("/tokenize", json={"prompt": "test", "add_special_tokens": False})
    assert isinstance(probe.json()["tokens"], list)
    eos = tokenize(http, prompt=info["eos_token"], add_special_tokens=False)["tokens"]
    assert len(eos) == 1  # the harness takes the first id as the end-of-text token
