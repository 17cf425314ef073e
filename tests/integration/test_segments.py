"""Segments in the store: a batch is one row until its messages leave it, and a
restart rebuilds exactly the messages that were there (in-process engine)."""
import asyncio
import contextlib
import threading

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


def _run_judged_by_join(*mains, timeout_s: float = 30) -> dict:
    """Run each coroutine function in ``mains`` with asyncio.run, one after the other,
    in a daemon thread: a node whose event loop spins never ends, so the test judges
    it by the join (and reports any error the runs raised)."""
    out: dict = {}

    def run():
        try:
            for main in mains:
                asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported below
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "the event loop was held"
    assert "error" not in out, out.get("error")
    return out


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


def test_a_checkpoint_comes_early_once_it_has_enough_to_write(tmp_path):
    """What the next checkpoint has to write of the sends since the last one brings
    it forward, long before its interval is up: no commit waits behind one large
    checkpoint (Engine._checkpoint_loop, woken by Engine.apply_upto). A plain
    message counts its body; a batch's message its share of the segment's row, as
    its body stays in the log record (Store._segment_rows)."""
    async def main():
        eng = Engine(str(tmp_path / "n"), checkpoint_interval_s=3600, checkpoint_bytes=64 * 1024)
        await eng.start()
        try:
            svc = Service(eng, ["k"])
            await svc.put_queue(ADMIN, "q", {})
            await svc.send(ADMIN, [], ("q", [b"x" * 1000] * 1000, 0.0))  # a batch: its row, 9 KB
            await svc.send(ADMIN, [("q", b"y" * 1000, 0.0, "")] * 10, None)  # 10 KB of plain messages
            for _ in range(20):
                await asyncio.sleep(0)
            assert _segment_rows(eng) == [] and eng.core.dirty.write_bytes == 9_000 + 10_000
            await svc.send(ADMIN, [("q", b"z" * 1000, 0.0, "")] * 50, None)  # 69 KB in all
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while not _segment_rows(eng) and loop.time() < deadline:
                await asyncio.sleep(0.01)
            assert [n for _, n, _ in _segment_rows(eng)] == [1000]
            assert eng.store.db.execute("SELECT count(*) FROM messages").fetchall() == [(60,)]
            assert eng.core.dirty.write_bytes == 0
        finally:
            await eng.stop()
    asyncio.run(main())


def test_a_checkpoint_comes_early_once_compaction_has_enough_bodies_to_copy(tmp_path):
    """A backlog older than the log's tail: the checkpoint that compacts a record
    copies its bodies into the rows of the segments still naming it (Store.checkpoint).
    Those copies bring the checkpoint forward too (Engine._checkpoint_due), so none
    copies a second of batched sends at once. A segment whose messages all left has
    no row to copy into, and counts nothing."""
    async def main():
        eng = Engine(str(tmp_path / "n"), checkpoint_interval_s=3600, checkpoint_bytes=64 * 1024,
                     log_keep_records=6)
        await eng.start()
        try:
            svc = Service(eng, ["k"])
            await svc.put_queue(ADMIN, "q", {})
            await svc.put_queue(ADMIN, "gone", {})
            await svc.send(ADMIN, [], ("gone", [b"g" * 100_000], 0.0))  # consumed below
            a = eng.core.lsn
            await svc.send(ADMIN, [], ("q", [b"x" * 1000] * 40, 0.0))   # a backlog of 40 KB
            await svc.send(ADMIN, [], ("q", [b"y" * 1000] * 40, 0.0))   # and 40 KB more
            await eng.checkpoint_now()
            assert [(lsn, size) for _, lsn, size in _segment_refs(eng)] == [(a, 0), (a + 1, 0), (a + 2, 0)]
            [d] = await svc.receive(ADMIN, "gone", 0, 1)
            await svc.ack(ADMIN, d.token)
            await eng.checkpoint_now()  # its segment's row goes
            assert [lsn for _, lsn, _ in _segment_refs(eng)] == [a + 1, a + 2]

            async def settle():
                for _ in range(20):
                    await asyncio.sleep(0)

            last = eng._checkpoint_write  # (the write of the last checkpoint taken)
            while eng.store.compaction_point(eng.core.lsn) < a + 1:
                await svc.send(ADMIN, [("q", b"z", 0.0, "")], None)
            await settle()
            # records a and a + 1 are due to go: 40 KB to copy (not the consumed 100 KB)
            assert eng._checkpoint_write is last, "a checkpoint came early"
            assert not eng._checkpoint_due()
            await svc.send(ADMIN, [("q", b"z", 0.0, "")], None)  # a + 2 due too: 80 KB
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while [lsn for _, lsn, _ in _segment_refs(eng)] != [None, None] and loop.time() < deadline:
                await asyncio.sleep(0.01)
            assert [(lsn, size) for _, lsn, size in _segment_refs(eng)] == [(None, 40_000), (None, 40_000)]
            got = await svc.receive(ADMIN, "q", 0, 100)
            assert [d.body for d in got] == [b"x" * 1000] * 40 + [b"y" * 1000] * 40 + [b"z"] * (len(got) - 80)
        finally:
            await eng.stop()
    asyncio.run(main())


