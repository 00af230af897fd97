"""/health latency while a server makes one large whole (non-streamed) reply.

A reply of n choices of max_tokens tokens, each with top_logprobs alternatives (16 x
2,000 x 20 is 42 MB of JSON), is built and encoded after its last token. A server that
does that on its event loop keeps every probe and every other stream waiting meanwhile.
The probe polls ``/health`` from its own process (``health_probe``) from before the
request is sent until its reply has been read.

    python -m benchmarks.large_reply --base-url http://127.0.0.1:8000 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import httpx

from benchmarks.health_probe import HealthProbe
from benchmarks.metrics import percentiles


def one_round(base_url: str, n: int, max_tokens: int, top_logprobs: int,
              interval: float) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": "hi"}], "n": n,
            "max_tokens": max_tokens, "ignore_eos": True, "logprobs": True,
            "top_logprobs": top_logprobs}
    probe = HealthProbe(base_url, interval)
    probe.start()
    began = time.perf_counter()
    try:
        reply = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=900.0)
    finally:
        samples = probe.stop()
    latencies = [s for s, _ in samples]
    return {"status": reply.status_code, "reply_bytes": len(reply.content),
            "seconds": round(time.perf_counter() - began, 3), "probes": len(samples),
            "failed_probes": sum(not ok for _, ok in samples),
            "probe_max_ms": round(max(latencies, default=0.0) * 1000, 1),
            "probes_over_50_ms": sum(s > 0.05 for s in latencies),
            "probe_ms": percentiles(latencies)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--top-logprobs", type=int, default=20)
    parser.add_argument("--probe-interval", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help="write the rounds as JSON here")
    args = parser.parse_args(argv)
    rounds = [one_round(args.base_url, args.n, args.max_tokens, args.top_logprobs,
                        args.probe_interval) for _ in range(args.rounds)]
    print("| round | status | reply MB | s | probes | /health max ms | p99 ms | over 50 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rounds):
        print(f"| {i} | {r['status']} | {r['reply_bytes'] / 1e6:.1f} | {r['seconds']:.1f} | "
              f"{r['probes']} | {r['probe_max_ms']} | {r['probe_ms']['p99']} | "
              f"{r['probes_over_50_ms']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"argv": sys.argv, "rounds": rounds}, f, indent=1)
    return 0 if all(r["status"] == 200 for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
