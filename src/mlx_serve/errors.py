"""Every error a client can see, each knowing its HTTP status and OpenAI error type.

    MLXServeError                       500 server_error
    ├── RequestError                    400 invalid_request_error
    │   ├── UnsupportedParameterError   400 (an OpenAI field we cannot honour)
    │   └── ContextLengthExceededError  400 context_length_exceeded
    ├── AuthenticationError             401 invalid_api_key (+ WWW-Authenticate)
    ├── ModelNotFoundError              404 model_not_found
    ├── RequestTimeoutError             408: the body did not arrive in time
    ├── PayloadTooLargeError            413
    ├── OverloadedError                 429 (+ Retry-After): the inbox is full
    │   └── BodiesOverloadedError       429: too many body bytes being read at once
    ├── EngineUnavailableError          503 (+ Retry-After): loading, draining, wedged
    │   └── EngineDeadError             503: the actor is gone or has failed for good
    ├── GenerationError                 500: a batch step failed this request
    └── StepTimeoutError                503: the step in flight exceeded its deadline

The engine and the HTTP layer both raise these; the HTTP layer maps them to responses in
one place (``http_errors``). Nothing here imports Starlette or MLX.
"""

from __future__ import annotations


class MLXServeError(Exception):
    status_code: int = 500
    error_type: str = "server_error"
    code: str | None = None
    retry_after: int | None = None
    # False: the same request would fail the same way, so clients should not resend it
    # (``x-should-retry: false``, which the OpenAI SDKs honour over their own retries).
    should_retry: bool | None = None
    # Refused with the body unread: the connection cannot carry another request.
    closes_connection: bool = False

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, object]:
        """The OpenAI error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class RequestError(MLXServeError):
    status_code = 400
    error_type = "invalid_request_error"


class UnsupportedParameterError(RequestError):
    code = "unsupported_parameter"


class ContextLengthExceededError(RequestError):
    code = "context_length_exceeded"


class AuthenticationError(MLXServeError):
    status_code = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class ModelNotFoundError(MLXServeError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class RequestTimeoutError(MLXServeError):
    status_code = 408
    error_type = "invalid_request_error"
    code = "request_timeout"
    closes_connection = True


class PayloadTooLargeError(MLXServeError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"
    closes_connection = True


class OverloadedError(MLXServeError):
    status_code = 429
    error_type = "rate_limit_error"
    code = "server_overloaded"
    retry_after = 1


class BodiesOverloadedError(OverloadedError):
    closes_connection = True  # refused while its body was still arriving


class EngineUnavailableError(MLXServeError):
    status_code = 503
    error_type = "server_error"
    code = "engine_unavailable"
    retry_after = 5


class EngineDeadError(EngineUnavailableError):
    code = "engine_dead"


class ShuttingDownError(EngineUnavailableError):
    """A request ended unfinished because the server shuts down (its drain timed out, or
    a second signal): another replica can serve it."""

    code = "server_shutting_down"


class GenerationError(MLXServeError):
    code = "generation_failed"


class IsolatedRequestError(GenerationError):
    """Steps failed while this request was in them, and alone too: the request is the
    cause, so a resend would fail the same way, and enough of them in a row would make
    the engine give up on itself (recovery.py)."""

    should_retry = False


class UnstableGenerationError(GenerationError):
    """This request took part in too many failed steps, good steps between them, and no
    cause was pinned on it: every request in those steps looked the same (recovery.py).
    Whether it was the cause or a bystander of rare faults is not known, so a resend may
    well succeed (``x-should-retry: true``)."""

    should_retry = True


def isolation_error(cause: BaseException | None, *,
                    worn_out_after: int | None = None) -> GenerationError:
    """The answer of a request the recovery ended: found the cause of failing steps, or
    (``worn_out_after``) ended after that many failed steps with no cause found."""
    if worn_out_after is None:
        return IsolatedRequestError(f"generation failed: {cause}")
    return UnstableGenerationError(
        f"generation failed: {worn_out_after} steps this request was in failed, with no "
        f"cause pinned on any one request; a resend may succeed (last error: {cause})")


class StepTimeoutError(MLXServeError):
    status_code = 503
    code = "step_timeout"
    retry_after = 5


def as_request_error(exc: Exception) -> MLXServeError:
    """What a client sees for an exception that ended its request: our own errors as they
    are, a rejected input (ValueError) as a 400, anything else as a failed generation."""
    if isinstance(exc, MLXServeError):
        return exc
    if isinstance(exc, ValueError):
        return RequestError(f"the request could not be admitted: {exc}")
    return GenerationError(f"generation failed: {type(exc).__name__}: {exc}")
