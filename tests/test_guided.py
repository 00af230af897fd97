"""vLLM's structured-output fields (structured_outputs, guided_*): enforced, or a 400."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.server_process import ServerProcess

CITIES = ["Paris", "Rome", 'Ber"lin é']
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory):
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("guided") / "server.log") as s:
        yield s


def post(server, path: str, **body) -> httpx.Response:
    if path == "/v1/completions":
        body.setdefault("prompt", "The answer is")
    else:
        body.setdefault("messages", [{"role": "user", "content": "Answer."}])
    body.setdefault("max_tokens", 40)
    return httpx.post(server.base_url + path, json=body, timeout=60)


def text_of(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop"  # the constraint ended the reply
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_choice_is_one_of_the_choices(server, path):
    seen = {text_of(post(server, path, temperature=1.0, seed=seed, guided_choice=CITIES))
            for seed in range(6)}
    assert seen <= set(CITIES)
    other = text_of(post(server, path, temperature=1.0, seed=1,
                         structured_outputs={"choice": CITIES}))
    assert other in CITIES


def test_a_regex_matches_the_whole_reply(server):
    pattern = r"[0-9]{3}-[a-z]{2}"
    for seed in range(3):
        text = text_of(post(server, "/v1/completions", temperature=1.0, seed=seed,
                            guided_regex=pattern))
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("field", [{"guided_json": SCHEMA},
                                   {"guided_json": json.dumps(SCHEMA)},
                                   {"structured_outputs": {"json": SCHEMA}}])
def test_a_json_schema_validates(server, field):
    value = json.loads(text_of(post(server, "/v1/chat/completions", temperature=1.0, seed=2,
                                    **field)))
    assert set(value) == {"n"} and isinstance(value["n"], int) and value["n"] <= 99


def test_a_lark_grammar_holds_and_streams(server):
    grammar = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]{1,3}/'
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60, json={
            "prompt": "Well?", "max_tokens": 20, "stream": True, "temperature": 1.0,
            "seed": 4, "structured_outputs": {"grammar": grammar}}) as reply:
        data = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    text = "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1])
    assert re.fullmatch(r"yes|no|maybe [0-9]{1,3}", text), text


@pytest.mark.parametrize(("body", "param"), [
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"grammar": "start: ::= nonsense"}}, "structured_outputs.grammar"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
    ({"structured_outputs": {"choice": ["a"], "structural_tag": "{}"}},
     "structured_outputs.structural_tag"),
    ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos"),
])
def test_a_constraint_that_cannot_be_enforced_is_a_400(server, body, param):
    reply = post(server, "/v1/chat/completions", **body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
