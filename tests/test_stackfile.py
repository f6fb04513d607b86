"""The stack file: strict validation, every error at once, each with file:line and key path.

Most checks call :func:`hold_supervisor.stackfile.load.load` directly; ``hold validate``
and ``hold up`` are run once each to show the exit status (2), that the hold
layer's checks (device class, label) join the same list, and that nothing starts.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import CPU, HOLD, ROOT

from hold_supervisor.parse import allowed_cpus, format_cpus
from hold_supervisor.stackfile.load import StackFileError, fill, load

GOOD = """\
name: qwen-tools
hold: {device: npu, ttl: 4h, label: "qwen tools"}
units:
  model:
    cmd: [llama-server, --port, "{port}", -m, /models/q.gguf]
    port: auto
    cpus: "{CPU}"
    env: {OMP_NUM_THREADS: "12", THREADS: 12}
    pass_env: [HF_HOME]
    ready: {http: /health, timeout: 120s}
    restart: {policy: on-failure, max: 3, backoff: 1s, max_backoff: 30s}
    stop: {signal: TERM, grace: 10s}
  predictor:
    cmd: [predictor, --model-url, "http://127.0.0.1:{units.model.port}", "{{literal}}"]
    after: [model]
    ready: {log: "READY", timeout: 30s}
    restart: {policy: no}
  executor:
    cmd: [executor-daemon, --state, "{run_dir}/executor"]
    port: 9000
    after: [predictor]
    ready: {tcp: "{port}", timeout: 10s}
    stop: {signal: SIGINT, grace: 0s}
"""


def errors_of(text: str, tmp_path: Path) -> list[str]:
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    with pytest.raises(StackFileError) as info:
        load(str(path))
    prefix = f"{path}:"
    for e in info.value.errors:
        assert e.startswith(prefix), e
    return [e[len(prefix) :] for e in info.value.errors]


def test_the_issue_example_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text(GOOD.replace("{CPU}", str(CPU)))
    spec = load(str(path))
    assert spec.name == "qwen-tools"
    assert spec.order() == ["model", "predictor", "executor"]
    model = spec.units["model"]
    assert model.port == "auto" and model.cpus == frozenset({CPU})
    assert model.ready is not None and model.ready.timeout == 120.0
    assert model.env == {"OMP_NUM_THREADS": "12", "THREADS": "12"}
    assert model.restart.policy == "on-failure" and model.restart.max_backoff == 30.0
    assert spec.units["predictor"].restart.policy == "no"  # YAML's unquoted `no`
    assert spec.units["executor"].stop.signal == 2 and spec.units["executor"].stop.grace == 0
    assert spec.hold is not None and spec.hold.ttl == 4 * 3600
    assert spec.where("hold", "device") == f"{path}:2: hold.device"
    filled = [
        fill(a, unit="predictor", ports={"model": 4321, "executor": 9000}, run_dir="/r")
        for a in spec.units["predictor"].cmd
    ]
    assert filled[2:] == ["http://127.0.0.1:4321", "{literal}"]


def test_every_error_at_once_with_line_and_key_path(tmp_path: Path) -> None:
    outside = max(allowed_cpus()) + 1
    errs = errors_of(
        f"""\
name: qwen tools
colour: blue
units:
  model:
    cmd: [llama-server, --port, "{{prot}}", yes]
    port: automatic
    cpus: {CPU},{outside}
    env: {{1BAD: x}}
    ready: {{http: /health, timeout: 5x}}
    restart: {{policy: sometimes, max: -1, backoff: 10}}
    stop: {{signal: KILL, grace: soon}}
    after: [nobody, predictor]
    kind: job
    extra_key: 1
  predictor:
    after: [model]
    cmd: [predictor, "http://127.0.0.1:{{units.ghost.port}}", "{{units.executor.port}}"]
    ready: {{tcp: "{{port}}"}}
  executor:
    ready: {{}}
    cpus: "0-"
