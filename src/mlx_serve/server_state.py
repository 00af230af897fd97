"""What the routes share: settings, the engine, fail points, the served model's name and
the metrics."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mlx_serve.body_budget import BodyBudget
from mlx_serve.config import Settings
from mlx_serve.engine import Engine
from mlx_serve.failpoints import FailPoints
from mlx_serve.intake_turns import IntakeTurns
from mlx_serve.metrics import ServerMetrics
from mlx_serve.remote_engine import RemoteEngine
from mlx_serve.responses_store import ResponseStore


@dataclass
class ServerState:
    settings: Settings
    engine: Engine | RemoteEngine  # in this process, or in an engine process
    failpoints: FailPoints
    model_name: str
    metrics: ServerMetrics
    started: int = field(default_factory=lambda: int(time.time()))
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(0))
    bodies: BodyBudget = field(default_factory=lambda: BodyBudget(1 << 62))
    intake: IntakeTurns = field(default_factory=lambda: IntakeTurns(0))
    # Set by the server runner (``mlx-serve``): shut down gracefully with this status.
    request_exit: Callable[[int], None] | None = None
    # Set by the server runner once a signal's drain has run its course (its requests
    # finished or aborted), or a second signal asked to stop at once: the app's shutdown
    # then waits for nothing more (an engine that cannot answer would hold it forever).
    drained: bool = False
    stop_now: bool = False
