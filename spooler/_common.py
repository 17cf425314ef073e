"""What the sync and asyncio gRPC clients share: types, error mapping, retry policy."""
from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from datetime import datetime
from itertools import repeat
from typing import Callable, Optional

import grpc
import tenacity

from spooler import errors
from spooler.ids import run_ids
from spooler.pb import api_pb2

# gRPC's message size limit, on both sides. A body (or a send_batch) that cannot
# fit in one is refused here, as message_too_large: gRPC would refuse to send it,
# and on a Session that would break the stream under every call riding it.
MESSAGE_BYTES_MAX = 16 * 1024 * 1024
BODIES_BYTES_MAX = MESSAGE_BYTES_MAX - 64 * 1024  # room for the rest of the request
# A queue name or dedup key the SDK sends at all, in UTF-8 bytes (see check_name): far
# over any node's limit (255 and 128 characters), and two of them fit in the room
# BODIES_BYTES_MAX leaves.
NAME_BYTES_MAX = 16 * 1024
# A lease token the SDK sends at all: a node's tokens have at most 400 characters,
# and refuses longer ones as malformed; far longer ones (a body passed by mistake)
# would make a settle request gRPC cannot carry, and break the Session stream
# under every call riding it. So would a settle batch of more items than a node
# takes (BATCH_ITEMS_MAX, its batch_entries_max): both refused before sending.
TOKEN_CHARS_MAX = 1024
BATCH_ITEMS_MAX = 1000

PING_INTERVAL_MS = 2_000
PING_TIMEOUT_S = 5.0  # the clients' ping_timeout_s default
TIMEOUT_S_MAX = 1e6    # a client's timeout_s: at most about eleven days

