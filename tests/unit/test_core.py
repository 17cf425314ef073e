"""The pure core, transition by transition, with an injected clock.

Records are built the way the primary builds them; ``Log.commit`` stamps
epoch, lsn and time and applies them, like the engine does after fsync.
"""
import pytest

from node.core.spool import DEFAULT_SETTINGS, US, BrokenInvariant, Core, Lease, Segment, StaleLeaseError
from spooler.pb import log_pb2

S = US  # one second in core units


class Log:
    def __init__(self, core=None):
        self.core = core or Core(rand=lambda n: b"\x01" * n)
        self.epoch = 0
        self.records = []
        self.ids = 0

    def commit(self, rec, at):
        rec.epoch = self.epoch
        rec.lsn = self.core.lsn + 1
        rec.ts_us = at
        self.records.append(rec.SerializeToString())
        return self.core.apply(rec)

    def new_epoch(self, at):
        self.epoch += 1
        return self.commit(log_pb2.Record(epoch_begin=log_pb2.EpochBegin(node_id="n1")), at)

    def queue(self, name, at=0, **settings):
        return self.commit(log_pb2.Record(queue_put=log_pb2.QueuePut(name=name, settings=log_pb2.QueueSettings(**settings))), at)

    def send(self, queue, body=b"m", at=0, delay=0, key="", repeat=False):
        self.ids += 1
        rec = log_pb2.Record()
        rec.send.entries.add(queue=queue, id=f"m{self.ids}", body=body, delay_us=delay, dedup_key=key,
                             repeat=repeat)
        entries, run = self.commit(rec, at)
        assert run is None  # a record without a run
        return entries[0]

    def settle(self, kind, queue, mid, at, delay=0):
        rec = log_pb2.Record()
        rec.settle.entries.add(kind=kind, queue=queue, id=mid, delay_us=delay)
        return self.commit(rec, at)[0]

    def expire_due(self, now):
        due = self.core.due_expiries(now)
        if due:  # one record, as the lease timer makes it
            self.commit(self.core.expiry_record(due), now)
        return due


@pytest.fixture
def log():
    lg = Log()
    lg.new_epoch(0)
    return lg


def recv(log, queue, now, n=1):
    return log.core.receive(queue, now, n)


def test_send_then_receive_oldest_first(log):
    log.queue("q")
    a, _ = log.send("q", b"a", at=1)
    b, _ = log.send("q", b"b", at=2)
    [(m, lease)] = recv(log, "q", 3)
    assert (m.id, m.body, m.retry) == (a, b"a", 0)
    assert lease.expires_at == 3 + 30 * S  # default lease timeout
    [(m2, _)] = recv(log, "q", 3)
    assert m2.id == b
    assert recv(log, "q", 3) == []
    assert log.core.stats("q", 3)["leased"] == 2


def test_send_to_missing_queue_is_a_noop_result(log):
    assert log.send("nope") == (None, "queue_not_found")


def test_delay_hides_message_until_visible(log):
    log.queue("q")
    log.send("q", at=0, delay=5 * S)
    assert recv(log, "q", 5 * S - 1) == []
    st = log.core.stats("q", 5 * S - 1)
    assert (st["visible"], st["delayed"]) == (0, 1)
    [(m, _)] = recv(log, "q", 5 * S)
    assert m.retry == 0


def test_ack_removes_for_good(log):
    log.queue("q")
    mid, _ = log.send("q")
    [(m, lease)] = recv(log, "q", 1)
    log.core.begin_settle(lease)
    assert log.settle(log_pb2.ACK, "q", mid, 2) is True
    assert recv(log, "q", 10**12) == []
    assert log.core.stats("q", 3)["ackedTotal"] == 1
    with pytest.raises(StaleLeaseError) as e:
        log.core.check_lease(lease.epoch, lease.id, lease.nonce, 3)
    assert e.value.reason == "settled"


@pytest.mark.parametrize("kind", [log_pb2.ACK, log_pb2.NACK])
def test_ended_leases_are_remembered_up_to_their_bound_oldest_forgotten_first(kind):
    """limits.md, "ended leases remembered": a stale token says ``settled`` while its
    lease's end is remembered, ``expired`` once it is forgotten (oldest first), and
    the memory stays within ``ended_leases_max``."""
    lg = Log(Core(rand=lambda n: b"\x01" * n, ended_leases_max=3))
    lg.new_epoch(0)
    lg.queue("q")
    leases = []
    for i in range(5):
        mid, _ = lg.send("q", at=i)
        [(m, lease)] = recv(lg, "q", i)
        lg.core.begin_settle(lease)
        assert lg.settle(kind, "q", m.id, i) is True
        leases.append(lease)
        assert len(lg.core.ended) <= 3
    reasons = []
    for lease in leases:
        with pytest.raises(StaleLeaseError) as e:
            lg.core.check_lease(lease.epoch, lease.id, lease.nonce, 10)
        reasons.append(e.value.reason)
    assert reasons == ["expired", "expired", "settled", "settled", "settled"]


def test_settling_lease_is_fenced_from_expiry_and_second_settle(log):
    log.queue("q", lease_timeout_us=1 * S)
    log.send("q")
    [(m, lease)] = recv(log, "q", 0)
    log.core.begin_settle(lease)
    assert log.core.due_expiries(10 * S) == []  # no expiry while the ack is committing
    with pytest.raises(StaleLeaseError) as e:
        log.core.check_lease(lease.epoch, lease.id, lease.nonce, 0)
    assert e.value.reason == "settled"
    assert e.value.lease is lease  # the edge waits on the settle's commit it keeps there


def test_nack_increments_retry_and_honours_delay(log):
    log.queue("q")
    mid, _ = log.send("q")
    [(m, lease)] = recv(log, "q", 0)
    log.settle(log_pb2.NACK, "q", mid, 10, delay=3 * S)
    assert recv(log, "q", 10 + 3 * S - 1) == []
    [(m, _)] = recv(log, "q", 10 + 3 * S)
    assert m.retry == 1
    assert log.core.stats("q", 10 + 3 * S)["nackedTotal"] == 1


def test_lease_expiry_is_a_server_nack(log):
    log.queue("q", lease_timeout_us=2 * S)
    log.send("q")
    [(m, lease)] = recv(log, "q", 0)
    assert log.expire_due(2 * S - 1) == []
    with pytest.raises(StaleLeaseError) as e:  # the gate says expired even before the timer ran
        log.core.check_lease(lease.epoch, lease.id, lease.nonce, 2 * S)
    assert e.value.reason == "expired"
    assert log.expire_due(2 * S) == [("q", m.id)]
    [(m2, _)] = recv(log, "q", 2 * S)
    assert (m2.id, m2.retry) == (m.id, 1)
    assert log.core.stats("q", 2 * S)["leaseExpiredTotal"] == 1


def test_max_retries_moves_to_failure_queue_then_redrive(log):
    log.queue("q", max_retries=2, lease_timeout_us=1 * S)
    mid, _ = log.send("q")
    now = 0
    for expected_retry in (0, 1, 2):
        [(m, _)] = recv(log, "q", now)
        assert m.retry == expected_retry
        now += 1 * S
        log.expire_due(now)
    # third expiry would raise the count above maxRetries: moved instead
    assert recv(log, "q", now) == []
    assert log.core.stats("q", now)["failedTotal"] == 1
    [(f, flease)] = recv(log, "q.failed", now)
    assert (f.id, f.retry) == (mid, 0)
    log.core.begin_settle(flease)
    log.settle(log_pb2.NACK, "q.failed", mid, now)
    moved = log.commit(log_pb2.Record(redrive=log_pb2.Redrive(queue="q")), now + 1)
    assert moved == 1
    [(m, _)] = recv(log, "q", now + 1)
    assert (m.id, m.retry) == (mid, 0)
    assert log.core.stats("q.failed", now + 1)["visible"] == 0


