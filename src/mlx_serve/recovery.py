"""Fault isolation policy: which requests to put into the next batch after a step fails.

Pure bookkeeping, no I/O. After a failed step the whole set is replayed once (most faults
are transient). If the replay fails too, the engine is first tested on its own (a
self-test outside the batch: a broken engine ends here, every request answered 503),
then the failed set is bisected: each half is tested in a step of its own, in order,
while the other requests wait parked. A group whose step succeeds is cleared; a failing
group is split again; a request that fails alone ``max_alone_failures`` times is
isolated (the engine fails it and only it).

Probes run breadth first (both halves of a split before either is split again). A
failing probe is progress, not a sign of a broken engine: with two failing requests in
one batch both halves of a split fail, and so on down. So ``failure_streak`` counts only
failed steps of whole batches since the last good one (the first failure, its replay,
and any after a bisection); a longer streak than ``max_failed_rebuilds`` says the engine
itself is broken. Isolating the culprit restarts the streak; but
``max_failed_rebuilds`` isolations in a row with no good step between them may say the
engine is broken (every request looks guilty), or only that one client sent failing
requests one after another. The actor then runs the self-test again: if it passes,
serving goes on; the next such run of isolations before any good step is fatal.

A request also ends (worn out) once it has taken part in ``max_involvement`` failed
steps of whole batches, so that one which makes steps fail now and then cannot go on
doing so; no cause is pinned on it, so its answer says a resend may succeed. Such a
request is in every failed step, where its batch-mates miss the failed probes of the
halves without it (and the steps before they joined): once failed steps have narrowed
the suspects so, a failure is bisected at once from those suspects (then the rest, in
case of a second cause), without a replay first, and only suspects wear out, the rest
being forgiven as after an isolation. What the requests of a failed step shared
is forgiven once a culprit is isolated (the failures were its) and after
``forgive_after_good_steps`` good steps in a row (they were rare, transient faults), so
that a few poison requests in a row, or a trickle of transient step faults, do not add
up to fail every long request in the batch with them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Decision:
    """What the actor does next. ``batch`` None means: everything live, normal serving."""

    batch: frozenset[str] | None
    isolate: frozenset[str] = frozenset()
    fatal: bool = False
    self_test: bool = False  # the actor tests the engine outside the batch: fatal if it fails
    # Of ``isolate``: ended for taking part in too many failed steps, not found the cause.
    worn_out: frozenset[str] = frozenset()


@dataclass
class Isolation:
    max_failed_rebuilds: int = 3
    max_alone_failures: int = 2
    # Failed steps of whole batches a request may take part in, good steps between them
    # or not: a request that makes every other step fail cannot go on for long. Two
    # things forgive what the requests in a failed step shared: isolating a culprit (it
    # explains them), and this many good steps in a row (the faults before were rare,
    # transient ones, which must not add up over a long reply to fail it).
    max_involvement: int = 8
    forgive_after_good_steps: int = 16
    failure_streak: int = 0
    isolations_in_a_row: int = 0  # isolations with no good step between them
    self_tested: bool = False  # a self-test has passed since the last good step
    _replayed: bool = False
    _probing: frozenset[str] | None = None
    _pending: list[frozenset[str]] = field(default_factory=list)
    _alone_failures: dict[str, int] = field(default_factory=dict)
    _involvement: dict[str, int] = field(default_factory=dict)
    # The requests in every failed step, probes too, since ``_involvement`` began
    # counting: the suspects when someone wears out (None: no failed step yet).
    _in_every_failure: frozenset[str] | None = None
    _good_steps: int = 0  # good steps in a row since the last failed one

    @property
    def recovering(self) -> bool:
        return self.failure_streak > 0 or self._probing is not None or bool(self._pending)

    def on_failure(self, in_step: Collection[str]) -> Decision:
        """The step over ``in_step`` raised. Decide the next batch."""
        probing = self._probing is not None
        if self._good_steps >= self.forgive_after_good_steps:
            self._forgive()
        self._good_steps = 0
        if not probing:  # a whole batch failed
            self.failure_streak += 1
            if self.failure_streak > self.max_failed_rebuilds:
                return Decision(batch=None, fatal=True)
        group = frozenset(in_step)
        common = self._in_every_failure  # who can have caused every failure so far
        self._in_every_failure = group if common is None else common & group
        # Only whole batches failing wear requests out. A failed probe is the
        # bisection's evidence, bounded by its depth: counted, a bisection of a large
        # batch (7 levels for 128) wore out the culprit and its neighbours before the
        # culprit could fail alone.
        if not probing and (worn_out := self._wear(group)):
            self.failure_streak = 0
            return replace(self._next(worn_out), worn_out=worn_out)
        if not probing and not self._replayed and not self._suspects_narrowed(group):
            self._replayed = True  # first, assume a transient fault: replay everything
            return Decision(batch=None)
        isolate: frozenset[str] = frozenset()
        if len(group) == 1:
            (rid,) = group
            self._alone_failures[rid] = self._alone_failures.get(rid, 0) + 1
            if self._alone_failures[rid] >= self.max_alone_failures:
                isolate = group
                self._forgive()  # the failed steps the others shared are its
                # Finding the culprit is progress: the streak starts again. But if every
                # request we try turns out to be a "culprit", the engine is what's broken.
                self.failure_streak = 0
                self.isolations_in_a_row += 1
                if self.isolations_in_a_row >= self.max_failed_rebuilds:
                    if self.self_tested:
                        return Decision(batch=None, isolate=isolate, fatal=True)
                    self.self_tested, self.isolations_in_a_row = True, 0
                    return replace(self._next(isolate), self_test=True)
            else:
                self._pending.append(group)
        elif group:
            # Breadth first: a failing group's parts go to the back of the queue, so
            # the groups already waiting (often healthy) get their probe step first.
            self._pending += self._parts(group)
        decision = self._next(isolate)
        if not probing:  # the batch failed again: the engine's own test before bisecting
            decision = replace(decision, self_test=True)
        return decision

    def on_success(self, in_step: Collection[str]) -> Decision | None:
        """A step succeeded. Returns a new batch decision, or None to keep going as is."""
        self.failure_streak = 0
        self.isolations_in_a_row = 0
        self.self_tested = False
        if in_step:
            self._good_steps += 1
        if self._probing is None and not self._pending:
            self._replayed = False
            return None
        return self._next(frozenset())

    def reset(self) -> None:
        """Forget a recovery that has no request left in it: a clean slate."""
        self.failure_streak = self.isolations_in_a_row = self._good_steps = 0
        self._replayed, self._probing = False, None
        self._pending.clear()
        self._alone_failures.clear()
        self._forgive()

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests that ended (finished, cancelled) leave every pending group."""
        gone = set(request_ids)
        self._pending = [g - gone for g in self._pending if g - gone]
        for rid in gone:
            self._alone_failures.pop(rid, None)
            self._involvement.pop(rid, None)
        if self._in_every_failure is not None:
            # Emptied, it would suspect no one at the next wear-out: start it again.
            self._in_every_failure = (self._in_every_failure - gone) or None

    def _wear(self, group: frozenset[str]) -> frozenset[str]:
        """Count a failed whole batch against its requests; those now worn out.

        Of those at the cap, the ones in every failed step so far, where that is fewer
        of them: a request missing from a failed step did not cause it (one cause
        assumed), and the others' share of the failures is forgiven. With no such
        narrowing (failures of whole batches only, or two causes), all at the cap."""
        for rid in group:
            self._involvement[rid] = self._involvement.get(rid, 0) + 1
        worn = frozenset(r for r in group if self._involvement[r] >= self.max_involvement)
        suspects = worn & (self._in_every_failure or frozenset())
        if not worn or not suspects or suspects == worn:
            return worn
        self._forgive()
        return suspects

    def _suspects_narrowed(self, group: frozenset[str]) -> bool:
        """Whether failed steps since the count began (probes, or batches that some of
        ``group`` had not joined yet) narrowed the suspects to some of it: a request
        that makes steps fail now and then, not a transient fault, so it is bisected
        again at once, without a replay first."""
        suspects = self._in_every_failure
        return bool(suspects) and suspects != group

    def _forgive(self) -> None:
        """Forget the failed steps counted so far: who took part, who was in all."""
        self._involvement.clear()
        self._in_every_failure = None

    def _parts(self, group: frozenset[str]) -> list[frozenset[str]]:
        """A failed group's probes: its halves; or, where earlier failed steps narrowed
        the suspects to some of it, their halves first and then the rest in one probe
        (a request that fails steps only now and then is bisected from where its last
        failed probe left it, and a second cause among the rest is still found)."""
        suspects = self._in_every_failure or group
        rest = group - suspects
        ordered = sorted(suspects)
        half = len(ordered) // 2
        parts = [frozenset(ordered[:half]), frozenset(ordered[half:]), rest]
        return [part for part in parts if part]

    def _next(self, isolate: frozenset[str]) -> Decision:
        self._pending = [g - isolate for g in self._pending if g - isolate]
        if self._pending:
            self._probing = self._pending.pop(0)
            return Decision(batch=self._probing, isolate=isolate)
        self._probing = None
        self._replayed = False
        return Decision(batch=None, isolate=isolate)