GRPC_OPTIONS = [
    # one Session stream carries many batches at once: let it have more than
    # HTTP/2's default 64 KiB in flight before flow control stalls it
    ("grpc.http2.lookahead_bytes", 8 * 1024 * 1024),
    ("grpc.max_receive_message_length", MESSAGE_BYTES_MAX),
    ("grpc.max_send_message_length", MESSAGE_BYTES_MAX),
    # A node that hangs (a paused process, a host that stopped answering) must not
    # hold a call for its whole timeout: every ping, a keepalive or one gRPC sends
    # along with a request, has PING_TIMEOUT_S to be answered, or the connection is
    # closed and the calls on it fail at once (the client then moves to the next
    # node). gRPC answers pings off the event loop, so a busy node still answers in
    # time; a ping queued behind megabytes on a slow link may not (ping_timeout_s).
    # Pinging every 2 s while idle must stay within what the node permits
    # (node/api/grpc_api.py: min_ping_interval_without_data_ms).
    ("grpc.keepalive_time_ms", PING_INTERVAL_MS),
    ("grpc.keepalive_timeout_ms", int(PING_TIMEOUT_S * 1000)),
    ("grpc.http2.ping_timeout_ms", int(PING_TIMEOUT_S * 1000)),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_time_between_pings_ms", 1_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # After failed connection attempts gRPC waits 1 s, then 1.6 times longer each
    # time, up to 120 s, and a channel waiting that out fails every call at once:
    # a node back after a minute's outage would go unreached through a whole call's
    # retries (3.1 s). Capped at 1 s, a node that is back is reached within one
    # call's retries. (The connection attempt's own timeout stays gRPC's 20 s.)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def grpc_options(ping_timeout_s: float = PING_TIMEOUT_S) -> list:
    """GRPC_OPTIONS with another ping timeout (seconds, > 0)."""
    if isinstance(ping_timeout_s, bool) or not isinstance(ping_timeout_s, (int, float)) or not ping_timeout_s > 0:
        raise ValueError("ping_timeout_s must be a number > 0")
    ms = max(1, int(ping_timeout_s * 1000))
    return [(k, ms) if k in ("grpc.keepalive_timeout_ms", "grpc.http2.ping_timeout_ms") else (k, v)
            for k, v in GRPC_OPTIONS]

SETTINGS_PB = {"leaseTimeoutSeconds": "lease_timeout_seconds", "maxRetries": "max_retries",
               "retentionSeconds": "retention_seconds", "dedupWindowSeconds": "dedup_window_seconds",
               "failureQueue": "failure_queue"}
SNAKE_SETTINGS = {v: v for v in SETTINGS_PB.values()}


class LeaseEnd(str):
    """A lease's expiresAt (RFC 3339, UTC: the contract's string) that also carries
    ``left_s``, what was left of the lease when the primary granted or renewed it
    (0.0: not known, an older node), and ``deadline``: the ``time.monotonic()`` by
    which it has ended at the latest, measured from the start of the call that got
    it (None: not known). Renewals are timed by ``deadline``, on the client's own
    clock, so no difference between its wall clock and the nodes' moves them."""

    def __new__(cls, at: str, left_s: float = 0.0, started: Optional[float] = None):
        self = super().__new__(cls, at)
        self.left_s = left_s
        self.deadline = started + left_s if started is not None and left_s > 0 else None
        return self

    def __reduce__(self):
        # a deadline is on this host's monotonic clock: a copy on another host (a
        # Message pickled over) keeps the length, not the deadline
        return (LeaseEnd, (str(self), self.left_s))

    def __copy__(self):
        return self  # (immutable; a copy in this process keeps its deadline)

    def __deepcopy__(self, memo):
        return self


@dataclass
class Message:
    id: str
    body: bytes
    token: str
    retry_count: int
    expires_at: str  # a LeaseEnd from the gRPC clients
    queue: str
    # True once a consumer's renewals of this lease ended on an error (consume, handle):
    # the lease is gone (stale_lease: it ran out, was superseded, or its primary's epoch
    # ended) or will run out, and the message will be delivered again. A long handler
    # can look at it and stop early; its ack will come too late.
    lease_lost: bool = field(default=False, compare=False)

    @property
    def expires_at_dt(self) -> datetime:
        return datetime.fromisoformat(self.expires_at.replace("Z", "+00:00"))


@dataclass(slots=True)
class SendResult:
    id: str
    duplicate: bool


def settings_pb(settings: dict) -> api_pb2.Settings:
    """Accepts contract names (leaseTimeoutSeconds) or snake_case (lease_timeout_seconds)."""
    out = {}
    for k, v in settings.items():
        name = SETTINGS_PB.get(k) or SNAKE_SETTINGS.get(k)
        if name is None:
            raise errors.InvalidArgument(f"unknown setting {k!r}")
        if name == "failure_queue":
            if not isinstance(v, str):
                raise TypeError(f"{k} must be a str, not {type(v).__name__}")
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{k} must be a number, not {type(v).__name__}")
        if name == "max_retries" and type(v) is float:  # as over HTTP: 2.0 is 2, 2.5 is no count
            if not v.is_integer():
                raise errors.InvalidArgument(f"maxRetries must be a whole number, not {v!r}")
            v = int(v)
        if name == "max_retries" and type(v) is int and not -2**31 <= v < 2**31:
            raise errors.InvalidArgument(f"maxRetries {v} is out of range")  # (the node's bound is far lower)
        out[name] = v
    return api_pb2.Settings(**out)


def messages_of(r: api_pb2.ReceiveResponse, started: Optional[float] = None) -> list:
    """A receive's Messages. ``started``: the time.monotonic() at which the call began
    (see LeaseEnd). A receive's leases share one expiry (one lease timeout, granted
    at once): one LeaseEnd serves them all."""
    out, end = [], None
    for d in r.messages:
        if end is None or end != d.lease_expires_at or end.left_s != d.lease_seconds_left:
            end = LeaseEnd(d.lease_expires_at, d.lease_seconds_left, started)
        out.append(Message(d.id, d.body, d.lease_token, d.retry_count, end, d.queue))
    return out


def cluster_dict(c: api_pb2.ClusterInfo) -> dict:
    """A ClusterInfo as GET /v1/cluster's document (node/api/grpc_api.py's
    cluster_pb is the way back)."""
    nodes = []
    for n in c.nodes:
        d = {"id": n.id, "role": n.role, "address": n.address}
        if n.HasField("lsn"):
            d["lsn"] = n.lsn
        if n.HasField("match_lsn"):
            d["matchLsn"] = n.match_lsn
        if n.joining:
            d["joining"] = True
        if n.HasField("last_contact_ms"):
            d["lastContactMs"] = None if n.last_contact_ms < 0 else n.last_contact_ms
        if n.HasField("reachable"):
            d["reachable"] = n.reachable
        if n.HasField("disk_low"):
            d["diskLow"] = n.disk_low
        if n.HasField("eager"):
            d["eager"] = n.eager
        nodes.append(d)
    doc = {"nodeId": c.node_id, "role": c.role, "epoch": c.epoch, "primary": c.primary or None}
    if c.HasField("commit_lsn"):  # (an older node does not say)
        doc["commitLsn"], doc["appliedLsn"] = c.commit_lsn, c.applied_lsn
    doc["clusterId"] = c.cluster_id or None
    doc["nodes"] = nodes
    return doc


def whole_seconds(x: float):
    """A duration setting as JSON gives it: whole seconds as an integer (30, not
    30.0), so a client may decode it into an integer type; a fraction stays a
    fraction. One rule for the node's own answers and for those a replica or
    the SDK renders from gRPC's doubles."""
    return int(x) if float(x).is_integer() else x  # (inf and nan stay as they are)


def queue_dict(q: api_pb2.Queue) -> dict:
    s, st = q.settings, q.stats
    return {"name": q.name,
            "settings": {"leaseTimeoutSeconds": whole_seconds(s.lease_timeout_seconds), "maxRetries": s.max_retries,
                         "retentionSeconds": whole_seconds(s.retention_seconds),
                         "dedupWindowSeconds": whole_seconds(s.dedup_window_seconds),
                         "failureQueue": s.failure_queue},
            "stats": {"visible": st.visible, "leased": st.leased, "delayed": st.delayed,
                      "sentTotal": st.sent_total, "ackedTotal": st.acked_total, "failedTotal": st.failed_total,
                      "expiredTotal": st.expired_total, "nackedTotal": st.nacked_total,
                      "leaseExpiredTotal": st.lease_expired_total, "purgedTotal": st.purged_total}}


# What gRPC says when the channel could not connect, so the call never left this
# process (the pick of a connection failed before anything was written): no
# address would take a connection, or the node's name did not resolve (worded
# "DNS resolution failed" by older grpcio, "errors resolving NAME: ..." by 1.85).
_NOT_SENT = ("failed to connect to all addresses", "dns resolution failed", "errors resolving")


def refused_before_it_ran(e: grpc.RpcError) -> bool:
    """gRPC's RESOURCE_EXHAUSTED that is not a size (errors.from_grpc_trailers): the
    node's gRPC refused the call before any of it ran, e.g. at its cap on concurrent
    calls. Nothing was done."""
    return e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and isinstance(
        errors.from_grpc_trailers(e.code(), e.details(), e.trailing_metadata()), errors.Unavailable)


def map_rpc_error(e: grpc.RpcError, write: bool = False) -> errors.SpoolerError:
    """The client half of the error table. ``write``: the call changes state, so a
    transport failure after it left us means the outcome is unknown; one before it
    left (no connection to be had) is a plain ``unavailable``: nothing was accepted."""
    err = errors.from_grpc_trailers(e.code(), e.details(), e.trailing_metadata())
    if not write and isinstance(err, errors.OperationUnconfirmed) and not _has_detail(e):
        # a read that timed out changed nothing: plain unavailable (retry-safe), except
        # for a receive, which leases (see read_lost)
        return read_lost(f"no answer in time: {e.details()}")
    if isinstance(err, errors.Unavailable) and not _has_detail(e) and not refused_before_it_ran(e):
        # (RESOURCE_EXHAUSTED that is not a size: gRPC refused the call before it
        # ran, e.g. the node's cap on concurrent calls; nothing was done)
        if never_sent(e):
            return errors.Unavailable(f"no connection to the node: {e.details()}", retry_after_s=1.0)
        if write:  # no node answered "not accepted": the request may have been applied
            return errors.OperationUnconfirmed(f"transport failure: {e.details()}")
        # the request may have reached the node: for a receive, leases may be held
        return read_lost(f"transport failure after the request left: {e.details()}")
    if isinstance(err, errors.Internal) and not _has_detail(e):
        # not the node's own ``internal`` (which touched nothing) but a code it did not
        # send, e.g. a stream reset (INTERNAL) or a proxy's bare HTTP 500 (UNKNOWN) on
        # the way back: a write may have been applied, as over HTTP (errors.from_http),
        # and a receive may have leased, as when a Session stream breaks
        said = f"the call ended without an answer of the node's ({e.code().name}: {e.details()})"
        if write:
            return errors.OperationUnconfirmed(f"{said}: outcome unknown")
        return read_lost(said)
    return err


# gRPC codes after which a client tries its next node: none reachable, no answer
# in time (a hung node must not pin the client), or the node ended the call
MOVE_ON = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def read_lost(message: str) -> errors.Unavailable:
    """``unavailable`` for a read whose request reached a node but whose answer did
    not come back. For a plain read that is harmless; a receive may have leased
    something meanwhile, so a receive is not retried after it (``retryable``)."""
    e = errors.Unavailable(message)
    e.answer_lost = True
    return e


def never_sent(e: grpc.RpcError) -> bool:
    """The call failed because no connection could be had: nothing reached a node."""
    return e.code() == grpc.StatusCode.UNAVAILABLE and any(s in (e.details() or "").lower() for s in _NOT_SENT)


def _has_detail(e: grpc.RpcError) -> bool:
    return any(k == errors.KIND_TRAILER for k, _ in (e.trailing_metadata() or ()))


def retryable(exc: BaseException, *, send_with_key: bool = False, settle: bool = False,
              receive: bool = False) -> bool:
    if isinstance(exc, errors.Unavailable):
        # a receive whose answer was lost may hold leases: its caller hears of it
        return not (receive and getattr(exc, "answer_lost", False))
    if isinstance(exc, errors.OperationUnconfirmed):
        # (not one that a retry already answered: settle_after_unconfirmed)
        return (send_with_key or settle) and not getattr(exc, "final", False)
    return False


# The waits before the 2nd, 3rd, ... attempt of a call: 0.1, 0.2, 0.4, 0.8, 1.6 s.
# Six attempts span 3.1 s, more than a failover with the default 2 s timeout.
RETRY_FIRST_WAIT_S = 0.1
RETRY_WAIT_MAX_S = 1.6
RETRY_AFTER_MAX_S = 5.0  # the longest Retry-After a retry waits out (the node's longest: disk_low)


def retry_wait_s(retry: int, after: Optional[BaseException] = None) -> float:
    """The wait before retry number ``retry`` (1 = the second attempt), stretched
    by up to half at random: callers that failed together (one refused batch)
    do not all come back in the same instant and form the same batch again.
    Never shorter than the schedule, so six attempts still outlast a failover.

    ``after``: the error that failed the last attempt. A refusal the primary
    gave for its own load or room (errors.PRIMARY_REFUSALS: ``overloaded``,
    ``queue_full``, ``disk_low``, ``node_full``) is waited out for at least its
    Retry-After, as the node asked (up to RETRY_AFTER_MAX_S). Any other
    ``unavailable`` (no primary yet, a node stopping) keeps the schedule: its
    Retry-After is a hint for clients that cannot move on, and waiting it out
    would stretch a failover of a tenth of a second to half a second or more."""
    w = min(RETRY_WAIT_MAX_S, RETRY_FIRST_WAIT_S * 2 ** (retry - 1))
    if isinstance(after, errors.Unavailable) and after.reason in errors.PRIMARY_REFUSALS:
        w = max(w, min(after.retry_after_s, RETRY_AFTER_MAX_S))
    return w * random.uniform(1.0, 1.5)


def _policy(attempts: int, *, send_with_key: bool = False, settle: bool = False, receive: bool = False,
            stop_when: Optional[Callable[[], bool]] = None) -> dict:
    """When a call may be retried (never silently for an unkeyed unconfirmed send).

    * any call: ``unavailable`` from a node (known not accepted);
    * a send with a dedup key: also ``operation_unconfirmed`` (the key makes a
      repeat harmless inside the queue's dedup window);
    * ack/nack/renew: also a transport failure (a repeat of a settle that did
      land answers ``stale_lease``/``settled``, which the client reports as done).

    ``attempts`` retries, each after its wait; the caller made the first attempt and
    waited ``retry_wait_s(1)`` before handing over (tenacity waits only between its
    own attempts)."""
    stop = tenacity.stop_after_attempt(attempts)
    if stop_when is not None:  # e.g. the client was closed: the last error stands
        stop = tenacity.stop_any(stop, lambda _: stop_when())
    return dict(stop=stop,
                wait=lambda rs: retry_wait_s(rs.attempt_number + 1, rs.outcome.exception() if rs.outcome else None),
                retry=tenacity.retry_if_exception(lambda e: retryable(e, send_with_key=send_with_key, settle=settle,
                                                                      receive=receive)),
                reraise=True)


async def call_with_retries(fn, attempts: int, *, first_failed: Optional[BaseException] = None,
                            stop_when: Optional[Callable[[], bool]] = None, **kw):
    """``attempts`` in all (at least 1), the first without any retry machinery (the
    hot path); tenacity only once a retry-safe failure happened. ``first_failed``:
    the error of the caller's own first attempt, which failed retry-safely; all
    ``attempts`` here are retries. ``stop_when``: no further attempt once it says
    so (the client closed, a dedup window used up); the last error is raised."""
    last = _LastError(first_failed)
    if first_failed is None:
        try:
            return await fn()
        except errors.SpoolerError as e:
            if attempts <= 1 or not retryable(e, **kw) or (stop_when is not None and stop_when()):
                raise
            last.e = e
        attempts -= 1
    await asyncio.sleep(retry_wait_s(1, last.e))
    async for attempt in tenacity.AsyncRetrying(**_policy(attempts, stop_when=stop_when, **kw)):
        with attempt:
            last.unless_stopped(stop_when)
            try:
                return await fn()
            except errors.SpoolerError as e:
                last.e = e
                raise


def unconfirmed_after(e: errors.Unavailable) -> errors.OperationUnconfirmed:
    """A retry refused as ``unavailable`` (not accepted) after an earlier attempt of
    the same call whose outcome is unknown: the call as a whole may still have
    taken effect, so its caller hears ``operation_unconfirmed``, never a last
    ``unavailable`` that would say it surely did not."""
    u = errors.OperationUnconfirmed(f"an earlier attempt's outcome is unknown (the last one: {e})")
    u.__cause__ = e
    return u


class _LastError:
    """A retry's last error: what the caller hears when a retry is stopped before it
    is made (the client closed, a dedup window used up meanwhile), not a new one
    that would say something else (an ``unavailable`` where the send may have landed)."""

    __slots__ = ("e",)

    def __init__(self, e: Optional[BaseException]):
        self.e = e

    def unless_stopped(self, stop_when: Optional[Callable[[], bool]]) -> None:
        if stop_when is not None and stop_when():
            raise self.e if self.e is not None else errors.Unavailable("the client was closed")


def call_with_retries_sync(fn, attempts: int, *, first_failed: Optional[BaseException] = None,
                           stop_when: Optional[Callable[[], bool]] = None, **kw):
    """As call_with_retries."""
    last = _LastError(first_failed)
    if first_failed is None:
        try:
            return fn()
        except errors.SpoolerError as e:
            if attempts <= 1 or not retryable(e, **kw) or (stop_when is not None and stop_when()):
                raise
            last.e = e
        attempts -= 1
    time.sleep(retry_wait_s(1, last.e))

    def attempt():
        last.unless_stopped(stop_when)
        try:
            return fn()
        except errors.SpoolerError as e:
            last.e = e
            raise
    return tenacity.Retrying(**_policy(attempts, stop_when=stop_when, **kw))(attempt)


class DedupWindow:
    """Whether a keyed send may still be sent again. A resend is harmless only while
    the node would still find its key: the queue's dedup window, counted from the
    first attempt's record. That record was made after ``t0`` (when the first
    attempt began), and a resend may be recorded up to ``timeout_s`` after it
    leaves; so once an attempt may have landed, a resend goes out only while
    ``elapsed + timeout_s`` is inside the window. Before any attempt may have
    landed (each was ``unavailable``: not accepted), resends are always safe."""

    def __init__(self, t0: float, window_s: float, timeout_s: float, maybe_landed: bool):
        self.t0, self.window_s, self.timeout_s = t0, window_s, timeout_s
        self.maybe_landed = maybe_landed

    def used_up(self) -> bool:
        return self.maybe_landed and time.monotonic() - self.t0 + self.timeout_s >= self.window_s

    def noting(self, e: BaseException) -> None:
        if isinstance(e, errors.OperationUnconfirmed):
            self.maybe_landed = True


# A receive that failed with one of these leased nothing (the node answered it);
# after any other failure its answer may have been lost on the way, holding leases.
RECEIVE_DEFINITE = (errors.InvalidArgument, errors.Unauthenticated, errors.Forbidden, errors.QueueNotFound)
RELEASE_TIMEOUT_S = 2.0


# how long the client takes a node's UNIMPLEMENTED for a call (Session,
# ReleaseReceive) as that node's answer, before it asks again (a node upgraded
# in place keeps its address)
UNSUPPORTED_RECHECK_S = 300.0


class Lacking:
    """The nodes, by channel, that answered a call UNIMPLEMENTED (older nodes): the
    client uses the older form with those nodes only, and asks again after
    UNSUPPORTED_RECHECK_S. Per node, not for good: a client that met one older
    node once, in a rolling upgrade, would else never use the call again."""

    def __init__(self):
        self._since: dict = {}  # channel -> monotonic time it answered UNIMPLEMENTED

    def lacks(self, channel) -> bool:
        t = self._since.get(channel)
        if t is None:
            return False
        if time.monotonic() - t >= UNSUPPORTED_RECHECK_S:
            del self._since[channel]
            return False
        return True

    def found(self, channel, lacking: bool = True) -> None:
        self._since.pop(channel, None)
        if lacking:
            if len(self._since) >= 64:  # (channels of loops gone by: the oldest first)
                self._since.pop(next(iter(self._since)))
            self._since[channel] = time.monotonic()


def note_release_failure(client, e: Exception, log, channel=None) -> None:
    """After a failed ReleaseReceive: stop asking the node (``channel``, else the
    current one) if it has no such call (an older one); otherwise only log (the
    leases expire as they would have)."""
    if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNIMPLEMENTED:
        client._no_release.found(client.channel if channel is None else channel)
    log.info("could not release a receive whose answer was lost: %r", e)


# API.md: a receive waits at most 20 s for a message
WAIT_S_MAX = 20.0


def receive_request(queue: str, wait_s: float, max_messages: int) -> api_pb2.ReceiveRequest:
    """Named with a fresh receive id, so that a lost answer can be given back.
    A wait that is not a number from 0 to 20 s is refused here: the call's
    deadline is counted from it, and a NaN or a huge one would otherwise end the
    call at once as a timeout (``unavailable``, which reads as try again)."""
    if not isinstance(queue, str):
        raise TypeError(f"queue must be a str, not {type(queue).__name__}")
    check_name("queue name", queue)
    if isinstance(max_messages, bool) or not isinstance(max_messages, int) or max_messages < 1:
        # (0 would reach the node as "unset", which it reads as 1)
        raise errors.InvalidArgument(f"max_messages must be a whole number of at least 1, not {max_messages!r}")
    if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)):
        raise TypeError(f"wait_s must be a number, not {type(wait_s).__name__}")
    if not 0 <= wait_s <= WAIT_S_MAX:  # (NaN is neither)
        raise errors.InvalidArgument(f"wait_s must be from 0 to {WAIT_S_MAX:g} seconds, not {wait_s!r}")
    return api_pb2.ReceiveRequest(queue=queue, wait_seconds=wait_s, max_messages=max_messages,
                                  receive_id=os.urandom(12).hex())


