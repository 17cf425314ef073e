"""A wall clock stepped back (NTP, a VM restored) while a node was down: the node's
time resumes at the newest record it holds and goes on from there, so what was sent
before stays visible, new records are never stamped before old ones, and leases
still end (in-process engine, injected wall clock)."""
import asyncio

from node.api.service import Principal, Service
from node.engine import Engine

ADMIN = Principal(admin=True)
T0 = 1_800_000_000_000_000  # us
BACK_US = 3_600 * 1_000_000  # one hour


def _last_stamp(eng) -> int:
    from spooler.pb import log_pb2
    (data,), = eng.store.db.execute("SELECT rec FROM log ORDER BY lsn DESC LIMIT 1")
    return log_pb2.Record.FromString(data).ts_us


def test_a_clock_stepped_back_across_a_restart_hides_nothing_and_stamps_nothing_earlier(tmp_path):
    clock = [T0]

    async def life():
        eng = Engine(str(tmp_path / "n"), clock_us=lambda: clock[0], checkpoint_interval_s=3600)
        await eng.start()
        try:
            return eng, Service(eng, ["k"])
        except BaseException:
            await eng.stop()
            raise

    async def main():
        eng, svc = await life()
        await svc.put_queue(ADMIN, "q", {})
        await svc.send(ADMIN, [("q", b"before", 0.0, "")])
        await svc.send(ADMIN, [], ("q", [b"run"], 0.0))
        await eng.checkpoint_now()  # the tables hold them; the log keeps only its newest applied record
        before = _last_stamp(eng)
        await eng.stop()

        clock[0] = T0 - BACK_US
        eng, svc = await life()
        try:
            got = await svc.receive(ADMIN, "q", 0, 10)  # visible now, not in an hour
            assert sorted(d.body for d in got) == [b"before", b"run"]
            await svc.send(ADMIN, [("q", b"after", 0.0, "")])
            assert _last_stamp(eng) >= before  # the node's time did not go back with the clock
            assert [d.body for d in await svc.receive(ADMIN, "q", 0, 10)] == [b"after"]
            # and its time goes on (at the monotonic clock's pace) while the wall clock
            # stands an hour behind: a lease still expires, its message comes back
            await svc.put_queue(ADMIN, "q", {"leaseTimeoutSeconds": 0.5})
            await svc.send(ADMIN, [("q", b"leased", 0.0, "")])
            [d] = await svc.receive(ADMIN, "q", 0, 1)
            again = await svc.receive(ADMIN, "q", 10, 1)  # a long poll: answered when the lease ends
            assert [(x.id, x.retry_count) for x in again] == [(d.id, 1)]
        finally:
            await eng.stop()

    asyncio.run(main())
