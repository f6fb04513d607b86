"""The package layout: hold's ``supervisor`` refuses to share its folder with
supervisord's (the PyPI package ``supervisor`` installs a top-level package of
the same name; in one environment the two would merge without a word)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(
        ROOT / "supervisor",
        tmp_path / "supervisor",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return tmp_path / "supervisor"


def _import(where: Path, module: str) -> subprocess.CompletedProcess[str]:
    code = (
        f"import sys; sys.path.insert(0, {str(where)!r}); import {module}; "
        f"print({module.split('.')[0]}.__file__)"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=where, capture_output=True, text=True, timeout=30
    )


def test_alone_it_imports(tmp_path: Path) -> None:
    pkg = _copy(tmp_path)
    r = _import(tmp_path, "supervisor.procscan")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(pkg / "__init__.py")


def test_merged_with_supervisord_is_a_clear_import_error(tmp_path: Path) -> None:
    pkg = _copy(tmp_path)
    (pkg / "supervisord.py").write_text("# supervisord's main module\n")
    r = _import(tmp_path, "supervisor")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: "), r.stderr
    assert "supervisord" in last and "separate virtual environment" in last
    assert str(pkg) in last


def test_init_replaced_by_supervisord_is_a_clear_import_error(tmp_path: Path) -> None:
    """supervisord installed after hold: its __init__.py has overwritten ours."""
    pkg = _copy(tmp_path)
    (pkg / "__init__.py").write_text("# this is a package\n")
    r = _import(tmp_path, "supervisor.procscan")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: "), r.stderr
    assert "not hold's" in last and "separate virtual environment" in last


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside a function."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


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
        "import sys, hold.entry, hold.daemoncmd, hold.daemon; "
        "print(','.join(m for m in ('click', 'statistics', 'pydantic') if m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ""
