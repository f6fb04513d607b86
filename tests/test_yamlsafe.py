"""The strict YAML reader shared by the configuration and the stack file.

Each bound is shown to hold with both parsers (libyaml's, where installed,
and PyYAML's own), and the alias bomb's refusal is measured in a fresh
process: its time and its peak memory above the baseline of that process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from hold_supervisor import yamlsafe
from hold_supervisor.yamlsafe import MAX_DEPTH, MAX_VALUES, YamlError, compose, compose_bytes


def alias_bomb(levels: int = 7, items: int = 9) -> str:
    """About 400 bytes naming items**levels values (4.8 million for 7 and 9)."""
    lines = [f"a0: &a0 [{', '.join(['x'] * items)}]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * items)}]")
    return "\n".join(lines) + "\n"


PARSERS = ["pure"] + (["libyaml"] if getattr(yaml, "CSafeLoader", None) else [])


@pytest.fixture(params=PARSERS)
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "pure":
        monkeypatch.setattr(yamlsafe, "Loader", yaml.SafeLoader)
    yield request.param


def refused(text: str) -> list[str]:
    with pytest.raises(YamlError) as info:
        compose(text, "f.yaml")
    return info.value.lines


def test_the_alias_bomb_is_about_400_bytes() -> None:
    assert 300 <= len(alias_bomb()) <= 450
    # ... and what yaml.compose makes of it is small: the expansion is the danger.
    assert isinstance(yaml.compose(alias_bomb(), Loader=yaml.SafeLoader), yaml.MappingNode)


def test_alias_bomb_refused_fast_and_small(parser: str) -> None:
    errs = refused(alias_bomb())
    assert len(errs) == 1
    assert errs[0].startswith(
        "f.yaml:6: a5[0]: alias *a4: the document holds more than 100000 "
        "values with every alias expanded"
    )


MEASURE = textwrap.dedent("""
    import json, resource, sys, time
    sys.path.insert(0, sys.argv[1])
    # the baseline imports these
    import hold.config, hold_supervisor.stackfile.load, hold_supervisor.yamlsafe
    from hold_supervisor.parse import BadValue
    from hold_supervisor.stackfile.load import StackFileError
    out = {}
    for what, path in (("stack", sys.argv[2]), ("config", sys.argv[3])):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t = time.monotonic()
        try:
            if what == "stack":
                hold_supervisor.stackfile.load.load(path)
            else:
                hold.config.parse_file(path)
        except (StackFileError, BadValue) as e:
            message = str(e)
        else:
            message = None
        out[what] = {
            "seconds": time.monotonic() - t,
            "kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before,
            "message": message,
        }
    print(json.dumps(out))
