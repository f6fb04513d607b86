"""Containment: cgroup leaves or the walk, chosen once (issue 22).

The choice is made in :mod:`hold_supervisor.spawn.containment` (``choose``,
``within``, ``first_home``); everyone else asks the chosen object. The first
test holds the code to that: outside the module, nothing tests whether a leaf
or a hierarchy is there, unless :data:`EXCEPTIONS` says why. The others run a
tree under each strategy and stop it, with nothing left.
"""

from __future__ import annotations

import ast
import errno
import os
import time
from pathlib import Path

import pytest
from conftest import LOADED
from test_stop import _marked

from hold_supervisor.environ import minimal_env
from hold_supervisor.proc.cgroup import CgroupUnavailable, Hierarchy, removed
from hold_supervisor.spawn.containment import (
    LeafContainment,
    WalkContainment,
    choose,
    first_home,
    within,
)
from hold_supervisor.spawn.foreground import Foreground

ROOT = Path(__file__).resolve().parent.parent
HOME = "supervisor/spawn/containment.py"
NAMES = ("leaf", "hierarchy")  # what says "cgroup or walk" when tested for being there

# (file, the test as written) -> why it is not the cgroup-or-walk choice.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("supervisor/proc/tree.py", "self.leaf is not None"): (
        "Tree owns its leaf: membership is the leaf where it has one (proc/ may not "
        "import spawn/); everyone else asks Tree.method, kill_leaf, leaf_emptied..."
    ),
    ("supervisor/proc/tree.py", "self.leaf is None"): "as above",
    ("supervisor/proc/tree.py", '"walk" if self.leaf is None else "cgroup"'): (
        "Tree.method: how a stop of it reports its means"
    ),
    ("hold/cli/adoptjob.py", "leaf is None"): (
        "--adopt: whether its running tree could be moved into the leaf made for it "
        "(Containment.take_in); if not, the walk from then on"
    ),
    ("hold/daemon/ops.py", "leaf is not None"): (
        "the wire: a registration's optional 'leaf' field, checked before it is believed"
    ),
    ("hold/cli/down.py", "t.leaf is not None"): (
        "hold down: a moment for the guardian to remove a stopped tree's leaf, for the "
        "trees found in one (found from the stack's processes, not chosen here)"
    ),
    ("supervisor/stack/figures.py", "leaf is not None"): (
        "a unit's figures: read from its leaf where it has one (a task unit has a leaf "
        "and no tree of its own), else from its members"
    ),
    ("hold/daemon/records.py", "t.leaf"): "a lease's record: the leaves of its trees, listed",
    ("hold/daemon/adoptrules.py", "t.leaf"): (
        "an adoption refused inside another lease's leaf: the registered trees' leaves"
    ),
    ("hold/daemon/figures.py", "t.leaf"): (
        "a lease's figures: from each registered tree's leaf, else its members"
    ),
    ("hold/daemon/sessions.py", "t.leaf"): "a registered tree rebuilt from the ledger's record",
}


def _named(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in NAMES) or (
        isinstance(node, ast.Attribute) and node.attr in NAMES
    )


def choice_tests(source: str) -> list[tuple[int, str]]:
    """(line, test as written) of each test whether a ``leaf`` or ``hierarchy`` is
    there -- ``is None``, ``is not None``, or its truth in an ``if``, a conditional
    expression, ``and``/``or``/``not`` -- and each ``"cgroup" if ... else "walk"``.
    An ``assert`` (what mypy is told) is not a choice."""
    tree = ast.parse(source)
    asserted = {id(n) for a in ast.walk(tree) if isinstance(a, ast.Assert) for n in ast.walk(a)}
    found: list[ast.AST] = []
    for node in ast.walk(tree):
        if id(node) in asserted:
            continue
        if (
            isinstance(node, ast.Compare)
            and _named(node.left)
            and len(node.ops) == 1
            and isinstance(node.ops[0], ast.Is | ast.IsNot)
            and isinstance(node.comparators[0], ast.Constant)
            and node.comparators[0].value is None
        ):
            found.append(node)
        elif isinstance(node, ast.If | ast.IfExp | ast.While) and _named(node.test):
            found.append(node.test)
        elif isinstance(node, ast.BoolOp):
            found.extend(v for v in node.values if _named(v))
        elif (
            isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and _named(node.operand)
        ):
            found.append(node)
        elif isinstance(node, ast.comprehension):
            found.extend(c for c in node.ifs if _named(c))
        if isinstance(node, ast.IfExp) and {
            getattr(node.body, "value", None),
            getattr(node.orelse, "value", None),
        } == {"cgroup", "walk"}:
            found.append(node)
    return sorted((n.lineno, ast.get_source_segment(source, n) or "?") for n in found)


def test_the_check_can_fail() -> None:
    sample = (
        "if leaf is None:\n    pass\n"
        "x = leaf.path if leaf else None\n"
        "y = 'cgroup' if self.hierarchy is not None else 'walk'\n"
        "assert leaf is not None\n"
        "z = [t for t in trees if t.leaf]\n"
        "w = tree.leaf_emptied()\n"
    )
    assert choice_tests(sample) == [
        (1, "leaf is None"),
        (3, "leaf"),
        (4, "'cgroup' if self.hierarchy is not None else 'walk'"),
        (4, "self.hierarchy is not None"),
        (6, "t.leaf"),
    ]


