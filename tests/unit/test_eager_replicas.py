"""--eager-replicas: which replicas a primary sends a new record to at once.

With ``quorum`` (the default) a record goes at once to as many replicas as a
quorum needs with the primary, the most caught up; the others get what they
lack in one frame at the next tick, or at once while a frame or more behind.
Commits still count a majority's acknowledgements. These drive the pure core
(node/core/replication.py) as a primary of three or five members.
"""
from __future__ import annotations

import pytest

from node.core import replication as R

T0 = 10_000_000_000
TICK = 10_000  # the driver ticks every 10 ms (Driver._ticker)


def _primary(eager: str, members=("n1", "n2", "n3"), **kw) -> R.Replication:
    c = R.Replication("n1", list(members), 2_000_000, rand=lambda: 0.5, eager=eager, **kw)
    c.started = True
    c.role, c.epoch, c.primary = R.PRIMARY, 2, "n1"
    c.acked_sent = {p: T0 for p in c.peers}
    c.next = {p: 1 for p in c.peers}  # (as on election: from the end of the log)
    c.last_sent = {p: T0 for p in c.peers}  # (so a tick soon after is not a heartbeat, which carries records too)
    return c


def _append(c: R.Replication, now: int) -> tuple:
    """A new local record (fsync'd): its lsn and the peers it was sent to at once."""
    lsn = c.log.last_lsn + 1
    out = c.appended([(lsn, c.epoch, lsn, 300)], now)
    return lsn, _records_to(out)


def _records_to(out: list) -> dict:
    """peer -> the lsns of the records sent it in ``out``."""
    got: dict = {}
    for e in out:
        if isinstance(e, R.Send) and isinstance(e.msg, R.AppendReq) and e.msg.entries:
            got.setdefault(e.to, []).extend(x[0] for x in e.msg.entries)
    return got


def _ack(c: R.Replication, peer: str, lsn: int, now: int) -> list:
    return c.receive(R.AppendResp(c.epoch, peer, True, lsn, now), now)


def _commit_with_n2(c: R.Replication, count: int, now: int = T0) -> int:
    """``count`` new records a millisecond apart, each acknowledged by n2 (the
    eager replica) a tenth of a millisecond later. -> the time of the last."""
    for _ in range(count):
        now += 1000
        lsn, _ = _append(c, now)
        _ack(c, "n2", lsn, now + 100)
    return now


def _commits(out: list) -> list:
    return [e.lsn for e in out if isinstance(e, R.Commit)]


def test_a_record_goes_at_once_to_one_replica_of_two_and_to_the_other_in_one_frame_a_tick():
    c = _primary(R.EAGER_QUORUM)
    now = T0
    for _ in range(5):
        now += 1000
        lsn, sent = _append(c, now)
        assert sent == {"n2": [lsn]}  # the quorum's one replica (equals: by name)
        now += 500
        assert _commits(_ack(c, "n2", lsn, now)) == [lsn]  # n2 and this node: a majority
    assert c.next.get("n3", 1) == 1  # n3 has been sent nothing yet
    out = c.tick(now + TICK)
    assert _records_to(out) == {"n3": [1, 2, 3, 4, 5]}  # one frame with all it lacks
    assert _records_to(c.tick(now + 2 * TICK)) == {}  # nothing more to send it


def test_with_all_every_replica_gets_a_record_at_once():
    c = _primary(R.EAGER_ALL)
    lsn, sent = _append(c, T0 + 1000)
    assert sent == {"n2": [lsn], "n3": [lsn]}


def test_the_eager_replica_is_the_one_further_along():
    c = _primary(R.EAGER_QUORUM)
    c.match = {"n2": 0, "n3": 0}
    c.log.add(2, 1, 300)
    c.durable_lsn = 1
    c.match["n3"], c.next["n3"] = 1, 2  # n3 has acknowledged more than n2
    lsn, sent = _append(c, T0 + 1000)
    assert sent == {"n3": [lsn]}


