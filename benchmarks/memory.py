"""Memory mode: resident-memory drift of a server across a long run of requests.

A warm-up run settles allocator caches and the batch shapes first; RSS is read after it
("before"), sampled during the measured run, and read again at its end ("after").
Drift is ``(after - before) / before``; the goal is under 5 % across 2,000 requests.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from benchmarks.loadgen import Target, run_async, run_load
from benchmarks.servers import ServerProcess, rss_bytes
from benchmarks.workload import Workload

if TYPE_CHECKING:
    from benchmarks.ab import ABRunner

SAMPLE_INTERVAL = 0.5


async def _sample_rss(pid: int, out: list[int]) -> None:
    while True:
        out.append(rss_bytes(pid))
        await asyncio.sleep(SAMPLE_INTERVAL)


async def _measured(server: ServerProcess, target: Target, workload: Workload,
                    prompts: list[str]) -> tuple[dict[str, Any], list[int]]:
    samples: list[int] = []
    sampler = asyncio.create_task(_sample_rss(server.pid, samples))
    try:
        result = await run_load(target, workload, prompts)
    finally:
        sampler.cancel()
    return result, samples


def rss_run(server: ServerProcess, runner: ABRunner, requests: int,
            warmup: int | None = None) -> dict[str, Any]:
    """Warm up (``warmup`` requests, default a tenth), then ``requests`` requests at the
    config's largest concurrency.

    A warm-up long enough to fill the prefix cache's budget separates a leak from the
    cache growing towards its bound; /health's ``memory`` is recorded before and after.
    """
    cfg = runner.config
    conc = max(cfg.concurrencies)
    target = Target(server.base_url, cfg.api, cfg.stream, None, cfg.request_timeout)
    warm_requests = max(conc, requests // 10 if warmup is None else warmup)
    warm = Workload(cfg.prompt_tokens, cfg.output_tokens, warm_requests, conc,
                    cfg.seed + 7, None, cfg.run_time_limit * 10)
    run_async(run_load(target, warm, runner.prompts(warm)[0]))
    health_before = server.health()
    before = rss_bytes(server.pid)
    workload = Workload(cfg.prompt_tokens, cfg.output_tokens, requests, conc, cfg.seed + 8,
                        None, cfg.run_time_limit * 10)
    result, samples = run_async(_measured(server, target, workload,
                                            runner.prompts(workload)[0]))
    after = rss_bytes(server.pid)
    health_after = server.health()
    mib = 1024 * 1024
    report = {
        "requests": requests, "warmup_requests": warm_requests, "concurrency": conc,
        "memory_before": (health_before or {}).get("memory"),
        "memory_after": (health_after or {}).get("memory"),
        "completed": result["summary"]["completed"], "failed": result["summary"]["failed"],
        "rss_before_mib": round(before / mib, 1), "rss_after_mib": round(after / mib, 1),
        "rss_max_mib": round(max([*samples, before, after]) / mib, 1),
        "drift_percent": round(100.0 * (after - before) / before, 2),
        "summary": result["summary"],
    }
    print(f"RSS mlx_serve: before {report['rss_before_mib']} MiB, after "
          f"{report['rss_after_mib']} MiB, max {report['rss_max_mib']} MiB, drift "
          f"{report['drift_percent']} % over {report['completed']} requests "
          f"({report['failed']} failed)", flush=True)
    return report
