"""The engine's states, settings and statistics snapshot: plain values, and the error
that each state not taking requests answers with."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from mlx_serve.errors import (
    EngineDeadError,
    EngineUnavailableError,
    MLXServeError,
    OverloadedError,
    RequestError,
    ShuttingDownError,
)


class EngineState(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    RECOVERING = "recovering"
    DRAINING = "draining"
    WEDGED = "wedged"
    FAILED = "failed"
    STOPPED = "stopped"


# States in which the process is still worth keeping alive (liveness).
ALIVE_STATES = {EngineState.LOADING, EngineState.READY, EngineState.RECOVERING,
                EngineState.DRAINING}


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 32
    max_queue: int = 256
    step_timeout: float = 120.0
    max_failed_rebuilds: int = 3
    max_request_failures: int = 2
    pipeline_depth: int = 3  # steps in the MLX thread's hands: the running one + queued
    text_thread: bool = False  # each step's text on a thread of its own (runner.token_text)


@dataclass(frozen=True)
class EngineStatistics:
    state: EngineState
    running: int
    waiting: int
    steps: int
    recoveries: int
    replays: int
    isolated: int
    step_age: float
    error: str | None
    mlx_busy: float = 0.0  # seconds the MLX thread has spent in finished jobs
    prefill_steps: int = 0  # batch steps that also processed prompts
    worn_out: int = 0  # requests ended by too many failed steps, no cause found

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state.value, "running": self.running, "waiting": self.waiting,
            "steps": self.steps, "recoveries": self.recoveries, "replays": self.replays,
            "isolated": self.isolated, "step_age_s": round(self.step_age, 3),
            "error": self.error, "mlx_busy_s": round(self.mlx_busy, 4),
            "prefill_steps": self.prefill_steps, "worn_out": self.worn_out,
        }


def unavailable_error(state: EngineState) -> MLXServeError:
    """Why an engine in ``state`` takes no requests."""
    if state in (EngineState.FAILED, EngineState.STOPPED):
        return EngineDeadError(f"the generation engine has {state.value}")
    return EngineUnavailableError(f"the server is {state.value}; retry later")


def check_admission(held: int, new: int, capacity: int) -> None:
    """Refuse ``new`` requests (one HTTP request's choices) when the ``held`` ones still
    wanted, running or queued, leave no room for them within ``capacity`` (the decode
    batch plus the queue); a 400 when they could never fit at all."""
    if new > capacity:
        raise RequestError(f"this request makes {new} choices (n x prompts); this server "
                           f"holds at most {capacity} requests at once", param="n")
    if held + new > capacity:
        raise OverloadedError("the server is at capacity; retry shortly")


def ended_error(state: EngineState, aborted: bool) -> MLXServeError:
    """The terminal error of a request still open when the engine ended: a shutdown's
    (the engine stopped by an abort) or a dead engine's."""
    if aborted and state is EngineState.STOPPED:
        return ShuttingDownError("the server is shutting down: this request was ended "
                                 "unfinished; send it again (to another replica)")
    return EngineDeadError(f"the generation engine has {state.value}")
