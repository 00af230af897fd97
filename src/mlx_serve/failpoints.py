"""Named fault-injection sites for black-box fault tests and incident reproduction.

A site is a plain string (``engine.step``, ``sse.send``, ...). Code at a site calls
``points.check(site)`` (worker thread) or ``await points.acheck(site)`` (event loop); an
unconfigured site costs one ``dict.get``. Configuration comes from ``MLX_SERVE_FAILPOINTS``
or, at runtime, from ``set``/``clear``.

Grammar::

    spec    := entry (";" entry)*               empty entries are ignored
    entry   := site ["[user=" NAME "]"] "=" action
    action  := term ("->" term)*                 terms run in order
    term    := [P "%"] [N "*"] task
    task    := "off"                             do nothing
             | "hang"                            block until cleared or released
             | "sleep(" MS ")"                   sleep MS milliseconds (float)
             | "raise(" TYPE [":" MESSAGE] ")"   raise builtins.TYPE(MESSAGE)

- ``N*`` makes a term apply to N evaluations, then the next term takes over; after the
  last counted term the chain is exhausted and the site does nothing. A term without N
  applies forever, so only the last term may omit it.
- ``P%`` (0-100, float) is the chance that the task fires on an evaluation; evaluations
  that do not fire still count toward N.
- ``[user=NAME]`` fires only when the caller passes NAME among the step's users; an
  evaluation without NAME does not count toward N.
- Splitting on ``;`` and ``->`` ignores text inside parentheses, so a MESSAGE may contain
  ``;``, ``->``, ``:``, ``[``, ``]`` and balanced parentheses.

Example: ``engine.step=3*off->1*raise(RuntimeError:[metal::malloc] Resource limit
(499000) exceeded)`` lets three steps pass, fails the fourth, then stays quiet.
"""

from __future__ import annotations

import builtins
import logging
import math
import os
import random
import re
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from itertools import accumulate

import anyio

ENV_VAR = "MLX_SERVE_FAILPOINTS"
KNOWN_SITES = ("startup.load", "engine.admit", "engine.step", "engine.detokenize",
               "engine.self_test", "sse.send")
TASKS = ("off", "raise", "sleep", "hang")

# acheck's hang polls a threading.Event: release/clear may come from any thread, and an
# anyio.Event can only be set from its own loop. Latency on release is irrelevant here.
_HANG_POLL_S = 0.02

_TERM_RE = re.compile(
    r"(?:(?P<p>[^%*()]*)%)?(?:(?P<n>[^%*()]*)\*)?(?P<task>[A-Za-z_]\w*)(?:\((?P<arg>.*)\))?",
    re.DOTALL,
)
# The site ends at the first '=' outside "[user=NAME]"; '(' means we are past it already.
_ENTRY_RE = re.compile(r"([^=\[(]*(?:\[[^\]]*\])?)=(.*)", re.DOTALL)
_SITE_RE = re.compile(r"(?P<name>[\w.\-]+)(?:\[(?P<key>[^=\]]*)=(?P<value>[^\]]*)\])?")

logger = logging.getLogger(__name__)


class FailPointSpecError(ValueError):
    """A fail point spec, action or site name is malformed; the message names the bad part."""


@dataclass(frozen=True, slots=True)
class Term:
    task: str  # one of TASKS
    count: int | None = None  # None: applies forever
    probability: float | None = None  # percent; None: always fires
    exc_type: type[Exception] | None = None  # raise only
    message: str | None = None  # raise only; None: a default naming the site
    seconds: float = 0.0  # sleep only


@dataclass(frozen=True, slots=True)
class Action:
    terms: tuple[Term, ...]
    text: str  # as written (stripped), echoed back by describe()


def _split_top(text: str, sep: str) -> list[str]:
    """Split on ``sep`` outside parentheses, so messages may contain ``;`` and ``->``."""
    parts: list[str] = []
    depth = start = i = 0
    while i < len(text):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth < 0:
                raise FailPointSpecError(f"unbalanced ')' at offset {i} in {text!r}")
        elif depth == 0 and text.startswith(sep, i):
            parts.append(text[start:i])
            i = start = i + len(sep)
            continue
        i += 1
    if depth:
        raise FailPointSpecError(f"unclosed '(' in {text!r}")
    parts.append(text[start:])
    return parts


def _closes_early(arg: str) -> bool:
    """True when the running parenthesis depth dips below zero: ``1)(2``."""
    return min(accumulate((c == "(") - (c == ")") for c in arg), default=0) < 0


def _number(text: str, problem: str, high: float = math.inf) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan  # fails the range check below, with one message for both
    if not (0.0 <= value <= high and math.isfinite(value)):
        raise FailPointSpecError(f"{problem}, got {text!r}")
    return value


