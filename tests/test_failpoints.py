"""Tests for mlx_serve.failpoints: grammar, construction, counting, filters and runtime
changes (``sleep`` and ``hang`` are in test_failpoints_blocking)."""

from __future__ import annotations

import logging
import random
import threading

import pytest

from mlx_serve.failpoints import (
    ENV_VAR,
    KNOWN_SITES,
    FailPoints,
    FailPointSpecError,
    Term,
    parse_action,
)
from tests.failpoint_helpers import WAIT_S, outcomes, start_thread

MALLOC = "[metal::malloc] Resource limit (499000) exceeded"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# --- grammar ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "term"),
    [
        ("off", Term("off")),
        ("hang", Term("hang")),
        (" hang ", Term("hang")),
        ("sleep(250)", Term("sleep", seconds=0.25)),
        ("sleep(1.5)", Term("sleep", seconds=0.0015)),
        ("raise(ValueError:boom)", Term("raise", exc_type=ValueError, message="boom")),
        ("raise(ValueError)", Term("raise", exc_type=ValueError, message=None)),
        ("raise( KeyError :)", Term("raise", exc_type=KeyError, message="")),
        ("3*off", Term("off", count=3)),
        ("50%off", Term("off", probability=50.0)),
        ("12.5%2*sleep(10)", Term("sleep", count=2, probability=12.5, seconds=0.01)),
        ("0%hang", Term("hang", probability=0.0)),
        ("100%1*raise(OSError:x)", Term("raise", 1, 100.0, OSError, "x")),
    ],
)
def test_parse_single_terms(text: str, term: Term) -> None:
    action = parse_action(text)
    assert action.terms == (term,)
    assert action.text == text.strip()


def test_parse_chain() -> None:
    action = parse_action("2*off -> 25%1*sleep(5) -> hang")
    assert [t.task for t in action.terms] == ["off", "sleep", "hang"]
    assert [t.count for t in action.terms] == [2, 1, None]
    assert action.terms[1].probability == 25.0


def test_parse_malloc_example_keeps_brackets_and_parentheses() -> None:
    action = parse_action(f"3*off->1*raise(RuntimeError:{MALLOC})")
    assert action.terms == (
        Term("off", count=3),
        Term("raise", count=1, exc_type=RuntimeError, message=MALLOC),
    )


def test_separators_inside_a_message_are_part_of_it() -> None:
    message = "a;b->c (d=e) [f]: g"
    points = FailPoints.from_spec(f"engine.step=raise(ValueError:{message});sse.send=off")
    assert points.describe() == {
        "engine.step": f"raise(ValueError:{message})",
        "sse.send": "off",
    }
    with pytest.raises(ValueError) as info:
        points.check("engine.step")
    assert str(info.value) == message


def test_from_spec_empty_entries_and_whitespace() -> None:
    points = FailPoints.from_spec(" ; engine.step = 1*off ;; sse.send[user=bob]=hang ; ")
    assert points.describe() == {"engine.step": "1*off", "sse.send[user=bob]": "hang"}


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("engine.step", "expected site=action"),
        ("engine.step=", "empty action"),
        ("engine.step=explode", "unknown task 'explode'"),
        ("engine.step=3*", "expected [P%][N*]task"),
        ("engine.step=x*off", "count must be an integer >= 1, got 'x'"),
        ("engine.step=0*off", "count must be an integer >= 1, got '0'"),
        ("engine.step=150%off", "probability must be in 0-100, got '150'"),
        ("engine.step=abc%off", "probability must be in 0-100, got 'abc'"),
        ("engine.step=off(1)", "off takes no argument"),
        ("engine.step=hang(1)", "hang takes no argument"),
        ("engine.step=sleep", "sleep needs an argument"),
        ("engine.step=raise", "raise needs an argument: raise(Type:message)"),
        ("engine.step=sleep(abc)", "sleep needs milliseconds >= 0, got 'abc'"),
        ("engine.step=sleep(-1)", "got '-1'"),
        ("engine.step=sleep(nan)", "got 'nan'"),
        ("engine.step=sleep(1)(2)", "unexpected text after ')'"),
        ("engine.step=raise(RuntimeError:oops", "unclosed '('"),
        ("engine.step=off)", "unbalanced ')'"),
        ("engine.step=raise(Foo:x)", "'Foo' is not a builtin exception type"),
        ("engine.step=raise(os.error:x)", "'os.error' is not a builtin exception type"),
        ("engine.step=raise(print:x)", "'print' is not a builtin exception type"),
        ("engine.step=raise(KeyboardInterrupt:x)", "KeyboardInterrupt is not a subclass of Exc"),
        ("engine.step=raise(SystemExit:x)", "SystemExit is not a subclass of Exception"),
        ("engine.step=raise(UnicodeDecodeError:x)", "cannot be built from a message"),
        ("engine.step=hang->off", "term 1 has no N* count"),
        ("engine.step[role=x]=off", "unknown filter 'role'"),
        ("engine.step[user=]=off", "empty user name"),
        ("bad site=off", "bad site 'bad site'"),
        ("engine.step=off;engine.step=hang", "'engine.step' is configured twice"),
    ],
)
def test_bad_specs_name_the_bad_part(spec: str, fragment: str) -> None:
    with pytest.raises(FailPointSpecError) as info:
        FailPoints.from_spec(spec)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_bad_term_error_names_entry_and_term() -> None:
    with pytest.raises(FailPointSpecError) as info:
        FailPoints.from_spec("sse.send=off;engine.step=2*off->sleep(x)")
    message = str(info.value)
    assert "'engine.step=2*off->sleep(x)'" in message
    assert "term 2 'sleep(x)'" in message


