"""cgroup v2 leaves: membership that ``setsid`` and double-forking cannot escape.

A tree that lives in a cgroup leaf of its own can be killed atomically
(``cgroup.kill``, Linux 5.14+: processes forking during the kill die too), and
``populated 0`` in ``cgroup.events`` proves it empty. We create leaves under
the cgroup this process already lives in, which works as root and in a
delegated subtree (systemd ``Delegate=yes``, a user's ``user@.service``), and
needs no controller: without controllers in ``subtree_control`` a cgroup may
hold processes and children at once.
"""

from __future__ import annotations

import errno
import os
import re
import select
import time

from hold_supervisor.errors import SupervisorError
from hold_supervisor.proc import scan


class CgroupUnavailable(SupervisorError):
    """No writable cgroup v2 hierarchy here; callers fall back to walking /proc."""


def v2_mount() -> str | None:
    """Where the cgroup v2 hierarchy is mounted, from ``/proc/self/mountinfo``.

    Not assumed to be ``/sys/fs/cgroup``: on hybrid hosts it is
    ``/sys/fs/cgroup/unified``, and containers mount it where they like.
    """
    try:
        lines = scan.read_raw("self", "mountinfo").splitlines()
    except OSError:
        return None
    for line in lines:
        pre, sep, post = line.partition(b" - ")
        if sep and post.split(b" ", 1)[0] == b"cgroup2":
            # Mount points escape spaces as \040.
            return pre.split(b" ")[4].decode().replace("\\040", " ")
    return None


def own_cgroup(pid: int | str = "self") -> str | None:
    """This process's place in the v2 hierarchy (the ``0::`` line of /proc/PID/cgroup)."""
    try:
        lines = scan.read_raw(pid, "cgroup").splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(b"0::"):
            return line[3:].decode()
    return None


def cgroup_dir(pid: int | str, mount: str | None) -> str | None:
    """The directory of the cgroup that ``pid`` is in (``mount`` is :func:`v2_mount`),
    or None where it has none or there is no v2 hierarchy."""
    rel = own_cgroup(pid)
    if mount is None or rel is None:
        return None
    return os.path.normpath(mount + rel)


def within(path: str, top: str) -> bool:
    """Is the cgroup directory ``path`` the cgroup ``top`` or one below it?

    By whole path components (``/a/b-2`` is not inside ``/a/b``), on paths
    as given: normalise both first where they may differ in form.
    """
    return path == top or path.startswith(top + "/")


def removed(e: OSError) -> bool:
    """Is ``e`` a cgroup file's way of saying its cgroup is gone: removed
    (ENOENT), or being removed -- ENODEV, from a file opened just before the
    rmdir deactivated it (3 runs in 30 of an adopted job's release, under load)?"""
    return e.errno in (errno.ENOENT, errno.ENODEV)


