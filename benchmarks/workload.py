"""The workload every contender runs: seeded prompts of an exact token length.

A prompt is built from whole-word vocabulary pieces (" word") that the byte-level BPE
pre-tokenizer keeps apart, then checked with the model's own tokenizer and trimmed or
padded until ``tokenizer.encode(text)`` has exactly the asked length. The servers under
test tokenize ``/v1/completions`` text with the same call, and the engine harness uses
it too, so all three see the same prompt tokens.
"""

from __future__ import annotations

import argparse
import random
import re
from dataclasses import asdict, dataclass
from typing import Any, Protocol, cast

_WORD = re.compile(r"^ [A-Za-z]{2,}$")
_MAX_FIX_STEPS = 64


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Workload:
    """What to send: the same description drives the HTTP load generator and the engine."""

    prompt_tokens: int = 128
    output_tokens: int = 128
    num_requests: int = 64
    concurrency: int = 4
    seed: int = 0
    rate: float | None = None  # requests/s (Poisson); None: closed loop at ``concurrency``
    time_limit: float = 300.0  # seconds; requests not started by then are not sent
    # Short and long replies interleaved: this share of the requests asks for
    # ``long_output_tokens`` instead of ``output_tokens`` (None: every request alike).
    long_output_tokens: int | None = None
    long_fraction: float = 0.25

    def __post_init__(self) -> None:
        if self.output_tokens < 1:
            raise ValueError("output_tokens must be at least 1")
        if self.long_output_tokens is not None and self.long_output_tokens < 1:
            raise ValueError("long_output_tokens must be at least 1")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError("long_fraction must be between 0 and 1")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def output_lengths(self) -> list[int]:
        """Each request's output length, by request index: the same for every contender.

        With a long share, exactly ``round(num_requests * long_fraction)`` requests are
        long, at seeded places, so that long ones arrive among short ones throughout the
        run rather than in one stretch.
        """
        lengths = [self.output_tokens] * self.num_requests
        if self.long_output_tokens is not None:
            long_count = round(self.num_requests * self.long_fraction)
            for index in random.Random(f"output lengths {self.seed}").sample(
                    range(self.num_requests), long_count):
                lengths[index] = self.long_output_tokens
        return lengths


def add_length_mix_args(p: argparse.ArgumentParser) -> None:
    """The flags of a run that interleaves short and long replies."""
    p.add_argument("--long-output-tokens", type=int, default=None, metavar="N",
                   help="a share of the requests (--long-fraction) asks for N output tokens "
                        "instead of --output-tokens, at seeded places")
    p.add_argument("--long-fraction", type=float, default=Workload.long_fraction,
                   help="the share of long requests (default %(default)s)")


def length_mix(args: argparse.Namespace) -> dict[str, Any]:
    """Workload keywords from the flags of ``add_length_mix_args``."""
    return {"long_output_tokens": args.long_output_tokens,
            "long_fraction": args.long_fraction}


def load_tokenizer(path: str) -> Tokenizer:
    """The Hugging Face tokenizer of an mlx-lm model folder (what mlx-lm itself loads)."""
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers import AutoTokenizer

    return cast(Tokenizer, AutoTokenizer.from_pretrained(path))


def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The token ids a server runs for a chat request of one user message ``text``: the
    model's chat template with its generation prompt, as mlx_serve and mlx_lm.server
    render it (the template's text, encoded without adding special tokens again)."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def word_pieces(tokenizer: Tokenizer) -> list[str]:
    """Vocabulary entries of the form " word" that encode back to exactly one token."""
    vocab_size = len(tokenizer)  # type: ignore[arg-type]
    pieces = []
    for token_id in range(vocab_size):
        text = tokenizer.decode([token_id])
        if _WORD.match(text) and _encode(tokenizer, text) == [token_id]:
            pieces.append(text)
    if len(pieces) < 8:
        raise ValueError(f"only {len(pieces)} single-token words in this vocabulary")
    return pieces


def build_prompts(tokenizer: Tokenizer, count: int, length: int, seed: int) -> list[str]:
    """``count`` distinct seeded prompts, each exactly ``length`` tokens long."""
    if length < 1:
        raise ValueError("prompt length must be at least 1 token")
    pieces = word_pieces(tokenizer)
    rng = random.Random(seed)
    return [_exact_prompt(tokenizer, pieces, length, rng) for _ in range(count)]


def _exact_prompt(tokenizer: Tokenizer, pieces: list[str], length: int,
                  rng: random.Random) -> str:
    words = [rng.choice(pieces) for _ in range(length)]
    for _ in range(_MAX_FIX_STEPS):
        have = len(_encode(tokenizer, "".join(words)))
        if have == length:
            return "".join(words)
        if have > length:
            del words[-min(have - length, len(words) - 1):]
        else:
            words.extend(rng.choice(pieces) for _ in range(length - have))
    raise ValueError(f"could not build a prompt of exactly {length} tokens")


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text))
