"""Reads a whole drill history (see ``history.py``) and counts anomalies, Jepsen-style.

``check(events)`` returns a report dict; ``format_table(report)`` renders it;
``python -m tests.drills.checker history.jsonl [--json] [--slack S] [--partial]`` prints the
table and exits 1 when a required zero is not zero (or node states disagree / integrity
failed), and also when the history lacks the final facts some checks need (a completed
drain, node states, integrity results) unless ``--partial`` says to judge what it holds.

Every judgement is made so that an indeterminate outcome can only hide an anomaly,
never invent one: a call whose outcome is unknown is assumed to have taken effect when
that excuses what followed (an unknown nack excuses a retry increment and ends the
lease), and lease-overlap needs a second receive that *completed* before the first
lease's expiry. An unknown call held by a client link that delivered what it held late
(``client_late``) may take effect until the time the drill allows it after the heal.
Deliveries of one message are taken in the order their answers arrived;
an answer held up past its own lease's expiry (a partition) may be an older grant than
the one before it, which the retry-count and overlap rules allow for. A purge of a queue
(``f: purge``) that succeeded or may have excuses from "lost" only the messages of that
queue it may have taken (one of unknown outcome may take effect at any later time); one
that succeeded must have taken every message answered before it was asked for
(``purged_then_delivered``). Cost: O(n log n) in
the number of events (sorting and bisects), times the deliveries of one message for the
retry-count rule.
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
from collections import defaultdict, deque
from typing import Any, Iterable

try:  # run as ``python -m tests.drills.checker`` or imported as ``drills.checker``
    from .history import History
except ImportError:  # pragma: no cover - executed as a plain script
    from history import History  # type: ignore

# Error kinds that prove a call had no effect. Any other kind on a ``fail``
# (operation_unconfirmed, internal, a transport error, none) leaves the outcome unknown.
DEFINITE_FAILURE_KINDS = frozenset({
    "unavailable", "invalid_argument", "unauthenticated", "forbidden", "queue_not_found",
    "not_found", "method_not_allowed", "stale_lease", "message_too_large",
})
# Nemeses after which clients may be unable to write until the cluster recovers.
DISRUPTIVE_NEMESES = frozenset({"kill", "stop", "term", "partition", "power_loss", "disk_loss", "fsync_error",
                                "write_error", "upgrade"})
DUPLICATE_CAUSES = ("nack", "lease_expired", "primary_changed", "unknown_ack", "answered_late", "other")
REQUIRED_ZEROS = ("lost", "lost_after_delivery", "unexpected", "body_mismatches", "acked_then_redelivered",
                  "overlapping_leases", "settles_of_superseded_leases", "retry_count_decreases",
                  "failover_retry_increments", "double_primaries", "leases_behind_a_newer_epoch",
                  "renewals_behind_a_newer_epoch", "keyed_duplicates", "duplicated_messages",
                  "unkeyed_answered_duplicate", "purged_then_delivered")
# Expiry stamps come from the server's wall clock converted to the monotonic clock; the
# two clock reads of the conversion differ by microseconds. Overlap must exceed this.
DEFAULT_SLACK_S = 0.001
# How much a lease's length seen from its answer (expiry minus answer) may exceed
# the queue's lease: the expiry's conversion between clocks and timer steps.
LEASE_SEEN_SLACK_S = 0.05
# A kill is recorded just before its signal is sent: the killed primary may still
# commit for this long after the recorded time.
KILL_SLACK_S = 0.1
# Nemeses after which the node named (when it was the primary of ``epoch``) commits
# nothing more in that epoch.
PRIMARY_ENDING_NEMESES = frozenset({"kill", "power_loss", "disk_loss"})
DETAILS_MAX = 50  # examples kept per anomaly list (counts are always exact)

INF = float("inf")


class _Op:
    __slots__ = ("f", "process", "inv_t", "inv", "type", "done_t", "res", "late_t")

    def __init__(self, f: str, process: Any, inv_t: float, inv: dict):
        self.f, self.process, self.inv_t, self.inv = f, process, inv_t, inv
        self.type: str | None = None  # None: never completed
        self.done_t = INF
        self.res: dict = {}
        self.late_t = 0.0  # held by a link that delivered it late: may take effect until then

    @property
    def effect_t(self) -> float:
        """The latest time this call may have taken effect: its completion, or for an
        unknown call held by a client link that delivered what it held at its heal, the
        end of what the drill allows such a call after the heal (``late_effect_s``)."""
        return max(self.done_t, self.late_t)  # (late_t is set on unknown calls alone)

    @property
    def outcome(self) -> str:
        """"ok", "fail" (definitely no effect) or "unknown"."""
        if self.type == "ok":
            return "ok"
        if self.type == "fail" and self.res.get("error") in DEFINITE_FAILURE_KINDS:
            return "fail"
        return "unknown"


class _Delivery:
    __slots__ = ("id", "token", "epoch", "retry", "expires_at", "inv_t", "ok_t", "queue",
                 "body", "drain", "process")

    def __init__(self, op: _Op):
        r = op.res
        self.id = r.get("id")
        self.token = r.get("token")
        self.epoch = r.get("epoch")
        self.retry = r.get("retry")
        self.expires_at = r.get("expires_at")
        self.queue = r.get("queue", op.inv.get("queue"))
        self.body = r.get("body")
        self.drain = bool(r.get("drain") or op.inv.get("drain"))
        self.inv_t, self.ok_t, self.process = op.inv_t, op.done_t, op.process

    def brief(self) -> dict:
        return {"id": self.id, "epoch": self.epoch, "retry": self.retry, "received_at": self.ok_t,
                "expires_at": self.expires_at, "queue": self.queue, "process": self.process}


def _behind_a_newer_epoch(deliveries: list, asked: list, epoch_of) -> Iterable:
    """(item, newer delivery) for each of ``asked`` (sorted by invoke time; each with
    ``inv_t``) whose epoch (``epoch_of``; None: not known, skipped) is older than the
    newest epoch of a delivery answered before the item was asked (``deliveries``
    sorted by answer time): one sweep of both lists."""
    newest: Any = None  # (epoch, delivery) of the newest epoch answered so far
    done = iter(deliveries)
    nxt = next(done, None)
    for item in asked:
        while nxt is not None and nxt.ok_t < item.inv_t:
            if nxt.epoch is not None and (newest is None or nxt.epoch > newest[0]):
                newest = (nxt.epoch, nxt)
            nxt = next(done, None)
        epoch = epoch_of(item)
        if epoch is not None and newest is not None and epoch < newest[0]:
            yield item, newest[1]


class _Intervals:
    """Count intervals [start, end] that intersect (lo, hi): start < hi and end > lo.

    Every interval with end <= lo also has start < hi (start <= end <= lo < hi), so the
    count is #(start < hi) - #(end <= lo): two bisects."""

    def __init__(self, pairs: Iterable[tuple[float, float]]):
        pairs = list(pairs)
        self.starts = sorted(p[0] for p in pairs)
        self.ends = sorted(p[1] for p in pairs)

    def count(self, lo: float, hi: float) -> int:
        if hi <= lo:
            return 0
        return bisect.bisect_left(self.starts, hi) - bisect.bisect_right(self.ends, lo)