def test_a_replica_whose_stream_broke_is_passed_over_until_it_answers_again():
    c = _primary(R.EAGER_QUORUM)
    now = T0 + 1000
    lsn, sent = _append(c, now)
    assert sent == {"n2": [lsn]}
    now += 1000
    c.replica_stream_lost("n2", now)  # (it resends n2 from what it acknowledged)
    now += 1000
    lsn, sent = _append(c, now)
    assert "n3" in sent and lsn in sent["n3"], sent  # n3 now, with the one it lacked
    assert _commits(_ack(c, "n3", lsn, now + 500)) == [lsn]
    # n2 answers on its new stream: it counts again, and the one further along is n3
    _ack(c, "n2", 1, now + 600)
    lsn, sent = _append(c, now + 2000)
    assert set(sent) == {"n3"}


def test_a_replica_that_stops_answering_is_overtaken_within_a_tick():
    """A hung eager replica (no answers, stream still open): the other gets the
    records at the next tick, its acknowledgement commits them, and from then on
    it is the one sent new records at once."""
    c = _primary(R.EAGER_QUORUM)
    now = T0
    lsns = []
    for _ in range(3):
        now += 1000
        lsn, sent = _append(c, now)
        assert set(sent) == {"n2"}
        lsns.append(lsn)
    assert c.commit_lsn == 0
    out = c.tick(now + TICK)
    assert _records_to(out) == {"n3": lsns}
    now += TICK + 500
    assert _commits(_ack(c, "n3", lsns[-1], now)) == [lsns[-1]]
    lsn, sent = _append(c, now + 1000)
    assert sent == {"n3": [lsn]}


def test_a_lazy_replica_a_frame_or_more_behind_gets_the_next_frame_with_each_answer():
    c = _primary(R.EAGER_QUORUM, frame_entries_max=2)
    now = _commit_with_n2(c, 7)
    out = c.tick(now + TICK)
    assert _records_to(out) == {"n3": [1, 2]}
    now += TICK
    assert _records_to(_ack(c, "n3", 2, now + 100)) == {"n3": [3, 4]}  # catching up: at once
    assert _records_to(_ack(c, "n3", 4, now + 200)) == {"n3": [5, 6]}
    # what is left fits in one frame: it waits for the tick
    assert _records_to(_ack(c, "n3", 6, now + 300)) == {}
    assert _records_to(c.tick(now + TICK)) == {"n3": [7]}


def test_a_lazy_replica_behind_the_compacted_log_is_offered_a_snapshot_at_the_heartbeat():
    """What it lacks is compacted away: its answers and the ticks send it nothing
    more (a frame that asks for a snapshot goes once a heartbeat, as with all)."""
    c = _primary(R.EAGER_QUORUM)
    now = _commit_with_n2(c, 6)
    c.log.compact(4)
    c.next["n3"], c.match["n3"] = 2, 1
    assert _records_to(_ack(c, "n3", 1, now + 200)) == {}
    assert [e for e in c.tick(now + TICK) if isinstance(e, R.Send)] == []
    out = c.tick(now + c.heartbeat + 1000)
    frames = [e.msg for e in out if isinstance(e, R.Send) and e.to == "n3"]
    assert [(f.prev_epoch, f.entries) for f in frames] == [(-1, [])]


def test_a_lazy_replica_a_frame_or_more_behind_in_bytes_gets_the_next_frame_with_each_answer():
    c = _primary(R.EAGER_QUORUM, frame_bytes_max=1000)  # records of 300 bytes: frames of 3 (records: 512)
    now = _commit_with_n2(c, 7)
    assert _records_to(c.tick(now + TICK)) == {"n3": [1, 2, 3]}
    now += TICK
    assert _records_to(_ack(c, "n3", 3, now + 100)) == {"n3": [4, 5, 6]}  # 4 more: over a frame's bytes
    assert _records_to(_ack(c, "n3", 6, now + 200)) == {}  # the last one waits for the tick
    assert _records_to(c.tick(now + TICK)) == {"n3": [7]}


