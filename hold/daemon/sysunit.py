"""The system daemon's systemd unit, and ``hold daemon --install``.

``units/systemd/hold-daemon.service`` is this text rendered for
``/usr/local/bin/hold`` (a test keeps the two equal); ``--install`` renders
it for the ``hold`` being run, writes it, and starts the daemon.
"""

from __future__ import annotations

import os
import subprocess
import sys

from hold.daemon.tokens import write_atomic

UNIT_NAME = "hold-daemon.service"

TEMPLATE = """\
# The ticket daemon, system-wide: the one arbiter of this machine's devices,
# for every user. Install and start it with one command, as root:
#   hold daemon --install
# (or copy this file to /etc/systemd/system/ and `systemctl enable --now hold-daemon`).
# Every user's client finds it at /run/hold without any variable.
[Unit]
Description=hold: device ticket daemon
After=local-fs.target

[Service]
# The daemon sends READY=1 once its socket accepts and its state is recovered.
Type=notify
ExecStart={exec} daemon --system
# `systemctl reload hold-daemon` re-reads /etc/hold/config.yaml (refused while
# a class it would drop or change has live leases).
ExecReload=/bin/kill -HUP $MAINPID
# Leases and registered trees are on disk (state.json): a restarted daemon
# re-attaches live holders and stops the trees of dead ones, so restarting it
# whenever it dies is always safe. The device locks live in /run/lock, shared
# with per-user daemons: keep /tmp and /run/lock the machine's (no PrivateTmp).
Restart=always
RestartSec=1
RuntimeDirectory=hold
RuntimeDirectoryPreserve=yes
RuntimeDirectoryMode=0755

[Install]
WantedBy=multi-user.target
"""


def render(executable: str) -> str:
    return TEMPLATE.format(exec=executable)


def this_hold() -> str:
    """The ``hold`` command beside this interpreter, else ``python -m hold``."""
    beside = os.path.join(os.path.dirname(sys.executable), "hold")
    if os.access(beside, os.X_OK):
        return beside
    return f"{sys.executable} -m hold"


def install(unit_dir: str, start: bool) -> list[str]:
    """Write the unit into ``unit_dir`` and (``start``) enable and start it.

    Returns what was done, one line each; raises ``OSError`` or
    ``subprocess.CalledProcessError`` on a failure.
    """
    path = os.path.join(unit_dir, UNIT_NAME)
    write_atomic(path, render(this_hold()).encode(), 0o644)
    done = [f"wrote {path}"]
    if start:
        for argv in (["systemctl", "daemon-reload"], ["systemctl", "enable", "--now", UNIT_NAME]):
            subprocess.run(argv, check=True)
            done.append(" ".join(argv))
    return done
