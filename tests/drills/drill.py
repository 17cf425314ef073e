"""One seeded process-failover drill against a real local cluster.

``run_drill(seed, duration_s, nodes=3, workdir=...)`` starts ``nodes`` spooler-node
processes (``cluster.Cluster``), creates a queue, and for ``duration_s`` seconds runs

- producers (3 threads): send unique bodies ``s<seed>-p<i>-<n>``;
- a batch producer (1 thread): sends batches of 2-6 unique bodies ``s<seed>-b0-<n>`` over
  gRPC in the compact form (a batch sent to the primary is held there as one segment;
  one sent to a replica is forwarded as entries); each body is recorded as its own send,
  all with the batch's outcome;
- consumers (2 threads): receive (wait 0.5 s), then ~5 % nack, ~5 % renew-then-ack,
  ~1 % abandon the lease (it expires), otherwise ack;
- with ``partitions=True``, a stayer (1 thread): a consumer that stays on the primary of
  the nemesis's latest round whatever it answers, renewing each lease 3-8 times before
  its ack, so a cut-off primary is asked for leases and renewals all through its cut;
- a role observer: ``GET /v1/cluster`` on every live node every ~100 ms, recording a
  ``role`` event whenever a node's (role, epoch) changes;
- a nemesis on a seeded schedule, one fault at a time: SIGKILL the primary and restart
  it later, SIGSTOP the primary past the failover timeout then SIGCONT, SIGKILL+restart a
  replica; with ``partitions=True`` also network partitions (see ``PARTITION_ACTIONS``)
  made by a ``proxy.FaultProxy`` that every node-to-node connection crosses, each healed
  before the next fault; with ``cascades=True`` also two faults that overlap (see
  ``CASCADE_ACTIONS``: the successor of a killed primary killed too, a replica killed
  and then the primary stopped). ``faults=(kind, ...)`` makes the nemesis carry out those
  kinds first, in order, and keeps the load going past ``duration_s`` until they are over.
  With ``client_partitions=True`` the clients (producers, consumers, the drain) reach
  every node through a second fault proxy, and the nemesis also cuts the links between
  the clients and one node or holds their bytes (see ``CLIENT_PARTITION_ACTIONS``);
  the role observer and the nemesis's own views still reach the nodes directly.
  With ``purges=True`` a second queue gets a producer and a consumer of its own and is
  purged every second or few (see ``PURGE_QUEUE``).

Every client call but the stayer's talks to a random running node (a new one after an error) and is
recorded in a :class:`History` (invoke, then ok / fail / unknown as the module docstring
of ``history.py`` prescribes). Then it heals everything, drains the queue and its failure
queue (receives recorded with ``drain: true``), waits for every node to apply the same LSN,
stops the nodes gracefully, runs ``PRAGMA integrity_check`` and digests each node's store,
records the ``final`` event, writes ``history.jsonl`` into the workdir and returns
``checker.check``'s report (plus ``seed``, ``wall_s``, ``workdir``, ``drain_complete``...).
"""
from __future__ import annotations

import asyncio
import base64
import os
import random
import struct
import threading
import time
import traceback
from typing import Optional

from spooler import errors
from spooler.http import HttpClient

try:  # imported as tests.drills.drill (python -m) or drills.drill (pytest rootdir tests/)
    from .checker import DEFINITE_FAILURE_KINDS, check
    from .cluster import Cluster, db_digest, primaries_from_logs, snapshot_installs_from_logs
    from .history import History, expires_at_monotonic
    from .proxy import ANSWERS_HELD, BLACKHOLE, DROP
    from . import builds
except ImportError:  # pragma: no cover
    from checker import DEFINITE_FAILURE_KINDS, check  # type: ignore
    from cluster import Cluster, db_digest, primaries_from_logs, snapshot_installs_from_logs  # type: ignore
    from history import History, expires_at_monotonic  # type: ignore
    from proxy import ANSWERS_HELD, BLACKHOLE, DROP  # type: ignore
    import builds  # type: ignore

QUEUE = "drill"
FAILURE_QUEUE = QUEUE + ".failed"
LEASE_S = 2.0
MAX_RETRIES = 50
CLIENT_TIMEOUT_S = 3.0
# The queue deduplicates: the keyed producer's sends carry a key, and an attempt
# whose outcome it does not know is sent again with that key, far inside the window
DEDUP_WINDOW_S = 3600
KEYED_ATTEMPTS = 8
RECEIVE_WAIT_S = 0.5

PROCESS_ACTIONS = (("kill_primary", 0.4), ("stop_primary", 0.35), ("restart_replica", 0.25))
# With partitions=True the nemesis draws from these (about two thirds are partitions):
#   isolate_primary    the primary cut from both others, both ways (drop: connections reset)
#                      for longer than the failover timeout
#   blackhole_primary  the same, but every byte is held (blackhole): only timeouts notice
#   isolate_replica    one replica cut off both ways (drop or blackhole)
#   one_way_out        the primary cannot reach the others, they can reach it: either its
#                      calls to them fail while theirs to it work ("calls"), or every byte it
#                      sends them is held while theirs reach it ("bytes"; see proxy.py)
#   one_way_in         the reverse: the others cannot reach the primary, it can reach them
PARTITION_ACTIONS = (("kill_primary", 0.12), ("stop_primary", 0.10), ("restart_replica", 0.08),
                     ("isolate_primary", 0.16), ("blackhole_primary", 0.12), ("isolate_replica", 0.12),
                     ("one_way_out", 0.15), ("one_way_in", 0.15))
# With cascades=True the nemesis also draws faults that overlap (about half of its draws):
#   kill_primary_twice      SIGKILL the primary; as soon as a successor is elected, SIGKILL
#                           that one too, within 0.3 s of seeing it (its first writes and
#                           the fencing of the old leases are in flight); restart the first,
#                           then the second
#   kill_replica_stop_primary  SIGKILL a replica, then SIGSTOP the primary: no quorum is
#                           left; restart the replica (it and the third node elect a new
#                           primary), then SIGCONT the old one, which must step down
CASCADE_ACTIONS = (("kill_primary_twice", 0.5), ("kill_replica_stop_primary", 0.5))
# with disk_loss=True: a replica's disk is lost and a replacement joins (--join);
# the next fault waits until it has joined (one lost disk at a time)
# (since 0.4.30 a third of them the primary's disk: the primary is killed with its disk, the
# others elect one of themselves, and the replacement joins as a replica; the draws of
# every other kind are as before)
DISK_LOSS_ACTIONS = (("replace_replica", 0.2), ("replace_primary", 0.1))
# with graceful=True: the primary is told to stop (SIGTERM, as a rolling restart does: it
# hands over first), and started again once it has exited
GRACEFUL_ACTIONS = (("term_primary", 0.3),)
# with fsync_errors=True (needs power_loss: the nodes' test VFS fails an fsync on demand): the
# next fsync of the primary or of a replica fails; the node must stop (exit 70) without
# confirming what that fsync held, and rejoin once started again on the same data
FSYNC_ERROR_ACTIONS = (("fsync_error", 0.3),)
# with write_errors=True (needs power_loss too): the same for the next writes of the node's
# store (an I/O error of a write, not of an fsync: the WAL's frames, or the database file's
# pages of SQLite's checkpoint)
WRITE_ERROR_ACTIONS = (("write_error", 0.3),)
FSYNC_EXIT_TIMEOUT_S = 15.0  # from the failing fsync's (or write's) file made to the node's exit
# with client_partitions=True the clients reach the nodes through a fault proxy, and the
# nemesis also faults the links between the clients and one node (both of its ports, HTTP
# and gRPC), for 3.75-5 s (longer than a client's timeout), then heals them, in the first
# three by resetting their connections (what a link held is discarded: no request reaches
# a node after its client gave up on it):
#   client_hold_primary  the primary's answers are held, its requests reach it and run
#                        (answers_held: a send stored whose 201 never comes, an ack applied
#                        whose 204 never comes, a lease granted whose answer is lost); one
#                        draw in three holds the requests too (blackhole)
#   client_cut_primary   every connection to the primary is reset (drop)
#   client_replica       a replica, in one of the three modes
#   client_late          the primary's (two draws in three) or a replica's requests and
#                        answers are held (blackhole), and at the heal everything held is
#                        delivered: requests whose clients gave up on them long ago reach
#                        the node and run there (a send stored, a lease granted, an ack or
#                        nack applied, after the client's timeout and its retry elsewhere)
# The node-to-node links are untouched: the cluster keeps its primary, and the clients of
# the faulted node time out (or see a reset) and move to another node.
CLIENT_PARTITION_ACTIONS = (("client_hold_primary", 0.2), ("client_cut_primary", 0.1), ("client_replica", 0.1),
                            ("client_late", 0.1))
