"""Replication and election: a pure state machine (raft-shaped, epochs as terms).

No IO, no clock: inputs are ``tick(now)``, ``receive(msg, now)``,
``appended(...)`` (the local log grew and is fsync'd) and a few commands; each
returns a list of effects for the IO shell to carry out **in order**:

    Persist(epoch, voted_for, lease_seen) -- fsync before any message that depends on it
    Joined()                    -- a joining node holds the cluster's history: persist that
    Truncate(after_lsn)         -- drop unapplied log records after this lsn
    Store(req)                  -- write the records of this AppendReq and fsync
    Send(to, msg)               -- after the effects before it are durable
    Commit(lsn)                 -- records up to lsn are committed: apply them
    Role(role, epoch, primary)  -- the node's role changed

The ordering rules are the safety argument: a vote is persisted before it is
sent; an append is acknowledged only after its records are fsync'd; a primary
counts itself in a quorum only for records its own store has fsync'd.

Shipping (``eager``): with ``EAGER_QUORUM`` a primary sends each new record
at once only to as many replicas as a quorum needs with it (one of two, two
of four), the ones most caught up (eager_peers); the others get what they lack in
one frame at each tick, or at once while they are a frame or more behind.
Nothing else changes: every member still stores every record, a record still
commits on a majority's fsync, and a replica that falls behind or stops
answering is replaced within a tick (once another has answered its tick's
frame it is the further along), or at once when its stream breaks.
On two cores this takes one replica's round of work off the path of every
send (docs/benchmarks-history.md). ``EAGER_ALL`` sends every record to every replica
at once.

Leases: a primary serves (confirms writes, hands out leases) only while a
majority has acknowledged one of its appends sent within the last
``failover_timeout``; a new primary hands out leases only once the old
primary's such window has surely closed (``lease_ok_at``, from the voters'
"time since I last heard a primary"). Together: at most one node leases at any
time (see docs/DESIGN.md, "Elections and fencing").
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, Optional

from node.core.invariant import BrokenInvariant

REPLICA, CANDIDATE, PRIMARY = "replica", "candidate", "primary"
EAGER_QUORUM, EAGER_ALL = "quorum", "all"  # Replication(eager=...): see "Shipping" above


# ----------------------------------------------------------------- messages
@dataclass
class AppendReq:
    epoch: int
    primary: str
    prev_lsn: int
    prev_epoch: int
    prev_crc: int
    entries: list          # [(lsn, epoch, crc)] consecutive, from prev_lsn + 1
    commit_lsn: int        # capped at this frame's last record (or prev_lsn)
    sent_us: int           # echoed back: the primary's contact clock
    primary_commit: int = 0  # the primary's whole commit point (0: not known)
    # how long past this append someone may still hand out leases: this primary
    # (lease_us past a majority's contact), or an older one it is still waiting
    # out (until its lease_ok_at); 0 from builds before 0.3.0: a failover timeout
    lease_us: int = 0


@dataclass
class AppendResp:
    epoch: int
    sender: str
    ok: bool
    match_lsn: int         # ok: last lsn now known to match; not ok: a hint to back off to
    sent_us: int
    joining: bool = False  # the sender is a replacement that does not vote yet
    contact: bool = False  # only "your frame of sent_us reached me" (heard): ok and match_lsn say nothing
    # the sender's disk is below its reserve (it would refuse TimeoutNow): every
    # answer says so (Replication.disk), and a primary low on disk hands over
    # only to a member whose latest answer did not (_maybe_hand_over_for_disk)
    disk_low: bool = False


@dataclass
class VoteReq:
    epoch: int
    candidate: str
    last_epoch: int
    last_lsn: int
    pre: bool = False
    transfer: bool = False  # planned switchover: granted despite a live primary
    lease_us: int = 0       # the candidate's lease_us: how long it would lease on a vote (0: not known)


@dataclass
class VoteResp:
    epoch: int
    sender: str
    granted: bool
    pre: bool
    since_contact_us: int  # how long since this voter last heard a primary
    since_vote_us: int     # how long since it voted for some other candidate (who may have won)
    lease_us: int = 0      # that primary's leasing lease (0: not known, a failover timeout)
    vote_lease_us: int = 0  # the lease_us of the candidate of since_vote_us (0: not known)
    voter_epoch: int = 0    # the voter's own epoch (0: not known)


@dataclass
class TimeoutNow:
    epoch: int
    primary: str


# ------------------------------------------------------------------ effects
@dataclass
class Persist:
    epoch: int
    voted_for: str
    lease_seen: int = 0  # see Replication.lease_seen


@dataclass
class Joined:
    """A node that joined with an empty store (a replacement) now holds every record
    the cluster had committed when it came: it may vote from here on."""


@dataclass
class Truncate:
    after_lsn: int


@dataclass
class Store:
    req: AppendReq          # write req.entries (the IO shell holds their bytes)


@dataclass
class Send:
    to: str
    msg: object


@dataclass
class Commit:
    lsn: int


@dataclass
class Role:
    role: str
    epoch: int
    primary: Optional[str]


@dataclass
class LogView:
    """What the core knows of the local log: (epoch, crc) per lsn after ``base``."""

    base_lsn: int = 0
    base_epoch: int = 0
    base_crc: int = 0
    entries: list = field(default_factory=list)  # index i -> lsn base_lsn + 1 + i: (epoch, crc)
    # index i -> the bytes of that record, where known (0: not known, e.g. set
    # by hand in a test); may be shorter than entries, never longer
    sizes: list = field(default_factory=list)

    @property
    def last_lsn(self) -> int:
        return self.base_lsn + len(self.entries)

    @property
    def last_epoch(self) -> int:
        return self.entries[-1][0] if self.entries else self.base_epoch

    @classmethod
    def from_store(cls, rows: list, applied: tuple) -> "LogView":
        """The view of a store's log as it loads: ``rows`` [(lsn, epoch, crc, size)]
        in lsn order, ``applied`` the checkpoint's (lsn, epoch, crc).

        The base is always a record the store applied, so committed: the first
        row if the store applied it (compaction keeps the last applied record in
        the log), else the applied position, with every row after it. Never a
        row the store has not applied: a base is never truncated (a replica
        takes any record at or before it as matching), and a deposed primary's
        first record, never committed, can be what a restarted node's log
        begins with (a store that has applied nothing keeps every row from lsn
        1); the new primary's different record at that lsn would then never
        replace it."""
        if rows and rows[0][0] <= applied[0]:
            lsn, epoch, crc, _ = rows[0]
            rows = rows[1:]
        else:
            lsn, epoch, crc = applied
            if rows and rows[0][0] != lsn + 1:
                raise BrokenInvariant(f"the log's first row is lsn {rows[0][0]}, past the applied lsn {lsn} + 1")
        return cls(lsn, epoch, crc, [(e, c) for _, e, c, _ in rows], [size for *_, size in rows])

    def at(self, lsn: int) -> Optional[tuple]:
        """(epoch, crc) at lsn, or None if unknown (compacted away or beyond the end)."""
        if lsn == self.base_lsn:
            return (self.base_epoch, self.base_crc)
        i = lsn - self.base_lsn - 1
        if 0 <= i < len(self.entries):
            return self.entries[i]
        return None

    def first_of_epoch(self, epoch: int, upto: int, floor: int) -> int:
        """The first lsn in (floor, upto] whose record is of ``epoch``, the record at
        ``upto`` being of it (epochs never go down along a log: a bisection)."""
        lo = max(0, floor - self.base_lsn)
        i = bisect.bisect_left(self.entries, epoch, lo, upto - self.base_lsn - 1, key=lambda e: e[0])
        return self.base_lsn + 1 + i

    def add(self, epoch: int, crc: int, size: int = 0) -> None:
        """The next record: its epoch, chained checksum and size in bytes."""
        if len(self.sizes) < len(self.entries):
            self.sizes.extend([0] * (len(self.entries) - len(self.sizes)))
        self.entries.append((epoch, crc))
        self.sizes.append(size)

    def frame_end(self, prev: int, upto: int, bytes_max: int) -> int:
        """The last lsn of a frame of the records after ``prev`` up to ``upto``
        that holds at most ``bytes_max`` bytes of them, and at least one record
        (records of unknown size count nothing)."""
        sizes, total = self.sizes, 0
        for i in range(prev - self.base_lsn, min(upto - self.base_lsn, len(sizes))):
            total += sizes[i]
            if total > bytes_max:
                return max(prev + 1, self.base_lsn + i)
        return upto

    def truncate(self, after_lsn: int) -> None:
        del self.entries[max(0, after_lsn - self.base_lsn):]
        del self.sizes[max(0, after_lsn - self.base_lsn):]

    def compact(self, upto_lsn: int) -> None:
        """Forget (epoch, crc) before ``upto_lsn`` (the store compacted its log)."""
        if upto_lsn <= self.base_lsn or upto_lsn > self.last_lsn:
            return
        e = self.at(upto_lsn)
        del self.entries[:upto_lsn - self.base_lsn]
        del self.sizes[:upto_lsn - self.base_lsn]
        self.base_lsn, self.base_epoch, self.base_crc = upto_lsn, e[0], e[1]


def copy_held(end: tuple, copy_applied: int, last: tuple, applied: int,
              record_at: Callable[[int], Optional[tuple]]) -> bool:
    """Does a replica's log already hold a snapshot copy that reaches it, so that
    installing the copy would take nothing and the replica keeps its log
    (Engine._copy_held, which says why)? Positions are (lsn, epoch, crc):
    ``end`` the copy's last record (its applied position if its log is empty),
    ``copy_applied`` the lsn the copy applied, ``last`` the replica's last
    record, ``applied`` the lsn the replica applied, ``record_at(lsn)`` the
    replica's (epoch, crc) at lsn, or None.

    Held: a copy ending before our last record, at a record we applied or one
    that is ours (the checksum chains every record before it); and a copy
    ending at our last record, that record ours, if we applied at least what
    the copy applied. Not held: a copy ending past our log, or at lsn 0."""
    if end[0] > last[0]:
        return False
    if end[0] == last[0]:
        return end[0] > 0 and end[1:] == last[1:] and copy_applied <= applied
    return end[0] <= applied or record_at(end[0]) == end[1:]


# The records of one frame, in bytes (a single larger record goes alone): 8
# frames in flight to a lagging replica then hold at most ~32 MiB of records
# plus at most one record (8 MiB of bodies) each, whatever the log holds. The
# driver splits a frame over its gRPC message bound anyway (FRAME_BYTES_MAX).
FRAME_RECORD_BYTES_MAX = 4 << 20


class CommittedConflict(BrokenInvariant):
    """A primary's log differs from a record this node holds as committed. That
    cannot happen within one cluster (every primary holds every committed
    record; raft's leader completeness): this node's store is not this
    cluster's, or a committed write was lost (a disk that lied about an fsync,
    a store copied back from before). Nothing this node could do keeps both
    logs, so the edge stops the node (exit 70) rather than sit behind its
    primary for good, answering nothing."""


# a member a primary low on disk could not hand over to is tried again this many
# failover timeouts later (Replication._maybe_hand_over_for_disk)
DISK_HANDOVER_RETRY_TIMEOUTS = 10
SPLIT_RETRY_US = 200_000  # a refused candidate retries within this (see _on_vote_resp)


class Replication:
    def __init__(self, node_id: str, members: list, failover_timeout_us: int, rand: Callable[[], float],
                 heartbeat_us: Optional[int] = None, frame_entries_max: int = 512, frames_in_flight_max: int = 8,
                 frame_bytes_max: int = FRAME_RECORD_BYTES_MAX, eager: str = EAGER_ALL):
        if node_id not in members:
            raise ValueError(f"{node_id!r} is not one of the members {sorted(members)}")
        if eager not in (EAGER_QUORUM, EAGER_ALL):
            raise ValueError(f"eager must be {EAGER_QUORUM!r} or {EAGER_ALL!r}, not {eager!r}")
        self.id = node_id
        self.members = sorted(members)
        self.peers = [m for m in self.members if m != node_id]
        self.quorum = len(self.members) // 2 + 1
        self.timeout = failover_timeout_us
        # A primary hands out message leases only while a majority has acknowledged
        # one of its appends sent within ``lease_us``: half the failover timeout,
        # so a successor waits out at most that after the old primary's last
        # contact (a dead primary's messages come back sooner), with the other half
        # as slack for acknowledgements that are slow to come back (heartbeats go
        # every tenth of it). Confirming writes keeps the whole failover timeout.
        self.lease_us = failover_timeout_us // 2
        self.heartbeat = heartbeat_us or max(10_000, failover_timeout_us // 10)
        self.rand = rand
        # Extra wait before this node campaigns, set by the shell: a failover
        # timeout while its disk is below its reserve (as the primary it would
        # refuse every send), so that a member with room campaigns first; when
        # none has room, they all wait the same and one is elected a timeout later.
        self.campaign_handicap_us = 0
        # A primary whose disk stays below its reserve for a failover timeout hands
        # over to a member with room (_maybe_hand_over_for_disk): since when this
        # node's disk has been low (None: it has room), and the members a handover
        # for disk did not reach (it refused: low on disk too or stopping; or it
        # never caught up) -> when, each passed over for DISK_HANDOVER_RETRY_TIMEOUTS
        # or until it has said for a failover timeout that it has room again after
        # saying its disk was low (disk_low_said: such a member -> None while it
        # says low, then since when it has said it has room).
        self.disk_low_since: Optional[int] = None
        self.disk_handover_failed: dict = {}
        self.disk_low_said: dict = {}
        self.stopping = False  # (Replication.disk: no handover for disk while stopping)
        self.transfer_for_disk = False  # the switchover under way is such a handover
        self.frame_entries_max = frame_entries_max
        self.frames_in_flight_max = frames_in_flight_max
        self.frame_bytes_max = frame_bytes_max
        self.eager = eager
        # persistent (loaded by the shell before use)
        self.epoch = 0
        self.voted_for = ""
        self.log = LogView()
        self.durable_lsn = 0       # local records fsync'd (== log.last_lsn except while a Store is pending)
        self.commit_lsn = 0
        # A replacement started on an empty store: it has forgotten the records it
        # held and the votes it cast before, so it neither votes nor campaigns
        # until it holds everything its primary has committed, up to a record of
        # the primary's own epoch (and so every record committed before it came).
        # Counting its vote sooner could elect a node that lacks confirmed writes.
        # At first it does not even acknowledge appends: a primary its lost disk
        # had stopped acknowledging (for a newer one) must not regain a majority
        # with the replacement's acknowledgements. Such a primary last had a
        # majority before this start, so it has stopped serving once its own
        # failover timeout has passed since (it steps down before it counts a
        # late acknowledgement, _on_append_resp); that timeout is twice the lease
        # its appends state, or ours if longer, or if they state none. Nor does it
        # install a snapshot meanwhile: an install is acknowledged too (join_quiet).
        self.joining = False
        self.join_started = 0
        self.join_lease_us = 0     # the longest lease an append stated while we joined
        # The longest lease that any acknowledgement or vote we gave lately may
        # carry: an append's lease_us, a granted candidate's lease_us (0 from an
        # older build: a failover timeout of ours). A restart loses when we last
        # heard a primary and whom we voted for, so our start stands in for both,
        # with this lease (see start): a node whose own --failover-timeout is
        # shorter than another's must not assume its own. Raised before the
        # acknowledgement or vote leaves; lowered only once every acknowledgement
        # given with the higher figure is older than it (_note_lease).
        self.lease_seen = 0
        # volatile
        self.role = REPLICA
        self.primary: Optional[str] = None
        self.last_contact = None   # when we last heard a primary (None: never)
        self.contact_lease = 0     # that primary's lease_us (0: not known)
        self.primary_gone = False  # our stream from the primary broke: it may be dead
        self.election_at = None
        self.votes: dict = {}
        self.pre_votes: dict = {}
        self.next: dict = {}
        self.match: dict = {}
        # peer -> the last lsn of each frame of records sent it and not yet
        # acknowledged, oldest first (their number is what is in flight)
        self.frame_ends: dict = {}
        self.snapshot_at: dict = {}  # peer -> when it last reported a snapshot of ours installed
        self.last_sent: dict = {}
        self.acked_sent: dict = {}  # peer -> sent_us of the latest append it acknowledged in our epoch
        self.stream_lost_at: dict = {}  # peer -> when our stream to it last broke (primary)
        self.peer_joining: dict = {}  # peer -> its latest answer said it is still joining
        self.peer_disk_low: dict = {}  # peer -> its latest answer in our epoch said its disk is low
        self.lease_ok_at = 0
        self.transfer_to: Optional[str] = None
        self.campaign_at = 0
        # candidate -> (when we last granted it a vote, the lease it asked with): any
        # of them may have won on our vote and lease on it (see _vote_wait)
        self.votes_granted: dict = {}
        self.transfer_campaign = False
        self.transfer_started = 0
        self.transfer_sent = False
        # the switchover's TimeoutNow call failed without a refusal (it may or may
        # not have reached the target) at this time: sent again once the target
        # answers a frame sent after it (None: no call failed, or one is out again)
        self.timeout_now_failed_at: Optional[int] = None
        self.started = False
        self._lease_window = (0, 0)  # (since, the longest lease acknowledged or voted since then)

    # ------------------------------------------------------------- helpers
    def _reset_election_timer(self, now: int, fast: bool = False) -> None:
        if fast:
            self.election_at = now + min(20_000, self.timeout // 10) + int(self.rand() * self.timeout * 0.05)
        else:
            # a little jitter keeps two replicas from always campaigning together
            # (pre-votes make a split cheap); a lot would only slow failover
            self.election_at = now + self.timeout + int(self.rand() * self.timeout * 0.1)
        self.election_at += self.campaign_handicap_us

    def _since_contact(self, now: int) -> int:
        return (now - self.last_contact) if self.last_contact is not None else 10 * self.timeout

    def _vote_wait(self, now: int, candidate: str) -> tuple:
        """(since, lease) of the vote we granted to a candidate other than
        ``candidate`` that may still lease the longest on it: each may have become a
        primary and lease on our vote for the lease it asked with. A vote is kept
        per candidate (a later vote for ``candidate`` must not hide an earlier one
        for another), and dropped once its lease is surely over, or once we have
        heard a primary since (of that epoch or a later one: what it said of its
        lease covers that candidate, which it was or waited out, see _lease_wait).
        (10 timeouts, 0): none."""
        best, best_end = (10 * self.timeout, 0), None
        for c, (at, lease) in list(self.votes_granted.items()):
            end = at + (lease or self.timeout)
            if end <= now or (self.last_contact is not None and self.last_contact > at):
                del self.votes_granted[c]
                continue
            if c != candidate and (best_end is None or end > best_end):
                best, best_end = (now - at, lease), end
        return best

    def _persist(self) -> Persist:
        return Persist(self.epoch, self.voted_for, self.lease_seen)

    def _note_lease(self, lease: int, now: int) -> bool:
        """We are about to acknowledge an append, or grant a vote, that someone may
        lease on for ``lease``: keep ``lease_seen`` at least that (True: it changed,
        persist it before the answer leaves). It is lowered to the longest lease of
        the current window once the window is longer than ``lease_seen``: every
        answer given before the window is then older than its own lease."""
        lease = lease or self.timeout
        since, longest = self._lease_window
        longest = max(longest, lease)
        new = max(self.lease_seen, lease)
        if now - since > self.lease_seen:
            new, self._lease_window = longest, (now, lease)
        else:
            self._lease_window = (since, longest)
        if new == self.lease_seen:
            return False
        self.lease_seen = new
        return True

    def _up_to_date(self, last_epoch: int, last_lsn: int) -> bool:
        return (last_epoch, last_lsn) >= (self.log.last_epoch, self.log.last_lsn)

    def _become_replica(self, epoch: int, primary: Optional[str], now: int, out: list) -> None:
        changed = epoch != self.epoch
        was = (self.role, self.primary)
        if changed:
            self.epoch = epoch
            self.voted_for = ""
            out.append(self._persist())
        self.role = REPLICA
        self.primary = primary
        self.transfer_to = None
        self.transfer_for_disk = False
        if primary is not None:
            self.primary_gone = False
            self.pre_votes = {}  # a pre-vote round under way is over: we follow a primary
        self._reset_election_timer(now)
        if changed or was != (self.role, self.primary):
            out.append(Role(REPLICA, self.epoch, primary))

    def serving(self, now: int) -> bool:
        """A primary may confirm writes only while a majority has heard it recently."""
        return self.role == PRIMARY and self.transfer_to is None and now < self.lease_until(now)

    def may_lease(self, now: int) -> bool:
        """... and hand out message leases only while a majority heard it within
        ``lease_us``, and once no older primary can still be leasing."""
        return self.serving(now) and now >= self.lease_ok_at and now < self._majority_contact(now) + self.lease_us

    def lease_until(self, now: int) -> int:
        return self._majority_contact(now) + self.timeout

    def _majority_contact(self, now: int) -> int:
        """The send time of the latest append a majority (this node counted) acknowledged."""
        times = sorted([now] + [self.acked_sent.get(p, -1 << 62) for p in self.peers], reverse=True)
        return times[self.quorum - 1]

    def _lease_wait(self, since_contact: int, contact_lease: int, since_vote: int, vote_lease: int,
                    transfer: bool) -> int:
        """How long a new primary must wait before leasing, by what one voter says:
        until the primary it last heard (which leases at most ``contact_lease``
        past that contact) and the candidate it voted for since (which, had it
        won, leased at most ``vote_lease`` past its campaign, before the vote)
        can no longer lease; 0 for either: not known, a failover timeout. In a
        planned switchover the old primary stopped leasing, and had waited out
        every older one, before it sent TimeoutNow, so only the votes count."""
        other = (vote_lease or self.timeout) - since_vote
        if transfer and contact_lease:
            return other
        # (a primary before 0.3.0 says nothing, and sends TimeoutNow without waiting
        # out older primaries first: then the contact counts in a switchover too)
        return max((contact_lease or self.timeout) - since_contact, other)

    # ------------------------------------------------------------- inputs
    def start(self, now: int) -> list:
        """After loading epoch, vote and log: wait as a replica for a primary."""
        self.started = True
        self.durable_lsn = self.log.last_lsn
        self._lease_window = (now, 0)
        if self.peers and self.epoch > 0:
            # When we last heard a primary, and whom we voted for, were lost with
            # the process, and we may have acknowledged a primary or voted for a
            # candidate just before: either may still lease on that, for at most
            # lease_seen (0, from a store of a build before 0.4.0: not known, a
            # failover timeout of ours). So our start counts as such a contact
            # and as such a vote (for a candidate no one is called, so that it
            # counts in every campaign, a switchover's too), and a new primary
            # elected with our vote waits them out.
            # (Epoch 0 on disk: we never accepted a primary, so never acknowledged
            # one, as an epoch is persisted before anything of it is acknowledged;
            # a brand-new cluster's first primary leases at once.)
            stand_in = self.lease_seen or self.timeout
            self.last_contact, self.contact_lease = now, stand_in
            self.votes_granted[""] = (now, stand_in)
        if self.joining:
            self.join_started = now
        out: list = []
        if not self.peers:  # a single node elects itself at once
            return self._campaign(now, pre=False)
        self._reset_election_timer(now)
        out.append(Role(REPLICA, self.epoch, None))
        return out

    def tick(self, now: int) -> list:
        out: list = []
        if self.role == PRIMARY:
            if self.transfer_to is not None and now - self.transfer_started >= self.timeout:
                if self.transfer_sent:
                    # TimeoutNow is out: the target may win with an immediate lease, so
                    # never serve again in this epoch; step down and let an election decide
                    self._become_replica(self.epoch, None, now, out)
                    return out
                self._transfer_failed(now)  # the target never caught up: serve again
            self._maybe_hand_over_for_disk(now, out)
            if self.transfer_to is not None and not self.transfer_sent:
                self._maybe_finish_transfer(now, out)  # e.g. once lease_ok_at has passed
            if now >= self.lease_until(now):
                # no majority contact within the failover timeout: stop serving
                self._become_replica(self.epoch, None, now, out)
                return out
            for p in self.peers:
                if now - self.last_sent.get(p, -1 << 62) >= self.heartbeat:
                    self._send_append(p, now, out, heartbeat=True)
                elif self.eager == EAGER_QUORUM and self.next.get(p, self.log.last_lsn + 1) <= self.log.last_lsn:
                    self._send_append(p, now, out)  # a lazy peer's frame of the tick
            return out
        if self.election_at is not None and now >= self.election_at and not self.joining:
            out += self._campaign(now, pre=True)
        return out

    def primary_stream_broken(self, now: int) -> list:
        """The IO shell lost its stream from the primary (process gone?): campaign soon."""
        if self.role == REPLICA and self.primary is not None:
            self.primary_gone = True
            self._reset_election_timer(now, fast=True)
        return []

    def appended(self, records: list, now: int, durable: bool = True) -> list:
        """Primary only: new local records [(lsn, epoch, crc)].

        ``durable``: the shell has fsync'd them already. Otherwise they are shipped
        now, while the shell's own fsync runs (raft thesis 10.2.1: the leader may
        write its log in parallel with replicating it), and ``durable()`` tells
        when that fsync is done: until then this node does not count towards a
        quorum, and nothing commits past it (answers wait for this node AND a
        quorum)."""
        for r in records:
            lsn, epoch, crc = r[:3]
            if epoch != self.epoch or lsn != self.log.last_lsn + 1:
                raise BrokenInvariant(f"appended lsn {lsn} of epoch {epoch} after lsn {self.log.last_lsn} in epoch {self.epoch}")
            self.log.add(epoch, crc, r[3] if len(r) > 3 else 0)
            if durable:
                self.durable_lsn = lsn
        out: list = []
        if self.role != PRIMARY:
            return out
        for p in self.eager_peers():
            self._send_append(p, now, out)
        self._advance_commit(out)
        return out

    def eager_peers(self) -> list:
        """The peers a new record goes to at once (see "Shipping" above): every
        peer, or with EAGER_QUORUM the quorum - 1 that a record would commit with
        soonest: a switchover's target first (it must catch up), then those
        answering on the stream they have now (not lost since their last
        answer), not joining (a joining member acknowledges nothing for a
        while), not low on disk, and the furthest along (the highest lsn
        acknowledged; among equals the same one each time, by name). Every peer
        while this primary's disk is low: it looks for a member to hand over
        to, and wants each one caught up (_maybe_hand_over_for_disk takes only
        a member that holds every committed record, which a peer sent a frame
        a tick, with records committing in between, never is)."""
        if self.eager == EAGER_ALL or len(self.peers) < self.quorum or self.disk_low_since is not None:
            return self.peers
        never = -1 << 62

        def rank(p):
            return (p != self.transfer_to,
                    self.acked_sent.get(p, never) < self.stream_lost_at.get(p, never),
                    self.peer_joining.get(p, False), self.peer_disk_low.get(p, False),
                    -self.match.get(p, 0), p)
        return sorted(self.peers, key=rank)[:self.quorum - 1]

    def _frame_or_more_behind(self, p: str) -> bool:
        """``p`` lacks more records than one frame carries: it is catching up, so
        each of its acknowledgements brings the next frame (EAGER_QUORUM's lazy
        peers otherwise get one frame a tick)."""
        nxt, last = self.next.get(p, self.log.last_lsn + 1), self.log.last_lsn
        if last - nxt + 1 > self.frame_entries_max or nxt - 1 < self.log.base_lsn:
            return True  # (the second: what it lacks was compacted away, it needs a snapshot)
        return nxt <= last and self.log.frame_end(nxt - 1, last, self.frame_bytes_max) < last

    def durable(self, lsn: int, epoch: int, now: int) -> list:
        """Primary: its own fsync of the records it appended up to ``lsn`` in
        ``epoch`` (``appended(durable=False)``) is done. Ignored unless it is still
        the primary of that epoch (a primary never truncates its own log, so the
        records are still those it wrote); elsewhere its view stays conservative."""
        out: list = []
        if self.role != PRIMARY or self.epoch != epoch or lsn > self.log.last_lsn:
            return out
        if lsn > self.durable_lsn:
            self.durable_lsn = lsn
            self._advance_commit(out)
        return out

    def stored(self, req: AppendReq, now: int) -> list:
        """Replica: the records of ``req`` are fsync'd; acknowledge them."""
        out: list = []
        if req.entries:
            self.durable_lsn = max(self.durable_lsn, req.entries[-1][0])
        match = req.entries[-1][0] if req.entries else req.prev_lsn
        if req.epoch == self.epoch:
            ack = Send(req.primary, AppendResp(self.epoch, self.id, True, match, req.sent_us, self.joining,
                                               disk_low=self.disk_low_since is not None))
            out.append(ack)
            c = min(req.commit_lsn, match)
            if c > self.commit_lsn:
                self.commit_lsn = c
                out.append(Commit(c))
            if self.joining:
                self._maybe_joined(req, match, out)
                if not self.joining:
                    # the answer says we vote now: it leaves after Joined is persisted
                    out.remove(ack)
                    ack.msg.joining = False
                    out.append(ack)
        return out

    def _maybe_joined(self, req: AppendReq, match: int, out: list) -> None:
        """Everything the primary has committed is on our disk, up to a record of
        its own epoch: every record committed before this epoch precedes that one,
        so we hold them all. (``commit_lsn`` is capped at the frame's end, so it
        cannot tell; ``primary_commit`` is the primary's whole commit point.) Our
        log matches the primary's up to ``match`` only."""
        pc = req.primary_commit
        e = self.log.at(pc)
        if 0 < pc <= match and pc <= self.durable_lsn and e is not None and e[0] == self.epoch:
            self.joining = False
            # as if we had voted for it: no second primary of this epoch gets our vote
            self.voted_for = req.primary
            out.append(self._persist())
            out.append(Joined())

    def replica_stream_lost(self, peer: str, now: int) -> list:
        """Primary: the stream to ``peer`` broke and was reopened. Frames in flight
        on it are gone: resend from what the replica acknowledged (resending what
        it already holds is harmless, it matches and is skipped)."""
        out: list = []
        if self.role != PRIMARY or peer not in self.peers:
            return out
        self.stream_lost_at[peer] = now
        if self.match.get(peer, 0) > 0:  # else the next frame's refusal says where to go back to
            self.next[peer] = min(self.next.get(peer, self.log.last_lsn + 1), self.match[peer] + 1)
        self._no_frames_in_flight(peer)
        self._send_append(peer, now, out, heartbeat=True)
        return out

    def join_quiet(self, now: int) -> bool:
        """A joining replacement's first stretch, in which it acknowledges nothing,
        neither an append nor a snapshot's install (see ``joining``)."""
        return self.joining and now < self.join_started + max(self.timeout, 2 * self.join_lease_us)

    def snapshot_sent(self, peer: str, lsn: int, now: int) -> list:
        """Primary: ``peer`` installed a copy of our store whose log ends at ``lsn``."""
        out: list = []
        if self.role != PRIMARY or peer not in self.peers:
            return out
        if now >= self.lease_until(now):
            # an install's acknowledgement counts as an append's does: never once we
            # are past the failover timeout without a majority (_on_append_resp)
            self._become_replica(self.epoch, None, now, out)
            return out
        self.match[peer] = max(self.match.get(peer, 0), min(lsn, self.durable_lsn))
        self.next[peer] = lsn + 1
        self._no_frames_in_flight(peer)
        self.snapshot_at[peer] = now  # answers to frames sent before this predate the copy
        self._advance_commit(out)
        self._send_append(peer, now, out, heartbeat=True)
        return out

    def transfer_refused(self, target: str) -> Optional[str]:
        """Why a switchover to ``target`` cannot happen now (None: it can be tried)."""
        if self.transfer_to is not None:
            # one at a time: starting again would forget that a TimeoutNow may be out
            # (transfer_sent), and this primary would serve again while that target
            # may still win, lease at once, and find it leasing too
            return "under_way"
        if self.peer_joining.get(target):
            return "joining"  # it ignores TimeoutNow and refuses votes until it has joined
        return None

    def handover_target(self, now: int, exclude=()) -> Optional[str]:
        """Whom a primary that is told to stop hands over to first: of the members
        heard within three heartbeats and not joining, the one holding the most
        of the log (the lowest id among equals). A member whose stream broke and
        that has answered nothing sent since is not counted (it was just stopped,
        say, before this node: the switchover would wait a failover timeout for it).
        ``exclude``: members already tried (they refused: stopping too).
        None: not a primary, a switchover under way already, or no such member (a
        single node, or its peers are down), and the stop goes on without one."""
        if self.role != PRIMARY or self.transfer_to is not None:
            return None
        # heard within three heartbeats: a member that answers at all answers each one
        live = [p for p in sorted(self.peers) if p not in exclude
                and not self.peer_joining.get(p) and now - self.acked_sent.get(p, -1 << 62) < 3 * self.heartbeat
                and self.acked_sent.get(p, -1 << 62) >= self.stream_lost_at.get(p, -1 << 62)]
        return max(live, key=lambda p: self.match.get(p, 0)) if live else None

    def disk(self, low: bool, now: int, stopping: bool = False) -> None:
        """The shell's reading of this node's disk: below its reserve, or not. A
        member low on disk campaigns a failover timeout later than one with room
        (campaign_handicap_us) and says so in its answers (AppendResp.disk_low); a
        primary low on disk for a failover timeout hands over
        (_maybe_hand_over_for_disk), unless it is ``stopping`` (the stop's own
        handover is the one that runs)."""
        self.stopping = stopping
        self.campaign_handicap_us = self.timeout if low else 0
        if not low:
            self.disk_low_since = None
        elif self.disk_low_since is None:
            self.disk_low_since = now

    def disk_passed_over(self, now: int) -> list:
        """The members a handover for disk did not reach lately (they refused, or
        did not catch up): passed over until DISK_HANDOVER_RETRY_TIMEOUTS failover
        timeouts have gone by (a stop's handover passes them over too)."""
        return [p for p, at in self.disk_handover_failed.items()
                if now - at < DISK_HANDOVER_RETRY_TIMEOUTS * self.timeout]

    def unwilling(self, now: int) -> list:
        """Members a handover should not ask: passed over lately (disk_passed_over)
        or saying in their latest answer that their disk is low (they would refuse
        TimeoutNow)."""
        passed = self.disk_passed_over(now)
        return passed + [p for p in sorted(self.peers) if self.peer_disk_low.get(p) and p not in passed]

    def _peer_disk(self, p: str, low: bool, now: int) -> None:
        """Primary: member ``p``'s latest answer says its disk is ``low`` (below its
        reserve) or not. A member passed over by a handover for disk that has
        said its disk was low since, and has then said it has room for a failover
        timeout, is passed over no longer (it refused for want of room, most
        likely, and has it again; a disk hovering at its reserve is not asked
        again at every turn)."""
        self.peer_disk_low[p] = low
        if p in self.disk_handover_failed:
            said = self.disk_low_said
            if low:
                said[p] = None
            elif p in said:
                if said[p] is None:
                    said[p] = now  # (room from now on)
                if now - said[p] >= self.timeout:
                    del self.disk_handover_failed[p], said[p]

    def _maybe_hand_over_for_disk(self, now: int, out: list) -> None:
        """A primary whose disk has stayed below its reserve for a failover timeout
        refuses every send: it hands over to a member that will take over, as
        ``cluster promote`` would (the most caught-up of those heard lately).
        Only to a member that holds every committed record at the tick: while a
        switchover is under way this primary confirms nothing (serving), so a
        member that lags (a backlogged disk answering with contact
        acknowledgements only) would cost acks and leases until the switchover
        was given up, a failover timeout later (tick). With sends refused, the
        only writes are settles, and a member with a healthy disk catches up
        between them. A member whose own disk is low refuses (the shell's
        answer to TimeoutNow, transfer_declined), as does one that is stopping;
        a member that refused or was given up is passed over
        (disk_passed_over), and a member whose latest answer says its disk is
        low is not asked (peer_disk_low). With no member to try, this primary serves on
        (acks, receives; sends refused) and tries again later. Liveness only:
        the switchover is the same as a promote's."""
        since = self.disk_low_since
        if since is None or now - since < self.timeout or self.transfer_to is not None or now < self.lease_ok_at \
                or self.stopping:
            return  # (a new primary still waiting out an older one's leases could not send TimeoutNow yet)
        behind = [p for p in self.peers if self.match.get(p, 0) < self.commit_lsn]
        target = self.handover_target(now, exclude=self.unwilling(now) + behind)
        if target is not None:
            out += self.transfer(target, now)
            self.transfer_for_disk = True

    def _transfer_failed(self, now: int) -> None:
        """The switchover under way ended with this node still the primary."""
        if self.transfer_for_disk:
            self.disk_handover_failed[self.transfer_to] = now
            self.disk_low_said.pop(self.transfer_to, None)
        self.transfer_to = None
        self.transfer_for_disk = False

    def transfer_target_lost(self) -> bool:
        """The switchover's target's stream broke after the switchover began, and
        it has answered nothing sent since (it is stopping, most likely)."""
        t = self.transfer_to
        if t is None:
            return False
        lost = self.stream_lost_at.get(t, -1 << 62)
        return lost >= self.transfer_started and self.acked_sent.get(t, -1 << 62) < lost

    def abandon_transfer(self) -> bool:
        """Give up a switchover whose TimeoutNow has not gone out (the target did
        not catch up or answer in time): this primary serves again. Once TimeoutNow
        is out it cannot be given up (the target may win and lease at once): False."""
        if self.role != PRIMARY or self.transfer_to is None or self.transfer_sent:
            return False
        self.transfer_to = None
        self.transfer_for_disk = False
        return True

    def transfer_declined(self, target: str, epoch: int, now: int) -> bool:
        """``target`` answered this primary's TimeoutNow of ``epoch`` with a refusal
        (it is stopping, or its disk is low: it will not campaign): the switchover
        ends as if TimeoutNow had never gone out, and this primary serves again
        (a handover for disk passes the target over: _transfer_failed). Only a
        refusal counts, never a lost or failed call (the target may have acted).
        A switchover has one TimeoutNow call out at a time (_maybe_finish_transfer),
        so the refusal is of the only copy out."""
        if self.role != PRIMARY or epoch != self.epoch or self.transfer_to != target or not self.transfer_sent:
            return False
        self._transfer_failed(now)
        self.transfer_sent = False
        return True

    def timeout_now_failed(self, target: str, epoch: int, now: int) -> None:
        """The call carrying this primary's TimeoutNow of ``epoch`` to ``target``
        failed without a refusal: it may have reached the target, so the
        switchover stays under way (this primary never serves again in its epoch),
        and TimeoutNow goes out again once the target has answered a frame sent
        after now (_maybe_finish_transfer). One call at a time: a copy acted on
        moves the target's epoch past this one, so it refuses no later copy."""
        if self.role == PRIMARY and epoch == self.epoch and self.transfer_to == target and self.transfer_sent:
            self.timeout_now_failed_at = now

    def transfer(self, target: str, now: int) -> list:
        """Planned switchover: stop taking writes; hand over once target has caught up."""
        out: list = []
        if self.role != PRIMARY or target not in self.peers or self.transfer_refused(target):
            return out
        self.transfer_to = target
        self.transfer_for_disk = False
        self.transfer_started = now
        self.transfer_sent = False
        self.timeout_now_failed_at = None
        self._send_append(target, now, out, heartbeat=True)  # its answer shows it is alive
        return out

    def receive(self, msg, now: int) -> list:
        out: list = []
        if isinstance(msg, VoteReq) and not msg.pre and not msg.transfer and msg.epoch > self.epoch \
                and self._heard_recently(now):
            # leader stickiness: a live primary is not deposed by a node that lost
            # touch with it (a pre-vote would have failed; ignore, do not bump)
            return out
        # The one epoch gate: lower epoch -> reject; higher epoch -> step down first.
        if msg.epoch > self.epoch:
            if getattr(msg, "pre", False):
                pass  # pre-votes never change an epoch
            else:
                leader = msg.primary if isinstance(msg, (AppendReq, TimeoutNow)) else None
                self._become_replica(msg.epoch, leader, now, out)
        if isinstance(msg, AppendReq):
            self._on_append(msg, now, out)
        elif isinstance(msg, AppendResp):
            self._on_append_resp(msg, now, out)
        elif isinstance(msg, VoteReq):
            self._on_vote(msg, now, out)
        elif isinstance(msg, VoteResp):
            self._on_vote_resp(msg, now, out)
        elif isinstance(msg, TimeoutNow):
            if msg.epoch == self.epoch and self.role == REPLICA and not self.joining:
                out += self._campaign(now, pre=False, transfer=True)
        return out

    # ------------------------------------------------------------ primary
    def _send_append(self, p: str, now: int, out: list, heartbeat: bool = False) -> None:
        nxt = self.next.get(p, self.log.last_lsn + 1)
        full = len(self.frame_ends.get(p, ())) >= self.frames_in_flight_max
        if full and not heartbeat:
            return
        prev = nxt - 1
        pe = self.log.at(prev)
        if pe is None:
            # the records this peer needs were compacted away: it needs a snapshot
            # (the shell sees prev_epoch == -1 and streams one instead)
            pe = (-1, 0)
        # a heartbeat to a peer with the most frames in flight carries no records:
        # a slow replica that still answers must not have frame after frame queued
        # for it (it still says whether the peer is alive and where its log ends)
        upto = min(self.log.last_lsn, prev + self.frame_entries_max) if pe[0] >= 0 and not full else prev
        if upto > prev:
            # and by bytes: with frames_in_flight_max frames out, what a peer that
            # lags is sent and not yet acknowledged stays within about that many
            # times this, here and in the replica's read-ahead (not the log's size)
            upto = self.log.frame_end(prev, upto, self.frame_bytes_max)
        if upto <= prev and not heartbeat and now - self.last_sent.get(p, -1 << 62) < self.heartbeat:
            return
        entries = [(lsn,) + self.log.at(lsn) for lsn in range(prev + 1, upto + 1)]
        out.append(Send(p, AppendReq(self.epoch, self.id, prev, pe[0], pe[1], entries,
                                     min(self.commit_lsn, upto if entries else prev), now, self.commit_lsn,
                                     max(self.lease_us, self.lease_ok_at - now))))
        self.last_sent[p] = now
        if entries:
            self.next[p] = upto + 1  # pipelined: assume it lands; a refusal rewinds
            self.frame_ends.setdefault(p, []).append(upto)

    def _no_frames_in_flight(self, p: str) -> None:
        self.frame_ends[p] = []

    def contact(self, m: AppendResp, now: int) -> None:
        """Primary: an acknowledgement ``m`` has arrived (of a frame, or contact
        only). Its contact counts from its arrival: the IO shell notes it here at
        once, while the whole of it may still wait its turn for receive() (behind
        this node's own fsync of a large commit, say). Nothing else is done here,
        and nothing past the failover timeout is counted (receive steps down)."""
        if self.role == PRIMARY and m.epoch == self.epoch and m.sender in self.peers \
                and now < self.lease_until(now):
            self.acked_sent[m.sender] = max(self.acked_sent.get(m.sender, -1 << 62), m.sent_us)

    def _on_append_resp(self, m: AppendResp, now: int, out: list) -> None:
        if self.role != PRIMARY or m.epoch != self.epoch:
            return
        if now >= self.lease_until(now):
            # past the failover timeout without a majority: step down as tick would,
            # before a late acknowledgement (a replacement's, say) could renew us
            self._become_replica(self.epoch, None, now, out)
            return
        p = m.sender
        self.acked_sent[p] = max(self.acked_sent.get(p, -1 << 62), m.sent_us)
        self._peer_disk(p, m.disk_low, now)
        if m.contact:
            return  # contact only (heard): the frame's own acknowledgement follows its fsync
        self.peer_joining[p] = m.joining
        if m.ok:
            # a frame is in flight until an acknowledgement covers its last record.
            # Counted by lsn, not one per acknowledgement: a heartbeat's (sent while
            # the most frames are out) and each part's of a frame the shell split
            # took no slot, and freeing one for each let a slow replica that still
            # answers have ever more frames queued for it, and fall ever further behind
            ends = self.frame_ends.setdefault(p, [])
            while ends and ends[0] <= m.match_lsn:
                ends.pop(0)
            if m.match_lsn > self.match.get(p, 0):
                self.match[p] = m.match_lsn
            self._advance_commit(out)
            self._maybe_finish_transfer(now, out)
        elif m.sent_us >= self.snapshot_at.get(p, -1 << 62):
            # log mismatch: rewind to the hint and resend from there (not for a frame
            # sent before a snapshot was installed there: its answer predates the copy,
            # and would send the replica another one)
            self.next[p] = max(1, min(self.next.get(p, 1) - 1, m.match_lsn + 1))
            self._no_frames_in_flight(p)
        if self.next.get(p, 0) <= self.log.last_lsn and (
                self.eager == EAGER_ALL or p in self.eager_peers() or self._frame_or_more_behind(p)):
            self._send_append(p, now, out)

    def _advance_commit(self, out: list) -> None:
        lsns = sorted([self.durable_lsn] + [self.match.get(p, 0) for p in self.peers], reverse=True)
        # a quorum holds it, and this node too: the primary answers only for what
        # is on its own disk as well (its fsync may finish after the replicas')
        n = min(lsns[self.quorum - 1], self.durable_lsn)
        if n > self.commit_lsn:
            e = self.log.at(n)
            # only a record of our own epoch commits by counting (raft's rule);
            # earlier ones commit with it
            if e is not None and e[0] == self.epoch:
                self.commit_lsn = n
                out.append(Commit(n))

    def _maybe_finish_transfer(self, now: int, out: list) -> None:
        t = self.transfer_to
        if t is None:
            return  # (every acknowledgement a primary counts comes through here)
        # the target holds every record, and has answered since the switchover
        # began: a target that is down never gets TimeoutNow, so this primary
        # serves again after the failover timeout instead of stepping down.
        # One call at a time: sent once, and again only after that call failed
        # without a refusal (timeout_now_failed) and the target answered since.
        # A refusal (transfer_declined) then says for sure that the target did
        # not act: with copies in flight, one could be refused after another had
        # been acted on (or reach the target's next process, after a restart)
        failed = self.timeout_now_failed_at
        due = not self.transfer_sent or failed is not None and self.acked_sent.get(t, -1 << 62) > failed
        if due and self.match.get(t, 0) >= self.log.last_lsn and self.commit_lsn >= self.log.last_lsn \
                and self.acked_sent.get(t, -1 << 62) >= self.transfer_started and not self.peer_joining.get(t) \
                and now >= self.lease_ok_at:
            # (a target still joining would ignore TimeoutNow: wait for it to join. And
            # a primary still waiting out an older one's leases hands over only once
            # that wait is over: the target's campaign counts no contact with a
            # primary, only votes for other candidates, see _lease_wait)
            self.transfer_sent = True
            self.timeout_now_failed_at = None
            out.append(Send(t, TimeoutNow(self.epoch, self.id)))

    # ------------------------------------------------------------ replica
    def heard(self, m: AppendReq, now: int) -> list:
        """Replica: a frame ``m`` has arrived, but waits behind earlier frames still
        being stored (large records take a while to write and fsync). If it is from
        the primary we follow, in our epoch, its arrival is contact: note it now,
        as receive() would, and tell the primary at once (AppendResp.contact), so
        that its lease does not run out while our disk works through a backlog.
        The frame is received in its turn; its records are acknowledged then.

        [] (nothing noted) where the frame has to be received first: another epoch
        or primary (the epoch gate), while we join, or when its lease_us is longer
        than any we have acknowledged (lease_seen must be persisted first)."""
        if self.role != REPLICA or m.epoch != self.epoch or self.primary != m.primary or self.joining \
                or (m.lease_us or self.timeout) > self.lease_seen:
            return []
        self._note_lease(m.lease_us, now)  # (may only lower lease_seen here: nothing to persist first)
        self.last_contact = now
        self.contact_lease = m.lease_us
        self.primary_gone = False
        self._reset_election_timer(now)
        # (not ok, match 0: nothing of the log; a reader that ignored ``contact`` would
        # only rewind, never count a record as held)
        return [Send(m.primary, AppendResp(self.epoch, self.id, False, 0, m.sent_us, contact=True,
                                           disk_low=self.disk_low_since is not None))]

    def _on_append(self, m: AppendReq, now: int, out: list) -> None:
        if m.epoch < self.epoch:
            out.append(Send(m.primary, AppendResp(self.epoch, self.id, False, self.log.last_lsn, m.sent_us)))
            return
        if self.joining:
            self.join_lease_us = max(self.join_lease_us, m.lease_us)
            if self.join_quiet(now):
                return  # no acknowledgement yet (see joining): the primary retries
        if self.role != REPLICA or self.primary != m.primary:
            self._become_replica(m.epoch, m.primary, now, out)
        self.last_contact = now
        self.contact_lease = m.lease_us
        if self._note_lease(m.lease_us, now):
            out.append(self._persist())  # before anything that answers this append
        self.primary_gone = False
        self._reset_election_timer(now)
        mine = self.log.at(m.prev_lsn)
        if mine is not None and m.prev_epoch >= 0 and mine != (m.prev_epoch, m.prev_crc) \
                and m.prev_lsn <= self.commit_lsn:  # (-1: compacted on the primary, nothing to compare)
            raise CommittedConflict(f"{self.id}: {m.primary}'s record {m.prev_lsn} (epoch {m.prev_epoch}) differs "
                                    f"from the one committed here (epoch {mine[0]})")
        if m.prev_lsn > self.log.last_lsn or (mine is not None and mine != (m.prev_epoch, m.prev_crc)) \
                or (mine is None and m.prev_lsn > self.commit_lsn):
            # we do not hold the primary's record at prev: tell it where to back off to
            hint = max(min(self.log.last_lsn, m.prev_lsn - 1), self.commit_lsn)
            if mine is not None and m.prev_epoch >= 0 and mine[0] != m.prev_epoch and m.prev_lsn > self.log.base_lsn:
                # ours at prev is of another epoch: so is every record of ours of that
                # epoch before it (raft's conflict-term hint), back to the commit point.
                # Back off past all of them at once, not a record a round trip: a
                # deposed primary's tail of N records took N frames to set right
                hint = max(self.log.first_of_epoch(mine[0], m.prev_lsn, self.commit_lsn) - 1, self.commit_lsn)
            # (still joining or not, as in every answer: a replacement being sent a
            # snapshot answers these all the while, and must not look joined)
            out.append(Send(m.primary, AppendResp(self.epoch, self.id, False, hint, m.sent_us, self.joining,
                                                  disk_low=self.disk_low_since is not None)))
            return
        new = []
        for e in m.entries:
            lsn, ep, crc = e[:3]
            have = self.log.at(lsn)
            if have is None and lsn <= self.log.base_lsn:
                continue  # compacted here: committed, so it matches
            if have is not None:
                if have == (ep, crc):
                    continue
                # a conflicting record: it was never committed (raft's log matching)
                if lsn <= self.commit_lsn:
                    raise CommittedConflict(f"{self.id}: {m.primary}'s record {lsn} (epoch {ep}) differs from the "
                                            f"one committed here (epoch {have[0]})")
                out.append(Truncate(lsn - 1))
                self.log.truncate(lsn - 1)
                self.durable_lsn = min(self.durable_lsn, lsn - 1)
            new.append((lsn, ep, crc))
            self.log.add(ep, crc, e[3] if len(e) > 3 else 0)
        if new:
            out.append(Store(AppendReq(m.epoch, m.primary, new[0][0] - 1, 0, 0, new, m.commit_lsn, m.sent_us,
                                       m.primary_commit)))
            # the acknowledgement follows from stored(), after the fsync
            return
        out += self.stored(m, now)

    # ----------------------------------------------------------- elections
    def _campaign(self, now: int, pre: bool, transfer: bool = False) -> list:
        out: list = []
        # while our primary looks dead, retry soon: the other replicas may not have
        # seen its streams break yet and refuse this first round
        self._reset_election_timer(now, fast=self.primary_gone)
        if not self.peers:
            pre = False
        if pre:
            if self.role == REPLICA and self.primary is not None and self._since_contact(now) >= self.timeout:
                # a failover timeout without a word from it: it is no longer a primary
                # to forward to or to call ready behind (etcd's pre-candidate drops its
                # leader too); its next append, if it is alive after all, restores it.
                # Not sooner: a broken stream alone (primary_stream_broken) campaigns
                # early, but a live primary reconnects within that time.
                self.primary = None
                out.append(Role(REPLICA, self.epoch, None))
            self.pre_votes = {self.id: self._since_contact(now)}
            for p in self.peers:
                out.append(Send(p, VoteReq(self.epoch + 1, self.id, self.log.last_epoch, self.log.last_lsn, pre=True)))
            return out
        self.epoch += 1
        self.voted_for = self.id
        self.role = CANDIDATE
        self.primary = None
        self.campaign_at = now
        self.transfer_campaign = transfer
        own_since, own_lease = self._vote_wait(now, self.id)
        self.votes = {self.id: self._lease_wait(self._since_contact(now), self.contact_lease, own_since, own_lease,
                                                transfer)}
        out.append(self._persist())
        out.append(Role(CANDIDATE, self.epoch, None))
        for p in self.peers:
            out.append(Send(p, VoteReq(self.epoch, self.id, self.log.last_epoch, self.log.last_lsn,
                                       transfer=transfer, lease_us=self.lease_us)))
        self._check_won(now, out)
        return out

    def campaign_unsaved(self, epoch: int, primary: str, now: int) -> None:
        """A campaign's Persist failed (TimeoutNow made this node campaign, and its
        new epoch and self-vote never reached the disk), and the shell has loaded
        the persisted epoch and vote back: be again the replica it was, following
        ``primary`` if the epoch loaded is that primary's ``epoch``. No effects:
        the candidacy's Role came after its Persist, so nothing outside heard of it."""
        if self.role != CANDIDATE:
            return
        self.role = REPLICA
        self.votes = {}
        self.transfer_campaign = False
        self.primary = primary if self.epoch == epoch else None
        self._reset_election_timer(now)

    def _heard_recently(self, now: int) -> bool:
        return (self.role == PRIMARY) or (
            self.primary is not None and not self.primary_gone and self._since_contact(now) < self.timeout)

    def _on_vote(self, m: VoteReq, now: int, out: list) -> None:
        up_to_date = self._up_to_date(m.last_epoch, m.last_lsn)
        heard_recently = self._heard_recently(now)
        if m.pre:
            granted = m.epoch > self.epoch and up_to_date and not heard_recently and not self.joining
            out.append(Send(m.candidate, VoteResp(m.epoch, self.id, granted, True, self._since_contact(now),
                                                  self._vote_wait(now, m.candidate)[0], voter_epoch=self.epoch)))
            return
        granted = (m.epoch == self.epoch and self.voted_for in ("", m.candidate) and up_to_date
                   and self.role != PRIMARY and not self.joining)
        since_vote, vote_lease = self._vote_wait(now, m.candidate)
        if granted:
            self.voted_for = m.candidate
            self.votes_granted[m.candidate] = (now, m.lease_us or self.timeout)
            self._note_lease(m.lease_us, now)
            out.append(self._persist())  # fsync'd before the answer leaves
            self._reset_election_timer(now)
        out.append(Send(m.candidate, VoteResp(self.epoch, self.id, granted, False, self._since_contact(now),
                                              since_vote, self.contact_lease, vote_lease)))

    def _on_vote_resp(self, m: VoteResp, now: int, out: list) -> None:
        if m.pre:
            if not m.granted and m.voter_epoch > self.epoch and self.role != PRIMARY:
                # refused by a voter already in a later epoch than the one we would
                # campaign for: join its epoch (etcd's pre-candidate does too). Else a
                # node holding the longest log but an older epoch (it missed an
                # election that left no primary behind, its winner gone) could never
                # pass a pre-vote, and the others could never win its vote: no
                # primary ever, with a majority up.
                self._become_replica(m.voter_epoch, None, now, out)
                return
            # (a yes that arrives once we follow a primary again is stale: counting it
            # would start an election against a healthy primary)
            if self.role != PRIMARY and m.granted and m.epoch == self.epoch + 1 and not self._heard_recently(now):
                self.pre_votes[m.sender] = m.since_contact_us
                if len(self.pre_votes) >= self.quorum:
                    self.pre_votes = {}
                    out += self._campaign(now, pre=False)
            return
        if self.role == CANDIDATE and m.epoch == self.epoch and not m.granted and not m.pre:
            # refused: most likely a split vote (the other replica campaigned at the same
            # moment and voted for itself). Retry after a short random pause instead of
            # a whole failover timeout; the spread decides the next round. A quarter of
            # the timeout, at most 0.2 s (round trips are far shorter): with the 10%
            # jitter of the first round, a primary that hangs is replaced within its
            # timeout plus 0.5 s even after one split vote.
            self.election_at = min(self.election_at, now + self.campaign_handicap_us
                                   + int(self.rand() * min(self.timeout // 4, SPLIT_RETRY_US)))
        if self.role != CANDIDATE or m.epoch != self.epoch or not m.granted:
            return
        # a planned switchover's old primary stopped leasing before it sent
        # TimeoutNow, so only other candidates' possible leases count then
        self.votes[m.sender] = self._lease_wait(m.since_contact_us, m.lease_us, m.since_vote_us,
                                                m.vote_lease_us, self.transfer_campaign)
        self._check_won(now, out)

    def _check_won(self, now: int, out: list) -> None:
        if self.role != CANDIDATE or len(self.votes) < self.quorum:
            return
        self.role = PRIMARY
        self.primary = self.id
        self.transfer_to = None
        # No older primary can still be leasing once every voter's contact with
        # one is older than that primary's lease (_lease_wait). A majority of the
        # members voted, so at least one of them acknowledged whatever majority
        # let an older primary lease last.
        self.lease_ok_at = now + max(0, max(self.votes.values()))
        for p in self.peers:
            self.next[p] = self.log.last_lsn + 1
            self.match[p] = 0
            self._no_frames_in_flight(p)
            self.snapshot_at.pop(p, None)
            # a vote for our epoch is contact: that voter no longer follows anyone older
            self.acked_sent[p] = self.campaign_at if p in self.votes else -1 << 62
            self.last_sent[p] = -1 << 62
            self.peer_disk_low.pop(p, None)  # (not known in this epoch until it answers)
        out.append(Role(PRIMARY, self.epoch, self.id))
        for p in self.peers:
            self._send_append(p, now, out, heartbeat=True)