""",
        tmp_path,
    )
    text = "\n".join(errs)
    expect = [
        "1: name: 'qwen tools' is not valid: letters, digits",
        "2: colour: unknown key; accepted: name, hold, units",
        "5: units.model.cmd[2]: unknown placeholder {prot}: accepted {port}, {units.NAME.port}, "
        "{run_dir}, {stack_dir} or {scratch}",
        "5: units.model.cmd[3]: YAML reads the unquoted word 'yes' as the boolean true, not "
        "text: quote it ('yes')",
        "6: units.model.port: 'automatic' is not valid: auto (the kernel picks a free port) or a "
        "port number 1-65535",
        f"7: units.model.cpus: '{CPU},{outside}' is not valid: CPU {outside} is not usable here; a "
        f"list of CPUs and ranges like 0-3,8, each within the CPUs this process may use "
        f"({format_cpus(allowed_cpus())})",
        "8: units.model.env.1BAD: '1BAD' is not valid: letters, digits and _",
        "9: units.model.ready.timeout: '5x' is not valid: a duration with its unit: 250ms, 10s, "
        "4m, 2h",
        "10: units.model.restart.policy: 'sometimes' is not valid: one of no, on-failure, always",
        "10: units.model.restart.max: -1 is not valid: a whole number, 0 or more",
        "10: units.model.restart.backoff: 10 is not valid: a duration with its unit",
        "11: units.model.stop.signal: 'KILL' is not valid: a signal name or number",
        "11: units.model.stop.grace: 'soon' is not valid: a duration with its unit",
        "12: units.model.after[0]: 'nobody' names no unit (units: model, predictor, executor)",
        "12: units.model.after: cycle: model -> predictor -> model",
        "13: units.model.kind: 'job' is not valid: one of service, oneshot, task",
        "14: units.model.extra_key: unknown key; accepted: kind, cmd, cwd, port, cpus, env, "
        "env_file, pass_env, ready, liveness, restart, stop, after, essential, scratch, timeout, "
        "concurrency, args",
        "17: units.predictor.cmd[1]: {units.ghost.port} names no unit",
        "17: units.predictor.cmd[2]: {units.executor.port}: unit executor has no port",
        "18: units.predictor.ready.tcp: {port} used, but unit predictor has no port",
        "19: units.executor.cmd: missing (required)",
        "20: units.executor.ready: exactly one of http, tcp, log, exec, file, notify is needed",
        "21: units.executor.cpus: '0-' is not valid: a list of CPUs and ranges",
    ]
    for e in expect:
        assert any(line.startswith(e) for line in errs), f"missing {e!r} in:\n{text}"
    assert len(errs) == len(expect), text
    # In file order.
    assert [int(e.split(":")[0]) for e in errs] == sorted(int(e.split(":")[0]) for e in errs)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name: x\nunits:\n  a: {cmd: [a], after: [a]}\n", "3: units.a.after[0]: cycle: a -> a"),
        (
            "name: x\nunits:\n  a: {cmd: [a], after: [c]}\n  b: {cmd: [b], after: [a]}\n"
            "  c: {cmd: [c], after: [b]}\n",
            "3: units.a.after: cycle: a -> c -> b -> a",
        ),
        (
            "name: x\nunits:\n  a: {cmd: [a, '{units.b}']}\n",
            "3: units.a.cmd[1]: unknown placeholder {units.b}",
        ),
        (
            "name: x\nunits:\n  a: {cmd: [a, 'x{port']}\n",
            "3: units.a.cmd[1]: '{port' has no closing brace",
        ),
        (
            "name: x\nunits:\n  a: {cmd: [a], env: {X: '{home}'}}\n",
            "3: units.a.env.X: unknown placeholder {home}",
        ),
        (
            "name: x\nunits:\n  a: {cmd: a b c}\n",
            "3: units.a.cmd: 'a b c' is not valid: a non-empty list",
        ),
        ("name: x\nunits:\n  a: {cmd: []}\n", "3: units.a.cmd: [] is not valid: a non-empty list"),
        (
            "name: x\nunits:\n  a: {cmd: [a], ready: {http: /h}}\n",
            "3: units.a.ready.http: an http probe needs the unit's port",
        ),
        (
            "name: x\nunits:\n  a: {cmd: [a], ready: {http: health, timeout: 1s}, port: 80}\n",
            "3: units.a.ready.http: 'health' is not valid: a path such as /health",
        ),
        (
            "name: x\nunits:\n  a: {cmd: [a], ready: {log: '(', timeout: 1s}}\n",
            "3: units.a.ready.log: '(' is not valid: a regular expression",
        ),
        (
            "name: x\nunits:\n  a: {cmd: [a], ready: {log: x, file: y}}\n",
            "3: units.a.ready: exactly one of http, tcp, log, exec, file, notify is needed "
            "(got log, file)",
        ),
        (
            "name: x\nunits:\n  a: {cmd: [a], port: 80}\n  b: {cmd: [b], port: 80}\n",
            "4: units.b.port: port 80 is already unit a's",
        ),
        ("name: x\nunits:\n  a: {cmd: [a], port: 0}\n", "3: units.a.port: 0 is not valid"),
        (
            "name: x\nunits:\n  a: {cmd: [a], stop: {grace: 0}}\n",
            "3: units.a.stop.grace: 0 is not valid: a duration with its unit",
        ),
        ("name: x\nunits:\n  a: {cmd: [a], cpus: ''}\n", "3: units.a.cpus: '' is not valid"),
        ("name: x\nunits:\n  a: {cmd: [a]}\n  a: {cmd: [b]}\n", "4: units.a: duplicate key"),
        ("name: x\nunits:\n  a.b: {cmd: [a]}\n", "3: units.a.b: 'a.b' is not a valid unit name"),
        ("name: x\nunits: [a]\n", "2: units: ['a'] is not valid: a mapping"),
        ("name: x\n", "1: units: missing (required)"),
        ("- a\n", "1: the top level must be a mapping with name and units"),
        ("name: x\nunits:\n  a: {cmd: [a]\n", "4: not valid YAML"),
        (
            "name: x\nhold: {device: npu, ttl: 5, colour: red}\nunits:\n  a: {cmd: [a]}\n",
            "2: hold.ttl: 5 is not valid: a duration with its unit",
        ),
    ],
)
def test_each_error(tmp_path: Path, text: str, expected: str) -> None:
    errs = errors_of(text, tmp_path)
    assert any(e.startswith(expected) for e in errs), errs


def test_hold_validate_and_up_refuse_with_exit_2_and_start_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    path = tmp_path / "stack.yaml"
    path.write_text(f"""\
