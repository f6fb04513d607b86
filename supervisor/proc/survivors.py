"""The survivor check at the end of a stop -- who is still there, and who holds
what the tree held (:func:`check_survivors`, step 4 of
:func:`hold_supervisor.proc.stop.stop_tree`; the rule is :mod:`hold_supervisor.proc.stop`'s
docstring) -- and the :class:`StopReport` it ends.

Members still alive are *survivors*: the stop signals them again, and those
it cannot end make it a failure. A process that only holds one of the tree's
files or nodes, or listens on one of its ports, is a *holder*: reported,
never signalled, since nothing proves it is the tree's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from hold_supervisor.proc import scan
from hold_supervisor.proc.identity import (
    AccessDenied,
    NoSuchProcess,
    ProcessId,
    Stat,
    read_cmdline,
    user_name,
)
from hold_supervisor.proc.tree import Look as Look  # one look, as the tests and stop.py name it
from hold_supervisor.proc.tree import Member, Tree

LOOKS = 6  # the most looks the survivor check takes to get two that agree

# What the tree held: its nodes by key, and its listening ports (proto, port).
Nodes = dict[tuple[int, int], scan.Node]
Ports = set[tuple[str, int]]


class Survivor(NamedTuple):
    pid: int
    command: str
    found_by: str


class Holder(NamedTuple):
    """A process outside the tree that holds what the tree held: reported, never signalled.

    ``holds`` says what (``holds PATH``, ``listens on tcp/PORT``). ``pid`` is
    None for a port still listening whose owner this process may not inspect
    (``uid`` None and ``user``/``command`` ``"?"`` then).
    """

    pid: int | None
    uid: int | None
    user: str
    holds: str
    command: str


# The survivor check's shape, for :func:`hold_supervisor.proc.stop.stop_tree`'s
# ``survivors`` argument: (tree, nodes, ports, the settled look or None) ->
# (members still alive -> how found, holders).
SurvivorCheck = Callable[
    [Tree, Nodes, Ports, Look | None], tuple[dict[ProcessId, str], list[Holder]]
]


class StopReport:
    """What a stop did and what it proved.

    ``outcome``: ``"empty"`` (nothing was running), ``"exited"`` (all left
    within the grace after the polite signal), ``"killed"`` (the grace ran out
    and the rest was killed). ``survivors`` lists the members the final check
    still found; the stop succeeded only when it is empty. ``holders_after``
    lists processes that are not members but, at the final check, hold one
    of the tree's files or nodes or listen on one of its ports: they are
    someone else's as far as can be proved, so they were not signalled and
    do not make the stop fail (a caller may still want to say so).
    """

    __slots__ = (
        "duration",
        "escalated",
        "escaped",
        "grace_used",
        "held",
        "holders_after",
        "killed",
        "method",
        "outcome",
        "signal",
        "stopped",
        "survivors",
        "tree_id",
    )

    def __init__(self, tree_id: str, signal: str, method: str) -> None:
        self.tree_id = tree_id
        self.signal = signal
        self.method = method  # "cgroup" or "walk"
        self.outcome = "empty"
        self.stopped: list[Member] = []
        self.killed: list[Member] = []
        self.survivors: list[Survivor] = []
        self.escalated: list[Survivor] = []  # killed by the survivor check's second round
        # Members found outside the cgroup leaf they had been in: what they
        # started out there, once no longer their descendant, no look can find.
        self.escaped: list[Survivor] = []
        self.grace_used = 0.0
        self.duration = 0.0
        self.held: list[str] = []  # nodes and ports checked afterwards
        self.holders_after: list[Holder] = []  # not members: reported, never signalled

    @property
    def ok(self) -> bool:
        return not self.survivors

    @property
    def proven(self) -> bool:
        """Whether the survivor check's "nobody" is proof: no member had left the leaf."""
        return not self.escaped

    def summary(self) -> str:
        head = (
            f"tree {self.tree_id}: {self.outcome} via {self.method} "
            f"({len(self.stopped)} stopped, {len(self.killed)} killed after "
            f"{self.grace_used:.3f}s of {self.signal}; {self.duration * 1000:.1f} ms in all)"
        )
        if self.escalated:
            head += f"; {len(self.escalated)} more killed by the survivor check: " + ", ".join(
                f"{s.pid} ({s.found_by})" for s in self.escalated
            )
        if not self.survivors and self.escaped:
            # Not "empty": nothing proves it (issue 24).
            lines = [
                head
                + f"; survivor check unknown: {len(self.escaped)} left the cgroup leaf ("
                + ", ".join(f"{s.pid} {s.command[:40]}" for s in self.escaped)
                + "), found and stopped; what they started outside it cannot be proven gone"
            ]
        elif not self.survivors:
            lines = [head + "; survivor check empty"]
        else:
            lines = [head + f"; {len(self.survivors)} SURVIVED:"]
            lines += [f"  pid {s.pid} ({s.found_by}): {s.command}" for s in self.survivors]
        if self.holders_after:
            lines.append(
                f"  {len(self.holders_after)} process(es) outside the tree hold what it held"
                " (not members: reported, not signalled):"
            )
            for h in self.holders_after:
                pid = "?" if h.pid is None else h.pid
                lines.append(f"  pid {pid} (user {h.user}) {h.holds}: {h.command}")
        return "\n".join(lines)


