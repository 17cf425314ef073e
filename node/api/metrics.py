"""Prometheus metrics (one registry per node, so tests can run several).

The write path's own figures (sends, acks, group commits and their durations)
are counted in plain integers and bucket arrays on the event loop, and turned
into Prometheus families only when /metrics is read: prometheus-client's
Counter.inc and Histogram.observe take a lock each time; a commit observed
both ways took about 9 µs in a running node."""
from __future__ import annotations

import os
import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Sample

from spooler import __version__ as spooler_version
from spooler import errors as spooler_errors
from spooler.pb import log_pb2

# The outcome of a call its caller gave up on (it went away, or its deadline
# passed) before the answer; and the api of a call another member forwarded
CANCELLED, FORWARDED_API = "cancelled", "forwarded"


class Count:
    """A counter bumped on the event loop only (no lock); ``inc`` as prometheus-client's."""

    __slots__ = ("name", "doc", "value", "created")

    def __init__(self, name: str, doc: str):
        self.name, self.doc, self.value = name, doc, 0
        self.created = time.time()  # exposed as <name>_created, as prometheus-client's own counters do

    def inc(self, n: int = 1) -> None:
        self.value += n

    def families(self):
        f = CounterMetricFamily(self.name, self.doc)
        f.add_metric([], self.value, created=self.created)
        yield f


def _cumulative(bounds: tuple, counts) -> list:
    """A histogram's buckets as Prometheus has them: (upper bound, calls at or
    below it), from a count per bound and one above them all."""
    acc, buckets = 0, []
    for bound, n in zip(bounds + (float("inf"),), counts):
        acc += n
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), acc))
    return buckets


class Buckets:
    """A histogram observed on the event loop only (no lock)."""

    __slots__ = ("name", "doc", "bounds", "counts", "sum", "created")

    def __init__(self, name: str, doc: str, bounds: tuple):
        self.name, self.doc, self.bounds = name, doc, tuple(float(b) for b in bounds)
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1
        self.sum += v

    def families(self):
        f = HistogramMetricFamily(self.name, self.doc)
        f.add_metric([], _cumulative(self.bounds, self.counts), self.sum)
        f.samples.append(Sample(self.name + "_created", {}, self.created))
        yield f


class MemberBuckets:
    """A histogram per member of the cluster (the label takes the ids of --peers
    only), observed on the event loop only, as Buckets."""

    __slots__ = ("name", "doc", "bounds", "by_member", "created")

    def __init__(self, name: str, doc: str, bounds: tuple):
        self.name, self.doc, self.bounds = name, doc, tuple(float(b) for b in bounds)
        self.by_member: dict = {}
        self.created = time.time()

    def observe(self, member: str, v: float) -> None:
        b = self.by_member.get(member)
        if b is None:
            b = self.by_member[member] = Buckets(self.name, self.doc, self.bounds)
        b.observe(v)

    def families(self):
        f = HistogramMetricFamily(self.name, self.doc, labels=["member"])
        for member, b in sorted(self.by_member.items()):
            f.add_metric([member], _cumulative(b.bounds, b.counts), b.sum)
            f.samples.append(Sample(self.name + "_created", {"member": member}, b.created))
        yield f


# Bounds of spooler_call_seconds: a send or an ack answers in about a
# millisecond, a long poll in up to 20 s (API.md's largest wait)
CALL_SECONDS_BOUNDS = (.00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 25)


