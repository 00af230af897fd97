"""Completions' ``echo`` with ``logprobs``: the prompt's own tokens scored, as evaluation
harnesses (lm-evaluation-harness's ``local-completions``) read them."""

from __future__ import annotations

from operator import itemgetter

import httpx
import mlx.core as mx
import pytest
from openai import OpenAI

from tests.http_helpers import strict_json

# Prompts longer than this are scored in several chunks: the chunks' seams are tested.
PREFILL_STEP = 4
PROMPT = "Once upon a time there was a little cat who lived by the sea"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from tests.server_process import ServerProcess

    log = tmp_path_factory.mktemp("prompt-logprobs") / "server.log"
    with ServerProcess(tiny_model_dir, log,
                       args=["--prefill-step-size", str(PREFILL_STEP)]) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def prompt_ids(http) -> list[int]:
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert len(ids) > 3 * PREFILL_STEP
    return ids


def complete(http, **body) -> dict:
    reply = http.post("/v1/completions", json={"temperature": 0, **body})
    assert reply.status_code == 200, reply.text
    return strict_json(reply.text)


def test_each_prompt_token_is_scored_as_the_model_would_generate_it(http, prompt_ids):
    """Position i's alternatives equal the first-token alternatives of the prompt cut
    before i: the same distribution, whether scored or sampled from."""
    scored = complete(http, prompt=prompt_ids, max_tokens=1, logprobs=5,
                      echo=True)["choices"][0]["logprobs"]
    assert scored["token_logprobs"][0] is None and scored["top_logprobs"][0] is None
    assert len(scored["tokens"]) == len(prompt_ids) + 1
    for i in range(1, len(prompt_ids)):
        # ignore_eos: a first token that is EOS would end the reply without logprobs;
        # greedy: the sampled token is the likeliest, so no entry beyond the five.
        sampled = complete(http, prompt=prompt_ids[:i], max_tokens=1, logprobs=5,
                           ignore_eos=True, temperature=0)["choices"][0]["logprobs"]
        sampled = sampled["top_logprobs"][0]
        top, own = scored["top_logprobs"][i], scored["tokens"][i]
        # The prompt's own token is there too, beside the five where it is not one.
        assert own in top
        assert set(sampled) <= set(top) and set(top) - set(sampled) <= {own}, i
        assert [top[k] for k in sampled] == pytest.approx(list(sampled.values()), abs=1e-4), i
        assert scored["token_logprobs"][i] <= max(top.values()) + 1e-6


def greedy_continuation(model_dir, context: list[int], length: int) -> list[int]:
    """The tiny model's own greedy tokens after ``context``, computed in this process."""
    import mlx_lm

    model, _ = mlx_lm.load(str(model_dir))
    tokens = list(context)
    for _ in range(length):
        tokens.append(int(mx.argmax(model(mx.array(tokens)[None])[0, -1]).item()))
    return tokens[len(context):]


def lm_eval_loglikelihood(reply: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's ``LocalCompletionsAPI.parse_logprobs``, restated: the
    continuation's summed log-probability, and whether every token was the top one."""
    out = []
    for choice, ctxlen in zip(sorted(reply["choices"], key=itemgetter("index")), ctxlens,
                              strict=True):
        values = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        out.append((sum(values), all(v == max(t.values()) for v, t in zip(values, tops,
                                                                         strict=True))))
    return out


def test_an_lm_eval_loglikelihood_request(http, prompt_ids, tiny_model_dir):
    """The harness's exact request, several token-id prompts in one, read its way."""
    context = prompt_ids[:6]
    greedy = greedy_continuation(tiny_model_dir, context, 5)
    other = [(t + 1) % 512 for t in greedy]  # a continuation the model would not pick
    reply = complete(http, prompt=[context + greedy, context + other], max_tokens=1,
                     logprobs=1, seed=1234, echo=True)
    (greedy_sum, greedy_is_top), (other_sum, other_is_top) = lm_eval_loglikelihood(
        reply, [len(context), len(context)])
    assert greedy_is_top and not other_is_top
    assert greedy_sum > other_sum
    # The sum is the continuation's own scores, as scoring it token by token gives.
    by_step = sum(complete(http, prompt=context + greedy[:i + 1], max_tokens=1, logprobs=0,
                           echo=True)["choices"][0]["logprobs"]["token_logprobs"][-2]
                  for i in range(len(greedy)))
    assert greedy_sum == pytest.approx(by_step, abs=1e-3)
    assert reply["usage"]["prompt_tokens"] == 2 * (len(context) + 5)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_offsets_index_the_echoed_text(server):
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(model="tiny", prompt=[PROMPT, "The sea"], n=2,
                                      max_tokens=3, temperature=0, logprobs=2, echo=True,
                                      logit_bias={"0": -100, "2": -100})
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for choice in reply.choices:
        prompt = PROMPT if choice.index < 2 else "The sea"
        lp = choice.logprobs
        assert choice.text.startswith(prompt)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset)
        scored = len(lp.tokens) - 3
        assert "".join(lp.tokens[:scored]) == prompt  # the prompt's tokens, then the reply's
        for token, at in zip(lp.tokens, lp.text_offset, strict=True):
            if not token.startswith("bytes:"):  # a piece of a character: its bytes
                assert choice.text[at:at + len(token)] == token
        # Two alternatives that decode to the same text share one key; the position's
        # own token is there too, where it is not among the two.
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])
        assert all(token in top for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:],
                                                      strict=True))


