"""The drill checker on small synthetic histories: every anomaly alone, counted exactly."""
import json
import time

import pytest

from drills.checker import check, format_table, main
from drills.history import History, expires_at_monotonic

LEASE_S = 10.0


class Sim:
    """Builds a history with explicit times: every call takes (invoke t, completion t)."""

    def __init__(self):
        self.now = 0.0
        self.h = History(clock=lambda: self.now)
        self.node = None  # the node the calls' invokes name, if set

    def _call(self, f, t0, t1, outcome, inv, res, process="c1"):
        self.now = t0
        if self.node is not None:
            inv = {**inv, "node": self.node}
        op = self.h.invoke(process, f, **inv)
        if outcome is None:  # the process died: no completion
            return op
        self.now = t1
        getattr(op, outcome)(**res)
        return op

    def send(self, t0, t1, body, mid=None, outcome="ok", duplicate=False, error=None, queue="q", key=None):
        res = {"id": mid, "duplicate": duplicate} if outcome == "ok" else {"error": error or "timeout"}
        inv = {"queue": queue, "body": body} if key is None else {"queue": queue, "body": body, "key": key}
        return self._call("send", t0, t1, outcome, inv, res, "p1")

    def recv(self, t0, t1, mid, body, token, retry=0, epoch=1, lease_s=LEASE_S, queue="q",
             outcome="ok", **extra):
        res = {"id": mid, "body": body, "token": token, "retry": retry, "epoch": epoch,
               "expires_at": t1 + lease_s, "queue": queue, **extra} if outcome == "ok" else {"error": "timeout"}
        return self._call("receive", t0, t1, outcome, {"queue": queue}, res)

    def purge(self, t0, t1, queue="q", outcome="ok", error=None, purged=1):
        res = {"purged": purged} if outcome == "ok" else {"error": error or "timeout"}
        return self._call("purge", t0, t1, outcome, {"queue": queue}, res, "x1")

    def empty(self, t0, t1, queue="q"):
        return self._call("receive", t0, t1, "ok", {"queue": queue}, {"empty": True})

    def settle(self, f, t0, t1, mid, token, epoch=1, outcome="ok", **res):
        return self._call(f, t0, t1, outcome, {"id": mid, "token": token, "epoch": epoch}, res)

    def nemesis(self, t, f, node, **fields):
        self.now = t
        self.h.nemesis(f, node, **fields)

    def role(self, t, node, epoch, role="primary"):
        self.now = t
        self.h.role(node, role, epoch)

    def final(self, **facts):
        facts.setdefault("node_states", {"n1": "d1", "n2": "d1", "n3": "d1"})
        facts.setdefault("integrity", {"n1": "ok", "n2": "ok", "n3": "ok"})
        facts.setdefault("expired_ids", [])
        facts.setdefault("failed_queue_ids", [])
        self.h.final(**facts)

    def check(self):
        return check(self.h)


def delivered_once(s, t, mid, body, token, epoch=1):
    """send -> receive -> ack, starting at t."""
    s.send(t, t + 0.01, body, mid)
    s.recv(t + 0.1, t + 0.11, mid, body, token, epoch=epoch)
    s.settle("ack", t + 0.2, t + 0.21, mid, token, epoch=epoch)


def received_and_acked(s, t, mid, body, token):
    """receive -> ack of ``mid``, starting at t."""
    s.recv(t, t + 0.01, mid, body, token)
    s.settle("ack", t + 0.1, t + 0.11, mid, token)


REQUIRED = ("lost", "lost_after_delivery", "unexpected", "body_mismatches", "acked_then_redelivered",
            "overlapping_leases", "settles_of_superseded_leases", "retry_count_decreases",
            "failover_retry_increments", "double_primaries", "leases_behind_a_newer_epoch",
            "renewals_behind_a_newer_epoch", "keyed_duplicates", "duplicated_messages",
            "unkeyed_answered_duplicate", "purged_then_delivered")


def test_the_required_zeros_here_are_the_checker_s():
    from drills.checker import REQUIRED_ZEROS
    assert set(REQUIRED) == set(REQUIRED_ZEROS)


def assert_only(report, **expected):
    """Every required zero is 0 except those named, which have exactly the given value."""
    for k in REQUIRED:
        assert report[k] == expected.get(k, 0), (k, report[k])


def clean_sim():
    s = Sim()
    s.role(0.0, "n1", 1)
    delivered_once(s, 1.0, "m1", "b1", "t1")
    # m2: nacked, redelivered with retry 1, acked
    s.send(2.0, 2.01, "b2", "m2")
    s.recv(2.1, 2.11, "m2", "b2", "t2a")
    s.settle("nack", 2.2, 2.21, "m2", "t2a")
    s.recv(2.3, 2.31, "m2", "b2", "t2b", retry=1)
    s.settle("ack", 2.4, 2.41, "m2", "t2b")
    s.empty(2.5, 2.51)
    # m3: leased in epoch 1, primary killed, redelivered in epoch 2 with the same retry count
    s.send(3.0, 3.01, "b3", "m3")
    s.recv(3.1, 3.11, "m3", "b3", "t3a")
    s.nemesis(3.5, "kill", "n1")
    s.send(3.6, 3.7, "b4", outcome="fail", error="unavailable")
    s.role(5.0, "n2", 2)
    s.recv(5.1, 5.11, "m3", "b3", "t3b", epoch=2)
    s.settle("ack", 5.2, 5.21, "m3", "t3b", epoch=2)
    s.settle("ack", 5.3, 5.31, "m3", "t3a", outcome="fail", error="stale_lease", reason="primary_changed")
    delivered_once(s, 6.0, "m5", "b5", "t5", epoch=2)
    s.nemesis(6.5, "restart", "n1")
    s.final()
    return s


def test_clean_history_reports_all_zeros():
    r = clean_sim().check()
    assert_only(r)
    assert r["required_zeros_ok"] is True
    assert r["confirmed_sends"] == 4
    assert r["deliveries"] == 6
    assert r["empty_receives"] == 1
    assert r["unknown_sends"] == 0
    assert r["ids_delivered_more_than_once"] == 2
    assert r["duplicate_deliveries"] == {"nack": 1, "lease_expired": 0, "primary_changed": 1,
                                         "unknown_ack": 0, "answered_late": 0, "other": 0}
    assert r["nodes_agree"] is True and r["integrity_ok"] is True
    fu = r["failover_unavailability"]
    assert fu["count"] == 1 and fu["never_recovered"] == 0
    assert fu["max_s"] == pytest.approx(6.01 - 3.5)
    assert "required zeros: OK" in format_table(r)


def test_lost_send_is_listed():
    s = clean_sim()
    s.send(7.0, 7.01, "b6", "m6")
    r = s.check()
    assert_only(r, lost=1)
    assert r["lost_ids"] == ["m6"]
    assert r["required_zeros_ok"] is False


def test_expired_or_failure_queue_ids_are_not_lost():
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.send(1.1, 1.11, "b2", "m2")
    s.send(1.2, 1.21, "b3", "m3")
    # m3 exhausted its retries and was delivered from the failure queue
    s.recv(2.0, 2.01, "m3", "b3", "t3", queue="q.failed", drain=True)
    s.final(expired_ids=["m1"], failed_queue_ids=["m2"])
    r = s.check()
    assert_only(r)
    assert r["confirmed_sends"] == 3 and r["drain_deliveries"] == 1


def test_unexpected_body_never_sent():
    s = clean_sim()
    s.recv(7.0, 7.01, "mx", "never-sent", "tx", epoch=2)
    r = s.check()
    assert_only(r, unexpected=1)
    assert r["unexpected_details"][0]["why"] == "never_sent"


def test_send_failed_unavailable_but_delivered_is_unexpected():
    s = clean_sim()  # b4 failed with "unavailable" in clean_sim
    s.recv(7.0, 7.01, "m4", "b4", "t4", epoch=2)
    r = s.check()
    assert_only(r, unexpected=1)
    assert r["unexpected_details"][0]["why"] == "send_failed"
    assert r["unknown_sends"] == 0


