"""logprobs, n, several prompts and stop token ids through the official openai SDK (and
raw HTTP where the JSON itself is checked)."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from openai import OpenAI
from tokenizers import Tokenizer

from tests.http_helpers import strict_json

NO_EOS = {"0": -100, "2": -100}  # the tiny model's end-of-sequence ids: exact lengths


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    from tests.server_process import ServerProcess

    log = tmp_path_factory.mktemp("extras") / "server.log"
    with ServerProcess(tiny_model_dir, log) as server:
        yield OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "Tell me a story."}])
    kw.setdefault("max_tokens", 6)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", **kw)


def test_chat_logprobs_report_the_sampled_token_and_sorted_alternatives(client):
    reply = chat(client, logprobs=True, top_logprobs=3, logit_bias=NO_EOS)
    choice = reply.choices[0]
    items = choice.logprobs.content
    assert len(items) == 6
    raw = b"".join(bytes(t.bytes) for t in items).decode("utf-8", "replace")
    assert raw.lstrip(" ") == choice.message.content  # a chat reply drops a leading space
    for t in items:
        values = [a.logprob for a in t.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert t.logprob == pytest.approx(values[0])  # greedy: the best one was sampled


def test_a_nul_byte_token_reads_the_same_in_the_text_and_its_logprobs(client,
                                                                       tiny_model_dir):
    """The byte-level token of byte 0 ("Ā" in the vocabulary) is the NUL character in the
    text, as in its logprobs and in the tokenizer's own decode, whole and streamed."""
    vocab = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).get_vocab()
    forced = {str(vocab["Ā"]): 100}
    reply = client.completions.create(model="tiny", prompt="Once", max_tokens=3,
                                      temperature=0, logprobs=0, logit_bias=forced)
    choice = reply.choices[0]
    assert choice.text == "\x00" * 3 and choice.logprobs.tokens == ["\x00"] * 3
    streamed = client.completions.create(model="tiny", prompt="Once", max_tokens=3,
                                         temperature=0, logit_bias=forced, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "\x00" * 3


def test_streamed_chat_logprobs_cover_every_token(client):
    stream = chat(client, logprobs=True, top_logprobs=0, stream=True, logit_bias=NO_EOS)
    items = [t for chunk in stream for c in chunk.choices if c.logprobs
             for t in c.logprobs.content]
    assert len(items) == 6 and all(t.top_logprobs == [] for t in items)


def test_completion_logprobs_have_the_legacy_shape(client):
    reply = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5,
                                      temperature=0, logprobs=2, logit_bias=NO_EOS)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    # The two likeliest, and the chosen token where it is not one of them (OpenAI: "up to
    # logprobs+1 elements").
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    assert all(t in lp.top_logprobs[i] for i, t in enumerate(lp.tokens))


def test_the_chosen_token_is_among_the_top_logprobs_even_when_unlikely(client):
    reply = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12,
                                      temperature=2.0, seed=3, logprobs=1, logit_bias=NO_EOS)
    lp = reply.choices[0].logprobs
    assert all(t in lp.top_logprobs[i] for i, t in enumerate(lp.tokens))
    # At temperature 2 most sampled tokens are not the likeliest: their entry is the extra.
    extra = [i for i, top in enumerate(lp.top_logprobs) if len(top) == 2]
    assert extra and all(lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i]
                         for i in extra)
    zero = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=3,
                                     temperature=0, logprobs=0, logit_bias=NO_EOS)
    assert [list(top) for top in zero.choices[0].logprobs.top_logprobs] == [
        [t] for t in zero.choices[0].logprobs.tokens]  # as vLLM: the chosen token alone


