"""Habits of the command line (issue 14): ``--version``, combined short options,
each program's own usage, and ``--help`` within 80 columns.

Through the real entry points (``hold``, ``npu-hold``, ``gpu-hold`` of this
virtual environment); where a command runs, it runs for real, under the test's
own daemon (conftest).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HOLD, daemon_pid

from hold.cli.run import UsageError
from hold.cli.runargs import parse_run_args

BIN = Path(sys.executable).parent
PROGS = {
    "hold": [str(BIN / "hold")],
    "npu-hold": [str(BIN / "npu-hold")],
    "gpu-hold": [str(BIN / "gpu-hold")],
    "hold run": [str(BIN / "hold"), "run"],
}


def run(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )


def state_dir() -> Path:
    return Path(os.environ["HOLD_STATE_DIR"])


@pytest.mark.parametrize("prog", list(PROGS))
def test_version(prog: str) -> None:
    res = run([*PROGS[prog], "--version"])
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"{prog} {importlib.metadata.version('hold')}\n"
    assert res.stderr == ""
    assert daemon_pid(state_dir()) is None  # nothing started for it


def test_version_is_listed_in_help() -> None:
    assert "--version" in run([*PROGS["hold"], "--help"]).stdout
    assert "--version" in run([*PROGS["npu-hold"], "--help"]).stdout


def test_the_hot_path_stays_light() -> None:
    """``npu-hold`` imports neither click, yaml, structlog, psutil nor importlib.metadata
    (the run itself, lazy imports too: tests/test_figures.py)."""
    code = (
        "import sys, hold.cli.entry, hold.cli.run, hold.cli.runargs, hold.version; "
        "print(','.join(m for m in ('click', 'yaml', 'structlog', 'psutil', "
        "'importlib.metadata') if m in sys.modules))"
    )
    res = run([sys.executable, "-c", code])
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ""


@pytest.mark.parametrize("prog", ["npu-hold", "gpu-hold", "hold run"])
def test_no_command_prints_the_programs_own_usage(prog: str) -> None:
    res = run(PROGS[prog])
    assert res.returncode == 2
    assert res.stderr.startswith(
        f"{prog}: no command given\nUsage: {prog} [OPTIONS] -- COMMAND [ARG...]\n"
    ), res.stderr
    assert f"Try '{prog} --help'" in res.stderr
    if prog != "hold run":
        assert "hold run" not in res.stderr
    res = run([*PROGS[prog], "-v"])
    assert res.returncode == 2
    assert f"{prog}: no command given ({prog} [OPTIONS] -- COMMAND [ARG...])" in res.stderr
    assert daemon_pid(state_dir()) is None


@pytest.mark.parametrize(
    "argv",
    [
        ["-vt", "2m", "--", "x"],
        ["-vt2m", "x"],
        ["-v", "-t2m", "x"],
        ["-vt", "2", "x"],
        ["-t", "2m", "-v", "x"],
        ["--verbose", "--time=2m", "x"],
    ],
)
def test_short_options_combine_like_getopt(argv: list[str]) -> None:
    args = parse_run_args(argv)
    assert args.verbose and args.time == 120.0 and args.command == ["x"]


def test_combined_options_with_values_and_flags() -> None:
    args = parse_run_args(["-vd", "npu:0", "-l", "job", "-n1", "-e", "A=1", "--", "x", "-v"])
    assert args.verbose and args.device == "npu:0" and args.label == "job"
    assert args.count == 1 and args.env == {"A": "1"} and args.command == ["x", "-v"]
    # The value is the rest of the word, "=" and all, as getopt has it.
    with pytest.raises(ValueError, match="'=5'"):
        parse_run_args(["-t=5", "x"])


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["-vx", "x"], "no such option: -x (in -vx)"),
        (["-vt"], "option -t needs a value (DURATION)"),
        (["--verbose=1", "x"], "option --verbose takes no value"),
        (["--tme", "1m", "x"], "no such option: --tme; did you mean '--time'?"),
    ],
)
def test_bad_combinations_are_named(argv: list[str], said: str) -> None:
    with pytest.raises(UsageError) as e:
        parse_run_args(argv)
    assert str(e.value) == said


def test_combined_options_run_for_real(tmp_path: Path) -> None:
    """``npu-hold -vt1s``: a lease of one second, the command stopped at it (124),
    and the stop report said (-v)."""
    res = run([*PROGS["npu-hold"], "-vt1s", "--grace", "1s", "--", "sleep", "30"])
    assert res.returncode == 124, res.stderr
    assert "lease expired" in res.stderr
    assert "survivor check empty" in res.stderr  # the stop report, from -v
    res = run([*HOLD, "run", "-vt", "1m", "--", "true"])
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("prog", ["hold run", "npu-hold"])
def test_help_fits_80_columns(prog: str) -> None:
    res = run([*PROGS[prog], "--help"])
    assert res.returncode == 0
    long = [ln for ln in res.stdout.splitlines() if len(ln) > 80]
    assert not long, long
    for opt in ("--time DURATION", "--device CLASS[:INDEX,...]", "--version", "-v, --verbose"):
        assert opt in res.stdout
    assert res.stdout.startswith(f"Usage: {prog} [OPTIONS] -- COMMAND [ARG...]\n")


def test_a_lease_shorter_than_the_start_says_the_limit_given() -> None:
    """``npu-hold -t 1ms``: the lease is over before the command starts; what is
    said is the limit given, not what was left of it (once a negative number)."""
    res = run([*PROGS["npu-hold"], "-t", "1ms", "--", "sleep", "5"])
    assert res.returncode == 124, res.stderr
    assert "lease expired (its time limit of 1ms reached); stopped" in res.stderr, res.stderr
    assert "-0." not in res.stderr and "{" not in res.stderr, res.stderr


def test_compound_duration_for_real() -> None:
    """``-t 0m1.5s``: read as 1.5 s; the command is stopped at it (124)."""
    res = run([*PROGS["hold run"], "-t", "0m1.5s", "--grace", "0s500ms", "--", "sleep", "30"])
    assert res.returncode == 124, res.stderr
    assert "time limit of 1.5s reached" in res.stderr
    res = run([*PROGS["hold run"], "-t", "1m1h", "--", "true"])
    assert res.returncode == 2
    assert "'1m1h' is not valid: each unit once, the largest first" in res.stderr
