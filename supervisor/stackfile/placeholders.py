"""This project's placeholders in a stack file's strings, and nothing else's.

Ours are ``{port}``, ``{units.NAME.port}``, ``{run_dir}``, ``{stack_dir}`` and
``{scratch}``; ``{{`` and ``}}`` are literal braces. The shell's ``${NAME}`` and
``$NAME`` pass through untouched, and so does any brace text that is not a
name (``awk '{print $1}'``, ``{"a": 1}``, ``{a,b}``): a shell snippet is written
as it would be in a terminal. A name in braces that is not ours
(``{home}``) is refused with its line: it is a typo or a forgotten ``$``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

# One token at a time, leftmost first: the shell's ${...} (skipped whole, so
# its braces are not ours), a literal brace pair, or {name}.
_TOKEN = re.compile(r"\$\{[^{}]*\}|\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_.-]*)\}")
# `{port` with no closing brace: one of ours, cut short.
_CUT = re.compile(
    r"(?<![${])\{(port|run_dir|stack_dir|scratch|units\.[A-Za-z0-9_-]+\.port)(?![}A-Za-z0-9_.-])"
)
_UNIT_PORT = re.compile(r"units\.([^.]+)\.port")
SIMPLE = ("port", "run_dir", "stack_dir", "scratch")
ACCEPTED = (
    "{port}, {units.NAME.port}, {run_dir}, {stack_dir} or {scratch} "
    "({{ and }} for literal braces; the shell's ${NAME} passes through)"
)


@dataclass(frozen=True)
class Use:
    """One placeholder in a string: ``name`` as written, ``unit`` for ``units.NAME.port``."""

    name: str
    unit: str | None


def uses(text: str) -> Iterator[Use]:
    """Every placeholder of ours in ``text`` (known or not: the caller checks)."""
    for m in _TOKEN.finditer(text):
        inner = m.group(1)
        if inner is None:
            continue
        pm = _UNIT_PORT.fullmatch(inner)
        yield Use(inner, pm.group(1) if pm else None)


def cut_short(text: str) -> str | None:
    """A placeholder of ours without its closing brace (``{port``), if ``text`` has one."""
    m = _CUT.search(text)
    return None if m is None else m.group(0)


def fill(text: str, values: Mapping[str, str], ports: Mapping[str, int]) -> str:
    """``text`` with our placeholders filled: ``values`` for the simple names
    (``port``, ``run_dir``, ...), ``ports`` by unit for ``{units.NAME.port}``.

    Validated already: every name is known and has a value.
    """

    def sub(m: re.Match[str]) -> str:
        whole, inner = m.group(0), m.group(1)
        if whole.startswith("$"):
            return whole
        if inner is None:
            return whole[0]  # {{ -> {, }} -> }
        pm = _UNIT_PORT.fullmatch(inner)
        if pm is not None:
            return str(ports[pm.group(1)])
        return values[inner]

    return _TOKEN.sub(sub, text)
