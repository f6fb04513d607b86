"""How ``hold up --detach`` starts its background supervisor (``hold/cli/upchild.py``):
forked from the command before the file is read, or, where the command already
holds a heavy module (click, YAML) or a thread, a fresh ``python -P -m
hold.cli.upchild``. Either way the supervisor holds none of the command's descriptors,
and a command that dies before handing the stack over leaves nothing running.
Real processes throughout."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import HOLD, alive, wait_for

STARTER = textwrap.dedent("""
    import os, sys
    {before}
    from hold.cli.upchild import Starter
    s = Starter()
    print(s.pid, flush=True)
    os._exit(0)  # dies before handing anything over
""")


def start_and_die(before: str = "") -> tuple[int, str]:
    """A command that starts a supervisor and dies at once; the supervisor's pid and
    command line (read while it may still live)."""
    res = subprocess.run(
        [sys.executable, "-c", STARTER.format(before=before)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    pid = int(res.stdout)
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        cmdline = ""  # already gone: that is the point
    return pid, cmdline


def test_a_command_that_dies_before_the_hand_over_leaves_no_supervisor() -> None:
    """The forked supervisor holds no end of the command's pipes: the command's death
    is an empty stack, and it ends (a held write end would keep it waiting forever)."""
    pid, cmdline = start_and_die()
    assert "-m hold.cli.upchild" not in cmdline  # forked: the command's own command line
    wait_for(lambda: not alive(pid), 10, what="the forked supervisor's end")


def test_a_command_with_click_loaded_starts_a_fresh_interpreter() -> None:
    pid, cmdline = start_and_die("import click")
    if cmdline:
        assert "-P -m hold.cli.upchild" in cmdline
    wait_for(lambda: not alive(pid), 10, what="the supervisor's end")
    pid, cmdline = start_and_die(
        "import threading; threading.Thread(target=threading.Event().wait, daemon=True).start()"
    )
    if cmdline:
        assert "-P -m hold.cli.upchild" in cmdline
    wait_for(lambda: not alive(pid), 10, what="the supervisor's end")


def test_both_ways_run_a_stack_without_the_heavy_modules(tmp_path: Path) -> None:
    """``hold up --detach FILE`` forks; the same command with click loaded (as
    through the group) starts a fresh interpreter. Both supervisors run the stack,
    report it up, hold no YAML or click, and only the fork shares the
    command's command line."""
    pidfile = tmp_path / "pid"
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        "name: ways\nunits:\n  one:\n"
        f'    cmd: [sh, -c, "echo $$ > {pidfile}; exec sleep 60"]\n'
        f'    ready: {{file: "{pidfile}"}}\n'
    )
    with_click = "import sys, click; from hold.cli.entry import main; sys.exit(main())"
    for prog, forked in ((HOLD, True), ([sys.executable, "-c", with_click], False)):
        res = subprocess.run(
            [*prog, "up", "--detach", "--for", "30s", str(stack)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        assert res.stderr.count("stack ways is up in the background") == 1, res.stderr
        ps = subprocess.run([*HOLD, "ps", "ways", "--json"], capture_output=True, text=True)
        supervisor = json.loads(ps.stdout)["pid"]
        assert f"(pid {supervisor})" in res.stderr
        maps = Path(f"/proc/{supervisor}/maps").read_text()
        assert "_yaml" not in maps
        cmdline = Path(f"/proc/{supervisor}/cmdline").read_bytes().replace(b"\0", b" ")
        assert (b"hold.cli.upchild" not in cmdline) is forked, cmdline
        unit = int(pidfile.read_text())
        res = subprocess.run([*HOLD, "down", "ways"], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert not alive(unit)
        wait_for(lambda s=supervisor: not alive(s), 10, what="the supervisor's end")
        pidfile.unlink()


def test_units_run_in_the_stack_files_directory_from_anywhere(tmp_path: Path) -> None:
    """From the stack file's directory the supervisor's own is the units' (no stub
    enters it); from / it is entered: the same directory either way."""
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        "name: where\nunits:\n  one:\n"
        "    cmd: [sh, -c, 'pwd -P > where.tmp && mv where.tmp where; exec sleep 60']\n"
        '    ready: {file: "{stack_dir}/where"}\n'
    )
    for cwd in (tmp_path, Path("/")):
        res = subprocess.run(
            [*HOLD, "up", "--detach", str(stack)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=cwd,
        )
        assert res.returncode == 0, res.stderr
        assert (tmp_path / "where").read_text().strip() == str(tmp_path.resolve())
        res = subprocess.run([*HOLD, "down", "where"], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        (tmp_path / "where").unlink()
