"""The IO shell around the pure core: group commit, apply, timers, checkpoints.

The write path, in the order it is enforced here (``_commit_loop``):

    1. a caller proposes an operation -> it waits in ``_pending``;
    2. the writer takes every pending operation, stamps epoch, lsn and the
       primary's time, chains the checksum and encodes the records;
    3. (cluster) the records are shipped to the replicas, which fsync them
       while
    4. the store appends them here in ONE transaction: one fsync for the batch;
    5. the replication core commits them once this node's fsync is done AND a
       quorum (this node counted) holds them;
    6. only then are they applied to the core, and only then do callers get
       their results — so a 201/204 always means "durable here and on a quorum".

The core therefore only ever holds committed state: a receive can never hand
out a message whose send is not yet durable.

A single node is a cluster of one: the same replication core elects it (a
restart is a new epoch) and commits a record as soon as its own fsync is done.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import os
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import apsw

from spooler import errors
from spooler.pb import log_pb2
from node.core.invariant import BrokenInvariant
from node.core.replication import copy_held
from node.core.spool import QUEUES_MAX, Core
from node.process import release_memory
from node.store.sqlite import CheckpointData, Position, Store, chain
from node.waits import Changes, wait_event

log = logging.getLogger("spooler.engine")

# What stops a node for good (Engine._fail): named in its critical line and in the
# errors clients get, and (node.main.exit_status) the process's exit status.
STORAGE_FAILURE = "storage failure"            # a write or fsync of the store failed
LOG_CONFLICT = "log conflict with committed records"  # its primary's log differs from what it committed
INTERNAL_FAILURE = "internal failure"          # a background task died: a bug, not the disk


def wall_us() -> int:
    return time.time_ns() // 1000


def mono_us() -> int:
    return time.monotonic_ns() // 1000


class Limits:
    """Every bound of the node in one place (documented in docs/limits.md)."""

    def __init__(self, **kw):
        self.body_bytes_max = 256 * 1024
        self.queue_name_chars_max = 80
        self.dedup_key_chars_max = 128
        self.wait_s_max = 20.0
        self.delay_s_max = 14 * 86400.0
        self.batch_entries_max = 1000
        self.batch_bytes_max = 8 * 1024 * 1024
        self.leases_per_queue_max = 100_000
        self.leases_max = 1_000_000  # every queue together (each about 1.2 KB of memory)
        self.messages_per_queue_max = 2_000_000
        # every queue together (each message holds 150 to 950 bytes of the node's
        # memory while it exists: docs/limits.md); --max-messages
        self.messages_max = 5_000_000
        # dedup keys remembered, every queue together (each for its queue's window,
        # at most a day); --max-dedup-keys
        self.dedup_keys_max = 1_000_000
        self.queues_max = QUEUES_MAX  # the core's: it also bounds failure queues made on demand
        self.keys_max = 10_000
        self.commit_records_max = 4096       # records in one group commit
        self.commit_bytes_max = 16 * 1024 * 1024
        self.pending_records_max = 65_536    # waiting for the writer; beyond: 503
        self.lease_timeout_s_max = 43_200.0
        self.retention_s_max = 14 * 86400.0
        self.dedup_window_s_max = 86_400.0
        self.max_retries_max = 1000
        self.session_requests_in_flight_max = 1024  # per gRPC Session stream (then it stops reading)
        self.receives_waiting_max = 10_000  # long polls waiting on a node at once, every transport (then 503)
        # long polls a replica forwards to the primary at once (each is a gRPC call
        # there; a few thousand at once from the replicas cost a review's cluster its
        # primary): past it, 503
        self.forwarded_polls_max = 1000
        # sends are refused (503) while the data directory's file system has less free
        # than this: a full disk stops a node (S9), and it could not start again on it
        self.disk_free_bytes_min = 64 << 20
        # bodies of sends proposed and not yet stored (or refused): past it a send is
        # 503 (an HTTP send before its body is read), so clients sending at once cannot
        # make the node hold more than this (a review had 4,000 at once take 2.5 GB)
        self.sending_bytes_max = int(os.environ.get("SPOOLER_TEST_SENDING_BYTES_MAX", "") or (256 << 20))
        # a Session whose key was refused when it opened is ended once it has been
        # idle this long (it is answered request by request meanwhile); tests shorten it
        self.session_refused_idle_s = float(os.environ.get("SPOOLER_TEST_REFUSED_IDLE", "") or 10.0)
        self.receipts_max = 16_384          # named receives remembered for a lost-answer release
        self.receipt_tokens_max = 65_536    # leases those remember, in all
        self.receipt_age_s_max = 120.0
        self.releases_in_flight_max = 1024  # lost-answer releases a forwarding node retries at once
        for k, v in kw.items():
            if not hasattr(self, k):
                raise TypeError(k)
            setattr(self, k, v)

    def to_dict(self) -> dict:
        return dict(vars(self))


class Reply:
    """A proposal's outcome delivered by a plain call instead of a future: the
    callback ``cb(reply, result, error)`` runs right where the record is applied
    (or refused), a turn of the event loop sooner than a future's callback or an
    awaiting task would. It has the part of a future's interface the engine
    uses (done, set_result, set_exception) and ``cancel``: a caller that went
    away (its stream ended) is not called. ``on_settled(fn)``: ``fn()`` runs once
    when the engine settles the proposal (applied or refused), cancelled or not:
    the proposer's own bookkeeping (Service._sending). Neither must raise; if one
    does, the error is logged and the engine goes on."""

    __slots__ = ("_cb", "_done", "_then")

    def __init__(self, cb: Callable):
        self._cb = cb
        self._done = False
        self._then = None

    def done(self) -> bool:
        return self._done

    def cancel(self) -> bool:
        was = self._cb is not None and not self._done
        self._cb = None
        return was

    def on_settled(self, fn: Callable) -> None:
        if self._done:  # (settled already: at once)
            _call_logged(fn)
        else:
            self._then = fn

    def set_result(self, result) -> None:
        self._finish(result, None)

    def set_exception(self, e: BaseException) -> None:
        self._finish(None, e)

    def _finish(self, result, e) -> None:
        if self._done:
            return
        self._done = True
        if self._then is not None:
            _call_logged(self._then)
        if self._cb is not None:
            _call_logged(self._cb, self, result, e)


def _call_logged(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("a reply callback failed")


def _read_outcome(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def nobody_waits(fut: asyncio.Future) -> asyncio.Future:
    """A future nothing awaits (a proposal of the node's own: its epoch's first
    record, a lease expiry; a shielded step whose caller gave up): if it fails, that
    is expected or logged where it happened, and asyncio must not log it again as
    an exception never retrieved."""
    fut.add_done_callback(_read_outcome)
    return fut


# what the next checkpoint has to write (Dirty.write_bytes) that brings it forward
# (Engine._checkpoint_loop): a checkpoint writing 1 MB took 3 ms here, 20 MB 90-110 ms
CHECKPOINT_BYTES = int(os.environ.get("SPOOLER_CHECKPOINT_BYTES", 1 << 20))
# Test-only: while the file this names exists, the data directory's free space is
# the number of bytes it holds (a disk filling and freeing up, for tests and drills,
# without filling a real one). Unset in production.
TEST_DISK_FREE_FILE = os.environ.get("SPOOLER_TEST_DISK_FREE_FILE", "")
SNAPSHOT_STEP_PAGES = 2048   # pages of the store copied per writer-thread job when a snapshot is made


class Engine:
    def __init__(self, data_dir: str, node_id: str = "n1", limits: Optional[Limits] = None,
                 clock_us: Callable[[], int] = wall_us, vfs: Optional[str] = None,
                 checkpoint_interval_s: float = 1.0, checkpoint_bytes: int = CHECKPOINT_BYTES,
                 synchronous: str = "FULL", peers: Optional[dict] = None, failover_timeout_s: float = 2.0,
                 grpc_options=(), tls=None, log_keep_records: int = 100_000, log_keep_bytes: int = 256 << 20,
                 join: bool = False, cluster_key: str = "", eager_replicas: str = "quorum"):
        """peers: member id -> gRPC address, this node included (None: a cluster of one).
        ``join``: a replacement member; if its store is empty, it joins without a vote
        until it holds the cluster's history (Replication.joining)."""
        self.node_id = node_id
        # lost-answer releases the forwarder is retrying: (primary address, queue, name) -> auth;
        # sent along on replication acks too (Driver._pending_releases)
        self.pending_releases: dict = {}
        self.release_hook = None  # primary: releases that arrived on acks (Service._release_from_peer)
        self.limits = limits or Limits()
        self.clock_us = clock_us
        self.data_dir = data_dir
        self.store = Store(os.path.join(data_dir, "spool.db"), vfs=vfs, synchronous=synchronous,
                           log_keep_records=log_keep_records, log_keep_bytes=log_keep_bytes)
        self.store_generation = 0  # bumped when a snapshot replaces the store
        # set on the loop while a snapshot replaces the store and the core (the
        # writer thread swaps them): no checkpoint is taken meanwhile, from either
        self.installing = False
        self.core = Core(rand=os.urandom)
        self.checkpoint_interval_s = checkpoint_interval_s
        # a checkpoint comes early once it has this many bytes to write (_checkpoint_loop)
        self.checkpoint_bytes = max(1, int(checkpoint_bytes))  # (0 would make every pass due)
        self._checkpoint_soon = asyncio.Event()
        self._roles = Changes()      # on_role: a new role, or a new primary known
        self._readiness = Changes()  # anything that may end a wait to serve (until_ready)
        # memory that checkpoints let go of is handed back to the OS at most this often
        self.release_interval_s = float(os.environ.get("SPOOLER_RELEASE_MEMORY_INTERVAL", "5"))
        self._bodies_dropped = False
        self._released_at = -1 << 62
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-writer")
        self._io_jobs = 0                 # store calls submitted to the writer thread, not yet done
        # a commit of at most this many records runs on the loop thread when the
        # writer thread is idle (see store_io)
        self.inline_commit_records_max = int(os.environ.get("SPOOLER_INLINE_COMMIT_RECORDS", "2"))
        self.inline_commit_bytes_max = int(os.environ.get("SPOOLER_INLINE_COMMIT_BYTES", "262144"))
        self._pending: list = []          # (Record, Future) waiting for the writer
        # appended (fsync'd locally) but not applied: lsn -> (Record, crc, Future or None)
        self.unapplied: "collections.OrderedDict[int, tuple]" = collections.OrderedDict()
        # recent encoded records, kept only to ship them to replicas without a store
        # read; bounded by bytes (one record can be a whole batch of large bodies)
        self.recent: "collections.OrderedDict[int, bytes]" = collections.OrderedDict()  # lsn -> bytes
        self.recent_bytes = 0
        self.recent_bytes_max = 64 * 1024 * 1024
        from node.replication.driver import Driver
        peers = peers or {node_id: ""}
        self.cluster = len(peers) > 1
        self.tls = tls
        self.cluster_key = cluster_key  # (node/tls.py: CLUSTER_KEY_MD)
        self.repl = Driver(self, node_id, peers, failover_timeout_s, grpc_options, tls, join=join and self.cluster,
                           eager=eager_replicas)
        self._wake: Optional[asyncio.Event] = None
        self._events: dict[str, asyncio.Event] = {}
        self.receives_waiting = 0  # long polls waiting here now (a gauge in /metrics)
        self._disk_free, self._disk_checked_at = None, -1e9  # (disk_low)
        self.stopping = False  # a graceful stop began (Service.shut_down): serve nothing new
        self.draining = False  # a graceful stop was asked for: not ready (a primary hands over first)
        self._tasks: list = []
        self.crc = 0                      # checksum after the last appended record
        self.applied_crc = 0              # checksum after the last applied record
        self.write_epoch = 0              # epoch stamped on new records
        self.appended_lsn = 0
        self.last_ts = 0
        # now_us's anchor: a wall time and the monotonic time it was read at
        self._anchor_ts, self._anchor_mono = 0, mono_us()
        self.ready = False                # serving: primary, its EpochBegin applied, lease valid
        self.loaded = False               # load() is done: the core holds what the store holds
        # the checkpoint write on the writer thread, once its changes have left the
        # core (_take_checkpoint): stop() waits for it, it is never cancelled
        self._checkpoint_write: Optional[asyncio.Future] = None
        # seq0 -> a live segment whose row points at its record for its bodies, in lsn
        # order (Store._segment_rows); its row holds them once compaction passed it.
        # Ordered: taken from the front as compaction passes (a dict's first key is
        # found past every key deleted before it: 50,000 such takes from 100,000
        # entries took 822 ms here, against 14 ms)
        self._by_record: collections.OrderedDict = collections.OrderedDict()
        # The same segments as (lsn, seq0, bytes of bodies), in the order they were
        # noted, for counting what the next compaction will copy (_checkpoint_due):
        # taken from the front as the log's cut passes them, each once. Figures, not
        # the segments: one consumed meanwhile is not kept alive by this.
        self._ref_order: collections.deque = collections.deque()
        self._copies_due = 0
        self.role = "replica"
        self.primary_id: Optional[str] = None
        self._epoch_begin_lsn = 0
        self.failed: Optional[BaseException] = None
        self.failed_what = ""  # once failed: its cause (STORAGE_FAILURE, LOG_CONFLICT, INTERNAL_FAILURE)
        self.on_apply = []                # callables(record, result) for metrics
        self.metrics = None

    # ------------------------------------------------------------ startup
    def load(self) -> None:
        """Rebuild the core: checkpointed tables, then replay the log after them."""
        st, core = self.store, self.core
        applied = st.applied_position()
        # the newest applied record always stays in the log (compaction_point): its
        # stamp is where this node's time resumes, even if the clock went back
        for lsn, epoch, crc, data in st.records_after(applied.lsn - 1, limit=1) if applied.lsn else ():
            # ... and it is what the checkpoint says it applied: the replay below
            # chains its checksums from there, so a log that is not the one the
            # tables were checkpointed from is caught here, not taken for theirs
            if lsn == applied.lsn and (epoch, crc) != (applied.epoch, applied.crc):
                raise CorruptStore(f"the log's record {lsn} (epoch {epoch}, checksum {crc}) is not the one the "
                                   f"checkpoint applied (epoch {applied.epoch}, checksum {applied.crc}): "
                                   "store is corrupt")
            if lsn > applied.lsn + 1:  # (the replay's checksums would not chain either)
                raise CorruptStore(f"the log lacks records {applied.lsn + 1} to {lsn - 1}, after what the "
                                   f"checkpoint applied: store is corrupt")
            self.last_ts = max(self.last_ts, log_pb2.Record.FromString(data).ts_us)
        now = self.now_us()
        for name, settings, counters in st.load_queues():
            core.load_queue(name, settings, counters)
        self._by_record = refs = collections.OrderedDict()
        self._ref_order, self._copies_due = collections.deque(), 0
        for queue, seq0, prefix, first, n, vis, exp, offs, gone, lsn, pos in st.load_segments():
            seg = core.load_segment(queue, seq0, prefix, first, n, vis, exp, offs, gone, now, lsn or 0, pos)
            if pos is not None:
                refs[seq0] = seg
                self._ref_order.append((seg.lsn, seq0, seg.offs[-1]))
        for queue, mid, seq, retry, vis, exp, size in st.load_messages():
            core.load_message(queue, mid, seq, retry, vis, exp, now, size)
        for queue, key, mid, until in st.load_dedup():
            core.load_dedup(queue, key, mid, until)
        for kid, sha, queue, scopes in st.load_keys():
            core.keys[kid] = (sha, queue, scopes)
        core.next_seq = max(core.next_seq, int(st.get_meta("next_seq") or 1))
        core.cluster_id = str(st.get_meta("cluster_id") or "")
        core.lsn, core.epoch = applied.lsn, applied.epoch
        self.crc = applied.crc
        self.applied_crc = self.crc
        replayed = 0
        self.appended_lsn = core.lsn
        after = core.lsn
        while True:
            rows = st.records_after(after)
            if not rows:
                break
            for lsn, epoch, crc, data in rows:
                # the checksum first: bytes that do not chain are not parsed as a record
                if chain(self.crc, data) != crc:
                    raise CorruptStore(f"log checksum mismatch at lsn {lsn}: store is corrupt")
                rec = log_pb2.Record.FromString(data)
                self.crc = crc
                self.appended_lsn = lsn
                self._remember(lsn, data)
                if self.cluster:
                    # maybe not committed: applied once the cluster's commit covers it
                    self.unapplied[lsn] = (rec, crc, None)
                else:
                    try:
                        core.apply(rec)  # a cluster of one: every durable record is committed
                    except Exception as err:  # (a restart would find it again: not served)
                        raise CorruptStore(f"the store's record {lsn} cannot be applied: {err!r}") from err
                    self.applied_crc = crc
                    replayed += 1
                self.last_ts = max(self.last_ts, rec.ts_us)
                after = lsn
        core.woken.clear()
        # What was loaded and replayed holds together (counts, unique ids, leases),
        # or the node does not serve it: each broken invariant would lose or
        # duplicate messages unseen from here on, and a restart finds it again.
        bad = core.check()
        if bad:
            raise CorruptStore(f"the state loaded from the store breaks the core's invariants: {'; '.join(bad)}")
        self.loaded = True
        log.info("loaded: applied lsn %d epoch %d (%d replayed), log to lsn %d", core.lsn, core.epoch, replayed,
                 self.appended_lsn)

    async def start(self) -> None:
        """Load, then open a new epoch: a node restart is a primary change."""
        loop = asyncio.get_running_loop()
        await self.store_io(self.load)
        self._wake = asyncio.Event()
        self._tasks = [asyncio.create_task(self._commit_loop(), name="commit"),
                       asyncio.create_task(self._lease_timer(), name="lease-timer"),
                       asyncio.create_task(self._retention_timer(), name="retention"),
                       asyncio.create_task(self._checkpoint_loop(), name="checkpoint")]
        for t in self._tasks:
            t.add_done_callback(self._task_ended)
        await self.repl.start()
        if not self.cluster:  # a cluster of one elects itself at once: serve before returning
            deadline = loop.time() + 10
            while not self.ready and self.failed is None and loop.time() < deadline:
                await asyncio.sleep(0.001)
            if not self.ready:
                raise RuntimeError(f"node did not open its epoch: {self.failed!r}")

    async def stop(self) -> None:
        self.ready = False
        if self.repl is not None:
            await self.repl.stop()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        w = self._checkpoint_write
        if w is not None and not w.done():
            # a checkpoint whose changes already left the core: cancelling it would
            # lose them, as the last checkpoint below records the applied lsn
            # without them and a restart replays the log only past that lsn
            try:
                await w
            except Exception as e:  # as the checkpoint loop would: no last checkpoint over it
                if self.failed is None:
                    self._fail(e)
        if self.failed is None:
            await self.store_io(self._checkpoint_now_sync, self._take_checkpoint())
        self._io.shutdown(wait=True)
        try:
            self.store.close()
        except Exception:
            if self.failed is None:
                raise  # after a storage failure the store may refuse even to close

    @property
    def epoch(self) -> int:
        """The epoch of the records applied here (leases are checked against it)."""
        return self.core.epoch

    @property
    def known_epoch(self) -> int:
        """The newest epoch this node knows of: what its answers name (Spooler-Epoch,
        the gRPC trailer) and what GET /v1/cluster says. A replica learns a new
        primary's epoch from its first message, before that epoch's first record is
        committed and applied, so an answer it forwards to that primary names the
        same epoch as the leases in it."""
        return max(self.core.epoch, self.repl.core.epoch)

    # ------------------------------------------------------------- store
    async def store_io(self, fn, *args, inline: bool = False):
        """Run a store call. The store's connection is used by one thread at a time:
        normally the writer thread, so the event loop keeps serving while SQLite
        writes and fsyncs. ``inline``: if the writer thread has nothing to do, run
        the call right here on the loop thread instead. For a small commit the two
        thread hops (submit, then wake the loop) cost about as much as the fsync
        itself, so this is what keeps a lone send's latency down; a large or busy
        commit still goes to the thread, where it overlaps with the loop's work."""
        if inline and self._io_jobs == 0:
            return fn(*args)
        loop = asyncio.get_running_loop()
        self._io_jobs += 1
        cf = self._io.submit(fn, *args)

        def done(_):
            self._io_jobs -= 1

        def finished(f):
            # counted down on the loop thread once the job has really finished (not
            # when an awaiting task is cancelled): no inline call can overlap it
            try:
                loop.call_soon_threadsafe(done, f)
            except RuntimeError:
                pass  # the loop is closed: nothing will run inline any more

        cf.add_done_callback(finished)
        return await asyncio.wrap_future(cf)

    def small_commit(self, rows: list) -> bool:
        """A commit cheap enough to run inline (see store_io): a lone small write."""
        return (len(rows) <= self.inline_commit_records_max
                and sum(len(r[3]) for r in rows) <= self.inline_commit_bytes_max)

    # ------------------------------------------------------------- writes
    def propose(self, rec, internal: bool = False, reply: Optional[Reply] = None):
        """Queue a record for the next group commit; the future resolves to the
        core's apply result once the record is durable (and applied).
        ``internal``: the node's own records (expiries, drops) are never refused
        for back-pressure (they are bounded by the leases and messages that exist).
        ``reply``: tell it instead of a future (returned as given)."""
        if self.failed is not None:
            raise errors.Unavailable(self.stopped_why, retry_after_s=1.0)
        if self.role != "primary" or (not internal and not self.serving()):
            raise errors.Unavailable("not the primary, or no quorum", retry_after_s=0.5)
        if not internal and len(self._pending) >= self.limits.pending_records_max:
            raise errors.Unavailable("write queue full", retry_after_s=0.5, reason=errors.OVERLOADED)
        fut = asyncio.get_running_loop().create_future() if reply is None else reply
        self._pending.append((rec, fut))
        self._wake.set()
        return fut

    async def _commit_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                # One commit is one step under the replication lock: nothing else
                # (a frame from another primary, a step-down, a vote) can reach the
                # replication core or the store between stamping these records and
                # counting them durable here.
                async with self.repl.lock:
                    # A switchover's TimeoutNow is out (promote, or a stop's handover):
                    # nothing more is stamped in this epoch. The target was told to take
                    # over once it held every record stamped (checked under this lock);
                    # one stamped after that would make the voters, which hold it,
                    # refuse the target. The records wait, and fail `unavailable` (never
                    # stamped, so not stored) once this node has stepped down, or when
                    # a stop gives up waiting (drop_pending). Before TimeoutNow, records
                    # already queued are stamped as usual: the target must hold them
                    # before it is told (new writes are refused meanwhile).
                    c = self.repl.core
                    paused = self.role == "primary" and c.transfer_to is not None and c.transfer_sent
                    if not paused and not await self._commit_some():
                        return
                if paused:
                    await asyncio.sleep(0.01)

    @property
    def writes_waiting(self) -> int:
        """Records waiting for the group commit (a gauge in /metrics; bounded by
        Limits.pending_records_max)."""
        return len(self._pending)

    def drop_pending(self, why: str) -> None:
        """Fail every record not yet stamped, as never stored (``unavailable``)."""
        taken, self._pending = self._pending, []
        for _, fut in taken:
            if not fut.done():
                fut.set_exception(errors.Unavailable(why, retry_after_s=0.5))

    async def _commit_some(self) -> bool:
        """Take, stamp, ship, fsync and count one batch of pending records (under
        the replication lock). False: the store failed, the node stops."""
        lim = self.limits
        n = min(len(self._pending), lim.commit_records_max)
        taken = self._pending[:n]
        del self._pending[:n]
        if self.role != "primary":
            for _, fut in taken:
                if not fut.done():
                    fut.set_exception(errors.Unavailable("no longer the primary", retry_after_s=0.5))
            return True
        rows, size = [], 0
        for i, (rec, fut) in enumerate(taken):
            if size > lim.commit_bytes_max:  # the rest wait for the next commit
                self._pending[:0] = taken[i:]
                break
            rec.epoch = self.write_epoch
            self.appended_lsn += 1
            rec.lsn = self.appended_lsn
            # the primary's time, stamped once; never goes backwards (now_us)
            self.last_ts = rec.ts_us = self.now_us()
            data = rec.SerializeToString()
            size += len(data)
            self.crc = chain(self.crc, data)
            rows.append((rec.lsn, rec.epoch, self.crc, data))
            self.unapplied[rec.lsn] = (rec, self.crc, fut)
            self._remember(rec.lsn, data)
        meta = [(r[0], r[1], r[2], len(r[3])) for r in rows]
        if self.cluster:
            # 1. ship to the replicas first: they write while we do (the
            #    replication core does not count this node yet). A few turns of
            #    the loop hand the frames to gRPC, whose own threads send them
            #    while this thread waits for the fsync below.
            await self.repl.run_effects(self.repl.core.appended(meta, mono_us(), durable=False))
            for _ in range(3):
                await asyncio.sleep(0)
        t = time.perf_counter()
        try:
            # 2. fsync (one transaction, one fsync for the whole batch)
            await self.store_io(self.store.append, rows, inline=self.small_commit(rows))
        except Exception as e:  # fsync/IO failure: never confirm, stop serving
            self._fail(e)
            return False
        if self.metrics:
            self.metrics.observe_commit(len(rows), time.perf_counter() - t)
        # 3. count this node; the replication core emits Commit once this node AND
        #    a quorum hold the records, and apply_upto() then applies and answers:
        #    never before.
        if self.cluster:
            await self.repl.run_effects(self.repl.core.durable(meta[-1][0], meta[-1][1], mono_us()))
        else:
            await self.repl.run_effects(self.repl.core.appended(meta, mono_us()))
        return True

    def _remember(self, lsn: int, data: bytes) -> None:
        if not self.cluster:
            return  # nobody to ship to
        self.recent[lsn] = data
        self.recent_bytes += len(data)
        # evict the oldest, but never a record not yet applied (it may not even
        # be in the store yet, and the replicas may still need it from here)
        recent, applied = self.recent, self.core.lsn
        while self.recent_bytes > self.recent_bytes_max and len(recent) > 1 and next(iter(recent)) <= applied:
            self.recent_bytes -= len(recent.popitem(last=False)[1])

    def record_bytes(self, lsns: list) -> list:
        """Encoded records for shipping: from memory, else from the store's log."""
        out = []
        missing = [lsn for lsn in lsns if lsn not in self.recent]
        got = {}
        if missing:
            for lsn, _, _, data in self.store.records_after(missing[0] - 1, len(lsns) + 1, reader=True):
                got[lsn] = bytes(data)
        for lsn in lsns:
            data = self.recent.get(lsn) or got.get(lsn)
            if data is None:  # never ship an empty record in its place
                raise RuntimeError(f"record {lsn} is neither in memory nor in the store")
            out.append(data)
        return out

    def disk_low(self) -> bool:
        """Has the data directory's file system less free space than the limit?"""
        want = self.limits.disk_free_bytes_min
        if not want:
            return False
        free = self.disk_free_bytes()
        return free is not None and free < want

    def disk_free_bytes(self) -> Optional[int]:
        """Bytes free (for an unprivileged writer) on the data directory's file
        system, or None when it cannot tell (statvfs at most once a second)."""
        now = time.monotonic()
        if now >= self._disk_checked_at + 1.0:
            try:
                if TEST_DISK_FREE_FILE and os.path.exists(TEST_DISK_FREE_FILE):
                    with open(TEST_DISK_FREE_FILE) as f:
                        self._disk_free, self._disk_checked_at = int(f.read().strip() or 0), now
                    return self._disk_free
                st = os.statvfs(self.data_dir)
                # (a file system that reports no blocks at all, as some FUSE ones do,
                # says nothing of its room: not refused on that account)
                self._disk_free = st.f_bavail * st.f_frsize if st.f_blocks else None
            except (OSError, ValueError):
                self._disk_free = None  # cannot tell: not refused on that account
            self._disk_checked_at = now
        return self._disk_free

    def apply_upto(self, lsn: int) -> None:
        """Records up to ``lsn`` are committed: apply them in order and answer."""
        u = self.unapplied
        while u:
            first = next(iter(u))
            if first > lsn:
                break
            rec, crc, fut = u.pop(first)
            try:
                result = self.core.apply(rec)
            except Exception as e:  # a broken invariant stops the node (a bug, not the disk: 71)
                self._fail(e, INTERNAL_FAILURE)
                raise
            self.applied_crc = crc
            if rec.WhichOneof("op") == "epoch_begin" and first == self._epoch_begin_lsn:
                self._opened_epoch()
            if fut is not None and not fut.done():
                fut.set_result(result)
            for cb in self.on_apply:
                cb(rec, result)
        if self._checkpoint_due():
            self._checkpoint_soon.set()
        self._wake_receivers()

    def check_from_primary(self, rows: list) -> None:
        lsn0, crc = self.appended_lsn, self.crc
        for lsn, epoch, expect, data in rows:
            if lsn != lsn0 + 1:
                raise RuntimeError(f"replica log gap: record {lsn} after {lsn0}")
            crc = chain(crc, data)
            if crc != expect:
                raise RuntimeError(f"checksum mismatch in the primary's record {lsn}")
            lsn0 = lsn

    def stored_from_primary(self, rows: list) -> None:
        """Replica: records fsync'd from the primary's stream (rows as in the log table)."""
        for lsn, epoch, crc, data in rows:
            if lsn != self.appended_lsn + 1:
                raise BrokenInvariant(f"replica log gap at {lsn} after {self.appended_lsn}")
            if chain(self.crc, data) != crc:
                raise RuntimeError(f"checksum mismatch in the primary's record {lsn}")
            self.crc = crc
            self.appended_lsn = lsn
            rec = log_pb2.Record.FromString(data)
            self.unapplied[lsn] = (rec, crc, None)
            self._remember(lsn, data)
            self.last_ts = max(self.last_ts, rec.ts_us)

    def truncated(self, after_lsn: int, crc: int) -> None:
        """The log lost its unapplied records after ``after_lsn`` (they were never committed),
        or (resync) the engine learns where the store's log really ends."""
        if after_lsn < self.core.lsn:
            raise BrokenInvariant(f"truncating to {after_lsn}, below the applied lsn {self.core.lsn}")
        for lsn in [x for x in self.unapplied if x > after_lsn]:
            _, _, fut = self.unapplied.pop(lsn)
            if fut is not None and not fut.done():
                fut.set_exception(errors.OperationUnconfirmed("write was not confirmed by a quorum"))
            self.recent_bytes -= len(self.recent.pop(lsn, b""))
        self.appended_lsn = after_lsn
        self.crc = crc

    # ------------------------------------------------------------- roles
    def role_changes(self) -> asyncio.Future:
        """A future resolved at the next on_role (a new role, or a new primary known)."""
        return self._roles.next()

    def readiness_changes(self) -> asyncio.Future:
        """A future resolved at the next change that may end a wait for this node to
        serve as primary: its epoch opened, a role change, a failure, a stop."""
        return self._readiness.next()

    def readiness_changed(self) -> None:
        self._readiness.fire()

    def on_role(self, role: str, epoch: int, primary: Optional[str]) -> None:
        was = self.role
        self.role = role
        self.primary_id = primary
        self._roles.fire()
        self.readiness_changed()
        if role == "primary" and was != "primary":
            # open the epoch: EpochBegin is the first record; once it applies the
            # log is caught up and every older lease is gone
            self.write_epoch = epoch
            self._epoch_begin_lsn = self.appended_lsn + 1
            # With the cluster's id, repeated (Core._apply_epoch_begin). A new one is
            # offered only in the log's first record, the cluster's first epoch: past
            # it, a node without an id cannot tell whether its log named one (a build
            # before 0.4.31 applied that record and kept no id, a snapshot from such
            # a primary), and an offer of its own would be the id it adopts while
            # the others keep the first, each side then refusing the other's calls
            cid = self.core.cluster_id or (self.core.rand(16).hex() if self._epoch_begin_lsn == 1 else "")
            nobody_waits(self.propose(log_pb2.Record(epoch_begin=log_pb2.EpochBegin(node_id=self.node_id,
                                                                                   cluster_id=cid)),
                                      internal=True))
            log.info("node %s elected primary in epoch %d", self.node_id, epoch)
        elif role != "primary" and was == "primary":
            self.ready = False
            # writes not yet committed: their outcome is unknown now
            for _, (_, _, fut) in self.unapplied.items():
                if fut is not None and not fut.done():
                    fut.set_exception(errors.OperationUnconfirmed("primary stepped down before a quorum confirmed"))
            for _, fut in self._pending:
                if not fut.done():
                    fut.set_exception(errors.Unavailable("no longer the primary", retry_after_s=0.5))
            self._pending.clear()
            log.info("node %s is no longer primary (epoch %d)", self.node_id, epoch)

    def _opened_epoch(self) -> None:
        self.ready = True
        self.readiness_changed()
        log.info("node %s serving as primary in epoch %d", self.node_id, self.core.epoch)

    def serving(self) -> bool:
        """Primary, its epoch open, and a majority heard from within the failover
        timeout; not shutting down."""
        return self.ready and not self.stopping and self.role == "primary" and self.repl.serving()

    def clients_ready(self) -> bool:
        """/readyz and the gRPC health status: this node can serve clients (it is
        the primary, or it follows a primary it heard from), its store works, and
        it is not stopping (nor about to: ``draining``)."""
        return self.failed is None and not self.stopping and not self.draining \
            and (self.role == "primary" or self.primary_id is not None)

    def may_lease(self) -> bool:
        return self.serving() and self.repl.may_lease()

    def _fail(self, e: BaseException, what: str = STORAGE_FAILURE) -> None:
        """Stop serving for good (the process exits through ``on_fatal``, with the
        status ``node.main.exit_status`` gives ``what``). ``what`` names the cause
        in the critical line and in the errors given to the writes it leaves
        unconfirmed."""
        # (the error a failed WAL checkpoint raises out of its commit is SQLite's
        # "SQL logic error"; the I/O error behind it is its cause or context)
        behind = e.__cause__ or e.__context__
        log.critical("%s, the node stops serving: %r%s", what, e, f" (behind it: {behind!r})" if behind else "")
        self.failed = e
        self.readiness_changed()
        self.failed_what = what
        self.ready = False
        err = errors.OperationUnconfirmed(f"{what}: {e}")
        for _, (_, _, fut) in self.unapplied.items():
            if fut is not None and not fut.done():
                fut.set_exception(err)
        for _, fut in self._pending:
            if not fut.done():
                fut.set_exception(errors.Unavailable(self.stopped_why))
        self._pending.clear()
        if self.on_fatal:
            self.on_fatal(e)

    on_fatal = None

    @property
    def stopped_why(self) -> str:
        """Once failed: what clients are told (``_fail`` names the cause)."""
        return f"node stopped after a {self.failed_what}" if self.failed_what else ""

    def _task_ended(self, t: asyncio.Task) -> None:
        """A background task that dies stops the node: never hang on a broken invariant."""
        if t.cancelled() or self.failed is not None:
            return
        e = t.exception()
        if e is not None:
            log.critical("task %s died: %r", t.get_name(), e, exc_info=e)
            self._fail(e, INTERNAL_FAILURE)

    # ---------------------------------------------------------- receivers
    def _wake_receivers(self) -> None:
        woken = self.core.woken
        if not woken:
            return
        for name in woken:
            ev = self._events.pop(name, None)
            if ev is not None:
                ev.set()
        woken.clear()

    def wake_all_receivers(self) -> None:
        for ev in self._events.values():
            ev.set()
        self._events.clear()

    def queue_event(self, queue: str) -> asyncio.Event:
        ev = self._events.get(queue)
        if ev is None:
            ev = self._events[queue] = asyncio.Event()
        return ev

    # -------------------------------------------------------------- timers
    def _lost_contact(self, via) -> bool:
        """A lease granted to a receive forwarded by node ``via[0]`` at ``via[1]``
        (mono us) is expiring. If that node has acknowledged nothing the primary
        sent since the grant, for at least the failover timeout, it was cut off
        around then: the answer most likely never got through it (its own release
        cannot get through either), so nobody had the message and the expiry is
        not the consumer's failure. A node in contact answers a frame within a
        heartbeat; a lease shorter than the failover timeout is not judged."""
        node, granted = via
        c = self.repl.core
        if not self.cluster or c.role != "primary" or node not in c.peers:
            return False
        return mono_us() - granted >= c.timeout and c.acked_sent.get(node, -1) < granted

    async def _lease_timer(self, tick_s: float = 0.02) -> None:
        """Lease expiry is the server's nack: a Settle(EXPIRE) record."""
        was_serving = False
        while True:
            await asyncio.sleep(tick_s)
            if not self.serving():
                if was_serving:  # (stepped down, or lost its majority): long polls answer unavailable now
                    was_serving = False
                    self.wake_all_receivers()
                continue
            was_serving = True
            spared = self.core.spared
            due = self.core.due_expiries(self.now_us(), spare=self._lost_contact)
            if self.core.spared != spared:
                self._wake_receivers()
                log.info("gave back %d expired lease(s) of receives forwarded by a node that lost contact",
                         self.core.spared - spared)
            if due:
                rec = self.core.expiry_record(due)
                try:
                    nobody_waits(self.propose(rec, internal=True))
                except errors.SpoolerError:
                    self.core.abort_expiries(due)  # not serving now; try again on a later tick
            # delayed messages whose time came: wake long polls on their queue
            now = self.now_us()
            for name, ev in list(self._events.items()):
                vis = self.core.next_visible_at(name)
                if vis is not None and vis <= now:
                    self._events.pop(name, None)
                    ev.set()

    async def _retention_timer(self, tick_s: float = 0.1, slow_tick_s: float = 1.0,
                               fast_queues_max: int = 100) -> None:
        """Drops messages whose retention ended, at most ``tick_s`` late (their
        stats count them as visible until the Drop applies; a receive skips them
        at once): one Drop record per queue with something due, proposed together
        (one group commit). A tick walks every queue's heap top: about 1.4 ms at
        10,000 queues (QUEUES_MAX). While more than ``fast_queues_max`` queues had
        drops at the last tick, it ticks every ``slow_tick_s`` instead (as every
        tick did before 0.4.37), so that many queues whose messages expire while
        nobody consumes them make at most one Drop record each a second, not ten."""
        tick = tick_s
        while True:
            await asyncio.sleep(tick)
            if not self.serving():
                continue
            due = self.core.due_drops(self.now_us())
            tick = tick_s if len(due) <= fast_queues_max else slow_tick_s
            for queue, ids in due:
                try:
                    fut = self.propose(log_pb2.Record(drop=log_pb2.Drop(queue=queue, ids=ids)), internal=True)
                except errors.SpoolerError:
                    self.core.requeue_drops(queue, ids)  # not serving now; try again later
                else:
                    fut.add_done_callback(lambda f, q=queue, i=ids: self._drop_ended(f, q, i))

    def _drop_ended(self, fut: asyncio.Future, queue: str, ids: list) -> None:
        """A Drop that was taken but not confirmed (the node stepped down before its
        commit, or the quorum did not answer) goes back to the retention heap, so a
        later tick proposes it again. Should the first one commit after all, the
        second finds those messages gone: a Drop of a missing id is a no-op."""
        if fut.cancelled() or fut.exception() is not None:
            self.core.requeue_drops(queue, ids)

    async def _checkpoint_loop(self) -> None:
        """A checkpoint every ``checkpoint_interval_s``, or sooner once what it
        has to write of the sends since the last one (Dirty.write_bytes) reaches
        ``checkpoint_bytes`` (apply_upto wakes it).

        A checkpoint is one transaction on the store's one writer, and every
        commit waits behind it: its cost grows with what it writes (about 200 MB/s
        here). A batch's bodies cost it little (its row names the log record
        holding them, Store._segment_rows), but single sends' own rows, a
        compaction's copies and a row per batch still grow with what was sent:
        smaller checkpoints write the same in all, and no commit waits long."""
        soon = self._checkpoint_soon
        while True:
            soon.clear()
            # (while a snapshot is installed no checkpoint is taken: wait, never spin)
            if (self.installing or not self._checkpoint_due()
                    or (not len(self.core.dirty) and not self._copies_due)):  # nothing to write: wait
                await wait_event(soon, self.checkpoint_interval_s)
            # (nothing changed, but records whose bodies rows still name passed the
            # log's cut: a checkpoint that only compacts. Never ``continue`` when due:
            # the loop would spin without awaiting, and hold the event loop for good)
            if not len(self.core.dirty) and not self._copies_due:
                continue
            try:
                await self.checkpoint_now()
            except Exception as e:
                self._fail(e)
                return
            if self._bodies_dropped and mono_us() - self._released_at >= self.release_interval_s * 1e6:
                # the bodies a checkpoint let go of stay with the C library until it is
                # asked to hand them back (node/process.py: release_memory)
                self._bodies_dropped = False
                self._released_at = mono_us()
                released = await asyncio.to_thread(release_memory)
                if released is not None and self.metrics:
                    self.metrics.memory_released.inc(released)

    def _checkpoint_due(self) -> bool:
        """Whether the next checkpoint has ``checkpoint_bytes`` to write: what the
        sends since the last one left to write (Dirty.write_bytes), plus the bodies
        the log's compaction will copy into segment rows whose records it lets go
        (a backlog that outlived the log's tail; Store.checkpoint). Without the
        second, such a checkpoint copied a second of batched sends at once. And
        at once when the cluster's id was adopted (Dirty.cluster_id)."""
        if self.core.dirty.cluster_id or self.core.dirty.write_bytes + self._copies_due >= self.checkpoint_bytes:
            return True
        order = self._ref_order
        if not order or order[0][0] >= self.core.lsn:  # (compaction keeps the last applied record)
            return False
        w = self._checkpoint_write
        if w is not None and not w.done():
            # the writer thread may be trimming the log's sizes (Store.checkpoint), which
            # compaction_point reads: counted on the first commit after that write
            return False
        cut = self.store.compaction_point(self.core.lsn)
        refs = self._by_record
        while order and order[0][0] <= cut:
            _, seq0, size = order.popleft()
            if seq0 in refs:  # (a segment whose messages all left has no row to copy into)
                self._copies_due += size
        return self.core.dirty.write_bytes + self._copies_due >= self.checkpoint_bytes

    async def checkpoint_now(self) -> None:
        """Write what changed since the last checkpoint, then let memory go of what
        the store now holds (bodies, segments' bodies). Nothing while a snapshot
        is being installed: the core being replaced must not be written into the
        store replacing it (the next checkpoint takes the new core's changes)."""
        if self.installing:
            return
        w = self._checkpoint_write
        if w is not None and not w.done():
            # one checkpoint at a time (the loop's, or one asked for meanwhile): the cut
            # below reads the log's sizes, which the writer thread trims in the one before
            await asyncio.wait([w])
            if self.installing:
                return
        c = self._take_checkpoint(self.store.compaction_point(self.core.lsn))
        # The replication core's view of the log forgets first what the store is
        # about to delete: a replica that needs those records gets a snapshot, and
        # no record is asked of the store after it has gone.
        self.repl.core.log.compact(c.compact_upto)
        t = time.perf_counter()
        # Shielded: the changes have left the core (dirty taken, messages marked
        # persisted), so once this write is on its way it must happen even if
        # the caller is cancelled (a stop cancels the checkpoint loop); a write
        # dropped from the writer thread's queue would lose them for good.
        self._checkpoint_write = w = asyncio.ensure_future(self.store_io(self._checkpoint_now_sync, c))
        # What the write changed is noted in memory as soon as it is done, also
        # when this task is cancelled meanwhile: a row that took its bodies in
        # must not be read through its record any more.
        w.add_done_callback(lambda f: None if f.cancelled() or f.exception() is not None
                            else self._checkpoint_written(c, f.result()))
        await asyncio.shield(w)
        if self.metrics:
            self.metrics.checkpoint_seconds.observe(time.perf_counter() - t)

    def _checkpoint_written(self, c: CheckpointData, by_record: Optional[dict]) -> None:
        """Bodies now live in the store: drop them from memory, and note where they
        are. Only objects of the core ``c`` was taken from are touched (a snapshot
        may be replacing it meanwhile, on the writer thread)."""
        if by_record is None:
            return  # not written: taken from a core a snapshot has replaced
        # rows that took their bodies out of records compacted away (Store.checkpoint)
        refs = c.by_record
        while refs:
            seq0 = next(iter(refs))
            if refs[seq0].lsn > c.compact_upto:
                break
            refs.pop(seq0).pos = None
        for mid, m in c.persisted_msgs:
            if not m.removed:
                m.body = None
        for m in c.out_of_segments:
            m.src = None  # its own row (or none) speaks for it now
        for seg in c.persisted_segs:
            pos = by_record.get(seg.seq0)
            if pos is not None:
                seg.pos = pos
                refs[seg.seq0] = seg
                c.ref_order.append((seg.lsn, seg.seq0, seg.offs[-1]))
            seg.bodies = None
        if c.persisted_msgs or c.persisted_segs:
            self._bodies_dropped = True

    def _take_checkpoint(self, cut: int = -1) -> CheckpointData:
        """Copy what changed, on the loop thread, consistent at the applied lsn;
        ``cut``: the log's records up to it go in this checkpoint (compaction_point)."""
        core = self.core
        d, core.dirty = core.dirty, type(core.dirty)()
        queues = []
        for name in d.queues:
            q = core.queues.get(name)
            if q is None:
                queues.append((name, None, None))
            else:
                queues.append((name, json.dumps(q.settings), json.dumps(q.counters)))
        put, dele, persisted, out_of_segs = [], [], [], []
        segs = d.segs
        for mid, m in d.msgs.items():
            src = m.src
            body = m.body
            if src is not None:  # changed since it left its segment: record it as gone from there
                seg, i = src
                if not seg.gone[i]:
                    seg.gone[i] = 1
                    seg.n_gone += 1
                    segs[seg.seq0] = seg
                    out_of_segs.append(m)
                if body is None and not m.persisted:
                    body = self._body_at(seg, i)
            if m.removed:
                if m.persisted:
                    dele.append(mid)
                    m.persisted = False
                continue
            put.append((mid, m.queue, m.seq, m.retry, m.visible_at, m.expires_at,
                        None if m.persisted else body if type(body) is tuple else bytes(body)))
            if not m.persisted:
                m.persisted = True
                persisted.append((mid, m))
        segs_put, segs_gone, segs_del, persisted_segs = [], [], [], []
        for seq0, seg in segs.items():
            if seg.removed or seg.n_gone == seg.n:
                seg.bodies = None  # every message of it has left (with its own copy of its body)
                if seg.persisted:
                    segs_del.append(seq0)
                    seg.persisted = False
                    if self._by_record.get(seq0) is seg:
                        del self._by_record[seq0]  # its row goes: nothing to copy, nothing to hold
            elif not seg.persisted:
                bodies = seg.bodies
                seg.offs = offs = array("I", itertools.accumulate(map(len, bodies), initial=0))
                segs_put.append((seq0, seg.queue, seg.prefix, seg.first, seg.n, seg.visible_at, seg.expires_at,
                                 offs, bytes(seg.gone), bodies, seg.lsn))
                seg.persisted = True
                persisted_segs.append(seg)
            else:
                segs_gone.append((bytes(seg.gone), seq0))
        dedup = []
        for qname, key in d.dedup:
            q = core.queues.get(qname)
            hit = q.dedup.get(key) if q else None
            dedup.append((qname, key, hit[0], hit[1]) if hit else (qname, key, None, 0))
        keys = []
        for kid in d.keys:
            k = core.keys.get(kid)
            keys.append((kid, k[0], k[1], json.dumps(list(k[2]))) if k else (kid, None, "", ""))
        c = CheckpointData(lsn=core.lsn, epoch=core.epoch, crc=self.applied_crc, next_seq=core.next_seq,
                           queues=queues, msgs_put=put, msgs_del=dele, segs_put=segs_put, segs_gone=segs_gone,
                           segs_del=segs_del, dedup=dedup, keys=keys, compact_upto=cut, cluster_id=core.cluster_id)
        c.persisted_msgs = persisted
        c.out_of_segments = out_of_segs
        c.persisted_segs = persisted_segs
        c.generation = self.store_generation
        c.by_record = self._by_record
        c.ref_order = self._ref_order
        if cut >= 0:  # this checkpoint copies what is due (Store.checkpoint): counted afresh after it
            order = self._ref_order
            while order and order[0][0] <= cut:
                order.popleft()
            self._copies_due = 0
        return c

    def _checkpoint_now_sync(self, c: CheckpointData) -> Optional[dict]:
        if getattr(c, "generation", self.store_generation) != self.store_generation:
            return None  # taken from a core a snapshot has replaced
        return self.store.checkpoint(c)

    # ----------------------------------------------------------- snapshots
    async def snapshot_to(self, path: str) -> None:
        """A consistent copy of the store, made in slices of SNAPSHOT_STEP_PAGES
        pages, each its own job on the writer thread: commits run between them
        instead of waiting behind a whole copy (seconds for a large store, long
        enough to cost the primary its lease). Changes the store makes meanwhile
        through its own connection reach the copy as well (SQLite's backup
        updates the pages it has copied), so the copy is the store as of its last
        slice."""
        b = await self.store_io(self.snapshot_begin, path)
        try:
            while not await self.store_io(self.snapshot_step, b, SNAPSHOT_STEP_PAGES):
                pass
        finally:
            await self.store_io(self.snapshot_end, b)

    def snapshot_begin(self, path: str) -> tuple:
        import apsw
        if os.path.exists(path):
            os.remove(path)
        dest = apsw.Connection(path)
        return dest, dest.backup("main", self.store.db, "main")

    @staticmethod
    def snapshot_step(b: tuple, pages: int) -> bool:
        """Copy up to ``pages`` more pages; True once the copy is whole."""
        return b[1].step(pages)

    @staticmethod
    def snapshot_end(b: tuple) -> None:
        dest, backup = b
        try:
            backup.close()
        finally:
            dest.close()

    def install_snapshot_sync(self, path: str) -> None:
        """Writer thread: replace the store with a primary's copy, keep our vote,
        the longest lease we answered, and whether we are still joining."""
        st = self.store
        if not os.path.isfile(path):  # Store() would make an empty one, and we would install that
            raise FileNotFoundError(path)
        held = self._copy_held(path)
        if held is not None:
            raise CopyHeld(held)
        keep = {k: st.get_meta(k) for k in ("repl_epoch", "voted_for", "lease_seen_us", "joining")}
        # ours, not the primary's, written into the copy (one transaction, fsync'd)
        # before it replaces our store: a crash at any point leaves either our old
        # store or the copy with our values, never the primary's. A value we never
        # had is written as "none" too, not inherited (lease_seen 0: not known).
        incoming = Store(path, vfs=st.vfs, synchronous=st.synchronous, prefill_wal=False)  # closed at once
        try:
            with incoming.db:
                incoming.set_meta("repl_epoch", keep["repl_epoch"] or 0)
                incoming.set_meta("voted_for", keep["voted_for"] or "")
                incoming.set_meta("lease_seen_us", keep["lease_seen_us"] or 0)
                if keep["joining"] is not None:
                    incoming.set_meta("joining", keep["joining"])
                else:
                    incoming.db.execute("DELETE FROM meta WHERE k = 'joining'")
            # checked: the rename below moves only the copy's main file, and closing
            # keeps a WAL it cannot fold without a word (our values would be lost)
            incoming.fold_wal()
        finally:
            incoming.close()
        # Our WAL is deleted below, so first every frame of it goes into our file,
        # checked (closing does the same, but keeps the WAL silently when it fails,
        # and deleting that WAL would lose writes this node acknowledged). A failure
        # up to here leaves our store as it was, open, and the install is refused:
        # a reader holding the WAL (BusyError, or frames the checkpoint left). But
        # a write or fsync of our own file that fails is our store failing: after a
        # failed fsync the page cache can no longer be trusted (S9), so the node
        # stops, as after any failed write, instead of refusing and going on
        try:
            st.fold_wal()
        except (apsw.BusyError, RuntimeError):
            raise
        except Exception as err:
            raise InstallBroken(f"folding this node's WAL before a snapshot install failed: {err!r}") from err
        # The point of no return: from closing our store on, a failure leaves the
        # node without a store it can use, and it stops (InstallBroken, S9). A crash
        # leaves our old file (its WAL folded in) or the copy, each whole.
        try:
            st.close()
            db = os.path.join(self.data_dir, "spool.db")
            for suffix in ("-wal", "-shm"):
                if os.path.exists(db + suffix):
                    os.remove(db + suffix)
            os.replace(path, db)
            fd = os.open(self.data_dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self.store = Store(db, vfs=st.vfs, synchronous=st.synchronous, log_keep_records=st.log_keep_records,
                               log_keep_bytes=st.log_keep_bytes)
            self.core = Core(rand=os.urandom)
            self.unapplied.clear()
            self.recent.clear()
            self.recent_bytes = 0
            self.load()
        except Exception as err:
            raise InstallBroken(f"installing a snapshot failed after the old store was closed: {err!r}") from err
        finally:
            # last: a checkpoint taken from the old core (stamped with the old
            # generation) is skipped, never written into the new store (nor
            # into a half-installed one)
            self.store_generation += 1

    def _copy_held(self, path: str) -> Optional[Position]:
        """Writer thread: the end of the copy's log, if our log already holds it
        and the copy would take nothing from us (None: install it).

        A copy can come late: made before frames this node has since stored and
        acknowledged (a retry after the primary's deadline, say, whose first
        stream still got here). Installing it would throw those records away,
        and the primary may have counted this node for them: a committed record
        would then be on fewer nodes than a quorum. So, as a raft follower keeps
        the entries after a snapshot that its log already holds, we keep our
        log. Our log holds the copy's end when we have applied past it (applied
        records are committed, and every legitimate primary's log agrees with
        them up to there), or when our record at that lsn has the copy's epoch
        and checksum (the checksum chains every record before it).

        A copy ending where our log ends is kept out too when its last record
        is our last record (same lsn, epoch and checksum) and we have applied at
        least what the copy applied (its checkpoint's position, where a node
        that installs it resumes applying): installing it would only take our
        applied state back, until the commit point next moves. A copy that
        applied more than we did is installed, as is a copy ending past our
        log's end, a copy that ends at lsn 0, and a copy whose last record is not ours."""
        import apsw
        st = self.store
        ours = st.last_position()
        flags = apsw.SQLITE_OPEN_READWRITE  # (a read-only open of a WAL file needs its -shm)
        db = apsw.Connection(path, flags=flags, vfs=st.vfs) if st.vfs else apsw.Connection(path, flags=flags)
        try:
            meta = dict(db.execute("SELECT k, v FROM meta WHERE k IN "
                                   "('applied_epoch', 'applied_lsn', 'applied_crc')"))
            applied = Position(int(meta.get("applied_epoch") or 0), int(meta.get("applied_lsn") or 0),
                               int(meta.get("applied_crc") or 0))
            end = applied  # an empty log: the copy ends at its applied position
            for lsn, epoch, crc in db.execute("SELECT lsn, epoch, crc FROM log ORDER BY lsn DESC LIMIT 1"):
                end = Position(epoch, lsn, crc)
        finally:
            db.close()
        def record_at(lsn):
            for row in st.db.execute("SELECT epoch, crc FROM log WHERE lsn = ?", (lsn,)):
                return tuple(row)
            return None
        held = copy_held((end.lsn, end.epoch, end.crc), applied.lsn, (ours.lsn, ours.epoch, ours.crc),
                         self.core.lsn, record_at)
        return end if held else None

    # -------------------------------------------------------------- reading
    @staticmethod
    def _body_at(seg, i: int) -> tuple:
        """Where message ``i`` of a stored segment keeps its body (Store._read_at):
        in the record that sent it while the row names it, else in the row."""
        off, size = seg.offs[i], seg.offs[i + 1] - seg.offs[i]
        if seg.pos is not None:
            return ("log", seg.lsn, seg.pos[i], size, seg.seq0, off)
        return ("segments", seg.seq0, off, size)

    def bodies_of(self, msgs: list) -> list:
        """Bodies of messages: from memory, else from the store: out of their
        segment's row (one read per segment) or from their own rows (one query)."""
        got = {}
        wheres = {m.id: self._body_at(*m.src) for m in msgs
                  if m.body is None and m.src is not None and m.src[0].offs is not None}
        if wheres:
            for mid, body in zip(wheres, self.store.read_segment_bodies(list(wheres.values()))):
                if body is not None:
                    got[mid] = body
        # own rows; also a message whose segment row a checkpoint has just replaced by its own
        missing = [m.id for m in msgs if m.body is None and m.id not in got]
        if missing:
            got.update(self.store.read_bodies(missing))
        out = []
        for m in msgs:
            body = m.body if m.body is not None else got.get(m.id)
            if body is None:
                # memory holds a message whose body the store does not: a broken
                # invariant. The node stops (its members hold the body, and a new
                # primary hands it out); served on, every receive of the queue would
                # fail on it until retries moved it to the failure queue, and that
                # move would drop it on every member.
                err = RuntimeError(f"message {m.id} has no body in memory or in the store")
                if self.failed is None:
                    self._fail(err, INTERNAL_FAILURE)
                raise errors.Unavailable(f"{self.stopped_why}; try another node", retry_after_s=0.5)
            out.append(body)
        return out

    def now_us(self) -> int:
        """The node's time: its wall clock, except that it never goes back. It never
        falls behind the newest record this node stamped, loaded or received, and
        when the clock is behind it (stepped back, or slower than the primary
        that stamped before us) it goes on from there at the monotonic clock's
        pace until the wall clock catches up: leases still expire, delays still
        end, and nothing sent before is hidden."""
        t, m = self.clock_us(), mono_us()
        floor = self._anchor_ts + (m - self._anchor_mono)
        if self.last_ts > floor:
            floor = self._anchor_ts = self.last_ts
            self._anchor_mono = m
        if t >= floor:
            self._anchor_ts, self._anchor_mono = t, m
            return t
        return floor


class CopyHeld(Exception):
    """A snapshot copy whose log this node's log already holds, and that would
    take nothing from it (Engine._copy_held): not installed. ``args[0]``: the copy's end (Position)."""


class CorruptStore(RuntimeError):
    """The store cannot be loaded as it is (its log does not chain, or what it
    holds breaks the core's invariants): the node does not start (exit 70, as
    after a failed write: a restart would find the same)."""


class InstallBroken(Exception):
    """A snapshot install failed after the node's old store was closed, or its old
    store failed a write or fsync on the way: the node has no store it can trust,
    and stops (Driver._install_locked)."""
