"""The state directory: where the daemon's socket, state, tokens and log live.

``HOLD_STATE_DIR``, else the system daemon's ``/run/hold`` when one serves
there (or the caller is root), else ``$XDG_RUNTIME_DIR/hold`` for a user's
own daemon -- which still excludes every other arbiter on the machine
through the kernel locks of :mod:`hold.daemon.devlock`. Created 0700 (0755 for the
shared system daemon). Refused if it is a symlink, or owned by anyone but
this user or root: a directory another user controls could hand us their
socket or swap our token files.
"""

from __future__ import annotations

import os
import stat

from hold_supervisor.parse import BadValue


class StateDir:
    """Paths inside one state directory, checked once when opened."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path

    @property
    def socket(self) -> str:
        return os.path.join(self.path, "daemon.sock")

    @property
    def lock(self) -> str:
        """Held (flock) by the one live daemon for its whole life."""
        return os.path.join(self.path, "daemon.lock")

    def daemon_pid(self) -> int | None:
        """The pid its daemon wrote in :attr:`lock`; None if none is there. Never
        through a link, never waiting (a FIFO planted there): anyone who may
        write the directory may write this, so it names, it does not prove."""
        try:
            fd = os.open(self.lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            text = os.read(fd, 32).decode(errors="replace").strip()
        except OSError:
            return None
        finally:
            os.close(fd)
        return int(text) if text.isdigit() else None

    @property
    def start_lock(self) -> str:
        """Held by the one client that is starting a daemon."""
        return os.path.join(self.path, "start.lock")

    @property
    def state(self) -> str:
        return os.path.join(self.path, "state.json")

    @property
    def log(self) -> str:
        return os.path.join(self.path, "daemon.log")

    def token(self, cls: str, index: int) -> str:
        return os.path.join(self.path, f"{cls}-{index}.token")

    def stacks(self, environ: os._Environ[str] | dict[str, str] = os.environ) -> str:
        """Where this user's stacks keep their sockets and logs.

        Inside the state directory when it is ours; a user of the shared
        system daemon (whose directory only root may write) keeps them in
        ``$XDG_RUNTIME_DIR/hold/stacks``.
        """
        if os.access(self.path, os.W_OK):
            return os.path.join(self.path, "stacks")
        runtime = environ.get("XDG_RUNTIME_DIR")
        if not runtime:
            raise BadValue(
                "stack directory",
                os.path.join(self.path, "stacks"),
                "a directory you may write: set XDG_RUNTIME_DIR (the state directory "
                f"{self.path} is the system daemon's, writable by root only)",
            )
        return os.path.join(runtime, "hold", "stacks")


SYSTEM_DIR = "/run/hold"


def system_serves() -> bool:
    """Does the machine's system daemon answer on its well-known socket?"""
    # lazy: socket only to probe the system daemon; off hold down NAME and hold call
    from hold.unixsock import unix_stream

    sock = unix_stream()
    try:
        sock.connect(os.path.join(SYSTEM_DIR, "daemon.sock"))
    except OSError:
        return False
    finally:
        sock.close()
    return True


SOCKET_PATH_MAX = 107  # bytes of a Unix socket's name (sun_path, less its NUL)


def default_path(environ: os._Environ[str] | dict[str, str] = os.environ) -> str:
    explicit = environ.get("HOLD_STATE_DIR")
    if explicit:
        # Ours to create, write and delete in: never a relative path (it would
        # move with the caller's directory) nor one that is not a directory of
        # its own (``/``, ``/tmp/..``).
        parts = explicit.split("/")
        if not explicit.startswith("/") or ".." in parts or os.path.normpath(explicit) == "/":
            raise BadValue(
                "HOLD_STATE_DIR",
                explicit,
                "an absolute path of a directory of its own (not /, no ..)",
            )
        if len(os.path.join(explicit, "daemon.sock").encode()) > SOCKET_PATH_MAX:
            # The kernel's limit on a socket's name (sun_path): no daemon could
            # listen there, nor a client connect.
            raise BadValue(
                "HOLD_STATE_DIR",
                explicit,
                f"a path of at most {SOCKET_PATH_MAX - len('/daemon.sock')} bytes "
                "(the daemon's socket is named inside it)",
            )
        return explicit
    if os.geteuid() == 0 or system_serves():
        return SYSTEM_DIR
    runtime = environ.get("XDG_RUNTIME_DIR")
    if not runtime:
        raise BadValue(
            "state directory",
            "(none)",
            "set HOLD_STATE_DIR or XDG_RUNTIME_DIR (a directory only you can write)",
        )
    return os.path.join(runtime, "hold")


def check(path: str) -> None:
    """Refuse a state directory that is a symlink or belongs to someone else."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise BadValue("state directory", path, "a real directory, not a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise BadValue("state directory", path, "a directory")
    if st.st_uid not in (os.geteuid(), 0):
        raise BadValue("state directory", path, "a directory owned by you or by root")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise BadValue("state directory", path, "a directory others cannot write")


def open_state_dir(
    environ: os._Environ[str] | dict[str, str] = os.environ,
    *,
    create: bool = True,
    shared: bool = False,
) -> StateDir:
    path = os.path.abspath(default_path(environ))
    if create:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.mkdir(path, 0o755 if shared else 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise BadValue(
                "state directory", path, f"a directory we can create ({e.strerror})"
            ) from None
    check(path)
    return StateDir(path)
