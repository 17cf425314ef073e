"""The pure spool state machine: queues, messages, leases.

No IO and no clock here. Two kinds of input:

* ``apply(record)`` — a committed log record (``spooler.pb.log_pb2.Record``).
  Deterministic: it reads only the record (its ``ts_us`` is the primary's
  stamped time) and the state, so every node that applies the same records in
  the same order holds the same state. It never raises for a well-formed
  record: a command that no longer fits the state (a message acked twice, a
  queue deleted meanwhile) is a no-op with a result saying so. A record that
  breaks an invariant (it reuses the id of a message still held) raises
  ``BrokenInvariant``, and the node stops.
* lease calls — ``receive``, ``check_lease``, ``renew``, ``due_expiries`` —
  with an explicit ``now_us``. Leases live in memory on the primary only and
  are never logged: a primary change drops them by design, and their messages
  are visible again at once with the retry count they had.

Every change also lands in ``self.dirty`` so the store can checkpoint the
materialised state in batches (see ``node/store``); the log stays the source
of truth until then.
"""
from __future__ import annotations

import heapq
from bisect import bisect_right
from hmac import compare_digest
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

from node.core.invariant import BrokenInvariant
from spooler.ids import message_id, run_ids
from spooler.pb import log_pb2

US = 1_000_000

# Message lifecycle. Transitions (h11-style, in one place):
#   send ──> READY | DELAYED;  DELAYED ──time──> READY;  READY ──receive──> LEASED
#   LEASED ──ack──> (gone)     LEASED ──nack/expiry──> READY | DELAYED | failure queue | (gone: retention)
#   LEASED ──primary change──> READY (retry count unchanged)
#   READY, past a lowered maxRetries ──receive──> LEASED (lease over already) ──expiry──> failure queue
#   READY|DELAYED ──retention──> (gone)     any ──redrive/move──> READY in another queue
#   any ──purge, queue delete──> (gone; a lease on it ends: settled)
READY, DELAYED, LEASED = "ready", "delayed", "leased"

ACTIVE, SETTLING, EXPIRING = "active", "settling", "expiring"

DEFAULT_SETTINGS = {
    "lease_timeout_us": 30 * US,
    "max_retries": 5,
    "retention_us": 345_600 * US,
    "dedup_window_us": 0,
    "failure_queue": "",  # "" = "{queue}.failed"
}


# A lease's ``via`` for a message a receive found past its queue's maxRetries:
# nobody holds it, and its expiry moves the message (Core.receive)
PAST_RETRIES = ("past_retries",)
# such leases one receive call makes at most (the rest wait for the next call):
# a receive never stalls over a long run of them, nor fills a huge expiry record
PAST_RETRIES_PER_RECEIVE = 100

# The newest log format this build applies, said to the primary in every
# replication acknowledgement (AppendAck.log_format): 1 = Purge records (0.4.42).
# A primary proposes no record of a newer format than a member's latest answer
# to it says that member applies (Service.purge): an older build stops on a
# record it does not know.
LOG_FORMAT = 1
PURGE_LOG_FORMAT = 1

# the longest name a failure queue derived from its queue's name may have
DERIVED_NAME_CHARS_MAX = 255
# queues a node holds (Limits.queues_max is this): a failure queue is made on
# demand only while there is room for one more
QUEUES_MAX = 10_000


def failure_queue_of(name: str, settings: dict) -> str:
    """The queue's failure queue: as set, else "{name}.failed". A failure queue
    made on demand has one of its own in turn; where that name would pass
    DERIVED_NAME_CHARS_MAX the chain ends: the queue is its own failure queue
    (an exhausted message stays, its count saturates), since a longer name
    could never be read, received from or deleted by any route."""
    fq = settings["failure_queue"] or f"{name}.failed"
    return fq if len(fq) <= DERIVED_NAME_CHARS_MAX else name


class Msg:
    __slots__ = ("id", "queue", "seq", "body", "size", "retry", "visible_at", "expires_at", "state",
                 "lease", "gen", "persisted", "removed", "src")

    def __init__(self, id, queue, seq, body, retry, visible_at, expires_at, size=None):
        self.id = id
        self.queue = queue
        self.seq = seq
        self.body = body           # None once checkpointed: read from the store
        self.size = len(body) if size is None else size  # the body's length (a receive's byte budget)
        self.retry = retry
        self.visible_at = visible_at
        self.expires_at = expires_at
        self.state = READY
        self.lease = 0             # lease id while LEASED
        self.gen = 0               # heap entries carry gen; a stale entry is skipped
        self.persisted = False     # a row exists in the store's messages table
        self.removed = False
        self.src = None            # (Segment, index) while its segment's row still speaks for it


# what a segment's row costs a checkpoint per message (Dirty.write_bytes)
SEGMENT_ROW_BYTES_PER_MESSAGE = 9


class Segment:
    """The messages of one compact send (``SendBatch.run_*``), kept as ONE object
    while they sit untouched: one queue, consecutive seqs, one visibility time, one
    expiry, retry count 0, bodies together. This is what makes a batch cost one
    object on every node instead of one per message (DESIGN.md, "Segments").

    A message leaves its segment (``Core._take``) when it is leased or when a
    record changes it; from then on it is an ordinary ``Msg`` whose ``src`` points
    back here until a checkpoint records it as ``gone`` (then it has a row of its
    own, or none because it was removed). Durably a segment is one row: bodies,
    offsets and the ``gone`` flags; the row goes when every message is gone."""

    __slots__ = ("seq0", "queue", "prefix", "first", "n", "visible_at", "expires_at", "bodies", "offs",
                 "taken", "left", "cur", "state", "gen", "gone", "n_gone", "persisted", "removed", "lsn", "pos")

    def __init__(self, seq0, queue, prefix, first, n, visible_at, expires_at, bodies):
        self.seq0 = seq0
        self.queue = queue
        self.prefix = prefix
        self.first = first
        self.n = n
        self.visible_at = visible_at
        self.expires_at = expires_at
        self.bodies = bodies       # the record's bodies; None once checkpointed (read from the store)
        self.offs = None           # body offsets in the stored blob (n + 1), set at checkpoint
        self.taken = bytearray(n)  # 1: left the segment (an Msg now speaks for it)
        self.left = n              # not taken
        self.cur = 0               # every index below it is taken
        self.state = READY
        self.gen = 0
        self.gone = bytearray(n)   # 1: a checkpoint recorded it as out of the segment
        self.n_gone = 0
        self.persisted = False     # its row exists in the store
        self.removed = False       # its queue was deleted
        self.lsn = 0               # the record that sent it (0: not known, a segment loaded from the store)
        # where its bodies are while its row points at that record's stored bytes
        # instead of holding them (body i at pos[i], offs[i + 1] - offs[i] long;
        # the edge's business, see Engine._take_checkpoint); None: in its row, or in memory
        self.pos = None

    def id_of(self, i: int) -> str:
        return message_id(self.prefix, self.first + i)

    def size_of(self, i: int) -> int:
        """The length of message ``i``'s body (from the bodies in memory, else the
        offsets in the stored row: one of the two is always there)."""
        if self.bodies is not None:
            return len(self.bodies[i])
        return self.offs[i + 1] - self.offs[i]

    def untaken(self):
        taken = self.taken
        return [i for i in range(self.cur, self.n) if not taken[i]]


class Run(NamedTuple):
    """A compact run as its send's apply result names it. Stored (``error`` None):
    the ids are ``prefix`` + hex of ``first`` .. ``first + n - 1`` (``ids()``),
    made only by whoever reads them (a replica never does). Else ``error`` is the
    kind that stored none of its ``n`` bodies (the queue was deleted)."""
    prefix: str
    first: int
    n: int
    error: Optional[str] = None

    def ids(self) -> list:
        return run_ids(self.prefix, self.first, self.n)


