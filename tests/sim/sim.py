"""Deterministic simulation of the replication/election core.

One seed fixes everything: message delays, drops, duplicates, reordering,
partitions (one-way too), crashes and restarts, streams that break while the
primary lives on, switchovers, client writes. Time is
simulated. Each node is the real ``node.core.replication.Replication`` plus a
simulated disk that holds exactly what the effects made durable; a crash drops
the volatile state and any effects not yet carried out.

Invariants checked after every step:
  * one primary per epoch;
  * no two nodes may lease at the same instant;
  * every commit agrees with every earlier commit at the same lsn (committed
    records are never lost or changed), and a node that becomes primary holds
    every record committed before;
  * every frame delivered holds at most the core's R.FRAME_RECORD_BYTES_MAX
    bytes of records, or a single record (records have sizes, mostly small,
    now and then of a few MiB);
and at the end (network healed, everyone up): the logs of caught-up nodes are
identical and every acknowledged write is in them, and each core knows the
size of every record its disk holds; with members low on disk (``low_disk``),
the primary is one with room whenever a member has room.

Disks are compacted now and then (a checkpoint of what the node applied, then
log rows behind it deleted, as Store.compaction_point allows), each node loads
its disk as Driver.load does (LogView.from_store), and a replica that needs
records its primary compacted away gets a copy of the primary's disk
(InstallSnapshot), installed or kept out as Engine._copy_held decides; the
checks above then read each log from its first row.

Replay a failure: ``python -m tests.sim.sim SEED [nodes]`` prints the trace.
"""
from __future__ import annotations

import heapq
import random
import sys
import zlib
from dataclasses import dataclass, field, replace

from node.core import replication as R

MS = 1000


@dataclass
class LocalSync:
    """The primary's own fsync of its records up to ``lsn`` completes (a local event)."""
    lsn: int
    epoch: int
    incarnation: int


@dataclass
class Backlogged:
    """A frame that arrived behind others still being stored: its contact was
    acknowledged on arrival (Replication.heard); now it is received in its turn.
    It went away with its stream if that broke (sent by ``frm`` as before)."""
    msg: object


@dataclass
class Declined:
    """The shell's refusal of a TimeoutNow (Driver._timeout_now_received): its
    target is low on disk. Delivered to the primary that sent it."""
    target: str
    epoch: int


@dataclass
class Disk:
    epoch: int = 0
    voted_for: str = ""
    lease_seen: int = 0
    log: list = field(default_factory=list)  # [(epoch, crc, payload, size)], lsn = off + index + 1
    joining: bool = False  # a replacement's empty disk (--join) until it has joined
    # compaction (Store.compaction_point) deleted the rows up to lsn ``off``; the
    # checkpoint's applied position (lsn, epoch, crc), which compaction never passes
    # (the last applied record stays in the log)
    off: int = 0
    applied: tuple = (0, 0, 0)

    @property
    def last_lsn(self) -> int:
        return self.off + len(self.log)  # (an empty log's off is its applied lsn)

    def at(self, lsn: int):
        """(epoch, crc) of the record at ``lsn`` on this disk, or None (compacted
        away, or past the end); the applied position counts (Store.last_position)."""
        if self.off < lsn <= self.off + len(self.log):
            return self.log[lsn - self.off - 1][:2]
        if lsn == self.applied[0]:
            return self.applied[1:]
        return None

    def view(self):
        """What Driver.load makes of this disk (LogView.from_store)."""
        return R.LogView.from_store([(self.off + 1 + i, e, crc, size) for i, (e, crc, _, size) in enumerate(self.log)],
                                    self.applied)


@dataclass
class CopyMade:
    """The primary's copy of its store for ``to`` is made (Engine.snapshot_to runs
    in slices after the decision to send it): what it holds is the store as of
    now, which may be later than the frame that asked for it (a local event)."""
    to: str
    epoch: int
    incarnation: int


@dataclass
class SnapshotCopy:
    """A primary's store as InstallSnapshot streams it (Engine.snapshot_to): its
    fsync'd log rows from its first, and its applied position."""
    epoch: int
    primary: str
    incarnation: int
    off: int
    rows: list
    applied: tuple


@dataclass
class SnapshotDone:
    """The replica's answer to a copy, back at the primary (Driver._send_snapshot)."""
    peer: str
    epoch: int
    incarnation: int
    ok: bool
    last_lsn: int


