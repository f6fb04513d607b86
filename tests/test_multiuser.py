"""One machine, two real unprivileged users, the default configuration.

Each user runs ``hold`` as a new user would: no ``HOLD_STATE_DIR``, their own
``XDG_RUNTIME_DIR``, so each gets a per-user daemon (told to grant what it cannot
prove free: ``unreadable_processes: ignore``, but in the test of that refusal)
-- and still only one of them holds the device at a time, through the machine-wide kernel lock (in
the real lock directory, ``/run/lock``, named by the test node's identity so
that nothing else on the machine shares it). Then a system daemon, run in a
private mount namespace (its own ``/run``, so the machine's is untouched),
serving both users.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import HOLD, LOADED, alive, as_user, grant_checks, unpriv_python, wait_for

from hold.daemon import devlock
from hold.devices.classes import node_key
from hold.documents import LockRecord
from hold.statedir import system_serves

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="making users needs root")


class World:
    """A directory both users can reach: the device node, the configuration, a
    work directory, and each user's runtime directory."""

    def __init__(self, base: Path, runtime: Path, py: str, users: tuple[str, str]) -> None:
        self.base, self.runtime, self.py, self.users = base, runtime, py, users
        self.work = base / "work"
        self.config = base / "config.yaml"
        self.node = base / "dev" / "accel0"
        self.procs: list[subprocess.Popen[str]] = []
        self.prefix: list[str] = []  # e.g. nsenter into a mount namespace
        self.ns: Namespace | None = None  # a /run of its own (see the world fixture)

    def xdg(self, user: str) -> Path:
        return self.base / f"xdg-{user}"

    def state(self, user: str) -> Path:
        return self.xdg(user) / "hold"

    def env(self, user: str) -> dict[str, str]:
        # Default discovery: no HOLD_STATE_DIR, no HOLD_LOCK_DIR.
        return {"XDG_RUNTIME_DIR": str(self.xdg(user)), "HOLD_CONFIG": str(self.config)}

    def argv(self, user: str, *args: str) -> list[str]:
        return [
            *self.prefix,
            *as_user(user, [self.py, "-m", "hold", *args], self.runtime, self.env(user)),
        ]

    def start(self, user: str, *args: str, name: str) -> subprocess.Popen[str]:
        err = open(self.base / f"{name}.err", "w")  # noqa: SIM115
        try:
            p = subprocess.Popen(
                self.argv(user, *args), stdin=subprocess.DEVNULL, stdout=err, stderr=err, text=True
            )
        finally:
            err.close()
        self.procs.append(p)
        return p

    def err(self, name: str) -> str:
        return (self.base / f"{name}.err").read_text()

    def run(self, user: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(user, *args),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def gated(self, name: str, *extra: str) -> list[str]:
        return [self.py, str(self.runtime / "progs" / "gated.py"), str(self.work), name, *extra]

    def ready(self, name: str, timeout: float = 30) -> int:
        path = self.work / f"{name}.ready"
        return int(wait_for(lambda: path.exists() and path.read_text(), timeout, what=str(path)))

    def lock_name(self) -> str:
        """The device's lock file, as the users' commands see it."""
        key = node_key(str(self.node))
        assert key is not None
        return devlock.lock_path(devlock.LOCK_DIRS[0], key)

    def lock_file(self) -> Path:
        """The device's lock file, as this test reaches it."""
        path = self.lock_name()
        return self.ns.path(path) if self.ns is not None else Path(path)

    def as_user(self, user: str, script: str, *args: str) -> subprocess.CompletedProcess[str]:
        """``python -c script args`` run as ``user``, where the users' commands run."""
        argv = as_user(user, [self.py, "-c", script, *args], self.runtime, self.env(user))
        return subprocess.run(
            [*self.prefix, *argv],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )

    def record_file(self, user: str) -> Path:
        return Path(devlock.record_path(str(self.lock_file()), pwd.getpwnam(user).pw_uid))

    def record(self, user: str) -> LockRecord | None:
        """What ``user``'s daemons say of the lease that holds the lock (believed)."""
        return devlock.read_record(str(self.lock_file()), pwd.getpwnam(user).pw_uid)

    def daemon_pid(self, user: str) -> int | None:
        try:
            text = (self.state(user) / "daemon.lock").read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() and alive(int(text)) else None


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


@pytest.fixture
def world(unpriv_user: str, other_user: str, unpriv_runtime: Path) -> Iterator[World]:
    # A daemon of root's answering in /run/hold (the README's first line, run as
    # root, leaves one for 10 minutes) would be found by default discovery: the
    # users' commands then run in a mount namespace with a /run of its own, so
    # the tests neither skip nor meet it (issue 25).
    ns = Namespace() if system_serves() else None
    py = unpriv_python()
    base = Path(tempfile.mkdtemp(prefix="hold-users-", dir="/tmp"))
    base.chmod(0o755)
    w = World(base, unpriv_runtime, py, (unpriv_user, other_user))
    if ns is not None:
        w.ns, w.prefix = ns, ns.prefix
    (base / "dev").mkdir(mode=0o755)
    w.node.write_text("")
    w.node.chmod(0o666)
    # The per-user daemons here accept that they cannot read each other's
    # processes (unreadable_processes: ignore): these tests are of the kernel
    # locks between them; the refusal without it is test_a_per_user_daemon_
    # refuses_a_device_it_cannot_prove_free.
    w.config.write_text(
        f'devices:\n  npu:\n    nodes: ["{base}/dev/accel*"]\nunreadable_processes: ignore\n'
    )
    w.config.chmod(0o644)
    w.work.mkdir()
    w.work.chmod(0o777)
    (w.work / "order").write_text("")  # appended to by both users' commands
    (w.work / "order").chmod(0o666)
    for user in w.users:
        pw = pwd.getpwnam(user)
        w.xdg(user).mkdir(mode=0o700)
        os.chown(w.xdg(user), pw.pw_uid, pw.pw_gid)
    lock_existed = w.lock_file().exists()
    records_existed = {user: w.record_file(user).exists() for user in w.users}
    try:
        yield w
    finally:
        for p in w.procs:
            if p.poll() is None:
                p.terminate()
        for p in w.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for user in w.users:
            pid = w.daemon_pid(user)
            if pid is not None:
                _kill(pid, signal.SIGTERM)
                wait_for(lambda pid=pid: not alive(pid), 10, what="a user's daemon to stop")
        if not lock_existed:  # ours: named by this test's own node
            w.lock_file().unlink(missing_ok=True)
        for user, existed in records_existed.items():
            if not existed:
                w.record_file(user).unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)
        if ns is not None:
            ns.close()


