"""Console entry points. ``hold run``, ``npu-hold``, ``gpu-hold``,
``hold down NAME``, ``hold up [--detach] FILE``, ``hold audit`` (with plain
options, read by :mod:`hold.cli.options`) and ``hold daemon --detach``
(autostart's) are dispatched before click is imported (their start-up time is
a benchmark; the daemon's memory too).

Every other subcommand goes through the click group in :mod:`hold.cli.group`.
Each way in imports only its own modules, inside its branch: every program and
every TAB starts here.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    if "_HOLD_COMPLETE" in os.environ and _answered("hold"):  # first: a TAB is a start-up
        return 0
    from hold.errors import HoldError  # lazy: a TAB answered above needs none
    from hold_supervisor.errors import SupervisorError

    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except (HoldError, SupervisorError) as e:
        # The one place an error of either package becomes an exit status: bad
        # input found deep down is still exit 2, a tool failure 125, never a
        # traceback.
        print(f"{_prog(argv if argv is not None else sys.argv[1:])}: {e}", file=sys.stderr)
        return e.exit_code


def _prog(argv: list[str]) -> str:
    """The name an error is said under: ``hold status``, ``hold`` before a command."""
    return f"hold {argv[0]}" if argv and argv[0].isalpha() else "hold"


def _main(argv: list[str]) -> int:
    if argv == ["--version"]:  # before click: as fast as `npu-hold --version`
        from hold.version import version_line  # lazy: each way in loads only its own

        print(version_line("hold"))
        return 0
    if argv == ["daemon", "--detach"]:
        # What autostart runs: without click (its imports are ~4 MB of an idle
        # daemon's memory, and part of the first npu-hold's wait).
        from hold.cli.daemon import serve  # lazy: each way in loads only its own

        return serve(detach=True)
    if argv and argv[0] == "run":
        from hold.cli.run import main_run  # lazy: each way in loads only its own

        return main_run(argv[1:])
    if argv and argv[0] in PLAIN and "_HOLD_COMPLETE" not in os.environ:
        code = _plain(argv[0], argv[1:])
        if code is not None:
            return code
    # lazy: click's group only when no fast path took the line
    from hold.cli.group import cli
    from hold_supervisor.exitcodes import CANCELLED, USAGE

    try:
        return int(cli.main(args=argv, prog_name="hold", standalone_mode=False) or 0)
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else USAGE
    except Exception as e:
        import click  # lazy: loaded by the group already

        if isinstance(e, click.exceptions.Abort):
            return CANCELLED
        if isinstance(e, click.ClickException):
            e.show()
            return USAGE
        raise


def _answered(prog: str) -> bool:
    """The shell asked ``prog`` to complete a word: answered without click where
    :mod:`hold.cli.answers` can (most TABs); False: click's turn."""
    from hold.cli.answers import answer, complete_var  # lazy: only for a TAB

    return answer(prog, os.environ.get(complete_var(prog), ""))


PLAIN = ("audit", "down", "up")  # the click commands whose plain lines skip click


def _plain(command: str, argv: list[str]) -> int | None:
    """``hold audit``, ``hold down NAME`` or ``hold up FILE`` with a plainly valid
    line, read by its table in :mod:`hold.cli.options` and run without click;
    None: the line is click's (``--help``, an error: said in click's words)."""
    # lazy: each way in loads only its own
    from hold.cli.options import AUDIT_OPTIONS, DOWN_OPTIONS, UP_OPTIONS, UsageError, plain_line

    table, nargs = {"audit": (AUDIT_OPTIONS, 0), "down": (DOWN_OPTIONS, 1)}.get(
        command, (UP_OPTIONS, 1)
    )
    try:
        opts, args = plain_line(argv, table, nargs)
    except UsageError:
        return None
    if command == "down":
        # Without click (~20 ms of imports): a stop's time counts from here, and
        # the stack cannot start stopping before this process has asked it to
        # (bench/stack.py).
        from hold.cli.down import main_down  # lazy: each way in loads only its own

        return main_down(args[0])
    if command == "up":
        # Without click (~50 ms of imports): the background supervisor is started
        # first thing (bench/stack.py).
        from hold.cli.up import main_up  # lazy: each way in loads only its own

        return main_up(args[0], **opts)
    # `hold audit`: without click, ~30 ms of imports of ~100 on a GPU machine (issue 13).
    from hold.cli.audit import main_plain  # lazy: each way in loads only its own

    return main_plain(opts)


def npu_main() -> int:
    if "_NPU_HOLD_COMPLETE" in os.environ:  # the shell completing (hold.cli.answers)
        if _answered("npu-hold"):
            return 0
        from hold.cli.completion import complete_program  # lazy: click, for a TAB only

        return complete_program("npu-hold")
    return _quick_exit(_run_as("npu-hold", "npu"))


def gpu_main() -> int:
    if "_GPU_HOLD_COMPLETE" in os.environ:  # the shell completing (hold.cli.answers)
        if _answered("gpu-hold"):
            return 0
        from hold.cli.completion import complete_program  # lazy: click, for a TAB only

        return complete_program("gpu-hold")
    return _quick_exit(_run_as("gpu-hold", "gpu"))


def _run_as(prog: str, device: str) -> int:
    """``npu-hold`` / ``gpu-hold``: an error of either package that got this far is
    said as ``main`` says it, under the program's own name, never a traceback."""
    from hold.cli.run import main_run  # lazy: each way in loads only its own
    from hold.errors import HoldError
    from hold_supervisor.errors import SupervisorError

    try:
        return main_run(sys.argv[1:], prog=prog, device=device)
    except (HoldError, SupervisorError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return e.exit_code


def _quick_exit(code: int) -> int:
    """Exit with ``code`` now, without tearing the interpreter down (~2.5 ms of
    ``npu-hold``'s start-up, issue 13): by now the command's tree is stopped,
    the lease ended and every file closed; only stdout and stderr may still
    buffer. If flushing them fails, return instead (Python's own exit says why)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        return code
    os._exit(code)
