"""Where a request's time to first token goes inside mlx_serve, request by request.

Put this folder first on ``PYTHONPATH`` and set ``MLX_ADMISSION_PROBE_OUT=PATH``: the
server then appends one line per request to ``PATH.<pid>`` when the request's first
text leaves the runner: three spans in milliseconds, then when the request was submitted
(epoch seconds, so that ``--runs`` can match it to a measured run):

1. submitted to the engine -> taken from its inbox by the actor;
2. taken -> the batch step that admits it begins on the MLX thread;
3. that step begins -> the runner has the request's first text (prefill, the steps to
   the first token, and any token the detokenizer held back).

The client's TTFT adds what comes before the submission (HTTP, parsing, tokenizing) and
after (the event loop's fan-out, SSE). ``python -m benchmarks.admission_report PATH.*``
prints percentiles. Each hook costs a dictionary write; the line is written once per
request.
"""

import os

_OUT = os.environ.get("MLX_ADMISSION_PROBE_OUT")


class _Marks:
    """Each request's marks until its first text, then its line in the sink."""

    def __init__(self, out: str) -> None:
        self.marks: dict[str, dict[str, float]] = {}
        self.written: set[str] = set()
        self.out = out
        self.sink = None  # opened at the first line: a process that serves nothing (the
        # load generator, a probe, the engine harness) leaves no empty file behind

    def mark(self, request_id: str, key: str) -> None:
        import time

        self.marks.setdefault(request_id, {}).setdefault(key, time.monotonic())

    def first_text(self, request_id: str) -> None:
        """Write the request's spans once: at its first text."""
        import time

        if request_id in self.written:
            return
        self.written.add(request_id)
        t = self.marks.pop(request_id, {})
        if len(t) == 4:
            spans = (t["taken"] - t["submitted"], t["begun"] - t["taken"],
                     time.monotonic() - t["begun"])
            if self.sink is None:
                self.sink = open(f"{self.out}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115
            self.sink.write(" ".join(f"{s * 1e3:.3f}" for s in spans) + f" {t['wall']:.3f}\n")


def _install(out: str) -> None:
    import time

    from mlx_serve import engine, engine_step, open_requests
    from mlx_serve.runner import batch

    probe = _Marks(out)
    submit, take = engine.Engine.submit, open_requests.OpenRequests.open
    run, advance = engine_step.EngineStep.run, batch.Runner._advance

    def submitted(self, *requests, **kwargs):
        for r in requests:
            probe.mark(r.request_id, "submitted")
            probe.marks[r.request_id].setdefault("wall", time.time())
        return submit(self, *requests, **kwargs)

    def taken(self, entry, draining):
        probe.mark(entry.request.request_id, "taken")
        return take(self, entry, draining)

    def begun(self, runner):
        for r in list(self.admissions):
            probe.mark(r.request_id, "begun")
        return run(self, runner)

    def advanced(self, live, response):
        delta = advance(self, live, response)
        if delta.text:
            probe.first_text(live.request.request_id)
        return delta

    engine.Engine.submit = submitted
    open_requests.OpenRequests.open = taken
    engine_step.EngineStep.run = begun
    batch.Runner._advance = advanced


if _OUT:
    try:
        _install(_OUT)
    except Exception as exc:  # a probe must never stop the server it measures
        import sys

        print(f"admission probe not installed: {exc!r}", file=sys.stderr)