def test_n_choices_are_indexed_and_seeded_one_by_one(client):
    reply = chat(client, n=3, temperature=1.0, seed=11, logit_bias=NO_EOS)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1
    assert reply.usage.completion_tokens == 18
    again = chat(client, n=3, temperature=1.0, seed=11, logit_bias=NO_EOS)
    assert [c.message.content for c in again.choices] == [
        c.message.content for c in reply.choices]
    streamed: dict[int, str] = {}
    for chunk in chat(client, n=3, temperature=1.0, seed=11, logit_bias=NO_EOS, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == [c.message.content for c in reply.choices]


def test_several_prompts_make_one_choice_each_in_order(client):
    prompts = ["The cat", "A dog", "Servers"]
    reply = client.completions.create(model="tiny", prompt=prompts, max_tokens=4, n=2,
                                      temperature=0, logit_bias=NO_EOS)
    assert [c.index for c in reply.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model="tiny", prompt=prompt, max_tokens=4,
                                          temperature=0, logit_bias=NO_EOS)
        assert reply.choices[2 * i].text == reply.choices[2 * i + 1].text == alone.choices[0].text


def test_stop_token_ids_end_generation_like_an_end_of_sequence(client):
    forced = {**NO_EOS, "100": 100}  # token 100 every time
    plain = client.completions.create(model="tiny", prompt="Once", max_tokens=4,
                                      temperature=0, logit_bias=forced)
    cut = client.completions.create(model="tiny", prompt="Once", max_tokens=4,
                                    temperature=0, logit_bias=forced,
                                    extra_body={"stop_token_ids": [100]})
    assert plain.choices[0].finish_reason == "length" and plain.choices[0].text
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == "" and cut.usage.completion_tokens == 1


@pytest.mark.parametrize("stream", [False, True])
def test_the_token_that_ends_a_reply_has_its_logprob_as_usage_counts_it(client, stream):
    forced = {**NO_EOS, "100": 100}  # token 100 every time
    body = {"model": "tiny", "prompt": "Once", "max_tokens": 4, "temperature": 0,
            "logit_bias": forced, "logprobs": 1, "stop_token_ids": [100], "stream": stream}
    with httpx.Client(base_url=str(client.base_url), timeout=30) as http:
        reply = http.post("completions", json=body)
    assert reply.status_code == 200, reply.text
    if stream:
        chunks = [json.loads(line[6:]) for line in reply.text.splitlines()
                  if line.startswith("data: {")]
        tokens = [t for c in chunks for ch in c["choices"] if ch["logprobs"]
                  for t in ch["logprobs"]["tokens"]]
    else:
        (choice,) = reply.json()["choices"]
        assert choice["finish_reason"] == "stop" and choice["text"] == ""
        tokens = choice["logprobs"]["tokens"]
        assert choice["logprobs"]["text_offset"] == [0]
    assert len(tokens) == 1  # as completion_tokens: the stop token itself


@pytest.mark.parametrize("stream", [False, True])
def test_ruled_out_alternatives_get_a_finite_logprob(client, stream):
    # json_object masks every token that cannot start a JSON object: the alternatives
    # after the first are -inf, which JSON cannot carry. They read -9999.0, as in vLLM.
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": 0, "logprobs": True, "top_logprobs": 5, "stream": stream,
            "response_format": {"type": "json_object"}}
    with httpx.Client(base_url=str(client.base_url), timeout=30) as http:
        response = http.post("/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [strict_json(line[len("data: "):]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        items = [t for c in chunks for ch in c["choices"] if ch["logprobs"]
                 for t in ch["logprobs"]["content"]]
    else:
        items = strict_json(response.text)["choices"][0]["logprobs"]["content"]
    first = items[0]
    assert first["token"] == "{" and first["logprob"] == 0.0  # the only token allowed
    assert [a["logprob"] for a in first["top_logprobs"][1:]] == [-9999.0] * 4


EOS_FIRST = {"0": -100, "2": 100}  # the tiny model answers <|im_end|> at once


def test_min_tokens_holds_off_the_end_of_sequence_until_then(client):
    plain = chat(client, max_tokens=10, logit_bias=EOS_FIRST)
    assert plain.usage.completion_tokens == 1 and plain.choices[0].finish_reason == "stop"
    held = chat(client, max_tokens=10, logit_bias=EOS_FIRST, extra_body={"min_tokens": 4})
    # Four tokens that cannot end it, then the end-of-sequence token it was biased to.
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"
    assert held.choices[0].message.content
    forced = {**NO_EOS, "100": 100}  # token 100 every time, a stop token id here
    stopped = client.completions.create(model="tiny", prompt="Once", max_tokens=8,
                                        temperature=0, logit_bias=forced,
                                        extra_body={"stop_token_ids": [100], "min_tokens": 3})
    assert stopped.usage.completion_tokens == 4 and stopped.choices[0].finish_reason == "stop"


