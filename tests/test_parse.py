"""Strict parsers: durations and CPU lists are accepted exactly, refused by name."""

from __future__ import annotations

import os
import random

import pytest

from hold_supervisor.parse import (
    MAX_SHOWN,
    BadValue,
    allowed_cpus,
    did_you_mean,
    format_cpus,
    format_duration,
    parse_cpus,
    parse_duration,
    shorten,
)

# --------------------------------------------------------------------------
# Durations


@pytest.mark.parametrize(
    ("text", "plain_unit", "seconds"),
    [
        ("90s", "minutes", 90.0),
        ("4m", "minutes", 240.0),
        ("2h", "minutes", 7200.0),
        ("1.5h", "minutes", 5400.0),
        ("250ms", "seconds", 0.25),
        ("1d", "minutes", 86400.0),
        ("0.5s", "seconds", 0.5),
        # A plain number is in the unit the caller says: minutes for -t ...
        ("5", "minutes", 300.0),
        ("1.5", "minutes", 90.0),
        # ... seconds for a grace period.
        ("5", "seconds", 5.0),
        ("2.5", "seconds", 2.5),
        # Surrounding blanks (a value read from a file) are not part of it.
        (" 90s ", "minutes", 90.0),
        # Compound: from the largest unit down, a fraction in the last part only.
        ("1h30m", "minutes", 5400.0),
        ("2m30s", "seconds", 150.0),
        ("1d12h", "minutes", 129600.0),
        ("1m30.5s", "minutes", 90.5),
        ("1s500ms", "seconds", 1.5),
        ("1d2h3m4s5ms", "minutes", 93784.005),
        ("0h5m", "minutes", 300.0),
    ],
)
def test_duration_accepted(text: str, plain_unit: str, seconds: float) -> None:
    assert parse_duration(text, plain_unit=plain_unit) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text",
    [
        "5x",
        "-1",
        "-5s",
        "",
        "   ",
        "0",
        "0s",
        "0.0m",
        "s",
        "5 s",
        "5sec",
        "5S",
        "1.5.2s",
        ".5s",
        "5.",
        "1e3",
        "inf",
        "nan",
        "+5",
        "5s10m",
        "1h1h",
        "30m1h",
        "1.5h30m",
        "1h 30m",
        "1h30",
        "h30m",
        "1h30m-",
        "0h0m",
        "366d1h",
        "367d",
        # Digits other than ASCII 0-9 (Arabic-Indic five, fullwidth five):
        # int() and float() would take them, a strict parser must not.
        "\u0665m",
        "\uff15s",
    ],
)
def test_duration_refused_naming_the_value(text: str) -> None:
    with pytest.raises(BadValue) as info:
        parse_duration(text, what="time limit", plain_unit="minutes", where="-t")
    err = info.value
    assert err.value == text
    msg = str(err)
    assert repr(text) in msg, msg
    assert msg.startswith("-t: time limit"), msg
    assert err.accepted and err.accepted in msg


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("5s10m", "each unit once, the largest first"),
        ("1h1h", "each unit once"),
        ("1.5h30m", "only the last part may have a fraction"),
    ],
)
def test_compound_duration_refusal_says_why(text: str, why: str) -> None:
    with pytest.raises(BadValue) as info:
        parse_duration(text, what="-t/--time", plain_unit="minutes")
    msg = str(info.value)
    assert msg.startswith(f"-t/--time {text!r} is not valid: {why}"), msg
    assert "1h30m" in msg and "plain number is minutes" in msg


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (4.25, "4.2s"),
        (42, "42s"),
        (307, "5m07s"),
        (4320, "1h12m"),
        (7500, "2h05m"),
        (90000, "1d01h"),
        (273600, "3d04h"),
        (None, "-"),
    ],
)
def test_format_duration_reads_back(seconds: float | None, shown: str) -> None:
    assert format_duration(seconds) == shown
    if seconds is not None and seconds >= 60:
        back = parse_duration(shown, plain_unit="seconds")
        assert seconds - 3600 < back <= seconds  # cut, never more


def test_duration_zero_only_when_allowed() -> None:
    assert parse_duration("0", plain_unit="seconds", allow_zero=True) == 0.0
    assert parse_duration("0s", plain_unit="seconds", allow_zero=True) == 0.0
    with pytest.raises(BadValue, match="more than zero"):
        parse_duration("0", plain_unit="seconds")
    # allow_zero does not open the door to negatives.
    with pytest.raises(BadValue):
        parse_duration("-1", plain_unit="seconds", allow_zero=True)


def test_duration_message_says_what_a_plain_number_means() -> None:
    with pytest.raises(BadValue, match="plain number is minutes"):
        parse_duration("5x", plain_unit="minutes")
    with pytest.raises(BadValue, match="plain number is seconds"):
        parse_duration("5x", plain_unit="seconds")


def test_duration_refuses_a_non_string() -> None:
    with pytest.raises(BadValue):
        parse_duration(5, plain_unit="minutes")  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# CPU lists

