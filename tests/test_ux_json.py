"""Every JSON document for scripts is versioned and free of the wire's framing (issue 14).

``hold check --json``, ``hold status --json``, ``hold audit --json`` and
``hold call --json``, each through the real ``hold`` against the test's own
daemon (conftest), each held to a small schema: the keys it must have and
their types, ``"version": 1``, and none of the protocol's own fields (``ev``,
``done``) anywhere in it. (``ps``, ``logs`` and ``validate`` have theirs in
their own tests.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import HOLD, update_config
from test_audit import DOC_TYPES, ROW_TYPES

Types = dict[str, tuple[type, ...]]
NONE = type(None)
INSIDE = [
    "--pass-env",
    "HOLD_STATE_DIR",
    "--pass-env",
    "HOLD_CONFIG",
    "--pass-env",
    "HOLD_LOCK_DIR",
]
CHECK: Types = {
    "version": (int,),
    "ok": (bool,),
    "device": (str,),
    "why": (str,),
    "lease": (dict, NONE),
}
CHECK_LEASE: Types = {
    "id": (str,),
    "class": (str,),
    "devices": (list,),
    "label": (str, NONE),
    "user": (str,),
    "holder_pid": (int,),
    "granted": (int, float),
    "expires": (int, float),
}
STATUS: Types = {"version": (int,), "arbiter": (dict,), "classes": (dict,)}
ARBITER: Types = {"kind": (str,), "pid": (int,), "state_dir": (str,)}
HOLDER: Types = {
    "lease": (str,),
    "label": (str, NONE),
    "pid": (int,),
    "user": (str,),
    "since": (int, float),
    "expires": (int, float),
    "state": (str,),
}
CALL: Types = {
    "version": (int,),
    "call": (str,),
    "unit": (str,),
    "stack": (str,),
    "outcome": (str,),
    "exit": (int,),
    "returncode": (int, NONE),
    "stdout": (str,),
    "wall_s": (int, float),
}


def conforms(doc: Any, types: Types, *, top: bool = False) -> None:
    """``doc`` has every key of ``types``, each of its types; at the top, version 1."""
    assert isinstance(doc, dict), doc
    for key, accepted in types.items():
        assert key in doc, f"{key!r} missing from {sorted(doc)}"
        assert isinstance(doc[key], accepted), f"{key}: {doc[key]!r} is not {accepted}"
    if top:
        assert doc["version"] == 1
        assert not framing(doc), f"protocol fields in the document: {framing(doc)}"


def framing(doc: Any, path: str = "") -> list[str]:
    """Where the wire's own fields (``ev``, ``done``) occur in ``doc``."""
    if isinstance(doc, dict):
        found = [f"{path}.{k}" for k in doc if k in ("ev", "done")]
        return found + [p for k, v in doc.items() for p in framing(v, f"{path}.{k}")]
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in framing(v, f"{path}[{i}]")]
    return []


def hold(*args: str, inside: bool = False) -> tuple[int, Any]:
    """``hold ARGS`` (``inside``: inside an npu lease), its exit status and its JSON."""
    argv = [*HOLD, *args]
    if inside:
        argv = [*HOLD, "run", "--device", "npu", *INSIDE, "--", *argv]
    res = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    try:
        return res.returncode, json.loads(res.stdout)
    except json.JSONDecodeError:
        why = f"{argv}: not JSON ({res.returncode}): {res.stdout!r} {res.stderr}"
        raise AssertionError(why) from None


def test_check_outside_a_lease() -> None:
    code, doc = hold("check", "--json")
    assert code == 1  # as without --json
    conforms(doc, CHECK, top=True)
    assert doc["ok"] is False and doc["lease"] is None and doc["device"] == "npu"


def test_check_inside_a_lease() -> None:
    code, doc = hold("check", "--json", inside=True)
    assert code == 0, doc
    conforms(doc, CHECK, top=True)
    assert doc["ok"] is True
    conforms(doc["lease"], CHECK_LEASE)
    assert doc["lease"]["class"] == "npu" and doc["lease"]["devices"] == [0]
    assert doc["lease"]["id"] in doc["why"]
    code, doc = hold("check", "--device", "gpu", "--json", inside=True)
    assert code == 1 and doc["ok"] is False and doc["lease"] is None


def test_status_free_and_held() -> None:
    code, doc = hold("status", "--json")
    assert code == 0
    conforms(doc, STATUS, top=True)
    conforms(doc["arbiter"], ARBITER)
    assert set(doc["classes"]) >= {"npu", "gpu"}
    for info in doc["classes"].values():
        assert isinstance(info["queue"], list)
        for dev in info["devices"]:
            assert isinstance(dev["index"], int) and dev["holder"] is None
    code, doc = hold("status", "--json", inside=True)
    assert code == 0
    conforms(doc, STATUS, top=True)
    conforms(doc["classes"]["npu"]["devices"][0]["holder"], HOLDER)


def test_audit(isolated_hold: Path) -> None:
    node = isolated_hold / "fake0"
    node.write_bytes(b"\0" * 4096)
    update_config(isolated_hold, devices={"fake": {"nodes": [str(isolated_hold / "fake*")]}})
    code = f"f = open({str(node)!r}); print('held', flush=True); import time; time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        status, doc = hold("audit", "--device", "fake", "--json")
    finally:
        proc.kill()
        proc.wait()
    assert status == 1  # a stray, as without --json
    conforms(doc, DOC_TYPES, top=True)
    assert [r["pid"] for r in doc["holders"]] == [proc.pid]
    conforms(doc["holders"][0], ROW_TYPES)


STACK = """\
name: {name}
units:
  echo:
    kind: task
    cmd: [cat]
    cpus: "{cpu}"
    args:
      word: {{type: str}}
"""


def test_call(tmp_path: Path) -> None:
    from hold_supervisor.parse import allowed_cpus

    name = f"uxjson{os.getpid()}"
    (tmp_path / "s.yaml").write_text(STACK.format(name=name, cpu=max(allowed_cpus())))
    up = subprocess.run(
        [*HOLD, "up", "--detach", str(tmp_path / "s.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert up.returncode == 0, up.stderr
    try:
        code, doc = hold("call", name, "echo", "--arg", "word=hi", "--json")
    finally:
        subprocess.run([*HOLD, "down", name], capture_output=True, timeout=60)
    assert code == 0, doc
    assert json.loads(doc["stdout"]) == {"word": "hi"}
    conforms(doc, CALL, top=True)