class Calls:
    """Calls answered, by API, call and outcome, and how long each took, by API
    and call; counted on the event loop only (no lock), as Count and Buckets.

    ``api`` is "http" or "grpc" (a client's call), or "forwarded" (a call another
    member forwarded here; Metrics.answered); ``call`` an HTTP route's method
    and template ("POST /v1/queues/{queue}/messages", never the path itself), a
    gRPC method ("Send"), or one kind of request on a Session stream
    ("Session/send_batch"), each counted as the call it is; anything that
    matched no route or method is "unmatched". ``outcome`` is "ok", the error's
    kind (errors.py's table) or "cancelled". So every label takes one of a
    fixed set of values: no client can make the node grow a series per path,
    queue or key.

    Calls in progress, by the same api and call: a unary gRPC call or an HTTP
    request from its start (``enter``) to its end (``leave``), and each request
    on an open Session stream that is read and not yet answered (``sessions``:
    each open stream's api and its dict of such requests, read at a render)."""

    __slots__ = ("by_call", "created", "running", "sessions")

    def __init__(self):
        self.by_call: dict = {}  # (api, call) -> ({outcome: calls}, Buckets of their seconds)
        self.created = time.time()
        self.running: dict = {}  # (api, call) -> unary calls and HTTP requests under way
        self.sessions: dict = {}  # id -> (api, {request: (which, began)}) of each open Session stream

    def enter(self, api: str, call: str) -> tuple:
        key = (api, call)
        self.running[key] = self.running.get(key, 0) + 1
        return key

    def leave(self, key: tuple) -> None:
        self.running[key] -= 1

    def done(self, api: str, call: str, outcome: str, seconds: float) -> None:
        got = self.by_call.get((api, call))
        if got is None:
            got = self.by_call[(api, call)] = ({}, Buckets("spooler_call_seconds", "", CALL_SECONDS_BOUNDS))
        outcomes, times = got
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        times.observe(seconds)

    def families(self):
        c = CounterMetricFamily("spooler_calls", "Calls answered or given up, by API, call and outcome (ok, the "
                                "error's kind, or cancelled)", labels=["api", "call", "outcome"])
        h = HistogramMetricFamily("spooler_call_seconds", "How long calls took to answer, by API and call",
                                  labels=["api", "call"])
        for (api, call), (outcomes, times) in sorted(self.by_call.items()):
            for outcome, n in sorted(outcomes.items()):
                c.add_metric([api, call, outcome], n, created=self.created)
            h.add_metric([api, call], _cumulative(times.bounds, times.counts), times.sum)
        yield c
        yield h
        running = dict(self.running)  # (a call once under way keeps its series, at 0 when none is)
        for api, call in self.by_call:
            if call.startswith("Session/"):
                running.setdefault((api, call), 0)
        for api, requests in self.sessions.values():
            for which, _ in list(requests.values()):
                key = (api, "Session/" + which)
                running[key] = running.get(key, 0) + 1
        g = GaugeMetricFamily("spooler_calls_in_progress", "Calls under way, by API and call as spooler_calls "
                              "(a Session stream's requests read and not yet answered, each as its call)",
                              labels=["api", "call"])
        for (api, call), n in sorted(running.items()):
            g.add_metric([api, call], n)
        yield g
        g = GaugeMetricFamily("spooler_sessions_open", "Session streams open, by API (grpc: a client's; "
                              "forwarded: a member's)", labels=["api"])
        opened: dict = {}
        for api, _ in self.sessions.values():
            opened[api] = opened.get(api, 0) + 1
        for api in ("grpc", FORWARDED_API):
            g.add_metric([api], opened.get(api, 0))
        yield g


def _reason_label(reason: str) -> str:
    return reason if reason in spooler_errors.REASONS else ("other" if reason else "")