def release_request(req: api_pb2.ReceiveRequest) -> api_pb2.ReleaseReceiveRequest:
    return api_pb2.ReleaseReceiveRequest(queue=req.queue, receive_id=req.receive_id)


def auth_metadata(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),) if key else ()


# Bodies in one auto-batched request: half the node's default limit for a send
# batch (8 MiB) and far under gRPC's 16 MiB message limit, so that a burst of
# large messages goes out as several batches instead of one that is refused.
BATCH_BYTES_MAX = 4 * 1024 * 1024


def entry_bytes(queue: str, body: bytes, dedup_key: str) -> int:
    """A send's bound in an auto-batch: its body, and its queue name and key at 4
    bytes a character (the most UTF-8 takes), so that names and keys count too."""
    return len(body) + 4 * (len(queue) + len(dedup_key))


def batch_size(pending: list, batch_max: int, size_of) -> int:
    """How many of the ``pending`` sends the next auto-batch takes: at most
    ``batch_max``, and no more than BATCH_BYTES_MAX of their ``size_of``
    (entry_bytes; but always one)."""
    n, total = min(batch_max, len(pending)), 0
    for i in range(n):
        total += size_of(pending[i])
        if total > BATCH_BYTES_MAX and i:
            return i
    return n


def check_delay(delay_s) -> None:
    """A delay a request can carry (a double): a number, and an int a double holds
    (protobuf raised OverflowError for a larger one while building the request, which
    for an auto-batched send failed every caller in its batch)."""
    if not isinstance(delay_s, (int, float)) or isinstance(delay_s, bool):
        raise TypeError(f"delay_s must be a number, not {type(delay_s).__name__}")
    if isinstance(delay_s, int):
        try:
            float(delay_s)
        except OverflowError:
            raise errors.InvalidArgument(f"delay_s is out of range (an int of {delay_s.bit_length()} bits)") from None


