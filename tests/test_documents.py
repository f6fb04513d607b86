"""Every JSON file we write is a typed, versioned document (hold_supervisor.documents,
hold.documents): each round-trips; a wrong kind, a newer version, a field of the
wrong type, an oversize file and a key given twice are refused, the file named;
and a file of the code before the documents (no kind, no version) is still read."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hold.documents import (
    BadDocument,
    EndedLease,
    EndedLeases,
    HistoryLease,
    HistoryStray,
    LeaseEnd,
    LeaseEntry,
    LeaseState,
    LedgerState,
    LockRecord,
    SessionEntry,
    TokenFile,
    TreeEntry,
    UpHandOver,
    UpStatus,
)
from hold.leases import LeaseRecord
from hold_supervisor.documents import (
    CallRecord,
    Document,
    RunRecord,
    StackRecord,
    StackRunState,
)

WHERE = "/somewhere/the.file"

RECORD = LeaseRecord(
    "abcd1234",
    "npu",
    (0, 1),
    "train",
    4242,
    99,
    1000,
    "alice",
    100.0,
    200.0,
    4243,
    ("/sys/fs/cgroup/x",),
    ("t1",),
    ((4243, 100),),
)
TREE = TreeEntry("t1", "/sys/fs/cgroup/x", 5, 10.0, 4243, 100, 4243, 4243)
LEASE = LeaseEntry("abcd1234", "npu", (0,), "train", 100.0, 200.0, 5.0, LeaseState.EXPIRED, True)

SAMPLES: list[Document] = [
    StackRecord("demo", 1, "/x/stack.yaml", 10.0, StackRunState.RUNNING),
    StackRecord("demo", 1, "/x/stack.yaml", 10.0, StackRunState.STOPPED, 3, "unit failed"),
    CallRecord(
        1.5,
        "2025-01-01T00:00:00.000",
        "c1",
        "job",
        "ab" * 32,
        "exited",
        0,
        0.25,
        0.0,
        77,
        "0-1",
        ("1 (leaf): sleep",),
        "why",
    ),
    RunRecord(1.5, "2025-01-01T00:00:00.000", "demo", 1),
    TokenFile("npu-hold train pid 4242 Mon Jan 01 00:00:00 UTC 2025", RECORD),
    LockRecord(1000, "alice", 4242, 99, 100.0, 200.0, "abcd1234", "npu", "/run/hold", 7, "x"),
    LockRecord(1000, "alice", 4242, 99, 100.0, 200.0, "abcd1234", "npu", "/run/hold", 7),
    EndedLeases((EndedLease(RECORD, 300.0), EndedLease(RECORD._replace(label=None), 301.0))),
    HistoryLease(
        "abcd1234",
        "alice",
        1000,
        "npu",
        (0, 1),
        "train",
        False,
        90.0,
        100.0,
        200.0,
        LeaseEnd.RELEASED,
        "bob",
        12.5,
        3.25,
        1 << 30,
    ),
    HistoryStray("npu", 0, 77, 1000, "alice", "python x.py", None, 150.0, "abcd1234"),
    LedgerState((SessionEntry("s1", 4242, 99, 1000, "alice", LEASE, (TREE,), "/sys/x"),)),
    LedgerState(()),
    UpHandOver({"name": "demo", "units": {}}, "auto", "f00d", ("npu", (0, 1)), 3.0),
    UpHandOver({"name": "demo"}, "off", None, ("npu", None), None),
    UpStatus(line="starting"),
    UpStatus(ready=True),
]


def _ids(doc: Document) -> str:
    return type(doc).__name__


@pytest.mark.parametrize("doc", SAMPLES, ids=_ids)
def test_each_document_round_trips_with_its_kind_and_version(doc: Document) -> None:
    data = doc.encode()
    assert type(doc).decode(data, WHERE) == doc
    body = json.loads(data.split(b"\n")[1] if isinstance(doc, TokenFile) else data)
    assert body["kind"] == type(doc).KIND and body["version"] == type(doc).VERSION


def _json_of(doc: Document) -> dict[str, Any]:
    return doc.to_json()


def _bytes(doc: Document, obj: dict[str, Any] | str) -> bytes:
    """``obj`` as the file of ``doc``'s type would hold it (a token file: after its line)."""
    text = obj if isinstance(obj, str) else json.dumps(obj)
    return (b"line\n" if isinstance(doc, TokenFile) else b"") + text.encode()