def test_max_retries_zero_fails_on_first_nack(log):
    log.queue("q", max_retries=0, failure_queue="dlq")
    mid, _ = log.send("q")
    recv(log, "q", 0)
    log.settle(log_pb2.NACK, "q", mid, 1)
    assert "dlq" in log.core.queues
    assert [m.id for m, _ in recv(log, "dlq", 1)] == [mid]


def _nacked(log, queue, times, now=0):
    """A message of ``queue`` received and nacked ``times`` times."""
    mid, _ = log.send(queue, at=now)
    for _ in range(times):
        [(m, lease)] = recv(log, queue, now)
        log.core.begin_settle(lease)
        log.settle(log_pb2.NACK, queue, mid, now)
    return mid


def test_lowering_max_retries_stops_deliveries_past_the_new_limit(log):
    """A message delivered 4 times under maxRetries 5 is not delivered a 5th time
    once maxRetries is 1 (at most 2 deliveries): the receive leases it with a lease
    that is over already, and the lease timer's Settle(EXPIRE) moves it."""
    log.queue("q", max_retries=5)
    mid = _nacked(log, "q", 3)
    log.queue("q", at=1, max_retries=1)
    assert recv(log, "q", 2) == []
    assert log.core.stats("q", 2)["visible"] == 0
    log.core.woken.clear()  # (the engine drains it after each apply)
    assert log.expire_due(2) == [("q", mid)]  # due on the very next tick
    assert "q" in log.core.woken  # long polls on q look again: what waited behind it may go now
    st = log.core.stats("q", 2)
    # moved, and counted as failed only: nobody held that lease
    assert (st["visible"], st["leased"], st["failedTotal"], st["leaseExpiredTotal"]) == (0, 0, 1, 0)
    [(f, _)] = recv(log, "q.failed", 2)
    assert (f.id, f.retry) == (mid, 0)


def _lowered(log, retries=3, to=1):
    """A message nacked ``retries`` times under maxRetries 5, then maxRetries ``to``."""
    log.queue("q", max_retries=5)
    mid = _nacked(log, "q", retries)
    log.queue("q", at=1, max_retries=to)
    return mid


def test_max_retries_raised_again_before_the_move_is_proposed_delivers_it_uncounted(log):
    mid = _lowered(log)
    assert recv(log, "q", 2) == []
    log.queue("q", at=2, max_retries=3)  # one more delivery allowed again
    assert log.expire_due(2) == []       # given back instead
    [(m, _)] = recv(log, "q", 2)
    st = log.core.stats("q", 2)
    assert (m.id, m.retry, st["failedTotal"], st["leaseExpiredTotal"]) == (mid, 3, 0, 0)


def test_max_retries_raised_again_before_the_move_commits_delivers_it_uncounted(log):
    """The move's record was made, then maxRetries raised before it applied: every
    node leaves the message visible, its count kept, nothing counted."""
    mid = _lowered(log)
    assert recv(log, "q", 2) == []
    due = log.core.due_expiries(2)
    rec = log.core.expiry_record(due)
    assert [e.past_retries for e in rec.settle.entries] == [True]
    log.queue("q", at=2, max_retries=3)
    replica = Log()  # a node that applies the same records, and never leased anything
    for r in log.records:
        replica.core.apply(log_pb2.Record.FromString(r))
    log.commit(rec, 3)
    replica.core.apply(log_pb2.Record.FromString(log.records[-1]))
    for core in (log.core, replica.core):
        st = core.stats("q", 3)
        assert (st["visible"], st["leased"], st["failedTotal"], st["leaseExpiredTotal"]) == (1, 0, 0, 0)
        assert core.queues["q"].msgs[mid].retry == 3
    [(m, _)] = recv(log, "q", 3)
    assert (m.id, m.retry) == (mid, 3)


def test_a_run_of_messages_past_max_retries_is_moved_a_bounded_number_per_receive(log):
    from node.core.spool import PAST_RETRIES_PER_RECEIVE as CAP
    log.queue("q", max_retries=5)
    held = []
    for _ in range(CAP + 50):  # each nacked once, then held so that the next one is received alone
        mid = _nacked(log, "q", 1)
        [(_, lease)] = recv(log, "q", 0)
        held.append(lease)
    for lease in held:
        assert log.core.release(lease.id, lease.nonce, 0)
    good, _ = log.send("q", at=0)
    log.queue("q", at=1, max_retries=0)
    assert recv(log, "q", 2) == []              # the first CAP only: the call returns
    assert len(log.expire_due(2)) == CAP
    [(m, _)] = recv(log, "q", 2)                # the other 50 are leased to move, and the good one delivered
    assert (m.id, m.retry) == (good, 0)
    assert len(log.expire_due(2)) == 50
    assert log.core.stats("q", 2)["failedTotal"] == CAP + 50


def test_a_primary_change_before_the_move_leaves_it_to_the_next_primary(log):
    mid = _lowered(log)
    assert recv(log, "q", 2) == []
    log.new_epoch(3)  # the lease ends with the primary; the message is visible again, its count kept
    assert log.core.queues["q"].msgs[mid].retry == 3
    assert recv(log, "q", 4) == []
    assert log.expire_due(4) == [("q", mid)]
    assert log.core.stats("q", 4)["failedTotal"] == 1


def test_a_message_past_max_retries_is_delivered_when_no_failure_queue_can_be_made(log, monkeypatch):
    import node.core.spool as spool
    mid = _lowered(log)
    monkeypatch.setattr(spool, "QUEUES_MAX", len(log.core.queues))  # no room for q.failed
    [(m, _)] = recv(log, "q", 2)
    assert (m.id, m.retry) == (mid, 3)


def test_lowering_max_retries_spares_messages_within_the_new_limit(log):
    log.queue("q", max_retries=5)
    past = _nacked(log, "q", 2)         # 2 retries: may not be delivered again under maxRetries 1
    [(_, held)] = recv(log, "q", 0)     # (held, so that the next one is received alone)
    within = _nacked(log, "q", 1)       # 1 retry: may be delivered once more
    assert log.core.release(held.id, held.nonce, 0)  # given back, its count kept
    log.queue("q", at=1, max_retries=1)
    got = recv(log, "q", 2, n=10)
    assert [(m.id, m.retry) for m, _ in got] == [(within, 1)]
    assert log.expire_due(2) == [("q", past)]


def test_a_message_past_max_retries_is_still_delivered_when_it_has_nowhere_to_go(log):
    """A queue that is its own failure queue keeps its failures (the count saturates):
    there, a message past a lowered maxRetries goes on being delivered."""
    log.queue("q", max_retries=5, failure_queue="q")
    mid = _nacked(log, "q", 3)
    log.queue("q", at=1, max_retries=1)
    [(m, _)] = recv(log, "q", 2)
    assert (m.id, m.retry) == (mid, 3)


def test_renew_uses_the_current_lease_timeout(log):
    log.queue("q", lease_timeout_us=10 * S)
    log.send("q")
    [(m, lease)] = recv(log, "q", 0)
    assert lease.expires_at == 10 * S
    log.queue("q", at=1, lease_timeout_us=60 * S)  # settings change while leased
    assert log.core.renew(lease, 5 * S) == 65 * S
    assert log.core.due_expiries(10 * S) == []  # the old expiry no longer applies
    assert log.core.due_expiries(65 * S) == [("q", m.id)]