def check_send_types(queue, body, delay_s, dedup_key) -> None:
    if not isinstance(queue, str):
        raise TypeError(f"queue must be a str, not {type(queue).__name__}")
    if not isinstance(body, bytes):  # (protobuf takes bytes only: not bytearray, not memoryview)
        raise TypeError(f"body must be bytes, not {type(body).__name__}")
    check_delay(delay_s)
    if not isinstance(dedup_key, str):
        raise TypeError(f"dedup_key must be a str, not {type(dedup_key).__name__}")
    if len(body) > BODIES_BYTES_MAX:
        raise errors.MessageTooLarge(f"message of {len(body)} bytes; no node takes more than {BODIES_BYTES_MAX}")
    check_name("queue name", queue)
    check_name("dedup key", dedup_key)


def check_name(what: str, s: str) -> None:
    """A queue name or dedup key that a Session request can carry: one that is not
    (text UTF-8 cannot encode, or over NAME_BYTES_MAX bytes) is refused
    here, so that it fails this caller alone instead of the stream, or the
    auto-batch, that every other caller shares."""
    n = len(s)
    if not s.isascii():
        try:  # (a lone surrogate, e.g. a file name read with surrogate escapes)
            n = len(s.encode())
        except UnicodeEncodeError:
            raise errors.InvalidArgument(f"the {what} is not valid UTF-8 text: {s!r}") from None
    if n > NAME_BYTES_MAX:
        raise errors.InvalidArgument(f"a {what} of over {NAME_BYTES_MAX} bytes")


