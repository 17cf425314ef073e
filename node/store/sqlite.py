"""The node's durable store: one SQLite file (apsw, WAL, synchronous=FULL).

Two writes, both through the engine's one store gate (``Engine.store_io``: the
writer thread, or the event loop while that thread is idle; never both at once).
Reads from the event loop (:meth:`read_bodies`, ``records_after(reader=True)``)
use a connection of their own:

* :meth:`append` — group commit of log records: one transaction, one fsync
  for every record that arrived while the previous commit was syncing. A
  record is durable when ``append`` returns; nothing is answered before.
* :meth:`checkpoint` — writes the materialised state (queues, messages, dedup
  keys, API keys) as of an applied lsn, and compacts the log behind it,
  keeping a tail for replicas that fall behind. Recovery is: load the tables,
  replay the log after ``applied_lsn``.

Every statement here is IO; the decisions are in ``node/core``.
"""
from __future__ import annotations

import itertools
import json
from operator import add, sub
import os
import sys
import zlib
from array import array
from bisect import bisect_left
from dataclasses import dataclass
from typing import Iterable, Optional

import apsw

from spooler.pb import log_pb2

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS log(lsn INTEGER PRIMARY KEY, epoch INTEGER NOT NULL,
                               crc INTEGER NOT NULL, rec BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS queues(name TEXT PRIMARY KEY, settings TEXT NOT NULL,
                                  counters TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS messages(id TEXT PRIMARY KEY, queue TEXT NOT NULL, seq INTEGER NOT NULL,
                                    retry INTEGER NOT NULL, visible_at INTEGER NOT NULL,
                                    expires_at INTEGER NOT NULL, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS dedup(queue TEXT NOT NULL, key TEXT NOT NULL, msg_id TEXT NOT NULL,
                                 until INTEGER NOT NULL, PRIMARY KEY(queue, key)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS segments(seq0 INTEGER PRIMARY KEY, queue TEXT NOT NULL, prefix TEXT NOT NULL,
                                    first INTEGER NOT NULL, n INTEGER NOT NULL, visible_at INTEGER NOT NULL,
                                    expires_at INTEGER NOT NULL, offs BLOB NOT NULL, gone BLOB NOT NULL,
                                    bodies BLOB NOT NULL, lsn INTEGER, pos BLOB);
CREATE TABLE IF NOT EXISTS keys(id TEXT PRIMARY KEY, sha256 BLOB NOT NULL, queue TEXT NOT NULL,
                                scopes TEXT NOT NULL) WITHOUT ROWID;
"""

# the WAL's working size, made up front (Store._prefill_wal): a little more than
# SQLite's cycle of 1,000 frames of a 4 KiB page and its 24-byte header
WAL_PREFILL_BYTES = 1100 * (4096 + 24) + 32

# 2 added the segments table (a store of version 1 simply has none yet); 3 its
# columns lsn and pos: a row whose bodies are still in that log record's bytes
SCHEMA_VERSION = 3


def chain(crc: int, data: bytes) -> int:
    """The log checksum: crc32 over every record so far (a position's third part)."""
    return zlib.crc32(data, crc)


def _varint(b: bytes, i: int) -> tuple:
    x = shift = 0
    while True:
        c = b[i]
        i += 1
        x |= (c & 0x7F) << shift
        if c < 0x80:
            return x, i
        shift += 7


def _fields(b: bytes, i: int, end: int):
    """(field number, wire type, value start, value end) of each protobuf field in b[i:end]."""
    while i < end:
        key, i = _varint(b, i)
        wt = key & 7
        if wt == 0:
            j = _varint(b, i)[1]
        elif wt == 1:
            j = i + 8
        elif wt == 5:
            j = i + 4
        elif wt == 2:
            n, i = _varint(b, i)
            j = i + n
        else:
            raise ValueError(f"wire type {wt}")
        if j > end:
            raise ValueError("field past the end")
        yield key >> 3, wt, i, j
        i = j


SEND_COMPACT = log_pb2.Record.DESCRIPTOR.fields_by_name["send_compact"].number
RUN_BODIES = log_pb2.Send.DESCRIPTOR.fields_by_name["run_bodies"].number
_RUN_TAG = bytes([RUN_BODIES << 3 | 2])


def run_body_positions(rec: bytes, offs: array) -> Optional[array]:
    """Where each body of the run in an encoded ``Record.send_compact`` starts, given
    the bodies' offsets as a segment keeps them (n + 1, body i is offs[i + 1] -
    offs[i] long); None if the record holds no such run. A repeated bytes field is
    encoded element after element (tag, length, bytes), and ``run_bodies`` is the
    last field of a Send, so the run ends where the Send does: checked, as is the
    tag before the last body."""
    try:
        for f, wt, a, z in _fields(rec, 0, len(rec)):
            if f == SEND_COMPACT and wt == 2:
                break
        else:
            return None
        for f, wt, start, _ in _fields(rec, a, z):
            if f == RUN_BODIES and wt == 2:
                break
        else:
            return None
    except (ValueError, IndexError):
        return None
    n = len(offs) - 1
    if n < 1:
        return None
    lens = list(map(sub, offs[1:], offs[:-1]))
    # From body i's start to body i + 1's: its length, the tag (one byte), the
    # next length's varint. Mostly every length's varint is as long (bodies of
    # one size class): then body i starts at start + offs[i] + i * (1 + that).
    v = _varint_size(min(lens))
    if v == _varint_size(max(lens)):
        pos = array("I", map(add, offs[:-1], range(start, start + n * (1 + v), 1 + v)))
    else:
        heads = [1 + _varint_size(x) for x in lens]
        pos = array("I", itertools.accumulate(map(add, lens[:-1], heads[1:]), initial=start))
    last = lens[-1]
    if pos[-1] + last != z or rec[pos[-1] - 1 - _varint_size(last)] != _RUN_TAG[0]:
        return None
    return pos


def _varint_size(x: int) -> int:
    return (x.bit_length() + 6) // 7 or 1


def offsets_from_blob(blob: bytes) -> array:
    """A segment row's body offsets (n + 1 of them, uint32 little-endian)."""
    a = array("I")
    a.frombytes(blob)
    if sys.byteorder != "little":
        a.byteswap()
    return a


def offsets_to_blob(a: array) -> bytes:
    if sys.byteorder != "little":
        a = array("I", a)
        a.byteswap()
    return a.tobytes()


@dataclass
class Position:
    epoch: int = 0
    lsn: int = 0
    crc: int = 0


@dataclass
class CheckpointData:
    """A consistent copy of what changed, taken on the event loop at ``lsn``."""

    lsn: int
    epoch: int
    crc: int
    next_seq: int
    queues: list      # (name, settings json, counters json) or (name, None, None) = deleted
    msgs_put: list    # (id, queue, seq, retry, visible_at, expires_at, body): bytes, None = keep,
                      # or a tuple = copy it out of that segment row or log record (Store._body)
    msgs_del: list    # ids
    segs_put: list    # (seq0, queue, prefix, first, n, visible_at, expires_at, offs array, gone, bodies list,
                      #  lsn of the record whose run they are, or 0): see Store.checkpoint
    segs_gone: list   # (gone, seq0): messages that left these segments
    segs_del: list    # seq0s
    dedup: list       # (queue, key, msg_id or None = deleted, until)
    keys: list        # (id, sha256 or None = deleted, queue, scopes json)
    compact_upto: int = -1  # the log's records up to this lsn are deleted (compaction_point)
    cluster_id: str = ""    # the cluster's identity once the applied log names one (Core.cluster_id)


WAL_CHECKPOINT_PAGES = 1000  # SQLite's own automatic checkpoint's threshold


def _checkpoint_wal(db: apsw.Connection, name: str, pages: int) -> int:
    """After each commit (SQLite's WAL hook): once the WAL holds this many pages,
    copy them into the database file. SQLite's own automatic checkpoint does
    the same but drops its result, so a write or fsync of the database file
    that failed there went unseen and the node went on confirming writes (S9).
    Here it raises out of the commit that triggered it: that commit is in the
    WAL, fsync'd, but its caller sees the error and the node stops. A checkpoint
    another connection holds off (busy) is left for the next commit, as
    SQLite's is."""
    if pages >= WAL_CHECKPOINT_PAGES:
        try:
            db.wal_checkpoint(name, apsw.SQLITE_CHECKPOINT_PASSIVE)
        except apsw.BusyError:
            pass
    return apsw.SQLITE_OK


class Store:
    def __init__(self, path: str, vfs: Optional[str] = None, log_keep_records: int = 100_000,
                 synchronous: str = "FULL", log_keep_bytes: int = 256 << 20, wal_keep_bytes: int = 64 << 20,
                 prefill_wal: bool = True):
        """``prefill_wal``: make the WAL file its working size (_prefill_wal); off for a
        store opened only to be edited and closed (a snapshot's copy)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.vfs = vfs
        # FULL is the product. Anything else exists only so that the power-loss
        # tests can show their harness sees the loss FULL prevents.
        self.synchronous = synchronous
        self.log_keep_records = log_keep_records
        self.log_keep_bytes = log_keep_bytes
        self.wal_keep_bytes = wal_keep_bytes
        self.db = self._connect()
        self._reader: Optional[apsw.Connection] = None
        self.db.execute(SCHEMA)
        v = self.get_meta("schema_version")
        if v is not None and int(v) not in (1, 2, SCHEMA_VERSION):
            raise RuntimeError(f"store schema {v} is not {SCHEMA_VERSION}")
        if v is None or int(v) != SCHEMA_VERSION:
            with self.db:
                have = {r[1] for r in self.db.execute("PRAGMA table_info(segments)")}
                if "lsn" not in have:  # a version 2 store: its rows all hold their bodies
                    self.db.execute("ALTER TABLE segments ADD COLUMN lsn INTEGER")
                    self.db.execute("ALTER TABLE segments ADD COLUMN pos BLOB")
                self.set_meta("schema_version", SCHEMA_VERSION)
        self.db.execute("CREATE INDEX IF NOT EXISTS segments_by_record ON segments(lsn) WHERE lsn IS NOT NULL")
        if prefill_wal:
            self._prefill_wal()
        # The log's record sizes as running totals, for compaction by bytes: the
        # log's lsns are contiguous, so _log_sum[k] is the size of every record
        # before lsn _log_first + k (and _log_sum[0] a base of no meaning).
        self._log_first = 0
        self._log_sum = array("q", [0])
        for lsn, size in self.db.execute("SELECT lsn, length(rec) FROM log ORDER BY lsn"):
            if len(self._log_sum) == 1:
                self._log_first = lsn
            self._log_sum.append(self._log_sum[-1] + size)

    def _connect(self) -> apsw.Connection:
        flags = apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_CREATE
        db = apsw.Connection(self.path, flags=flags, vfs=self.vfs) if self.vfs else apsw.Connection(self.path, flags=flags)
        db.setbusytimeout(5000)
        db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit returns only after the WAL is fsync'd. This is the
        # "fsync" in "fsync, then quorum, then answer".
        db.execute(f"PRAGMA synchronous={self.synchronous}")
        # A large transaction (a checkpoint of many new messages) grows the WAL
        # file; once SQLite starts the WAL over, it cuts the file back to this
        # size instead of keeping it at its largest for ever. Ordinary commits
        # cycle well inside it (SQLite checkpoints the WAL every 1,000 pages).
        db.execute(f"PRAGMA journal_size_limit={int(self.wal_keep_bytes)}")
        db.set_wal_hook(_checkpoint_wal)
        return db

    def _prefill_wal(self) -> None:
        """Give the WAL file its working size up front, in zeros.

        A commit that appends to the WAL changes the file's size, so its
        fdatasync must also commit the file system's journal; a commit that
        overwrites the WAL where it already extends syncs the data alone. SQLite
        starts the WAL over after each checkpoint (every 1,000 pages) without
        shrinking the file, so a node that has run a while only overwrites, but
        a node just started (SQLite deletes the WAL when it closes) would append
        for its first thousand commits: measured here, 172 against 107 us per
        one-row commit alone, and more with other nodes syncing at the same time.

        Safe whatever the WAL holds: only bytes past its end are written, and
        SQLite reads a WAL only as far as its frames' checksums and salts chain
        from its header, so zeros are never taken for a frame (nor are the
        stale frames of an earlier cycle, which is how SQLite reuses the file)."""
        wal = self.path + "-wal"
        try:
            have = os.path.getsize(wal)
        except FileNotFoundError:
            return
        want = min(WAL_PREFILL_BYTES, self.wal_keep_bytes)  # never past what SQLite cuts it back to
        if have >= want:
            return
        fd = os.open(wal, os.O_WRONLY)
        try:
            os.pwrite(fd, bytes(want - have), have)
            os.fsync(fd)
        finally:
            os.close(fd)

    def fold_wal(self) -> None:
        """Copy every frame of the WAL into the database file and empty the WAL, or
        raise (apsw.BusyError while a reader holds it, an I/O error): after this the
        file alone holds every committed write. Closing the last connection tries
        the same, but says nothing when it fails and keeps the WAL."""
        n_log, n_done = self.db.wal_checkpoint(mode=apsw.SQLITE_CHECKPOINT_TRUNCATE)
        if n_log != n_done:
            raise RuntimeError(f"WAL checkpoint left {n_log - n_done} of {n_log} frames")

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self.db.close()

    # ---------------------------------------------------------------- meta
    def get_meta(self, k: str):
        for (v,) in self.db.execute("SELECT v FROM meta WHERE k=?", (k,)):
            return v
        return None

    def set_meta(self, k: str, v) -> None:
        self.db.execute("INSERT INTO meta(k, v) VALUES(?, ?) ON CONFLICT(k) DO UPDATE SET v=excluded.v", (k, v))

    # ----------------------------------------------------------------- log
    def append(self, rows: list) -> None:
        """Group commit: rows are (lsn, epoch, crc, encoded record). Returns once fsync'd."""
        with self.db:
            self.db.executemany("INSERT INTO log(lsn, epoch, crc, rec) VALUES(?, ?, ?, ?)", rows)
        sums = self._log_sum
        if len(sums) == 1 and rows:
            self._log_first = rows[0][0]
        total = sums[-1]
        for r in rows:
            total += len(r[3])
            sums.append(total)

    def truncate_log(self, after_lsn: int) -> None:
        """Drop the records after ``after_lsn`` (never committed by a quorum). Never
        an applied one: segment rows may name those for their bodies."""
        applied = self.applied_position().lsn
        if after_lsn < applied:
            raise RuntimeError(f"truncating the log to {after_lsn}, behind the checkpoint at {applied}")
        with self.db:
            self.db.execute("DELETE FROM log WHERE lsn > ?", (after_lsn,))
        del self._log_sum[max(1, after_lsn - self._log_first + 2):]

    def compaction_point(self, applied_lsn: int) -> int:
        """The last lsn that compaction may delete behind ``applied_lsn``: the log
        keeps at most ``log_keep_records`` records and ``log_keep_bytes`` bytes of
        applied records (always the last applied one, however large).

        Called on the event loop while the writer thread may append: an append
        only adds totals past the last record, and a truncation drops only
        unapplied ones, so the totals up to ``applied_lsn`` read here hold still."""
        cut = applied_lsn - self.log_keep_records
        sums, first = self._log_sum, self._log_first
        end = applied_lsn - first + 2  # _log_sum[end - 1]: every byte up to applied_lsn
        if 2 <= end <= len(sums):
            floor = sums[end - 1] - self.log_keep_bytes
            cut = max(cut, first + bisect_left(sums, floor, 0, end) - 1)
        return min(cut, applied_lsn - 1)

    def log_bytes(self) -> int:
        """Bytes of the records in the log table."""
        return self._log_sum[-1] - self._log_sum[0]

    def last_position(self) -> Position:
        for lsn, epoch, crc in self.db.execute("SELECT lsn, epoch, crc FROM log ORDER BY lsn DESC LIMIT 1"):
            return Position(epoch, lsn, crc)
        return self.applied_position()

    def applied_position(self) -> Position:
        return Position(int(self.get_meta("applied_epoch") or 0), int(self.get_meta("applied_lsn") or 0),
                        int(self.get_meta("applied_crc") or 0))

    def records_after(self, lsn: int, limit: int = 10_000, reader: bool = False) -> list:
        """[(lsn, epoch, crc, rec bytes)] with lsn > ``lsn``, in order. ``reader``: from the
        event loop, on the read connection (the writer's is busy in the writer thread)."""
        db = self._read_db() if reader else self.db
        return list(db.execute("SELECT lsn, epoch, crc, rec FROM log WHERE lsn > ? ORDER BY lsn LIMIT ?",
                               (lsn, limit)))

    # ---------------------------------------------------------- checkpoint
    def checkpoint(self, c: CheckpointData) -> dict:
        """Write ``c`` in one transaction; -> {seq0: positions} of the new segment rows
        that point at their record instead of holding their bodies (_segment_rows)."""
        db = self.db
        by_record: dict = {}
        with db:
            for name, settings, counters in c.queues:
                if settings is None:
                    db.execute("DELETE FROM queues WHERE name=?", (name,))
                else:
                    db.execute("INSERT INTO queues(name, settings, counters) VALUES(?, ?, ?) "
                               "ON CONFLICT(name) DO UPDATE SET settings=excluded.settings, "
                               "counters=excluded.counters", (name, settings, counters))
            if c.msgs_del:
                db.executemany("DELETE FROM messages WHERE id=?", ((i,) for i in c.msgs_del))
            new = [r for r in c.msgs_put if r[6] is not None]
            upd = [r[:6] for r in c.msgs_put if r[6] is None]
            if any(type(r[6]) is tuple for r in new):  # bodies still in their segment's row, or its record
                new = [r[:6] + (self._body(db, r[6]),) if type(r[6]) is tuple else r for r in new]
            if new:
                db.executemany("INSERT OR REPLACE INTO messages(id, queue, seq, retry, visible_at, expires_at, body) "
                               "VALUES(?, ?, ?, ?, ?, ?, ?)", new)
            if upd:
                db.executemany("UPDATE messages SET queue=?2, seq=?3, retry=?4, visible_at=?5, expires_at=?6 "
                               "WHERE id=?1", upd)
            # after the messages: a row copied a body out of a segment deleted here
            if c.segs_put:
                db.executemany("INSERT INTO segments(seq0, queue, prefix, first, n, visible_at, expires_at, offs, "
                               "gone, bodies, lsn, pos) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                               self._segment_rows(db, c.segs_put, c.compact_upto, by_record))
            if c.segs_gone:
                db.executemany("UPDATE segments SET gone=? WHERE seq0=?", c.segs_gone)
            if c.segs_del:
                db.executemany("DELETE FROM segments WHERE seq0=?", ((k,) for k in c.segs_del))
            for queue, key, msg_id, until in c.dedup:
                if msg_id is None:
                    db.execute("DELETE FROM dedup WHERE queue=? AND key=?", (queue, key))
                else:
                    db.execute("INSERT OR REPLACE INTO dedup(queue, key, msg_id, until) VALUES(?, ?, ?, ?)",
                               (queue, key, msg_id, until))
            for kid, sha, queue, scopes in c.keys:
                if sha is None:
                    db.execute("DELETE FROM keys WHERE id=?", (kid,))
                else:
                    db.execute("INSERT OR REPLACE INTO keys(id, sha256, queue, scopes) VALUES(?, ?, ?, ?)",
                               (kid, sha, queue, scopes))
            for k, v in (("applied_lsn", c.lsn), ("applied_epoch", c.epoch), ("applied_crc", c.crc),
                         ("next_seq", c.next_seq)):
                self.set_meta(k, v)
            if c.cluster_id:
                self.set_meta("cluster_id", c.cluster_id)
            # Bounded growth: the log keeps only a tail behind the checkpoint, in
            # records and in bytes (replicas that fall further behind get a
            # snapshot instead). The engine compacted its view of the log to the
            # same point before this ran. Segment rows whose bodies are still in
            # records about to go take them into themselves first, in this
            # transaction: this is the one place that deletes applied records.
            cut = c.compact_upto
            for seq0, lsn, offs, pos in db.execute("SELECT seq0, lsn, offs, pos FROM segments "
                                                   "WHERE lsn IS NOT NULL AND lsn <= ?", (cut,)).fetchall():
                offs, pos = offsets_from_blob(offs), offsets_from_blob(pos)
                rec = self._blob(db, "log", lsn, 0, -1)
                bodies = b"".join([rec[p:p + offs[i + 1] - offs[i]] for i, p in enumerate(pos)])
                if len(pos) + 1 != len(offs) or len(bodies) != offs[-1]:
                    raise RuntimeError(f"segment {seq0}: record {lsn} does not hold its bodies")
                db.execute("UPDATE segments SET bodies=?, lsn=NULL, pos=NULL WHERE seq0=?", (bodies, seq0))
            db.execute("DELETE FROM log WHERE lsn <= ?", (cut,))
        if len(self._log_sum) > 1 and cut >= self._log_first:
            # never the base total: at most every record there is
            k = min(cut - self._log_first + 1, len(self._log_sum) - 1)
            del self._log_sum[:k]
            self._log_first += k
        return by_record

    def _segment_rows(self, db: apsw.Connection, segs: list, cut: int, by_record: dict):
        """Rows for new segments. A segment's bodies are already stored once, as the
        run of the log record that sent it: while that record stays in the log (it
        is past ``cut``), the row points at it (lsn, and where each body starts in
        the record's bytes) instead of writing every body a second time. Compaction
        copies them into the row before the record goes (checkpoint). Where the
        record is not found, or does not hold these bodies, the row holds them."""
        for r in segs:
            seq0, offs, bodies, lsn = r[0], r[7], r[9], r[10]
            pos = None
            if lsn > cut:
                try:
                    rec = self._blob(db, "log", lsn, 0, -1)
                except apsw.SQLError:
                    rec = None
                if rec is not None:
                    pos = run_body_positions(rec, offs)
                    if pos is not None and (rec[pos[0]:pos[0] + offs[1]] != bodies[0]
                                            or rec[pos[-1]:pos[-1] + offs[-1] - offs[-2]] != bodies[-1]):
                        pos = None
            if pos is None:
                yield r[:7] + (offsets_to_blob(offs), r[8], b"".join(bodies), None, None)
            else:
                by_record[seq0] = pos
                yield r[:7] + (offsets_to_blob(offs), r[8], b"", lsn, offsets_to_blob(pos))

    # ------------------------------------------------------------- loading
    def load_queues(self) -> Iterable:
        for name, settings, counters in self.db.execute("SELECT name, settings, counters FROM queues"):
            yield name, json.loads(settings), json.loads(counters)

    def load_messages(self) -> Iterable:
        return self.db.execute("SELECT queue, id, seq, retry, visible_at, expires_at, length(body) FROM messages "
                               "ORDER BY seq")

    def load_segments(self) -> Iterable:
        """(queue, seq0, prefix, first, n, visible_at, expires_at, offsets array, gone bytes, lsn, pos
        array): lsn and pos None for a row holding its bodies, else where they are in that record"""
        for row in self.db.execute("SELECT queue, seq0, prefix, first, n, visible_at, expires_at, offs, gone, "
                                   "lsn, pos FROM segments ORDER BY seq0"):
            yield row[:7] + (offsets_from_blob(row[7]), bytes(row[8]), row[9],
                             None if row[10] is None else offsets_from_blob(row[10]))

    def load_dedup(self) -> Iterable:
        return self.db.execute("SELECT queue, key, msg_id, until FROM dedup")

    def load_keys(self) -> Iterable:
        for kid, sha, queue, scopes in self.db.execute("SELECT id, sha256, queue, scopes FROM keys"):
            yield kid, bytes(sha), queue, tuple(json.loads(scopes))

    # ------------------------------------------------------------- reading
    def _read_db(self) -> apsw.Connection:
        if self._reader is None:
            self._reader = self._connect()
        return self._reader

    def read_bodies(self, ids: list) -> dict:
        """Bodies of checkpointed messages, id -> bytes, in one query per 500 ids."""
        out = {}
        db = self._read_db()
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            q = "SELECT id, body FROM messages WHERE id IN (" + ",".join("?" * len(chunk)) + ")"
            for mid, body in db.execute(q, chunk):
                out[mid] = bytes(body)
        return out

    BLOB_COLUMNS = {"segments": "bodies", "log": "rec"}

    @classmethod
    def _blob(cls, db: apsw.Connection, table: str, rowid: int, off: int, length: int) -> bytes:
        """Bytes ``off`` to ``off + length`` (-1: to the end) of a segment row's bodies
        (table "segments", rowid seq0) or of a log record (table "log", rowid lsn), by
        incremental blob I/O: only those pages are read. apsw.SQLError if the row is gone."""
        with db.blob_open("main", table, cls.BLOB_COLUMNS[table], rowid, False) as blob:
            blob.seek(off)
            return blob.read(length)

    @classmethod
    def _read_at(cls, db: apsw.Connection, wheres: list) -> list:
        """Bodies of segments' messages, each given where it is: ("segments", seq0,
        offset, length, ...) in its row, or ("log", lsn, offset, length, seq0, offset
        in the row) in the record that sent it. -> bytes for each, None where its row
        is gone. One blob read per row or record; a body whose record was compacted
        away meanwhile is read from its row, which took the bodies in first
        (checkpoint), so the caller's note of where it is may be late."""
        out = [None] * len(wheres)
        todo = list(enumerate(wheres))
        while todo:
            groups: dict = {}
            for k, w in todo:
                groups.setdefault((w[0], w[1]), []).append((k, w))
            todo = []
            for (table, rowid), parts in groups.items():
                lo = min(w[2] for _, w in parts)
                hi = max(w[2] + w[3] for _, w in parts)
                try:
                    data = cls._blob(db, table, rowid, lo, hi - lo)
                except (apsw.SQLError, ValueError):  # no such row (any more), or its bodies are elsewhere
                    data = b""
                if len(data) < hi - lo:
                    if table == "log":
                        todo += [(k, ("segments", w[4], w[5], w[3])) for k, w in parts]
                    continue
                for k, w in parts:
                    out[k] = data[w[2] - lo:w[2] - lo + w[3]]
        return out

    @classmethod
    def _body(cls, db: apsw.Connection, where: tuple) -> bytes:
        """One body (see _read_at) that must be there: a checkpoint copying it out."""
        [body] = cls._read_at(db, [where])
        if body is None:
            raise RuntimeError(f"segment body {where} is not in the store")
        return body

    def read_segment_bodies(self, wheres: list) -> list:
        """_read_at, from the event loop (the read connection)."""
        return self._read_at(self._read_db(), wheres)

    def integrity_check(self) -> str:
        return "; ".join(r[0] for r in self.db.execute("PRAGMA integrity_check"))
