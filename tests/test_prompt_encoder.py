"""Prompts are encoded to the tokenizer's own ids; short ones without releasing the
interpreter lock, long ones releasing it."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mlx_serve.http_stack import interpreter_lock_on
from mlx_serve.prompt_encoder import KEEP_LOCK_UP_TO_CHARS, PromptEncoder
from mlx_serve.prompts import render_chat
from mlx_serve.protocol import ChatCompletionRequest
from mlx_serve.tiny_model import build_tiny_model

TEXTS = [
    "Hello world",
    "  two  spaces, a\ttab and a newline\n",
    "<|im_start|>user\nspecial tokens inside<|im_end|>",
    "Ünïcödé, 中文, emoji 🙂🚀 and digits 0123456789",
    "The quick brown fox jumps over the lazy dog. " * 40,
    "The quick brown fox jumps over the lazy dog. " * 400,  # past KEEP_LOCK_UP_TO_CHARS
]


def _tokenizer(folder: Path):
    from mlx_lm.tokenizer_utils import load

    return load(folder)


@pytest.fixture(scope="module")
def agentic_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("agentic"), agentic=True)


@pytest.fixture(params=["plain", "agentic"])
def tokenizer(request, tiny_model_dir: Path, agentic_model_dir: Path):
    return _tokenizer(tiny_model_dir if request.param == "plain" else agentic_model_dir)


def test_the_ids_are_the_tokenizers_own(tokenizer) -> None:
    encode = PromptEncoder(tokenizer)
    assert encode.direct  # the test models' tokenizers take the direct path
    for text in TEXTS:
        for special in (True, False):
            assert encode(text, add_special_tokens=special) == list(
                tokenizer.encode(text, add_special_tokens=special))


def test_a_rendered_chat_is_what_the_template_tokenizes_to(tokenizer) -> None:
    encode = PromptEncoder(tokenizer)
    for messages in (
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "Say <|im_end|> literally, then 🙂"},
         {"role": "assistant", "content": "Sure."},
         {"role": "user", "content": "Again"}],
    ):
        body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
        assert render_chat(tokenizer, encode, body).tokens == list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def _lock_kept_during(fn: Callable[[], object]) -> bool:
    """True if no other thread ran Python while ``fn`` ran.

    A spinning thread waits for the lock; one release inside ``fn`` hands it over. The
    switch interval is made long enough that ``fn`` is not preempted otherwise.
    """
    count = [0]
    stop = threading.Event()
    spinning = threading.Event()

    def spin() -> None:
        spinning.set()
        while not stop.is_set():
            count[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    spinner = threading.Thread(target=spin, daemon=True)
    try:
        spinner.start()
        assert spinning.wait(10)
        deadline = time.monotonic() + 10
        while count[0] == 0:  # until the spinner has run: it now waits for the lock
            assert time.monotonic() < deadline, "the spinner never ran"
        before = count[0]
        fn()
        return count[0] == before
    finally:
        stop.set()
        spinner.join(10)
        sys.setswitchinterval(interval)


@pytest.mark.skipif(not interpreter_lock_on(), reason="a free-threaded interpreter has no lock")
def test_short_text_keeps_the_interpreter_lock_and_long_text_releases_it(
        tiny_model_dir: Path) -> None:
    tokenizer = _tokenizer(tiny_model_dir)
    encode = PromptEncoder(tokenizer)
    short = TEXTS[-2]
    assert len(short) <= KEEP_LOCK_UP_TO_CHARS
    # Kept even though transformers' own encode hands it away (why this module exists).
    assert _lock_kept_during(lambda: encode(short))
    # Long (64,000 tokens, ~150 ms to encode): with a few thousand tokens a release was
    # missed once on a loaded machine, the waiting spinner not getting a core before the
    # encoder took the lock back. Such text is encoded on a worker thread, where keeping
    # the lock would stop the event loop for the whole encode.
    long = TEXTS[-2] * 80
    assert not _lock_kept_during(lambda: encode(long))
    assert not _lock_kept_during(lambda: tokenizer.encode(long))  # the control


class _OwnEncode:
    """A tokenizer whose encode is its own: the encoder must not bypass it."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [7, *self._inner.encode(text, add_special_tokens=add_special_tokens)]


def test_a_tokenizer_with_its_own_encode_is_used_as_it_is(tiny_model_dir: Path) -> None:
    tokenizer = _OwnEncode(_tokenizer(tiny_model_dir))
    encode = PromptEncoder(tokenizer)
    assert not encode.direct
    assert encode("Hello") == tokenizer.encode("Hello")


def test_a_backend_that_disagrees_on_the_probe_is_not_used(tiny_model_dir: Path,
                                                          caplog) -> None:
    tokenizer = _tokenizer(tiny_model_dir)
    hf = tokenizer._tokenizer
    stock = hf.encode
    # The class is stock, but this instance's encode adds a token the Rust side does not.
    hf.encode = lambda text, add_special_tokens=True: [
        *stock(text, add_special_tokens=add_special_tokens), 3]
    encode = PromptEncoder(tokenizer)
    assert not encode.direct
    assert "disagrees" in caplog.text
    assert encode("Hello") == hf.encode("Hello")