def _framed(n: int) -> int:
    """A body of ``n`` bytes in a request: its field's tag, its length, itself."""
    return n + 2 + (n >= 1 << 7) + (n >= 1 << 14) + (n >= 1 << 21)


def check_batch(queue, bodies, delay_s) -> None:
    """A send_batch's arguments, before anything is sent."""
    if not bodies:
        raise errors.InvalidArgument("nothing to send: a batch needs at least one body")
    check_send_types(queue, bodies[0], delay_s, "")
    for b in bodies:
        if type(b) is not bytes:  # (as check_send_types; bytes subclasses are checked there)
            check_send_types(queue, b, delay_s, "")
    total = sum(map(len, bodies))
    if total + 5 * len(bodies) > BODIES_BYTES_MAX:  # near the limit: count each body's framing too
        total = sum(map(_framed, map(len, bodies)))
        if total > BODIES_BYTES_MAX:
            raise errors.MessageTooLarge(f"batch of {total} bytes with its framing; one request carries at "
                                         f"most {BODIES_BYTES_MAX}")


def compact_request(queue: str, bodies: list, delay_s: float) -> api_pb2.SendBatchRequest:
    """A send batch in the compact form, asking for the run's ids in the compact
    form too (send_outcomes reads either)."""
    return api_pb2.SendBatchRequest(queue=queue, bodies=bodies, delay_seconds=delay_s, compact_run_ids=True)