def _parse_raise(arg: str) -> dict:
    name, colon, message = arg.partition(":")
    name = name.strip()
    # Only builtins: a spec must never import modules or reach arbitrary attributes.
    exc_type = getattr(builtins, name, None) if name.isidentifier() else None
    if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
        raise FailPointSpecError(f"{name!r} is not a builtin exception type")
    if not issubclass(exc_type, Exception):
        # KeyboardInterrupt/SystemExit/GeneratorExit would bypass every error handler.
        raise FailPointSpecError(f"{name} is not a subclass of Exception")
    try:
        exc_type(message)  # fail now, not at the site: e.g. UnicodeDecodeError needs 5 args
    except Exception as exc:
        raise FailPointSpecError(f"{name} cannot be built from a message: {exc}") from None
    return {"exc_type": exc_type, "message": message if colon else None}


def _parse_task(task: str, arg: str | None) -> dict:
    if task not in TASKS:
        raise FailPointSpecError(f"unknown task {task!r} (expected one of {', '.join(TASKS)})")
    if task in ("off", "hang"):
        if arg is not None:
            raise FailPointSpecError(f"{task} takes no argument")
        return {}
    if arg is None:
        form = "sleep(MS)" if task == "sleep" else "raise(Type:message)"
        raise FailPointSpecError(f"{task} needs an argument: {form}")
    if task == "raise":
        return _parse_raise(arg)
    return {"seconds": _number(arg, "sleep needs milliseconds >= 0") / 1000.0}


def _parse_term(text: str) -> Term:
    match = _TERM_RE.fullmatch(text.strip())
    if match is None:
        raise FailPointSpecError("expected [P%][N*]task[(arg)]")
    p, n, task, arg = match["p"], match["n"], match["task"], match["arg"]
    if arg is not None and _closes_early(arg):
        # The regex takes everything up to the last ')': reject "sleep(1)(2)".
        raise FailPointSpecError("unexpected text after ')'")
    probability = None if p is None else _number(p, "probability must be in 0-100", 100.0)
    count = None
    if n is not None:
        count = int(n) if n.strip().isdigit() else 0
        if count < 1:
            raise FailPointSpecError(f"count must be an integer >= 1, got {n!r}")
    return Term(task, count, probability, **_parse_task(task, arg))


def parse_action(text: str) -> Action:
    """Parse ``term->term->...``; raises FailPointSpecError naming the bad term."""
    stripped = text.strip()
    if not stripped:
        raise FailPointSpecError("empty action")
    terms: list[Term] = []
    for index, piece in enumerate(_split_top(stripped, "->"), 1):
        try:
            terms.append(_parse_term(piece))
        except FailPointSpecError as exc:
            raise FailPointSpecError(f"term {index} {piece.strip()!r}: {exc}") from None
    for index, term in enumerate(terms[:-1], 1):
        if term.count is None:
            raise FailPointSpecError(
                f"term {index} has no N* count, so the terms after it could never run"
            )
    return Action(tuple(terms), stripped)


def _parse_site(text: str, user: str | None = None) -> tuple[str, str | None]:
    match = _SITE_RE.fullmatch(text.strip())
    if match is None:
        raise FailPointSpecError(f"bad site {text.strip()!r}: expected NAME or NAME[user=USER]")
    if match["key"] is not None:
        if match["key"].strip() != "user":
            raise FailPointSpecError(f"unknown filter {match['key']!r}; only [user=NAME] exists")
        if not match["value"]:
            raise FailPointSpecError(f"empty user name in {text.strip()!r}")
        if user is not None and user != match["value"]:
            raise FailPointSpecError(f"site says user {match['value']!r} but user={user!r}")
        user = match["value"]
    return match["name"], user


def _site_key(site: str, user: str | None) -> str:
    return site if user is None else f"{site}[user={user}]"


class _Rule:
    """One configured (site, user) action and its progress; mutated only under the lock."""

    __slots__ = ("user", "action", "released", "_index", "_used")

    def __init__(self, action: Action, user: str | None) -> None:
        self.user = user
        self.action = action
        self.released = threading.Event()  # set by clear/release/replace: ends every hang
        self._index = 0  # current term
        self._used = 0  # evaluations counted against the current term

    def advance(self, rng: random.Random) -> Term | None:
        """Count one evaluation; return the term that fires, if any."""
        terms = self.action.terms
        while self._index < len(terms):
            term = terms[self._index]
            if term.count is None or self._used < term.count:
                break
            self._index, self._used = self._index + 1, 0
        else:
            return None  # chain exhausted
        self._used += 1
        if term.probability is not None and rng.random() * 100.0 >= term.probability:
            return None
        return term


def _injected(site: str, term: Term) -> Exception:
    assert term.exc_type is not None
    message = term.message if term.message is not None else f"fail point {site!r} fired"
    exc = term.exc_type(message)
    exc.add_note(f"injected by fail point {site!r}")  # str(exc) stays exactly the message
    return exc