class _CountingBackend:
    """The Rust tokenizer, counting how it is called and from which thread."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.calls: list[tuple[str, int, int]] = []  # (method, texts, thread)

    def encode(self, text, add_special_tokens=True):
        self.calls.append(("encode", 1, threading.get_ident()))
        return self._inner.encode(text, add_special_tokens=add_special_tokens)

    def encode_batch(self, texts, add_special_tokens=True):
        self.calls.append(("encode_batch", len(texts), threading.get_ident()))
        return self._inner.encode_batch(texts, add_special_tokens=add_special_tokens)


def _counting(tokenizer) -> tuple[PromptEncoder, _CountingBackend]:
    encode = PromptEncoder(tokenizer)
    assert encode.direct
    backend = _CountingBackend(encode._backend)
    encode._backend = backend
    return encode, backend


def test_a_lone_prompt_is_encoded_in_place_and_a_burst_in_one_batch_off_the_loop(
        tiny_model_dir: Path) -> None:
    tokenizer = _tokenizer(tiny_model_dir)
    encode, backend = _counting(tokenizer)
    texts = [f"{text} #{i}" for i, text in enumerate(TEXTS[:-1] * 6)]

    async def lone() -> list[int]:
        return await encode.encode_soon(texts[0])

    async def burst() -> list[list[int]]:  # asked for in one pass of the loop
        return list(await asyncio.gather(*(encode.encode_soon(t) for t in texts)))

    loop_thread = threading.get_ident()
    assert asyncio.run(asyncio.wait_for(lone(), 30)) == tokenizer.encode(texts[0])
    assert backend.calls == [("encode", 1, loop_thread)]
    backend.calls.clear()
    assert asyncio.run(asyncio.wait_for(burst(), 30)) == [tokenizer.encode(t) for t in texts]
    assert [(m, n) for m, n, _ in backend.calls] == [("encode_batch", len(texts))]
    assert backend.calls[0][2] != loop_thread


def test_a_burst_without_special_tokens_and_a_departed_request(tiny_model_dir: Path) -> None:
    """Each flag is its own batch, off the loop; a request gone before its batch is done
    is skipped."""
    tokenizer = _tokenizer(tiny_model_dir)
    encode, backend = _counting(tokenizer)

    async def burst() -> tuple[list[int], list[int], list[int]]:
        with_special = encode.encode_soon("Hello world")
        gone = encode.encode_soon("a client that left")
        gone.cancel()
        plain = [encode.encode_soon(t, add_special_tokens=False) for t in TEXTS[:3]]
        first = await with_special
        return first, *(await asyncio.gather(*plain))[:2]

    first, *plain = asyncio.run(asyncio.wait_for(burst(), 30))
    assert first == tokenizer.encode("Hello world")
    assert plain == [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS[:2]]
    assert sorted((m, n) for m, n, _ in backend.calls) == [("encode_batch", 1), ("encode_batch", 3)]


def test_a_failing_batch_fails_each_request_that_waits(tiny_model_dir: Path) -> None:
    encode, backend = _counting(_tokenizer(tiny_model_dir))

    def broken(texts, add_special_tokens=True):
        raise RuntimeError("tokenizer fault")

    backend.encode_batch = broken

    async def burst() -> list[object]:
        return await asyncio.gather(*(encode.encode_soon(t) for t in TEXTS[:3]),
                                    return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(burst(), 30))
    assert [str(r) for r in results] == ["tokenizer fault"] * 3


def test_texts_made_by_functions_are_made_where_they_are_encoded(tiny_model_dir: Path) -> None:
    """A lone one on the loop; a burst's on the worker, where one that fails fails alone."""
    tokenizer = _tokenizer(tiny_model_dir)
    encode = PromptEncoder(tokenizer)
    made_on: list[int] = []

    def maker(text: str):
        def make() -> str:
            made_on.append(threading.get_ident())
            if text == "refused":
                raise ValueError("the template refused it")
            return text
        return make

    async def lone() -> list[int]:
        return await encode.encode_soon(maker("Hello world"))

    async def burst() -> list[object]:
        return await asyncio.gather(*(encode.encode_soon(maker(t)) for t in
                                      ["Hello", "refused", "world"]), return_exceptions=True)

    loop_thread = threading.get_ident()
    assert asyncio.run(asyncio.wait_for(lone(), 30)) == tokenizer.encode("Hello world")
    assert made_on == [loop_thread]
    made_on.clear()
    hello, refused, world = asyncio.run(asyncio.wait_for(burst(), 30))
    assert (hello, world) == (tokenizer.encode("Hello"), tokenizer.encode("world"))
    assert isinstance(refused, ValueError)
    assert len(made_on) == 3 and loop_thread not in made_on
