"""The bad-input corpus: the project's regression wall.

Every hostile or mistaken input found so far, in tables: command lines
(durations, CPU lists, labels, signals, counts, device specs, variables,
options), stack files, configuration files and path tricks. Each row says
what is given, the exit status expected (2: bad input) and what the message
must contain (the value, and file:line for YAML); after each row nothing was
started (the command would have made a marker file), nothing was asked of a
daemon (no ``daemon.sock``) and nothing was written (not even the row's own
state directory was made).

Rows run as real processes (``python -m hold ...``), several at a time, each
with its own state directory and marker; the stack and configuration tables
are also read in this process (the functions every command calls), which is
where most of their rows are checked line by line. A bad input found later
is one more row.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from conftest import HOLD, stop_daemon

from hold_supervisor.parse import BadValue, allowed_cpus
from hold_supervisor.stackfile.load import StackFileError

NPU_HOLD = [
    sys.executable,
    "-c",
    "import sys; from hold.cli.entry import npu_main; sys.exit(npu_main())",
]
OUTSIDE = max(allowed_cpus()) + 1  # a CPU this process may not use


class Row(NamedTuple):
    id: str
    argv: Sequence[str]  # after `hold` ({marker}: the file the command would make)
    expect: Sequence[str]  # each in stderr ({file}: the row's stack or configuration file)
    rc: int = 2
    doc: str | bytes | None = None  # the row's stack file (argv names it as {file})
    config: str | bytes | None = None  # the row's configuration, else the test's own
    prog: Sequence[str] = HOLD
    env: dict[str, str] | None = None


def run_rows(base: Path, rows: Sequence[Row]) -> None:
    """Run every row as its own process (in parallel), then check each; report all failures."""

    def one(i: int, row: Row) -> str | None:
        d = base / f"row{i}"
        d.mkdir()
        marker, state = d / "marker", d / "state"
        file = d / "stack.yaml"
        env = {**os.environ, "HOLD_STATE_DIR": str(state)}
        if row.config is not None:
            file = d / "config.yaml"
            data = row.config if isinstance(row.config, bytes) else row.config.encode()
            file.write_bytes(data.replace(b"{marker}", str(marker).encode()))
            env["HOLD_CONFIG"] = str(file)
        if row.doc is not None:
            data = row.doc if isinstance(row.doc, bytes) else row.doc.encode()
            file.write_bytes(data.replace(b"{marker}", str(marker).encode()))
        env.update(row.env or {})

        def fill(s: str) -> str:
            return s.replace("{marker}", str(marker)).replace("{file}", str(file))

        argv = [*row.prog, *(fill(a) for a in row.argv)]
        t = time.monotonic()
        try:
            res = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                env=env,
                cwd=d,
                timeout=30,
            )
        except subprocess.TimeoutExpired:
            return f"{row.id}: no answer in 30 s"
        finally:
            started = (state / "daemon.sock").exists()
            written = state.exists()
            stop_daemon(state)  # a row that failed that way leaves no daemon behind
        took = time.monotonic() - t
        problems = []
        if res.returncode != row.rc:
            problems.append(f"exit {res.returncode}, expected {row.rc}")
        for want in row.expect:
            if fill(want) not in res.stderr:
                problems.append(f"no {fill(want)!r} in the message")
        if "Traceback" in res.stderr:
            problems.append("a traceback")
        if marker.exists():
            problems.append("the command ran (its marker exists)")
        if started:
            problems.append("a daemon was started (daemon.sock exists)")
        elif written:
            problems.append("the state directory was made")
        if took > 10:
            problems.append(f"took {took:.1f}s")
        if problems:
            return f"{row.id}: " + "; ".join(problems) + f"\n    stderr: {res.stderr.strip()!r}"
        return None

    with ThreadPoolExecutor(max_workers=8) as pool:
        failures = [f for f in pool.map(one, range(len(rows)), rows) if f]
    assert not failures, "\n".join(failures)


def ids_unique(rows: Sequence[Row]) -> None:
    seen = [r.id for r in rows]
    assert len(seen) == len(set(seen)), "row ids must be unique"


TOUCH = ["--", "touch", "{marker}"]


def run(*opts: str) -> list[str]:
    return ["run", *opts, *TOUCH]


# ----------------------------------------------------------------------------
# The command line of `hold run` and `npu-hold`.

ARGV_ROWS = [
    # Durations.
    Row("time-unit", run("-t", "5x"), ["-t/--time '5x' is not valid"]),
    Row("time-negative", run("-t", "-1"), ["-t/--time '-1' is not valid"]),
    Row("time-zero", run("-t", "0"), ["-t/--time '0' is not valid", "more than zero"]),
    Row("time-empty", run("-t", ""), ["-t/--time '' is not valid"]),
    Row("time-exponent", run("-t", "1e3"), ["-t/--time '1e3' is not valid"]),
    Row("time-inf", run("-t", "inf"), ["-t/--time 'inf' is not valid"]),
    Row("time-nan", run("-t", "nan"), ["-t/--time 'nan' is not valid"]),
    Row("time-word-unit", run("-t", "5sec"), ["-t/--time '5sec' is not valid"]),
    Row("time-arabic-digit", run("-t", "\u0665m"), ["-t/--time '\u0665m' is not valid"]),
    Row("time-over-a-year", run("-t", "400d"), ["-t/--time '400d' is not valid: at most a year"]),
    Row("time-no-value", ["run", "-t"], ["option -t needs a value (DURATION)"]),
    Row("grace-word", run("--grace", "soon"), ["--grace 'soon' is not valid"]),
    Row("grace-negative", run("--grace", "-1s"), ["--grace '-1s' is not valid"]),
    Row(
        "wait-timeout-unit",
        run("-d", "npu", "--wait-timeout", "1x"),
        ["--wait-timeout '1x' is not valid"],
    ),
    # CPU lists.
    Row("cpus-empty", run("--cpus", ""), ["--cpus '' is not valid"]),
    Row("cpus-open-range", run("--cpus", "0-"), ["--cpus '0-' is not valid"]),
    Row("cpus-reversed", run("--cpus", "3-1"), ["--cpus '3-1' is not valid"]),
    Row("cpus-word", run("--cpus", "all"), ["--cpus 'all' is not valid"]),
    Row("cpus-huge", run("--cpus", "0-99999"), ["--cpus '0-99999' is not valid"]),
    Row(
        "cpus-outside",
        run("--cpus", str(OUTSIDE)),
        [f"--cpus '{OUTSIDE}' is not valid: CPU {OUTSIDE} is not usable here"],
    ),
    Row("cpus-blank-item", run("--cpus", "0,,1"), ["--cpus '0,,1' is not valid"]),
    Row("cpus-negative", run("--cpus", "-1"), ["--cpus '-1' is not valid"]),
    Row("cpus-arabic-digit", run("--cpus", "\u0660"), ["--cpus '\u0660' is not valid"]),
    # Labels (a newline would forge a token line).
    Row(
        "label-newline",
        run("-d", "npu", "-l", "a\nb"),
        ["-l/--label 'a\\nb' is not valid: a label must not contain control characters"],
    ),
    Row("label-escape", run("-d", "npu", "-l", "a\x1b[31m"), ["-l/--label 'a\\x1b[31m'"]),
    Row(
        "label-line-separator",
        run("-d", "npu", "-l", "a\u2028b"),
        ["-l/--label 'a\\u2028b' is not valid"],
    ),
    Row("label-empty", run("-d", "npu", "-l", ""), ["-l/--label '' is not valid"]),
    Row(
        "label-too-long",
        run("-d", "npu", "-l", "x" * 300),
        ["-l/--label 'xxxxxxxx", "(300 characters) is not valid: a label is at most 200"],
    ),
    Row("label-without-device", run("-l", "x"), ["--label needs --device"]),
    # Signals.
    Row("signal-kill", run("-s", "KILL"), ["--signal 'KILL' is not valid"]),
    Row("signal-stop", run("-s", "SIGSTOP"), ["--signal 'SIGSTOP' is not valid"]),
    Row("signal-nine", run("-s", "9"), ["--signal '9' is not valid"]),
    Row("signal-zero", run("-s", "0"), ["--signal '0' is not valid"]),
    Row("signal-out-of-range", run("-s", "999"), ["--signal '999' is not valid"]),
    Row("signal-unknown", run("-s", "SIGFOO"), ["--signal 'SIGFOO' is not valid"]),
    Row("signal-empty", run("-s", ""), ["--signal '' is not valid"]),
    Row("signal-negative", run("--signal=-15"), ["--signal '-15' is not valid"]),
    # Counts.
    Row("count-zero", run("-d", "npu", "-n", "0"), ["-n/--count '0' is not valid"]),
    Row("count-negative", run("-d", "npu", "-n", "-1"), ["-n/--count '-1' is not valid"]),
    Row("count-word", run("-d", "npu", "-n", "two"), ["-n/--count 'two' is not valid"]),
    Row("count-fraction", run("-d", "npu", "-n", "1.5"), ["-n/--count '1.5' is not valid"]),
    Row(
        "count-arabic-digit", run("-d", "npu", "-n", "\u0661"), ["-n/--count '\u0661' is not valid"]
    ),
    Row("count-without-device", run("-n", "1"), ["--count needs --device"]),
    Row(
        "count-disagrees-with-indices",
        run("-d", "npu:0", "-n", "2"),
        ["-n/--count '2' is not valid: the number of indices in --device npu:0"],
    ),
    # Device specs.
    Row("device-unknown-class", run("-d", "tpu"), ["--device 'tpu' is not valid: a device class"]),
    Row("device-close-class", run("-d", "npus"), ["--device 'npus'", "did you mean 'npu'?"]),
    Row("device-upper-case", run("-d", "NPU"), ["--device 'NPU' is not valid"]),
    Row("device-empty-indices", run("-d", "npu:"), ["--device 'npu:' is not valid"]),
    Row(
        "device-index-twice",
        run("-d", "npu:0,0"),
        ["--device 'npu:0,0' is not valid: each index once"],
    ),
    Row("device-plus-sign", run("-d", "npu:+0"), ["--device 'npu:+0' is not valid"]),
    Row("device-blank", run("-d", "npu: 0"), ["--device 'npu: 0' is not valid"]),
    Row(
        "device-out-of-range",
        run("-d", "npu:1"),
        ["--device 'npu:1' is not valid: indices 0-0 (npu has 1 here)"],
    ),
    Row("device-negative", run("-d", "npu:-1"), ["--device 'npu:-1' is not valid"]),
    Row("device-no-class", run("-d", ":0"), ["--device ':0' is not valid"]),
    Row("device-two-colons", run("-d", "npu:0:1"), ["--device 'npu:0:1' is not valid"]),
    Row("device-arabic-digit", run("-d", "npu:\u0660"), ["--device 'npu:\u0660' is not valid"]),
    Row(
        "device-huge-index",
        run("-d", "npu:" + "9" * 5000),
        ["--device 'npu:9999", "(5004 characters) is not valid"],
    ),
    # Variables.
    Row("env-blank-name", run("-e", "A B=1"), ["environment variable name 'A B' is not valid"]),
    Row("env-no-equals", run("-e", "NOEQ"), ["environment assignment 'NOEQ' is not valid"]),
    Row("env-empty-name", run("-e", "=x"), ["environment variable name '' is not valid"]),
    Row("pass-env-digit", run("--pass-env", "1X"), ["environment variable name '1X' is not valid"]),
    Row(
        "pass-env-assignment",
        run("--pass-env", "A=B"),
        ["environment variable name 'A=B' is not valid"],
    ),
    # Options.
    Row("option-cpu", run("--cpu", "0"), ["no such option: --cpu; did you mean '--cpus'?"]),
    Row(
        "option-devices",
        run("--devices", "npu"),
        ["no such option: --devices; did you mean '--device'?"],
    ),
    Row("option-lable", run("--lable", "x"), ["no such option: --lable; did you mean '--label'?"]),
    Row("option-unknown-short", run("-x"), ["no such option: -x"]),
    Row("option-flag-with-value", run("--verbose=1"), ["option --verbose takes no value"]),
    Row(
        "option-exclusive",
        run("-d", "npu", "--no-wait", "--wait-timeout", "1s"),
        ["--no-wait and --wait-timeout exclude each other"],
    ),
    Row("no-command", ["run", "-t", "1m"], ["no command given"]),
    # npu-hold: the same parser, its own name.
    Row(
        "npu-hold-time",
        ["-t", "5x", *TOUCH],
        ["npu-hold: -t/--time '5x' is not valid"],
        prog=NPU_HOLD,
    ),
    Row(
        "npu-hold-index", ["-d", "npu:0,0", *TOUCH], ["npu-hold: --device 'npu:0,0'"], prog=NPU_HOLD
    ),
    Row("npu-hold-option", ["--cpu", "0", *TOUCH], ["did you mean '--cpus'?"], prog=NPU_HOLD),
    # Path tricks: a configuration that is not a file.
    Row("config-directory", run(), ["HOLD_CONFIG '/' is not valid"], env={"HOLD_CONFIG": "/"}),
    Row(
        "config-device",
        run(),
        ["HOLD_CONFIG '/dev/zero' is not valid"],
        env={"HOLD_CONFIG": "/dev/zero"},
    ),
    Row(
        "config-missing",
        run(),
        ["HOLD_CONFIG '/nonexistent/config.yaml' is not valid"],
        env={"HOLD_CONFIG": "/nonexistent/config.yaml"},
    ),
    Row(
        "config-relative",
        run(),
        ["HOLD_CONFIG 'config.yaml' is not valid"],
        env={"HOLD_CONFIG": "config.yaml"},
    ),
    # A state directory that is not a directory of its own: never written in.
    Row("state-root", run(), ["HOLD_STATE_DIR '/' is not valid"], env={"HOLD_STATE_DIR": "/"}),
    Row(
        "state-relative",
        run(),
        ["HOLD_STATE_DIR 'state' is not valid"],
        env={"HOLD_STATE_DIR": "state"},
    ),
    Row(
        "state-dotdot",
        run(),
        ["HOLD_STATE_DIR '/tmp/..' is not valid"],
        env={"HOLD_STATE_DIR": "/tmp/.."},
    ),
]


def test_command_lines(tmp_path: Path) -> None:
    ids_unique(ARGV_ROWS)
    run_rows(tmp_path, ARGV_ROWS)


def test_count_beyond_the_class_is_refused_before_the_daemon(tmp_path: Path) -> None:
    run_rows(
        tmp_path,
        [
            Row("count-beyond-class", run("-d", "npu", "-n", "5"), ["'5'"]),
            Row("count-huge", run("-d", "npu", "-n", "9" * 30), ["'99999"]),
        ],
    )


# ----------------------------------------------------------------------------
# Stack files (hold validate, hold up).

HEAD = "name: t\nunits:\n  a:\n    cmd: [touch, '{marker}']\n"  # the unit is line 3


def unit(extra: str) -> str:
    """The stack with ``extra`` (lines of unit ``a``, from line 5)."""
    return HEAD + textwrap.indent(textwrap.dedent(extra), "    ")


def alias_bomb(levels: int = 7, items: int = 9) -> str:
    lines = [f"a0: &a0 [{', '.join(['x'] * items)}]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * items)}]")
    return "\n".join(lines) + "\n"


BOMB = alias_bomb()
DEEP = "[" * 2000 + "]" * 2000

# (id, document, what the errors must contain)
STACK_DOCS: list[tuple[str, str | bytes, list[str]]] = [
    # Durations.
    (
        "ready-timeout-unit",
        unit("ready: {file: x, timeout: 5x}\n"),
        ["{file}:5: units.a.ready.timeout: '5x' is not valid"],
    ),
    (
        "ready-timeout-plain",
        unit("ready: {file: x, timeout: 5}\n"),
        ["{file}:5: units.a.ready.timeout: 5 is not valid: a duration with its unit"],
    ),
    ("grace-word", unit("stop: {grace: soon}\n"), ["{file}:5: units.a.stop.grace: 'soon'"]),
    (
        "backoff-negative",
        unit("restart: {policy: always, backoff: -1s}\n"),
        ["{file}:5: units.a.restart.backoff: '-1s' is not valid"],
    ),
    (
        "ttl-plain",
        "name: t\nhold: {device: npu, ttl: 5}\nunits:\n  a: {cmd: [x]}\n",
        ["{file}:2: hold.ttl: 5 is not valid"],
    ),
    (
        "ttl-over-a-year",
        "name: t\nhold: {device: npu, ttl: 400d}\nunits:\n  a: {cmd: [x]}\n",
        ["{file}:2: hold.ttl: '400d' is not valid: at most a year"],
    ),
    # CPU lists.
    ("cpus-open", unit("cpus: 0-\n"), ["{file}:5: units.a.cpus: '0-' is not valid"]),
    ("cpus-empty", unit("cpus: ''\n"), ["{file}:5: units.a.cpus: '' is not valid"]),
    ("cpus-list", unit("cpus: [0, 1]\n"), ["{file}:5: units.a.cpus: [0, 1] is not valid"]),
    ("cpus-bool", unit("cpus: yes\n"), ["{file}:5: units.a.cpus: True is not valid"]),
    (
        "cpus-outside",
        unit(f"cpus: '{OUTSIDE}'\n"),
        [f"{{file}}:5: units.a.cpus: '{OUTSIDE}' is not valid: CPU {OUTSIDE} is not usable here"],
    ),
    # Labels.
    (
        "label-newline",
        'name: t\nhold: {device: npu, label: "a\\nb"}\nunits:\n  a: {cmd: [x]}\n',
        ["{file}:2: hold.label: 'a\\nb' is not valid: a label must not contain control"],
    ),
    (
        "label-too-long",
        "name: t\nhold: {device: npu, label: " + "x" * 300 + "}\nunits:\n  a: {cmd: [x]}\n",
        ["{file}:2: hold.label: 'xxx", "at most 200"],
    ),
    # Signals.
    ("signal-kill", unit("stop: {signal: KILL}\n"), ["{file}:5: units.a.stop.signal: 'KILL'"]),
    ("signal-zero", unit("stop: {signal: 0}\n"), ["{file}:5: units.a.stop.signal: 0 is not"]),
    ("signal-unknown", unit("stop: {signal: SIGFOO}\n"), ["units.a.stop.signal: 'SIGFOO'"]),
    # Counts.
    (
        "restart-max-negative",
        unit("restart: {policy: always, max: -1}\n"),
        ["{file}:5: units.a.restart.max: -1 is not valid: a whole number, 0 or more"],
    ),
    (
        "restart-max-bool",
        unit("restart: {policy: always, max: yes}\n"),
        ["{file}:5: units.a.restart.max: True is not valid"],
    ),
    (
        "concurrency-zero",
        unit("kind: task\ncpus: '0'\nconcurrency: 0\n"),
        ["{file}:7: units.a.concurrency: 0 is not valid: a whole number, 1 or more"],
    ),
    ("port-zero", unit("port: 0\n"), ["{file}:5: units.a.port: 0 is not valid"]),
    (
        "port-huge",
        unit("port: 99999999999999999999\n"),
        ["{file}:5: units.a.port: 99999999999999999999 is not valid"],
    ),
    # Device specs.
    (
        "device-unknown",
        "name: t\nhold: {device: tpu}\nunits:\n  a: {cmd: [x]}\n",
        ["{file}:2: hold.device: 'tpu' is not valid: a device class"],
    ),
    (
        "device-index-twice",
        "name: t\nhold: {device: 'npu:0,0'}\nunits:\n  a: {cmd: [x]}\n",
        ["{file}:2: hold.device: 'npu:0,0' is not valid: each index once"],
    ),
    (
        "device-plus",
        "name: t\nhold: {device: 'npu:+0'}\nunits:\n  a: {cmd: [x]}\n",
        ["{file}:2: hold.device: 'npu:+0' is not valid"],
    ),
    # Names and keys.
    (
        "unknown-key-command",
        "name: t\nunits:\n  a:\n    command: [x]\n",
        [
            "{file}:4: units.a.command: unknown key; accepted: kind, cmd,",
            "did you mean 'cmd'?",
            "{file}:3: units.a.cmd: missing (required)",
        ],
    ),
    (
        "unknown-key-depends-on",
        unit("depends_on: [b]\n"),
        ["{file}:5: units.a.depends_on: unknown key;", "did you mean 'after'?"],
    ),
    (
        "unknown-key-environment",
        unit("environment: {A: b}\n"),
        ["{file}:5: units.a.environment: unknown key;", "did you mean 'env'?"],
    ),
    (
        "unknown-key-services",
        "name: t\nservices:\n  a: {cmd: [x]}\n",
        ["{file}:2: services: unknown key;", "did you mean 'units'?"],
    ),
    (
        "unknown-key-typo",
        unit("ready: {file: x, timout: 1s}\n"),
        ["{file}:5: units.a.ready.timout: unknown key;", "did you mean 'timeout'?"],
    ),
    (
        "unknown-key-stop-timeout",
        unit("stop: {timeout: 5s}\n"),
        ["{file}:5: units.a.stop.timeout: unknown key;", "did you mean 'grace'?"],
    ),
    (
        "stack-name-dotdot",
        "name: ..\nunits:\n  a: {cmd: [x]}\n",
        ["{file}:1: name: '..' is not valid"],
    ),
    (
        "stack-name-slash",
        "name: ../../etc\nunits:\n  a: {cmd: [x]}\n",
        ["{file}:1: name: '../../etc' is not valid"],
    ),
    (
        "unit-name-slash",
        "name: t\nunits:\n  a/b: {cmd: [x]}\n",
        ["{file}:3: units.a/b: 'a/b' is not a valid unit name"],
    ),
    ("env-name", unit("env: {'A=B': x}\n"), ["{file}:5: units.a.env.A=B: 'A=B' is not valid"]),
    (
        "cmd-nul",
        unit('ready: {exec: ["a\\0b"]}\n'),
        ["{file}:5: units.a.ready.exec: item 0: 'a\\x00b' is not valid: no NUL characters"],
    ),
    # YAML documents.
    (
        "alias-bomb",
        "name: t\nunits:\n  a: {cmd: [x]}\n" + BOMB,
        ["{file}:9: a5[0]: alias *a4: the document holds more than 100000 values"],
    ),
    (
        "deep",
        "name: t\nunits:\n  a: {cmd: [x]}\nx: " + DEEP + "\n",
        ["{file}:4: ", "nested deeper than 64 levels"],
    ),
    (
        "deep-block",
        "name: t\nunits:\n" + "".join(" " * (2 * i) + "a:\n" for i in range(1, 100)),
        ["{file}:66: ", "nested deeper than 64 levels"],
    ),
    (
        "not-utf8",
        b"name: t\nunits:\n  a: {cmd: [caf\xe9]}\n",
        ["{file}:3: not UTF-8 text: byte 0xe9 at offset 30 (line 3, column 16)"],
    ),
    ("latin1-bom", b"\xff\xfename: t\n", ["{file}:1: not UTF-8 text: byte 0xff at offset 0"]),
    (
        "duplicate-unit",
        "name: t\nunits:\n  a: {cmd: [x]}\n  a: {cmd: [y]}\n",
        ["{file}:4: units.a: duplicate key 'a', first at {file}:3"],
    ),
    (
        "duplicate-units",
        "name: t\nunits:\n  a: {cmd: [x]}\nunits:\n  b: {cmd: [y]}\n",
        ["{file}:4: units: duplicate key 'units', first at {file}:2"],
    ),
    (
        "duplicate-cmd",
        "name: t\nunits:\n  a:\n    cmd: [x]\n    cmd: [y]\n",
        ["{file}:5: units.a.cmd: duplicate key 'cmd', first at {file}:4"],
    ),
    (
        "alias-recursive",
        "name: t\nunits: &u\n  a: {cmd: [x], after: *u}\n",
        ["{file}:3: units.a.after: alias *u is inside the value it names"],
    ),
    (
        "alias-undefined",
        "name: t\nunits:\n  a: {cmd: *c}\n",
        ["{file}:3: units.a.cmd: alias *c names no anchor before it"],
    ),
    (
        "tag-python",
        "name: !!python/object/apply:os.system [touch {marker}]\nunits: {}\n",
        ["{file}:1: name: the tag 'tag:yaml.org,2002:python/object/apply:os.system' is not"],
    ),
    (
        "tag-binary",
        "name: t\nunits:\n  a: {cmd: [!!binary eA==]}\n",
        ["{file}:3: units.a.cmd[0]: the tag 'tag:yaml.org,2002:binary' is not accepted"],
    ),
    (
        "merge-key",
        "name: t\nx: &d {cmd: [x]}\nunits:\n  a: {<<: *d}\n",
        ["{file}:4: units.a: merge keys (<<) are not supported"],
    ),
    (
        "two-documents",
        "name: t\nunits:\n  a: {cmd: [x]}\n---\nname: u\n",
        ["{file}:4: a second document (---): the file holds one"],
    ),
    (
        "control-character",
        "name: t\x07\nunits:\n  a: {cmd: [x]}\n",
        ["{file}:1: not valid YAML: character '\\x07' is not allowed"],
    ),
    ("syntax", "name: t\nunits:\n  a: {cmd: [x]\n", ["{file}:4: not valid YAML"]),
    (
        "complex-key",
        "name: t\nunits:\n  ? [a]\n  : {cmd: [x]}\n",
        ["{file}:3: units: a key must be a plain value"],
    ),
    ("empty", "", ["{file}:1: the file is empty"]),
    ("top-level-list", "- a\n", ["{file}:1: the top level must be a mapping"]),
    (
        "huge-int",
        unit("restart: {max: " + "9" * 5000 + "}\n"),
        ["{file}:5: units.a.restart.max: '9999", "(5000 characters) is not a valid number"],
    ),
    (
        "too-large",
        "name: t\nunits:\n  a: {cmd: [x]}\n# " + "x" * (1 << 20) + "\n",
        ["{file}: larger than 1024 KiB"],
    ),
]

# The rows also run through the CLI (the rest are read in-process only).
STACK_CLI = {
    "alias-bomb",
    "deep",
    "not-utf8",
    "duplicate-unit",
    "unknown-key-command",
    "device-index-twice",
    "label-newline",
    "cpus-outside",
    "tag-python",
    "too-large",
}


def write_doc(path: Path, doc: str | bytes, marker: Path) -> Path:
    data = doc if isinstance(doc, bytes) else doc.encode()
    path.write_bytes(data.replace(b"{marker}", str(marker).encode()))
    return path


def test_stack_files_read_in_process(tmp_path: Path) -> None:
    """Every stack row through the loader every command uses (the hold layer's checks too)."""
    from hold.cli.stack import load_checked

    failures = []
    for i, (rid, doc, expect) in enumerate(STACK_DOCS):
        path = write_doc(tmp_path / f"stack{i}.yaml", doc, tmp_path / "marker")
        t = time.monotonic()
        try:
            load_checked(str(path))
        except StackFileError as e:
            got = e.errors
        else:
            failures.append(f"{rid}: accepted")
            continue
        took = time.monotonic() - t
        text = "\n".join(got)
        missing = [w.replace("{file}", str(path)) for w in expect]
        missing = [w for w in missing if w not in text]
        if missing or took > 1.0 or not all(e.startswith(f"{path}:") for e in got):
            failures.append(f"{rid}: missing {missing} (took {took:.2f}s) in:\n    {text}")
    assert not failures, "\n".join(failures)


def test_stack_files_through_hold_validate_and_up(tmp_path: Path) -> None:
    rows = [
        Row(f"{cmd}-{rid}", [cmd, "{file}"], expect, doc=doc)
        for rid, doc, expect in STACK_DOCS
        if rid in STACK_CLI
        for cmd in ("validate", "up")
    ]
    assert len(rows) == 2 * len(STACK_CLI)
    run_rows(tmp_path, rows)


def test_stack_file_path_tricks(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    rows = [
        Row("up-directory", ["up", str(tmp_path)], [f"{tmp_path}: not a regular file"]),
        Row("up-fifo", ["up", str(fifo)], [f"{fifo}: not a regular file"]),  # never blocks
        Row("up-device", ["up", "/dev/zero"], ["/dev/zero: not a regular file"]),
        Row(
            "up-missing",
            ["up", "/nonexistent.yaml"],
            ["/nonexistent.yaml: cannot read the file: No such file or directory"],
        ),
        Row(
            "validate-symlink-loop",
            ["validate", str(tmp_path / "loop1")],
            ["cannot read the file: Too many levels of symbolic links"],
        ),
    ]
    run_rows(tmp_path, rows)


# ----------------------------------------------------------------------------
# Configuration files.

# (id, document, what the message must contain, line expected in file:line)
CONFIG_DOCS: list[tuple[str, str | bytes, str]] = [
    (
        "visible-env-assignment",
        "devices:\n  x:\n    nodes: [/dev/x]\n    visible_env: ['A=B']\n",
        "{file}:4: devices.x.visible_env 'A=B' is not valid: a variable name",
    ),
    (
        "visible-env-digit",
        "devices:\n  x:\n    nodes: [/dev/x]\n    visible_env: [1A]\n",
        "{file}:4: devices.x.visible_env '1A' is not valid: a variable name",
    ),
    (
        "visible-env-hold",
        "devices:\n  x:\n    nodes: [/dev/x]\n    visible_env: [HOLD_TREE]\n",
        "{file}:4: devices.x.visible_env 'HOLD_TREE' is not valid: a variable hold does not set",
    ),
    (
        "visible-env-path",
        "devices:\n  x:\n    nodes: [/dev/x]\n    visible_env: [PATH]\n",
        "{file}:4: devices.x.visible_env 'PATH' is not valid",
    ),
    (
        "visible-env-ld-preload",
        "devices:\n  x:\n    nodes: [/dev/x]\n    visible_env: [LD_PRELOAD]\n",
        "{file}:4: devices.x.visible_env 'LD_PRELOAD' is not valid: a variable that selects",
    ),
    (
        "visible-env-home",
        "devices:\n  x:\n    nodes: [/dev/x]\n    visible_env: [CUDA_VISIBLE_DEVICES, HOME]\n",
        "{file}:4: devices.x.visible_env 'HOME' is not valid: a variable that selects",
    ),
    (
        "visible-env-nested",
        "devices:\n  x:\n    nodes: [/dev/x]\n    visible_env: [[A]]\n",
        "{file}:4: devices.x.visible_env '(a list or mapping)' is not valid",
    ),
    (
        "nodes-relative",
        "devices:\n  x:\n    nodes: [dev/x]\n",
        "{file}:3: devices.x.nodes 'dev/x' is not valid: an absolute path pattern",
    ),
    (
        "nodes-dotdot",
        "devices:\n  x:\n    nodes: [/dev/../etc/passwd]\n",
        "{file}:3: devices.x.nodes '/dev/../etc/passwd' is not valid: an absolute path pattern, "
        "normalised",
    ),
    (
        "nodes-newline",
        'devices:\n  x:\n    nodes: ["/dev/x\\ny"]\n',
        "{file}:3: devices.x.nodes '/dev/x\\ny' is not valid: an absolute path pattern without "
        "control characters",
    ),
    (
        "nodes-not-a-list",
        "devices:\n  x:\n    nodes: /dev/x\n",
        "{file}:3: devices.x.nodes '(not a list)' is not valid",
    ),
    (
        "nodes-missing",
        "devices:\n  x:\n    visible_env: [X]\n",
        "{file}:3: devices.x '(no nodes)' is not valid",
    ),
    (
        "holder-relative",
        "devices:\n  x:\n    nodes: [/dev/x]\n    allowed_holders: [bin/d]\n",
        "{file}:4: devices.x.allowed_holders 'bin/d' is not valid: an absolute path",
    ),
    (
        "holder-not-normal",
        "devices:\n  x:\n    nodes: [/dev/x]\n    allowed_holders: [/usr//d]\n",
        "{file}:4: devices.x.allowed_holders '/usr//d' is not valid",
    ),
    (
        "class-upper",
        "devices:\n  GPU:\n    nodes: [/dev/x]\n",
        "{file}:2: device class name 'GPU' is not valid",
    ),
    (
        "class-digit",
        "devices:\n  1gpu:\n    nodes: [/dev/x]\n",
        "{file}:2: device class name '1gpu' is not valid",
    ),
    (
        "class-twice",
        "devices:\n  x: {nodes: [/dev/x]}\n  x: {nodes: [/dev/y]}\n",
        "{file}:3: devices.x: duplicate key 'x', first at {file}:2",
    ),
    (
        "nodes-twice",
        "devices:\n  x:\n    nodes: [/dev/x]\n    nodes: [/dev/y]\n",
        "{file}:4: devices.x.nodes: duplicate key 'nodes', first at {file}:3",
    ),
    (
        "devices-twice",
        "devices: {}\ndevices: {}\n",
        "{file}:2: devices: duplicate key 'devices', first at {file}:1",
    ),
    (
        "class-key-typo",
        "devices:\n  x:\n    node: [/dev/x]\n",
        "{file}:3: key devices.x. 'node' is not valid: one of nodes, shared_nodes, visible_env, "
        "allowed_holders; did you mean 'nodes'?",
    ),
    (
        "class-key-env",
        "devices:\n  x:\n    nodes: [/dev/x]\n    env: [X]\n",
        "{file}:4: key devices.x. 'env' is not valid:",
    ),
    (
        "class-not-mapping",
        "devices:\n  x: [/dev/x]\n",
        "{file}:2: devices.x '(not a mapping)' is not valid",
    ),
    (
        "cgroups-word",
        "cgroups: maybe\n",
        "{file}:1: cgroups 'maybe' is not valid: one of auto, off, required",
    ),
    (
        "cgroups-typo",
        "cgroup: auto\n",
        "{file}:1: key 'cgroup' is not valid: one of busy_devices, cgroups, compat, devices, "
        "limits, report, scratch, state, unreadable_processes; did you mean 'cgroups'?",
    ),
    (
        "report-labels-word",
        "report: {labels: yes}\n",
        "{file}:1: report.labels 'yes' is not valid: one of true, false",
    ),
    ("report-sample-zero", "report:\n  sample: 0s\n", "{file}:2: report.sample '0s' is not valid"),
    (
        "report-typo",
        "report: {label: true}\n",
        "{file}:1: key report. 'label' is not valid: labels or sample; did you mean 'labels'?",
    ),
    ("busy-word", "busy_devices: block\n", "{file}:1: busy_devices 'block' is not valid"),
    ("state-yes", "state: {shared: yes}\n", "{file}:1: state.shared 'yes' is not valid"),
    (
        "scratch-size-word",
        "scratch: {min_free: lots}\n",
        "{file}:1: scratch.min_free 'lots' is not valid: a size such as 500M",
    ),
    (
        "scratch-typo",
        "scratch: {min_fre: 1G}\n",
        "{file}:1: key scratch. 'min_fre' is not valid: min_free; did you mean 'min_free'?",
    ),
    (
        "compat-typo",
        "compat: {home_token: true}\n",
        "{file}:1: key compat. 'home_token' is not valid: home_tokens; did you mean 'home_tokens'?",
    ),
    ("top-level-list", "- cgroups\n", "{file}:1: the top level '(a list)' is not valid"),
    (
        "alias-bomb",
        "cgroups: auto\nx:\n" + textwrap.indent(BOMB, "  "),
        "{file}:8: x.a5[0]: alias *a4: the document holds more than 100000 values",
    ),
    ("deep", "cgroups: auto\nx: " + DEEP + "\n", "nested deeper than 64 levels"),
    (
        "not-utf8",
        b"cgroups: \xff\n",
        "{file}:1: not UTF-8 text: byte 0xff at offset 9 (line 1, column 10)",
    ),
    (
        "tag",
        "cgroups: !!python/name:os.system\n",
        "{file}:1: cgroups: the tag 'tag:yaml.org,2002:python/name:os.system' is not accepted",
    ),
    ("two-documents", "cgroups: auto\n---\ncgroups: off\n", "{file}:2: a second document"),
    ("syntax", "devices: {x: [\n", "{file}:2: not valid YAML"),
]

CONFIG_CLI = {
    "visible-env-assignment",
    "class-twice",
    "alias-bomb",
    "deep",
    "not-utf8",
    "cgroups-typo",
    "nodes-dotdot",
}


def test_configuration_files_read_in_process(tmp_path: Path) -> None:
    from hold.config import parse_file

    failures = []
    for i, (rid, doc, expect) in enumerate(CONFIG_DOCS):
        path = write_doc(tmp_path / f"config{i}.yaml", doc, tmp_path / "marker")
        t = time.monotonic()
        try:
            parse_file(str(path))
        except BadValue as e:
            got = str(e)
        else:
            failures.append(f"{rid}: accepted")
            continue
        took = time.monotonic() - t
        want = expect.replace("{file}", str(path))
        if want not in got or took > 1.0 or not got.startswith(f"{path}:"):
            failures.append(f"{rid}: {want!r} not in (took {took:.2f}s):\n    {got}")
    assert not failures, "\n".join(failures)


def test_configuration_files_through_every_kind_of_command(tmp_path: Path) -> None:
    """A bad configuration is exit 2 for `hold run` (with and without a device), `npu-hold`,
    `hold validate` and `hold up`, before anything starts."""
    stack = tmp_path / "ok.yaml"
    stack.write_text("name: ok\nunits:\n  a: {cmd: [touch, '" + str(tmp_path / "m") + "']}\n")
    commands = {
        "run": (HOLD, run()),
        "run-device": (HOLD, run("-d", "npu")),
        "npu-hold": (NPU_HOLD, TOUCH),
        "validate": (HOLD, ["validate", str(stack)]),
        "up": (HOLD, ["up", str(stack)]),
    }
    rows = []
    for rid, doc, expect in CONFIG_DOCS:
        if rid not in CONFIG_CLI:
            continue
        for name, (prog, argv) in commands.items():
            rows.append(Row(f"{name}-{rid}", argv, [expect], config=doc, prog=prog))
    run_rows(tmp_path, rows)
    assert not (tmp_path / "m").exists()