def _percentile(sorted_values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (p in percent) of an ascending list."""
    if not sorted_values:
        return None
    k = math.ceil(p / 100.0 * len(sorted_values)) - 1
    return sorted_values[max(0, min(len(sorted_values) - 1, k))]


def _keep(lst: list, item: Any) -> None:
    if len(lst) < DETAILS_MAX:
        lst.append(item)


def check(events: Iterable[dict], slack_s: float = DEFAULT_SLACK_S) -> dict:
    """Analyse a whole history (a ``History`` or an iterable of event dicts)."""
    events = getattr(events, "events", events)  # a History (whichever import path) or a list
    timed, finals = [], []
    for ev in events:
        if ev.get("type") == "final":
            finals.append(ev)
        elif "t" in ev:
            timed.append(ev)
    timed.sort(key=lambda e: e["t"])  # stable; already sorted when recorded by History

    # -- pass 1: pair invokes with completions -------------------------------------------
    ops: dict[tuple, _Op] = {}
    order: list[_Op] = []
    nemeses: list[dict] = []
    roles: list[dict] = []
    orphan_completions = 0
    for ev in timed:
        typ = ev.get("type")
        if typ == "invoke":
            op = _Op(ev.get("f"), ev.get("process"), ev["t"], ev)
            ops[(ev.get("process"), ev.get("op"))] = op
            order.append(op)
        elif typ in ("ok", "fail", "unknown"):
            op = ops.get((ev.get("process"), ev.get("op")))
            if op is None or op.type is not None:
                orphan_completions += 1
                continue
            op.type, op.done_t, op.res = typ, ev["t"], ev
        elif typ == "nemesis":
            nemeses.append(ev)
        elif typ == "role":
            roles.append(ev)

    # Lease ends are the primary's wall-clock time; the history's ``t`` is the clients'
    # monotonic clock, and an expiry was converted to it when its answer arrived. When
    # the wall clock moves against ``t`` later (a virtual machine paused: the monotonic
    # clock stood still while real time passed, and the wall clock catches up), the
    # primary ends the lease that much earlier in ``t``. Events stamped with ``w``
    # (their wall time) say by how much: ``seen`` moves an expiry into the ``t`` of the
    # moment it is compared at. Without ``w`` nothing moves.
    off_t = [ev["t"] for ev in timed if "w" in ev]
    off_v = [ev["w"] - ev["t"] for ev in timed if "w" in ev]

    def off_at(t: float) -> float:
        if not off_t:
            return 0.0
        return off_v[max(0, bisect.bisect_right(off_t, t) - 1)]

    def seen(expiry: float, src_t: float, at_t: float) -> float:
        """``expiry``, converted to ``t`` when the event at ``src_t`` was recorded, as
        the wall clock places it in ``t`` at ``at_t``."""
        return expiry + off_at(src_t) - off_at(at_t)

    late_calls = mark_late_calls(order, nemeses)

    # -- pass 2: index by function ----------------------------------------------------------
    sends: list[_Op] = []
    deliveries: list[_Delivery] = []
    unknown_receives: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    settles: dict[Any, list[_Op]] = defaultdict(list)  # lease token -> ack/nack/renew ops
    purges: dict[Any, list[_Op]] = defaultdict(list)  # queue -> its purges that succeeded or may have
    empty_receives = 0
    for op in order:
        if op.f == "purge":
            if op.outcome != "fail":
                purges[op.inv.get("queue")].append(op)
        elif op.f == "send":
            sends.append(op)
        elif op.f == "receive":
            oc = op.outcome
            if oc == "ok":
                if op.res.get("empty") or op.res.get("id") is None:
                    empty_receives += 1
                else:
                    deliveries.append(_Delivery(op))
            elif oc == "unknown":  # may have created a lease nobody saw
                unknown_receives[op.inv.get("queue")].append((op.inv_t, op.effect_t))
        elif op.f in ("ack", "nack", "renew"):
            settles[op.inv.get("token")].append(op)
    deliveries.sort(key=lambda d: d.ok_t)

    # -- one node leasing at a time: a lease granted in an epoch older than one
    # already granted (answered before this receive was even sent) means two
    # primaries were handing out leases at the same time ------------------------
    behind, behind_details = 0, []
    for d, newer in _behind_a_newer_epoch(deliveries, sorted(deliveries, key=lambda x: x.inv_t),
                                          lambda d: d.epoch):
        behind += 1
        _keep(behind_details, {"older": d.brief(), "newer": newer.brief()})
    # ... and none extended: a renewal is lease time granted too, so a lease of an
    # epoch older than one already granted (answered before the renewal was sent)
    # renewed means the older primary still granted lease time while the newer leased
    renews_behind, renews_behind_details = 0, []
    renewed = sorted((op for ops in settles.values() for op in ops if op.f == "renew" and op.outcome == "ok"),
                     key=lambda o: o.inv_t)
    for op, newer in _behind_a_newer_epoch(deliveries, renewed, lambda o: o.inv.get("epoch")):
        renews_behind += 1
        _keep(renews_behind_details, {"renewed": {"id": op.inv.get("id"), "epoch": op.inv["epoch"],
                                                  "asked_at": op.inv_t, "answered_at": op.done_t,
                                                  "process": op.process},
                                      "newer": newer.brief()})
    by_token = {d.token: d for d in deliveries if d.token is not None}

    # A lower bound on each queue's lease length: every lease of a queue is as long
    # (the drill's receives name no lease of their own), and each answer shows at
    # least that much of its lease left (expiry minus answer; the grant came before
    # the answer), so the longest seen, less a little for the clocks' conversion. A
    # hidden lease raises the count only by expiring, so only a receive that began
    # at least that long before ``hi`` counts. (The shortest seen was used: a single
    # answer held past its own lease, as a partition or a stopped process makes
    # one, brought it to 0 for the whole run.)
    lease_min: dict = {}
    for d in deliveries:
        if d.expires_at is not None:
            left = d.expires_at - d.ok_t - LEASE_SEEN_SLACK_S
            lease_min[d.queue] = max(left, lease_min.get(d.queue, left))

    def hidden_window(queues: set, lo: float, hi: float) -> tuple:
        """(queues, lo, latest start): the receives of unknown outcome that may have
        leased the message in (lo, hi) and whose lease may have expired (+1) before hi
        are those in these queues in flight somewhere in (lo, latest start)."""
        qs = set(queues) | {None}
        shortest = min((lease_min[q] for q in qs if q in lease_min), default=0.0)
        return qs, lo, hi - max(0.0, shortest)

    # The receives of unknown outcome, each of which may have leased one message
    # (a receive answers one), whose expiry then added one to its count: one such
    # receive explains at most one increment in the whole run (matched below).
    hidden_recv: dict[Any, list] = {q: sorted(v) for q, v in unknown_receives.items()}

    # When each epoch's primary committed last, at the latest: when a newer epoch was
    # seen (a role event, or a lease granted in it), or when that primary was killed.
    # A lease of that epoch expiring later was dropped by the next primary, which
    # adds nothing to the count (a failover redelivers without a retry).
    primary_of: dict = {}
    for r in roles:
        if r.get("role") == "primary" and isinstance(r.get("epoch"), int):
            primary_of.setdefault(r["epoch"], set()).add(r.get("node"))
    seen_epochs = sorted([(r["t"], r["epoch"]) for r in roles if r.get("role") == "primary"
                          and isinstance(r.get("epoch"), int)]
                         + [(d.ok_t, d.epoch) for d in deliveries if isinstance(d.epoch, int)])
    epoch_end_cache: dict = {}

    def epoch_end(ep: Any) -> float:
        if not isinstance(ep, int):
            return INF
        if ep not in epoch_end_cache:
            end = next((t for t, e2 in seen_epochs if e2 > ep), INF)
            for nm in nemeses:
                if (nm.get("f") in PRIMARY_ENDING_NEMESES and nm.get("role") == "primary"
                        and nm.get("epoch") == ep and nm.get("node") in primary_of.get(ep, {nm.get("node")})):
                    end = min(end, nm["t"] + KILL_SLACK_S)
            epoch_end_cache[ep] = end
        return epoch_end_cache[ep]

    # -- sends ---------------------------------------------------------------------------------
    final: dict = {}
    for fe in finals:
        for k, v in fe.items():
            if isinstance(v, dict) and isinstance(final.get(k), dict):
                final[k] = {**final[k], **v}
            elif isinstance(v, list) and isinstance(final.get(k), list):
                final[k] = final[k] + v
            else:
                final[k] = v
    expired_ids = set(final.get("expired_ids") or ())
    failed_queue_ids = set(final.get("failed_queue_ids") or ())

    delivered_ids = {d.id for d in deliveries}
    delivered_bodies = {d.body for d in deliveries if d.body is not None}
    body_outcomes: dict[Any, set] = defaultdict(set)
    body_first_send: dict[Any, float] = {}
    body_send_queue: dict[Any, Any] = {}
    body_of_id: dict[Any, Any] = {}
    confirmed = 0
    lost_ids: list = []
    # -- purges: a purge of a queue may have taken every message of it that was stored
    # before the purge took effect: at the latest its answer, and for a purge of unknown
    # outcome at any time after (a forwarded or proposed purge may commit long after its
    # client gave up, under a later primary too). A confirmed message never delivered
    # and never acked is not lost but purged when such a purge may have come after its
    # first send began; one delivered, never acked and not seen again, when such a purge
    # may have come after its last delivery was asked for (it existed until then). A
    # purge that succeeded took, for certain, every message whose send was answered
    # before the purge was asked for: such a message delivered from that queue by a
    # receive asked for after the purge was answered came back (purged_then_delivered)
    purged_ids: set = set()
    send_of_id: dict[Any, _Op] = {}  # message id -> the first send answered with it
    last_asked: dict[Any, float] = {}  # message id -> when its last delivery was asked for
    for d in deliveries:
        last_asked[d.id] = max(d.inv_t, last_asked.get(d.id, d.inv_t))

    def may_be_purged(mid: Any, since: float) -> bool:
        queue = body_send_queue.get(body_of_id.get(mid))
        return any((p.done_t if p.outcome == "ok" else INF) > since for p in purges.get(queue, ()))

    unknown_sends = unknown_sends_appeared = 0
    send_oks: list[tuple[float, float]] = []  # (invoke t, ok t)
    keyed_ids: dict[Any, set] = defaultdict(set)  # dedup key -> the message ids its sends were answered
    unkeyed_dup, unkeyed_dup_details = 0, []
    for op in sends:
        body = op.inv.get("body")
        key = op.inv.get("key")
        oc = op.outcome
        body_outcomes[body].add(oc)
        body_first_send.setdefault(body, op.inv_t)
        body_send_queue.setdefault(body, op.inv.get("queue"))
        if oc == "ok":
            send_oks.append((op.inv_t, op.done_t))
            mid = op.res.get("id")
            if key is not None:
                keyed_ids[key].add(mid)
            # a keyed resend answered "duplicate" confirms the first attempt's message
            # (whose own answer may have been lost): counted once per id. An unkeyed
            # send is never a duplicate: answered so, it is counted (below) and
            # confirmed all the same, so that its loss is seen
            if key is None and op.res.get("duplicate"):
                unkeyed_dup += 1
                _keep(unkeyed_dup_details, {"id": mid, "body": body, "answered_at": op.done_t})
            if key is None or not op.res.get("duplicate") or mid not in body_of_id:
                confirmed += 1
                body_of_id[mid] = body
                send_of_id.setdefault(mid, op)
                if mid not in delivered_ids and mid not in failed_queue_ids and mid not in expired_ids:
                    if may_be_purged(mid, body_first_send[body]):  # (its first send, keyed resends too)
                        purged_ids.add(mid)
                    else:
                        lost_ids.append(mid)
        elif oc == "unknown":
            unknown_sends += 1
            if body in delivered_bodies:
                unknown_sends_appeared += 1

    # -- keyed duplicates: sends with one dedup key (all inside the queue's window) must
    # make one message: every answer names it, and no other message carries its body
    key_of_body = {op.inv.get("body"): op.inv["key"] for op in sends if op.inv.get("key") is not None}
    for d in deliveries:
        if d.body in key_of_body:
            keyed_ids[key_of_body[d.body]].add(d.id)
    keyed_dups = 0
    keyed_dup_details: list = []
    for key, ids in keyed_ids.items():
        if len(ids) > 1:
            keyed_dups += 1
            _keep(keyed_dup_details, {"key": key, "ids": sorted(map(str, ids))})

    # -- one send, one message: an unkeyed body (each is sent by one call, never
    # again) delivered or answered under more ids than the calls with it that may
    # have stored it was stored twice (an unsafe resend inside a client or a node)
    ids_of_body: dict[Any, set] = defaultdict(set)
    may_have_stored: dict[Any, int] = defaultdict(int)
    for op in sends:
        if op.inv.get("key") is None:
            if op.outcome == "ok" and op.res.get("id") is not None:
                ids_of_body[op.inv.get("body")].add(op.res["id"])
            if op.outcome != "fail":
                may_have_stored[op.inv.get("body")] += 1
    for d in deliveries:
        if d.body is not None and d.body not in key_of_body:
            ids_of_body[d.body].add(d.id)
    dup_msgs, dup_msg_details = 0, []
    for body, ids in ids_of_body.items():
        if len(ids) > max(1, may_have_stored.get(body, 0)):
            dup_msgs += 1
            _keep(dup_msg_details, {"body": body, "ids": sorted(map(str, ids)),
                                    "sends": may_have_stored.get(body, 0)})

    unexpected = 0
    unexpected_details: list = []
    body_mismatches = 0
    body_mismatch_details: list = []
    first_body: dict = {}  # id -> the body it was first delivered with
    for d in deliveries:
        if d.body is None:
            continue
        outcomes = body_outcomes.get(d.body)
        if not outcomes:
            unexpected += 1
            _keep(unexpected_details, {**d.brief(), "body": d.body, "why": "never_sent"})
        elif outcomes == {"fail"}:
            unexpected += 1
            _keep(unexpected_details, {**d.brief(), "body": d.body, "why": "send_failed"})
        # the body its send was answered with, else (its answer lost) its first delivery's
        expect = body_of_id[d.id] if d.id in body_of_id else first_body.setdefault(d.id, d.body)
        if expect != d.body:
            body_mismatches += 1
            _keep(body_mismatch_details, {**d.brief(), "body": d.body, "sent_body": expect})

    # -- lost after a delivery: a confirmed message delivered, never acked (no ack of any
    # of its leases that succeeded or may have), not in the failure queue, not expired,
    # and not delivered again by the final drain (which empties the queue and its failure
    # queue, and which the history says completed: ``drained``): it was dropped after a
    # nack or an expiry, or its lease was never given back --------------------------------
    ids_acked = set()
    for token, lst in settles.items():
        if any(op.f == "ack" and op.outcome in ("ok", "unknown") for op in lst):
            mid = by_token[token].id if token in by_token else None
            ids_acked.update(x for x in (mid, *(op.inv.get("id") for op in lst)) if x is not None)
    lost_after: list = []
    for mid in (body_of_id if final.get("drained") else ()):  # (only a drained history shows it)
        if (mid in delivered_ids and mid not in ids_acked and mid not in failed_queue_ids
                and mid not in expired_ids):
            if may_be_purged(mid, last_asked[mid]):
                purged_ids.add(mid)
            else:
                lost_after.append(mid)

    purged_then_delivered, ptd_details = 0, []
    for d in deliveries:
        sop = send_of_id.get(d.id)
        if sop is None or sop.outcome != "ok":
            continue
        for p in purges.get(d.queue, ()):
            if p.outcome == "ok" and sop.done_t < p.inv_t and p.done_t < d.inv_t:
                purged_then_delivered += 1
                _keep(ptd_details, {**d.brief(), "sent_at": sop.done_t, "purge_asked_at": p.inv_t,
                                    "purge_answered_at": p.done_t})
                break

    # -- acks: acked then redelivered -----------------------------------------------------------
    first_ack_ok: dict[Any, float] = {}
    for token, lst in settles.items():
        for op in lst:
            if op.f == "ack" and op.outcome == "ok":
                mid = op.inv.get("id")
                if mid is None and token in by_token:
                    mid = by_token[token].id
                if op.done_t < first_ack_ok.get(mid, INF):
                    first_ack_ok[mid] = op.done_t
    acked_then_redelivered = 0
    atr_details: list = []
    for d in deliveries:
        t_ack = first_ack_ok.get(d.id)
        if t_ack is not None and d.inv_t > t_ack:
            acked_then_redelivered += 1
            _keep(atr_details, {**d.brief(), "acked_at": t_ack})

    # -- per-id delivery chains -------------------------------------------------------------------
    chains: dict[Any, list[_Delivery]] = defaultdict(list)
    for d in deliveries:
        chains[d.id].append(d)
    causes = {c: 0 for c in DUPLICATE_CAUSES}
    dup_details: list = []
    # every redelivery put down to no cause, with what the checker knew of the lease
    # before it: enough to explain one after the run, when its history is gone
    other_examples: list = []
    overlapping = 0
    overlap_details: list = []
    retry_incr = 0
    retry_details: list = []
    ids_delivered_more_than_once = 0

    def may_end_before(x: _Delivery, t: float) -> bool:
        """x's lease may have ended by a nack or its expiry (renewals counted) before t."""
        expiry = None if x.expires_at is None else seen(x.expires_at, x.ok_t, t)
        for op in settles.get(x.token, ()):
            if op.inv_t >= t:
                continue
            if op.f == "nack" and op.outcome != "fail":
                return True
            if op.f == "renew" and op.outcome == "ok":
                new = op.res.get("expires_at")
                if new is not None:
                    new = seen(new, op.done_t, t)
                    if expiry is None or new > expiry:
                        expiry = new
        return expiry is not None and expiry < t

    def concurrent_ended(chain: list, skip: tuple, lo: float, hi: float, rmin: Any, rmax: Any) -> int:
        """Deliveries of the same message, other than ``skip``, whose receive was in flight
        somewhere in (lo, hi), so their lease may have been granted in between although
        they completed outside it (an answer held up past its own lease's expiry), and whose
        lease may have ended (+1 to the retry count) before hi. Retry counts only grow in
        grant order, so one outside [rmin, rmax] was granted before or after that span."""
        def in_span(x: _Delivery) -> bool:
            if not isinstance(x.retry, int):
                return True
            return (not isinstance(rmin, int) or x.retry >= rmin) and (not isinstance(rmax, int) or x.retry <= rmax)
        return sum(1 for x in chain if x not in skip and x.ok_t > lo and x.inv_t < hi
                   and in_span(x) and may_end_before(x, hi))

    def lease_end(x: _Delivery, t: float) -> tuple:
        """(a nack of x's lease may have taken effect before t, x's expiry with the
        renewals invoked before t, as seen at t)."""
        nack_possible, expiry = False, None if x.expires_at is None else seen(x.expires_at, x.ok_t, t)
        for op in settles.get(x.token, ()):
            if op.inv_t >= t:
                continue
            if op.f == "nack" and op.outcome != "fail":
                nack_possible = True
            elif op.f == "renew" and op.outcome == "ok":
                new = op.res.get("expires_at")
                if new is not None:
                    new = seen(new, op.done_t, t)
                    if expiry is None or new > expiry:
                        expiry = new
        return nack_possible, expiry

    def granted_after(e: _Delivery, d: _Delivery) -> bool:
        """d's lease was granted after e's, for certain: a newer epoch (an older
        primary leasing after a newer one began is an anomaly itself), or in one queue
        and epoch a higher retry count (counts only grow there), or the same count asked
        for after e's answer."""
        if d.epoch is not None and e.epoch is not None and d.epoch != e.epoch:
            return d.epoch > e.epoch
        if d.queue != e.queue or not isinstance(d.retry, int) or not isinstance(e.retry, int):
            return False
        return d.retry > e.retry or (d.retry == e.retry and d.inv_t > e.ok_t)

    superseded, superseded_details, superseded_seen = 0, [], set()
    retry_down, retry_down_details = 0, []
    demands: list = []  # (increments only hidden leases can explain, hidden_window, details)
    for mid, chain in chains.items():
        first = chain[0]
        # First delivery: retry count starts at 0; only a lease nobody saw (or one whose
        # answer arrived later) may have raised it.
        body = first.body if first.body is not None else body_of_id.get(mid)
        sent_t = body_first_send.get(body)
        if sent_t is not None and isinstance(first.retry, int):
            base = concurrent_ended(chain, (first,), sent_t, first.ok_t, None, first.retry)
            if first.retry > base:  # what only hidden leases can explain, if any (matched below)
                demands.append((first.retry - base, hidden_window({first.queue, body_send_queue.get(body)},
                                                                  sent_t, first.ok_t),
                                {**first.brief(), "previous": None, "allowed": base}))
        if len(chain) > 1:
            ids_delivered_more_than_once += 1
        for prev, d in zip(chain, chain[1:]):
            nack_possible = ack_ok = ack_unknown = False
            expiry = None if prev.expires_at is None else seen(prev.expires_at, prev.ok_t, d.ok_t)
            for op in settles.get(prev.token, ()):
                oc = op.outcome
                if op.f == "nack":
                    if oc != "fail" and op.inv_t < d.ok_t:
                        nack_possible = True
                elif op.f == "ack":
                    if oc == "ok":
                        ack_ok = True
                    elif oc == "unknown":
                        ack_unknown = True
                elif op.f == "renew" and oc == "ok" and op.inv_t < d.ok_t:
                    new = op.res.get("expires_at")
                    if new is not None:
                        new = seen(new, op.done_t, d.ok_t)
                        if expiry is None or new > expiry:
                            expiry = new
            expired = expiry is not None and expiry < d.ok_t  # may have expired before the grant
            higher_epoch = (d.epoch is not None and prev.epoch is not None and d.epoch > prev.epoch)
            # d's answer came after prev's, but d was granted first: it was asked for
            # before prev was answered, and its lease had ended by then (an answer held
            # on the way, delivered late). The chain's order is the answers' order; the
            # pair's real order is the other way round, and prev is d's redelivery
            d_end = None if d.expires_at is None else seen(d.expires_at, d.ok_t, prev.ok_t)
            answered_late = d.inv_t < prev.ok_t and d_end is not None and d_end <= prev.ok_t
            # or d's lease is of an older epoch than prev's: granted before prev's epoch
            # began (a primary leases only in its own), asked for before prev was
            # answered, and its answer held on the way (its primary paused, seed 13653);
            # a primary change made the message visible again meanwhile
            lower_epoch = d.epoch is not None and prev.epoch is not None and d.epoch < prev.epoch
            answered_late = answered_late or (lower_epoch and d.inv_t < prev.ok_t)

            if answered_late:
                cause = "answered_late"
            elif nack_possible:
                cause = "nack"
            elif expired and not ack_ok:
                cause = "lease_expired"
            elif higher_epoch:
                cause = "primary_changed"
            elif ack_unknown:
                cause = "unknown_ack"
            else:
                cause = "other"
            causes[cause] += 1
            _keep(dup_details, {**d.brief(), "cause": cause, "previous": prev.brief()})
            if cause == "other":
                # e.g. granted within the slack before the earlier lease's end (neither
                # an expiry nor an overlap): to_previous_end_s says how close
                _keep(other_examples, {
                    **d.brief(), "previous": prev.brief(), "previous_end": expiry,
                    "to_previous_end_s": None if expiry is None else expiry - d.ok_t,
                    "previous_settles": [{"f": op.f, "outcome": op.outcome, "invoked": op.inv_t,
                                          "done": None if op.done_t == INF else op.done_t}  # (None: no answer)
                                         for op in settles.get(prev.token, ())]})

            # Retry count: +1 at most per lease settled by its consumer (nack) or expiring
            # while its epoch's primary could still commit (a lease the next primary
            # dropped adds nothing: a primary change adds nothing). Leases of unknown
            # receives may add one each, each receive once in the run (matched below).
            if isinstance(d.retry, int) and isinstance(prev.retry, int):
                counted = expired and expiry < epoch_end(prev.epoch)
                base = (1 if (nack_possible or counted) else 0) + concurrent_ended(
                    chain, (prev, d), prev.inv_t, d.ok_t, prev.retry, d.retry)
                if d.retry > prev.retry + base:
                    demands.append((d.retry - prev.retry - base, hidden_window({prev.queue, d.queue}, prev.inv_t,
                                                                               d.ok_t),
                                    {**d.brief(), "previous": prev.brief(), "allowed": base}))

        # Overlap, against every earlier delivery of the message in the same epoch (not
        # only the one answered just before: a lease of another epoch may come between).
        # Same epoch (an unknown epoch counts as the same: it cannot show a change),
        # granted (received) before the earlier lease's expiry, with no nack of it that
        # could have ended it first, and the earlier lease granted before this one's
        # expiry (one held up past its own lease's expiry may be the older grant). An
        # ack never excuses: an ack that took effect first deletes the message, so a
        # grant after it is a redelivery of an acked message, and one before it overlaps.
        for i in range(1, len(chain)):
            d = chain[i]
            for e in chain[:i]:
                if d.epoch is not None and e.epoch is not None and d.epoch != e.epoch:
                    continue
                nack_possible, expiry = lease_end(e, d.ok_t)
                if (expiry is not None and d.ok_t < expiry - slack_s and not nack_possible
                        and (d.expires_at is None or e.ok_t < seen(d.expires_at, d.ok_t, e.ok_t) - slack_s)):
                    overlapping += 1
                    _keep(overlap_details, {**d.brief(), "previous": e.brief(), "overlap_s": expiry - d.ok_t})
                    break

        # A lease settled with success while a later lease of its message was already
        # granted: an ack of it (whenever it ran) or a nack or renewal of it invoked after
        # the later lease was answered. A successful settle proves the lease was live when
        # it took effect, so both leases were live at once (or, for an ack that ran first,
        # the acked message was delivered again); in a later epoch, the old lease was not
        # fenced.
        for e in chain:
            for op in settles.get(e.token, ()):
                if op.outcome != "ok":
                    continue
                for d in chain:
                    if d is e or not granted_after(e, d) or not (op.f == "ack" or d.ok_t < op.inv_t):
                        continue
                    if (e.token, d.token) not in superseded_seen:
                        superseded_seen.add((e.token, d.token))
                        superseded += 1
                        _keep(superseded_details, {**d.brief(), "settled": op.f, "settled_at": op.done_t,
                                                   "earlier": e.brief()})

        # Retry counts never fall in a queue (nothing here redrives): a delivery asked for
        # after another was answered, with a lower count, lost an increment that committed.
        for i in range(1, len(chain)):
            d = chain[i]
            for e in chain[:i]:
                if (d.queue == e.queue and isinstance(d.retry, int) and isinstance(e.retry, int)
                        and d.inv_t > e.ok_t and d.retry < e.retry):
                    retry_down += 1
                    _keep(retry_down_details, {**d.brief(), "previous": e.brief()})
                    break

    for details in unexplained_increments(demands, hidden_recv):
        retry_incr += 1
        _keep(retry_details, details)

    # -- roles ----------------------------------------------------------------------------------
    primaries: dict[Any, set] = defaultdict(set)
    for r in roles:
        if r.get("role") == "primary":
            primaries[r.get("epoch")].add(r.get("node"))
    double = [{"epoch": e, "nodes": sorted(map(str, n))}
              for e, n in sorted(primaries.items(), key=lambda kv: str(kv[0])) if len(n) > 1]

    # -- failover unavailability ----------------------------------------------------------------
    send_oks.sort()
    inv_ts = [p[0] for p in send_oks]
    suffix_min = [INF] * (len(send_oks) + 1)
    for i in range(len(send_oks) - 1, -1, -1):
        suffix_min[i] = min(send_oks[i][1], suffix_min[i + 1])
    windows = []
    for nm in nemeses:
        if nm.get("f") not in DISRUPTIVE_NEMESES:
            continue
        # first send ok among sends invoked after the nemesis: a send already accepted
        # before it and answered after says nothing about the cluster's availability.
        nxt = suffix_min[bisect.bisect_left(inv_ts, nm["t"])]
        windows.append({"t": nm["t"], "f": nm.get("f"), "node": nm.get("node"), "kind": nm.get("kind"),
                        "role": nm.get("role"), "unavailable_s": None if nxt == INF else nxt - nm["t"]})
    durations = sorted(w["unavailable_s"] for w in windows if w["unavailable_s"] is not None)

    cp = client_partition_calls(order, nemeses, delivered_bodies)

    # -- final facts ------------------------------------------------------------------------------
    node_states = final.get("node_states") or {}
    integrity = final.get("integrity") or {}
    nodes_agree = (len(set(map(json.dumps, node_states.values()))) <= 1) if node_states else None
    integrity_ok = all(v == "ok" for v in integrity.values()) if integrity else None

    report: dict = {
        "events": len(timed) + len(finals),
        "sends": len(sends),
        "confirmed_sends": confirmed,
        "deliveries": len(deliveries),
        "drain_deliveries": sum(1 for d in deliveries if d.drain),
        "empty_receives": empty_receives,
        "unknown_receives": sum(len(v) for v in unknown_receives.values()),
        "lost": len(lost_ids),
        "lost_ids": lost_ids,
        "unexpected": unexpected,
        "unexpected_details": unexpected_details,
        "unknown_sends": unknown_sends,
        "unknown_sends_appeared": unknown_sends_appeared,
        "ids_delivered_more_than_once": ids_delivered_more_than_once,
        "duplicate_deliveries": causes,
        "duplicate_details": dup_details,
        "duplicate_other_examples": other_examples,
        "acked_then_redelivered": acked_then_redelivered,
        "acked_then_redelivered_details": atr_details,
        "overlapping_leases": overlapping,
        "overlapping_leases_details": overlap_details,
        "settles_of_superseded_leases": superseded,
        "settles_of_superseded_leases_details": superseded_details,
        "retry_count_decreases": retry_down,
        "retry_count_decreases_details": retry_down_details,
        "lost_after_delivery": len(lost_after),
        "lost_after_delivery_ids": lost_after,
        "purges": sum(len(v) for v in purges.values()),
        "purged": len(purged_ids),
        "purged_then_delivered": purged_then_delivered,
        "purged_then_delivered_details": ptd_details,
        "failover_retry_increments": retry_incr,
        "failover_retry_increments_details": retry_details,
        "leases_behind_a_newer_epoch": behind,
        "leases_behind_a_newer_epoch_details": behind_details,
        "renewals_behind_a_newer_epoch": renews_behind,
        "renewals_behind_a_newer_epoch_details": renews_behind_details,
        "double_primaries": len(double),
        "double_primaries_details": double,
        "body_mismatches": body_mismatches,
        "body_mismatch_details": body_mismatch_details,
        "keyed_sends": sum(1 for op in sends if op.inv.get("key") is not None),
        "keyed_answered_duplicate": sum(1 for op in sends if op.inv.get("key") is not None
                                        and op.outcome == "ok" and op.res.get("duplicate")),
        "keyed_duplicates": keyed_dups,
        "keyed_duplicates_details": keyed_dup_details,
        "duplicated_messages": dup_msgs,
        "duplicated_messages_details": dup_msg_details,
        "unkeyed_answered_duplicate": unkeyed_dup,
        "unkeyed_answered_duplicate_details": unkeyed_dup_details,
        "failover_unavailability": {
            "count": len(windows),
            "never_recovered": sum(1 for w in windows if w["unavailable_s"] is None),
            "p50_s": _percentile(durations, 50),
            "p99_s": _percentile(durations, 99),
            "max_s": durations[-1] if durations else None,
            "windows": windows,
        },
        "nodes_agree": nodes_agree,
        "node_states": node_states,
        "integrity_ok": integrity_ok,
        "integrity": integrity,
        "orphan_completions": orphan_completions,
        **cp,
        "client_partition_late_calls": late_calls,
    }
    report["required_zeros_ok"] = (all(report[k] == 0 for k in REQUIRED_ZEROS)
                                   and nodes_agree is not False and integrity_ok is not False)
    return report


def unexplained_increments(demands: list, receives: dict) -> list:
    """The retry increments that no receive of unknown outcome can explain. Each
    demand is (n, (queues, lo, latest start), details): n increments of one
    delivery that only hidden leases could have made; a receive in one of those
    queues in flight somewhere in (lo, latest start) may have made one of them,
    and each receive makes at most one in the whole run (it answers one message,
    whose lease expires once). A maximum matching (augmenting paths) of
    increments to receives: what is left unmatched is unexplained, whatever
    order the demands came in. -> the details of each demand with an unmatched
    increment ("allowed": what explained it, plus the receives matched to it)."""
    starts = {q: [r[0] for r in rs] for q, rs in receives.items()}
    units, cands = [], []
    for i, (n, (qs, lo, latest), _) in enumerate(demands):
        c = [(q, j) for q in qs if q in receives
             for j in range(bisect.bisect_left(starts[q], latest)) if receives[q][j][1] > lo]
        for _ in range(n):
            units.append(i)
            cands.append(c)
    owner: dict = {}     # receive -> the unit it explains
    assigned: dict = {}  # unit -> its receive

    def place(u: int) -> bool:
        """An augmenting path from unit u (breadth first, no recursion)."""
        reached_from: dict = {}
        todo = deque([u])
        while todo:
            x = todo.popleft()
            for r in cands[x]:
                if r in reached_from:
                    continue
                reached_from[r] = x
                if r in owner:
                    todo.append(owner[r])
                    continue
                while True:  # r is free: shift every receive along the path
                    x2 = reached_from[r]
                    held = assigned.get(x2)
                    owner[r], assigned[x2] = x2, r
                    if x2 == u:
                        return True
                    r = held
        return False

    matched = [place(u) for u in range(len(units))]
    out, got = [], defaultdict(int)
    for u, ok in enumerate(matched):
        if ok:
            got[units[u]] += 1
    for i, (n, _, details) in enumerate(demands):
        if got.get(i, 0) < n:
            out.append({**details, "allowed": details.get("allowed", 0) + got.get(i, 0)})
    return out


def client_partition_windows(nemeses: list) -> list:
    """The faults of the links between the clients and a node, as (node, start, heal,
    late): each ``client_partition`` up to that node's ``client_heal``, or to one naming
    no node (the run's final heal ends every fault), or to the end (INF). ``late``: the
    latest time a call held there may take effect, when its heal delivered what the
    links held (the fault's ``late_effect_s`` after a heal marked ``late``); else None."""
    windows: list = []
    open_at: dict = {}
    for nm in nemeses:
        if nm.get("f") == "client_partition":
            open_at[nm.get("node")] = (nm["t"], nm.get("late_effect_s"))
        elif nm.get("f") == "client_heal":
            for node in ([nm["node"]] if nm.get("node") is not None else list(open_at)):
                if node in open_at:
                    t0, late_s = open_at.pop(node)
                    late = nm["t"] + float(late_s) if late_s is not None and nm.get("late") else None
                    windows.append((node, t0, nm["t"], late))
    return windows + [(node, t0, INF, None) for node, (t0, _) in open_at.items()]


def mark_late_calls(order: list, nemeses: list) -> int:
    """Calls held by a client link that delivered what it held at its heal: a call
    invoked before the heal that ended unknown after the fault began may reach its node
    at the heal and take effect up to the window's ``late`` (client_partition_windows),
    long after its client gave up on it. Sets those calls' ``late_t``; returns how many."""
    windows = [w for w in client_partition_windows(nemeses) if w[3] is not None]
    n = 0
    if windows:
        for op in order:
            if op.outcome != "unknown":
                continue
            node = op.inv.get("node")
            for w_node, t0, t1, until in windows:
                # (a call that names no node, the SDK's, which picks its node itself,
                # may have crossed any node's links)
                if (node is None or w_node == node) and op.inv_t < t1 and op.done_t > t0:
                    op.late_t = max(op.late_t, until)
                    n += 1
                    break
    return n


def client_partition_calls(order: list, nemeses: list, delivered_bodies: set) -> dict:
    """Evidence, not a judgement: the calls that crossed a faulted link between the
    clients and a node (client_partition_windows), by the node their invoke names:
    invoked before the heal and completed (or never) after the fault began. How many
    ended unknown, and how many of those unknown sends were delivered (the node stored
    the message, its answer was lost). The judgements of those calls are the checker's
    usual ones."""
    windows = client_partition_windows(nemeses)
    calls = unknowns = appeared = 0
    by_f: dict = defaultdict(int)
    if windows:
        for op in order:
            node = op.inv.get("node")
            if not any(n == node and op.inv_t < t1 and op.done_t > t0 for n, t0, t1, _ in windows):
                continue
            calls += 1
            if op.outcome == "unknown":
                unknowns += 1
                by_f[op.f] += 1
                if op.f == "send" and op.inv.get("body") in delivered_bodies:
                    appeared += 1
    return {"client_partitions": len(windows), "client_partition_calls": calls,
            "client_partition_unknowns": unknowns, "client_partition_unknowns_by_call": dict(by_f),
            "client_partition_unknown_sends_delivered": appeared}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def format_table(report: dict) -> str:
    rows: list[tuple[str, str, str]] = []

    def row(name: str, value: Any, required: bool = False) -> None:
        status = ""
        if required:
            status = "OK" if (value is None or value is True or (type(value) is int and value == 0)) else "FAIL"
        rows.append((name, _fmt(value), status))

    for k in ("events", "sends", "confirmed_sends", "deliveries", "drain_deliveries",
              "empty_receives", "unknown_receives", "unknown_sends", "unknown_sends_appeared",
              "keyed_sends", "keyed_answered_duplicate", "ids_delivered_more_than_once", "purges", "purged"):
        row(k, report[k])
    for cause, n in report["duplicate_deliveries"].items():
        row(f"duplicate_deliveries.{cause}", n)
    for k in REQUIRED_ZEROS:
        row(k, report[k], required=True)
    row("nodes_agree", report["nodes_agree"], required=True)
    row("integrity_ok", report["integrity_ok"], required=True)
    fu = report["failover_unavailability"]
    row("failover_unavailability.count", fu["count"])
    row("failover_unavailability.never_recovered", fu["never_recovered"])
    for k in ("p50_s", "p99_s", "max_s"):
        row(f"failover_unavailability.{k}", fu[k])
    row("orphan_completions", report["orphan_completions"])
    if report.get("client_partitions"):
        for k in ("client_partitions", "client_partition_calls", "client_partition_unknowns",
                  "client_partition_unknown_sends_delivered", "client_partition_late_calls"):
            row(k, report[k])

    w1 = max(len(r[0]) for r in rows)
    w2 = max(len(r[1]) for r in rows)
    lines = [f"{'metric'.ljust(w1)}  {'value'.rjust(w2)}  status", "-" * (w1 + w2 + 10)]
    lines += [f"{a.ljust(w1)}  {b.rjust(w2)}  {c}".rstrip() for a, b, c in rows]
    lines.append("")
    lines.append("required zeros: " + ("OK" if report["required_zeros_ok"] else "FAIL"))
    examples = [("lost", report["lost_ids"]),
                ("unexpected", report["unexpected_details"]),
                ("acked_then_redelivered", report["acked_then_redelivered_details"]),
                ("overlapping_leases", report["overlapping_leases_details"]),
                ("lost_after_delivery", report["lost_after_delivery_ids"]),
                ("settles_of_superseded_leases", report["settles_of_superseded_leases_details"]),
                ("retry_count_decreases", report["retry_count_decreases_details"]),
                ("failover_retry_increments", report["failover_retry_increments_details"]),
                ("double_primaries", report["double_primaries_details"]),
                ("leases_behind_a_newer_epoch", report["leases_behind_a_newer_epoch_details"]),
                ("renewals_behind_a_newer_epoch", report["renewals_behind_a_newer_epoch_details"]),
                ("body_mismatches", report["body_mismatch_details"]),
                ("purged_then_delivered", report["purged_then_delivered_details"])]
    for name, items in examples:
        if items:
            lines.append(f"{name} (first {min(len(items), 5)}):")
            lines += [f"  {json.dumps(it, default=str)}" for it in items[:5]]
    if report["nodes_agree"] is False:
        lines.append(f"node_states: {json.dumps(report['node_states'], default=str)}")
    if report["integrity_ok"] is False:
        lines.append(f"integrity: {json.dumps(report['integrity'], default=str)}")
    return "\n".join(lines)


def unchecked(events: Iterable[dict]) -> list[str]:
    """What a history leaves unchecked: the final facts a whole drill records and
    ``check`` reads when they are there. Without a completed drain no message can be
    found lost after a delivery; without node states or integrity results neither
    agreement nor integrity is judged. The drill itself fails a seed that did not
    drain; a history checked on its own passes only when nothing is left out."""
    final: dict = {}
    for e in events:
        if e.get("type") == "final":
            final.update(e)
    out = []
    if not final:
        out.append("no final record (the drill did not finish)")
    if not final.get("drained"):
        out.append("not drained: lost_after_delivery not checked")
    if not final.get("node_states"):
        out.append("no node states: nodes_agree not checked")
    if not final.get("integrity"):
        out.append("no integrity results: integrity_ok not checked")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.drills.checker",
                                 description="Check a Spooler drill history (JSON lines).")
    ap.add_argument("history", help="history.jsonl written by History.to_jsonl")
    ap.add_argument("--json", action="store_true", help="print the full report as JSON")
    ap.add_argument("--slack", type=float, default=DEFAULT_SLACK_S,
                    help="seconds a lease overlap must exceed to count (default %(default)s)")
    ap.add_argument("--partial", action="store_true",
                    help="pass a history that lacks final facts (drain, node states, integrity) "
                         "on what it holds; without it such a history exits 1")
    args = ap.parse_args(argv)
    hist = History.from_jsonl(args.history)
    report = check(hist, slack_s=args.slack)
    report["unchecked"] = unchecked(hist)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_table(report))
        for why in report["unchecked"]:
            print(f"unchecked: {why}")
    if not report["required_zeros_ok"]:
        return 1
    return 0 if args.partial or not report["unchecked"] else 1


if __name__ == "__main__":
    sys.exit(main())