def test_offsets_stay_in_order_where_characters_are_split_across_tokens(server):
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    prompt = "世界 hi"  # each CJK character is several byte tokens of the tiny tokenizer
    choice = client.completions.create(model="tiny", prompt=prompt, max_tokens=3,
                                       temperature=0, logprobs=0, echo=True,
                                       logit_bias={"0": -100, "2": -100}).choices[0]
    offsets = choice.logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[-1] <= len(choice.text), offsets
    # Whole tokens start where their text is: " hi"'s pieces at 2 on.
    for token, at in zip(choice.logprobs.tokens, offsets, strict=True):
        if not token.startswith("bytes:"):  # pieces of a character are their bytes
            assert choice.text[at:at + len(token)] == token, (token, at, choice.text)


def test_a_stream_sends_the_scored_echo_first(server, http, prompt_ids):
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                            temperature=0, logprobs=1, echo=True,
                                            stream=True, logit_bias={"0": -100, "2": -100}))
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.finish_reason is None
    whole = complete(http, prompt=PROMPT, max_tokens=4, logprobs=1, echo=True,
                     logit_bias={"0": -100, "2": -100})["choices"][0]
    streamed = [t for c in chunks for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=1e-5)
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole["logprobs"]["text_offset"]
    assert "".join(c.choices[0].text for c in chunks) == whole["text"]
    # The batch went on from the scoring pass's KV: the same reply as without the echo.
    plain = complete(http, prompt=PROMPT, max_tokens=4, logit_bias={"0": -100, "2": -100})
    assert whole["text"] == PROMPT + plain["choices"][0]["text"]


def test_a_one_token_prompt_has_nothing_to_score(http):
    reply = complete(http, prompt=[100], max_tokens=2, logprobs=1, echo=True,
                     logit_bias={"0": -100, "2": -100})
    lp = reply["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == 3
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])