def _disk_handover_after_us(eager: str) -> int:
    """A primary low on disk for over a failover timeout; n2 was passed over by an
    earlier handover (it refused, say) but answers; n3 has room. A record (a
    settle, say: sends are refused) every 2 ms, each frame answered 0.5 ms after
    it is sent. -> how long until TimeoutNow goes to a member, in the core's time
    (found in a review: with the quorum first, n3 got a frame a tick and never
    held every committed record, so the handover waited out n2's pass-over)."""
    timeout = 2_000_000
    c = _primary(eager)
    start = now = T0
    c.match = {p: 0 for p in c.peers}
    c.disk(True, now - 2 * timeout)
    c.disk_handover_failed["n2"] = now
    answers = []  # (when, peer, lsn, sent_us)

    def handle(out, t):
        for e in out:
            if isinstance(e, R.Send) and isinstance(e.msg, R.TimeoutNow):
                return True
            if isinstance(e, R.Send) and isinstance(e.msg, R.AppendReq):
                m = e.msg
                answers.append((t + 500, e.to, m.entries[-1][0] if m.entries else m.prev_lsn, m.sent_us))
        return False
    while now - start < 12 * timeout:
        now += 500
        for a in sorted(x for x in answers if x[0] <= now):
            answers.remove(a)
            if handle(c.receive(R.AppendResp(c.epoch, a[1], True, a[2], a[3]), now), now):
                return now - start
        if (now - start) % 2000 == 1000:
            handle(c.appended([(c.log.last_lsn + 1, c.epoch, 1, 100)], now), now)
        if (now - start) % TICK == 0 and handle(c.tick(now), now):
            return now - start
    return now - start


def test_a_primary_low_on_disk_sends_records_to_every_member_and_hands_over_at_once():
    assert _disk_handover_after_us(R.EAGER_ALL) <= 100_000  # the control: the first ticks
    assert _disk_handover_after_us(R.EAGER_QUORUM) <= 100_000


def test_a_switchover_target_is_sent_records_at_once():
    """The target must hold every record before it takes over: each of its answers
    brings the rest at once, not only while it is a frame or more behind."""
    c = _primary(R.EAGER_QUORUM, frame_entries_max=2)
    now = _commit_with_n2(c, 5)
    now += 1000
    assert _records_to(c.transfer("n3", now)) == {"n3": [1, 2]}
    assert _records_to(_ack(c, "n3", 2, now + 100)) == {"n3": [3, 4]}
    assert _records_to(_ack(c, "n3", 4, now + 200)) == {"n3": [5]}  # less than a frame behind: at once
    out = _ack(c, "n3", 5, now + 300)
    assert [e for e in out if isinstance(e, R.Send) and isinstance(e.msg, R.TimeoutNow)]


@pytest.mark.parametrize("why", ["joining", "disk_low"])
def test_a_joining_member_or_one_low_on_disk_is_not_the_eager_one(why):
    c = _primary(R.EAGER_QUORUM)
    (c.peer_joining if why == "joining" else c.peer_disk_low)["n2"] = True
    lsn, sent = _append(c, T0 + 1000)
    assert sent == {"n3": [lsn]}


def test_five_members_send_a_record_at_once_to_two_replicas():
    c = _primary(R.EAGER_QUORUM, members=("n1", "n2", "n3", "n4", "n5"))
    lsn, sent = _append(c, T0 + 1000)
    assert sent == {"n2": [lsn], "n3": [lsn]}
    assert _commits(_ack(c, "n2", lsn, T0 + 1500)) == []
    assert _commits(_ack(c, "n3", lsn, T0 + 1600)) == [lsn]
    assert _records_to(c.tick(T0 + 1000 + TICK)) == {"n4": [lsn], "n5": [lsn]}


def test_two_members_send_every_record_to_the_other_at_once():
    c = _primary(R.EAGER_QUORUM, members=("n1", "n2"))
    lsn, sent = _append(c, T0 + 1000)
    assert sent == {"n2": [lsn]}


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="eager must be"):
        R.Replication("n1", ["n1", "n2", "n3"], 2_000_000, rand=lambda: 0.5, eager="some")
