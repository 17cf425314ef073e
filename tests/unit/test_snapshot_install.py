"""A replica that installs a primary's copy of the store keeps its own persistent
replication state: its epoch, its vote, the longest lease it answered (R2) and
whether it is still joining. They are written into the copy before the copy
replaces the store, so a crash at any point leaves the node with its own values."""
import os

import apsw
import pytest

from node.engine import Engine, InstallBroken
from node.store.sqlite import Store

KEYS = ("repl_epoch", "voted_for", "lease_seen_us", "joining")


def _primary_copy(tmp_path, dest):
    prim = Store(str(tmp_path / "p" / "spool.db"))
    with prim.db:
        for k, v in zip(KEYS, (9, "n1", 123, 0)):
            prim.set_meta(k, v)
    out = apsw.Connection(dest)
    with out.backup("main", prim.db, "main") as b:
        b.step(-1)
    out.close()
    prim.close()


def _meta(path):
    s = Store(path)
    try:
        return tuple(s.get_meta(k) for k in KEYS)
    finally:
        s.close()


def _ours_and_a_copy(tmp_path):
    """A node whose store holds our values (KEYS), and a primary's copy holding its own."""
    eng = Engine(str(tmp_path / "n"))
    with eng.store.db:
        for k, v in zip(KEYS, (7, "n2", 5_000_000, 1)):
            eng.store.set_meta(k, v)
    copy = str(tmp_path / "n" / "snapshot-incoming.db")
    _primary_copy(tmp_path, copy)
    return eng, copy


def test_the_copy_holds_our_values_before_it_replaces_our_store(tmp_path, monkeypatch):
    eng, copy = _ours_and_a_copy(tmp_path)

    def crash(*_):
        raise OSError("the process dies here")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(InstallBroken) as e:  # past closing our store: the node stops (S9)
        eng.install_snapshot_sync(copy)
    assert isinstance(e.value.__cause__, OSError)
    # the file that would replace the store holds them itself, with no -wal beside it
    # (os.replace moves only the main file)
    assert not os.path.exists(copy + "-wal")
    alone = str(tmp_path / "alone.db")
    with open(copy, "rb") as src, open(alone, "wb") as dst:
        dst.write(src.read())
    assert _meta(alone) == (7, "n2", 5_000_000, 1)


def test_a_value_we_never_had_is_not_taken_from_the_primary(tmp_path):
    eng = Engine(str(tmp_path / "n"))  # a store of an older build: no lease_seen_us, never joining
    with eng.store.db:
        eng.store.set_meta("repl_epoch", 7)
        eng.store.set_meta("voted_for", "n2")
    copy = str(tmp_path / "n" / "snapshot-incoming.db")
    _primary_copy(tmp_path, copy)
    eng.install_snapshot_sync(copy)
    assert tuple(eng.store.get_meta(k) for k in KEYS) == (7, "n2", 0, None)
    eng.store.close()


# --- races around an install (found by a review; each fails without its mechanism) -------

import asyncio  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import node.engine as engine_mod  # noqa: E402
from node.replication.driver import SNAPSHOT_INCOMING, snapshot_chunks  # noqa: E402
from spooler.pb import log_pb2, replication_pb2 as pb  # noqa: E402

PEERS = {"n1": "127.0.0.1:1", "n2": "127.0.0.1:2", "n3": "127.0.0.1:3"}


async def _primary_snapshot(d, queue, n, size, path):
    """A single node's store holding ``queue`` with n messages, copied to ``path``."""
    e = Engine(d)
    await e.start()
    await e.propose(log_pb2.Record(queue_put=log_pb2.QueuePut(name=queue)))
    for i in range(n):
        rec = log_pb2.Record()
        rec.send.entries.add(queue=queue, id=f"{queue}-{i}", body=os.urandom(size))
        await e.propose(rec)
    await e.checkpoint_now()
    await e.snapshot_to(path)
    pos = e.store.applied_position()
    await e.stop()
    return pos


async def _replica(d):
    r = Engine(d, node_id="n3", peers=PEERS)
    await r.store_io(r.load)
    await r.store_io(r.repl.load)
    return r