def look_again(tree: Tree, look: Look) -> Look:
    """The look after ``look``. One that found nobody is confirmed by reading
    only what is new since (see :meth:`Tree.look`): a stop of a tree that had
    ended costs one read of every process, not two. For a tree born in its
    leaf, nobody was already the kernel's word (``populated 0``, and an empty
    leaf gains no process by a fork): ``look`` itself, nothing read."""
    if not look[1]:
        return look if tree.leaf_only else tree.look(after=look[0])
    return tree.look()


def check_survivors(
    tree: Tree, nodes: Nodes, ports: Ports, settled: Look | None = None
) -> tuple[dict[ProcessId, str], list[Holder]]:
    """(members still alive -> how found, non-members holding what the tree held).

    Only members are ever signalled (by the caller). A non-member is listed
    as a holder when it started at or after the tree's root (an older
    process that holds the same file was plainly somebody else's all along)
    and holds one of ``nodes`` or listens on one of ``ports``.

    Members: looked for until two consecutive looks agree (see
    :mod:`hold_supervisor.proc.stop`'s docstring), so that "none" means none; or
    ``settled``, the last of two looks that found none, when nothing was
    signalled after them.

    Holders are looked for only where the tree held something (``nodes``,
    or one of ``ports`` still listening). For a tree born in its leaf, whose
    looks read no process outside it, that takes one walk of /proc then:
    once the leaf is empty, anyone may still hold what the tree held (a
    descriptor passed over a Unix socket, the same file opened again, the
    port bound again), and only the descriptors of every process say who.
    """
    procs, found = settled if settled is not None else _agreed(tree)
    out: dict[ProcessId, str] = {m.ident: "+".join(m.found_by) for m in found.values()}
    if not nodes and not ports:
        return out, []
    memo: list[list[int]] = []

    def candidates() -> list[int]:
        if not memo:
            # A look that read less than every process (the leaf, the subtree)
            # did not read who else may hold what the tree held.
            partial = tree.leaf_only or tree.below_only
            everyone = {**scan.snapshot(), **procs} if partial else procs
            memo.append(_younger(tree, everyone, found))
        return memo[0]

    holders = []
    if nodes:
        holders = [
            _holder(pid, f"holds {node.path}")
            for pid, node in sorted(scan.holders_of(nodes.values(), candidates()).items())
        ]
    if ports:
        holders += _port_holders(ports, candidates)
    return out, holders


def _younger(tree: Tree, procs: dict[int, Stat], found: dict[int, Member]) -> list[int]:
    """The live processes of ``procs`` that started at or after the tree's root,
    other than members and those never to count (see :meth:`Tree.protected`)."""
    protected = tree.protected(procs)
    return [
        st.pid
        for st in procs.values()
        if st.starttime >= tree.since
        and not st.is_dead
        and st.pid not in protected
        and st.pid not in found
    ]


def _agreed(tree: Tree) -> Look:
    """Look until two looks in a row find the same members (at most :data:`LOOKS`);
    if they never agree, the last that found anyone: seen, then not seen, is
    not proven gone."""
    procs, found = tree.look()
    last_seen = found
    for _ in range(LOOKS - 1):
        procs, again = look_again(tree, (procs, found))
        if again:
            last_seen = again
        if {m.ident for m in again.values()} == {m.ident for m in found.values()}:
            break
        found = again
    else:
        found = last_seen  # never settled: not proven gone
    return procs, found


def _port_holders(ports: Ports, younger: Callable[[], list[int]]) -> list[Holder]:
    """Who still listens on one of ``ports``: the younger owners we can see, and
    the ports whose owner nobody we may inspect is (without a pid). ``younger``
    is asked only where a port still listens."""
    listening = scan.listeners()
    still = {i: ln for i, ln in listening.items() if (ln.proto, ln.port) in ports}
    if not still:
        return []
    holders: list[Holder] = []
    owners = scan.socket_owners(set(still), younger())
    for inode, pid in sorted(owners.items(), key=lambda kv: kv[1]):
        ln = still[inode]
        holders.append(_holder(pid, f"listens on {ln.proto}/{ln.port}"))
    # Who owns the rest? Members (already survivors), ourselves, an older
    # process -- or nobody this process may inspect (another user's, seen by
    # a caller without the right to read its descriptors). Only the last kind
    # is listed, without a pid. It is not a failure either: a member is found
    # by membership, which needs no look at descriptors, so an owner we
    # cannot see is someone else's as far as can be proved -- and an
    # unrelated user binding a port the tree let go of must not turn our stop
    # into a failure. The port is named, since it is not free.
    rest = set(still) - set(owners)
    if rest:
        # Every process now, not only the look's: a look may leave out the
        # processes older than the tree (hold_supervisor.proc.cache), owners too.
        rest -= set(scan.socket_owners(rest, scan.pids()))
    for inode in sorted(rest):
        ln = still[inode]
        holders.append(Holder(None, None, "?", f"{ln.proto}/{ln.port} still listening", "?"))
    return holders


def _holder(pid: int, holds: str) -> Holder:
    uid = _real_uid(pid)
    return Holder(pid, uid, "?" if uid is None else user_name(uid), holds, command_of(pid))


def _real_uid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def command_of(pid: int) -> str:
    """The process's command line, or ``?`` if it is gone or not ours to read."""
    try:
        return read_cmdline(pid)
    except (NoSuchProcess, AccessDenied):
        return "?"
