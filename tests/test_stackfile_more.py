"""The stack file's newer keys: one-shots and conditions, cwd, env_file, shell text,
liveness, scratch, notify; each refusal names FILE:LINE and what is accepted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import CPU

from hold_supervisor.stackfile.load import StackFileError, fill, filled_env, load
from hold_supervisor.stackfile.placeholders import fill as fill_text


def _load(tmp_path: Path, body: str, name: str = "s.yaml"):  # type: ignore[no-untyped-def]
    path = tmp_path / name
    path.write_text(body)
    return load(str(path))


def _errors(tmp_path: Path, body: str) -> list[str]:
    with pytest.raises(StackFileError) as info:
        _load(tmp_path, body)
    # "FILE:LINE: message" -> "LINE: message"
    return [e.split(":", 1)[1] for e in info.value.errors]


def test_oneshot_and_conditions(tmp_path: Path) -> None:
    spec = _load(
        tmp_path,
        "name: s\nunits:\n"
        "  db: {cmd: [db], ready: {tcp: 5432}}\n"
        "  migrate: {kind: oneshot, cmd: [m], after: [db], timeout: 1m}\n"
        "  api: {cmd: [api], after: {migrate: completed, db: started}}\n"
        "  seed: {kind: oneshot, cmd: [s], after: {migrate: started}, essential: false}\n"
        f"  job: {{kind: task, cmd: [j], cpus: '{CPU}'}}\n",
    )
    assert spec.services() == ["db", "migrate", "api", "seed"]
    assert spec.tasks() == ["job"]
    assert spec.condition("migrate", "db") == "ready"  # a name alone: a service's readiness
    assert spec.condition("api", "migrate") == "completed"
    assert spec.condition("api", "db") == "started"
    assert spec.condition("seed", "migrate") == "started"
    assert spec.units["api"].after == ("migrate", "db")
    assert spec.units["seed"].essential is False and spec.units["api"].essential is True


@pytest.mark.parametrize(
    ("units", "expected"),
    [
        (
            "  a: {kind: oneshot, cmd: [a]}\n  b: {cmd: [b], after: {a: ready}}\n",
            "4: units.b.after.a: a is a oneshot: it has no readiness; wait for started or "
            "completed",
        ),
        (
            "  a: {cmd: [a]}\n  b: {cmd: [b], after: {a: completed}}\n",
            "4: units.b.after.a: a is a service: it does not complete; wait for started or ready",
        ),
        (
            "  a: {cmd: [a]}\n  b: {cmd: [b], after: {a: process_healthy}}\n",
            "4: units.b.after.a: 'process_healthy' is not valid: one of started, ready, "
            "completed (process_healthy is ready here)",
        ),
        (
            "  a: {kind: oneshot, cmd: [a], port: 80}\n",
            "3: units.a.port: not for a oneshot unit (a oneshot runs once, to completion, "
            "when the stack starts); port is for kind: service",
        ),
        (
            "  a: {kind: oneshot, cmd: [a], ready: {tcp: 80}}\n",
            "3: units.a.ready: not for a oneshot unit",
        ),
        ("  a: {cmd: [a], timeout: 5s}\n", "3: units.a.timeout: not for a service unit"),
        (
            "  a: {cmd: [a], essential: 'no'}\n",
            "3: units.a.essential: 'no' is not valid: true or false",
        ),
        (
            "  a: {cmd: [a], liveness: {tcp: 80, log: x}}\n",
            "3: units.a.liveness.log: unknown key; accepted: http, tcp, exec, file, period",
        ),
        (
            "  a: {cmd: [a], liveness: {http: /h}}\n",
            "3: units.a.liveness.http: an http check needs the unit's port",
        ),
        (
            "  a: {cmd: [a], liveness: {exec: 'true', every: 5s}}\n",
            "3: units.a.liveness.every: unknown key; accepted: http, tcp, exec, file, period, "
            "timeout, failures; did you mean 'period'?",
        ),
        (
            "  a: {cmd: [a], ready: {notify: false}}\n",
            "3: units.a.ready.notify: False is not valid: true (the unit is ready when it "
            "sends READY=1",
        ),
        (
            "  a: {cmd: [a, '{scratch}/x']}\n",
            "3: units.a.cmd[1]: {scratch} used, but unit a has no scratch",
        ),
        (
            "  a: {cmd: [a], scratch: {min_free: lots}}\n",
            "3: units.a.scratch.min_free: 'lots' is not valid: a size such as 500M",
        ),
        ("  a: {cmd: [a], cwd: nowhere}\n", "3: units.a.cwd: 'nowhere' is not a directory (in "),
        (
            "  a: {cmd: [a], working_dir: /}\n",
            "3: units.a.working_dir: unknown key; accepted: kind, cmd, cwd",
        ),
    ],
)
def test_refusals(tmp_path: Path, units: str, expected: str) -> None:
    errs = _errors(tmp_path, "name: s\nunits:\n" + units)
    assert any(e.startswith(expected) for e in errs), "\n".join(errs)


def test_shell_text_passes_through_and_ours_is_filled(tmp_path: Path) -> None:
    spec = _load(
        tmp_path,
        "name: s\nunits:\n"
        "  a:\n"
        '    cmd: [sh, -c, \'echo ${HOME} $USER {port} {{x}}; awk "{print $1}" f; '
        "echo {a,b} ${X:-{stack_dir}}']\n"
        "    port: 8080\n"
        "    scratch: true\n"
        "    env: {S: '{scratch}/t', D: '{stack_dir}'}\n",
    )
    a = spec.units["a"]
    text = fill(a.cmd[2], unit="a", ports={"a": 8080}, run_dir="/r", stack_dir="/st", scratch="/sc")
    # {port}, {{x}} and {stack_dir} were ours (even inside the shell's ${X:-...});
    # ${HOME}, $USER, awk's braces and {a,b} are the shell's.
    assert text == ('echo ${HOME} $USER 8080 {x}; awk "{print $1}" f; echo {a,b} ${X:-/st}')
    env = filled_env(a, "a", {"a": 8080}, "/r", stack_dir="/st", scratch="/sc")
    assert env == {"S": "/sc/t", "D": "/st"}
    assert fill_text("{units.b.port}", {}, {"b": 9}) == "9"


def test_unknown_name_in_braces_is_still_refused(tmp_path: Path) -> None:
    errs = _errors(tmp_path, "name: s\nunits:\n  a: {cmd: [sh, -c, 'echo {HOME}']}\n")
    assert errs == [
        "3: units.a.cmd[2]: unknown placeholder {HOME}: accepted {port}, {units.NAME.port}, "
        "{run_dir}, {stack_dir} or {scratch} ({{ and }} for literal braces; the shell's "
        "${NAME} passes through)"
    ]


def test_cwd_and_stack_dir_are_the_stack_files(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    spec = _load(
        tmp_path,
        "name: s\nunits:\n  a: {cmd: [a], cwd: sub}\n  b: {cmd: [b], cwd: '{stack_dir}/sub'}\n",
    )
    assert spec.stack_dir == str(tmp_path)
    assert spec.units["a"].cwd == "sub"


def test_env_file_read_strictly(tmp_path: Path) -> None:
    (tmp_path / "ok.env").write_text(
        "# comment\n\nA=1\nexport B = two words  # note\nC='$HOME {x}'\n"
        'D="line\\nnext \\"q\\""\nE=${NOT_EXPANDED}\n'
    )
    spec = _load(
        tmp_path,
        "name: s\nunits:\n  a: {cmd: [a], env_file: ok.env, env: {A: override}}\n",
    )
    a = spec.units["a"]
    assert dict(a.file_env) == {
        "A": "1",
        "B": "two words",
        "C": "$HOME {x}",
        "D": 'line\nnext "q"',
        "E": "${NOT_EXPANDED}",
    }
    assert filled_env(a, "a", {}, "/r")["A"] == "override"


def test_env_file_problems_name_their_line(tmp_path: Path) -> None:
    (tmp_path / "bad.env").write_text("A=1\nnot a line\n1X=2\nQ='open\n")
    (tmp_path / "link.env").symlink_to(tmp_path / "bad.env")
    errs = _errors(
        tmp_path,
        "name: s\nunits:\n  a: {cmd: [a], env_file: bad.env}\n"
        "  b: {cmd: [b], env_file: link.env}\n  c: {cmd: [c], env_file: none.env}\n",
    )
    assert "3: units.a.env_file: bad.env:2: 'not a line' is not valid: NAME=value" in "\n".join(
        errs
    )
    assert any(e.startswith("3: units.a.env_file: bad.env:3: '1X' is not valid") for e in errs)
    assert any(
        e.startswith("3: units.a.env_file: bad.env:4: Q: unmatched single quote") for e in errs
    )
    # A symlink is not followed; a missing file is named.
    assert any(
        e.startswith("4: units.b.env_file: link.env: cannot read the env_file") for e in errs
    )
    assert any(
        e.startswith("5: units.c.env_file: none.env: cannot read the env_file: No such file")
        for e in errs
    )


def test_from_another_directory_the_same_stack_dir(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text("name: s\nunits:\n  a: {cmd: [./run.sh], cwd: .}\n")
    here = os.getcwd()
    os.chdir("/")
    try:
        spec = load(str(tmp_path / "s.yaml"))
    finally:
        os.chdir(here)
    assert spec.stack_dir == str(tmp_path)


def test_unquoted_yaml_words_in_text_are_named_with_the_fix(tmp_path: Path) -> None:
    errs = _errors(
        tmp_path,
        "name: s\nunits:\n  a:\n    cmd: [echo, yes, 'yes', ~, off]\n    env: {X: , Y: on}\n"
        "    ready: {exec: [test, no]}\n",
    )
    assert errs == [
        "4: units.a.cmd[1]: YAML reads the unquoted word 'yes' as the boolean true, not text: "
        "quote it ('yes')",
        "4: units.a.cmd[3]: YAML reads '~' as null, not text: quote it ('~')",
        "4: units.a.cmd[4]: YAML reads the unquoted word 'off' as the boolean false, not text: "
        "quote it ('off')",
        "5: units.a.env.X: YAML reads an empty value as null, not text: quote it ('')",
        "5: units.a.env.Y: YAML reads the unquoted word 'on' as the boolean true, not text: "
        "quote it ('on')",
        "6: units.a.ready.exec: item 1: YAML reads the unquoted word 'no' as the boolean false, "
        "not text: quote it ('no')",
    ]