def test_retention_counts_from_visibility_not_send(log):
    log.queue("q", retention_us=10 * S)
    mid, _ = log.send("q", at=0, delay=100 * S)
    assert log.core.due_drops(50 * S) == []  # a delay never eats retention
    assert log.core.due_drops(110 * S) == [("q", [mid])]
    n = log.commit(log_pb2.Record(drop=log_pb2.Drop(queue="q", ids=[mid])), 110 * S)
    assert n == 1
    assert log.core.stats("q", 110 * S)["expiredTotal"] == 1
    assert recv(log, "q", 110 * S) == []


def test_expired_message_is_not_handed_out(log):
    log.queue("q", retention_us=10 * S)
    log.send("q", at=0)
    assert recv(log, "q", 10 * S) == []


def test_expired_message_of_a_batch_is_not_handed_out(log):
    """The same for messages still held in their batch's segment (S7)."""
    for q in ("q", "q2"):
        log.queue(q, retention_us=10 * S)
        _run(log, q, [b"a", b"b"], at=0, prefix=q)
    assert [m.body for m, _ in recv(log, "q2", 10 * S - 1, n=2)] == [b"a", b"b"]  # just before: both
    assert recv(log, "q", 10 * S) == []


def test_leased_message_past_retention_drops_when_lease_ends(log):
    log.queue("q", retention_us=10 * S, lease_timeout_us=20 * S)
    mid, _ = log.send("q", at=0)
    recv(log, "q", 1)
    assert log.core.due_drops(15 * S) == []  # leased: not dropped under the consumer
    log.expire_due(21 * S)
    assert log.core.stats("q", 21 * S)["expiredTotal"] == 1
    assert mid not in log.core.queues["q"].msgs


@pytest.mark.parametrize("kind,own_failure_queue", [(log_pb2.NACK, False), (log_pb2.EXPIRE, False),
                                                    (log_pb2.NACK, True)])
def test_a_lease_ending_across_retention_still_lets_its_message_drop(log, kind, own_failure_queue):
    """A nack (or expiry) stamped just before the message's retention ends is
    applied after the retention timer ran, which skipped the message then since it
    was leased: the message comes back with a retention entry, so it is dropped
    (counted in expiredTotal) instead of sitting visible, never delivered and never
    dropped. Also where its retries are spent on a queue that is its own failure
    queue."""
    settings = {"retention_us": 10 * S, "lease_timeout_us": 30 * S}
    if own_failure_queue:
        settings.update(max_retries=0, failure_queue="q")
    log.queue("q", **settings)
    mid, _ = log.send("q", at=0)
    recv(log, "q", 1 * S)
    assert log.core.due_drops(10 * S + 500_000) == []   # the timer runs while the nack is on its way
    log.settle(kind, "q", mid, at=10 * S - 1000)          # stamped before retention ended
    assert log.core.due_drops(12 * S) == [("q", [mid])]
    log.commit(log_pb2.Record(drop=log_pb2.Drop(queue="q", ids=[mid])), 12 * S)
    st = log.core.stats("q", 12 * S)
    assert (st["visible"], st["expiredTotal"]) == (0, 1)


@pytest.mark.parametrize("max_retries", [0, 5])
def test_a_nack_stamped_after_retention_ended_drops_the_message(log, max_retries):
    """A nack stamped after the message's retention ended (the consumer held it
    past its retention) drops it there and then, counted in expiredTotal: it is
    neither made visible again (with retries left) nor moved to the failure queue
    as a spent retry (max_retries 0), where it would start a new retention."""
    log.queue("q", retention_us=10 * S, lease_timeout_us=30 * S, max_retries=max_retries)
    mid, _ = log.send("q", at=0)
    recv(log, "q", 1 * S)
    assert log.core.due_drops(11 * S) == []               # leased: not dropped under its consumer
    log.settle(log_pb2.NACK, "q", mid, at=12 * S)          # stamped after retention ended
    st = log.core.stats("q", 12 * S)
    assert (st["visible"], st["leased"], st["expiredTotal"], st["failedTotal"]) == (0, 0, 1, 0)
    assert mid not in log.core.queues["q"].msgs
    assert "q.failed" not in log.core.queues or not log.core.queues["q.failed"].msgs
    assert recv(log, "q", 12 * S) == []


def test_fail_and_redrive_cycles_leave_no_heap_entries_behind(log):
    """Messages moved into a failure queue and redriven out of it, again and again:
    neither queue's heaps keep growing with stale entries (a failure queue is no
    settle's or send's queue, and was never swept)."""
    log.queue("q", max_retries=0)
    for cycle in range(6):
        for _ in range(600):
            log.send("q", at=cycle * 10 * S)
        got = recv(log, "q", cycle * 10 * S + 1, n=600)
        assert len(got) == 600
        for m, _ in got:
            log.settle(log_pb2.NACK, "q", m.id, at=cycle * 10 * S + 2)
        assert log.commit(log_pb2.Record(redrive=log_pb2.Redrive(queue="q")), cycle * 10 * S + 3) == 600
        for m, _ in recv(log, "q", cycle * 10 * S + 4, n=600):
            log.settle(log_pb2.ACK, "q", m.id, at=cycle * 10 * S + 5)
    for name in ("q", "q.failed"):
        q = log.core.queues[name]
        held = len(q.retention) + len(q.ready) + len(q.delayed)
        assert held <= 2 * (q.size + 1024), (name, held)


def test_renewing_one_lease_again_and_again_keeps_the_lease_heap_small(log):
    """Each renew pushes a new expiry and leaves the old one stale until it comes
    due (up to a lease timeout later): the heap is rebuilt from the live leases
    once it holds over twice their number, not left to grow with every renew."""
    log.queue("q", lease_timeout_us=43_200 * S)
    log.send("q", at=0)
    [(m, lease)] = recv(log, "q", 1)
    for i in range(20_000):
        log.core.renew(lease, 2 + i)
    assert len(log.core.lease_heap) <= 2 * len(log.core.leases) + 1025
    assert log.core.due_expiries(43_200 * S + 20_001) == [("q", m.id)]  # the live expiry is still there


def test_due_drops_names_each_message_once(log):
    """A lease that ends before retention does (here a primary change) gives the
    message a second retention entry while its first is still queued: the Drop
    proposed for it names it once, not once per entry."""
    log.queue("q", retention_us=10 * S)
    mid, _ = log.send("q", at=0)
    recv(log, "q", 1)
    log.new_epoch(2)  # the lease ends; its message is visible again, retention unchanged
    [(m, _)] = recv(log, "q", 3)
    log.new_epoch(4)  # and once more
    assert log.core.due_drops(10 * S) == [("q", [mid])]


def test_leases_ending_again_and_again_leave_one_retention_entry(log):
    """Each lease that ends pushes its message's retention entry again; the sweep
    (_tidy) keeps one per message, so a message leased and given back thousands
    of times does not grow its queue's heaps without end."""
    log.queue("q", retention_us=3600 * S)
    log.send("q", at=0)
    for i in range(3000):
        recv(log, "q", 1 + i)
        log.new_epoch(1 + i)
    other, _ = log.send("q", at=5000)
    [(m, lease)] = [x for x in recv(log, "q", 5000, n=2) if x[0].id == other]
    log.settle(log_pb2.ACK, "q", other, 5001)  # a settle sweeps its queue's heaps
    assert len(log.core.queues["q"].retention) == 1


def test_dedup_window(log):
    log.queue("q", dedup_window_us=10 * S)
    a = log.send("q", at=0, key="k")
    assert a[1] is False
    assert log.send("q", at=9 * S, key="k") == (a[0], True)
    assert log.core.stats("q", 9 * S)["sentTotal"] == 1
    b = log.send("q", at=10 * S, key="k")  # window over: a new message
    assert b[1] is False and b[0] != a[0]


