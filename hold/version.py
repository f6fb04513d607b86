"""The installed version, for ``--version`` (``hold 0.1.0``).

Read from the package's metadata when asked, never at import: the hot path
(``npu-hold -- true``) does not pay for ``importlib.metadata``.
"""

from __future__ import annotations

DIST = "hold"


def version() -> str:
    """The version of the installed ``hold`` distribution (``unknown`` if it is not installed)."""
    # lazy: never at import (the module's docstring); tests/test_ux_cli.py checks it
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version(DIST)
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def version_line(prog: str) -> str:
    return f"{prog} {version()}"
