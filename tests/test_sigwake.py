"""Signals on a pipe (:mod:`hold_supervisor.sigwake`), and the one scope that
owns a leaf until its command runs (:meth:`Foreground.until_run`): every way
out of taking the signals puts the caller's handlers back, and a signal whose
handler raises before the command runs leaves no leaf behind."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from hold_supervisor.environ import minimal_env
from hold_supervisor.sigwake import drain, signals_to_pipe
from hold_supervisor.spawn.containment import choose
from hold_supervisor.spawn.foreground import Foreground


class _Stopped(Exception):
    pass


def _raise(signum: int, frame: FrameType | None) -> None:
    raise _Stopped(signum)


def test_signals_come_as_bytes_and_the_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with signals_to_pipe([signal.SIGUSR1]) as wake:
        assert signal.getsignal(signal.SIGUSR1) is not before
        signal.raise_signal(signal.SIGUSR1)
        assert drain(wake) == [signal.SIGUSR1]
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_failure_while_taking_them_puts_back_those_already_taken() -> None:
    """SIGKILL cannot be handled: taking it fails after SIGUSR1 was taken."""
    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(OSError), signals_to_pipe([signal.SIGUSR1, signal.SIGKILL]):
        pytest.fail("the scope was entered")
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_signal_both_taken_and_ignored_gets_its_first_handler_back() -> None:
    before = signal.getsignal(signal.SIGUSR2)
    with signals_to_pipe([signal.SIGUSR2], ignore=[signal.SIGUSR2]):
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGUSR2) is before


class _SignalledOnTheWay(Foreground):
    """A run that meets a signal whose handler raises just before it takes the
    signals itself (a waiter SIGTERMed as it was granted, in ``hold run``)."""

    def _signals_taken(self):  # type: ignore[no-untyped-def]
        signal.raise_signal(signal.SIGUSR1)  # the handler runs as this returns
        return super()._signals_taken()


@pytest.fixture
def raising_usr1() -> Iterator[None]:
    old = signal.signal(signal.SIGUSR1, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.parametrize("cgroup_mode", ["cgroup"], indirect=True)
def test_a_signal_before_the_command_runs_leaves_no_leaf(
    cgroup_mode: str, raising_usr1: None, tmp_path: Path
) -> None:
    tree_id = os.urandom(6).hex()
    ran = tmp_path / "ran"
    fg = _SignalledOnTheWay(
        ["touch", str(ran)],
        env=minimal_env(os.environ, tree_id=tree_id),
        tree_id=tree_id,
        grace=1.0,
        containment=choose("required"),
    )
    with pytest.raises(_Stopped), fg.until_run():
        leaf = fg.prepare("required")
        assert leaf is not None and os.path.isdir(leaf.path)
        fg.run()
    assert not os.path.exists(leaf.path), "the leaf outlived a run that never began"
    assert not ran.exists()
    assert signal.getsignal(signal.SIGUSR1) is _raise
