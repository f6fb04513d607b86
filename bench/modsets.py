"""Which modules each start-up path imports, before and after a change (issue 22).

    .venv/bin/python -m bench.modsets --before e6fc6f0        # this tree against that commit
    .venv/bin/python -m bench.modsets --before e6fc6f0 --show  # and every module added or gone

Each version (checked out as :mod:`bench.ab` does) runs the same commands in a
world of its own (state directory, configuration naming a file-backed ``npu``
class, home, lock directory): ``npu-hold --device npu -- true`` twice (the
first autostarts the daemon), ``hold run -- true`` (cgroups ``auto`` and
``off``), ``hold --version``, ``hold check``, ``hold status --json``, plain
``hold audit``, a TAB after ``hold st`` and ``npu-hold --de``, and ``hold up
--detach FILE`` then ``hold down NAME`` of a stack of one service, and of one
with a oneshot and a task too, called once (``hold call NAME TASK``).

Every Python process they start, forks included (the daemon, a stack's
background supervisor, a keeper), records what it imports: a
``sitecustomize`` put in front of ``PYTHONPATH`` adds an audit hook that
appends each module's name, as it is first imported, to one log per command
(a fork starts with its parent's modules at the fork). Nothing of this is in
the code measured.

The table gives each process's count of modules per version; a process whose
set grew is marked, and the exit status is 1 if any did.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.ab import checkout, entry_module

# The recorder. Only os and sys (already loaded at start) so that it adds nothing.
SITECUSTOMIZE = """\
import os, sys

_LOG = os.environ.get("MODSETS_LOG")


def _write(kind, text):
    fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{os.getpid()}\\t{kind}\\t{text}\\n".encode())
    finally:
        os.close(fd)


def _hook(event, args):
    if event == "import":
        _write("IMPORT", args[0])


if _LOG:
    _write("START", repr(sys.orig_argv))
    for _name in sorted(sys.modules):
        _write("IMPORT", _name)
    _parent = [os.getpid()]

    def _forked():
        _write("FORK", str(_parent[0]))
        _parent[0] = os.getpid()
        for _name in sorted(sys.modules):  # what it holds: the parent's at the fork
            _write("IMPORT", _name)

    def _before():
        _parent[0] = os.getpid()
        _write("FORKING", "")

    os.register_at_fork(before=_before, after_in_child=_forked)
    sys.addaudithook(_hook)
