"""``hold.daemon.schedule.plan``: who gets which free device next, as a pure function."""

from __future__ import annotations

import random
from typing import NamedTuple

import pytest

from hold.daemon.schedule import plan


class Req(NamedTuple):
    count: int = 1
    indices: tuple[int, ...] | None = None
    allowed: frozenset[int] | None = None


def only(count: int, *usable: int) -> Req:
    return Req(count=count, allowed=frozenset(usable))


def n(count: int) -> Req:
    return Req(count=count)


def at(*indices: int) -> Req:
    return Req(count=len(indices), indices=indices)


@pytest.mark.parametrize(
    ("free", "queue", "expect"),
    [
        # Nothing to do.
        ([0, 1], [], []),
        ([], [n(1), n(2)], []),
        # Single requests in arrival order, lowest devices first.
        ([0, 1], [n(1), n(1), n(1)], [(0, [0]), (1, [1])]),
        ([3, 1, 2], [n(1), n(1)], [(0, [1]), (1, [2])]),
        # A request for two is granted both when both are free...
        ([0, 1], [n(2), n(1)], [(0, [0, 1])]),
        # ...and otherwise reserves the free one: the later single waits.
        ([1], [n(2), n(1)], []),
        ([1], [n(2), n(1), at(1)], []),
        # Earlier singles go first; the pair then reserves what is left.
        ([0, 1, 2], [n(1), n(3), n(1)], [(0, [0])]),
        ([0, 1, 2], [n(1), n(2), n(1)], [(0, [0]), (1, [1, 2])]),
        # Specific devices.
        ([0, 1], [at(1), n(1)], [(0, [1]), (1, [0])]),
        ([0, 1], [at(0, 1), n(1)], [(0, [0, 1])]),
        # A waiting specific request reserves the free devices it names...
        ([0], [at(0, 1), n(1)], []),
        ([0, 2], [at(0, 1), n(1)], [(1, [2])]),
        # ...but a later request for a device no earlier one can use goes ahead.
        ([1], [at(0), at(1)], [(1, [1])]),
        ([1], [at(0), n(1)], [(1, [1])]),
        # Inside an allocation only the usable devices are taken or reserved.
        ([0, 1, 2], [only(1, 2), n(1)], [(0, [2]), (1, [0])]),
        ([0, 1], [only(2, 1, 2), n(1)], [(1, [0])]),
        ([0, 1], [only(1, 3), n(1)], [(1, [0])]),
        # A pair that cannot be served blocks everything behind it.
        ([2], [n(2), at(2)], []),
    ],
)
def test_plan(free: list[int], queue: list[Req], expect: list[tuple[int, list[int]]]) -> None:
    assert plan(free, queue) == expect


def test_plan_does_not_change_its_inputs() -> None:
    free = [2, 0, 1]
    queue = [n(2), at(2), n(1)]
    plan(free, queue)
    assert free == [2, 0, 1] and queue == [n(2), at(2), n(1)]


def test_a_pair_is_not_starved_by_a_stream_of_singles() -> None:
    """Devices 0 and 1; a pair waits behind a holder of 0 while singles keep coming."""
    held = {0}
    queue: list[Req] = [n(2)]
    for _ in range(20):
        queue.append(n(1))
        free = [i for i in (0, 1) if i not in held]
        assert plan(free, queue) == []  # device 1 stays reserved for the pair
    held.clear()  # the holder of 0 leaves: the pair goes first, the singles wait
    assert plan([0, 1], queue) == [(0, [0, 1])]


def test_plan_properties_random() -> None:
    """For random queues: grants are disjoint, from the free devices, of the size
    asked for, and never take a device that an earlier waiting request could use."""
    rnd = random.Random(20240501)
    for _ in range(2000):
        size = rnd.randint(1, 6)
        free = sorted(rnd.sample(range(size), rnd.randint(0, size)))
        queue: list[Req] = []
        for _ in range(rnd.randint(0, 6)):
            if rnd.random() < 0.5:
                queue.append(n(rnd.randint(1, size)))
            else:
                queue.append(at(*sorted(rnd.sample(range(size), rnd.randint(1, size)))))
        grants = plan(free, queue)
        got = dict(grants)
        positions = [pos for pos, _ in grants]
        assert positions == sorted(set(positions))
        taken: list[int] = [d for _, devs in grants for d in devs]
        assert len(taken) == len(set(taken)), (free, queue, grants)
        assert set(taken) <= set(free)
        for pos, devs in grants:
            req = queue[pos]
            assert len(devs) == req.count
            if req.indices is not None:
                assert devs == list(req.indices)
        for i, earlier in enumerate(queue):
            if i in got:
                continue
            usable = set(free) if earlier.indices is None else set(earlier.indices)
            for j in got:
                if j > i:
                    assert not usable & set(got[j]), (free, queue, grants, i, j)
        # Work-conserving in arrival order: the first request is granted
        # whenever the free devices can satisfy it.
        if queue:
            first = queue[0]
            can = (
                len(free) >= first.count
                if first.indices is None
                else set(first.indices) <= set(free)
            )
            assert (0 in got) == can
