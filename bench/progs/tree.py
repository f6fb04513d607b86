"""A process tree of a chosen size, with setsid escapees, for the stop benchmark.

Usage: tree.py READY_FD TOTAL ESCAPEES [--ignore-leaves N] [--ignore-escapees N]

Shape (TOTAL processes in all, the root included)::

    root
    +-- branch x B                     (children of the root)
    |   +-- leaf x ...                 (grandchildren, shared out round-robin)
    |   +-- [middle] -> escapee x ...  (setsid + double fork: the middle exits,
    |                                   so the escapee has left the root's
    |                                   session, group and ancestry)

Every process writes one line, ``PID STARTTIME``, to READY_FD once it is in
place (its TERM disposition set), then closes the descriptor and sleeps in
``pause()``: it uses no CPU, so the benchmark times the stop and not the
tree's own work. The middle processes of the double forks exit before
writing and are not counted.

``--ignore-leaves N`` / ``--ignore-escapees N``: that many leaves / escapees
(and then the root too) ignore SIGTERM, so the stop must wait out the grace
and kill. Everything else keeps TERM's default action (die at once), the
most prompt "clean exit" a program can have, so scenario timings measure the
supervisor rather than the programs' shutdown code.

Plain ``os.fork`` without ``exec``: every process keeps the environment it
was spawned with, ``HOLD_TREE`` marker included, exactly as a forking server
would; and a forked Python costs ~1 ms instead of ~15 ms for a new one, which
keeps the set-up of a 100-process tree well under a second.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

BRANCHES = 9  # children of the root; the rest are spread under them


def announce(fd: int) -> None:
    """Say "I am up" (pid and start time, so the benchmark can check identity)."""
    with open(f"/proc/{os.getpid()}/stat", "rb") as f:
        starttime = f.read().rpartition(b")")[2].split()[19].decode()
    os.write(fd, f"{os.getpid()} {starttime}\n".encode())
    os.close(fd)


def sleep_forever(fd: int, ignore_term: bool) -> None:
    """Set the TERM disposition *before* announcing, then wait for signals only."""
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    announce(fd)
    while True:
        signal.pause()


def leaf(fd: int, ignore_term: bool) -> None:
    sleep_forever(fd, ignore_term)
    os._exit(0)


def escapee(fd: int, ignore_term: bool) -> None:
    """Called in a fresh child: leave the session and be re-parented away."""
    os.setsid()
    if os.fork() > 0:
        os._exit(0)  # the middle process: exits, orphaning the escapee
    sleep_forever(fd, ignore_term)
    os._exit(0)


def branch(fd: int, leaves: list[bool], escapees: list[bool]) -> None:
    """Start this branch's leaves and escapees (each flag: ignores TERM)."""
    for ignore in leaves:
        if os.fork() == 0:
            leaf(fd, ignore)
    for ignore in escapees:
        pid = os.fork()
        if pid == 0:
            escapee(fd, ignore)
        os.waitpid(pid, 0)  # reap the middle, so it is not left a zombie
    sleep_forever(fd, ignore_term=False)
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ready_fd", type=int)
    p.add_argument("total", type=int)
    p.add_argument("escapees", type=int)
    p.add_argument("--ignore-leaves", type=int, default=0)
    p.add_argument("--ignore-escapees", type=int, default=0)
    a = p.parse_args()

    n_leaves = a.total - 1 - BRANCHES - a.escapees
    if n_leaves < 0:
        sys.exit(
            f"tree.py: {a.total} processes cannot hold 1 root, {BRANCHES} branches "
            f"and {a.escapees} escapees"
        )
    # Which leaves / escapees ignore TERM: the first N of each, shared out
    # round-robin below, so they end up spread over the branches.
    leaf_flags = [i < a.ignore_leaves for i in range(n_leaves)]
    esc_flags = [i < a.ignore_escapees for i in range(a.escapees)]
    per_branch_leaves: list[list[bool]] = [leaf_flags[b::BRANCHES] for b in range(BRANCHES)]
    per_branch_esc: list[list[bool]] = [esc_flags[b::BRANCHES] for b in range(BRANCHES)]

    for b in range(BRANCHES):
        if os.fork() == 0:
            branch(a.ready_fd, per_branch_leaves[b], per_branch_esc[b])
    root_ignores = a.ignore_leaves > 0 or a.ignore_escapees > 0
    sleep_forever(a.ready_fd, root_ignores)


if __name__ == "__main__":
    main()