class SimNode:
    def __init__(self, sim, nid):
        self.sim = sim
        self.id = nid
        self._disk = Disk()
        self.up = True
        self.core = None
        self.pending = []  # (lsn, epoch, crc) written as primary, not yet known committed
        # a primary's records shipped before its own fsync completed (appended with
        # durable=False): on no disk here yet; a crash loses them
        self.volatile = []  # (lsn, epoch, crc, payload, size)
        self.incarnation = 0
        self.low_disk = False  # below its reserve (low_disk sims): drawn at each boot, flipped by the nemesis

    def boot(self):
        sim = self.sim
        entries, frames = sim.rng.choice([1, 3, 64]), sim.rng.choice([1, 4])
        # (one frame of one record in flight is one record a round trip: no faster
        # than the sim writes, so a replica that fell behind would never catch up)
        # which replicas a new record goes to at once, drawn at each boot (so a
        # cluster mixes both, as during a rolling change of --eager-replicas)
        eager = sim.eager_rng.choice([R.EAGER_QUORUM, R.EAGER_ALL])
        c = R.Replication(self.id, sim.members, failover_timeout_us=sim.timeout_for(self.id), rand=sim.rng.random,
                          frame_entries_max=entries, frames_in_flight_max=2 if entries == frames == 1 else frames,
                          eager=eager)
        c.epoch, c.voted_for, c.joining = self.disk.epoch, self.disk.voted_for, self.disk.joining
        c.lease_seen = self.disk.lease_seen
        # low_disk: now and then a member low on disk (Driver._handicap), drawn at
        # each boot: it campaigns a timeout later; every node may be one at once,
        # and a primary must still be elected
        self.low_disk = sim.low_disk and sim.rng.random() < 0.3
        c.disk(self.low_disk, sim.now)
        # as Driver.load: (epoch, crc) and the size of every record the disk holds,
        # after the first row's (the base); what the store applied was committed
        c.log = self.disk.view()
        c.epoch = max(c.epoch, c.log.last_epoch)
        c.commit_lsn = max(c.commit_lsn, self.disk.applied[0])
        self.core = c
        self.run(c.start(sim.now))

    @property
    def disk(self) -> Disk:
        return self._disk

    @disk.setter
    def disk(self, d: Disk) -> None:
        """A disk put in place of another: a lost disk's replacement (or a test's
        disk set by hand); Sim.check_matches leaves the node out from then on."""
        self._disk = d
        self.sim.replaced.add(self.id)

    def crc_at(self, lsn):
        if lsn > self.disk.last_lsn and self.volatile:
            return self.volatile[lsn - self.disk.last_lsn - 1][2]
        return self.disk.at(lsn)[1] if lsn >= 1 else 0

    def flush_volatile(self, upto=None):
        """The writer thread finishes the pending local writes, in order (it does so
        before any later store operation: truncation, replica appends)."""
        while self.volatile and (upto is None or self.volatile[0][0] <= upto):
            lsn, ep, crc, payload, size = self.volatile.pop(0)
            assert lsn == self.disk.last_lsn + 1, (self.id, "volatile write out of order", lsn)
            self.disk.log.append((ep, crc, payload, size))

    def local_sync(self, m: LocalSync):
        if not self.up or m.incarnation != self.incarnation:
            return
        self.flush_volatile(m.lsn)
        self.run(self.core.durable(m.lsn, m.epoch, self.sim.now))

    def run(self, effects):
        """Carry out effects in order; a crash mid-way drops the rest."""
        sim = self.sim
        for i, eff in enumerate(effects):
            if not self.up:
                return
            if sim.rng.random() < sim.p_crash_mid_effects:
                sim.trace(f"{self.id} crashes before effect {i}/{len(effects)}")
                sim.crash(self.id)
                return
            if isinstance(eff, (R.Truncate, R.Store, R.Role)):
                self.flush_volatile()
            if isinstance(eff, R.Persist):
                self.disk.epoch, self.disk.voted_for, self.disk.lease_seen = eff.epoch, eff.voted_for, eff.lease_seen
            elif isinstance(eff, R.Joined):
                self.disk.joining = False
            elif isinstance(eff, R.Truncate):
                assert eff.after_lsn >= self.committed_here(), (self.id, "truncating committed records")
                assert eff.after_lsn >= self.disk.applied[0], (self.id, "truncating applied records")
                assert eff.after_lsn >= self.disk.off, (self.id, "truncating compacted records")
                del self.disk.log[eff.after_lsn - self.disk.off:]
            elif isinstance(eff, R.Store):
                for lsn, ep, crc in eff.req.entries:
                    assert lsn == self.disk.last_lsn + 1, (self.id, lsn, self.disk.last_lsn)
                    self.disk.log.append((ep, crc, sim.payloads[(lsn, ep, crc)], sim.sizes[(lsn, ep, crc)]))
                self.run(self.core.stored(eff.req, sim.now))
            elif isinstance(eff, R.Send):
                sim.send(self.id, eff.to, eff.msg)
            elif isinstance(eff, R.Commit):
                sim.on_commit(self, eff.lsn)
            elif isinstance(eff, R.Role):
                sim.on_role(self, eff)

    def committed_here(self):
        return self.core.commit_lsn if self.core else 0