@pytest.mark.parametrize("doc", SAMPLES, ids=_ids)
def test_a_wrong_kind_is_refused_naming_the_file_and_what_is_accepted(doc: Document) -> None:
    obj = {**_json_of(doc), "kind": "something-else"}
    with pytest.raises(BadDocument, match="something-else") as e:
        type(doc).decode(_bytes(doc, obj), WHERE)
    assert str(e.value).startswith(WHERE) and f"{type(doc).KIND!r} document" in str(e.value)


@pytest.mark.parametrize("doc", SAMPLES, ids=_ids)
def test_a_newer_version_is_refused(doc: Document) -> None:
    obj = {**_json_of(doc), "version": type(doc).VERSION + 1}
    with pytest.raises(BadDocument, match="newer than this hold reads") as e:
        type(doc).decode(_bytes(doc, obj), WHERE)
    assert str(e.value).startswith(WHERE)


@pytest.mark.parametrize("doc", SAMPLES, ids=_ids)
def test_a_field_of_the_wrong_type_is_refused(doc: Document) -> None:
    obj = _json_of(doc)
    # The first field that is a string or number, given as a list.
    name = next(k for k, v in obj.items() if k not in ("kind", "version") and v is not None)
    obj[name] = [obj[name]] if not isinstance(obj[name], list) else "text"
    with pytest.raises(BadDocument) as e:
        type(doc).decode(_bytes(doc, obj), WHERE)
    assert str(e.value).startswith(WHERE) and repr(name) in str(e.value)


@pytest.mark.parametrize("doc", SAMPLES, ids=_ids)
def test_a_key_given_twice_is_refused(doc: Document) -> None:
    text = json.dumps(_json_of(doc))
    assert text.endswith("}")
    with pytest.raises(BadDocument, match="given twice") as e:
        type(doc).decode(_bytes(doc, text[:-1] + ', "kind": "x"}'), WHERE)
    assert str(e.value).startswith(WHERE)


@pytest.mark.parametrize("doc", SAMPLES, ids=_ids)
def test_an_oversize_file_is_refused_before_it_is_parsed(doc: Document) -> None:
    obj = {**_json_of(doc), "padding": "x" * type(doc).MAX_SIZE}
    with pytest.raises(BadDocument, match=f"more than {type(doc).MAX_SIZE}") as e:
        type(doc).decode(_bytes(doc, obj), WHERE)
    assert str(e.value).startswith(WHERE)


def test_nan_and_depth_are_refused() -> None:
    lock = SAMPLES[5]
    assert isinstance(lock, LockRecord)
    text = json.dumps(lock.to_json()).replace('"since": 100.0', '"since": NaN')
    with pytest.raises(BadDocument, match="NaN is not a JSON number"):
        LockRecord.decode(text.encode(), WHERE)
    deep = {**lock.to_json(), "extra": [[[]]]}
    with pytest.raises(BadDocument, match="nested more than 2 deep"):
        LockRecord.decode(json.dumps(deep).encode(), WHERE)
    for garbage in (b"\xff\xfe", b"", b"[]", b"null", b"\x00" * 10):
        with pytest.raises(BadDocument):
            LockRecord.decode(garbage, WHERE)


def test_an_unknown_field_is_ignored_and_a_state_must_be_known() -> None:
    obj = {**SAMPLES[0].to_json(), "added_later": 1}
    assert StackRecord.decode(json.dumps(obj).encode(), WHERE) == SAMPLES[0]
    obj["state"] = "sleeping"
    with pytest.raises(BadDocument, match="'state' must be one of 'running', 'stopped'"):
        StackRecord.decode(json.dumps(obj).encode(), WHERE)


# ------------------------------------------------------- what the code before wrote

