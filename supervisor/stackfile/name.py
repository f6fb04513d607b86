"""A stack's name: a directory under the state directory (no '/', no '..').

Its own module, so that checking a stack file (``hold up``'s command) needs
neither the control socket's module nor ``socket``."""

from __future__ import annotations

import re

from hold_supervisor.parse import BadValue

STACK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", re.ASCII)


def check_stack_name(name: str, *, where: str = "") -> str:
    """``name`` if it may name a stack, else :class:`BadValue`."""
    if not isinstance(name, str) or not STACK_NAME.fullmatch(name):
        raise BadValue(
            "stack name",
            name,
            "letters, digits, '_', '.' and '-' (at most 64), starting with a letter or digit",
            where,
        )
    return name
