"""The isolation policy on its own: which requests go into the next batch after faults."""

import random

import pytest

from mlx_serve.recovery import Decision, Isolation

ALL = {"a", "b", "c", "d"}


def test_a_single_failure_replays_everything():
    iso = Isolation(max_failed_rebuilds=3)
    decision = iso.on_failure(ALL)
    assert decision.batch is None and not decision.fatal and not decision.isolate
    assert iso.on_success(ALL) is None
    assert not iso.recovering


def drive(iso: Isolation, live: set[str], fails, until: str, limit: int = 400,
          finish_after_one_step: bool = False) -> tuple[set[str], set[str]]:
    """Follow the policy's decisions, step by step, until ``until`` has ended and the
    recovery is over; ``fails(members)`` says whether a step over those fails. Returns
    the requests ended, and those of them worn out. ``finish_after_one_step``: each
    request other than ``until`` finishes after its first good step, and a new one
    takes its place."""
    ended: set[str] = set()
    worn: set[str] = set()
    batch: frozenset[str] | None = None
    fresh = iter(range(10**6))
    for _ in range(limit):
        members = set(batch) if batch is not None else live - ended
        failed = fails(members)
        decision = iso.on_failure(members) if failed else iso.on_success(members)
        if not failed and finish_after_one_step:
            done = members - {until}
            iso.forget(done)
            live = (live - done) | {f"new{next(fresh)}" for _ in done}
            batch = None if batch is None else frozenset(batch - done) or None
        if decision is not None:
            assert not decision.fatal
            ended |= decision.isolate
            worn |= decision.worn_out
            batch = decision.batch
        if until in ended and batch is None and not iso.recovering:
            return ended, worn
    raise AssertionError("the policy did not settle")


def run_until_settled(iso: Isolation, live: set[str], poison: str, limit: int = 40):
    """Simulate steps where any batch holding ``poison`` fails; return isolated ids."""
    ended, worn = drive(iso, live, lambda members: poison in members, until=poison,
                        limit=limit)
    assert not worn  # a poison is found, not worn out
    return ended


def test_bisection_isolates_exactly_the_poison_request():
    live = {f"r{i}" for i in range(8)}
    iso = Isolation(max_failed_rebuilds=3, max_alone_failures=2)
    assert run_until_settled(iso, live, poison="r5") == {"r5"}
    assert iso.failure_streak == 0


def test_failure_streak_never_reaches_fatal_for_one_poison_in_a_large_batch():
    live = {f"r{i:03d}" for i in range(128)}
    for poison in ("r000", "r017", "r127"):
        iso = Isolation(max_failed_rebuilds=3, max_alone_failures=2)
        assert run_until_settled(iso, set(live), poison=poison, limit=60) == {poison}


def test_whole_batches_failing_are_fatal_after_the_rebuild_budget():
    iso = Isolation(max_failed_rebuilds=3)
    first, replay = iso.on_failure(ALL), iso.on_failure(ALL)
    assert first == Decision(batch=None)  # replay everything
    # The replay failed: test the engine itself, then bisect.
    assert replay.self_test and replay.batch is not None and not replay.fatal
    iso.reset()  # (the probes' requests ended)
    iso.failure_streak = 3
    assert iso.on_failure(ALL).fatal  # a fourth whole batch failing in a row


def test_every_step_failing_ends_in_isolations_then_fatal_within_bounded_steps():
    live = {f"r{i}" for i in range(8)}
    iso = Isolation(max_failed_rebuilds=3, max_alone_failures=2)
    isolated: set[str] = set()
    batch: frozenset[str] | None = None
    self_tests = 0
    steps = 0
    while steps < 100:
        steps += 1
        decision = iso.on_failure(set(batch) if batch is not None else live - isolated)
        self_tests += decision.self_test
        isolated |= decision.isolate
        if decision.fatal:
            break
        batch = decision.batch
    assert decision.fatal and steps < 40, steps
    assert len(isolated) == 6  # two runs of 3 isolations, a self-test after the first
    assert self_tests == 2  # before bisecting, and after the first run of isolations


def test_two_failing_requests_in_one_batch_are_both_isolated_and_the_rest_served():
    live = {f"r{i}" for i in range(4)}
    iso = Isolation(max_failed_rebuilds=3, max_alone_failures=2)
    isolated: set[str] = set()
    batch: frozenset[str] | None = None
    for _ in range(40):
        members = set(batch) if batch is not None else live - isolated
        if members & {"r0", "r3"}:  # one in each half of the first split
            decision = iso.on_failure(members)
        else:
            decision = iso.on_success(members)
            if decision is None and not iso.recovering:
                break
        if decision is not None:
            assert not decision.fatal
            assert not decision.worn_out  # a poison is found, not worn out
            isolated |= decision.isolate
            batch = decision.batch
    assert isolated == {"r0", "r3"}


def test_finished_requests_leave_pending_groups():
    iso = Isolation(max_failed_rebuilds=5)
    iso.on_failure(ALL)
    first = iso.on_failure(ALL)  # the replay failed too: bisect
    assert first.batch is not None and first.batch < ALL
    iso.forget(ALL - first.batch)
    assert iso.on_success(first.batch).batch is None  # nothing else left to probe