def test_ignore_eos_goes_on_to_max_tokens_without_showing_the_eos(client):
    for stream in (False, True):
        if stream:
            chunks = list(chat(client, max_tokens=6, logit_bias=EOS_FIRST, stream=True,
                               stream_options={"include_usage": True},
                               extra_body={"ignore_eos": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            tokens = chunks[-1].usage.completion_tokens
        else:
            reply = chat(client, max_tokens=6, logit_bias=EOS_FIRST,
                         extra_body={"ignore_eos": True})
            text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
            tokens = reply.usage.completion_tokens
        # Six <|im_end|> tokens: they count, they show no text, and they end nothing.
        assert (text, finish, tokens) == ("", "length", 6)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_decides_whether_they_show(client, skip):
    forced = {"1": 100}  # <|im_start|> every token
    reply = client.completions.create(model="tiny", prompt="Once", max_tokens=3, temperature=0,
                                      logit_bias=forced, logprobs=0,
                                      extra_body={"skip_special_tokens": skip})
    choice = reply.choices[0]
    assert reply.usage.completion_tokens == 3
    assert choice.logprobs.tokens == ["<|im_start|>"] * 3  # the tokens are reported either way
    assert choice.text == ("" if skip else "<|im_start|>" * 3)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logit_bias=forced, stream=True,
        extra_body={"skip_special_tokens": skip})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == ("" if skip else "<|im_start|>" * 3)


def test_stop_strings_count_only_after_min_tokens(client):
    prompt, m = "Once upon a time", 3  # its 5 greedy tokens' texts join into its text

    def complete(**extra):
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=5,
                                          temperature=0, logit_bias=NO_EOS, **extra)
        return reply.choices[0].text, reply.choices[0].finish_reason

    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0,
                                     logprobs=0, logit_bias=NO_EOS).choices[0]
    pieces = full.logprobs.tokens
    assert "".join(pieces) == full.text
    first, after = pieces[0], pieces[m]  # the first token's text; the one after the m
    assert first and first not in "".join(pieces[1:])
    assert after and after not in "".join(pieces[:m])
    assert complete(stop=[first]) == ("", "stop")
    # Inside the first m tokens a stop string does not count; right after them it does.
    assert complete(stop=[first], extra_body={"min_tokens": m}) == (full.text, "length")
    assert complete(stop=[after], extra_body={"min_tokens": m}) == ("".join(pieces[:m]), "stop")


def test_echo_puts_the_prompt_before_the_completion(client):
    prompt = "Once upon a time"
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=5,
                                      temperature=0, logit_bias=NO_EOS).choices[0].text
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=5,
                                      temperature=0, logit_bias=NO_EOS, echo=True)
    assert whole.choices[0].text == prompt + plain
    assert whole.usage.completion_tokens == 5
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=5,
                                            temperature=0, logit_bias=NO_EOS, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text == prompt  # the echo is the choice's first chunk
    assert "".join(c.choices[0].text for c in chunks) == prompt + plain


def test_echo_of_several_prompts_and_of_token_ids(client, tiny_model_dir):
    def text(prompt, **extra) -> list[str]:
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=3,
                                          temperature=0, logit_bias=NO_EOS, **extra)
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    prompts = ["The cat", "A dog"]
    plain = text(prompts)
    # Choices 0-1 answer the first prompt, 2-3 the second; each echoes its own.
    assert text(prompts, n=2, echo=True) == [prompts[i // 2] + plain[i // 2] for i in range(4)]
    ids = [100, 101, 102]
    decoded = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")).decode(ids)
    assert decoded and text(ids, echo=True) == [decoded + text(ids)[0]]


def test_reasoning_effort_for_a_model_that_does_not_reason_is_a_400(client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        chat(client, reasoning_effort="low")
    assert info.value.param == "reasoning_effort"
    assert "not supported with this model" in info.value.message


def test_cached_tokens_add_up_over_the_prompts_of_one_request(client):
    """Each prompt of a list counts its own reuse of the prefix cache, as prompt_tokens
    counts each prompt: before, the request reported the largest single reuse."""
    rng = random.Random(41)
    first, second = ([rng.randrange(3, 500) for _ in range(60)] for _ in range(2))
    for prompt in (first, second):  # stored: their KV is there to reuse
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    reply = client.completions.create(model="tiny", prompt=[first[:30] + [7], second + [7]],
                                      max_tokens=2, temperature=0, n=2)
    assert reply.usage.prompt_tokens == 31 + 61
    assert reply.usage.prompt_tokens_details.cached_tokens == 30 + 60


def test_the_choices_of_one_chat_share_its_cached_tokens(client):
    """n choices of one prompt share its prefill: its reuse counts once, not n times."""
    messages = [{"role": "system", "content": "You answer briefly and well. " * 8},
                {"role": "user", "content": "hi"}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                   temperature=0)  # stored
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                           temperature=0, n=3)
    cached = reply.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < reply.usage.prompt_tokens