name: bad
hold: {{device: tpu, label: "two\\nlines"}}
units:
  a:
    cmd: [touch, "{marker}"]
    ready: {{file: "{marker}", timeout: 1}}
""")
    for cmd in ("validate", "up"):
        res = subprocess.run([*HOLD, cmd, str(path)], capture_output=True, text=True, timeout=30)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.splitlines()
        assert any(
            ln.startswith(f"{path}:2: hold.device: 'tpu' is not valid: a device class: ")
            for ln in lines
        ), res.stderr
        assert any(
            ln.startswith(
                f"{path}:2: hold.label: 'two\\nlines' is not valid: a label "
                "must not contain control characters"
            )
            for ln in lines
        ), lines
        assert any(
            ln.startswith(f"{path}:6: units.a.ready.timeout: 1 is not valid") for ln in lines
        ), lines
    assert not marker.exists()


def test_hold_validate_accepts_the_demo_stack() -> None:
    res = subprocess.run(
        [*HOLD, "validate", "units/demo-stack.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "units/demo-stack.yaml: stack demo is valid: 3 unit(s) started by hold up"
    assert [ln.split()[:2] for ln in lines[2:]] == [
        ["1.", "model"],
        ["2.", "predictor"],
        ["3.", "executor"],
    ]
    assert "after predictor (ready)" in lines[4]


def test_missing_program_is_refused_before_anything_starts(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    path = tmp_path / "stack.yaml"
    path.write_text(f"""\
