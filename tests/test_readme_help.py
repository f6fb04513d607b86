"""README <-> --help: the README's option lists match each command's ``--help`` (issue 14).

THE README TEST (``pytest -k readme_help``). For every command shown in a
README synopsis block (the plain code blocks whose lines start with ``hold``,
``npu-hold``, ``gpu-hold`` or ``sudo hold``): every option the README shows
exists in that command's ``--help``, and every option of its ``--help`` is
shown in the README, but for the few in :data:`NOT_IN_SYNOPSIS`, each with
the reason it is left out. An option with a short and a long name counts
once, as either. And every command of ``hold --help`` has a synopsis line.

When this fails after a change to a command's options: change the README's
synopsis (or, for an option that belongs in prose, add it below with where
the README says it).
"""

from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PROGRAMS = ("hold", "npu-hold", "gpu-hold")
OPTION = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")

# Options of --help that the README's synopses leave out on purpose, and why.
NOT_IN_SYNOPSIS: dict[str, set[str]] = {
    "*": {"--help"},  # every command has it
    # "--version on hold, hold run, npu-hold and gpu-hold prints the version"
    # (README, under `hold run`)
    "hold": {"--version"},
    "hold run": {"--version"},
    "npu-hold": {"--version"},
    "gpu-hold": {"--version"},
    # --detach: what a client's autostart runs; --idle-exit: README, Lifetimes;
    # --unit-dir, --no-start: what --install writes, for packagers (--help).
    "hold daemon": {"--detach", "--idle-exit", "--unit-dir", "--no-start"},
}


def synopses(readme: str) -> dict[str, list[str]]:
    """Each command shown in a README synopsis block -> its synopsis lines (the
    description column cut off, continued lines joined)."""
    out: dict[str, list[str]] = {}
    for block in plain_blocks(readme):
        last: list[str] | None = None
        for raw in block:
            text = raw.removeprefix("sudo ")
            words = text.split()
            if words and words[0] in PROGRAMS:
                cmd = words[0] if words[0] != "hold" or len(words) == 1 else " ".join(words[:2])
                synopsis = re.split(r"\s{2,}", text.strip())[0]
                last = out.setdefault(cmd, [])
                last.append(synopsis)
            elif last is not None and raw.strip().startswith("["):  # a synopsis continued
                last[-1] += " " + raw.strip()
            else:
                last = None
    return out


def plain_blocks(text: str) -> list[list[str]]:
    """The lines of each code block without a language (```` ``` ```` alone)."""
    blocks: list[list[str]] = []
    fence: str | None = None  # inside a block: its opening line
    for line in text.splitlines():
        if fence is None and line.startswith("```"):
            fence = line
            blocks.append([])
        elif fence is not None and line.strip() == "```":
            if fence != "```":
                blocks.pop()
            fence = None
        elif fence is not None:
            blocks[-1].append(line)
    return blocks


def readme_options(
    cmd: str, shown: dict[str, list[str]], seen: frozenset[str] = frozenset()
) -> set[str]:
    """The options the README shows for ``cmd``: ``[hold run options]`` stands for
    ``hold run``'s, and a line that ends in ``...`` ("the same": ``gpu-hold ...``,
    ``hold run --device CLASS ...``) for npu-hold's."""
    found: set[str] = set()
    seen = seen | {cmd}
    for line in shown[cmd]:
        found |= set(OPTION.findall(line.split(cmd, 1)[1]))
        if "[hold run options]" in line and "hold run" not in seen:
            found |= readme_options("hold run", shown, seen)
        if line.split()[-1] == "..." and "npu-hold" not in seen:
            found |= readme_options("npu-hold", shown, seen)
    return found


@cache
def help_options(cmd: str) -> list[set[str]]:
    """``cmd --help``'s options: one set of names (short and long) per option."""
    res = subprocess.run(
        [str(BIN / cmd.split()[0]), *cmd.split()[1:], "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    out = []
    for line in res.stdout.splitlines():
        if re.match(r"\s{2,}-", line):
            names = re.split(r"\s{2,}", line.strip())[0]
            out.append({n for n in OPTION.findall(names)})
    assert out, f"no options found in {cmd} --help:\n{res.stdout}"
    return out


SHOWN = synopses((ROOT / "README.md").read_text())


def test_readme_help_every_command_has_a_synopsis() -> None:
    from hold.cli.group import cli

    hidden = {name for name, c in cli.commands.items() if c.hidden}
    missing = sorted(f"hold {n}" for n in cli.commands if f"hold {n}" not in SHOWN) + sorted(
        p for p in PROGRAMS if p != "hold" and p not in SHOWN
    )
    assert [m for m in missing if m.split()[-1] not in hidden] == []


@pytest.mark.parametrize("cmd", sorted(c for c in SHOWN if c != "hold"))
def test_readme_help_options_match(cmd: str) -> None:
    documented = readme_options(cmd, SHOWN)
    groups = help_options(cmd)
    known = set().union(*groups)
    assert sorted(documented - known) == [], f"README shows options {cmd} --help does not have"
    allowed = NOT_IN_SYNOPSIS["*"] | NOT_IN_SYNOPSIS.get(cmd, set())
    left_out = [sorted(g) for g in groups if not g & (documented | allowed)]
    assert left_out == [], f"{cmd} --help has options the README's synopsis does not show"


def test_readme_help_the_parser_finds_the_synopses() -> None:
    """The test above tests something: the README's known synopses are found."""
    assert {
        "hold run",
        "npu-hold",
        "gpu-hold",
        "hold status",
        "hold audit",
        "hold up",
        "hold call",
        "hold daemon",
    } <= set(SHOWN)
    assert {"-t", "--cpus", "--pass-env", "-v", "--device"} <= readme_options("hold run", SHOWN)
    assert {"--no-wait", "--private", "--cpus"} <= readme_options("npu-hold", SHOWN)
