"""``hold up --detach``: the background supervisor, and how the command starts it.

The command (:class:`Starter`, in :func:`hold.cli.up.main_up`) forks the
supervisor (or starts ``python -P -m hold.cli.upchild SPEC_FD STATUS_FD``) *before*
it reads the stack file, so that the supervisor's imports overlap the
validation. Once the file is checked, it writes the resolved stack on SPEC_FD as one
:class:`hold.documents.UpHandOver` (:func:`hold_supervisor.stackfile.spec.to_json`, the
settings of :class:`hold.cli.stackrun.UpSettings`, ``--for``) and reads STATUS_FD
(:class:`hold.cli.stackrun.StatusPipe`, :class:`hold.documents.UpStatus` lines)
until the stack is up or has failed. An empty SPEC_FD (the command refused the
file, or died) ends the supervisor before it did anything.

So the file is validated once, and the supervisor, which lives as long as the
stack, never holds YAML, click or structlog: most of a Python
process's memory would be theirs (``python -X importtime -m hold.cli.upchild``).
A fork (no second interpreter to start, the imports the command already made
shared) saves about 25 ms of ``hold up --detach`` on a 2-core machine.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING, NoReturn

from hold.cli.stackdir import open_sd, run_dir_of, say
from hold.cli.stackrun import StatusPipe, UpSettings, run_up
from hold_supervisor.exitcodes import USAGE
from hold_supervisor.parse import BadValue

if TYPE_CHECKING:
    from hold.documents import UpHandOver
    from hold_supervisor.stackfile.spec import StackSpec


# Never in the supervisor's memory (it lives as long as the stack): a command
# that has loaded one of these starts a fresh interpreter instead of forking.
HEAVY = ("yaml", "click", "structlog")


class Starter:
    """The command's side: the supervisor started at once, handed the stack later.

    Forked from the command, before it has read anything (no YAML in it
    yet, one thread): the supervisor then imports what its run
    needs while the command validates, without paying a second interpreter's
    start. A command that already holds a heavy module (``hold up --detach
    --for`` comes through click) or a second thread starts ``python -P -m
    hold.cli.upchild`` instead, as before."""

    def __init__(self) -> None:
        spec_r, self.spec_w = os.pipe2(os.O_CLOEXEC)
        self.status_r, status_w = os.pipe2(os.O_CLOEXEC)
        try:
            if _may_fork():
                self.pid = _fork(spec_r, status_w)
            else:
                self.pid = _exec(spec_r, status_w)
        finally:
            os.close(spec_r)
            os.close(status_w)

    def abandon(self) -> None:
        """The file was refused: the supervisor reads an empty stack and ends."""
        os.close(self.spec_w)
        os.close(self.status_r)
        self._wait()

    def hand_over(self, spec: StackSpec, settings: UpSettings, run_for: float | None) -> int:
        """Send the stack; 0 once it is up, else the supervisor's exit status."""
        # lazy: not before the fork; by now the validation has loaded it
        from hold.documents import UpHandOver
        from hold_supervisor.stackfile.spec import to_json

        doc = UpHandOver(to_json(spec), *settings, run_for)
        try:
            with os.fdopen(self.spec_w, "wb") as f:
                f.write(doc.encode())
        except BrokenPipeError:
            pass  # it died: its status says why
        return self._follow(spec.name)

    def _follow(self, name: str) -> int:
        from hold.documents import BadDocument, UpStatus  # lazy: after the fork

        with os.fdopen(self.status_r, "rb") as f:
            for raw in f:
                try:
                    msg = UpStatus.decode(raw, "hold up's status pipe")
                except BadDocument:
                    continue
                if msg.ready:
                    say(
                        f"stack {name} is up in the background (pid {self.pid}); "
                        f"hold ps {name}, hold logs {name} UNIT, hold down {name}"
                    )
                    return 0  # it runs on without us (not ours to reap)
                if msg.line is not None:
                    print(msg.line, file=sys.stderr, flush=True)
        return self._wait()

    def _wait(self) -> int:
        while True:
            try:
                return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            except InterruptedError:  # pragma: no cover (PEP 475 retries)
                continue


def _may_fork() -> bool:
    heavy = any(m in sys.modules for m in HEAVY)
    return not heavy and threading.active_count() == 1


def _exec(spec_r: int, status_w: int) -> int:
    """A fresh interpreter: ``python -P -m hold.cli.upchild SPEC_FD STATUS_FD``."""
    # lazy: only where the command may not fork
    import subprocess

    # -P: no script or working directory in front of sys.path (it would be
    # the user's directory here); in its own session, as a fork would be.
    argv = [sys.executable, "-P", "-m", "hold.cli.upchild", str(spec_r), str(status_w)]
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,  # until it opens the stack's supervisor.log
        stderr=subprocess.DEVNULL,
        pass_fds=(spec_r, status_w),
        start_new_session=True,
    )
    proc.returncode = 0  # reaped by Starter._wait, never by subprocess
    return proc.pid


def _fork(spec_r: int, status_w: int) -> int:
    """The supervisor as a fork of this process; its pid (the child never returns)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # else the child would write the command's buffered text again
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # until it opens the stack's supervisor.log
            os.dup2(null, fd)
        keep = sorted({0, 1, 2, spec_r, status_w})
        for low, high in zip(keep, [*keep[1:], 1 << 20], strict=True):
            os.closerange(low + 1, high)  # the command's other ends among them
        if not sys.flags.safe_path and sys.path and sys.path[0] in ("", os.getcwd()):
            del sys.path[0]  # as -P: never the user's directory in front
        code = main([str(spec_r), str(status_w)])
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except BaseException:
        # lazy: only for a crash
        import traceback

        traceback.print_exc()  # to supervisor.log once it is open
    finally:
        _exit(code)


def _exit(code: int) -> NoReturn:
    """End the forked supervisor as an interpreter ends (its threads first, its
    output flushed), but never return into the command's frames nor run the
    command's exit handlers."""
    try:
        for t in threading.enumerate():
            if t is not threading.main_thread() and not t.daemon:
                t.join()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(code)


def main(argv: list[str]) -> int:
    """The supervisor's side: imports first (while the command validates), then the stack."""
    spec_fd, status_fd = int(argv[0]), int(argv[1])

    with os.fdopen(spec_fd, "rb") as f:
        data = f.read()
    if not data:
        return 0

    # lazy: the supervisor's side, after the fork (this module is loaded before it)
    from hold.documents import UpHandOver

    return _run(UpHandOver.decode(data, "hold up's hand-over"), status_fd)


def _run(doc: UpHandOver, status_fd: int) -> int:
    # lazy: the supervisor's own, after the fork: the command forks first thing
    from hold_supervisor.safefile import UnsafePath, ensure_dir, open_for_append
    from hold_supervisor.stackfile.spec import from_json

    spec = from_json(doc.spec)
    settings = UpSettings(doc.cgroups, doc.digest, doc.device)
    try:
        sd = open_sd()
        run_dir = run_dir_of(sd, spec.name)
        # Never through a link planted at the directories or the log.
        ensure_dir(os.path.dirname(run_dir), owned=False)
        ensure_dir(run_dir)
        log = open_for_append(os.path.join(run_dir, "supervisor.log"))
    except (UnsafePath, BadValue) as e:
        StatusPipe(status_fd).write(f"hold up: {e}")
        return USAGE
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    return run_up(spec, sd, settings, doc.run_for, status_fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
