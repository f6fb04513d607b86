"""A unit's ``env_file``: ``NAME=value`` lines, read strictly.

Accepted, one per line: ``NAME=value``, ``export NAME=value``, blank lines and
``#`` comments. A value is taken as written (no expansion: ``$HOME`` stays
``$HOME``, as systemd's ``EnvironmentFile=`` does); ``'single quotes'`` keep
their text as is, ``"double quotes"`` understand ``\\n``, ``\\t``, ``\\"`` and
``\\\\``. Anything else is an error naming ``FILE:LINE``: a line a person wrote
is never guessed at.
"""

from __future__ import annotations

import os
import re
import stat

from hold_supervisor.environ import check_name
from hold_supervisor.parse import BadValue

MAX_BYTES = 1 << 20
_LINE = re.compile(r"(?:export\s+)?([^=\s]+)\s*=\s*(.*)", re.ASCII)
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "$": "$"}


def read(path: str, shown: str) -> tuple[dict[str, str], list[str]]:
    """The variables in ``path`` and the problems found (``shown:LINE: ...``, one each).

    ``path`` is opened without following a symlink in its last part; anything
    but a regular file (a FIFO, a device), a file over 1 MiB, or not valid
    UTF-8, is one problem.
    """
    try:
        # O_NONBLOCK: a FIFO named here would block the open until a writer came.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        return {}, [f"{shown}: cannot read the env_file: {e.strerror}"]
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}, [f"{shown}: the env_file is not a regular file"]
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        return {}, [f"{shown}: the env_file is over {MAX_BYTES} bytes"]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return {}, [f"{shown}: not UTF-8 at byte {e.start}"]
    if "\0" in text:
        return {}, [
            f"{shown}: a NUL character at line {text[: text.index(chr(0))].count(chr(10)) + 1}"
        ]
    out: dict[str, str] = {}
    problems: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            parsed = _line(line)
        except ValueError as e:
            problems.append(f"{shown}:{n}: {e}")
            continue
        if parsed is not None:
            out[parsed[0]] = parsed[1]
    return out, problems


def _line(line: str) -> tuple[str, str] | None:
    stripped = line.strip()
    if not stripped or stripped.startswith("#"):
        return None
    m = _LINE.fullmatch(stripped)
    if m is None:
        raise ValueError(
            f"{_cut(stripped)} is not valid: NAME=value, export NAME=value or # comment"
        )
    try:
        name = check_name(m.group(1))
    except BadValue as e:
        raise ValueError(f"{m.group(1)!r} is not valid: {e.accepted}") from None
    return name, _value(m.group(2), name)


def _value(raw: str, name: str) -> str:
    if raw[:1] == "'":
        if len(raw) < 2 or not raw.endswith("'") or "'" in raw[1:-1]:
            raise ValueError(f"{name}: unmatched single quote in {_cut(raw)}")
        return raw[1:-1]
    if raw[:1] == '"':
        out: list[str] = []
        i = 1
        while i < len(raw):
            c = raw[i]
            if c == '"':
                if raw[i + 1 :].strip() and not raw[i + 1 :].strip().startswith("#"):
                    raise ValueError(f"{name}: text after the closing quote in {_cut(raw)}")
                return "".join(out)
            if c == "\\" and i + 1 < len(raw):
                esc = raw[i + 1]
                if esc not in _ESCAPES:
                    raise ValueError(
                        f'{name}: unknown escape \\{esc} (accepted: \\n \\t \\" \\\\ \\$)'
                    )
                out.append(_ESCAPES[esc])
                i += 2
                continue
            out.append(c)
            i += 1
        raise ValueError(f"{name}: unmatched double quote in {_cut(raw)}")
    # Unquoted: a ` #` starts a comment, as in a shell.
    return re.split(r"\s+#", raw, maxsplit=1)[0].rstrip()


def _cut(text: str) -> str:
    return repr(text if len(text) <= 60 else text[:57] + "...")
