"""Settings: one validated object built once from ``MLX_SERVE_*`` variables and CLI flags."""

from __future__ import annotations

import difflib
import ipaddress
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from mlx_serve.failpoints import KNOWN_SITES, FailPoints

ENV_PREFIX = "MLX_SERVE_"
LOOPBACK_NAMES = {"localhost"}
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# The server's log lines, wherever it sets up logging itself (mlx-serve, plain uvicorn,
# the engine process).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def flag_name(setting: str) -> str:
    """A setting's command-line flag: ``decode_batch_size`` is ``--decode-batch-size``."""
    return "--" + setting.replace("_", "-")


def env_name(setting: str) -> str:
    """A setting's environment variable: ``MLX_SERVE_DECODE_BATCH_SIZE``."""
    return ENV_PREFIX + setting.upper()


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """Every knob of the server. Field descriptions double as ``--help`` text."""

    # An empty variable (a deployment template's unset value) is no setting, for every
    # setting: MLX_SERVE_PORT= is the default port, not an error.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore",
                                      env_ignore_empty=True)

    model: str | None = Field(
        None, description="mlx-lm model folder or Hugging Face repo id (default: embedded model)"
    )
    served_model_name: str | None = Field(None, description="model id that clients use")
    api_key: str | None = Field(
        None, description="require 'Authorization: Bearer KEY' on the /v1 endpoints (prefer "
                          "the environment variable: a flag shows in the process list)",
    )
    allowed_origins: str | None = Field(
        None, description="comma-separated origins whose pages a browser may let call this "
                          "server (CORS; '*' for any); default: none",
    )
    host: str = Field("127.0.0.1", min_length=1,
                      description="address to bind (0.0.0.0: every interface)")
    port: int = Field(8000, ge=0, le=65535, description="port to bind")
    cache_dir: Path | None = Field(None, description="where the default model is converted to")
    dequantize_default_model: bool | None = Field(
        None,
        description="serve the default model as float32 (default: on when OpenBLAS is active)",
    )
    openblas: bool | None = Field(
        None, description="preload Debian's OpenBLAS on Linux (default: when installed)"
    )
    jemalloc: bool | None = Field(
        None, description="preload Debian's jemalloc on Linux (default: when installed)"
    )

    decode_batch_size: int = Field(32, ge=1, description="requests decoded together per step")
    prefill_batch_size: int = Field(8, ge=1, description="prompts prefilled together")
    prefill_step_size: int = Field(512, ge=1, description="prompt tokens per prefill chunk")
    pipeline_depth: int = Field(
        3, ge=1, le=8,
        description="batch steps handed to the MLX thread ahead of their results (3: the "
                    "running step and two queued)",
    )
    max_queue: int = Field(256, ge=1, description="requests waiting for a batch slot before 429")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="largest request body")
    max_body_bytes_in_flight: int = Field(
        256 * 1024 * 1024, ge=1024,
        description="request-body bytes read at once across all requests; a body that "
                    "would pass it is refused with 429 as it arrives (a lone body always "
                    "fits)",
    )
    header_timeout: float = Field(
        60.0, gt=0,
        description="seconds a connection may take to send a whole request head (from its "
                    "start, or from a next request's first byte); then it is closed "
                    "(mlx-serve only: uvicorn itself bounds no head's arrival)",
    )
    send_timeout: float = Field(
        60.0, gt=0,
        description="seconds a reply's writes may wait on a client that takes none of it "
                    "(its socket buffers full); then the connection is aborted and a "
                    "stream's request cancelled (mlx-serve only)",
    )
    body_timeout: float = Field(
        60.0, gt=0,
        description="seconds a request body may take to arrive whole once its headers have "
                    "(408 after): a client that stops sending holds nothing for longer",
    )
    max_context: int | None = Field(None, ge=2, description="override the model's context length")
    default_max_tokens: int | None = Field(
        None, ge=1, description="max_tokens when a request names none (default: rest of context)"
    )

    prefix_cache_bytes: int = Field(
        1 << 30, ge=0, description="byte budget of the prompt prefix cache (0 turns it off)"
    )
    responses_store_bytes: int = Field(
        64 << 20, ge=0,
        description="byte budget of stored Responses, for previous_response_id and GET/DELETE "
                    "/v1/responses/{id} (least recently used out first; 0 stores none)",
    )
    mlx_cache_limit_bytes: int | None = Field(
        None, ge=0, le=2**63 - 1,
        description="most freed device memory MLX keeps for reuse (default: MLX's own limit)",
    )
    mlx_thread_nice: int = Field(
        0, ge=-20, le=19,
        description="scheduling niceness of the MLX thread and the threads it starts "
                    "(Linux; below 0 needs CAP_SYS_NICE): on a host with few cores a "
                    "negative value lets batch steps run ahead of HTTP and other processes",
    )
    text_thread: bool = Field(
        False,
        description="turn each step's tokens into text (detokenizer, stop strings) on a "
                    "thread of its own while the MLX thread runs the next step, not on "
                    "the MLX thread after each step (same replies)",
    )
    one_array_logprobs: bool = Field(
        True,
        description="evaluate each decode step's log-probabilities as one array, not one "
                    "per sequence as mlx-lm does (same output, shorter steps)",
    )
    early_decode_join: bool = Field(
        True,
        description="move each prompt into the decode batch in the step that finished its "
                    "prefill, a step sooner than mlx-lm does, and send its first token from "
                    "that step (first tokens two steps sooner; the same tokens)",
    )
    max_n: int = Field(16, ge=1, le=128, description="most choices (n x prompts) per request")
    reasoning_format: Literal["reasoning", "reasoning_content", "both"] = Field(
        "reasoning", description="reply field(s) that carry a thinking model's reasoning"
    )
    intake_per_pass: int = Field(
        0, ge=0, le=4096,
        description="at most this many arriving requests prepared (read, validated, "
                    "tokenized) per pass of the event loop, the rest of a burst waiting for "
                    "the next passes, so /health and running streams are served meanwhile; "
                    "best at least prefill_batch_size when set (0: no limit)",
    )
    sse_ping_seconds: float = Field(15.0, gt=0, description="SSE keep-alive comment interval")
    stream_interval: int = Field(
        1, ge=1, le=64,
        description="tokens per streamed chunk after the first (1: every token; more: "
                    "fewer writes at high concurrency)",
    )

    engine_process: bool = Field(
        False,
        description="run the engine (batch steps, MLX) in a child process and HTTP in this "
                    "one: a crash of the engine's native code ends only the child, and every "
                    "open request still gets an answer",
    )
    step_timeout: float = Field(120.0, gt=0, description="seconds before a step counts as wedged")
    max_failed_rebuilds: int = Field(3, ge=1, description="failed rebuilds in a row before failed")
    max_request_failures: int = Field(
        2, ge=1, description="failed probe steps a request may take alone (a failing batch "
                             "is bisected) before it is isolated",
    )
    exit_on_fatal: bool = Field(False, description="exit non-zero when the engine fails for good")
    drain_timeout: float = Field(30.0, ge=0, description="seconds to finish in-flight on SIGTERM")

    failpoints: str | None = Field(None, description="fault injection sites (see README)")
    failpoints_http: bool = Field(False, description="allow /_debug/failpoints on loopback")
    log_level: str = Field("info", description=f"log level: {', '.join(LOG_LEVELS)}")
    access_log: bool = Field(
        True, description="log a line per HTTP request, as uvicorn does (mlx-serve only; "
                          "plain uvicorn has --no-access-log)",
    )

    @property
    def origins(self) -> list[str]:
        return [o.strip() for o in (self.allowed_origins or "").split(",") if o.strip()]

    @field_validator("model", "served_model_name", "cache_dir", "allowed_origins",
                     "failpoints", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        # A blank value given directly (an empty environment variable is dropped before
        # this) is no setting: a blank model is not "." (the working directory).
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("cache_dir")
    @classmethod
    def _home_expanded(cls, folder: Path | None) -> Path | None:
        # "~/models" from a unit file or a Kubernetes env entry, where no shell expands it.
        return folder.expanduser() if folder is not None else None

    @field_validator("model")
    @classmethod
    def _model_folder_exists(cls, model: str | None) -> str | None:
        # A Hugging Face repo id never starts so; a folder that is not there is a typo
        # to report now, not a server that starts only to answer every request with 503.
        if model and model.startswith(("/", "./", "../", "~")) and not (
                Path(model).expanduser().exists()):
            raise ValueError(f"no such model folder: {model}")
        # "models/tinym" reads as a repo id, but when "models" is a folder here it is
        # almost surely a path with a typo: the start would fail later, on the network.
        if model and "/" in model and not Path(model).exists() and (
                Path(model.split("/", 1)[0]).is_dir()):
            raise ValueError(f"no such model folder: {model} (a Hugging Face repo id that "
                             "starts with the name of a folder here is taken for a path)")
        return model

    @field_validator("api_key")
    @classmethod
    def _empty_key_is_no_key(cls, key: str | None) -> str | None:
        if key and not key.strip():  # a key no client could send
            raise ValueError("is blank: give a key, or none")
        # A key read from a file often ends with a newline, which no header can carry.
        return key.strip() if key else None  # MLX_SERVE_API_KEY= turns it off, as vLLM

    @field_validator("log_level")
    @classmethod
    def _known_log_level(cls, level: str) -> str:
        if level.lower() not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
        return level.lower()

    @field_validator("failpoints")
    @classmethod
    def _failpoints_parse(cls, spec: str | None) -> str | None:
        points = FailPoints.from_spec(spec)  # a FailPointSpecError (a ValueError) says why
        unknown = sorted(set(points.sites) - set(KNOWN_SITES))
        if unknown:  # a typo would inject nothing
            raise ValueError(f"unknown fail-point sites {unknown}; known: {KNOWN_SITES}")
        return spec

    @model_validator(mode="after")
    def _debug_endpoints_only_on_loopback(self) -> Settings:
        if self.failpoints_http and not is_loopback(self.host):
            raise ValueError("failpoints_http is refused unless the server binds to loopback")
        return self


def describe_invalid(exc: ValidationError) -> str:
    """A settings error, one line per fault, naming each setting by its flag and its
    variable but never echoing a value: pydantic's own text quotes the input, which
    for a check of the whole settings is all of them, the API key included."""
    lines = []
    for error in exc.errors(include_url=False, include_input=False):
        name = "_".join(str(part) for part in error["loc"])
        where = f"{name} ({flag_name(name)}, {env_name(name)})" if name else "settings"
        lines.append(f"  {where}: {error['msg']}")
    return "\n".join(lines)


# Variables of the prefix that are not settings but the server's own.
_NOT_SETTINGS = frozenset({"MLX_SERVE_PRELOAD_REEXEC"})


def unknown_environment(environ: Mapping[str, str]) -> list[str]:
    """``MLX_SERVE_*`` variables that name no setting (a typo, or ``NO_``: off is
    ``=false``), each with the setting it likely meant."""
    known = {env_name(name) for name in Settings.model_fields} | _NOT_SETTINGS
    notes = []
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and name not in known:
            guess = difflib.get_close_matches(name.replace("_NO_", "_"), known, n=1)
            notes.append(f"{name} (did you mean {guess[0]}?)" if guess else name)
    return notes