SIXTEEN = frozenset(range(16))


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0-3,8", {0, 1, 2, 3, 8}),
        ("0", {0}),
        ("3-3", {3}),
        ("1,0", {0, 1}),
        ("0-1,1-2", {0, 1, 2}),
        ("15", {15}),
        (" 0-3, 8 ", {0, 1, 2, 3, 8}),
    ],
)
def test_cpus_accepted(text: str, cpus: set[int]) -> None:
    assert parse_cpus(text, allowed=SIXTEEN) == frozenset(cpus)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "  ",
        "0-",
        "-3",
        "3-1",
        "a",
        "0,a",
        "0,",
        ",0",
        "0,,1",
        "0-3-5",
        "0 1",
        "0x1",
        "-1",
        "1.0",
        "\u0661",  # Arabic-Indic one
    ],
)
def test_cpus_refused_naming_the_value(text: str) -> None:
    with pytest.raises(BadValue) as info:
        parse_cpus(text, allowed=SIXTEEN, where="--cpus")
    err = info.value
    assert err.value == text
    msg = str(err)
    assert repr(text) in msg and msg.startswith("--cpus: CPU list"), msg
    # It says what would have been accepted, including the usable CPUs.
    assert "0-15" in msg, msg


def test_cpus_outside_the_allowed_set_are_refused_and_named() -> None:
    with pytest.raises(BadValue) as info:
        parse_cpus("2-5", allowed=frozenset({0, 1, 2, 3}))
    msg = str(info.value)
    assert "'2-5'" in msg and "CPU 4-5 is not usable" in msg, msg


def test_cpus_default_allowed_set_is_this_process_affinity() -> None:
    mine = frozenset(os.sched_getaffinity(0))
    assert allowed_cpus() == mine
    assert parse_cpus(format_cpus(mine)) == mine
    beyond = max(mine) + 1
    with pytest.raises(BadValue, match=str(beyond)):
        parse_cpus(str(beyond))
    with pytest.raises(BadValue):
        parse_cpus("9999")
    with pytest.raises(BadValue):
        parse_cpus("0-99999")


def test_format_cpus_known_forms() -> None:
    assert format_cpus({0, 1, 2, 3, 8}) == "0-3,8"
    assert format_cpus({0, 2, 4}) == "0,2,4"
    assert format_cpus({0, 1}) == "0-1"
    assert format_cpus({7}) == "7"
    assert format_cpus(set()) == ""
    assert format_cpus(frozenset({5, 3, 4, 10, 11, 1})) == "1,3-5,10-11"


def test_format_cpus_matches_the_kernel() -> None:
    # The kernel's own rendering of this process's mask is the reference.
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith("Cpus_allowed_list:"))
    assert format_cpus(frozenset(os.sched_getaffinity(0))) == line.split(":", 1)[1].strip()


def test_format_parse_round_trip() -> None:
    rng = random.Random(1234)
    universe = frozenset(range(64))
    for _ in range(500):
        cpus = frozenset(c for c in universe if rng.random() < rng.random())
        if not cpus:
            continue
        text = format_cpus(cpus)
        assert parse_cpus(text, allowed=universe) == cpus, text
        assert format_cpus(parse_cpus(text, allowed=universe)) == text


# --------------------------------------------------------------------------
# Messages: a value is named, never echoed whole; unknown names get a suggestion.


def test_a_long_value_is_cut_in_the_message_and_kept_whole() -> None:
    long = "x" * 10_000
    e = BadValue("label", long, "at most 200 characters", "f.yaml:3")
    text = str(e)
    assert text.startswith("f.yaml:3: label 'xxxx")
    assert "... (10000 characters) is not valid: at most 200 characters" in text
    assert len(text) < MAX_SHOWN + 100
    assert e.value == long
    assert shorten("short") == "'short'"
    assert shorten(12345) == "12345"


@pytest.mark.parametrize(
    ("word", "accepted", "synonyms", "hint"),
    [
        ("--cpu", ["--cpus", "--count", "--time"], None, "; did you mean '--cpus'?"),
        ("--lable", ["--label", "--time"], None, "; did you mean '--label'?"),
        ("command", ["cmd", "env", "after"], {"command": "cmd"}, "; did you mean 'cmd'?"),
        ("depends_on", ["cmd", "env", "after"], {"depends_on": "after"}, "; did you mean 'after'?"),
        ("Depends-On", ["cmd", "env", "after"], {"depends_on": "after"}, "; did you mean 'after'?"),
        ("CMD", ["cmd", "env", "after"], None, "; did you mean 'cmd'?"),
        # A synonym for a name not accepted here suggests nothing from the table.
        ("command", ["http", "tcp"], {"command": "cmd"}, ""),
        ("zzzz", ["cmd", "env"], None, ""),
    ],
)
def test_did_you_mean(
    word: str, accepted: list[str], synonyms: dict[str, str] | None, hint: str
) -> None:
    assert did_you_mean(word, accepted, synonyms) == hint