def test_max_tokens_0_with_echo_scores_the_prompt_alone(http, prompt_ids):
    """OpenAI's legacy way to score a prompt (older evaluation harnesses send it): the
    reply is the echoed prompt and its scores, with no token of its own."""
    alone = complete(http, prompt=PROMPT, max_tokens=0, logprobs=2, echo=True)
    going_on = complete(http, prompt=PROMPT, max_tokens=1, logprobs=2, echo=True)
    choice, reference = alone["choices"][0], going_on["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    lp, ref = choice["logprobs"], reference["logprobs"]
    assert len(lp["tokens"]) == len(prompt_ids)
    for key in ("tokens", "top_logprobs", "text_offset"):
        assert lp[key] == ref[key][:-1], key
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(ref["token_logprobs"][1:-1], abs=1e-6)
    assert alone["usage"]["completion_tokens"] == 0
    assert alone["usage"]["prompt_tokens"] == alone["usage"]["total_tokens"] == len(prompt_ids)
    # Without logprobs, and for several prompts and choices: each echo, nothing more.
    several = complete(http, prompt=[PROMPT, "The sea"], n=2, max_tokens=0, echo=True)
    assert [(c["index"], c["text"], c["logprobs"], c["finish_reason"])
            for c in several["choices"]] == [
        (i, PROMPT if i < 2 else "The sea", None, "length") for i in range(4)]


def test_max_tokens_0_with_echo_streams_the_prompt_then_the_end(server):
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    chunks = list(client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=0, temperature=0, logprobs=1, echo=True,
        stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts == [PROMPT, ""]
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None, "length"]
    scored = [v for c in chunks if c.choices for v in c.choices[0].logprobs.token_logprobs]
    assert scored[0] is None and all(isinstance(v, float) for v in scored[1:])
    assert chunks[-1].usage.completion_tokens == 0


def test_max_tokens_0_with_prompt_logprobs_gives_the_scores_alone(http, prompt_ids):
    alone = complete(http, prompt=prompt_ids, max_tokens=0, prompt_logprobs=2)
    going_on = complete(http, prompt=prompt_ids, max_tokens=1, prompt_logprobs=2)
    choice = alone["choices"][0]
    assert choice["text"] == "" and choice["finish_reason"] == "length"
    assert choice["logprobs"] is None and alone["usage"]["completion_tokens"] == 0
    positions, reference = choice["prompt_logprobs"], going_on["choices"][0]["prompt_logprobs"]
    assert len(positions) == len(prompt_ids) and positions[0] is None
    for entry, ref in zip(positions[1:], reference[1:], strict=True):
        assert entry.keys() == ref.keys()
        for token, e in entry.items():
            assert e["rank"] == ref[token]["rank"]
            assert e["logprob"] == pytest.approx(ref[token]["logprob"], abs=1e-6)


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"max_tokens": 0}, "max_tokens", "must be at least 1"),
    ({"max_tokens": 0, "logprobs": 1}, "max_tokens", "must be at least 1"),
    ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens", "at most max_tokens (0)"),
])
def test_max_tokens_0_asks_for_nothing_without_echo_or_prompt_logprobs(http, body, param,
                                                                       says):
    reply = http.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert says in error["message"], error


def test_scores_do_not_depend_on_chunks_or_neighbours(tiny_model_dir):
    """In-process: prompts scored alone in one chunk, in chunks of 3, or right-padded
    beside others give the same scores, and each leaves the KV its continuation needs."""
    import mlx_lm

    from mlx_serve.runner.logprobs import TokenTexts
    from mlx_serve.runner.prompt_scoring import score_prompts

    model, tokenizer = mlx_lm.load(str(tiny_model_dir))
    prompts = [tokenizer.encode(text) for text in (PROMPT, "The sea", "A", "Rain fell")]
    texts = TokenTexts(tokenizer)
    alone = [score_prompts(model, [p], [3], texts, chunk_tokens=1024, max_rows=1)[0]
             for p in prompts]
    for chunk, rows in ((3, 1), (1024, 4), (6, 4)):
        together = score_prompts(model, prompts, [3, 1, 0, 2], texts, chunk_tokens=chunk,
                                 max_rows=rows)
        for prompt, (scores, cache), (reference, _), k in zip(
                prompts, together, alone, [3, 1, 0, 2], strict=True):
            assert scores.first_token == tokenizer.decode(prompt[:1])
            assert [t.token for t in scores.scored] == [texts(t)[0] for t in prompt[1:]]
            assert [t.logprob for t in scores.scored] == pytest.approx(
                [t.logprob for t in reference.scored], abs=1e-4), (chunk, rows)
            assert [[a[0] for a in t.top] for t in scores.scored] == [
                [a[0] for a in t.top][:k] for t in reference.scored]
            if len(prompt) == 1:
                assert cache is None and scores.scored == ()
                continue
            assert cache[0].offset == len(prompt) - 1  # the batch goes on from the last
            going_on = model(mx.array(prompt[-1:])[None], cache=cache)[0, -1]
            from_scratch = model(mx.array(prompt)[None])[0, -1]
            assert mx.allclose(going_on, from_scratch, atol=1e-4).item()