def test_unknown_send_that_appeared():
    s = clean_sim()
    s.send(7.0, 9.0, "b7", outcome="unknown", error="timeout")
    s.send(7.1, 9.1, "b8", outcome="fail", error="operation_unconfirmed")  # failed-with-unknown
    s.send(7.2, 9.2, "b9", outcome=None)  # the producer died: no completion
    s.recv(10.0, 10.01, "m8", "b8", "t8", epoch=2)
    s.settle("ack", 10.1, 10.11, "m8", "t8", epoch=2)
    r = s.check()
    assert_only(r)
    assert r["unknown_sends"] == 3
    assert r["unknown_sends_appeared"] == 1


def test_acked_then_redelivered():
    s = clean_sim()
    s.recv(7.0, 7.01, "m1", "b1", "t1b", epoch=2)  # m1 was acked at 1.21
    r = s.check()
    # (and the ack of t1 succeeded while a later lease exists: counted there too)
    assert_only(r, acked_then_redelivered=1, settles_of_superseded_leases=1)
    assert r["acked_then_redelivered_details"][0]["id"] == "m1"


def test_a_receive_concurrent_with_a_successful_ack_is_still_an_anomaly():
    # acked_then_redelivered needs the definite order (the receive invoked after the ack
    # was answered). But a successful ack ends the message whichever came first: granted
    # before the ack took effect, the new lease overlapped a live one (in a newer epoch:
    # an older primary still honoured its lease); granted after, the acked message came
    # back. Either way it is counted, as a settle of a superseded lease.
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1", epoch=1)
    s.recv(2.0, 2.2, "m1", "b1", "t1b", epoch=2)
    s.settle("ack", 2.05, 2.1, "m1", "t1", epoch=1)
    r = s.check()
    assert_only(r, settles_of_superseded_leases=1)
    assert r["duplicate_deliveries"]["primary_changed"] == 1
    s.recv(2.15, 2.3, "m1", "b1", "t1c", epoch=3)  # invoked after the ack completed
    assert_only(s.check(), acked_then_redelivered=1, settles_of_superseded_leases=2)


def test_an_ack_that_failed_ends_nothing_and_the_new_epoch_may_deliver_again():
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1", epoch=1)
    s.recv(2.0, 2.2, "m1", "b1", "t1b", epoch=2)
    s.settle("ack", 2.05, 2.3, "m1", "t1", epoch=1, outcome="fail", error="stale_lease", reason="primary_changed")
    s.settle("ack", 2.4, 2.41, "m1", "t1b", epoch=2)
    assert_only(s.check())


def test_overlapping_leases_in_one_epoch():
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1")  # lease until 11.11
    s.recv(2.0, 2.01, "m1", "b1", "t1b")  # granted while t1 still valid
    s.settle("ack", 2.1, 2.11, "m1", "t1b")
    r = s.check()
    assert_only(r, overlapping_leases=1)
    assert r["duplicate_deliveries"]["other"] == 1
    assert r["overlapping_leases_details"][0]["overlap_s"] == pytest.approx(9.1)
    [x] = r["duplicate_other_examples"]
    assert (x["id"], x["previous"]["received_at"]) == ("m1", 1.11)
    assert x["to_previous_end_s"] == pytest.approx(9.1)


def test_a_redelivery_within_the_slack_of_the_lease_end_is_other_and_says_how_close():
    """Granted again just before the earlier lease's end as the client saw it: neither an
    expiry nor an overlap (the slack allows for the two clocks), so its cause is
    ``other``; the example it leaves says how close to the end it came, and which
    settles the earlier lease had."""
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1")  # lease until 11.11
    s.settle("renew", 3.0, 3.01, "m1", "t1", outcome="fail", error="unavailable")
    s.recv(11.1, 11.1095, "m1", "b1", "t2")
    s.settle("ack", 11.2, 11.21, "m1", "t2")
    r = s.check()
    assert_only(r)
    assert r["duplicate_deliveries"]["other"] == 1
    [x] = r["duplicate_other_examples"]
    assert x["to_previous_end_s"] == pytest.approx(0.0005)
    assert [(o["f"], o["outcome"], o["done"]) for o in x["previous_settles"]] == [("renew", "fail", 3.01)]


def test_a_lease_whose_answer_came_after_its_redelivery_was_answered_late_not_other():
    """Seed 12104: a receive's answer was held on the way and came after the
    message's next delivery (retry 1, granted once the first lease ended, then
    acked). In the answers' order the first lease follows an acked one with a
    lower count: put down to no cause (``other``). It was granted first, asked
    for before the other was answered, and its lease had ended by then: its
    cause is ``answered_late``, and no required zero counts it."""
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 3.0, "m1", "b1", "t1", lease_s=-0.5)  # leased at once, ended 2.5, answered at 3.0
    s.recv(2.55, 2.6, "m1", "b1", "t2", retry=1)
    s.settle("ack", 2.65, 2.7, "m1", "t2")
    r = s.check()
    assert_only(r)
    assert r["duplicate_deliveries"]["answered_late"] == 1 and r["duplicate_deliveries"]["other"] == 0


def test_an_older_epochs_lease_answered_after_a_newer_epochs_delivery_was_answered_late():
    """Seed 13653: a receive leased by the primary of epoch 1 just before it was
    SIGSTOPped was answered only after SIGCONT, after the primary of epoch 2 had
    delivered the message again (at once, as a primary change makes it visible)
    and that delivery was acked. In the answers' order the epoch-1 lease follows
    the epoch-2 one, with its lease still running at the other's grant (so not
    "answered late" by its expiry) and a lower epoch (so not "primary changed"):
    it was put down to no cause. A lower epoch is the proof that it was granted
    first: answered late."""
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 3.6, "m1", "b1", "t1", epoch=1, lease_s=-0.7)  # granted by 1.9, until 2.9; answered at 3.6
    s.recv(2.0, 2.05, "m1", "b1", "t2", epoch=2)
    s.settle("ack", 2.06, 2.08, "m1", "t2", epoch=2)
    r = s.check()
    assert_only(r)
    assert r["duplicate_deliveries"]["answered_late"] == 1 and r["duplicate_deliveries"]["other"] == 0, \
        r["duplicate_deliveries"]


def test_redelivery_after_lease_expiry_is_not_overlapping():
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1", lease_s=1.0)  # expires 2.11
    s.recv(2.0, 2.2, "m1", "b1", "t1b", retry=1)  # long poll answered after the expiry
    s.settle("ack", 2.3, 2.31, "m1", "t1b")
    r = s.check()
    assert_only(r)
    assert r["duplicate_deliveries"]["lease_expired"] == 1


def test_renewed_lease_overlap_is_detected():
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1", lease_s=1.0)  # expires 2.11
    s.settle("renew", 1.5, 1.51, "m1", "t1", expires_at=2.51)
    s.recv(2.2, 2.3, "m1", "b1", "t1b", retry=1)  # after the original expiry, before the renewed one
    r = s.check()
    assert r["overlapping_leases"] == 1
    assert r["failover_retry_increments"] == 1  # the renewed lease had not expired: no +1 due


def test_redelivery_in_higher_epoch_is_not_overlapping():
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1", epoch=1)
    s.recv(2.0, 2.01, "m1", "b1", "t1b", epoch=2)
    s.settle("ack", 2.1, 2.11, "m1", "t1b", epoch=2)
    r = s.check()
    assert_only(r)
    assert r["duplicate_deliveries"]["primary_changed"] == 1


def test_a_lease_of_an_older_epoch_granted_after_a_newer_one_is_counted():
    """One node leasing at a time: a receive answered from epoch 2 before another
    receive was even sent, which then got a lease of epoch 1, means epoch 1's
    primary still handed out leases while epoch 2's did."""
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.send(1.02, 1.03, "b2", "m2")
    s.send(1.04, 1.05, "b3", "m3")
    s.recv(2.0, 2.01, "m1", "b1", "t1", epoch=2)
    s.recv(2.5, 2.51, "m2", "b2", "t2", epoch=1)  # sent after the epoch-2 answer came
    s.recv(2.005, 2.6, "m3", "b3", "t3", epoch=1)  # sent before it: may have been granted first
    r = s.check()
    assert_only(r, leases_behind_a_newer_epoch=1)
    assert r["leases_behind_a_newer_epoch_details"][0]["older"]["epoch"] == 1


