"""Replication RPCs that must not reach the replication core: before the node
has loaded its epoch, vote and log, and (a snapshot) while a replacement is in
its quiet first stretch; and a primary past its failover timeout does not count
an install's acknowledgement."""
import asyncio

import grpc
import pytest

from node.core import replication as R
from node.engine import Engine, mono_us
from node.replication.driver import ReplicationServicer
from node.store.sqlite import chain
from spooler.pb import log_pb2, replication_pb2 as pb

PEERS = {"n1": "127.0.0.1:1", "n2": "127.0.0.1:2", "n3": "127.0.0.1:3"}


class Aborted(Exception):
    pass


class Ctx:
    """What a handler sees of gRPC's context: abort raises, as gRPC's does."""

    def __init__(self):
        self.code = None

    async def abort(self, code, details="", trailing_metadata=()):
        self.code = code
        raise Aborted(details)

    def invocation_metadata(self):
        return ()

    def peer(self):
        return "ipv4:127.0.0.1:1"


def _voted(tmp_path, **kw) -> Engine:
    """n3's store: epoch 7, its vote cast for n1, a record of epoch 7."""
    e = Engine(str(tmp_path), node_id="n3", peers=PEERS, **kw)
    with e.store.db:
        e.store.set_meta("repl_epoch", 7)
        e.store.set_meta("voted_for", "n1")
    data = log_pb2.Record(epoch=7, lsn=1, epoch_begin=log_pb2.EpochBegin(node_id="n1")).SerializeToString()
    e.store.append([(1, 7, chain(0, data), data)])
    return e


def _loaded(e: Engine):
    """``e``'s replication driver with the store's epoch, vote and log loaded and
    its core started: what serving a peer's call needs."""
    d = e.repl
    d.load()
    d.core.start(mono_us())
    return d


async def _frames():
    yield pb.AppendFrame(epoch=9, primary="n2")


async def _chunks():
    yield pb.SnapshotChunk(epoch=9, primary="n2", data=b"", last=True)


CALLS = {
    "Vote": lambda s, ctx: s.Vote(pb.VoteRequest(epoch=7, candidate="n2", last_epoch=0, last_lsn=0), ctx),
    "TimeoutNow": lambda s, ctx: s.TimeoutNow(pb.TimeoutNowRequest(epoch=9, primary="n2"), ctx),
    "InstallSnapshot": lambda s, ctx: s.InstallSnapshot(_chunks(), ctx),
    "Stream": lambda s, ctx: s.Stream(_frames(), ctx).__anext__(),
}


@pytest.mark.parametrize("rpc", sorted(CALLS))
def test_a_node_still_loading_its_store_refuses_every_replication_call(tmp_path, rpc):
    e = _voted(tmp_path)
    s, ctx = ReplicationServicer(e.repl), Ctx()
    with pytest.raises(Aborted):
        asyncio.run(CALLS[rpc](s, ctx))
    assert ctx.code == grpc.StatusCode.UNAVAILABLE
    assert e.store.get_meta("voted_for") == "n1" and int(e.store.get_meta("repl_epoch")) == 7  # untouched
    assert e.store.last_position().lsn == 1
    e.store.close()


def test_once_loaded_the_same_vote_is_refused_for_what_the_store_says(tmp_path):
    """The control: after the load, the core itself refuses that vote (it voted
    for n1 in epoch 7 already, and the candidate's log is behind)."""
    e = _voted(tmp_path)

    async def main():
        e.repl.load()
        e.repl.core.start(mono_us())
        return await ReplicationServicer(e.repl).Vote(
            pb.VoteRequest(epoch=7, candidate="n2", last_epoch=0, last_lsn=0), Ctx())

    r = asyncio.run(main())
    assert not r.granted
    assert e.store.get_meta("voted_for") == "n1"
    e.store.close()


def test_a_restart_reads_its_vote_back_and_votes_for_no_one_else_in_that_epoch(tmp_path):
    """R2: the vote on disk is the vote after a restart. n3 voted for n1 in epoch 7;
    loaded again, it refuses n2 in epoch 7 although n2's log is as long as its own
    (in the control above n2's log is behind, which refuses it whatever the vote),
    and its stored vote stays n1; n1 itself is granted that vote again."""
    e = _voted(tmp_path)
    d = _loaded(e)

    async def vote(candidate):
        return await ReplicationServicer(d).Vote(
            pb.VoteRequest(epoch=7, candidate=candidate, last_epoch=7, last_lsn=1), Ctx())

    r = asyncio.run(vote("n2"))
    assert not r.granted, "a second vote in epoch 7: the stored vote was not read back"
    assert d.core.voted_for == "n1" and e.store.get_meta("voted_for") == "n1"
    assert asyncio.run(vote("n1")).granted   # the control: refused for the vote, not for the log
    assert e.store.get_meta("voted_for") == "n1" and int(e.store.get_meta("repl_epoch")) == 7
    e.store.close()


def test_a_restart_stands_in_with_the_longest_lease_on_disk_not_its_own_timeout(tmp_path):
    """R2 (DESIGN, "Serving and leasing"): the longest lease this node acknowledged
    (``lease_seen_us``, written by test_cluster.py::test_replicas_persist_the_longest_
    lease_they_acknowledged) is read back at start: the restart counts as a contact
    and a vote that may be leased on for that long, here longer than this node's own
    failover timeout (a primary with a longer one), not for its own timeout."""
    e = _voted(tmp_path)
    own = e.repl.core.timeout
    with e.store.db:
        e.store.set_meta("lease_seen_us", 3 * own)
    d = _loaded(e)
    assert d.core.lease_seen == 3 * own
    assert d.core.contact_lease == 3 * own and d.core.votes_granted[""][1] == 3 * own
    e.store.close()