def test_two_users_with_the_default_configuration_never_hold_one_device_at_once(
    world: World,
) -> None:
    a_user, b_user = world.users
    a = world.start(
        a_user,
        "run",
        "-d",
        "npu",
        "-l",
        "A",
        "-t",
        "1m",
        "--grace",
        "0.5s",
        "--",
        *world.gated("A", "--wait"),
        name="A",
    )
    world.ready("A")
    # Each user has a daemon of their own, found without any variable.
    assert (world.state(a_user) / "daemon.sock").exists()

    busy = world.run(b_user, "run", "-d", "npu", "--no-wait", "-t", "1m", "-l", "B", "--", "true")
    assert busy.returncode == 75, busy.stderr
    # Told whose lease is in the way: user, pid, since.
    assert f"held by user {a_user}'s lease 'A' (pid {a.pid}, since " in busy.stderr
    assert (world.state(b_user) / "daemon.sock").exists()
    assert world.daemon_pid(a_user) != world.daemon_pid(b_user)
    # B's own daemon shows A's lease, from the lock's record: user, pid, since, until.
    st = world.run(b_user, "status")
    assert st.returncode == 0, st.stderr
    assert f"arbiter: per-user daemon of {b_user}" in st.stdout
    line = next(ln for ln in st.stdout.splitlines() if ln.startswith("npu:0"))
    assert f"user {a_user}" in line and f"pid {a.pid}" in line and "via another daemon" in line
    assert "since " in line and "until " in line and "'A'" in line

    # B waits in line, and is woken when A's lease ends.
    b = world.start(
        b_user, "run", "-d", "npu", "-l", "B", "-t", "1m", "--", *world.gated("B"), name="B"
    )
    wait_for(lambda: "waiting for npu" in world.err("B"), 20, what="B to say it waits")
    assert f"user {a_user}'s lease 'A'" in world.err("B")
    assert not (world.work / "B.ready").exists()
    (world.work / "A.go").write_text("")
    assert a.wait(30) == 0, world.err("A")
    world.ready("B")
    assert b.wait(30) == 0, world.err("B")
    assert (world.work / "order").read_text().split() == ["A", "B"]