name: missing
units:
  a:
    cmd: [touch, "{marker}"]
  b:
    cmd: [no-such-program-here]
""")
    res = subprocess.run(
        [*HOLD, "up", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 127, res.stderr
    assert f"{path}:6: units.b.cmd: no-such-program-here: command not found" in res.stderr
    assert not marker.exists()


# --------------------------------------------------------------------------
# The strict reader's refusals, and what people of other tools type.


def test_unknown_keys_get_a_did_you_mean(tmp_path: Path) -> None:
    errs = errors_of(
        """\
name: x
services: {}
units:
  a:
    command: [a]
    depends_on: [b]
    environment: {A: b}
    restart: {policy: always, max_restarts: 3}
    stop: {timeout: 5s}
    ready: {file: x, timout: 1s}
  b: {cmd: [b], cpu: "0"}
""",
        tmp_path,
    )
    text = "\n".join(errs)
    for line, key, ours in [
        (2, "services", "units"),
        (5, "units.a.command", "cmd"),
        (6, "units.a.depends_on", "after"),
        (7, "units.a.environment", "env"),
        (8, "units.a.restart.max_restarts", "max"),
        (9, "units.a.stop.timeout", "grace"),
        (10, "units.a.ready.timout", "timeout"),
        (11, "units.b.cpu", "cpus"),
    ]:
        assert any(
            e.startswith(f"{line}: {key}: unknown key; accepted: ")
            and e.endswith(f"; did you mean {ours!r}?")
            for e in errs
        ), f"{key} -> {ours} not in:\n{text}"


def test_every_synonym_names_a_key_of_its_table() -> None:
    from hold_supervisor.stackfile.schema import STACK

    for where, table in STACK.tables():
        for theirs, ours in table.synonyms.items():
            assert ours in table.keys, (where, theirs, ours)
            assert theirs not in table.keys, (where, theirs)
            assert theirs == theirs.lower().replace("-", "_"), theirs


def test_duplicate_keys_name_both_lines(tmp_path: Path) -> None:
    errs = errors_of("name: x\nunits:\n  a:\n    cmd: [a]\n    cmd: [b]\nname: y\n", tmp_path)
    path = tmp_path / "stack.yaml"
    assert errs == [
        f"5: units.a.cmd: duplicate key 'cmd', first at {path}:4 (each key once)",
        f"6: name: duplicate key 'name', first at {path}:1 (each key once)",
    ]


def test_a_number_in_a_command_is_the_text_written(tmp_path: Path) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text(
        "name: x\nunits:\n  a:\n    cmd: [sleep, 010, 1:30, 1_000, 0x10, 2.50, 7]\n"
        "    env: {A: 010}\n    ready: {exec: [check, 0o7]}\n"
    )
    unit = load(str(path)).units["a"]
    # YAML 1.1 would have made these 8, 90, 1000, 16 and 2.5.
    assert unit.cmd == ("sleep", "010", "1:30", "1_000", "0x10", "2.50", "7")
    assert unit.env == {"A": "010"}
    assert unit.ready is not None and unit.ready.exec == ("check", "0o7")


def test_a_date_is_text_and_a_python_tag_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text("name: x\nunits:\n  a: {cmd: [backup, 2024-01-01]}\n")
    assert load(str(path)).units["a"].cmd == ("backup", "2024-01-01")
    errs = errors_of("name: x\nunits:\n  a: {cmd: [!!python/name:os.system x]}\n", tmp_path)
    assert errs[0].startswith("3: units.a.cmd[0]: the tag 'tag:yaml.org,2002:python/name:")


def test_the_number_of_errors_listed_is_bounded(tmp_path: Path) -> None:
    from hold_supervisor.stackfile.load import MAX_ERRORS

    body = "".join(f"  u{i}: {{cmd: [x], kind: job}}\n" for i in range(300))
    errs = errors_of("name: x\nunits:\n" + body, tmp_path)
    assert len(errs) == MAX_ERRORS + 1
    assert errs[-1] == f" ... and {300 - MAX_ERRORS} more problems"