class Lease:
    __slots__ = ("id", "nonce", "queue", "msg_id", "epoch", "expires_at", "state", "via", "commit")

    def __init__(self, id, nonce, queue, msg_id, epoch, expires_at, via=None):
        self.id = id
        self.nonce = nonce
        self.queue = queue
        self.msg_id = msg_id
        self.epoch = epoch
        self.expires_at = expires_at
        self.state = ACTIVE
        self.via = via             # opaque: how the lease left (the edge's, for due_expiries' spare)
        self.commit = None         # opaque: while SETTLING, the edge's handle on the settle's commit


class Queue:
    def __init__(self, name: str, settings: dict):
        self.name = name
        self.settings = dict(settings)
        self.msgs: dict[str, Msg] = {}
        self.ready: list = []      # (seq, gen, id)
        self.delayed: list = []    # (visible_at, seq, gen, id)
        self.retention: list = []  # (expires_at, seq, id)
        self.n_ready = self.n_delayed = self.n_leased = 0
        self.counters = {"sent": 0, "acked": 0, "failed": 0, "expired": 0, "nacked": 0,
                         "lease_expired": 0, "purged": 0}
        self.dedup: dict[str, tuple] = {}  # key -> (message id, until_us); Core.dedup_exp ends them
        # segments (see Segment): their untaken messages count in n_ready/n_delayed
        self.seg_ready: list = []          # (seq of its next untaken message, gen, Segment)
        self.seg_delayed: list = []        # (visible_at, seq0, gen, Segment)
        self.seg_retention: list = []      # (expires_at, seq0, Segment)
        self.segs: dict[str, list] = {}    # id prefix -> segments with untaken messages, by first id

    @property
    def size(self) -> int:
        """Messages in the queue (in segments or not)."""
        return self.n_ready + self.n_delayed + self.n_leased

    @property
    def failure_queue(self) -> str:
        return failure_queue_of(self.name, self.settings)


@dataclass
class Dirty:
    """What changed since the last checkpoint (values are read at checkpoint time)."""

    msgs: dict = field(default_factory=dict)     # id -> Msg (removed or not)
    queues: set = field(default_factory=set)     # names (present or deleted)
    dedup: set = field(default_factory=set)      # (queue, key)
    keys: set = field(default_factory=set)       # key ids
    segs: dict = field(default_factory=dict)     # seq0 -> Segment (new, gone flags, or removed)
    # about what the next checkpoint writes of what was sent since the last one, in
    # bytes: a plain message's row holds its body, a segment's row names the log
    # record holding its bodies (offsets, positions and a flag: 9 bytes a message).
    # The edge checkpoints early when it grows (Engine._checkpoint_loop).
    write_bytes: int = 0
    # the cluster's id was adopted: the edge checkpoints at once (a restarted
    # node knows its cluster only from its store until its primary says what
    # is committed, and an unchecked call could reach it meanwhile)
    cluster_id: bool = False

    def __len__(self):
        return len(self.msgs) + len(self.queues) + len(self.dedup) + len(self.keys) + len(self.segs) \
            + self.cluster_id


