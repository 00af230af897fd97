"""Prometheus metrics for ``GET /metrics``, with prometheus-client.

Two kinds, neither of them on the per-token path:

- the engine's own figures (state, running and waiting requests, steps, recoveries,
  memory) are read from its statistics when the endpoint is scraped, as ``/health``
  reads them;
- each request's latencies, tokens and ending are observed once, when it ends, by the
  ``RequestTracker`` its route holds.

Names follow vLLM's (``vllm:time_to_first_token_seconds`` is
``mlx_serve_time_to_first_token_seconds`` here). Every server has a registry of its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from mlx_serve.engine_state import EngineState

# Seconds. Time to first token and whole requests span milliseconds (a tiny model on a
# GPU) to minutes (long prompts on a CPU); a token takes milliseconds to seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_ENGINE_COUNTERS = (  # statistics field, metric name, help
    ("steps", "mlx_serve_steps", "Batch steps the model ran."),
    ("prefill_steps", "mlx_serve_prefill_steps", "Batch steps that also processed prompts."),
    ("recoveries", "mlx_serve_recoveries", "Failed batch steps recovered from."),
    ("replays", "mlx_serve_replays", "Requests replayed into a rebuilt batch."),
    ("isolated", "mlx_serve_isolated_requests",
     "Requests failed alone as the cause of failing steps."),
    ("worn_out", "mlx_serve_worn_out_requests",
     "Requests ended after too many failed steps with no cause found."),
    ("mlx_busy", "mlx_serve_mlx_busy_seconds", "Seconds the MLX thread spent in jobs."),
)


class _EngineCollector:
    """The engine's figures, read at scrape time from its statistics and its memory."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def describe(self) -> list[Metric]:
        return []  # nothing to read before the first scrape

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.statistics()
        state = GaugeMetricFamily("mlx_serve_engine_state",
                                  "1 for the engine's current state, 0 for the others.",
                                  labels=["state"])
        for value in EngineState:
            state.add_metric([value.value], float(stats.state is value))
        yield state
        yield GaugeMetricFamily("mlx_serve_num_requests_running",
                                "Requests in the batch.", value=stats.running)
        yield GaugeMetricFamily("mlx_serve_num_requests_waiting",
                                "Requests waiting for a batch slot.", value=stats.waiting)
        for field, name, doc in _ENGINE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(stats, field))
        runner = self._engine.runner
        memory = runner.memory() if runner is not None else {}
        for key, value in memory.items():  # active, cache, peak and prefix-cache bytes
            yield GaugeMetricFamily(f"mlx_serve_memory_{key}", f"MLX memory: {key}.",
                                    value=value)


class ServerMetrics:
    """One server's registry: the engine's collector and the per-request metrics."""

    def __init__(self, engine: Any, responses: Any = None, bodies: Any = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        if bodies is not None:  # request bodies being read: read when scraped
            Gauge("mlx_serve_request_body_bytes_in_flight",
                  "Request-body bytes being read at once.",
                  registry=r).set_function(lambda: bodies.used)
        if responses is not None:  # the stored Responses: read when scraped
            Gauge("mlx_serve_responses_stored", "Responses kept for previous_response_id.",
                  registry=r).set_function(lambda: len(responses))
            Gauge("mlx_serve_responses_stored_bytes", "What the stored Responses take.",
                  registry=r).set_function(lambda: responses.nbytes)
        self.ttft = Histogram("mlx_serve_time_to_first_token_seconds",
                              "From a request's arrival to its first output.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("mlx_serve_e2e_request_latency_seconds",
                             "From a request's arrival to its end.", buckets=E2E_BUCKETS,
                             registry=r)
        self.tpot = Histogram("mlx_serve_request_time_per_output_token_seconds",
                              "A request's time per output token after the first.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("mlx_serve_prompt_tokens",
                                     "Prompt tokens of requests that ended.", registry=r)
        self.generation_tokens = Counter("mlx_serve_generation_tokens",
                                         "Generated tokens of requests that ended.",
                                         registry=r)
        self.success = Counter("mlx_serve_request_success",
                               "Choices that finished, by finish reason.",
                               ["finished_reason"], registry=r)
        self.errors = Counter("mlx_serve_request_errors",
                              "Error replies (HTTP errors and errors in a stream), by status.",
                              ["status"], registry=r)
        self.aborted = Counter("mlx_serve_request_aborted",
                               "Requests whose client left before their end.", registry=r)

    def track(self, prompt_tokens: int, arrived: float) -> RequestTracker:
        """A tracker for a request that arrived at ``arrived`` (``time.monotonic()``)."""
        return RequestTracker(self, prompt_tokens, arrived)

    def error(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition the client's Accept header asks for (Prometheus' text format
        0.0.4 without one, OpenMetrics on request), and its content type."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


class RequestTracker:
    """One request, from its arrival to its end: observed once, when it ends."""

    __slots__ = ("_metrics", "_prompt_tokens", "_start", "_first", "_ended")

    def __init__(self, metrics: ServerMetrics, prompt_tokens: int, arrived: float) -> None:
        self._metrics = metrics
        self._prompt_tokens = prompt_tokens
        self._start = arrived
        self._first: float | None = None
        self._ended = False

    def first_output(self) -> None:
        """The first output reached the client's stream (streamed requests only: a whole
        reply's events arrive together at its end)."""
        if self._first is None:
            self._first = time.monotonic()

    def end(self, finishes: Iterable[str | None], tokens: int, error_status: int | None
            ) -> None:
        """``finishes``: each choice's finish reason (None: unfinished); ``tokens``:
        generated in all; ``error_status``: the status of an error the reply carried."""
        if self._ended:
            return
        now = self._observe(tokens)
        m = self._metrics
        unfinished = False
        for finish in finishes:
            if finish is None:
                unfinished = True
            else:
                m.success.labels(finish).inc()
        if error_status is not None:
            m.error(error_status)
        elif unfinished:
            m.aborted.inc()
        if self._first is not None and error_status is None:
            m.ttft.observe(self._first - self._start)
            if tokens > 1:
                m.tpot.observe((now - self._first) / (tokens - 1))

    def failed(self, tokens: int = 0) -> None:
        """A failure that becomes the request's HTTP error (counted as an error where the
        response is made): its time and its tokens, as every other ending's."""
        if not self._ended:
            self._observe(tokens)

    def _observe(self, tokens: int) -> float:
        """What every ending adds, once: tokens and time from arrival; returns now."""
        self._ended = True
        m, now = self._metrics, time.monotonic()
        m.prompt_tokens.inc(self._prompt_tokens)
        m.generation_tokens.inc(tokens)
        m.e2e.observe(now - self._start)
        return now
