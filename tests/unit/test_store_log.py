"""The store's log tail: compaction bounds it in records and in bytes."""
import os

import pytest

from node.store.sqlite import CheckpointData, Store


def _checkpoint(st: Store, applied: int) -> None:
    c = CheckpointData(lsn=applied, epoch=1, crc=0, next_seq=0, queues=[], msgs_put=[], msgs_del=[],
                       segs_put=[], segs_gone=[], segs_del=[], dedup=[], keys=[])
    c.compact_upto = st.compaction_point(applied)
    st.checkpoint(c)


def _append(st: Store, first: int, n: int, size: int) -> None:
    st.append([(lsn, 1, 0, bytes([lsn % 251]) * size) for lsn in range(first, first + n)])


def _log(st: Store) -> tuple:
    (lo, hi, total, n), = st.db.execute("SELECT min(lsn), max(lsn), coalesce(sum(length(rec)), 0), count(*) FROM log")
    return lo, hi, total, n


@pytest.fixture
def store(tmp_path):
    st = Store(os.path.join(str(tmp_path), "spool.db"), log_keep_records=100_000, log_keep_bytes=10_000)
    yield st
    st.close()


def test_the_applied_tail_is_bounded_in_bytes(store):
    _append(store, 1, 50, 1000)
    _checkpoint(store, 50)
    assert _log(store) == (41, 50, 10_000, 10)
    # records after the applied point are never compacted, whatever their size
    _append(store, 51, 20, 5000)
    _checkpoint(store, 60)
    lo, hi, total, n = _log(store)
    assert (lo, hi) == (59, 70)
    assert store.log_bytes() == total == 12 * 5000


def test_the_record_count_still_bounds_a_tail_of_small_records(tmp_path):
    st = Store(os.path.join(str(tmp_path), "spool.db"), log_keep_records=5, log_keep_bytes=10_000)
    _append(st, 1, 30, 10)
    _checkpoint(st, 30)
    assert _log(st) == (26, 30, 50, 5)
    st.close()


def test_the_last_applied_record_stays_however_large(tmp_path):
    st = Store(os.path.join(str(tmp_path), "spool.db"), log_keep_records=100, log_keep_bytes=100)
    _append(st, 1, 3, 1000)
    _checkpoint(st, 3)
    assert _log(st) == (3, 3, 1000, 1)
    assert st.last_position().lsn == 3
    st.close()


def test_the_sizes_are_read_back_when_the_store_opens(tmp_path):
    path = os.path.join(str(tmp_path), "spool.db")
    st = Store(path, log_keep_records=100_000, log_keep_bytes=10_000)
    _append(st, 1, 8, 1000)
    _checkpoint(st, 8)  # 8,000 bytes: nothing compacted yet
    st.close()
    st = Store(path, log_keep_records=100_000, log_keep_bytes=10_000)
    assert st.log_bytes() == 8000
    _append(st, 9, 4, 1000)
    _checkpoint(st, 12)
    assert _log(st) == (3, 12, 10_000, 10)
    st.close()


def test_a_truncation_leaves_the_sizes_in_step(store):
    _append(store, 1, 20, 1000)
    store.truncate_log(15)
    assert store.log_bytes() == 15_000
    _append(store, 16, 10, 2000)
    _checkpoint(store, 25)
    # behind 25: 10 records of 2,000 bytes would be 20,000; 5 of them fit
    assert _log(store) == (21, 25, 10_000, 5)
    # never behind the checkpoint: applied records stay (segment rows may name them)
    with pytest.raises(RuntimeError, match="behind the checkpoint at 25"):
        store.truncate_log(24)
    assert _log(store) == (21, 25, 10_000, 5) and store.log_bytes() == 10_000


def test_a_truncation_to_the_start_empties_a_log_never_checkpointed(store):
    _append(store, 1, 20, 1000)
    store.truncate_log(0)  # everything (a resync back to the start)
    assert store.log_bytes() == 0 and _log(store)[3] == 0
    _append(store, 1, 3, 100)
    assert store.log_bytes() == 300