# how long after a client_late heal a request it held may still take effect (the checker
# reads it from the nemesis event): it reaches the node within milliseconds of the heal,
# then runs as any request does (a receive's wait, a commit's quorum, a forward to the
# primary; the node-to-node links are healthy meanwhile)
LATE_EFFECT_S = 5.0
LATE_PROBE_TIMEOUT_S = 1.0  # the nemesis's own send into the held links gives up after this
# with slow_links=True (needs partitions: the proxy between the nodes): every byte between
# one node (the primary, or a replica) and the others is late, by 5% to 100% of the failover
# timeout (proxy.py "slow"), for as long as a partition lasts, then on time again: heartbeats and frames late, a quorum slow
# to answer, forwarded calls slow, elections run over slow links; nothing is lost
SLOW_LINK_ACTIONS = (("slow_links", 0.3),)
# with disk_low=True: the primary's disk fills (reads below its reserve: it refuses sends),
# in one draw in three a replica's with it, for a failover timeout and 2.5 to 5 s more, then
# has room again. A primary low on disk for a failover timeout hands over to a member with
# room (Replication.disk); a replica low on disk refuses to take over. The round notes
# whether a member with room was primary before the disks had room again.
DISK_LOW_ACTIONS = (("disk_low", 0.3),)
# with upgrade_from=TREE (an older build's node/ and spooler/, see builds.py): every node
# starts on that build, and the nemesis's first rounds are a rolling upgrade, one node a
# round, replicas first and the primary last: the node is told to stop (SIGTERM; a primary
# hands over first, an exit other than 0 fails the seed) and started again on this
# checkout's build; the rounds after it draw as usual
UPGRADE_ACTIONS = (("upgrade", 0.0),)
# with purges=True: a second queue with a producer and a consumer of its own, which a
# purger empties (POST .../purge) every PURGE_EVERY_S; the checker excuses from "lost" only
# that queue's messages a purge may have taken, and counts any message delivered after a
# purge that confirmed it gone (purged_then_delivered). The main queue is never purged.
# Its producer delays one send in five (by 0.1-1 s) and its consumer works 0.05-0.25 s on
# each message, so the queue holds visible, delayed and leased messages when a purge comes.
PURGE_QUEUE = "drill-purged"
PURGE_FAILURE_QUEUE = PURGE_QUEUE + ".failed"
PURGE_EVERY_S = (1.0, 3.0)
SPREAD_EVERY = 20  # with client partitions, a client moves to a random node after ~1 call in this many
# with sdk_clients=True a service on the asyncio SDK runs beside the HTTP clients (sdk_client):
# this many senders with one send each awaiting its answer (the SDK's auto-batching
# coalesces them on its Session stream), and one consumer
SDK_SENDERS = 4
# every fault kind the nemesis knows, for a scripted start (Drill(faults=...))
FAULT_KINDS = frozenset(a for acts in (PROCESS_ACTIONS, PARTITION_ACTIONS, CASCADE_ACTIONS, DISK_LOSS_ACTIONS,
                                       GRACEFUL_ACTIONS, FSYNC_ERROR_ACTIONS, WRITE_ERROR_ACTIONS,
                                       CLIENT_PARTITION_ACTIONS, SLOW_LINK_ACTIONS, DISK_LOW_ACTIONS,
                                       UPGRADE_ACTIONS)
                        for a, _ in acts)
SCRIPT_WAIT_S = 120.0  # how long past duration_s the load runs for the scripted faults to be done


def lease_token_epoch(token: str) -> Optional[int]:
    """The epoch a lease token carries (version 1: urlsafe base64 of >BQQ version, epoch,
    lease id, then nonce and queue), or None if the token is not in that form."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        version, epoch, _ = struct.unpack(">BQQ", raw[:17])
    except (ValueError, TypeError, struct.error):
        return None
    return epoch if version == 1 else None


def classify(exc: BaseException) -> tuple[str, dict]:
    """("fail" | "unknown", fields) for an exception of a client call."""
    if isinstance(exc, errors.SpoolerError):
        # (a connection that could not be made is "unavailable": HttpClient knows
        # nothing was sent, so it is a definite failure)
        fields = {"error": exc.kind, "message": str(exc)[:160]}
        if exc.reason:
            fields["reason"] = exc.reason
        if getattr(exc, "answer_lost", False):
            # the SDK's receive whose request reached a node but whose answer did not
            # come back: ``unavailable`` (a read, safe to repeat), yet it may have
            # leased; the SDK's one release may come too late (guarantees.md, S5)
            fields["answer_lost"] = True
            return "unknown", fields
        return ("fail" if exc.kind in DEFINITE_FAILURE_KINDS else "unknown"), fields
    return "unknown", {"error": type(exc).__name__, "message": str(exc)[:160]}


class _Client:
    """A logical client process: one node at a time, another random one after an error.
    With ``spread`` (client partitions) it also moves to a random running node, maybe
    the same, after about one call in SPREAD_EVERY, as clients behind a load balancer
    spread over the nodes: a fault of one node's client links then catches some of
    every client's calls, not only those of the clients that happened to be on it."""

    def __init__(self, cluster: Cluster, rng: random.Random, name: str, spread: bool = False, pin=None):
        self.cluster, self.rng, self.name, self.spread = cluster, rng, name, spread
        self.pin = pin  # () -> the node to stay on, whatever its answers (None: as any client)
        self.node: Optional[str] = None
        self.http: Optional[HttpClient] = None

    def pick(self, anywhere: bool = False) -> None:
        stay = self.pin() if self.pin is not None else None
        if stay is not None:
            if stay != self.node or self.http is None:
                self.node = stay
                self.http = HttpClient(self.cluster.client_url(stay), self.cluster.admin_key,
                                       timeout_s=CLIENT_TIMEOUT_S)
            return
        with self.cluster.lock:
            running = [n for n in self.cluster.ids if self.cluster.alive(n)]
        others = (running if anywhere else [n for n in running if n != self.node]) or running or self.cluster.ids
        self.node = self.rng.choice(others)
        self.http = HttpClient(self.cluster.client_url(self.node), self.cluster.admin_key,
                               timeout_s=CLIENT_TIMEOUT_S)

    def client(self) -> HttpClient:
        if self.http is None:
            self.pick()
        return self.http

    def moved(self) -> None:
        """After a call that did not fail: with ``spread``, move now and then."""
        if self.spread and self.rng.random() < 1 / SPREAD_EVERY:
            self.pick(anywhere=True)


