"""The environment a child starts with: an allowlist, what the caller names, a marker.

Never the parent's whole environment: a supervisor started from a shell that
holds ``AWS_SECRET_ACCESS_KEY`` must not hand it to a model server.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from hold_supervisor.parse import BadValue

DEFAULT_ALLOW: tuple[str, ...] = ("PATH", "HOME", "LANG", "LC_*", "TERM", "USER", "TZ")
MARKER = "HOLD_TREE"
# A safe PATH for a child whose parent had none (as execvp(3) would assume).
FALLBACK_PATH = "/usr/local/bin:/usr/bin:/bin"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_name(name: str, *, where: str = "") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadValue(
            "environment variable name",
            name,
            "letters, digits and _, not starting with a digit",
            where,
        )
    return name


def parse_assignment(text: str, *, where: str = "") -> tuple[str, str]:
    """``NAME=VALUE`` (as given to ``--env``) -> ``(NAME, VALUE)``."""
    name, sep, value = text.partition("=")
    if not sep:
        raise BadValue("environment assignment", text, "NAME=VALUE", where)
    check_name(name, where=where)
    if "\0" in value:
        raise BadValue("environment value", text, "no NUL characters", where)
    return name, value


def _allowed(name: str, allow: Iterable[str]) -> bool:
    for pattern in allow:
        if pattern.endswith("*"):
            if name.startswith(pattern[:-1]):
                return True
        elif name == pattern:
            return True
    return False


def minimal_env(
    parent: Mapping[str, str],
    *,
    tree_id: str,
    allow: Iterable[str] = DEFAULT_ALLOW,
    pass_names: Iterable[str] = (),
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Build a child's environment.

    ``allow`` patterns (a trailing ``*`` matches a prefix) and ``pass_names``
    are copied from ``parent`` where present; ``extra`` is set as given and
    wins; ``HOLD_TREE=<tree_id>`` is always set last so nothing overrides it.
    The marker only helps *find* escaped descendants; nothing ever trusts it.
    """
    allow = tuple(allow)
    names = set(pass_names)
    env = {k: v for k, v in parent.items() if k in names or _allowed(k, allow)}
    if extra:
        env.update(extra)
    env.setdefault("PATH", FALLBACK_PATH)
    env[MARKER] = tree_id
    return env
