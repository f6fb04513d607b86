"""The package layout: one concept per package, and who may import whom.

The contracts are the ones each package's ``__init__`` states; a move that
breaks one fails here, with the importing module and the import named.
Imports inside functions count as much as those at the top.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# folder on disk -> import name (pyproject's package-dir maps supervisor/)
FOLDERS = {"hold": "hold", "supervisor": "hold_supervisor"}

# package -> the packages it must never import. "<top>" is a package's
# top-level modules (hold.config, hold_supervisor.parse, ...).
FORBIDDEN: dict[str, set[str]] = {
    "hold.<top>": {"hold.cli", "hold.client", "hold.daemon", "hold.views"},
    "hold.devices": {"hold.cli", "hold.client", "hold.daemon", "hold.views"},
    "hold.daemon": {"hold.cli", "hold.client", "hold.views"},
    "hold.client": {"hold.cli", "hold.daemon", "hold.views"},
    "hold.views": {"hold.cli"},
    "hold.cli": set(),
    "hold_supervisor.<top>": {
        "hold_supervisor.proc",
        "hold_supervisor.spawn",
        "hold_supervisor.stack",
        "hold_supervisor.stackfile",
        "hold_supervisor.task",
    },
    "hold_supervisor.proc": {
        "hold_supervisor.spawn",
        "hold_supervisor.stack",
        "hold_supervisor.stackfile",
        "hold_supervisor.task",
    },
    "hold_supervisor.stackfile": {
        "hold_supervisor.proc",
        "hold_supervisor.spawn",
        "hold_supervisor.stack",
        "hold_supervisor.task",
    },
    "hold_supervisor.spawn": {
        "hold_supervisor.stack",
        "hold_supervisor.stackfile",
        "hold_supervisor.task",
    },
    "hold_supervisor.task": {"hold_supervisor.stack"},
    "hold_supervisor.stack": set(),
}
# The one exception, and why: ``python -m hold`` is the command line.
ALLOWED = {("hold.__main__", "hold.cli.entry")}


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for folder, name in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _package(module: str) -> str:
    """``hold.daemon.ops`` -> ``hold.daemon``; ``hold.config`` -> ``hold.<top>``."""
    parts = module.split(".")
    folder = ROOT / {v: k for k, v in FOLDERS.items()}[parts[0]]
    if len(parts) > 1 and (folder / parts[1]).is_dir():
        return f"{parts[0]}.{parts[1]}"
    return f"{parts[0]}.<top>"


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_every_folder_is_a_listed_package() -> None:
    """pyproject's package list and the folders agree (a folder left out would not install)."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {m for m, p in _modules().items() if p.name == "__init__.py"}
    assert listed == found


def _violations(modules: dict[str, Path]) -> list[str]:
    known = _modules()
    wrong = []
    for module, path in modules.items():
        mine = _package(module)
        for imported in sorted(_imports(path)):
            if imported.split(".")[0] not in FOLDERS.values() or imported not in known:
                continue
            theirs = _package(imported)
            if theirs in FORBIDDEN[mine] and (module, imported) not in ALLOWED:
                wrong.append(f"{module} imports {imported} ({mine} must not import {theirs})")
    return wrong


def test_each_package_imports_only_what_its_contract_allows() -> None:
    modules = _modules()
    assert len(modules) > 100
    assert set(FORBIDDEN) >= {_package(m) for m in modules}
    wrong = _violations(modules)
    assert not wrong, "\n".join(wrong)