def test_a_renewal_of_an_older_epoch_asked_after_a_newer_lease_was_granted_is_counted():
    """A renewal is lease time granted too: the old primary renewing a lease of
    epoch 1 for a renewal sent after a lease of epoch 2 was answered means two
    primaries granted lease time at once. One sent before that answer may have
    been granted first (not counted), and so may one refused, or of unknown
    outcome."""
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.send(1.02, 1.03, "b2", "m2")
    s.recv(1.1, 1.11, "m1", "b1", "t1", epoch=1)
    s.settle("renew", 1.9, 2.2, "m1", "t1", epoch=1, expires_at=12.2)  # sent before the newer answer
    s.recv(2.0, 2.01, "m2", "b2", "t2", epoch=2)
    s.settle("renew", 2.5, 2.51, "m1", "t1", epoch=1, expires_at=12.5)  # sent after it: counted
    s.settle("renew", 2.6, 2.61, "m1", "t1", epoch=1, outcome="fail", error="unavailable")
    s.settle("renew", 2.7, 2.71, "m1", "t1", epoch=1, outcome="fail", error="timeout")
    s.settle("ack", 3.0, 3.01, "m2", "t2", epoch=2)
    r = s.check()
    assert_only(r, renewals_behind_a_newer_epoch=1)
    [d] = r["renewals_behind_a_newer_epoch_details"]
    assert d["renewed"]["asked_at"] == 2.5 and d["newer"]["epoch"] == 2, d
    assert "renewals_behind_a_newer_epoch (first 1):" in format_table(r)


def test_redelivery_after_concurrent_nack_is_not_overlapping():
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1")
    s.recv(1.5, 2.05, "m1", "b1", "t1b", retry=1)  # long poll, answered right after the nack
    s.settle("nack", 2.0, 2.1, "m1", "t1")  # completed after the second receive
    r = s.check()
    assert_only(r)
    assert r["duplicate_deliveries"]["nack"] == 1


def test_failover_retry_increment():
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1", epoch=1)
    s.recv(2.0, 2.01, "m1", "b1", "t1b", retry=1, epoch=2)  # primary change must not add 1
    r = s.check()
    assert_only(r, failover_retry_increments=1)
    assert r["failover_retry_increments_details"][0]["allowed"] == 0


@pytest.mark.parametrize("nack_outcome", ["ok", "unknown"])
def test_retry_increments_after_nack_and_expiry_are_legitimate(nack_outcome):
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1")
    s.settle("nack", 1.2, 1.21, "m1", "t1", outcome=nack_outcome)
    s.recv(1.3, 1.31, "m1", "b1", "t2", retry=1, lease_s=0.5)  # expires 1.81
    s.recv(2.0, 2.01, "m1", "b1", "t3", retry=2, epoch=1)
    s.recv(2.1, 2.11, "m1", "b1", "t4", retry=2, epoch=2)  # failover: same count
    s.settle("ack", 2.2, 2.21, "m1", "t4", epoch=2)
    r = s.check()
    assert_only(r)
    assert r["duplicate_deliveries"] == {"nack": 1, "lease_expired": 1, "primary_changed": 1,
                                         "unknown_ack": 0, "answered_late": 0, "other": 0}


def test_two_increments_after_one_nack_is_counted():
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1")
    s.settle("nack", 1.2, 1.21, "m1", "t1")
    s.recv(1.3, 1.31, "m1", "b1", "t2", retry=2)
    r = s.check()
    assert_only(r, failover_retry_increments=1)


def test_receive_of_unknown_outcome_excuses_one_increment():
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1", lease_s=1.0)
    s.settle("nack", 1.2, 1.21, "m1", "t1")
    s.recv(1.3, 3.3, None, None, None, outcome="unknown")  # may have leased m1; that lease expired
    s.recv(4.0, 4.01, "m1", "b1", "t2", retry=2, lease_s=1.0)
    assert_only(s.check())
    s.recv(5.0, 5.01, "m1", "b1", "t3", retry=4, epoch=2, lease_s=1.0)  # nothing excuses +2 here
    r = s.check()
    assert_only(r, failover_retry_increments=1)
    assert r["unknown_receives"] == 1


def test_a_receive_of_unknown_outcome_too_recent_to_have_expired_excuses_nothing():
    """A hidden lease raises the count only by expiring: a receive that began less
    than a lease (10 s here) before the redelivery cannot have done it."""
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1")
    s.settle("nack", 1.2, 1.21, "m1", "t1")
    s.recv(1.3, 3.3, None, None, None, outcome="unknown")
    s.recv(4.0, 4.01, "m1", "b1", "t2", retry=2)
    assert_only(s.check(), failover_retry_increments=1)


def test_first_delivery_with_nonzero_retry_is_counted():
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1", retry=1, epoch=2)
    assert_only(s.check(), failover_retry_increments=1)


def test_unknown_ack_cause():
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1", epoch=1)
    s.settle("ack", 1.2, 3.2, "m1", "t1", outcome="unknown", error="timeout")
    s.recv(2.0, 2.01, "m1", "b1", "t2", epoch=1)
    r = s.check()
    # an ack never makes a message visible again: had it taken effect before the second
    # grant, the acked message came back; if not, t1 was still live: an overlap either way
    assert_only(r, overlapping_leases=1)
    assert r["duplicate_deliveries"]["unknown_ack"] == 1


def _client_partition_history(ack_answered: bool):
    """The links between the clients and n1 faulted from 2.0 to 6.0 (answers held):
    an ack applied or not, whose 204 never came; a send stored whose 201 never came
    (delivered later), one never stored; a receive in flight when the fault began."""
    s = Sim()
    s.role(0.0, "n1", 1)
    s.node = "n1"
    s.send(1.0, 1.01, "b1", "m1")  # before the fault: not one of its calls
    s.recv(1.1, 1.11, "m1", "b1", "t1", lease_s=2.0)
    s.recv(1.5, 4.5, None, None, None, outcome="unknown")  # in flight when it began
    s.nemesis(2.0, "client_partition", "n1")
    if ack_answered:
        s.settle("ack", 2.1, 2.11, "m1", "t1")
    else:
        s.settle("ack", 2.1, 5.1, "m1", "t1", outcome="unknown", error="operation_unconfirmed")
    s.send(2.2, 5.2, "b2", outcome="unknown", error="operation_unconfirmed")
    s.send(2.3, 5.3, "b3", outcome="unknown", error="operation_unconfirmed")
    s.node = "n2"
    s.send(2.4, 2.41, "b4", "m4")  # another node's: not one of its calls
    s.recv(4.0, 4.01, "m1", "b1", "t1b", retry=1)  # t1 expired at 3.11
    s.settle("ack", 4.1, 4.11, "m1", "t1b")
    s.nemesis(6.0, "client_heal", "n1")
    s.recv(6.5, 6.51, "m2", "b2", "t2")
    s.settle("ack", 6.6, 6.61, "m2", "t2")
    s.recv(6.7, 6.71, "m4", "b4", "t4")
    s.settle("ack", 6.8, 6.81, "m4", "t4")
    s.node = "n1"
    s.send(6.9, 6.91, "b5", "m5")  # after the heal: not one of its calls
    s.recv(6.95, 6.96, "m5", "b5", "t5")
    s.settle("ack", 6.97, 6.98, "m5", "t5")
    s.node = "n3"
    s.nemesis(7.0, "client_partition", "n3")
    s.send(7.5, 7.9, "b6", outcome="unknown", error="operation_unconfirmed")
    s.nemesis(8.0, "client_heal", None)  # the final heal names no node: it ends every fault
    s.send(8.5, 8.51, "b7", "m7")
    s.recv(8.6, 8.61, "m7", "b7", "t7")
    s.settle("ack", 8.7, 8.71, "m7", "t7")
    s.final()
    return s.check()


