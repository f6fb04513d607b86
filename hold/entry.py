"""Console entry points. ``hold run`` is dispatched before click is imported.

Every other subcommand goes through the click group in :mod:`hold.cli`.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "run":
        from hold.runcmd import main_run

        return main_run(argv[1:])
    from hold.cli import cli

    return int(cli.main(args=argv, prog_name="hold", standalone_mode=False) or 0)


def _needs_daemon(prog: str) -> int:
    print(
        f"{prog}: needs the ticket daemon, which is not built yet; "
        "use 'hold run' for a command without a device",
        file=sys.stderr,
    )
    return 125


def npu_main() -> int:
    return _needs_daemon("npu-hold")


def gpu_main() -> int:
    return _needs_daemon("gpu-hold")