def test_the_wal_file_shrinks_back_after_a_large_transaction(tmp_path):
    path = os.path.join(str(tmp_path), "spool.db")
    st = Store(path, wal_keep_bytes=1 << 20)
    st.append([(1, 1, 0, os.urandom(6 << 20))])  # SQLite checkpoints the WAL after this commit
    assert os.path.getsize(path + "-wal") > 6 << 20
    st.append([(2, 1, 0, b"x")])  # the WAL starts over, and its file is cut back
    assert os.path.getsize(path + "-wal") <= 1 << 20
    st.close()


def _copy_as_after_a_crash(src: str, dst: str) -> None:
    """The files as a kill -9 would leave them: the open store's db and WAL, not closed."""
    import shutil
    for suffix in ("", "-wal"):
        shutil.copyfile(src + suffix, dst + suffix)


def test_a_new_store_has_its_wal_at_working_size_and_commits_overwrite_it(tmp_path):
    from node.store.sqlite import WAL_PREFILL_BYTES
    path = os.path.join(str(tmp_path), "spool.db")
    st = Store(path)
    assert os.path.getsize(path + "-wal") == WAL_PREFILL_BYTES
    _append(st, 1, 500, 300)  # 500 commits: each writes inside the file, none grows it
    _append(st, 501, 1, 300)
    for lsn in range(502, 1002):
        st.append([(lsn, 1, 0, b"r" * 300)])
    assert os.path.getsize(path + "-wal") == WAL_PREFILL_BYTES
    # the zeros past the last frame are never read as records: a copy taken
    # without closing (as after a crash) opens with every record and no other
    other = os.path.join(str(tmp_path), "copy.db")
    _copy_as_after_a_crash(path, other)
    st.close()
    st2 = Store(other)
    assert _log(st2) == (1, 1001, 1001 * 300, 1001)
    st2.close()


def test_the_prefill_never_goes_past_the_size_the_wal_is_cut_back_to(tmp_path):
    path = os.path.join(str(tmp_path), "spool.db")
    st = Store(path, wal_keep_bytes=1 << 20)
    assert os.path.getsize(path + "-wal") == 1 << 20
    st.close()


