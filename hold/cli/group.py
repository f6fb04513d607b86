"""The ``hold`` command group (everything but the hot path, see :mod:`hold.cli.entry`).

Click renders the group's help, usage, errors and completion, and reads every
command's line but the fast ones of :mod:`hold.cli.options`; for ``audit``,
``up`` and ``down`` it reads their ``--help`` and bad lines, with options made
from those tables (:func:`options`), so that each option is declared once.
Each command imports its own module inside it: the group is imported whole for
any of them.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any, TypeVar

import click

from hold.cli.completion import (
    RUN_SETTINGS,
    SHELLS,
    RunCommand,
    class_values,
    run_arguments,
    script,
    stack_values,
    unit_values,
)
from hold.cli.options import AUDIT_OPTIONS, DOWN_OPTIONS, UP_OPTIONS, Option, Table
from hold.errors import HoldError
from hold.protocol import Ev, Op
from hold_supervisor.exitcodes import NO, SURVIVORS, TOOL, USAGE
from hold_supervisor.parse import BadValue

# `hold release` waits for the lease's tree to be stopped (its grace: at most
# an hour) but not on a daemon that stops answering: hold.client.connection.ANSWER_TIMEOUT
# of silence and it is asked whether it still reads (Client.recv_alive).
RELEASE_TIMEOUT = 3600.0 + 60.0
# What TAB offers for an option's value (Option.values), click's side.
COMPLETIONS = {"classes": class_values}
F = TypeVar("F", bound=Callable[..., Any])


def click_option(opt: Option) -> Callable[[F], F]:
    """``opt`` (a row of :mod:`hold.cli.options`) as click's option."""
    names = [opt.long, opt.short] if opt.short else [opt.long]
    if opt.flag:
        return click.option(*names, opt.dest, is_flag=True, help=opt.help, hidden=opt.hidden)
    return click.option(
        *names,
        opt.dest,
        default=opt.default,
        show_default=opt.default is not None,
        metavar=opt.metavar,
        type=int if opt.integer else str,
        help=opt.help,
        hidden=opt.hidden,
        shell_complete=COMPLETIONS.get(opt.values or ""),
    )


def options(table: Table) -> Callable[[F], F]:
    """Every row of ``table`` as click's options, in the table's order."""

    def apply(f: F) -> F:
        for opt in reversed(table):
            f = click_option(opt)(f)
        return f

    return apply


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(
    package_name="hold",
    prog_name="hold",
    message="%(prog)s %(version)s",
    help="Show the version and exit.",
)
def cli() -> None:
    """Device tickets and process supervision: nothing outlives what started it."""


@cli.command(
    "run",
    cls=RunCommand,
    context_settings=RUN_SETTINGS,
    add_help_option=False,
    params=[run_arguments()],
    help="Run COMMAND; when it ends, everything it started ends (hold run --help).",
)
def run_cmd(args: tuple[str, ...]) -> None:
    from hold.cli.run import main_run  # lazy: only this command's module

    raise SystemExit(main_run(list(args)))


def _prog() -> str:
    """The command's name, as errors are said under it: ``hold release``."""
    ctx = click.get_current_context(silent=True)
    return ctx.command_path if ctx is not None else "hold"


def _fail(msg: str, code: int = USAGE) -> None:
    click.echo(f"{_prog()}: {msg}", err=True)
    raise SystemExit(code)


def _state_dir(shared: bool = False) -> Any:
    from hold.statedir import open_state_dir  # lazy: only the commands that need it

    try:
        return open_state_dir(shared=shared)
    except BadValue as e:
        _fail(str(e))


def _classes() -> Any:
    # lazy: only the commands that read the configuration
    from hold.config import load
    from hold.devices.classes import classes_from_config

    try:
        cfg = load()
        return cfg, classes_from_config(cfg.devices, cfg.path)
    except BadValue as e:
        _fail(str(e))


@cli.command("daemon")
@click.option("--detach", is_flag=True, help="Fork into the background (used by autostart).")
@click.option(
    "--idle-exit",
    metavar="DURATION",
    help="Exit after this long with nothing to do (default: 10m with --detach, never without).",
)
@click.option(
    "--system",
    is_flag=True,
    help="Serve every user of this machine (as root, in /run/hold: what the systemd unit runs).",
)
@click.option(
    "--reload",
    "reload_",
    is_flag=True,
    help="Make the running daemon re-read its configuration, and exit.",
)
@click.option(
    "--install",
    is_flag=True,
    help="Install the system daemon's systemd unit and start it (as root).",
)
@click.option(
    "--unit-dir",
    default="/etc/systemd/system",
    show_default=True,
    help="With --install: where the unit goes.",
)
@click.option("--no-start", is_flag=True, help="With --install: write the unit only.")
def daemon_cmd(
    detach: bool,
    idle_exit: str | None,
    system: bool,
    reload_: bool,
    install: bool,
    unit_dir: str,
    no_start: bool,
) -> None:
    """Serve device leases for this state directory (one daemon per directory)."""
    if install:
        _install(unit_dir, start=not no_start)
    if reload_:
        _reload()
    from hold.cli.daemon import serve  # lazy: only this command's module

    raise SystemExit(serve(detach=detach, idle_exit=idle_exit, system=system))