"""

# The second stack's other units: a oneshot, and a task with a scratch directory.
TASKS = (
    "  prep: {{kind: oneshot, cmd: ['true']}}\n"
    "  job: {{kind: task, cpus: '{cpu}', scratch: {{}},\n"
    "        cmd: [sh, -c, 'echo x > $HOLD_SCRATCH/f']}}\n"
)
# Put into sys.modules by hand, never imported (so never seen by the hook), but
# in a fork's copy of its parent's modules: left out of every set alike.
UNSEEN = ("typing.io", "typing.re", "cython_runtime", "_cython_")
NPU = "import sys; from {entry} import npu_main; sys.exit(npu_main())"
HOLD = "import sys; from {entry} import main; sys.exit(main(sys.argv[1:]))"


def processes(log: Path, world: Path) -> dict[str, set[str]]:
    """Each Python process of one command, named by its command line (forks:
    ``+fork``, numbered if one parent forked twice), and the modules it held;
    for one that forked, also those it held when it first did (what a
    fork-first design such as ``hold up --detach``'s keeps small)."""
    own: dict[int, set[str]] = {}
    names: dict[int, str] = {}
    order: list[int] = []
    first_fork: dict[int, set[str]] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        pid_s, kind, text = line.split("\t", 2)
        pid = int(pid_s)
        if kind == "START":
            argv = ast.literal_eval(text)
            words = (a.replace(str(world), "W") for a in argv[1:])
            names[pid] = " ".join(a for a in words if not a.startswith(("import sys", "-c")))
            own[pid] = set()
            order.append(pid)
        elif kind == "FORK":
            parent = int(text)
            own[pid] = set()
            base = f"{names.get(parent, '?')} +fork"
            taken = sum(1 for n in names.values() if n.startswith(base))
            names[pid] = base if not taken else f"{base}#{taken + 1}"
            order.append(pid)
        elif kind == "FORKING":
            if pid not in first_fork:  # what the parent had imported when it first forked
                first_fork[pid] = set(own.get(pid, ()))
        elif not text.startswith(UNSEEN):
            own.setdefault(pid, set()).add(text)
    out = {}
    for p in order:
        out[names.get(p, str(p))] = own[p]
        if p in first_fork:
            out[f"{names.get(p, str(p))} (at its first fork)"] = first_fork[p]
    return out


def world(code: Path, at: Path) -> dict[str, str]:
    """The environment of one version's runs: its own state, configuration and home."""
    for d in ("state", "home", "locks", "dev"):
        (at / d).mkdir(parents=True, exist_ok=True)
    (at / "locks").chmod(0o1777)
    (at / "dev" / "accel0").touch()
    (at / "cfg.yaml").write_text(f'devices:\n  npu:\n    nodes: ["{at}/dev/accel*"]\n')
    (at / "walk.yaml").write_text(
        f'cgroups: off\ndevices:\n  npu:\n    nodes: ["{at}/dev/accel*"]\n'
    )
    (at / "site").mkdir(exist_ok=True)
    (at / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    for name, more in (("plain", ""), ("tasks", TASKS.format(cpu=max(os.sched_getaffinity(0))))):
        (at / f"{name}.yaml").write_text(
            f"name: {name}\nunits:\n  one:\n"
            f'    cmd: [sh, -c, "echo $$ > {at}/{name}.pid; exec sleep 60"]\n'
            f'    ready: {{file: "{at}/{name}.pid"}}\n{more}'
        )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HOLD_", "_HOLD", "_NPU", "COMP_", "PYTHON"))
    }
    env.update(
        PYTHONPATH=f"{at / 'site'}:{code}",
        PYTHONDONTWRITEBYTECODE="1",
        HOLD_STATE_DIR=str(at / "state"),
        HOLD_CONFIG=str(at / "cfg.yaml"),
        HOLD_LOCK_DIR=str(at / "locks"),
        HOME=str(at / "home"),
    )
    return env


def measure(code: Path, at: Path) -> dict[str, dict[str, set[str]]]:
    """command -> process -> modules, for one version."""
    env = world(code, at)
    entry = entry_module(code)
    npu = [sys.executable, "-c", NPU.format(entry=entry)]
    hold = [sys.executable, "-c", HOLD.format(entry=entry)]
    tab = {"COMP_CWORD": "1"}
    cmds: list[tuple[str, list[str], dict[str, str]]] = [
        ("npu-hold -- true (autostart)", [*npu, "--device", "npu", "--", "true"], {}),
        ("npu-hold -- true", [*npu, "--device", "npu", "--", "true"], {}),
        ("hold run -- true", [*hold, "run", "--", "true"], {}),
        (
            "hold run -- true (no configuration file)",
            [*hold, "run", "--", "true"],
            {"HOLD_CONFIG": ""},
        ),
        (
            "hold run -- true (cgroups: off)",
            [*hold, "run", "--", "true"],
            {"HOLD_CONFIG": str(at / "walk.yaml")},
        ),
        ("hold --version", [*hold, "--version"], {}),
        ("hold check", [*hold, "check"], {}),
        ("hold status --json", [*hold, "status", "--json"], {}),
        ("hold audit", [*hold, "audit"], {}),
        ("TAB hold st", hold, {"_HOLD_COMPLETE": "bash_complete", "COMP_WORDS": "hold st", **tab}),
        (
            "TAB npu-hold --de",
            npu,
            {"_NPU_HOLD_COMPLETE": "bash_complete", "COMP_WORDS": "npu-hold --de", **tab},
        ),
        ("hold up --detach FILE", [*hold, "up", "--detach", str(at / "plain.yaml")], {}),
        ("hold down NAME", [*hold, "down", "plain"], {}),
        ("hold up --detach FILE (a task)", [*hold, "up", "--detach", str(at / "tasks.yaml")], {}),
        ("hold call NAME TASK", [*hold, "call", "tasks", "job"], {}),
        ("hold down NAME (a task)", [*hold, "down", "tasks"], {}),
    ]
    out: dict[str, dict[str, set[str]]] = {}
    try:
        logs = {}
        for i, (name, argv, extra) in enumerate(cmds):
            logs[name] = log = at / f"log{i}"
            run_env = {k: v for k, v in {**env, **extra}.items() if v}  # "": unset
            run_env["MODSETS_LOG"] = str(log)
            res = subprocess.run(argv, env=run_env, cwd=at, capture_output=True, timeout=120)
            if res.returncode not in (0, 1):  # check/status may say 1 (nothing held)
                raise SystemExit(f"{name} ({code}): exit {res.returncode}\n{res.stderr.decode()}")
            if name.startswith("hold up"):
                _wait_for(at / f"{argv[-1][:-5]}.pid")
            out[name] = processes(log, at)
        # The long-lived ones (the daemon, each stack's supervisor) again, once
        # every command above has been served.
        for name in ("npu-hold -- true (autostart)", *(n for n in logs if n.startswith("hold up"))):
            later = processes(logs[name], at)
            out[f"{name}: its children, after all"] = dict(list(later.items())[1:])
    finally:
        _stop(at / "state" / "daemon.lock")
    return out


def _wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _stop(lock: Path) -> None:
    try:
        text = lock.read_text().strip()
    except OSError:
        return
    if text.isdigit():
        try:
            os.kill(int(text), signal.SIGTERM)
        except ProcessLookupError:
            pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="a git revision (the baseline)")
    ap.add_argument("--after", default=".", help="a git revision, or . for this tree (default)")
    ap.add_argument("--show", action="store_true", help="name every module added or gone")
    ap.add_argument("--json", type=Path, help="write every set there (command, process, modules)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as t:
        work = Path(t)
        sets = {
            v: measure(checkout(rev, work / v), work / f"w-{v}")
            for v, rev in (("before", a.before), ("after", a.after))
        }
    if a.json:
        doc = {
            v: {c: {p: sorted(m) for p, m in ps.items()} for c, ps in s.items()}
            for v, s in sets.items()
        }
        a.json.write_text(json.dumps(doc, indent=1))
    grew = False
    print("| command | process | before | after | |")
    print("|---|---|---:|---:|---|")
    for cmd, procs in sets["before"].items():
        after = sets["after"].get(cmd, {})
        for proc in sorted(set(procs) | set(after)):
            b, f = procs.get(proc), after.get(proc)
            added = sorted((f or set()) - (b or set()))
            gone = sorted((b or set()) - (f or set()))
            mark = "GREW" if added else ""
            grew |= bool(added)
            nb = len(b) if b is not None else "-"
            nf = len(f) if f is not None else "-"
            print(f"| {cmd} | {proc[:60]} | {nb} | {nf} | {mark} |")
            if a.show and (added or gone):
                print(f"|   | +{added} -{gone} | | | |")
    return 1 if grew else 0


if __name__ == "__main__":
    sys.exit(main())