def _chunks(path, epoch, primary, last_marked=True, digest=True, changed_at=None, chunk_bytes=1 << 16,
            sent=None):
    """``path`` as a primary of this build streams it (snapshot_chunks), at the
    network's pace. ``digest=False``: as a primary before 0.4.45 (no digest).
    ``changed_at``: that byte of the file arrives changed (after the primary
    hashed it), as a copy damaged on its way would. ``sent``: a list that gets
    each chunk's size as it goes."""
    async def gen():
        offset = 0
        async for ch in snapshot_chunks(path, epoch, primary, chunk_bytes=chunk_bytes):
            if changed_at is not None and offset <= changed_at < offset + len(ch.data):
                data = bytearray(ch.data)
                data[changed_at - offset] ^= 0x01
                ch.data = bytes(data)
            offset += len(ch.data)
            ch.last = ch.last and last_marked
            if not digest:
                ch.ClearField("sha256")
            if sent is not None:
                sent.append(len(ch.data))
            yield ch
            await asyncio.sleep(0.01)  # the network's pace: another stream interleaves
    return gen()


def test_two_snapshots_streamed_at_once_install_one_whole_copy(tmp_path):
    """Two primaries (a deposed one and its successor) stream copies to one
    replica at once: each stream has a file of its own, so what is installed is
    one whole copy, never a byte mix of both or an empty store, and the
    replication core's log matches the store it holds."""
    async def main():
        a, b = str(tmp_path / "A.db"), str(tmp_path / "B.db")
        await _primary_snapshot(str(tmp_path / "pa"), "qa", 12, 200_000, a)
        await _primary_snapshot(str(tmp_path / "pb"), "qb", 12, 200_000, b)
        r = await _replica(str(tmp_path / "r"))
        try:
            acks = await asyncio.gather(r.repl.serve_snapshot(_chunks(a, 5, "n1"), None),
                                        r.repl.serve_snapshot(_chunks(b, 6, "n2"), None))
            assert any(x.ok for x in acks), acks
            assert r.store.integrity_check() == "ok"
            held = sorted(q[0] for q in r.store.load_queues())
            assert held in (["qa"], ["qb"]) and sorted(r.core.queues) == held, held
            assert r.repl.core.log.last_lsn == r.core.lsn == r.store.applied_position().lsn
            assert not [n for n in os.listdir(r.data_dir) if n.startswith("snapshot-incoming")]
        finally:
            await r.stop()

    asyncio.run(main())


def _serve_a_small_copy(tmp_path, check, **chunks):
    """A primary's copy holding queue qa (3 messages) streamed to a fresh replica
    (``chunks``: _chunks' options); ``check(ack, replica)`` then."""
    async def main():
        a = str(tmp_path / "A.db")
        await _primary_snapshot(str(tmp_path / "pa"), "qa", 3, 1000, a)
        r = await _replica(str(tmp_path / "r"))
        try:
            check(await r.repl.serve_snapshot(_chunks(a, 5, "n1", **chunks), None), r)
        finally:
            await r.stop()

    asyncio.run(main())


def test_a_snapshot_stream_that_ends_before_its_last_chunk_installs_nothing(tmp_path):
    def check(ack, r):
        assert not ack.ok
        assert sorted(r.core.queues) == [] and [q[0] for q in r.store.load_queues()] == []
        assert not [n for n in os.listdir(r.data_dir) if n.startswith("snapshot-incoming")]

    _serve_a_small_copy(tmp_path, check, last_marked=False)


