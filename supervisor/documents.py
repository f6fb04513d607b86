"""Every JSON file the project writes: one typed, versioned document per file, one way to read it.

The mechanism is here, with the documents of the supervisor (``stack.json``, a
task unit's call and run records); :mod:`hold.documents` holds ``hold``'s (token
files, lock records, ``ended.json``, ``history.jsonl``, ``state.json``, the
hand-over of ``hold up --detach``) on the same mechanism. Two modules, because
``hold_supervisor`` never imports ``hold`` and ``hold``'s documents are made of
its own types (a :class:`hold.leases.LeaseRecord`); one mechanism, so every file
is written and refused alike. The wire (:mod:`hold.protocol`, a stack's control
socket) is not a document: its messages carry ``op``/``ev``, not a kind.

A document is a frozen dataclass deriving from :class:`Document`: its class says
its ``KIND`` and ``VERSION``, both written into the file, :meth:`Document.body`
gives its fields and :meth:`Document.from_fields` reads them back, each field
strictly through :class:`Fields`. :meth:`Document.encode` gives the bytes;
:meth:`Document.decode` takes bytes and the file's name and gives the document,
or raises :class:`BadDocument` naming the file and what is accepted: the bytes
are decoded by :func:`hold_supervisor.jsonlines.strict_loads` (UTF-8, nesting
limited, no duplicate key, no ``NaN``) after a size check, then the kind, the
version and every field are checked. A field this version does not know is
ignored (a newer writer may add one without a new version); a missing or
mistyped one is refused.

Files that outlive an upgrade: a document class with ``LEGACY`` set reads a
file of the code before this module -- no ``kind``, no ``version``, or neither
-- as that version (:meth:`Document.legacy` shapes one that was not an object).
:meth:`Document.read` opens a file the one way (:mod:`hold_supervisor.safefile`:
no link followed, never a FIFO, at most ``MAX_SIZE`` bytes read); a reader with
an opening of its own (a lock file, opened ``O_NOFOLLOW | O_NONBLOCK`` and read
with ``pread``) decodes its bytes with :meth:`Document.decode`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Self, TypeVar

from hold_supervisor import jsonlines
from hold_supervisor.errors import SupervisorError
from hold_supervisor.exitcodes import USAGE

E = TypeVar("E", bound=StrEnum)


class BadDocument(SupervisorError, ValueError):
    """A file that is not the document it should be; the message names the file,
    what is wrong and what is accepted."""

    exit_code = USAGE


def _short(value: object, limit: int = 60) -> str:
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class Fields:
    """A document's fields as decoded, each read with its type checked: a field
    missing or of another type is a :class:`BadDocument` naming the file, the
    field and the type wanted."""

    __slots__ = ("_obj", "where")

    def __init__(self, obj: dict[str, Any], where: str) -> None:
        self._obj = obj
        self.where = where

    def _bad(self, name: str, wanted: str) -> BadDocument:
        got = self._obj.get(name, None)
        said = "missing" if name not in self._obj else f"{_short(got)}"
        return BadDocument(f"{self.where}: field {name!r} must be {wanted} (got {said})")

    def has(self, name: str) -> bool:
        return name in self._obj

    def text(self, name: str) -> str:
        v = self._obj.get(name)
        if not isinstance(v, str):
            raise self._bad(name, "a string")
        return v

    def opt_text(self, name: str) -> str | None:
        v = self._obj.get(name)
        if v is not None and not isinstance(v, str):
            raise self._bad(name, "a string or null")
        return v

    def integer(self, name: str) -> int:
        v = self._obj.get(name)
        if not _is_int(v):
            raise self._bad(name, "an integer")
        assert isinstance(v, int)
        return v

    def opt_integer(self, name: str) -> int | None:
        v = self._obj.get(name)
        if v is not None and not _is_int(v):
            raise self._bad(name, "an integer or null")
        return v

    def number(self, name: str) -> float:
        v = self._obj.get(name)
        if not (_is_int(v) or isinstance(v, float)):
            raise self._bad(name, "a number")
        assert isinstance(v, int | float)
        return float(v)

    def opt_number(self, name: str) -> float | None:
        return None if self._obj.get(name) is None else self.number(name)

    def flag(self, name: str, default: bool | None = None) -> bool:
        v = self._obj.get(name, default)
        if not isinstance(v, bool):
            raise self._bad(name, "true or false")
        return v

    def choice(self, name: str, enum: type[E]) -> E:
        """A state stored as its string: one of ``enum``'s members."""
        v = self._obj.get(name)
        try:
            return enum(v) if isinstance(v, str) else enum("\0")
        except ValueError:
            raise self._bad(name, "one of " + ", ".join(repr(m.value) for m in enum)) from None

    def texts(self, name: str) -> tuple[str, ...]:
        v = self._obj.get(name)
        if not isinstance(v, list) or not all(isinstance(i, str) for i in v):
            raise self._bad(name, "a list of strings")
        return tuple(v)

    def integers(self, name: str) -> tuple[int, ...]:
        v = self._obj.get(name)
        if not isinstance(v, list) or not all(_is_int(i) for i in v):
            raise self._bad(name, "a list of integers")
        return tuple(v)

    def obj(self, name: str) -> dict[str, Any]:
        """A nested object, as it is (for a type with its own reader)."""
        v = self._obj.get(name)
        if not isinstance(v, dict):
            raise self._bad(name, "an object")
        return v

    def objects(self, name: str) -> list[Fields]:
        """A list of objects, each read as fields of this file."""
        v = self._obj.get(name)
        if not isinstance(v, list) or not all(isinstance(i, dict) for i in v):
            raise self._bad(name, "a list of objects")
        return [Fields(i, f"{self.where}: {name}[{n}]") for n, i in enumerate(v)]

    def nested(self, name: str) -> Fields | None:
        """A nested object (or null) read as fields of this file."""
        v = self._obj.get(name)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self._bad(name, "an object or null")
        return Fields(v, f"{self.where}: {name}")

    def whole(self) -> dict[str, Any]:
        """Every field as decoded (for a reader of its own, e.g. a record of the wire)."""
        return self._obj


