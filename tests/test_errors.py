"""One root of errors per package (as psutil has one), and one place that turns
them into exit statuses (``hold.cli.entry.main``)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import hold
import hold_supervisor
from hold.errors import HoldError
from hold_supervisor.errors import SupervisorError
from hold_supervisor.exitcodes import TOOL, USAGE

# Not errors but control flow (a signal arrived) or bugs (a transition the
# code must never make): deliberately outside the trees.
OUTSIDE = {
    "hold.cli.interrupt.Interrupted",
    "hold.cli.call._Interrupted",
    "hold_supervisor.states.BadTransition",
    # An internal signal that never leaves its caller: spawn turns a failed
    # chdir into a SpawnError.
    "hold_supervisor.spawn.intoleaf.ChdirFailed",
}


def _exceptions(package: object, root: type) -> list[tuple[str, type]]:
    out = []
    path = package.__path__  # type: ignore[attr-defined]
    for info in pkgutil.walk_packages(path, package.__name__ + "."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                out.append((f"{module.__name__}.{name}", obj))
    return out


@pytest.mark.parametrize(
    ("package", "root"), [(hold, HoldError), (hold_supervisor, SupervisorError)]
)
def test_every_error_has_its_packages_root(package: object, root: type) -> None:
    found = _exceptions(package, root)
    assert len(found) >= 10  # every package walked, its subpackages too
    stray = [name for name, cls in found if name not in OUTSIDE and not issubclass(cls, root)]
    assert not stray, f"errors outside the package roots: {stray}"


def test_exit_codes_come_with_the_errors() -> None:
    from hold.client.connection import ConfigMismatch, DaemonUnreachable
    from hold_supervisor.parse import BadValue
    from hold_supervisor.safefile import UnsafePath

    assert BadValue("x", "y", "z").exit_code == USAGE
    assert issubclass(UnsafePath, BadValue)  # so exit 2 too
    assert DaemonUnreachable("gone").exit_code == TOOL
    assert ConfigMismatch("other").exit_code == USAGE


def test_entry_turns_an_error_into_its_exit_status(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hold.cli.entry import main

    # A state directory that is not one: refused deep down, exit 2 and one line.
    monkeypatch.setenv("HOLD_STATE_DIR", "relative/dir")
    code = main(["down", "somestack"])  # the path that skips click
    assert code == USAGE
    err = capsys.readouterr().err
    assert "HOLD_STATE_DIR" in err and "Traceback" not in err
