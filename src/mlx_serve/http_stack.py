"""What this process serves HTTP with, said once at startup.

uvicorn picks uvloop and httptools (a C parser) when they are installed, as
``uvicorn[standard]``, a dependency of mlx-serve, brings them. Without httptools it
parses every request and frames every streamed chunk with h11, in pure Python, on the
event loop that also hands out every step's tokens (12-22 % more of its CPU per token,
measured against httptools): a deployment that lost it (a hand-built image,
``--no-deps``) should hear so.

On a free-threaded interpreter (CPython 3.14t) the MLX thread builds each step's graph
while the event loop streams the last step's tokens, where a standard build runs one of
them at a time. An extension module without free-threading support turns the lock back
on when imported; that is said too, since serving then behaves as on a standard build.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import sys
import sysconfig

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


def interpreter_lock_on() -> bool:
    """Whether this interpreter runs with its lock: always, but on a free-threaded build
    that kept it off."""
    is_enabled = getattr(sys, "_is_gil_enabled", None)  # Python 3.13 and later
    return True if is_enabled is None else bool(is_enabled())


def log_interpreter_lock() -> None:
    """On a free-threaded build, say whether its interpreter lock stayed off."""
    if not sysconfig.get_config_var("Py_GIL_DISABLED"):
        return  # a standard build: nothing to tell
    if interpreter_lock_on():
        log.warning("free-threaded interpreter with its lock on: PYTHON_GIL=1, or an "
                    "extension module without free-threading support turned it on at "
                    "import; the MLX thread and the event loop take turns")
    else:
        log.info("free-threaded interpreter, lock off: the MLX thread and the event loop "
                 "run in parallel")
