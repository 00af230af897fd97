import pytest

from mlx_serve.stop_strings import StopStringMatcher


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, hit = matcher.feed(piece)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


@pytest.mark.parametrize(
    ("pieces", "stops", "expected", "hit"),
    [
        (["Hello", " wor", "ld"], ("world",), "Hello ", True),
        (["abc", "STO", "P", "more"], ("STOP",), "abc", True),
        (["a", "b", "c"], ("x",), "abc", False),
        (["ab", "c"], (), "abc", False),
        (["fo", "o", "bar"], ("bar", "oob"), "f", True),  # the earliest match wins
        (["hel", "lo"], ("lol",), "hello", False),  # a held prefix that never completes
        (["xSTO", "Pyz"], ("STOP",), "x", True),
        (["end ST"], ("STOP",), "end ST", False),  # flushed at the end of generation
    ],
)
def test_stop_strings_match_across_pieces(pieces, stops, expected, hit):
    assert feed_all(StopStringMatcher(stops), pieces) == (expected, hit)


def test_text_that_may_start_a_stop_is_held_back_until_decided():
    m = StopStringMatcher(("</s>",))
    assert m.feed("abc</") == ("abc", False)
    assert m.feed("x") == ("</x", False)


@pytest.mark.parametrize(
    ("pieces", "stops", "expected"),
    [
        (["Hello", " wor", "ld", "!"], ("world",), "Hello world"),
        (["fo", "o", "bar"], ("bar", "oob"), "foob"),  # the earliest match, whole
        (["abcd"], ("bc", "b"), "abc"),  # two at one place: the first listed
    ],
)
def test_included_stop_strings_end_the_text(pieces, stops, expected):
    # vLLM's include_stop_str_in_output
    assert feed_all(StopStringMatcher(stops, include=True), pieces) == (expected, True)