class Metrics:
    def __init__(self, engine):
        self.engine = engine
        r = self.registry = CollectorRegistry()
        self.sends = Count("spooler_sends", "Messages stored (duplicates excluded)")
        self.duplicates = Count("spooler_send_duplicates", "Sends answered as dedup duplicates")
        self.receives = Count("spooler_receives", "Messages leased to consumers")
        self.acks = Count("spooler_acks", "Messages acked")
        self.nacks = Count("spooler_nacks", "Messages nacked by consumers")
        self.expiries = Count("spooler_lease_expiries", "Leases that timed out (server-side nacks)")
        self.drops = Count("spooler_retention_drops", "Messages dropped by retention")
        self.commit_records = Buckets("spooler_commit_batch_records", "Log records per group commit",
                                      (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096))
        self.fsync_seconds = Buckets("spooler_commit_seconds", "Duration of one group commit (write + fsync)",
                                     (.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .5, 1))
        self.member_ack_seconds = MemberBuckets(
            "spooler_member_ack_seconds", "On the primary: from sending a frame to a replica to its acknowledgement "
            "(a frame with records is acknowledged once the replica has them on disk)",
            (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        self.checkpoint_seconds = Buckets("spooler_checkpoint_seconds",
                                          "Duration of one checkpoint (the applied state written, the log compacted)",
                                          (.001, .005, .01, .05, .1, .5, 1, 5, 10))
        self.memory_released = Count("spooler_memory_released_bytes",
                                     "Bytes the resident size fell by when the node handed the C library's free "
                                     "memory back to the OS after checkpoints")
        self.errors = Counter("spooler_errors", "Errors answered to clients, by kind and reason (a batch's "
                              "entries each)", ["kind", "reason"], registry=r)
        self.calls = Calls()
        r.register(_LoopCollector(self.calls,
                                  self.sends, self.duplicates, self.receives, self.acks, self.nacks, self.expiries,
                                  self.drops, self.commit_records, self.fsync_seconds, self.checkpoint_seconds,
                                  self.memory_released, self.member_ack_seconds))
        r.register(_StateCollector(engine))
        # process_open_fds beside process_max_fds: how near the node is to its
        # descriptors (its connection bounds are sized to them; limits.md), and
        # its resident memory and CPU
        ProcessCollector(registry=r)
        engine.on_apply.append(self._on_apply)
        engine.metrics = self
        self._rendered = None  # (until, body) of a costly render, answered again until then
        self.renders = 0

    def answered(self, api: str, call: str, began: float, e=None, *, forwarded: bool = False,
                 probe: bool = False) -> None:
        """One call answered, or given up: spooler_calls_total and
        spooler_call_seconds (from ``began``, time.monotonic()), and for an error
        answered to a client spooler_errors_total. ``e``: None (ok), a SpoolerError,
        or CANCELLED (the caller went away or its deadline passed first); of an
        error only its ``kind`` and ``reason`` are read (a Session answer's
        ErrorDetail passes as it is).

        ``forwarded``: a call another member forwarded here. It is counted under
        api "forwarded" and its error is not counted: the member that answered
        the client counts both, so a sum over the cluster counts each client's
        call once. ``probe``: /healthz or /readyz, whose 503 says "not ready", not
        an error of anyone's."""
        if e is None:
            outcome = "ok"
        elif e is CANCELLED:
            outcome = CANCELLED
        else:
            outcome = e.kind
            if not (forwarded or probe):
                self.error(e)
        self.calls.done(FORWARDED_API if forwarded else api, call, outcome, time.monotonic() - began)

    def error(self, e) -> None:
        """One error answered to a client (spooler_errors_total): by its kind and its
        reason (one of errors.REASONS; "other" for any reason not among them)."""
        self.errors.labels(e.kind, _reason_label(e.reason)).inc()

    def observe_commit(self, records: int, seconds: float) -> None:
        self.commit_records.observe(records)
        self.fsync_seconds.observe(seconds)

    def _on_apply(self, rec, result) -> None:
        op = rec.WhichOneof("op")
        if op in ("send", "send_compact"):
            # only entries can be duplicates (a run carries no dedup keys)
            entries, run = result
            dup = sum(1 for _, d in entries if d is True)
            stored = sum(1 for m, d in entries if m is not None and d is False)
            if run is not None and run.error is None:
                stored += run.n
            self.sends.inc(stored)
            if dup:
                self.duplicates.inc(dup)
        elif op == "settle":
            # counted per record, not per entry
            acks = nacks = expiries = 0
            ACK, NACK = log_pb2.ACK, log_pb2.NACK
            for e, changed in zip(rec.settle.entries, result):
                if not changed:
                    continue
                k = e.kind
                if k == ACK:
                    acks += 1
                elif k == NACK:
                    nacks += 1
                else:
                    expiries += 1
            for n, counter in ((acks, self.acks), (nacks, self.nacks), (expiries, self.expiries)):
                if n:
                    counter.inc(n)
        elif op == "drop":
            self.drops.inc(result)

    # A render reads every queue on the event loop (10,000 queues: about 4 MB and a
    # fifth of a second), and /metrics needs no key: 8 scrapers asking back to back
    # held a primary's loop until it lost its majority. A render that took
    # RENDER_REUSE_FROM_S or more is answered again to whoever asks within ten
    # times as long, so that scraping holds the loop at most a tenth of the time;
    # a cheap one (a node with few queues) is never reused, so it is never stale.
    # (SPOOLER_TEST_METRICS_REUSE_FROM_S: the integration tests' nodes set "inf",
    # never reuse, so that a test reads what its last call did; the reuse itself
    # is tested in process, tests/unit/test_reply_and_metrics.py)
    RENDER_REUSE_FROM_S = float(os.environ.get("SPOOLER_TEST_METRICS_REUSE_FROM_S", "") or 0.01)

    def render(self) -> bytes:
        now = time.monotonic()
        if self._rendered is not None and now < self._rendered[0]:
            return self._rendered[1]
        body = generate_latest(self.registry)
        took = time.monotonic() - now
        self.renders += 1
        self._rendered = (now + 10 * took, body) if took >= self.RENDER_REUSE_FROM_S else None
        return body


class _LoopCollector:
    """Exposes the Count and Buckets figures (read on the loop, where /metrics runs)."""

    def __init__(self, *figures):
        self.figures = figures

    def collect(self):
        for f in self.figures:
            yield from f.families()


class _StateCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        e = self.engine
        depth = GaugeMetricFamily("spooler_queue_messages", "Messages in a queue by state", labels=["queue", "state"])
        waited = GaugeMetricFamily("spooler_queue_first_visible_seconds",
                                   "How long the first message in line (the next a receive hands out) has been "
                                   "visible; 0 when none is. Right on the primary only", labels=["queue"])
        # what happened to a queue's messages, as its stats' totals (sentTotal and
        # the rest): part of the replicated state, so the same on every member and
        # kept across restarts; they start again from 0 for a queue deleted and made anew
        events = CounterMetricFamily("spooler_queue_events", "What happened to a queue's messages, as GET "
                                     "/v1/queues/{queue}'s totals: sent, acked, nacked, lease_expired, failed "
                                     "(moved to the failure queue), expired (dropped by retention), purged",
                                     labels=["queue", "event"])
        now = e.now_us()
        core = e.core
        held = 0
        for name in list(core.queues):
            s = core.stats(name, now)
            for state in ("visible", "leased", "delayed"):
                depth.add_metric([name, state], s[state])
                held += s[state]
            since = core.first_in_line_since(name, now)
            waited.add_metric([name], max(0, now - since) / 1e6 if since is not None else 0.0)
            for event, n in core.queues[name].counters.items():  # (the totals stats() names ...Total)
                events.add_metric([name, event], n)
        yield depth
        yield waited
        yield events
        # the node-wide caps beside what they bound (a send past one is refused,
        # reason node_full; limits.md)
        lim = e.limits
        for name, doc, value in (
                ("spooler_messages_held", "Messages in every queue together", held),
                ("spooler_messages_max", "Most messages the node holds, every queue together (--max-messages)",
                 lim.messages_max),
                ("spooler_dedup_keys", "Dedup keys remembered, every queue together", core.dedup_n),
                ("spooler_dedup_keys_max", "Most dedup keys the node remembers (--max-dedup-keys)",
                 lim.dedup_keys_max),
                ("spooler_leases", "Leases held now, every queue together", len(core.leases)),
                ("spooler_leases_max", "Most leases the node holds at once, every queue together", lim.leases_max),
                # the write path's backlog: records waiting for the next group commit
                # (past the max, writes are refused: reason overloaded), and records
                # stamped and not yet applied (waiting for an fsync, here or on a quorum)
                ("spooler_writes_waiting", "Log records waiting for the group commit", e.writes_waiting),
                ("spooler_writes_waiting_max", "Most log records that wait for the group commit; past it writes "
                 "are refused (unavailable, reason overloaded)", lim.pending_records_max),
                ("spooler_writes_unconfirmed", "Log records stamped and not yet applied: being written, or "
                 "waiting for a quorum's acknowledgement", len(e.unapplied))):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        g = GaugeMetricFamily("spooler_build_info", "1, labelled with this node's version (spooler-node --version)",
                              labels=["version"])
        g.add_metric([spooler_version], 1)
        yield g
        g = GaugeMetricFamily("spooler_epoch", "Newest epoch this node knows (as Spooler-Epoch)")
        g.add_metric([], e.known_epoch)
        yield g
        g = GaugeMetricFamily("spooler_applied_lsn", "Last applied log sequence number")
        g.add_metric([], e.core.lsn)
        yield g
        g = GaugeMetricFamily("spooler_receives_waiting", "Receives in a long poll on this node now")
        g.add_metric([], e.receives_waiting)
        yield g
        free = e.disk_free_bytes()
        if free is not None:  # (a file system that says nothing of its room: no sample)
            g = GaugeMetricFamily("spooler_disk_free_bytes",
                                  "Bytes free for this node on its data directory's file system")
            g.add_metric([], free)
            yield g
        g = GaugeMetricFamily("spooler_disk_free_bytes_min", "Below this many free bytes the primary refuses "
                              "sends as unavailable (reason disk_low): --disk-reserve-bytes")
        g.add_metric([], e.limits.disk_free_bytes_min)
        yield g
        if getattr(e, "loaded", False):
            yield from _cluster_families(e.repl.status(), e.node_id)


def _cluster_families(st: dict, me: str):
    """The cluster as this node sees it (GET /v1/cluster's figures): what to
    alert on without polling that route (no primary, a member out of reach, a
    replica falling behind)."""
    for name, doc, value in (
            ("spooler_is_primary", "1 while this node is the primary", st["role"] == "primary"),
            ("spooler_primary_known", "1 while this node knows a primary (itself or the one it follows)",
             bool(st["primary"])),
            ("spooler_commit_lsn", "Last log sequence number this node knows to be committed", st["commitLsn"])):
        g = GaugeMetricFamily(name, doc)
        g.add_metric([], float(value))
        yield g
    heard = GaugeMetricFamily("spooler_member_last_contact_seconds",
                              "How long ago this node last heard each other member (+Inf: not since it started "
                              "or took office)", labels=["member"])
    up = GaugeMetricFamily("spooler_member_reachable", "1 if this node heard the member within the failover timeout",
                           labels=["member"])
    match = GaugeMetricFamily("spooler_member_match_lsn",
                              "On the primary: how far each replica confirmed the log", labels=["member"])
    low = GaugeMetricFamily("spooler_member_disk_low",
                            "On the primary: 1 if the member's latest answer said its disk is below its reserve",
                            labels=["member"])
    for n in st["nodes"]:
        if n["id"] == me:
            continue
        if "diskLow" in n:
            low.add_metric([n["id"]], 1.0 if n["diskLow"] else 0.0)
        if "lastContactMs" in n:
            ms = n["lastContactMs"]
            heard.add_metric([n["id"]], float("inf") if ms is None else ms / 1e3)
        if "reachable" in n:
            up.add_metric([n["id"]], 1.0 if n["reachable"] else 0.0)
        if "matchLsn" in n:
            match.add_metric([n["id"]], float(n["matchLsn"]))
    yield heard
    yield up
    yield match
    yield low