def test_copies_due_with_nothing_else_changed_compact_and_never_hold_the_loop(tmp_path):
    """A restart whose log's cut passes a batch still in its queue: the copies are
    due while nothing else changed since the last checkpoint. The loop takes a
    checkpoint that only compacts; it must never go round without awaiting (it
    held the event loop for good in a first version of Engine._checkpoint_due)."""
    out = {}

    async def first():
        eng = Engine(str(tmp_path / "n"), checkpoint_interval_s=3600, log_keep_records=6)
        await eng.start()
        try:
            svc = Service(eng, ["k"])
            await svc.put_queue(ADMIN, "q", {})
            await svc.send(ADMIN, [], ("q", [b"x" * 100_000], 0.0))
            out["lsn"] = eng.core.lsn
            for _ in range(3):
                await svc.send(ADMIN, [("q", b"y", 0.0, "")], None)
            await eng.checkpoint_now()
        finally:
            await eng.stop()

    async def again():
        # fewer records kept: the cut passes the batch's record as soon as it loads
        eng = Engine(str(tmp_path / "n"), checkpoint_interval_s=3600, checkpoint_bytes=64 * 1024,
                     log_keep_records=1)
        await eng.start()
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while _segment_refs(eng) != [(_segment_refs(eng)[0][0], None, 100_000)] and loop.time() < deadline:
                await asyncio.sleep(0.01)
            out["rows"] = [(lsn, size) for _, lsn, size in _segment_refs(eng)]
            got = await Service(eng, ["k"]).receive(ADMIN, "q", 0, 10)
            out["bodies"] = [d.body for d in got]
        finally:
            await eng.stop()

    _run_judged_by_join(first, again, timeout_s=60)
    assert out["rows"] == [(None, 100_000)]  # the row took its bodies in
    assert out["bodies"] == [b"x" * 100_000, b"y", b"y", b"y"]


def test_an_idle_node_with_a_zero_checkpoint_threshold_does_not_hold_the_loop(tmp_path):
    """Nothing to write: the checkpoint loop waits out its interval whatever
    ``checkpoint_bytes`` says (0 made every pass of it due). And a stop right
    after a send that brings a checkpoint forward ends: the loop's wait for that
    wake-up used asyncio.wait_for, which on Python 3.11 lost the stop's
    cancellation when both came in one turn, and the stop waited for ever
    (node/waits.py)."""
    out = {}

    async def main():
        eng = Engine(str(tmp_path / "n"), checkpoint_interval_s=0.05, checkpoint_bytes=0)
        await eng.start()
        try:
            svc = Service(eng, ["k"])
            await svc.put_queue(ADMIN, "q", {})
            await asyncio.sleep(0.3)  # idle: the loop serves meanwhile
            await svc.send(ADMIN, [("q", b"x", 0.0, "")], None)
            out["sent"] = True
        finally:
            await eng.stop()

    _run_judged_by_join(main)
    assert out["sent"]


def _segment_refs(eng):
    return [(seq0, lsn, len(bodies)) for seq0, lsn, bodies in
            eng.store.db.execute("SELECT seq0, lsn, bodies FROM segments ORDER BY seq0")]