def test_a_replacement_that_hears_a_vote_before_it_loads_still_joins(tmp_path):
    e = Engine(str(tmp_path), node_id="n3", peers=PEERS, join=True)
    with pytest.raises(Aborted):
        asyncio.run(ReplicationServicer(e.repl).Vote(
            pb.VoteRequest(epoch=3, candidate="n2", last_epoch=0, last_lsn=0), Ctx()))
    e.repl.load()
    assert e.repl.core.joining and e.repl.core.epoch == 0
    e.store.close()


def test_a_replacement_installs_no_snapshot_in_its_quiet_first_stretch(tmp_path):
    e = Engine(str(tmp_path), node_id="n3", peers=PEERS, join=True)

    async def main():
        e.repl.load()
        e.repl.core.start(mono_us())
        assert e.repl.core.joining and e.repl.core.join_quiet(mono_us())
        # (the copy's path is never opened: refused before the install begins)
        return await e.repl._install_locked(str(tmp_path / "no-such-copy.db"), 9, "n2")

    ack = asyncio.run(main())
    assert not ack.ok
    assert e.store.last_position().lsn == 0
    e.store.close()


def _primary(acked_us: int) -> R.Replication:
    c = R.Replication("n1", ["n1", "n2", "n3"], 2_000_000, rand=lambda: 0.5)
    c.started = True
    c.role, c.epoch, c.primary = R.PRIMARY, 2, "n1"
    c.log = R.LogView(0, 0, 0, [(2, 11), (2, 12), (2, 13)])
    c.durable_lsn = 3
    c.acked_sent = {"n2": acked_us, "n3": acked_us}
    return c


def test_a_primary_past_its_failover_timeout_counts_no_install():
    now = 10_000_000_000
    stale = _primary(now - 3_000_000)  # no majority heard for 3 s, with a 2 s timeout
    out = stale.snapshot_sent("n2", 3, now)
    assert not [x for x in out if isinstance(x, R.Commit)] and stale.commit_lsn == 0
    assert stale.role == R.REPLICA
    live = _primary(now - 100_000)  # the control: heard 0.1 s ago, the install commits
    assert [x.lsn for x in live.snapshot_sent("n2", 3, now) if isinstance(x, R.Commit)] == [3]


class _BareEngine:
    """The little of an Engine that a replication Driver touches while it serves
    frames; a test's subclass supplies store_io (its disk)."""
    release_hook = None
    metrics = None
    failed = None  # (Engine._fail: the store failed)

    def __init__(self):
        self.pending_releases: dict = {}
        self.fatal: list = []

    def _fail(self, e, what="storage failure"):  # as Engine._fail: the node is told to stop (here, noted)
        self.failed = e
        self.fatal.append(e)
        self.fatal_what = what

    def apply_upto(self, lsn):
        pass