def test_a_checkpoint_taken_while_a_snapshot_is_installed_is_not_written_into_it(tmp_path, monkeypatch):
    """The writer thread replaces the store, then the core; a checkpoint the loop
    takes in between holds the old core's changes and must not land in the new
    store (it would overwrite the copy's applied position and add the old
    core's queues). Here opening the new store is slowed to hold that window
    open, on both ways in: the driver's (which takes no checkpoint while it
    installs) and a bare install (whose old checkpoint is stamped with the old
    generation and skipped)."""
    async def main(via_driver):
        d = tmp_path / ("drv" if via_driver else "bare")
        snap = str(d / "copy.db")
        os.makedirs(d / "r")
        ppos = await _primary_snapshot(str(d / "p"), "from_primary", 5, 100, snap)
        r = await _replica(str(d / "r"))
        try:
            r.core.apply(log_pb2.Record(epoch=1, lsn=1, ts_us=int(time.time() * 1e6),
                                        queue_put=log_pb2.QueuePut(name="stale")))
            assert "stale" in r.core.dirty.queues
            real = engine_mod.Store
            installing, go = threading.Event(), threading.Event()

            def slow(path, *a, **kw):
                if path.endswith("spool.db"):
                    installing.set()
                    go.wait(10)  # held until the checkpoint below is on its way (or declined)
                return real(path, *a, **kw)

            monkeypatch.setattr(engine_mod, "Store", slow)
            if via_driver:
                inst = asyncio.ensure_future(r.repl.serve_snapshot(_chunks(snap, 5, "n1"), None))
            else:
                inst = asyncio.ensure_future(r.store_io(r.install_snapshot_sync, snap))
            assert await asyncio.to_thread(installing.wait, 10)  # the install is under way
            ckpt = asyncio.ensure_future(r.checkpoint_now())
            # the window held open: until the checkpoint's write waits behind the
            # install on the writer thread (a bare install), or it declined (the driver's)
            deadline = time.monotonic() + 10
            while not ckpt.done() and r._io_jobs < 2:
                assert time.monotonic() < deadline, "the checkpoint neither queued nor declined"
                await asyncio.sleep(0.005)
            go.set()
            await inst
            await ckpt
            monkeypatch.setattr(engine_mod, "Store", real)
            assert r.store.applied_position() == ppos
            assert [q[0] for q in r.store.load_queues()] == ["from_primary"]
        finally:
            await r.stop()

    asyncio.run(main(True))
    asyncio.run(main(False))


def test_no_checkpoint_is_taken_while_an_install_runs(tmp_path):
    """While the writer thread loads the new core (replaying the copy's log, which
    marks changes to be checkpointed), a checkpoint on the loop would take those
    marks away and, stamped with the old generation, write none of them: they
    would be lost from the store once the log behind them was compacted. So the
    engine takes no checkpoint at all while an install runs; its changes wait."""
    async def main():
        r = await _replica(str(tmp_path / "r"))
        try:
            r.core.apply(log_pb2.Record(epoch=1, lsn=1, ts_us=int(time.time() * 1e6),
                                        queue_put=log_pb2.QueuePut(name="pending")))
            r.installing = True
            await r.checkpoint_now()
            assert "pending" in r.core.dirty.queues, "a checkpoint ran during an install"
            assert r.store.applied_position().lsn == 0
            r.installing = False
            await r.checkpoint_now()
            assert [q[0] for q in r.store.load_queues()] == ["pending"]
        finally:
            await r.stop()

    asyncio.run(main())


def test_a_snapshot_is_made_in_slices_that_commits_run_between(tmp_path, monkeypatch):
    """Copying a large store for a replica does not hold the writer thread for the
    whole copy: a commit made while the copy is under way is done before the copy
    is, and the copy is a whole, consistent store."""
    async def main():
        monkeypatch.setattr(engine_mod, "SNAPSHOT_STEP_PAGES", 16)
        e = Engine(str(tmp_path / "p"))
        await e.start()
        try:
            await e.propose(log_pb2.Record(queue_put=log_pb2.QueuePut(name="q")))
            for i in range(20):
                rec = log_pb2.Record()
                rec.send.entries.add(queue="q", id=f"m-{i}", body=os.urandom(100_000))
                await e.propose(rec)
            await e.checkpoint_now()
            order = []
            real_step = e.snapshot_step

            def step(b, pages):
                done = real_step(b, pages)
                order.append("copied" if done else "slice")
                return done

            e.snapshot_step = step
            path = str(tmp_path / "copy.db")
            copying = asyncio.ensure_future(e.snapshot_to(path))
            deadline = asyncio.get_running_loop().time() + 10
            while not order:
                assert asyncio.get_running_loop().time() < deadline, "the copy never took a step"
                await asyncio.sleep(0.001)
            rec = log_pb2.Record()
            rec.send.entries.add(queue="q", id="during", body=b"x")
            await e.propose(rec)
            order.append("commit")
            committed = (await e.store_io(e.store.last_position)).lsn
            await copying
            assert order.count("slice") > 1 and order.index("commit") < order.index("copied"), order
            copy = Store(path)
            try:
                assert copy.integrity_check() == "ok"
                assert copy.last_position().lsn >= committed   # with the commit made during the copy
            finally:
                copy.close()
        finally:
            await e.stop()

    asyncio.run(main())