def test_no_single_sigkill_frees_a_device_whose_tree_may_still_run(world: World) -> None:
    a_user, b_user = world.users
    a = world.start(
        a_user,
        "run",
        "-d",
        "npu",
        "-l",
        "A",
        "-t",
        "1m",
        "--grace",
        "0.5s",
        "--",
        *world.gated("A", "--wait"),
        name="A",
    )
    command = world.ready("A")
    first = world.daemon_pid(a_user)
    assert first is not None

    # A's daemon dies: A's client still holds the lock.
    _kill(first)
    wait_for(lambda: not alive(first), 10, what="A's daemon to die")
    busy = world.run(b_user, "run", "-d", "npu", "--no-wait", "-t", "1m", "--", "true")
    assert busy.returncode == 75, busy.stderr
    # The client re-attaches to a new daemon and hands it the lock back.
    wait_for(lambda: "re-attached" in world.err("A"), 20, what="A to re-attach")

    # Now A's client dies: the new daemon still holds the lock until A's tree is stopped.
    # (A zombie is gone: its parent died, and pytest, the subreaper, reaps it later.)
    probe = (
        "try:\n"
        f"    state = open('/proc/{command}/stat').read().rsplit(')', 1)[1].split()[0]\n"
        "except OSError:\n"
        "    state = 'gone'\n"
        "print('A-command-alive' if state not in ('Z', 'X', 'gone') else 'A-command-gone')\n"
    )
    b = world.start(
        b_user, "run", "-d", "npu", "-l", "B", "-t", "1m", "--", world.py, "-c", probe, name="B"
    )
    wait_for(lambda: "waiting for npu" in world.err("B"), 20, what="B to wait")
    _kill(a.pid)
    assert b.wait(30) == 0, world.err("B")
    assert "A-command-gone" in world.err("B")
    assert not alive(command)


