"""Prompts are encoded to the tokenizer's own ids; short ones without releasing the
interpreter lock, long ones releasing it."""

from __future__ import annotations

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
