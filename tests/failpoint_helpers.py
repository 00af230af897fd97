"""Shared by the fail-point tests: evaluate a site and record what happened, start a
daemon thread."""

from __future__ import annotations

import threading

from mlx_serve.failpoints import FailPoints

WAIT_S = 10.0  # generous bound for cross-thread hand-offs; only reached on failure


def outcomes(points: FailPoints, site: str, n: int, users=()) -> list[str]:
    """Evaluate ``site`` n times; record 'ok' or the raised exception's type name."""
    result = []
    for _ in range(n):
        try:
            points.check(site, users)
        except Exception as exc:
            result.append(type(exc).__name__)
        else:
            result.append("ok")
    return result


def start_thread(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread
