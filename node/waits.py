"""Waiting, with a timeout, for an asyncio Event or for the next of a stream of changes, without losing a cancellation."""
from __future__ import annotations

import asyncio


async def wait_event(ev: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``ev`` is set or ``timeout_s`` has passed; True if it was set.

    Not ``asyncio.wait_for(ev.wait(), timeout_s)``: on Python 3.11, a task
    cancelled in the same turn of the loop as the event is set gets wait_for's
    result instead of its CancelledError (the cancellation is lost; 3.12 fixed
    it). A loop around such a wait then never ends, and whatever awaits that
    task (a node's stop) waits for ever."""
    try:
        async with asyncio.timeout(timeout_s):
            await ev.wait()
        return True
    except TimeoutError:
        return False


class Changes:
    """The next change of something, as one future shared by every waiter.

    ``next()`` gives the pending future (a new one once the last has fired);
    ``fire()`` resolves it. A waiter that looks at the state, finds it not yet
    as wanted and then awaits ``next()`` in the same turn of the loop misses no
    change: nothing else runs between the look and the wait."""

    __slots__ = ("_f",)

    def __init__(self) -> None:
        self._f: asyncio.Future | None = None

    def next(self) -> asyncio.Future:
        f = self._f
        if f is None or f.done():
            f = self._f = asyncio.get_running_loop().create_future()
        return f

    def fire(self) -> None:
        f = self._f
        if f is not None and not f.done():
            f.set_result(None)


async def wait_change(change: asyncio.Future, timeout_s: float) -> bool:
    """Wait for a shared future of Changes.next() or ``timeout_s``; True if it
    fired. asyncio.wait, not wait_for: it never cancels the shared future (one
    waiter's cancellation or timeout leaves it to the others), takes its
    callback off it when it returns, and keeps a cancellation that comes in the
    turn of the change (see wait_event)."""
    done, _ = await asyncio.wait({change}, timeout=timeout_s)
    return bool(done)
