"""``hold down`` and ``hold restart``: asking a running stack to stop, or to restart
a unit; ``hold down`` of a stack that is still starting (no control socket yet,
its lock held) signals its process. Both return only once it is done: ``hold down``
as soon as the stack answers ``stopped`` (sent once the survivor check is done and
the stack has let go of its name), or, with no answer, once its lock is free.

Every wait has a deadline (docs/DESIGN.md, "Deadlines"). The stack answers within
:data:`~hold.cli.stackdir.ANSWER_WAIT` seconds, and says how long the stop or restart
may take (``within``). A supervisor that misses either is stuck (stopped, or its
loop not getting on), and ``hold down`` stops the stack through what does answer:
it SIGKILLs the supervisor -- verified first as the holder of the stack's lock --
and the ticket daemon, the guardian of every unit's tree, stops them all when the
supervisor's connection drops (the lifeline, as for any ``hold up`` that dies).
``hold down`` watches the trees it found under the supervisor until they are empty;
what is still there after :data:`LIFELINE_WAIT` (no guardian: the daemon was
unreachable when the stack came up, or is stuck too) it stops itself, with the
survivor check. A SIGKILL rather than ``hold release``: a stack without ``hold:``
has no lease to release, and a supervisor left alive with its units gone would
hold the stack's name, and restart them the moment it runs again.

No such stack running: exit 1 (``NO``, as ``hold ps``, ``logs`` and ``call``),
with the closest name of the stacks that exist; but ``hold down`` of a stack that
has run here and is stopped already is 0, as ``systemctl stop`` of an inactive
unit: what was asked holds, and a script's cleanup may say it twice. A stack
stopped without its supervisor's answer is 0 too (3 with survivors); ``hold
restart`` of a stack that does not answer is 124."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from hold.cli.stackdir import (
    ANSWER_WAIT,
    ask,
    lock_holder,
    no_such_stack,
    not_answering,
    open_sd,
    run_dir_of,
    say,
    stopped_text,
    supervisor_of,
)
from hold.client import waits
from hold_supervisor.exitcodes import EXPIRED, NO, OK, SURVIVORS, TOOL, UNIT_FAILED, USAGE
from hold_supervisor.parse import BadValue
from hold_supervisor.proc import scan as procscan
from hold_supervisor.proc.cgroup import Leaf, cgroup_dir, leaf_in, v2_mount
from hold_supervisor.proc.identity import ProcessId, read_stat
from hold_supervisor.proc.scan import holders_of, node_of_stat
from hold_supervisor.stack.controlsock import NoAnswer
from hold_supervisor.stack.wire import StackEv, StackOp

if TYPE_CHECKING:
    from hold_supervisor.proc.tree import Tree

PROG = "hold down"
# Beyond what the stack said its stop or restart may take: a busy machine.
_MARGIN = 10.0
# How long the units of a stack whose supervisor was killed are left to the ticket
# daemon (it gives each its own grace) before hold down stops what is left itself.
LIFELINE_WAIT = waits.LIFELINE  # 20 s unless HOLD_ANSWER_WAIT says (hold.client.waits)
_OWN_GRACE = 5.0  # the grace of that stop of our own


def main_down(name: str) -> int:
    def progress(msg: dict[str, Any]) -> float | None:
        if msg.get("ev") == StackEv.STOPPING:
            say(f"stopping stack {name}...", PROG)
            # The stack says how long its stop may take (each unit's grace...).
            within = msg.get("within")
            return float(within) + _MARGIN if isinstance(within, (int, float)) else 3600.0
        return None

    heard = True
    try:
        ans = ask(name, {"op": StackOp.DOWN}, timeout=ANSWER_WAIT, on_message=progress)
    except ConnectionResetError:
        ans = {"ev": StackEv.STOPPED, "code": 0, "survivors": []}  # it was already stopping
        heard = False
    except NoAnswer as e:
        return _down_unanswered(name, e)
    except BadValue as e:
        say(str(e), PROG)
        return USAGE
    if ans is None:
        return _down_starting(name)
    if ans.get("ev") == StackEv.ERROR:
        say(str(ans.get("error")), PROG)
        return int(ans.get("code", USAGE))
    # Its answer comes once every unit is proven gone and the name is free. After
    # a reset connection we have no word of the stop, and "stopped" must never be
    # said while a unit may still be running: then its lock says when it is over.
    lock = os.path.join(run_dir_of(open_sd(), name), "stack.lock")
    if not heard and not _wait_unlocked(lock, 3600):
        say(f"stack {name} is still stopping after an hour; see hold ps {name}", PROG)
        return TOOL
    for s in ans.get("survivors") or []:
        say(f"survivor pid {s['pid']} ({s['found_by']}): {s['command']}", PROG)
    code = int(ans.get("code", 0))
    say(f"stack {name} stopped" + (" (with survivors)" if code == SURVIVORS else ""), PROG)
    return SURVIVORS if code == SURVIVORS else OK


def _down_starting(name: str) -> int:
    """``hold down`` of a stack with no control socket: not running, or starting
    (its lock is held: waiting for a ticket, making its trees). A starting stack
    is stopped like a running one: its process is told (SIGTERM) and waited for;
    one that has not let go in :data:`~hold.cli.stackdir.ANSWER_WAIT` seconds while
    stopped (SIGSTOP), or in :data:`LIFELINE_WAIT` otherwise, is killed as a
    stuck one is (see the module's docstring)."""
    run_dir = run_dir_of(open_sd(), name)
    lock = os.path.join(run_dir, "stack.lock")
    pid = lock_holder(lock)
    if pid is None:
        # As systemctl stop: a stack that has run here and is stopped is already
        # what was asked (0); a name that never ran here is a mistake (1).
        if not os.path.isdir(run_dir):
            no_such_stack(name, PROG, ever=True)
            return NO
        say(f"stack {name} is not running (nothing to stop)", PROG)
        return OK
    say(f"stack {name} is starting (pid {pid}); stopping it", PROG)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    except PermissionError:
        say(f"stack {name} (pid {pid}) is not yours to stop", PROG)
        return USAGE
    wait = ANSWER_WAIT if stopped_text(pid) else LIFELINE_WAIT
    if not _wait_unlocked(lock, wait):
        why = f"the supervisor of stack {name} (pid {pid}) did not stop in {wait:g} s"
        return _kill_and_watch(name, run_dir, pid, why + stopped_text(pid))
    say(f"stack {name} stopped", PROG)
    return 0


def _down_unanswered(name: str, e: NoAnswer) -> int:
    """The stack did not answer ``down`` (or did not finish its stop) in time."""
    run_dir = run_dir_of(open_sd(), name)
    pid = lock_holder(os.path.join(run_dir, "stack.lock"))
    if pid is None:
        say(f"stack {name} stopped", PROG)  # it let go of its name meanwhile
        return OK
    if e.heard is not None:
        why = (
            f"the supervisor of stack {name} (pid {pid}) did not finish its stop in "
            f"{e.waited:g} s{stopped_text(pid)}"
        )
    else:
        why = not_answering(name, pid, e.waited)
    return _kill_and_watch(name, run_dir, pid, why)


def _kill_and_watch(name: str, run_dir: str, pid: int, why: str) -> int:
    """SIGKILL the stuck supervisor ``pid``; the ticket daemon stops its units'
    trees (the lifeline). Returns once every tree found under it is empty."""
    lock = os.path.join(run_dir, "stack.lock")
    if not _holds(pid, lock):
        say(f"{why}; pid {pid} no longer holds the stack's lock: left alone", PROG)
        return TOOL
    try:
        since = read_stat(pid).starttime
    except Exception:
        since = None
    trees, strays = _trees_under(pid, since)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError:
        say(f"{why}; it is not yours to stop", PROG)
        return USAGE
    if not _wait_unlocked(lock, ANSWER_WAIT):
        say(f"{why}; it was killed but still holds the stack's lock", PROG)
        return TOOL
    left = _wait_trees(trees, LIFELINE_WAIT)
    survivors = _stop_left(left) + _kill_strays(strays)
    how = "its units were stopped through the ticket daemon"
    if not trees:
        how = "it was killed, and no unit of it was running"
    elif left:
        done = len(trees) - len(left)
        how = (
            f"{done} of its {len(trees)} unit tree(s) were stopped through the ticket "
            f"daemon, the rest (not empty after {LIFELINE_WAIT:g} s) by hold down"
        )
    for s in survivors:
        say(f"survivor pid {s}", PROG)
    say(f"{why}; {how}", PROG)
    say(f"stack {name} stopped" + (" (with survivors)" if survivors else ""), PROG)
    return SURVIVORS if survivors else OK


def _holds(pid: int, path: str) -> bool:
    """Does ``pid`` have ``path`` open (by device and inode)? The pid written in a
    held lock is believed only then: never a SIGKILL for a reused pid."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return pid in holders_of([node_of_stat(st, path)], [pid])


def _trees_under(pid: int, since: int | None) -> tuple[list[Tree], list[tuple[int, int]]]:
    """The units' trees below the supervisor ``pid``, by their marker (``HOLD_TREE``)
    and cgroup leaf (``hold-<tree id>``); and its descendants in none of them, as
    (pid, start time)."""
    # lazy: the walk only once a supervisor was killed; off hold down NAME's usual path
    from hold_supervisor.environ import MARKER
    from hold_supervisor.proc.tree import Tree

    procs = procscan.snapshot()
    # An outer tree's marker, inherited by the supervisor: never ours to stop.
    own = procscan.environ_value(pid, MARKER.encode())
    mount = v2_mount()
    leaves: dict[str, str | None] = {}
    strays: list[tuple[int, int]] = []
    for p in sorted(procscan.descendants([pid], procs)):
        if procs[p].is_dead:
            continue
        tree_id = procscan.environ_value(p, MARKER.encode())
        if tree_id is None or tree_id == own:
            strays.append((p, procs[p].starttime))
            continue
        path = cgroup_dir(p, mount)
        leaf = leaf_in(path, tree_id) if path is not None else None
        if leaves.get(tree_id) is None:
            leaves[tree_id] = leaf
    start = since if since is not None else min((procs[p].starttime for p in procs), default=0)
    trees = [
        Tree(t, None, None, None, leaf=Leaf(lf) if lf else None, since=start)
        for t, lf in leaves.items()
    ]
    return trees, strays


def _empty(tree: Tree) -> bool:
    if tree.contained:
        return tree.leaf_emptied()
    return not tree.members()


def _wait_trees(trees: list[Tree], timeout: float) -> list[Tree]:
    """Wait until every tree is empty (the guardian stops them); those that are not
    after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    left = [t for t in trees if not _empty(t)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1 if all(t.contained for t in left) else 0.25)
        left = [t for t in left if not _empty(t)]
    for t in trees:
        if t not in left and t.leaf is not None:
            # The guardian removes an emptied leaf; a moment for it, never waited on.
            end = time.monotonic() + 2.0
            while os.path.isdir(t.leaf.path) and time.monotonic() < end:
                time.sleep(0.05)
    return left


def _stop_left(trees: list[Tree]) -> list[int]:
    """Stop what the guardian did not (none, or stuck too); the survivors' pids."""
    # lazy: only for units left behind; off hold down NAME's usual path
    from hold_supervisor.proc.stop import stop_tree

    out: list[int] = []
    for t in trees:
        report = stop_tree(t, grace=_OWN_GRACE)
        out.extend(s.pid for s in report.survivors)
        if report.ok:
            try:
                t.remove_leaf()
            except (OSError, ValueError):
                pass
    return out


def _kill_strays(strays: list[tuple[int, int]]) -> list[int]:
    """The supervisor's descendants in no unit's tree (none is expected): killed if
    they are still the same processes."""
    left = [ProcessId(p, start) for p, start in strays]
    for ident in left:
        if ident.matches():
            try:
                os.kill(ident.pid, signal.SIGKILL)
            except OSError:
                pass
    deadline = time.monotonic() + 2.0
    while (alive := [i for i in left if i.matches()]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [i.pid for i in alive]


def _wait_unlocked(path: str, timeout: float) -> bool:
    """True once nobody holds ``path``'s flock (or it does not exist). Woken by the
    kernel when the holder lets go (a blocking flock in a thread), not by polling."""
    # lazy: only to wait out a killed supervisor's lock; off hold down NAME's usual path
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    got = threading.Event()

    def take() -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            got.set()
        except OSError:
            pass

    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        os.close(fd)  # free already: closing lets go at once
        return True
    except BlockingIOError:
        pass
    # The thread may outlive a timeout (blocked in flock): a daemon thread, and its
    # descriptor left to the process's exit.
    threading.Thread(target=take, name="wait-unlocked", daemon=True).start()
    if got.wait(timeout):
        os.close(fd)
        return True
    return False


def main_restart(name: str, unit: str) -> int:
    """``hold restart NAME UNIT``: 0 once the unit is ready again; 124 if the stack
    did not answer in :data:`~hold.cli.stackdir.ANSWER_WAIT` seconds, or did not finish
    within what it said the restart may take."""

    def progress(msg: dict[str, Any]) -> float | None:
        within = msg.get("within")
        if msg.get("ev") == StackEv.RESTARTING and isinstance(within, (int, float)):
            return float(within) + _MARGIN
        return None

    try:
        ans = ask(
            name, {"op": StackOp.RESTART, "unit": unit}, timeout=ANSWER_WAIT, on_message=progress
        )
    except NoAnswer as e:
        pid = supervisor_of(name)
        if e.heard is not None:
            what = (
                f"the supervisor of stack {name} (pid {pid}) did not finish restarting "
                f"{unit} in {e.waited:g} s{stopped_text(pid)}"
            )
        else:
            what = f"{not_answering(name, pid, e.waited)}; {unit} was not restarted"
        say(f"{what}; hold down {name} stops the stack through the ticket daemon", "hold restart")
        return EXPIRED
    except BadValue as e:
        say(str(e), "hold restart")
        return USAGE
    if ans is None:
        no_such_stack(name, "hold restart")
        return NO
    if ans.get("ev") == StackEv.ERROR:
        say(str(ans.get("error")), "hold restart")
        return int(ans.get("code", UNIT_FAILED))
    say(f"{unit} restarted (pid {ans.get('pid')})", "hold restart")
    return 0
