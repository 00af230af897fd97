"""Runner: drives mlx-lm's BatchGenerator on the MLX thread, one step per call.

Every method runs on the MLX thread, called by the actor one job at a time. The runner
keeps, per live request, exactly what is needed to replay it into a fresh batch: the
prompt, the tokens delivered so far, and the text state (detokenizer, held stop text).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections import deque
from collections.abc import Collection, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from mlx_serve.failpoints import FailPoints
from mlx_serve.generation import GenerationRequest, StepOutcome
from mlx_serve.prompt_encoder import PromptEncoder
from mlx_serve.runner.decode_step import use_one_array_step
from mlx_serve.runner.detokenizer import streaming_detokenizers
from mlx_serve.runner.early_split import (
    FirstToken,
    drop_handed_back,
    mark_sent_ahead,
    take_first_tokens,
    use_early_split,
)
from mlx_serve.runner.end_tokens import EndTokens
from mlx_serve.runner.format_guard import FormatFaults
from mlx_serve.runner.formats import compile_format
from mlx_serve.runner.insertion import insert_sequence
from mlx_serve.runner.live import BatchLimits, Live
from mlx_serve.runner.logprobs import TokenTexts, token_logprob
from mlx_serve.runner.memory import MLXMemory
from mlx_serve.runner.prefix_cache import PrefixCache
from mlx_serve.runner.prompt_scoring import Scored, score_requests
from mlx_serve.runner.self_test import self_test
from mlx_serve.runner.special_tokens import SpecialTokens, text_machines
from mlx_serve.runner.text import TextPipeline
from mlx_serve.runner.token_text import Ended, TokenRecord, TokenStep, step_texts
from mlx_serve.runner.tokenizer_side import json_tool_parser

log = logging.getLogger(__name__)

DEFAULT_CONTEXT_LENGTH = 4096


class Runner:
    json_tool_parser = staticmethod(json_tool_parser)

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        context_length: int,
        vocab_size: int,
        limits: BatchLimits,
        failpoints: FailPoints,
        prefix_cache_bytes: int = 0,
        one_array_logprobs: bool = True,
        early_decode_join: bool = True,
        model_path: str = "",
    ) -> None:
        self.model = model
        self.model_path = model_path  # where the tokenizer can be loaded from again
        self.tokenizer = tokenizer
        self.encode = PromptEncoder(tokenizer)  # prompts, on the event loop
        self.context_length = context_length
        self.vocab_size = vocab_size
        self._limits = limits
        self._failpoints = failpoints
        # Created on the MLX thread: MLX streams belong to the thread that made them.
        self._stream = mx.default_stream(mx.default_device())
        self._eos_ids = tuple(sorted(tokenizer.eos_token_ids))
        self._special = SpecialTokens(tokenizer, frozenset(self._eos_ids))
        self._end_tokens = EndTokens(self._eos_ids)
        self._text_machines = text_machines(tokenizer)
        self.token_texts = TokenTexts(tokenizer)
        self._new_detokenizer = streaming_detokenizers(tokenizer)  # one per request
        self._live: dict[str, Live] = {}
        self._by_uid: dict[int, Live] = {}
        self._broken = False  # the last step failed: nothing steps until a rebuild
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        # Choices of one prompt wait for its first sequence's prefill, then reuse its KV.
        self._waiting_for_prefill: dict[tuple[int, ...], list[Live]] = {}
        self._format_faults = FormatFaults()
        self._unscored: list[Live] = []  # replayed before their prompts were scored
        self._text_ended: Ended = deque()  # see runner.token_text
        self._one_array_logprobs = one_array_logprobs
        self._early_decode_join = early_decode_join
        self._batch = self._new_batch()
        self._mlx_memory = MLXMemory()

    # -- the actor's calls -------------------------------------------------------------

    def self_test(self) -> None:
        """A forward pass over a few tokens outside the batch (``runner.self_test``)."""
        self._failpoints.check("engine.self_test")
        self_test(self.model, (self._eos_ids or (0,))[:1] * 4)  # any id the model has

    def step(
        self, admissions: Sequence[GenerationRequest], cancellations: Collection[str]
    ) -> StepOutcome:
        """Admit, cancel, run one batch step and turn its tokens into text deltas: both
        phases (``step_tokens``, then ``step_texts``) on the calling thread.

        Never raises: a fault of one request is reported in ``failed``, a fault of the
        step itself in ``error`` (the batch must then be rebuilt before the next step).
        """
        outcome = self.step_texts(self.step_tokens(admissions, cancellations))
        try:
            self.take_out_ended()
        except Exception as exc:  # the batch would not let them go: rebuild it
            self._broken = True  # the deltas still go out; the replay starts after them
            return dataclasses.replace(outcome, error=exc)
        return outcome

    def step_texts(self, tokens: TokenStep) -> StepOutcome:
        """A step's second phase (``runner.token_text``): on the MLX thread, or on one
        text thread that takes the steps in order."""
        return step_texts(tokens, self._text_ended)

    def step_tokens(
        self, admissions: Sequence[GenerationRequest], cancellations: Collection[str]
    ) -> TokenStep:
        """A step's first phase: admit, cancel, run one batch step, account its tokens."""
        if self._broken:  # a step behind a failed one: take its requests, step nothing
            return TokenStep([], [], outcome=self._take_while_broken(admissions,
                                                                     cancellations))
        self.take_out_ended()
        self._remove(cancellations)
        failed = self._admit(admissions)
        if not self._by_uid:
            return TokenStep([], [], outcome=StepOutcome(failed=tuple(failed)))
        try:
            if self._failpoints:  # the users set is built only when fail points exist
                self._failpoints.check("engine.step", self._users())
            prompt_responses, responses = self._batch.next()
            responses = drop_handed_back(self._batch, responses)
            first_tokens = take_first_tokens(self._batch)
            if self._failpoints:
                self._failpoints.check("engine.detokenize", self._users())
            self._release_waiting(prompt_responses)
        except Exception as exc:
            self._broken = True
            return TokenStep([], [], outcome=StepOutcome(failed=tuple(failed), error=exc,
                                                         ran_batch=True))
        if faults := self._format_faults.take():  # before their requests' tokens are read
            gone = [rid for rid in faults if rid in self._live]
            self._remove(gone)
            failed += [(rid, faults[rid]) for rid in gone]
        records: list[TokenRecord] = []
        for r in responses:
            live = self._by_uid.get(r.uid)
            if live is not None:
                self._account_or_fail(live, r, records, failed)
        sent = {}
        for uid, token in first_tokens.items():
            live = self._by_uid.get(uid)
            if live is not None and self._may_send_ahead(live, token):
                sent[uid] = token
                self._account_or_fail(live, FirstToken(uid, token), records, failed)
        mark_sent_ahead(self._batch, sent)
        # Sampled every so often, and when the batch empties so that idle figures settle.
        if not self._by_uid or self._mlx_memory.due():
            self._sample_memory()
        return TokenStep(records, failed, bool(prompt_responses))

    def _account_or_fail(self, live: Live, response: Any, records: list[TokenRecord],
                         failed: list[tuple[str, Exception]]) -> None:
        try:
            records.append(self._account(live, response))
        except Exception as exc:  # one request's fault fails that request only
            self._remove([live.request.request_id])
            failed.append((live.request.request_id, exc))

    def _may_send_ahead(self, live: Live, token: int) -> bool:
        """Whether a first token read right after its sequence's move may go out now:
        one that cannot end the request in the batch (not a stop token, not the last
        allowed), for a request that asked for no logprobs (read only from the batch)."""
        stops = live.request.params.stop_token_ids
        return (live.request.output.logprobs is None and live.remaining > 1
                and token not in self._eos_ids and token not in stops)

    def _take_while_broken(self, admissions: Sequence[GenerationRequest],
                           cancellations: Collection[str]) -> StepOutcome:
        """Record new and departed requests; the next rebuild replays the live ones."""
        for request_id in cancellations:
            live = self._live.pop(request_id, None)
            if live is not None and live.uid is not None:
                self._by_uid.pop(live.uid, None)
        for request in admissions:
            self._live[request.request_id] = self._new_live(request)
        return StepOutcome(skipped=True)

    def rebuild(self, active: Collection[str] | None = None) -> None:
        """Replace the batch generator and replay live requests into it.

        ``active`` names the requests to put into the fresh batch (default: all); the
        other live requests stay parked, keeping their state, until a later rebuild.
        """
        self._close_batch()
        self._broken = False
        while self._text_ended:  # their replies have ended: nothing to replay
            self._live.pop(self._text_ended.popleft()[0], None)
        # A sampler that raised inside mlx-lm's compiled sampling can leave MLX's global
        # random state unusable; unseeded sampling restarts from fresh entropy.
        mx.random.seed(secrets.randbits(63))
        self._batch = self._new_batch()
        self._by_uid.clear()
        self._waiting_for_prefill.clear()
        for live in self._live.values():
            live.uid = None
        chosen = self._live.keys() if active is None else active
        for request_id in chosen:
            live = self._live[request_id]
            if live.scores_due:  # taken while broken: the next step scores, then inserts
                self._unscored.append(live)
            else:
                self._insert(live, list(live.request.prompt_tokens) + live.generated)

    def forget(self, request_ids: Collection[str]) -> None:
        """Drop requests for good (finished elsewhere, failed or isolated)."""
        self._remove(request_ids)

    def compile_response_format(self, response_format: dict) -> object:
        """Compile an OpenAI ``response_format`` for this tokenizer (any thread)."""
        return compile_format(self.tokenizer, response_format, self.vocab_size)

    def live_ids(self) -> list[str]:
        return list(self._live)

    def memory(self) -> dict[str, int]:
        """MLX's memory figures in bytes, as last sampled on the MLX thread (any thread)."""
        return {**self._mlx_memory.figures, "prefix_cache_bytes": self.prefix_cache.nbytes}

    def _sample_memory(self) -> None:
        self._mlx_memory.sample()

    def close(self) -> None:
        self._close_batch()
        self._live.clear()
        self._unscored.clear()
        self._by_uid.clear()

    # -- internals ---------------------------------------------------------------------

    def _new_batch(self) -> BatchGenerator:
        batch = BatchGenerator(
            self.model,
            completion_batch_size=self._limits.decode_batch_size,
            prefill_batch_size=self._limits.prefill_batch_size,
            prefill_step_size=self._limits.prefill_step_size,
            stream=self._stream,
        )
        if self._one_array_logprobs:
            use_one_array_step(batch)
        if self._early_decode_join:
            use_early_split(batch)
        return batch

    def _close_batch(self) -> None:
        try:
            self._batch.close()
        except Exception:  # a broken generator must not stop us from replacing it
            log.exception("closing the old batch generator failed")

    def _new_live(self, request: GenerationRequest) -> Live:
        # Special tokens take their place in the reply but show no text (as vLLM's).
        text = TextPipeline(self._new_detokenizer(), request,
                            self._text_machines[request.output.tool_calls], self._special)
        return Live(request, text)

    def _admit(self, admissions: Sequence[GenerationRequest]) -> list[tuple[str, Exception]]:
        """Put newcomers into the batch, and requests whose prompts still need their
        scores (replayed before their first admission); those prompts are scored
        together first. A fault fails its own request only."""
        failed: list[tuple[str, Exception]] = []
        if not admissions and not self._unscored:  # most steps: nothing to place
            return failed
        placing, self._unscored = [live for live in self._unscored
                                   if self._live.get(live.request.request_id) is live], []
        for request in admissions:
            try:
                self._failpoints.check("engine.admit", _user_set(request.user))
                placing.append(self._new_live(request))
            except Exception as exc:
                failed.append((request.request_id, exc))
        scored = score_requests(self.model, [x.request for x in placing],
                                self.token_texts, self._limits.prefill_step_size,
                                self._limits.prefill_batch_size)
        for live in placing:
            request_id = live.request.request_id
            try:
                self._place(live, scored.get(request_id))
            except Exception as exc:
                self._live.pop(request_id, None)
                failed.append((request_id, exc))
            else:
                self._live[request_id] = live
        return failed

    def _place(self, live: Live, scored: Scored | Exception | None) -> None:
        if isinstance(scored, Exception):
            raise scored
        prompt = live.request.prompt_tokens
        waiting = self._waiting_for_prefill.get(prompt)
        if scored is not None:  # the prompt was run already: go on from its KV
            self._insert_scored(live, scored)
        elif waiting is not None:
            waiting.append(live)  # a sibling choice is prefilling this very prompt
        else:
            self._insert(live, list(prompt))
            if self.prefix_cache.enabled:  # later equal prompts will wait for this one
                self._waiting_for_prefill.setdefault(prompt, [])

    def _release_waiting(self, prompt_responses: Any) -> None:
        """Once a prompt is prefilled, share its KV with the choices waiting for it."""
        for r in prompt_responses:
            live = self._by_uid.get(r.uid)
            if live is None or not r.end_of_prompt or live.prefilled:
                continue
            live.prefilled = True
            waiting = self._waiting_for_prefill.pop(live.request.prompt_tokens, None)
            if waiting:
                cache, tokens = self._batch.extract_cache([r.uid])[r.uid]
                self.prefix_cache.store(tokens, cache)
            for sibling in waiting or ():
                if sibling.request.request_id in self._live:
                    self._insert(sibling, list(sibling.request.prompt_tokens))

    def _insert_scored(self, live: Live, scored: Scored) -> None:
        """Insert a request whose prompt was scored, with the KV that left."""
        prompt = list(live.request.prompt_tokens)
        live.prompt_logprobs, cache = scored
        live.scores_due = False
        if cache is None:  # a one-token prompt: nothing was run
            self._insert(live, prompt)
            return
        live.cached_tokens = 0  # computed just now, not found in the prefix cache
        self._insert(live, prompt, (cache, prompt[-1:]))

    def _insert(self, live: Live, prompt: list[int],
                computed: tuple[list[Any], list[int]] | None = None) -> None:
        """Put a request into the batch, from the prefix cache's longest match of
        ``prompt`` or from ``computed`` (a KV cache and the tokens after it)."""
        cache, rest = computed or self.prefix_cache.lookup(prompt)
        if live.cached_tokens is None:  # the first admission, not a replay
            live.cached_tokens = len(prompt) - len(rest)
        live.uid = insert_sequence(self._batch, live, prompt, cache, rest, self._end_tokens,
                                   self._format_faults)
        self._by_uid[live.uid] = live

    def _remove(self, request_ids: Collection[str], keep_cache: bool = False) -> None:
        uids = []
        for request_id in request_ids:
            live = self._live.pop(request_id, None)
            if live is None:
                continue
            waiting = self._waiting_for_prefill.pop(live.request.prompt_tokens, None)
            for sibling in waiting or ():  # the leader left early: siblings go on alone
                if sibling.request.request_id in self._live:
                    self._insert(sibling, list(sibling.request.prompt_tokens))
            if live.uid is not None:
                self._by_uid.pop(live.uid, None)
                uids.append(live.uid)
        if uids:
            caches = self._batch.remove(uids, return_prompt_caches=keep_cache)
            for cache, tokens in caches.values():
                self.prefix_cache.store(tokens, cache)

    def _users(self) -> set[str]:
        return {u for live in self._by_uid.values() if (u := live.request.user) is not None}

    def _account(self, live: Live, response: Any) -> TokenRecord:
        """Account one generated token on the MLX thread: what a replay needs, its
        log-probabilities (read from the batch's arrays), and mlx-lm's own end."""
        live.generated.append(response.token)
        request = live.request
        logprobs: tuple = ()
        k = request.output.logprobs
        if k is not None:  # the token that ended the reply too: usage counts it (vLLM)
            logprobs = (token_logprob(self.token_texts, response.logprobs, response.token, k),)
        prompt_logprobs = live.prompt_logprobs
        if prompt_logprobs is not None:  # only ever with the request's first token
            live.prompt_logprobs = None
        if response.finish_reason is not None:  # mlx-lm has taken it out of the batch
            if response.prompt_cache is not None:  # and extracted its KV for us
                self.prefix_cache.store(list(response.all_tokens), response.prompt_cache)
            self._remove([request.request_id])
        return TokenRecord(live, response.token, response.finish_reason, logprobs,
                           prompt_logprobs)

    @property
    def ended_waiting(self) -> bool:
        """Whether replies the text ended wait to be taken out of the batch."""
        return bool(self._text_ended)

    def take_out_ended(self) -> None:
        """Take out of the batch the requests whose text ended (or failed) since the
        last call, their KV kept for the prefix cache where the text ended them (MLX
        thread). A broken batch keeps them: its rebuild drops them."""
        while self._text_ended and not self._broken:
            request_id, keep_cache = self._text_ended[0]
            self._remove([request_id], keep_cache=keep_cache)
            self._text_ended.popleft()  # only once out: a fault leaves it for the rebuild


def _user_set(user: str | None) -> set[str]:
    return {user} if user is not None else set()