class Drill:
    def __init__(self, seed: int, duration_s: float, nodes: int, workdir: str, producers: int = 3,
                 consumers: int = 2, send_pause_s: float = 0.05, failover_timeout_s: float = 1.0,
                 log=print, power_loss: bool = False, partitions: bool = False, cascades: bool = False,
                 disk_loss: bool = False, graceful: bool = False, fsync_errors: bool = False,
                 write_errors: bool = False, faults: tuple = (), node_args: tuple = (),
                 client_partitions: bool = False, slow_links: bool = False, sdk_clients: bool = False,
                 disk_low: bool = False, purges: bool = False, upgrade_from: Optional[str] = None):
        unknown = [f for f in faults if f not in FAULT_KINDS]
        if unknown:
            raise ValueError(f"unknown fault kinds {unknown}; known: {sorted(FAULT_KINDS)}")
        for flag, on in (("fsync_errors", fsync_errors), ("write_errors", write_errors)):
            if on and not power_loss:
                raise ValueError(f"{flag}=True needs power_loss=True (the test VFS is what fails the call)")
        if slow_links and not partitions:
            raise ValueError("slow_links=True needs partitions=True (the proxy between the nodes makes them slow)")
        needs = {"cascades": (cascades, {a for a, _ in CASCADE_ACTIONS}),
                 "fsync_errors": (fsync_errors, {a for a, _ in FSYNC_ERROR_ACTIONS}),
                 "write_errors": (write_errors, {a for a, _ in WRITE_ERROR_ACTIONS}),
                 "disk_loss": (disk_loss, {a for a, _ in DISK_LOSS_ACTIONS}),
                 "graceful": (graceful, {a for a, _ in GRACEFUL_ACTIONS}),
                 "client_partitions": (client_partitions, {a for a, _ in CLIENT_PARTITION_ACTIONS}),
                 "slow_links": (slow_links, {a for a, _ in SLOW_LINK_ACTIONS}),
                 "disk_low": (disk_low, {a for a, _ in DISK_LOW_ACTIONS}),
                 "upgrade_from": (upgrade_from, {a for a, _ in UPGRADE_ACTIONS}),
                 "partitions": (partitions, {a for a, _ in PARTITION_ACTIONS} - {a for a, _ in PROCESS_ACTIONS})}
        for flag, (on, kinds) in needs.items():
            if not on and set(faults) & kinds:
                raise ValueError(f"faults {sorted(set(faults) & kinds)} need {flag}=True")
        # The nemesis carries these out first, in order, each in place of a round's drawn kind
        # (the round's other draws are the seed's as usual); the load goes on past duration_s
        # until the last of them is over, so a test that needs a kind does not hang on timing.
        self.old_nodes: set = set()  # nodes still on the older build (upgrade_from)
        self.versions: dict = {}     # node -> [the version it ran at the start, and after each upgrade]
        if upgrade_from:
            faults = ("upgrade",) * nodes + tuple(faults)
        self.faults = list(faults)
        self.faults_done = threading.Event()
        self.rounds: list[str] = []  # the fault kind of each round carried out, in order
        self.seed, self.duration_s, self.workdir = seed, duration_s, os.path.abspath(workdir)
        self.n_producers, self.n_consumers = producers, consumers
        self.send_pause_s = send_pause_s
        self.failover_timeout_s = failover_timeout_s
        self.log = log
        self.h = History()
        self.power_loss = power_loss
        self.partitions = partitions
        self.cascades = cascades
        self.disk_loss = disk_loss
        self.graceful = graceful
        self.fsync_errors = fsync_errors
        self.write_errors = write_errors
        self.client_partitions = client_partitions
        self.sdk_clients = sdk_clients
        self.slow_links = slow_links
        self.disk_low = disk_low
        self.purges = purges
        # (report: "disk_low"; handover_s: from the disks filling to a member with room seen as primary)
        # cut_short: rounds the end of the load cut short before a handover was seen
        self.disk_low_rounds: dict = {"rounds": 0, "handed_over": 0, "cut_short": 0, "handover_s": []}
        self.cluster = Cluster(os.path.join(self.workdir, "nodes"), nodes=nodes,
                               failover_timeout_s=failover_timeout_s, power_loss=power_loss,
                               partitions=partitions, extra_args=node_args, fsync_errors=fsync_errors,
                               write_errors=write_errors, client_partitions=client_partitions,
                               disk_low=disk_low, entry=builds.entry(upgrade_from) if upgrade_from else None)
        if upgrade_from:
            self.old_nodes = set(self.cluster.ids)
        self.stop_load = threading.Event()
        self.stop_observer = threading.Event()
        self.thread_errors: list[str] = []
        self.failed_queue_ids: set = set()
        self.notes: list[str] = []
        self.late_probes = 0  # sends of the nemesis into client_late faults (_late_probe)
        self.stay_on: Optional[str] = None  # the stayer's node: the primary of the nemesis's latest round
        self.expected_down: set = set()   # nodes the drill itself killed / stopped gracefully
        self.unexpected_exits: list[dict] = []

    def rng(self, name: str) -> random.Random:
        return random.Random(f"{self.seed}/{name}")

    # -- recorded calls ------------------------------------------------------------------------
    def _call(self, c: _Client, f: str, fn, inv: dict, on_ok):
        """Invoke, run fn(http), complete; returns (outcome, value or exception)."""
        http = c.client()
        op = self.h.invoke(c.name, f, node=c.node, **inv)
        try:
            v = fn(http)
        except Exception as e:  # noqa: BLE001
            typ, fields = classify(e)
            getattr(op, typ)(**fields)
            c.pick()
            return typ, e
        op.ok(**on_ok(v, http))
        c.moved()
        return "ok", v

    def send(self, c: _Client, body: str, queue: str = QUEUE, delay_s: Optional[float] = None):
        return self._call(c, "send", lambda http: http.send(queue, body.encode(), delay_s=delay_s),
                          {"queue": queue, "body": body, **({"delay_s": delay_s} if delay_s else {})},
                          lambda v, http: {"id": v["id"], "duplicate": v.get("duplicate", False)})

    def receive(self, c: _Client, queue: str, wait_s: float, drain: bool = False):
        extra = {"drain": True} if drain else {}

        def on_ok(d, http):
            if d is None:
                return {"empty": True, **extra}
            # The epoch of the primary that granted the lease, from the token. Spooler-Epoch is
            # the answering node's own epoch: when a replica forwarded the receive to a newer
            # primary before applying that primary's EpochBegin, it names the older epoch.
            te = lease_token_epoch(d.token)
            d.epoch = te if te is not None else http.last_epoch
            return {"id": d.id, "body": d.body.decode(errors="replace"), "token": d.token,
                    "retry": d.retry_count, "epoch": d.epoch, "node_epoch": http.last_epoch,
                    "expires_at": expires_at_monotonic(d.expires_at), "expires_at_rfc3339": d.expires_at,
                    "queue": queue, **extra}
        return self._call(c, "receive", lambda http: http.receive(queue, wait_s=wait_s),
                          {"queue": queue, **extra}, on_ok)

    def settle(self, c: _Client, f: str, d: dict):
        inv = {"id": d["id"], "token": d["token"], "epoch": d["epoch"]}
        if f == "renew":
            return self._call(c, f, lambda http: http.renew(d["token"]), inv,
                              lambda v, http: {"expires_at": expires_at_monotonic(v), "expires_at_rfc3339": v})
        fn = (lambda http: http.ack(d["token"])) if f == "ack" else (lambda http: http.nack(d["token"]))
        return self._call(c, f, fn, inv, lambda v, http: {})

    def settle_retrying(self, c: _Client, f: str, d: dict, attempts: int = 4):
        """ack/nack; an unknown or unavailable outcome is retried (elsewhere) while the lease lives."""
        for _ in range(attempts):
            typ, v = self.settle(c, f, d)
            if typ == "ok" or isinstance(v, errors.StaleLease):
                return typ, v
            if time.monotonic() > d["expires_at"]:
                return typ, v
            time.sleep(0.05)
        return typ, v

    # -- threads ---------------------------------------------------------------------------------
    def _guard(self, name, fn):
        def run():
            try:
                fn()
            except Exception:  # noqa: BLE001
                self.thread_errors.append(f"{name}: {traceback.format_exc()}")
                self.stop_load.set()
        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        return t

    def producer(self, i: int, name: str = "", queue: str = QUEUE):
        name = name or f"p{i}"
        rng = self.rng(name)
        c = _Client(self.cluster, rng, name, spread=self.client_partitions)
        n = 0
        while not self.stop_load.is_set():
            n += 1
            # the purged queue's sends: one in five delayed, so that a purge finds some
            delay = round(rng.uniform(0.1, 1.0), 3) if queue == PURGE_QUEUE and rng.random() < 0.2 else None
            typ, v = self.send(c, f"s{self.seed}-{name}-{n}", queue, delay)
            if typ != "ok":
                self.stop_load.wait(0.05 + rng.random() * 0.1)
            elif self.send_pause_s:
                self.stop_load.wait(rng.random() * 2 * self.send_pause_s)

    def keyed_producer(self, name: str = "k0"):
        """Sends each body with a dedup key (the body itself) and, as a client with
        idempotency keys does, sends it again with the same key after any answer
        but a 201/200 (an unknown outcome, or a refusal), up to KEYED_ATTEMPTS
        times. It also sends again, with its key, a body answered a while ago
        (about one send in five, half a second to a few seconds later, so often
        across a failover), as a client whose answer was lost would: each such
        resend must be answered as a duplicate of the same message. The checker's
        keyed_duplicates counts keys that made more than one message (S6)."""
        rng = self.rng(name)
        c = _Client(self.cluster, rng, name, spread=self.client_partitions)
        n = 0
        answered: list = []  # (when, body) of sends answered, to send again later

        def send(body: str) -> str:
            typ, _ = self._call(c, "send", lambda http: http.send(QUEUE, body.encode(), dedup_key=body),
                                {"queue": QUEUE, "body": body, "key": body},
                                lambda v, http: {"id": v["id"], "duplicate": v.get("duplicate", False)})
            return typ

        while not self.stop_load.is_set():
            old = [x for x in answered if time.monotonic() - x[0] > 0.5]
            if old and rng.random() < 0.2:
                when, body = rng.choice(old)
                answered.remove((when, body))
            else:
                n += 1
                body = f"s{self.seed}-{name}-{n}"
            for _ in range(KEYED_ATTEMPTS):
                if send(body) == "ok":
                    answered.append((time.monotonic(), body))
                    del answered[:-50]
                    break
                self.stop_load.wait(0.05 + rng.random() * 0.1)
            if self.send_pause_s:
                self.stop_load.wait(rng.random() * 2 * self.send_pause_s)

    def batch_producer(self, name: str = "b0"):
        from spooler.client import Client
        from spooler._common import batch_request, batch_results
        rng = self.rng(name)
        c = _Client(self.cluster, rng, name, spread=self.client_partitions)
        n = 0
        while not self.stop_load.is_set():
            c.client()
            bodies = []
            for _ in range(rng.randint(2, 6)):
                n += 1
                bodies.append(f"s{self.seed}-{name}-{n}")
            ops = [self.h.invoke(name, "send", node=c.node, queue=QUEUE, body=b, batch=bodies[0]) for b in bodies]
            try:
                with Client(self.cluster.client_grpc_target(c.node), self.cluster.admin_key,
                            timeout_s=CLIENT_TIMEOUT_S, retry_attempts=1) as g:
                    req = batch_request([(QUEUE, b.encode(), 0.0, "") for b in bodies])  # the compact form
                    res = batch_results(g._call("SendBatch", req, write=True))
            except errors.SpoolerError as e:
                typ, fields = classify(e)
                for op in ops:
                    getattr(op, typ)(**fields)
                c.pick()
                self.stop_load.wait(0.05 + rng.random() * 0.1)
                continue
            if len(res) != len(bodies):
                # an answer of another length than the batch (batch_results is not told
                # the length, to see it here): a node's defect. Each entry's outcome is
                # unknown, and the seed fails (as for a client thread's error), instead
                # of the entries left without an answer passing as unknown sends
                for op in ops:
                    op.unknown(error="short_answer")
                self.thread_errors.append(f"{name}: SendBatch of {len(bodies)} answered {len(res)} results")
                self.stop_load.set()
                continue
            for op, r in zip(ops, res):
                op.ok(id=r.id, duplicate=r.duplicate)
            c.moved()
            if self.send_pause_s:
                self.stop_load.wait(rng.random() * 2 * self.send_pause_s)

    def _lease(self, c: _Client, queue: str, rng: random.Random) -> Optional[dict]:
        """One receive of a consumer: the lease it got ({id, token, epoch, expires_at}),
        or None (nothing there; or an error, after a short pause)."""
        typ, v = self.receive(c, queue, RECEIVE_WAIT_S)
        if typ != "ok":
            self.stop_load.wait(0.05 + rng.random() * 0.1)
            return None
        if v is None:
            return None
        return {"id": v.id, "token": v.token, "epoch": v.epoch, "expires_at": expires_at_monotonic(v.expires_at)}

    def consumer(self, i: int, name: str = "", queue: str = QUEUE):
        name = name or f"c{i}"
        rng = self.rng(name)
        c = _Client(self.cluster, rng, name, spread=self.client_partitions)
        while not self.stop_load.is_set():
            dd = self._lease(c, queue, rng)
            if dd is None:
                continue
            x = rng.random()
            if x < 0.01:
                continue  # abandon: the lease expires, the server auto-nacks
            if x < 0.06:
                self.settle_retrying(c, "nack", dd)
                continue
            if x < 0.11:
                time.sleep(rng.random() * 0.2)
                typ, v2 = self.settle(c, "renew", dd)
                if typ == "ok":
                    dd["expires_at"] = expires_at_monotonic(v2)
            elif queue == PURGE_QUEUE:
                time.sleep(rng.uniform(0.05, 0.25))  # slower than its producer: a purge finds messages
            elif rng.random() < 0.2:
                time.sleep(rng.random() * 0.05)  # some work
            self.settle_retrying(c, "ack", dd)

    def stayer(self, name: str = "s0"):
        """A consumer that stays on the node that was primary when the nemesis last
        began a round, whatever it answers: through a partition of that primary it
        keeps asking the cut-off node for leases and renewing the one it holds (every
        other client moves on after an error, so none would see a cut-off primary
        granting lease time; the checker counts any such grant behind a newer epoch).
        Each lease is renewed 3 to 8 times, 0.1-0.3 s apart, then acked."""
        rng = self.rng(name)
        # (until the nemesis's first round names a primary it moves as any client does)
        c = _Client(self.cluster, rng, name, pin=lambda: self.stay_on)
        while not self.stop_load.is_set():
            c.pick()  # (to the nemesis's latest primary, once it names one)
            dd = self._lease(c, QUEUE, rng)
            if dd is None:
                continue
            for _ in range(rng.randint(3, 8)):
                if self.stop_load.wait(rng.uniform(0.1, 0.3)):
                    break
                typ, v2 = self.settle(c, "renew", dd)
                if typ == "ok":
                    dd["expires_at"] = expires_at_monotonic(v2)
                elif isinstance(v2, errors.StaleLease):
                    break
            self.settle_retrying(c, "ack", dd)

    def purger(self, name: str = "x0"):
        """Empties PURGE_QUEUE every PURGE_EVERY_S, at a random node (a replica forwards)."""
        rng = self.rng(name)
        c = _Client(self.cluster, rng, name, spread=self.client_partitions)
        while not self.stop_load.wait(rng.uniform(*PURGE_EVERY_S)):
            self._call(c, "purge", lambda http: http.purge(PURGE_QUEUE), {"queue": PURGE_QUEUE},
                       lambda v, http: {"purged": v})

    def sdk_client(self, name: str = "g0"):
        """A service on the asyncio SDK (``spooler.aio.AsyncClient``): one client over
        every node's gRPC port (through the client proxy, if any), SDK_SENDERS senders
        whose sends its auto-batching coalesces on its Session stream and retries where
        the SDK holds a retry safe, and a consumer whose receives it gives back when
        their answers are lost and whose acks, nacks and renewals ride the same stream.
        Every call is recorded as the HTTP clients' are, with no node (the SDK picks
        it): the checker holds the SDK to its word, ``unavailable`` meaning "not
        stored" and a confirmed ack meaning the message never comes back."""
        asyncio.run(self._sdk_main(name))

    async def _sdk_main(self, name: str) -> None:
        from spooler.aio import AsyncClient
        rng = self.rng(name)
        c = self.cluster
        targets = ",".join(c.client_grpc_target(n) for n in c.ids)
        client = AsyncClient(targets, key=c.admin_key, timeout_s=CLIENT_TIMEOUT_S)
        try:
            tasks = [asyncio.create_task(self._sdk_sender(client, f"{name}s{i}", random.Random(rng.random())))
                     for i in range(SDK_SENDERS)]
            tasks.append(asyncio.create_task(self._sdk_consumer(client, f"{name}c", random.Random(rng.random()))))
            await asyncio.gather(*tasks)  # each ends at its first look at stop_load after it is set
        finally:
            await client.close()

    async def _sdk_call(self, proc: str, f: str, coro, inv: dict, on_ok):
        """Invoke, await coro, complete; returns (outcome, value or exception)."""
        op = self.h.invoke(proc, f, **inv)
        try:
            v = await coro
        except Exception as e:  # noqa: BLE001
            typ, fields = classify(e)
            getattr(op, typ)(**fields)
            return typ, e
        op.ok(**on_ok(v))
        return "ok", v

    async def _sdk_sender(self, client, proc: str, rng: random.Random) -> None:
        n = 0
        while not self.stop_load.is_set():
            n += 1
            body = f"s{self.seed}-{proc}-{n}"
            typ, _ = await self._sdk_call(proc, "send", client.send(QUEUE, body.encode()),
                                          {"queue": QUEUE, "body": body, "sdk": True},
                                          lambda r: {"id": r.id, "duplicate": r.duplicate})
            if typ != "ok":
                await asyncio.sleep(0.05 + rng.random() * 0.1)
            elif self.send_pause_s:
                await asyncio.sleep(rng.random() * 2 * self.send_pause_s)

    async def _sdk_consumer(self, client, proc: str, rng: random.Random) -> None:
        def delivered(ms):
            if not ms:
                return {"empty": True}
            m = ms[0]
            return {"id": m.id, "body": m.body.decode(errors="replace"), "token": m.token, "retry": m.retry_count,
                    "epoch": lease_token_epoch(m.token), "expires_at": expires_at_monotonic(str(m.expires_at)),
                    "expires_at_rfc3339": str(m.expires_at), "queue": QUEUE}
        while not self.stop_load.is_set():
            typ, ms = await self._sdk_call(proc, "receive", client.receive(QUEUE, wait_s=RECEIVE_WAIT_S),
                                           {"queue": QUEUE, "sdk": True}, delivered)
            if typ != "ok":
                await asyncio.sleep(0.05 + rng.random() * 0.1)
                continue
            if not ms:
                continue
            m = ms[0]
            inv = {"id": m.id, "token": m.token, "epoch": lease_token_epoch(m.token), "sdk": True}
            x = rng.random()
            if x < 0.01:
                continue  # abandon: the lease expires, the server auto-nacks
            if x < 0.06:
                await self._sdk_call(proc, "nack", client.nack(m.token), inv, lambda v: {})
                continue
            if x < 0.11:
                await asyncio.sleep(rng.random() * 0.2)
                await self._sdk_call(proc, "renew", client.renew(m.token), inv,
                                     lambda v: {"expires_at": expires_at_monotonic(str(v)),
                                                "expires_at_rfc3339": str(v)})
            elif rng.random() < 0.2:
                await asyncio.sleep(rng.random() * 0.05)  # some work
            await self._sdk_call(proc, "ack", client.ack(m.token), inv, lambda v: {})

    def observer(self):
        last: dict = {}
        while not self.stop_observer.is_set():
            with self.cluster.lock:  # a node process that exited without the nemesis killing it
                for nid, p in self.cluster.procs.items():
                    if p.proc is not None and p.proc.poll() is not None and nid not in self.expected_down:
                        self.expected_down.add(nid)
                        rc = p.proc.returncode
                        self.h.append({"type": "crash", "node": nid, "returncode": rc})
                        self.unexpected_exits.append({"node": nid, "returncode": rc, "t": time.monotonic()})
            for nid in self.cluster.live():
                info = self.cluster.info(nid, timeout_s=0.5)
                if info is None:
                    continue
                key = (info.get("role"), info.get("epoch"))
                if last.get(nid) != key:
                    last[nid] = key
                    self.h.role(nid, info.get("role"), info.get("epoch"), primary=info.get("primary"),
                                appliedLsn=info.get("appliedLsn"), commitLsn=info.get("commitLsn"))
            self.stop_observer.wait(0.1)

    def _wait_healthy(self, timeout_s: float = 20.0) -> None:
        """Every node answers and they agree on one primary."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            infos = self.cluster.infos()
            cp = self.cluster.current_primary()
            if cp is not None and len(infos) == len(self.cluster.ids):
                return
            time.sleep(0.1)
        self.notes.append(f"cluster not healthy {timeout_s}s after a nemesis at t={time.monotonic():.3f}")

    def nemesis(self):
        rng = self.rng("nemesis")
        actions = PARTITION_ACTIONS if self.partitions else PROCESS_ACTIONS
        if self.cascades:  # half of the draws overlap two faults
            actions = tuple((a, w / 2) for a, w in actions) + tuple((a, w / 2) for a, w in CASCADE_ACTIONS)
        if self.disk_loss:  # added last: the other actions keep their share of the draws
            total = sum(w for _, w in actions)
            actions = tuple((a, w * (1 - 0.3) / total) for a, w in actions) + DISK_LOSS_ACTIONS
        if self.graceful:  # after disk loss: without it, every other seed draws as before
            total = sum(w for _, w in actions)
            actions = tuple((a, w * (1 - 0.3) / total) for a, w in actions) + GRACEFUL_ACTIONS
        # last again (fsync errors, then write errors): without them, every other seed draws as before
        for on, more in ((self.fsync_errors, FSYNC_ERROR_ACTIONS), (self.write_errors, WRITE_ERROR_ACTIONS)):
            if on:
                total = sum(w for _, w in actions)
                actions = tuple((a, w * (1 - 0.3) / total) for a, w in actions) + more
        if self.client_partitions:  # after fsync and write errors, for the same reason
            total, share = sum(w for _, w in actions), sum(w for _, w in CLIENT_PARTITION_ACTIONS)
            actions = tuple((a, w * (1 - share) / total) for a, w in actions) + CLIENT_PARTITION_ACTIONS
        if self.slow_links:  # after client partitions, for the same reason
            total = sum(w for _, w in actions)
            actions = tuple((a, w * (1 - 0.3) / total) for a, w in actions) + SLOW_LINK_ACTIONS
        if self.disk_low:  # last of all, for the same reason
            total = sum(w for _, w in actions)
            actions = tuple((a, w * (1 - 0.3) / total) for a, w in actions) + DISK_LOW_ACTIONS
        # its own stream, so that cascades do not shift the other draws of a seed
        crng = self.rng("cascade")
        try:
            self._nemesis_rounds(rng, crng, actions)
        finally:
            self.faults_done.set()  # also when a round failed: run() is not left waiting

    def _nemesis_rounds(self, rng: random.Random, crng: random.Random, actions: tuple) -> None:
        c, h, ft = self.cluster, self.h, self.failover_timeout_s
        script = list(self.faults)
        if not script:
            self.faults_done.set()
        first = True
        while not self.stop_load.is_set():
            if self.stop_load.wait(rng.uniform(1.0, 2.0) if first else rng.uniform(2.0, 4.0)):
                break
            first = False
            action = rng.choices([a for a, _ in actions], [w for _, w in actions])[0]
            if script:
                action = script[0]
            down = rng.uniform(1.5, 4.0)
            # with partitions, every round draws the same numbers whatever the action, so the
            # n-th fault's kind and parameters depend on the seed alone
            x1, x2 = (rng.random(), rng.random()) if self.partitions or self.client_partitions else (None, None)
            cp = c.current_primary()
            if cp is None or len(c.live()) < len(c.ids) or any(
                    px is not None and px.faulted() for px in (c.proxy, c.client_proxy)):
                self._wait_healthy(5.0)  # one fault at a time
                continue
            p, epoch = cp
            self.stay_on = p  # the stayer's node for this round (and until the next)
            if action in ("kill_primary_twice", "kill_replica_stop_primary"):
                self._cascade(action, p, epoch, down, crng)
            elif action in ("replace_replica", "replace_primary"):
                self._replace(p, epoch, crng, primary=action == "replace_primary")
            elif action == "term_primary":
                self._term(p, epoch, down)
            elif action == "upgrade":
                self._upgrade(p, epoch, down)
            elif action in ("fsync_error", "write_error"):
                self._storage_error(action, p, epoch, down, crng)
            elif action == "disk_low":
                self._disk_low(p, epoch, down, crng)
            elif action in ("client_hold_primary", "client_cut_primary", "client_replica", "client_late"):
                # past a client's timeout: calls caught in a hold time out (and move on)
                self._client_partition(action, p, epoch, CLIENT_TIMEOUT_S + down / 2, x1, x2)
            elif action not in ("kill_primary", "stop_primary", "restart_replica"):
                self._partition(action, p, epoch, ft + 0.75 * down, x1, x2)
            elif action == "kill_primary":
                h.nemesis("power_loss" if self.power_loss else "kill", p, role="primary", epoch=epoch)
                self.expected_down.add(p)
                c.kill(p)
                self.stop_load.wait(down)
                h.nemesis("restart", p)
                c.restart(p)
                self.expected_down.discard(p)
                h.nemesis("restarted", p)
            elif action == "stop_primary":
                h.nemesis("stop", p, role="primary", epoch=epoch)
                c.stop_proc(p)
                self.stop_load.wait(ft + down / 2)
                h.nemesis("cont", p)
                c.cont(p)
            else:
                replicas = [n for n in c.ids if n != p]
                r = replicas[int(x1 * len(replicas))] if self.partitions else rng.choice(replicas)
                h.nemesis("power_loss" if self.power_loss else "kill", r, role="replica", epoch=epoch)
                self.expected_down.add(r)
                c.kill(r)
                h.nemesis("restart", r)
                c.restart(r)
                self.expected_down.discard(r)
                h.nemesis("restarted", r)
            self.rounds.append(action)
            if script:  # carried out (a round that waited for health above kept it)
                script.pop(0)
                if not script:
                    self.faults_done.set()
            self._wait_healthy()

    def _kill(self, node: str, role: str, epoch: int) -> None:
        self.h.nemesis("power_loss" if self.power_loss else "kill", node, role=role, epoch=epoch)
        self.expected_down.add(node)
        self.cluster.kill(node)

    def _restart(self, node: str) -> None:
        self.h.nemesis("restart", node)
        self.cluster.restart(node)
        self.expected_down.discard(node)
        self.h.nemesis("restarted", node)

    def _term(self, p: str, epoch: int, down: float) -> None:
        """A rolling restart's step: the primary told to stop (it hands over) and
        started again ``down`` seconds later (``_stop_and_restart``)."""
        self.h.nemesis("term", p, role="primary", epoch=epoch)
        self._stop_and_restart(p, down)

    def _stop_and_restart(self, node: str, down: float, upgraded: bool = False) -> None:
        """SIGTERM ``node`` (a primary hands over first; an exit other than 0 is noted,
        and fails the seed as an unexpected exit would), and start it again ``down``
        seconds later; ``upgraded``: on this checkout's build from then on."""
        self.expected_down.add(node)
        rc = self.cluster.graceful_stop(node)
        if rc not in (0, None):
            self.unexpected_exits.append({"node": node, "returncode": rc, "t": time.monotonic(), "on": "SIGTERM"})
        if upgraded:
            self.cluster.set_entry(node, None)
            self.old_nodes.discard(node)
        self.stop_load.wait(down)
        self._restart(node)

    def _upgrade(self, p: str, epoch: int, down: float) -> None:
        """A rolling upgrade's step: the first node still on the older build that is
        not the primary (the primary once it is the last) is told to stop, and ``down``
        seconds later started on this checkout's build."""
        old = [n for n in self.cluster.ids if n in self.old_nodes]
        if not old:
            self.notes.append("an upgrade round found every node upgraded already")
            return
        node = next((n for n in old if n != p), p)
        self.h.nemesis("upgrade", node, role="primary" if node == p else "replica", epoch=epoch)
        self._stop_and_restart(node, down, upgraded=True)
        self.versions.setdefault(node, []).append(self.cluster.version(node))

    def _storage_error(self, kind: str, p: str, epoch: int, down: float, rng: random.Random) -> None:
        """``kind`` "fsync_error": the next fsync of the primary or of a replica fails;
        "write_error": its next writes do (S9). The node must exit with
        EXIT_STORE_FAILED, confirming nothing that failed (the checker judges that),
        and is started again on the same data ``down`` seconds later (the disk
        healed), when it must rejoin. Any other exit, or none within
        FSYNC_EXIT_TIMEOUT_S, is an unexpected exit and fails the seed. The load's
        writes reach the node's store soon; so that it is not left waiting on them
        (the load may be ending), the nemesis also writes: it puts a queue of its own,
        outside the drill's, once a second until the node has exited."""
        from node.main import EXIT_STORE_FAILED
        c = self.cluster
        fail = c.fail_fsync if kind == "fsync_error" else c.fail_writes
        replicas = [n for n in c.ids if n != p]
        node = p if rng.random() < 0.5 else replicas[int(rng.random() * len(replicas))]
        self.h.nemesis(kind, node, role="primary" if node == p else "replica", epoch=epoch)
        self.expected_down.add(node)
        fail(node, True)
        rc = None
        try:
            deadline = time.monotonic() + FSYNC_EXIT_TIMEOUT_S
            n = 0
            while rc is None and time.monotonic() < deadline:
                rc = c.wait_exit(node, 1.0)
                if rc is None:
                    n += 1
                    self._poke(n, avoid=node)
        finally:
            fail(node, False)
        if rc != EXIT_STORE_FAILED:
            self.unexpected_exits.append({"node": node, "returncode": rc, "t": time.monotonic(), "on": kind})
        self.stop_load.wait(down)
        self._restart(node)

    def _disk_low(self, p: str, epoch: int, down: float, rng: random.Random) -> None:
        """The primary's disk (in one draw in three a replica's too) reads as full for a
        failover timeout and ``down`` + 1 s more (Engine.disk_low reads it at most once a
        second), then has room again. Noted: whether a member with room was primary
        before then (the primary hands over after a failover timeout low on disk)."""
        c = self.cluster
        replicas = [n for n in c.ids if n != p]
        full = [p] + ([replicas[int(rng.random() * len(replicas))]] if rng.random() < 1 / 3 else [])
        for n in full:
            self.h.nemesis("disk_low", n, role="primary" if n == p else "replica", epoch=epoch)
            c.fill_disk(n, True)
        self.disk_low_rounds["rounds"] += 1
        t0 = time.monotonic()
        deadline = t0 + self.failover_timeout_s + 1.0 + down
        handed = None
        try:
            while not self.stop_load.is_set() and time.monotonic() < deadline:
                cp = c.current_primary()
                if handed is None and cp is not None and cp[0] not in full:
                    handed = cp
                    self.disk_low_rounds["handed_over"] += 1
                    self.disk_low_rounds["handover_s"].append(round(time.monotonic() - t0, 2))
                    self.h.nemesis("disk_low_handed_over", cp[0], epoch=cp[1])
                time.sleep(0.1)
        finally:
            for n in full:
                c.fill_disk(n, False)
                self.h.nemesis("disk_room", n)
        if handed is None and self.stop_load.is_set():
            self.disk_low_rounds["cut_short"] += 1
        elif handed is None:
            self.notes.append(f"disk_low: {p} (low on disk with {full[1:] or 'no replica'}) was still primary, "
                              f"or no primary was known, {self.failover_timeout_s + 1.0 + down:.1f} s on")

    def _poke(self, n: int, avoid: str) -> None:
        """One write outside the drill's queue (a queue's setting changed): every node's
        store syncs it. Through any live node but ``avoid``; its outcome is not recorded."""
        c = self.cluster
        others = [x for x in c.live() if x != avoid]
        if not others:
            return
        try:
            HttpClient(c.url(others[n % len(others)]), c.admin_key, timeout_s=CLIENT_TIMEOUT_S).put_queue(
                "nemesis-poke", retentionSeconds=3600 + n)
        except Exception:  # noqa: BLE001 - no primary just now, or it is the failing node: the next one
            pass

    def _replace(self, p: str, epoch: int, rng: random.Random, primary: bool = False) -> None:
        """A replica's disk is lost (or the primary's, ``primary``: it is killed with
        its disk, and the others elect one of themselves): its replacement starts
        empty with --join; wait until it has joined, so that at most one disk is lost
        at a time."""
        c = self.cluster
        replicas = [n for n in c.ids if n != p]
        r = replicas[int(rng.random() * len(replicas))]
        if primary:
            r = p
        self.h.nemesis("disk_loss", r, role="primary" if primary else "replica", epoch=epoch)
        self.expected_down.add(r)
        c.replace(r)
        self.expected_down.discard(r)
        self.h.nemesis("restarted", r)
        deadline = time.monotonic() + 30.0
        while c.joining(r) is not False and time.monotonic() < deadline:
            time.sleep(0.1)
        if c.joining(r) is not False:
            self.notes.append(f"the replacement of {r} had not joined 30 s after it started")
        else:
            self.h.nemesis("joined", r)

    def _cascade(self, action: str, p: str, epoch: int, down: float, rng: random.Random) -> None:
        """Two faults that overlap (CASCADE_ACTIONS)."""
        c, ft = self.cluster, self.failover_timeout_s
        self.h.nemesis("cascade", p, kind=action, epoch=epoch)  # what follows belongs together
        if action == "kill_primary_twice":
            self._kill(p, "primary", epoch)
            deadline = time.monotonic() + 3 * ft + 5.0
            nxt = None
            while nxt is None and time.monotonic() < deadline and not self.stop_load.is_set():
                cp = c.current_primary(timeout_s=0.3)
                if cp is not None and cp[0] != p and cp[1] > epoch:
                    nxt = cp
                else:
                    time.sleep(0.02)
            if nxt is not None:
                self.stop_load.wait(rng.uniform(0.0, 0.3))
                self._kill(nxt[0], "primary", nxt[1])
                self.stop_load.wait(down / 2)
            else:
                if not self.stop_load.is_set():  # (else the load's end cut the wait short)
                    self.notes.append(f"no successor of {p} (epoch {epoch}) within {3 * ft + 5.0:.1f}s to kill")
                self.stop_load.wait(down / 2)
            self._restart(p)
            if nxt is not None:
                self.stop_load.wait(down / 2)
                self._restart(nxt[0])
        else:  # kill_replica_stop_primary
            replicas = [n for n in c.ids if n != p]
            r = replicas[int(rng.random() * len(replicas))]
            self._kill(r, "replica", epoch)
            self.stop_load.wait(rng.uniform(0.2, 1.0))
            self.h.nemesis("stop", p, role="primary", epoch=epoch)
            c.stop_proc(p)
            self.stop_load.wait(down / 2)
            self._restart(r)  # it and the third node can elect without the stopped primary
            self.stop_load.wait(ft + down / 2)
            self.h.nemesis("cont", p)
            c.cont(p)

    def _partition(self, action: str, p: str, epoch: int, hold_s: float, x1: float, x2: float) -> None:
        """One partition of the primary ``p`` (or of a replica) for ``hold_s``, then heal.
        x1, x2: this round's uniform draws, for the replica and the variant."""
        c, h, px = self.cluster, self.h, self.cluster.proxy
        node, role, level = p, "primary", "calls"
        if action == "isolate_primary":
            kind, mode, direction = "isolate", DROP, "both"
        elif action == "blackhole_primary":
            kind, mode, direction = "blackhole", BLACKHOLE, "both"
        elif action == "isolate_replica":
            replicas = [n for n in c.ids if n != p]
            node, role = replicas[int(x1 * len(replicas))], "replica"
            kind, mode, direction = "isolate", (DROP if x2 < 0.5 else BLACKHOLE), "both"
        elif action == "slow_links":
            if x1 >= 0.5:
                replicas = [n for n in c.ids if n != p]
                node, role = replicas[int((x1 - 0.5) * 2 * len(replicas))], "replica"
            kind = mode = "slow"
            direction, level = "both", "bytes"
        else:  # one_way_out / one_way_in
            direction = "out" if action == "one_way_out" else "in"
            level = "bytes" if x1 < 0.5 else "calls"
            kind = action + ("_bytes" if level == "bytes" else "")
            mode = (DROP if x2 < 0.5 else BLACKHOLE) if level == "calls" else "one_way"
        delay_s = round(self.failover_timeout_s * (0.05 + 0.95 * x2), 3) if kind == "slow" else None
        h.nemesis("partition", node, role=role, epoch=epoch, kind=kind, mode=mode, direction=direction,
                  level=level, hold_s=round(hold_s, 3), **({"delay_s": delay_s} if delay_s else {}))
        if kind == "slow":
            links = px.slow_links(node, delay_s)
        elif level == "bytes":
            links = px.one_way_bytes(node, direction)
        else:
            links = px.isolate(node, mode, direction)
        self.stop_load.wait(hold_s)
        h.nemesis("heal", node, kind=kind, links=sorted(f"{a}->{b}:{m}" for (a, b), m in links.items()))
        px.heal()
        t_heal = time.monotonic()
        if self._wait_rejoined(30.0):
            # not a fault: how long until every node follows one primary again (evidence only)
            h.nemesis("rejoined", node, kind=kind, after_heal_s=round(time.monotonic() - t_heal, 3))
        else:
            self.notes.append(f"{node} did not rejoin within 30s of the heal of {kind} at t={t_heal:.3f}")

    def _client_partition(self, action: str, p: str, epoch: int, hold_s: float, x1: float, x2: float) -> None:
        """The links between the clients and the primary ``p`` (or a replica) faulted for
        ``hold_s`` (CLIENT_PARTITION_ACTIONS), then healed. Healed with their connections
        reset, whatever they held is discarded, so a request held there never reaches the
        node after its client gave up (the checker takes an unknown call to have taken
        effect, if at all, while it was in flight). ``client_late`` heals them without a
        reset: what they held is delivered, and the nemesis events say for how long after
        the heal a call held there may take effect (``late_effect_s``), which the checker
        then allows its unknown calls. x1, x2: this round's uniform draws."""
        c, h, px = self.cluster, self.h, self.cluster.client_proxy
        node, role, late = p, "primary", action == "client_late"
        if action == "client_replica" or (late and x1 >= 2 / 3):
            replicas = [n for n in c.ids if n != p]
            node, role = replicas[int((x1 if not late else x2) * len(replicas))], "replica"
        if late:
            mode = BLACKHOLE
        elif action == "client_replica":
            mode = (ANSWERS_HELD, BLACKHOLE, DROP)[min(2, int(x2 * 3))]
        elif action == "client_cut_primary":
            mode = DROP
        else:
            mode = BLACKHOLE if x2 < 1 / 3 else ANSWERS_HELD
        kind = "hold_late" if late else {ANSWERS_HELD: "hold_answers", BLACKHOLE: "hold", DROP: "cut"}[mode]
        links = {k: mode for k in c.client_links(node)}
        extra = {"late_effect_s": LATE_EFFECT_S} if late else {}
        h.nemesis("client_partition", node, role=role, epoch=epoch, kind=kind, mode=mode,
                  hold_s=round(hold_s, 3), **extra)
        px.set_links(links)
        t0 = time.monotonic()
        if late:
            self._late_probe(node)
        self.stop_load.wait(max(0.0, hold_s - (time.monotonic() - t0)))
        h.nemesis("client_heal", node, links=sorted(f"{a}->{b}:{m}" for (a, b), m in links.items()),
                  **({"late": True} if late else {}))
        px.heal(reset=not late)

    def _late_probe(self, node: str) -> None:
        """One send of the nemesis's own into the held links (a client_late fault), so
        that every such fault holds at least one request whose client gives up on it (a
        timeout of LATE_PROBE_TIMEOUT_S): recorded as any client's send, and stored once
        the heal delivers it."""
        self.late_probes += 1
        body = f"s{self.seed}-late-{self.late_probes}"
        http = HttpClient(self.cluster.client_url(node), self.cluster.admin_key, timeout_s=LATE_PROBE_TIMEOUT_S)
        op = self.h.invoke("late-probe", "send", node=node, queue=QUEUE, body=body)
        try:
            v = http.send(QUEUE, body.encode())
        except Exception as e:  # noqa: BLE001 - recorded; held, it times out
            typ, fields = classify(e)
            getattr(op, typ)(**fields)
        else:
            op.ok(id=v["id"], duplicate=v.get("duplicate", False))

    def _wait_rejoined(self, timeout_s: float) -> bool:
        """Every node answers and names the same primary in the same epoch."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            infos = self.cluster.infos(timeout_s=0.5)
            views = {(d.get("primary"), d.get("epoch")) for d in infos.values()}
            if len(infos) == len(self.cluster.ids) and len(views) == 1 and next(iter(views))[0] is not None:
                return True
            time.sleep(0.05)
        return False

    # -- phases -------------------------------------------------------------------------------------
    def heal(self):
        c = self.cluster
        if c.proxy is not None and c.proxy.faulted():
            links = c.proxy.faulted()
            self.h.nemesis("heal", None, phase="heal",
                           links=sorted(f"{a}->{b}:{m}" for (a, b), m in links.items()))
            c.proxy.heal()
        if c.client_proxy is not None and c.client_proxy.faulted():
            links = c.client_proxy.faulted()
            self.h.nemesis("client_heal", None, phase="heal",
                           links=sorted(f"{a}->{b}:{m}" for (a, b), m in links.items()))
            c.client_proxy.heal(reset=True)
        for nid in c.ids:
            if nid in c.stopped:
                self.h.nemesis("cont", nid, phase="heal")
                c.cont(nid)
            if not c.alive(nid):
                self.h.nemesis("restart", nid, phase="heal")
                c.restart(nid)
                self.expected_down.discard(nid)

    def setup_queue(self):
        c = _Client(self.cluster, self.rng("setup"), "setup")
        deadline = time.monotonic() + 30
        queues = [QUEUE, PURGE_QUEUE] if self.purges else [QUEUE]
        while queues:
            try:
                c.client().put_queue(queues[0], leaseTimeoutSeconds=LEASE_S, maxRetries=MAX_RETRIES,
                                     dedupWindowSeconds=DEDUP_WINDOW_S)
                queues.pop(0)
            except errors.SpoolerError:
                if time.monotonic() > deadline:
                    raise
                c.pick()
                time.sleep(0.2)

    def _stats(self, c: _Client, queue: str) -> Optional[dict]:
        try:
            return c.client().get_queue(queue)["stats"]
        except errors.QueueNotFound:
            return {}
        except errors.SpoolerError:
            c.pick()
            return None

    def drain(self, timeout_s: float = 120.0) -> bool:
        """Receive+ack from the queue and its failure queue (and with purges the purged queue
        and its failure queue) until every one is empty."""
        c = _Client(self.cluster, self.rng("drain"), "drain")
        deadline = time.monotonic() + timeout_s
        pairs = [(QUEUE, FAILURE_QUEUE)] + ([(PURGE_QUEUE, PURGE_FAILURE_QUEUE)] if self.purges else [])
        failure_queues = {f for _, f in pairs}
        queues = [q for q, _ in pairs]
        while time.monotonic() < deadline:
            got = 0
            for q in queues:
                while time.monotonic() < deadline:
                    typ, v = self.receive(c, q, 0.2, drain=True)
                    if typ != "ok":
                        time.sleep(0.1)
                        break
                    if v is None:
                        break
                    got += 1
                    if q in failure_queues:
                        self.failed_queue_ids.add(v.id)
                    dd = {"id": v.id, "token": v.token, "epoch": v.epoch,
                          "expires_at": expires_at_monotonic(v.expires_at)}
                    self.settle_retrying(c, "ack", dd)
            if got:
                continue
            stats = {q: self._stats(c, q) for pair in pairs for q in pair}
            if any(s is None for s in stats.values()):
                continue
            for f in failure_queues:
                if stats[f] and f not in queues:
                    queues.append(f)  # created on demand: exists once something failed
            if all((s.get("visible", 0) + s.get("leased", 0) + s.get("delayed", 0)) == 0 for s in stats.values()):
                return True
            time.sleep(0.1)
        self.notes.append(f"drain incomplete after {timeout_s}s")
        return False

    def finish(self) -> dict:
        """Converge, stop every node gracefully (replicas first), integrity + digest per node."""
        c = self.cluster
        try:
            lsns = c.wait_converged(timeout_s=60)
        except AssertionError as e:
            lsns = {nid: (c.info(nid) or {}).get("appliedLsn") for nid in c.ids}
            self.notes.append(f"nodes did not converge: {str(e)[:2000]}")
        cp = c.current_primary()
        primary = cp[0] if cp else c.ids[0]
        self.stop_observer.set()
        self.expected_down.update(c.ids)
        states, integrity, counters = {}, {}, {}
        rcs: dict = {}

        def stop(nid):
            rcs[nid] = c.graceful_stop(nid)
        ts = [threading.Thread(target=stop, args=(n,)) for n in c.ids if n != primary]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        stop(primary)  # last: no election while the others stop
        for nid, rc in sorted(rcs.items()):
            if rc not in (0, None):
                self.notes.append(f"{nid} exited with {rc} on SIGTERM")
        for nid in c.ids:
            try:
                d = db_digest(c.procs[nid].data_dir)
                states[nid], integrity[nid], counters[nid] = d["digest"], d["integrity"], d["counters"]
            except Exception as e:  # noqa: BLE001
                states[nid], integrity[nid] = f"error: {e}", f"error: {e}"
        return {"node_states": states, "integrity": integrity, "node_counters": counters,
                "applied_lsn": lsns}

    def run(self) -> dict:
        t0 = time.monotonic()
        os.makedirs(self.workdir, exist_ok=True)
        hist_path = os.path.join(self.workdir, "history.jsonl")
        report: dict = {}
        drained = False
        final: dict = {}
        final_proxy: Optional[dict] = None
        final_client_proxy: Optional[dict] = None
        with self.cluster:
            try:
                self.cluster.primary(timeout_s=30)
                for nid in self.cluster.ids:
                    self.versions[nid] = [self.cluster.version(nid)]
                self.setup_queue()
                obs = self._guard("observer", self.observer)
                load = [self._guard(f"p{i}", lambda i=i: self.producer(i)) for i in range(self.n_producers)]
                load.append(self._guard("b0", self.batch_producer))
                load.append(self._guard("k0", self.keyed_producer))
                load += [self._guard(f"c{i}", lambda i=i: self.consumer(i)) for i in range(self.n_consumers)]
                if self.sdk_clients:
                    load.append(self._guard("g0", self.sdk_client))
                if self.partitions:
                    load.append(self._guard("s0", self.stayer))
                if self.purges:
                    load += [self._guard("q0", lambda: self.producer(0, "q0", PURGE_QUEUE)),
                             self._guard("qc0", lambda: self.consumer(0, "qc0", PURGE_QUEUE)),
                             self._guard("x0", self.purger)]
                nem = self._guard("nemesis", self.nemesis)
                self.stop_load.wait(self.duration_s)
                if not self.faults_done.wait(SCRIPT_WAIT_S):
                    self.notes.append(f"scripted faults {self.faults} not all carried out "
                                      f"{SCRIPT_WAIT_S:.0f}s past the duration")
                self.stop_load.set()
                for t in load + [nem]:
                    t.join(timeout=60)
                    if t.is_alive():
                        self.notes.append(f"thread {t.name} did not stop")
                self.heal()
                self.cluster.primary(timeout_s=30)
                drained = self.drain()
                final = self.finish()
                if self.cluster.proxy is not None:
                    final_proxy = self.cluster.proxy.stats()
                if self.cluster.client_proxy is not None:
                    final_client_proxy = self.cluster.client_proxy.stats()
                obs.join(timeout=10)
            finally:
                self.stop_observer.set()
                # every election the nodes logged, however briefly its primary served
                # (the observer samples every 100 ms or so and can miss one)
                for epoch, nodes in sorted(primaries_from_logs(self.cluster.workdir).items()):
                    for nid in sorted(nodes):
                        self.h.role(nid, "primary", epoch, source="node_log")
                self.h.final(expired_ids=[], failed_queue_ids=sorted(self.failed_queue_ids), drained=drained,
                             **final)
                self.h.to_jsonl(hist_path)
        report = check(self.h)
        if self.cluster.watch_errors_total:  # a down node's links may have accepted, or a live one's refused
            self.notes.append(f"the cluster's watcher failed {self.cluster.watch_errors_total} refusals "
                              f"(tried again): {self.cluster.watch_errors[:3]}")
        # evidence, "f outcome [error]" -> how many: the SDK service's calls; the
        # stayer's, and those of them asked of a primary while a partition cut it
        # off (from its partition's start to its heal)
        sdk_calls: dict = {}
        stayer_calls: dict = {}
        stayer_cut_calls: dict = {}
        sdk_ops: set = set()  # (process, op) of the SDK service's calls
        cut: set = set()  # nodes a partition of them as primary holds cut off now
        asked_cut: set = set()  # the stayer's ops asked of a cut-off primary
        for e in self.h.events:
            typ = e.get("type")
            if typ == "nemesis" and e["f"] == "partition" and e.get("role") == "primary":
                cut.add(e["node"])
            elif typ == "nemesis" and e["f"] == "heal":
                if e.get("node") is None:  # the run's final heal: of everything
                    cut.clear()
                cut.discard(e.get("node"))
            elif typ == "invoke":
                if e.get("sdk"):
                    sdk_ops.add((e["process"], e["op"]))
                if e.get("process") == "s0" and e.get("node") in cut:
                    asked_cut.add(e["op"])
            elif typ in ("ok", "fail", "unknown"):
                k = f"{e['f']} {typ}" + (f" {e['error']}" if e.get("error") else "")
                if (e.get("process"), e.get("op")) in sdk_ops:
                    sdk_calls[k] = sdk_calls.get(k, 0) + 1
                if e.get("process") == "s0":
                    stayer_calls[k] = stayer_calls.get(k, 0) + 1
                    if e["op"] in asked_cut:
                        stayer_cut_calls[k] = stayer_cut_calls.get(k, 0) + 1
        nem_counts: dict = {}
        for e in self.h.events:
            if e.get("type") == "nemesis" and e.get("phase") != "heal" and e["f"] not in ("restarted", "rejoined"):
                k = e["f"] + (f"_{e['kind']}" if e.get("kind") and e["f"] != "heal" else "") + (
                    f"_{e['role']}" if e.get("role") else "")
                nem_counts[k] = nem_counts.get(k, 0) + 1
        rejoins = [{"kind": e.get("kind"), "node": e.get("node"), "after_heal_s": e["after_heal_s"]}
                   for e in self.h.events if e.get("type") == "nemesis" and e["f"] == "rejoined"]
        report.update(seed=self.seed, rejoins=rejoins, duration_s=self.duration_s, wall_s=time.monotonic() - t0,
                      workdir=self.workdir, history=hist_path, drain_complete=drained,
                      nemesis_counts=nem_counts, sdk_calls=sdk_calls, stayer_calls=stayer_calls,
                      stayer_cut_calls=stayer_cut_calls, faults=list(self.rounds), thread_errors=self.thread_errors, notes=self.notes,
                      node_counters=final.get("node_counters"), proxy_links=final_proxy,
                      client_proxy_links=final_client_proxy)
        report["unexpected_exits"] = self.unexpected_exits
        report["versions"] = self.versions
        if self.disk_low:
            report["disk_low"] = dict(self.disk_low_rounds, handover_s=list(self.disk_low_rounds["handover_s"]))
        report["snapshot_installs"] = snapshot_installs_from_logs(self.cluster.workdir)
        if self.thread_errors or not drained or self.unexpected_exits:
            report["required_zeros_ok"] = False
        return report


def run_drill(seed: int, duration_s: float, nodes: int = 3, workdir: Optional[str] = None, **kw) -> dict:
    """Run one drill; returns checker.check's report plus run facts. The history is kept
    in ``<workdir>/history.jsonl`` and the node logs in ``<workdir>/nodes/n*/n*.log``."""
    if workdir is None:
        import tempfile
        workdir = tempfile.mkdtemp(prefix=f"drill-{seed}-")
    return Drill(seed, duration_s, nodes, workdir, **kw).run()
