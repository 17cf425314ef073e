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
    log: list = field(default_factory=list)  # [(epoch, crc, payload, size)], lsn = index + 1
    joining: bool = False  # a replacement's empty disk (--join) until it has joined


class SimNode:
    def __init__(self, sim, nid):
        self.sim = sim
        self.id = nid
        self.disk = Disk()
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
        # as Driver.load: (epoch, crc) and the size of every record the disk holds
        c.log = R.LogView(0, 0, 0, [(e, crc) for e, crc, *_ in self.disk.log],
                          [size for *_, size in self.disk.log])
        self.core = c
        self.run(c.start(sim.now))

    def crc_at(self, lsn):
        if lsn > len(self.disk.log) and self.volatile:
            return self.volatile[lsn - len(self.disk.log) - 1][2]
        return self.disk.log[lsn - 1][1] if lsn >= 1 else 0

    def flush_volatile(self, upto=None):
        """The writer thread finishes the pending local writes, in order (it does so
        before any later store operation: truncation, replica appends)."""
        while self.volatile and (upto is None or self.volatile[0][0] <= upto):
            lsn, ep, crc, payload, size = self.volatile.pop(0)
            assert lsn == len(self.disk.log) + 1, (self.id, "volatile write out of order", lsn)
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
                del self.disk.log[eff.after_lsn:]
            elif isinstance(eff, R.Store):
                for lsn, ep, crc in eff.req.entries:
                    assert lsn == len(self.disk.log) + 1, (self.id, lsn, len(self.disk.log))
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
    def send(self, frm, to, msg):
        if isinstance(msg, R.AppendReq) and msg.entries:
            msg = self.on_the_wire(self.nodes[frm], msg)
        if (frm, to) in self.blocked or self.rng.random() < self.p_drop:
            return
        copies = 2 if self.rng.random() < self.p_dup else 1
        for _ in range(copies):
            lo, hi = self.delay_ms
            at = self.now + self.rng.randint(lo, hi) * MS
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
            # leader completeness: the new primary holds every committed record
            for lsn, (ep, crc) in self.committed.items():
                have = node.disk.log[lsn - 1][:2] if lsn <= len(node.disk.log) else None
                assert have == (ep, crc), f"new primary {node.id} lacks committed lsn {lsn}"

    def on_commit(self, node, lsn):
        for i in range(1, lsn + 1):
            have = node.disk.log[i - 1][:2] if i <= len(node.disk.log) else None
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
        self.trace(f"{nid} RESTART (epoch {n.disk.epoch}, log {len(n.disk.log)}, timeout {self.timeouts[nid] // MS} ms)")
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

    def nemesis(self):
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
        elif n.up and self.declines(n, msg, _frm):
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
            elif self.declines(n, msg, frm):
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
        logs = {n.id: [x[:2] for x in n.disk.log] for n in self.nodes.values()}
        commits = {n.id: n.core.commit_lsn for n in self.nodes.values()}
        top = p.core.commit_lsn
        for nid, lg in logs.items():
            assert commits[nid] == top, f"{nid} commit {commits[nid]} != primary's {top}"
            assert lg[:top] == logs[p.id][:top], f"{nid}'s log differs from the primary's"
        for lsn, ep, crc in self.acked:
            assert lsn <= top and logs[p.id][lsn - 1] == (ep, crc), f"acknowledged write lsn {lsn} lost"
        if any(not n.low_disk for n in self.nodes.values()):
            assert not p.low_disk, f"{p.id}, low on disk, is still the primary, while " \
                f"{[n.id for n in self.nodes.values() if not n.low_disk]} have room"
        for n in self.nodes.values():  # sizes survived restarts, reloads and truncations
            held = min(len(n.disk.log), n.core.log.last_lsn)
            assert n.core.log.sizes[:held] == [x[3] for x in n.disk.log[:held]], f"{n.id}'s core lost record sizes"


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