def test_answers_lost_in_a_client_partition_are_unknown_and_judged_as_usual():
    """A send whose 201 was held is maybe landed (delivered or not, never lost or
    unexpected); an ack whose 204 was held is no confirmed ack, so its message seen
    again after its lease expired is no anomaly; the calls that crossed the faulted
    links are counted (evidence that the fault caught some)."""
    r = _client_partition_history(ack_answered=False)
    assert_only(r)
    assert r["duplicate_deliveries"]["lease_expired"] == 1
    assert r["unknown_sends"] == 3 and r["unknown_sends_appeared"] == 1
    assert r["client_partitions"] == 2
    assert r["client_partition_calls"] == 5
    assert r["client_partition_unknowns"] == 5
    assert r["client_partition_unknowns_by_call"] == {"receive": 1, "ack": 1, "send": 3}
    assert r["client_partition_unknown_sends_delivered"] == 1
    assert "client_partition_calls" in format_table(r)


def test_an_ack_answered_in_a_client_partition_then_seen_again_is_counted():
    """The same history with the held ack's 204 delivered: a confirmed ack, then its
    message delivered again."""
    r = _client_partition_history(ack_answered=True)
    assert_only(r, acked_then_redelivered=1, settles_of_superseded_leases=1)
    assert r["client_partition_calls"] == 5 and r["client_partition_unknowns"] == 4


def _late_receive_history(late: bool):
    """The links between the clients and n1 hold every byte from 2.0 to 6.0. A receive
    sent to n1 at 2.5 ends unknown at 5.5 (its client gave up). m1 is sent at 5.8, by
    another node. At the heal, with ``late``, the link delivers the held receive: it
    leases m1 at about 6.0 (lease 1 s), nobody sees that lease, it expires, and m1
    comes back at 9.0 with its retry count raised by one."""
    s = Sim()
    s.role(0.0, "n1", 1)
    s.node = "n1"
    s.nemesis(2.0, "client_partition", "n1", **({"late_effect_s": 5.0} if late else {}))
    s.recv(2.5, 5.5, None, None, None, outcome="unknown")
    s.node = "n2"
    s.send(5.8, 5.81, "b1", "m1")
    s.nemesis(6.0, "client_heal", "n1", **({"late": True} if late else {}))
    s.recv(9.0, 9.01, "m1", "b1", "t1", retry=1, lease_s=1.0)
    s.settle("ack", 9.1, 9.11, "m1", "t1")
    s.final()
    return s.check()


def test_a_receive_a_client_link_delivered_late_may_lease_after_its_client_gave_up():
    """A receive held by a link that delivers what it held at its heal may lease up to
    the heal plus ``late_effect_s``, long after it ended unknown: a message sent after
    that may have been leased by it, so its retry count raised by that lease's expiry
    is excused. Healed with a reset, the receive could only have leased before it
    ended, before the message existed: the same raised count is an anomaly."""
    r = _late_receive_history(late=True)
    assert_only(r)
    assert r["client_partition_late_calls"] == 1
    assert "client_partition_late_calls" in format_table(r)
    r = _late_receive_history(late=False)
    assert_only(r, failover_retry_increments=1)
    assert r["client_partition_late_calls"] == 0


def _late_fault_history(recv_node: str, final_heal: bool):
    """As ``_late_receive_history(late=True)``, but the unknown receive went to
    ``recv_node``, and with ``final_heal`` the late fault is not healed by its own
    round (a late heal of n1) but by the run's final heal (no node, a reset)."""
    s = Sim()
    s.role(0.0, "n1", 1)
    s.node = recv_node
    s.nemesis(2.0, "client_partition", "n1", late_effect_s=5.0)
    s.recv(2.5, 5.5, None, None, None, outcome="unknown")
    s.node = "n2"
    s.send(5.8, 5.81, "b1", "m1")
    if final_heal:
        s.nemesis(6.0, "client_heal", None, phase="heal")
    else:
        s.nemesis(6.0, "client_heal", "n1", late=True)
    s.recv(9.0, 9.01, "m1", "b1", "t1", retry=1, lease_s=1.0)
    s.settle("ack", 9.1, 9.11, "m1", "t1")
    s.final()
    return s.check()


def test_only_calls_to_the_late_node_and_a_late_heal_may_take_effect_late():
    """The late window excuses no more than it must: an unknown receive sent to
    another node than the one whose links held it crossed no held link, and a late
    fault healed by the run's final heal (a reset) delivered nothing late; in both,
    the receive could only have leased while in flight, before m1 existed, so m1's
    raised retry count is an anomaly, as without any late fault."""
    assert_only(_late_fault_history("n1", final_heal=False))  # the window itself
    r = _late_fault_history("n2", final_heal=False)
    assert_only(r, failover_retry_increments=1)
    assert r["client_partition_late_calls"] == 0
    r = _late_fault_history("n1", final_heal=True)
    assert_only(r, failover_retry_increments=1)
    assert r["client_partition_late_calls"] == 0


def test_a_call_that_names_no_node_may_have_crossed_the_late_links():
    """The SDK's calls name no node (the SDK picks its node itself): one that ended
    unknown while a late fault held some node's links may have crossed them, so it
    gets the late window; healed by the final reset, it does not."""
    r = _late_fault_history(None, final_heal=False)
    assert_only(r)
    assert r["client_partition_late_calls"] == 1
    assert_only(_late_fault_history(None, final_heal=True), failover_retry_increments=1)


def test_a_client_partition_never_healed_lasts_to_the_end_and_none_counts_nothing():
    s = Sim()
    s.node = "n1"
    s.send(1.0, 1.5, "b1", outcome="unknown")
    r = s.check()
    assert (r["client_partitions"], r["client_partition_calls"]) == (0, 0)
    assert "client_partition_calls" not in format_table(r)
    s.nemesis(2.0, "client_partition", "n1")
    s.send(9.0, 9.5, "b2", outcome="unknown")
    s.send(9.6, 9.7, "b3", "m3")
    r = s.check()
    assert (r["client_partitions"], r["client_partition_calls"], r["client_partition_unknowns"]) == (1, 2, 1)


def test_double_primary():
    s = clean_sim()
    s.role(3.6, "n3", 1)  # n1 claimed epoch 1 at t=0
    s.role(5.5, "n2", 2)  # the same node again is fine
    r = s.check()
    assert_only(r, double_primaries=1)
    assert r["double_primaries_details"] == [{"epoch": 1, "nodes": ["n1", "n3"]}]


def test_nodes_disagree_and_integrity():
    s = Sim()
    delivered_once(s, 1.0, "m1", "b1", "t1")
    s.final(node_states={"n1": "a", "n2": "a", "n3": "b"})
    r = s.check()
    assert_only(r)
    assert r["nodes_agree"] is False and r["integrity_ok"] is True
    assert r["required_zeros_ok"] is False

    s2 = Sim()
    delivered_once(s2, 1.0, "m1", "b1", "t1")
    s2.final(integrity={"n1": "ok", "n2": "corrupt"})
    r2 = s2.check()
    assert r2["nodes_agree"] is True and r2["integrity_ok"] is False
    assert r2["required_zeros_ok"] is False


def test_missing_final_facts_do_not_fail():
    s = Sim()
    delivered_once(s, 1.0, "m1", "b1", "t1")
    r = s.check()
    assert r["nodes_agree"] is None and r["integrity_ok"] is None
    assert r["required_zeros_ok"] is True


def test_failover_unavailability_percentiles():
    s = Sim()
    t = 0.0
    for i, gap in enumerate([0.5, 1.0, 2.0, 4.0]):
        t += 10.0
        s.nemesis(t, ["kill", "stop", "partition", "power_loss"][i], "n1")
        s.send(t - 0.1, t + 0.5, f"in-flight-{i}", f"x{i}")  # invoked before the nemesis: ignored
        s.send(t + 0.1, t + gap, f"b{i}", f"m{i}")
        s.recv(t + 5, t + 5.01, f"m{i}", f"b{i}", f"t{i}")
        s.recv(t + 5.1, t + 5.11, f"x{i}", f"in-flight-{i}", f"tx{i}")
    s.nemesis(t + 6.0, "heal", None)
    s.nemesis(t + 7.0, "kill", "n2")  # nothing written after it
    fu = s.check()["failover_unavailability"]
    assert fu["count"] == 5 and fu["never_recovered"] == 1
    assert fu["p50_s"] == pytest.approx(1.0)
    assert fu["p99_s"] == pytest.approx(4.0)
    assert fu["max_s"] == pytest.approx(4.0)


