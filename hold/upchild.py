"""``hold up --detach``: the background supervisor, and how the command starts it.

The command (:class:`Starter`, in :func:`hold.upcmd.main_up`) starts
``python -m hold.upchild SPEC_FD STATUS_FD`` *before* it reads the stack file,
so that the new interpreter's start and imports overlap the validation. Once the
file is checked, it writes the resolved stack on SPEC_FD as one JSON document
(``{"spec", "settings", "run_for"}``: :func:`supervisor.stackspec.to_json` and
:class:`hold.upcmd.UpSettings`) and reads STATUS_FD (:class:`hold.upcmd.StatusPipe`)
until the stack is up or has failed. An empty SPEC_FD (the command refused the
file, or died) ends the supervisor before it did anything.

So the file is validated once, and the supervisor, which lives as long as the
stack, never imports YAML, pydantic, click or structlog: most of a Python
process's memory would be theirs (``python -X importtime -m hold.upchild``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hold.upcmd import UpSettings
    from supervisor.stackspec import StackSpec


class Starter:
    """The command's side: the supervisor started at once, handed the stack later."""

    def __init__(self) -> None:
        import subprocess  # here: the supervisor imports this module too, and needs none

        spec_r, self.spec_w = os.pipe2(os.O_CLOEXEC)
        self.status_r, status_w = os.pipe2(os.O_CLOEXEC)
        # -P: no script or working directory in front of sys.path (it would be
        # the user's directory here); as `python -m hold up` was, in its own session.
        argv = [sys.executable, "-P", "-m", "hold.upchild", str(spec_r), str(status_w)]
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # until it opens the stack's supervisor.log
                stderr=subprocess.DEVNULL,
                pass_fds=(spec_r, status_w),
                start_new_session=True,
            )
        finally:
            os.close(spec_r)
            os.close(status_w)

    def abandon(self) -> None:
        """The file was refused: the supervisor reads an empty stack and ends."""
        os.close(self.spec_w)
        os.close(self.status_r)
        self.proc.wait()

    def hand_over(self, spec: StackSpec, settings: UpSettings, run_for: float | None) -> int:
        """Send the stack; 0 once it is up, else the supervisor's exit status."""
        from supervisor.stackspec import to_json

        doc = {"spec": to_json(spec), "settings": settings._asdict(), "run_for": run_for}
        try:
            with os.fdopen(self.spec_w, "wb") as f:
                f.write(json.dumps(doc).encode())
        except BrokenPipeError:
            pass  # it died: its status says why
        return self._follow(spec.name)

    def _follow(self, name: str) -> int:
        from hold.stackdir import say

        with os.fdopen(self.status_r, "rb") as f:
            for raw in f:
                try:
                    msg = json.loads(raw)
                except ValueError:
                    continue
                if msg.get("ready"):
                    say(
                        f"stack {name} is up in the background (pid {self.proc.pid}); "
                        f"hold ps {name}, hold logs {name} UNIT, hold down {name}"
                    )
                    # It runs on without us: forget it without waiting (not ours to reap).
                    self.proc.returncode = 0
                    return 0
                if "line" in msg:
                    print(msg["line"], file=sys.stderr, flush=True)
        return self.proc.wait()


def main(argv: list[str]) -> int:
    """The supervisor's side: imports first (while the command validates), then the stack."""
    spec_fd, status_fd = int(argv[0]), int(argv[1])
    from hold import client, lease, upcmd  # noqa: F401  (what the run needs, loaded now)
    from supervisor import cgroup, display, stack  # noqa: F401

    with os.fdopen(spec_fd, "rb") as f:
        data = f.read()
    if not data:
        return 0
    doc = json.loads(data)
    return _run(doc, status_fd)


def _run(doc: dict[str, object], status_fd: int) -> int:
    from hold.stackdir import open_sd, run_dir_of
    from hold.upcmd import StatusPipe, UpSettings, run_up
    from supervisor.exitcodes import USAGE
    from supervisor.parse import BadValue
    from supervisor.safefile import UnsafePath, ensure_dir, open_for_append
    from supervisor.stackspec import from_json

    assert isinstance(doc["spec"], dict) and isinstance(doc["settings"], dict)
    spec = from_json(doc["spec"])
    settings = UpSettings.from_json(doc["settings"])
    run_for = doc.get("run_for")
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
    seconds = float(run_for) if isinstance(run_for, (int, float)) else None
    return run_up(spec, sd, settings, seconds, status_fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
