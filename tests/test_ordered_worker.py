"""The ordered worker thread (ffi/runtime/ordered_worker.h) that enqueues overlapped host-path fetches on a GPU and
starts every host-path job when its stream gets there, through the native module's test binding: tasks run one at a
time in submission order, a wait is bounded and counts tickets, a task that raises neither ends the thread nor stops
later tasks, stop runs what is queued and joins the thread (the named thread is gone), a stopped worker refuses new
tasks; a watch fires once, when its condition holds or at its deadline, tasks run while it is left, drain waits for
it and stop too."""
from __future__ import annotations

import threading
import time

from conftest import harness
from jax_engram import _ffi

NATIVE = _ffi.native("cpu")
_threads = harness().threads_named


def test_order_bounded_wait_failure_and_stop():
    name = "je-test-order"
    before = _threads(name)
    w = NATIVE._OrderedWorker(name)
    assert _threads(name) == before + 1
    ran: list[tuple[int, str]] = []
    gate = threading.Event()

    def task(i, block=False):
        def run():
            if block:
                gate.wait(30)
            ran.append((i, threading.current_thread().name))
        return run

    t1 = w.submit(task(1, block=True))
    t2 = w.submit(task(2))
    assert (t1, t2) == (1, 2) and w.submitted() == 2
    assert not w.wait(t2, 0.05), "a wait returned while its task was still blocked"
    assert w.completed() == 0 and ran == []
    gate.set()
    assert w.wait(t2, 30) and [i for i, _ in ran] == [1, 2] and w.completed() == 2

    def boom():
        raise RuntimeError("a failing task")

    t3 = w.submit(boom)
    t4 = w.submit(task(4))
    assert w.wait(t4, 30) and w.completed() == 4 and [i for i, _ in ran] == [1, 2, 4], (t3, ran)
    assert all(n != threading.main_thread().name for _, n in ran)  # the tasks ran on the worker, not the caller

    for i in range(5, 25):
        w.submit(task(i))
    t0 = time.monotonic()
    w.stop()  # runs the 20 queued tasks, then joins
    assert [i for i, _ in ran] == [1, 2, 4] + list(range(5, 25)) and w.completed() == w.submitted() == 24
    assert _threads(name) == before, "the worker thread outlived stop()"
    assert w.submit(task(99)) == 0 and w.drain(1.0) and [i for i, _ in ran][-1] == 24
    assert time.monotonic() - t0 < 30
    w.stop()  # idempotent


def test_watches_fire_once_when_ready_or_at_their_deadline():
    name = "je-test-watch"
    before = _threads(name)
    w = NATIVE._OrderedWorker(name)
    flag = threading.Event()
    fired: list[tuple[str, bool]] = []
    w.submit_watch(flag.is_set, lambda timed_out: fired.append(("flag", timed_out)), 30.0)
    w.submit_watch(lambda: False, lambda timed_out: fired.append(("never", timed_out)), 0.3)
    ran = []
    t = w.submit(lambda: ran.append("task"))  # tasks still run while watches are left
    assert w.wait(t, 30) and ran == ["task"]
    assert not w.drain(0.05) and w.watches() >= 1, "drain returned with a watch left"
    time.sleep(0.5)
    assert fired == [("never", True)] and w.watches() == 1, fired  # the deadline passed; the flag is not set yet
    flag.set()
    assert w.drain(30) and w.watches() == 0
    assert fired == [("never", True), ("flag", False)], fired
    # stop() waits for a watch left behind (bounded by its deadline), then joins
    w.submit_watch(lambda: False, lambda timed_out: fired.append(("at_stop", timed_out)), 0.2)
    w.stop()
    assert fired[-1] == ("at_stop", True) and _threads(name) == before