def test_jsonl_round_trip(tmp_path):
    s = clean_sim()
    path = tmp_path / "h.jsonl"
    s.h.to_jsonl(str(path))
    back = History.from_jsonl(str(path))
    assert back.events == s.h.events
    assert check(back) == s.check()
    # op ids keep increasing after a reload
    op = back.invoke("c9", "send", queue="q", body="new")
    assert op.op > max(e.get("op", 0) for e in s.h.events)


def test_main_exit_codes(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    s = clean_sim()
    s.h.final(drained=True)  # the whole drill's final facts: drained, node states, integrity
    s.h.to_jsonl(str(good))
    assert main([str(good)]) == 0
    out = capsys.readouterr().out
    assert "required zeros: OK" in out and "unchecked" not in out

    s = clean_sim()
    s.send(7.0, 7.01, "b6", "m6")
    bad = tmp_path / "bad.jsonl"
    s.h.to_jsonl(str(bad))
    assert main([str(bad)]) == 1
    out = capsys.readouterr().out
    assert "required zeros: FAIL" in out and "m6" in out
    assert main(["--json", str(bad)]) == 1
    assert json.loads(capsys.readouterr().out)["lost_ids"] == ["m6"]


def test_op_handle_completes_once_and_records_unknown_on_exception():
    h = History()
    op = h.invoke("c1", "send", queue="q", body="b")
    op.ok(id="m", duplicate=False)
    with pytest.raises(RuntimeError):
        op.fail(error="unavailable")
    with pytest.raises(ValueError):
        with h.invoke("c1", "ack", id="m", token="t", epoch=1):
            raise ValueError("boom")
    types = [e["type"] for e in h.events]
    assert types == ["invoke", "ok", "invoke", "unknown"]
    assert all(a["t"] <= b["t"] for a, b in zip(h.events, h.events[1:]))


def test_expires_at_conversion():
    now_wall = time.time()
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now_wall + 30)) + ".000000Z"
    got = expires_at_monotonic(iso)
    assert abs(got - (time.monotonic() + 30)) < 1.5


def test_large_history_is_fast():
    s = Sim()
    n = 5000
    for i in range(n):
        t = float(i)
        s.send(t, t + 0.01, f"b{i}", f"m{i}")
        s.recv(t + 0.1, t + 0.11, f"m{i}", f"b{i}", f"t{i}")
        s.settle("ack", t + 0.2, t + 0.21, f"m{i}", f"t{i}")
    start = time.process_time()  # (this process's CPU: a loaded machine's waits are not counted)
    r = s.check()
    elapsed = time.process_time() - start
    assert r["confirmed_sends"] == n and r["required_zeros_ok"]
    assert elapsed < 4.0, elapsed  # about 0.2 s here; a check quadratic in the history takes minutes


def test_answer_held_past_its_lease_expiry_is_the_older_grant():
    """A partition held a receive's answer until after its lease had expired; the redelivery
    (retry 1) was answered first. Neither a retry increment nor an overlap."""
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.05, 5.0, "m1", "b1", "t1", lease_s=-2.0)  # expired at 3.0, answered at 5.0
    s.recv(3.1, 3.11, "m1", "b1", "t2", retry=1)  # redelivered after that expiry
    s.settle("ack", 5.1, 5.11, "m1", "t1", outcome="fail", error="stale_lease", reason="expired")
    s.settle("ack", 5.5, 5.51, "m1", "t2")
    r = s.check()
    assert_only(r)
    assert r["ids_delivered_more_than_once"] == 1


def test_answer_held_but_its_lease_still_live_is_still_counted():
    """The same, but the held lease had not expired when the redelivery was answered: the
    +1 is unexplained and the two leases overlapped."""
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.05, 5.0, "m1", "b1", "t1", lease_s=-0.5)  # expires 4.5
    s.recv(3.1, 3.11, "m1", "b1", "t2", retry=1)
    s.settle("ack", 5.5, 5.51, "m1", "t2")
    assert_only(s.check(), failover_retry_increments=1, overlapping_leases=1)


def test_concurrent_long_poll_does_not_excuse_a_double_increment():
    """A long poll answered after an earlier delivery overlapped it in time, but its smaller
    retry count shows it was granted first: it excuses nothing later."""
    s = Sim()
    s.send(0.5, 0.51, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1")
    s.settle("nack", 1.2, 1.21, "m1", "t1")
    s.recv(1.0, 1.25, "m1", "b1", "t2", retry=1)  # a long poll waiting since 1.0
    s.settle("nack", 1.3, 1.31, "m1", "t2")
    s.recv(1.4, 1.41, "m1", "b1", "t3", retry=3)  # +2 after one nack
    assert_only(s.check(), failover_retry_increments=1)


# --- holes found by an audit of the checker (2026-12-02) ------------------------------------

def test_a_message_dropped_after_its_nack_is_lost_once_the_history_is_drained():
    """Delivered, nacked with a 204, never delivered again although the final drain
    emptied the queue: lost after delivery. An ack that may have landed (unknown), the
    failure queue, or a history without a completed drain excuse it."""
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1")
    s.settle("nack", 1.2, 1.21, "m1", "t1")
    s.send(2.0, 2.01, "b2", "m2")
    s.recv(2.1, 2.11, "m2", "b2", "t2")
    s.settle("ack", 2.2, 3.2, "m2", "t2", outcome="unknown", error="timeout")
    s.final(drained=True)
    r = s.check()
    assert_only(r, lost_after_delivery=1)
    assert r["lost_after_delivery_ids"] == ["m1"] and r["required_zeros_ok"] is False
    s2 = Sim()
    s2.send(1.0, 1.01, "b1", "m1")
    s2.recv(1.1, 1.11, "m1", "b1", "t1")
    s2.final(drained=True, failed_queue_ids=["m1"])
    assert_only(s2.check())
    s3 = Sim()
    s3.send(1.0, 1.01, "b1", "m1")
    s3.recv(1.1, 1.11, "m1", "b1", "t1")
    s3.final()  # no completed drain: nothing to conclude
    assert_only(s3.check())


def test_a_lease_acked_after_a_later_lease_was_answered_is_counted():
    """t1 expired and t2 was granted (retry 1); then an ack of t1 succeeded. The node
    honoured a lease it had replaced (same epoch), or an older primary's lease (newer
    epoch). A renewal or nack of t1 that succeeded after t2 was answered likewise."""
    for f in ("ack", "renew", "nack"):
        s = Sim()
        s.send(1.0, 1.01, "b1", "m1")
        s.recv(1.1, 1.11, "m1", "b1", "t1", lease_s=1.0)
        s.recv(2.5, 2.51, "m1", "b1", "t2", retry=1)
        extra = {"expires_at": 20.0} if f == "renew" else {}
        s.settle(f, 3.0, 3.01, "m1", "t1", **extra)
        s.settle("ack", 3.5, 3.51, "m1", "t2")
        r = s.check()
        assert_only(r, settles_of_superseded_leases=1)
        assert r["settles_of_superseded_leases_details"][0]["settled"] == f


def test_a_nack_of_a_lease_answered_before_its_redelivery_is_not_superseded():
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1")
    s.settle("nack", 1.2, 1.4, "m1", "t1")
    s.recv(1.3, 1.5, "m1", "b1", "t2", retry=1)  # granted once the nack took effect
    s.settle("ack", 1.6, 1.61, "m1", "t2")
    assert_only(s.check())


def test_an_overlap_with_a_lease_two_deliveries_back_is_counted():
    """A (epoch 1, live), B (epoch 2), then C (epoch 1) granted while A was live: the
    neighbours differ in epoch, but A and C overlap."""
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "tA", epoch=1)
    s.recv(1.5, 1.6, "m1", "b1", "tB", epoch=2)
    s.recv(1.55, 1.7, "m1", "b1", "tC", epoch=1)
    r = s.check()
    assert r["overlapping_leases"] == 1, r["overlapping_leases_details"]
    assert r["overlapping_leases_details"][0]["previous"]["epoch"] == 1