def test_parse_action_rejects_bad_input() -> None:
    with pytest.raises(FailPointSpecError, match="unknown task"):
        parse_action("1*off->nope")


# --- construction ----------------------------------------------------------------------


def test_unconfigured_points_are_falsy_and_no_ops() -> None:
    for points in (FailPoints.from_spec(None), FailPoints.from_spec(" ; "), FailPoints()):
        assert not points
        assert points.describe() == {}
        assert points.check("engine.step", {"alice"}) is None


@pytest.mark.anyio
async def test_unconfigured_acheck_is_a_no_op() -> None:
    points = FailPoints.from_spec("engine.step=raise(ValueError:x)")
    assert points
    await points.acheck("sse.send")
    assert outcomes(points, "engine.admit", 3) == ["ok"] * 3


def test_unconfigured_check_takes_no_lock() -> None:
    # The performance contract: an unconfigured site is one dict.get, never the lock.
    points = FailPoints.from_spec("engine.step=off")
    done = threading.Event()
    with points._lock:
        start_thread(lambda: (points.check("sse.send"), done.set()))
        assert done.wait(WAIT_S)


def test_from_env() -> None:
    points = FailPoints.from_env({ENV_VAR: "engine.admit=1*raise(LookupError:nope)"})
    assert outcomes(points, "engine.admit", 2) == ["LookupError", "ok"]
    assert not FailPoints.from_env({})
    with pytest.raises(FailPointSpecError, match=ENV_VAR):
        FailPoints.from_env({ENV_VAR: "engine.admit=bogus"})


def test_known_sites_and_unknown_site_warning(caplog: pytest.LogCaptureFixture) -> None:
    assert KNOWN_SITES == (
        "startup.load",
        "engine.admit",
        "engine.step",
        "engine.detokenize",
        "engine.self_test",
        "sse.send",
    )
    with caplog.at_level(logging.WARNING, logger="mlx_serve.failpoints"):
        points = FailPoints.from_spec("engine.stpe=1*raise(ValueError:x)")
    assert "engine.stpe" in caplog.text
    assert outcomes(points, "engine.stpe", 2) == ["ValueError", "ok"]


# --- counting and chains ---------------------------------------------------------------


def test_malloc_example_counts_then_exhausts() -> None:
    points = FailPoints.from_spec(f"engine.step=3*off->1*raise(RuntimeError:{MALLOC})")
    assert outcomes(points, "engine.step", 3) == ["ok"] * 3
    with pytest.raises(RuntimeError) as info:
        points.check("engine.step")
    assert type(info.value) is RuntimeError
    assert str(info.value) == MALLOC
    assert "engine.step" in info.value.__notes__[0]
    assert outcomes(points, "engine.step", 10) == ["ok"] * 10


def test_term_without_count_applies_forever() -> None:
    points = FailPoints.from_spec("engine.step=raise(ValueError:always)")
    assert outcomes(points, "engine.step", 20) == ["ValueError"] * 20


def test_chain_moves_through_terms() -> None:
    points = FailPoints.from_spec("engine.step=2*raise(KeyError:k)->1*off->raise(OSError:o)")
    assert outcomes(points, "engine.step", 6) == ["KeyError"] * 2 + ["ok"] + ["OSError"] * 3


def test_raise_without_message_names_the_site() -> None:
    points = FailPoints.from_spec("engine.detokenize=raise(TimeoutError)")
    with pytest.raises(TimeoutError, match="fail point 'engine.detokenize' fired"):
        points.check("engine.detokenize")