def test_a_store_whose_wal_cannot_be_folded_into_its_file_is_not_replaced(tmp_path, monkeypatch):
    """The install deletes our WAL before the copy takes our file's place. Closing
    our store folds the WAL into the file only when it can (not while another
    connection reads the file, nor after an I/O error) and says nothing when it
    cannot, so the install folds it first and checks: a WAL it cannot fold leaves
    our store as it was, open, and the install is refused. Without that check, a
    crash between deleting the WAL and the copy's rename lost every write the WAL
    held (here: the rename fails)."""
    eng = Engine(str(tmp_path / "n"))
    with eng.store.db:
        eng.store.set_meta("repl_epoch", 7)  # committed: in the WAL
    copy = str(tmp_path / "n" / "snapshot-incoming.db")
    _primary_copy(tmp_path, copy)
    reader = apsw.Connection(str(tmp_path / "n" / "spool.db"))  # say, an operator's sqlite3 shell
    rows = reader.execute("SELECT k FROM meta")
    next(rows)  # a read transaction open on the WAL
    eng.store.db.setbusytimeout(50)

    def crash(*_):
        raise OSError("the process dies here")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(apsw.BusyError):  # before the point of no return: not InstallBroken
        eng.install_snapshot_sync(copy)
    assert eng.store.get_meta("repl_epoch") == 7  # still open and whole
    rows.close()
    reader.close()
    eng.store.close()
    assert _meta(str(tmp_path / "n" / "spool.db"))[0] == 7  # and so is the file, alone


def test_an_install_that_fails_after_closing_the_store_stops_the_node_and_one_before_is_refused(
        tmp_path, monkeypatch):
    """S9 for a snapshot install: a failure once our store is closed (a rename,
    the new file's open or load) leaves the node no store to serve from: it
    stops, as after any failed write. A failure before (a copy that is not a
    store, a WAL it cannot fold) leaves our store as it was: the install is
    refused, the node goes on, and the primary sends a copy again later."""
    async def main():
        a = str(tmp_path / "A.db")
        await _primary_snapshot(str(tmp_path / "pa"), "qa", 3, 1000, a)
        bad = str(tmp_path / "bad.db")
        with open(bad, "wb") as f:
            f.write(b"not a database, " * 512)
        r = await _replica(str(tmp_path / "r"))
        stopped = []
        r.on_fatal = stopped.append
        try:
            ack = await r.repl.serve_snapshot(_chunks(bad, 5, "n1"), None)
            assert not ack.ok and r.failed is None and not stopped
            await r.store_io(r.repl._persist, 5, "", 0)  # our store still takes writes
            assert r.store.get_meta("repl_epoch") == 5
            # a whole copy, refused as our WAL cannot be folded (a tool reads our file):
            # nothing of the copy is left behind, its WAL and shared memory neither
            reader = apsw.Connection(os.path.join(r.data_dir, "spool.db"))
            rows = reader.execute("SELECT k FROM meta")
            next(rows)
            r.store.db.setbusytimeout(50)
            ack = await r.repl.serve_snapshot(_chunks(a, 5, "n1"), None)
            rows.close()
            reader.close()
            assert not ack.ok and r.failed is None and not stopped
            assert not [n for n in os.listdir(r.data_dir) if n.startswith("snapshot-incoming")]
            assert r.store.get_meta("repl_epoch") == 5

            def crash(*_):
                raise OSError("EIO")
            monkeypatch.setattr(os, "replace", crash)
            with pytest.raises(InstallBroken):
                await r.repl.serve_snapshot(_chunks(a, 6, "n1"), None)
            assert isinstance(r.failed, InstallBroken) and stopped == [r.failed]
        finally:
            monkeypatch.undo()
            await r.stop()

    asyncio.run(main())



def test_our_values_written_into_the_copy_are_in_its_file_before_it_is_installed(tmp_path, monkeypatch):
    """Our epoch, vote, lease and joining mark go into the copy through its WAL;
    the rename moves only the copy's main file. Closing the copy folds its WAL
    into the file only when it can (not after an I/O error of that checkpoint,
    nor while another connection has the file open) and says nothing when it
    cannot, keeping the WAL: the install must fold and check the copy's WAL as
    it does our own store's, and refuse the copy when it cannot. Otherwise the
    node goes on (and restarts) with the primary's vote and epoch in place of
    its own. Here closing the copy skips its checkpoint (what a failed one
    leaves: the WAL, and no error)."""
    eng, copy = _ours_and_a_copy(tmp_path)
    close = Store.close

    def close_without_checkpoint(self):
        if self.path == copy:
            self.db.config(apsw.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1)
        close(self)
    monkeypatch.setattr(Store, "close", close_without_checkpoint)
    try:
        eng.install_snapshot_sync(copy)
    except Exception:
        pass  # refused, or stopped: what the node runs with, and a restart finds, is below
    monkeypatch.undo()
    installed = tuple(eng.store.get_meta(k) for k in KEYS)
    eng.store.close()
    assert installed == (7, "n2", 5_000_000, 1)
    assert _meta(str(tmp_path / "n" / "spool.db")) == (7, "n2", 5_000_000, 1)