def test_a_repeat_applies_only_as_a_repeat(log):
    """An entry the primary let in as a repeat (``repeat``) is a duplicate while its
    key is remembered; once the key's window is over, or the queue's window was
    turned off, it stores nothing and is refused ``unavailable``: a new message
    here would pass the caps it was never counted against."""
    log.queue("q", dedup_window_us=10 * S)
    a = log.send("q", at=0, key="k")
    assert log.send("q", at=9 * S, key="k", repeat=True) == (a[0], True)
    assert log.send("q", at=10 * S, key="k", repeat=True) == (None, "unavailable")
    assert log.core.stats("q", 10 * S)["sentTotal"] == 1 and log.core.dedup_n == 0
    b = log.send("q", at=10 * S, key="k")  # the same key sent anew: a new message
    assert b[1] is False and b[0] != a[0]
    log.queue("q", at=11 * S, dedup_window_us=0)
    assert log.send("q", at=12 * S, key="k", repeat=True) == (None, "unavailable")
    assert log.core.stats("q", 12 * S)["sentTotal"] == 2


def test_dedup_keys_are_forgotten_when_their_window_ends_whatever_record_comes_next(log):
    """A key is remembered for its window only: the next record of any kind after
    it ends (here a send to another queue, unkeyed) forgets it, and marks it for
    the checkpoint to delete; the node-wide count follows every add, end and
    queue delete."""
    log.queue("q", dedup_window_us=10 * S)
    log.queue("other")
    for i in range(3):
        log.send("q", at=i, key=f"k{i}")
    assert log.core.dedup_n == 3 and len(log.core.queues["q"].dedup) == 3
    log.send("q", at=5, key="k0")  # a repeat: remembered once
    assert log.core.dedup_n == 3
    log.core.dirty.dedup.clear()
    log.send("other", at=10 * S + 1)  # k0 and k1 end (at 10 s and 10 s + 1 us); k2 at 10 s + 2 us
    assert sorted(log.core.queues["q"].dedup) == ["k2"] and log.core.dedup_n == 1
    assert log.core.dirty.dedup == {("q", "k0"), ("q", "k1")}
    log.send("q", at=10 * S + 3, key="k9")
    assert log.core.dedup_n == 1  # k2 ended as that record applied, k9 came
    log.commit(log_pb2.Record(queue_delete=log_pb2.QueueDelete(name="q")), 10 * S + 4)
    assert log.core.dedup_n == 0
    log.queue("q", at=10 * S + 5, dedup_window_us=10 * S)  # the same name again: none of the old keys
    log.send("other", at=30 * S)  # (the old keys' ends, due now, find nothing to forget)
    assert log.core.dedup_n == 0 and log.core.queues["q"].dedup == {}


def test_a_restart_counts_the_dedup_keys_it_loads_and_forgets_the_ended_ones(log):
    log.queue("q", dedup_window_us=10 * S)
    core = Core(rand=lambda n: b"\x01" * n)
    for data in log.records:
        core.apply(log_pb2.Record.FromString(data))
    core.load_dedup("q", "old", "m1", 5 * S)   # as the engine loads the store's rows
    core.load_dedup("q", "new", "m2", 50 * S)
    assert core.dedup_n == 2
    again = Log(core)
    again.epoch = log.epoch
    again.queue("x", at=6 * S)  # the first record applied after the restart
    assert list(core.queues["q"].dedup) == ["new"] and core.dedup_n == 1


def test_a_deleted_queues_dedup_keys_leave_the_expiry_heap_within_bounds(log):
    """A deleted queue's keys are forgotten at once (the count), and their ends
    leave the heap once it holds more than twice the keys remembered plus 1,024:
    rounds of create, fill with keys, delete cannot pile them up for a day."""
    at = 0
    for _ in range(3):  # the heap: 600, then 1,200 dropped to 0, then 600
        log.queue("q", at=at, dedup_window_us=86_400 * S)
        for i in range(600):
            at += 1
            log.send("q", at=at, key=f"k{i}")
        assert log.core.dedup_n == 600
        at += 1
        log.commit(log_pb2.Record(queue_delete=log_pb2.QueueDelete(name="q")), at)
        assert log.core.dedup_n == 0
        assert len(log.core.dedup_exp) <= 2 * log.core.dedup_n + 1024
    assert len(log.core.dedup_exp) == 600  # the last round's: below the bound, left to end on their own


def test_dedup_off_when_window_zero(log):
    log.queue("q")
    a = log.send("q", key="k")
    b = log.send("q", key="k")
    assert a[0] != b[0] and not b[1]


def test_new_epoch_makes_leases_stale_and_messages_visible_with_count_kept(log):
    log.queue("q", lease_timeout_us=100 * S)
    mid, _ = log.send("q")
    [(m, lease)] = recv(log, "q", 0)
    log.settle(log_pb2.NACK, "q", mid, 1)  # a committed nack keeps its increment
    [(m, lease)] = recv(log, "q", 2)
    assert m.retry == 1
    log.new_epoch(3)  # primary change (a node restart is one)
    with pytest.raises(StaleLeaseError) as e:
        log.core.check_lease(lease.epoch, lease.id, lease.nonce, 3)
    assert e.value.reason == "primary_changed"
    [(m2, lease2)] = recv(log, "q", 3)  # visible at once
    assert (m2.id, m2.retry) == (mid, 1)  # no increment for an infrastructure event
    assert lease2.epoch == 2


def test_leases_per_queue_limit(log):
    log.queue("q")
    for _ in range(5):
        log.send("q")
    assert len(log.core.receive("q", 0, 10, leases_max=3)) == 3
    assert log.core.receive("q", 0, 10, leases_max=3) == []


def test_queue_delete_ends_leases(log):
    log.queue("q")
    log.send("q")
    [(m, lease)] = recv(log, "q", 0)
    assert log.commit(log_pb2.Record(queue_delete=log_pb2.QueueDelete(name="q")), 1) is True
    assert "q" not in log.core.queues
    with pytest.raises(StaleLeaseError):
        log.core.check_lease(lease.epoch, lease.id, lease.nonce, 1)


def test_apply_is_deterministic_across_nodes(log):
    """A replica applying the same records ends in the same state (leases aside)."""
    log.queue("q", max_retries=1, dedup_window_us=5 * S)
    for i in range(20):
        log.send("q", at=i, key=f"k{i % 7}", delay=(i % 3) * S)
    for m, lease in recv(log, "q", 10 * S, 8):
        log.settle(log_pb2.NACK if m.seq % 2 else log_pb2.ACK, "q", m.id, 10 * S + 1)
    log.expire_due(10**9)
    replica = Core(rand=lambda n: b"\x02" * n)
    for data in log.records:
        replica.apply(log_pb2.Record.FromString(data))

    def snapshot(core):
        return {name: (q.settings, q.counters, sorted((m.id, m.retry, m.visible_at, m.expires_at, m.seq)
                                                      for m in q.msgs.values()), dict(q.dedup))
                for name, q in core.queues.items()}

    assert snapshot(replica) == snapshot(log.core)
    assert replica.lsn == log.core.lsn


def test_log_gap_is_refused(log):
    rec = log_pb2.Record(epoch=1, lsn=log.core.lsn + 2, ts_us=0, queue_delete=log_pb2.QueueDelete(name="x"))
    with pytest.raises(AssertionError):
        log.core.apply(rec)


def _run(log, queue, bodies, at, delay=0, entries=(), prefix="p", first=0x1f):
    rec = log_pb2.Record()
    send = rec.send_compact
    for q, body in entries:
        log.ids += 1
        send.entries.add(queue=q, id=f"m{log.ids}", body=body)
    send.run_queue, send.run_id_prefix, send.run_id_first = queue, prefix, first
    send.run_delay_us = delay
    send.run_bodies.extend(bodies)
    return log.commit(rec, at)


