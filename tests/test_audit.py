"""``hold audit`` with real processes holding "device" nodes.

The devices are a class ``fake`` over temporary regular files (4 KiB each, so
they can be mapped); a holder is ``tests/progs/node_holder.py`` (a descriptor,
or a mapping with every descriptor closed) or, for another user, a shell that
opens the file and execs ``sleep``. Leases come from ``hold run --device``
against the test's own daemon (conftest), so what is covered is decided by
the token files the daemon wrote, exactly as for a user.

Every wait is bounded; every process a test starts is ended by the ``procs``
fixture (and the leak check proves it).
"""

from __future__ import annotations

import functools
import json
import os
import pwd
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    HOLD,
    PROGS,
    alive,
    as_user,
    audit_clean,
    launcher_of,
    unpriv_python,
    update_config,
    wait_for,
)

from hold.daemon.tokens import read_record
from hold_supervisor.exitcodes import INCOMPLETE
from hold_supervisor.proc import scan
from hold_supervisor.proc.identity import Stat

PY = sys.executable
HOLDER = str(PROGS / "node_holder.py")
NODE_SIZE = 4096

ROW_TYPES: dict[str, tuple[type, ...]] = {
    "device": (str,),
    "cls": (str,),
    "index": (int, type(None)),
    "node": (str,),
    "how": (str,),
    "shared_nodes": (list,),  # the class's shared nodes it holds too (one row per device)
    "pid": (int,),
    "starttime": (int,),
    "uid": (int,),
    "user": (str,),
    "command": (str,),
    "origin": (dict,),  # its container, pod, Slurm job or unit, its pid inside (what is known)
    "age_s": (int, float),
    "rss_bytes": (int, type(None)),
    "device_memory_bytes": (int, type(None)),
    "covered": (bool,),
    "lease": (str, type(None)),
    "label": (str, type(None)),
    "why": (str,),
}
DOC_TYPES: dict[str, tuple[type, ...]] = {
    "version": (int,),
    "holders": (list,),
    "stray": (int,),
    "not_inspected": (int,),
    "processes": (int,),
    "scan_seconds": (int, float),
}


# --------------------------------------------------------------------------
# Helpers.


