"""A signal, before a command's own handlers take over, ends the command cleanly.

``hold run`` may be starting a daemon or waiting in line, ``hold up`` waiting
for its ticket or making its trees: a traceback, or a silent death that leaves
an empty cgroup leaf behind, is no answer to Ctrl-C or ``hold down``. Inside
:func:`interrupting`, the signals raise :class:`Interrupted`, so that every
scope on the way out (leaves, locks, connections) is left as it should be.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterable, Iterator


class Interrupted(Exception):  # control flow, not an error: outside HoldError
    """A stop signal arrived; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise(signum: int, frame: object) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def interrupting(signals: Iterable[int]) -> Iterator[None]:
    """Within the scope, each of ``signals`` raises :class:`Interrupted`; the old
    handlers are back on the way out."""
    old = {s: signal.signal(s, _raise) for s in signals}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