def batch_request(sends: list, compact: bool = True) -> api_pb2.SendBatchRequest:
    """sends: [(queue, body, delay_s, dedup_key)] -> one SendBatchRequest; in the
    compact form (one queue, one delay, bodies only) when every send fits it and
    ``compact`` (only on a Session: a node that has Session understands it)."""
    q0, _, d0, _ = sends[0]
    if compact and all(q == q0 and d == d0 and not k for q, _, d, k in sends):
        return compact_request(q0, [s[1] for s in sends], d0)
    return api_pb2.SendBatchRequest(entries=[api_pb2.SendRequest(queue=q, body=b, delay_seconds=d, dedup_key=k)
                                             for q, b, d, k in sends])


SETTLE_ACTIONS = {"ack": api_pb2.SETTLE_ACK, "nack": api_pb2.SETTLE_NACK, "renew": api_pb2.SETTLE_RENEW}


def settle_action(a) -> int:
    """"ack", "nack" or "renew" -> its SettleAction; anything else is invalid_argument."""
    try:
        return SETTLE_ACTIONS[a]
    except (KeyError, TypeError):
        raise errors.InvalidArgument(f"unknown settle action {a!r}: ack, nack or renew") from None


def _token(t) -> None:
    if not isinstance(t, str):
        raise TypeError(f"a lease token must be a str, not {type(t).__name__}")
    if len(t) > TOKEN_CHARS_MAX:
        raise errors.InvalidArgument(f"malformed lease token: {len(t)} characters, a token has at most "
                                     f"{TOKEN_CHARS_MAX}")


def lease_request(token: str, delay_s: float = 0.0) -> api_pb2.LeaseRequest:
    """An Ack/Nack/Renew request; a token that is not a str is a TypeError that says
    so (None stays unset, as in a SettleBatch item: the node refuses it)."""
    if token is not None:
        _token(token)
    check_delay(delay_s)
    return api_pb2.LeaseRequest(token=token, delay_seconds=delay_s)


def key_request(queue: str, scopes) -> api_pb2.CreateKeyRequest:
    """A CreateKey request. ``scopes``: a list of scope names, or one string of them
    separated by commas (as ``spoolctl keys create --scope send,receive``): a
    string was taken letter by letter."""
    if not isinstance(queue, str):
        raise TypeError(f"queue must be a str, not {type(queue).__name__}")
    if isinstance(scopes, str):
        scopes = [x.strip() for x in scopes.split(",")]
    scopes = list(scopes)
    if not all(isinstance(x, str) for x in scopes):
        raise TypeError("scopes must be scope names (str)")
    return api_pb2.CreateKeyRequest(queue=queue, scopes=scopes)


def settle_request(items, action_of=settle_action) -> api_pb2.SettleBatchRequest:
    """[(token, action, delay_s)] -> one SettleBatchRequest. Each item is built where
    it lives in the request, and a zero delay is left unset: in CPython that costs
    about a third of building Item messages and copying them in (a batch of 100
    acks: 90 against 250 us here)."""
    if not isinstance(items, (list, tuple)):
        items = list(items)
    if len(items) > BATCH_ITEMS_MAX:
        raise errors.InvalidArgument(f"at most {BATCH_ITEMS_MAX} items in a batch")
    req = api_pb2.SettleBatchRequest()
    add = req.items.add
    for item in items:
        try:
            t, a, d = item
        except ValueError:  # (token, action): no delay
            t, a = item
            d = None
        action = action_of(a)  # (an unknown action fails first, as it did)
        if t is not None:
            _token(t)
        it = add()
        if t is not None:  # None: unset, as Item(token=None) left it (the node refuses it)
            it.token = t
        it.action = action
        if d is not None and d != 0:
            if type(d) is int:
                check_delay(d)
            it.delay_seconds = d
    return req


def send_outcomes(r: api_pb2.SendBatchResponse, n: Optional[int] = None) -> list:
    """Per message, in request order: a SendResult, or the SpoolerError of a message
    that was not stored (its queue was deleted while the batch was committed).
    ``n``: how many sends the request held; an answer that names another number of
    outcomes cannot be matched to them (a faulty node): operation_unconfirmed."""
    got = len(r.results) + (r.run_count or len(r.run_ids))
    if n is not None and got != n:  # (counted before a run's ids are made: a faulty count may be huge)
        raise errors.OperationUnconfirmed(f"the node answered {got} outcomes for {n} sends")
    out = [errors.from_detail(x.error) if x.HasField("error") else SendResult(x.id, x.duplicate) for x in r.results]
    ids = run_ids(r.run_id_prefix, r.run_id_first, r.run_count) if r.run_count else r.run_ids
    out.extend(map(SendResult, ids, repeat(False, len(ids))))
    return out


