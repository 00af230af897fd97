"""What this process serves HTTP with, said once at startup.

uvicorn picks uvloop and httptools (a C parser) when they are installed, as
``uvicorn[standard]``, a dependency of mlx-serve, brings them. Without httptools it
parses every request and frames every streamed chunk with h11, in pure Python, on the
event loop that also hands out every step's tokens (12-22 % more of its CPU per token,
measured against httptools): a deployment that lost it (a hand-built image,
``--no-deps``) should hear so.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging

log = logging.getLogger("mlx_serve")


def log_http_stack() -> None:
    """Log the running event loop's kind and whether httptools is there (call on it)."""
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]  # uvloop | asyncio
    if importlib.util.find_spec("httptools") is not None:
        log.info("event loop: %s; httptools installed (uvicorn's HTTP parser by default)",
                 loop)
    else:
        log.warning("event loop: %s; httptools is not installed, so uvicorn parses "
                    "requests and frames streamed chunks with h11 in pure Python, on the "
                    "event loop; install uvicorn[standard] for its C parser", loop)