class Procs:
    """What one test started: ``hold run`` clients (ended politely, so that they
    stop their own trees) and plain holders, plus every pid a holder reported
    (escapees are nobody's child); all ended at teardown."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.clients: list[subprocess.Popen[bytes]] = []
        self.plain: list[subprocess.Popen[bytes]] = []
        self.reported: list[Stat] = []
        self.n = 0

    def _out(self) -> Path:
        self.n += 1
        return self.base / f"holder{self.n}.out"

    def holder(
        self,
        how: str,
        node: Path | str,
        *opts: str,
        lease: str | None = None,
        wrap: list[str] | None = None,
    ) -> dict[str, int]:
        """Start a holder (under ``hold run --device LEASE`` when given); its roles -> pids."""
        out = self._out()
        argv = [PY, HOLDER, str(out), how, str(node), *opts]
        if wrap:
            argv = [*wrap, *argv]
        if lease is not None:
            argv = [*HOLD, "run", "--device", lease, "--", *argv]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        (self.clients if lease is not None else self.plain).append(proc)
        want = {"main", "holder"} | ({"child"} if "--child" in opts else set())

        def ready() -> dict[str, int]:  # empty: not yet
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise AssertionError(f"{argv} ended with {proc.returncode}: {err}")
            if not out.exists():
                return {}
            roles = dict(line.split() for line in out.read_text().splitlines())
            return {r: int(p) for r, p in roles.items()} if set(roles) >= want else {}

        roles: dict[str, int] = wait_for(ready, 20, 0.02, f"holder {argv}")
        for pid in roles.values():
            st = scan.stat_of(pid)
            if st is not None:
                self.reported.append(st)
        return roles

    def plain_proc(self, argv: list[str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        self.plain.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.clients:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.clients:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for proc in self.plain:
            proc.kill()
            proc.wait()
        for st in self.reported:
            now = scan.stat_of(st.pid)
            if now is not None and now.starttime == st.starttime and not now.is_dead:
                try:
                    os.kill(st.pid, signal.SIGKILL)
                except OSError:
                    pass
        for proc in self.clients + self.plain:
            if proc.stderr:
                proc.stderr.close()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


def fake_nodes(tmp_path: Path, count: int = 2) -> list[Path]:
    """A class ``fake`` of ``count`` files (added to the test's configuration)."""
    d = tmp_path / "nodes"
    d.mkdir()
    nodes = [d / f"fakedev{i}" for i in range(count)]
    for n in nodes:
        n.write_bytes(b"\0" * NODE_SIZE)
    update_config(tmp_path, devices={"fake": {"nodes": [f"{d}/fakedev*"]}})
    return nodes


def audit(
    *args: str, env: dict[str, str] | None = None, prefix: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*(prefix or []), *HOLD, "audit", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def audit_json(*args: str, code: int | str | None = None, **kw: Any) -> dict[str, Any]:
    """``hold audit --json --device fake``'s document; ``code``: the exit status it
    must have, or ``"clean"``: no stray (0, or 7 where it says it could not read
    every process: see conftest.audit_clean)."""
    res = audit("--json", "--device", "fake", *args, **kw)
    if code is not None:
        want = audit_clean(res.stdout) if code == "clean" else code
        assert res.returncode == want, (res.returncode, res.stdout, res.stderr)
    doc: dict[str, Any] = json.loads(res.stdout)
    return doc


def rows_of(doc: dict[str, Any], pid: int) -> list[dict[str, Any]]:
    return [r for r in doc["holders"] if r["pid"] == pid]


def row_of(doc: dict[str, Any], pid: int) -> dict[str, Any]:
    rows = rows_of(doc, pid)
    assert len(rows) == 1, (pid, doc)
    return rows[0]


def lease_of(index: int) -> dict[str, Any]:
    rec = read_record(os.path.join(os.environ["HOLD_STATE_DIR"], f"fake-{index}.token"))
    assert rec is not None, f"no token for fake:{index}"
    return rec


def open_fds_to(pid: int, node: Path) -> list[str]:
    """The descriptors of ``pid`` that reach ``node`` (an independent look at /proc)."""
    want = os.stat(node)
    out = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            st = os.stat(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            out.append(name)
    return out


def open_to_others(tmp_path: Path) -> None:
    """Let other users reach what is under ``tmp_path`` (pytest makes it 0700)."""
    for p in [tmp_path, *tmp_path.parents]:
        if p == Path("/"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o055)
    for p in tmp_path.rglob("*"):
        os.chmod(p, os.stat(p).st_mode | (0o055 if p.is_dir() else 0o044))


def as_uid(user: str) -> list[str]:
    pw = pwd.getpwnam(user)
    return ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups"]


def user_holder(procs: Procs, user: str, node: Path) -> int:
    """``user`` holds ``node`` open (a shell that opens it on fd 3 and execs sleep)."""
    script = f"exec 3<{shlex.quote(str(node))}; exec sleep 120"
    proc = procs.plain_proc([*as_uid(user), "sh", "-c", script])
    wait_for(lambda: open_fds_to(proc.pid, node), 10, 0.02, f"{user}'s holder of {node}")
    return proc.pid


@functools.cache
def user_python(user: str, runtime: Path) -> str:
    """A Python that ``user`` may run through :func:`as_user` (``env -i`` then exec)."""
    for cand in (unpriv_python(), "/usr/bin/python3"):
        ok = subprocess.run(
            as_user(user, [cand, "-c", "import hold.views.audit"], runtime, {}),
            capture_output=True,
            timeout=30,
        )
        if ok.returncode == 0:
            return cand
    pytest.skip(f"no Python here that {user} may run with the copied runtime")


# --------------------------------------------------------------------------
# Covered and stray.


def test_covered_holders_direct_and_setsid_escapee(
    cgroup_mode: str, tmp_path: Path, procs: Procs
) -> None:
    nodes = fake_nodes(tmp_path)
    direct = procs.holder("fd", nodes[0], lease="fake:0")
    escapee = procs.holder("fd", nodes[1], "--escape", lease="fake:1")
    esc, main = scan.stat_of(escapee["holder"]), scan.stat_of(escapee["main"])
    assert esc is not None and main is not None
    assert esc.session != main.session and esc.ppid != main.pid  # it left

    doc = audit_json(code="clean")
    assert doc["stray"] == 0
    r0 = row_of(doc, direct["holder"])
    lease0 = lease_of(0)
    assert (r0["device"], r0["how"], r0["covered"]) == ("fake:0", "fd", True)
    assert r0["lease"] == lease0["lease"]
    assert r0["why"] == f"descends from holder pid {lease0['holder_pid']}"
    r1 = row_of(doc, escapee["holder"])
    lease1 = lease_of(1)
    assert (r1["device"], r1["covered"], r1["lease"]) == ("fake:1", True, lease1["lease"])
    if cgroup_mode == "cgroup":
        # The lease's client is a subreaper with a leaf too (issue 24): the
        # escapee is its child, and in the lease's cgroup leaf.
        assert lease0["leaves"] and lease1["leaves"]
        assert scan.ancestors(escapee["holder"])[0].pid == lease1["holder_pid"]
        assert r1["why"] in (
            "in the lease's cgroup",
            f"descends from holder pid {lease1['holder_pid']}",
        )
    else:
        # Without a cgroup the client is a child subreaper: the escapee is its
        # child. (The lease names the keeper, the pid its command line started:
        # the client went on below it, hold_supervisor.spawn.keeper.)
        assert not lease1.get("leaves")
        assert esc.ppid == launcher_of(lease1["holder_pid"])
        assert scan.stat_of(esc.ppid).ppid == lease1["holder_pid"]  # type: ignore[union-attr]
        assert r1["why"] == f"descends from holder pid {lease1['holder_pid']}"

    table = audit("--device", "fake")
    assert table.returncode == audit_clean(table.stdout), table.stderr
    assert "STRAY" not in table.stdout and f"{lease0['lease']} " in table.stdout


def test_stray_holder_without_lease(tmp_path: Path, procs: Procs) -> None:
    nodes = fake_nodes(tmp_path)
    h = procs.holder("fd", nodes[0])
    doc = audit_json(code=1)
    r = row_of(doc, h["holder"])
    assert (r["device"], r["covered"], r["lease"], r["label"]) == ("fake:0", False, None, None)
    assert r["why"] == "no live lease on fake:0"
    assert r["node"] == str(nodes[0]) and r["uid"] == os.getuid()
    assert doc["stray"] == 1

    table = audit("--device", "fake")
    assert table.returncode == 1
    line = next(ln for ln in table.stdout.splitlines() if f" {h['holder']} " in ln)
    assert line.startswith("fake:0") and "STRAY: no live lease on fake:0" in line


def test_holder_of_device_1_under_a_lease_for_device_0(tmp_path: Path, procs: Procs) -> None:
    nodes = fake_nodes(tmp_path)
    h = procs.holder("fd", nodes[1], lease="fake:0")
    lease = lease_of(0)
    doc = audit_json(code=1)
    r = row_of(doc, h["holder"])
    assert (r["device"], r["covered"], r["lease"]) == ("fake:1", False, lease["lease"])
    assert r["why"] == f"lease {lease['lease']} is for fake:0, not fake:1"
    table = audit("--device", "fake")
    assert table.returncode == 1 and f"STRAY: lease {lease['lease']} is for fake:0" in table.stdout


def test_holder_with_only_a_mapping(tmp_path: Path, procs: Procs) -> None:
    nodes = fake_nodes(tmp_path)
    h = procs.holder("mmap", nodes[0])
    assert open_fds_to(h["holder"], nodes[0]) == [], "the holder still has a descriptor"
    doc = audit_json(code=1)
    r = row_of(doc, h["holder"])
    assert (r["device"], r["how"], r["covered"]) == ("fake:0", "mmap", False)

    # Covered the same way when inside a lease.
    c = procs.holder("mmap", nodes[1], lease="fake:1")
    doc = audit_json(code=1)
    r = row_of(doc, c["holder"])
    assert (r["device"], r["how"], r["covered"]) == ("fake:1", "mmap", True)


def test_holder_through_a_hard_link(tmp_path: Path, procs: Procs) -> None:
    nodes = fake_nodes(tmp_path)
    other = tmp_path / "elsewhere"
    other.mkdir()
    link = other / "renamed"
    os.link(nodes[1], link)
    h_fd = procs.holder("fd", link)
    h_map = procs.holder("mmap", link)
    doc = audit_json(code=1)
    for pid, how in ((h_fd["holder"], "fd"), (h_map["holder"], "mmap")):
        r = row_of(doc, pid)
        # Matched by the inode, and named by the class's own node.
        assert (r["device"], r["how"], r["node"]) == ("fake:1", how, str(nodes[1]))


def test_holder_through_a_bind_mount(tmp_path: Path, procs: Procs) -> None:
    nodes = fake_nodes(tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    # In a mount namespace of its own, so no mount is left on the host
    # whatever happens to the test.
    bind = f"mount --bind {shlex.quote(str(nodes[0].parent))} {shlex.quote(str(mnt))}"
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", bind],
        capture_output=True,
        text=True,
        timeout=10,
    )
    if probe.returncode != 0:
        pytest.skip(f"mount --bind does not work here: {probe.stderr.strip()}")
    bind = f"mount --bind {shlex.quote(str(nodes[0].parent))} {shlex.quote(str(mnt))}"
    wrap = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        bind + ' && exec "$@"',
        "sh",
    ]
    h = procs.holder("fd", mnt / "fakedev1", wrap=wrap)
    m = procs.holder("mmap", mnt / "fakedev0", wrap=wrap)
    assert os.readlink(f"/proc/{h['holder']}/fd/{open_fds_to(h['holder'], nodes[1])[0]}") == str(
        mnt / "fakedev1"
    )
    doc = audit_json(code=1)
    rh, rm = row_of(doc, h["holder"]), row_of(doc, m["holder"])
    assert (rh["device"], rh["how"], rh["node"]) == ("fake:1", "fd", str(nodes[1]))
    assert (rm["device"], rm["how"], rm["node"]) == ("fake:0", "mmap", str(nodes[0]))


# --------------------------------------------------------------------------
# --kill


def test_kill_stops_the_stray_tree_and_never_a_covered_holder(tmp_path: Path, procs: Procs) -> None:
    nodes = fake_nodes(tmp_path)
    covered = procs.holder("fd", nodes[0], lease="fake:0")
    stray = procs.holder("fd", nodes[1], "--child")
    client = procs.clients[0]

    res = audit("--json", "--device", "fake", "--kill", "--yes", "--grace", "5s")
    # Strays were found and all of them were stopped: nothing left to act on (0, not 1 or 3).
    assert res.returncode == audit_clean(res.stdout), (res.stdout, res.stderr)
    doc = json.loads(res.stdout)
    killed = doc["killed"]
    assert [k["pid"] for k in killed] == [stray["holder"]]
    k = killed[0]
    assert k["stopped"] is True and k["survivors"] == [] and k["outcome"] == "exited"
    assert set(k["members"]) == {stray["holder"], stray["child"]}
    gone = lambda: not alive(stray["holder"]) and not alive(stray["child"])  # noqa: E731
    wait_for(gone, 20, what="the stray tree to end")
    assert alive(covered["holder"]) and client.poll() is None

    after = audit_json(code="clean")
    assert [r["pid"] for r in after["holders"]] == [covered["holder"]]

    # The table says what was stopped.
    s2 = procs.holder("mmap", nodes[1])
    res = audit("--device", "fake", "--kill", "--yes", "--grace", "5s")
    assert res.returncode == audit_clean(res.stdout), (res.stdout, res.stderr)
    assert f"pid {s2['holder']}: stopped exited" in res.stdout
    assert alive(covered["holder"])


def test_kill_reports_a_stray_it_may_not_signal(
    tmp_path: Path, procs: Procs, unpriv_user: str
) -> None:
    """A stray of another user, and a caller without CAP_KILL: the kill fails, and says so."""
    nodes = fake_nodes(tmp_path)
    open_to_others(tmp_path)
    pid = user_holder(procs, unpriv_user, nodes[0])
    # Root without CAP_KILL may read every process but signal only its own.
    no_kill = ["setpriv", "--bounding-set=-kill", "--inh-caps=-kill", "--"]
    res = audit("--json", "--device", "fake", "--kill", "--yes", "--grace", "0", prefix=no_kill)
    assert res.returncode == 3, (res.stdout, res.stderr)
    doc = json.loads(res.stdout)
    assert row_of(doc, pid)["user"] == unpriv_user
    (k,) = doc["killed"]
    assert k["pid"] == pid and k["stopped"] is False
    assert pid in [s["pid"] for s in k["survivors"]]
    assert alive(pid)

    res = audit("--device", "fake", "--kill", "--yes", "--grace", "0", prefix=no_kill)
    assert res.returncode == 3, (res.stdout, res.stderr)
    assert f"pid {pid}: NOT stopped" in res.stdout and f"survivor pid {pid} " in res.stdout


def test_kill_never_stops_the_callers_ancestor(tmp_path: Path, procs: Procs) -> None:
    """A shell that holds the node and runs ``hold audit --kill --yes``: spared, and said so."""
    nodes = fake_nodes(tmp_path)
    node = shlex.quote(str(nodes[0]))
    cmd = shlex.join([*HOLD, "audit", "--json", "--device", "fake", "--kill", "--yes"])
    # The audit is not the shell's last command, so the shell cannot exec it.
    script = f"exec 3<{node}; {cmd} 3<&-; exit $?"
    res = subprocess.run(
        ["sh", "-c", script], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 3, (res.stdout, res.stderr)
    doc = json.loads(res.stdout)
    (row,) = doc["holders"]
    assert row["covered"] is False and row["command"].startswith("sh -c")
    (k,) = doc["killed"]
    assert k["pid"] == row["pid"] and k["stopped"] is False and "ancestor" in k["why"]


def test_kill_without_yes_and_no_terminal_refuses(tmp_path: Path, procs: Procs) -> None:
    nodes = fake_nodes(tmp_path)
    h = procs.holder("fd", nodes[0], "--child")
    res = audit("--device", "fake", "--kill")
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "--kill without --yes needs a terminal" in res.stderr
    assert alive(h["holder"]) and alive(h["child"])


# --------------------------------------------------------------------------
# The document, what may not be inspected, and bad input.


def test_json_schema(tmp_path: Path, procs: Procs) -> None:
    nodes = fake_nodes(tmp_path)
    covered = procs.holder("fd", nodes[0], lease="fake:0")
    stray = procs.holder("mmap", nodes[1])
    doc = audit_json(code=1)
    assert set(doc) == set(DOC_TYPES)
    for key, types in DOC_TYPES.items():
        assert isinstance(doc[key], types) and not isinstance(doc[key], bool), (key, doc[key])
    assert doc["version"] == 1
    assert doc["stray"] == 1 and doc["not_inspected"] >= 0
    assert doc["processes"] >= len(doc["holders"]) and doc["scan_seconds"] >= 0
    assert len(doc["holders"]) == 2
    for r in doc["holders"]:
        assert set(r) == set(ROW_TYPES), r
        for key, types in ROW_TYPES.items():
            assert isinstance(r[key], types), (key, r[key])
            if bool not in types:
                assert not isinstance(r[key], bool), (key, r[key])
        assert r["how"] in ("fd", "mmap") and r["cls"] == "fake"
        assert r["device"] == f"fake:{r['index']}" and r["rss_bytes"] > 0
        assert r["age_s"] >= 0 and r["user"] == pwd.getpwuid(r["uid"]).pw_name
        assert r["starttime"] == scan.stat_of(r["pid"]).starttime  # type: ignore[union-attr]
    c, s = row_of(doc, covered["holder"]), row_of(doc, stray["holder"])
    lease = lease_of(0)
    assert (c["covered"], c["lease"], c["label"]) == (True, lease["lease"], lease["label"])
    assert (s["covered"], s["lease"], s["label"], s["how"]) == (False, None, None, "mmap")
    assert str(stray["holder"]) and HOLDER in s["command"]


def test_scan_limited_by_permission_counts_what_it_could_not_see(
    tmp_path: Path, procs: Procs, unpriv_user: str, unpriv_runtime: Path
) -> None:
    nodes = fake_nodes(tmp_path)
    root_holder = procs.holder("fd", nodes[0])
    user_state = tmp_path / "user-state"
    user_state.mkdir(mode=0o700)
    pw = pwd.getpwnam(unpriv_user)
    os.chown(user_state, pw.pw_uid, pw.pw_gid)
    open_to_others(tmp_path)
    user_pid = user_holder(procs, unpriv_user, nodes[1])
    py = user_python(unpriv_user, unpriv_runtime)
    env = {"HOLD_STATE_DIR": str(user_state), "HOLD_CONFIG": str(tmp_path / "config.yaml")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        argv = as_user(
            unpriv_user, [py, "-m", "hold", "audit", "--device", "fake", *args], unpriv_runtime, env
        )
        return subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60
        )

    res = run("--json")
    assert res.returncode == 1, (res.stdout, res.stderr)
    doc = json.loads(res.stdout)
    # Root's holder cannot be seen by this user, and is counted, not dropped.
    assert rows_of(doc, root_holder["holder"]) == []
    assert doc["not_inspected"] > 0
    r = row_of(doc, user_pid)
    assert (r["device"], r["user"], r["covered"]) == ("fake:1", unpriv_user, False)

    res = run()
    assert res.returncode == 1, (res.stdout, res.stderr)
    tail = res.stdout.strip().splitlines()[-1]
    n = int(tail.split("not inspected: ")[1].split()[0])
    assert n > 0 and tail.endswith(f"not inspected: {n} (permission)"), tail

    # As root, both are seen (and fewer processes are out of reach: in a
    # sandbox even root may not look into its init).
    doc = audit_json(code=1)
    assert doc["not_inspected"] < n
    assert {r["pid"] for r in doc["holders"]} == {root_holder["holder"], user_pid}


def test_scan_counts_descriptors_it_may_list_but_not_follow(
    tmp_path: Path, procs: Procs, unpriv_user: str
) -> None:
    """Root without CAP_SYS_PTRACE may list another user's ``fd/`` (it may read any
    directory) but not follow the links in it: that process is not inspected, and
    counted as such, not passed over as holding nothing."""
    nodes = fake_nodes(tmp_path)
    open_to_others(tmp_path)
    pid = user_holder(procs, unpriv_user, nodes[0])
    assert os.listdir(f"/proc/{pid}/fd")
    no_ptrace = ["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace", "--"]
    # Nothing stray among what it read, but it could not read everything: not
    # "clean" (0), which a script must be able to tell (issue 45).
    doc = audit_json(code=INCOMPLETE, prefix=no_ptrace)
    assert rows_of(doc, pid) == [] and doc["not_inspected"] > 0
    res = audit("--device", "fake", prefix=no_ptrace)
    assert res.returncode == INCOMPLETE and "(permission)" in res.stdout.splitlines()[-1]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--device", "nosuch"], "'nosuch'"),
        (["--yes"], "--yes only goes with --kill"),
        (["--kill", "--grace", "5x"], "5x"),
        (["--grace", "-1"], "-1"),
    ],
)
def test_bad_input_exits_2(tmp_path: Path, procs: Procs, args: list[str], says: str) -> None:
    nodes = fake_nodes(tmp_path)
    h = procs.holder("fd", nodes[0])
    res = audit(*args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert says in res.stderr and "Traceback" not in res.stderr
    assert res.stdout == ""
    assert alive(h["holder"])