""")


def test_alias_bomb_refusal_measured_in_a_fresh_process(tmp_path: Path) -> None:
    """The issue's bomb (17 s and 1.2 GB before): under 1 s and 100 MB above the baseline,
    through both readers (the stack file and the configuration)."""
    stack = tmp_path / "stack.yaml"
    stack.write_text("name: bomb\nunits:\n  a: {cmd: [x]}\n" + alias_bomb())
    config = tmp_path / "bomb-config.yaml"
    config.write_text("cgroups: auto\nx-bomb:\n" + textwrap.indent(alias_bomb(), "  "))
    res = subprocess.run(
        [sys.executable, "-c", MEASURE, str(ROOT), str(stack), str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    print(got)  # the measurement, for the record (pytest -s)
    for what in ("stack", "config"):
        m = got[what]
        assert m["message"] is not None and "every alias expanded" in m["message"], m
        assert m["seconds"] < 1.0, m
        assert m["kib"] < 100 * 1024, m


def test_depth_is_bounded_without_recursion(parser: str) -> None:
    for text in (
        "a: " + "[" * 2000 + "]" * 2000,
        "{a: " * 2000 + "1" + "}" * 2000,
        "a:\n" + "".join(" " * i + "b:\n" for i in range(1, 300)),
    ):
        errs = refused(text)
        assert len(errs) == 1 and errs[0].endswith(f"nested deeper than {MAX_DEPTH} levels"), errs
    # The bound itself is accepted.
    ok = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert compose(ok, "f.yaml") is not None
    assert refused("[" + ok + "]")[0].endswith(f"nested deeper than {MAX_DEPTH} levels")


def test_an_alias_counts_at_its_full_depth(parser: str) -> None:
    deep = "[" * 40 + "]" * 40
    text = f"a: &x {deep}\nb: " + "[" * 30 + "*x" + "]" * 30 + "\n"
    errs = refused(text)
    assert errs[0].startswith("f.yaml:2: b[0]")
    assert errs[0].endswith(f"alias *x nests values deeper than {MAX_DEPTH} levels")


def test_size_is_bounded_with_and_without_aliases(parser: str) -> None:
    many = "[" + ", ".join(["1"] * (MAX_VALUES + 5)) + "]"
    assert "more than 100000 values" in refused(many)[0]
    # Aliases that stay small are fine, and still the same node (nothing copied).
    root = compose("a: &x {b: [1, 2]}\nc: *x\n", "f.yaml")
    assert isinstance(root, yaml.MappingNode)
    assert root.value[0][1] is root.value[1][1]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a: &x [1, *x]\n", "1: a[1]: alias *x is inside the value it names"),
        ("a: *x\n", "1: a: alias *x names no anchor before it"),
        ("a: &x 1\nb: &x 2\n", "2: anchor &x defined twice (first at line 1)"),
        ("a: !!python/object:os.system x\n", "1: a: the tag 'tag:yaml.org,2002:python/object"),
        ("a: !!binary aGk=\n", "1: a: the tag 'tag:yaml.org,2002:binary' is not accepted"),
        ("a: !!set {x}\n", "1: a: the tag 'tag:yaml.org,2002:set' is not accepted"),
        ("a: !mine x\n", "1: a: the tag '!mine' is not accepted"),
        ("a: &x {b: 1}\nc: {<<: *x}\n", "2: c: merge keys (<<) are not supported"),
        ("? [a]\n: b\n", "1: top level: a key must be a plain value"),
        ("a: &k [1]\n*k : 2\n", "2: top level: a key must be a plain value"),
        ("a: 1\n---\nb: 2\n", "2: a second document (---): the file holds one"),
        ("a: \x07\n", "1: not valid YAML: character '\\x07' is not allowed"),
        ("a: b\nc: \x00\n", "2: not valid YAML: character '\\x00' is not allowed"),
        ("a: {b: [1]\n", "2: not valid YAML: "),
        ("a: " + "9" * 5000 + "\n", "1: a: '9999"),
        ("a: !!int x\n", "1: a: 'x' is not a valid number"),
        ("a: !!bool maybe\n", "1: a: 'maybe' is not a valid number"),
    ],
)
def test_refused_with_the_line(parser: str, text: str, expected: str) -> None:
    errs = refused(text)
    assert errs[0].startswith("f.yaml:" + expected), errs


def test_duplicate_keys_name_both_lines_every_one(parser: str) -> None:
    errs = refused("a: 1\nb:\n  c: 1\n  c: 2\na: 3\n")
    assert errs == [
        "f.yaml:4: b.c: duplicate key 'c', first at f.yaml:3 (each key once)",
        "f.yaml:5: a: duplicate key 'a', first at f.yaml:1 (each key once)",
    ]


def test_non_utf8_names_the_byte_offset_and_line() -> None:
    with pytest.raises(YamlError) as info:
        compose_bytes(b"a: 1\nb: caf\xe9\n", "f.yaml")
    assert info.value.lines == [
        "f.yaml:2: not UTF-8 text: byte 0xe9 at offset 11 (line 2, column 7): "
        "invalid continuation byte"
    ]
    with pytest.raises(YamlError) as info:
        compose_bytes(b"a: \xff\xfe\n", "f.yaml")
    assert info.value.lines[0].startswith("f.yaml:1: not UTF-8 text: byte 0xff at offset 3")
    # An encoded surrogate is no UTF-8 either.
    with pytest.raises(YamlError):
        compose_bytes(b"a: \xed\xa0\x80\n", "f.yaml")


def test_files_that_are_not_regular_or_too_large(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, expected in (
        (str(tmp_path), "not a regular file"),
        (str(fifo), "not a regular file"),  # never blocks waiting for a writer
        ("/dev/zero", "not a regular file"),
        (str(tmp_path / "none"), "cannot read the file: No such file or directory"),
    ):
        with pytest.raises(YamlError) as info:
            yamlsafe.load_file(path)
        assert info.value.lines == [f"{path}: {expected}"]
    big = tmp_path / "big.yaml"
    big.write_text("a: '" + "x" * yamlsafe.MAX_BYTES + "'\n")
    with pytest.raises(YamlError) as info:
        yamlsafe.load_file(str(big))
    assert info.value.lines == [f"{big}: larger than 1024 KiB: refused unread"]


def test_scalars_are_plain_values(parser: str) -> None:
    root = compose("a: 1\nb: 1.5\nc: yes\nd: ~\ne: 2024-01-01\nf: =\ng: '1'\n", "f.yaml")
    assert isinstance(root, yaml.MappingNode)
    values = {k.value: yamlsafe.scalar_value(v) for k, v in root.value}
    assert values == {"a": 1, "b": 1.5, "c": True, "d": None, "e": "2024-01-01", "f": "=", "g": "1"}
