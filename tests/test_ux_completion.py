"""Shell completion (issue 14): ``hold completion bash|zsh|fish`` and the answers.

The answers are asked as the shells ask them: the program itself, run with
click's variables (``_HOLD_COMPLETE=bash_complete``, ``COMP_WORDS``,
``COMP_CWORD``; ``_NPU_HOLD_COMPLETE`` for ``npu-hold``, which answers through
:mod:`hold.cli.completion` without click on its normal path). With bash present,
the generated script is sourced in a real bash and its function called.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CPU, update_config

from hold.cli.completion import complete_run

BIN = Path(sys.executable).parent
STACK = f"""\
name: comptest
units:
  api:
    cmd: [sleep, "100"]
  worker:
    cmd: [sleep, "100"]
  tool:
    kind: task
    cmd: [cat]
    cpus: "{CPU}"
"""


def complete(prog: str, words: list[str], shell: str = "bash") -> list[str]:
    """What ``prog`` answers for ``words`` (the last one is being typed): the values."""
    env = dict(os.environ)
    var = f"_{prog.replace('-', '_').upper()}_COMPLETE"
    env[var] = f"{shell}_complete"
    if shell == "fish":
        env["COMP_WORDS"] = " ".join([prog, *words])
        env["COMP_CWORD"] = words[-1]
    else:
        env["COMP_WORDS"] = " ".join([prog, *words])
        env["COMP_CWORD"] = str(len(words))
    res = subprocess.run([str(BIN / prog)], env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    if shell == "fish":  # TYPE,VALUE<tab>HELP
        return [line.split("\t")[0].partition(",")[2] for line in res.stdout.splitlines()]
    if shell == "zsh":  # TYPE, VALUE, HELP: a line each
        return res.stdout.splitlines()[1::3]
    return [line.partition(",")[2] for line in res.stdout.splitlines() if line]


@pytest.fixture
def own_classes(isolated_hold: Path) -> list[str]:
    """Two classes only this test has (beside the conftest's npu and gpu)."""
    nodes = isolated_hold / "dev"
    update_config(
        isolated_hold,
        devices={"tpuz": {"nodes": [f"{nodes}/tpuz*"]}, "fpgaz": {"nodes": [f"{nodes}/fpgaz*"]}},
    )
    return ["fpgaz", "gpu", "npu", "tpuz"]


@pytest.fixture
def stack(tmp_path: Path) -> str:
    """A stack directory as ``hold up`` leaves it: ``stack.json`` naming the file, logs."""
    state = Path(os.environ["HOLD_STATE_DIR"])
    state.mkdir(mode=0o700, exist_ok=True)
    run_dir = state / "stacks" / "comptest"
    (run_dir / "logs").mkdir(parents=True)
    (tmp_path / "stack.yaml").write_text(STACK)
    # As a hold before hold_supervisor.documents wrote it (no kind, no version).
    record = {
        "name": "comptest",
        "pid": 1,
        "file": str(tmp_path / "stack.yaml"),
        "started": 1.0,
        "state": "running",
    }
    (run_dir / "stack.json").write_text(json.dumps(record))
    (state / "stacks" / "other").mkdir()
    return "comptest"


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_each_shell_gets_a_script(shell: str) -> None:
    res = subprocess.run(
        [str(BIN / "hold"), "completion", shell], capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 0, res.stderr
    for prog in ("hold", "npu-hold", "gpu-hold"):
        var = f"_{prog.replace('-', '_').upper()}_COMPLETE={shell}_complete"
        assert var in res.stdout
    register = {
        "bash": "complete -o nosort -F _npu_hold_completion npu-hold",
        "zsh": "compdef _npu_hold_completion npu-hold",
        "fish": "complete --no-files --command npu-hold",
    }
    assert register[shell] in res.stdout


def test_an_unknown_shell_is_a_usage_error() -> None:
    res = subprocess.run(
        [str(BIN / "hold"), "completion", "tcsh"], capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 2
    assert "bash" in res.stderr


def test_subcommands_and_options() -> None:
    assert complete("hold", ["st"]) == ["status"]
    assert "completion" in complete("hold", [""])
    assert complete("hold", ["check", "--dev"]) == ["--device"]
    assert complete("hold", ["audit", "--j"]) == ["--json"]
    assert complete("hold", ["to"]) == ["top"]
    assert complete("hold", ["top", "--"]) == ["--delay", "--iterations", "--help"]


def test_device_classes_from_the_configuration(own_classes: list[str]) -> None:
    assert sorted(complete("hold", ["check", "--device", ""])) == own_classes
    assert sorted(complete("hold", ["audit", "--device", ""])) == own_classes
    assert complete("hold", ["audit", "--device", "tp"]) == ["tpuz"]
    for prog in ("npu-hold", "gpu-hold"):
        assert sorted(complete(prog, ["--device", ""])) == own_classes
        assert complete(prog, ["-d", "fp"]) == ["fpgaz"]
    assert sorted(complete("hold", ["run", "-vd", ""])) == own_classes
    assert complete("hold", ["run", "--device", "tp"], shell="zsh") == ["tpuz"]
    assert complete("npu-hold", ["--device", "tp"], shell="fish") == ["tpuz"]


def test_run_options_from_the_table() -> None:
    assert complete("npu-hold", ["--dev"]) == ["--device"]
    assert complete("gpu-hold", ["--wait"]) == ["--wait-timeout"]
    assert complete("hold", ["run", "--pass"]) == ["--pass-env"]
    assert complete("npu-hold", ["-t", "1h", "--no-"]) == ["--no-wait"]
    assert complete("npu-hold", ["--signal", "TE"]) == ["TERM"]
    from hold.cli.options import RUN_OPTIONS

    assert complete("npu-hold", ["--"]) == [o.long for o in RUN_OPTIONS]


def test_after_the_options_the_command_is_the_shells() -> None:
    """After ``--`` or the command's first word, nothing of ours: the shell's files."""
    assert complete("npu-hold", ["--", "--dev"]) == ["--dev"]
    assert complete("hold", ["run", "-t", "5", "ls", "--dev"]) == ["--dev"]


def test_stack_and_unit_names(stack: str) -> None:
    assert complete("hold", ["logs", ""]) == ["comptest", "other"]
    assert complete("hold", ["ps", "co"]) == ["comptest"]
    assert complete("hold", ["down", "oth"]) == ["other"]
    assert complete("hold", ["logs", stack, ""]) == ["api", "tool", "worker"]
    assert complete("hold", ["restart", stack, "w"]) == ["worker"]
    assert complete("hold", ["call", stack, ""]) == ["tool"]  # task units only


def test_units_from_the_logs_when_the_file_is_gone(stack: str, tmp_path: Path) -> None:
    (tmp_path / "stack.yaml").unlink()
    logs = Path(os.environ["HOLD_STATE_DIR"]) / "stacks" / stack / "logs"
    (logs / "api.log").write_text("")
    (logs / "worker.log.1").write_text("")
    assert complete("hold", ["logs", stack, ""]) == ["api"]
    assert complete("hold", ["logs", "nosuch", ""]) == []


@pytest.mark.parametrize(
    ("words", "incomplete", "offered"),
    [
        ([], "--c", ["--cpus", "--count"]),
        (["-v"], "--ver", ["--verbose", "--version"]),
        (["-vt"], "", []),  # -t waits for a duration: nothing to offer
        (["-vt1m"], "--pri", ["--private"]),
        (["--time=1h"], "--lab", ["--label"]),
        (["--device", "="], "n", ["npu"]),  # bash splits --device=n
    ],
)
def test_complete_run_in_process(words: list[str], incomplete: str, offered: list[str]) -> None:
    assert [i.value for i in complete_run(words, incomplete)] == offered


def test_the_equals_form() -> None:
    assert [i.value for i in complete_run([], "--device=n")] == ["--device=npu"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash here")
def test_in_a_real_bash(stack: str, own_classes: list[str]) -> None:
    script = f"""
        set -e
        PATH={BIN}:$PATH
        source <(hold completion bash)
        complete -p hold npu-hold gpu-hold
        ask() {{ COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMPREPLY=()
                 "_${{1//-/_}}_completion" "$1"
                 echo "$1: ${{COMPREPLY[*]}}"; }}
        ask hold logs ''
        ask hold logs comptest w
        ask npu-hold --dev
        ask gpu-hold --device tp
    """
    res = subprocess.run(
        ["bash", "--norc", "-c", script], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    for prog in ("hold", "npu-hold", "gpu-hold"):
        assert f"complete -o nosort -F _{prog.replace('-', '_')}_completion {prog}" in lines
    assert lines[-4:] == [
        "hold: comptest other",
        "hold: worker",
        "npu-hold: --device",
        "gpu-hold: tpuz",
    ]


def test_the_normal_path_never_sees_completion() -> None:
    """``npu-hold`` without the variable imports neither click nor hold.cli.completion."""
    code = (
        "import sys, hold.cli.entry, hold.cli.run; "
        "print([m for m in ('click', 'hold.cli.completion') if m in sys.modules])"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert res.stdout.strip() == "[]", res.stderr


# --------------------------------------------------------------------------
# The answers given without click (hold.cli.answers) are click's, word for word.


def test_the_command_table_is_the_groups() -> None:
    """:data:`hold.cli.answers.COMMANDS` lists the group's commands, with click's
    one-line help; :data:`STACK_COMMANDS` those whose first argument is a stack."""
    import click

    from hold.cli import answers
    from hold.cli.completion import stack_values
    from hold.cli.group import cli

    ctx = click.Context(cli)
    shown = [(n, c) for n in cli.list_commands(ctx) if not (c := cli.get_command(ctx, n)).hidden]  # type: ignore[union-attr]
    assert list(answers.COMMANDS) == [(n, c.get_short_help_str()) for n, c in shown]
    stacks = {
        n
        for n, c in shown
        if (a := [p for p in c.params if isinstance(p, click.Argument)])
        and a[0]._custom_shell_complete is stack_values
    }
    assert stacks == answers.STACK_COMMANDS


CORPUS = [
    ("hold", ["st"]),
    ("hold", [""]),
    ("hold", ["r"]),
    ("hold", ["zz"]),
    ("hold", ["ps", ""]),
    ("hold", ["logs", "comp"]),
    ("hold", ["down", "x"]),
    ("hold", ["run", "--de"]),
    ("hold", ["run", "--device", ""]),
    ("hold", ["run", "-t", "5", "--", "ec"]),
    ("hold", ["run", "--device=n"]),
    ("hold", ["status", ""]),
    ("hold", ["status", "-"]),
    ("hold", ["'st"]),
    ("npu-hold", ["-"]),
    ("npu-hold", ["--signal", "T"]),
    ("npu-hold", ["-vt", "3", "--pa"]),
    ("npu-hold", ["--device", "g"]),
    ("npu-hold", ["--", "sle"]),
    ("gpu-hold", ["--label", ""]),
]


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_answers_without_click_are_clicks(
    shell: str, stack: str, own_classes: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """For each line of the corpus: what :func:`hold.cli.answers.answer` prints (where
    it answers) is what click prints for the same variables; and it answers the
    common words (a command, a stack, npu-hold's) without click."""
    from click.shell_completion import shell_complete

    from hold.cli import answers
    from hold.cli.completion import RUN_SETTINGS, RunCommand, run_arguments
    from hold.cli.group import cli

    left: list[str] = []
    for prog, words in CORPUS:
        line = " ".join([prog, *words])
        os.environ["COMP_WORDS"] = line
        os.environ["COMP_CWORD"] = words[-1] if shell == "fish" else str(len(words))
        if shell == "fish" and not words[-1]:
            os.environ["COMP_WORDS"] = line + " "
        var = answers.complete_var(prog)
        try:
            fast = answers.answer(prog, f"{shell}_complete")
            ours = capsys.readouterr().out
            cmd = (
                cli
                if prog == "hold"
                else RunCommand(
                    prog,
                    params=[run_arguments()],
                    context_settings=RUN_SETTINGS,
                    add_help_option=False,
                )
            )
            assert shell_complete(cmd, {}, prog, var, f"{shell}_complete") == 0
            theirs = capsys.readouterr().out
        finally:
            del os.environ["COMP_WORDS"], os.environ["COMP_CWORD"]
        if not fast:
            left.append(line)
            continue
        if words[-1] == "--device=n":
            # Where click is wrong: it splits --device=n at the "=" itself and, as
            # RunCommand declares no --device, offers the word as a file; the value
            # is what a user wants (bash splits the word before either sees it).
            assert theirs.replace("\n", ",").split(",")[:2] == ["file", "n"]
            assert "--device=npu" in ours, ours
            continue
        assert ours == theirs, (shell, line)
    # Left to click: the words of a command other than run and the stack commands.
    assert left == ["hold status ", "hold status -"], left


def test_a_tab_at_a_command_name_imports_no_click() -> None:
    """The first word of hold, a stack's name, any word of npu-hold: no click loaded."""
    code = (
        "import os, sys\n"
        "from hold.cli.entry import main, npu_main\n"
        "os.environ.update(_HOLD_COMPLETE='bash_complete', COMP_WORDS='hold st', COMP_CWORD='1')\n"
        "assert main([]) == 0\n"
        "os.environ.update(COMP_WORDS='hold logs x', COMP_CWORD='2')\n"
        "assert main([]) == 0\n"
        "print('click' in sys.modules, file=sys.stderr)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert "plain,status" in res.stdout
    assert res.stderr.strip() == "False"