def _following_n1(eng, T: int, lease_seen: int):
    """n2's Driver over ``eng``, a replica of n1 in epoch 1 (heard at half a
    timeout's lease), its disk's lease_seen ``lease_seen``."""
    from node.replication.driver import Driver
    d = Driver(eng, "n2", {"n1": "a", "n2": "b", "n3": "c"}, T / 1e6)
    c = d.core
    c.epoch, c.lease_seen = 1, lease_seen
    now = mono_us()
    c.start(now)
    c.receive(R.AppendReq(1, "n1", 0, 0, 0, [], 0, now, 0, T // 2), now)
    return d


def test_a_failed_persist_stops_the_node_and_promises_no_lease():
    """R7, R2 and S9. A frame raises the replica's lease_seen (its primary now states
    a longer lease), and persisting that fails (a write or an fsync error of the
    store). The node is told to stop (Engine._fail), as for any failed write of its
    store: it does not reload and go on writing into a store whose fsync failed (it
    did: _resync, then the next frames). A frame read while that write was on its
    way gets no contact acknowledgement (it would promise a lease that a restart
    from that disk does not wait out), and no frame is handled after the failure."""
    T = 1_000_000

    class Eng(_BareEngine):
        async def store_io(self, fn, *a, inline=False):
            if getattr(fn, "__name__", "") == "_persist":
                await asyncio.sleep(0.05)
                raise OSError("injected fsync failure")
            return fn(*a)

    async def main():
        eng = Eng()
        d = _following_n1(eng, T, T // 2)
        resyncs = []

        async def resync():
            resyncs.append(True)
        d._resync = resync

        async def frames():
            yield pb.AppendFrame(epoch=1, primary="n1", sent_us=mono_us(), lease_us=T, contact_acks=True)
            # read while the first frame's persist is on its way (and then fails)
            yield pb.AppendFrame(epoch=1, primary="n1", sent_us=mono_us(), lease_us=T, contact_acks=True)
            yield pb.AppendFrame(epoch=1, primary="n1", sent_us=mono_us(), lease_us=T, contact_acks=True)

        acks = [a async for a in d.serve_stream(frames(), None)]
        return eng, acks, resyncs

    eng, acks, resyncs = asyncio.run(main())
    assert len(eng.fatal) == 1 and isinstance(eng.fatal[0], OSError), eng.fatal  # told to stop, once
    assert resyncs == [], "reloaded the store and went on after a failed write"
    assert acks == [], acks  # nothing acknowledged: no contact, no frame after the failure


def test_no_contact_acknowledgement_while_a_persist_is_on_its_way_to_disk():
    """R7 and R2. A frame raises the replica's lease_seen (its primary now states
    a longer lease), and persisting that is slow but succeeds. A frame read while
    that write is on its way must get no contact acknowledgement
    (Driver._persisting): until the write lands, a restart from the disk would
    not wait out the lease the acknowledgement promises. Once it has landed, the
    same frame is acknowledged (the control)."""
    T = 1_000_000
    disk = {"lease_seen": T // 2}

    class Eng(_BareEngine):
        def __init__(self):
            super().__init__()
            self.writing = asyncio.Event()

        async def store_io(self, fn, *a, inline=False):
            if getattr(fn, "__name__", "") == "_persist":
                self.writing.set()
                await asyncio.sleep(1.0)  # a slow disk: the write lands, late
                disk["lease_seen"] = d.core.lease_seen
                return None
            return fn(*a)

    async def main():
        nonlocal d
        eng = Eng()
        d = _following_n1(eng, T, disk["lease_seen"])
        c = d.core
        seen = []

        async def frames():
            yield pb.AppendFrame(epoch=1, primary="n1", sent_us=mono_us(), lease_us=T, contact_acks=True)
            await asyncio.wait_for(eng.writing.wait(), 10)  # arrives while the first one's write is on its way
            seen.append((c.lease_seen, disk["lease_seen"]))
            yield pb.AppendFrame(epoch=1, primary="n1", sent_us=mono_us(), lease_us=T, contact_acks=True)

        during = [a async for a in d.serve_stream(frames(), None)]

        # the control: the write has landed; a frame waiting behind a busy one
        return during, seen, await _behind_a_busy_frame(d, T, asks=True, busy_s=1.0)

    d = None
    during, seen, after = asyncio.run(main())
    assert seen == [(T, T // 2)], seen  # the scenario: memory ahead of the disk, the write on its way
    assert [a for a in during if a.contact] == [], "a contact acknowledgement promised a lease not yet saved"
    assert [a for a in after if a.contact], "the control: with nothing on its way to disk, contact is acknowledged"


def _loaded_as_primary(e, heard: tuple):
    """Engine ``e``'s replication, loaded and started, made primary of epoch 1 with
    ``heard`` acknowledging it just now. -> its core."""
    e.repl.load()
    c = e.repl.core
    c.start(mono_us())
    now = mono_us()
    c.role, c.epoch, c.primary = R.PRIMARY, 1, "n1"
    e.role = "primary"
    c.acked_sent = {n: now for n in heard}
    return c


async def _behind_a_busy_frame(d, lease_us: int, asks: bool, busy_s: float) -> list:
    """Two frames on one stream to driver ``d``, the second read while the first is
    being handled (for ``busy_s``); ``asks``: their ``contact_acks``. -> every answer."""
    busy = asyncio.Event()

    async def frames():
        yield pb.AppendFrame(epoch=1, primary="n1", sent_us=mono_us(), lease_us=lease_us, contact_acks=asks)
        await asyncio.wait_for(busy.wait(), 10)   # read while the first one is being handled
        yield pb.AppendFrame(epoch=1, primary="n1", sent_us=mono_us(), lease_us=lease_us, contact_acks=asks)
    real = d._handle_frame

    async def slow_handle(f):
        busy.set()
        await asyncio.sleep(busy_s)
        return await real(f)
    d._handle_frame = slow_handle
    return [a async for a in d.serve_stream(frames(), None)]


@pytest.mark.parametrize("asks", [True, False])
def test_only_a_frame_that_asks_for_it_gets_a_contact_acknowledgement(asks):
    """R7: a frame that waits behind a busy one is answered at once with a contact
    acknowledgement only if it asks for one (``AppendFrame.contact_acks``, sent
    from 0.4.11 on); a primary that does not ask gets only the frame's own
    acknowledgement, in its turn. (True is the control.)"""
    T = 1_000_000

    class Eng(_BareEngine):
        async def store_io(self, fn, *a, inline=False):
            return fn(*a)

    async def main():
        return await _behind_a_busy_frame(_following_n1(Eng(), T, T), T, asks=asks, busy_s=0.3)

    acks = asyncio.run(main())
    assert len([a for a in acks if not a.contact]) == 2   # each frame's own, in its turn
    assert len([a for a in acks if a.contact]) == (1 if asks else 0), acks


def test_a_switchover_under_way_stamps_no_more_records(tmp_path):
    """A record that waits for the group commit once a switchover's TimeoutNow is
    out is not stamped: the target was told to take over when it held every stamped
    record, and one stamped after that would have the voters that hold it refuse
    the target. It waits; once this node has stepped down it fails ``unavailable``
    (never stamped, so known not stored). A stop that gives up waiting for the
    target fails what waits at once (drop_pending)."""
    from spooler import errors

    e = Engine(str(tmp_path), node_id="n1", peers=PEERS)

    async def main():
        e.repl.load()
        c = e.repl.core
        c.start(mono_us())
        c.role, c.epoch, c.primary, c.transfer_to, c.transfer_sent = R.PRIMARY, 1, "n1", "n2", True
        e.role = "primary"
        fut = asyncio.get_running_loop().create_future()
        e._pending.append((log_pb2.Record(epoch_begin=log_pb2.EpochBegin(node_id="n1")), fut))
        e._wake = asyncio.Event()  # (Engine.start makes it)
        e._wake.set()
        loop_task = asyncio.create_task(e._commit_loop())
        try:
            for _ in range(20):  # 0.2 s of a commit loop that is free to run
                await asyncio.sleep(0.01)
            assert e.appended_lsn == 0 and len(e._pending) == 1 and not fut.done()
            e.role = "replica"  # the target took over; this node stepped down
            for _ in range(100):
                if fut.done():
                    break
                await asyncio.sleep(0.01)
            assert isinstance(fut.exception(), errors.Unavailable) and e.appended_lsn == 0
            fut2 = asyncio.get_running_loop().create_future()
            e._pending.append((log_pb2.Record(epoch_begin=log_pb2.EpochBegin(node_id="n1")), fut2))
            e.drop_pending("stopping")
            assert isinstance(fut2.exception(), errors.Unavailable) and not e._pending
        finally:
            loop_task.cancel()

    asyncio.run(main())
    assert e.store.last_position().lsn == 0
    e.store.close()


def test_a_stop_whose_timeout_now_is_out_fails_what_waits_for_the_group_commit(tmp_path, monkeypatch):
    """R5: a stopping primary whose target was sent TimeoutNow but has not taken
    over when the handover's bound is up (Driver.hand_over) goes on with its stop,
    and fails what still waits for the group commit ``unavailable`` at once (never
    stamped, so known not stored: a client retries it on the new primary) rather
    than leave it to the stop."""
    from spooler import errors

    e = Engine(str(tmp_path), node_id="n1", peers=PEERS)

    async def told_but_silent(target, wait_s, give_up_if_lost=False):
        c = e.repl.core   # TimeoutNow went out; the target has not taken over within the bound
        c.transfer_to, c.transfer_started, c.transfer_sent = target, mono_us(), True

    async def main():
        c = _loaded_as_primary(e, heard=("n2", "n3"))   # both heard just now: a target to hand over to
        monkeypatch.setattr(e.repl, "switch_over", told_but_silent)
        fut = asyncio.get_running_loop().create_future()
        e._pending.append((log_pb2.Record(epoch_begin=log_pb2.EpochBegin(node_id="n1")), fut))
        return await e.repl.hand_over(), fut, c

    got, fut, c = asyncio.run(main())
    assert got is None and c.transfer_sent
    assert fut.done() and isinstance(fut.exception(), errors.Unavailable), "a queued write left waiting"
    assert not e._pending and e.store.last_position().lsn == 0
    e.store.close()


def test_a_stop_during_a_switchover_under_way_waits_for_it(tmp_path, monkeypatch):
    """A primary stopping while a switchover is under way already (its disk is
    low: Replication.disk; or a promote) waits for that one as for its own, within
    the stop's bound (Driver.hand_over), rather than stop without a handover
    (handover_target names no one while one is under way) or start another: it
    returns the target once it has taken over; given up at the bound (TimeoutNow
    not out yet), this node serves again. And a member that a handover for disk
    found refusing lately is passed over by the stop too."""
    e = Engine(str(tmp_path), node_id="n1", peers=PEERS)

    async def main():
        c = _loaded_as_primary(e, heard=("n2", "n3"))
        c.transfer("n3", mono_us())
        c.transfer_for_disk = True

        async def n3_takes_over():
            await asyncio.sleep(0.05)
            c._become_replica(c.epoch + 1, "n3", mono_us(), [])
        t = asyncio.create_task(n3_takes_over())
        got = await e.repl.hand_over()
        await t
        return got

    assert asyncio.run(main()) == "n3"
    e.store.close()

    e = Engine(str(tmp_path / "silent"), node_id="n1", peers=PEERS)

    async def silent():
        c = _loaded_as_primary(e, heard=("n2", "n3"))
        c.transfer("n3", mono_us())   # n3 never answers: TimeoutNow never goes out
        c.transfer_for_disk = True
        return await e.repl.hand_over(), c

    got, c = asyncio.run(silent())
    assert got is None and c.role == R.PRIMARY and c.transfer_to is None   # given up: it serves again
    e.store.close()

    e = Engine(str(tmp_path / "passed"), node_id="n1", peers=PEERS)
    tried = []

    async def switch_over(target, wait_s, give_up_if_lost=False):
        tried.append(target)

    async def passed_over():
        c = _loaded_as_primary(e, heard=("n2", "n3"))
        c.disk_handover_failed["n2"] = mono_us()   # n2 refused a handover for disk just now
        monkeypatch.setattr(e.repl, "switch_over", switch_over)
        await e.repl.hand_over()

    asyncio.run(passed_over())
    assert tried == ["n3"]
    e.store.close()


def test_a_stopping_node_refuses_to_take_over_and_ends_its_inbound_streams(tmp_path):
    """A node that is stopping: TimeoutNow is refused (FAILED_PRECONDITION, the
    one answer the primary takes as "it did not act": Replication.transfer_declined)
    and never reaches the core; the control, the same call before the stop, makes
    it campaign. Once the stop has ended its inbound streams (end_inbound), a
    stream waiting for its primary's next frame ends at once, as OK, and without
    a campaign for the broken stream; a new stream is refused; the ticker no longer
    ticks the core (no heartbeat, no campaign)."""
    e = _voted(tmp_path)

    async def main():
        e.repl.load()
        c = e.repl.core
        c.start(mono_us())
        c.receive(R.AppendReq(7, "n1", 1, 7, 0, [], 0, mono_us(), 0, 0), mono_us())
        assert c.role == R.REPLICA and c.primary == "n1"
        s = ReplicationServicer(e.repl)
        e.draining = True
        ctx = Ctx()
        with pytest.raises(Aborted):
            await s.TimeoutNow(pb.TimeoutNowRequest(epoch=7, primary="n1"), ctx)
        assert ctx.code == grpc.StatusCode.FAILED_PRECONDITION
        assert c.role == R.REPLICA and c.epoch == 7        # no campaign
        e.draining = False
        e.repl._ask_vote = lambda peer, m: asyncio.sleep(0)  # (no peers to ask here)
        await s.TimeoutNow(pb.TimeoutNowRequest(epoch=7, primary="n1"), Ctx())
        assert c.role == R.CANDIDATE and c.epoch == 8      # the control: it campaigns
        e.draining = True
        await s.TimeoutNow(pb.TimeoutNowRequest(epoch=7, primary="n1"), Ctx())   # no refusal: it acted on one
        assert c.role == R.CANDIDATE and c.epoch == 8      # (and the core ignores the stale copy)
        e.draining = False
        # a stream from the primary of epoch 9, parked waiting for its next frame
        more = asyncio.Event()

        async def frames():
            yield pb.AppendFrame(epoch=9, primary="n2", prev_lsn=1, prev_epoch=7, prev_crc=c.log.at(1)[1],
                                 sent_us=mono_us(), lease_us=0)
            await more.wait()  # never set: the primary has nothing more to say
            yield pb.AppendFrame(epoch=9, primary="n2")

        broken = []
        e.repl.core.primary_stream_broken = lambda now: broken.append(now) or []
        acks = []

        async def serve():
            async for a in s.Stream(frames(), Ctx()):
                acks.append(a)

        t = asyncio.create_task(serve())
        for _ in range(200):
            if acks and e.repl._inbound:
                break
            await asyncio.sleep(0.005)
        assert acks and c.primary == "n2" and c.epoch == 9
        await asyncio.sleep(0.02)
        assert not t.done()                                # the control: it waits for the next frame
        ticks = []
        e.repl.core.tick = lambda now: ticks.append(now) or []
        e.repl.end_inbound()
        done, _ = await asyncio.wait({t}, timeout=1.0)    # (not wait_for: it would cancel t itself)
        assert t in done                                   # ended, and not by an exception
        assert t.exception() is None and not broken and not e.repl._inbound
        assert t.cancelling() == 0                         # the cancel it took is not left pending
        ctx = Ctx()
        with pytest.raises(Aborted):
            await s.Stream(frames(), ctx).__anext__()
        assert ctx.code == grpc.StatusCode.UNAVAILABLE
        ticker = asyncio.create_task(e.repl._ticker())
        await asyncio.sleep(0.1)
        ticker.cancel()
        assert ticks == []

    asyncio.run(main())
    e.store.close()


def test_a_primary_serves_again_only_when_its_target_refuses_timeout_now(tmp_path):
    """The primary's side of a refusal: FAILED_PRECONDITION (the target did not act)
    ends the switchover and this node serves again; any other failure (the call may
    have reached the target, which may be campaigning) leaves it under way."""
    e = Engine(str(tmp_path), node_id="n1", peers=PEERS)

    class Failed(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

        def details(self):
            return "node 'n2' is stopping"

    class Stub:
        def __init__(self, code):
            self.code = code

        async def TimeoutNow(self, req, timeout=None, metadata=()):
            raise Failed(self.code)

    async def main():
        e.repl.load()
        c = e.repl.core
        c.start(mono_us())
        seen = []
        for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                     grpc.StatusCode.FAILED_PRECONDITION):
            c.role, c.epoch, c.primary, c.transfer_to, c.transfer_sent = R.PRIMARY, 1, "n1", "n2", True
            e.repl._stubs["n2"] = Stub(code)
            c.timeout_now_failed_at = None
            await e.repl._timeout_now("n2", R.TimeoutNow(1, "n1"))
            seen.append((c.transfer_to, c.transfer_sent, e.repl.declined, c.timeout_now_failed_at is not None))
        return seen

    seen = asyncio.run(main())
    # (a failure other than the refusal: sent again once the target answers, Replication.timeout_now_failed)
    assert seen == [("n2", True, None, True), ("n2", True, None, True), (None, False, "n2", False)]
    e.store.close()


def test_a_primary_notes_an_acknowledgements_contact_when_it_reads_it_not_once_its_lock_is_free(tmp_path):
    """R7, the primary's side: an acknowledgement read from a replica's stream
    counts as that replica's contact (Replication.contact) at once, while the
    replication lock is still held elsewhere (this node's own fsync of a large
    commit, say), not only once the lock lets the rest of it through."""
    e = Engine(str(tmp_path), node_id="n1", peers=PEERS)

    class Call:
        """The stream's answers: one acknowledgement, then nothing more."""

        def __init__(self, ack):
            self.acks = [ack]

        def __aiter__(self):
            return self

        async def __anext__(self):
            if self.acks:
                return self.acks.pop(0)
            await asyncio.Event().wait()   # (until the test cancels the reader)

    class Stub:
        def __init__(self, ack):
            self.ack = ack

        def Stream(self, frames, metadata=()):
            return Call(self.ack)

    async def main():
        c = _loaded_as_primary(e, heard=("n3",))   # a majority heard just now: within its failover timeout
        sent = c.acked_sent["n3"] + 1
        e.repl._stubs["n2"] = Stub(pb.AppendAck(epoch=1, sender="n2", ok=True, match_lsn=0, sent_us=sent))
        loop = asyncio.get_running_loop()
        async with e.repl.lock:   # held, as by a commit under way, all the while
            reader = asyncio.create_task(e.repl._stream_to("n2", asyncio.Queue()))
            deadline = loop.time() + 2.0
            while c.acked_sent.get("n2") != sent and loop.time() < deadline:
                await asyncio.sleep(0.01)
            noted = c.acked_sent.get("n2")
            reader.cancel()
        try:
            await reader
        except asyncio.CancelledError:
            pass
        return noted, sent

    noted, sent = asyncio.run(main())
    assert noted == sent, "the acknowledgement's contact waited for the replication lock"
    e.store.close()


@pytest.mark.parametrize("rpc", ["Vote", "TimeoutNow"])
def test_a_vote_or_takeover_cancelled_at_its_deadline_still_lands_its_persist(tmp_path, rpc):
    """R2. gRPC cancels a handler at its caller's deadline. A Vote or TimeoutNow
    cancelled while its Persist (epoch, vote) is on its way to disk: the write goes
    on in the store's thread, and the handler's effects run to their end (shielded),
    so the core's memory is never marked ahead of its disk (``_unsaved``: no contact
    acknowledgement would ever be sent again until a frame failed) and what the
    core holds is what the store holds."""
    e = _voted(tmp_path)
    landed = []

    async def main():
        d = _loaded(e)
        c = d.core
        d._ask_vote = lambda peer, m: asyncio.sleep(0)   # (no peers to ask here)
        release = asyncio.Event()
        real_io = e.store_io

        async def slow_io(fn, *a, inline=False):
            if getattr(fn, "__name__", "") == "_persist":
                async def job():                             # a slow fsync in the store's thread,
                    await release.wait()                     # which a cancelled awaiter does not stop
                    out = await real_io(fn, *a)
                    landed.append(a)
                    return out
                return await asyncio.shield(asyncio.ensure_future(job()))
            return await real_io(fn, *a, inline=inline)
        e.store_io = slow_io
        s = ReplicationServicer(d)
        call = (s.Vote(pb.VoteRequest(epoch=8, candidate="n2", last_epoch=7, last_lsn=1), Ctx()) if rpc == "Vote"
                else s.TimeoutNow(pb.TimeoutNowRequest(epoch=7, primary="n1"), Ctx()))
        t = asyncio.ensure_future(call)
        for _ in range(400):
            if d._persisting:
                break
            await asyncio.sleep(0.005)
        assert d._persisting and c.epoch == 8              # the Persist is under way
        t.cancel()                                         # the caller's deadline
        asyncio.get_running_loop().call_later(0.05, release.set)   # the slow fsync ends
        done, _ = await asyncio.wait({t}, timeout=5.0)
        assert t in done and t.cancelled()
        for _ in range(400):
            if landed and not d._persisting:
                break
            await asyncio.sleep(0.005)
        assert landed and not d._persisting
        assert not d._unsaved, "a Persist that landed left the node refusing contact acknowledgements"
        return c.epoch, c.voted_for

    epoch, voted_for = asyncio.run(main())
    assert (epoch, voted_for) == (8, "n2" if rpc == "Vote" else "n3")
    assert e.store.get_meta("repl_epoch") == 8 and e.store.get_meta("voted_for") == voted_for
    e.store.close()


def test_a_takeover_whose_persist_fails_reloads_what_the_disk_holds(tmp_path):
    """R2. TimeoutNow makes the node campaign: epoch and vote to disk first. If that
    write fails, the call fails (the primary does not take it for a refusal) and the
    core is loaded back from the store, as after a failed vote request: it neither
    campaigns in an epoch its disk does not hold nor stays marked unsaved: it is
    the replica it was (Replication.campaign_unsaved)."""
    e = _voted(tmp_path)

    async def main():
        d = _loaded(e)
        c = d.core
        d._ask_vote = lambda peer, m: asyncio.sleep(0)
        real_io = e.store_io

        async def failing_io(fn, *a, inline=False):
            if getattr(fn, "__name__", "") == "_persist":
                raise OSError("injected fsync failure")
            return await real_io(fn, *a, inline=inline)
        e.store_io = failing_io
        with pytest.raises(OSError):
            await ReplicationServicer(d).TimeoutNow(pb.TimeoutNowRequest(epoch=7, primary="n1"), Ctx())
        return c.epoch, c.voted_for, d._unsaved, c.role, c.primary, c.votes, e.failed is not None

    # the replica it was, following n1 in epoch 7: not a candidate counting its own vote;
    # and, since 0.4.29, told to stop (S9: a failed write of its store)
    assert asyncio.run(main()) == (7, "n1", False, R.REPLICA, "n1", {}, True)
    e.store.close()


def test_a_stopping_node_ends_a_snapshot_still_arriving(tmp_path):
    """R5. A stop's end_inbound also ends a snapshot copy that is still arriving
    (the gRPC server's stop would otherwise wait for it: up to its grace period),
    as unfinished: nothing installed, its partial file removed; a new copy is
    refused. The control: before the stop, the same copy waits for its next chunk."""
    from node.replication.driver import SNAPSHOT_INCOMING
    e = _voted(tmp_path)

    async def main():
        d = _loaded(e)
        s = ReplicationServicer(d)
        more = asyncio.Event()

        async def chunks():
            yield pb.SnapshotChunk(epoch=9, primary="n2", data=b"x" * 4096)
            await more.wait()  # never set: the rest of the copy is slow to come
            yield pb.SnapshotChunk(epoch=9, primary="n2", data=b"", last=True)

        t = asyncio.ensure_future(s.InstallSnapshot(chunks(), Ctx()))
        incoming = lambda: [p for p in tmp_path.iterdir() if p.name.startswith(SNAPSHOT_INCOMING)]  # noqa: E731
        for _ in range(400):
            if d._inbound and incoming():
                break
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.02)
        assert not t.done() and incoming()                 # the control: it waits for the rest
        d.end_inbound()
        done, _ = await asyncio.wait({t}, timeout=1.0)
        assert t in done and t.exception() is None
        assert t.result().ok is False and not incoming() and not d._inbound
        assert t.cancelling() == 0
        ctx = Ctx()
        with pytest.raises(Aborted):
            await asyncio.wait_for(s.InstallSnapshot(chunks(), ctx), 1.0)
        assert ctx.code == grpc.StatusCode.UNAVAILABLE
        return d.core.epoch

    assert asyncio.run(main()) == 7                        # nothing of the copy was installed
    e.store.close()


def test_a_stopping_node_lets_an_install_under_way_finish(tmp_path):
    """R5. The other side of the test above: once a copy has come in whole and its
    install has begun, a stop's end_inbound does not cut it short (an install
    answered as failed would be one the store holds): it runs to its end and is
    answered as installed."""
    import threading
    e = _voted(tmp_path)

    async def main():
        d = _loaded(e)
        s = ReplicationServicer(d)
        started, go = threading.Event(), threading.Event()

        def slow_install(path):  # in the store's thread, as the real one
            started.set()
            go.wait(10)
        e.install_snapshot_sync = slow_install
        t = asyncio.ensure_future(s.InstallSnapshot(_chunks(), Ctx()))
        for _ in range(400):
            if started.is_set():
                break
            await asyncio.sleep(0.005)
        assert started.is_set()
        d.end_inbound()
        await asyncio.sleep(0.05)
        assert not t.done()                                # not cut short by the stop
        go.set()
        done, _ = await asyncio.wait({t}, timeout=5.0)
        assert t in done and t.result().ok is True

    asyncio.run(main())
    e.store.close()


def test_a_shielded_step_that_fails_after_its_caller_left_is_not_reported_unread():
    """A shielded step (a vote's, a TimeoutNow's) whose caller gave up (gRPC's
    deadline) and which fails later was logged a second time by asyncio, as "Task
    exception was never retrieved", with nobody left to read it. Its failure is
    logged where it happens; the task's outcome is read by `shielded` itself."""
    import gc
    from node.replication.driver import shielded

    async def main():
        seen = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: seen.append(ctx.get("message", "")))
        gate = asyncio.Event()

        async def step():
            await gate.wait()
            raise OSError("injected fsync failure")

        caller = asyncio.ensure_future(shielded(step()))
        await asyncio.sleep(0)
        caller.cancel()                                    # the caller's deadline
        done, _ = await asyncio.wait({caller}, timeout=1.0)
        assert caller in done and caller.cancelled()
        gate.set()                                         # the step fails after that
        for _ in range(5):
            await asyncio.sleep(0)
        gc.collect()
        return seen

    assert not [m for m in asyncio.run(main()) if "never retrieved" in m]


class _FrameEngine(_BareEngine):
    """A _BareEngine that takes a frame's records: every store call runs at once,
    inline (a test's subclass says what the store and the checks do)."""
    def small_commit(self, rows):
        return True

    async def store_io(self, fn, *a, inline=False):
        return fn(*a)


def _one_record_frame(eng, T: int) -> tuple:
    """n2's Driver over ``eng`` (a replica of n1) serves one frame carrying one
    record, its resyncs noted instead of run. -> (its answers, its resyncs)"""
    async def main():
        d = _following_n1(eng, T, T)
        resyncs = []

        async def resync():
            resyncs.append(True)
        d._resync = resync
        rec = log_pb2.Record(epoch_begin=log_pb2.EpochBegin(node_id="n1")).SerializeToString()

        async def frames():
            yield pb.AppendFrame(epoch=1, primary="n1", prev_lsn=0, prev_epoch=0, prev_crc=0,
                                 entries=[pb.Entry(lsn=1, epoch=1, crc=chain(0, rec), rec=rec)],
                                 commit_lsn=0, sent_us=mono_us(), lease_us=T)

        return [a async for a in d.serve_stream(frames(), None)], resyncs
    return asyncio.run(main())


def test_a_replica_whose_store_write_fails_stops_and_acknowledges_nothing():
    """S9 on a replica: a frame's records cannot be written (a write or an fsync of
    the store fails). The frame is not acknowledged as holding them, and the node
    is told to stop (``Engine._fail``), as a primary whose commit fails is; it
    does not resync and go on taking frames into a store it cannot trust (it did,
    and stopped only if its own checkpoint then had something to write)."""
    import apsw

    T = 1_000_000

    class Eng(_FrameEngine):
        def __init__(self):
            super().__init__()
            self.store = self

        def append(self, rows):
            raise apsw.IOError("injected write failure")

        def check_from_primary(self, rows):
            pass

    eng = Eng()
    acks, resyncs = _one_record_frame(eng, T)
    assert [type(e) for e in eng.fatal] == [apsw.IOError], "the node was not told to stop"
    assert not [a for a in acks if a.ok and a.match_lsn >= 1], acks  # nothing acknowledged as held
    assert not resyncs  # a stopping node does not reload its view of the store


def test_a_replica_reads_ahead_of_a_busy_frame_only_up_to_its_byte_bound(monkeypatch):
    """A frame read while an earlier one is being stored waits in memory
    (serve_stream's read-ahead). Past READ_AHEAD_BYTES_MAX of such frames the
    replica reads no more until it has worked through them, and gRPC's flow
    control holds the sender: a member that sends more than a correct primary
    ever has out cannot fill the node's memory. The bound is on what waits now,
    not on all a stream ever read ahead: behind a later busy frame it reads
    ahead again (else, after 128 MiB, a replica would stop answering contact
    behind a slow disk for good). Every frame is still handled, in order."""
    import node.replication.driver as drv
    monkeypatch.setattr(drv, "READ_AHEAD_BYTES_MAX", 8 << 20)
    T = 1_000_000

    async def main():
        d = _following_n1(_BareEngine(), T, T // 2)
        pulled, handled = [], []
        busy = {0: asyncio.Event(), 20: asyncio.Event()}  # these frames' disk is slow

        async def frames():
            for i in range(100):
                pulled.append(i)
                yield pb.AppendFrame(epoch=1, primary="n1", sent_us=mono_us(), lease_us=T,
                                     entries=[pb.Entry(lsn=10_000 + i, epoch=1, rec=bytes(1 << 20))])

        async def handle(f):
            i = f.entries[0].lsn - 10_000
            handled.append(i)
            if i in busy:
                await busy[i].wait()
            return []
        d._handle_frame = handle

        async def turns():  # the event loop's turns, no wall-clock wait: reads that can happen, happen
            for _ in range(2000):
                await asyncio.sleep(0)

        served = asyncio.ensure_future(_drain(d.serve_stream(frames(), None)))
        await turns()
        behind_first = len(pulled)
        busy[0].set()
        await turns()
        behind_second = len(pulled)
        busy[20].set()
        await asyncio.wait_for(served, 10)
        return behind_first, behind_second, handled

    behind_first, behind_second, handled = asyncio.run(main())
    # the frame being handled, and 8 of about 1 MiB read ahead of it; then again
    assert behind_first == 1 + 8, behind_first
    assert behind_second == 21 + 8, behind_second
    assert handled == list(range(100))


async def _drain(agen) -> list:
    return [a async for a in agen]


def test_the_replication_core_knows_each_record_s_size_as_written_received_and_loaded(tmp_path):
    """Frames are bounded in bytes by the sizes in the core's LogView: a
    primary's records give theirs as they are written (Engine's commit), a
    replica's as a frame brings them (Driver._handle_frame), and a restart reads
    them back with the log (Driver.load). Without them, every size is 0 and the
    byte bound does nothing."""
    e = Engine(str(tmp_path / "p"), node_id="n1", peers=PEERS)

    async def primary():
        c = _loaded_as_primary(e, heard=("n2", "n3"))
        e.write_epoch = 1
        rec = log_pb2.Record(queue_put=log_pb2.QueuePut(name="q" * 200))
        e._pending.append((rec, asyncio.get_running_loop().create_future()))
        e._wake = asyncio.Event()
        e._wake.set()
        loop_task = asyncio.create_task(e._commit_loop())
        try:
            for _ in range(500):
                if c.log.last_lsn >= 1 and e.appended_lsn >= 1:
                    break
                await asyncio.sleep(0.01)
            return list(c.log.sizes)
        finally:
            loop_task.cancel()
            await asyncio.gather(loop_task, return_exceptions=True)

    written = asyncio.run(primary())
    (stored,), = e.store.db.execute("SELECT length(rec) FROM log WHERE lsn = 1")
    assert written == [stored] and stored > 200
    e.store.close()

    async def replica():
        d = _following_n1(_BareEngine(), 1_000_000, 500_000)
        frame = pb.AppendFrame(epoch=1, primary="n1", sent_us=mono_us(), lease_us=1_000_000,
                               entries=[pb.Entry(lsn=1, epoch=1, crc=7, rec=b"r" * 300)])
        d._run = _noop_run
        await d._handle_frame(frame)
        return list(d.core.log.sizes)
    assert asyncio.run(replica()) == [300]

    e2 = Engine(str(tmp_path / "r"), node_id="n2", peers=PEERS)
    e2.store.append([(1, 1, 0, b"a" * 10), (2, 1, 0, b"b" * 20), (3, 1, 0, b"c" * 30)])
    e2.repl.load()
    # (a store that applied nothing: the view is based on the applied position,
    # LogView.from_store, so every row's size is known)
    assert e2.repl.core.log.base_lsn == 0 and e2.repl.core.log.sizes == [10, 20, 30]
    e2.store.close()


async def _noop_run(effects) -> None:
    return None


def test_a_frame_that_breaks_an_invariant_stops_the_replica_instead_of_resyncing():
    """A frame whose handling breaks an invariant (here the engine finds a gap
    between its log and the frame's records: Engine.check_from_primary) is not a
    failed write (those stop the node in Driver._store) nor a conflict with
    committed records (LOG_CONFLICT). It stopped nothing: the replica logged it,
    reloaded its view of the log from the store and went on, a truncation below
    what it had applied clamped over. Now the node stops as for an internal
    failure, acknowledges nothing of the frame, and does not resync."""
    from node.engine import INTERNAL_FAILURE
    T = 1_000_000

    class Eng(_FrameEngine):
        def check_from_primary(self, rows):
            raise RuntimeError("replica log gap: record 1 after 5")

    eng = Eng()
    acks, resyncs = _one_record_frame(eng, T)
    assert [type(e) for e in eng.fatal] == [RuntimeError] and eng.fatal_what == INTERNAL_FAILURE, eng.fatal
    assert not [a for a in acks if a.ok and a.match_lsn >= 1], acks
    assert not resyncs


def test_a_replication_stream_that_dies_of_a_bug_stops_the_primary(tmp_path):
    """A primary's stream to a replica handles the network's failures and the
    replica's refusals itself. Anything else it died of went unseen: the next
    frame started a new stream, and the bug (a record missing from memory and
    store, say) was never reported. Now the node stops, as when any other
    background task dies (Engine._task_ended: an internal failure)."""
    from node.engine import INTERNAL_FAILURE
    e = Engine(str(tmp_path / "p"), node_id="n1", peers=PEERS)

    async def main():
        _loaded_as_primary(e, heard=("n2", "n3"))
        d = e.repl

        async def broken_stream(to, outbox):
            raise ValueError("a bug in the stream")
        d._stream_to = broken_stream
        d._send("n2", R.AppendReq(1, "n1", 0, 0, 0, [], 0, mono_us(), 0, 1_000_000))
        for _ in range(100):
            if e.failed is not None:
                break
            await asyncio.sleep(0.01)
        return e.failed, e.failed_what

    failed, what = asyncio.run(main())
    assert isinstance(failed, ValueError) and what == INTERNAL_FAILURE, (failed, what)
    e.store.close()


def test_a_restarted_node_replaces_a_first_record_that_never_committed(tmp_path):
    """Driver.load on a store that holds a deposed primary's first record (n1's
    lsn 1 of epoch 7, which no majority stored) and has applied nothing: the
    core's view is based on the applied position (LogView.from_store), so the
    new primary's different lsn 1 replaces that record. With the first row as
    the base (before 0.4.47) the core truncated twice, its view no longer
    matched what it stored, and a later frame stopped the node with "differs
    from the one committed here" (tests/unit/test_log_view_load.py)."""
    e = _voted(tmp_path)
    try:
        d = e.repl
        d.load()
        c = d.core
        assert c.log.base_lsn == 0 and c.log.last_lsn == 1 and c.commit_lsn == 0
        now = mono_us()
        c.start(now)
        # n2, primary of epoch 9, sends its own lsn 1 and 2
        out = c.receive(R.AppendReq(9, "n2", 0, 0, 0, [(1, 9, 201), (2, 9, 202)], 0, now, 0, 1_000_000), now)
        assert [type(x).__name__ for x in out if isinstance(x, (R.Truncate, R.Store))] == ["Truncate", "Store"]
        assert next(x for x in out if isinstance(x, R.Truncate)).after_lsn == 0
        store = next(x for x in out if isinstance(x, R.Store))
        assert [x[0] for x in store.req.entries] == [1, 2]
        assert c.log.at(1) == (9, 201) and c.log.at(2) == (9, 202) and c.log.last_lsn == 2
        acks = [x.msg for x in c.stored(store.req, now) if isinstance(x, R.Send)]
        assert acks and acks[-1].ok and acks[-1].match_lsn == 2
        # the next frame follows on from n2's lsn 2, with lsn 2 committed
        out = c.receive(R.AppendReq(9, "n2", 2, 9, 202, [(3, 9, 203)], 2, now + 1, 2, 1_000_000), now + 1)
        assert any(isinstance(x, R.Store) for x in out)
        assert c.log.at(3) == (9, 203)
    finally:
        e.store.close()
