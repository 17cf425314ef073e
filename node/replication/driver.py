"""The IO shell around the replication core: gRPC streams, votes, the ticker.

Every input to the core (a tick, a frame, a vote, a local append) runs under
one asyncio lock together with the effects it returns, carried out in order:
Persist and Store are fsync'd (in the store's writer thread) before any Send
that follows them leaves. That is what makes a vote binding and an
acknowledgement mean "on disk".
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import tempfile
import time
import types
from typing import Optional

import apsw
import grpc

from node import logs
from node.core import replication as R
from node.core.invariant import BrokenInvariant
from node.core.spool import LOG_FORMAT
from node.engine import INTERNAL_FAILURE, LOG_CONFLICT, CopyHeld, InstallBroken, mono_us, nobody_waits
from node.tls import ANOTHER_CLUSTER, CLUSTER_ID_MD, another_cluster
from spooler.pb import replication_pb2 as pb
from spooler.pb import replication_pb2_grpc as pb_grpc

# The log format this node says it applies (AppendAck.log_format); a test stands
# in for an older build with SPOOLER_TEST_LOG_FORMAT (tests/integration/test_cluster.py)
ACK_LOG_FORMAT = int(os.environ.get("SPOOLER_TEST_LOG_FORMAT", "") or LOG_FORMAT)

log = logging.getLogger("spooler.replication")
# The records of one AppendFrame, in bytes: under the 16 MiB a node-to-node gRPC
# message may be (GRPC_OPTIONS). The core bounds a frame by records (512); two
# send batches of up to 8 MiB each can be in them, and such a frame would fail
# every time it was sent. A longer frame goes out as several, each with at least
# one record (one record holds one request: at most 8 MiB of bodies).
FRAME_BYTES_MAX = 12 << 20
# A replica reads frames ahead of the one it is storing (each answered with a
# contact acknowledgement) up to this many bytes; past it, it reads no more
# until it has worked through them, and gRPC's flow control holds the sender.
# A correct primary of this version has far less out to one replica (8
# frames counted, of at most R.FRAME_RECORD_BYTES_MAX or one record each, and
# a few more on their way after a refusal or a lost stream resets that count);
# a member that sends more is held, instead of filling this node's memory.
READ_AHEAD_BYTES_MAX = 128 << 20
SNAPSHOT_INCOMING = "snapshot-incoming-"   # + a unique part + ".db": a copy being received
RELEASE_RESEND_S = 0.25  # a pending lost-answer release rides on an ack at most this often
RELEASES_PER_ACK = 64
# how long a primary told to stop waits for its successor to take over (hand_over);
# a handover on a working cluster takes a few tens of milliseconds.
# SPOOLER_TEST_HANDOVER_WAIT: another bound, for a test that must tell it apart
HANDOVER_WAIT_S = float(os.environ.get("SPOOLER_TEST_HANDOVER_WAIT", "1.0") or 1.0)
# once a stopping primary has stepped down for its target's campaign and its vote
# is on disk, how long it waits to hear the winner (only to say so): the target
# may be stopping too (TimeoutNow reached it just before its own stop)
HANDOVER_HEAR_S = 0.5
# Contact acknowledgements (serve_stream, Replication.heard/contact): off only in
# a test's control run, which shows that a backlog on slow disks deposes a primary
# without them.
CONTACT_ACKS = os.environ.get("SPOOLER_TEST_CONTACT_ACKS", "1") != "0"
# Heartbeats to a replica while it is sent a snapshot (_send): off only in a test's
# control run. SPOOLER_TEST_SNAPSHOT_DELAY (seconds): a test's slow link, the copy's
# last chunk held back that long.
SNAPSHOT_HEARTBEATS = os.environ.get("SPOOLER_TEST_SNAPSHOT_HEARTBEATS", "1") != "0"
SNAPSHOT_DELAY_S = float(os.environ.get("SPOOLER_TEST_SNAPSHOT_DELAY", "0") or 0)
# SPOOLER_TEST_SNAPSHOT_REFUSE=1: a test's replica whose every install fails (it
# answers frames, and refuses each copy once received), to see the primary back off
SNAPSHOT_REFUSE = os.environ.get("SPOOLER_TEST_SNAPSHOT_REFUSE", "") == "1"
# A copy of the whole store is made only for a replica that answers (it heard
# one of our frames within this many heartbeats), and after a failed one the
# next waits 0.25 s, doubling up to SNAPSHOT_RETRY_MAX_S: a replica that is down,
# still loading, or not started yet is not sent copy after copy of the store.
SNAPSHOT_HEARD_HEARTBEATS = 3
SNAPSHOT_RETRY_MAX_S = 10.0


def frame_parts(msg: "R.AppendReq", data: list, limit: int = FRAME_BYTES_MAX) -> list:
    """An AppendReq's records as one or more frames' entries of at most ``limit``
    bytes of records each (at least one record each): [((prev lsn, epoch, crc),
    [pb.Entry...]), ...]. Each part follows on from the one before it, so the
    replica takes them as consecutive appends and acknowledges each."""
    parts, part, size = [], [], 0
    prev = (msg.prev_lsn, msg.prev_epoch, msg.prev_crc)
    for (lsn, ep, crc), b in zip(msg.entries, data):
        if part and size + len(b) > limit:
            parts.append((prev, part))
            last = part[-1]
            prev, part, size = (last.lsn, last.epoch, last.crc), [], 0
        part.append(pb.Entry(lsn=lsn, epoch=ep, crc=crc, rec=b))
        size += len(b)
    parts.append((prev, part))
    return parts


class Driver:
    def __init__(self, engine, node_id: str, peers: dict, failover_timeout_s: float, grpc_options=(), tls=None,
                 join: bool = False, eager: str = R.EAGER_QUORUM):
        """peers: id -> gRPC address, this node included. ``join``: see load().
        ``eager``: which replicas a new record goes to at once (Replication)."""
        self.engine = engine
        self.join = join
        from node.tls import peer_metadata
        self._key_md = peer_metadata(getattr(engine, "cluster_key", ""))
        self.id = node_id
        self.addresses = dict(peers)
        self.core = R.Replication(node_id, list(peers), failover_timeout_us=int(failover_timeout_s * 1e6),
                                  rand=random.random, eager=eager)
        self.grpc_options = list(grpc_options)
        self.tls = tls
        self.lock = asyncio.Lock()
        self._channels: dict = {}
        self._stubs: dict = {}
        self._outbox: dict = {}       # peer -> asyncio.Queue of AppendFrame (primary side)
        self._stream_tasks: dict = {}
        self._tasks: list = []
        self._frame_bytes: dict = {}  # lsn -> bytes of the frame being handled (replica side)
        self._refused: set = set()    # strangers whose replication traffic was refused (logged once)
        self._replies: Optional[list] = None  # AppendAcks produced while handling one frame
        # Replica: records a frame's handling found committed, applied once the
        # frame's acknowledgement has left (see serve_stream)
        self._apply_after_ack = 0
        # effect lists under way that hold a Persist: the core's epoch, vote and
        # lease_seen in memory may be ahead of the disk (no contact acknowledgement then)
        self._persisting = 0
        # a Persist failed and the core has not been reloaded from the store since:
        # its memory may hold what never reached the disk (no contact acknowledgement)
        self._unsaved = False
        self._timeout_warned: set = set()  # candidates found to run with another --failover-timeout
        self._vote_reply = None
        self._snapshots: dict = {}
        self._snapshot_retry: dict = {}  # peer -> (failures in a row, monotonic time of the next try)
        # member -> mono_us of the last call it answered or made to this node (a frame,
        # an acknowledgement, a vote asked or answered, a TimeoutNow): what
        # /v1/cluster's lastContactMs and reachable say of every member, also where
        # the replication core keeps no track (a replica of the other replicas, a
        # node with no primary)
        self.heard_from: dict = {}
        self.stopped = False
        # a stop: the streams primaries keep open to this node are ended, and new
        # ones refused (end_inbound); the gRPC server's stop would wait them out
        self.closing = False
        # the tasks serving those streams -> whether end_inbound may cancel one now
        # (not while it waits at a yield, in gRPC's own code: it ends after it)
        self._inbound: dict = {}
        self.declined: Optional[str] = None  # the last switchover target that refused (stopping, its disk low)
        self.declined_why = ""  # what it said
        self._disk_failures_said: dict = {}  # member -> the failure of a handover for disk last logged
        self._no_handover_said: Optional[tuple] = None  # the members unwilling when none was left, last logged
        # member -> the log format its latest acknowledgement to this node said, in
        # any epoch (members_behind)
        self.log_formats: dict = {}

    # ------------------------------------------------------------ lifecycle
    @property
    def _peer_md(self) -> tuple:
        """On every call to a member: the cluster's key, and its id once the
        applied log names one (node/tls.py)."""
        cid = getattr(getattr(self.engine, "core", None), "cluster_id", "")
        return self._key_md + ((CLUSTER_ID_MD, cid),) if cid else self._key_md

    def load(self) -> None:
        """Persistent state into the core (called after the engine loaded its store)."""
        st = self.engine.store
        c = self.core
        c.epoch = int(st.get_meta("repl_epoch") or 0)
        c.voted_for = st.get_meta("voted_for") or ""
        c.lease_seen = int(st.get_meta("lease_seen_us") or 0)
        rows = list(st.db.execute("SELECT lsn, epoch, crc, length(rec) FROM log ORDER BY lsn"))
        a = st.applied_position()
        c.log = R.LogView.from_store(rows, (a.lsn, a.epoch, a.crc))
        c.epoch = max(c.epoch, c.log.last_epoch)
        # what the store applied was committed: a primary's record that differs from
        # it is a conflict to stop on (R.CommittedConflict), never a truncation
        c.commit_lsn = max(c.commit_lsn, self.engine.core.lsn)
        # --join on a store that has never held anything: a replacement, joining
        # without a vote (Replication.joining) until it holds the cluster's history.
        # On any other store the flag changes nothing (a restart of a member that
        # has joined, or that was there from the start).
        if self.join and c.epoch == 0 and c.log.last_lsn == 0 and st.get_meta("joining") is None:
            self._set_joining(True)
            log.info("joining the cluster: no vote until this node holds what the cluster committed")
        c.joining = st.get_meta("joining") == 1

    def _set_joining(self, joining: bool) -> None:
        st = self.engine.store
        with st.db:
            st.set_meta("joining", 1 if joining else 0)

    async def start(self) -> None:
        # copies being sent or received when the process last ended: never installed
        for name in os.listdir(self.engine.data_dir):
            if name.endswith(".db") and name.startswith(("snapshot-incoming", "snapshot-for-")):
                os.remove(os.path.join(self.engine.data_dir, name))
        await self.engine.store_io(self.load)
        for p in self.core.peers:
            from node.tls import aio_channel
            self._channels[p] = aio_channel(self.addresses[p], self.grpc_options, self.tls)
            self._stubs[p] = pb_grpc.ReplicationStub(self._channels[p])
        async with self.lock:
            self._handicap()
            await self._run(self.core.start(mono_us()))
        self._tasks.append(asyncio.create_task(self._ticker(), name="repl-ticker"))
        for t in self._tasks:
            t.add_done_callback(self.engine._task_ended)

    async def stop(self) -> None:
        self.stopped = True
        # (snapshots too: a copy being made puts slice after slice on the writer
        # thread, which the engine's last checkpoint then waits behind)
        for t in list(self._tasks) + list(self._stream_tasks.values()) + list(self._snapshots.values()):
            t.cancel()
        for ch in self._channels.values():
            await ch.close()

    async def _ticker(self) -> None:
        step = min(0.01, self.core.heartbeat / 1e6 / 4)
        started = warned = mono_us()
        while True:
            await asyncio.sleep(step)
            if self.closing:
                continue  # stopping: no heartbeat, and above all no campaign
            async with self.lock:
                now = mono_us()
                self._handicap()
                c = self.core
                before = (c.transfer_to, c.transfer_for_disk)
                await self._run(self.core.tick(now))
                self._said_disk_handover(before)
                if c.joining and c.last_contact is None and now - warned >= max(30_000_000, 10 * c.timeout):
                    warned = now
                    log.warning("joining (--join) for %.0f s and no primary heard: a joining node never votes, so if "
                                "every member started on an empty store (a new cluster), start them without --join",
                                (now - started) / 1e6)

    def _handicap(self) -> None:
        """The core hears of this node's disk before each tick (Replication.disk): a
        member low on disk campaigns a failover timeout later than the others, and
        a primary low on disk for a failover timeout hands over to a member with
        room. Engine.disk_low reads statvfs at most once a second. A node that is
        stopping starts no handover for its disk: the stop's own (hand_over) is
        the one that runs."""
        self.core.disk(self.engine.disk_low(), mono_us(), stopping=self.engine.draining)

    def _said_disk_handover(self, before: tuple) -> None:
        """Log what a tick did about a primary low on disk (Replication.disk)."""
        c = self.core
        to, for_disk = before
        if c.transfer_for_disk and (c.transfer_to, for_disk) != (to, True):
            log.warning("less than %d bytes free on this node's disk (--disk-reserve-bytes) for a failover timeout, "
                        "and every send refused: handing over to %s, as cluster promote would",
                        self.engine.limits.disk_free_bytes_min, c.transfer_to)
        said = self._disk_failures_said
        for m, at in c.disk_handover_failed.items():  # (a refusal comes between ticks: _timeout_now)
            if said.get(m) != at:
                said[m] = at
                log.warning("%s did not take over from this node, low on disk (it refused, or was not ready in "
                            "time); asked again in %g s at the earliest", m,
                            R.DISK_HANDOVER_RETRY_TIMEOUTS * c.timeout / 1e6)
        now = mono_us()
        since = c.disk_low_since
        if c.role == R.PRIMARY and since is not None and now - since >= c.timeout and c.transfer_to is None \
                and now >= c.lease_ok_at and not c.stopping:
            unwilling = c.unwilling(now)
            # (a member that is only catching up is asked at a later tick: nothing to say)
            if c.handover_target(now, exclude=unwilling) is None and tuple(unwilling) != self._no_handover_said:
                self._no_handover_said = tuple(unwilling)  # (once for each set: a tick comes every few ms)
                low = [p for p in unwilling if c.peer_disk_low.get(p)]
                why = [f"{p}: its disk is low too" for p in low] + [f"{p}: passed over" for p in unwilling
                                                                   if p not in low]
                log.warning("this node's disk is below its reserve and no member can take over (%s): serving on, "
                            "sends refused", "; ".join(why + ["no other member heard lately"]))
        else:
            self._no_handover_said = None

    # ------------------------------------------------------------- queries
    def members_behind(self, log_format: int) -> list:
        """The members whose latest acknowledgement to this node (as primary, in
        this epoch or an earlier one) said they apply no record of ``log_format``
        (older builds: they would stop on one). A member this node has not heard
        from as primary is not counted: see upgrades.md."""
        return sorted(m for m, f in self.log_formats.items() if f < log_format)

    def serving(self) -> bool:
        return self.core.serving(mono_us())

    def may_lease(self) -> bool:
        return self.core.may_lease(mono_us())

    def lease_wait_s(self) -> float:
        """How long until this primary may lease, if it is waiting out an older one
        (else a short pause: it is waiting for a majority to answer again)."""
        return max(0.1, (self.core.lease_ok_at - mono_us()) / 1e6)

    def status(self) -> dict:
        c, now = self.core, mono_us()
        eager = c.eager_peers() if c.role == R.PRIMARY else ()
        nodes = []
        for m in c.members:
            # a candidate is not the primary: "replica", as at the top level (API.md's two roles)
            role = "primary" if (c.role == R.PRIMARY if m == self.id else m == c.primary) else "replica"
            d = {"id": m, "role": role, "address": self.addresses[m]}
            if c.role == R.PRIMARY and m != self.id:
                d["matchLsn"] = c.match.get(m, 0)
                d["eager"] = m in eager  # new records go to it at once (--eager-replicas)
            elif m == self.id:
                d["lsn"] = c.log.last_lsn
            # how long ago this node last heard that one, where it keeps track: a
            # primary of each replica's acknowledgements (its vote until the first
            # one), a replica of its primary; null: not heard since this node
            # started or took office
            # Where this node has traffic to judge by: the primary of every member (their
            # acknowledgements), a replica of its primary (its frames), a node that
            # knows no primary of every member (the votes it asks and answers). Not
            # a replica of the other replicas: they exchange nothing while all is well.
            if m != self.id and (c.role == R.PRIMARY or m == c.primary or c.primary is None):
                heard = self.heard_from.get(m, -1)
                if c.role == R.PRIMARY or m == c.primary:
                    tracked = c.acked_sent.get(m) if c.role == R.PRIMARY else c.last_contact
                    heard = max(heard, tracked if tracked is not None else -1)
                d["lastContactMs"] = None if heard < 0 else round(max(0, now - heard) / 1e3, 1)
                # answering within the failover timeout, as a primary's majority must
                d["reachable"] = heard >= 0 and now - heard < c.timeout
            if (c.joining if m == self.id else c.role == R.PRIMARY and c.peer_joining.get(m)):
                d["joining"] = True  # a replacement that does not vote yet
            # below its disk reserve: this node's own reading; on the primary, what
            # each member's latest answer said (absent: not heard in this epoch)
            if m == self.id:
                d["diskLow"] = c.disk_low_since is not None  # (Replication.disk: read before each tick)
            elif c.role == R.PRIMARY and m in c.peer_disk_low:
                d["diskLow"] = c.peer_disk_low[m]
            nodes.append(d)
        return {"role": "primary" if c.role == R.PRIMARY else "replica", "epoch": c.epoch, "primary": c.primary,
                "commitLsn": c.commit_lsn, "nodes": nodes}

    # ------------------------------------------------------------- inputs
    async def run_effects(self, effects: list) -> None:
        """Carry out effects; the caller holds ``self.lock`` (the engine's commit)."""
        await self._run(effects)

    async def transfer(self, target: str) -> None:
        async with self.lock:
            await self._run(self.core.transfer(target, mono_us()))

    async def switch_over(self, target: str, wait_s: float, give_up_if_lost: bool = False) -> None:
        """A planned switchover to ``target``, waited for at most ``wait_s``: until
        this node has stepped down AND heard the new primary (its first frame), or
        serves again (the target did not catch up within the failover timeout, or
        refused). ``give_up_if_lost`` (a stop): stop waiting once the target's
        stream has broken (Replication.transfer_target_lost), and give the
        switchover up if TimeoutNow is not out yet; and once this node has stepped
        down for the target's campaign, wait at most HANDOVER_HEAR_S more to hear
        the winner. The caller reads the outcome from the core (role, primary),
        and from ``declined`` whether the target refused."""
        self.declined = None
        await self.transfer(target)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        c = self.core
        stepped_down = False
        while loop.time() < deadline and (c.role == R.PRIMARY or not c.primary or c.primary == self.id):
            if c.role == R.PRIMARY and c.transfer_to is None:
                return  # abandoned: this node serves again
            if give_up_if_lost and c.transfer_target_lost():
                async with self.lock:
                    c.abandon_transfer()  # (only while TimeoutNow is not out: then this node serves again)
                return
            if give_up_if_lost and c.role != R.PRIMARY and not stepped_down and not self._persisting:
                # stepped down for a campaign, and its vote is on disk: hear the winner, briefly
                stepped_down = True
                deadline = min(deadline, loop.time() + HANDOVER_HEAR_S)
            await asyncio.sleep(0.01)

    def end_inbound(self) -> None:
        """A stop, once any handover is over: end the replication streams that
        primaries keep open to this node, and refuse new ones. Otherwise the gRPC
        server's stop waits out its grace period for them (about a second)."""
        self.closing = True
        for t, cancellable in list(self._inbound.items()):
            if cancellable:
                t.cancel()

    async def hand_over(self) -> Optional[str]:
        """A primary told to stop first hands over to the member holding the most of
        the log (core.handover_target), as ``cluster promote`` would. Its successor
        then leases at once: this node stopped leasing before it sent TimeoutNow.
        Without it, the successor is elected as soon as this node's streams end,
        but must wait out this node's lease before it hands out messages (about
        half a failover timeout).

        Bounded by HANDOVER_WAIT_S (or the failover timeout, if shorter): a target
        that has not caught up by then (it hung, or is stopping too) is given up,
        and the stop goes on as it did before handovers (the cluster elects as
        after a crash). Once TimeoutNow is out this node never serves again in its
        epoch, so the stop goes on then too. A target that refuses (it is stopping
        too) is passed over for the next, within the same bound. Returns the new
        primary, or None."""
        c = self.core
        if c.role != R.PRIMARY:
            return None
        loop = asyncio.get_running_loop()
        wait_s = min(HANDOVER_WAIT_S, c.timeout / 1e6)
        deadline = loop.time() + wait_s
        # members a handover for this node's disk found refusing lately (low on disk
        # too, most likely), or that say their disk is low: passed over here as well
        refused: list = c.unwilling(mono_us())
        while True:
            # a switchover under way already (this node is low on disk, Replication.disk,
            # or a promote): waited for as the stop's own would be, within the same bound
            target = c.transfer_to or c.handover_target(mono_us(), exclude=refused)
            if target is None:
                if refused:
                    log.warning("stopping without a handover: no member left to try (%s refused or went away)",
                                ", ".join(refused))
                return None
            log.info("stopping as the primary: handing over to %s first%s", target,
                     " (a switchover to it was under way)" if c.transfer_to == target else "")
            await self.switch_over(target, max(0.0, deadline - loop.time()), give_up_if_lost=True)
            if c.role != R.PRIMARY and c.primary == target:
                log.info("handed over to %s (epoch %d)", target, c.epoch)
                return target
            if c.role == R.PRIMARY and c.transfer_to is None and loop.time() < deadline:
                # it refused or went away (stopping too, most likely): the next member
                log.info("%s will not take over (%s): trying the next member", target,
                         "it refused" if self.declined == target else "its stream broke")
                refused.append(target)
                continue
            break
        async with self.lock:
            if c.role != R.PRIMARY:
                why = f"{c.primary} is primary" if c.primary else "no primary is known yet"
            elif c.transfer_to is None:
                why = (f"{target} refused: {self.declined_why}" if self.declined == target
                       else f"the switchover was given up ({target} went away or did not catch up in time)")
            elif c.abandon_transfer():
                why = f"{target} did not catch up within {wait_s:g} s"
            else:
                # TimeoutNow is out: this node never stamps again in its epoch, so what
                # waits for the group commit is known not stored
                why = f"{target} was told to take over but had not yet (or went away)"
                self.engine.drop_pending("the primary is stopping and handing over; not stored")
        log.warning("stopping without a handover to %s: %s", target, why)
        return None

    # -------------------------------------------------------------- effects
    def _apply_deferred(self) -> None:
        """Apply what a frame's handling found committed (under the lock)."""
        lsn, self._apply_after_ack = self._apply_after_ack, 0
        if lsn:
            self.engine.apply_upto(lsn)

    async def _run(self, effects: list) -> None:
        if any(type(eff) is R.Persist for eff in effects):
            self._persisting += 1
            try:
                await self._run_effects(effects)
            except BaseException:
                self._unsaved = True  # until _resync has reloaded the core
                raise
            finally:
                self._persisting -= 1
        else:
            await self._run_effects(effects)

    async def _run_effects(self, effects: list) -> None:
        e = self.engine
        if self._replies is None:
            self._apply_deferred()  # nothing else sees the state behind a frame's commit point
        for eff in effects:
            if isinstance(eff, R.Send):
                self._send(eff.to, eff.msg)
            elif isinstance(eff, R.Commit):
                if self._replies is not None:
                    # handling a primary's frame: its acknowledgement is what the primary
                    # waits for (fsync, then acknowledge); applying comes after it
                    self._apply_after_ack = max(self._apply_after_ack, eff.lsn)
                else:
                    e.apply_upto(eff.lsn)
            elif isinstance(eff, R.Persist):
                await self._store(self._persist, eff.epoch, eff.voted_for, eff.lease_seen)
            elif isinstance(eff, R.Store):
                lsns = [x[0] for x in eff.req.entries]
                rows = [(lsn, ep, crc, self._frame_bytes[lsn]) for lsn, ep, crc in eff.req.entries]
                e.check_from_primary(rows)  # contiguity and checksums, before anything is written
                t = time.perf_counter()
                await self._store(e.store.append, rows, inline=e.small_commit(rows))
                if e.metrics:  # a replica's group commits count like the primary's
                    e.metrics.observe_commit(len(rows), time.perf_counter() - t)
                e.stored_from_primary(rows)
                for lsn in lsns:
                    self._frame_bytes.pop(lsn, None)
                await self._run(self.core.stored(eff.req, mono_us()))
            elif isinstance(eff, R.Truncate):
                # checked before the store's log is cut (Engine.truncated checks it again after)
                if eff.after_lsn < e.core.lsn:
                    raise BrokenInvariant(f"truncating to {eff.after_lsn}, below applied {e.core.lsn}")
                crc = await self._store(self._truncate, eff.after_lsn)
                e.truncated(eff.after_lsn, crc)
            elif isinstance(eff, R.Role):
                self._on_role(eff)
                e.on_role(eff.role, eff.epoch, eff.primary)
            elif isinstance(eff, R.Joined):
                await self._store(self._set_joining, False)
                log.info("joined the cluster in epoch %d: this node votes again", self.core.epoch)

    async def _store(self, fn, *args, inline: bool = False):
        """Every write the replication makes to the store (a frame's records, the epoch,
        vote and lease seen, a truncation, the joined mark) goes through here. One
        that fails (a write or an fsync error) stops the node (S9), as a primary's
        failed commit does: nothing it held is acknowledged, and the node does not
        reload and go on writing into a store whose writes or fsyncs failed (after a
        failed fsync, a later one that succeeds says nothing of the earlier pages)."""
        e = self.engine
        try:
            return await e.store_io(fn, *args, inline=inline)
        except Exception as err:
            if e.failed is None:
                e._fail(err)
            raise

    def _persist(self, epoch: int, voted_for: str, lease_seen: int) -> None:
        st = self.engine.store
        with st.db:  # one transaction: fsync'd at commit (synchronous=FULL)
            st.set_meta("repl_epoch", epoch)
            st.set_meta("voted_for", voted_for)
            st.set_meta("lease_seen_us", lease_seen)

    def _truncate(self, after_lsn: int) -> int:
        st = self.engine.store
        st.truncate_log(after_lsn)
        for (crc,) in st.db.execute("SELECT crc FROM log WHERE lsn = ?", (after_lsn,)):
            return crc
        a = st.applied_position()
        if a.lsn != after_lsn:
            raise BrokenInvariant(f"truncating to {after_lsn}, which is neither in the log nor the checkpoint")
        return a.crc

    def _on_role(self, eff: R.Role) -> None:
        self._snapshot_retry.clear()  # a new office: earlier failures say nothing of the copies it needs
        if eff.role != R.PRIMARY:
            for p, t in list(self._stream_tasks.items()):
                t.cancel()
            self._stream_tasks.clear()
            self._outbox.clear()

    # ---------------------------------------------------------------- sends
    def _send(self, to: str, msg) -> None:
        if isinstance(msg, R.AppendReq) and msg.prev_epoch == -1:
            # what this replica needs was compacted away: send it a snapshot instead
            t = self._snapshots.get(to)
            if (t is None or t.done()) and self._snapshot_due(to):
                self._snapshots[to] = asyncio.create_task(self._send_snapshot(to, msg.epoch), name=f"snapshot-{to}")
            # ... and the frame itself, which holds no records (the core sends such a
            # frame at most once a heartbeat): the replica answers it as any frame
            # that does not follow on from its log, and so the copy's time does not
            # cost this primary its majority, nor the replica its primary, when the
            # replica is needed for the majority (another member is down)
            if not SNAPSHOT_HEARTBEATS:
                return
        if isinstance(msg, R.AppendReq):
            t = self._stream_tasks.get(to)
            if t is None or t.done() or to not in self._outbox:
                self._outbox[to] = asyncio.Queue()
                t = self._stream_tasks[to] = asyncio.create_task(self._stream_to(to, self._outbox[to]),
                                                                 name=f"stream-{to}")
                # a stream's own failures (the network's, the replica's refusals) are
                # handled inside it; anything else it dies of is a bug: the node stops
                t.add_done_callback(self.engine._task_ended)
            q = self._outbox[to]
            lsns = [x[0] for x in msg.entries]
            data = self.engine.record_bytes(lsns) if lsns else []
            for prev, part in frame_parts(msg, data):
                q.put_nowait(pb.AppendFrame(
                    epoch=msg.epoch, primary=msg.primary, prev_lsn=prev[0], prev_epoch=prev[1],
                    prev_crc=prev[2], commit_lsn=min(msg.commit_lsn, part[-1].lsn) if part else msg.commit_lsn,
                    sent_us=msg.sent_us, primary_commit_lsn=msg.primary_commit, lease_us=msg.lease_us,
                    entries=part, contact_acks=CONTACT_ACKS))
        elif isinstance(msg, R.AppendResp):
            if self._replies is not None:
                self._replies.append(pb.AppendAck(epoch=msg.epoch, sender=msg.sender, ok=msg.ok,
                                                  match_lsn=msg.match_lsn, sent_us=msg.sent_us,
                                                  joining=msg.joining, disk_low=msg.disk_low,
                                                  log_format=ACK_LOG_FORMAT))
        elif isinstance(msg, R.VoteReq):
            asyncio.ensure_future(self._ask_vote(to, msg))
        elif isinstance(msg, R.VoteResp):
            self._vote_reply = msg
        elif isinstance(msg, R.TimeoutNow):
            asyncio.ensure_future(self._timeout_now(to, msg))

    async def _stream_to(self, peer: str, q: asyncio.Queue) -> None:
        """One bidi stream to a replica: frames out, acks in. A broken stream is
        reopened, and the core resends from the replica's last acknowledged
        position. Each attempt has its own frame queue: gRPC may keep a failed
        call's request iterator waiting, and it must not take frames meant for
        the next stream (it gets an end marker instead)."""
        async def frames(q: asyncio.Queue):
            while True:
                f = await q.get()
                if f is None:
                    return
                yield f

        while not self.stopped:
            try:
                call = self._stubs[peer].Stream(frames(q), metadata=self._peer_md)
                async for ack in call:
                    now = self.heard_from[peer] = mono_us()
                    if not ack.contact and ack.sent_us and self.engine.metrics is not None:
                        # (sent_us: our clock when the core made the frame, echoed back)
                        self.engine.metrics.member_ack_seconds.observe(peer, (now - ack.sent_us) / 1e6)
                    if ack.releases and self.engine.release_hook is not None:
                        self.engine.release_hook(list(ack.releases))
                    m = R.AppendResp(ack.epoch, ack.sender, ack.ok, ack.match_lsn, ack.sent_us, ack.joining,
                                     ack.contact, ack.disk_low)
                    self.log_formats[peer] = ack.log_format
                    if CONTACT_ACKS:
                        self.core.contact(m, mono_us())  # now, not once the lock is free (see contact)
                    async with self.lock:
                        await self._run(self.core.receive(m, mono_us()))
            except asyncio.CancelledError:
                raise
            except grpc.RpcError as e:
                self._note_refusal(peer, e)
                log.debug("stream to %s broke: %s", peer, e.code())
            q.put_nowait(None)  # ends this attempt's iterator, wherever gRPC left it
            q = self._outbox[peer] = asyncio.Queue()
            await asyncio.sleep(0.05)
            async with self.lock:
                await self._run(self.core.replica_stream_lost(peer, mono_us()))

    def _snapshot_due(self, peer: str) -> bool:
        """Is a copy of the store worth making for ``peer`` now? Only if it answers
        (a copy for a replica that is down fails once it is made: the whole store
        written for nothing, ten times a second while the stream retries), and
        not before the backoff after a failed one."""
        now = mono_us()
        heard = self.core.acked_sent.get(peer, -1 << 62)
        # (with the test switch off, no empty frame goes out beside the copy, so a
        # replica that needs one has nothing to answer: not gated then)
        if SNAPSHOT_HEARTBEATS and now - heard > SNAPSHOT_HEARD_HEARTBEATS * self.core.heartbeat:
            return False
        return time.monotonic() >= self._snapshot_retry.get(peer, (0, 0.0))[1]

    async def _send_snapshot(self, peer: str, epoch: int) -> None:
        e = self.engine
        path = os.path.join(e.data_dir, f"snapshot-for-{peer}.db")
        ok = False
        try:
            await e.snapshot_to(path)   # in slices: commits go on meanwhile
            log.info("sending a snapshot to %s", peer)
            ack = await self._stubs[peer].InstallSnapshot(snapshot_chunks(path, epoch, self.id, SNAPSHOT_DELAY_S),
                                                          timeout=120, metadata=self._peer_md)
            ok = ack.ok
            if ack.ok:
                async with self.lock:
                    if self.core.role == R.PRIMARY and self.core.epoch == epoch:
                        await self._run(self.core.snapshot_sent(peer, ack.last_lsn, mono_us()))
            else:
                log.info("%s did not install the snapshot copy (its log says why); another follows after a pause",
                         peer)
        except grpc.RpcError as err:
            log.warning("snapshot to %s failed: %s", peer, err.code())
        except apsw.Error as err:   # e.g. the store was closed under the copy (this node stepped down)
            log.warning("snapshot for %s could not be made: %s", peer, err)
        finally:
            if os.path.exists(path):
                os.remove(path)
            if ok:
                self._snapshot_retry.pop(peer, None)
            else:
                n = self._snapshot_retry.get(peer, (0, 0.0))[0] + 1
                wait_s = min(SNAPSHOT_RETRY_MAX_S, 0.25 * 2 ** min(n - 1, 8))
                self._snapshot_retry[peer] = (n, time.monotonic() + wait_s)

    async def serve_snapshot(self, request_iterator, context):
        """Replica: replace our store with the primary's copy, then follow it.

        Each stream writes a file of its own (two primaries, or a primary's
        retry after its deadline, may stream at once), and only a copy whose
        last chunk came is installed. The install itself runs to its end even
        if the call is cancelled meanwhile (its work is on the writer thread):
        what it leaves is a whole store and a core loaded from it.

        A node that is stopping (end_inbound) ends a copy still arriving, as it
        ends the frame streams, and refuses new ones; an install under way runs
        to its end."""
        e = self.engine
        if self.closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"node {self.id!r} is stopping")
        fd, path = tempfile.mkstemp(prefix=SNAPSHOT_INCOMING, suffix=".db", dir=e.data_dir)
        me = asyncio.current_task()
        self._inbound[me] = True
        epoch, primary, complete, handed = 0, "", False, False
        digest, expected = hashlib.sha256(), b""
        try:
            with os.fdopen(fd, "wb") as f:
                async for ch in request_iterator:
                    if not self.is_member(ch.primary):
                        log.warning("refused a snapshot from %r: not a member of this node's cluster", ch.primary)
                        return pb.SnapshotAck(epoch=self.core.epoch, ok=False)
                    epoch, primary = ch.epoch, ch.primary
                    f.write(ch.data)
                    digest.update(ch.data)
                    if ch.last:
                        complete, expected = True, ch.sha256
                        break
                if not complete:
                    return pb.SnapshotAck(epoch=self.core.epoch, ok=False)
                # What arrived must be what the primary read from its copy file
                # (SnapshotChunk.sha256). A copy is checked as a store when it is
                # installed, but a byte changed on the way inside a row still leaves
                # a store; this is what catches it. (It does not cover the primary's
                # file before it was read, nor this one after it is written.)
                if not expected:
                    log.info("a snapshot from %s came without a digest (a primary before 0.4.45): it is checked "
                             "as a store only", primary)
                elif digest.digest() != expected:
                    log.warning("refused a snapshot from %s: what arrived does not hash to the digest it was sent "
                                "with; this node's store is unchanged", primary)
                    return pb.SnapshotAck(epoch=self.core.epoch, ok=False)
                f.flush()
                os.fsync(f.fileno())
            handed = True  # from here the install removes the file, when it is done with it
            self._inbound[me] = False
            return await shielded(self._install(path, epoch, primary))
        except asyncio.CancelledError:
            if not self.closing or handed:
                raise
            me.uncancel()  # ended by end_inbound: nothing installed, the primary sees the stream end
            return pb.SnapshotAck(epoch=self.core.epoch, ok=False)
        finally:
            self._inbound.pop(me, None)
            if not handed:
                _remove_copy(path)

    async def _install(self, path: str, epoch: int, primary: str) -> pb.SnapshotAck:
        try:
            return await self._install_locked(path, epoch, primary)
        finally:
            _remove_copy(path)

    async def _install_locked(self, path: str, epoch: int, primary: str) -> pb.SnapshotAck:
        e = self.engine
        async with self.lock:
            if epoch < self.core.epoch or self.core.role == R.PRIMARY or self.core.join_quiet(mono_us()):
                return pb.SnapshotAck(epoch=self.core.epoch, ok=False)
            if SNAPSHOT_REFUSE:
                log.warning("refused a snapshot from %s (SPOOLER_TEST_SNAPSHOT_REFUSE)", primary)
                return pb.SnapshotAck(epoch=self.core.epoch, ok=False)
            e.installing = True
            try:
                try:
                    await e.store_io(e.install_snapshot_sync, path)
                except CopyHeld as held:  # a late copy: our log holds it (Engine._copy_held); keep ours
                    end = held.args[0]
                    log.info("kept this node's log (to lsn %d) over a snapshot from %s that ends at lsn %d",
                             self.core.log.last_lsn, primary, end.lsn)
                    return pb.SnapshotAck(epoch=self.core.epoch, ok=True, last_lsn=end.lsn)
                except InstallBroken as err:  # our store is gone: stop, as after a failed write (S9)
                    if e.failed is None:
                        e._fail(err)
                    raise
                except Exception as err:  # our store is as it was: the primary tries again later
                    log.warning("refused a snapshot from %s: it could not be installed (%r); this "
                                "node's store is unchanged", primary, err)
                    return pb.SnapshotAck(epoch=self.core.epoch, ok=False)
                await self._store(self.load)  # a joining node is still joining (install_snapshot_sync)
            finally:
                e.installing = False
            c = self.core
            c.durable_lsn = c.log.last_lsn
            c.commit_lsn = max(c.commit_lsn, e.core.lsn)
            log.info("installed a snapshot from %s: log to lsn %d, applied %d", primary, c.log.last_lsn, e.core.lsn)
            return pb.SnapshotAck(epoch=c.epoch, ok=True, last_lsn=c.log.last_lsn)

    async def _ask_vote(self, peer: str, m: R.VoteReq) -> None:
        try:
            r = await self._stubs[peer].Vote(pb.VoteRequest(
                epoch=m.epoch, candidate=m.candidate, last_epoch=m.last_epoch, last_lsn=m.last_lsn,
                pre=m.pre, transfer=m.transfer, lease_us=m.lease_us), timeout=self.core.timeout / 1e6,
                metadata=self._peer_md)
        except grpc.RpcError as e:
            self._note_refusal(peer, e)
            return
        self.heard_from[peer] = mono_us()
        async with self.lock:
            await self._run(self.core.receive(R.VoteResp(r.epoch, r.sender, r.granted, r.pre, r.since_contact_us,
                                                         r.since_vote_us, r.lease_us, r.vote_lease_us, r.voter_epoch),
                                                mono_us()))

    @staticmethod
    def _note_refusal(peer: str, e: grpc.RpcError) -> None:
        """Say (at most once a minute) why ``peer`` refuses this node's calls, when
        that is something an operator must fix: each side's log then says it."""
        code = e.code()
        if code == grpc.StatusCode.UNAUTHENTICATED:
            warn_once_a_minute(log, ("refused by", peer), "%s refuses this node's replication calls: the members' "
                               "--cluster-key differ (%s)", peer, e.details())
        elif code == grpc.StatusCode.PERMISSION_DENIED and ANOTHER_CLUSTER in (e.details() or ""):
            warn_once_a_minute(log, ("of another cluster", peer), "%s refuses this node's replication calls: %s "
                               "(the address in --peers reaches a node of another cluster, or this node's store "
                               "is another cluster's)", peer, e.details())
        elif code == grpc.StatusCode.PERMISSION_DENIED:
            warn_once_a_minute(log, ("not a member of", peer), "%s refuses this node's replication calls: %s "
                               "(its --peers do not name this node as they are given here)", peer, e.details())

    async def _timeout_now(self, peer: str, m: R.TimeoutNow) -> None:
        try:
            await self._stubs[peer].TimeoutNow(pb.TimeoutNowRequest(epoch=m.epoch, primary=m.primary),
                                               timeout=self.core.timeout / 1e6, metadata=self._peer_md)
        except grpc.RpcError as e:
            # FAILED_PRECONDITION is the target's own refusal (serve_timeout_now: it
            # is stopping, and did not act on it); any other failure may have
            # reached it: the switchover stays under way, and TimeoutNow goes out
            # again once the target answers (Replication.timeout_now_failed)
            async with self.lock:
                if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    self.core.timeout_now_failed(peer, m.epoch, mono_us())
                elif self.core.transfer_declined(peer, m.epoch, mono_us()):
                    self.declined, self.declined_why = peer, e.details() or ""
                    log.info("%s refused to take over (%s): this node serves again", peer, e.details())

    # ------------------------------------------------------------ servicer
    def is_member(self, node_id: str) -> bool:
        """Whether ``node_id`` is one of the other members this node was started
        with (``--peers``). Replication traffic from anyone else (a node of
        another cluster on a reused address, or any node at all when this one
        runs alone) is refused before it can touch the epoch or the log."""
        return node_id in self.core.peers

    async def _refuse(self, context, who: str) -> None:
        if who not in self._refused and len(self._refused) < 64:  # said once per stranger
            self._refused.add(who)
            log.warning("refused replication traffic from %r: not a member of this node's cluster (--peers)", who)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"{who!r} is not a member of the cluster of node {self.id!r}")

    async def serve_stream(self, request_iterator, context):
        """Replica side of a primary's stream: its frames are handled one at a time,
        in order, each acknowledged once stored.

        A frame whose handling waits (a large one is written and fsync'd in the
        store's thread) does not stop the stream from being read: the frames that
        arrive meanwhile wait their turn here, and each is answered at once with a
        contact acknowledgement (Replication.heard), so that a primary does not
        lose its majority, and step down, while our disk works through a backlog of
        large records. A frame handled without waiting costs nothing of this."""
        if self.closing:  # stopping (end_inbound)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"node {self.id!r} is stopping")
        me = asyncio.current_task()
        inbound = self._inbound
        inbound[me] = True
        sender = None
        it = request_iterator.__aiter__()
        ahead: list = []          # (frame, its size) read while an earlier one was being handled
        ahead_bytes = 0           # ... their sizes' sum: reading stops past READ_AHEAD_BYTES_MAX
        reading = None            # the pending read of the next frame, if any
        read_end = None           # how reading ended while a frame was handled (StopAsyncIteration, error)
        try:
            while not self.closing and self.engine.failed is None:  # (a failed store: the node is stopping)
                if ahead:
                    f, size = ahead.pop(0)
                    ahead_bytes -= size
                elif read_end is not None:
                    if isinstance(read_end, StopAsyncIteration):
                        break
                    raise read_end
                else:
                    r, reading = reading, None
                    try:
                        f = await (r if r is not None else it.__anext__())
                    except StopAsyncIteration:
                        break
                if f.primary != sender and not self.is_member(f.primary):
                    await self._refuse(context, f.primary)
                sender = f.primary
                self.heard_from[sender] = mono_us()
                # Shielded: if the primary dies mid-frame, gRPC cancels this handler;
                # the frame's store-and-bookkeeping must still finish as one step, or
                # the log on disk and the core's view of it would part ways.
                done, value = start_shielded(self._handle_frame(f))
                while not done:
                    if reading is None and read_end is None and ahead_bytes < READ_AHEAD_BYTES_MAX:
                        reading = asyncio.ensure_future(it.__anext__())
                    waits = {value} if reading is None else {value, reading}
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    if reading is not None and reading.done():
                        r, reading = reading, None
                        try:
                            nxt = r.result()
                        except (StopAsyncIteration, Exception) as e:  # noqa: BLE001 - met in its turn
                            read_end = e
                        else:
                            size = nxt.ByteSize()  # computed once: taken off again when its turn comes
                            ahead.append((nxt, size))
                            ahead_bytes += size
                            for ack in self._contact_acks(nxt):
                                inbound[me] = False
                                yield ack
                                inbound[me] = True
                    if value.done():
                        done, value = True, value.result()
                replies = value
                rel = self._pending_releases(f.primary)
                for r in replies:
                    if rel:
                        r.releases.extend(rel)
                    inbound[me] = False
                    yield r
                    inbound[me] = True
                if self._apply_after_ack:
                    # the acknowledgements are out (a yield resumes once gRPC has sent
                    # it): now apply what the frame committed
                    async with self.lock:
                        self._apply_deferred()
        except asyncio.CancelledError:
            if not self.closing:
                raise
            # ended by end_inbound (this node is stopping): the stream ends as OK, at
            # once, rather than held until the server's stop gives up on it
            me.uncancel()
        finally:
            inbound.pop(me, None)
            if reading is not None:
                reading.cancel()
            # the primary's end of the stream is gone: it may have died (unless this
            # node ended it, stopping: a node that is leaving does not campaign)
            if sender is not None and sender == self.core.primary and not self.stopped and not self.closing:
                async with self.lock:
                    await self._run(self.core.primary_stream_broken(mono_us()))

    def _contact_acks(self, f) -> list:
        """A frame that waits behind one being handled: its arrival is contact, if
        the core can note it now (the primary we follow, our epoch, nothing of
        ours on its way to disk that an acknowledgement would depend on, and
        nothing in memory that a failed write left unsaved)."""
        if not f.contact_acks or self._persisting or self._unsaved or self.stopped or self.engine.failed is not None:
            return []
        out = self.core.heard(R.AppendReq(f.epoch, f.primary, f.prev_lsn, f.prev_epoch, f.prev_crc, [],
                                          f.commit_lsn, f.sent_us, f.primary_commit_lsn, f.lease_us), mono_us())
        return [pb.AppendAck(epoch=m.epoch, sender=m.sender, ok=m.ok, match_lsn=m.match_lsn, sent_us=m.sent_us,
                             contact=True, disk_low=m.disk_low, log_format=ACK_LOG_FORMAT)
                for m in (e.msg for e in out)]

    def _pending_releases(self, primary: str) -> list:
        """Lost-answer releases this node's forwarder is still trying to deliver to
        ``primary``: they ride along on the acks of the primary's own stream, each at
        most every RELEASE_RESEND_S and at most RELEASES_PER_ACK on one ack."""
        pending = self.engine.pending_releases
        if not pending:
            return []
        a, now, out = self.addresses.get(primary), time.monotonic(), []
        for (addr, q, rid), entry in pending.items():
            if addr == a and now - entry[1] >= RELEASE_RESEND_S:
                entry[1] = now
                out.append(pb.PendingRelease(queue=q, receive_id=rid, authorization=entry[0]))
                if len(out) >= RELEASES_PER_ACK:
                    break
        return out

    async def _handle_frame(self, f) -> list:
        async with self.lock:
            for e in f.entries:
                self._frame_bytes[e.lsn] = e.rec
            self._replies = []
            try:
                await self._run(self.core.receive(R.AppendReq(
                    f.epoch, f.primary, f.prev_lsn, f.prev_epoch, f.prev_crc,
                    [(e.lsn, e.epoch, e.crc, len(e.rec)) for e in f.entries], f.commit_lsn, f.sent_us,
                    f.primary_commit_lsn, f.lease_us), mono_us()))
                return self._replies
            except R.CommittedConflict as err:
                # (before the check, the node resynced and sat behind its primary for good,
                # answering nothing: a stop says it where an operator looks)
                log.critical("the primary's log conflicts with records this node holds as committed: %s. This "
                             "node's store is not this cluster's, or a committed write was lost here; it stops. "
                             "Replace it: start it on an empty store with --join (operations.md)", err)
                if self.engine.failed is None:
                    self.engine._fail(err, LOG_CONFLICT)
                return []
            except Exception as err:
                # The store's failures stop the node where they happen (_store), and a
                # conflict with committed records is the case above: what is left is a
                # broken invariant (a gap, a checksum, a truncation below applied
                # records). The node stops. (It reloaded its view of the log from the
                # store and went on: a truncation below what it had applied was clamped
                # over, and it could count toward a quorum for records it no longer held.)
                self._broken(err, f"a frame from {f.primary}")
                return []
            finally:
                self._replies = None
                self._frame_bytes.clear()

    def _broken(self, err: BaseException, what: str) -> None:
        """A broken invariant met while handling ``what``: the node stops
        (INTERNAL_FAILURE: a bug, not the disk), unless it is stopping already."""
        if self.engine.failed is None:
            log.critical("%s broke an invariant of this node: %r", what, err, exc_info=err)
            self.engine._fail(err, INTERNAL_FAILURE)

    async def _resync(self) -> None:
        """Make the core's and the engine's view of the log what the store holds."""
        e = self.engine
        self._unsaved = True  # (the core is reloaded in the writer thread meanwhile)
        await e.store_io(self.load)
        pos = await e.store_io(e.store.last_position)
        self.core.durable_lsn = self.core.log.last_lsn
        e.truncated(max(pos.lsn, e.core.lsn), pos.crc if pos.lsn >= e.core.lsn else e.applied_crc)
        self._unsaved = False

    async def serve_vote(self, req, context):
        if not self.is_member(req.candidate):
            await self._refuse(context, req.candidate)
        self.heard_from[req.candidate] = mono_us()
        if req.lease_us and req.lease_us != self.core.lease_us and req.candidate not in self._timeout_warned:
            # leases stay safe (every wait uses the lease a frame or vote states, or the
            # longest one a restarted node had answered), but a node with a much
            # shorter timeout than its primary's campaigns between its heartbeats
            self._timeout_warned.add(req.candidate)
            log.warning("%s runs with --failover-timeout %.3f s, this node with %.3f s: keep them equal outside a "
                        "rolling change of the setting (docs/operations.md)", req.candidate,
                        2 * req.lease_us / 1e6, self.core.timeout / 1e6)
        # shielded: a cancellation (the candidate's deadline) does not cut the vote's
        # Persist short: the step runs to its end in a task of its own (its answer
        # unread), so the core is never left marked ahead of its disk
        r = await shielded(self._vote(req))
        if r is None:  # ignored (leader stickiness), or failed: answer as a refusal
            return pb.VoteResponse(epoch=self.core.epoch, sender=self.id, granted=False, pre=req.pre,
                                   since_contact_us=0, since_vote_us=0)
        return pb.VoteResponse(epoch=r.epoch, sender=r.sender, granted=r.granted, pre=r.pre,
                               since_contact_us=r.since_contact_us, since_vote_us=r.since_vote_us,
                               lease_us=r.lease_us, vote_lease_us=r.vote_lease_us, voter_epoch=r.voter_epoch)

    async def serve_timeout_now(self, req, context):
        if not self.is_member(req.primary):
            await self._refuse(context, req.primary)
        self.heard_from[req.primary] = mono_us()
        why = await shielded(self._timeout_now_received(req))  # shielded: as a vote's
        if why:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"node {self.id!r} {why}")
        return pb.ReplEmpty()

    async def _vote(self, req):
        """A vote request through the core, under the lock: the core's answer, or None."""
        async with self.lock:
            self._vote_reply = None
            try:
                await self._run(self.core.receive(R.VoteReq(req.epoch, req.candidate, req.last_epoch, req.last_lsn,
                                                            req.pre, req.transfer, req.lease_us), mono_us()))
            except Exception as err:
                # a Persist that failed (the node stops: _store) left the core ahead of
                # the disk (its epoch, vote, lease_seen): load them back and refuse.
                # Anything else is a broken invariant: the node stops as well.
                self._broken(err, f"a vote request from {req.candidate}")
                log.exception("vote request from %s failed; reloading the persistent state", req.candidate)
                self._vote_reply = None
                await self._resync()
            r, self._vote_reply = self._vote_reply, None
        return r

    async def _timeout_now_received(self, req) -> str:
        """A TimeoutNow through the core, under the lock. -> why it was refused ("":
        taken): this node is stopping, or its disk is below its reserve (as the
        primary it would refuse every send: disk_low)."""
        async with self.lock:
            # a node that is stopping does not take over (it would be gone at once):
            # it says so, and the primary serves again or tries another member
            # (Replication.transfer_declined). Decided under the lock: either
            # the core sees the TimeoutNow, or the refusal is sent; never both.
            # (only while it would act: a replica of that epoch or an older one; once
            # it has acted on a TimeoutNow, its epoch is past the request's)
            c = self.core
            if c.role == R.REPLICA and c.epoch <= req.epoch:
                if self.engine.draining:
                    return "is stopping"
                if self.engine.disk_low():
                    return (f"has less than {self.engine.limits.disk_free_bytes_min} bytes free on its disk: as "
                            "the primary it would refuse every send")
            try:
                await self._run(self.core.receive(R.TimeoutNow(req.epoch, req.primary), mono_us()))
            except Exception as err:
                # its Persist failed (the campaign's epoch and vote): as a failed vote request
                # (the primary sees the call fail, not a refusal: Replication.timeout_now_failed)
                self._broken(err, f"a TimeoutNow from {req.primary}")
                log.exception("TimeoutNow from %s failed; reloading the persistent state", req.primary)
                await self._resync()
                self.core.campaign_unsaved(req.epoch, req.primary, mono_us())
                raise
            return ""