def test_probability_follows_the_seeded_rng() -> None:
    points = FailPoints.from_spec("engine.step=30%raise(ValueError:p)", rng=random.Random(1234))
    twin = random.Random(1234)
    expected = ["ValueError" if twin.random() * 100 < 30 else "ok" for _ in range(200)]
    assert outcomes(points, "engine.step", 200) == expected
    assert 30 < expected.count("ValueError") < 90  # the seed really mixes both outcomes


def test_probability_extremes() -> None:
    points = FailPoints.from_spec("a=0%raise(ValueError:x);b=100%raise(ValueError:x)")
    assert outcomes(points, "a", 50) == ["ok"] * 50
    assert outcomes(points, "b", 50) == ["ValueError"] * 50


def test_evaluations_that_do_not_fire_still_count() -> None:
    spec = "engine.step=50%4*raise(ValueError:x)->raise(KeyError:k)"
    points = FailPoints.from_spec(spec, rng=random.Random(7))
    twin = random.Random(7)
    first = ["ValueError" if twin.random() * 100 < 50 else "ok" for _ in range(4)]
    assert outcomes(points, "engine.step", 6) == first + ["KeyError"] * 2


def test_counts_are_exact_under_concurrency() -> None:
    points = FailPoints.from_spec("engine.step=500*off->300*raise(ValueError:x)")
    results: list[list[str]] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        results.append(outcomes(points, "engine.step", 200))

    threads = [start_thread(worker) for _ in range(8)]
    for thread in threads:
        thread.join(WAIT_S)
    assert len(results) == 8
    assert sum(r.count("ValueError") for r in results) == 300


# --- user filters ----------------------------------------------------------------------


def test_user_filter_fires_only_for_that_user_and_counts_only_then() -> None:
    points = FailPoints.from_spec("engine.step[user=alice]=1*off->1*raise(ValueError:poison)")
    assert outcomes(points, "engine.step", 5, users={"bob"}) == ["ok"] * 5
    assert outcomes(points, "engine.step", 5) == ["ok"] * 5
    assert outcomes(points, "engine.step", 1, users={"bob", "alice"}) == ["ok"]
    assert outcomes(points, "engine.step", 3, users={"bob"}) == ["ok"] * 3
    assert outcomes(points, "engine.step", 2, users=["alice"]) == ["ValueError", "ok"]


def test_filtered_and_unfiltered_rules_coexist() -> None:
    points = FailPoints.from_spec("engine.step=1*off->raise(KeyError:k)")
    points.set("engine.step", "raise(ValueError:v)", user="alice")
    assert points.describe() == {
        "engine.step": "1*off->raise(KeyError:k)",
        "engine.step[user=alice]": "raise(ValueError:v)",
    }
    # Both rules count on alice's steps; the filtered one is more specific and wins.
    assert outcomes(points, "engine.step", 2, users={"alice"}) == ["ValueError"] * 2
    assert outcomes(points, "engine.step", 1) == ["KeyError"]


def test_set_with_user_suffix_and_conflict() -> None:
    points = FailPoints()
    points.set("engine.admit[user=carol]", "raise(PermissionError:no)")
    points.set("engine.admit[user=carol]", "2*raise(ValueError:v)", user="carol")
    assert points.describe() == {"engine.admit[user=carol]": "2*raise(ValueError:v)"}
    assert outcomes(points, "engine.admit", 3, users={"carol"}) == ["ValueError"] * 2 + ["ok"]
    with pytest.raises(FailPointSpecError, match="user"):
        points.set("engine.admit[user=carol]", "off", user="dave")
    with pytest.raises(FailPointSpecError, match="unknown task"):
        points.set("engine.admit", "boom")


# --- runtime changes -------------------------------------------------------------------


def test_set_replaces_and_restarts_counts_clear_removes() -> None:
    points = FailPoints()
    points.set("engine.step", "1*raise(ValueError:a)")
    assert outcomes(points, "engine.step", 2) == ["ValueError", "ok"]
    points.set("engine.step", "1*raise(KeyError:b)")
    assert outcomes(points, "engine.step", 2) == ["KeyError", "ok"]
    points.clear("engine.step")
    assert not points
    points.clear("engine.step")  # clearing an unconfigured site is harmless


def test_clear_with_user_suffix_removes_only_that_filter() -> None:
    points = FailPoints.from_spec("engine.step=off;engine.step[user=a]=off;engine.step[user=b]=off")
    points.clear("engine.step[user=a]")
    assert points.describe() == {"engine.step": "off", "engine.step[user=b]": "off"}
    points.clear("engine.step")
    assert points.describe() == {}
