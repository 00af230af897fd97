"""Structured output (runner.structured): constrained decoding inside mlx-lm's shared batch.

The tiny model is random, so left alone it writes noise: every constrained output being
valid JSON that matches its schema is a strong test of the logits processor.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler

from mlx_serve.runner.structured import StructuredOutputError, compile_response_format

# Every string and number is bounded, so even a random model finishes well within budget.
ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "admin": {"type": "boolean"},
        "status": {"enum": ["open", "closed", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "note": {"anyOf": [{"type": "integer", "minimum": -9, "maximum": 9}, {"type": "null"}]},
    },
    "required": ["name", "age", "admin", "status", "tags", "note"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a user as JSON.", "Hello, how are you today?", "Tell me a story.",
           "What is the capital of France?"]
GREEDY = make_sampler(0.0)
WARM = make_sampler(1.0)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


def check(value: object, schema: dict) -> None:
    """Validate with jsonschema where installed, else by hand for the schemas used here."""
    try:
        import jsonschema
    except ImportError:
        return _check_by_hand(value, schema)
    jsonschema.validate(value, schema)


def _check_by_hand(value: object, schema: dict) -> None:
    if "anyOf" in schema:
        errors = []
        for option in schema["anyOf"]:
            try:
                return _check_by_hand(value, option)
            except AssertionError as exc:
                errors.append(exc)
        raise AssertionError(errors)
    if "enum" in schema:
        assert value in schema["enum"]
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value)
    elif kind is not None:
        assert isinstance(value, types[kind]), (value, kind)
    if kind == "string":
        assert len(value) <= schema.get("maxLength", len(value))
    if kind == "array":
        assert len(value) <= schema.get("maxItems", len(value))
        for item in value:
            _check_by_hand(item, schema["items"])
    if kind == "object":
        assert set(schema.get("required", ())) <= set(value)
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props)
        for key, item in value.items():
            if key in props:
                _check_by_hand(item, props[key])


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path):
    model, tokenizer = mlx_lm.load(str(tiny_model_dir))
    return model, tokenizer


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True)


def run_batch(model, tokenizer, prompts, processors, samplers, max_tokens=200):
    """Generate in one BatchGenerator; return [(tokens without EOS, finish_reason)]."""
    gen = BatchGenerator(model, stop_tokens=[[t] for t in sorted(tokenizer.eos_token_ids)])
    try:
        uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts), samplers=samplers,
                          logits_processors=processors)
        out: dict[int, list[int]] = {u: [] for u in uids}
        finish: dict[int, str] = {}
        for _ in range(max_tokens + 50):  # bounded: prefill steps plus one per token
            for r in gen.next()[1]:
                if r.finish_reason != "stop":
                    out[r.uid].append(r.token)
                if r.finish_reason:
                    finish[r.uid] = r.finish_reason
            if len(finish) == len(uids):
                break
        assert len(finish) == len(uids), "generation did not finish"
        return [(out[u], finish[u]) for u in uids]
    finally:
        gen.close()


def test_schema_outputs_validate_in_a_batch_shared_with_unconstrained_requests(tiny):
    model, tok = tiny
    mx.random.seed(0)
    fmt = compile_response_format(tok, schema_format(ITEM), model.args.vocab_size)
    prompts = [chat(tok, p) for p in PROMPTS]
    processors = [[fmt.make_processor(len(prompts[0]))], [],
                  [fmt.make_processor(len(prompts[2]))], []]
    results = run_batch(model, tok, prompts, processors, [GREEDY, GREEDY, WARM, WARM])
    for i in (0, 2):
        tokens, finish = results[i]
        assert finish == "stop"
        check(json.loads(tok.decode(tokens)), ITEM)
    assert results[1][1] == "length"  # the random model, unconstrained, never says EOS


@pytest.mark.parametrize("seed", range(3))
def test_sampled_outputs_always_validate(tiny, seed):
    model, tok = tiny
    mx.random.seed(seed)
    fmt = compile_response_format(tok, schema_format(ITEM), model.args.vocab_size)
    prompts = [chat(tok, p) for p in PROMPTS]
    processors = [[fmt.make_processor(len(p))] for p in prompts]
    for tokens, finish in run_batch(model, tok, prompts, processors, [WARM] * 4):
        assert finish == "stop"
        check(json.loads(tok.decode(tokens)), ITEM)


def test_json_object_is_an_object_whenever_it_stops(tiny):
    model, tok = tiny
    mx.random.seed(1)
    fmt = compile_response_format(tok, {"type": "json_object"}, model.args.vocab_size)
    prompts = [chat(tok, p) for p in PROMPTS]
    processors = [[fmt.make_processor(len(p))] for p in prompts]
    results = run_batch(model, tok, prompts, processors, [GREEDY, GREEDY, WARM, WARM])
    # Free-form keys and strings are unbounded, so a random model may run out of tokens.
    stopped = [tokens for tokens, finish in results if finish == "stop"]
    assert stopped
    for tokens in stopped:
        assert isinstance(json.loads(tok.decode(tokens)), dict)


def test_replayed_request_continues_exactly(tiny):
    model, tok = tiny
    fmt = compile_response_format(tok, schema_format(ITEM), model.args.vocab_size)
    prompt = chat(tok, PROMPTS[0])
    (full, finish), = run_batch(model, tok, [prompt], [[fmt.make_processor(len(prompt))]],
                                [GREEDY])
    assert finish == "stop" and len(full) > 12
    for k in (1, 5, 12):
        done = full[:k]
        processor = fmt.make_processor_at(len(prompt), done)
        (rest, finish), = run_batch(model, tok, [prompt + done], [[processor]], [GREEDY],
                                    max_tokens=200 - k)
        assert finish == "stop"
        assert done + rest == full


def test_processor_is_idempotent_and_ends_with_eos_only(tiny):
    model, tok = tiny
    vocab = model.args.vocab_size
    fmt = compile_response_format(tok, schema_format(ITEM), vocab)
    text = '{"name": "Ann", "age": 7, "admin": true, "status": "open", "tags": [], "note": null}'
    answer = tok.encode(text, add_special_tokens=False)
    prompt = [1, 5, 6]
    processor = fmt.make_processor(len(prompt))
    logits = mx.zeros((1, vocab))
    eos = sorted(tok.eos_token_ids)
    for i in range(len(answer)):
        context = mx.array(prompt + answer[:i])
        first = processor(context, logits)
        again = processor(context, logits)  # a repeat call consumes nothing new
        assert mx.array_equal(first, again)
        allowed = set(_allowed(first))
        assert answer[i] in allowed
        assert not set(eos) & allowed, "EOS allowed before the JSON is complete"
    done = processor(mx.array(prompt + answer), logits)
    assert _allowed(done) == eos  # complete: EOS is the only choice
    # mlx-lm calls once more with the EOS in the context before it sees the finish.
    processor(mx.array(prompt + answer + [eos[0]]), logits)


def _allowed(logits: mx.array) -> list[int]:
    finite = mx.isfinite(logits[0]).tolist()
    return [i for i, ok in enumerate(finite) if ok]


@pytest.mark.parametrize("extra", [88, -12])
def test_the_mask_spans_the_model_vocabulary(tiny, extra):
    """A padded embedding's extra ids are never allowed; a smaller one is still covered."""
    model, tok = tiny
    width = model.args.vocab_size + extra
    fmt = compile_response_format(tok, {"type": "json_object"}, width)
    logits = mx.where(mx.arange(width) >= 500, 100.0, 0.0)[None]
    out = fmt.make_processor(3)(mx.array([1, 5, 6]), logits)
    assert out.shape == (1, width)
    allowed = _allowed(out)
    assert allowed and max(allowed) < min(width, len(tok._tokenizer))
    assert all(tok.decode([t]).startswith("{") for t in allowed)


