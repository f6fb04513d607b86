"""The stack file's one schema (``supervisor/stackfile/schema.py``): a table of keys
per mapping, walked by one reader.

Checked over a stack that uses every key of every table: each key is in the
README's reference, refused with a value of the wrong type, missing or null as
its table says; then over thousands of mutations of that stack (each value
replaced by values of every shape, each key removed, an unknown key added):
each is read into a spec (that travels as JSON unchanged) or refused, every
problem at a key path of the file. Last, in a process of its own: a file is
loaded without pydantic, and a bad one is refused with its line (by ``hold
validate``, exit 2).
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conftest import CPU, HOLD, ROOT

from hold_supervisor import yamlsafe
from hold_supervisor.stackfile import schema
from hold_supervisor.stackfile.checks import cross_checks
from hold_supervisor.stackfile.load import _plain
from hold_supervisor.stackfile.spec import UnitSpec, from_json, to_json
from hold_supervisor.stackfile.values import YamlWord

EVERY_KEY = (
    textwrap.dedent("""\
    name: every-key
    hold: {device: npu, ttl: 4h, label: "the label"}
    units:
      model:
        kind: service
        cmd: [server, --port, "{port}", 8080, "1.5"]
        cwd: .
        port: auto
        cpus: "0"
        env: {A: "1", B: "{port}"}
        env_file: vars.env
        pass_env: [HOME, PATH]
        ready: {http: /health, timeout: 20s}
        liveness: {tcp: "{port}", period: 5s, timeout: 1s, failures: 2}
        restart: {policy: on-failure, max: 4, backoff: 0s, max_backoff: 9s, reset_after: 1m}
        stop: {signal: INT, grace: 0s}
        essential: false
        scratch: {keep: true, min_free: 1G}
      pred:
        cmd: [pred]
        port: 9000
        after: {model: ready, init: completed}
        ready: {log: "READY.*", timeout: 1s}
        liveness: {exec: "test -e x"}
        scratch: true
      side:
        cmd: [side]
        after: [model]
        ready: {exec: [check, "1"]}
        liveness: {file: /tmp/x}
        scratch: false
      note:
        cmd: [note]
        ready: {notify: true}
        restart: {policy: no}
        stop: {signal: 15}
      tcp:
        cmd: [t]
        port: 8082
        ready: {tcp: 8081}
        liveness: {http: /alive}
      filed:
        cmd: [f]
        ready: {file: /tmp/ready}
      init:
        kind: oneshot
        cmd: [init]
        timeout: 30s
      job:
        kind: task
        cmd: [job]
        cpus: 0-1
        timeout: 2m
        concurrency: 2
        args:
          n: {type: int, min: 1, max: 5, required: true}
          s: {type: str, max_len: 3, choices: [a, b]}
          f: {type: float, min: -1.5}
          b: {type: bool}