class FailPoints:
    """Configured fail points. ``check`` may run on any thread; set/clear on another."""

    def __init__(self, *, rng: random.Random | None = None) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # signals hang enter/leave
        self._rng = rng if rng is not None else random.Random()
        # Copy-on-write under _lock, so the unconfigured fast path is one lock-free dict.get
        # that always sees a complete mapping. Values are never empty tuples.
        self._sites: dict[str, tuple[_Rule, ...]] = {}
        self._hanging: dict[str, int] = {}

    @property
    def sites(self) -> list[str]:
        """The sites configured."""
        return list(self._sites)

    @classmethod
    def from_spec(cls, spec: str | None, *, rng: random.Random | None = None) -> FailPoints:
        points = cls(rng=rng)
        seen: set[tuple[str, str | None]] = set()
        for entry in _split_top(spec or "", ";"):
            if not entry.strip():
                continue
            match = _ENTRY_RE.fullmatch(entry.strip())
            if match is None:
                raise FailPointSpecError(f"{entry.strip()!r}: expected site=action")
            try:
                site, user = _parse_site(match[1])
                action = parse_action(match[2])
            except FailPointSpecError as exc:
                raise FailPointSpecError(f"{entry.strip()!r}: {exc}") from None
            if (site, user) in seen:
                raise FailPointSpecError(f"{_site_key(site, user)!r} is configured twice")
            seen.add((site, user))
            points._install(site, user, action)
        return points

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FailPoints:
        try:
            return cls.from_spec(environ.get(ENV_VAR))
        except FailPointSpecError as exc:
            raise FailPointSpecError(f"{ENV_VAR}: {exc}") from None

    def set(self, site: str, action: str, user: str | None = None) -> None:
        """Install or replace the action for (site, user); its counts start from zero."""
        name, user = _parse_site(site, user)
        self._install(name, user, parse_action(action))

    def _install(self, site: str, user: str | None, action: Action) -> None:
        if site not in KNOWN_SITES:
            logger.warning("fail point %r is not a known site %s", site, KNOWN_SITES)
        with self._lock:
            old = self._sites.get(site, ())
            replaced = [rule for rule in old if rule.user == user]
            kept = tuple(rule for rule in old if rule.user != user)
            # User-filtered rules go first: when several raise at once, the more specific
            # one (usually a poison request) wins. Every matching rule still counts.
            rules = sorted((*kept, _Rule(action, user)), key=lambda rule: rule.user is None)
            self._sites = {**self._sites, site: tuple(rules)}
        for rule in replaced:
            rule.released.set()  # a replaced hang would otherwise block forever

    def clear(self, site: str) -> None:
        """Remove ``site`` (every user filter) or ``site[user=NAME]``; ends their hangs."""
        name, user = _parse_site(site)
        with self._lock:
            old = self._sites.get(name, ())
            removed = [rule for rule in old if user is None or rule.user == user]
            kept = tuple(rule for rule in old if rule not in removed)
            sites = {key: value for key, value in self._sites.items() if key != name}
            if kept:
                sites[name] = kept
            self._sites = sites
        for rule in removed:
            rule.released.set()

    def release(self) -> None:
        """End every current hang; released rules stop hanging until set() again."""
        with self._lock:
            rules = [rule for rules in self._sites.values() for rule in rules]
        for rule in rules:
            rule.released.set()

    def _evaluate(self, site: str, users: Collection[str]) -> list[tuple[Term, _Rule]]:
        # Counting happens here, under the lock, so counts are exact across threads;
        # the caller sleeps/hangs/raises afterwards, outside it.
        fired = []
        with self._lock:
            for rule in self._sites.get(site, ()):
                if rule.user is not None and rule.user not in users:
                    continue  # not involved: does not count toward N
                term = rule.advance(self._rng)
                if term is not None and term.task != "off":
                    fired.append((term, rule))
        return fired

    def _hang_delta(self, site: str, delta: int) -> None:
        with self._changed:
            self._hanging[site] = self._hanging.get(site, 0) + delta
            self._changed.notify_all()

    def check(self, site: str, users: Collection[str] = ()) -> None:
        """Evaluate ``site`` synchronously (worker thread): may sleep, hang or raise."""
        if not self._sites.get(site):
            return
        for term, rule in self._evaluate(site, users):
            if term.task == "raise":
                raise _injected(site, term)
            if term.task == "sleep":
                time.sleep(term.seconds)
            elif term.task == "hang" and not rule.released.is_set():
                self._hang_delta(site, +1)
                try:
                    rule.released.wait()
                finally:
                    self._hang_delta(site, -1)

    async def acheck(self, site: str, users: Collection[str] = ()) -> None:
        """Evaluate ``site`` on the event loop: sleeps and hangs never block the loop."""
        if not self._sites.get(site):
            return
        for term, rule in self._evaluate(site, users):
            if term.task == "raise":
                raise _injected(site, term)
            if term.task == "sleep":
                await anyio.sleep(term.seconds)
            elif term.task == "hang" and not rule.released.is_set():
                self._hang_delta(site, +1)
                try:
                    while not rule.released.is_set():
                        await anyio.sleep(_HANG_POLL_S)
                finally:
                    self._hang_delta(site, -1)

    def wait_hanging(self, site: str, count: int = 1, timeout: float | None = None) -> bool:
        """Block until at least ``count`` callers hang at ``site``; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self._hanging.get(site, 0) >= count, timeout)

    def describe(self) -> dict[str, str]:
        sites = self._sites  # an immutable snapshot: the dict is only ever replaced
        return {
            _site_key(site, rule.user): rule.action.text
            for site, rules in sites.items()
            for rule in rules
        }

    def __bool__(self) -> bool:
        return bool(self._sites)
