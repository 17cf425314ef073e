"""The transport-neutral API: what every route and RPC does.

HTTP (``http.py``) and gRPC (``grpc_api.py``) only parse, call a method here
and render the answer; validation, authorization, limits and the mapping to
log records live here once. Errors are raised as ``spooler.errors`` classes.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import hashlib
import hmac
import itertools
import logging
import math
import os
import re
import struct
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Optional

from spooler import errors
from spooler._common import LeaseEnd, whole_seconds
from spooler.ids import message_id
from spooler.pb import log_pb2
from node import logs
from node.core import replication as R
from node.core.spool import PURGE_LOG_FORMAT, US, BadToken, StaleLeaseError, failure_queue_of
from node.engine import Engine, Reply, mono_us, nobody_waits
from node.waits import wait_change, wait_event

log = logging.getLogger("spooler.service")

NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,80}\Z")
DERIVED_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,255}\Z")  # failure queues may be derived: "{queue}.failed"
NAMES_OK_MAX = 4096  # queue names check_name_any remembers as good (then it starts over)
# lease tokens are URL-safe base64 without padding (what base64.urlsafe_b64* do, minus their wrappers)
_TO_URLSAFE = bytes.maketrans(b"+/", b"-_")
_FROM_URLSAFE = str.maketrans("-_", "+/")
KEY_ID_RE = re.compile(r"^[a-f0-9]{12}\Z")
SCOPES = ("send", "receive", "admin")
RECEIVE_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")
ISSUED_TOKENS_MAX = 16_384  # decode_token's memory of tokens handed out (past it, the older half is forgotten)
TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{27,400}")  # URL-safe base64, unpadded; fullmatch
SECONDS_RE = re.compile(r"[ \t]*([0-9]+(\.[0-9]*)?|\.[0-9]+)[ \t]*\Z")  # a header's or a query's seconds, e.g. "5", "0.25"

# API setting name -> (internal field, to-internal, from-internal)
SETTINGS = {
    "leaseTimeoutSeconds": "lease_timeout_us",
    "maxRetries": "max_retries",
    "retentionSeconds": "retention_us",
    "dedupWindowSeconds": "dedup_window_us",
    "failureQueue": "failure_queue",
}


def rfc3339(us: int) -> str:
    return datetime.fromtimestamp(us / US, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _num(x: float) -> str:
    """A bound as people write it: 1209600, not 1.2096e+06; 0.5 stays 0.5."""
    return str(whole_seconds(float(x)))


# the longest API key a node accepts in an Authorization header (docs/limits.md)
KEY_CHARS_MAX = 512


def _bearer(authorization: str) -> tuple:
    """An Authorization value -> (scheme, key), the blanks around each dropped."""
    scheme, _, key = authorization.strip().partition(" ")
    return scheme, key.strip()


@dataclass(frozen=True)
class Principal:
    admin: bool          # a bootstrap admin key: everything
    queue: str = "*"     # a scoped key's queue, "*" = every queue
    scopes: frozenset = frozenset()
    key_id: str = ""
    auth: str = ""       # the Authorization value, for forwarding to the primary
    forwarded: bool = False  # this call was forwarded to us: never forward it again
    via: str = ""            # the node that forwarded it, when it said

    def allows(self, scope: str, queue: Optional[str]) -> bool:
        if self.admin:
            return True
        if self.queue != "*" and (queue is None or queue != self.queue):
            return False
        return scope in self.scopes or "admin" in self.scopes

    def any_scope(self, queue: str) -> bool:
        return self.admin or ((self.queue == "*" or self.queue == queue) and bool(self.scopes))


@dataclass
class Delivery:
    id: str
    body: bytes
    token: str
    retry_count: int
    expires_at: str
    queue: str
    left_s: float = 0.0  # the lease's length when granted (0: not known, an older primary)


def _carriable(authorization: str) -> bool:
    """Whether gRPC metadata can carry this Authorization value (printable ASCII):
    every key a node holds can be (admin keys are refused otherwise at start,
    scoped keys are made so), so one that cannot is nobody's."""
    return authorization.isascii() and authorization.isprintable()


# the most a call is held for a primary that does not serve or lease yet (lease_hold_max_s)
LEASE_HOLD_S_MAX = 5.0


def _not_ready(e) -> str:
    """Why a primary does not serve yet (or any more)."""
    if e.stopping:
        return "the node is shutting down"
    if e.failed is not None:
        return e.stopped_why
    return "this node is taking over as primary"


def _tally(into: dict, counts: dict, sign: int) -> None:
    """Add (sign +1) or take back (-1) ``counts`` in ``into``; a name at 0 is dropped."""
    for k, n in counts.items():
        left = into.get(k, 0) + sign * n
        if left > 0:
            into[k] = left
        else:
            into.pop(k, None)


def _into_future(fut: asyncio.Future, _reply, result, error) -> None:
    """A Reply's outcome into a future of the caller's (see Service.send_begin)."""
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


# Why apply refused a send's entry (Core._apply_send), by error kind; nothing of
# the entry was stored
_REFUSED_AT_APPLY = {
    "queue_not_found": "queue was deleted while the send was committed",
    "unavailable": "the dedup key's window ended while this repeat was committed: nothing was stored, "
                   "send it again",
}


