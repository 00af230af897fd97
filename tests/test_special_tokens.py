"""Special tokens in a reply's text: left out by default (vLLM's ``skip_special_tokens``),
except where the text needs them: thinking and tool-call markers, stop strings, calls."""

from __future__ import annotations

import pytest

from mlx_serve.generation import FinishReason, GenerationRequest, OutputOptions, SamplingParams

IM_START = "<|im_start|>"  # a special token of the tiny tokenizers (id 1)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def run_text(tokenizer, text: str, *, split: bool = False, skip: bool = True,
             stop: tuple[str, ...] = (), ignore_eos: bool = False, include: bool = False):
    """Feed ``text``'s tokens through a reply's text pipeline, as the runner builds it;
    returns the joined content, reasoning, tool calls and the finish."""
    from mlx_lm.generate import make_text_state_machine

    from mlx_serve.runner.special_tokens import SpecialTokens
    from mlx_serve.runner.text import TextPipeline

    special = SpecialTokens(tokenizer, frozenset(tokenizer.eos_token_ids))
    request = GenerationRequest("r", (1,), SamplingParams(max_tokens=100, stop=stop,
                                                          ignore_eos=ignore_eos,
                                                          include_stop_str_in_output=include),
                                output=OutputOptions(split_reasoning=split,
                                                     skip_special_tokens=skip))
    machine = make_text_state_machine(tokenizer) if split else None
    pipe = TextPipeline(tokenizer.detokenizer, request, machine, special)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    content, reasoning, calls, finish = "", "", [], None
    for i, token in enumerate(tokens):
        piece = pipe.advance(token, "length" if i == len(tokens) - 1 else None)
        content, reasoning = content + piece.content, reasoning + piece.reasoning
        calls += piece.tool_calls
        if piece.finish is not None:
            finish = piece.finish
            break
    return content, reasoning, calls, finish


def test_special_tokens_add_no_text_unless_asked_for(tiny_tokenizer):
    text = f"Hello{IM_START} world"
    assert tiny_tokenizer.encode(IM_START, add_special_tokens=False) == [1]
    assert run_text(tiny_tokenizer, text)[0] == "Hello world"
    assert run_text(tiny_tokenizer, text, skip=False)[0] == text


def test_a_stop_string_made_of_a_special_token_still_matches(tiny_tokenizer):
    content, _, _, finish = run_text(tiny_tokenizer, f"Hello{IM_START} world",
                                     stop=(IM_START,))
    assert (content, finish) == ("Hello", FinishReason.STOP)


def test_a_special_token_left_in_for_a_stop_string_leaves_no_text_if_it_does_not_stop(
        tiny_tokenizer):
    stop = (f"{IM_START}user",)
    assert run_text(tiny_tokenizer, f"Hello{IM_START} world{IM_START}", stop=stop) == (
        "Hello world", "", [], FinishReason.LENGTH)
    content, _, _, finish = run_text(tiny_tokenizer, f"Hello{IM_START}user world", stop=stop)
    assert (content, finish) == ("Hello", FinishReason.STOP)


def test_a_stop_string_kept_in_the_output_keeps_its_special_token(tiny_tokenizer):
    content, _, _, finish = run_text(tiny_tokenizer, f"He{IM_START}llo{IM_START}user x",
                                     stop=(f"{IM_START}user",), include=True)
    assert (content, finish) == (f"Hello{IM_START}user", FinishReason.STOP)


def test_an_ignored_end_of_sequence_token_never_shows(tiny_tokenizer):
    eos = tiny_tokenizer.decode([min(tiny_tokenizer.eos_token_ids)])
    text = f"Hello{eos}{IM_START} world"
    assert run_text(tiny_tokenizer, text, ignore_eos=True)[0] == "Hello world"
    assert run_text(tiny_tokenizer, text, ignore_eos=True, skip=False)[0] == (
        f"Hello{IM_START} world")


def test_markers_made_of_special_tokens_still_route_thinking_and_calls(agentic_tokenizer):
    # The agentic tokenizer's <think> and <tool_call> are special tokens.
    special = {t.content for t in agentic_tokenizer.added_tokens_decoder.values() if t.special}
    assert {"<think>", "</think>", "<tool_call>", "</tool_call>", IM_START} <= special
    call = '{"name": "f", "arguments": {"x": "a' + IM_START + 'b"}}'
    text = f"<think>plan{IM_START}</think>Sure{IM_START}.<tool_call>{call}</tool_call>"
    content, reasoning, calls, _ = run_text(agentic_tokenizer, text, split=True)
    assert (reasoning, content) == ("plan", "Sure.")
    assert calls == [call]  # inside a call every token reaches its parser
    # Without the state machine (a completion) the markers are special tokens like any.
    assert run_text(agentic_tokenizer, text)[0] == "planSure." + call.replace(IM_START, "")


def test_requests_with_the_same_settings_share_one_set_and_the_sets_kept_are_bounded(
        tiny_tokenizer):
    from mlx_serve.runner import special_tokens

    special = special_tokens.SpecialTokens(tiny_tokenizer, frozenset(tiny_tokenizer.eos_token_ids))

    def request(*stop: str) -> GenerationRequest:
        return GenerationRequest("r", (1,), SamplingParams(max_tokens=5, stop=stop))

    first = special.hidden(request("a", IM_START), reads_markers=False)
    assert special.hidden(request("a", IM_START), reads_markers=False) is first
    assert 1 not in first and 1 in special.hidden(request("a"), reads_markers=False)
    for i in range(3 * special_tokens._SETS_KEPT):
        special.hidden(request(str(i)), reads_markers=False)
    assert len(special._sets) <= special_tokens._SETS_KEPT


def test_a_marker_where_it_moves_nothing_is_left_out_unless_a_stop_string_needs_it(
        agentic_tokenizer):
    from mlx_serve.runner.special_tokens import SpecialTokens

    special = SpecialTokens(agentic_tokenizer, frozenset(agentic_tokenizer.eos_token_ids))
    think_start, think_end = agentic_tokenizer.think_start_id, agentic_tokenizer.think_end_id

    def by_state(*stop: str) -> dict:
        request = GenerationRequest("r", (1,), SamplingParams(max_tokens=5, stop=stop))
        return special.hidden_by_state(request, reads_markers=True)

    plain = by_state()
    assert think_end in plain["normal"] and think_start not in plain["normal"]
    assert think_start in plain["reasoning"] and think_end not in plain["reasoning"]
    assert think_end not in by_state("</think>")["normal"]  # the stop string still matches
    assert by_state() is plain  # one dict per setting
