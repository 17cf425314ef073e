"""node/waits.py: an Event wait with a timeout that never loses a cancellation."""
import asyncio

import pytest

from node.waits import wait_event


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