class Core:
    def __init__(self, rand: Callable[[int], bytes], ended_leases_max: int = 100_000):
        self.rand = rand                 # injected randomness (lease nonces)
        self.epoch = 0                   # epoch of the last applied record
        self.lsn = 0                     # lsn of the last applied record
        self.next_seq = 1                # message order (oldest first)
        self.cluster_id = ""             # the first EpochBegin's cluster_id in the log ("" = none yet)
        self.queues: dict[str, Queue] = {}
        self.keys: dict[str, tuple] = {}  # key id -> (sha256, queue, scopes tuple)
        self.keys_version = 0            # bumped by every key put or delete (the edge's auth memo)
        self.leases: dict[int, Lease] = {}
        self.lease_heap: list = []       # (expires_at, lease id)
        self.next_lease_id = 1
        self.spared = 0                  # leases given back at expiry by due_expiries(spare=)
        self.ended: OrderedDict[int, str] = OrderedDict()  # lease id -> reason, bounded
        self.ended_leases_max = ended_leases_max
        self.dirty = Dirty()
        self.woken: set = set()          # queues that gained ready messages since last drained
        # Dedup keys remembered, every queue together (Limits.dedup_keys_max), and
        # when each ends: (until_us, queue, key), a heap for all queues, so that a
        # key is forgotten once its window is over whether or not its queue gets
        # another keyed send (each record's time ends them, on every node alike).
        self.dedup_n = 0
        self.dedup_exp: list = []
        # the lengths of the id prefixes of every segment this core indexed (Core._seg_of)
        self.prefix_lengths: tuple = ()

    # ------------------------------------------------------------------ apply
    def apply(self, rec) -> object:
        if rec.lsn != self.lsn + 1:
            raise BrokenInvariant(f"log gap: applying lsn {rec.lsn} after {self.lsn}")
        if rec.epoch < self.epoch:
            raise BrokenInvariant(f"epoch went back: {rec.epoch} after {self.epoch}")
        op = rec.WhichOneof("op")
        if op is None:  # a record type this build does not know: never skip a change
            raise ValueError(f"record {rec.lsn} holds an operation this node does not know (an older build?)")
        self.lsn = rec.lsn
        self.epoch = rec.epoch
        ts = rec.ts_us
        if self.dedup_exp and self.dedup_exp[0][0] <= ts:
            self._prune_dedup(ts)
        return getattr(self, "_apply_" + op)(getattr(rec, op), ts)

    def _apply_epoch_begin(self, op, ts):
        # The cluster's identity: the first one the log names, for good. Every
        # node applies the same log, so every node adopts the same id. Only the
        # log's first record offers one (Engine.on_role); later ones repeat it, so
        # a node whose store kept none adopts it again from the next of them.
        if not self.cluster_id and op.cluster_id:
            self.cluster_id = op.cluster_id
            self.dirty.cluster_id = True
        # A primary change: every lease of an older epoch is gone; its message
        # is visible at once, retry count unchanged (infrastructure, not consumer).
        for lease in list(self.leases.values()):
            q = self.queues.get(lease.queue)
            m = q.msgs.get(lease.msg_id) if q else None
            if m is not None and m.state == LEASED:
                self._detach(q, m, "primary_changed")
                m.visible_at = min(m.visible_at, ts)
                self._make_available(q, m, ts)
                # due_drops skipped it while leased: give retention another look
                heapq.heappush(q.retention, (m.expires_at, m.seq, m.id))
            self._end_lease(lease, "primary_changed")
        self.lease_heap.clear()
        return None

    def _apply_queue_put(self, op, ts):
        given = {f.name: v for f, v in op.settings.ListFields()}
        q = self.queues.get(op.name)
        created = q is None
        if created:
            q = self.queues[op.name] = Queue(op.name, {**DEFAULT_SETTINGS, **given})
        else:
            q.settings.update(given)
        self.dirty.queues.add(op.name)
        return created

    def _drop_all(self, q: Queue) -> int:
        """Every message of ``q`` goes (a queue delete, a purge); a lease on one ends
        (stale_lease, reason settled). -> how many there were. The queue's counts
        are the caller's to reset (a purge zeroes them, a delete drops the queue).
        ``_detach`` and ``_remove`` inlined: one pass over up to the per-queue cap
        of messages, on every node's loop (limits.md: under half the time of the calls)."""
        n = q.size
        msgs, q.msgs = q.msgs, {}
        dirty, leases = self.dirty.msgs, self.leases
        for mid, m in msgs.items():
            if m.state == LEASED:
                self._end_lease(leases.get(m.lease), "settled")
            m.gen += 1
            m.state = None
            m.removed = True
            dirty[mid] = m
        for lst in q.segs.values():  # segments with untaken messages (the others end with their Msgs)
            for seg in lst:
                seg.removed = True
                self.dirty.segs[seg.seq0] = seg
        return n

    def _apply_purge(self, op, ts):
        """-> the messages the queue held, or None: no such queue. Its settings,
        totals (purgedTotal counts these) and dedup keys stay."""
        q = self.queues.get(op.queue)
        if q is None:
            return None
        n = self._drop_all(q)
        q.counters["purged"] += n
        q.segs = {}
        q.n_ready = q.n_delayed = q.n_leased = 0  # (untaken segment messages were counted here)
        q.ready, q.delayed, q.retention = [], [], []  # every entry is stale now
        q.seg_ready, q.seg_delayed, q.seg_retention = [], [], []
        self.dirty.queues.add(q.name)
        return n

    def _apply_queue_delete(self, op, ts):
        q = self.queues.pop(op.name, None)
        if q is None:
            return False
        self._drop_all(q)
        for key in q.dedup:
            self.dirty.dedup.add((q.name, key))
        self.dedup_n -= len(q.dedup)  # (their entries in dedup_exp find no queue, or a new one's own keys)
        if len(self.dedup_exp) > 2 * self.dedup_n + 1024:  # those entries would stay up to a day: drop them
            self.dedup_exp = [(until, name, key) for name, other in self.queues.items()
                              for key, (_, until) in other.dedup.items()]
            heapq.heapify(self.dedup_exp)
        self.dirty.queues.add(op.name)
        self.woken.add(op.name)  # its long polls answer queue_not_found now, not at their deadline
        return True

    def _apply_send(self, op, ts):
        """-> (entries, run). entries: per entry (id, duplicate) or (None, error
        kind: ``queue_not_found``, or ``unavailable`` for a repeat whose key was
        forgotten before it applied); run: None (the record has no run) or a ``Run``."""
        out = []
        queues = self.queues
        for e in op.entries:
            q = queues.get(e.queue)
            if q is None:
                out.append((None, "queue_not_found"))
                continue
            mid = e.id
            key = e.dedup_key
            if key:
                window = q.settings["dedup_window_us"]
                hit = q.dedup.get(key) if window > 0 else None  # (apply ended every key whose window is over)
                if hit is not None and ts < hit[1]:
                    out.append((hit[0], True))
                    continue
                if e.repeat:
                    # the primary let it in as a repeat, at no cap's cost; stored now,
                    # it could pass the queue's, the node's or the keys' cap
                    out.append((None, "unavailable"))
                    continue
                if window > 0:
                    if hit is None:
                        self.dedup_n += 1
                    q.dedup[key] = (mid, ts + window)
                    heapq.heappush(self.dedup_exp, (ts + window, q.name, key))
                    self.dirty.dedup.add((q.name, key))
            if mid in q.msgs or (q.segs and self._seg_of(q, mid) is not None):
                raise BrokenInvariant(f"record {self.lsn} sends message {mid} to {q.name}, which holds one "
                                      "by that id: ids are never reused")
            visible_at = ts + e.delay_us if e.delay_us > 0 else ts
            m = Msg(mid, q.name, self.next_seq, e.body, 0, visible_at, visible_at + q.settings["retention_us"])
            self.next_seq += 1
            self.dirty.write_bytes += len(e.body)
            q.msgs[mid] = m
            q.counters["sent"] += 1
            self._make_available(q, m, ts)
            heapq.heappush(q.retention, (m.expires_at, m.seq, mid))
            out.append((mid, False))
            self.dirty.queues.add(q.name)
        return out, (self._apply_send_run(op, ts) if op.run_bodies else None)

    def _apply_send_compact(self, op, ts):
        return self._apply_send(op, ts)

    def _apply_send_run(self, op, ts):
        """The compact form: the same as one entry per body without a dedup key,
        held as one Segment (this is the hot path of batched sends)."""
        bodies = op.run_bodies
        n = len(bodies)
        prefix, first = op.run_id_prefix, op.run_id_first
        q = self.queues.get(op.run_queue)
        if q is None:
            return Run(prefix, first, n, "queue_not_found")
        name = q.name
        lst = q.segs.get(prefix)
        if lst:
            k = bisect_right(lst, first, key=_first)
            if (k and lst[k - 1].first + lst[k - 1].n > first) or (k < len(lst) and lst[k].first < first + n):
                raise BrokenInvariant(f"record {self.lsn} sends ids {prefix}{first:x} on ({n}) to {name}, "
                                      "which holds some of them: ids are never reused")
        visible_at = ts + op.run_delay_us if op.run_delay_us > 0 else ts
        seg = Segment(self.next_seq, name, prefix, first, n, visible_at,
                      visible_at + q.settings["retention_us"], bodies)
        seg.lsn = self.lsn
        self.next_seq += n
        self._add_segment(q, seg, ts)
        self.dirty.segs[seg.seq0] = seg
        self.dirty.write_bytes += SEGMENT_ROW_BYTES_PER_MESSAGE * n
        q.counters["sent"] += n
        self.dirty.queues.add(name)
        self._tidy(q)
        return Run(prefix, first, n)

    def _add_segment(self, q: Queue, seg: Segment, now: int) -> None:
        """Index a segment's untaken messages and place them (ready or delayed)."""
        lst = q.segs.get(seg.prefix)
        if lst is None:
            lst = q.segs[seg.prefix] = []
            if len(seg.prefix) not in self.prefix_lengths:
                self.prefix_lengths = tuple(sorted(self.prefix_lengths + (len(seg.prefix),)))
        if lst and lst[-1].first > seg.first:
            lst.insert(bisect_right(lst, seg.first, key=_first), seg)
        else:
            lst.append(seg)
        heapq.heappush(q.seg_retention, (seg.expires_at, seg.seq0, seg))
        seg.gen += 1
        if seg.visible_at > now:
            seg.state = DELAYED
            q.n_delayed += seg.left
            heapq.heappush(q.seg_delayed, (seg.visible_at, seg.seq0, seg.gen, seg))
        else:
            seg.state = READY
            q.n_ready += seg.left
            heapq.heappush(q.seg_ready, (seg.seq0 + seg.cur, seg.gen, seg))
            self.woken.add(q.name)

    def _tidy(self, q: Queue) -> None:
        """Heaps delete lazily: an entry goes stale when its message or segment moves
        on, and is skipped when popped. A replica never pops (it neither receives nor
        drops), and a primary pops a retention entry only when it is due, so stale
        entries are swept here once a queue's heaps hold over twice what is live
        (amortised O(1) per push)."""
        live = q.size + 1024
        if len(q.retention) + len(q.ready) + len(q.delayed) + len(q.seg_retention) + len(q.seg_ready) \
                + len(q.seg_delayed) <= 2 * live:
            return
        msgs = q.msgs
        # a lease that ends gives its message a retention entry of its own while the
        # first may still be queued (_give_back): keep one entry per message
        kept = {}
        for e in q.retention:
            if (m := msgs.get(e[2])) is not None and m.expires_at == e[0]:
                kept[e[2]] = e
        q.retention = list(kept.values())
        q.ready = [e for e in q.ready if (m := msgs.get(e[2])) is not None and m.gen == e[1] and m.state == READY]
        q.delayed = [e for e in q.delayed
                     if (m := msgs.get(e[3])) is not None and m.gen == e[2] and m.state == DELAYED]
        q.seg_retention = [e for e in q.seg_retention if e[2].left and not e[2].removed]
        q.seg_ready = [e for e in q.seg_ready if e[2].gen == e[1] and e[2].state == READY and e[2].left]
        q.seg_delayed = [e for e in q.seg_delayed if e[3].gen == e[2] and e[3].state == DELAYED and e[3].left]
        for h in (q.retention, q.ready, q.delayed, q.seg_retention, q.seg_ready, q.seg_delayed):
            heapq.heapify(h)

    def _seg_of(self, q: Queue, mid: str):
        """(Segment, index) holding the untaken message ``mid``, else None (_untaken_in)."""
        return _untaken_in(q.segs, self.prefix_lengths, mid)

    def _leave(self, q: Queue, seg: Segment, i: int) -> None:
        """Message ``i`` is no longer inside ``seg`` (taken or acked)."""
        seg.taken[i] = 1
        seg.left -= 1
        self._moved_on(q, seg, i)

    @staticmethod
    def _moved_on(q: Queue, seg: Segment, i: int) -> None:
        """Messages left ``seg`` from index ``i`` on (their ``taken`` flags set, ``left``
        counted down): its head moves past them, and a segment with none left is no
        longer indexed."""
        if i == seg.cur:
            c = seg.taken.find(0, i)
            seg.cur = seg.n if c < 0 else c
        if not seg.left:
            lst = q.segs.get(seg.prefix)
            if lst is not None:
                lst.remove(seg)
                if not lst:
                    del q.segs[seg.prefix]

    def _take(self, q: Queue, seg: Segment, i: int, size: Optional[int] = None) -> Msg:
        """Message ``i`` leaves its segment as an Msg in the segment's state (still
        counted there: ready or delayed) but in no heap: the caller leases or
        detaches it at once."""
        if size is None:
            size = seg.size_of(i)
        self._leave(q, seg, i)
        m = Msg(seg.id_of(i), q.name, seg.seq0 + i, seg.bodies[i] if seg.bodies is not None else None,
                0, seg.visible_at, seg.expires_at, size)
        m.state = seg.state
        m.gen = 1
        m.src = (seg, i)
        q.msgs[m.id] = m
        heapq.heappush(q.retention, (m.expires_at, m.seq, m.id))  # its segment's entry no longer covers it
        return m

    def _apply_settle(self, op, ts):
        """Per entry: True if it changed a message, False if the message was gone."""
        out = []
        ACK = log_pb2.ACK
        entries = op.entries
        n, k = len(entries), 0
        tidy, last = set(), None  # the queues named (swept at the end)
        while k < n:
            e = entries[k]
            k += 1
            q = self.queues.get(e.queue)
            if q is None:
                out.append(False)
                continue
            if q is not last:
                tidy.add(q)
                last = q
            m = q.msgs.get(e.id)
            if m is not None and e.kind == ACK and m.state == LEASED:
                # the usual case on the primary: an ack of a leased message (what
                # _detach, _end_lease and _remove do for it, inline)
                q.n_leased -= 1
                lease = self.leases.pop(m.lease, None)
                if lease is not None:
                    self.ended[lease.id] = "settled"
                m.gen += 1
                m.state = None
                del q.msgs[m.id]
                m.removed = True
                self.dirty.msgs[m.id] = m
                q.counters["acked"] += 1
                self.dirty.queues.add(q.name)
                out.append(True)
                continue
            if m is None:
                s = self._seg_of(q, e.id)
                if s is None:
                    out.append(False)
                    continue
                if e.kind == ACK:
                    # the usual case on a replica (receives are not logged): the
                    # message goes without ever becoming an Msg of its own, and so
                    # do those of the acks after it that name the next messages of
                    # the same segment (a receive hands them out oldest first)
                    j = self._ack_untaken_run(q, *s, entries, k - 1)
                    self.dirty.queues.add(q.name)
                    out.extend([True] * (j - k + 1))
                    k = j
                    continue
                if e.past_retries:  # (retry count 0 inside a segment: never past maxRetries)
                    out.append(False)
                    continue
                m = self._take(q, *s)
            if e.past_retries and e.kind == log_pb2.EXPIRE:
                out.append(self._expire_past_retries(q, m, ts))
                self.dirty.queues.add(q.name)
                continue
            self._detach(q, m, "settled" if e.kind != log_pb2.EXPIRE else "expired")
            if e.kind == ACK:
                q.counters["acked"] += 1
                self._remove(m)
            else:
                q.counters["nacked" if e.kind == log_pb2.NACK else "lease_expired"] += 1
                delay = e.delay_us if e.kind == log_pb2.NACK else 0
                self._retry_or_fail(q, m, ts, delay)
            self.dirty.queues.add(q.name)
            out.append(True)
        ended = self.ended
        while len(ended) > self.ended_leases_max:
            ended.popitem(last=False)
        for q in tidy:
            if self.queues.get(q.name) is q:
                self._tidy(q)
        return out

    def _ack_untaken_run(self, q: Queue, seg: Segment, i: int, entries, k: int) -> int:
        """Entry ``k`` acks message ``i``, untaken in ``seg``: that message and those
        of the entries after it that ack the next messages of ``seg`` in order
        (untaken, each id checked) leave it as gone, without an Msg of their own,
        in one pass. -> the index of the first entry not taken."""
        ACK, name, msgs = log_pb2.ACK, q.name, q.msgs
        taken = seg.taken
        most = min(seg.n - i, len(entries) - k)
        ids = run_ids(seg.prefix, seg.first + i, most) if most > 1 else None
        j = 1
        while j < most and not taken[i + j]:
            e = entries[k + j]
            # (an Msg of the same id would be the one acked one by one: ids are unique
            # by construction, but apply takes the lookup's order, not a guess)
            if e.id != ids[j] or e.kind != ACK or e.queue != name or e.id in msgs:
                break
            j += 1
        ones = b"\x01" * j
        taken[i:i + j] = ones
        seg.gone[i:i + j] = ones
        seg.n_gone += j
        seg.left -= j
        self._moved_on(q, seg, i)
        if seg.state == READY:
            q.n_ready -= j
        else:
            q.n_delayed -= j
        q.counters["acked"] += j
        self.dirty.segs[seg.seq0] = seg
        return k + j

    def _expire_past_retries(self, q: Queue, m: Msg, ts: int) -> bool:
        """A Settle(EXPIRE, past_retries) entry: the message moves to the failure queue
        if it is still past maxRetries (as an expiry would move it, retention
        permitting); else maxRetries was raised again since the receive found it,
        and it stays, visible, its count kept. Either way no lease expiry is counted:
        nobody held that lease. True if it moved."""
        self.woken.add(q.name)  # messages behind it may be delivered now: wake the long polls
        if m.retry > q.settings["max_retries"] and self._fails_elsewhere(q):
            self._detach(q, m, "expired")
            self._retry_or_fail(q, m, ts, 0)  # (retry + 1 > maxRetries: the failure queue)
            return True
        lease = self.leases.get(m.lease) if m.state == LEASED else None
        if lease is not None and lease.via is PAST_RETRIES:
            self._give_back(lease, ts)  # (on a replica, which holds no leases, it is visible already)
        return False

    def _apply_drop(self, op, ts):
        q = self.queues.get(op.queue)
        n = 0
        for mid in op.ids:
            m = q.msgs.get(mid) if q else None
            if m is None and q is not None:
                s = self._seg_of(q, mid)
                if s is not None and ts >= s[0].expires_at:
                    m = self._take(q, *s)
            if m is None or ts < m.expires_at:
                continue
            self._detach(q, m, "expired")
            self._remove(m)
            q.counters["expired"] += 1
            n += 1
        if n:
            self.dirty.queues.add(q.name)
            self._tidy(q)
        return n

    def _apply_redrive(self, op, ts):
        q = self.queues.get(op.queue)
        if q is None:
            return 0
        fq = self.queues.get(q.failure_queue)
        if fq is None or fq is q:
            return 0
        moved = 0
        for lst in list(fq.segs.values()):
            for seg in list(lst):
                for i in seg.untaken():
                    self._take(fq, seg, i)
        for m in sorted(fq.msgs.values(), key=lambda m: m.seq):
            self._detach(fq, m, "settled")
            self._move(fq, m, q, ts)
            moved += 1
        self.dirty.queues.update((q.name, fq.name))
        self._tidy(fq)  # emptied: what its heaps still hold is stale
        return moved

    def _apply_key_put(self, op, ts):
        self.keys[op.id] = (bytes(op.secret_sha256), op.queue, tuple(op.scopes))
        self.keys_version += 1
        self.dirty.keys.add(op.id)
        return None

    def _apply_key_delete(self, op, ts):
        found = self.keys.pop(op.id, None) is not None
        self.keys_version += 1
        self.dirty.keys.add(op.id)
        return found

    # --------------------------------------------------------------- helpers
    def _seq(self) -> int:
        s = self.next_seq
        self.next_seq += 1
        return s

    def _make_available(self, q: Queue, m: Msg, now: int) -> None:
        """Place a message that is not leased into the ready or delayed set."""
        m.gen += 1
        if m.visible_at > now:
            m.state = DELAYED
            q.n_delayed += 1
            heapq.heappush(q.delayed, (m.visible_at, m.seq, m.gen, m.id))
        else:
            m.state = READY
            q.n_ready += 1
            heapq.heappush(q.ready, (m.seq, m.gen, m.id))
            self.woken.add(q.name)
        self.dirty.msgs[m.id] = m

    def _detach(self, q: Queue, m: Msg, lease_end_reason: str) -> None:
        """Take a message out of whichever set holds it (ready, delayed or leased);
        a lease on it ends with ``lease_end_reason``. Heap entries go stale via gen."""
        if m.state == READY:
            q.n_ready -= 1
        elif m.state == DELAYED:
            q.n_delayed -= 1
        elif m.state == LEASED:
            q.n_leased -= 1
            self._end_lease(self.leases.get(m.lease), lease_end_reason)
        m.gen += 1
        m.state = None

    def _remove(self, m: Msg) -> None:
        q = self.queues.get(m.queue)
        if q is not None and q.msgs.get(m.id) is m:
            del q.msgs[m.id]
        m.removed = True
        self.dirty.msgs[m.id] = m

    def _retry_or_fail(self, q: Queue, m: Msg, ts: int, delay_us: int) -> None:
        if ts >= m.expires_at:  # its retention ended while it was leased
            q.counters["expired"] += 1
            self._remove(m)
            return
        if m.retry + 1 > q.settings["max_retries"]:
            name = q.failure_queue
            # no room for one more queue: it stays, as if the queue were its own failure queue
            fq = self._ensure_queue(name) if self._fails_elsewhere(q) else q
            if fq is q:  # a queue that is its own failure queue: keep it, count saturates
                m.visible_at = ts + max(0, delay_us)
                self._make_available(q, m, ts)
                heapq.heappush(q.retention, (m.expires_at, m.seq, m.id))  # see below
                return
            q.counters["failed"] += 1  # failedTotal: moved to the failure queue (API.md)
            self._move(q, m, fq, ts)
            return
        m.retry += 1
        m.visible_at = ts + max(0, delay_us)
        self._make_available(q, m, ts)
        # its retention entry may have come due while it was leased, and due_drops
        # skipped it then (a leased message is not dropped): it needs one again, or
        # it would sit visible, never delivered (receive passes over expired ones)
        # and never dropped. A second entry for it is harmless (_tidy, due_drops).
        heapq.heappush(q.retention, (m.expires_at, m.seq, m.id))

    def _move(self, src: Queue, m: Msg, dst: Queue, ts: int) -> None:
        """Move a taken message into ``dst`` as a new arrival with retry count 0."""
        del src.msgs[m.id]
        m.queue = dst.name
        m.seq = self._seq()
        m.retry = 0
        m.visible_at = ts
        m.expires_at = ts + dst.settings["retention_us"]
        dst.msgs[m.id] = m
        heapq.heappush(dst.retention, (m.expires_at, m.seq, m.id))
        self._make_available(dst, m, ts)
        self.dirty.queues.add(dst.name)
        self._tidy(dst)  # a failure queue is neither a settle's nor a send's queue: swept here

    def _ensure_queue(self, name: str) -> Queue:
        q = self.queues.get(name)
        if q is None:
            q = self.queues[name] = Queue(name, DEFAULT_SETTINGS)
            self.dirty.queues.add(name)
        return q

    def _prune_dedup(self, ts: int) -> None:
        """Forget every dedup key whose window ended by ``ts`` (a record's time)."""
        h, queues = self.dedup_exp, self.queues
        while h and h[0][0] <= ts:
            until, name, key = heapq.heappop(h)
            q = queues.get(name)
            hit = q.dedup.get(key) if q is not None else None
            if hit is not None and hit[1] == until:
                del q.dedup[key]
                self.dedup_n -= 1
                self.dirty.dedup.add((name, key))

    def release(self, lease_id: int, nonce: bytes, now: int) -> bool:
        """Give a leased message back as if it had never been received: visible at
        once, retry count unchanged. For a delivery whose answer never left the
        node (the caller's connection broke before it was sent): no consumer has
        it, so the lease ending is not the consumer's failure. Only an active
        lease whose token matches; a later ack of it answers stale (expired)."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.state != ACTIVE or not _same(lease.nonce, nonce):
            return False
        return self._give_back(lease, now)

    def _give_back(self, lease: Lease, now: int) -> bool:
        q = self.queues.get(lease.queue)
        m = q.msgs.get(lease.msg_id) if q else None
        if m is None or m.state != LEASED or m.lease != lease.id:
            return False
        self._detach(q, m, "expired")
        self._make_available(q, m, now)
        heapq.heappush(q.retention, (m.expires_at, m.seq, m.id))  # skipped while it was leased
        return True

    def _end_lease(self, lease: Optional[Lease], reason: str) -> None:
        if lease is None:
            return
        self.leases.pop(lease.id, None)
        self.ended[lease.id] = reason
        while len(self.ended) > self.ended_leases_max:
            self.ended.popitem(last=False)

    # ------------------------------------------------------- time (primary)
    def promote(self, q: Queue, now: int) -> None:
        """Delayed messages whose time has come become ready."""
        h = q.delayed
        while h and h[0][0] <= now:
            _, seq, gen, mid = heapq.heappop(h)
            m = q.msgs.get(mid)
            if m is None or m.gen != gen or m.state != DELAYED:
                continue
            q.n_delayed -= 1
            m.gen += 1
            m.state = READY
            q.n_ready += 1
            heapq.heappush(q.ready, (m.seq, m.gen, m.id))
            self.woken.add(q.name)
        h = q.seg_delayed
        while h and h[0][0] <= now:
            _, _, gen, seg = heapq.heappop(h)
            if seg.gen != gen or seg.state != DELAYED or seg.removed:
                continue
            seg.gen += 1
            seg.state = READY
            q.n_delayed -= seg.left
            q.n_ready += seg.left
            if seg.left:
                heapq.heappush(q.seg_ready, (seg.seq0 + seg.cur, seg.gen, seg))
                self.woken.add(q.name)

    def next_visible_at(self, queue: str) -> Optional[int]:
        q = self.queues.get(queue)
        if q is None:
            return None
        h = q.delayed
        while h:
            vis, _, gen, mid = h[0]
            m = q.msgs.get(mid)
            if m is not None and m.gen == gen and m.state == DELAYED:
                break
            heapq.heappop(h)
        sh = q.seg_delayed
        while sh:
            seg = sh[0][3]
            if seg.gen == sh[0][2] and seg.state == DELAYED and seg.left and not seg.removed:
                break
            heapq.heappop(sh)
        times = ([h[0][0]] if h else []) + ([sh[0][0]] if sh else [])
        return min(times) if times else None

    # --------------------------------------------------------- leases (primary)
    def receive(self, queue: str, now: int, max_n: int = 1, leases_max: int = 1 << 62, via=None,
                bytes_max: int = 1 << 62) -> list:
        """Lease up to ``max_n`` of the oldest visible messages. Returns [(Msg, Lease)].

        Only the primary calls this; the caller has checked that the queue exists.
        ``via``: kept on the leases for ``due_expiries``' ``spare`` (opaque here).
        ``bytes_max``: the bodies of one answer; the oldest message is always
        leased, the next only while the sum stays within it (the rest stay
        visible, untouched).
        """
        q = self.queues[queue]
        self.promote(q, now)
        out = []
        h = q.ready
        timeout = q.settings["lease_timeout_us"]
        nonces, k0 = b"", 0  # one draw of randomness for the leases of this call
        sh = q.seg_ready
        room = bytes_max
        past = 0  # leases for messages past maxRetries (below)
        while (h or sh) and len(out) < max_n and q.n_leased < leases_max:
            if sh and (not h or sh[0][0] < h[0][0]):
                # the oldest visible message sits in a segment: take it out
                seq, gen, seg = sh[0]
                if seg.gen != gen or seg.state != READY or not seg.left or seg.removed or now >= seg.expires_at:
                    heapq.heappop(sh)  # stale, or retention over (due_drops proposes its Drop)
                    continue
                if seq != seg.seq0 + seg.cur:  # its head was taken meanwhile (a drop, a settle)
                    heapq.heapreplace(sh, (seg.seq0 + seg.cur, gen, seg))
                    continue
                # The oldest visible messages sit in this segment: a run of them, up to
                # the oldest message of the ready heap (segments' seqs never interleave,
                # so no other segment holds one older than the run's last), leased in
                # one pass: the hot path of receive (a stale ready entry only makes
                # the run shorter)
                want = min(max_n - len(out), leases_max - q.n_leased)
                run, room, full = self._take_run(q, seg, want, room, h[0][0] if h else None, bool(out))
                if seg.left:
                    heapq.heapreplace(sh, (seg.seq0 + seg.cur, gen, seg))
                else:
                    heapq.heappop(sh)
                if run:
                    if not nonces:
                        nonces, k0 = self.rand(8 * (max_n - len(out))), len(out)
                    self._lease_run(q, run, nonces, 8 * (len(out) - k0), now + timeout, via, out)
                if full or not run:
                    break  # the answer is full: the rest stay where they are
                continue
            else:
                seq, gen, mid = heapq.heappop(h)
                m = q.msgs.get(mid)
                if m is None or m.gen != gen or m.state != READY:
                    continue
                if now >= m.expires_at:
                    # retention over: not handed out; due_drops() proposes its Drop
                    continue
                if m.retry > q.settings["max_retries"] and self._fails_elsewhere(q):
                    # Past a maxRetries lowered since its last delivery: never
                    # delivered again. It gets a lease that is over already and held
                    # by nobody, so the lease timer's next tick proposes its move
                    # (due_expiries, a Settle(EXPIRE) entry marked past_retries; every
                    # node applies it alike). Should that record not commit, the
                    # lease is tried again on a later tick, or ends with this primary
                    # and the next one finds the message here again.
                    if past >= PAST_RETRIES_PER_RECEIVE:
                        heapq.heappush(h, (seq, gen, mid))  # the next call's (woken when these move)
                        break
                    past += 1
                    self._lease(q, m, Lease(self.next_lease_id, self.rand(8), q.name, m.id, self.epoch, now,
                                            PAST_RETRIES))
                    continue
                if out and m.size > room:
                    heapq.heappush(h, (seq, gen, mid))  # the answer is full: back where it was
                    break
            room -= m.size
            if not nonces:
                nonces, k0 = self.rand(8 * (max_n - len(out))), len(out)
            k = 8 * (len(out) - k0)
            lease = Lease(self.next_lease_id, nonces[k:k + 8], q.name, m.id, self.epoch, now + timeout, via)
            self._lease(q, m, lease)
            out.append((m, lease))
        return out

    def _take_run(self, q: Queue, seg: Segment, want: int, room: int, bound: Optional[int], have: bool):
        """Up to ``want`` untaken messages of ``seg`` from its head, oldest first,
        while their seq stays below ``bound`` (None: no bound) and their bodies fit
        in ``room`` (the first always, unless ``have``: an answer holds at least one
        message). They leave the segment as ``_take`` has one leave, in one pass.
        -> (Msgs, room left, whether the room stopped it)."""
        taken, n, s0 = seg.taken, seg.n, seg.seq0
        bodies, offs = seg.bodies, seg.offs
        stop = n if bound is None else min(n, bound - s0)
        picked = []
        full = False
        i = seg.cur
        while i < stop and len(picked) < want:
            if not taken[i]:
                size = len(bodies[i]) if bodies is not None else offs[i + 1] - offs[i]
                if (have or picked) and size > room:
                    full = True
                    break
                room -= size
                picked.append((i, size))
            i += 1
        if not picked:
            return picked, room, full
        i0 = picked[0][0]
        ids = run_ids(seg.prefix, seg.first + i0, picked[-1][0] - i0 + 1)
        name, vis, exp, state = q.name, seg.visible_at, seg.expires_at, seg.state
        msgs, retention = q.msgs, q.retention
        push = heapq.heappush
        out = []
        for i, size in picked:
            taken[i] = 1
            m = Msg(ids[i - i0], name, s0 + i, bodies[i] if bodies is not None else None, 0, vis, exp, size)
            m.state = state
            m.gen = 1
            m.src = (seg, i)
            msgs[m.id] = m
            push(retention, (exp, s0 + i, m.id))  # its segment's entry no longer covers it
            out.append(m)
        seg.left -= len(picked)
        self._moved_on(q, seg, i0)  # (i0 is the head: the first untaken one)
        return out, room, full

    def _lease_run(self, q: Queue, run: list, nonces: bytes, k: int, expires_at: int, via, out: list) -> None:
        """Lease ``run``'s ready Msgs (out of every heap) until ``expires_at``, their
        nonces read from ``nonces`` at ``k``: ``_lease`` for each, in one pass.
        Appends (Msg, Lease) to ``out``."""
        leases, lh, name, epoch = self.leases, self.lease_heap, q.name, self.epoch
        push = heapq.heappush
        lid = self.next_lease_id
        for m in run:
            lease = Lease(lid, nonces[k:k + 8], name, m.id, epoch, expires_at, via)
            leases[lid] = lease
            push(lh, (expires_at, lid))
            m.gen += 1
            m.state = LEASED
            m.lease = lid
            out.append((m, lease))
            lid += 1
            k += 8
        self.next_lease_id = lid
        q.n_ready -= len(run)
        q.n_leased += len(run)
        self._bound_lease_heap()

    def _lease(self, q: Queue, m: Msg, lease: Lease) -> None:
        """``m``, ready and out of the ready heap, is leased by ``lease``."""
        self.next_lease_id += 1
        self.leases[lease.id] = lease
        self._push_lease(lease)
        q.n_ready -= 1
        q.n_leased += 1
        m.gen += 1
        m.state = LEASED
        m.lease = lease.id

    def _fails_elsewhere(self, q: Queue) -> bool:
        """Would a message past ``q``'s maxRetries leave it (_retry_or_fail)? Not
        when the queue is its own failure queue, or no new queue may be made."""
        name = q.failure_queue
        return name != q.name and (name in self.queues or len(self.queues) < QUEUES_MAX)

    def check_lease(self, epoch: int, lease_id: int, nonce: bytes, now: int) -> Lease:
        """The one lease gate: returns the live lease or raises StaleLeaseError."""
        if epoch != self.epoch:
            if epoch < self.epoch:
                raise StaleLeaseError("primary_changed")
            raise BadToken("lease token from an unknown epoch")
        lease = self.leases.get(lease_id)
        if lease is None:
            raise StaleLeaseError(self.ended.get(lease_id, "expired"))
        if not _same(lease.nonce, nonce):
            raise BadToken("lease token does not match")
        if lease.state == SETTLING:
            raise StaleLeaseError("settled", lease)
        if lease.state == EXPIRING or now >= lease.expires_at:
            raise StaleLeaseError("expired")
        return lease

    def begin_settle(self, lease: Lease) -> None:
        """Fence a lease while its ack/nack is being committed: no expiry, no second settle."""
        lease.state = SETTLING

    def end_settle(self, lease: Lease) -> None:
        """Undo begin_settle when the settle was known not to be accepted."""
        if lease.state == SETTLING and self.leases.get(lease.id) is lease:
            lease.state = ACTIVE
            lease.commit = None
            self._push_lease(lease)

    def _push_lease(self, lease: Lease) -> None:
        """The lease's expiry into the heap. Entries go stale when a lease ends
        (ack) or moves on (renew) and are only skipped when they come due, up to a
        lease timeout (12 h) later: so the heap is rebuilt from the live leases
        once it holds over twice their number (amortised O(1) per push)."""
        heapq.heappush(self.lease_heap, (lease.expires_at, lease.id))
        self._bound_lease_heap()

    def _bound_lease_heap(self) -> None:
        h = self.lease_heap
        if len(h) > 2 * len(self.leases) + 1024:
            h[:] = [(x.expires_at, x.id) for x in self.leases.values() if x.state == ACTIVE]
            heapq.heapify(h)

    def renew(self, lease: Lease, now: int) -> int:
        q = self.queues[lease.queue]
        lease.expires_at = now + q.settings["lease_timeout_us"]
        self._push_lease(lease)
        return lease.expires_at

    def expiry_record(self, due: list):
        """The Settle(EXPIRE) record for ``due_expiries``' leases; those of messages
        past maxRetries (Core.receive) are marked so."""
        rec = log_pb2.Record()
        add = rec.settle.entries.add
        for queue, mid in due:
            q = self.queues.get(queue)
            m = q.msgs.get(mid) if q is not None else None
            lease = self.leases.get(m.lease) if m is not None and m.state == LEASED else None
            if lease is not None and lease.via is PAST_RETRIES:
                add(kind=log_pb2.EXPIRE, queue=queue, id=mid, past_retries=True)
            else:
                add(kind=log_pb2.EXPIRE, queue=queue, id=mid)
        return rec

    def abort_expiries(self, due: list) -> None:
        """The Settle(EXPIRE) for these could not be proposed: expire them on a later tick."""
        for queue, mid in due:
            q = self.queues.get(queue)
            m = q.msgs.get(mid) if q else None
            lease = self.leases.get(m.lease) if m is not None and m.state == LEASED else None
            if lease is not None and lease.state == EXPIRING:
                lease.state = ACTIVE
                self._push_lease(lease)

    def due_expiries(self, now: int, spare=None) -> list:
        """Leases whose time ran out: [(queue, message id)] for a Settle(EXPIRE) record.

        ``spare(via) -> bool``: a lease whose ``via`` it accepts is given back
        instead (as ``release``: visible now, retry count kept), because nobody
        could have had it: the edge knows its answer went to a node that lost
        contact (see Engine._lost_contact). Counted in ``spared``."""
        out = []
        h = self.lease_heap
        while h and h[0][0] <= now:
            exp, lid = heapq.heappop(h)
            lease = self.leases.get(lid)
            if lease is None or lease.state != ACTIVE or lease.expires_at != exp:
                continue
            if lease.via is PAST_RETRIES:
                q = self.queues.get(lease.queue)
                m = q.msgs.get(lease.msg_id) if q is not None else None
                if m is not None and m.retry <= q.settings["max_retries"] and self._give_back(lease, now):
                    self.woken.add(q.name)  # maxRetries was raised again: it may be delivered
                    continue
            elif spare is not None and lease.via is not None and spare(lease.via):
                if self._give_back(lease, now):
                    self.spared += 1
                    continue
            lease.state = EXPIRING
            out.append((lease.queue, lease.msg_id))
        return out

    def due_drops(self, now: int, max_n: int = 10_000) -> list:
        """Messages past retention and not leased: [(queue, [ids])] for Drop records."""
        out = []
        for q in self.queues.values():
            h = q.retention
            ids = []
            while h and h[0][0] <= now and len(ids) < max_n:
                exp, seq, mid = heapq.heappop(h)
                m = q.msgs.get(mid)
                if m is None or m.expires_at != exp:
                    continue
                if m.state == LEASED:
                    continue  # dropped when its lease ends (see _retry_or_fail)
                if ids and ids[-1] == mid:
                    continue  # its second entry (see _tidy): equal entries pop one after another
                ids.append(mid)
            sh = q.seg_retention
            while sh and sh[0][0] <= now and len(ids) < max_n:
                seg = heapq.heappop(sh)[2]
                if seg.left and not seg.removed:
                    ids.extend([seg.id_of(i) for i in seg.untaken()])
            if ids:
                out.append((q.name, ids))
        return out

    def requeue_drops(self, queue: str, ids: list) -> None:
        q = self.queues.get(queue)
        again = set()
        for mid in ids:
            m = q.msgs.get(mid) if q else None
            if m is not None:
                heapq.heappush(q.retention, (m.expires_at, m.seq, m.id))
            elif q is not None:
                s = self._seg_of(q, mid)
                if s is not None and s[0].seq0 not in again:
                    again.add(s[0].seq0)
                    heapq.heappush(q.seg_retention, (s[0].expires_at, s[0].seq0, s[0]))

    # ------------------------------------------------------------- reading
    def dedup_ended(self, now: int, most: int) -> int:
        """How many remembered dedup keys have a window over by ``now`` (the next
        record applied forgets them), counted up to ``most``. Reads only: it walks
        the heap's entries due by ``now`` (a heap's due entries hang together from
        its root)."""
        h, queues, n = self.dedup_exp, self.queues, 0
        todo = [0] if h and h[0][0] <= now else []
        while todo and n < most:
            i = todo.pop()
            until, name, key = h[i]
            q = queues.get(name)
            hit = q.dedup.get(key) if q is not None else None
            if hit is not None and hit[1] == until:
                n += 1
            for j in (2 * i + 1, 2 * i + 2):
                if j < len(h) and h[j][0] <= now:
                    todo.append(j)
        return n

    def messages_held(self) -> int:
        """Messages in every queue together (O(queues): the node-wide cap reads it
        seldom, see Service._node_room)."""
        return sum(q.size for q in self.queues.values())

    def first_in_line_since(self, queue: str, now: int) -> Optional[int]:
        """When the first message in line (the oldest by send order among the
        visible ones, the next a receive would hand out) became visible, or None
        when none is. It makes only the changes a receive would make to the heaps
        it reads (stale entries dropped, a segment's entry moved to its head), and
        leaves everything it would lease where it is. For /metrics: how long the
        queue's head has waited for a consumer. A nacked message keeps its place
        in line and becomes visible anew: the figure is the head's wait, not the
        longest wait of any message."""
        q = self.queues[queue]
        self.promote(q, now)
        h, sh = q.ready, q.seg_ready
        while h:
            _, gen, mid = h[0]
            m = q.msgs.get(mid)
            if m is not None and m.gen == gen and m.state == READY and now < m.expires_at:
                break
            heapq.heappop(h)  # (receive would drop it the same way)
        while sh:
            seq, gen, seg = sh[0]
            if seg.gen != gen or seg.state != READY or not seg.left or seg.removed or now >= seg.expires_at:
                heapq.heappop(sh)
            elif seq != seg.seq0 + seg.cur:
                heapq.heapreplace(sh, (seg.seq0 + seg.cur, gen, seg))
            else:
                break
        if sh and (not h or sh[0][0] < h[0][0]):
            return sh[0][2].visible_at
        return q.msgs[h[0][2]].visible_at if h else None

    def stats(self, queue: str, now: int) -> dict:
        q = self.queues[queue]
        self.promote(q, now)
        c = q.counters
        return {"visible": q.n_ready, "leased": q.n_leased, "delayed": q.n_delayed,
                "sentTotal": c["sent"], "ackedTotal": c["acked"], "failedTotal": c["failed"],
                "expiredTotal": c["expired"], "nackedTotal": c["nacked"],
                "leaseExpiredTotal": c["lease_expired"], "purgedTotal": c["purged"]}

    # ------------------------------------------------------------- loading
    def load_queue(self, name: str, settings: dict, counters: dict) -> None:
        q = self.queues[name] = Queue(name, settings)
        q.counters.update(counters)

    def load_message(self, queue, id, seq, retry, visible_at, expires_at, now, size=0) -> None:
        q = self.queues[queue]
        m = Msg(id, queue, seq, None, retry, visible_at, expires_at, size)
        m.persisted = True
        q.msgs[id] = m
        self._make_available(q, m, now)
        del self.dirty.msgs[id]  # loaded from the store: nothing to write back
        heapq.heappush(q.retention, (expires_at, seq, id))
        self.next_seq = max(self.next_seq, seq + 1)

    def load_segment(self, queue, seq0, prefix, first, n, visible_at, expires_at, offs, gone, now,
                     lsn: int = 0, pos=None) -> Segment:
        """A stored segment: bodies stay in the store; ``gone`` ones have rows of their own or none."""
        q = self.queues[queue]
        seg = Segment(seq0, queue, prefix, first, n, visible_at, expires_at, None)
        seg.offs = offs
        seg.lsn, seg.pos = lsn, pos
        seg.gone[:] = gone
        seg.taken[:] = gone
        seg.n_gone = seg.n - seg.gone.count(0)
        seg.left = n - seg.n_gone
        seg.cur = seg.taken.find(0) if seg.left else n
        seg.persisted = True
        if seg.left:
            self._add_segment(q, seg, now)
        self.next_seq = max(self.next_seq, seq0 + n)
        return seg

    def messages(self, queue: str):
        """Every message of a queue as (id, seq, retry, visible_at, expires_at), in
        segments or not: the logical state, for tests and checks."""
        q = self.queues[queue]
        out = [(m.id, m.seq, m.retry, m.visible_at, m.expires_at) for m in q.msgs.values()]
        for lst in q.segs.values():
            for seg in lst:
                out.extend((seg.id_of(i), seg.seq0 + i, 0, seg.visible_at, seg.expires_at) for i in seg.untaken())
        return sorted(out, key=lambda t: t[1])

    def check(self, most: int = 20) -> list:
        """The state's structural invariants, recounted from scratch: up to ``most``
        descriptions of what is broken, [] when nothing is. O(messages): for the
        load at start (Engine.load) and for tests, never on a call's path.

        * a queue's ready, delayed and leased counts are what its messages and
          segments hold; a segment's ``left`` is its untaken messages; no
          counter of a queue is negative;
        * a message id names one live message, every queue together: no two
          messages share one, segments of one id prefix do not overlap, and no
          message is also untaken in a segment;
        * a leased message has its lease, and a lease names a message leased by it;
        * the count of dedup keys is the keys the queues hold."""
        bad: list = []
        ranges: dict = {}  # id prefix -> its Segments, every queue's (sorted by first below)
        held: dict = {}
        keys = 0
        for name, q in self.queues.items():
            n = {READY: 0, DELAYED: 0, LEASED: 0}
            for prefix, lst in q.segs.items():
                for seg in lst:
                    left = seg.n - seg.cur - seg.taken.count(1, seg.cur)
                    if seg.prefix != prefix or seg.queue != name or seg.state not in (READY, DELAYED) \
                            or seg.left != left or left <= 0:
                        bad.append(f"queue {name}: the segment at seq {seg.seq0} is not what its index says "
                                   f"({seg.queue}, {seg.prefix}, {seg.state}, {seg.left} left of {left})")
                        continue
                    n[seg.state] += left
                    ranges.setdefault(prefix, []).append(seg)
            for mid, m in q.msgs.items():
                if m.id != mid or m.queue != name:
                    bad.append(f"message {mid} is filed in queue {name} as {m.id} of {m.queue}")
                elif mid in held:
                    bad.append(f"message {mid} is in queues {held[mid]} and {name}")
                elif m.state not in n:
                    bad.append(f"message {mid} of {name} is in no state ({m.state})")
                else:
                    held[mid] = name
                    n[m.state] += 1
                    if m.state == LEASED:
                        lease = self.leases.get(m.lease)
                        if lease is None or lease.msg_id != mid or lease.queue != name:
                            bad.append(f"message {mid} of {name} is leased without its lease")
            if (q.n_ready, q.n_delayed, q.n_leased) != (n[READY], n[DELAYED], n[LEASED]):
                bad.append(f"queue {name} counts {q.n_ready} ready, {q.n_delayed} delayed and {q.n_leased} "
                           f"leased, and holds {n[READY]}, {n[DELAYED]} and {n[LEASED]}")
            if any(v < 0 for v in q.counters.values()):
                bad.append(f"queue {name} has a negative counter: {q.counters}")
            keys += len(q.dedup)
            if len(bad) >= most:
                return bad[:most]
        for prefix, segs in ranges.items():
            segs.sort(key=_first)
            for s0, s1 in zip(segs, segs[1:]):
                if s1.first < s0.first + s0.n:
                    bad.append(f"segments of {s0.queue} and {s1.queue} share ids from {prefix}{s1.first:x}")
        lengths = tuple(sorted({len(prefix) for prefix in ranges}))
        for mid, name in held.items():
            found = _untaken_in(ranges, lengths, mid)
            if found is not None:
                bad.append(f"message {mid} of {name} is also untaken in a segment of {found[0].queue}")
                if len(bad) >= most:
                    return bad[:most]
        for lid, lease in self.leases.items():
            q = self.queues.get(lease.queue)
            m = q.msgs.get(lease.msg_id) if q is not None else None
            if lid != lease.id or m is None or m.state != LEASED or m.lease != lid:
                bad.append(f"lease {lid} names message {lease.msg_id} of {lease.queue}, which it does not lease")
        if keys != self.dedup_n:
            bad.append(f"{self.dedup_n} dedup keys counted, {keys} held")
        return bad[:most]

    def load_dedup(self, queue, key, msg_id, until) -> None:
        q = self.queues[queue]
        if key not in q.dedup:
            self.dedup_n += 1
        q.dedup[key] = (msg_id, until)
        heapq.heappush(self.dedup_exp, (until, queue, key))


class StaleLeaseError(Exception):
    """``lease``: set for a lease still fenced by a settle whose commit is not
    applied yet (reason ``settled``), so the caller can wait for that commit."""

    def __init__(self, reason: str, lease: "Optional[Lease]" = None):
        super().__init__(reason)
        self.reason = reason
        self.lease = lease


class BadToken(Exception):
    pass


def _first(seg: Segment) -> int:
    return seg.first


def _untaken_in(by_prefix: dict, lengths: tuple, mid: str):
    """(Segment, index) of the untaken message ``mid`` among ``by_prefix`` (id prefix
    -> Segments of that prefix, sorted by first id), else None: one lookup per
    length of prefix in ``lengths`` (a node's prefixes are all 16 characters:
    one), however many prefixes there are."""
    for n in lengths:
        lst = by_prefix.get(mid[:n])
        if lst is None:
            continue
        try:
            c = int(mid[n:], 16)
        except ValueError:
            continue
        k = bisect_right(lst, c, key=_first) - 1
        if k < 0:
            continue
        seg = lst[k]
        i = c - seg.first
        if i < seg.n and not seg.taken[i] and seg.id_of(i) == mid:
            return seg, i
    return None


def _same(a: bytes, b: bytes) -> bool:
    return compare_digest(a, b)  # constant time