def test_compact_run_is_the_same_as_one_entry_per_body(log):
    """The compact form of a batch (ids from a prefix and a counter) lands exactly as
    entries would: after the record's entries, in order, ids as the record says."""
    log.queue("q", retention_us=100 * S)
    log.queue("other")
    res = _run(log, "q", [b"a", b"b", b"c"], at=5, entries=[("other", b"e")])
    entries, run = res
    assert entries == [("m1", False)]
    assert run == ("p", 0x1f, 3, None)  # the ids are made only by whoever reads them
    assert run.ids() == ["p0000001f", "p00000020", "p00000021"]
    got = recv(log, "q", 6, 10)
    assert [(m.id, m.body, m.retry) for m, _ in got] == [("p0000001f", b"a", 0), ("p00000020", b"b", 0),
                                                          ("p00000021", b"c", 0)]
    assert got[0][0].expires_at == 5 + 100 * S  # retention from visibility
    st = log.core.stats("q", 6)
    assert (st["sentTotal"], st["leased"], st["visible"]) == (3, 3, 0)
    assert [m.id for m, _ in recv(log, "other", 6)] == ["m1"]


def test_compact_run_with_a_delay_and_to_a_missing_queue(log):
    log.queue("q")
    _run(log, "q", [b"late"], at=10, delay=5 * S)
    assert recv(log, "q", 10 + 5 * S - 1) == []
    [(m, _)] = recv(log, "q", 10 + 5 * S)
    assert (m.body, m.visible_at) == (b"late", 10 + 5 * S)
    assert _run(log, "gone", [b"x", b"y"], at=11) == ([], ("p", 0x1f, 2, "queue_not_found"))


def test_a_record_of_an_unknown_kind_stops_apply(log):
    """A newer primary's record this build cannot read is never skipped: apply refuses
    it (the node stops) rather than go on without the change."""
    rec = log_pb2.Record()
    rec.ParseFromString(b"\xfa\x01\x02\x08\x01")  # field 31, unknown here
    assert rec.WhichOneof("op") is None
    lsn = log.core.lsn
    with pytest.raises(ValueError):
        log.commit(rec, 1)
    assert log.core.lsn == lsn  # not applied, not even counted


def test_a_delivery_that_never_left_is_given_back_unchanged(log):
    """release: the answer carrying a lease could not be sent, so the message is
    visible again at once with its retry count; the old token is stale."""
    log.queue("q")
    mid, _ = log.send("q", b"a", at=1)
    [(m, lease)] = recv(log, "q", 2)
    assert not log.core.release(lease.id, b"\x09" * 8, 3)  # the token's nonce must match
    assert log.core.release(lease.id, lease.nonce, 3)
    assert not log.core.release(lease.id, lease.nonce, 3)  # once
    [(m2, lease2)] = recv(log, "q", 4)
    assert (m2.id, m2.retry) == (mid, 0) and lease2.id != lease.id
    with pytest.raises(StaleLeaseError):
        log.core.check_lease(lease.epoch, lease.id, lease.nonce, 5)
    assert log.core.stats("q", 5)["leased"] == 1


def test_an_expiry_the_edge_spares_gives_the_message_back_uncounted(log):
    """due_expiries(spare=): a lease whose ``via`` the edge says nobody could have had
    (forwarded through a node that lost contact) is given back at expiry, not expired;
    others expire as always, and a lease without ``via`` is never asked about."""
    log.queue("q", lease_timeout_us=10 * S)
    a, _ = log.send("q", b"a", at=1)
    b, _ = log.send("q", b"b", at=1)
    c, _ = log.send("q", b"c", at=1)
    [(ma, la)] = log.core.receive("q", 2, 1, via=("n2", 1))
    [(mb, lb)] = log.core.receive("q", 2, 1, via=("n3", 1))
    [(mc, lc)] = log.core.receive("q", 2, 1)
    asked = []

    def spare(via):
        asked.append(via)
        return via[0] == "n2"
    due = log.core.due_expiries(20 * S, spare=spare)
    assert sorted(due) == [("q", b), ("q", c)] and sorted(asked) == [("n2", 1), ("n3", 1)]
    assert log.core.spared == 1
    with pytest.raises(StaleLeaseError):
        log.core.check_lease(la.epoch, la.id, la.nonce, 21 * S)
    [(m, _)] = recv(log, "q", 21 * S)
    assert (m.id, m.retry) == (a, 0)


# ----------------------------------------------------------------- segments
# A compact batch is held as one Segment until its messages leave it (DESIGN.md,
# "Segments"); whatever happens, it must behave exactly like one message per body.

def _segment_count(core, queue):
    return sum(len(lst) for lst in core.queues[queue].segs.values())


def test_a_batch_stays_one_segment_until_its_messages_are_taken(log):
    log.queue("q")
    _run(log, "q", [b"a", b"b", b"c"], at=1)
    q = log.core.queues["q"]
    assert q.msgs == {} and _segment_count(log.core, "q") == 1  # no per-message object yet
    assert [t[0] for t in log.core.messages("q")] == ["p0000001f", "p00000020", "p00000021"]
    [(m, _)] = recv(log, "q", 2)
    assert (m.id, m.body, m.retry) == ("p0000001f", b"a", 0)
    assert list(q.msgs) == ["p0000001f"]  # only the leased one left the segment
    st = log.core.stats("q", 2)
    assert (st["visible"], st["leased"], q.size) == (2, 1, 3)
    got = recv(log, "q", 2, 10)
    assert [m.body for m, _ in got] == [b"b", b"c"]
    assert _segment_count(log.core, "q") == 0 and recv(log, "q", 2) == []


def test_a_nacked_message_of_a_segment_keeps_its_place_oldest_first(log):
    """Order is by send across segments and single messages: a message nacked back to
    ready sits before the rest of its batch and before later sends."""
    log.queue("q")
    _run(log, "q", [b"a", b"b"], at=1)
    log.send("q", b"single", at=2)
    [(a, _)] = recv(log, "q", 3)
    log.settle(log_pb2.NACK, "q", a.id, 4)
    got = recv(log, "q", 5, 10)
    assert [(m.body, m.retry) for m, _ in got] == [(b"a", 1), (b"b", 0), (b"single", 0)]


def test_a_replica_settles_messages_it_still_holds_in_segments(log):
    """Receives are not logged: a replica applies acks and nacks of messages that, on
    it, never left their segment. Both end in the same logical state."""
    log.queue("q", max_retries=1)
    _run(log, "q", [bytes([i]) for i in range(10)], at=1)
    got = recv(log, "q", 2, 6)
    for k, (m, _) in enumerate(got):
        log.settle((log_pb2.ACK, log_pb2.NACK, log_pb2.NACK)[k % 3], "q", m.id, 3, delay=(k % 2) * S)
    [(m, _)] = recv(log, "q", 4)  # the first nacked one (no delay), back in place
    log.settle(log_pb2.NACK, "q", m.id, 5)  # past max_retries: to q.failed
    replica = Core(rand=lambda n: b"\x02" * n)
    for data in log.records:
        replica.apply(log_pb2.Record.FromString(data))
    for name in ("q", "q.failed"):
        assert replica.messages(name) == log.core.messages(name)
        assert replica.stats(name, 6) == log.core.stats(name, 6)
    assert [t[2] for t in replica.messages("q.failed")] == [0]
    # the replica, elected, hands them out in the same order the old primary would
    Log(replica).new_epoch(7)
    log.new_epoch(7)
    assert [m.id for m, _ in replica.receive("q", 8 * S, 20)] == [m.id for m, _ in log.core.receive("q", 8 * S, 20)]