OLD_TOKEN = (
    b"npu-hold train pid 4242 Mon Jan 01 00:00:00 UTC 2025\n"
    b'{"cls": "npu", "command_pid": 4243, "devices": [0, 1], "expires": 200.0, '
    b'"granted": 100.0, "holder_pid": 4242, "holder_start": 99, "label": "train", '
    b'"lease": "abcd1234", "leaves": ["/sys/fs/cgroup/x"], "roots": [[4243, 100]], '
    b'"trees": ["t1"], "uid": 1000, "user": "alice"}\n'
)
OLD_LOCK = (
    b'{"arbiter": "/run/hold", "cls": "npu", "daemon_pid": 7, "label": "x", '
    b'"lease": "abcd1234", "pid": 4242, "since": 100.0, "start": 99, "uid": 1000, '
    b'"until": 200.0, "user": "alice"}\n'
)
OLD_HISTORY_LEASE = (
    b'{"by":"bob","cls":"npu","cpu_s":3.25,"devices":[0,1],"end":"released","ended":200.0,'
    b'"granted":100.0,"held":12.5,"kind":"lease","label":"train","lease":"abcd1234",'
    b'"peak_bytes":1073741824,"private":false,"requested":90.0,"uid":1000,"user":"alice"}'
)
OLDER_HISTORY_LEASE = (  # before cpu_s and peak_bytes were recorded
    b'{"by":null,"cls":"npu","devices":[0],"end":"ended","ended":200.0,"granted":100.0,'
    b'"held":null,"kind":"lease","label":"l","lease":"ab","private":false,'
    b'"requested":null,"uid":0,"user":"root"}'
)
OLD_HISTORY_STRAY = (
    b'{"cls":"npu","command":"python x.py","device":0,"kind":"stray","lease":"abcd1234",'
    b'"memory_bytes":null,"pid":77,"seen":150.0,"uid":1000,"user":"alice"}'
)
OLD_STATE = (
    b'{"sessions": [{"lease": {"cls": "npu", "devices": [0], "expires": 200.0, '
    b'"grace": 5.0, "granted": 100.0, "label": "train", "lease_id": "abcd1234", '
    b'"private": true, "state": "expired"}, "owner_cgroup": "/sys/x", "owner_pid": 4242, '
    b'"owner_start": 99, "session_id": "s1", "trees": [{"grace": 10.0, '
    b'"leaf": "/sys/fs/cgroup/x", "pgid": 4243, "root_pid": 4243, "root_start": 100, '
    b'"sid": 4243, "since": 5, "tree_id": "t1"}], "uid": 1000, "user": "alice"}], '
    b'"version": 1}'
)
OLD_STACK = (
    b'{"name": "demo", "pid": 1, "file": "/x/stack.yaml", "started": 10.0, '
    b'"state": "stopped", "code": 3, "cause": "unit failed"}'
)
OLD_CALL = (
    b'{"args_sha256": "' + b"ab" * 32 + b'", "call": "c1", "cpus": "0-1", "detail": "why", '
    b'"exit": 0, "outcome": "exited", "pid": 77, "queued_s": 0.0, '
    b'"survivors": ["1 (leaf): sleep"], "time": 1.5, "ts": "2025-01-01T00:00:00.000", '
    b'"unit": "job", "wall_s": 0.25}'
)
OLD_RUN = (
    b'{"pid": 1, "run": "begins", "stack": "demo", "time": 1.5, "ts": "2025-01-01T00:00:00.000"}'
)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (OLD_TOKEN, SAMPLES[4]),
        (OLD_LOCK, SAMPLES[5]),
        (OLD_HISTORY_LEASE, SAMPLES[8]),
        (OLD_HISTORY_STRAY, SAMPLES[9]),
        (OLD_STATE, SAMPLES[10]),
        (OLD_STACK, SAMPLES[1]),
        (OLD_CALL, SAMPLES[2]),
        (OLD_RUN, SAMPLES[3]),
    ],
    ids=["token", "lock", "history-lease", "history-stray", "state", "stack", "call", "run"],
)
def test_a_file_of_the_code_before_is_read_as_its_legacy_version(
    data: bytes, expected: Document
) -> None:
    assert type(expected).decode(data, WHERE) == expected


def test_an_old_ended_json_a_bare_list_is_read() -> None:
    old = [{**RECORD.to_json(), "ended": 300.0}]
    doc = EndedLeases.decode(json.dumps(old).encode(), WHERE)
    assert doc == EndedLeases((EndedLease(RECORD, 300.0),))


def test_older_history_lines_without_figures_are_read() -> None:
    doc = HistoryLease.decode(OLDER_HISTORY_LEASE, WHERE)
    assert doc.cpu_s is None and doc.peak_bytes is None and doc.end is LeaseEnd.ENDED


def test_a_legacy_file_of_another_kind_is_refused() -> None:
    with pytest.raises(BadDocument, match="kind 'stray'"):
        HistoryLease.decode(OLD_HISTORY_STRAY, WHERE)
    # The pipes of hold up --detach join one installation: nothing legacy there.
    with pytest.raises(BadDocument, match="'up' document"):
        UpHandOver.decode(b'{"spec": {}, "cgroups": "auto"}', WHERE)


def test_a_lock_record_keeps_its_text_short_and_refuses_huge_numbers() -> None:
    obj = {**SAMPLES[5].to_json(), "user": "u" * 1000}
    assert LockRecord.decode(json.dumps(obj).encode(), WHERE).user == "u" * 200
    obj["pid"] = 1 << 70
    with pytest.raises(BadDocument, match="'pid' is beyond 64 bits"):
        LockRecord.decode(json.dumps(obj).encode(), WHERE)
