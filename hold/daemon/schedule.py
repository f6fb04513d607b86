"""Who gets which free device next: arrival order, without starving big requests.

Requests of a class are considered in arrival order. One that can be granted
from the free devices is; one that cannot *reserves* the free devices it could
use, so a later request never takes a device an earlier one is waiting for. A
request for two devices therefore waits in line like everyone else, and a
stream of later single requests cannot starve it; a later request for a
specific device that no earlier request can use still goes ahead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol


class Want(Protocol):
    @property
    def count(self) -> int: ...

    @property
    def indices(self) -> tuple[int, ...] | None: ...

    @property
    def allowed(self) -> frozenset[int] | None: ...


def plan(free: Iterable[int], queue: Sequence[Want]) -> list[tuple[int, list[int]]]:
    """``[(position in queue, devices granted)]`` for the requests that can go now."""
    avail = sorted(free)
    grants: list[tuple[int, list[int]]] = []
    for pos, req in enumerate(queue):
        if req.indices is not None:
            want = [i for i in req.indices]
            if all(i in avail for i in want):
                grants.append((pos, want))
            avail = [i for i in avail if i not in want]  # granted, or reserved
        else:
            # Only devices the client can use (inside an allocation): the rest
            # stays for those behind it.
            usable = [i for i in avail if req.allowed is None or i in req.allowed]
            take = usable[: req.count]
            if len(take) == req.count:
                grants.append((pos, take))
            avail = [i for i in avail if i not in take]  # granted, or reserved
        if not avail:
            break
    return grants