def test_the_same_prompt_is_scored_once_and_each_copy_goes_on_alone(tiny_model_dir):
    """A request's n choices (or several requests) with one prompt: the model sees it
    once, each gets the scores it asked for and a KV cache of its own."""
    import mlx_lm

    from mlx_serve.runner.logprobs import TokenTexts
    from mlx_serve.runner.prompt_scoring import score_prompts

    model, tokenizer = mlx_lm.load(str(tiny_model_dir))
    rows: list[int] = []

    class Counting:  # the model, recording how many rows each forward pass carries
        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, tokens, cache=None):
            rows.append(tokens.shape[0])
            return model(tokens, cache=cache)

    prompt, other = tokenizer.encode(PROMPT), tokenizer.encode("The sea")
    texts = TokenTexts(tokenizer)
    got = score_prompts(Counting(), [prompt, other, prompt, prompt], [1, 0, 3, 0], texts,
                        chunk_tokens=1024, max_rows=4, ranks=[False, False, False, True])
    assert rows == [2]  # one pass, one row for each distinct prompt
    (reference, _), = score_prompts(model, [prompt], [3], texts, chunk_tokens=1024,
                                    max_rows=1, ranks=[True])
    for (scores, _), k, ranked in zip([got[0], got[2], got[3]], [1, 3, 0],
                                      [False, False, True], strict=True):
        assert [t.logprob for t in scores.scored] == pytest.approx(
            [t.logprob for t in reference.scored], abs=1e-4)
        assert [len(t.top) for t in scores.scored] == [k] * len(reference.scored)
        assert scores.ranks == (reference.ranks if ranked else ())
    caches = [got[i][1] for i in (0, 2, 3)]
    assert len({id(c[0].keys) for c in caches}) == 3  # no two share an array to extend
    from_scratch = model(mx.array(prompt)[None])[0, -1]
    model(mx.array(prompt[-1:])[None], cache=caches[0])  # one copy goes on ...
    for cache in caches[1:]:  # ... and the others are where they were
        assert cache[0].offset == len(prompt) - 1
        going_on = model(mx.array(prompt[-1:])[None], cache=cache)[0, -1]
        assert mx.allclose(going_on, from_scratch, atol=1e-4).item()


def test_a_request_taken_while_the_batch_was_broken_still_gets_its_scores(tiny_model_dir):
    """A request that arrives behind a failed step is replayed by the rebuild before it
    was ever admitted: its prompt is scored by the next step, as a newcomer's is."""
    from mlx_serve.failpoints import FailPoints
    from mlx_serve.generation import GenerationRequest, OutputOptions, SamplingParams
    from mlx_serve.runner import BatchLimits, load_runner

    def run(failpoints: str | None) -> dict[str, list]:
        fp = FailPoints.from_spec(failpoints)
        runner = load_runner(str(tiny_model_dir), limits=BatchLimits(), failpoints=fp)
        prompt = tuple(runner.encode(PROMPT))
        params = SamplingParams(max_tokens=3, temperature=0.0)
        plain = GenerationRequest("plain", prompt[:5], params)
        scored = GenerationRequest("scored", prompt, params, output=OutputOptions(
            logprobs=1, keep_leading_space=True, prompt_logprobs=1))
        deltas: dict[str, list] = {"plain": [], "scored": []}
        outcome = runner.step([plain], [])
        if failpoints is not None:
            assert outcome.error is not None  # the batch is broken now
            assert runner.step([scored], []).skipped  # taken, not admitted
            runner.rebuild()
            outcome = runner.step([], [])
        else:
            outcome = runner.step([scored], [])
        for _ in range(20):
            for request_id, delta in outcome.deltas:
                deltas[request_id].append(delta)
            if all(d and d[-1].finish_reason for d in deltas.values()):
                break
            outcome = runner.step([], [])
        runner.close()
        fp.release()
        return deltas

    clean, recovered = run(None), run("engine.step=1*raise(RuntimeError:broken)->off")
    for deltas in (clean, recovered):
        carrying = [d.prompt_logprobs for d in deltas["scored"] if d.prompt_logprobs]
        assert len(carrying) == 1 and deltas["scored"][0].prompt_logprobs is carrying[0]
    assert [t.logprob for t in recovered["scored"][0].prompt_logprobs.scored] == \
        pytest.approx([t.logprob for t in clean["scored"][0].prompt_logprobs.scored], abs=1e-5)
    assert [d.text for d in recovered["scored"]] == [d.text for d in clean["scored"]]