def test_isolating_the_culprit_restarts_the_streak_but_endless_culprits_are_fatal():
    iso = Isolation(max_failed_rebuilds=3, max_alone_failures=2)
    outcomes = []
    for rid in ("p1", "p2", "p3", "p4", "p5", "p6"):  # one at a time, every step failing
        first, replay, last = (iso.on_failure({rid}) for _ in range(3))
        assert replay.self_test and not (first.self_test or first.fatal or replay.fatal)
        outcomes.append((set(last.isolate), last.self_test, last.fatal))
        if last.fatal:
            break
    # The third isolation in a row asks for a self-test (which passed: serving went
    # on); the next three, still with no good step between them, are fatal.
    assert outcomes == [({"p1"}, False, False), ({"p2"}, False, False),
                        ({"p3"}, True, False), ({"p4"}, False, False),
                        ({"p5"}, False, False), ({"p6"}, False, True)]


def test_a_good_step_after_a_self_test_allows_the_next_one():
    iso = Isolation(max_failed_rebuilds=3, max_alone_failures=2)
    for rid in ("p1", "p2", "p3"):
        decision = [iso.on_failure({rid}) for _ in range(3)][-1]
    assert decision.self_test and not decision.fatal
    assert iso.on_success({"healthy"}) is None
    for rid in ("p4", "p5", "p6"):
        decision = [iso.on_failure({rid}) for _ in range(3)][-1]
    assert decision.self_test and not decision.fatal


def test_a_good_step_forgives_earlier_isolations():
    iso = Isolation(max_failed_rebuilds=3, max_alone_failures=2)
    for rid in ("p1", "p2"):
        for _ in range(3):
            iso.on_failure({rid})
        assert iso.on_success({"healthy"}) is None
    assert iso.isolations_in_a_row == 0


def fails_every_other_step_it_joins(rid: str):
    joined = 0

    def fails(members: set[str]) -> bool:
        nonlocal joined
        if rid not in members:
            return False
        joined += 1
        return joined % 2 == 1
    return fails


def fails_at_random(rid: str, rate: float, seed: int):
    rng = random.Random(seed)
    return lambda members: rid in members and rng.random() < rate


def test_a_request_in_too_many_failed_steps_is_isolated_even_with_good_steps_between():
    # "flaky" stays; short healthy requests come and go, one step each.
    iso = Isolation(max_failed_rebuilds=3, max_involvement=8)
    ended, worn = drive(iso, {"flaky", "h"}, fails_every_other_step_it_joins("flaky"),
                        until="flaky", limit=60, finish_after_one_step=True)
    assert ended == worn == {"flaky"}  # ended for its failed steps, not found guilty


@pytest.mark.parametrize("batch", [8, 40, 128])
def test_a_request_that_fails_most_steps_at_random_spares_most_of_its_batch(batch):
    # Before, every request at the cap wore out with it: 52-86 % of its batch-mates
    # over these runs. Now only those in every failed step wear out, and once failed
    # probes have narrowed the suspects a failure is bisected from there at once.
    innocents = {f"r{i:03d}" for i in range(batch)}
    lost = 0
    for seed in range(20):
        ended, _ = drive(Isolation(), innocents | {"flaky"},
                         fails_at_random("flaky", 0.7, seed), until="flaky")
        assert "flaky" in ended
        lost += len(ended - {"flaky"})
    assert lost <= 0.2 * 20 * batch


def test_a_second_cause_outside_the_narrowed_suspects_is_still_found():
    live = {f"r{i}" for i in range(8)}
    iso = Isolation(max_failed_rebuilds=3, max_alone_failures=2)
    iso.on_failure(live)  # a transient fault: replay
    first_probe = iso.on_failure(live).batch  # it came back: bisect
    assert first_probe is not None
    iso.on_failure(first_probe)  # and once more, in a probe: the suspects narrow to it
    assert "r7" not in first_probe
    # From now on a request outside those suspects fails every step it is in.
    ended, worn = drive(iso, live, lambda members: "r7" in members, until="r7")
    assert ended == {"r7"} and not worn  # found, not worn out; no one else ended


@pytest.mark.parametrize("batch", [8, 40, 128])
def test_innocents_outlive_poison_requests_sent_one_after_another(batch):
    # Each poison's failed steps and probes took the innocent requests along; before,
    # they added up over the poisons until the third or fourth failed every innocent.
    # In a large batch the poison and its neighbours take part in more failed steps than
    # the cap on the way down the bisection: still only the poison ends, found the cause
    # (run_until_settled checks).
    innocents = {f"r{i}" for i in range(batch)}
    iso = Isolation(max_failed_rebuilds=3, max_alone_failures=2, max_involvement=8)
    for k in range(6):
        poison = f"p{k}"
        assert run_until_settled(iso, innocents | {poison}, poison=poison) == {poison}
        iso.forget([poison])


def test_rare_transient_failures_do_not_add_up_over_a_long_reply():
    iso = Isolation(max_failed_rebuilds=3, max_involvement=8, forgive_after_good_steps=16)
    for _ in range(20):  # a failed step every 50, each replayed with success
        for _ in range(50):
            assert iso.on_success(ALL) is None
        decision = iso.on_failure(ALL)
        assert decision == Decision(batch=None)  # replay everything, fail nobody
        iso.on_success(ALL)
    # Failing every other step is no transient fault: still bounded.
    isolated: set[str] = set()
    for _ in range(8):
        isolated |= iso.on_failure(ALL).isolate
        iso.on_success(ALL)
    assert isolated == ALL


def test_a_reset_recovery_treats_the_next_failure_as_a_first_one():
    iso = Isolation(max_failed_rebuilds=3)
    iso.on_failure({"a", "b", "c"})  # replay
    iso.on_failure({"a", "b", "c"})  # bisect: probing
    assert iso.recovering
    iso.reset()  # its requests all ended
    assert not iso.recovering
    assert iso.on_failure({"d"}) == Decision(batch=None)  # a fresh replay, not a probe
    assert iso.failure_streak == 1
