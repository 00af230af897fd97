"""A request's format processor whose faults end that request, not the batch step.

mlx-lm calls every request's logits processors inside one batch step, so a processor that
raises fails the step for every request in it. A format can fail only mid-generation: a
JSON schema whose ``$ref`` cycle has no way out compiles, and its matcher finds no token
to allow once the reply reaches the cycle. Caught here, the fault is recorded for the
runner, which ends that request with a 400 after the step, and the step goes on (the
request's logits left as they were; the token sampled from them is never used).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlx_serve.errors import RequestError

__all__ = ["FormatFault", "FormatFaults", "GuardedFormat"]


class FormatFault(RequestError):
    """The request's format (named by ``param``, the field it came from) admits no
    continuation of what the reply holds so far."""

    def __init__(self, reason: Exception, param: str = "response_format") -> None:
        super().__init__(
            f"the reply cannot go on under '{param}': {reason} (a JSON schema's $ref cycle "
            "without a way out, a constraint larger than the grammar engine takes, or text "
            "this model's tokens cannot spell ends a reply here)", param=param)


class GuardedFormat:
    """Wraps one request's format processor; on its first fault, reports it once through
    ``on_fault`` and from then on leaves the logits alone."""

    __slots__ = ("_inner", "_on_fault", "_param", "fault")

    def __init__(self, inner: Callable[[Any, Any], Any],
                 on_fault: Callable[[FormatFault], None], param: str = "response_format"
                 ) -> None:
        self._inner = inner
        self._on_fault = on_fault
        self._param = param
        self.fault: FormatFault | None = None

    def __call__(self, tokens: Any, logits: Any) -> Any:
        if self.fault is not None:
            return logits
        try:
            return self._inner(tokens, logits)
        except Exception as exc:  # the grammar's fault, not the batch's
            self.fault = FormatFault(exc, self._param)
            self._on_fault(self.fault)
            return logits


class FormatFaults:
    """The faults recorded during a step, by request id, for the runner to fail after it."""

    __slots__ = ("_faults",)

    def __init__(self) -> None:
        self._faults: dict[str, FormatFault] = {}

    def guard(self, request_id: str, processor: Callable[[Any, Any], Any],
              param: str = "response_format") -> GuardedFormat:
        def record(fault: FormatFault) -> None:
            self._faults.setdefault(request_id, fault)

        return GuardedFormat(processor, record, param)

    def take(self) -> dict[str, FormatFault]:
        faults, self._faults = self._faults, {}
        return faults