def test_retention_drops_the_untaken_messages_of_a_segment(log):
    log.queue("q", retention_us=10 * S)
    _run(log, "q", [b"a", b"b", b"c"], at=0)
    [(a, _)] = recv(log, "q", 1)
    assert log.core.due_drops(10 * S - 1) == []
    [(queue, ids)] = log.core.due_drops(10 * S)
    assert (queue, sorted(ids)) == ("q", ["p00000020", "p00000021"])  # the leased one waits for its lease
    log.core.requeue_drops("q", ids)  # as when the Drop could not be proposed: asked again later
    [(_, again)] = log.core.due_drops(10 * S)
    assert sorted(again) == sorted(ids)
    assert log.commit(log_pb2.Record(drop=log_pb2.Drop(queue="q", ids=again)), 10 * S) == 2
    st = log.core.stats("q", 10 * S)
    assert (st["expiredTotal"], st["visible"], st["leased"]) == (2, 0, 1)
    assert [t[0] for t in log.core.messages("q")] == [a.id]


def test_a_drop_before_retention_ends_leaves_the_segment_whole(log):
    log.queue("q", retention_us=10 * S)
    _run(log, "q", [b"a"], at=0)
    assert log.commit(log_pb2.Record(drop=log_pb2.Drop(queue="q", ids=["p0000001f"])), 5 * S) == 0
    assert _segment_count(log.core, "q") == 1 and log.core.queues["q"].msgs == {}
    assert [m.body for m, _ in recv(log, "q", 6 * S)] == [b"a"]


def test_a_drop_stamped_before_a_messages_retention_ends_leaves_it(log):
    """Apply re-checks the time (S7): a Drop whose stamp comes before a message's
    retention ends (proposed from a stale view, or by a primary whose clock is
    behind) drops nothing, and the message is still delivered."""
    log.queue("q", retention_us=10 * S)
    mid, _ = log.send("q", at=0)
    assert log.commit(log_pb2.Record(drop=log_pb2.Drop(queue="q", ids=[mid])), 10 * S - 1) == 0
    assert log.core.stats("q", 5 * S)["expiredTotal"] == 0
    [(m, _)] = recv(log, "q", 5 * S)
    assert m.id == mid


def test_a_delayed_segment_becomes_visible_at_its_time(log):
    log.queue("q")
    _run(log, "q", [b"a", b"b"], at=10, delay=5 * S)
    assert log.core.stats("q", 11)["delayed"] == 2
    assert log.core.next_visible_at("q") == 10 + 5 * S
    assert recv(log, "q", 10 + 5 * S - 1) == []
    assert [m.body for m, _ in recv(log, "q", 10 + 5 * S, 5)] == [b"a", b"b"]
    assert log.core.next_visible_at("q") is None


def test_redrive_and_delete_reach_messages_inside_segments(log):
    log.queue("q")
    log.queue("q.failed")
    _run(log, "q.failed", [b"x", b"y"], at=1)  # sent straight to the failure queue
    assert log.commit(log_pb2.Record(redrive=log_pb2.Redrive(queue="q")), 2) == 2
    assert log.core.messages("q.failed") == []
    assert [m.body for m, _ in recv(log, "q", 3, 5)] == [b"x", b"y"]
    _run(log, "q.failed", [b"z"], at=4)
    assert log.commit(log_pb2.Record(queue_delete=log_pb2.QueueDelete(name="q.failed")), 5) is True
    # the emptied segment ends with its messages (each goes at the next checkpoint); the other with its queue
    segs = [seg for seg in log.core.dirty.segs.values() if seg.queue == "q.failed"]
    assert [(seg.left, seg.removed) for seg in segs] == [(0, False), (1, True)]


def test_a_receive_takes_a_segment_run_only_up_to_an_older_message_outside_it():
    """A receive leases a segment's messages as a run (Core._take_run), but never
    past an older message outside the segment: here message 3 of a stored segment
    has a row of its own (it was leased and nacked before a restart), so the
    oldest-first order is 0, 1, 2, then it, then 4... and the run also stops at
    the answer's byte budget and the queue's lease cap, leaving the rest in place."""
    core = Core(rand=lambda n: b"\x03" * n)
    core.load_queue("q", dict(DEFAULT_SETTINGS), {})
    offs = [10 * i for i in range(11)]  # ten bodies of 10 bytes each, in the store
    gone = bytearray(10)
    gone[3] = 1
    core.load_segment("q", 100, "p", 0, 10, 0, 10**12, offs, gone, 1)
    core.load_message("q", "p00000003", 103, 1, 0, 10**12, 1, size=10)
    got = core.receive("q", 2, 6)
    assert [(m.id, m.retry) for m, _ in got] == [("p00000000", 0), ("p00000001", 0), ("p00000002", 0),
                                                  ("p00000003", 1), ("p00000004", 0), ("p00000005", 0)]
    assert len({lease.id for _, lease in got}) == 6 and [lease.msg_id for _, lease in got] == [m.id for m, _ in got]
    got = core.receive("q", 2, 10, bytes_max=25)  # two bodies fit; the third waits
    assert [m.id for m, _ in got] == ["p00000006", "p00000007"]
    got = core.receive("q", 2, 10, leases_max=9)  # one more lease allowed
    assert [m.id for m, _ in got] == ["p00000008"]
    assert [m.id for m, _ in core.receive("q", 2, 10)] == ["p00000009"]
    st = core.stats("q", 2)
    assert (st["visible"], st["leased"]) == (0, 10)


def test_acks_a_replica_applies_as_a_run_end_as_one_by_one():
    """A replica holds the messages a primary leased still inside their segments and
    applies a record's acks of consecutive messages in one pass (Core._ack_untaken_run):
    for records of every shape (runs, gaps, repeats, unknown ids, other queues, nacks
    in between, ids past a segment's end) it must end exactly as applying the same
    entries one record each does: the same answers, messages, counters."""
    import random
    rnd = random.Random(7)
    for trial in range(40):
        cores = []
        for _ in range(2):
            lg = Log(Core(rand=lambda n: b"\x04" * n))
            lg.new_epoch(0)
            lg.queue("q")
            lg.queue("r")
            _run(lg, "q", [b"a"] * 50, at=1)
            _run(lg, "q", [b"b"] * 50, at=1, first=0x1f + 50)  # the next segment, its ids following on
            _run(lg, "q", [b"b"] * 20, at=1, prefix="o")
            _run(lg, "r", [b"c"] * 30, at=1, prefix="s")
            if trial % 4 == 0:  # a plain message beside the segments
                lg.send("q", b"one", at=1)
            cores.append(lg)
        ids = [m[0] for m in cores[0].core.messages("q")] + ["p000000ff", "x1", "p0000001F", "p0000001f0"]
        entries = []
        i = rnd.randrange(40)
        for _ in range(rnd.randrange(1, 120)):
            roll = rnd.random()
            if roll < 0.75:
                i += 1  # the next one
            elif roll < 0.85:
                i += rnd.randrange(-3, 4)  # a gap, a step back, a repeat
            else:
                i = rnd.randrange(len(ids))
            i = max(0, min(i, len(ids) - 1))
            queue = "q" if rnd.random() < 0.95 else "r"
            kind = log_pb2.ACK if rnd.random() < 0.9 else log_pb2.NACK
            entries.append((kind, queue, ids[i]))
        whole, one_by_one = cores
        rec = log_pb2.Record()
        for kind, queue, mid in entries:
            rec.settle.entries.add(kind=kind, queue=queue, id=mid)
        got = whole.commit(rec, 2)
        each = [one_by_one.settle(kind, queue, mid, 2) for kind, queue, mid in entries]
        assert got == each, trial
        for name in ("q", "r"):
            assert whole.core.messages(name) == one_by_one.core.messages(name), trial
            assert whole.core.stats(name, 3) == one_by_one.core.stats(name, 3), trial
        assert ({k: (s.left, s.cur, bytes(s.gone)) for k, s in whole.core.dirty.segs.items()}
                == {k: (s.left, s.cur, bytes(s.gone)) for k, s in one_by_one.core.dirty.segs.items()}), trial
        assert whole.core.check() == [] and one_by_one.core.check() == [], trial


