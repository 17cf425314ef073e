"""Segment rows that point at their log record (store schema 3): finding a run's
bodies in an encoded record, and opening a store of schema 2."""
import itertools
import os
import random
from array import array

import apsw
import pytest

from node.store.sqlite import SCHEMA_VERSION, CheckpointData, Store, run_body_positions
from spooler.pb import log_pb2


def _offs(bodies):
    return array("I", itertools.accumulate(map(len, bodies), initial=0))


def _record(bodies, entries=0, lsn=7):
    rec = log_pb2.Record(epoch=3, lsn=lsn, ts_us=1_700_000_000_000_000)
    op = rec.send_compact
    for i in range(entries):  # plain entries come before the run in a compact send
        op.entries.add(queue="q", id=f"e{i}", body=b"entry" * i, dedup_key=f"k{i}")
    op.run_queue, op.run_id_prefix, op.run_id_first, op.run_delay_us = "q", "p-", 16, 5
    op.run_bodies.extend(bodies)
    return rec.SerializeToString()


@pytest.mark.parametrize("seed", range(40))
def test_the_positions_of_a_runs_bodies_are_where_protobuf_put_them(seed):
    r = random.Random(seed)
    sizes = [0, 1, 127, 128, 300, 16383, 16384, 70_000]
    bodies = [bytes([r.randrange(256)]) * r.choice(sizes) for _ in range(r.randint(1, 60))]
    data = _record(bodies, entries=r.randint(0, 3))
    pos = run_body_positions(data, _offs(bodies))
    assert pos is not None and len(pos) == len(bodies)
    assert [data[p:p + len(b)] for p, b in zip(pos, bodies)] == bodies


def test_a_record_without_that_run_has_no_positions():
    bodies = [b"a" * 10, b"b" * 20]
    rec = log_pb2.Record(epoch=1, lsn=1, ts_us=1)
    rec.send.entries.add(queue="q", id="x", body=b"a" * 10)  # a plain Send: no run
    assert run_body_positions(rec.SerializeToString(), _offs(bodies)) is None
    data = _record(bodies)
    assert run_body_positions(data, _offs([b"a" * 10, b"b" * 21])) is None  # other lengths
    assert run_body_positions(data, _offs([b"a" * 10])) is None               # fewer bodies
    assert run_body_positions(data, _offs(bodies + [b"c"])) is None           # more bodies
    assert run_body_positions(data[:-3], _offs(bodies)) is None               # cut short
    assert run_body_positions(b"\xff\xff\xff", _offs(bodies)) is None         # not a record


def _checkpoint(st, lsn, segs_put, cut=-1):
    return st.checkpoint(CheckpointData(lsn=lsn, epoch=1, crc=0, next_seq=1000, queues=[], msgs_put=[],
                                        msgs_del=[], segs_put=segs_put, segs_gone=[], segs_del=[], dedup=[],
                                        keys=[], compact_upto=cut))


def test_a_row_points_at_its_record_only_when_the_record_holds_its_bodies(tmp_path):
    st = Store(os.path.join(str(tmp_path), "spool.db"))
    try:
        bodies = [b"x" * 50, b"y" * 60]
        st.append([(1, 1, 0, _record(bodies, lsn=1)), (2, 1, 0, _record([b"z" * 50, b"y" * 60], lsn=2))])
        seg = lambda seq0, lsn: (seq0, "q", "p-", 16, 2, 0, 1 << 60, _offs(bodies), bytes(2), bodies, lsn)
        by_record = _checkpoint(st, 2, [seg(1, 1), seg(3, 2), seg(5, 9)])
        assert list(by_record) == [1]  # record 2 holds other bodies, record 9 is not there
        rows = st.db.execute("SELECT seq0, lsn, bodies FROM segments ORDER BY seq0").fetchall()
        assert rows == [(1, 1, b""), (3, None, b"".join(bodies)), (5, None, b"".join(bodies))]
        # read back from the record, then copied into the row when the record goes
        assert st.read_segment_bodies([("log", 1, p, 50 + 10 * i, 1, 50 * i) for i, p in enumerate(by_record[1])]) \
            == bodies
        _checkpoint(st, 2, [], cut=1)
        assert st.db.execute("SELECT lsn, bodies, pos FROM segments WHERE seq0 = 1").fetchall() == [
            (None, b"".join(bodies), None)]
        # the record is gone: a read aimed at it finds the row instead
        assert st.read_segment_bodies([("log", 1, by_record[1][0], 50, 1, 0)]) == [bodies[0]]
        assert st.read_segment_bodies([("segments", 1, 0, 50), ("segments", 1, 50, 60)]) == bodies
        assert st.read_segment_bodies([("segments", 7, 0, 50)]) == [None]  # no such row
    finally:
        st.close()


