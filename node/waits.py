"""Waiting for an asyncio Event with a timeout, without losing a cancellation."""
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
