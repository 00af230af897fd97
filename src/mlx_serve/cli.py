"""``mlx-serve`` / ``python -m mlx_serve``: flags mirror the MLX_SERVE_* settings."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any, NoReturn

import uvicorn
from pydantic import ValidationError

from mlx_serve.config import LOG_FORMAT, Settings, describe_invalid, flag_name
from mlx_serve.preload import reexec_with_preloads


def _flag_type(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if isinstance(annotation, types.UnionType) and args else annotation
    return base


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-serve",
        description="OpenAI-compatible LLM server for MLX. Every flag can also be set "
        "as an MLX_SERVE_<NAME> environment variable.",
    )
    for name, field in Settings.model_fields.items():
        flag = flag_name(name)
        kind = _flag_type(field.annotation)
        # The parser's own default stays None, so that an unset flag leaves the setting to
        # its environment variable; the help says the setting's default.
        shown = field.description or ""
        if field.default is not None:
            shown += f" (default: {str(field.default).lower() if kind is bool else field.default})"
        if kind is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                default=None, help=shown)
        else:
            converter = kind if kind in (int, float) else str
            parser.add_argument(flag, dest=name, type=converter, default=None, help=shown)
    return parser


def settings_from_args(argv: Sequence[str] | None) -> Settings:
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    return Settings(**overrides)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        settings = settings_from_args(argv)
    except ValidationError as exc:
        print(f"mlx-serve: invalid settings:\n{describe_invalid(exc)}", file=sys.stderr)
        return 2
    reexec_with_preloads(argv, settings.openblas, settings.jemalloc)
    logging.basicConfig(level=settings.log_level.upper(),
                        format=LOG_FORMAT)
    from mlx_serve.app import create_app
    from mlx_serve.http_deadlines import uvicorn_protocol, with_deadlines
    from mlx_serve.serving import DrainingServer

    app = create_app(settings)
    http = with_deadlines(uvicorn_protocol(), settings.header_timeout, settings.send_timeout)
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=settings.log_level.lower(), backlog=2048,
                            access_log=settings.access_log, http=http or "auto",
                            ws="none",  # nothing here speaks WebSocket
                            timeout_graceful_shutdown=5)
    server = DrainingServer(config, app, settings.drain_timeout)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn's own exit, after its shutdown (a port in use: 3)
        _exit_now(_exit_status(exc.code))
    _exit_now(server.exit_code)


def _exit_status(code: object) -> int:
    """The status the interpreter gives a ``SystemExit`` code: None is 0, an int is
    itself, anything else is printed to standard error and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _exit_now(code: int) -> NoReturn:
    """Leave without interpreter teardown once uvicorn has shut down.

    Every reply has been written by then. A step left running on the MLX thread (a
    drain timeout does not wait for it) must not meet MLX's native threads being torn
    down at exit, which aborts the process ("terminate called ...") and turns a clean
    drain into status -6. The same teardown aborted now and then after the MLX thread
    had ended (see ``runner/streams.py``), as when the port was in use.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
