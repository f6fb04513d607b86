"""A configuration file's problems are reported all at once (issue 25).

As a stack file's are: each problem a ``FILE:LINE: key 'value' is not valid:
...`` line (the texts of tests/test_corpus.py), in file order, exit 2, and
nothing started. Only a file that cannot be read as a mapping (YAML syntax,
a list at the top) stops at its first problem.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import HOLD

from hold_supervisor.parse import BadValue

# Three independent mistakes: an unknown top-level key, a bad cgroups value,
# a device class with a relative node path (checked last, reported in its place).
THREE = "cgroup: auto\ndevices:\n  x:\n    nodes: [dev/x]\ncgroups: maybe\n"


def three_lines(path: Path) -> list[str]:
    return [
        f"{path}:1: key 'cgroup' is not valid: one of busy_devices, cgroups, compat, devices, "
        "limits, report, scratch, state, unreadable_processes; did you mean 'cgroups'?",
        f"{path}:4: devices.x.nodes 'dev/x' is not valid: an absolute path pattern",
        f"{path}:5: cgroups 'maybe' is not valid: one of auto, off, required",
    ]


def config_file() -> Path:
    return Path(os.environ["HOLD_CONFIG"])  # the test's own (tests/conftest.py: isolated_hold)


@pytest.mark.parametrize("argv", [["run", "--", "true"], ["status"]], ids=["run", "status"])
def test_three_mistakes_through_commands(argv: list[str], tmp_path: Path) -> None:
    path = config_file()
    path.write_text(THREE)
    state = Path(os.environ["HOLD_STATE_DIR"])
    res = subprocess.run(
        [*HOLD, *argv],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    )
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    want = three_lines(path)
    got = [line for line in res.stderr.splitlines() if str(path) in line]
    assert len(got) == 3, res.stderr
    # One per line, in file order (the first carries the command's prefix).
    for line, expected in zip(got, want, strict=True):
        assert line.endswith(expected), res.stderr
    assert not state.exists(), "the state directory was made (or a daemon started)"


def test_three_mistakes_in_process() -> None:
    from hold.config import parse_file

    path = config_file()
    path.write_text(THREE)
    with pytest.raises(BadValue) as info:
        parse_file(str(path))
    assert str(info.value).splitlines() == three_lines(path)


def test_every_problem_of_every_section(tmp_path: Path) -> None:
    """Several problems in one section, and in one class, are each reported."""
    from hold.config import parse_file

    path = tmp_path / "many.yaml"
    path.write_text(
        "report: {labels: yes, sample: 0s}\n"  # 1
        "state: {shared: yes}\n"  # 2
        "compat: {home_token: true}\n"  # 3
        "scratch: {min_fre: 1G}\n"  # 4
        "devices:\n"  # 5
        "  GPU:\n"  # 6
        "    node: [/dev/x]\n"  # 7
        "  y:\n"  # 8
        "    nodes: [dev/y, /dev/../z]\n"  # 9
        "    visible_env: [HOME]\n"  # 10
        "  z:\n"  # 11
        "    visible_env: [X]\n"  # 12
        "busy_devices: block\n"  # 13
    )
    with pytest.raises(BadValue) as info:
        parse_file(str(path))
    got = str(info.value).splitlines()
    want = [
        "1: report.labels 'yes' is not valid: one of true, false",
        "1: report.sample '0s' is not valid",
        "2: state.shared 'yes' is not valid",
        "3: key compat. 'home_token' is not valid",
        "4: key scratch. 'min_fre' is not valid",
        "6: device class name 'GPU' is not valid",
        "7: key devices.GPU. 'node' is not valid: one of nodes, shared_nodes, visible_env, "
        "allowed_holders; did you mean 'nodes'?",
        "7: devices.GPU '(no nodes)' is not valid",
        "9: devices.y.nodes 'dev/y' is not valid: an absolute path pattern",
        "9: devices.y.nodes '/dev/../z' is not valid: an absolute path pattern, normalised",
        "10: devices.y.visible_env 'HOME' is not valid",
        "12: devices.z '(no nodes)' is not valid",
        "13: busy_devices 'block' is not valid",
    ]
    assert len(got) == len(want), "\n".join(got)
    for line, expected in zip(got, want, strict=True):
        assert line.startswith(f"{path}:{expected}"), "\n".join(got)


def test_one_problem_is_raised_as_it_was(tmp_path: Path) -> None:
    """A lone problem keeps its own error (what, value, where), as before."""
    from hold.config import parse_file

    path = tmp_path / "one.yaml"
    path.write_text("cgroups: maybe\n")
    with pytest.raises(BadValue) as info:
        parse_file(str(path))
    assert (info.value.what, info.value.value, info.value.where) == (
        "cgroups",
        "maybe",
        f"{path}:1",
    )


def test_a_good_file_is_still_read(tmp_path: Path) -> None:
    from hold.config import parse_file
    from hold.devices.classes import classes_from_config

    path = tmp_path / "good.yaml"
    path.write_text(
        "cgroups: off\nreport: {labels: true, sample: 5s}\nscratch: {min_free: 1G}\n"
        "state: {shared: true}\ncompat: {home_tokens: false}\nbusy_devices: warn\n"
        "devices:\n  x: {nodes: [/dev/x], visible_env: [X_VISIBLE]}\n"
    )
    cfg = parse_file(str(path))
    assert (cfg.cgroups, cfg.report_labels, cfg.report_sample) == ("off", True, 5.0)
    assert (cfg.scratch_min_free, cfg.shared_state, cfg.home_tokens) == (1 << 30, True, False)
    assert cfg.busy_devices == "warn"
    x = classes_from_config(cfg.devices, cfg.path)["x"]
    assert (x.nodes, x.visible_env) == (("/dev/x",), ("X_VISIBLE",))


def test_an_unreadable_file_stops_at_its_first_problem(tmp_path: Path) -> None:
    from hold.config import parse_file

    path = tmp_path / "list.yaml"
    path.write_text("- cgroups\n- maybe\n")
    with pytest.raises(BadValue) as info:
        parse_file(str(path))
    assert str(info.value) == f"{path}:1: the top level '(a list)' is not valid: a mapping"