def test_the_contract_can_fail(tmp_path: Path) -> None:
    """A daemon module that imports the command line, inside a function, is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f() -> None:\n    from hold.cli.group import cli\n")
    fine = tmp_path / "fine.py"
    fine.write_text("from hold.devices.classes import DeviceClass\n")
    assert _violations({"hold.daemon.bad": bad, "hold.daemon.fine": fine}) == [
        "hold.daemon.bad imports hold.cli.group (hold.daemon must not import hold.cli)"
    ]


def test_supervisor_never_imports_hold() -> None:
    """The layering: process control knows nothing of devices and tickets."""
    files = sorted((ROOT / "supervisor").rglob("*.py"))
    assert len(files) > 20
    wrong = {
        str(f.relative_to(ROOT)): sorted(m for m in _imports(f) if m.split(".")[0] == "hold")
        for f in files
    }
    assert not {f: m for f, m in wrong.items() if m}


def test_autostarts_daemon_imports_no_click() -> None:
    """``hold daemon --detach`` (what autostart runs) skips click: an idle daemon's memory."""
    code = (
        "import sys, hold.cli.entry, hold.cli.daemon, hold.daemon.server; "
        "print(','.join(m for m in ('click', 'statistics') if m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ""


# Issue 22, one /proc reader: outside hold_supervisor.proc no module builds a
# /proc path itself. Each exception: (file, the expression as written) -> why.
# None now: the one that was (the holder scan's listing of /proc/PID/fd, its hot
# loop) moved into hold_supervisor.proc.scan.NodeMatcher with the matching.
PROC_PATH_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _proc_paths(source: str) -> list[tuple[int, str]]:
    """(line, expression) of each string literal that is ``/proc`` or starts with
    ``/proc/``, and each f-string that starts so; docstrings and bare strings left out."""
    tree = ast.parse(source)
    bare = {id(s.value) for s in ast.walk(tree) if isinstance(s, ast.Expr)}
    in_fstring = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}

    def is_proc(text: object) -> bool:
        return isinstance(text, str) and (text == "/proc" or text.startswith("/proc/"))

    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in bare:
            continue
        if isinstance(node, ast.JoinedStr):
            first = node.values[0] if node.values else None
            hit = isinstance(first, ast.Constant) and is_proc(first.value)
        else:
            hit = (
                isinstance(node, ast.Constant)
                and id(node) not in in_fstring
                and is_proc(node.value)
            )
        if hit:
            out.append((node.lineno, ast.get_source_segment(source, node) or "?"))
    return sorted(out)


def test_only_hold_supervisor_proc_builds_proc_paths() -> None:
    """Every read of /proc goes through ``hold_supervisor.proc`` (``scan`` above all):
    a string literal ``"/proc/..."`` or an f-string ``f"/proc/{pid}/..."`` anywhere
    else fails here, unless :data:`PROC_PATH_EXCEPTIONS` names it with a reason."""
    sample = 'x = "/proc/locks"\ny = f"/proc/{pid}/exe"\nos.listdir("/proc")\n"""/proc/doc"""\n'
    assert [seg for _, seg in _proc_paths(sample)] == [
        '"/proc/locks"',
        'f"/proc/{pid}/exe"',
        '"/proc"',
    ]
    found: dict[tuple[str, str], list[int]] = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("supervisor/proc/"):
                continue
            for line, seg in _proc_paths(path.read_text()):
                found.setdefault((rel, seg), []).append(line)
    wrong = {f"{f}:{lines}: {seg}" for (f, seg), lines in found.items()}
    wrong -= {f"{f}:{found[f, seg]}: {seg}" for f, seg in PROC_PATH_EXCEPTIONS if (f, seg) in found}
    assert not wrong, "build the path in hold_supervisor.proc.scan instead"
    stale = set(PROC_PATH_EXCEPTIONS) - set(found)
    assert not stale, f"exceptions that no longer occur: {stale}"


# --------------------------------------------------------------------------
# No import cycles between modules: a cycle hidden by an import inside a
# function is still one (the order of first use then decides what works).


def _runtime_imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules ``path`` imports when it runs: at module level or in a
    function; not under ``if TYPE_CHECKING:`` (annotations only, never executed)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        found.update(n for n in names if n in known)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph = {}
    for module, path in modules.items():
        # A package's own __init__ is imported by its modules' import anyway.
        graph[module] = {m for m in _runtime_imports(path, modules) if m != module}
    return graph


