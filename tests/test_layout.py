"""The package layout: one concept per package, and who may import whom.

The contracts are the ones each package's ``__init__`` states; a move that
breaks one fails here, with the importing module and the import named.
Imports inside functions count as much as those at the top.
"""

from __future__ import annotations

import ast
import subprocess
import sys
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
        "print(','.join(m for m in ('click', 'statistics', 'pydantic') if m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ""