class Sim:
    def __init__(self, seed: int, nodes: int = 3, steps: int = 400, verbose: bool = False, mixed: bool = False,
                 low_disk: bool = False):
        self.seed = seed
        self.low_disk = low_disk
        self.rng = random.Random(seed)
        self.members = [f"n{i + 1}" for i in range(nodes)]
        self.timeout = 200 * MS
        # mixed: every node runs with its own --failover-timeout, drawn again at
        # each restart (a rolling change of it); self.timeout is the longest
        self.mixed = mixed
        self.timeout_choices = [200 * MS, 400 * MS, 800 * MS] if mixed else [self.timeout]
        self.timeouts = {nid: self.rng.choice(self.timeout_choices) for nid in self.members}
        if mixed:
            self.timeout = max(self.timeout_choices)
        self.now = 0
        self.steps = steps
        self.verbose = verbose
        self.log_lines: list = []
        self.queue: list = []  # (deliver_at, seq, to, msg, frm)
        self.seq = 0
        self.blocked: set = set()  # (frm, to)
        self.p_drop = self.rng.choice([0.0, 0.01, 0.05])
        self.p_dup = self.rng.choice([0.0, 0.02])
        self.p_crash_mid_effects = self.rng.choice([0.0, 0.002])
        self.delay_ms = self.rng.choice([(1, 3), (1, 20), (5, 60)])
        self.p_parallel = self.rng.choice([0.0, 0.5, 1.0])  # primary writes shipped before its fsync
        # a frame that arrives behind others still being stored: its contact is
        # acknowledged on arrival (Replication.heard), the frame is received later
        # (its own generator: the other draws of a seed stay what they were)
        self.backlog_rng = random.Random(f"backlog-{seed}")
        self.p_backlog = self.backlog_rng.choice([0.0, 0.05, 0.2])
        self.backlog_until: dict = {}  # node -> when the frames waiting behind its busy disk are received
        # low_disk: a member's disk fills or frees up now and then (its own generator)
        self.disk_rng = random.Random(f"disk-{seed}")
        # the records' sizes in bytes: mostly small, now and then a few MiB, so that
        # frames to a replica that lags are cut by the core's byte bound
        # (FRAME_RECORD_BYTES_MAX) as well as by its record bound (its own
        # generator, as the backlog's: the other draws of a seed stay what they were)
        self.size_rng = random.Random(f"sizes-{seed}")
        self.eager_rng = random.Random(f"eager-{seed}")  # (SimNode.boot; its own generator too)
        # compaction: now and then a node checkpoints what it has applied and deletes
        # log rows behind it (Engine.checkpoint_now); a replica that needs those gets
        # a snapshot of the primary's store (its own generator too)
        self.compact_rng = random.Random(f"compact-{seed}")
        self.p_compact = self.compact_rng.choice([0.0, 0.2, 0.5])
        self.compactions = 0
        self.snapshot_busy: dict = {}  # (primary, replica) -> until when a copy is under way
        self.snapshots = 0             # copies sent
        self.installs = 0              # ... installed
        self.copies_kept_out = 0       # ... not installed: the replica's log held the copy's end (Engine._copy_held)
        # writes by a primary in each --eager-replicas mode, and of them how many it
        # sent at once to fewer than all its peers: mode -> [writes, to fewer]
        self.writes_by_mode = {R.EAGER_QUORUM: [0, 0], R.EAGER_ALL: [0, 0]}
        self.payloads: dict = {}
        self.sizes: dict = {}          # (lsn, epoch, crc) -> the record's size in bytes
        self.frames = 0                # frames of records sent
        self.frames_cut_by_bytes = 0   # ... that ended early on the byte bound
        self.committed: dict = {}      # lsn -> (epoch, crc): the one committed history
        self.acked: list = []          # (lsn, epoch, crc) of writes a primary answered
        self.primaries: dict = {}      # epoch -> node id
        self.writes = 0
        self.pending_noops: list = []
        self.replaced: set = set()     # nodes whose disk was replaced (SimNode.disk; not in check_matches)
        self.nodes = {nid: None for nid in self.members}
        for nid in self.members:
            self.nodes[nid] = SimNode(self, nid)
        for n in list(self.nodes.values()):
            n.boot()

    def timeout_for(self, nid) -> int:
        return self.timeouts[nid]

    def trace(self, s):
        line = f"[{self.now / 1000:9.1f}ms] {s}"
        self.log_lines.append(line)
        if self.verbose:
            print(line)

    # ---------------------------------------------------------- network
    def send(self, frm, to, msg, extra_us: int = 0):
        if isinstance(msg, R.AppendReq) and msg.prev_epoch == -1:
            # what ``to`` needs was compacted away here: a copy of the store goes
            # instead (Driver._send), and the frame too (it holds no records)
            self.send_snapshot(frm, to, msg.epoch)
        if isinstance(msg, R.AppendReq) and msg.entries:
            msg = self.on_the_wire(self.nodes[frm], msg)
        if (frm, to) in self.blocked or self.rng.random() < self.p_drop:
            return
        copies = 2 if self.rng.random() < self.p_dup else 1
        for _ in range(copies):
            lo, hi = self.delay_ms
            at = self.now + self.rng.randint(lo, hi) * MS + extra_us
            self.seq += 1
            heapq.heappush(self.queue, (at, self.seq, to, msg, frm))

    def on_the_wire(self, sender, msg):
        """A frame of records as the driver sends it: each record's bytes go with
        it, and the receiving driver hands the core their sizes (Driver._handle_frame).
        Counts the frame, and whether the byte bound ended it (the sender's log
        went on, its record bound did not, and the next record would have taken
        the frame past FRAME_RECORD_BYTES_MAX)."""
        entries = [(lsn, ep, crc, self.sizes[(lsn, ep, crc)]) for lsn, ep, crc in msg.entries]
        self.frames += 1
        c, upto = sender.core, entries[-1][0]
        nxt = c.log.at(upto + 1)
        if len(entries) < c.frame_entries_max and nxt is not None:
            total = sum(e[3] for e in entries) + self.sizes[(upto + 1,) + nxt]
            if total > R.FRAME_RECORD_BYTES_MAX:
                self.frames_cut_by_bytes += 1
        return replace(msg, entries=entries)

    def check_frame(self, to, msg):
        """A frame delivered holds at most the core's byte bound of records, or one record."""
        if isinstance(msg, R.AppendReq) and len(msg.entries) > 1:
            total = sum(self.sizes[tuple(e[:3])] for e in msg.entries)
            assert total <= R.FRAME_RECORD_BYTES_MAX, \
                f"frame {msg.primary}->{to} of lsn {msg.entries[0][0]}..{msg.entries[-1][0]} " \
                f"({len(msg.entries)} records) holds {total} bytes > {R.FRAME_RECORD_BYTES_MAX}"

    def send_snapshot(self, frm, to, epoch):
        """One copy at a time to a peer; another only once this one is answered or
        has had its time (Driver._snapshots, _snapshot_retry)."""
        if self.now < self.snapshot_busy.get((frm, to), -1):
            return
        hi = self.delay_ms[1]
        self.snapshot_busy[(frm, to)] = self.now + 20 * hi * MS
        self.seq += 1
        heapq.heappush(self.queue, (self.now + self.compact_rng.randint(0, 2 * hi) * MS, self.seq, frm,
                                    CopyMade(to, epoch, self.nodes[frm].incarnation), frm))

    def copy_made(self, src, m: CopyMade):
        """The copy leaves (Driver._send_snapshot), tagged with the epoch of the frame
        that asked for it even if ``src`` has stepped down since (its task runs on),
        holding ``src``'s disk as it is now. Now and then it is slow on its way,
        past the time a retry may be sent: a late copy, which the replica must not
        install over records it has since acknowledged (Engine._copy_held)."""
        if not src.up or src.incarnation != m.incarnation:
            return  # died with the process
        self.snapshots += 1
        self.trace(f"{src.id} sends {m.to} a snapshot: log {src.disk.off + 1}..{src.disk.last_lsn}, "
                   f"applied {src.disk.applied[0]}")
        late = self.compact_rng.randint(1, 40 * self.delay_ms[1]) * MS if self.compact_rng.random() < 0.25 else 0
        self.send(src.id, m.to, SnapshotCopy(m.epoch, src.id, src.incarnation, src.disk.off, list(src.disk.log),
                                             src.disk.applied), extra_us=late)

    def install(self, n, m: SnapshotCopy):
        """Replica ``n`` receives a copy (Driver._install_locked, Engine.install_snapshot_sync)."""
        c, d = n.core, n.disk
        ok, last = False, 0
        if m.epoch >= c.epoch and c.role != R.PRIMARY and not c.join_quiet(self.now):
            end_lsn = m.off + len(m.rows)
            end = (end_lsn,) + m.rows[-1][:2] if m.rows else m.applied
            applied_here = min(c.commit_lsn, d.last_lsn)  # the engine applies what it knows committed
            held = R.copy_held(end, m.applied[0], (d.last_lsn,) + d.at(d.last_lsn), applied_here, d.at)
            ok, last = True, end[0]
            if not held:
                d.log, d.off, d.applied = list(m.rows), m.off, m.applied  # (our vote, epoch and lease stay)
                # Driver.load: epoch, vote and lease seen read back from the store,
                # the log's view, what the store applied counted committed
                c.voted_for, c.lease_seen = d.voted_for, d.lease_seen
                c.log = d.view()
                c.epoch = max(d.epoch, c.log.last_epoch)
                c.commit_lsn = max(c.commit_lsn, m.applied[0])
                c.durable_lsn = c.log.last_lsn
                last = c.log.last_lsn
                self.installs += 1
            else:
                self.copies_kept_out += 1
            self.trace(f"{n.id} {'keeps its log over' if held else 'installs'} the snapshot of {m.primary} "
                       f"(to lsn {end[0]})")
        self.send(n.id, m.primary, SnapshotDone(n.id, m.epoch, m.incarnation, ok, last))

    def snapshot_message(self, n, msg) -> bool:
        """A copy or its answer reaches live ``n``; False: ``msg`` is neither."""
        if isinstance(msg, SnapshotCopy):
            self.install(n, msg)
        elif isinstance(msg, SnapshotDone):
            self.snapshot_done(n, msg)
        else:
            return False
        return True

    def snapshot_done(self, n, m: SnapshotDone):
        """The primary hears how its copy went (Driver._send_snapshot)."""
        self.snapshot_busy.pop((n.id, m.peer), None)
        c = n.core
        if m.ok and n.incarnation == m.incarnation and c.role == R.PRIMARY and c.epoch == m.epoch:
            n.run(c.snapshot_sent(m.peer, m.last_lsn, self.now))

    def compact(self):
        """A live node's checkpoint: it records what it has applied (every record it
        holds that it knows committed) and deletes log rows behind that, keeping the
        last applied one (Store.compaction_point); the core forgets them first."""
        up = [n for n in self.nodes.values() if n.up]
        if not up:
            return
        n = self.compact_rng.choice(up)
        d = n.disk
        applied = min(n.core.commit_lsn, d.last_lsn)
        if applied > d.applied[0]:
            d.applied = (applied,) + d.at(applied)
        cut = d.applied[0] - self.compact_rng.choice([1, 2, 3, 10])
        if cut > d.off:
            n.core.log.compact(cut)
            del d.log[:cut - d.off]
            d.off = cut
            self.compactions += 1
            self.trace(f"{n.id} compacts its log to lsn {cut} (applied {d.applied[0]})")

    def record_size(self) -> int:
        r = self.size_rng.random()
        if r < 0.08:
            return self.size_rng.randint(256 << 10, 6 << 20)  # large: up to 6 MiB (> the frame bound)
        return self.size_rng.randint(40, 4000)

    # ------------------------------------------------------------ events
    def on_role(self, node, eff):
        self.trace(f"{node.id} -> {eff.role} epoch {eff.epoch}")
        if eff.role != R.PRIMARY:
            node.pending = []  # the engine answers these operation_unconfirmed: outcome unknown
        if eff.role == R.PRIMARY:
            prev = self.primaries.get(eff.epoch)
            assert prev in (None, node.id), f"two primaries in epoch {eff.epoch}: {prev} and {node.id}"
            self.primaries[eff.epoch] = node.id
            self.pending_noops.append(node.id)  # like the engine: EpochBegin first
            # leader completeness: the new primary holds every committed record (those
            # compacted away were applied, and the checksum of the first one it holds
            # chains them all)
            for lsn, (ep, crc) in self.committed.items():
                if lsn <= node.disk.off and lsn != node.disk.applied[0]:
                    continue
                assert node.disk.at(lsn) == (ep, crc), f"new primary {node.id} lacks committed lsn {lsn}"

    def on_commit(self, node, lsn):
        for i in range(max(1, node.disk.off), lsn + 1):
            have = node.disk.at(i)
            if have is None and i == node.disk.off:
                continue  # compacted; applied, so committed before (and checked then)
            assert have is not None, f"{node.id} commits lsn {i} it does not hold"
            prior = self.committed.get(i)
            assert prior is None or prior == have, f"lsn {i} committed as {prior} and as {have} on {node.id}"
            self.committed[i] = have
        if node.core.role == R.PRIMARY:
            for (lsn_, ep, crc) in list(node.pending):
                if lsn_ <= lsn:
                    self.acked.append((lsn_, ep, crc))
                    node.pending.remove((lsn_, ep, crc))

    def crash(self, nid):
        n = self.nodes[nid]
        if not n.up:
            return
        n.up = False
        n.core = None
        n.pending = []
        n.volatile = []  # lost: never fsync'd
        n.incarnation += 1
        self.trace(f"{nid} CRASH")

    def restart(self, nid):
        n = self.nodes[nid]
        if n.up:
            return
        n.up = True
        if self.mixed and self.rng.random() < 0.5:
            self.timeouts[nid] = self.rng.choice(self.timeout_choices)
        self.trace(f"{nid} RESTART (epoch {n.disk.epoch}, log {n.disk.off + 1}..{n.disk.last_lsn}, "
                   f"timeout {self.timeouts[nid] // MS} ms)")
        n.boot()

    def flush_noops(self):
        while self.pending_noops:
            n = self.nodes[self.pending_noops.pop(0)]
            if n.up and n.core.role == R.PRIMARY:
                self.write(n)

    def client_write(self):
        for n in self.nodes.values():
            if n.up and n.core.serving(self.now):
                self.write(n)
                return

    def write(self, n):
        if True:
            if True:
                c = n.core
                lsn, ep = c.log.last_lsn + 1, c.epoch
                self.writes += 1
                payload = f"w{self.writes}".encode()
                size = self.record_size()  # (the payload stands for that many bytes)
                crc = zlib.crc32(payload, n.crc_at(lsn - 1))
                self.payloads[(lsn, ep, crc)] = payload
                self.sizes[(lsn, ep, crc)] = size
                n.pending.append((lsn, ep, crc))
                if n.volatile or self.rng.random() < self.p_parallel:
                    # shipped first; the local fsync completes later (or a crash loses it)
                    n.volatile.append((lsn, ep, crc, payload, size))
                    self.seq += 1
                    heapq.heappush(self.queue, (self.now + self.rng.randint(0, 30) * MS, self.seq, n.id,
                                                LocalSync(lsn, ep, n.incarnation), n.id))
                    effects = c.appended([(lsn, ep, crc, size)], self.now, durable=False)
                else:
                    n.disk.log.append((ep, crc, payload, size))  # the group commit's fsync
                    effects = c.appended([(lsn, ep, crc, size)], self.now)
                sent_to = {e.to for e in effects if isinstance(e, R.Send) and e.msg.entries
                           and e.msg.entries[-1][0] >= lsn}
                if c.role == R.PRIMARY:
                    counts = self.writes_by_mode[c.eager]
                    counts[0] += 1
                    counts[1] += len(sent_to) < len(c.peers)
                n.run(effects)

    def check_leases(self):
        holders = [n.id for n in self.nodes.values() if n.up and n.core.may_lease(self.now)]
        assert len(holders) <= 1, f"two nodes may lease at once: {holders}"
        self.check_matches()

    def check_matches(self):
        """What a live primary counts a replica of its epoch as holding (``match``,
        what commits count), that replica's disk holds: a late snapshot installed
        over records it acknowledged would break this (a replaced disk is left
        out: its primary's count is of the old disk until it answers)."""
        for p in self.nodes.values():
            if not (p.up and p.core.role == R.PRIMARY):
                continue
            for nid, lsn in p.core.match.items():
                n = self.nodes[nid]
                if not n.up or n.core.epoch != p.core.epoch or nid in self.replaced or lsn <= n.disk.off:
                    continue
                want = p.core.log.at(lsn)
                assert want is None or n.disk.at(lsn) == want, \
                    f"{p.id} counts {nid} as holding lsn {lsn} {want}; its disk holds {n.disk.at(lsn)}"

    def nemesis(self):
        if self.compact_rng.random() < self.p_compact:
            self.compact()
        if self.low_disk and self.disk_rng.random() < 0.02:
            n = self.nodes[self.disk_rng.choice(self.members)]
            n.low_disk = not n.low_disk
            self.trace(f"{n.id} disk {'LOW' if n.low_disk else 'has room'}")
        r = self.rng.random()
        ids = self.members
        if self.mixed and r < 0.004:
            # a node's disk is lost and a replacement starts on an empty one (--join),
            # with a timeout of its own; one at a time (losing a majority's disks
            # loses data whatever the rules)
            if not any(n.disk.joining for n in self.nodes.values()):
                nid = self.rng.choice(ids)
                self.crash(nid)
                self.nodes[nid].disk = Disk(joining=True)
                self.trace(f"{nid} DISK LOST")
                self.restart(nid)
            return
        if r < 0.02:
            self.crash(self.rng.choice(ids))
        elif r < 0.06:
            down = [i for i in ids if not self.nodes[i].up]
            if down:
                self.restart(self.rng.choice(down))
        elif r < 0.08:
            a, b = self.rng.sample(ids, 2)
            self.blocked.add((a, b))
            if self.rng.random() < 0.5:
                self.blocked.add((b, a))
            self.trace(f"partition {a}->{b}")
        elif r < 0.11:
            self.blocked.clear()
            self.trace("heal")
        elif r < 0.12:
            # a primary's process dies: its peers' streams break at once
            prim = [n for n in self.nodes.values() if n.up and n.core.role == R.PRIMARY]
            if prim:
                p = prim[0].id
                self.crash(p)
                for n in self.nodes.values():
                    if n.up and n.core.primary == p:
                        n.run(n.core.primary_stream_broken(self.now))
        elif r < 0.125:
            # the primary's streams break but its process lives on (a reset
            # connection, a flapping link): replicas may elect fast while the old
            # primary still holds its lease
            prim = [n for n in self.nodes.values() if n.up and n.core.role == R.PRIMARY]
            if prim:
                p = prim[0].id
                self.trace(f"streams from {p} break, {p} lives")
                for n in self.nodes.values():
                    if n.up and n.core.primary == p:
                        n.run(n.core.primary_stream_broken(self.now))
                for other in self.members:  # and the primary reopens them
                    if other != p and prim[0].up:
                        prim[0].run(prim[0].core.replica_stream_lost(other, self.now))
                if self.rng.random() < 0.5:  # and sometimes the link stays down a while
                    for other in self.members:
                        if other != p:
                            self.blocked.add((p, other))
        elif r < 0.135:
            prim = [n for n in self.nodes.values() if n.up and n.core.role == R.PRIMARY]
            if prim:
                tgt = self.rng.choice([i for i in ids if i != prim[0].id])
                self.trace(f"transfer {prim[0].id} -> {tgt}")
                prim[0].run(prim[0].core.transfer(tgt, self.now))

    def deliver_next(self) -> None:
        """The earliest message in flight arrives (or a node's disk sync ends)."""
        at, _, to, msg, _frm = heapq.heappop(self.queue)
        self.now = max(self.now, at)
        self.check_frame(to, msg)
        n = self.nodes[to]
        if isinstance(msg, LocalSync):
            n.local_sync(msg)
        elif isinstance(msg, CopyMade):
            self.copy_made(n, msg)
        elif n.up and self.declines(n, msg, _frm):
            pass
        elif n.up and self.snapshot_message(n, msg):
            pass
        elif n.up:
            if isinstance(msg, Backlogged):
                n.run(n.core.receive(msg.msg, self.now))
            elif isinstance(msg, R.AppendReq) and (self.now < self.backlog_until.get(to, 0)
                                                   or self.backlog_rng.random() < self.p_backlog):
                # the node's disk is busy with earlier frames: this one waits its turn,
                # in order behind the others (one stream), but its contact counts now
                if self.now >= self.backlog_until.get(to, 0):
                    self.backlog_until[to] = self.now + self.backlog_rng.randint(1, 100) * MS
                n.run(n.core.heard(msg, self.now))
                self.seq += 1
                heapq.heappush(self.queue, (self.backlog_until[to], self.seq, to, Backlogged(msg), _frm))
            else:
                n.run(n.core.receive(msg, self.now))
        self.flush_noops()

    def declines(self, n, msg, frm) -> bool:
        """``msg`` reaches live ``n`` as the shell would have it: a refusal of a
        TimeoutNow it answers for the core (its disk is low: Driver._timeout_now_received),
        and a refusal that comes back to the primary. True: handled here."""
        if isinstance(msg, Declined):
            n.core.transfer_declined(msg.target, msg.epoch, self.now)  # (no effects: it serves again)
            return True
        if isinstance(msg, R.TimeoutNow) and n.low_disk and n.core.role == R.REPLICA and n.core.epoch <= msg.epoch:
            self.trace(f"{n.id} refuses TimeoutNow from {frm}: low on disk")
            self.send(n.id, frm, Declined(n.id, msg.epoch))
            return True
        return False

    def tick_all(self, at: int) -> None:
        """Time moves to ``at``; every live node's timers run (after the shell has
        told each core of its disk, as Driver._handicap does)."""
        self.now = at
        for n in self.nodes.values():
            if n.up:
                n.core.disk(n.low_disk, self.now)
                n.run(n.core.tick(self.now))
        self.flush_noops()

    def step(self):
        # advance to the next message or tick
        tick_at = self.now + self.rng.randint(1, 15) * MS
        if self.queue and self.queue[0][0] <= tick_at:
            self.deliver_next()
        else:
            self.tick_all(tick_at)
            if self.rng.random() < 0.5:
                self.client_write()
            self.nemesis()
        self.check_leases()

    def run(self):
        for _ in range(self.steps):
            self.step()
        # heal, restart everyone, let it settle
        self.blocked.clear()
        self.p_drop = 0.0
        self.p_crash_mid_effects = 0.0
        for nid in self.members:
            self.restart(nid)
        for writes in (True, False):  # settle with writes, then let the last ones propagate
            end = self.now + 20 * self.timeout
            while self.now < end:
                self.step_quiet(writes)
        self.final_checks()

    def step_quiet(self, writes: bool):
        tick_at = self.now + 5 * MS
        if self.queue and self.queue[0][0] <= tick_at:
            at, _, to, msg, frm = heapq.heappop(self.queue)
            self.now = max(self.now, at)
            self.check_frame(to, msg)
            n = self.nodes[to]
            if isinstance(msg, LocalSync):
                n.local_sync(msg)
            elif isinstance(msg, CopyMade):
                self.copy_made(n, msg)
            elif self.declines(n, msg, frm) or self.snapshot_message(n, msg):
                pass
            else:
                n.run(n.core.receive(msg.msg if isinstance(msg, Backlogged) else msg, self.now))
            self.flush_noops()
        else:
            self.now = tick_at
            for n in self.nodes.values():
                n.core.disk(n.low_disk, self.now)
                n.run(n.core.tick(self.now))
            self.flush_noops()
            if writes and self.rng.random() < 0.05:
                self.client_write()
        self.check_leases()

    def final_checks(self):
        prim = [n for n in self.nodes.values() if n.core.role == R.PRIMARY]
        assert len(prim) == 1, f"no single primary after healing: {[n.id for n in prim]}"
        p = prim[0]
        commits = {n.id: n.core.commit_lsn for n in self.nodes.values()}
        top = p.core.commit_lsn
        for n in self.nodes.values():
            assert commits[n.id] == top, f"{n.id} commit {commits[n.id]} != primary's {top}"
            for lsn in range(max(n.disk.off, p.disk.off) + 1, top + 1):
                assert n.disk.at(lsn) == p.disk.at(lsn), f"{n.id}'s log differs from the primary's at lsn {lsn}"
        for lsn, ep, crc in self.acked:
            held = p.disk.at(lsn) if lsn > p.disk.off else self.committed.get(lsn)
            assert lsn <= top and held == (ep, crc), f"acknowledged write lsn {lsn} lost"
        if any(not n.low_disk for n in self.nodes.values()):
            assert not p.low_disk, f"{p.id}, low on disk, is still the primary, while " \
                f"{[n.id for n in self.nodes.values() if not n.low_disk]} have room"
        for n in self.nodes.values():
            # each core's view of its log is its disk's, sizes included (they survived
            # restarts, reloads, truncations and compactions), and what a disk holds
            # up to the commit point is the committed history
            v, d = n.core.log, n.disk
            for lsn in range(max(v.base_lsn, d.off) + 1, min(v.last_lsn, d.last_lsn) + 1):
                assert v.at(lsn) == d.at(lsn), f"{n.id}'s core says lsn {lsn} is {v.at(lsn)}, its disk {d.at(lsn)}"
                i = lsn - v.base_lsn - 1
                assert i < len(v.sizes) and v.sizes[i] == d.log[lsn - d.off - 1][3], \
                    f"{n.id}'s core lost the size of lsn {lsn}"
                if lsn <= top:
                    assert d.at(lsn) == self.committed.get(lsn), f"{n.id} holds lsn {lsn} unlike the committed one"


def run_seed(seed: int, nodes: int = 3, steps: int = 400, verbose: bool = False, mixed: bool = False,
             low_disk: bool = False) -> Sim:
    sim = Sim(seed, nodes, steps, verbose, mixed, low_disk)
    try:
        sim.run()
    except AssertionError as e:
        tail = "\n".join(sim.log_lines[-40:])
        what = (", mixed timeouts" if mixed else "") + (", members low on disk" if low_disk else "")
        flags = (" mixed" if mixed else "") + (" low_disk" if low_disk else "")
        raise AssertionError(f"seed {seed} ({nodes} nodes{what}) failed: {e}\n"
                             f"replay: python -m tests.sim.sim {seed} {nodes}{flags}\n"
                             f"last events:\n{tail}") from None
    return sim


if __name__ == "__main__":
    seed = int(sys.argv[1])
    nodes = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    s = run_seed(seed, nodes, verbose=True, mixed="mixed" in sys.argv[3:], low_disk="low_disk" in sys.argv[3:])
    print(f"ok: {len(s.committed)} committed, {len(s.acked)} acknowledged, epochs {sorted(s.primaries)}")
