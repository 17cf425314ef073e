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

import json
import os
import sys
import zlib
from array import array
from bisect import bisect_left
from dataclasses import dataclass
from typing import Iterable, Optional

import apsw

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
                                    bodies BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS keys(id TEXT PRIMARY KEY, sha256 BLOB NOT NULL, queue TEXT NOT NULL,
                                scopes TEXT NOT NULL) WITHOUT ROWID;
"""

# the WAL's working size, made up front (Store._prefill_wal): a little more than
# SQLite's cycle of 1,000 frames of a 4 KiB page and its 24-byte header
WAL_PREFILL_BYTES = 1100 * (4096 + 24) + 32

# 2 added the segments table; a store of version 1 simply has none yet
SCHEMA_VERSION = 2


def chain(crc: int, data: bytes) -> int:
    """The log checksum: crc32 over every record so far (a position's third part)."""
    return zlib.crc32(data, crc)


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
                      # or (seq0, offset, length) = copy it out of that segment's row
    msgs_del: list    # ids
    segs_put: list    # (seq0, queue, prefix, first, n, visible_at, expires_at, offs array, gone, bodies)
    segs_gone: list   # (gone, seq0): messages that left these segments
    segs_del: list    # seq0s
    dedup: list       # (queue, key, msg_id or None = deleted, until)
    keys: list        # (id, sha256 or None = deleted, queue, scopes json)
    compact_upto: int = -1  # the log's records up to this lsn are deleted (compaction_point)


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
        if v is None or int(v) == 1:
            self.set_meta("schema_version", SCHEMA_VERSION)
        elif int(v) != SCHEMA_VERSION:
            raise RuntimeError(f"store schema {v} is not {SCHEMA_VERSION}")
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
        """Drop the records after ``after_lsn`` (never committed by a quorum)."""
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
    def checkpoint(self, c: CheckpointData) -> None:
        db = self.db
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
            if any(type(r[6]) is tuple for r in new):  # bodies still in their segment's row
                new = [r[:6] + (self._seg_body(db, *r[6]),) if type(r[6]) is tuple else r for r in new]
            if new:
                db.executemany("INSERT OR REPLACE INTO messages(id, queue, seq, retry, visible_at, expires_at, body) "
                               "VALUES(?, ?, ?, ?, ?, ?, ?)", new)
            if upd:
                db.executemany("UPDATE messages SET queue=?2, seq=?3, retry=?4, visible_at=?5, expires_at=?6 "
                               "WHERE id=?1", upd)
            # after the messages: a row copied a body out of a segment deleted here
            if c.segs_put:
                db.executemany("INSERT INTO segments(seq0, queue, prefix, first, n, visible_at, expires_at, offs, "
                               "gone, bodies) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                               (r[:7] + (offsets_to_blob(r[7]),) + r[8:] for r in c.segs_put))
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
            # Bounded growth: the log keeps only a tail behind the checkpoint, in
            # records and in bytes (replicas that fall further behind get a
            # snapshot instead). The engine compacted its view of the log to the
            # same point before this ran.
            cut = c.compact_upto
            db.execute("DELETE FROM log WHERE lsn <= ?", (cut,))
        if len(self._log_sum) > 1 and cut >= self._log_first:
            # never the base total: at most every record there is
            k = min(cut - self._log_first + 1, len(self._log_sum) - 1)
            del self._log_sum[:k]
            self._log_first += k

    # ------------------------------------------------------------- loading
    def load_queues(self) -> Iterable:
        for name, settings, counters in self.db.execute("SELECT name, settings, counters FROM queues"):
            yield name, json.loads(settings), json.loads(counters)

    def load_messages(self) -> Iterable:
        return self.db.execute("SELECT queue, id, seq, retry, visible_at, expires_at, length(body) FROM messages "
                               "ORDER BY seq")

    def load_segments(self) -> Iterable:
        """(queue, seq0, prefix, first, n, visible_at, expires_at, offsets array, gone bytes)"""
        for row in self.db.execute("SELECT queue, seq0, prefix, first, n, visible_at, expires_at, offs, gone "
                                   "FROM segments ORDER BY seq0"):
            yield row[:7] + (offsets_from_blob(row[7]), bytes(row[8]))

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

    @staticmethod
    def _seg_body(db: apsw.Connection, seq0: int, off: int, length: int) -> bytes:
        """Bytes ``off`` to ``off + length`` of a segment row's bodies (incremental blob
        I/O: only those pages are read). apsw.SQLError if the row is gone."""
        with db.blob_open("main", "segments", "bodies", seq0, False) as blob:
            blob.seek(off)
            return blob.read(length)

    def read_segment_bodies(self, spans: list) -> list:
        """Bodies out of segment rows: spans are (seq0, [(offset, length)]); -> a list of
        lists of bytes (None where the row is gone). One blob read per segment."""
        db = self._read_db()
        out = []
        for seq0, parts in spans:
            lo = min(o for o, _ in parts)
            hi = max(o + n for o, n in parts)
            try:
                data = self._seg_body(db, seq0, lo, hi - lo)
            except apsw.SQLError:  # no such row (any more)
                out.append([None] * len(parts))
                continue
            out.append([data[o - lo:o - lo + n] for o, n in parts])
        return out

    def integrity_check(self) -> str:
        return "; ".join(r[0] for r in self.db.execute("PRAGMA integrity_check"))
