"""The daemon's worker pool: jobs never wait for each other, an idle worker is
reused instead of a thread started, and a stopping daemon's wait is bounded."""

from __future__ import annotations

import threading

from hold.daemon.workers import Workers


def test_a_blocked_job_does_not_hold_up_the_next() -> None:
    pool = Workers(keep=2)
    release, second_ran = threading.Event(), threading.Event()
    try:
        pool.submit(lambda: release.wait(10))
        pool.submit(second_ran.set)
        assert second_ran.wait(5), "the second job waited for the first"
        assert not pool.join(0.05)  # the first is still in flight
        release.set()
        assert pool.join(5)
    finally:
        release.set()
        pool.dismiss()


def test_an_idle_worker_takes_the_next_job_instead_of_a_new_thread() -> None:
    pool = Workers(keep=1)
    seen: list[int] = []
    try:
        for _ in range(5):
            pool.submit(lambda: seen.append(threading.get_ident()))
            assert pool.join(5)
        assert len(seen) == 5 and len(set(seen)) == 1, seen
    finally:
        pool.dismiss()


def test_a_failing_job_is_reported_and_the_worker_goes_on() -> None:
    pool = Workers(keep=1)
    said: list[BaseException | None] = []
    old = threading.excepthook
    threading.excepthook = lambda args: said.append(args.exc_value)
    done = threading.Event()
    try:

        def boom() -> None:
            raise RuntimeError("boom")

        pool.submit(boom)
        assert pool.join(5)
        pool.submit(done.set)
        assert done.wait(5)
    finally:
        threading.excepthook = old
        pool.dismiss()
    assert [str(e) for e in said] == ["boom"]


def test_dismissed_workers_end() -> None:
    pool = Workers(keep=3)
    before = threading.active_count()
    gates = [threading.Event() for _ in range(3)]
    for g in gates:
        pool.submit(lambda g=g: g.wait(10))
    assert threading.active_count() == before + 3
    for g in gates:
        g.set()
    assert pool.join(5)
    pool.dismiss()
    deadline = threading.Event()
    for _ in range(100):
        if threading.active_count() == before:
            break
        deadline.wait(0.05)
    assert threading.active_count() == before