class Service:
    def __init__(self, engine: Engine, admin_keys: list):
        self.engine = engine
        self.limits = engine.limits
        self._admin = [hashlib.sha256(k.encode()).digest() for k in admin_keys if k]
        from node.api.forward import Forwarder
        from node.tls import peer_metadata
        self.cluster_key = getattr(engine, "cluster_key", "")  # --cluster-key (node/tls.py)
        self.fwd = Forwarder(tls=engine.tls, peer_md=peer_metadata(self.cluster_key),
                             current_primary=self._primary_address,
                             releases_max=engine.limits.releases_in_flight_max, node_id=engine.node_id,
                             pending=engine.pending_releases,
                             primary_changes=getattr(engine, "role_changes", None))
        engine.release_hook = self._release_from_peer
        self._id_prefix = os.urandom(8).hex()
        self._id_counter = 0
        # (caller, queue, receive id) -> (tokens it leased, or None once released;
        # when, in us): what a receive that named itself handed out, so that the
        # caller, if the answer was lost, can give it back (release_receive).
        # Bounded by names, tokens and age.
        self._receipts: OrderedDict = OrderedDict()
        # lease tokens handed out lately -> their decoded fields (decode_token's
        # shortcut: unpacking one costs about 3 us, a settle of 100 acks 0.3 ms)
        self._issued: dict = {}
        self._receipt_tokens = 0
        self._peer_releases: OrderedDict = OrderedDict()  # releases that came on acks, done
        self.session_wakes: set = set()  # the writers of open Session streams (shut_down wakes them)
        # creations proposed and not yet answered, counted against their caps: a
        # check of the core alone let concurrent creates pass the cap together
        self._queues_creating: dict = {}  # name -> calls creating it (until the engine settles them)
        self._sending: dict = {}  # queue -> messages proposed to it, not yet applied or refused
        # The node-wide cap on messages (Limits.messages_max, _node_room): what the
        # core held when last counted, the messages of sends settled since then (as
        # if all were stored: a refused one counts until the next count), and the
        # core's position, core and epoch at that count.
        self._held = self._held_since = self._held_lsn = 0
        self._held_of = None
        self._keys_on_way = 0  # new dedup keys of sends on their way (Limits.dedup_keys_max)
        self.sending_bytes = 0    # their bodies' bytes (Limits.sending_bytes_max)
        self.forwarded_polls = 0  # long polls this replica has forwarded, waiting (Limits.forwarded_polls_max)
        self._names_ok: set = set()  # names check_name_any passed (a pure check: remembered, bounded)
        self._keys_creating = 0

    @property
    def core(self):
        return self.engine.core  # a replica that installs a snapshot gets a new core

    @property
    def stopping(self) -> bool:
        return self.engine.stopping

    def shut_down(self) -> None:
        """A graceful stop begins: new calls answer ``unavailable``, long polls end
        now (unavailable: the client tries its next node), and Session streams
        end as unavailable once what they had read is answered. Writes already
        proposed still commit and answer."""
        self.engine.stopping = True
        self.engine.readiness_changed()
        self.engine.wake_all_receivers()
        self.fwd.shut_down()  # a replica's forwarded long polls end too
        for wake in list(self.session_wakes):
            wake.set()

    # -------------------------------------------------------------- auth
    def authenticate(self, authorization: Optional[str], forwarded: str = "", memo: Optional[list] = None) -> Principal:
        """``forwarded``: "" for a client's call, else the forwarding node's id (or "1").

        ``memo``: a list a Session stream keeps (its Authorization is fixed for its
        life). A key that passed is remembered there with the keys it was checked
        against (this core, its ``keys_version``); while no key has been put or
        deleted since, the stream's next request skips the hashing. A deleted key
        changes the version, so it stops working on open streams at once."""
        if memo:
            core = self.core
            if memo[0]() is core and memo[1] == core.keys_version:
                return memo[2]
        try:
            p = self._authenticate(authorization)
        except errors.Unauthenticated:
            e = self.engine
            if authorization and _carriable(authorization) and (not e.loaded or forwarded and not e.ready):
                # this node cannot tell an unknown key from one it has not loaded or
                # applied yet: still loading its store, or a call forwarded to it as
                # the primary while it is not serving as one (restarted, stepped
                # down, or its epoch not open yet): not now, rather than "unknown key"
                why = ("it is loading its store" if not e.loaded else "it is not the primary" if e.role != "primary"
                       else _not_ready(e))
                raise errors.Unavailable(f"this node cannot check keys right now: {why}", retry_after_s=0.5) from None
            if authorization and not forwarded and e.cluster and e.role != "primary":
                # keys are replicated, but a new one may not have reached us yet:
                # the primary decides (every call from here is forwarded) and, while
                # no primary is known, nobody can: not now, rather than "unknown key"
                if not _carriable(authorization):
                    raise  # no key of ours has such characters, and gRPC could not carry it
                if e.primary_id:
                    return Principal(admin=False, auth=authorization)
                raise errors.Unavailable("no primary is known to check this key against", retry_after_s=0.5) from None
            if authorization and e.role == "primary" and not e.ready:
                # a new primary may not have applied the key's creation yet
                raise errors.Unavailable(_not_ready(e), retry_after_s=0.5) from None
            raise
        via = forwarded if forwarded in self.engine.repl.addresses else ""
        p = Principal(p.admin, p.queue, p.scopes, p.key_id, authorization or "", bool(forwarded), via)
        if memo is not None:
            core = self.core
            # the core by a weak reference: a core a snapshot replaced is not kept
            # alive by an idle stream (it no longer matches, so the key is checked again)
            memo[:] = (weakref.ref(core), core.keys_version, p)
        return p

    @staticmethod
    def unknown_here(p: Principal) -> bool:
        """A key this replica does not know: authenticate let it through for the
        primary to decide (it may be new). (A plain check: the callers on the hot
        path await ``verified`` only then.)"""
        return not (p.admin or p.key_id or not p.auth or p.forwarded)

    async def verified(self, p: Principal) -> Principal:
        """A key this replica does not know is checked with the primary before
        anything else, so that a bad key gets the primary's 401 from every node,
        ahead of any check of the request's form. One more round trip, for such
        keys only."""
        if not self.unknown_here(p):
            return p
        a = self._remote(p)
        if a:
            await self.fwd.check_key(a, p.auth)  # (401 for a key the primary does not know either)
        return p

    def _primary_address(self) -> Optional[str]:
        e = self.engine
        return e.repl.addresses.get(e.primary_id) if e.primary_id else None

    def forwards(self) -> bool:
        """This node passes client calls on to the primary (``_remote`` says where).
        Such a call's shape is checked here first: a malformed request gets the
        same 400 from every node, also while no primary is known."""
        e = self.engine
        return e.cluster and e.role != "primary"

    def _remote(self, p: Principal) -> Optional[str]:
        """The primary's address when this call must be forwarded, else None."""
        e = self.engine
        if not self.forwards():
            if not e.ready:
                # elected, but the records its predecessor committed are not all
                # applied here until its first record commits: what it holds now
                # may lack a queue, a message or a count that exists
                raise errors.Unavailable(_not_ready(e), retry_after_s=0.5)
            return None
        if e.stopping:
            raise errors.Unavailable("the node is shutting down", retry_after_s=0.5)
        if p.forwarded:
            raise errors.Unavailable("not the primary (a forwarded call is not forwarded again)", retry_after_s=0.5)
        if not e.primary_id:
            raise errors.Unavailable("no primary is known right now", retry_after_s=0.5)
        return e.repl.addresses[e.primary_id]

    def _authenticate(self, authorization: Optional[str]) -> Principal:
        if not authorization:
            raise errors.Unauthenticated("missing Authorization: Bearer <key>")
        scheme, key = _bearer(authorization)
        if scheme.lower() != "bearer" or not key or len(key) > KEY_CHARS_MAX:
            raise errors.Unauthenticated("expected Authorization: Bearer <key>")
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        ok = False
        for a in self._admin:  # constant time, and compare against every one
            ok |= hmac.compare_digest(a, digest)
        if ok:
            return Principal(admin=True)
        if key.startswith("spk_"):
            kid, _, secret = key[4:].partition("_")
            rec = self.core.keys.get(kid)
            if rec is not None:
                sha = hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()
                if hmac.compare_digest(rec[0], sha):
                    return Principal(admin=False, queue=rec[1], scopes=frozenset(rec[2]), key_id=kid)
        raise errors.Unauthenticated("unknown key")

    @staticmethod
    def authorize(p: Principal, scope: str, queue: Optional[str]) -> None:
        if not p.allows(scope, queue):
            raise errors.Forbidden(f"key lacks the {scope} scope" + (f" on queue {queue}" if queue else ""))

    def _global_admin(self, p: Principal) -> None:
        if not (p.admin or (p.queue == "*" and "admin" in p.scopes)):
            raise errors.Forbidden("needs an admin key for every queue")

    # ---------------------------------------------------------- validation
    def check_name(self, name: str) -> str:
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise errors.InvalidArgument("queue name must match [A-Za-z0-9._-]{1,80}")
        return name

    def _queue(self, name: str):
        q = self.core.queues.get(name)
        if q is None:
            raise errors.QueueNotFound(f"queue {name} does not exist")
        return q

    def _seconds(self, v, what: str, lo: float, hi: float, lo_open: bool = False) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise errors.InvalidArgument(f"{what} must be a number")
        try:
            v = float(v)
        except OverflowError:
            raise errors.InvalidArgument(f"{what} is out of range") from None
        if not math.isfinite(v):
            raise errors.InvalidArgument(f"{what} must be a finite number")
        if v < lo or (lo_open and v <= lo) or v > hi:
            raise errors.InvalidArgument(f"{what} must be {'>' if lo_open else '>='} {_num(lo)} and <= {_num(hi)}")
        return float(v)

    def parse_seconds_header(self, v: Optional[str], what: str, hi: float) -> float:
        if v is None:
            return 0.0  # absent; present but empty is malformed (as an empty Spooler-Dedup-Key is)
        if not SECONDS_RE.match(v):  # float() alone would also take "1_0", "1e3", "+5"
            raise errors.InvalidArgument(f"{what} must be a number of seconds (digits, an optional fraction)")
        try:
            f = float(v.strip())
        except (ValueError, OverflowError):
            raise errors.InvalidArgument(f"{what} must be a number of seconds") from None
        return self._seconds(f, what, 0.0, hi)

    def settings_to_internal(self, name: str, given: dict) -> log_pb2.QueueSettings:
        if not isinstance(given, dict):
            raise errors.InvalidArgument("settings must be a JSON object")
        lim = self.limits
        out = log_pb2.QueueSettings()
        for k, v in given.items():
            if k not in SETTINGS:
                raise errors.InvalidArgument(f"unknown setting {k!r}; known: {', '.join(SETTINGS)}")
            if k == "leaseTimeoutSeconds":
                out.lease_timeout_us = max(1, round(self._seconds(v, k, 0, lim.lease_timeout_s_max, lo_open=True) * US))
            elif k == "retentionSeconds":
                out.retention_us = max(1, round(self._seconds(v, k, 0, lim.retention_s_max, lo_open=True) * US))
            elif k == "dedupWindowSeconds":
                w = self._seconds(v, k, 0, lim.dedup_window_s_max)
                out.dedup_window_us = max(1, round(w * US)) if w > 0 else 0  # a window never rounds to "off"
            elif k == "maxRetries":
                if isinstance(v, float) and v.is_integer():  # JSON's 2.0 is the integer 2
                    v = int(v)
                if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= lim.max_retries_max:
                    raise errors.InvalidArgument(f"maxRetries must be an integer 0..{lim.max_retries_max}")
                out.max_retries = v
            elif k == "failureQueue":
                if not isinstance(v, str) or not NAME_RE.match(v):
                    raise errors.InvalidArgument("failureQueue must be a queue name [A-Za-z0-9._-]{1,80}")
                if v == name:
                    raise errors.InvalidArgument("a queue cannot be its own failure queue")
                out.failure_queue = v
        return out

    # -------------------------------------------------------------- queues
    def queue_doc(self, name: str) -> dict:
        q = self._queue(name)
        s = q.settings
        return {"name": name,
                "settings": {"leaseTimeoutSeconds": whole_seconds(s["lease_timeout_us"] / US),
                             "maxRetries": s["max_retries"],
                             "retentionSeconds": whole_seconds(s["retention_us"] / US),
                             "dedupWindowSeconds": whole_seconds(s["dedup_window_us"] / US),
                             "failureQueue": failure_queue_of(name, s)},
                "stats": self.core.stats(name, self.engine.now_us())}

    async def put_queue(self, p: Principal, name: str, settings: dict) -> tuple:
        self.check_name(name)
        st = self.settings_to_internal(name, settings)  # validated here, also before forwarding
        if (a := self._remote(p)):
            if st.HasField("max_retries"):  # JSON's 2.0 travels as the integer it is
                settings = {**settings, "maxRetries": st.max_retries}
            return await self.fwd.put_queue(a, p.auth, name, settings)
        self.authorize(p, "admin", name)
        if st.HasField("failure_queue"):
            # exhausted messages will be written there, and redrive reads it back
            self.authorize(p, "admin", st.failure_queue)
        queues, creating = self.core.queues, self._queues_creating
        if name not in queues and name not in creating:
            if len(queues) + sum(1 for n in creating if n not in queues) >= self.limits.queues_max:
                raise errors.InvalidArgument(f"at most {self.limits.queues_max} queues")
        created = await self._propose_counted(log_pb2.Record(queue_put=log_pb2.QueuePut(name=name, settings=st)),
                                              functools.partial(_tally, creating, {name: 1}))
        return created, self.queue_doc(name)

    async def get_queue(self, p: Principal, name: str) -> dict:
        self.check_name_any(name)
        if (a := self._remote(p)):
            return await self.fwd.get_queue(a, p.auth, name)
        if not p.any_scope(name):
            raise errors.Forbidden(f"key has no scope on queue {name}")
        return self.queue_doc(name)

    def check_name_any(self, name: str) -> str:
        """A name a queue may have: one a PUT may give ([A-Za-z0-9._-]{1,80}), or a
        failure queue derived from one ("{queue}.failed", its own "{queue}.failed.failed",
        ...), which may be longer than 80 (up to 255). A name that passed is
        remembered (at most NAMES_OK_MAX): every send checks its queue's name twice."""
        ok = self._names_ok
        if type(name) is str and name in ok:
            return name
        if isinstance(name, str) and DERIVED_NAME_RE.match(name):
            base = name
            while len(base) > 80 and base.endswith(".failed"):
                base = base[:-len(".failed")]
            if NAME_RE.match(base):
                if type(name) is str:
                    if len(ok) >= NAMES_OK_MAX:
                        ok.clear()
                    ok.add(name)
                return name
        raise errors.InvalidArgument("queue name must match [A-Za-z0-9._-]{1,80}"
                                     " (or be a failure queue derived from one: \"{queue}.failed\")")

    async def list_queues(self, p: Principal) -> list:
        if (a := self._remote(p)):
            return await self.fwd.list_queues(a, p.auth)
        return [self.queue_doc(n) for n in sorted(self.core.queues) if p.any_scope(n)]

    async def delete_queue(self, p: Principal, name: str) -> None:
        self.check_name_any(name)
        if (a := self._remote(p)):
            return await self.fwd.delete_queue(a, p.auth, name)
        self.authorize(p, "admin", name)
        self._queue(name)
        await self.engine.propose(log_pb2.Record(queue_delete=log_pb2.QueueDelete(name=name)))

    async def purge(self, p: Principal, name: str) -> int:
        """Every message of the queue goes, leased ones too (their leases end:
        stale_lease, reason settled); its settings, totals and dedup keys stay.
        -> how many it held when the purge applied. Refused (unavailable) while a
        member that answered this primary runs a build that cannot apply it, and on
        a replica while the primary runs a build that has no purge (it answers the
        forwarded call UNIMPLEMENTED: method_not_allowed would tell the caller that
        the call itself is wrong, when only the cluster's upgrade is unfinished)."""
        self.check_name_any(name)
        if (a := self._remote(p)):
            try:
                return await self.fwd.purge(a, p.auth, name)
            except errors.MethodNotAllowed:
                raise errors.Unavailable(f"the primary (at {a}) runs a build older than 0.4.42, which has no "
                                         "purge: upgrade it first", retry_after_s=30.0) from None
        self.authorize(p, "admin", name)
        self._queue(name)
        behind = self.engine.repl.members_behind(PURGE_LOG_FORMAT)
        if behind:
            raise errors.Unavailable(f"member(s) {', '.join(behind)} run a build older than 0.4.42, which cannot "
                                     "apply a purge: upgrade them first", retry_after_s=30.0)
        n = await self.engine.propose(log_pb2.Record(purge=log_pb2.Purge(queue=name)))
        if n is None:  # deleted between the check and the apply
            raise errors.QueueNotFound(f"queue {name} does not exist")
        return n

    async def redrive(self, p: Principal, name: str) -> int:
        self.check_name_any(name)
        if (a := self._remote(p)):
            return await self.fwd.redrive(a, p.auth, name)
        self.authorize(p, "admin", name)
        q = self._queue(name)
        self.authorize(p, "admin", q.failure_queue)  # redrive empties the failure queue
        fq = self.core.queues.get(q.failure_queue)
        moving = {}
        if fq is not None and fq is not q:
            # what the failure queue holds when the redrive applies: what it holds now
            # and what is on its way to it; the queue gets that on top of its own
            moving[name] = fq.size + self._sending.get(fq.name, 0)
            after = q.size + self._sending.get(name, 0) + moving[name]
            if after > self.limits.messages_per_queue_max:
                raise errors.Unavailable(f"redrive would put {after} messages in queue {name}; it holds at "
                                         f"most {self.limits.messages_per_queue_max}", retry_after_s=1.0)
        return await self._propose_counted(log_pb2.Record(redrive=log_pb2.Redrive(queue=name)),
                                           functools.partial(_tally, self._sending, moving))

    def _propose_counted(self, rec, count: Callable[[int], None], reply: Optional[Reply] = None):
        """Propose ``rec``; ``count(+1)`` now and ``count(-1)`` once the engine settles
        it, applied or refused: what it adds counts against its cap until then (the
        messages it sends, the queue or key it makes). A caller that goes away
        meanwhile changes nothing: the engine holds a Reply, not the caller's future.
        -> ``reply``, or a future of the outcome."""
        fut = None
        if reply is None:
            fut = asyncio.get_running_loop().create_future()
            reply = Reply(functools.partial(_into_future, fut))
        self.engine.propose(rec, reply=reply)
        count(+1)
        reply.on_settled(functools.partial(count, -1))
        return reply if fut is None else fut

    def _count_key(self, sign: int) -> None:
        self._keys_creating += sign

    # ------------------------------------------------------------ messages
    async def send(self, p: Principal, entries: list, run: Optional[tuple] = None) -> list:
        """entries: [(queue, body bytes, delay_s float, dedup_key str)]; run: None or
        (queue, [body bytes], delay_s), plain messages stored after the entries in
        the compact form. -> [(id, duplicate, error)], the entries', then the run's.

        All of it is one log record, validated before it is made. ``error`` is
        None, or the SpoolerError of an entry that apply refused (its queue was
        deleted in the same group commit); the other entries are stored.
        """
        if not self.engine.ready and not self.forwards():
            # (a Session stream's sends are not held, they go straight to send_begin:
            # the SDK tries them again.) The bodies count against sending_bytes_max
            # while they wait, as a forwarded send's do below.
            with self._holding_bodies(entries, run):
                await self.until_ready(asyncio.get_running_loop().time() + self.lease_hold_max_s())
        fut = self.send_begin(p, entries, run)
        if fut is None:
            # forwarded: its bodies are held here until the primary answers, and
            # count against sending_bytes_max as the primary's own sends do (a
            # replica with a stopped primary held every forwarded body it was sent)
            with self._holding_bodies(entries, run):
                return await self.fwd.send(self._remote(p), p.auth, entries, run)
        return self.send_results(await fut)

    @contextlib.contextmanager
    def _holding_bodies(self, entries: list, run: Optional[tuple]):
        """A send's bodies held on this node meanwhile (waiting or forwarded), counted
        against sending_bytes_max: 503 at once if they would pass it."""
        total = sum(len(e[1]) for e in entries) + (sum(map(len, run[1])) if run else 0)
        self.check_sending_room(total)
        self.sending_bytes += total
        try:
            yield
        finally:
            self.sending_bytes -= total

    def send_begin(self, p: Principal, entries: list, run: Optional[tuple] = None, reply=None):
        """The synchronous part of ``send``: every check, then the proposal. -> the
        proposal's future (its result goes through ``send_results``), or None when
        this node does not hold the primary's state and the send must be forwarded
        (only the shape is checked then). ``reply``: an engine Reply to tell instead
        of a future; a Session stream answers from it: no task per send."""
        lim = self.limits
        n = len(entries) + (len(run[1]) if run else 0)
        if not n:
            raise errors.InvalidArgument("nothing to send")
        if n > lim.batch_entries_max:
            raise errors.InvalidArgument(f"at most {lim.batch_entries_max} messages in a batch")
        # the shape first, on every node alike (a replica before it forwards): names,
        # sizes, delays, keys; then the primary's own checks: scope, queue, room
        total = self._send_shape(entries, run)
        if self.forwards():
            return None
        if not self.engine.ready:  # (as _remote: a queue may exist that this node has not applied yet)
            raise errors.Unavailable(_not_ready(self.engine), retry_after_s=0.5)
        if self.engine.disk_low():
            # acks, nacks and retention go on (they make room); a send would fill the
            # disk, and a node whose disk is full stops, and cannot start again on it
            raise errors.Unavailable(f"the node's disk has less than {self.limits.disk_free_bytes_min} bytes free: "
                                     "sends are refused until there is room", retry_after_s=5.0,
                                     reason=errors.DISK_LOW)
        self.check_sending_room(total)
        rec = log_pb2.Record()
        send = rec.send_compact if run and run[1] else rec.send
        add = send.entries.add
        checked: dict = {}  # queue -> room left; each queue is validated once per batch
        rooms: dict = {}    # queue -> its room before this batch
        keyed = 0           # dedup keys this batch would add to what the node remembers
        repeats = 0         # entries whose key the queue remembers: answered with the first id, storing nothing
        now = self.engine.now_us()
        for queue, body, delay_s, key in entries:
            room = checked.get(queue)
            if room is None:
                room = rooms[queue] = self._room(p, queue)
            stores = True  # (a repeat of a key the queue remembers is answered, storing nothing)
            if key:
                q = self.core.queues[queue]
                if q.settings["dedup_window_us"]:
                    hit = q.dedup.get(key)
                    if hit is not None and now < hit[1]:
                        stores = False  # no room needed: a resend is answered even at a cap (S6)
                        repeats += 1
                    else:
                        keyed += 1
            if stores:
                if room <= 0:
                    raise self._full(queue)
                room -= 1
            checked[queue] = room
            add(queue=queue, id=self._next_id(), body=body, delay_us=round(delay_s * US) if delay_s else 0,
                dedup_key=key or "", repeat=not stores)  # (a repeat is refused at apply if it would store)
        n -= repeats
        if n and not self._node_room(n):
            raise errors.Unavailable(f"the node holds its maximum of {lim.messages_max} messages, "
                                     "every queue together", retry_after_s=1.0, reason=errors.NODE_FULL)
        if keyed:
            over = self.core.dedup_n + self._keys_on_way + keyed - lim.dedup_keys_max
            # keys whose window has ended are forgotten as the next record applies:
            # this send's own, if nothing comes before it (an idle node's keys would
            # otherwise count for ever)
            if over > 0 and self.core.dedup_ended(now, over) < over:
                raise errors.Unavailable(f"the node remembers its maximum of {lim.dedup_keys_max} dedup keys, "
                                         "every queue together: sends with a new key wait until older keys' "
                                         "windows end", retry_after_s=1.0, reason=errors.NODE_FULL)
        if run:
            queue, bodies, delay_s = run
            room = checked.get(queue)
            if room is None:
                room = rooms[queue] = self._room(p, queue)
            if room < len(bodies):
                raise self._full(queue)
            checked[queue] = room - len(bodies)
            if bodies:
                send.run_queue = queue
                send.run_id_prefix = self._id_prefix
                send.run_id_first = self._id_counter + 1
                self._id_counter += len(bodies)
                send.run_delay_us = round(delay_s * US) if delay_s else 0
                send.run_bodies.extend(bodies)
        # Messages on their way to a queue count against its cap (_room) until the
        # engine settles the record: applied (then the queue's size has them) or refused;
        # their bytes against sending_bytes_max.
        tally = functools.partial(_tally, self._sending, {q: room - checked[q] for q, room in rooms.items()})

        def count(sign: int) -> None:
            tally(sign)
            self.sending_bytes += sign * total
            self._keys_on_way += sign * keyed
            if sign < 0:
                self._held_since += n

        return self._propose_counted(rec, count, reply)

    def _node_room(self, n: int) -> bool:
        """May ``n`` more messages come in, every queue together, within
        Limits.messages_max? Counted as what the core held when last counted, plus
        the messages of sends settled since, plus those on their way (_sending,
        redrives included): never less than what the node holds (acks and expiries
        since the count only make it larger), so the cap is never passed. Counting
        every queue costs O(queues), so it is done afresh only when the node has a
        new core or epoch (as a replica it applied others' sends), and before a
        refusal if anything was applied or settled since the last count (acks may
        have made room): a client refused over and over costs no count while
        nothing applies, and one count per refusal while records apply (about a
        millisecond with 10,000 queues)."""
        core = self.core
        of = (id(core), core.epoch)
        if of != self._held_of:
            self._recount(core, of)
        cap, on_way = self.limits.messages_max, sum(self._sending.values())
        if self._held + self._held_since + on_way + n <= cap:
            return True
        if core.lsn != self._held_lsn or self._held_since:  # (a send refused unstored counts there too)
            self._recount(core, of)
        return self._held + self._held_since + on_way + n <= cap

    def _recount(self, core, of) -> None:
        self._held, self._held_since, self._held_lsn, self._held_of = core.messages_held(), 0, core.lsn, of

    def check_send_to(self, p: Principal, queue: str) -> None:
        """The checks of an HTTP send that need no body, made before its declared
        length is set aside in ``sending_bytes`` and its body is read: the queue's
        name, the caller's send scope on it (when this node knows the key), and, on
        the node that holds the primary's state, that the queue exists. Else any key
        could hold the whole budget with bodies it never sends to queues it may not
        send to, and refuse every other send on the node (HTTP and gRPC) for the
        client timeout. send_begin makes the same checks again, in the same order."""
        self.check_name_any(queue)
        if self.forwards() and self.unknown_here(p):
            return  # the primary knows the key (forwarded, it says 401 or 403)
        self.authorize(p, "send", queue)
        if not self.forwards() and self.engine.ready:  # (not ready: send_begin says so)
            self._queue(queue)

    def check_sending_room(self, n_bytes: int) -> None:
        """503 if ``n_bytes`` more of bodies would pass sending_bytes_max (one send
        always fits when none is on its way)."""
        if self.sending_bytes and self.sending_bytes + n_bytes > self.limits.sending_bytes_max:
            raise errors.Unavailable(f"the node holds {self.sending_bytes} bytes of sends not yet stored: "
                                     "try again", retry_after_s=0.5, reason=errors.OVERLOADED)

    @staticmethod
    def send_results(applied: tuple) -> list:
        """A committed send's apply result (Core._apply_send's (entries, run)) ->
        [(id, duplicate, error)], the entries', then the run's (see ``send``)."""
        entries, run = applied
        out = [("", False, errors.make(d, _REFUSED_AT_APPLY[d])) if mid is None else (mid, d, None)
               for mid, d in entries]
        if run is not None:
            if run.error is None:
                out.extend([(mid, False, None) for mid in run.ids()])
            else:
                out.extend([("", False, errors.make(run.error, _REFUSED_AT_APPLY[run.error]))
                            for _ in range(run.n)])
        return out

    def _check_dedup_key(self, key: str) -> None:
        if len(key) > self.limits.dedup_key_chars_max or not key.isprintable():
            raise errors.InvalidArgument(f"dedup key: 1..{self.limits.dedup_key_chars_max} printable characters")

    def _send_shape(self, entries: list, run: Optional[tuple]) -> int:
        """What a send must be whatever the queues hold (names, sizes, delays, keys),
        checked on every node before anything else. Scope and room are the primary's."""
        lim = self.limits
        sizes = [len(body) for _, body, _, _ in entries]
        if run:
            sizes.extend(map(len, run[1]))
        for queue in {e[0] for e in entries} | ({run[0]} if run else set()):
            self.check_name_any(queue)
        for _, _, delay_s, key in entries:
            if delay_s:
                self._seconds(delay_s, "delay", 0.0, lim.delay_s_max)
            if key:
                self._check_dedup_key(key)
        if run and run[2]:
            self._seconds(run[2], "delay", 0.0, lim.delay_s_max)
        biggest, total = max(sizes), sum(sizes)
        if biggest > lim.body_bytes_max:
            raise errors.MessageTooLarge(f"message of {biggest} bytes; the limit is {lim.body_bytes_max}")
        if total > lim.batch_bytes_max:
            raise errors.MessageTooLarge(f"batch of {total} bytes; the limit is {lim.batch_bytes_max}")
        return total

    def _room(self, p: Principal, queue: str) -> int:
        """Validate a queue a batch sends to (once per batch): its name, the caller's
        scope, that it exists; -> how many more messages it may hold."""
        self.check_name_any(queue)
        self.authorize(p, "send", queue)
        return self.limits.messages_per_queue_max - self._queue(queue).size - self._sending.get(queue, 0)

    def _full(self, queue: str) -> errors.SpoolerError:
        return errors.Unavailable(f"queue {queue} holds its maximum of {self.limits.messages_per_queue_max} messages",
                                  retry_after_s=1.0, reason=errors.QUEUE_FULL)

    def _next_id(self) -> str:
        """Message ids: a random per-process prefix and a counter (unique across
        restarts and nodes without a syscall per message)."""
        self._id_counter += 1
        return message_id(self._id_prefix, self._id_counter)

    def _lease_out(self, queue: str, max_n: int, via: str = "") -> list:
        """``via``: the node that forwarded this receive; its leases carry (node, when)
        so that one expiring after that node lost contact is given back, not counted
        (Engine._lost_contact)."""
        now = self.engine.now_us()
        max_n = min(max_n, self.limits.leases_max - len(self.core.leases))  # the node-wide bound
        if max_n <= 0:
            return []
        # at most batch_bytes_max of bodies: an answer stays well under gRPC's
        # 16 MiB message limit (the rest stay visible for the next receive)
        got = self.core.receive(queue, now, max_n, self.limits.leases_per_queue_max,
                                (via, mono_us()) if via else None, self.limits.batch_bytes_max)
        if not got:
            return []
        bodies = self.engine.bodies_of([m for m, _ in got])
        if self.engine.metrics:  # leases live in memory, not in the log: counted here
            self.engine.metrics.receives.inc(len(got))
        end = got[0][1].expires_at  # one receive: one lease timeout, one expiry
        expires, left_s = rfc3339(end), (end - now) / US
        return [Delivery(m.id, body, self.encode_token(lease), m.retry, expires, queue, left_s)
                for (m, lease), body in zip(got, bodies)]

    async def receive(self, p: Principal, queue: str, wait_s: float, max_n: int = 1, receive_id: str = "",
                      caller_receive_id: str = "") -> list:
        """``receive_id``: optional, chosen by the caller and unique to this call; it
        lets the caller give back what the call leased if the answer is lost on the
        way (``release_receive``). A forwarding node names the call with a name of
        its own and passes the caller's on as ``caller_receive_id``."""
        self.check_name_any(queue)
        wait_s = self._seconds(wait_s, "wait", 0.0, self.limits.wait_s_max)
        if not 1 <= max_n <= self.limits.batch_entries_max:
            raise errors.InvalidArgument(f"max messages must be 1..{self.limits.batch_entries_max}")
        if self.forwards():
            if receive_id:
                self._check_receive_id(receive_id)
            # (one that does not wait is held on the primary only right after a
            # failover, until it may lease, and counts there against
            # receives_waiting_max: not here, so that it still goes through)
            polls = 1 if wait_s else 0
            if polls and self.forwarded_polls >= self.limits.forwarded_polls_max:
                raise errors.Unavailable(f"this node forwards {self.forwarded_polls} long polls to the primary "
                                         "already: try again, or ask the primary", retry_after_s=1.0)
            self.forwarded_polls += polls
            try:
                return await self.fwd.receive(self._remote(p), p.auth, queue, wait_s, max_n, receive_id,
                                              release_for_s=self._release_for_s())
            finally:
                self.forwarded_polls -= polls
        loop = asyncio.get_running_loop()
        # how long this receive may be held, past its own wait, for a primary that
        # does not serve or lease yet: one budget for both holds below
        hold_until = loop.time() + self.lease_hold_max_s()
        # (as _remote: a queue may exist that this node has not applied yet)
        await self.until_ready(hold_until)
        self.authorize(p, "receive", queue)
        self._queue(queue)
        keys = [(self._caller(p), queue, self._check_receive_id(n)) for n in (receive_id, caller_receive_id) if n]
        for key in keys:
            if key in self._receipts:
                if self._receipts[key][0] is not None:
                    raise errors.InvalidArgument("receive id already used: name every receive afresh")
                # released before it got here: its caller gave up on it (a request
                # held in the network with a cut link arrives late)
                logs.throttled(log, logging.INFO, ("released before",), "a receive released by its caller "
                               "before it arrived leased nothing")
                return []
        deadline = loop.time() + wait_s
        held = False
        while True:
            if not self.engine.serving():
                raise errors.Unavailable("node is not serving", retry_after_s=1.0)
            ev = self.engine.queue_event(queue)
            out = self._lease_out(queue, max_n, p.via) if self.engine.may_lease() else []
            if out:
                if keys and not self._note_receipt(keys, out):
                    self.give_back([d.token for d in out])  # its caller released it while it waited
                    return []
                return out
            left = deadline - loop.time()
            vis = self.core.next_visible_at(queue)
            if left <= 0:
                if not held and vis is not None and vis <= self.engine.now_us() and self.engine.may_lease():
                    held = True  # it may lease since the check above: one more look
                    continue
                if not self.engine.may_lease() and self.core.stats(queue, self.engine.now_us())["visible"]:
                    # messages are visible, but this node may not lease them yet: "nothing
                    # became visible" would be false. A new primary waits out older ones'
                    # leases (at most about a failover timeout after it took office); a
                    # primary whose majority is slow to answer waits for it. The receive
                    # is held that long, once, so that the messages a failover made
                    # visible again are handed out by the first receive after it (API.md:
                    # "visible again at once"), not refused; past it, 503.
                    wait = self.engine.repl.lease_wait_s()
                    if not held and loop.time() < hold_until:
                        held = True
                        deadline = min(loop.time() + wait, hold_until)
                        continue
                    raise errors.Unavailable(f"this primary may not hand out leases for about {wait:.2f} s (an older "
                                             "primary's may still run, or a majority has not answered lately)",
                                             retry_after_s=wait)
                return []
            if vis is not None:
                left = min(left, max(0.001, (vis - self.engine.now_us()) / US))
            if not self.engine.may_lease():
                left = min(left, 0.05)  # a new primary waits out the old one's leases
            if self.engine.receives_waiting >= self.limits.receives_waiting_max:
                # Session streams carry up to 1,024 polls each, past the cap on calls:
                # this bounds the waiters (and their memory) node-wide
                raise errors.Unavailable(f"{self.limits.receives_waiting_max} receives are waiting on this node "
                                         "already: try again", retry_after_s=1.0, reason=errors.OVERLOADED)
            self.engine.receives_waiting += 1
            try:
                await wait_event(ev, left)
            finally:
                self.engine.receives_waiting -= 1
            if queue not in self.core.queues:
                raise errors.QueueNotFound(f"queue {queue} was deleted")

    # -------------------------------------------------------------- leases
    def encode_token(self, lease) -> str:
        raw = struct.pack(">BQQ", 1, lease.epoch, lease.id) + lease.nonce + lease.queue.encode()
        token = binascii.b2a_base64(raw, newline=False).translate(_TO_URLSAFE).rstrip(b"=").decode()
        issued = self._issued
        issued[token] = (lease.epoch, lease.id, lease.nonce, lease.queue)
        if len(issued) > ISSUED_TOKENS_MAX:  # forget the older half (their leases have most likely ended)
            self._issued = dict(itertools.islice(issued.items(), ISSUED_TOKENS_MAX // 2, None))
        return token

    def decode_token(self, token: str) -> tuple:
        """-> (epoch, lease id, nonce, queue). A token this node handed out lately is
        looked up (``_issued``: its fields, as encode_token packed them); any other
        is checked character by character and unpacked. Either way the lease gate
        (Core.check_lease) decides whether it is still good."""
        try:
            got = self._issued.get(token)
        except TypeError:  # not hashable: not a token
            got = None
        if got is not None:
            return got
        try:
            # every character checked here: a2b_base64 would skip the ones it does not know
            if not isinstance(token, str) or not TOKEN_RE.fullmatch(token):
                raise ValueError
            raw = binascii.a2b_base64((token + "=" * (-len(token) % 4)).translate(_FROM_URLSAFE))
            version, epoch, lease_id = struct.unpack(">BQQ", raw[:17])
            nonce, queue = raw[17:25], raw[25:].decode()
            if version != 1 or len(nonce) != 8 or not DERIVED_NAME_RE.match(queue):
                raise ValueError
        except (ValueError, UnicodeError, struct.error, binascii.Error):
            raise errors.InvalidArgument("malformed lease token") from None
        return epoch, lease_id, nonce, queue

    # ---------------------------------------------------- lost receive answers
    def _check_receive_id(self, rid: str) -> str:
        if not isinstance(rid, str) or not RECEIVE_ID_RE.match(rid):
            raise errors.InvalidArgument("receive id must be 1-64 characters of [A-Za-z0-9._-]")
        return rid

    async def until_ready(self, deadline: float) -> None:
        """A primary taking over (elected, its EpochBegin not yet committed: a round
        trip and an fsync, longer while its majority is slow) serves in a moment.
        A send or receive asked meanwhile waits for that, until ``deadline`` (the
        loop's clock) at the latest, instead of being refused: a client that saw
        the new primary named (its own cluster document names it from its
        election) and asks it at once gets an answer, not 503. Past that, or once
        the node is not taking over any more (stepped down, stopping, failed), 503
        as before. Such waits count against receives_waiting_max with the long
        polls (past it, 503 at once), and wake on the engine's readiness_changes,
        not on a timer."""
        e = self.engine
        if e.ready:
            return
        loop = asyncio.get_running_loop()
        if e.role == "primary" and not e.stopping and e.failed is None and loop.time() < deadline:
            if e.receives_waiting >= self.limits.receives_waiting_max:
                raise errors.Unavailable(f"{self.limits.receives_waiting_max} calls are waiting on this node "
                                         "already: try again", retry_after_s=1.0, reason=errors.OVERLOADED)
            e.receives_waiting += 1
            try:
                while (not e.ready and e.role == "primary" and not e.stopping and e.failed is None
                       and (left := deadline - loop.time()) > 0):
                    if not await wait_change(e.readiness_changes(), left):
                        break
            finally:
                e.receives_waiting -= 1
        if not e.ready:
            raise errors.Unavailable(_not_ready(e), retry_after_s=0.5)

    def lease_hold_max_s(self) -> float:
        """The longest a send or receive is held, past its own wait, for a primary
        that does not serve or lease yet: a new one waits out older primaries'
        leases for at most about half a failover timeout past their last contact
        (DESIGN.md, "Serving and leasing"). A failover timeout and half a second,
        and never over 5 s: a replica forwarding the call waits 10 s for it
        (Forwarder.timeout_s) before it takes the answer for lost."""
        return min(self.engine.repl.core.timeout / US + 0.5, LEASE_HOLD_S_MAX)

    def _release_for_s(self) -> float:
        """How long a forwarding node keeps trying to release a lost answer: as long
        as a primary remembers a receive's name. Not just the lease's length from
        the loss: the receive itself may still be on its way, held with a cut link,
        and reach the primary (and lease) once the link is back, long after the
        forwarding node gave up on it (drill seed 10859). The release, sent once
        this node hears from that primary again, gives those leases back, or
        leaves the name released so that the late receive leases nothing."""
        return self.limits.receipt_age_s_max

    @staticmethod
    def _caller(p: Principal) -> str:
        """Whose receive names are whose: a key's id, else a digest of the key (the
        key alone: ``Bearer k`` and ``bearer  k`` are one caller, as they are one key)."""
        return p.key_id or hashlib.sha256(_bearer(p.auth)[1].encode("utf-8", "surrogateescape")).hexdigest()[:24]

    def _trim_receipts(self, now: int) -> None:
        r, lim = self._receipts, self.limits
        cutoff = now - int(lim.receipt_age_s_max * US)
        while r and (len(r) > lim.receipts_max or self._receipt_tokens > lim.receipt_tokens_max
                     or next(iter(r.values()))[1] < cutoff):
            tokens, _ = r.popitem(last=False)[1]
            self._receipt_tokens -= len(tokens or ())

    def _note_receipt(self, keys: list, out: list) -> bool:
        """Remember what a named receive leased, under each of its names; False if
        one of them was released first."""
        if any(k in self._receipts for k in keys):
            return False
        now = self.engine.now_us()
        tokens = [d.token for d in out]
        for key in keys:
            self._receipts[key] = (tokens, now)
            self._receipt_tokens += len(tokens)
        self._trim_receipts(now)
        return True

    async def release_receive(self, p: Principal, queue: str, receive_id: str) -> int:
        """Give back what a named receive handed out when its answer was lost on the
        way (a connection that broke with the answer in flight, a forwarding node
        cut off from the primary): its messages are visible again at once with
        their retry count unchanged. Only the caller that made the receive can
        release it. A name released before its receive answered makes that receive
        give back what it leases and answer empty. Only for answers that never
        reached a consumer: a consumer that has a message nacks it."""
        self.check_name_any(queue)
        self._check_receive_id(receive_id)
        if (a := self._remote(p)):
            return await self.fwd.release_receive(a, p.auth, queue, receive_id)
        return self._release_here(p, queue, receive_id)

    def _release_from_peer(self, releases: list) -> None:
        """Releases a replica sent along on its replication acks (its calls to us fail).
        It repeats them until its own call gets through: each is done once here."""
        for r in releases:
            seen = (r.queue, r.receive_id, r.authorization)
            if seen in self._peer_releases:
                continue
            self._peer_releases[seen] = None
            while len(self._peer_releases) > 4096:
                self._peer_releases.popitem(last=False)
            try:
                p = self.authenticate(r.authorization)
                if self.engine.role == "primary":
                    self._release_here(p, r.queue, r.receive_id)
            except errors.SpoolerError as e:
                log.info("a release sent on a replication ack was refused: %s", e)

    def _release_here(self, p: Principal, queue: str, receive_id: str) -> int:
        self.check_name_any(queue)
        self.authorize(p, "receive", queue)
        key = (self._caller(p), queue, self._check_receive_id(receive_id))
        tokens, _ = self._receipts.pop(key, (None, 0))
        self._receipt_tokens -= len(tokens or ())
        now = self.engine.now_us()
        self._receipts[key] = (None, now)  # a receive still on its way under this name gives back
        self._trim_receipts(now)
        return self.give_back(tokens or [])

    def give_back(self, tokens: list, auth: Optional[str] = None) -> int:
        """Deliveries whose answer could not be sent: their messages are visible
        again at once with an unchanged retry count (see Core.release). Only the
        primary holds leases: a node that forwarded the receive releases it there
        by the name it gave it (when it has the caller's ``auth``)."""
        e = self.engine
        if e.cluster and e.role != "primary":
            if auth is not None and tokens and (a := self._primary_address()):
                for queue, rid in self.fwd.names_of(tokens):
                    self.fwd.release_soon(a, auth, queue, rid, self._release_for_s())
            return 0
        now, n = self.engine.now_us(), 0
        for token in tokens:
            try:
                epoch, lease_id, nonce, _ = self.decode_token(token)
            except errors.SpoolerError:
                continue
            if epoch == self.core.epoch and self.core.release(lease_id, nonce, now):
                n += 1
        if n:
            self.engine._wake_receivers()
            # (a client that resets its connections in a loop would write one line each)
            logs.throttled(log, logging.INFO, ("gave back",), "gave back %d leased message(s) whose delivery "
                           "could not be sent", n)
        return n

    def _live_lease(self, p: Principal, token: str, now: Optional[int] = None, serving: Optional[bool] = None):
        """``now``, ``serving``: computed once by a caller that checks a whole batch."""
        epoch, lease_id, nonce, queue = self.decode_token(token)
        self.authorize(p, "receive", queue)
        if not (self.engine.serving() if serving is None else serving):
            raise errors.Unavailable("node is not serving", retry_after_s=1.0)
        if now is None:
            now = self.engine.now_us()
        try:
            lease = self.core.check_lease(epoch, lease_id, nonce, now)
        except StaleLeaseError as e:
            if e.lease is not None and e.lease.commit is not None:
                # fenced by another request's ack or nack, whose commit is not applied yet
                raise _SettlingElsewhere(e.lease.commit) from None
            if queue not in self.core.queues:
                # the queue was deleted (its leases ended with it): say so, as SQS does,
                # not stale_lease; a queue created again under the name is another one,
                # and the old lease is stale there
                raise errors.QueueNotFound(f"queue {queue} does not exist") from None
            raise errors.StaleLease(f"lease is no longer valid: {e.reason}", reason=e.reason) from None
        except BadToken as e:
            raise errors.InvalidArgument(str(e)) from None
        if lease.queue != queue:  # the scope was checked against the token's queue: it must be the lease's
            raise errors.InvalidArgument("lease token does not match")
        return lease

    def _settle_shape(self, token: str, action: str, delay_s: float, decode: bool = True) -> int:
        """-> the delay in us. ``decode``: also check the token's form. Only a nack
        has a delay: an ack's or a renew's is ignored, as the unary Ack and Renew
        (and HTTP's ack and renew, whatever Spooler-Delay-Seconds says) ignore it."""
        if action not in ("ack", "nack", "renew"):
            raise errors.InvalidArgument(f"unknown action {action!r}")
        if decode:
            self.decode_token(token)
        if action != "nack" or not delay_s:
            return 0
        return round(self._seconds(delay_s, "delay", 0.0, self.limits.delay_s_max) * US)

    async def ack(self, p: Principal, token: str) -> None:
        await self.settle(p, [(token, "ack", 0.0)])

    async def nack(self, p: Principal, token: str, delay_s: float = 0.0) -> None:
        await self.settle(p, [(token, "nack", delay_s)])

    async def renew(self, p: Principal, token: str) -> str:
        if self.forwards():
            self.decode_token(token)
            return (await self.fwd.settle(self._remote(p), p.auth, [(token, "renew", 0.0)], False))[0]
        try:
            lease = self._live_lease(p, token)
        except _SettlingElsewhere as s:
            raise await s.outcome() from None
        return self._renewed(lease, self.engine.now_us())

    def _renewed(self, lease, now: int) -> LeaseEnd:
        """Renew ``lease`` -> its new end, and how long it lasts from ``now`` (so that
        clients time their renewals on their own clocks: LeaseEnd).

        A renewal grants lease time as a receive does, and like a lease it is
        kept in memory only (no log record, no quorum): so it passes the gate a
        receive passes (``Engine.may_lease``: a majority heard this primary within
        half a failover timeout, and no older primary can still lease). A primary
        cut off from its replicas stops renewing when it stops leasing, half a
        failover timeout before it stops serving, with the margin a successor's
        wait for the old leases counts on; it answers ``unavailable``, and the
        lease is still the consumer's if the primary is heard again."""
        if not self.engine.may_lease():
            raise errors.Unavailable("this primary may not extend leases now (a majority has not answered it "
                                     "lately, or an older primary's leases may still run)",
                                     retry_after_s=self.engine.repl.lease_wait_s())
        end = self.core.renew(lease, now)
        return LeaseEnd(rfc3339(end), (end - now) / US)

    async def settle(self, p: Principal, items: list, per_item_errors: bool = False) -> list:
        """items: [(token, "ack"|"nack"|"renew", delay_s)]. Acks and nacks share one
        log record. Returns per item None, an expiresAt (renew: a LeaseEnd) or, with
        ``per_item_errors``, the SpoolerError of that item."""
        if not items:
            raise errors.InvalidArgument("nothing to settle")
        if len(items) > self.limits.batch_entries_max:
            raise errors.InvalidArgument(f"at most {self.limits.batch_entries_max} items in a batch")
        if self.forwards():
            if not per_item_errors:  # a batch's malformed items are answered one by one, by the primary
                for token, action, delay_s in items:
                    self._settle_shape(token, action, delay_s)
            return await self.fwd.settle(self._remote(p), p.auth, items, per_item_errors)
        out: list = [None] * len(items)
        rec = log_pb2.Record()
        add = rec.settle.entries.add
        fenced = []  # (item index, lease), in the record's entry order
        elsewhere = []  # (item index, _SettlingElsewhere): leases another request is settling
        first_error = None
        serving, now = self.engine.serving(), self.engine.now_us()
        for i, (token, action, delay_s) in enumerate(items):
            try:
                delay_us = self._settle_shape(token, action, delay_s, decode=False)
                lease = self._live_lease(p, token, now, serving)
                if action == "renew":
                    out[i] = self._renewed(lease, now)
                    continue
                self.core.begin_settle(lease)  # fenced: no expiry, no second settle
                fenced.append((i, lease))
                # built in place, field by field, a zero delay unset: less than half of
                # add()'s keywords' cost (about 75 against 180 us for 100 acks)
                e = add()
                e.queue = lease.queue
                e.id = lease.msg_id
                if action == "ack":
                    e.kind = log_pb2.ACK
                else:
                    e.kind = log_pb2.NACK
                    if delay_us:
                        e.delay_us = delay_us
            except _SettlingElsewhere as s:
                elsewhere.append((i, s))
            except errors.SpoolerError as e:
                out[i] = e
                if not per_item_errors:
                    first_error = e
                    break  # what was fenced so far is still committed below
        if fenced:
            try:
                fut = self.engine.propose(rec)
            except errors.SpoolerError:
                # known not accepted (503): the leases are the consumer's again
                for _, lease in fenced:
                    self.core.end_settle(lease)
                raise
            # Another request's settle of these leases waits for this commit: each
            # lease stays fenced, keeping it, until the record applies (the lease
            # then ends) or the epoch ends (it is then stale). A duplicate token
            # inside this batch was answered at once (it is committed with the batch).
            for _, lease in fenced:
                lease.commit = fut
            # Shielded: this caller going away (its deadline, its stream's end: just
            # when an SDK tries the ack again) must not cancel what the next attempt
            # waits on. (nobody_waits: a failure seen by no one is not logged as
            # never retrieved; a cancelled shield stops reading it.)
            changed = await asyncio.shield(nobody_waits(fut))
            for (i, lease), ok in zip(fenced, changed):
                if not ok:  # the message was moved or deleted meanwhile (redrive, queue delete)
                    out[i] = (errors.QueueNotFound(f"queue {lease.queue} does not exist")
                              if lease.queue not in self.core.queues else  # as _live_lease says
                              errors.StaleLease("lease is no longer valid: settled", reason="settled"))
        for i, s in elsewhere:
            out[i] = await s.outcome()
        if not per_item_errors:
            if first_error is not None:
                raise first_error
            for r in out:
                if isinstance(r, errors.SpoolerError):
                    raise r
        return out

    # ---------------------------------------------------------------- keys
    async def create_key(self, p: Principal, queue: str, scopes: list) -> dict:
        """``queue``: a queue name, or "*" ("" too: gRPC's unset field) for every queue."""
        # the request's shape first, on whichever node it reaches: a replica answers
        # a malformed request as the primary would, and forwards only what is well formed
        if not isinstance(queue, str):
            raise errors.InvalidArgument('queue must be a queue name or "*"')
        queue = queue or "*"
        if queue != "*":
            self.check_name(queue)
        if (not isinstance(scopes, list) or not scopes
                or any(not isinstance(s, str) or s not in SCOPES for s in scopes)):
            raise errors.InvalidArgument(f"scopes: a non-empty list of {', '.join(SCOPES)}")
        if (a := self._remote(p)):
            return await self.fwd.create_key(a, p.auth, queue, scopes)
        self._global_admin(p)
        if len(self.core.keys) + self._keys_creating >= self.limits.keys_max:
            raise errors.InvalidArgument(f"at most {self.limits.keys_max} keys")
        kid = os.urandom(6).hex()
        secret = base64.urlsafe_b64encode(os.urandom(24)).rstrip(b"=").decode()
        sha = hashlib.sha256(secret.encode()).digest()  # only the hash is stored
        scopes = sorted(set(scopes))
        await self._propose_counted(log_pb2.Record(key_put=log_pb2.KeyPut(id=kid, secret_sha256=sha, queue=queue,
                                                                            scopes=scopes)), self._count_key)
        return {"id": kid, "key": f"spk_{kid}_{secret}", "queue": queue, "scopes": scopes}

    async def list_keys(self, p: Principal) -> list:
        if (a := self._remote(p)):
            return await self.fwd.list_keys(a, p.auth)
        self._global_admin(p)
        return [{"id": k, "queue": v[1], "scopes": list(v[2])} for k, v in sorted(self.core.keys.items())]

    async def delete_key(self, p: Principal, kid: str) -> None:
        if (a := self._remote(p)):
            return await self.fwd.delete_key(a, p.auth, kid)
        self._global_admin(p)
        if not isinstance(kid, str) or not KEY_ID_RE.match(kid) or kid not in self.core.keys:
            raise errors.NotFound(f"no key {kid}")
        await self.engine.propose(log_pb2.Record(key_delete=log_pb2.KeyDelete(id=kid)))

    # ------------------------------------------------------------- cluster
    async def cluster(self, p: Principal) -> dict:
        """This node's view (a key this replica does not know was checked with the
        primary first: ``verified``)."""
        return self.cluster_doc()

    def cluster_doc(self) -> dict:
        e = self.engine
        if not e.loaded:  # (its epoch, role and positions are the blank defaults until then)
            raise errors.Unavailable("the node is loading its store", retry_after_s=0.5)
        st = e.repl.status()
        nodes = st["nodes"]
        if not e.cluster:
            nodes[0]["address"] = getattr(e, "grpc_address", "")
        return {"nodeId": e.node_id, "role": st["role"], "epoch": st["epoch"], "primary": st["primary"],
                "commitLsn": st["commitLsn"], "appliedLsn": e.core.lsn, "clusterId": e.core.cluster_id or None,
                "nodes": nodes}

    async def promote(self, p: Principal, node: str) -> dict:
        e = self.engine
        if not isinstance(node, str) or not node:  # checked before forwarding, as in create_key
            raise errors.InvalidArgument("promote needs the id of the node to take over (\"node\")")
        if node not in e.repl.addresses:  # every member has the same --peers
            raise errors.InvalidArgument(f"unknown node {node}")
        if (a := self._remote(p)):
            return await self.fwd.promote(a, p.auth, node, e.repl.addresses[node], e.repl.core.timeout / 1e6)
        self._global_admin(p)
        if node == e.node_id and e.role == "primary":
            return self.cluster_doc()  # already the primary
        if e.role != "primary":
            raise errors.Unavailable("promote must be sent to the primary", retry_after_s=0.5)
        refused = e.repl.core.transfer_refused(node)
        if refused == "joining":
            # it would ignore TimeoutNow, and this primary would step down for nothing
            raise errors.Unavailable(f"{node} is still joining (--join): it cannot take over until it holds the "
                                     "cluster's history; GET /v1/cluster shows when it has joined",
                                     retry_after_s=max(1.0, e.repl.core.timeout / 1e6))
        if refused == "under_way":
            raise errors.Unavailable(f"a switchover to {e.repl.core.transfer_to} is under way; GET /v1/cluster "
                                     "tells when it is over", retry_after_s=max(1.0, e.repl.core.timeout / 1e6))
        # answer with the cluster as it is after the switchover: this node has
        # stepped down AND heard from the new primary (its first heartbeat), so
        # the answer names it instead of "primary": null
        # (bounded: 5 s or two failover timeouts)
        await e.repl.switch_over(node, max(5.0, 2 * e.repl.core.timeout / 1e6))
        c = e.repl.core  # what the answer is built from (self.cluster_doc): the same fields
        if c.primary == node:
            return self.cluster_doc()
        if c.role == R.PRIMARY and e.repl.declined == node:
            raise errors.Unavailable(f"the switchover to {node} did not happen: it refused to take over "
                                     f"({e.repl.declined_why}); {e.node_id} is primary", retry_after_s=1.0)
        if c.role == R.PRIMARY or c.primary:
            # known not to have happened (a 200 here would read as success)
            now = f"{c.primary} is" if c.primary else "no node is"
            raise errors.Unavailable(f"the switchover to {node} did not happen ({node} did not take over "
                                     f"in time; {now} primary): try again", retry_after_s=1.0)
        raise errors.OperationUnconfirmed(f"the switchover to {node} was started but no new primary is known yet; "
                                          "GET /v1/cluster tells when one is")


class _SettlingElsewhere(Exception):
    """A lease that another request's ack or nack has fenced and is committing.

    Answering ``settled`` at once would say more than is known: that commit may
    still fail (a storage error, a primary that loses its majority), and then the
    message is not acked. An SDK that tries an ack again after an attempt whose
    answer was lost reads ``settled`` as "our earlier ack landed", so the answer
    waits for that commit: ``settled`` once it is in, ``operation_unconfirmed``
    if it failed."""

    def __init__(self, fut):
        super().__init__()
        self.fut = fut

    async def outcome(self) -> errors.SpoolerError:
        await asyncio.wait({self.fut})  # (not cancelled with this caller: it is another request's)
        if not self.fut.cancelled() and self.fut.exception() is None:
            return errors.StaleLease("lease is no longer valid: settled", reason="settled")
        return errors.OperationUnconfirmed("another request's ack or nack of this lease was being "
                                           "committed, and its outcome is unknown")
