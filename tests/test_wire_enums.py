"""The wire's operations and events, and a lease's state, as enums (hold.protocol.Op,
hold.protocol.Ev, hold.daemon.ledger.LeaseState): every operation has its handler
and reaches it at a real daemon, an unknown one is refused as it always was, a
member is written as its plain string, and a state.json written before the enums
still loads (and is written back the same).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, cast

import pytest
from conftest import daemon_pid, wait_for

from hold.client.connection import Client
from hold.daemon import ledger
from hold.daemon.ops import Ops
from hold.documents import LeaseState
from hold.protocol import Ev, LineBuffer, Message, Op, encode
from hold.statedir import open_state_dir
from hold_supervisor import jsonlines
from hold_supervisor.exitcodes import USAGE

# --------------------------------------------------------------------------
# The dispatch: one handler per operation.


def test_every_op_has_a_handler_and_nothing_else_does() -> None:
    none = cast(Any, None)  # the table is built from bound methods: no state is touched
    handlers = Ops(none, none, none).handlers
    assert set(handlers) == set(Op), set(Op) ^ set(handlers)
    assert all(callable(h) for h in handlers.values())


def _until(client: Client, *evs: Ev, timeout: float = 20.0) -> Message:
    """The next message whose event is one of ``evs`` (a grant's queue notes skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = client.recv(deadline)
        assert msg is not None, "the daemon closed the connection"
        if msg.get("ev") in evs:
            return msg
        assert msg.get("ev") in (Ev.QUEUED, Ev.WARNING), msg


def _refused(ans: Message, why: str) -> bool:
    """Refused by the operation's own handler (not as an unknown op)."""
    return ans.get("ev") == Ev.ERROR and why in str(ans.get("error"))


def test_every_op_reaches_its_handler_at_a_real_daemon() -> None:
    sd = open_state_dir()
    reached: set[Op] = set()
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    client = Client.connect(sd)
    try:
        ans = client.request({"op": Op.OPEN})
        assert ans["ev"] == Ev.SESSION and ans["session"], ans
        reached.add(Op.OPEN)

        for op, ev in ((Op.STATUS, Ev.STATUS), (Op.LEASES, Ev.LEASES)):
            ans = client.request({"op": op})
            assert ans["ev"] == ev, ans
            reached.add(op)
        ans = client.request({"op": Op.CHECK, "cls": "npu"})
        assert ans["ev"] == Ev.CHECK and ans["covered"] is False, ans
        reached.add(Op.CHECK)
        ans = client.request({"op": Op.REPORT, "since": 0})
        assert ans["ev"] == Ev.REPORT, ans
        reached.add(Op.REPORT)

        client.send({"op": Op.ACQUIRE, "cls": "npu", "label": "enums", "ttl": 60.0, "grace": 1.0})
        ans = _until(client, Ev.GRANTED, Ev.BUSY, Ev.ERROR)
        assert ans["ev"] == Ev.GRANTED and ans["devices"] == [0], ans
        reached.add(Op.ACQUIRE)
        lease_id = ans["lease"]
        ans = client.request({"op": Op.LEASES})
        assert [lease["lease"] for lease in ans["leases"]] == [lease_id], ans

        tree_id = os.urandom(6).hex()
        ans = client.request({"op": Op.TREE, "tree_id": tree_id, "leaf": None, "grace": 1.0})
        assert ans == {"ev": Ev.OK, "tree": tree_id}, ans
        reached.add(Op.TREE)
        # ROOT has no answer: what it did is in the saved state.
        client.send({"op": Op.ROOT, "tree_id": tree_id, "pid": child.pid})
        assert client.request({"op": Op.STATUS})["ev"] == Ev.STATUS

        def saved_root() -> Any:
            doc = json.loads(Path(sd.state).read_text())
            (s,) = doc["sessions"]
            assert s["lease"]["state"] == "active", s  # a LeaseState is saved as its string
            return s["trees"][0]["root_pid"] == child.pid

        wait_for(saved_root, 20, what="the tree's root in state.json")
        reached.add(Op.ROOT)

        ans = client.request({"op": Op.RELEASE, "lease": "0" * 16})
        assert _refused(ans, f"no live lease {'0' * 16}"), ans
        reached.add(Op.RELEASE)
        ans = client.request({"op": Op.ATTACH, "session": "0" * 16})
        assert _refused(ans, "to re-attach"), ans
        reached.add(Op.ATTACH)
        ans = client.request({"op": Op.RELOAD})
        assert ans["ev"] == Ev.RELOADED and ans["classes"]["npu"] == 1, ans
        reached.add(Op.RELOAD)

        client.send({"op": Op.END})
        assert child.wait(timeout=15) is not None  # its tree stopped (and reaped here)
        ans = _until(client, Ev.ENDED, Ev.ERROR)
        assert ans["ev"] == Ev.ENDED and ans["survivors"] == [], ans
        reached.add(Op.END)
    finally:
        client.close()
        if child.poll() is None:
            child.kill()
            child.wait()

    pid = daemon_pid(Path(sd.path))
    assert pid is not None
    client = Client.connect(sd, autostart=False)
    try:
        ans = client.request({"op": Op.RETIRE})
        assert ans == {"ev": Ev.RETIRING, "pid": pid}, ans
        reached.add(Op.RETIRE)
    finally:
        client.close()
    wait_for(lambda: daemon_pid(Path(sd.path)) is None, 10, what="the retired daemon gone")
    assert reached == set(Op), set(Op) - reached


@pytest.mark.parametrize(
    ("op", "shown"),
    [("bogus", "'bogus'"), ("OPEN", "'OPEN'"), (None, "None"), (7, "7"), (["open"], "['open']")],
)
def test_an_unknown_op_is_refused_as_before(op: Any, shown: str) -> None:
    client = Client.connect(open_state_dir())
    try:
        msg: Message = {"cls": "npu"} if op is None else {"op": op}
        ans = client.request(msg)
        assert ans == {"ev": "error", "code": USAGE, "error": f"unknown op {shown}"}, ans
        assert client.request({"op": "status"})["ev"] == "status"  # the connection goes on
    finally:
        client.close()


# --------------------------------------------------------------------------
# On the wire and on disk, a member is its string.


@pytest.mark.parametrize("member", [*Op, *Ev, *LeaseState], ids=repr)
def test_a_member_is_written_as_its_string(member: Op | Ev | LeaseState) -> None:
    plain = member.value
    assert type(plain) is str and member == plain
    assert jsonlines.dumps_line(member) == jsonlines.dumps_line(plain) == f'"{plain}"\n'.encode()
    assert encode({"ev": member}) == encode({"ev": plain})
    assert json.dumps({"s": member}, sort_keys=True) == json.dumps({"s": plain}, sort_keys=True)
    (back,) = LineBuffer().feed(encode({"ev": member}))
    assert type(back["ev"]) is str and back["ev"] == member


def test_the_wire_names_are_unchanged() -> None:
    """The strings other clients (and older ones) send and read: none renamed."""
    assert [str(op) for op in Op] == [
        "open",
        "attach",
        "acquire",
        "tree",
        "root",
        "status",
        "release",
        "end",
        "leases",
        "check",
        "retire",
        "reload",
        "report",
    ]
    assert {str(ev) for ev in Ev} == {
        "session",
        "attached",
        "queued",
        "warning",
        "granted",
        "busy",
        "expired",
        "released",
        "ended",
        "ok",
        "status",
        "leases",
        "check",
        "retiring",
        "reloaded",
        "report",
        "error",
    }
    assert [str(s) for s in LeaseState] == ["active", "expired", "ending"]


# A state.json as the daemon wrote it before the enums (literal, not generated).
OLD_STATE = """{"sessions": [{"lease": {"cls": "npu", "devices": [0], "expires": 1700003600.5,
"grace": 10.0, "granted": 1700000000.25, "label": "train", "lease_id": "0123456789abcdef",
"private": false, "state": "expired"}, "owner_pid": 4242, "owner_start": 987654,
"session_id": "fedcba9876543210", "trees": [{"grace": 10.0, "leaf": null, "pgid": 4243,
"root_pid": 4243, "root_start": 987700, "sid": 4243, "since": 987650,
"tree_id": "aabbccddeeff"}], "uid": 1000, "user": "someone"}, {"lease": {"cls": "gpu",
"devices": [0], "expires": 1700007200.0, "grace": 5.0, "granted": 1700000100.0,
"label": "eval", "lease_id": "1111222233334444", "private": true, "state": "ending"},
"owner_pid": 4300, "owner_start": 987800, "session_id": "5555666677778888", "trees": [],
"uid": 1001, "user": "other"}], "version": 1}"""


def test_an_old_state_file_loads_and_is_written_back_the_same(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text(OLD_STATE)
    old.chmod(0o600)
    sessions = ledger.load(str(old))
    states = [s.lease.state for s in sessions if s.lease is not None]
    assert states == [LeaseState.EXPIRED, LeaseState.ENDING]
    assert all(type(state) is LeaseState for state in states)
    assert states == ["expired", "ending"]  # and still equal to the strings
    new = tmp_path / "new.json"
    ledger.save(str(new), sessions)
    # Written back as this version's document: the same sessions, now with a kind.
    written = json.loads(new.read_text())
    assert (written.pop("kind"), written.pop("version")) == ("state", 2)
    assert written == {k: v for k, v in json.loads(OLD_STATE).items() if k != "version"}
    assert '"state":"expired"' in new.read_text()


def test_a_lease_without_a_state_is_active_and_an_unknown_one_is_refused(tmp_path: Path) -> None:
    doc = json.loads(OLD_STATE)
    del doc["sessions"][0]["lease"]["state"]
    path = tmp_path / "state.json"
    path.write_text(json.dumps(doc))
    path.chmod(0o600)
    lease = ledger.load(str(path))[0].lease
    assert lease is not None and lease.state is LeaseState.ACTIVE
    doc["sessions"][0]["lease"]["state"] = "gone"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"state.json: .*'state' must be one of .*'gone'"):
        ledger.load(str(path))


# --------------------------------------------------------------------------
# Both wires (the daemon's, a stack's control socket) spelled through their enums.


def test_no_op_or_event_is_written_as_a_bare_string() -> None:
    """A message built in the code names its ``"op"`` and ``"ev"`` by an enum member
    (hold.protocol.Op/Ev, hold_supervisor.stack.wire.StackOp/StackEv), never a
    string literal: a typo is then an AttributeError, not a silent new word."""
    import ast

    root = Path(__file__).resolve().parent.parent
    bare = []
    for folder in ("hold", "supervisor"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Dict):
                    continue
                for k, v in zip(node.keys, node.values, strict=True):
                    if (
                        isinstance(k, ast.Constant)
                        and k.value in ("op", "ev")
                        and isinstance(v, ast.Constant)
                        and isinstance(v.value, str)
                    ):
                        bare.append(
                            f"{path.relative_to(root)}:{node.lineno}: {k.value}={v.value!r}"
                        )
    assert not bare, "\n".join(bare)


def test_the_stack_words_are_their_strings() -> None:
    from hold_supervisor.stack.wire import StackEv, StackOp

    assert json.dumps({"op": StackOp.CANCEL, "ev": StackEv.STOPPED}) == (
        '{"op": "cancel", "ev": "stopped"}'
    )
    assert len(set(StackOp)) == len(StackOp) and len(set(StackEv)) == len(StackEv)