def test_a_delivery_without_an_epoch_is_checked_for_overlap_as_the_same_epoch():
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1", epoch=1)
    s.recv(2.0, 2.01, "m1", "b1", "t2", epoch=None)
    assert_only(s.check(), overlapping_leases=1)


def test_a_retry_count_that_falls_is_counted():
    """Two nacks committed (retry 2); after a failover the message comes back with
    retry 0: the increments were lost."""
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1")
    s.settle("nack", 1.2, 1.21, "m1", "t1")
    s.recv(1.3, 1.31, "m1", "b1", "t2", retry=1)
    s.settle("nack", 1.4, 1.41, "m1", "t2")
    s.recv(1.5, 1.51, "m1", "b1", "t3", retry=2)
    s.recv(3.0, 3.01, "m1", "b1", "t4", retry=0, epoch=2)
    s.settle("ack", 3.1, 3.11, "m1", "t4", epoch=2)
    r = s.check()
    assert_only(r, retry_count_decreases=1)


def test_a_body_delivered_under_the_wrong_id_fails_the_run():
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1")
    s.send(1.0, 1.01, "b2", "m2")
    s.recv(1.1, 1.11, "m1", "b2", "t1")
    s.settle("ack", 1.2, 1.21, "m1", "t1")
    r = s.check()
    assert r["body_mismatches"] == 1 and r["required_zeros_ok"] is False


def test_elections_the_nodes_logged_count_for_double_primaries(tmp_path):
    """The observer polls the nodes' role every 100 ms or so and can miss a primary
    that served less; the drill also reads every election the nodes logged (a
    replaced node's old log included), and two winners of one epoch fail the run."""
    from drills.cluster import primaries_from_logs
    (tmp_path / "n1").mkdir()
    (tmp_path / "n2-disk2").mkdir()
    (tmp_path / "n1" / "n1.log").write_text(
        "2026-12-02 10:00:00,000 INFO spooler.engine node n1 elected primary in epoch 1\n"
        "2026-12-02 10:00:05,000 INFO spooler.engine node n1 elected primary in epoch 3\n")
    (tmp_path / "n2-disk2" / "n2.log").write_text(
        "2026-12-02 10:00:02,000 INFO spooler.engine node n2 elected primary in epoch 2\n"
        "2026-12-02 10:00:06,000 INFO spooler.engine node n2 elected primary in epoch 3\n")
    got = primaries_from_logs(str(tmp_path))
    assert got == {1: {"n1"}, 2: {"n2"}, 3: {"n1", "n2"}}
    s = Sim()
    for epoch, nodes in got.items():
        for nid in nodes:
            s.role(7.0, nid, epoch)
    s.final()
    r = s.check()
    assert r["double_primaries"] == 1 and r["double_primaries_details"][0]["epoch"] == 3


def test_the_snapshot_installs_the_nodes_logged_are_counted(tmp_path):
    from drills.cluster import snapshot_installs_from_logs
    (tmp_path / "n1").mkdir()
    (tmp_path / "n3-disk2").mkdir()
    (tmp_path / "n1" / "n1.log").write_text(
        "2026-12-05 10:00:00,000 INFO spooler.replication installed a snapshot from n2: log to lsn 9, applied 9\n"
        "2026-12-05 10:00:01,000 INFO spooler.engine node n1 elected primary in epoch 3\n")
    (tmp_path / "n3-disk2" / "n3.log").write_text(
        "2026-12-05 10:00:02,000 WARNING spooler.replication refused a snapshot from n1: it could not be "
        "installed (NotADBError('file is not a database')); this node's store is unchanged\n"
        "2026-12-05 10:00:03,000 INFO spooler.replication installed a snapshot from n1: log to lsn 12, applied 12\n"
        "2026-12-07 10:00:04,000 WARNING spooler.replication refused a snapshot from n1: what arrived does not "
        "hash to the digest it was sent with; this node's store is unchanged\n"
        "2026-12-07 10:00:05,000 INFO spooler.replication a snapshot from n2 came without a digest (a primary "
        "before 0.4.45): it is checked as a store only\n")
    assert snapshot_installs_from_logs(str(tmp_path)) == {"installed": 2, "refused": 1, "refused_digest": 1,
                                                          "without_digest": 1}


@pytest.mark.parametrize("jump_s", [0.0, 7.0])
def test_a_wall_clock_that_jumps_ahead_of_the_history_ends_leases_that_much_earlier(jump_s):
    """A virtual machine paused for 7 s (seen here in a CI run): the monotonic clock
    of ``t`` stood still, the wall clock caught up on resume, and the primary, whose
    lease ends are its wall time (guarantees S4), ended a 2 s lease granted just
    before: the message was delivered again at once, its retry count raised. Judged
    in ``t`` alone that is an overlap and an increment no consumer caused; the wall
    time stamped beside ``t`` (``w``) shows the jump. The control, no jump: the same
    deliveries overlap."""
    s = Sim()
    skew = [0.0]
    s.h = History(clock=lambda: s.now, wall=lambda: 1_000.0 + s.now + skew[0])
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1", lease_s=2.0)      # ends at 3.11 in t, as converted then
    skew[0] = jump_s
    s.recv(1.2, 1.25, "m1", "b1", "t1b", retry=1)         # delivered again, one more retry
    s.settle("ack", 1.3, 1.31, "m1", "t1b")
    r = s.check()
    if jump_s:
        assert_only(r)
        assert r["duplicate_deliveries"]["lease_expired"] == 1
    else:
        assert_only(r, overlapping_leases=1, failover_retry_increments=1)


def test_a_history_on_the_monotonic_clock_stamps_the_wall_time_beside_it():
    before = time.time()
    ev = History().append({"type": "nemesis", "f": "kill"})
    assert before <= ev["w"] <= time.time() and isinstance(ev["t"], float)
    assert "w" not in History(clock=lambda: 5.0).append({"type": "nemesis", "f": "kill"})


def test_two_messages_for_one_dedup_key_are_a_keyed_duplicate():
    s = Sim()
    s.send(0.0, 0.2, "k-body", outcome="fail", error="operation_unconfirmed", key="k1")  # it landed as m1
    s.send(0.5, 0.6, "k-body", "m2", key="k1")  # the resend was stored again: dedup failed
    received_and_acked(s, 1.0, "m1", "k-body", "t1")
    received_and_acked(s, 1.2, "m2", "k-body", "t2")
    s.final(drained=True)
    r = s.check()
    assert_only(r, keyed_duplicates=1)
    assert r["keyed_duplicates_details"] == [{"key": "k1", "ids": ["m1", "m2"]}]
    assert r["keyed_sends"] == 2


def test_a_keyed_resend_answered_duplicate_confirms_the_first_message():
    """The resend's answer (duplicate, the first id) is one message, no anomaly;
    and it confirms that message: never delivered, it is lost."""
    s = Sim()
    s.send(0.0, 0.2, "a", outcome="fail", error="operation_unconfirmed", key="ka")
    s.send(0.5, 0.6, "a", "m1", duplicate=True, key="ka")
    s.recv(1.0, 1.01, "m1", "a", "t1")
    s.settle("ack", 1.1, 1.11, "m1", "t1")
    s.send(2.0, 2.2, "b", outcome="fail", error="operation_unconfirmed", key="kb")
    s.send(2.5, 2.6, "b", "m2", duplicate=True, key="kb")  # confirmed, then never delivered
    s.final(drained=True)
    r = s.check()
    assert_only(r, lost=1)
    assert r["lost_ids"] == ["m2"] and r["confirmed_sends"] == 2
    assert r["keyed_sends"] == 4 and r["keyed_answered_duplicate"] == 2


# --- found by a review of the checker (2026-12-06); each failed before its fix ------------