def _install(unit_dir: str, start: bool) -> None:
    from hold.cli.daemon import DaemonCommandError, install  # lazy: only this command's

    try:
        for line in install(unit_dir, start):
            click.echo(f"{_prog()}: {line}")
    except DaemonCommandError as e:
        _fail(str(e), e.exit_code)
    raise SystemExit(0)


def _reload() -> None:
    from hold.cli.daemon import DaemonCommandError, reload  # lazy: only this command's

    _classes()  # the file must read before the daemon is asked to
    try:
        click.echo(f"{_prog()}: {reload(_state_dir())}")
    except DaemonCommandError as e:
        _fail(str(e), e.exit_code)
    raise SystemExit(0)


def _client() -> Any:
    # lazy: only the commands that ask the daemon
    from hold.client.connection import Client, DaemonUnreachable
    from hold_supervisor.safefile import UnsafePath

    _classes()  # a configuration error is reported here, not as a daemon that never answers
    try:
        return Client.connect(_state_dir())
    except UnsafePath as e:  # a planted link in the state directory: bad input
        _fail(str(e), USAGE)
    except DaemonUnreachable as e:
        _fail(str(e), TOOL)


def _status() -> Any:
    """The daemon's ``status`` answer; its refusal (over this user's limits, say)
    said as the daemon words it, with its exit status."""
    from hold.client.connection import DaemonRefused  # lazy: only the commands that ask

    try:
        return _client().ask({"op": Op.STATUS}, Ev.STATUS)
    except DaemonRefused as e:
        _fail(str(e), e.exit_code)


@cli.command("status")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status_cmd(as_json: bool) -> None:
    """Each device, its holder, and its queue; and which arbiter serves.

    Leases of every user are shown (user, since, until); a lease's label only
    where its owner did not make it private. Devices leased through another
    arbiter (another user's own daemon) are shown from their kernel lock's record.
    """
    from hold.views.status import SECOND_LOOK, main_status, unrated, with_gpu  # lazy: as above

    ans = _status()
    if not as_json and unrated(ans):  # a CPU per cent needs two readings: the second now
        time.sleep(SECOND_LOOK)
        ans = _status()
    main_status(with_gpu(ans), as_json)


@cli.command("top")
@click.option(
    "-d",
    "--delay",
    default="2",
    show_default=True,
    metavar="SECONDS",
    help="Time between frames: 2, 0.5, 500ms, 1m (at least 100ms).",
)
@click.option(
    "-n",
    "--iterations",
    type=click.IntRange(min=1),
    metavar="N",
    help="Exit after N frames (default: at a terminal, until q; piped, 1).",
)
def top_cmd(delay: str, iterations: int | None) -> None:
    """A live view: devices (holder, time left, queue, GPU use), leases and stack
    units (CPU, memory), and strays in red. q quits, space refreshes.

    Not at a terminal, it prints N frames (-n, 1 by default) as plain lines.
    It never starts a daemon: with none, it says so and asks again.
    """
    # lazy: only this command's modules
    from hold.cli.interrupt import Interrupted, interrupting
    from hold.cli.stackdir import running_stacks
    from hold.views.top import main_top, parse_delay

    try:
        seconds = parse_delay(delay)
    except BadValue as e:
        _fail(str(e))
    try:
        with interrupting((signal.SIGTERM, signal.SIGHUP)):
            code = main_top(_state_dir(), _classes()[1], running_stacks, seconds, iterations)
    except Interrupted as e:  # the terminal is back already (curses.wrapper)
        code = 128 + e.signum
    raise SystemExit(code)


@cli.command("web")
@click.option(
    "--listen",
    default="127.0.0.1:8377",
    show_default=True,
    metavar="ADDRESS:PORT",
    help="Where to serve; an address not loopback warns what it exposes.",
)
def web_cmd(listen: str) -> None:
    """A read-only status page, live: devices, holders, queue, strays (GET only)."""
    from hold.views.web import main_web  # lazy: only this command's module

    raise SystemExit(main_web(_state_dir(), _classes()[1], listen))