def test_a_log_that_is_not_the_checkpoint_s_is_refused_when_the_store_opens(tmp_path):
    """load() checks the log against what the checkpoint applied (the record at
    the applied lsn: its epoch and chained checksum) and each record it replays
    against the chain: a store whose tables and log part ways does not start."""
    import asyncio

    import apsw

    from node.engine import CorruptStore, Engine
    from spooler.pb import log_pb2

    d = str(tmp_path / "n")

    async def fill():
        e = Engine(d)
        await e.start()
        await e.propose(log_pb2.Record(queue_put=log_pb2.QueuePut(name="q")))
        for i in range(4):
            rec = log_pb2.Record()
            rec.send.entries.add(queue="q", id=f"m{i}", body=b"x")
            await e.propose(rec)
        await e.stop()
    asyncio.run(fill())

    def opens() -> str:
        e = Engine(d)
        try:
            e.load()
            return "ok"
        except CorruptStore as err:  # (what node.main turns into exit 70)
            return str(err)
        finally:
            e.store.close()

    assert opens() == "ok"
    db = apsw.Connection(os.path.join(d, "spool.db"))
    (applied,), = db.execute("SELECT v FROM meta WHERE k = 'applied_lsn'")
    applied = int(applied)
    (crc,), = db.execute("SELECT crc FROM log WHERE lsn = ?", (applied,))
    db.execute("UPDATE log SET crc = ? WHERE lsn = ?", (crc + 1, applied))
    db.close()
    assert "is not the one the checkpoint applied" in opens()

    db = apsw.Connection(os.path.join(d, "spool.db"))
    db.execute("UPDATE log SET crc = ? WHERE lsn = ?", (crc, applied))
    # the checkpoint one record back (as if the last had not been applied): that
    # record is replayed, and its bytes no longer chain to its checksum
    (prev_epoch, prev_crc), = db.execute("SELECT epoch, crc FROM log WHERE lsn = ?", (applied - 1,))
    for k, v in (("applied_lsn", applied - 1), ("applied_epoch", prev_epoch), ("applied_crc", prev_crc)):
        db.execute("UPDATE meta SET v = ? WHERE k = ?", (v, k))
    # (that record, the send of m3, replayed over tables that hold m3 already,
    # would make it twice: refused as well)
    assert "cannot be applied" in opens() and "ids are never reused" in opens()
    (rec,), = db.execute("SELECT rec FROM log WHERE lsn = ?", (applied,))
    db.execute("UPDATE log SET rec = ? WHERE lsn = ?", (bytes(rec) + b"\0", applied))
    db.close()
    assert f"checksum mismatch at lsn {applied}" in opens()

    # records missing between what the checkpoint applied and the rest of the log
    db = apsw.Connection(os.path.join(d, "spool.db"))
    db.execute("UPDATE log SET rec = ? WHERE lsn = ?", (bytes(rec), applied))
    (a3_epoch, a3_crc), = db.execute("SELECT epoch, crc FROM log WHERE lsn = ?", (applied - 3,))
    for k, v in (("applied_lsn", applied - 3), ("applied_epoch", a3_epoch), ("applied_crc", a3_crc)):
        db.execute("UPDATE meta SET v = ? WHERE k = ?", (v, k))
    assert "ids are never reused" in opens()  # (as above: replayed sends the tables hold)
    db.execute("DELETE FROM log WHERE lsn IN (?, ?)", (applied - 3, applied - 2))
    db.close()
    assert f"the log lacks records {applied - 2} to {applied - 2}" in opens()


def test_a_wal_checkpoint_that_fails_fails_the_commit_that_ran_it(tmp_path, monkeypatch):
    """S9: SQLite checkpoints the WAL into the database file every 1,000 pages,
    after a commit, and its own automatic checkpoint drops the result: a write
    or fsync of the database file that failed there went unseen. The store's
    WAL hook (``_checkpoint_wal``) runs that checkpoint instead and raises out
    of the commit. The failure is injected into the checkpoint's result (a
    Python VFS cannot show it: apsw raises a VFS method's exception at the next
    call whatever SQLite did with its error code)."""
    import apsw

    import node.store.sqlite as sq

    class Failing:
        def __init__(self, db):
            self.db = db

        def wal_checkpoint(self, name, mode):
            raise apsw.IOError("disk I/O error (fsync of the database file)")

    ran, real = [], sq._checkpoint_wal

    def hook(db, name, pages):
        ran.append(pages)
        return real(Failing(db) if failing else db, name, pages)
    monkeypatch.setattr(sq, "_checkpoint_wal", hook)
    failing = False
    st = Store(os.path.join(str(tmp_path), "spool.db"))
    try:
        _append(st, 1, 10, 100)
        failing = True
        with pytest.raises(apsw.Error) as e:
            for lsn in range(11, 3000):  # a page or more each: the WAL passes 1,000 pages
                _append(st, lsn, 1, 5000)
        # out of the commit as SQLite's error for it, the I/O error behind it
        assert isinstance(e.value, apsw.IOError) or isinstance(e.value.__context__, apsw.IOError), repr(e.value)
        assert max(ran) >= sq.WAL_CHECKPOINT_PAGES and lsn < 2999
        failing = False
        # the commit that ran the checkpoint is in the WAL: nothing written is lost
        assert _log(st)[1] == lsn
        # and one another connection holds off is left for a later commit
        assert real(_Busy(), "main", 5000) == apsw.SQLITE_OK
    finally:
        failing = False
        st.close()


class _Busy:
    def wal_checkpoint(self, name, mode):
        import apsw
        raise apsw.BusyError("database is locked")