def test_another_user_can_neither_pass_a_check_nor_release(world: World) -> None:
    a_user, b_user = world.users
    world.start(
        a_user,
        "run",
        "-d",
        "npu",
        "-l",
        "A",
        "-t",
        "1m",
        "--",
        *world.gated("A", "--wait"),
        name="A",
    )
    world.ready("A")
    rec = wait_for(lambda: world.record(a_user), 10, what="A's lock record")
    assert rec.user == a_user and rec.label == "A"

    # B forges a token naming B's own shell in a directory B controls.
    forged = world.base / "forged"
    forged.mkdir(mode=0o777)
    forged.chmod(0o777)
    script = (
        "import json, os, subprocess, sys\n"
        "st = open('/proc/self/stat').read().rsplit(')', 1)[1].split()\n"
        "rec = {'lease': 'ffff', 'cls': 'npu', 'label': 'B', 'holder_pid': os.getpid(),\n"
        "       'holder_start': int(st[19]), 'leaves': []}\n"
        f"open({str(forged / 'npu-0.token')!r}, 'w').write("
        "f'npu-hold B pid {os.getpid()} now\\n' + json.dumps(rec) + '\\n')\n"
        "sys.exit(subprocess.call([sys.executable, '-m', 'hold', 'check', '--device', 'npu']))\n"
    )
    env = {**world.env(b_user), "HOLD_STATE_DIR": str(forged)}
    res = subprocess.run(
        as_user(b_user, [world.py, "-c", script], world.runtime, env),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 1, res.stderr
    assert "no npu lease covers this process" in res.stderr
    assert (forged / "npu-0.token").exists()

    # B cannot end A's lease: B's arbiter does not know it, and A's is not B's to ask.
    res = world.run(b_user, "release", rec.lease)
    assert res.returncode == 2 and "no live lease" in res.stderr, res.stderr
    assert (world.work / "A.ready").exists() and not (world.work / "A.go").exists()
    assert devlock.is_locked(str(world.lock_file()))
    (world.work / "A.go").write_text("")


# --------------------------------------------------------------------------
# The system daemon, in a mount namespace of its own (a private /run).


class Namespace:
    """A private mount namespace with its own /run (tmpfs, /run/lock 1777),
    kept alive by one process; commands enter it with nsenter."""

    def __init__(self) -> None:
        self.holder = subprocess.Popen(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                "mount -t tmpfs -o mode=755 tmpfs /run && mkdir -m 1777 /run/lock && "
                "echo ready && exec sleep 600",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.holder.stdout is not None
        line = self.holder.stdout.readline()
        if line.strip() != "ready":
            self.holder.kill()
            self.holder.wait()
            pytest.skip("no private mount namespace here (unshare --mount failed)")
        self.prefix = ["nsenter", f"--mount=/proc/{self.holder.pid}/ns/mnt", "--"]

    def path(self, inside: str) -> Path:
        """A path as seen inside the namespace, reached from outside."""
        return Path(f"/proc/{self.holder.pid}/root") / inside.lstrip("/")

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait(10)
        assert self.holder.stdout is not None
        self.holder.stdout.close()


@pytest.fixture
def system(world: World) -> Iterator[tuple[World, Namespace, subprocess.Popen[str]]]:
    ns = Namespace()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HOLD_STATE_DIR", "HOLD_LOCK_DIR", "XDG_RUNTIME_DIR")
    }
    env["HOLD_CONFIG"] = str(world.config)
    log = open(world.base / "system.err", "w")  # noqa: SIM115
    daemon = subprocess.Popen(
        [*ns.prefix, *HOLD, "daemon", "--system"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
    )
    log.close()
    world.ns, world.prefix = ns, ns.prefix
    try:
        sock = ns.path("/run/hold/daemon.sock")
        wait_for(lambda: sock.exists() or daemon.poll() is not None, 20, what="system daemon")
        assert daemon.poll() is None, (world.base / "system.err").read_text()
        assert sock.stat().st_mode & 0o777 == 0o666
        yield world, ns, daemon  # type: ignore[misc]
    finally:
        for p in world.procs:
            if p.poll() is None:
                p.terminate()
        for p in world.procs:
            p.wait(15)
        if daemon.poll() is None:
            daemon.terminate()
            daemon.wait(20)
        ns.close()


def _raw(world: World, user: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Send ``messages`` on one connection to the system daemon as ``user``; the answers."""
    script = (
        "import json, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX); s.settimeout(10)\n"
        "s.connect('/run/hold/daemon.sock'); f = s.makefile('rwb')\n"
        "out = []\n"
        "for m in json.loads(sys.argv[1]):\n"
        "    f.write(json.dumps(m).encode() + b'\\n'); f.flush()\n"
        "    line = f.readline()\n"
        "    out.append(json.loads(line) if line else None)\n"
        "print(json.dumps(out))\n"
    )
    argv = [
        *world.prefix,
        *as_user(
            user, [world.py, "-c", script, json.dumps(messages)], world.runtime, world.env(user)
        ),
    ]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    out: list[dict[str, Any]] = json.loads(res.stdout)
    return out


def test_the_system_daemon_serves_every_user_and_trusts_none_with_anothers_tree(
    system: tuple[World, Namespace, subprocess.Popen[str]],
) -> None:
    world, ns, daemon = system
    a_user, b_user = world.users
    # Found without any variable (XDG_RUNTIME_DIR is set, and not used).
    a = world.start(
        a_user,
        "run",
        "-d",
        "npu",
        "-l",
        "A",
        "--private",
        "-t",
        "1m",
        "--",
        *world.gated("A", "--wait"),
        name="A",
    )
    command = world.ready("A")
    assert not (world.state(a_user) / "daemon.sock").exists()
    tok = wait_for(lambda: _token(ns), 10, what="A's token in /run/hold")
    assert tok["user"] == a_user
    # The token is everyone's to read: a private label is not in it.
    first = ns.path("/run/hold/npu-0.token").read_text().splitlines()[0]
    assert tok["label"] is None and first.startswith("npu-hold private pid "), first

    st = world.run(b_user, "status")
    assert st.returncode == 0, st.stderr
    assert "arbiter: system daemon" in st.stdout
    assert f"user {a_user}" in st.stdout and "(private)" in st.stdout and "'A'" not in st.stdout
    own = world.run(a_user, "status")
    assert "'A'" in own.stdout, own.stdout

    busy = world.run(b_user, "run", "-d", "npu", "--no-wait", "-t", "1m", "--", "true")
    assert busy.returncode == 75 and f"user {a_user}" in busy.stderr, busy.stderr
    assert "held by a private lease" in busy.stderr and "None" not in busy.stderr, busy.stderr
    res = world.run(b_user, "release", tok["lease"])
    assert res.returncode == 2 and f"belongs to {a_user}" in res.stderr, res.stderr

    # B names A's registered tree: refused. B names the marker of an A process
    # that no one registered, then hangs up: the daemon stops B's "tree" only
    # as far as B could, and A's process lives.
    answers = _raw(world, b_user, [{"op": "open"}, {"op": "tree", "tree_id": tok["trees"][0]}])
    assert answers[1]["ev"] == "error", answers
    marker = "0123456789abcdef"
    stray = subprocess.Popen(
        as_user(a_user, ["sleep", "60"], world.runtime, {"HOLD_TREE": marker}),
    )
    world.procs.append(stray)
    wait_for(lambda: _marker_of(stray.pid) == marker, 10, what="A's marked process")
    answers = _raw(world, b_user, [{"op": "open"}, {"op": "tree", "tree_id": marker}])
    assert answers[1] == {"ev": "ok", "tree": marker}, answers
    log = ns.path("/run/hold/daemon.log")
    wait_for(
        lambda: (
            f'"tree": "{marker}"' in log.read_text()
            and "tree_stopped" in log.read_text().split(marker, 1)[1]
        ),
        20,
        what="B's session to end",
    )
    assert stray.poll() is None and alive(command) and a.poll() is None
    stray.terminate()
    stray.wait(10)
    (world.work / "A.go").write_text("")
    assert a.wait(30) == 0, world.err("A")

    # The system daemon down: a user pointed at its directory gets a clear error.
    daemon.terminate()
    assert daemon.wait(20) == 0
    stack = world.base / "stack.yaml"
    stack.write_text("name: mu\nunits:\n  one:\n    cmd: [sleep, '30']\n")
    stack.chmod(0o644)

    def as_b(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**world.env(b_user), "HOLD_STATE_DIR": "/run/hold"}
        argv = [
            *world.prefix,
            *as_user(b_user, [world.py, "-m", "hold", *args], world.runtime, env),
        ]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)

    res = as_b("status")
    assert res.returncode == 125, res.stderr
    assert res.stderr.startswith("hold status: no ticket daemon serves /run/hold"), res.stderr
    assert "the system daemon, it is down" in res.stderr
    # A stack without a device runs unguarded, says so, and keeps its files in
    # the user's own directory (the system's is root's).
    res = as_b("up", "--for", "1s", str(stack))
    assert res.returncode == 0, res.stderr
    assert "no guardian" in res.stderr and "it is down" in res.stderr, res.stderr
    assert (world.xdg(b_user) / "hold" / "stacks").is_dir()
    for out in (res.stderr, *(as_b(*a).stderr for a in (("release", "x"), ("check",)))):
        assert "Traceback" not in out and "Error:" not in out, out


def _token(ns: Namespace) -> dict[str, Any] | None:
    from hold.daemon.tokens import read_record

    return read_record(str(ns.path("/run/hold/npu-0.token")))


def _marker_of(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"HOLD_TREE="):
            return item[10:].decode()
    return None


def test_a_lock_file_planted_by_someone_never_hangs_and_root_takes_it_back(
    tmp_path: Path,
) -> None:
    """A FIFO or a symlink at a lock file's name never hangs an open nor is
    followed; root's daemon (this test is root) removes it and makes the lock
    file. A directory there cannot be removed that way: it counts as held."""
    t0 = time.monotonic()
    fifo = tmp_path / "hold-dev-x.lock"
    os.mkfifo(fifo)
    fd = devlock.open_lock(str(fifo))
    os.close(fd)
    assert stat.S_ISREG(fifo.lstat().st_mode) and stat.S_IMODE(fifo.lstat().st_mode) == 0o666
    link = tmp_path / "hold-dev-y.lock"
    link.symlink_to(tmp_path / "elsewhere")
    os.close(devlock.open_lock(str(link)))
    assert not link.is_symlink() and not (tmp_path / "elsewhere").exists()
    mine = tmp_path / "hold-dev-z.lock"
    mine.write_text("")
    mine.chmod(0o600)  # another user's, theirs alone: no other user's daemon could open it
    os.close(devlock.open_lock(str(mine)))
    assert stat.S_IMODE(mine.stat().st_mode) == 0o666
    planted = tmp_path / "hold-dev-w.lock"
    planted.mkdir()
    with pytest.raises(devlock.LockUnusable):
        devlock.open_lock(str(planted))
    assert time.monotonic() - t0 < LOADED  # nothing waited on what another user made


def test_another_user_can_neither_rewrite_nor_plant_a_leases_record(world: World) -> None:
    """User B rewrites the lock file with a record that keeps A's daemon's pid
    (which the kernel names as the lock's holder) and says "forged"; B cannot
    write A's own record file. What B's ``hold status`` shows of A's lease is
    what A's daemon wrote. Where B made A's record file before A's lease, A
    still gets the device, and B's status says the record was made by B
    rather than believing it (it believed any record naming the holder)."""
    a_user, b_user = world.users
    planted = world.record_file(a_user)
    if planted.exists():
        pytest.skip(f"{planted} exists already (another run's): not ours to plant over")
    forge = (
        "import json, sys\n"
        "lock, rec = sys.argv[1], json.loads(open(sys.argv[2]).read())\n"
        "rec['label'] = rec['user'] = 'forged'\n"
        "open(lock, 'w').write(json.dumps(rec))\n"
        "try:\n"
        "    open(sys.argv[2], 'w')\n"
        "except PermissionError:\n"
        "    print('refused')\n"
    )
    world.start(a_user, "run", "-d", "npu", "-l", "A", "--", *world.gated("A", "--wait"), name="A")
    world.ready("A")
    rec = wait_for(lambda: world.record(a_user), 10, what="A's lock record")
    assert rec.label == "A" and rec.daemon_pid == world.daemon_pid(a_user)
    a_record = devlock.record_path(world.lock_name(), pwd.getpwnam(a_user).pw_uid)
    res = world.as_user(b_user, forge, world.lock_name(), a_record)
    assert res.returncode == 0 and res.stdout == "refused\n", (res.stdout, res.stderr)
    status = world.run(b_user, "status")
    line = next(ln for ln in status.stdout.splitlines() if ln.startswith("npu:0"))
    assert "'A'" in line and a_user in line and "forged" not in line, line
    (world.work / "A.go").write_text("")
    world.procs[-1].wait(30)

    # B makes A's record file before A's next lease: A's daemon cannot write it.
    planted.unlink()
    res = world.as_user(b_user, "import sys; open(sys.argv[1], 'w').write('{}')", a_record)
    assert res.returncode == 0, res.stderr
    world.start(
        a_user, "run", "-d", "npu", "-l", "A2", "--", *world.gated("A2", "--wait"), name="A2"
    )
    world.ready("A2")
    status = world.run(b_user, "status")
    line = next(ln for ln in status.stdout.splitlines() if ln.startswith("npu:0"))
    assert f"made by user {b_user}, not believed" in line and a_user in line, line
    (world.work / "A2.go").write_text("")
    assert world.procs[-1].wait(30) == 0, world.err("A2")


@pytest.mark.parametrize("planted", ["0600 file", "fifo"])
def test_a_lock_file_planted_by_another_user_is_shown_unusable_not_free(
    world: World, planted: str
) -> None:
    """User B makes the device's lock file theirs alone (0600), or a FIFO, before
    anyone: user A's own daemon cannot open it, so the device cannot be granted
    (exit 75, the file named, no hang) -- and ``hold status`` says so rather
    than "free" (it said free, issue 24). Root's daemon takes such a file back
    (the test above)."""
    a_user, b_user = world.users
    lock = world.lock_file()
    if lock.exists():
        pytest.skip(f"{lock} exists already (another run's): not ours to plant over")
    pw = pwd.getpwnam(b_user)
    if planted == "fifo":
        os.mkfifo(lock, 0o600)
    else:
        lock.write_text("")
        lock.chmod(0o600)
    os.chown(lock, pw.pw_uid, pw.pw_gid)
    t0 = time.monotonic()
    res = world.run(a_user, "run", "-d", "npu", "--no-wait", "--", "true")
    assert res.returncode == 75, res.stderr
    assert str(world.lock_file().name) in res.stderr and "cannot be locked" in res.stderr, (
        res.stderr
    )
    status = world.run(a_user, "status")
    assert status.returncode == 0, status.stderr
    line = next(ln for ln in status.stdout.splitlines() if ln.startswith("npu:0"))
    assert "unusable" in line and "free" not in line, line
    # Who made it so: the file's owner; and no holder's pid (none holds it).
    assert f"user {b_user}" in line and "pid -" in line and "None" not in line, line
    assert time.monotonic() - t0 < 30  # nothing hung on the FIFO


@pytest.mark.timeout(240)
def test_the_system_daemon_survives_a_hostile_user(
    system: tuple[World, Namespace, subprocess.Popen[str]],
) -> None:
    """User B feeds the hostile-message corpus (and a seeded fuzz) to the
    machine's daemon while user A holds a lease: A's lease and command are
    untouched, the daemon is the same process, and it still serves."""
    import base64
    import random

    import test_hostile as th

    world, ns, daemon = system
    a_user, b_user = world.users
    a = world.start(
        a_user,
        "run",
        "-d",
        "npu",
        "-l",
        "A",
        "-t",
        "5m",
        "--",
        *world.gated("A", "--wait"),
        name="A",
    )
    command = world.ready("A")
    # The token once it names A's command: the client tells the daemon its pid
    # after the command runs, and the token is written again then.
    tok = wait_for(
        lambda: (t := _token(ns)) and t.get("command_pid") is not None and t,
        10,
        what="A's token naming its command",
    )
    items = [*th.framing_items(), *th.encoding_items(), *th.json_items(), *th.field_items()]
    rng = random.Random(9)
    cases = [(prelude, payload) for _, payload, prelude, _ in items if len(payload) < 200_000]
    cases += [([], th.mutate(rng)) for _ in range(200)]
    corpus = world.base / "corpus.json"
    corpus.write_text(json.dumps([[p, base64.b64encode(b).decode()] for p, b in cases]))
    corpus.chmod(0o644)
    script = (
        "import base64, json, socket, sys\n"
        "sent = 0\n"
        "for prelude, payload in json.load(open(sys.argv[1])):\n"
        "    s = socket.socket(socket.AF_UNIX); s.settimeout(1.0)\n"
        "    try:\n"
        "        s.connect('/run/hold/daemon.sock')\n"
        "        for m in prelude:\n"
        "            s.sendall(json.dumps(m).encode() + b'\\n')\n"
        "        s.sendall(base64.b64decode(payload))\n"
        "        s.shutdown(socket.SHUT_WR)\n"  # the daemon answers, sees the end, closes
        "        while s.recv(65536):\n"
        "            pass\n"
        "    except OSError:\n"
        "        pass\n"
        "    finally:\n"
        "        s.close()\n"
        "    sent += 1\n"
        "print(sent)\n"
    )
    argv = [
        *world.prefix,
        *as_user(b_user, [world.py, "-c", script, str(corpus)], world.runtime, world.env(b_user)),
    ]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert int(res.stdout) == len(cases) > 250
    # Nothing of A's was touched, and the daemon is the same, serving.
    assert daemon.poll() is None
    assert _token(ns) == tok
    assert a.poll() is None and alive(command)
    st = world.run(b_user, "status")
    assert st.returncode == 0 and f"user {a_user}" in st.stdout, st.stderr
    log = ns.path("/run/hold/daemon.log").read_text()
    assert "request_failed" not in log  # every bad message was refused, none crashed a handler
    (world.work / "A.go").write_text("")
    assert a.wait(30) == 0, world.err("A")


def test_a_per_user_daemon_believes_its_count_only_until_an_open(world: World) -> None:
    # A per-user daemon cannot read other users' processes: a close may belong
    # to a file its scan never saw, so its count says "empty" only until the
    # node is opened again (hold.daemon.occupancy, "opens only"). As root the same
    # lease would be followed back to zero (tests/test_occupancy_count.py).
    user = world.users[0]
    for _ in range(2):
        res = world.run(user, "run", "-d", "npu", "--", "true")
        assert res.returncode == 0, res.stderr
    opened = world.run(user, "run", "-d", "npu", "--", "sh", "-c", f"exec 3<{world.node}")
    assert opened.returncode == 0, opened.stderr
    res = world.run(user, "run", "-d", "npu", "--", "true")
    assert res.returncode == 0, res.stderr
    lines = (world.state(user) / "daemon.log").read_text().splitlines()
    log = [json.loads(line) for line in lines if line.startswith("{")]
    # The lease that opened the node is followed by a scan at its end (which
    # starts the count again), so the grant after it needs none.
    checks = grant_checks(world.state(user))
    assert checks == ["scan", "count", "count", "count"], checks
    scans = [(ev["at"], ev["why"]["0"]) for ev in log if ev["event"] == "scan_needed"]
    assert scans == [
        ("grant", "no scan since the watch started"),
        ("lease end", "opened since the last scan"),
    ], scans


def test_a_per_user_daemon_refuses_a_device_it_cannot_prove_free(world: World) -> None:
    """User B's process holds the node; user A's own daemon may not read B's
    processes, so its scan sees nobody -- and it did grant (issue 24). Now it
    refuses (exit 2: waiting cannot change it), says why and what to do, and
    grants only where the configuration accepts the risk."""
    a_user, b_user = world.users
    world.config.write_text(f'devices:\n  npu:\n    nodes: ["{world.node}"]\n')
    ready = world.work / "holder.ready"
    code = (
        "import sys, time; f = open(sys.argv[1]); "
        "open(sys.argv[2], 'w').write('1'); time.sleep(120)"
    )
    holder = subprocess.Popen(
        [
            *world.prefix,
            *as_user(
                b_user, [world.py, "-c", code, str(world.node), str(ready)], world.runtime, {}
            ),
        ],
        stdin=subprocess.DEVNULL,
    )
    world.procs.append(holder)
    wait_for(ready.exists, 30, what="user B's process to open the node")

    res = world.run(a_user, "run", "-d", "npu", "-t", "1m", "--", "true")
    assert res.returncode == 2, res.stderr
    assert "npu:0 cannot be proven free" in res.stderr, res.stderr
    assert f"runs as {a_user}" in res.stderr and "of other users" in res.stderr, res.stderr
    assert "system daemon" in res.stderr and "unreadable_processes: ignore" in res.stderr
    log = (world.state(a_user) / "daemon.log").read_text()
    assert '"grant_unproven"' in log and '"granted"' not in log, log[-2000:]
    # hold status says so too, not "free" (issue 45): why, and what to do.
    shown = world.run(a_user, "status", "--json")
    assert shown.returncode == 0, shown.stderr
    dev = json.loads(shown.stdout)["classes"]["npu"]["devices"][0]
    assert dev["holder"] is None and dev["known"] == "unproven", dev
    assert f"runs as {a_user}" in dev["proof"] and "system daemon" in dev["proof"], dev
    out = world.run(a_user, "status").stdout
    (line,) = [ln for ln in out.splitlines() if ln.startswith("npu:0")]
    assert line.split()[1] == "unproven", out

    # The documented setting: the risk accepted, the scan's word stands (it
    # sees nobody: B's process is not its to read).
    world.config.write_text(
        f'devices:\n  npu:\n    nodes: ["{world.node}"]\nunreadable_processes: ignore\n'
    )
    assert world.run(a_user, "daemon", "--reload").returncode == 0
    res = world.run(a_user, "run", "-d", "npu", "-t", "1m", "--", "true")
    assert res.returncode == 0, res.stderr
    assert holder.poll() is None  # nobody stopped B's process: not A's to stop
