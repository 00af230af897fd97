"""--stream-interval: fewer, larger chunks; the same text, usage and finish.

The same server also runs with MLX's buffer cache off (--mlx-cache-limit-bytes 0).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from tests.server_process import ServerProcess

INTERVAL = 4


@pytest.fixture(scope="module")
def interval_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("interval") / "server.log"
    with ServerProcess(tiny_model_dir, log,
                       env={"MLX_SERVE_STREAM_INTERVAL": str(INTERVAL),
                            "MLX_SERVE_MLX_CACHE_LIMIT_BYTES": "0"}) as server:
        yield server


def streamed(server: ServerProcess, body: dict) -> list[dict]:
    with httpx.stream("POST", server.base_url + "/v1/completions",
                      json={**body, "stream": True,
                            "stream_options": {"include_usage": True}},
                      timeout=60) as reply:
        assert reply.status_code == 200
        lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_chunks_carry_several_tokens_and_add_up_to_the_whole_reply(interval_server, seed):
    body = {"prompt": f"Once upon a time {seed}", "max_tokens": 30, "temperature": 0}
    whole = httpx.post(interval_server.base_url + "/v1/completions", json=body,
                       timeout=60).json()
    chunks = streamed(interval_server, body)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    usage = chunks[-1]["usage"]
    assert "".join(texts) == whole["choices"][0]["text"]
    assert finishes[-1] == whole["choices"][0]["finish_reason"]
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"]
    tokens = usage["completion_tokens"]
    # The first token goes out alone; then at most one chunk per INTERVAL tokens, plus
    # one for the finish.
    assert len(texts) <= 1 + math.ceil((tokens - 1) / INTERVAL) + 1
    if tokens > 2 * INTERVAL:
        assert len(texts) < tokens


def test_n_choices_stream_with_their_own_indexes(interval_server):
    body = {"prompt": "The sea", "max_tokens": 12, "temperature": 0.8, "seed": 7, "n": 2}
    whole = httpx.post(interval_server.base_url + "/v1/completions", json=body,
                       timeout=60).json()
    chunks = streamed(interval_server, body)
    for index in (0, 1):
        text = "".join(c["choices"][0]["text"] for c in chunks
                       if c["choices"] and c["choices"][0]["index"] == index)
        assert text == whole["choices"][index]["text"]


def test_merging_keeps_each_choice_s_order_and_leaves_rich_deltas_alone():
    from mlx_serve.errors import GenerationError
    from mlx_serve.generation import Delta, Failure, FinishReason, TokenLogprob
    from mlx_serve.streaming import merge_text_deltas

    lp = (TokenLogprob("x", (120,), -0.5),)
    events = [Delta("a", 1, index=0), Delta("b", 1, index=1), Delta("c", 1, index=0),
              Delta("d", 1, index=1, logprobs=lp), Delta("e", 1, index=1),
              Delta("f", 1, FinishReason.STOP, index=0, cached_tokens=3),
              Delta("g", 1, index=0)]
    merged = merge_text_deltas(events)
    assert [(d.index, d.text, d.token_count, d.finish_reason) for d in merged] == [
        (0, "acf", 3, FinishReason.STOP), (1, "b", 1, None), (1, "d", 1, None),
        (1, "e", 1, None), (0, "g", 1, None)]
    assert merged[0].cached_tokens == 3 and merged[2].logprobs == lp
    failure = Failure(GenerationError("boom"), 1)
    assert merge_text_deltas([Delta("a", 1), failure, Delta("b", 1)]) == [
        Delta("ab", 2), failure]


def test_with_a_zero_cache_limit_mlx_keeps_no_freed_memory(interval_server):
    body = {"prompt": "Memory", "max_tokens": 20, "temperature": 0}
    for _ in range(2):
        assert httpx.post(interval_server.base_url + "/v1/completions", json=body,
                          timeout=60).status_code == 200
    memory = httpx.get(interval_server.base_url + "/health", timeout=5).json()["memory"]
    assert memory["active_bytes"] > 0  # the weights
    assert memory["cache_bytes"] == 0
    assert memory["peak_bytes"] >= memory["active_bytes"]