def test_a_refused_copy_leaves_neither_its_file_nor_its_wal_behind(tmp_path, monkeypatch):
    """A copy refused because its WAL cannot be folded (our values are written into
    it through that WAL) keeps the WAL, and closing it leaves the WAL on disk: the
    install removes the copy's file, WAL and shared memory, so a refused copy leaves
    nothing in the data directory (the primary sends another later, under a new name)."""
    async def main():
        a = str(tmp_path / "A.db")
        await _primary_snapshot(str(tmp_path / "pa"), "qa", 3, 1000, a)
        r = await _replica(str(tmp_path / "r"))
        incoming = os.path.join(r.data_dir, SNAPSHOT_INCOMING)
        fold, close = Store.fold_wal, Store.close

        def fold_fails_for_the_copy(self):
            if self.path.startswith(incoming):
                raise apsw.BusyError("the copy's WAL cannot be folded")
            return fold(self)

        def close_keeps_the_copys_wal(self):
            if self.path.startswith(incoming):
                self.db.config(apsw.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1)
                leftover.append(self.path)
            close(self)
        leftover: list = []
        monkeypatch.setattr(Store, "fold_wal", fold_fails_for_the_copy)
        monkeypatch.setattr(Store, "close", close_keeps_the_copys_wal)
        try:
            ack = await r.repl.serve_snapshot(_chunks(a, 5, "n1"), None)
            assert not ack.ok and r.failed is None
            assert leftover  # the copy was opened, written to, and closed with its WAL kept
            assert not [n for n in os.listdir(r.data_dir) if n.startswith(SNAPSHOT_INCOMING)], \
                os.listdir(r.data_dir)
            await r.store_io(r.repl._persist, 5, "", 0)  # our store is as it was, and takes writes
            assert r.store.get_meta("repl_epoch") == 5
        finally:
            monkeypatch.undo()
            await r.stop()

    asyncio.run(main())


def test_our_store_failing_its_fsync_while_folding_its_wal_stops_the_node(tmp_path, monkeypatch):
    """S9: before a copy is installed, our WAL is folded into our file, which
    fsyncs it. A write or fsync of our own file that fails there is our store
    failing, not a copy to refuse: the node stops (status 70), as after any
    failed write. It was refused as a bad copy, and the node went on confirming
    writes on a store whose fsync had failed (found by a review). A reader
    holding the WAL is still a refusal (the test above)."""
    async def main():
        a = str(tmp_path / "A.db")
        await _primary_snapshot(str(tmp_path / "pa"), "qa", 3, 1000, a)
        r = await _replica(str(tmp_path / "r"))
        stopped = []
        r.on_fatal = stopped.append
        ours = os.path.join(r.data_dir, "spool.db")
        fold = Store.fold_wal

        def failing_fsync(self):
            if self.path == ours:
                raise apsw.IOError("disk I/O error (fsync)")
            return fold(self)
        monkeypatch.setattr(Store, "fold_wal", failing_fsync)
        try:
            with pytest.raises(InstallBroken):
                await r.repl.serve_snapshot(_chunks(a, 6, "n1"), None)
            assert isinstance(r.failed, InstallBroken) and stopped == [r.failed]
            assert isinstance(r.failed.__cause__, apsw.IOError)
        finally:
            monkeypatch.undo()
            await r.stop()

    asyncio.run(main())


async def _sends_then_a_copy_then_more(p, early, after_each=None):
    """Start primary ``p``: queue q, five sends, a checkpoint and a copy of it to
    ``early``, then five more sends (``after_each(i)`` after each). Returns the
    lsn the copy's checkpoint applied."""
    await p.start()
    await p.propose(log_pb2.Record(queue_put=log_pb2.QueuePut(name="q")))
    for i in range(5):
        rec = log_pb2.Record()
        rec.send.entries.add(queue="q", id=f"a{i}", body=b"x" * 100)
        await p.propose(rec)
    await p.checkpoint_now()
    await p.snapshot_to(early)
    k = p.store.applied_position().lsn
    for i in range(5):
        rec = log_pb2.Record()
        rec.send.entries.add(queue="q", id=f"b{i}", body=b"y" * 100)
        await p.propose(rec)
        if after_each is not None:
            await after_each(i)
    return k