def test_a_segment_row_points_at_its_record_until_compaction_copies_its_bodies_in(tmp_path):
    """A batch's bodies are stored once, in its log record: the segment's row points
    there (Store._segment_rows) until the log lets that record go, when the row
    takes them in, in the same transaction (Store.checkpoint). Bodies read right
    throughout, and after restarts on either form."""
    bodies = [b"", b"a" * 127, b"b" * 128, b"c" * 16384, b"d", b"e" * 300]

    async def first():
        async with _node(tmp_path) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {})
            await svc.send(ADMIN, [], ("q", bodies, 0.0))
            lsn = eng.core.lsn
            await eng.checkpoint_now()
            [(seq0, ref, size)] = _segment_refs(eng)
            assert (ref, size) == (lsn, 0)  # no bodies of its own: they are in record lsn
            got = await svc.receive(ADMIN, "q", 0, 2)
            assert [d.body for d in got] == bodies[:2]
            await svc.ack(ADMIN, got[0].token)
            await svc.nack(ADMIN, got[1].token)  # a row of its own: its body copied out of the record
            await eng.checkpoint_now()
            assert eng.store.db.execute("SELECT body FROM messages").fetchall() == [(bodies[1],)]

    async def second():
        async with _node(tmp_path) as (eng, svc):  # loaded with the row pointing at its record
            [seg] = [e[2] for e in eng.core.queues["q"].seg_retention]
            assert seg.pos is not None and seg.lsn > 0
            got = await svc.receive(ADMIN, "q", 0, 1)
            assert [d.body for d in got] == [bodies[1]]
            eng.store.log_keep_records = 1
            await svc.put_queue(ADMIN, "other", {})  # one more record, so the batch's can go
            await eng.checkpoint_now()
            [(_, ref, size)] = _segment_refs(eng)
            assert (ref, size) == (None, sum(map(len, bodies)))  # copied in before the record went
            assert seg.pos is None
            assert eng.store.db.execute("SELECT count(*) FROM log WHERE lsn <= ?", (seg.lsn,)).fetchall() == [(0,)]
            got = await svc.receive(ADMIN, "q", 0, 10)
            assert [d.body for d in got] == bodies[2:]
            for d in got:
                await svc.nack(ADMIN, d.token)

    async def third():
        async with _node(tmp_path) as (eng, svc):
            got = await svc.receive(ADMIN, "q", 0, 10)
            assert sorted(d.body for d in got) == sorted(bodies[1:])

    asyncio.run(first())
    asyncio.run(second())
    asyncio.run(third())


def test_a_read_racing_compaction_finds_the_bodies_in_the_row(tmp_path):
    """Between a checkpoint's commit and the loop's note that a row now holds its
    bodies, a read still aims at the record, which is gone: it reads the row."""
    async def main():
        async with _node(tmp_path) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {})
            await svc.send(ADMIN, [], ("q", [b"x" * 10, b"y" * 20, b"z" * 30], 0.0))
            await eng.checkpoint_now()
            [seg] = [e[2] for e in eng.core.queues["q"].seg_retention]
            pos = seg.pos
            eng.store.log_keep_records = 1
            await svc.put_queue(ADMIN, "other", {})
            await eng.checkpoint_now()
            assert seg.pos is None and _segment_refs(eng)[0][1] is None
            seg.pos = pos  # as the loop saw it before the checkpoint's end was noted
            got = await svc.receive(ADMIN, "q", 0, 3)
            assert [d.body for d in got] == [b"x" * 10, b"y" * 20, b"z" * 30]
    asyncio.run(main())


def test_a_checkpoint_whose_caller_is_cancelled_still_notes_what_it_wrote(tmp_path):
    """A stop cancels the checkpoint loop while its write goes on (shielded): when
    the write is done, the rows that took their bodies in are noted all the same,
    so nothing reads them through a record compacted away."""
    async def main():
        async with _node(tmp_path) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {})
            await svc.send(ADMIN, [], ("q", [b"a" * 10, b"b" * 20], 0.0))
            await eng.checkpoint_now()
            [seg] = [e[2] for e in eng.core.queues["q"].seg_retention]
            assert seg.pos is not None
            [got] = await svc.receive(ADMIN, "q", 0, 1)
            eng.store.log_keep_records = 1
            await svc.put_queue(ADMIN, "other", {})
            task = asyncio.ensure_future(eng.checkpoint_now())
            await asyncio.sleep(0)  # on its way: the write is on the writer thread
            task.cancel()
            w = eng._checkpoint_write
            await asyncio.wait_for(asyncio.shield(w), 10)
            await asyncio.sleep(0)  # the write's done-callback
            assert _segment_refs(eng)[0][1] is None and seg.pos is None
            await svc.nack(ADMIN, got.token)  # its own row, its body copied out of the segment's row
            await eng.checkpoint_now()
            assert eng.store.db.execute("SELECT body FROM messages").fetchall() == [(b"a" * 10,)]
    asyncio.run(main())


def test_the_checkpoint_loop_waits_while_a_snapshot_is_installed(tmp_path):
    """While a snapshot is installed no checkpoint is taken. With enough to write
    waiting, the loop must still wait for its interval instead of spinning on the
    event loop, which would hold it (no heartbeats, no answers; for good, if the
    install then failed)."""
    out = {}

    async def main():
        eng = Engine(str(tmp_path / "n"), checkpoint_interval_s=0.05, checkpoint_bytes=1000)
        await eng.start()
        try:
            svc = Service(eng, ["k"])
            await svc.put_queue(ADMIN, "q", {})
            eng.installing = True
            await svc.send(ADMIN, [("q", b"x" * 5000, 0.0, "")], None)
            await asyncio.sleep(0.3)  # the loop serves meanwhile
            out["rows"] = eng.store.db.execute("SELECT count(*) FROM messages").fetchall()
            eng.installing = False
        finally:
            await eng.stop()

    _run_judged_by_join(main)
    assert out["rows"] == [(0,)]  # and no checkpoint was taken
