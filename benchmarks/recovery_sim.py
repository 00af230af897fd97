"""The fault-isolation policy against seeded faults: who ends, and how the engine fares.

No model and no engine: ``mlx_serve.recovery.Isolation`` decides each next batch, and a
fault model says whether a step over those requests fails. Two models:

- ``request``: one request (``flaky``) makes each step it joins fail with chance P;
  every other request is innocent. Reported: the innocents ended with it (the share of
  all innocents over the runs), and whether it was found the cause or wore out.
- ``engine``: every step fails with chance P whoever is in it, and so does the engine's
  self-test. Reported: runs that ended with the engine declared failed, requests
  wrongly found the cause, requests worn out.

Requests never finish on their own here (as a long reply would not, within the
steps simulated), so every figure is what the policy alone does.

    python -m benchmarks.recovery_sim [--batches 8,40,128] [--rates 0.3,0.5,0.7] \\
        [--runs 200] [--json out.json]

To set two versions of the policy side by side, run it once with each on ``PYTHONPATH``
(``PYTHONPATH=OLD/src python -m benchmarks.recovery_sim``).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from mlx_serve.recovery import Isolation

FLAKY = "flaky"


@dataclass
class Outcome:
    """One run: who ended, how, and whether the engine was declared failed."""

    ended: set[str]
    worn: set[str]
    fatal: bool
    steps: int


def simulate(members_at_start: set[str], step_fails: Callable[[set[str]], bool],
             self_test_fails: Callable[[], bool], until: Callable[[set[str]], bool],
             limit: int = 400) -> Outcome:
    """Follow the policy's decisions until ``until(ended)`` holds with the recovery
    over, the engine is declared failed, or ``limit`` steps have run."""
    iso = Isolation()
    ended: set[str] = set()
    worn: set[str] = set()
    batch: frozenset[str] | None = None
    for step in range(1, limit + 1):
        members = set(batch) if batch is not None else members_at_start - ended
        if not members:
            return Outcome(ended, worn, False, step)
        failed = step_fails(members)
        decision = iso.on_failure(members) if failed else iso.on_success(members)
        if decision is not None:
            if decision.fatal or (decision.self_test and self_test_fails()):
                return Outcome(ended, worn, True, step)
            ended |= decision.isolate
            worn |= decision.worn_out
            batch = decision.batch
        if until(ended) and batch is None and not iso.recovering:
            return Outcome(ended, worn, False, step)
    return Outcome(ended, worn, False, limit)


def chance(rate: float, seed: int) -> Callable[[], bool]:
    """True with chance ``rate`` at each call, from its own seeded generator."""
    rng = random.Random(seed)
    return lambda: rng.random() < rate


def fails_when_in(rid: str, fires: Callable[[], bool]) -> Callable[[set[str]], bool]:
    return lambda members: rid in members and fires()


def flaky_request(batch: int, rate: float, runs: int) -> dict[str, float]:
    innocents = {f"r{i:03d}" for i in range(batch)}
    lost = found = worn_out = 0
    for seed in range(runs):
        out = simulate(innocents | {FLAKY}, fails_when_in(FLAKY, chance(rate, seed)),
                       lambda: False, lambda ended: FLAKY in ended)
        lost += len(out.ended - {FLAKY})
        found += FLAKY in out.ended - out.worn
        worn_out += FLAKY in out.worn
    return {"innocents_lost_share": lost / (runs * batch), "culprit_found": found / runs,
            "culprit_worn_out": worn_out / runs}


def flaky_engine(batch: int, rate: float, runs: int) -> dict[str, float]:
    fatal = blamed = worn = 0
    everyone = {f"r{i:03d}" for i in range(batch)}
    for seed in range(runs):
        fires = chance(rate, seed)  # steps and self-tests draw from one sequence
        out = simulate(everyone, lambda _, fires=fires: fires(), fires,
                       lambda ended: len(ended) == batch)
        fatal += out.fatal
        blamed += len(out.ended - out.worn)
        worn += len(out.worn)
    return {"engine_failed": fatal / runs, "wrongly_found_cause": blamed / (runs * batch),
            "worn_out": worn / (runs * batch)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")],
                   default=[8, 40, 128])
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.3, 0.5, 0.7])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = []
    print("| model | batch | P | figures over the runs |\n|---|---|---|---|")
    for model, fn in (("request", flaky_request), ("engine", flaky_engine)):
        for batch in args.batches:
            for rate in args.rates:
                figures = fn(batch, rate, args.runs)
                rows.append({"model": model, "batch": batch, "rate": rate, **figures})
                text = ", ".join(f"{k} {v:.1%}" for k, v in figures.items())
                print(f"| {model} | {batch} | {rate} | {text} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": args.runs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
