"""The click commands ``hold report`` and ``hold metrics`` (their bodies:
:mod:`hold.reportcmd`, :mod:`hold.metrics`); registered by :mod:`hold.cli`."""

from __future__ import annotations

import time

import click


@click.command("report")
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
    from hold.cli import _classes, _fail, _state_dir
    from hold.errors import HoldError
    from hold.reportcmd import fetch, main_report, parse_since
    from supervisor.exitcodes import TOOL
    from supervisor.parse import BadValue

    cfg, _ = _classes()
    try:
        doc = fetch(_state_dir(), parse_since(since, time.time()), cfg.report_labels)
    except BadValue as e:
        _fail(str(e))
    except HoldError as e:
        _fail(str(e), TOOL)
    main_report(doc, as_json)


@click.command("metrics")
@click.option(
    "--output",
    metavar="FILE",
    help="Write the text there atomically (node_exporter's textfile collector).",
)
def metrics_cmd(output: str | None) -> None:
    """This machine's devices and tickets in Prometheus' text format: per device
    leased, holder, waiters, lease age, strays; per class grants, expiries, waits."""
    from hold.audit import build_report
    from hold.cli import _classes, _client, _fail, _state_dir
    from hold.metrics import main_metrics
    from supervisor.safefile import UnsafePath

    _, classes = _classes()
    ans = _client().request({"op": "status"})
    try:
        raise SystemExit(main_metrics(ans, build_report(_state_dir(), classes, None), output))
    except (UnsafePath, OSError) as e:
        _fail(f"cannot write {output}: {e}")
