"""``hold up``: the command. It reads and checks the stack file once, then runs
the stack in the foreground (:func:`hold.cli.stackrun.run_up`) or hands it,
validated, to a background supervisor (``--detach``: :mod:`hold.cli.upchild`,
started before the file is read so that its imports overlap the validation).
"""

from __future__ import annotations

import gc
import sys
from typing import TYPE_CHECKING

from hold.cli.stackdir import load_checked, open_sd, say
from hold.cli.stackrun import UpSettings, run_up
from hold.cli.upchild import Starter
from hold_supervisor.exitcodes import USAGE
from hold_supervisor.parse import BadValue, parse_duration

if TYPE_CHECKING:
    from hold_supervisor.stackfile.spec import StackSpec


def with_scratch_floor(spec: StackSpec, floor: int | None) -> StackSpec:
    """``spec`` with the configuration's scratch floor (``scratch: {min_free}``) for
    every unit's scratch that names none of its own (None: the built-in default)."""
    if floor is None:
        return spec
    import dataclasses  # lazy: after the fork (inspect and ast come with it)

    units = {
        name: dataclasses.replace(u, scratch=dataclasses.replace(u.scratch, min_free=floor))
        if u.scratch is not None and u.scratch.min_free is None
        else u
        for name, u in spec.units.items()
    }
    return dataclasses.replace(spec, units=units)


def main_up(
    path: str, *, detach: bool = False, run_for: str | None = None, status_fd: int | None = None
) -> int:
    """``hold up``; the exit status (see the README's table)."""
    starter = None
    if detach:
        # First: the background interpreter starts and imports while we validate.
        starter = Starter()
    # lazy: the configuration's and the stack file's readers (YAML) load after the
    # fork above, while the background supervisor starts
    from hold.config import load
    from hold_supervisor.stackfile.load import StackFileError

    try:
        seconds = (
            parse_duration(run_for, what="--for", plain_unit="seconds")
            if run_for is not None
            else None
        )
        cfg = load()  # once for the whole command, passed down
        spec = with_scratch_floor(load_checked(path, cfg), cfg.scratch_min_free)
        settings = UpSettings.of(spec, cfg)
        sd = open_sd()
    except StackFileError as e:
        if starter is not None:
            starter.abandon()
        for line in e.errors:
            print(line, file=sys.stderr)
        return USAGE
    except BadValue as e:
        if starter is not None:
            starter.abandon()
        say(str(e))
        return USAGE
    if starter is not None:
        code = starter.hand_over(spec, settings, seconds)
        if code == 0:
            # The command ends now, the stack up: freezing what it made skips the
            # interpreter's last collection over it (~5 ms of the return, issue 13).
            gc.freeze()
        return code
    return run_up(spec, sd, settings, seconds, status_fd)