# -- vLLM's prompt_logprobs ---------------------------------------------------------------

def test_vllm_prompt_logprobs_key_each_position_by_token_id(http, prompt_ids):
    """Each position holds the prompt's own token (its rank in the vocabulary) and the
    k likeliest, ranked 1..k; the values are the echo's."""
    reply = complete(http, prompt=prompt_ids, max_tokens=1, prompt_logprobs=2)
    choice = reply["choices"][0]
    positions = choice["prompt_logprobs"]
    assert choice["logprobs"] is None and positions[0] is None
    assert len(positions) == len(prompt_ids)
    echoed = complete(http, prompt=prompt_ids, max_tokens=1, logprobs=2,
                      echo=True)["choices"][0]["logprobs"]
    for i, entry in enumerate(positions[1:], 1):
        own = entry[str(prompt_ids[i])]
        assert own["logprob"] == pytest.approx(echoed["token_logprobs"][i], abs=1e-6)
        assert own["decoded_token"] == echoed["tokens"][i]
        top = sorted((e for e in entry.values() if e["rank"] <= 2), key=lambda e: e["rank"])
        assert [e["rank"] for e in top] == [1, 2] and top[0]["logprob"] >= top[1]["logprob"]
        if own["rank"] <= 2:  # among the alternatives: listed once, at its place
            assert len(entry) == 2 and top[own["rank"] - 1] is own
        else:
            assert len(entry) == 3 and own["logprob"] <= top[1]["logprob"]


def test_the_models_own_greedy_tokens_rank_first(http, prompt_ids, tiny_model_dir):
    context = prompt_ids[:6]
    greedy = greedy_continuation(tiny_model_dir, context, 4)
    positions = complete(http, prompt=context + greedy, max_tokens=1,
                         prompt_logprobs=1)["choices"][0]["prompt_logprobs"]
    entries = [positions[len(context) + i] for i in range(len(greedy))]
    assert [e[str(t)]["rank"] for e, t in zip(entries, greedy, strict=True)] == [1] * 4
    assert all(len(e) == 1 for e in entries)  # the top one is the token itself


def test_vllm_prompt_logprobs_in_a_chat_reply_cover_the_rendered_prompt(http):
    reply = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
        "temperature": 0, "prompt_logprobs": 0, "n": 2})
    assert reply.status_code == 200, reply.text
    body = strict_json(reply.text)
    positions = body["prompt_logprobs"]
    assert len(positions) == body["usage"]["prompt_tokens"] and positions[0] is None
    assert all(len(entry) == 1 for entry in positions[1:])  # no alternatives: its own only


def test_vllm_prompt_logprobs_beside_an_echo_keep_their_own_counts(http, prompt_ids):
    choice = complete(http, prompt=prompt_ids, max_tokens=1, logprobs=1, echo=True,
                      prompt_logprobs=3)["choices"][0]
    # One alternative, and the position's own token where it is another.
    assert all(1 <= len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])
    assert all(3 <= len(entry) <= 4 for entry in choice["prompt_logprobs"][1:])


def test_vllm_prompt_logprobs_are_not_streamed(http):
    reply = http.post("/v1/completions", json={"prompt": "hi", "stream": True,
                                               "prompt_logprobs": 1})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt_logprobs"


def test_a_token_reports_its_own_bytes_also_as_a_sentencepiece_byte_fallback():
    from mlx_serve.runner.logprobs import TokenTexts

    class SentencePieceLike:  # byte-fallback tokens are pieces named <0xNN>
        pieces = {0: "<0xE2>", 1: "<0xF0>", 2: "▁sea", 3: "<0x41>"}
        texts = {0: "\ufffd", 1: "\ufffd", 2: " sea", 3: "A"}

        def decode(self, ids):
            return self.texts[ids[0]]

        def convert_ids_to_tokens(self, token):
            return self.pieces[token]

    texts = TokenTexts(SentencePieceLike())
    # Before, both pieces reported the bytes of U+FFFD, as their text reads.
    assert texts(0) == ("\ufffd", (0xE2,)) and texts(1) == ("\ufffd", (0xF0,))
    assert texts(2) == (" sea", tuple(b" sea")) and texts(3) == ("A", (0x41,))