def test_the_choice_is_made_in_one_place() -> None:
    """Outside ``spawn/containment.py`` no module tests whether there is a leaf or a
    hierarchy to choose between the cgroup and the walk, except where
    :data:`EXCEPTIONS` names the test and why it is not that choice."""
    found: dict[tuple[str, str], list[int]] = {}
    for folder in ("hold", "supervisor"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == HOME:
                continue
            for line, seg in choice_tests(path.read_text()):
                found.setdefault((rel, seg), []).append(line)
    wrong = sorted(f"{f}:{n}: {seg}" for (f, seg), n in found.items() if (f, seg) not in EXCEPTIONS)
    assert not wrong, "ask the Containment (or the Tree) instead:\n" + "\n".join(wrong)
    stale = set(EXCEPTIONS) - set(found)
    assert not stale, f"exceptions that no longer occur: {stale}"
    assert choice_tests((ROOT / HOME).read_text()), "the choice itself is there"


# --------------------------------------------------------------------------
# The strategies


def test_choose_off_is_the_walk_and_auto_takes_a_leaf_where_it_can() -> None:
    assert isinstance(choose("off"), WalkContainment)
    try:
        base = Hierarchy.find().base
    except CgroupUnavailable:
        assert isinstance(choose("auto"), WalkContainment)
        with pytest.raises(CgroupUnavailable):
            choose("required")
        return
    for mode in ("auto", "required"):
        got = choose(mode)
        assert isinstance(got, LeafContainment) and got.hierarchy.base == base


def test_a_leaf_that_cannot_be_made_gives_way_to_the_walk_under_auto_only() -> None:
    broken = LeafContainment(Hierarchy("/nonexistent/hold-test"))
    with pytest.raises(CgroupUnavailable):
        first_home(broken, "hold-x", "required")
    now, leaf = first_home(broken, "hold-x", "auto")
    assert isinstance(now, WalkContainment) and leaf is None
    assert now.limit("off") is not None and broken.limit() is None


def test_calls_follow_their_unit(cgroup_mode: str) -> None:
    """A task unit's calls nest in the unit's leaf, or are walked as the unit is."""
    unit = choose("required" if cgroup_mode == "cgroup" else "off")
    leaf = unit.home("hold-unit")
    try:
        calls = within(leaf)
        assert calls.method == unit.method and calls.joins_leaf == unit.joins_leaf
        inner = calls.home("hold-call")
        if cgroup_mode == "cgroup":
            assert leaf is not None and inner is not None
            assert os.path.dirname(inner.path) == leaf.path
        else:
            assert inner is None
        calls.release(inner)
    finally:
        unit.release(leaf)
    assert leaf is None or not os.path.exists(leaf.path)


def test_each_strategy_runs_a_tree_and_stops_it_with_nothing_left(
    cgroup_mode: str, tmp_path: Path
) -> None:
    """A tree with a double-forked orphan and a setsid escapee, under each strategy:
    stopped at its time limit by the means its strategy names, nobody left, the
    leaf (if any) gone."""
    containment = choose("required" if cgroup_mode == "cgroup" else "off")
    tree_id = os.urandom(6).hex()
    ready = tmp_path / "ready"
    script = f"(sleep 60 &) ; setsid sh -c 'sleep 60' & echo up > {ready}; sleep 60"
    fg = Foreground(
        ["/bin/sh", "-c", script],
        env=minimal_env(os.environ, tree_id=tree_id),
        tree_id=tree_id,
        timeout=1.0,
        grace=2.0,
        containment=containment,
    )
    t0 = time.monotonic()
    result = fg.run()
    assert ready.exists(), "the tree ran"
    assert result.cause.kind == "expired"
    assert result.report.method == containment.method == fg.containment.method
    assert len(result.report.stopped) >= 3, result.report.summary()
    assert not result.report.survivors
    assert _marked(tree_id) == []
    assert time.monotonic() - t0 < 1.0 + 2.0 + LOADED  # the time limit, the grace
    if cgroup_mode == "cgroup":
        assert fg.leaf is not None and not os.path.exists(fg.leaf.path)
    else:
        assert fg.leaf is None


def test_a_cgroup_file_read_as_its_cgroup_is_removed_says_gone() -> None:
    """A cgroup file opened before its cgroup's rmdir reads ENODEV (an adopted job's
    release met it, 3 runs in 30 under load): taken as gone, as a missing file is,
    by every reader of a leaf."""
    try:
        hier = Hierarchy.find()
    except CgroupUnavailable as e:
        pytest.skip(f"no cgroup leaf here: {e}")
    leaf = hier.create(f"holdtest-gone-{os.urandom(6).hex()}")
    procs = os.open(leaf.procs_file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.rmdir(leaf.path)
        with pytest.raises(OSError) as info:
            os.read(procs, 4096)
    finally:
        os.close(procs)
    assert info.value.errno == errno.ENODEV and removed(info.value)
    assert removed(FileNotFoundError(errno.ENOENT, "gone"))
    assert not removed(PermissionError(errno.EACCES, "not ours"))
    # And the leaf's readers, on the path that is gone now.
    assert leaf.pids() == [] and not leaf.populated() and leaf.wait_empty(0.1)
    leaf.kill()