class Leaf:
    """A cgroup v2 directory that holds exactly one tree."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path

    def __repr__(self) -> str:
        return f"Leaf({self.path!r})"

    @property
    def procs_file(self) -> str:
        return f"{self.path}/cgroup.procs"

    def pids(self) -> list[int]:
        """Processes in the leaf now, and in any cgroup below it (an empty list once
        it is gone).

        Below it: a task unit's calls each get a leaf inside the unit's leaf, and
        the unit's tree (what the guardian stops) is all of them, as it is for
        ``cgroup.kill`` and ``populated``, which count the whole subtree too.
        """
        try:
            with open(self.procs_file, "rb") as f:
                out = [int(x) for x in f.read().split()]
        except OSError as e:
            if removed(e):
                return []
            raise
        try:
            subs = [e.path for e in os.scandir(self.path) if e.is_dir(follow_symlinks=False)]
        except OSError:
            subs = []
        for sub in subs:
            out.extend(Leaf(sub).pids())
        return out

    def populated(self) -> bool:
        """False once no process of the tree is left (zombies do not count)."""
        try:
            with open(f"{self.path}/cgroup.events", "rb") as f:
                return _populated(f.read())
        except OSError as e:
            if removed(e):
                return False
            raise

    def wait_empty(self, timeout: float) -> bool:
        """Block until the leaf is empty or ``timeout`` passes; True if empty.

        ``cgroup.events`` raises POLLPRI on every change, so this wakes the
        moment the last process exits instead of polling at some interval.
        """
        deadline = time.monotonic() + timeout
        try:
            fd = os.open(f"{self.path}/cgroup.events", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            if removed(e):
                return True
            raise
        try:
            poller = select.poll()
            poller.register(fd, select.POLLPRI | select.POLLERR)
            while True:
                # Read the *polled* descriptor: kernfs keeps reporting the
                # event until that same open file has been read again, so a
                # read through another descriptor would make poll spin.
                try:
                    if not _populated(os.pread(fd, 4096, 0)):
                        return True
                except OSError:  # the leaf was removed
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                poller.poll(left * 1000)
        finally:
            os.close(fd)

    def move(self, pid: int) -> None:
        """Move the running process ``pid`` (all its threads) into the leaf.

        ``OSError``: ESRCH once it is gone; EACCES or EPERM where this user may
        not write the ``cgroup.procs`` of the common ancestor of where it is and
        the leaf (it lives outside this user's delegation).
        """
        fd = os.open(self.procs_file, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, str(pid).encode())
        finally:
            os.close(fd)

    def kill(self) -> None:
        """SIGKILL every process in the leaf, atomically with respect to forks."""
        try:
            with open(f"{self.path}/cgroup.kill", "w") as f:
                f.write("1")
        except OSError as e:
            if not removed(e):
                raise

    def remove(self, root: str) -> None:
        """Remove the (empty) leaf; ``root`` is the directory it must lie under."""
        real_root = os.path.realpath(root)
        real = os.path.realpath(self.path)
        if os.path.islink(self.path) or os.path.dirname(real) != real_root:
            raise ValueError(f"refusing to remove {self.path}: not a leaf directly under {root}")
        # Empty cgroups below it first (a task's call leaves, left by a stop
        # that the owner did not live to clean up); a busy one keeps it all.
        try:
            subs = [e.name for e in os.scandir(real) if e.is_dir(follow_symlinks=False)]
        except OSError:
            subs = []
        for name in subs:
            Leaf(os.path.join(real, name)).remove(real)
        try:
            os.rmdir(real)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise


def _populated(events: bytes) -> bool:
    for line in events.splitlines():
        if line.startswith(b"populated "):
            return line.split()[1] != b"0"
    return True  # no such key: assume the worst


def _writable(path: str) -> bool:
    """May this user make leaves in ``path`` and move its processes into them?"""
    return os.access(path, os.W_OK | os.X_OK) and os.access(f"{path}/cgroup.procs", os.W_OK)


class Hierarchy:
    """Where this process may create leaves: its own cgroup, or the nearest
    ancestor of it that this user may write (a delegated subtree)."""

    def __init__(self, base: str) -> None:
        self.base = base

    @classmethod
    def find(cls) -> Hierarchy:
        """The writable cgroup v2 directory for this process's leaves, or
        :class:`CgroupUnavailable` saying why there is none.

        The process's own cgroup when this user may write it (root; or a
        process inside a delegated subtree: systemd's ``user@UID.service``,
        a unit with ``Delegate=yes``, ``systemd-run --user --scope``). Else
        the nearest ancestor that this user may write -- a delegation that
        holds the process in a cgroup made by someone else below it -- since
        moving a process into a leaf takes write access to the
        ``cgroup.procs`` of the common ancestor of where it is and where it
        goes, and that ancestor is then the delegation. No ancestor above
        the hierarchy's mount (a container's, a cgroup namespace's root).

        Nothing is done for a process outside every delegation (a login
        session's ``session-N.scope`` belongs to root): it could not move its
        own children into a leaf anywhere, so it walks /proc instead.
        """
        mount = v2_mount()
        if mount is None:
            raise CgroupUnavailable("no cgroup v2 hierarchy is mounted")
        rel = own_cgroup()
        if rel is None:
            raise CgroupUnavailable("this process has no cgroup v2 membership")
        mount = os.path.normpath(mount)
        own = os.path.normpath(mount + rel)
        if not os.path.isfile(f"{own}/cgroup.procs"):
            raise CgroupUnavailable(f"{own}: not a cgroup v2 directory")
        base = own
        while True:
            if _writable(base):
                return cls(base)
            if base == mount or not within(base, mount):
                break
            base = os.path.dirname(base)
        raise CgroupUnavailable(
            f"{own}: not writable by this user, nor any cgroup above it (no delegation)"
        )

    @classmethod
    def of_process(cls, pid: int) -> Hierarchy:
        """Where leaves for the running process ``pid`` go: in its own cgroup, so that
        what is moved into one keeps the limits and the accounting of where it ran.
        :class:`CgroupUnavailable` where there is none, or this user may not write it."""
        mount = v2_mount()
        if mount is None:
            raise CgroupUnavailable("no cgroup v2 hierarchy is mounted")
        where = cgroup_dir(pid, mount)
        if where is None or not os.path.isfile(f"{where}/cgroup.procs"):
            raise CgroupUnavailable(f"pid {pid} has no cgroup v2 membership")
        if not _writable(where):
            raise CgroupUnavailable(f"{where} (pid {pid}'s cgroup): not writable by this user")
        return cls(where)

    def create(self, name: str) -> Leaf:
        """A fresh leaf ``NAME.PID.START`` (its creator, this process, in its name).

        The creator's identity is the name so that it holds from the ``mkdir``
        on: a creator killed before it gave the leaf to anyone who would remove
        it (its registration with a daemon, its tree's stop) leaves an empty
        leaf nobody knew of; the next leaf made here removes it
        (:func:`sweep_stale`)."""
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"bad cgroup leaf name {name!r}")
        sweep_stale(self.base)
        path = f"{self.base}/{name}.{creator_suffix()}"
        try:
            os.mkdir(path)
        except OSError as e:
            raise CgroupUnavailable(f"cannot create {path}: {e.strerror}") from None
        # The root cgroup has no cgroup.kill, so ask the new leaf.
        if not os.path.isfile(f"{path}/cgroup.kill"):
            os.rmdir(path)
            raise CgroupUnavailable(f"{path}: no cgroup.kill (needs Linux 5.14 or newer)")
        return Leaf(path)


# A leaf's name: what its maker asked for, then the maker's pid and start time.
_MADE_BY = re.compile(r"hold-[0-9a-z]+\.([0-9]+)\.([0-9]+)")
_own_suffix: str | None = None


def creator_suffix() -> str:
    """``PID.START`` of this process, for the names of the leaves it makes."""
    global _own_suffix
    pid = os.getpid()
    if _own_suffix is None or not _own_suffix.startswith(f"{pid}."):  # a fork makes its own
        st = scan.stat_of(pid)
        _own_suffix = f"{pid}.{st.starttime if st is not None else 0}"
    return _own_suffix


def made_by(name: str) -> tuple[int, int] | None:
    """The ``(pid, start time)`` of the process that made the leaf ``name``; None for a
    name not of :meth:`Hierarchy.create`'s pattern (not ours: never touched)."""
    m = _MADE_BY.fullmatch(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def leaf_named(name: str, tree_id: str) -> bool:
    """Is ``name`` the leaf :meth:`Hierarchy.create` made for ``hold-TREE_ID``?"""
    return made_by(name) is not None and name.split(".", 1)[0] == f"hold-{tree_id}"


def leaf_in(path: str, tree_id: str) -> str | None:
    """The leaf of the tree ``tree_id`` that the cgroup directory ``path`` is in or below."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if leaf_named(part, tree_id):
            return "/".join(parts[: i + 1])
    return None


def sweep_made_by(cgroup: str, mount: str, creator: tuple[int, int], uid: int) -> list[str]:
    """(A guardian: the ticket daemon, of a client that died.) The empty leaves that
    ``creator`` made in ``cgroup`` or a cgroup above it (where :meth:`Hierarchy.find`
    makes them), owned by ``uid``; the paths removed. Only once ``creator`` is gone."""
    removed: list[str] = []
    for here in {os.path.dirname(p) for p in leaves_made_by(cgroup, mount, creator)}:
        removed += sweep_stale(here, creator=creator, uid=uid)
    return removed


def leaves_made_by(cgroup: str, mount: str, creator: tuple[int, int]) -> list[str]:
    """The leaves named as made by ``creator`` in ``cgroup`` or a cgroup above it."""
    found: list[str] = []
    here = os.path.normpath(cgroup)
    mount = os.path.normpath(mount)
    while within(here, mount):
        try:
            names = os.listdir(here)
        except OSError:
            names = []
        found += [os.path.join(here, n) for n in names if made_by(n) == creator]
        if here == mount:
            break
        here = os.path.dirname(here)
    return found


def sweep_stale(
    base: str, *, creator: tuple[int, int] | None = None, uid: int | None = None
) -> list[str]:
    """Remove the leaves directly under ``base`` that a dead creator left empty; the
    paths removed.

    Only leaves of :meth:`Hierarchy.create`'s name pattern, owned by this user
    (made by a process of ours), whose creator (by pid *and* start time) is
    gone, and in which no process is left: a leaf with a process is a tree's,
    stopped by whoever guards it (a daemon it was registered with, a stop in
    progress). The cost is this directory's entries, never the machine's
    processes: it runs per leaf made. ``creator``: only that process's leaves;
    ``uid``: leaves owned by that user (else this process's).
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    me = os.geteuid() if uid is None else uid
    for e in entries:
        who = made_by(e.name)
        if who is None or not e.is_dir(follow_symlinks=False):
            continue
        if creator is not None and who != creator:
            continue
        st = scan.stat_of(who[0])
        if st is not None and st.starttime == who[1] and not st.is_dead:
            continue  # its creator lives: its leaf
        try:
            if e.stat(follow_symlinks=False).st_uid != me:
                continue
        except OSError:
            continue
        leaf = Leaf(e.path)
        if leaf.populated() or leaf.pids():
            continue
        try:
            leaf.remove(base)
        except (OSError, ValueError):
            continue  # a process came in meanwhile (EBUSY is quiet), or it is odd
        if not os.path.exists(e.path):
            removed.append(e.path)
    return removed