def settle_outcomes(r, n: int, started: Optional[float] = None) -> list:
    """A SettleBatch answer, per item in request order: None (ack, nack), the new
    expiry (renew: a LeaseEnd; ``started`` as for messages_of), or the item's
    SpoolerError. An answer naming another number of outcomes than ``n`` items
    cannot be matched to them (a faulty node); the items may have been applied:
    operation_unconfirmed."""
    if len(r.results) != n:
        raise errors.OperationUnconfirmed(f"the node answered {len(r.results)} outcomes for {n} settles")
    return [errors.from_detail(x.error) if x.HasField("error")
            else (LeaseEnd(x.expires_at, x.lease_seconds_left, started) if x.expires_at else None)
            for x in r.results]


def batch_results(r: api_pb2.SendBatchResponse, n: Optional[int] = None) -> list:
    """send_batch's answer: every SendResult, or the first message's error raised
    (``n``: as for send_outcomes)."""
    out = send_outcomes(r, n)
    if r.results:  # (an answer of compact runs only holds no error)
        for x in out:
            if isinstance(x, errors.SpoolerError):
                raise x
    return out


def settle_after_unconfirmed(e: errors.StaleLease) -> None:
    """An ack or nack tried again after an attempt whose outcome was unknown
    (``operation_unconfirmed``) met ``stale_lease``. ``settled``: our earlier
    attempt landed, so this one is done (returns). ``primary_changed`` cannot
    tell: the earlier attempt may have committed before the change, or not (and
    then the message is visible again), so that unknown outcome is raised, not
    a ``stale_lease`` that would say it will be delivered again. ``expired``
    stands (a landed ack would have said ``settled``)."""
    if e.reason == errors.StaleLease.SETTLED:
        return
    if e.reason == errors.StaleLease.PRIMARY_CHANGED:
        out = errors.OperationUnconfirmed(
            "an earlier attempt's outcome is unknown and the primary changed since: it may or may not "
            "have been applied")
        out.final = True  # no further attempt can tell more: not retried
        raise out from None
    raise e


# errors a send batch gets for one queue of it (it does not exist, the key may not
# send to it): every entry naming that queue would get the same
QUEUE_LEVEL = (errors.QueueNotFound, errors.Forbidden)
# errors a send batch gets for one bad entry of it (a body too large, a bad dedup key)
ENTRY_LEVEL = (errors.InvalidArgument, errors.MessageTooLarge)


def resend_groups(err: errors.SpoolerError, queues: list) -> Optional[list]:
    """How an auto-batch the node refused as a whole is sent again, or None to
    fail it whole: [[index, ...], ...] in the batch's order.

    * An error about one of its queues (QUEUE_LEVEL) or ``unavailable`` (one
      full queue, at its message cap, refuses the whole batch): one batch per
      queue, so that the callers sending to the other queues do not fail for it
      (nothing was stored, so a resend is safe); a batch of one queue fails
      whole, as each of its entries would.
    * An error of one bad entry (ENTRY_LEVEL: a body too large, a bad dedup
      key): the batch in two halves, each sent again the same way, so
      that only the bad entry fails after about 2 log2(n) batches: one among 100
      costs the good ones about 14 round trips, not 100 (0.4.37 and before sent
      every entry again alone)."""
    if len(queues) < 2:
        return None
    several = len(set(queues)) > 1
    if isinstance(err, QUEUE_LEVEL + (errors.Unavailable,)):
        if not several:
            return None
        groups: dict = {}
        for i, q in enumerate(queues):
            groups.setdefault(q, []).append(i)
        return list(groups.values())
    if isinstance(err, ENTRY_LEVEL):
        half = (len(queues) + 1) // 2
        return [list(range(half)), list(range(half, len(queues)))]
    return None


def keep_renewing_after(log, m, e: errors.SpoolerError) -> bool:
    """A consumer's renewal of message ``m``'s lease failed with ``e``: log it; True
    if renewing should go on (the lease is not known to be lost). Otherwise
    ``m.lease_lost`` is set, for the handler to see."""
    if isinstance(e, errors.StaleLease):  # the lease is gone: nothing left to renew
        log.warning("renew of %s failed (%s): the lease is lost, the message will be delivered again",
                    m.id, e.reason)
    elif isinstance(e, (errors.Unavailable, errors.OperationUnconfirmed, errors.Internal)):
        # not known to be lost (an internal error changed nothing, or was the transport's): again soon
        log.warning("renew of %s failed: %s", m.id, e)
        return True
    else:
        log.warning("renew of %s failed: %s; no more renewals", m.id, e)  # a definite answer (e.g. queue gone)
    m.lease_lost = True
    return False


def settle_failed(log, m, action: str, e: errors.SpoolerError) -> bool:
    """A consumer's ack or nack of message ``m`` failed with ``e`` after the
    client's own retries: log it; True if consuming should go on. A lease gone
    stale, or an outage that outlasted the retries, costs at most a redelivery
    (delivery is at least once): the consumer keeps going and receives again
    once the cluster is back. Anything else (a key without the scope, ...) is
    the caller's to see."""
    if isinstance(e, errors.StaleLease):
        log.warning("%s of %s came too late (%s): it may be delivered again", action, m.id, e.reason)
        return True
    if isinstance(e, (errors.Unavailable, errors.OperationUnconfirmed)):
        log.warning("%s of %s not confirmed (%s): it may be delivered again", action, m.id, e)
        return True
    return False