def _remove_copy(path: str) -> None:
    """A snapshot copy's file with its WAL and shared-memory files, whichever of
    them are left (after an install, the rename took the file itself)."""
    for p in (path, path + "-wal", path + "-shm"):
        if os.path.exists(p):
            os.remove(p)


async def snapshot_chunks(path: str, epoch: int, primary: str, last_delay_s: float = 0.0,
                          chunk_bytes: int = 1 << 20):
    """The copy at ``path`` as InstallSnapshot's chunks; the last one carries the
    SHA-256 of all of them (checked by serve_snapshot). ``last_delay_s``: a
    pause before the last chunk (SPOOLER_TEST_SNAPSHOT_DELAY)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk_bytes)
            digest.update(data)
            last = len(data) < chunk_bytes
            if last and last_delay_s:
                await asyncio.sleep(last_delay_s)
            yield pb.SnapshotChunk(epoch=epoch, primary=primary, data=data, last=last,
                                   sha256=digest.digest() if last else b"")
            if last:
                return


async def shielded(coro):
    """``await coro``, shielded from the caller's cancellation like
    ``asyncio.shield``, but with no task unless ``coro`` really waits.

    A replica's frame is usually handled without ever waiting (the lock is free
    and the commit runs inline), and asyncio.shield would still wrap it in a task:
    a turn of the loop to start it and another to hand its result back, on the
    path of every acknowledgement. So ``coro`` is run here up to its first wait;
    if it finishes, nothing could have cancelled it. If it waits, the rest runs in
    a task as before (Python 3.12's eager tasks do the same).

    The first step runs in the caller's task and context: a timeout
    (asyncio.timeout, wait_for) or a context variable set before the first wait
    would belong to the caller, not to the task that finishes. The frame's path
    uses neither (it waits only on the lock and the store's thread); keep it so."""
    done, value = start_shielded(coro)
    return value if done else await asyncio.shield(value)


def start_shielded(coro) -> tuple:
    """Run ``coro`` up to its first wait (see shielded): (True, its result) if it
    finished there, else (False, the task that runs the rest, which the caller's
    cancellation does not reach)."""
    try:
        first = coro.send(None)
    except StopIteration as done:
        return True, done.value
    # its outcome is read here too: once the caller was cancelled nobody else reads
    # it (what failed is logged where it failed)
    return False, nobody_waits(asyncio.ensure_future(_resume(coro, first)))


@types.coroutine
def _resume(coro, waiting_on):
    """Go on with ``coro``, which has already run up to awaiting ``waiting_on``."""
    while True:
        try:
            yield waiting_on  # the task waits for it, then resumes us (asyncio sends None)
        except BaseException as e:  # noqa: BLE001 - thrown in by the task: pass it on
            try:
                waiting_on = coro.throw(e)
            except StopIteration as done:
                return done.value
        else:
            try:
                waiting_on = coro.send(None)
            except StopIteration as done:
                return done.value


def warn_once_a_minute(logger, what: tuple, msg: str, *args) -> None:
    """A refusal between members (a key mismatch, a node the others do not
    count as a member), logged at most once a minute for each ``what``: a
    refused node retries every few milliseconds."""
    logs.throttled(logger, logging.WARNING, ("replication",) + tuple(what), msg, *args)


class ReplicationServicer(pb_grpc.ReplicationServicer):
    """The peers' RPCs. The gRPC server starts before the node has loaded its
    store (node/main.py), and until the replication core holds this node's
    epoch, vote and log (``Replication.started``) every call is refused
    ``UNAVAILABLE`` without reaching it: a vote answered from the core's blank
    defaults would forget the vote already cast in that epoch, or grant one to a
    candidate missing committed records, and write that over the stored vote."""

    def __init__(self, driver: Driver):
        self.d = driver

    async def _loaded(self, context) -> None:
        from node.tls import CLUSTER_KEY_MD, from_a_member
        key = getattr(self.d.engine, "cluster_key", "")
        if key and not from_a_member(context.invocation_metadata(), key):
            # (before anything else: an outsider learns nothing, not even whether we are loaded)
            peer = context.peer() or ""
            warn_once_a_minute(log, ("refused", peer.rpartition(":")[0]), "refused a replication call from %s "
                          "without this cluster's key (--cluster-key): a member given another key or none, or "
                          "not a member", peer)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "replication calls need this cluster's key (--cluster-key)")
        if not key and any(k == CLUSTER_KEY_MD for k, _ in context.invocation_metadata() or ()):
            # the others hold a key and this node none: it takes part, and anyone who
            # reaches its gRPC port can act as a member through it
            peer = context.peer() or ""
            warn_once_a_minute(log, ("unkeyed",), "a member (%s) sends a cluster key and this node has none: give "
                          "it the cluster's key (--cluster-key), or the cluster is open through this node", peer)
        if not self.d.core.started:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"node {self.d.id!r} is still loading its store")
        # (after loading: the id is the applied log's)
        mine = self.d.engine.core.cluster_id
        theirs = another_cluster(context.invocation_metadata(), mine)
        if theirs is not None:
            peer = context.peer() or ""
            warn_once_a_minute(log, ("another cluster", peer.rpartition(":")[0]), "refused a replication call "
                               "from %s, a node of %s %s: this node's cluster is %s", peer, ANOTHER_CLUSTER,
                               theirs, mine)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"node {self.d.id!r} is of cluster {mine}, not of {ANOTHER_CLUSTER} {theirs}")

    async def Stream(self, request_iterator, context):
        await self._loaded(context)
        async for ack in self.d.serve_stream(request_iterator, context):
            yield ack

    async def Vote(self, request, context):
        await self._loaded(context)
        return await self.d.serve_vote(request, context)

    async def TimeoutNow(self, request, context):
        await self._loaded(context)
        return await self.d.serve_timeout_now(request, context)

    async def InstallSnapshot(self, request_iterator, context):
        await self._loaded(context)
        return await self.d.serve_snapshot(request_iterator, context)