def test_a_late_copy_that_our_log_holds_and_passes_is_not_installed_over_it(tmp_path):
    """A copy made before records this replica has since stored (and may have
    acknowledged, so the primary counted it for them) arrives late: the replica
    keeps its log and answers with the copy's end, as a raft follower keeps the
    entries after a snapshot its log holds. A copy of another history that ends
    before our log's end is still installed."""
    async def main():
        early, mid, full, other = (str(tmp_path / f"{n}.db") for n in ("early", "mid", "full", "other"))
        p = Engine(str(tmp_path / "p"))
        k2 = None

        async def after_the_second(i):
            nonlocal k2
            if i == 1:
                await p.snapshot_to(mid)
                k2 = p.store.last_position().lsn

        k = await _sends_then_a_copy_then_more(p, early, after_each=after_the_second)
        after = p.store.records_after(k)
        m = after[-1][0]
        await p.checkpoint_now()
        await p.snapshot_to(full)
        await p.stop()
        # another history: ends between k and m, its record there differs from ours
        o_end = await _primary_snapshot(str(tmp_path / "o"), "other", 7, 100, other)

        r = await _replica(str(tmp_path / "r"))
        try:
            assert (await r.repl.serve_snapshot(_chunks(early, 5, "n1"), None)).ok
            assert r.store.last_position().lsn == k
            # frames stored after it, not yet applied (no commit point heard for them)
            await r.store_io(r.store.append, after)
            assert r.store.last_position().lsn == m > r.core.lsn == k

            # late copies: one ending at what we applied, one past it, at a record we hold
            for copy, end in ((early, k), (mid, k2)):
                ack = await r.repl.serve_snapshot(_chunks(copy, 5, "n1"), None)
                assert ack.ok and ack.last_lsn == end, ack
                assert r.core.lsn == k <= end < m
                assert [row[0] for row in r.store.records_after(k)] == list(range(k + 1, m + 1))

            assert k < o_end.lsn < m, (k, o_end, m)
            ack = await r.repl.serve_snapshot(_chunks(other, 5, "n1"), None)
            assert ack.ok and ack.last_lsn == o_end.lsn, ack
            assert [q[0] for q in r.store.load_queues()] == ["other"]
        finally:
            await r.stop()

        # a replica that applied past the copy's end and has trimmed its log since
        # (no record at the copy's end to compare): what it applied is committed
        r = Engine(str(tmp_path / "r2"), node_id="n3", peers=PEERS, log_keep_records=1)
        await r.store_io(r.load)
        await r.store_io(r.repl.load)
        try:
            assert (await r.repl.serve_snapshot(_chunks(full, 5, "n1"), None)).ok
            await r.checkpoint_now()
            assert r.core.lsn == m
            assert not [row for row in r.store.records_after(0) if row[0] <= k]  # trimmed
            ack = await r.repl.serve_snapshot(_chunks(early, 5, "n1"), None)
            assert ack.ok and ack.last_lsn == k, ack
            assert r.core.lsn == m and r.store.last_position().lsn == m
        finally:
            await r.stop()

    asyncio.run(main())