def renew_delay_s(expires_at: str, now: Optional[datetime] = None, mono: Optional[float] = None) -> float:
    """Renew at half the remaining lease time (at least 50 ms from now): by the
    lease's monotonic deadline when the node said how long it lasts (LeaseEnd),
    else (an older node) by the wall clock, which a clock behind the nodes' makes
    too late. An expiry that cannot be read (a faulty node's empty answer) renews
    again in a second, instead of ending the renewer while the handler runs on."""
    from datetime import timezone
    deadline = getattr(expires_at, "deadline", None)
    if deadline is not None:
        return max(0.05, (deadline - (time.monotonic() if mono is None else mono)) / 2)
    try:
        exp = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    except (AttributeError, TypeError, ValueError):
        return 1.0
    now = now or datetime.now(timezone.utc)
    return max(0.05, (exp - now).total_seconds() / 2)


class Nodes:
    """The node list a client talks to, shared by the sync and asyncio clients.

    ``target`` is "host:port" or "h1:p1,h2:p2,...": any node serves any call, and
    on "unavailable" the client moves on to the next node. ``_grpc`` is the grpc
    module that makes channels (``grpc`` or ``grpc.aio``)."""

    _grpc = grpc

    def __init__(self, target: str = "127.0.0.1:50051", key: str = "", *, timeout_s: float = 30.0,
                 batch_max: int = 100, batches_in_flight_max: int = 4, retry_attempts: int = 6,
                 credentials=None, ping_timeout_s: float = PING_TIMEOUT_S):
        """credentials: grpc channel credentials for a node running mTLS
        (``grpc.ssl_channel_credentials(ca, key, cert)``); None = plaintext.
        ping_timeout_s: a connection whose ping goes unanswered this long is
        closed and its calls fail (a hung node); raise it on a slow link that
        carries large messages."""
        for name, v in (("batch_max", batch_max), ("batches_in_flight_max", batches_in_flight_max),
                        ("retry_attempts", retry_attempts)):
            # 0 would leave auto-batching spinning on empty batches, or sends never
            # flushed, or calls never made
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, not {v!r}")
        if batch_max > BATCH_ITEMS_MAX:
            # a node refuses a batch of more entries whole, and each of its sends
            # would then go again alone, one after another
            raise ValueError(f"batch_max must be at most {BATCH_ITEMS_MAX} (a node's entries per batch), "
                             f"not {batch_max!r}")
        if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                or not 0 < timeout_s <= TIMEOUT_S_MAX):
            # (past about 1e10 s gRPC's deadline overflows and every call fails at
            # once, a send as "maybe stored"; infinity is not "no timeout")
            raise ValueError(f"timeout_s must be a number of seconds in (0, {TIMEOUT_S_MAX:g}], not {timeout_s!r}")
        self._init_nodes(target, credentials, ping_timeout_s)
        self.md = auth_metadata(key)
        self.timeout_s = timeout_s
        self.batch_max = batch_max
        self.batches_in_flight_max = batches_in_flight_max
        self.retry_attempts = retry_attempts
        self._pending: list = []     # sends waiting for auto-batching
        self._in_flight = 0          # auto-batching's send batches awaiting their answer
        self.send_rpcs = 0           # SendBatch RPCs made by auto-batching (observability, tests)
        self._no_release = Lacking()  # nodes without ReleaseReceive
        self._init_client()

    def _init_client(self) -> None:
        """What the sync or the asyncio client keeps of its own."""

    def _init_nodes(self, target: str, credentials, ping_timeout_s: float = PING_TIMEOUT_S) -> None:
        if not isinstance(target, str) or not target.replace(",", "").strip():
            raise ValueError(f"target must name a node, \"host:port\" or \"h1:p1,h2:p2,...\", not {target!r}")
        self._grpc_options = grpc_options(ping_timeout_s)
        self.target = target
        self._targets = [t.strip() for t in target.split(",") if t.strip()]
        self._target_i = 0
        self._credentials = credentials  # channel credentials for mTLS, or None
        # one channel (and stub) per node, made on first use and kept: moving back and
        # forth between nodes reuses them, and calls in flight on one keep it open
        self._channels: dict = {}
        self._channels_closed = False  # close() closed every channel (set just before it does)
        self._open()

    def _open(self) -> None:
        from spooler.pb import api_pb2_grpc
        t = self._targets[self._target_i]
        got = self._channels.get(self._target_i)  # by position: a list may name one address twice
        if got is None:
            g = self._grpc
            ch = (g.secure_channel(t, self._credentials, options=self._grpc_options) if self._credentials
                  else g.insecure_channel(t, options=self._grpc_options))
            got = self._channels[self._target_i] = (ch, api_pb2_grpc.SpoolerStub(ch))
        # (one pair, assigned at once: a thread reads the channel and the stub of one
        # node together (``_current``), never the stub of one and the channel of the next)
        self._current = got
        self.channel, self.stub = got

    @property
    def _release_supported(self) -> bool:
        """The node this client talks to now has ReleaseReceive, as far as it knows."""
        return not self._no_release.lacks(self.channel)

    def _all_channels(self) -> list:
        return [ch for ch, _ in self._channels.values()]

    def target_now(self) -> str:
        """The node this client currently talks to."""
        return self._targets[self._target_i]

    def _next_target(self, failed_channel=None) -> None:
        """Move on to the next node. ``failed_channel``: the channel of the call that
        failed; if the client already moved away from it (another call failed first,
        e.g. many timing out together), it stays where it is now."""
        if self._channels_closed:
            return  # close() closed them: a call failing because of it moves nothing, opens nothing
        if len(self._targets) > 1 and (failed_channel is None or failed_channel is self.channel):
            self._target_i = (self._target_i + 1) % len(self._targets)
            self._open()