@cli.command("check")
@click.option(
    "--device",
    "cls",
    default="npu",
    show_default=True,
    metavar="CLASS",
    help="Device class.",
    shell_complete=class_values,
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (version 1).")
def check_cmd(cls: str, as_json: bool) -> None:
    """Exit 0 if this process runs inside a live lease of that class, else 1.

    The answer comes from the arbiter that grants the leases (asked over its
    socket, where the kernel tells it who asks), never from a file: the
    caller is this program's parent, and this program (its child) is what
    the arbiter traces back to a lease's holder or cgroup leaf.
    """
    # lazy: only this command's modules
    from hold.client.check import check_document, check_lease
    from hold.statedir import StateDir, default_path

    _classes()  # a configuration error: file:line, exit 2
    try:
        sd = StateDir(os.path.abspath(default_path()))
    except BadValue as e:
        _fail(str(e))
    ok, why, lease = check_lease(sd, cls, want_lease=as_json)
    if as_json:
        click.echo(json.dumps(check_document(ok, why, cls, lease), indent=2, sort_keys=True))
    else:
        click.echo(f"hold check: {why}", err=not ok)
    raise SystemExit(0 if ok else NO)


@cli.command("release")
@click.argument("lease_id")
def release_cmd(lease_id: str) -> None:
    """End a lease (yours, or any as root): its tree is stopped, with the survivor check."""
    from hold.client.connection import DaemonSilent  # lazy: only the commands that ask

    client = _client()
    try:
        client.send({"op": Op.RELEASE, "lease": lease_id})
        # The answer comes once the lease's tree is stopped (its grace, at
        # most an hour); meanwhile the daemon must go on answering (ping).
        client.ping()
        ans = client.recv_alive(time.monotonic() + RELEASE_TIMEOUT)
    except DaemonSilent as e:
        _fail(f"{e}; lease {lease_id} may not be released", TOOL)
    except TimeoutError:
        _fail(
            f"the ticket daemon did not say lease {lease_id} was released within "
            f"{RELEASE_TIMEOUT:g} s",
            TOOL,
        )
    if ans is None or ans.get("ev") == Ev.ERROR:
        _fail(
            str(ans.get("error") if ans else "the daemon closed the connection"),
            int(ans.get("code", USAGE)) if ans else TOOL,
        )
    survivors = ans.get("survivors") or []
    for s in survivors:
        click.echo(
            f"{_prog()}: survivor pid {s['pid']} ({s['found_by']}): {s['command']}", err=True
        )
    click.echo(f"{_prog()}: lease {lease_id} released")
    raise SystemExit(SURVIVORS if survivors else 0)


@cli.command("audit")
@options(AUDIT_OPTIONS)
def audit_cmd(
    cls: str | None,
    user: str | None,
    as_json: bool,
    kill: bool,
    yes: bool,
    grace: str,
    log: str | None,
) -> None:
    """Every process holding a device node, and the lease that covers it (or STRAY).

    Exit 0 when every holder is covered, 1 when any is stray, 3 when --kill
    left survivors.
    """
    from hold.cli.audit import run_audit  # lazy: only this command's module

    raise SystemExit(run_audit(cls, as_json, kill, yes, grace, user, log))


# ---------------------------------------------------------------------- stacks (hold.cli.stack)


@cli.command("report")
@click.option(
    "--since",
    metavar="DURATION|DATE",
    help="Only from then: a duration back from now (7d, 12h) or a date "
    "(2025-05-01, 2025-05-01T08:00).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (version 1).")
def report_cmd(since: str | None, as_json: bool) -> None:
    """Who used which device, for how long: per user and per device, leased and held
    time, waits in line, expiries, releases by others, strays seen (the daemon's history).

    Every user sees everyone's totals; other users' labels only where the
    configuration says report: {labels: true}, and never a private one.
    """
    # lazy: only this command's modules
    from hold.views.report import fetch, main_report, parse_since

    cfg, _ = _classes()
    try:
        doc = fetch(_state_dir(), parse_since(since, time.time()), cfg.report_labels)
    except BadValue as e:
        _fail(str(e))
    except HoldError as e:
        _fail(str(e), TOOL)
    main_report(doc, as_json)


@cli.command("metrics")
@click.option(
    "--output",
    metavar="FILE",
    help="Write the text there atomically (node_exporter's textfile collector).",
)
def metrics_cmd(output: str | None) -> None:
    """This machine's devices and tickets in Prometheus' text format: per device
    leased, holder, waiters, lease age, strays; per class grants, expiries, waits."""
    # lazy: only this command's modules
    from hold.views.audit import build_report
    from hold.views.metrics import main_metrics
    from hold.views.status import with_gpu
    from hold_supervisor.safefile import UnsafePath, WriteFailed

    _, classes = _classes()
    ans = with_gpu(_status())
    try:
        raise SystemExit(main_metrics(ans, build_report(_state_dir(), classes, None), output))
    except (UnsafePath, WriteFailed) as e:  # each names the file it could not write
        _fail(str(e))


@cli.command("up")
@click.argument("file", type=click.Path())
@options(UP_OPTIONS)
def up_cmd(file: str, detach: bool, run_for: str | None, status_fd: int | None) -> None:
    """Start the units of a stack FILE in dependency order and supervise them."""
    from hold.cli.stack import main_up  # lazy: only this command's module

    raise SystemExit(main_up(file, detach=detach, run_for=run_for, status_fd=status_fd))


@cli.command("validate")
@click.argument("file", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="The resolved stack as JSON (versioned).")
def validate_cmd(file: str, as_json: bool) -> None:
    """Check a stack FILE without starting anything (every error, with its line), and
    show what hold up would do."""
    from hold.cli.stack import main_validate  # lazy: only this command's module

    raise SystemExit(main_validate(file, as_json))


@cli.command("ps")
@click.argument("name", required=False, shell_complete=stack_values)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def ps_cmd(name: str | None, as_json: bool) -> None:
    """Running stacks, or the units of stack NAME."""
    from hold.cli.stack import main_ps  # lazy: only this command's module

    raise SystemExit(main_ps(name, as_json))


@cli.command("logs")
@click.argument("name", shell_complete=stack_values)
@click.argument("unit", required=False, shell_complete=unit_values)
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines while the stack runs.")
@click.option("--lines", "-n", type=click.IntRange(min=0), help="Only the last N lines.")
@click.option(
    "--since",
    metavar="DURATION|TIME",
    help="Only lines from then on: 10m, 2h, 17:05, 2026-12-01T17:05.",
)
@click.option("--json", "as_json", is_flag=True, help="JSON lines: an object per line (version 1).")
def logs_cmd(
    name: str,
    unit: str | None,
    follow: bool,
    lines: int | None,
    since: str | None,
    as_json: bool,
) -> None:
    """The output of stack NAME: every unit's, interleaved by time, or UNIT's."""
    from hold.cli.stack import main_logs  # lazy: only this command's module

    raise SystemExit(main_logs(name, unit, follow, lines, since, as_json))


@cli.command("down")
@click.argument("name", shell_complete=stack_values)
@options(DOWN_OPTIONS)
def down_cmd(name: str) -> None:
    """Stop stack NAME: reverse order, each unit's signal and grace, survivor check."""
    from hold.cli.stack import main_down  # lazy: only this command's module

    raise SystemExit(main_down(name))


@cli.command("restart")
@click.argument("name", shell_complete=stack_values)
@click.argument("unit", shell_complete=unit_values)
def restart_cmd(name: str, unit: str) -> None:
    """Stop UNIT of stack NAME (its whole tree) and start it again."""
    from hold.cli.stack import main_restart  # lazy: only this command's module

    raise SystemExit(main_restart(name, unit))


@cli.command("call")
@click.argument("name", shell_complete=stack_values)
@click.argument("unit", shell_complete=unit_values)
@click.option(
    "--arg",
    "arg_pairs",
    multiple=True,
    metavar="KEY=VALUE",
    help="An argument, read by its declared type (repeatable).",
)
@click.option("--json-args", metavar="FILE|-", help="Arguments as a JSON object (- for stdin).")
@click.option("--no-wait", is_flag=True, help="Exit 75 at once if every slot is taken.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")
def call_cmd(
    name: str,
    unit: str,
    arg_pairs: tuple[str, ...],
    json_args: str | None,
    no_wait: bool,
    as_json: bool,
) -> None:
    """Run task UNIT of the running stack NAME once; its stdout, and its exit status.

    The stack checks the arguments (exit 2 if refused), runs the task on its
    CPU lane and stops it at its timeout (exit 124). Ctrl-C cancels the call.
    """
    from hold.cli.call import main_call  # lazy: only this command's module

    raise SystemExit(main_call(name, unit, list(arg_pairs), json_args, no_wait, as_json))


@cli.command("completion")
@click.argument("shell", type=click.Choice(SHELLS))
def completion_cmd(shell: str) -> None:
    """Print the shell completion script of hold, npu-hold and gpu-hold.

    \b
    bash, in ~/.bashrc:                eval "$(hold completion bash)"
    zsh, in ~/.zshrc after compinit:   eval "$(hold completion zsh)"
    fish, in config.fish:              hold completion fish | source
    """
    click.echo(script(shell, cli), nl=False)


__all__ = ["cli"]