@pytest.mark.parametrize("answered", [True, False])
def test_one_unkeyed_send_stored_as_two_messages_is_a_duplicated_message(answered):
    """Each unkeyed body is sent by one call: delivered under two ids, the send was
    stored twice (an unsafe resend in a client or a node). Per id, each was
    delivered once and acked, so nothing else saw it. Whether the send's answer
    came or was lost."""
    s = Sim()
    s.role(0, "n1", 1)
    if answered:
        s.send(1.0, 1.01, "b1", "m1")
    else:
        s.send(1.0, 4.0, "b1", outcome="unknown")
    received_and_acked(s, 4.1, "m1", "b1", "t1")
    received_and_acked(s, 4.3, "m1x", "b1", "t2")
    s.final(drained=True)
    r = s.check()
    assert_only(r, duplicated_messages=1)
    assert r["duplicated_messages_details"][0]["ids"] == ["m1", "m1x"]


def test_a_keyed_body_sent_twice_is_judged_by_its_key_not_as_a_duplicated_message():
    s = Sim()
    s.role(0, "n1", 1)
    s.send(1.0, 1.01, "k1", "m1", key="k1")
    s.send(2.0, 2.01, "k1", "m1", duplicate=True, key="k1")
    s.recv(2.1, 2.11, "m1", "k1", "t1")
    s.settle("ack", 2.2, 2.21, "m1", "t1")
    s.final(drained=True)
    assert_only(s.check())


def test_a_lease_ending_after_its_primary_was_killed_adds_nothing_to_the_count():
    """The primary of epoch 1 is killed 0.3 s before the lease's end: it cannot
    count that expiry, and the next primary drops the lease without a retry. A
    redelivery answered after the lease's end with retry 1 is a failover retry
    increment (it was taken for an expiry before: the lease had ended by the
    answer). The control: the same with the kill after the lease's end."""
    def run(kill_t):
        s = Sim()
        s.role(0, "n1", 1)
        s.send(1.0, 1.01, "b1", "m1")
        s.recv(1.1, 1.11, "m1", "b1", "t1", epoch=1, lease_s=2.0)  # its lease ends at 3.11
        s.nemesis(kill_t, "kill", "n1", role="primary", epoch=1)
        s.role(kill_t + 0.2, "n2", 2)
        s.recv(kill_t + 0.25, max(kill_t + 0.4, 3.2), "m1", "b1", "t2", retry=1, epoch=2, lease_s=2.0)
        s.settle("ack", 5.0, 5.01, "m1", "t2", epoch=2)
        s.final(drained=True)
        return s.check()
    assert_only(run(2.8), failover_retry_increments=1)
    assert_only(run(3.3))  # expired at 3.11 while n1 was alive: it may have counted it


def test_a_lease_ending_after_a_newer_epoch_was_seen_adds_nothing_to_the_count():
    s = Sim()
    s.role(0, "n1", 1)
    s.send(1.0, 1.01, "b1", "m1")
    s.recv(1.1, 1.11, "m1", "b1", "t1", epoch=1, lease_s=2.0)  # ends at 3.11
    s.role(2.9, "n2", 2)  # n1 was cut off: a new primary by 2.9
    s.recv(3.0, 3.5, "m1", "b1", "t2", retry=1, epoch=2, lease_s=2.0)
    s.settle("ack", 3.6, 3.61, "m1", "t2", epoch=2)
    s.final(drained=True)
    assert_only(s.check(), failover_retry_increments=1)


def test_one_receive_of_unknown_outcome_explains_one_increment_not_one_per_message():
    """A receive answers one message: if it timed out, it may have leased one
    whose expiry added one to its count, not one to each of five."""
    s = Sim()
    s.role(0, "n1", 1)
    for i in range(5):
        s.send(1.0 + i * 0.01, 1.005 + i * 0.01, f"b{i}", f"m{i}")
    s.recv(1.2, 4.2, None, None, None, outcome="unknown", lease_s=1.0)
    for i in range(5):
        t = 5.0 + i * 0.1
        s.recv(t, t + 0.01, f"m{i}", f"b{i}", f"t{i}", retry=1, lease_s=1.0)
        s.settle("ack", t + 0.02, t + 0.03, f"m{i}", f"t{i}")
    s.final(drained=True)
    r = s.check()
    assert_only(r, failover_retry_increments=4)
    # and two unknown receives explain two
    s = Sim()
    s.role(0, "n1", 1)
    for i in range(2):
        s.send(1.0 + i * 0.01, 1.005 + i * 0.01, f"b{i}", f"m{i}")
        s.recv(1.2 + i * 0.01, 4.2, None, None, None, outcome="unknown", lease_s=1.0)
    for i in range(2):
        s.recv(5.0 + i, 5.01 + i, f"m{i}", f"b{i}", f"t{i}", retry=1, lease_s=1.0)
        s.settle("ack", 5.02 + i, 5.03 + i, f"m{i}", f"t{i}")
    s.final(drained=True)
    assert_only(s.check())


def test_the_matching_of_increments_to_receives_does_not_depend_on_their_order():
    """Receive A (early) could explain either message's increment, receive B
    (late) only the second's: matched greedily in order, A went to the first and
    B to the second; the other order of checking must find the same."""
    from drills.checker import unexplained_increments
    a, b = (1.0, 2.0), (6.0, 7.0)
    receives = {"q": sorted([a, b])}
    early_only = (1, ({"q"}, 0.5, 3.0), {"who": "early"})   # receives starting before 3.0 and ending after 0.5
    both = (1, ({"q"}, 0.5, 8.0), {"who": "late"})
    assert unexplained_increments([both, early_only], receives) == []
    assert unexplained_increments([early_only, both], receives) == []
    assert unexplained_increments([both, early_only, both], receives) == [{"who": "late", "allowed": 0}]


def test_one_answer_held_past_its_lease_does_not_switch_off_the_hidden_lease_guard():
    """A receive of unknown outcome can add one only once its lease has expired:
    one begun too recently before a redelivery excuses nothing. The lease's
    length is what the answers show of it; one answer held past its own lease
    (a partition, a stopped process) used to bring it to 0 for the whole run."""
    def run(late_elsewhere):
        s = Sim()
        s.role(0, "n1", 1)
        s.send(1.0, 1.01, "b1", "m1")
        s.recv(1.1, 1.11, "m1", "b1", "t1", lease_s=LEASE_S)
        s.settle("nack", 1.2, 1.21, "m1", "t1")
        s.recv(2.0, 2.5, None, None, None, outcome="unknown")  # too recent: its lease is 10 s
        s.recv(3.0, 3.01, "m1", "b1", "t2", retry=2)
        s.settle("ack", 3.1, 3.11, "m1", "t2")
        if late_elsewhere:
            s.send(40.0, 40.01, "b9", "m9")
            s.recv(41.0, 60.0, "m9", "b9", "t9", lease_s=-9.0)  # answered 9 s after its lease ended
            s.settle("ack", 60.1, 60.11, "m9", "t9", outcome="fail", error="stale_lease")
            s.recv(61.0, 61.01, "m9", "b9", "t9b", retry=1)
            s.settle("ack", 61.1, 61.11, "m9", "t9b")
        s.final(drained=True)
        return s.check()
    assert_only(run(False), failover_retry_increments=1)
    assert_only(run(True), failover_retry_increments=1)


def test_a_message_whose_send_answer_was_lost_still_keeps_one_body():
    s = Sim()
    s.role(0, "n1", 1)
    s.send(1.0, 4.0, "b1", outcome="unknown")
    s.send(1.0, 1.01, "b2", "m2")
    s.recv(1.1, 1.11, "m2", "b2", "tz")
    s.settle("ack", 1.2, 1.21, "m2", "tz")
    s.recv(4.1, 4.11, "m1", "b1", "t1")
    s.settle("nack", 4.2, 4.21, "m1", "t1")
    s.recv(4.3, 4.31, "m1", "b2", "t2", retry=1)  # m1 now carries b2
    s.settle("ack", 4.4, 4.41, "m1", "t2")
    s.final(drained=True)
    r = s.check()
    assert r["body_mismatches"] == 1 and r["required_zeros_ok"] is False


