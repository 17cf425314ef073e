"""Prometheus metrics (one registry per node, so tests can run several)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from spooler.pb import log_pb2


class Metrics:
    def __init__(self, engine):
        self.engine = engine
        r = self.registry = CollectorRegistry()
        self.sends = Counter("spooler_sends", "Messages stored (duplicates excluded)", registry=r)
        self.duplicates = Counter("spooler_send_duplicates", "Sends answered as dedup duplicates", registry=r)
        self.receives = Counter("spooler_receives", "Messages leased to consumers", registry=r)
        self.acks = Counter("spooler_acks", "Messages acked", registry=r)
        self.nacks = Counter("spooler_nacks", "Messages nacked by consumers", registry=r)
        self.expiries = Counter("spooler_lease_expiries", "Leases that timed out (server-side nacks)", registry=r)
        self.drops = Counter("spooler_retention_drops", "Messages dropped by retention", registry=r)
        self.commit_records = Histogram("spooler_commit_batch_records", "Log records per group commit",
                                        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096), registry=r)
        self.fsync_seconds = Histogram("spooler_commit_seconds", "Duration of one group commit (write + fsync)",
                                       buckets=(.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .5, 1),
                                       registry=r)
        self.http_errors = Counter("spooler_errors", "Errors answered, by kind", ["kind"], registry=r)
        r.register(_StateCollector(engine))
        engine.on_apply.append(self._on_apply)
        engine.metrics = self

    def observe_commit(self, records: int, seconds: float) -> None:
        self.commit_records.observe(records)
        self.fsync_seconds.observe(seconds)

    def _on_apply(self, rec, result) -> None:
        op = rec.WhichOneof("op")
        if op in ("send", "send_compact"):
            # only entries can be duplicates (a run carries no dedup keys)
            n_run = len(getattr(rec, op).run_bodies)
            entries = result[:len(result) - n_run]
            dup = sum(1 for _, d in entries if d is True)
            stored = sum(1 for m, d in entries if m is not None and d is False)
            if n_run and result[-1][0] is not None:
                stored += n_run
            self.sends.inc(stored)
            if dup:
                self.duplicates.inc(dup)
        elif op == "settle":
            # counted per record, not per entry: each inc() takes the counter's lock
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

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        e = self.engine
        depth = GaugeMetricFamily("spooler_queue_messages", "Messages in a queue by state", labels=["queue", "state"])
        now = e.now_us()
        for name in list(e.core.queues):
            s = e.core.stats(name, now)
            for state in ("visible", "leased", "delayed"):
                depth.add_metric([name, state], s[state])
        yield depth
        g = GaugeMetricFamily("spooler_epoch", "Newest epoch this node knows (as Spooler-Epoch)")
        g.add_metric([], e.known_epoch)
        yield g
        g = GaugeMetricFamily("spooler_applied_lsn", "Last applied log sequence number")
        g.add_metric([], e.core.lsn)
        yield g
        g = GaugeMetricFamily("spooler_receives_waiting", "Receives in a long poll on this node now")
        g.add_metric([], e.receives_waiting)
        yield g
