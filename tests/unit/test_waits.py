"""node/waits.py: an Event wait with a timeout that never loses a cancellation."""
import asyncio

import pytest

from node.waits import Changes, wait_change, wait_event


def test_a_cancel_in_the_turn_the_event_is_set_still_cancels():
    """asyncio.wait_for(ev.wait(), t) on Python 3.11 returns instead when the
    event is set in the same turn as the cancel: a loop around it never ends (a
    node's stop then waited for its checkpoint loop for ever)."""
    async def main():
        ev = asyncio.Event()
        t = asyncio.ensure_future(wait_event(ev, 10))
        await asyncio.sleep(0)  # t is waiting
        ev.set()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
    asyncio.run(main())


def test_it_says_whether_the_event_came_or_the_time_ran_out():
    async def main():
        ev = asyncio.Event()
        assert await wait_event(ev, 0.01) is False
        asyncio.get_running_loop().call_later(0.01, ev.set)
        assert await wait_event(ev, 10) is True
        assert asyncio.current_task().cancelling() == 0  # its own timeout left no cancel behind
    asyncio.run(main())


def test_a_change_wait_keeps_a_cancel_that_comes_in_the_turn_of_the_change():
    """Service.until_ready waits on Engine.readiness_changes in a loop until its
    deadline: with asyncio.wait_for on 3.11 a cancel in the turn of the change
    was lost, and a stopping node's held call went on waiting."""
    async def main():
        ch = Changes()
        t = asyncio.ensure_future(wait_change(ch.next(), 10))
        await asyncio.sleep(0)
        ch.fire()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
    asyncio.run(main())


def test_one_change_wakes_every_waiter_and_one_waiters_cancel_leaves_the_others():
    async def main():
        ch = Changes()
        a = asyncio.ensure_future(wait_change(ch.next(), 10))
        b = asyncio.ensure_future(wait_change(ch.next(), 10))
        c = asyncio.ensure_future(wait_change(ch.next(), 10))
        await asyncio.sleep(0)
        a.cancel()
        await asyncio.sleep(0)
        ch.fire()
        assert await b is True and await c is True
        assert a.cancelled()
        assert await wait_change(ch.next(), 0.01) is False  # a fired change is not seen again
        ch.fire()  # nobody waiting: nothing to resolve, and no error
    asyncio.run(main())