""")
    .replace('cpus: "0"', f'cpus: "{CPU}"')
    .replace("cpus: 0-1", f"cpus: {CPU}-{CPU}")
)

MINIMAL = "name: m\nunits:\n  a: {cmd: [x]}\n"

# Values of every shape YAML can give (and a few it cannot), put in every place.
VALUES: list[Any] = [
    None,
    "",
    "x",
    "auto",
    "TERM",
    "KILL",
    "/health",
    "{port}",
    "10s",
    "0s",
    "5",
    "0-1",
    "a\0b",
    "int",
    "on-failure",
    "service",
    "task",
    "oneshot",
    "ready",
    "1G",
    YamlWord("yes", True),
    YamlWord("", None),
    True,
    False,
    0,
    1,
    -1,
    2.5,
    70000,
    10**30,
    float("nan"),
    [],
    ["a"],
    [None],
    ["a", 1],
    [[]],
    {},
    {"k": "v"},
    {"type": "int"},
]


def read(text: str) -> tuple[dict[str, Any], dict[Any, int]]:
    root = yamlsafe.compose(text, "s.yaml")
    lines: dict[Any, int] = {}
    errors: list[tuple[int, str]] = []
    data = _plain(root, (), lines, "s.yaml", errors)
    assert not errors and isinstance(data, dict)
    return data, lines


def places(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every key path in ``node`` (mappings and lists), parents first."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield (*path, k)
            yield from places(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield (*path, i)
            yield from places(v, (*path, i))


def at(data: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        data = data[p]
    return data


def mutations(data: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for path in list(places(data)):
        parent = path[:-1]
        for value in VALUES:
            m = copy.deepcopy(data)
            at(m, parent)[path[-1]] = value
            yield f"{path} = {value!r}", m
        m = copy.deepcopy(data)
        container = at(m, parent)
        if isinstance(container, dict):
            del container[path[-1]]
            yield f"{path} removed", m
        else:
            container.pop(path[-1])
            yield f"{path} removed (list)", m
    for path in [(), *places(data)]:
        m = copy.deepcopy(data)
        node = at(m, path)
        if isinstance(node, dict):
            node["zzz"] = "x"
            yield f"{path} + unknown key", m


def table_keys() -> Iterator[tuple[tuple[Any, ...], schema.Key]]:
    """(key path, key) for every key of every table (``*``: any name, ``0``: any item)."""
    for where, table in schema.STACK.tables():
        for key in table.keys.values():
            yield (*where, key.name), key


def pattern(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """A key path of EVERY_KEY as a table's key path: unit and argument names as ``*``."""
    out = list(path)
    if len(out) > 1 and out[0] == "units":
        out[1] = "*"
        if len(out) > 3 and out[2] == "args":
            out[3] = "*"
    return tuple(out)


def keys_in_the_example(data: dict[str, Any]) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    """Each table key EVERY_KEY writes: its table key path -> one place it is written."""
    table = {p for p, _ in table_keys()}
    out: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for path in places(data):
        if isinstance(path[-1], str) and pattern(path) in table:
            out.setdefault(pattern(path), path)
    return out


def test_the_example_uses_every_key_and_reads_into_the_spec() -> None:
    data, lines = read(EVERY_KEY)
    assert set(keys_in_the_example(data)) == {p for p, _ in table_keys()}
    spec, problems = schema.read(data, "s.yaml", lines)
    assert not problems and spec is not None
    assert spec.units["pred"].conditions == {"model": "ready", "init": "completed"}
    assert spec.units["pred"].after == ("model", "init")
    assert spec.units["model"].cmd == ("server", "--port", "{port}", "8080", "1.5")
    assert spec.units["model"].liveness is not None and spec.units["model"].liveness.failures == 2
    assert spec.units["job"].args is not None and spec.units["job"].args["n"].max == 5
    assert spec.path == "s.yaml" and spec.lines is lines
    # Every default is the spec's own.
    data, lines = read(MINIMAL)
    spec, problems = schema.read(data, "s.yaml", lines)
    assert spec is not None and spec.units == {"a": UnitSpec(cmd=("x",))}


def test_every_key_is_in_the_readme() -> None:
    text = (ROOT / "README.md").read_text()
    reference = text[text.index("## Stacks: `hold up`") : text.index("## Benchmarks")]
    missing = [
        ".".join(map(str, where))
        for where, key in table_keys()
        if not any(f"`{key.name}{end}" in reference for end in "`:.")
    ]
    assert not missing, f"not in README's stack file reference: {missing}"


def refusals_of(data: dict[str, Any], lines: dict[Any, int]) -> list[tuple[Any, ...]]:
    spec, problems = schema.read(data, "s.yaml", lines)
    assert (spec is None) == bool(problems)
    return [(*loc, msg) for loc, msg in problems]


