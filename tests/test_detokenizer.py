"""The tabled BPE detokenizer gives exactly mlx-lm's text, segment by segment."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, NaiveStreamingDetokenizer
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlx_serve.generation import GenerationRequest, OutputOptions, SamplingParams
from mlx_serve.runner.detokenizer import TabledBPEStreamingDetokenizer, streaming_detokenizers
from mlx_serve.runner.text import TextPipeline


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


def _segments(detokenizer, ids: list[int], every: int = 1
              ) -> tuple[list[str], str, list[int]]:
    """The new text read every ``every`` tokens, then what finalize adds; the whole
    text; the tokens."""
    out = []
    for i, token in enumerate(ids):
        detokenizer.add_token(token)
        if i % every == every - 1:
            out.append(detokenizer.last_segment)
    detokenizer.finalize()
    out.append(detokenizer.last_segment)
    return out, detokenizer.text, detokenizer.tokens


def test_random_streams_detokenize_exactly_as_mlx_lm(tokenizer):
    make = streaming_detokenizers(tokenizer)
    assert isinstance(make(), TabledBPEStreamingDetokenizer)
    vocab = len(tokenizer._detokenizer.tokenmap)
    space = tokenizer._detokenizer.tokenmap.index("Ġ")  # the lone space mlx-lm holds
    nul = tokenizer._detokenizer.tokenmap.index("Ā")  # the one byte decoded apart (below)
    rng = random.Random(0)
    held_back = 0
    for _ in range(400):
        # Whole tokens, the byte-level ones that split UTF-8 characters (the tiny
        # vocabulary's first 256 ids), lone spaces, special tokens and ids past the map.
        ids = [rng.choice([rng.randrange(vocab), rng.randrange(3, 259), space,
                           rng.randrange(3), vocab + rng.randrange(3)])
               for _ in range(rng.randrange(1, 40))]
        ids = [t + 1 if t == nul else t for t in ids]
        every = rng.choice([1, 1, 2, 5])  # the runner reads after every token
        ours = _segments(make(), ids, every)
        theirs = _segments(tokenizer.detokenizer, ids, every)
        assert ours == theirs, (ids, every)
        held_back += any(s == "" for s in theirs[0])
    assert held_back > 100  # the streams did hold text back, not only whole tokens


def test_the_nul_bytes_token_is_nul_as_the_tokenizer_decodes_it(tokenizer):
    """mlx-lm's streaming detokenizer writes it as its stand-in character "Ā"; the
    tokenizer's own decode (and mlx-lm's finalize, and each token's logprobs text) give
    the NUL byte, and so does the served text."""
    nul = tokenizer._detokenizer.tokenmap.index("Ā")
    ids = tokenizer.encode("hi") + [nul] + tokenizer.encode("there")
    ours = _segments(streaming_detokenizers(tokenizer)(), ids)
    assert ours[1] == tokenizer.decode(ids) == "hi\x00there"
    assert _segments(tokenizer.detokenizer, ids)[1] == "hi\u0100there"  # mlx-lm's


def test_a_long_reply_reads_the_same_text_piece_by_piece_and_whole(tokenizer):
    # The text is kept in pieces; what the segments add up to is the whole text.
    rng = random.Random(1)
    nul = tokenizer._detokenizer.tokenmap.index("Ā")  # decoded apart from mlx-lm (above)
    ids = [t + 1 if t == nul else t for t in (rng.randrange(3, 512) for _ in range(3000))]
    ours, theirs = _segments(streaming_detokenizers(tokenizer)(), ids), \
        _segments(tokenizer.detokenizer, ids)
    assert ours == theirs
    assert "".join(ours[0]) == ours[1] and len(ours[1]) > 3000


def test_each_request_gets_its_own_state(tokenizer):
    make = streaming_detokenizers(tokenizer)
    first, second = make(), make()
    first.add_token(300)
    assert first.tokens == [300] and second.tokens == [] and second.text == ""
    first.reset()
    assert first.tokens == [] and first.text == "" and first.last_segment == ""


def test_a_completion_keeps_its_leading_space_as_with_mlx_lm(tokenizer):
    # Completions keep the first token's leading space (TextPipeline patches the
    # detokenizer); chat replies drop it. Both exactly as on mlx-lm's detokenizer.
    space_word = next(i for i, v in enumerate(tokenizer._detokenizer.tokenmap)
                      if v.startswith("Ġ") and len(v) > 2)
    ids = [space_word, 300, space_word]
    make = streaming_detokenizers(tokenizer)
    for keep in (True, False):
        request = GenerationRequest("r", (1,), SamplingParams(max_tokens=3), None, 0,
                                    OutputOptions(keep_leading_space=keep))
        texts = []
        for detokenizer in (make(), tokenizer.detokenizer):
            pipe = TextPipeline(detokenizer, request, None)
            texts.append("".join(pipe.advance(t, "length" if i == 2 else None).content
                                 for i, t in enumerate(ids)))
        assert texts[0] == texts[1]
        assert texts[0].startswith(" ") is keep


def test_other_detokenizers_are_mlx_lms_own(tokenizer):
    class Wrapper:  # a tokenizer whose streaming detokenizer is not the BPE one
        _detokenizer = NaiveStreamingDetokenizer(tokenizer._tokenizer)

        @property
        def detokenizer(self):
            return NaiveStreamingDetokenizer(tokenizer._tokenizer)

    made = streaming_detokenizers(Wrapper())()
    assert type(made) is NaiveStreamingDetokenizer
    assert not isinstance(made, BPEStreamingDetokenizer)


def test_another_mlx_lm_release_keeps_its_own_detokenizer(tokenizer, monkeypatch):
    import mlx_lm

    monkeypatch.setattr(mlx_lm, "__version__", "0.32.99")
    assert type(streaming_detokenizers(tokenizer)()) is BPEStreamingDetokenizer
