"""Shared by the black-box HTTP tests: the tiny model's served id and tokens, clients of
a real server, and bounded polls of its /health."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.server_process import ServerProcess

MODEL = "tiny"  # the served id: the tiny model folder's name
EOS_IDS = (0, 2)  # the tiny model's end-of-sequence tokens (<|endoftext|>, <|im_end|>)
NO_EOS = {str(t): -100 for t in EOS_IDS}  # logit_bias that keeps a request going to max_tokens
HI = [{"role": "user", "content": "hi"}]
TIMEOUT = 30.0


def server_fixture(name: str) -> Any:
    """A module's ``server`` fixture: one tiny-model server for the module's tests, its
    log under a temporary folder named ``name``."""

    @pytest.fixture(scope="module")
    def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[ServerProcess]:
        # ServerProcess waits for /health (bounded) on entry and stops the server on exit.
        with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp(name) / "server.log") as proc:
            yield proc

    return server


def client_fixture() -> Any:
    """A module's ``client`` fixture: the sync SDK on the module's ``server``."""

    @pytest.fixture
    def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
        with sdk_client(server) as c:
            yield c

    return client


def sdk_client(server: ServerProcess) -> openai.OpenAI:
    # max_retries=0: the SDK must not hide a 429/5xx/timeout behind a silent retry.
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=TIMEOUT,
                         max_retries=0)


def async_client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=TIMEOUT,
                              max_retries=0)


def chat_prompt_tokens(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> int:
    """Token count of the tiny model's ChatML rendering (with the generation prompt)."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return len(tokenizer.encode(text + "<|im_start|>assistant\n").ids)


def health(server: ServerProcess) -> dict[str, Any]:
    response = httpx.get(server.base_url + "/health", timeout=5)
    assert response.status_code == 200, response.text
    return response.json()


def wait_health(server: ServerProcess, predicate: Callable[[dict[str, Any]], bool],
                timeout: float = 10.0) -> dict[str, Any]:
    """Poll /health until ``predicate(body)`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=server.base_url, timeout=5) as c:
        while True:
            body = c.get("/health").json()
            if predicate(body):
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"/health never satisfied the condition: {body}")
            time.sleep(0.02)


def strict_json(text: str) -> Any:
    """JSON as the standard has it: NaN and Infinity, which Python's json accepts, are not."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def sse_data(lines: list[str]) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order (comments and blank lines dropped)."""
    return [line[len("data:"):].strip() for line in lines if line.startswith("data:")]


def printable_window(text: str, start: int, size: int) -> int | None:
    """Index >= start of ``size`` plain ASCII letters/digits/punctuation, or None."""
    for i in range(start, len(text) - size + 1):
        window = text[i:i + size]
        if all(32 <= ord(ch) < 127 for ch in window) and window.strip() == window and \
                text.index(window) == i:
            return i
    return None


async def read_then_leave(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                          lines: int = 5, require_ok: bool = True) -> None:
    """Stream ``body`` to ``path``, read ``lines`` SSE data lines (or an error reply, when
    not ``require_ok``), then hang up."""
    async with client.stream("POST", path, json=body) as response:
        if require_ok:
            assert response.status_code == 200
        received = 0
        async for line in response.aiter_lines():
            received += line.startswith("data:")
            if received >= lines:
                break
