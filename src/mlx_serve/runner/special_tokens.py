"""Which generated tokens a reply's text leaves out.

As vLLM's ``skip_special_tokens`` (on by default): the tokenizer's special tokens (the
added tokens it marks special, what ``decode(skip_special_tokens=True)`` drops) count in
the reply but add no text. Some must stay in the text all the same:

- those a thinking or tool-call marker is made of, which mlx-lm's text state machine
  reads to route reasoning and calls apart (and strips);
- those a request's stop strings are made of, so that such a stop string still matches
  (the text pipeline takes their text out again once the stop matcher has passed it on:
  a stop string that does not complete leaves no special token in the reply);
- every one inside a tool call: the call's parser reads them (Kimi-K2's
  ``<|tool_call_begin|>``, Gemma's ``<|"|>``). The text pipeline sees to that one.

An ignored end-of-sequence token (``ignore_eos``) is never shown, whatever the setting.
"""

from __future__ import annotations

from typing import Any

from mlx_serve.generation import GenerationRequest

_SETS_KEPT = 256  # requests' distinct settings whose sets are kept


class SpecialTokens:
    def __init__(self, tokenizer: Any, eos_ids: frozenset[int]) -> None:
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._texts = {i: t.content for i, t in decoder.items() if getattr(t, "special", False)}
        self.eos = eos_ids
        self._all = frozenset(self._texts)
        # Left out when the state machine reads the markers: all but theirs; without tool
        # calls, the call markers are special tokens like any other.
        self._unmarked = {calls: self._not_in(marker_strings(tokenizer, calls))
                          for calls in (True, False)}
        self._sets: dict[tuple[bool, bool, bool, tuple[str, ...]], frozenset[int]] = {}
        self._strays = _stray_markers(tokenizer, {text: i for i, text in self._texts.items()})
        self._by_state: dict[tuple[bool, bool, bool, tuple[str, ...]],
                             dict[str, frozenset[int]]] = {}

    def _not_in(self, markers: tuple[str, ...]) -> frozenset[int]:
        return frozenset(i for i, text in self._texts.items()
                         if not any(text in marker for marker in markers))

    def hidden(self, request: GenerationRequest, reads_markers: bool) -> frozenset[int]:
        """The tokens left out of ``request``'s text outside tool calls; ``reads_markers``:
        its text goes through the state machine, which must see the markers (the tool-call
        ones only where the request parses calls)."""
        ignore_eos = request.params.ignore_eos
        if not request.output.skip_special_tokens:
            return self.eos if ignore_eos else frozenset()
        # Made on the MLX thread as a request is admitted: a tokenizer may have thousands
        # of special tokens, and requests mostly share their settings.
        key = _key(request, reads_markers)
        found = self._sets.get(key)
        if found is None:
            if len(self._sets) >= _SETS_KEPT:
                self._sets.clear()
            found = self._sets[key] = self._make(*key)
        return found

    def hidden_by_state(self, request: GenerationRequest, reads_markers: bool
                        ) -> dict[str, frozenset[int]]:
        """``hidden()`` in each state of the text state machine that differs from it: a
        marker token where it moves nothing (a ``</think>`` outside reasoning) is a
        special token like the others, left out of the text."""
        if not (reads_markers and request.output.skip_special_tokens and self._strays):
            return {}
        key = _key(request, reads_markers)
        found = self._by_state.get(key)
        if found is None:
            hidden, stop = self.hidden(request, reads_markers), request.params.stop
            if len(self._by_state) >= _SETS_KEPT:
                self._by_state.clear()
            found = self._by_state[key] = {  # a stop string's own tokens stay in its text
                state: hidden | {i for i in strays if not any(self._texts[i] in s for s in stop)}
                for state, strays in self._strays.items()}
        return found

    def kept_for_stops(self, request: GenerationRequest, reads_markers: bool
                       ) -> tuple[str, ...]:
        """The texts of the special tokens left in only for ``request``'s stop strings
        to match, longest first."""
        if not (request.params.stop and request.output.skip_special_tokens):
            return ()
        # Those of the set left out without stop strings (``_make``'s first line) that
        # the request's set keeps: the set itself is cached, so nothing is rebuilt here.
        unstopped = self._unmarked[request.output.tool_calls] if reads_markers else self._all
        kept = unstopped - self.hidden(request, reads_markers)
        return tuple(sorted({self._texts[i] for i in kept}, key=len, reverse=True))

    def hidden_in_call(self, request: GenerationRequest) -> frozenset[int]:
        """The tokens left out inside a tool call: only an ignored end-of-sequence one."""
        return self.eos if request.params.ignore_eos else frozenset()

    def _make(self, reads_markers: bool, calls: bool, ignore_eos: bool, stop: tuple[str, ...]
              ) -> frozenset[int]:
        hidden = self._unmarked[calls] if reads_markers else self._all
        if stop:
            hidden = frozenset(i for i in hidden
                               if not any(self._texts[i] in s for s in stop))
        return hidden | self.eos if ignore_eos else hidden


def _key(request: GenerationRequest, reads_markers: bool
         ) -> tuple[bool, bool, bool, tuple[str, ...]]:
    """The settings a request's sets of tokens left out depend on."""
    return (reads_markers, request.output.tool_calls, request.params.ignore_eos,
            request.params.stop)


def marker_strings(tokenizer: Any, calls: bool = True) -> tuple[str, ...]:
    """The text that mlx-lm's ``make_text_state_machine`` matches for this tokenizer
    (``calls`` false: for the machine of a request that parses no calls)."""
    found: list[str] = []
    if getattr(tokenizer, "has_thinking", False):
        found += [tokenizer.think_start, tokenizer.think_end]
    if calls and getattr(tokenizer, "has_tool_calling", False):
        found += [tokenizer.tool_call_start, tokenizer.tool_call_end]
    found += getattr(tokenizer, "structural_markers", ()) or ()
    for edges in (getattr(tokenizer, "response_transitions", None) or {}).values():
        found += [text for text, _ in edges]
    return tuple(text for text in found if text)


def _stray_markers(tokenizer: Any, special_ids: dict[str, int]) -> dict[str, frozenset[int]]:
    """By state, the special marker tokens that are no transition there: the end of a
    reasoning span outside one, a call's end outside a call, a span's start inside it."""
    def ids(*texts: str | None) -> frozenset[int]:
        return frozenset(special_ids[t] for t in texts if t in special_ids)

    think_start = think_end = call_end = None
    if getattr(tokenizer, "has_thinking", False):
        think_start, think_end = tokenizer.think_start, tokenizer.think_end
    if getattr(tokenizer, "has_tool_calling", False):
        call_end = tokenizer.tool_call_end
    strays = {"normal": ids(think_end, call_end), "reasoning": ids(think_start, call_end)}
    return {state: found for state, found in strays.items() if found}


def text_machines(tokenizer: Any) -> dict[bool, Any]:
    """mlx-lm's text state machine for a request that parses tool calls (True) and for
    one that does not (False: its call markers are no transitions); None for a tokenizer
    without markers."""
    from mlx_lm.generate import make_text_state_machine

    if not (getattr(tokenizer, "has_thinking", False)
            or getattr(tokenizer, "has_tool_calling", False)):
        return {True: None, False: None}
    return {True: make_text_state_machine(tokenizer),
            False: make_text_state_machine(_WithoutToolCalls(tokenizer))}


class _WithoutToolCalls:
    """A tokenizer's view with no tool calling."""

    has_tool_calling = False

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)
