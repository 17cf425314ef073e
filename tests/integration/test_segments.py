"""Segments in the store: a batch is one row until its messages leave it, and a
restart rebuilds exactly the messages that were there (in-process engine)."""
import asyncio
import contextlib

from node.api.service import Principal, Service
from node.engine import Engine

ADMIN = Principal(admin=True)


@contextlib.asynccontextmanager
async def _node(tmp_path):
    """A node on ``tmp_path/n`` that checkpoints only when a test says so."""
    eng = Engine(str(tmp_path / "n"), checkpoint_interval_s=3600)
    await eng.start()  # on existing data: a restart, so a new epoch
    try:
        yield eng, Service(eng, ["k"])
    finally:
        await eng.stop()


def _segment_rows(eng):
    return [tuple(r) for r in eng.store.db.execute("SELECT seq0, n, gone FROM segments")]


def test_segment_rows_survive_a_restart_with_every_change_that_left_them(tmp_path):
    bodies = [f"body-{i}".encode() * (i + 1) for i in range(10)]

    async def first():
        async with _node(tmp_path) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {"maxRetries": 5})
            await svc.send(ADMIN, [], ("q", bodies, 0.0))
            await eng.checkpoint_now()
            [seg] = eng.core.queues["q"].segs["".join(eng.core.queues["q"].segs)]
            assert seg.bodies is None  # in the store now, read from its row
            assert [(n, bytes(g)) for _, n, g in _segment_rows(eng)] == [(10, bytes(10))]
            assert eng.store.db.execute("SELECT count(*) FROM messages").fetchall() == [(0,)]
            got = await svc.receive(ADMIN, "q", 0, 3)
            assert [d.body for d in got] == bodies[:3]  # out of the segment's row
            await svc.ack(ADMIN, got[0].token)
            await svc.nack(ADMIN, got[1].token)
            await eng.checkpoint_now()
            # the acked one has no row, the nacked one a row of its own; the leased one
            # is unchanged, so the segment still speaks for it
            assert [bytes(g) for _, _, g in _segment_rows(eng)] == [b"\x01\x01" + bytes(8)]
            assert eng.store.db.execute("SELECT id, retry, body FROM messages").fetchall() == [
                (got[1].id, 1, bodies[1])]
            return [d.id for d in got]

    async def again(ids):
        async with _node(tmp_path) as (eng, svc):  # a restart: a new epoch, the lease on ids[2] is gone
            got = await svc.receive(ADMIN, "q", 0, 20)
            assert [(d.body, d.retry_count) for d in got] == [(bodies[1], 1)] + [(b, 0) for b in bodies[2:]]
            assert [d.id for d in got[:2]] == ids[1:]
            st = eng.core.stats("q", eng.now_us())
            assert (st["sentTotal"], st["ackedTotal"], st["nackedTotal"], st["leased"]) == (10, 1, 1, 9)
            for d in got:
                await svc.ack(ADMIN, d.token)
            await eng.checkpoint_now()
            assert _segment_rows(eng) == []  # every message gone: the row goes too
            assert eng.store.db.execute("SELECT count(*) FROM messages").fetchall() == [(0,)]

    ids = asyncio.run(first())
    asyncio.run(again(ids))


def test_a_message_taken_while_its_segment_is_checkpointed_keeps_its_body(tmp_path):
    """The checkpoint copies a changed message's body out of its segment's row in the
    same transaction that may delete that row."""
    async def main():
        async with _node(tmp_path) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {})
            await svc.send(ADMIN, [], ("q", [b"a", b"b"], 0.0))
            await eng.checkpoint_now()
            got = await svc.receive(ADMIN, "q", 0, 2)
            await svc.nack(ADMIN, got[0].token)
            await svc.ack(ADMIN, got[1].token)
            await eng.checkpoint_now()  # both gone from the segment: row deleted, "a" copied out
            assert _segment_rows(eng) == []
            [again] = await svc.receive(ADMIN, "q", 0, 2)
            assert (again.body, again.retry_count) == (b"a", 1)
    asyncio.run(main())


def test_a_batch_consumed_between_checkpoints_leaves_no_bodies_in_memory(tmp_path):
    """A segment whose messages all left before its first checkpoint is never
    written; the checkpoint still lets go of its bodies (each taken message had its
    own copy)."""
    async def main():
        async with _node(tmp_path) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {})
            for _ in range(5):
                await svc.send(ADMIN, [], ("q", [b"x" * 1000] * 10, 0.0))
                for d in await svc.receive(ADMIN, "q", 0, 10):
                    await svc.ack(ADMIN, d.token)
            q = eng.core.queues["q"]
            segs = [e[2] for e in q.seg_retention]
            assert len(segs) == 5 and all(seg.bodies is not None for seg in segs)
            await eng.checkpoint_now()
            assert [seg for seg in segs if seg.bodies is not None] == []
            assert _segment_rows(eng) == []
    asyncio.run(main())