def test_a_replica_heaps_stay_bounded(log):
    """A replica never receives or drops, so nothing pops its heaps: stale entries
    (messages acked, nacked back, dropped) are swept once they outnumber the live."""
    log.queue("q")
    for r in range(40):
        ids = _run(log, "q", [b"x"] * 100, at=r)[1].ids()
        ids += [log.send("q", b"one", at=r)[0] for _ in range(20)]
        for m, _ in recv(log, "q", r, 200):
            log.settle(log_pb2.ACK, "q", m.id, r)
    replica = Core(rand=lambda n: b"\x02" * n)
    for data in log.records:
        replica.apply(log_pb2.Record.FromString(data))
    for core in (log.core, replica):
        q = core.queues["q"]
        held = (len(q.retention) + len(q.ready) + len(q.delayed) + len(q.seg_retention) + len(q.seg_ready)
                + len(q.seg_delayed))
        assert q.size == 0 and held <= 2 * (q.size + 1024)  # 40 x 120 sends went through


def test_a_chain_of_derived_failure_queues_ends_at_255_characters(log):
    """Each failure queue made on demand has "{name}.failed" as its own; where that
    name would pass 255 characters (which no route could reach), the queue is its
    own failure queue: an exhausted message stays there, visible again."""
    name = "q" * 80
    while len(name) + len(".failed") <= 255:
        name += ".failed"
    assert len(name) == 255
    log.queue(name, max_retries=0)
    assert log.core.queues[name].failure_queue == name
    mid, _ = log.send(name)
    recv(log, name, 0)
    log.settle(log_pb2.NACK, name, mid, 1)
    assert max(map(len, log.core.queues)) == 255
    [(m, _)] = recv(log, name, 1)
    assert (m.id, m.retry) == (mid, 0)
    assert log.core.stats(name, 1)["failedTotal"] == 0  # nothing moved


def test_a_receive_leases_within_its_byte_budget_oldest_first(log):
    """Bodies of one receive stay within ``bytes_max``: the oldest message always,
    the next ones while they fit; the rest stay visible and untouched, in order,
    single messages and messages of a batch alike."""
    log.queue("q")
    ids = [log.send("q", body=b"x" * 4)[0] for _ in range(3)]
    _run(log, "q", [b"y" * 4, b"z" * 4, b"w" * 4], at=0)
    ids += ["p0000001f", "p00000020", "p00000021"]
    got = log.core.receive("q", 1, 10, bytes_max=10)
    assert [m.id for m, _ in got] == ids[:2]
    assert log.core.stats("q", 1)["visible"] == 4
    got = log.core.receive("q", 1, 10, bytes_max=9)  # a single message out of the heap, then the batch
    assert [m.id for m, _ in got] == ids[2:4]
    got = log.core.receive("q", 1, 10, bytes_max=3)  # the oldest always, even past the budget
    assert [m.id for m, _ in got] == ids[4:5]
    assert [m.id for m, _ in log.core.receive("q", 1, 10)] == ids[5:]
    st = log.core.stats("q", 1)
    assert (st["visible"], st["leased"]) == (0, 6)


def test_the_benchmarks_measure_of_a_dedup_keys_memory_sees_the_key():
    """bench/memory.py ``key_bytes``, which limits.md's figure for a dedup key
    comes from: keys remembered after their messages are acked cost memory
    beyond the same sends without keys, and a longer key costs more."""
    from bench.memory import key_bytes

    short, long_ = key_bytes(n=2000, key_chars=8), key_bytes(n=2000, key_chars=200)
    assert short["bytes_per_key"] > 100, short
    assert long_["bytes_per_key"] > short["bytes_per_key"] + 150, (short, long_)


def test_the_first_epoch_begin_that_names_a_cluster_names_it_for_good():
    """Every node applies the same log, so the first id the log names is every
    node's: an EpochBegin from before ids (none), then a primary's offer, then a
    later primary's different offer (it opened its epoch before applying the
    first) leave the first offer."""
    lg = Log()
    lg.new_epoch(0)  # a build before cluster ids: none named
    assert lg.core.cluster_id == ""
    for offer, at in (("c0ffee", 1), ("beef", 2)):
        lg.epoch += 1
        lg.commit(log_pb2.Record(epoch_begin=log_pb2.EpochBegin(node_id="n2", cluster_id=offer)), at)
        assert lg.core.cluster_id == "c0ffee"
    # and a node that applies the same records from the start adopts the same one
    other = Core(rand=lambda n: b"\x02" * n)
    for data in lg.records:
        other.apply(log_pb2.Record.FromString(data))
    assert other.cluster_id == "c0ffee"


def test_a_send_that_reuses_the_id_of_a_held_message_is_a_broken_invariant():
    """Ids are never reused (a random prefix per process and a counter). A record
    that sent a message under the id of one its queue still holds, plain or inside
    a segment, replaced it in the queue's index: the older one was lost unseen and
    the counts went wrong. Now it raises BrokenInvariant, which stops the node
    (Engine.apply_upto: an internal failure). Ids of messages no longer held are
    not looked at."""
    def fresh():
        lg = Log()
        lg.new_epoch(0)
        lg.queue("q")
        _run(lg, "q", [b"s"] * 10, at=1, first=0x100)  # ids p00000100 .. p00000109
        return lg

    def entry(lg, mid):
        rec = log_pb2.Record()
        rec.send.entries.add(queue="q", id=mid, body=b"again")
        return lg.commit(rec, 2)

    lg = fresh()
    plain, _ = lg.send("q", b"one", at=1)
    with pytest.raises(BrokenInvariant, match="never reused"):
        entry(lg, plain)
    with pytest.raises(BrokenInvariant, match="never reused"):
        entry(fresh(), "p00000105")  # untaken inside the segment
    for first, n in ((0x109, 5), (0xfc, 5), (0x102, 2)):  # a run over the segment's end, start, middle
        with pytest.raises(BrokenInvariant, match="never reused"):
            _run(fresh(), "q", [b"r"] * n, at=2, first=first)
    lg = fresh()
    _run(lg, "q", [b"r"] * 4, at=2, first=0x10a)  # right after it, and right before it: no id shared
    _run(lg, "q", [b"r"] * 4, at=2, first=0xfc)
    acked, _ = lg.send("q", b"two", at=2)
    [(m, _)] = [(m, l) for m, l in recv(lg, "q", 3, 20) if m.id == acked]
    lg.settle(log_pb2.ACK, "q", acked, 3)
    entry(lg, acked)  # no longer held
    assert lg.core.check() == []