V2_SEGMENTS = """CREATE TABLE segments(seq0 INTEGER PRIMARY KEY, queue TEXT NOT NULL, prefix TEXT NOT NULL,
    first INTEGER NOT NULL, n INTEGER NOT NULL, visible_at INTEGER NOT NULL, expires_at INTEGER NOT NULL,
    offs BLOB NOT NULL, gone BLOB NOT NULL, bodies BLOB NOT NULL)"""


def test_a_schema_2_store_opens_with_its_rows_holding_their_bodies(tmp_path):
    path = os.path.join(str(tmp_path), "spool.db")
    db = apsw.Connection(path)
    db.execute("CREATE TABLE meta(k TEXT PRIMARY KEY, v) WITHOUT ROWID")
    db.execute("INSERT INTO meta VALUES('schema_version', 2)")
    db.execute(V2_SEGMENTS)
    offs = _offs([b"ab", b"cde"])
    db.execute("INSERT INTO segments VALUES(1, 'q', 'p-', 16, 2, 0, 99, ?, ?, ?)",
               (offs.tobytes(), bytes(2), b"abcde"))
    db.close()
    st = Store(path)
    try:
        assert int(st.get_meta("schema_version")) == SCHEMA_VERSION == 3
        [row] = st.load_segments()
        assert row[7].tolist() == offs.tolist() and row[9:] == (None, None)
        assert st.read_segment_bodies([("segments", 1, 0, 2), ("segments", 1, 2, 3)]) == [b"ab", b"cde"]
    finally:
        st.close()
    db = apsw.Connection(path)
    db.execute("UPDATE meta SET v = 4 WHERE k = 'schema_version'")  # a newer build's store
    db.close()
    with pytest.raises(RuntimeError, match="schema 4"):
        Store(path)


def test_a_body_named_by_a_record_compacted_away_is_read_from_the_row(tmp_path):
    """A message leaving a segment gets its own row with its body copied out of
    where the segment keeps it; if the record is gone, the row took the bodies in."""
    st = Store(os.path.join(str(tmp_path), "spool.db"))
    try:
        bodies = [b"x" * 50, b"y" * 60]
        st.append([(1, 1, 0, _record(bodies, lsn=1)), (2, 1, 0, _record([b"z"], lsn=2))])
        seg = (1, "q", "p-", 16, 2, 0, 1 << 60, _offs(bodies), bytes(2), bodies, 1)
        pos = _checkpoint(st, 2, [seg])[1]
        assert st._body(st.db, ("log", 1, pos[1], 60, 1, 50)) == bodies[1]
        _checkpoint(st, 2, [], cut=1)  # the record goes, the row takes the bodies in
        assert st._body(st.db, ("log", 1, pos[1], 60, 1, 50)) == bodies[1]
        assert st._body(st.db, ("segments", 1, 0, 50)) == bodies[0]
        with pytest.raises(RuntimeError, match="not in the store"):
            st._body(st.db, ("segments", 1, 100, 60))
    finally:
        st.close()
