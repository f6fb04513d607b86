"""``hold audit``'s selection for a Slurm epilog (issue 26): ``--device CLASS:INDEX,...``,
``--user``, and ``--log`` (a JSON line per stray); each bad value refused, changing nothing.

Over a class of two regular files (a process can hold one by descriptor), held
by root and by a real unprivileged user.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import HOLD, PROGS, alive, as_user, unpriv_python, update_config, wait_for


@pytest.fixture
def fake(isolated_hold: Path) -> list[Path]:
    nodes = [isolated_hold / f"fake{i}" for i in range(2)]
    for n in nodes:
        n.write_bytes(b"")
        n.chmod(0o666)
    update_config(isolated_hold, devices={"fake": {"nodes": [f"{isolated_hold}/fake*"]}})
    isolated_hold.chmod(0o755)
    return nodes


class Holders:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str]) -> int:
        before = self.out.read_text().count("holder") if self.out.exists() else 0
        self.procs.append(subprocess.Popen(argv))
        wait_for(lambda: self.out.read_text().count("holder") > before, 20, what="a holder")
        return int(self.out.read_text().splitlines()[-1].split()[1])


@pytest.fixture
def holders(isolated_hold: Path) -> Iterator[Holders]:
    out = isolated_hold / "pids"
    out.touch()
    out.chmod(0o666)
    h = Holders(out)
    try:
        yield h
    finally:
        for p in h.procs:
            p.kill()
            p.wait(10)


def audit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HOLD, "audit", *args], capture_output=True, text=True, timeout=60)


def rows(res: subprocess.CompletedProcess[str]) -> list[tuple[str, int]]:
    doc: dict[str, Any] = json.loads(res.stdout)
    return sorted((r["device"], r["uid"]) for r in doc["holders"])


def test_device_indices_and_user_select_the_rows_and_the_kill(
    fake: list[Path], holders: Holders, isolated_hold: Path, unpriv_user: str, unpriv_runtime: Path
) -> None:
    uid = pwd.getpwnam(unpriv_user).pw_uid
    holder = [str(PROGS / "node_holder.py"), str(holders.out), "fd"]
    user_holder = [str(unpriv_runtime / "progs" / "node_holder.py"), str(holders.out), "fd"]
    root0 = holders.start([sys.executable, *holder, str(fake[0])])
    root1 = holders.start([sys.executable, *holder, str(fake[1])])
    user0 = holders.start(
        as_user(unpriv_user, [unpriv_python(), *user_holder, str(fake[0])], unpriv_runtime, {})
    )
    res = audit("--device", "fake:0", "--json")
    assert res.returncode == 1, res.stderr
    assert rows(res) == [("fake:0", 0), ("fake:0", uid)]
    res = audit("--device", "fake:0", "--user", unpriv_user, "--json")
    assert rows(res) == [("fake:0", uid)]
    # Processes of other users it could not read are not the user's: the
    # answer about the user is whole (root reads every process of theirs).
    assert json.loads(res.stdout)["not_inspected"] == 0, res.stdout
    assert rows(audit("--device", "fake", "--user", str(uid), "--json")) == [("fake:0", uid)]
    log = isolated_hold / "strays.jsonl"
    # The user holds nothing of fake:1: nothing stopped, nothing logged.
    res = audit("--device", "fake:1", "--user", unpriv_user, "--kill", "--yes", "--log", str(log))
    assert res.returncode == 0, res.stderr
    assert log.read_text() == ""
    res = audit(
        "--device",
        "fake:0",
        "--user",
        unpriv_user,
        "--kill",
        "--yes",
        "--grace",
        "2s",
        "--log",
        str(log),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    wait_for(lambda: not alive(user0), 10, what="the user's stray stopped")
    assert alive(root0) and alive(root1)
    (line,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert (line["pid"], line["uid"], line["device"], line["stopped"]) == (
        user0,
        uid,
        "fake:0",
        True,
    )
    assert line["node"] == str(fake[0]) and line["kill_survivors"] == []
    assert "slurm_job_id" not in line  # not in a Slurm job
    assert log.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--device", "fake:2"], "indices 0-1"),
        (["--device", "fake:"], "CLASS:INDEX"),
        (["--device", "fake:0,0"], "each index once"),
        (["--device", "fke:0"], "did you mean 'fake'"),
        (["--user", "no-such-user-26"], "a user name of this machine, or a uid"),
    ],
)
def test_bad_selections_are_refused(fake: list[Path], args: list[str], says: str) -> None:
    res = audit(*args, "--kill", "--yes")
    assert res.returncode == 2, res.stdout + res.stderr
    assert says in res.stderr and args[1] in res.stderr, res.stderr


def test_a_log_that_is_a_symlink_is_refused_and_its_target_unchanged(
    fake: list[Path], isolated_hold: Path
) -> None:
    target = isolated_hold / "victim"
    target.write_text("keep\n")
    link = isolated_hold / "log.jsonl"
    os.symlink(target, link)
    res = audit("--log", str(link))
    assert res.returncode == 2, res.stderr
    assert str(link) in res.stderr
    assert target.read_text() == "keep\n"
