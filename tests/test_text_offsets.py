"""Completion log-probabilities' text_offset: each token's start in the reply's text."""

from __future__ import annotations

from mlx_serve.generation import TokenLogprob
from mlx_serve.text_offsets import TextOffsets, prompt_offsets


def tokens(*parts: bytes) -> list[TokenLogprob]:
    # A token holding part of a character reads as a replacement character.
    return [TokenLogprob(p.decode("utf-8", "replace"), tuple(p), -1.0) for p in parts]


def test_a_character_split_across_tokens_counts_once_where_it_is_completed():
    world = "世界".encode()  # two characters, six bytes: four tokens here
    parts = tokens(world[:2], world[2:3], world[3:5], world[5:], b" hi")
    assert TextOffsets().add(parts, "世界 hi") == [0, 0, 1, 1, 2]


def test_a_character_never_completed_is_the_earlier_tokens_and_the_next_starts_after_it():
    # As the detokenizer writes it: the lone lead byte as a replacement character.
    assert TextOffsets().add(tokens(b"h", "é".encode()[:1], b"nic"), "h\ufffdnic") == [0, 1, 2]


def test_offsets_never_pass_the_text_the_tokens_made():
    # The last token's text (a stop string's start, say) was left out of the reply.
    assert TextOffsets(5).add(tokens(b"ab", b"cd", b"ef"), "abc") == [5, 7, 8]


def test_the_count_starts_again_from_the_real_text_at_every_delta():
    offsets = TextOffsets()
    assert offsets.add(tokens(b"x<", b"|stop|>"), "x") == [0, 1]
    assert offsets.add(tokens(b"yz"), "yz") == [1]
    assert offsets.length == 3


def test_an_echoed_prompt_s_offsets_index_its_text_and_never_go_back():
    echo = "世界 hi"
    world = echo.encode()
    scored = tokens(world[1:3], world[3:6], b" h", b"i")
    offsets = prompt_offsets(tokens(world[:1])[0], scored, echo)
    assert offsets == [0, 0, 1, 2, 4]
    assert offsets == sorted(offsets) and max(offsets) <= len(echo)
    assert echo[offsets[3]:].startswith(" h") and echo[offsets[4]:] == "i"
    # A BOS token is not in the echoed text: it takes no room there.
    assert prompt_offsets(tokens(b"<s>")[0], tokens(b"ab", b"c"), "abc") == [0, 0, 2]
    assert prompt_offsets(tokens(b"a")[0], tokens(b"b", b"c"), "abc") == [0, 1, 2]


def test_a_broken_byte_written_a_token_later_by_the_reply_still_counts_where_it_is():
    # The detokenizer holds a lone continuation byte back and writes its replacement
    # character with the next token's text; the decoding here counts it at once.
    offsets = TextOffsets()
    assert offsets.add(tokens(b"ay"), "ay") == [0]
    assert offsets.add(tokens(b"\xa1"), "") == [2]
    assert offsets.add(tokens(b"oes"), "\ufffdoes") == [3]
    # And the other way: a lead byte's replacement written at once, decoded a token later.
    offsets = TextOffsets()
    assert offsets.add(tokens(b"\xcd"), "\ufffd") == [0]
    assert offsets.add(tokens(b"oes"), "oes") == [1]


def test_two_broken_bytes_held_back_together_count_one_after_the_other():
    offsets = TextOffsets()
    assert offsets.add(tokens(b"b"), "b") == [0]
    assert offsets.add(tokens(b"\xa1"), "") == [1]
    assert offsets.add(tokens(b"\xa4"), "") == [2]
    assert offsets.add(tokens(b" c"), "\ufffd\ufffd c") == [3]