def test_no_module_imports_itself_back() -> None:
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 5000))
    cycles = _cycles(_import_graph(_modules()))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_can_fail(tmp_path: Path) -> None:
    """Two modules that import each other, one inside a function, one under
    TYPE_CHECKING beside them (no cycle): the first pair is found, the other not."""
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("import b\n")
    b.write_text("def f() -> None:\n    import a\n")
    c.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n")
    (tmp_path / "d.py").write_text("import c\n")
    mods = {"a": a, "b": b, "c": c, "d": tmp_path / "d.py"}
    graph = _import_graph(mods)
    graph["a"].add("c")
    assert _cycles(graph) == [["a", "b"]]


def _formatter_opt_outs(root: Path) -> list[str]:
    """Lines that take themselves away from the formatter (``fmt: skip``/``off``)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if ".venv" in path.parts or "build" in path.parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"#\s*fmt:\s*(skip|off)\s*$", line):
                found.append(f"{path.relative_to(root)}:{n}")
    return found


def test_the_formatter_lays_out_every_line() -> None:
    """No ``# fmt: skip``: a line squeezed to fit a count is what issue 22 undid."""
    assert _formatter_opt_outs(ROOT) == []


def test_the_formatter_check_can_fail(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("x = [1,\n  2]  # fmt: skip\n")
    assert _formatter_opt_outs(tmp_path) == ["m.py:2"]


# --------------------------------------------------------------------------
# Issue 22: an import inside a function is there for a reason (a heavy or
# unneeded module kept off a hot path; bench/modsets.py measures which), and
# says it: a comment on its line(s), or on the line above it or above the
# block of imports it is part of. Everything else imports at the top.


def _unexplained_imports(source: str) -> list[str]:
    """``line: statement`` of each import inside a function with no comment to it."""
    tree = ast.parse(source)
    comments = {
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    local = {
        node
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(fn)
        if isinstance(node, (ast.Import, ast.ImportFrom))
    }
    import_lines = {
        n for node in local for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)
    }
    lines = source.splitlines()
    out = []
    for node in sorted(local, key=lambda n: n.lineno):
        own = range(node.lineno, (node.end_lineno or node.lineno) + 1)
        above = node.lineno - 1
        said = bool(comments.intersection(own))
        # Up through the block it is part of (isort's sections: blank lines between).
        while not said and above > 0:
            if not lines[above - 1].strip():
                nearest = above - 1
                while nearest > 0 and not lines[nearest - 1].strip():
                    nearest -= 1
                if nearest not in import_lines:
                    break  # a blank line ends the block, unless imports are above it
                above = nearest
            said = above in comments
            if above not in import_lines:
                break
            above -= 1
        if not said:
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_every_import_inside_a_function_says_why() -> None:
    files = [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 100
    wrong = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in files
        for line in _unexplained_imports(p.read_text())
    ]
    assert not wrong, "import at the top, or say why not:\n" + "\n".join(wrong)


def test_the_why_check_can_fail(tmp_path: Path) -> None:
    """Uncommented imports inside functions are named; one with a comment on its
    line(s), above it, or above the block it is part of is not, nor one at the top."""
    mod = tmp_path / "mod.py"
    mod.write_text(
        "import os\n"
        "def bare() -> None:\n"
        "    import json\n"
        "def said() -> None:\n"
        "    import csv  # lazy: off the hot path\n"
        "    # lazy: off the hot path\n"
        "    import zlib\n"
        "\n"
        "    from hold import config\n"
        "    x = 1\n"
        "    from hold import errors\n"
        "def nested() -> None:\n"
        "    def inner() -> None:\n"
        "        from hold import (\n"
        "            protocol,  # lazy: said on a line of its own\n"
        "        )\n"
        "        import re\n"
        "        x = 2  # a comment of its own\n"
        "\n"
        "        import zipfile\n"
    )
    assert _unexplained_imports(mod.read_text()) == [
        "3: import json",
        "11: from hold import errors",
        "20: import zipfile",
    ]
