"""GcPause: one pause of the cyclic collector shared by every thread inside, restored after."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from refitd.plan.gc_pause import GcPause


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    """Every test starts with the collector on and leaves it on, whatever happens."""
    was = gc.isenabled()
    gc.enable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        else:
            gc.disable()


def test_the_collector_stays_off_until_the_last_thread_leaves() -> None:
    pause = GcPause()
    entered = threading.Barrier(3, timeout=10)
    first_may_leave = threading.Event()
    first_left = threading.Event()
    second_may_leave = threading.Event()

    def hold(may_leave: threading.Event, left: threading.Event | None) -> None:
        with pause:
            entered.wait()
            assert may_leave.wait(10)
        if left is not None:
            left.set()

    first = threading.Thread(target=hold, args=(first_may_leave, first_left))
    second = threading.Thread(target=hold, args=(second_may_leave, None))
    first.start()
    second.start()
    try:
        entered.wait()
        assert not gc.isenabled()
        assert pause.holders == 2
        first_may_leave.set()
        assert first_left.wait(10)
        # the thread that switched the collector off may leave first: still off
        assert not gc.isenabled()
        assert pause.holders == 1
    finally:
        first_may_leave.set()
        second_may_leave.set()
        first.join(10)
        second.join(10)
    assert pause.holders == 0
    assert gc.isenabled()


def test_re_entered_in_one_thread_and_left_by_an_exception() -> None:
    pause = GcPause()
    with pytest.raises(RuntimeError, match="inside"), pause:
        with pause:
            assert not gc.isenabled()
        assert not gc.isenabled()
        raise RuntimeError("inside")
    assert gc.isenabled()
    assert pause.holders == 0


def test_a_collector_switched_off_by_the_application_stays_off() -> None:
    gc.disable()
    pause = GcPause()
    with pause:
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_two_owners_never_leave_the_collector_off() -> None:
    """Two GcPause objects interleaved (two controllers in one process): whatever the order
    they leave in, the collector is back on once both have left."""
    a, b = GcPause(), GcPause()
    a.__enter__()
    b.__enter__()  # sees the collector off: it will not switch it back on itself
    a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    assert gc.isenabled()
    a.__enter__()
    b.__enter__()
    b.__exit__(None, None, None)
    assert not gc.isenabled()
    a.__exit__(None, None, None)
    assert gc.isenabled()
