"""The quick path of the stack file (``supervisor/stackfile/plain.py``, no pydantic)
against the models (``supervisor/stackfile/refusals.py``, pydantic), side by side.

Its one rule: it only ever accepts what the models accept, with the spec they
give; anything else is theirs to refuse (and word). Checked over a stack that
uses every key, and over thousands of mutations of it (each value replaced by
values of every shape, each key removed, an unknown key added), read both
ways in this process. Then, in a process of its own: a valid file is loaded
without importing pydantic at all; a bad one still gets the models' words with
its line (and from ``hold validate``, exit 2).
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conftest import HOLD

from hold_supervisor import yamlsafe
from hold_supervisor.stackfile import plain, refusals
from hold_supervisor.stackfile.load import _plain
from hold_supervisor.stackfile.values import YamlWord

EVERY_KEY = textwrap.dedent("""\
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
        ready: {tcp: 8081}
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


def compare(what: str, data: dict[str, Any], lines: dict[Any, int]) -> str | None:
    """None if the quick path keeps its rule on ``data``; else what went wrong."""
    quick = plain.to_spec(copy.deepcopy(data), "s.yaml", lines)
    spec, problems = refusals.validate(copy.deepcopy(data), "s.yaml", lines)
    if spec is None:
        assert problems
        if quick is not None:
            return f"{what}: accepted, but the models refuse it: {problems}"
        return None
    if quick is not None and quick != spec:
        return f"{what}: another spec than the models'\n  quick:  {quick}\n  models: {spec}"
    return None


def test_every_key_read_alike() -> None:
    for text in (EVERY_KEY, MINIMAL):
        data, lines = read(text)
        quick = plain.to_spec(data, "s.yaml", lines)
        spec, problems = refusals.validate(data, "s.yaml", lines)
        assert not problems and spec is not None
        assert quick is not None and quick == spec  # accepted, with the models' spec
    assert quick.units["a"].cmd == ("x",)
    data, lines = read(EVERY_KEY)
    quick = plain.to_spec(data, "s.yaml", lines)
    assert quick is not None and quick.units["pred"].conditions == {
        "model": "ready",
        "init": "completed",
    }


def test_mutations_never_accepted_beyond_the_models() -> None:
    data, lines = read(EVERY_KEY)
    failures, cases, accepted, quick_too = [], 0, 0, 0
    for what, m in mutations(data):
        cases += 1
        problem = compare(what, m, lines)
        if problem:
            failures.append(problem)
        elif plain.to_spec(copy.deepcopy(m), "s.yaml", lines) is not None:
            quick_too += 1
        if refusals.validate(copy.deepcopy(m), "s.yaml", lines)[0] is not None:
            accepted += 1
    assert not failures, f"{len(failures)} of {cases}:\n" + "\n".join(failures[:20])
    assert cases > 3000
    # The quick path is used for (nearly) every file the models accept, not only the base.
    assert accepted > 500 and quick_too >= accepted * 0.95, (accepted, quick_too)


def test_valid_file_loads_without_pydantic(tmp_path: Path) -> None:
    """A valid stack is loaded without pydantic; a bad one gets the models' words."""
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
    assert out.strip().endswith("True")
    res = subprocess.run([*HOLD, "validate", str(bad)], capture_output=True, text=True)
    assert res.returncode == 2
    assert f"{bad}:5: units.a.ready.tmeout: unknown key" in res.stderr
