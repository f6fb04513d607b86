"""One strict YAML reader, for the configuration and for the stack file.

``yaml.compose`` is not enough for files people write and others may hand
them: it recurses once per nesting level (2,000 levels is a traceback), it
reads undecodable bytes as a traceback too, and an alias is a reference, so
a 400-byte document of nested aliases names millions of values, which the
first consumer that walks it (or ``yaml.safe_load``) builds, for seconds and
gigabytes. Here the parser's *events* are composed into the same node graph
``yaml.compose`` returns (``yaml.MappingNode`` and friends, an alias still
the very node it names), without recursion, refusing as soon as one of the
bounds below is passed; nothing large is ever built:

* the file: at most :data:`MAX_BYTES`, a regular file, UTF-8 (the refusal
  names the byte, its offset, line and column);
* nesting: at most :data:`MAX_DEPTH` levels, an alias counted as the value it
  names (so a consumer's recursion is bounded too);
* size: at most :data:`MAX_VALUES` values in the document with every alias
  expanded, counted as each alias is met (the size of what it names is known
  then); a value that contains an alias to itself is refused;
* keys: plain values only, each once per mapping (both lines named); no merge
  keys (``<<``);
* tags: the standard scalar tags only (str, int, float, bool, null; an
  implicit timestamp is kept as the text written); one document per file.

Every problem is a :class:`YamlError` (a :class:`~hold_supervisor.parse.BadValue`,
so every command already turns it into exit 2), each line of it
``FILE:LINE: message``.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import yaml

from hold_supervisor.parse import BadValue, shorten

MAX_BYTES = 1 << 20  # 1 MiB
MAX_DEPTH = 64
MAX_VALUES = 100_000
MAX_PROBLEMS = 50  # listed in one refusal; the rest are counted

_TAG = "tag:yaml.org,2002:"
SCALAR_TAGS = frozenset(_TAG + t for t in ("str", "int", "float", "bool", "null", "timestamp"))
_MERGE = _TAG + "merge"
_VALUE = _TAG + "value"  # YAML 1.1's "=": read as the text "="
_C = getattr(yaml, "CSafeLoader", None)  # libyaml's parser where there is one: ~20 times faster
Loader: Any = _C if _C is not None else yaml.SafeLoader


class YamlError(BadValue):
    """The file is not acceptable YAML; ``problems`` holds ``(line or None, message)``."""

    def __init__(self, path: str, problems: list[tuple[int | None, str]]) -> None:
        self.path = path
        self.problems = problems
        line, first = problems[0]
        self.what, self.value, self.accepted = "YAML", path, first
        self.where = f"{path}:{line}" if line is not None else path
        ValueError.__init__(self, "\n".join(self.lines))

    @property
    def lines(self) -> list[str]:
        """``FILE:LINE: message`` for each problem (at most :data:`MAX_PROBLEMS`)."""
        out = [
            f"{self.path}:{line}: {msg}" if line is not None else f"{self.path}: {msg}"
            for line, msg in self.problems[:MAX_PROBLEMS]
        ]
        if len(self.problems) > MAX_PROBLEMS:
            out.append(f"{self.path}: ... and {len(self.problems) - MAX_PROBLEMS} more problems")
        return out


def refusal(path: str | None, problems: list[BadValue]) -> BadValue | None:
    """One error for every problem found in the file at ``path`` (None if none).

    A problem alone is raised as it is; several become one
    :class:`hold_supervisor.yamlsafe.YamlError` (the reader's own error for
    several problems: a :class:`BadValue`, so every caller shows it as it
    shows one), each problem a ``FILE:LINE: key 'value' is not valid: ...``
    line, in file order, at most :data:`hold_supervisor.yamlsafe.MAX_PROBLEMS`
    of them (the rest counted). A problem that is itself such a list is
    flattened into it.
    """
    if not problems:
        return None
    if len(problems) == 1:
        return problems[0]
    lines: list[tuple[int | None, str]] = []
    for e in problems:
        if isinstance(e, YamlError):
            lines.extend(e.problems)
            continue
        _, _, line = e.where.rpartition(":")
        lines.append(
            (
                int(line) if line.isdigit() else None,
                f"{e.what} {shorten(e.value)} is not valid: {e.accepted}",
            )
        )
    lines.sort(key=lambda p: p[0] or 0)  # stable: one line's problems stay in order
    return YamlError(path or "", lines)


def load_file(path: str, *, shown: str | None = None) -> yaml.Node | None:
    """The composed document in the file at ``path`` (None for an empty one)."""
    shown = path if shown is None else shown
    return compose_bytes(read_bytes(path, shown=shown), shown)


def read_bytes(path: str, *, shown: str | None = None) -> bytes:
    """The file's bytes: a regular file (never a FIFO that blocks) of at most MAX_BYTES."""
    shown = path if shown is None else shown
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        raise YamlError(shown, [(None, f"cannot read the file: {e.strerror}")]) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise YamlError(shown, [(None, "not a regular file")])
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_BYTES:
            chunk = os.read(fd, MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise YamlError(shown, [(None, f"cannot read the file: {e.strerror}")]) from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_BYTES:
        raise YamlError(shown, [(None, f"larger than {MAX_BYTES // 1024} KiB: refused unread")])
    return data


def decode(data: bytes, path: str) -> str:
    """``data`` as UTF-8, strictly; the refusal names the first bad byte and where it is."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise YamlError(
            path,
            [
                (
                    line,
                    f"not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} "
                    f"(line {line}, column {column}): {e.reason}",
                )
            ],
        ) from None


def compose_bytes(data: bytes, path: str) -> yaml.Node | None:
    if len(data) > MAX_BYTES:
        raise YamlError(path, [(None, f"larger than {MAX_BYTES // 1024} KiB")])
    return compose(decode(data, path), path)


class _Open:
    """A sequence or mapping whose end has not been seen yet."""

    __slots__ = ("anchor", "height", "key", "keys", "node", "path", "size")

    def __init__(self, node: yaml.Node, path: tuple[str | int, ...], anchor: str | None) -> None:
        self.node = node
        self.path = path
        self.size = 1  # values, aliases expanded, this one included
        self.height = 1  # levels, this one included
        self.key: yaml.Node | None = None  # a mapping's key waiting for its value
        self.keys: dict[str, int] = {}  # a mapping's keys so far: the line of each
        self.anchor = anchor


def compose(
    text: str, path: str, *, max_depth: int = MAX_DEPTH, max_values: int = MAX_VALUES
) -> yaml.Node | None:
    """``text`` composed as ``yaml.compose`` would, within the bounds; None if empty."""
    if len(text) > MAX_BYTES:  # characters: at least as many bytes
        raise YamlError(path, [(None, f"larger than {MAX_BYTES // 1024} KiB")])
    c = _Composer(path, max_depth, max_values)
    try:
        for event in yaml.parse(text, Loader=Loader):
            c.take(event)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = e.problem or e.context or "malformed"
        if "nesting depth" in problem:  # libyaml's own bound (1,000), met while scanning ahead
            raise c.fail(line, f"nested deeper than {max_depth} levels") from None
        raise c.fail(line, f"not valid YAML: {problem}") from None
    except yaml.reader.ReaderError as e:
        # The position is in characters for PyYAML's reader, in bytes for libyaml's.
        if Loader is yaml.SafeLoader:
            line = text.count("\n", 0, e.position) + 1
        else:
            line = text.encode("utf-8").count(b"\n", 0, e.position) + 1
        char = e.character if isinstance(e.character, str) else chr(int(e.character or 0))
        raise c.fail(
            line, f"not valid YAML: character {char!r} is not allowed ({e.reason})"
        ) from None
    except yaml.YAMLError as e:
        raise c.fail(1, f"not valid YAML: {shorten(str(e))}") from None
    if c.problems:
        raise YamlError(path, sorted(c.problems, key=lambda p: p[0] or 0))
    return c.root


class _Composer:
    """The composition of one document, event by event, within the bounds."""

    def __init__(self, path: str, max_depth: int, max_values: int) -> None:
        self.path = path
        self.max_depth = max_depth
        self.max_values = max_values
        self.resolver = yaml.resolver.Resolver()
        self.problems: list[tuple[int | None, str]] = []  # those that do not stop the reading
        self.stack: list[_Open] = []
        # anchor -> (node, size, height, line); size None while the node is still open
        self.anchors: dict[str, tuple[yaml.Node, int | None, int, int]] = {}
        self.root: yaml.Node | None = None
        self.documents = 0
        self.total = 0

    def fail(self, line: int, msg: str) -> YamlError:
        return YamlError(self.path, sorted([*self.problems, (line, msg)], key=lambda p: p[0] or 0))

    def take(self, event: Any) -> None:
        mark = event.start_mark
        line = mark.line + 1 if mark is not None else 1
        if isinstance(event, yaml.DocumentStartEvent):
            self.documents += 1
            if self.documents > 1:
                raise self.fail(line, "a second document (---): the file holds one")
        elif isinstance(event, yaml.AliasEvent):
            self._alias(event, line)
        elif isinstance(event, yaml.ScalarEvent):
            here = _dotted(self._child_path()) or "top level"
            snode = _scalar(event, self.resolver, line, here, self.fail)
            self._count(1, line, here)
            _anchor(event.anchor, snode, 1, 1, line, self.anchors, self.fail)
            self._attach(snode, 1, 1, line)
        elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            self._open(event, line)
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            done = self.stack.pop()
            done.node.end_mark = event.end_mark
            if done.anchor is not None:
                self.anchors[done.anchor] = (done.node, done.size, done.height, line)
            self._attach(done.node, done.size, done.height, done.node.start_mark.line + 1)

    def _alias(self, event: Any, line: int) -> None:
        here = _dotted(self._child_path()) or "top level"
        got = self.anchors.get(str(event.anchor))
        if got is None:
            raise self.fail(line, f"{here}: alias *{event.anchor} names no anchor before it")
        node, size, height, _ = got
        if size is None:
            raise self.fail(line, f"{here}: alias *{event.anchor} is inside the value it names")
        if len(self.stack) + height > self.max_depth:
            raise self.fail(
                line,
                f"{here}: alias *{event.anchor} nests values deeper than {self.max_depth} levels",
            )
        self._count(size, line, f"{here}: alias *{event.anchor}", alias=True)
        self._attach(node, size, height, line)

    def _open(self, event: Any, line: int) -> None:
        stack = self.stack
        here_path = self._child_path()
        here = _dotted(here_path) or "top level"
        if stack and isinstance(stack[-1].node, yaml.MappingNode) and stack[-1].key is None:
            raise self.fail(line, f"{here}: a key must be a plain value, not a list or mapping")
        if len(stack) + 1 > self.max_depth:
            raise self.fail(line, f"{here}: nested deeper than {self.max_depth} levels")
        self._count(1, line, here)
        cnode = _collection(event, self.resolver, line, here, self.fail)
        anchor = str(event.anchor) if event.anchor is not None else None
        if anchor is not None:
            _anchor(anchor, cnode, None, 1, line, self.anchors, self.fail)
        stack.append(_Open(cnode, here_path, anchor))

    def _child_path(self) -> tuple[str | int, ...]:
        if not self.stack:
            return ()
        top = self.stack[-1]
        if isinstance(top.node, yaml.SequenceNode):
            return (*top.path, len(top.node.value))
        if top.key is None:
            return top.path  # a key
        return (*top.path, str(top.key.value))

    def _count(self, size: int, line: int, what: str, alias: bool = False) -> None:
        self.total += size
        if self.total > self.max_values:
            raise self.fail(
                line,
                f"{what}: the document holds more than {self.max_values} values with every "
                "alias expanded" + (" (a YAML alias bomb?)" if alias else ""),
            )

    def _attach(self, node: yaml.Node, size: int, height: int, line: int) -> None:
        if not self.stack:
            self.root = node
            return
        top = self.stack[-1]
        top.size += size
        top.height = max(top.height, height + 1)
        if isinstance(top.node, yaml.SequenceNode):
            top.node.value.append(node)
            return
        if top.key is not None:
            top.node.value.append((top.key, node))
            top.key = None
            return
        self._key(top, node, line)

    def _key(self, top: _Open, node: yaml.Node, line: int) -> None:
        where = _dotted(top.path) or "top level"
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail(line, f"{where}: a key must be a plain value, not a list or mapping")
        if node.tag == _MERGE:
            raise self.fail(line, f"{where}: merge keys (<<) are not supported: write the keys out")
        name = str(node.value)
        first = top.keys.get(name)
        if first is not None:
            self.problems.append(
                (
                    line,
                    f"{_dotted((*top.path, name))}: duplicate key {shorten(name)}, first at "
                    f"{self.path}:{first} (each key once)",
                )
            )
        else:
            top.keys[name] = line
        top.key = node


def _scalar(event: Any, resolver: Any, line: int, here: str, fail: Any) -> yaml.ScalarNode:
    tag = event.tag
    if tag is None or tag == "!":
        tag = resolver.resolve(yaml.ScalarNode, event.value, event.implicit)
    if tag == _VALUE:
        tag = _TAG + "str"
    if tag not in SCALAR_TAGS and tag != _MERGE:
        raise fail(line, f"{here}: the tag {shorten(tag)} is not accepted (plain values only)")
    node = yaml.ScalarNode(tag, event.value, event.start_mark, event.end_mark, event.style)
    if tag in (_TAG + "int", _TAG + "float", _TAG + "bool"):
        try:
            scalar_value(node)
        except (ValueError, KeyError, OverflowError, yaml.YAMLError):
            raise fail(line, f"{here}: {shorten(event.value)} is not a valid number") from None
    return node


def _collection(event: Any, resolver: Any, line: int, here: str, fail: Any) -> yaml.Node:
    mapping = isinstance(event, yaml.MappingStartEvent)
    kind = yaml.MappingNode if mapping else yaml.SequenceNode
    tag = event.tag
    if tag is None or tag == "!":
        tag = resolver.resolve(kind, None, event.implicit)
    if tag != _TAG + ("map" if mapping else "seq"):
        raise fail(line, f"{here}: the tag {shorten(tag)} is not accepted (plain values only)")
    return kind(tag, [], event.start_mark, None, flow_style=event.flow_style)


def _anchor(
    name: Any,
    node: yaml.Node,
    size: int | None,
    height: int,
    line: int,
    anchors: dict[str, tuple[yaml.Node, int | None, int, int]],
    fail: Any,
) -> None:
    if name is None:
        return
    name = str(name)
    if name in anchors:
        raise fail(line, f"anchor &{name} defined twice (first at line {anchors[name][3]})")
    anchors[name] = (node, size, height, line)


_CONSTRUCT = yaml.constructor.SafeConstructor()  # its per-tag methods only: they keep nothing


def scalar_value(node: yaml.ScalarNode) -> Any:
    """The plain value of a scalar the reader accepted: str, int, float, bool or None.

    An implicit timestamp (``2024-01-01``) is kept as the text written: no
    value here is a date, and a date is never silently what a name meant.
    """
    tag = node.tag
    if tag == _TAG + "int":
        return _CONSTRUCT.construct_yaml_int(node)
    if tag == _TAG + "float":
        return _CONSTRUCT.construct_yaml_float(node)
    if tag == _TAG + "bool":
        return _CONSTRUCT.construct_yaml_bool(node)
    if tag == _TAG + "null":
        return None
    return str(node.value)


def _dotted(loc: tuple[str | int, ...]) -> str:
    """``units.a.cmd[0]``; a deep one cut in the middle."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out if len(out) <= 80 else out[:40] + "..." + out[-37:]