@dataclass(frozen=True, slots=True)
class Document:
    """The base of every document: a kind and a version, written into the file."""

    KIND: ClassVar[str]
    VERSION: ClassVar[int]
    OLDEST: ClassVar[int | None] = None  # the oldest version still read (None: VERSION only)
    # The version that a file written before this module (no "kind", no
    # "version", or neither) is read as; None: such a file is refused.
    LEGACY: ClassVar[int | None] = None
    MAX_SIZE: ClassVar[int] = jsonlines.MAX_LINE
    MAX_DEPTH: ClassVar[int] = jsonlines.MAX_DEPTH

    def body(self) -> dict[str, Any]:
        """The document's fields as JSON values (without kind and version)."""
        raise NotImplementedError

    @classmethod
    def from_fields(cls, f: Fields, version: int) -> Self:
        """The document from its fields; :class:`BadDocument` (through ``f``) if one is wrong."""
        raise NotImplementedError

    @classmethod
    def legacy(cls, value: Any) -> dict[str, Any] | None:
        """A legacy file's value that is not an object, as this document's fields; None: refused."""
        return None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.KIND, "version": self.VERSION, **self.body()}

    def encode(self) -> bytes:
        """The document as one line of compact UTF-8 JSON, with its newline."""
        return jsonlines.dumps_line(self.to_json())

    def text(self) -> str:
        """The document as one line of a text log (:meth:`encode`'s, without its newline)."""
        return self.encode()[:-1].decode("utf-8")

    @classmethod
    def accepted(cls) -> str:
        oldest = cls.OLDEST if cls.OLDEST is not None else cls.VERSION
        if cls.LEGACY is not None:
            oldest = min(oldest, cls.LEGACY)
        versions = (
            f"version {cls.VERSION}"
            if oldest == cls.VERSION
            else (f"versions {oldest} to {cls.VERSION}")
        )
        return f"a {cls.KIND!r} document, {versions}"

    @classmethod
    def decode(cls, data: bytes, where: str) -> Self:
        """The document in ``data`` (the bytes of the file ``where``); :class:`BadDocument`."""
        return cls.from_value(cls.parse(data, where), where)

    @classmethod
    def parse(cls, data: bytes, where: str) -> Any:
        """The JSON value in ``data``, within this document's limits; :class:`BadDocument`."""
        if len(data) > cls.MAX_SIZE:
            raise BadDocument(
                f"{where}: {len(data)} bytes, more than {cls.MAX_SIZE} (accepted: {cls.accepted()})"
            )
        try:
            value = jsonlines.strict_loads(data, max_depth=cls.MAX_DEPTH)
        except jsonlines.BadJSON as e:
            raise BadDocument(f"{where}: {e} (accepted: {cls.accepted()})") from None
        return value

    @classmethod
    def read(cls, path: str, *, owned: bool = True) -> Self:
        """The document in the file ``path``: opened through
        :func:`hold_supervisor.safefile.open_for_read` (no link followed, never a
        FIFO; ``owned``: ours, one link), at most :data:`MAX_SIZE` bytes read.
        ``FileNotFoundError``, ``OSError``, ``UnsafePath`` or :class:`BadDocument`."""
        # lazy: safefile (fcntl) only to read one; off hold down NAME's path and before up's fork
        from hold_supervisor.safefile import open_for_read

        with os.fdopen(open_for_read(path, owned=owned), "rb") as f:
            data = f.read(cls.MAX_SIZE + 1)
        return cls.decode(data, path)

    @classmethod
    def from_value(cls, value: Any, where: str) -> Self:
        """The document from a decoded JSON value (a line already parsed, an element)."""
        if not isinstance(value, dict):
            fields = cls.legacy(value) if cls.LEGACY is not None else None
            if fields is None:
                raise BadDocument(f"{where}: not a JSON object (accepted: {cls.accepted()})")
            return cls.from_fields(Fields(fields, where), cls.LEGACY or 0)
        kind = value.get("kind")
        version = value.get("version")
        if cls.LEGACY is not None and (kind is None or version is None):
            # Written before this module: read as LEGACY (a kind, where one was
            # written then, must still be this one's).
            if kind not in (None, cls.KIND) or version not in (None, cls.LEGACY):
                raise BadDocument(
                    f"{where}: kind {_short(kind)}, version {_short(version)} "
                    f"(accepted: {cls.accepted()})"
                )
            return cls.from_fields(Fields(value, where), cls.LEGACY)
        if kind != cls.KIND:
            raise BadDocument(
                f"{where}: a document of kind {_short(kind)} (accepted: {cls.accepted()})"
            )
        oldest = cls.OLDEST if cls.OLDEST is not None else cls.VERSION
        if not isinstance(version, int) or isinstance(version, bool) or version < oldest:
            raise BadDocument(
                f"{where}: {cls.KIND} version {_short(version)} is not one this hold reads "
                f"(accepted: {cls.accepted()})"
            )
        if version > cls.VERSION:
            raise BadDocument(
                f"{where}: {cls.KIND} version {version} is newer than this hold reads "
                f"(accepted: {cls.accepted()}): written by a newer hold?"
            )
        return cls.from_fields(Fields(value, where), version)


