"""Where a request's time to first token goes inside mlx_serve, request by request.

Put this folder first on ``PYTHONPATH`` and set ``MLX_ADMISSION_PROBE_OUT=PATH``: the
server then appends one line per request to ``PATH.<pid>``: six spans in milliseconds,
then when the request was submitted (epoch seconds, so that ``--runs`` can match it to
a measured run):

0. the HTTP request enters the application -> submitted to the engine (reading the
   body, validating it, tokenizing the prompt; ``nan`` for a request submitted by no
   HTTP request);
1. submitted to the engine -> taken from its inbox by the actor;
2. taken -> the batch step that admits it begins on the MLX thread;
3. that step begins -> the runner has the request's first text (prefill, the steps to
   the first token, and any token the detokenizer held back);
4. first text -> the actor hands it out on the event loop (the rest of the step, the
   hop back, the actor's turn);
5. handed out -> the first body frame of its stream is written to the socket (the
   route's turn, the frame, the write); ``nan`` for a reply that is not streamed, or
   that ended with its first text.

Only mlx_serve's own process installs the probe (``python -m mlx_serve``, ``mlx-serve``,
or uvicorn serving ``mlx_serve.app``): the load generator, the host sampler and the
engine harness start with the same ``PYTHONPATH`` and would each pay for importing the
server, seconds a process (with torch installed beside transformers, tens of seconds).

The line is written at the first frame, or when the request ends without one. The
client's TTFT adds the sockets both ways and the server's parsing of the request line
and headers before it enters the application. ``python -m benchmarks.admission_report
PATH.*`` prints percentiles. Each hook costs a dictionary look-up or write.
"""

import os
import sys
from contextvars import ContextVar
from itertools import pairwise

_OUT = os.environ.get("MLX_ADMISSION_PROBE_OUT")
_ORDER = ("arrived", "submitted", "taken", "begun", "text", "loop", "written")


class _Marks:
    """Each request's marks until its first frame (or its end), then its line."""

    def __init__(self, out: str) -> None:
        self.marks: dict[str, dict[str, float]] = {}
        self.out = out
        self.sink = None  # opened at the first line: a process that serves nothing (the
        # load generator, a probe, the engine harness) leaves no empty file behind

    def mark(self, request_id: str, key: str) -> None:
        import time

        self.marks.setdefault(request_id, {}).setdefault(key, time.monotonic())

    def mark_if(self, request_id: str, key: str, after: str) -> bool:
        """Mark ``key`` once ``after`` is marked (a first text, a hand-out); True if so."""
        t = self.marks.get(request_id)
        if t is None or after not in t or key in t:
            return False
        self.mark(request_id, key)
        return True

    def write(self, request_id: str) -> None:
        """The request's line, once, if its first text was reached."""
        t = self.marks.pop(request_id, None)
        if t is None or "text" not in t or "wall" not in t:
            return
        spans = [t[b] - t[a] if a in t and b in t else float("nan")
                 for a, b in pairwise(_ORDER)]
        if self.sink is None:
            self.sink = open(f"{self.out}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115
        self.sink.write(" ".join(f"{s * 1e3:.3f}" for s in spans) + f" {t['wall']:.3f}\n")


# When the HTTP request being handled entered the application: the route's task, and so
# its submission, sees the value set as the request came in.
_ARRIVED: ContextVar[float | None] = ContextVar("admission_probe_arrived", default=None)


def _engine_hooks(probe: _Marks) -> list[tuple[type, str, object]]:
    """Marks from the submission to the hand-out on the event loop: (owner, name, hook)."""
    import time

    from mlx_serve import engine, engine_step, open_requests
    from mlx_serve.runner import token_text

    submit, take = engine.Engine.submit, open_requests.OpenRequests.open
    begin, make_delta = engine_step.EngineStep._begin, token_text._delta
    deliver, finish = engine.Engine._deliver, engine.Engine._finish

    def submitted(self, *requests, **kwargs):
        arrived = _ARRIVED.get()
        for r in requests:
            if arrived is not None:
                probe.marks.setdefault(r.request_id, {})["arrived"] = arrived
            probe.mark(r.request_id, "submitted")
            probe.marks[r.request_id].setdefault("wall", time.time())
        return submit(self, *requests, **kwargs)

    def taken(self, entry, draining):
        probe.mark(entry.request.request_id, "taken")
        return take(self, entry, draining)

    def begun(self):
        admissions = begin(self)
        for r in admissions:
            probe.mark(r.request_id, "begun")
        return admissions

    def advanced(record, ended):
        delta = make_delta(record, ended)
        if delta.text:
            probe.mark_if(record.live.request.request_id, "text", "begun")
        return delta

    def delivered(self, deltas):
        for rid, _ in deltas:
            probe.mark_if(rid, "loop", "text")
        return deliver(self, deltas)

    def finished(self, rid, event):
        probe.mark_if(rid, "loop", "text")  # a first text that also ends the request
        probe.write(rid)
        return finish(self, rid, event)

    return [(engine.Engine, "submit", submitted),
            (open_requests.OpenRequests, "open", taken),
            (engine_step.EngineStep, "_begin", begun),
            (token_text, "_delta", advanced),
            (engine.Engine, "_deliver", delivered),
            (engine.Engine, "_finish", finished)]


def _http_hooks(probe: _Marks) -> list[tuple[type, str, object]]:
    """Marks at the request's entry to the application and at its first frame."""
    import time

    from starlette.applications import Starlette

    from mlx_serve import streaming

    enter = Starlette.__call__
    stream_response = streaming.SSEResponse.stream_response

    async def entered(self, scope, receive, send):
        if scope["type"] == "http":
            _ARRIVED.set(time.monotonic())
        return await enter(self, scope, receive, send)

    async def streamed(self, send):
        # The engine's ids of this reply's choices are the reply's id and "-<index>",
        # all submitted before the stream starts; a copy made in one go, as the MLX
        # thread may add marks meanwhile.
        prefix = self.headers.get("x-request-id", "") + "-"
        pending = [rid for rid in list(probe.marks) if rid.startswith(prefix)]

        async def first_frame_marked(message):
            nonlocal pending
            await send(message)
            if pending and message["type"] == "http.response.body":
                # The choices whose first text this frame carried are written once.
                written = [rid for rid in pending if probe.mark_if(rid, "written", "loop")]
                for rid in written:
                    probe.write(rid)
                pending = [] if written else pending

        return await stream_response(self, first_frame_marked)

    return [(Starlette, "__call__", entered),
            (streaming.SSEResponse, "stream_response", streamed)]


def _install(out: str) -> None:
    probe = _Marks(out)
    hooks = _http_hooks(probe) + _engine_hooks(probe)  # all built before any is set
    for owner, name, hook in hooks:
        setattr(owner, name, hook)


def serves(argv: list[str]) -> bool:
    """Whether the command line ``argv`` (``sys.orig_argv``) runs mlx_serve's server."""
    words = [os.path.basename(a) for a in argv[1:]]
    if "-m" in words[:-1]:
        words = words[words.index("-m") + 1:]
    else:  # the interpreter's own options, then the script
        words = words[next((i for i, w in enumerate(words) if not w.startswith("-")),
                           len(words)):]
    if not words:
        return False
    if words[0] in ("mlx_serve", "mlx-serve"):
        return True
    return words[0] == "uvicorn" and any(w.startswith("mlx_serve") for w in words[1:])


if _OUT and serves(sys.orig_argv):
    try:
        _install(_OUT)
    except Exception as exc:  # a probe must never stop the server it measures
        print(f"admission probe not installed: {exc!r}", file=sys.stderr)