def test_replay_rejects_tokens_the_format_forbids(tiny):
    model, tok = tiny
    fmt = compile_response_format(tok, {"type": "json_object"}, model.args.vocab_size)
    with pytest.raises(RuntimeError):
        fmt.make_processor_at(3, tok.encode("hello", add_special_tokens=False))


@pytest.mark.parametrize("response_format", [
    schema_format({"type": "strin"}),
    schema_format({"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-"}}}),
    schema_format({"type": "string", "minLength": 5, "maxLength": 2}),
    schema_format({"type": "string", "format": "no-such-format"}),
    schema_format({"$ref": "#/$defs/missing"}),
    schema_format({"$ref": "#"}),  # these three admit no value: their first mask fails
    schema_format({"anyOf": [{"$ref": "#"}]}),
    schema_format({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                   "$ref": "#/$defs/a"}),
    schema_format({"type": "array", "uniqueItems": True}),  # not enforceable: refused
    {"type": "json_schema", "json_schema": {"name": "t", "schema": ["not", "an", "object"]}},
    {"type": "json_schema", "json_schema": "nope"},
    {"type": "json_schema"},
    {"type": "xml"},
    "json_object",
])
def test_invalid_formats_raise(tiny, response_format):
    model, tok = tiny
    with pytest.raises(StructuredOutputError):
        compile_response_format(tok, response_format, model.args.vocab_size)


def test_compiled_formats_are_cached_and_thread_safe(tiny):
    model, tok = tiny
    vocab = model.args.vocab_size
    schemas = [dict(ITEM, title=f"s{i}") for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        compiled = list(pool.map(
            lambda s: compile_response_format(tok, schema_format(s), vocab), schemas * 2))
    assert all(c is not None for c in compiled)
    again = compile_response_format(tok, schema_format(dict(ITEM, title="s3")), vocab)
    assert again is compile_response_format(tok, schema_format(dict(ITEM, title="s3")), vocab)


@pytest.mark.default_model
@pytest.mark.timeout(600)
def test_default_model_fills_a_schema():
    from mlx_serve.models import resolve_model

    path, _ = resolve_model(None)
    model, tok = mlx_lm.load(path)
    schema = {"type": "object",
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = compile_response_format(tok, schema_format(schema), model.args.vocab_size)
    prompt = chat(tok, "Invent a person. Reply with JSON giving their name and age.")
    (tokens, finish), = run_batch(model, tok, [prompt], [[fmt.make_processor(len(prompt))]],
                                  [GREEDY], max_tokens=40)
    assert finish == "stop"
    value = json.loads(tok.decode(tokens))
    check(value, schema)
    assert value["name"]