# ---------------------------------------------------------------------- the supervisor's


class StackRunState(StrEnum):
    """Where a stack's run stands, as ``stack.json`` says it."""

    RUNNING = "running"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class StackRecord(Document):
    """``stack.json`` in a stack's run directory: who runs the stack, from which
    file, and how it ended (``code`` and ``cause`` once stopped)."""

    KIND = "stack"
    VERSION = 1
    LEGACY = 0  # a running stack's file, written before kinds and versions

    name: str
    pid: int
    file: str
    started: float
    state: StackRunState
    code: int | None = None
    cause: str | None = None

    def body(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": self.name,
            "pid": self.pid,
            "file": self.file,
            "started": self.started,
            "state": self.state.value,
        }
        if self.state is StackRunState.STOPPED:
            doc.update(code=self.code, cause=self.cause)
        return doc

    @classmethod
    def from_fields(cls, f: Fields, version: int) -> Self:
        return cls(
            f.text("name"),
            f.integer("pid"),
            f.text("file"),
            f.number("started"),
            f.choice("state", StackRunState),
            f.opt_integer("code"),
            f.opt_text("cause"),
        )


@dataclass(frozen=True, slots=True)
class CallRecord(Document):
    """A task unit's call, as its line in the unit's log (no stdout or stderr:
    they may be large or secret). ``ts`` is the time as the units' logs write it."""

    KIND = "call"
    VERSION = 1
    LEGACY = 0  # a log line written before kinds and versions

    time: float
    ts: str
    call: str
    unit: str
    args_sha256: str
    outcome: str
    exit: int | None
    wall_s: float
    queued_s: float
    pid: int | None
    cpus: str
    survivors: tuple[str, ...]
    detail: str | None = None

    def body(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "time": self.time,
            "ts": self.ts,
            "call": self.call,
            "unit": self.unit,
            "args_sha256": self.args_sha256,
            "outcome": self.outcome,
            "exit": self.exit,
            "wall_s": self.wall_s,
            "queued_s": self.queued_s,
            "pid": self.pid,
            "cpus": self.cpus,
            "survivors": list(self.survivors),
        }
        if self.detail:
            doc["detail"] = self.detail
        return doc

    @classmethod
    def from_fields(cls, f: Fields, version: int) -> Self:
        return cls(
            f.number("time"),
            f.text("ts"),
            f.text("call"),
            f.text("unit"),
            f.text("args_sha256"),
            f.text("outcome"),
            f.opt_integer("exit"),
            f.number("wall_s"),
            f.number("queued_s"),
            f.opt_integer("pid"),
            f.text("cpus"),
            f.texts("survivors"),
            f.opt_text("detail"),
        )


@dataclass(frozen=True, slots=True)
class RunRecord(Document):
    """The line a task unit's log gets when a run of its stack begins."""

    KIND = "run"
    VERSION = 1
    LEGACY = 0

    time: float
    ts: str
    stack: str
    pid: int

    def body(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "ts": self.ts,
            "run": "begins",
            "stack": self.stack,
            "pid": self.pid,
        }

    @classmethod
    def from_fields(cls, f: Fields, version: int) -> Self:
        return cls(f.number("time"), f.text("ts"), f.text("stack"), f.integer("pid"))