def test_check_names_each_invariant_the_state_breaks():
    """Core.check recounts the state from scratch (the load at start runs it, and the
    randomized tests after their runs): each kind of damage is named, and a whole
    state is not."""
    import copy

    lg = Log()
    lg.new_epoch(0)
    lg.queue("q", dedup_window_us=60 * S)
    lg.queue("r")
    _run(lg, "q", [b"s"] * 10, at=1, first=0x100)
    _run(lg, "r", [b"t"] * 5, at=1, prefix="z", first=0x1)
    lg.send("q", b"keyed", at=1, key="k1")
    lg.send("q", b"later", at=1, delay=60 * S)
    got = recv(lg, "q", 2, 3)  # leases: two from the segment, taken out of it
    assert len(got) == 3 and lg.core.check() == []

    def broken(damage) -> str:
        core = copy.deepcopy(lg.core)
        damage(core)
        found = core.check()
        assert found, damage
        return "; ".join(found)

    q = lambda core: core.queues["q"]  # noqa: E731
    leased = got[0][0].id
    assert "counts" in broken(lambda c: setattr(q(c), "n_ready", q(c).n_ready + 1))
    assert "leased without its lease" in broken(lambda c: c.leases.pop(q(c).msgs[leased].lease))
    assert "which it does not lease" in broken(
        lambda c: c.leases.__setitem__(999, Lease(999, b"", "q", "nothing", 1, 10 * S)))

    def twice(c):  # a plain message of q copied into r
        m = copy.copy(next(m for m in q(c).msgs.values() if m.state == "ready"))
        m.queue = "r"
        c.queues["r"].msgs[m.id] = m
        c.queues["r"].n_ready += 1
    assert "is in queues q and r" in broken(twice)

    def also_in_segment(c):  # a plain message under the id of an untaken one
        m = q(c).msgs.pop(next(mid for mid, m in q(c).msgs.items() if m.state == "delayed"))
        m.id = "p00000109"
        q(c).msgs[m.id] = m
    assert "also untaken in a segment" in broken(also_in_segment)

    def overlap(c):  # r holds a segment sharing q's ids
        seg = Segment(500, "r", "p", 0x105, 3, 1, 10 * S, [b"o"] * 3)
        c._add_segment(c.queues["r"], seg, 1)
        c.queues["r"].segs["p"] = [seg]
    assert "share ids from p105" in broken(overlap)

    def left_wrong(c):
        q(c).segs["p"][0].left += 1
        q(c).n_ready += 1
    assert "not what its index says" in broken(left_wrong)
    assert "dedup keys counted" in broken(lambda c: setattr(c, "dedup_n", c.dedup_n + 1))
    assert "negative counter" in broken(lambda c: q(c).counters.__setitem__("acked", -1))


def test_the_first_message_in_line_is_the_next_a_receive_hands_out_and_says_since_when_it_is_visible():
    """Core.first_in_line_since (/metrics: spooler_queue_first_visible_seconds): the
    oldest visible message by send order, a plain one or one inside a segment, and
    the time it became visible; None when nothing is visible. Delayed messages count
    once their time has come, a message past its retention does not, and a nacked
    one keeps its place in line with its new visible time."""
    lg = Log()
    lg.new_epoch(0)
    lg.queue("q", retention_us=100 * S)
    core = lg.core
    assert core.first_in_line_since("q", 1 * S) is None
    lg.send("q", b"later", at=1 * S, delay=10 * S)  # visible at 11 s
    assert core.first_in_line_since("q", 5 * S) is None
    _run(lg, "q", [b"s"] * 3, at=2 * S)
    a, _ = lg.send("q", b"a", at=3 * S)
    assert core.first_in_line_since("q", 5 * S) == 2 * S  # the segment's head
    assert core.first_in_line_since("q", 12 * S) == 11 * S  # the delayed one, sent first, is visible now
    got = recv(lg, "q", 12 * S, 3)
    assert [m.body for m, _ in got] == [b"later", b"s", b"s"]
    assert core.first_in_line_since("q", 12 * S) == 2 * S  # the segment's last message
    (m, lease), = recv(lg, "q", 12 * S)
    assert m.body == b"s" and core.first_in_line_since("q", 12 * S) == 3 * S  # a
    lg.settle(log_pb2.NACK, "q", m.id, 13 * S)  # back in line before a, visible again from 13 s
    assert core.first_in_line_since("q", 14 * S) == 13 * S
    assert [x.body for x, _ in recv(lg, "q", 14 * S)] == [b"s"]  # and it is the next handed out
    assert core.first_in_line_since("q", 14 * S) == 3 * S
    assert core.first_in_line_since("q", 200 * S) is None  # a's retention is over
    assert core.check() == []


def test_a_message_inside_a_segment_is_found_whatever_the_lengths_of_the_queues_id_prefixes():
    """Core._seg_of looks a message up by each length of id prefix the core has seen
    (one dict lookup per length, not a scan of every prefix): segments whose
    prefixes differ in length, one a prefix of another's, are each found, ids
    past 2^32 included, and an id that only looks like one of theirs is not."""
    lg = Log()
    lg.new_epoch(0)
    lg.queue("q")
    _run(lg, "q", [b"a"] * 3, at=1, prefix="p", first=0x10)
    _run(lg, "q", [b"b"] * 3, at=1, prefix="p1", first=0x20)  # "p100000020": also "p" + 0x100000020 (not held)
    _run(lg, "q", [b"c"] * 3, at=1, prefix="p", first=(1 << 32) + 0x10)  # nine hex digits
    _run(lg, "q", [b"d"] * 3, at=1, prefix="f" * 16, first=0xffffffff)
    core, q = lg.core, lg.core.queues["q"]
    assert core.prefix_lengths == (1, 2, 16)
    for mid, body in (("p00000011", b"a"), ("p100000021", b"b"), ("p100000012", b"c"),
                      ("f" * 16 + "ffffffff", b"d"), ("f" * 16 + "100000001", b"d")):
        seg, i = core._seg_of(q, mid)
        assert seg.bodies[i] == body and seg.id_of(i) == mid, mid
    for mid in ("p00000013", "p0000010", "p1000000011", "q00000011", "p0x11", "p1_00000011"):
        assert core._seg_of(q, mid) is None, mid
    assert core.check() == []


def test_purge_drops_every_message_of_a_queue_and_ends_its_leases(log):
    """A purge takes every message of the queue: visible, delayed, leased (its
    lease ends: stale_lease, reason settled), in a compact run or not, taken
    from the run or not. The queue's settings, totals and dedup keys stay
    (purgedTotal counts what went), other queues are untouched, and what is
    sent afterwards is delivered as usual."""
    log.queue("q", max_retries=3, dedup_window_us=60 * S)
    log.queue("other")
    keyed, _ = log.send("q", b"k", at=1, key="key")
    log.send("q", b"later", at=1, delay=30 * S)
    _run(log, "q", [b"r1", b"r2", b"r3", b"r4"], at=2)
    other, _ = log.send("other", b"o", at=2)
    [(held, lease)] = recv(log, "q", 3)
    assert held.id == keyed
    [(m, _)] = recv(log, "q", 3)                       # one message taken out of the run
    log.settle(log_pb2.NACK, "q", m.id, 3)              # and given back as an Msg of its own
    before = log.core.stats("q", 4)
    assert (before["visible"], before["delayed"], before["leased"]) == (4, 1, 1)
    assert log.commit(log_pb2.Record(purge=log_pb2.Purge(queue="q")), 4) == 6
    st = log.core.stats("q", 4)
    assert (st["visible"], st["delayed"], st["leased"], st["purgedTotal"], st["sentTotal"]) == (0, 0, 0, 6, 6)
    assert log.core.queues["q"].settings["max_retries"] == 3
    with pytest.raises(StaleLeaseError) as e:
        log.core.check_lease(lease.epoch, lease.id, lease.nonce, 5)
    assert e.value.reason == "settled"
    assert recv(log, "q", 100 * S) == []               # the delayed one too
    assert log.send("q", b"k again", at=6, key="key") == (keyed, True)   # the key is remembered
    fresh, _ = log.send("q", b"new", at=7)
    assert [m.id for m, _ in recv(log, "q", 8)] == [fresh]
    assert [m.id for m, _ in recv(log, "other", 8)] == [other]
    assert log.core.check() == []
    assert log.commit(log_pb2.Record(purge=log_pb2.Purge(queue="nope")), 9) is None