def test_an_unkeyed_send_answered_duplicate_is_counted_and_checked_for_loss():
    s = Sim()
    s.role(0, "n1", 1)
    s.send(1.0, 1.01, "b1", "m1", duplicate=True)
    s.final(drained=True)
    r = s.check()
    assert_only(r, unkeyed_answered_duplicate=1, lost=1)
    assert r["confirmed_sends"] == 1


def test_main_fails_a_history_that_leaves_checks_out_unless_told_it_is_partial(tmp_path, capsys):
    """A drill that did not drain, or recorded no node states or integrity results,
    passes those checks vacuously; the command line says so and exits 1 for it."""
    undrained = tmp_path / "undrained.jsonl"
    clean_sim().h.to_jsonl(str(undrained))  # node states and integrity, no drain
    assert main([str(undrained)]) == 1
    out = capsys.readouterr().out
    assert "required zeros: OK" in out and "unchecked: not drained" in out
    assert main(["--partial", str(undrained)]) == 0
    capsys.readouterr()
    assert main(["--json", str(undrained)]) == 1
    assert json.loads(capsys.readouterr().out)["unchecked"] == ["not drained: lost_after_delivery not checked"]

    bare = Sim()
    delivered_once(bare, 1.0, "m1", "b1", "t1")
    bare.h.final(drained=True)  # drained, but neither node states nor integrity
    path = tmp_path / "bare.jsonl"
    bare.h.to_jsonl(str(path))
    assert main([str(path)]) == 1
    out = capsys.readouterr().out
    assert "unchecked: no node states" in out and "unchecked: no integrity results" in out

    unfinished = Sim()
    delivered_once(unfinished, 1.0, "m1", "b1", "t1")
    path = tmp_path / "unfinished.jsonl"
    unfinished.h.to_jsonl(str(path))
    assert main([str(path)]) == 1
    assert "unchecked: no final record" in capsys.readouterr().out

    s = clean_sim()  # a real anomaly fails whatever --partial says
    s.send(7.0, 7.01, "b6", "m6")
    bad = tmp_path / "bad.jsonl"
    s.h.to_jsonl(str(bad))
    assert main(["--partial", str(bad)]) == 1


def test_a_purge_excuses_only_what_it_may_have_taken_of_its_own_queue():
    """Confirmed, never delivered (or delivered, never acked, in a drained history):
    purged, not lost, when a purge of its queue that succeeded or may have took effect
    after its send began; a message of another queue, one sent after the purge's
    answer, and a purge refused for certain excuse nothing."""
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1", queue="pq")          # taken by the purge
    s.send(1.0, 1.01, "b2", "m2", queue="q")           # another queue: lost
    s.send(1.5, 1.6, "b3", "m3", queue="pq")           # concurrent with the purge: may be taken
    s.send(1.2, 1.21, "b4", "m4", queue="pq")
    s.recv(1.3, 1.31, "m4", "b4", "t4", queue="pq")    # leased, the purge ended its lease
    s.purge(1.4, 1.55, queue="pq", purged=3)
    s.send(2.0, 2.01, "b5", "m5", queue="pq")          # after the purge: lost
    s.purge(3.0, 3.1, queue="q", outcome="fail", error="unavailable")  # refused: took nothing
    s.final(drained=True)
    r = s.check()
    assert_only(r, lost=2)
    assert sorted(r["lost_ids"]) == ["m2", "m5"]
    assert r["purges"] == 1 and r["purged"] == 3
    s2 = Sim()  # a purge of unknown outcome may have taken effect up to its (lack of an) answer
    s2.send(1.0, 1.01, "b1", "m1", queue="pq")
    s2.purge(0.5, 4.0, queue="pq", outcome="unknown")
    assert_only(s2.check())


def test_a_message_delivered_after_a_purge_that_confirmed_it_gone_is_counted():
    """Sent (answered) before a purge of its queue was asked for, received by a call
    asked for after the purge was answered: the purge did not take it."""
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1", queue="pq")
    s.send(1.0, 1.01, "b2", "m2", queue="pq")
    s.recv(1.1, 1.11, "m2", "b2", "t2", queue="pq")
    s.purge(2.0, 2.1, queue="pq", purged=2)
    s.recv(2.2, 2.21, "m1", "b1", "t1", queue="pq")
    s.settle("ack", 2.3, 2.31, "m1", "t1")
    s.settle("ack", 2.4, 2.41, "m2", "t2", outcome="fail", error="stale_lease")  # its lease ended
    s.final(drained=True)
    r = s.check()
    assert_only(r, purged_then_delivered=1)
    assert r["purged_then_delivered_details"][0]["id"] == "m1"
    assert "purged_then_delivered" in format_table(r) and r["required_zeros_ok"] is False
    # not counted: the send answered after the purge was asked for (it may follow it),
    # the receive asked for before the purge's answer (it may precede it), a purge of
    # unknown outcome, a purge of another queue, a delivery from the failure queue
    for send_t, recv_t, outcome, pq, rq in ((1.95, 2.2, "ok", "pq", "pq"), (1.0, 2.05, "ok", "pq", "pq"),
                                            (1.0, 2.2, "unknown", "pq", "pq"), (1.0, 2.2, "ok", "q", "pq"),
                                            (1.0, 2.2, "ok", "pq", "pq.failed")):
        s = Sim()
        s.send(send_t, send_t + 0.06 if send_t > 1.9 else 1.01, "b1", "m1", queue="pq")
        s.purge(2.0, 2.1, queue=pq, outcome=outcome)
        s.recv(recv_t, recv_t + 0.01, "m1", "b1", "t1", queue=rq)
        s.settle("ack", 2.3, 2.31, "m1", "t1")
        s.final(drained=True)
        assert_only(s.check())


def test_a_purge_excuses_a_delivered_message_only_if_it_may_have_come_after_its_last_delivery():
    """Found by a review (2026-12-07): a message delivered after a purge was answered
    survived it; dropped after that delivery, it is lost after delivery, not purged.
    And a keyed message whose first attempt's answer was lost, purged, then answered
    "duplicate" to a resend after the purge, may be what the purge took (its first
    attempt stored it); a purge of unknown outcome may take effect at any later time."""
    s = Sim()
    s.send(1.0, 1.01, "b1", "m1", queue="pq")
    s.purge(0.9, 1.5, queue="pq")
    s.recv(3.0, 3.01, "m1", "b1", "t1", queue="pq")
    s.settle("nack", 3.1, 3.11, "m1", "t1")
    s.final(drained=True)
    r = s.check()
    assert_only(r, lost_after_delivery=1)
    assert r["purged"] == 0
    s = Sim()  # the same with a purge that may have come after the delivery: purged
    s.send(1.0, 1.01, "b1", "m1", queue="pq")
    s.recv(3.0, 3.01, "m1", "b1", "t1", queue="pq")
    s.purge(3.05, 3.2, queue="pq")
    s.final(drained=True)
    r = s.check()
    assert_only(r)
    assert r["purged"] == 1
    s = Sim()  # keyed: stored by an attempt whose answer was lost, purged, answered to a resend
    s.send(1.0, 1.5, "b1", outcome="unknown", queue="pq", key="k")
    s.purge(2.0, 2.1, queue="pq")
    s.send(3.0, 3.01, "b1", "m1", duplicate=True, queue="pq", key="k")
    s.final(drained=True)
    r = s.check()
    assert_only(r)
    assert r["purged"] == 1
    s = Sim()  # a purge of unknown outcome, given up on at 2.1, may commit after a send at 3.0
    s.purge(2.0, 2.1, queue="pq", outcome="unknown")
    s.send(3.0, 3.01, "b1", "m1", queue="pq")
    s.final(drained=True)
    r = s.check()
    assert_only(r)
    assert r["purged"] == 1
    s = Sim()  # and one that succeeded, answered before the send, cannot
    s.purge(2.0, 2.1, queue="pq")
    s.send(3.0, 3.01, "b1", "m1", queue="pq")
    s.final(drained=True)
    assert_only(s.check(), lost=1)
