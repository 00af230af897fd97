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


def rss_run(server: ServerProcess, runner: ABRunner, requests: int) -> dict[str, Any]:
    """Warm up, then ``requests`` requests at the config's largest concurrency."""
    cfg = runner.config
    conc = max(cfg.concurrencies)
    target = Target(server.base_url, cfg.api, cfg.stream, None, cfg.request_timeout)
    warm = Workload(cfg.prompt_tokens, cfg.output_tokens, max(conc, requests // 10), conc,
                    cfg.seed + 7, None, cfg.run_time_limit * 10)
    run_async(run_load(target, warm, runner.prompts(warm)[0]))
    before = rss_bytes(server.pid)
    workload = Workload(cfg.prompt_tokens, cfg.output_tokens, requests, conc, cfg.seed + 8,
                        None, cfg.run_time_limit * 10)
    result, samples = run_async(_measured(server, target, workload,
                                            runner.prompts(workload)[0]))
    after = rss_bytes(server.pid)
    mib = 1024 * 1024
    report = {
        "requests": requests, "concurrency": conc,
        "completed": result["summary"]["completed"], "failed": result["summary"]["failed"],
        "rss_before_mib": round(before / mib, 1), "rss_after_mib": round(after / mib, 1),
        "rss_max_mib": round(max(samples, default=after) / mib, 1),
        "drift_percent": round(100.0 * (after - before) / before, 2),
        "summary": result["summary"],
    }
    print(f"RSS mlx_serve: before {report['rss_before_mib']} MiB, after "
          f"{report['rss_after_mib']} MiB, max {report['rss_max_mib']} MiB, drift "
          f"{report['drift_percent']} % over {report['completed']} requests "
          f"({report['failed']} failed)", flush=True)
    return report
