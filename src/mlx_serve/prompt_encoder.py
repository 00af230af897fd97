"""Prompt text -> token ids without handing the interpreter lock away mid-request.

transformers' fast tokenizers encode even a single text through the Rust tokenizer's
``encode_batch``, which releases the interpreter lock. Prompts are encoded on the event
loop, and while the MLX thread runs Python (it builds every step's graph) the loop then
waits for the lock to come back: until the MLX thread next calls into MLX, or up to the
switch interval (5 ms). A burst of 128 requests paid that 128 times in one turn of the
loop; on an H200 host the loop stood still for 60-100 ms and /health with it. The Rust
tokenizer's single ``encode`` keeps the lock for its fraction of a millisecond.

Long text is the other way round. It is encoded on a worker thread (request_building's
``off_loop_if_long``), and there keeping the lock would stop the event loop for the
whole encode: a 4 MB prompt held it, and every probe and stream with it, for 3.4 s.
Text over ``KEEP_LOCK_UP_TO_CHARS`` goes through ``encode_batch``, which releases it.

It is used only where it gives the tokenizer's own ids: the tokenizer's class must encode
through transformers' stock path (no override), with no truncation or padding set, and
both ways must agree on a probe text at start-up. Otherwise the tokenizer's ``encode``
is used as it is.

A burst is the exception to encoding short text in place: 128 prompts arriving at once,
each encoded with the lock kept, held the event loop for 65 ms of a burst on an H100
host (py-spy), /health waiting behind them. ``encode_soon`` gathers the short prompts
asked for in one pass of the loop: a lone one is encoded in place as before, several go
to a worker thread as one ``encode_batch``, which releases the lock and encodes them in
parallel, so the loop serves its sockets meanwhile. A text may come as the function
that makes it (a chat's template), which then runs where the text is encoded. On an
H100 host, with 64 or 128 completions or chats arriving at once, the /health probe sent
during the arrivals read at most 28 ms in 9 of 10 runs against 34-254 ms before; on two
vCPUs, with 128 completions, a run's slowest probe went from 50-64 ms to 6-17 ms. The
tokens/s were unchanged within the runs' spread (benchmarks/MEASUREMENTS.md, 12-07).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

# Special-token look-alikes, whitespace runs, accents, emoji and digits: where encoders
# that differ in their handling of special tokens or normalisation would disagree.
_PROBE = ("  Hello <|im_start|>user\n<s></s>[INST] world!\t\tÇa va? 🙂 12345 "
          "<|endoftext|><|eot_id|> end  ")


# A prompt's text, or a function that makes it (see PromptEncoder.encode_soon).
Text = str | Callable[[], str]

# The longest text encoded with the lock kept; request_building encodes no longer text
# on the event loop.
KEEP_LOCK_UP_TO_CHARS = 2048


class PromptEncoder:
    """``encode(text, add_special_tokens=True) -> list[int]``, the tokenizer's own ids."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._backend = _stock_backend(tokenizer)
        # encode_soon's texts of the current loop pass, per event loop (tests run several)
        self._batches: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop,
            list[tuple[Text, bool, asyncio.Future[list[int]]]]] = weakref.WeakKeyDictionary()
        if self._backend is not None and not self._agrees():
            log.warning("the tokenizer's Rust encoder disagrees with its encode(); "
                        "encoding prompts through transformers")
            self._backend = None

    @property
    def direct(self) -> bool:
        """True when prompts are encoded by the Rust tokenizer's own ``encode``."""
        return self._backend is not None

    def __call__(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._backend is not None:
            if len(text) > KEEP_LOCK_UP_TO_CHARS:  # other threads run meanwhile
                return self._backend.encode_batch(
                    [text], add_special_tokens=add_special_tokens)[0].ids
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def encode_many(self, texts: Sequence[str], add_special_tokens: bool = True
                    ) -> list[list[int]]:
        """Several texts at once; the Rust tokenizer's ``encode_batch`` releases the lock
        and spreads them over the cores (call it off the event loop)."""
        if self._backend is not None:
            return [e.ids for e in self._backend.encode_batch(
                list(texts), add_special_tokens=add_special_tokens)]
        return [self(text, add_special_tokens) for text in texts]

    def encode_soon(self, text: Text, add_special_tokens: bool = True
                    ) -> asyncio.Future[list[int]]:
        """On the event loop: ``text``'s ids, encoded with whatever else is asked for in
        this pass of the loop (see the module's docstring). ``text`` may be a function
        that makes it (a chat's template): it runs where the text is encoded, so a
        burst's texts are made on the worker thread too; what it raises is this
        request's error alone."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[int]] = loop.create_future()
        batch = self._batches.get(loop)
        if batch is None:
            batch = self._batches[loop] = []
            loop.call_soon(self._encode_batch, loop)
        batch.append((text, add_special_tokens, future))
        return future

    def _encode_batch(self, loop: asyncio.AbstractEventLoop) -> None:
        batch = [item for item in self._batches.pop(loop, []) if not item[2].done()]
        if len(batch) == 1 or (batch and self._backend is None):  # in place, lock kept
            for text, special, future in batch:
                _settle(future, functools.partial(self._encode_one, text, special))
            return
        for special in (True, False):
            group = [(text, future) for text, s, future in batch if s is special]
            if group:
                work = loop.run_in_executor(None, self._encode_group,
                                            [text for text, _ in group], special)
                work.add_done_callback(functools.partial(_hand_out, group=group))

    def _encode_one(self, text: Text, add_special_tokens: bool) -> list[int]:
        return self(text() if callable(text) else text, add_special_tokens)

    def _encode_group(self, items: list[Text], add_special_tokens: bool
                      ) -> list[list[int] | Exception]:
        """On a worker thread: each item's text (made here if a function), then one
        ``encode_many``; an item whose text could not be made gets its error."""
        texts: list[str | Exception] = []
        for item in items:
            try:
                texts.append(item() if callable(item) else item)
            except Exception as exc:  # e.g. a template that refuses the messages
                texts.append(exc)
        ids = iter(self.encode_many([t for t in texts if isinstance(t, str)],
                                    add_special_tokens))
        return [t if isinstance(t, Exception) else next(ids) for t in texts]

    def _agrees(self) -> bool:
        assert self._backend is not None
        return all(
            self._backend.encode(_PROBE, add_special_tokens=special).ids
            == list(self._tokenizer.encode(_PROBE, add_special_tokens=special))
            for special in (True, False))


def _settle(future: asyncio.Future[list[int]], encode: Callable[[], list[int]]) -> None:
    try:
        ids = encode()
    except Exception as exc:  # the request that asked gets it, not the loop
        future.set_exception(exc)
    else:
        future.set_result(ids)


def _hand_out(work: asyncio.Future[list[list[int] | Exception]], *,
              group: list[tuple[Text, asyncio.Future[list[int]]]]) -> None:
    """A batch's ids to the requests still waiting for them (a departed client's not)."""
    for i, (_, future) in enumerate(group):
        if future.done():
            continue
        if work.cancelled():  # the loop is closing
            future.cancel()
        elif (failure := work.exception()) is not None:
            future.set_exception(failure)
        elif isinstance(result := work.result()[i], Exception):
            future.set_exception(result)
        else:
            future.set_result(result)


def _stock_backend(tokenizer: Any) -> Any | None:
    """The Rust tokenizer behind ``tokenizer`` if its encode is transformers' stock one."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep its own path
        return None
    if not isinstance(hf, TokenizersBackend):
        return None
    cls = type(hf)
    stock = (cls.encode is PreTrainedTokenizerBase.encode
             and cls._encode_plus is TokenizersBackend._encode_plus)
    backend = getattr(hf, "backend_tokenizer", None)
    if not stock or not isinstance(backend, Tokenizer):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    if backend.encode_special_tokens != bool(getattr(hf, "split_special_tokens", False)):
        return None
    return backend