def test_a_late_copy_that_ends_where_our_log_ends_does_not_take_our_applied_state_back(tmp_path):
    """A copy whose log ends at our log's last record (same lsn, epoch and
    checksum) but that applied less than we did (its checkpoint is older) is
    not installed: it would only take what we applied back, until the commit
    point next moves. A copy ending there that applied more than we did is
    installed, and so is one of another history."""
    async def main():
        early, late, full, other = (str(tmp_path / f"{n}.db") for n in ("early", "late", "full", "other"))
        p = Engine(str(tmp_path / "p"))
        k = await _sends_then_a_copy_then_more(p, early)
        await p.snapshot_to(late)  # its log ends at m, its checkpoint at k
        assert p.store.applied_position().lsn == k
        after = p.store.records_after(k)
        m = after[-1][0]
        await p.checkpoint_now()
        await p.snapshot_to(full)  # its log ends at m, its checkpoint at m
        await p.stop()
        o_end = await _primary_snapshot(str(tmp_path / "o"), "other", 10, 100, other)

        r = await _replica(str(tmp_path / "r"))
        try:
            assert (await r.repl.serve_snapshot(_chunks(early, 5, "n1"), None)).ok
            await r.store_io(r.store.append, after)  # stored, not applied (no commit point heard)
            assert r.store.last_position().lsn == m > r.core.lsn == k

            # ends where our log ends (its last record is ours), applied as much as we did (k): kept out
            ack = await r.repl.serve_snapshot(_chunks(late, 5, "n1"), None)
            assert ack.ok and ack.last_lsn == m, ack
            assert r.core.lsn == k and r.store.last_position().lsn == m

            # ends there too and applied more than we did: installed
            ack = await r.repl.serve_snapshot(_chunks(full, 5, "n1"), None)
            assert ack.ok and ack.last_lsn == m, ack
            assert r.core.lsn == m and r.core.queues["q"].size == 10

            # ends there, applied less than we did now: kept out, nothing we applied goes back
            ack = await r.repl.serve_snapshot(_chunks(late, 5, "n1"), None)
            assert ack.ok and ack.last_lsn == m, ack
            assert r.core.lsn == m and r.core.queues["q"].size == 10
            assert r.store.applied_position().lsn == m and r.store.last_position().lsn == m
            await r.checkpoint_now()
            assert r.store.applied_position().lsn == m

            # another history ending at our log's end (its last record is not ours): installed
            assert o_end.lsn == m and o_end != r.store.last_position(), (o_end, m)
            ack = await r.repl.serve_snapshot(_chunks(other, 5, "n1"), None)
            assert ack.ok and ack.last_lsn == m, ack
            assert [q[0] for q in r.store.load_queues()] == ["other"]
            assert r.core.lsn == m and "q" not in r.core.queues
        finally:
            await r.stop()

    asyncio.run(main())


def test_a_copy_changed_on_its_way_is_refused_and_the_same_copy_whole_is_installed(tmp_path, caplog):
    """A byte of a message's body changed between the primary's copy and the
    replica's file: the copy is still a store (it passes every check of an
    install), so only the digest the primary sent tells. Refused, the node's
    store unchanged and nothing of the copy left; the copy as it was, installed."""
    async def main():
        a = str(tmp_path / "A.db")
        p = Engine(str(tmp_path / "pa"))
        await p.start()
        await p.propose(log_pb2.Record(queue_put=log_pb2.QueuePut(name="qa")))
        body = b"the body of the one message, " * 40
        rec = log_pb2.Record()
        rec.send.entries.add(queue="qa", id="m1", body=body)
        await p.propose(rec)
        await p.checkpoint_now()
        await p.snapshot_to(a)
        await p.stop()
        with open(a, "rb") as f:
            whole = f.read()
        at = whole.index(body) + 100
        assert at < len(whole) - 4096  # a chunk before the last (the digest covers every chunk)
        r = await _replica(str(tmp_path / "r"))
        try:
            sent = []
            ack = await r.repl.serve_snapshot(_chunks(a, 5, "n1", changed_at=at, chunk_bytes=4096, sent=sent), None)
            assert not ack.ok and len(sent) > 2
            assert "does not hash to the digest" in caplog.text  # (what the drills count: drills/cluster.py)
            assert sorted(r.core.queues) == [] and [q[0] for q in r.store.load_queues()] == []
            assert r.store.integrity_check() == "ok"
            assert not [n for n in os.listdir(r.data_dir) if n.startswith(SNAPSHOT_INCOMING)]

            ack = await r.repl.serve_snapshot(_chunks(a, 5, "n1"), None)
            assert ack.ok
            q = r.core.queues["qa"]
            assert r.bodies_of([q.msgs["m1"]]) == [body]
        finally:
            await r.stop()

    asyncio.run(main())


def test_a_copy_from_a_primary_that_sends_no_digest_is_installed(tmp_path, caplog):
    """A primary before 0.4.45 sends no digest: its copy is installed, checked as
    a store only (a rolling upgrade may upgrade the replicas first)."""
    caplog.set_level("INFO", logger="spooler.replication")

    def check(ack, r):
        assert ack.ok and sorted(r.core.queues) == ["qa"]
        assert "came without a digest" in caplog.text

    _serve_a_small_copy(tmp_path, check, digest=False)
