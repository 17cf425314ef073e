"""driver.shielded: ``await coro`` shielded from the caller's cancellation, with no
task when coro never waits (a replica's frame handled with an inline commit)."""
import asyncio

import pytest

from node.replication.driver import shielded


def test_a_coroutine_that_never_waits_runs_in_the_callers_task():
    async def quick():
        return asyncio.current_task()

    async def main():
        me = asyncio.current_task()
        assert await shielded(quick()) is me  # no task of its own
    asyncio.run(main())


def test_one_that_waits_finishes_even_when_its_caller_is_cancelled():
    steps = []

    async def slow(lock):
        async with lock:  # held elsewhere: this waits
            steps.append("got the lock")
            await asyncio.sleep(0.01)
            steps.append("done")
            return "value"

    async def main():
        lock = asyncio.Lock()
        await lock.acquire()
        caller = asyncio.ensure_future(shielded(slow(lock)))
        await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        lock.release()
        for _ in range(100):
            if "done" in steps:
                break
            await asyncio.sleep(0.005)
        assert steps == ["got the lock", "done"]
    asyncio.run(main())


def test_its_result_and_its_errors_come_back_after_a_wait():
    async def waits_then(value, exc=None):
        await asyncio.sleep(0)
        await asyncio.sleep(0.001)
        if exc:
            raise exc
        return value

    async def main():
        assert await shielded(waits_then(5)) == 5
        with pytest.raises(KeyError):
            await shielded(waits_then(0, KeyError("x")))
    asyncio.run(main())
