"""The process's limit on open files: kept through mlx-lm's import, and raised.

Every connection is a file. Importing ``mlx_lm`` sets the limit to 2,048 (hard limit
4,096) whatever the deployment gave the process: a hard limit, once lowered, cannot be
raised again without privileges, and on a host whose hard limit is below 4,096 the
import fails. About 2,000 idle connections then left no file for the next one, and
``/health`` and ``/live`` probes were reset until the head deadline closed the idle
ones. So mlx-lm is first imported with that call skipped (``import_mlx_lm``), and at
startup the soft limit is raised towards the hard one, as vLLM's API server does
(``raise_open_files_limit``).
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("mlx_serve")

OPEN_FILES_TARGET = 65536  # vLLM's target for the soft limit

try:
    import resource
except ImportError:  # not on a POSIX system: nothing to keep
    resource = None  # type: ignore[assignment]


@contextmanager
def _open_files_limit_kept() -> Iterator[None]:
    """Within it, calls that set ``RLIMIT_NOFILE`` do nothing (others go through)."""
    if resource is None:
        yield
        return
    setrlimit = resource.setrlimit

    def others_only(which: int, limits: Any) -> None:
        if which != resource.RLIMIT_NOFILE:
            setrlimit(which, limits)

    resource.setrlimit = others_only
    try:
        yield
    finally:
        resource.setrlimit = setrlimit


def import_mlx_lm() -> None:
    """Import mlx-lm (once) without letting it set the open-files limit."""
    if "mlx_lm.utils" in sys.modules:
        return
    with _open_files_limit_kept():
        importlib.import_module("mlx_lm")


def raise_open_files_limit(target: int = OPEN_FILES_TARGET) -> None:
    """Raise the soft open-files limit to ``target``, or the hard limit if lower."""
    if resource is None:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d: %s", soft, exc)
            return
        log.info("open-files limit raised from %d to %d (hard limit %s)", soft, wanted,
                 "none" if hard == resource.RLIM_INFINITY else hard)
    elif soft < 4096:
        log.warning("open-files limit %d: a connection is a file, so about that many "
                    "clients at once are the most this server can hold", soft)