def test_every_key_refused_as_its_table_says() -> None:
    """A value of the wrong type, the key left out, the key written null (a key that may
    be left out or null meets, if anything, its table's rule: one probe kind)."""
    data, lines = read(EVERY_KEY)
    keys = dict(table_keys())
    probe_rule = [("exactly one of",)]
    for table_path, path in keys_in_the_example(data).items():
        key = keys[table_path]
        m = copy.deepcopy(data)
        at(m, path[:-1])[path[-1]] = {"zzz": [1]}  # no key takes a mapping of lists
        got = refusals_of(m, lines)
        if not got:  # after's mapping form: the names and conditions are checked across units
            got = [(*path, msg) for _, msg in cross_checks(m, lines) if "zzz" in msg]
        assert got and all(p[: len(path)] == path for p in got), (path, got)
        words = ("is not valid", "unknown key", "names no unit")
        assert any(w in p[-1] for w in words for p in got), got

        m = copy.deepcopy(data)
        del at(m, path[:-1])[path[-1]]
        got = refusals_of(m, lines)
        if key.required:
            assert got == [(*path, "missing (required)")], (path, got)
        else:
            assert [(p[-1][:14],) for p in got if p[:-1] == path[:-1]] in ([], probe_rule), got

        m = copy.deepcopy(data)
        at(m, path[:-1])[path[-1]] = None
        got = refusals_of(m, lines)
        if key.nullable:
            assert [(p[-1][:14],) for p in got if p[:-1] == path[:-1]] in ([], probe_rule), got
        else:
            assert got == [(*path, got[0][-1])] and "None is not valid" in got[0][-1], (path, got)


def test_several_problems_reported_together() -> None:
    data, lines = read(EVERY_KEY)
    data["colour"] = "blue"
    del data["units"]["init"]["cmd"]
    data["units"]["model"]["stop"]["grace"] = "soon"
    data["units"]["job"]["args"]["n"]["typ"] = "int"
    assert sorted(refusals_of(data, lines)) == [
        ("colour", "unknown key; accepted: name, hold, units"),
        ("units", "init", "cmd", "missing (required)"),
        (
            "units",
            "job",
            "args",
            "n",
            "typ",
            "unknown key; accepted: type, min, max, max_len, choices, required; "
            "did you mean 'type'?",
        ),
        (
            "units",
            "model",
            "stop",
            "grace",
            "'soon' is not valid: a duration with its unit: 250ms, 10s, 4m, 2h",
        ),
    ]


def test_mutations_read_or_refused_at_their_key_path() -> None:
    data, lines = read(EVERY_KEY)
    failures, cases, accepted = [], 0, 0
    for what, m in mutations(data):
        cases += 1
        try:
            spec, problems = schema.read(m, "s.yaml", lines)
        except Exception as e:  # any crash is the finding
            failures.append(f"{what}: {e!r}")
            continue
        if spec is not None:
            accepted += 1
            if problems or from_json(to_json(spec)) != spec:
                failures.append(f"{what}: {problems} or not the same spec through JSON")
            continue
        if not problems:
            failures.append(f"{what}: no spec and no problem")
        written = set(places(m))
        for loc, msg in problems:
            # At a key of the file, or a key missing from a mapping of it.
            parent = loc[:-1] if msg == "missing (required)" else loc
            if parent and parent not in written:
                failures.append(f"{what}: {loc} is no key path of the file ({msg})")
    assert not failures, f"{len(failures)} of {cases}:\n" + "\n".join(failures[:20])
    assert cases > 3000 and accepted > 500, (cases, accepted)


def test_a_stack_file_is_loaded_without_pydantic(tmp_path: Path) -> None:
    """Neither a valid file nor a bad one imports pydantic; a bad one is refused with its line."""
    good = tmp_path / "good.yaml"
    good.write_text("name: nopyd\nunits:\n  a: {cmd: [sleep, '30'], ready: {file: /}}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: nopyd\nunits:\n  a:\n    cmd: [x]\n    ready: {file: /, tmeout: 1s}\n")
    probe = textwrap.dedent("""
        import sys
        from hold.cli.stackdir import load_checked
        from hold_supervisor.stackfile.load import StackFileError
        try:
            load_checked(sys.argv[1])
        except StackFileError as e:
            print("\\n".join(e.errors))
        print("pydantic" in sys.modules)
    """)
    out = subprocess.run(
        [sys.executable, "-c", probe, str(good)], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"
    out = subprocess.run(
        [sys.executable, "-c", probe, str(bad)], capture_output=True, text=True, check=True
    ).stdout
    assert f"{bad}:5: units.a.ready.tmeout: unknown key; accepted: http" in out
    assert "did you mean 'timeout'?" in out
    assert out.strip().endswith("False")
    res = subprocess.run([*HOLD, "validate", str(bad)], capture_output=True, text=True)
    assert res.returncode == 2
    assert f"{bad}:5: units.a.ready.tmeout: unknown key" in res.stderr
