"""A node that is not the primary forwards client calls to the primary.

Over the primary's gRPC client service, with the caller's own Authorization
(the primary checks it again), so HTTP and gRPC callers can use any node. A
forwarded call carries ``spooler-forwarded``; a node never forwards it again
(two replicas with stale views must not bounce a call between them).
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from typing import Optional

import grpc

from node import logs
from spooler import errors
from spooler._common import (GRPC_OPTIONS, SETTLE_ACTIONS, cluster_dict, map_rpc_error, queue_dict, read_lost,
                             send_outcomes, settings_pb, settle_outcomes, settle_request)
from spooler.pb import api_pb2, api_pb2_grpc

FORWARDED = "spooler-forwarded"
log = logging.getLogger("spooler.forward")
# errors with which the primary answered a receive: it leased nothing
_DEFINITE = (errors.InvalidArgument, errors.Unauthenticated, errors.Forbidden, errors.QueueNotFound)
# answers after which retrying a release is pointless (an older primary has no ReleaseReceive)
_FINAL = _DEFINITE + (errors.MethodNotAllowed, errors.NotFound)
NAMES_MAX = 65_536  # tokens of forwarded answers remembered with the name of their receive


def _leased_nothing(e: BaseException) -> bool:
    """A forwarded receive that failed so leased nothing for us: the primary refused it
    (its own answer, with its kind: an unavailable there is "not now", said before
    leasing), or it never reached the primary. Anything else may have leased."""
    if isinstance(e, _DEFINITE):
        return True
    return isinstance(e, errors.Unavailable) and not getattr(e, "answer_lost", False)


def _put(d: OrderedDict, k, v, cap: int) -> None:
    d[k] = v
    while len(d) > cap:
        d.popitem(last=False)


def _action_number(action) -> int:
    """The wire number of a settle action. An unknown number from a gRPC caller
    (named ``number N`` by grpc_api) goes on as it came, so the primary refuses
    it in the same words as when it is asked directly."""
    n = SETTLE_ACTIONS.get(action)
    if n is None and isinstance(action, str) and action.startswith("number "):
        try:
            n = int(action[7:])
        except ValueError:
            n = 0
    return n or 0


CHANGE_POLL_S = 0.05  # how often a forwarded call looks for a new primary without primary_changes


class Forwarder:
    def __init__(self, timeout_s: float = 10.0, tls=None, current_primary=None, releases_max: int = 1024,
                 node_id: str = "1", pending: Optional[dict] = None, primary_changes=None, peer_md: tuple = ()):
        """current_primary: callable -> the address this node now takes for the primary's
        (a forwarded call to a primary that was replaced meanwhile is cut short).
        primary_changes: callable -> a future resolved at the next change of the
        primary this node knows (Engine.role_changes); without it a waiting call
        looks every CHANGE_POLL_S."""
        self.timeout_s = timeout_s
        self.tls = tls
        self.peer_md = peer_md  # the cluster's key (node/tls.py), on every forwarded call
        self.current_primary = current_primary or (lambda: None)
        self.primary_changes = primary_changes
        self._stubs: dict = {}
        self._releases: set = set()  # running release_soon tasks (held: asyncio keeps weak refs)
        self.releases_max = releases_max
        self.node_id = node_id  # sent with every forwarded call (the primary notes where leases went)
        # releases being retried: (primary address, queue, name) -> [auth, last sent on an ack]
        self.pending = {} if pending is None else pending
        self._token_names: OrderedDict = OrderedDict()   # lease token -> (queue, our name)
        self._polls: set = set()  # forwarded receives waiting for the primary's answer
        self.stopping = False
        self.handover_grace_s = 2.0  # see call(): a forwarded promote's answer after the handover

    def stub(self, address: str):
        s = self._stubs.get(address)
        if s is None:
            from node.tls import aio_channel
            ch = aio_channel(address, GRPC_OPTIONS, self.tls)
            s = self._stubs[address] = api_pb2_grpc.SpoolerStub(ch)
        return s

    async def call(self, address: str, method: str, req, auth: str, write: bool, extra_s: float = 0.0,
                   timeout_s: float | None = None, handing_to: str | None = None):
        """Forward one call to the primary at ``address``. It is cut short once this
        node takes another node for the primary, but not while that node is
        ``handing_to`` or unknown: a promote's own success changes the primary
        (and leaves none known for a moment), and its answer is on the way. That
        answer is waited for ``handover_grace_s`` at most from the change (a
        paused old primary never sends it)."""
        md = ((FORWARDED, self.node_id),) + self.peer_md + ((("authorization", auth),) if auth else ())
        call = getattr(self.stub(address), method)(
            req, metadata=md, timeout=(self.timeout_s if timeout_s is None else timeout_s) + extra_s)
        task = asyncio.ensure_future(call)
        loop = asyncio.get_running_loop()
        changed_at = None  # when this node first took another node (or none) for the primary
        try:
            while True:
                # woken by the answer or by a change of the primary, nothing else (a
                # long poll forwarded for 20 s costs no turns of the loop meanwhile)
                timeout = None if self.primary_changes else CHANGE_POLL_S
                now = self.current_primary()
                if now != address:
                    if changed_at is None:
                        changed_at = loop.time()
                    grace = self.handover_grace_s - (loop.time() - changed_at)
                    if not (handing_to and now in (handing_to, None) and grace > 0):
                        # a new primary was elected while we waited on the old one (paused
                        # or cut off): stop waiting; the caller retries against the new one
                        task.cancel()
                        if write:
                            raise errors.OperationUnconfirmed("the primary changed while the call was forwarded")
                        # the call may have been answered meanwhile (a receive's leases)
                        lost = read_lost("the primary changed while the call was forwarded")
                        lost.retry_after_s = 0.1
                        raise lost
                    # the promote's own handover: its answer is on the way
                    timeout = grace if timeout is None else min(timeout, grace)
                waits = {task, self.primary_changes()} if self.primary_changes else {task}
                done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if task in done:
                    return task.result()
        except grpc.RpcError as e:
            raise map_rpc_error(e, write=write) from None
        finally:
            if not task.done():
                task.cancel()

    # the shapes Service returns -------------------------------------------------
    async def put_queue(self, a, auth, name, settings):
        from node.api.grpc_api import SETTINGS_TO_PB
        r = await self.call(a, "PutQueue", api_pb2.PutQueueRequest(
            name=name, settings=settings_pb({SETTINGS_TO_PB.get(k, k): v for k, v in settings.items()})), auth, True)
        return r.created, queue_dict(r.queue)

    async def get_queue(self, a, auth, name):
        return queue_dict(await self.call(a, "GetQueue", api_pb2.QueueRequest(name=name), auth, False))

    async def list_queues(self, a, auth):
        r = await self.call(a, "ListQueues", api_pb2.ListQueuesRequest(), auth, False)
        return [queue_dict(q) for q in r.queues]

    async def check_key(self, a, auth) -> None:
        """Has the primary check ``auth`` (a key this node does not know): raises
        its error (unauthenticated) or returns. Asks for the cluster document,
        which any key may read and which is small whatever the node holds."""
        await self.call(a, "GetCluster", api_pb2.Empty(), auth, False)

    async def delete_queue(self, a, auth, name):
        await self.call(a, "DeleteQueue", api_pb2.QueueRequest(name=name), auth, True)

    async def redrive(self, a, auth, name):
        return (await self.call(a, "Redrive", api_pb2.QueueRequest(name=name), auth, True)).moved

    async def purge(self, a, auth, name):
        return (await self.call(a, "Purge", api_pb2.QueueRequest(name=name), auth, True)).purged

    async def send(self, a, auth, entries, run=None):
        if run:  # forwarded one entry per message: any node version reads that
            entries = list(entries) + [(run[0], b, run[2], "") for b in run[1]]
        req = api_pb2.SendBatchRequest(entries=[api_pb2.SendRequest(queue=q, body=b, delay_seconds=d or 0.0,
                                                                     dedup_key=k or "") for q, b, d, k in entries])
        r = await self.call(a, "SendBatch", req, auth, True)
        return [("", False, x) if isinstance(x, errors.SpoolerError) else (x.id, x.duplicate, None)
                for x in send_outcomes(r)]

    async def receive(self, a, auth, queue, wait_s, max_n, receive_id="", release_for_s=30.0):
        """Named with a name of this node's own (never the caller's: a caller that
        resends the same request elsewhere must not have its new leases released
        by ours), so that when the answer does not come back, whatever the primary
        leased for it is given back (release_soon) instead of expiring into a
        retry. The caller's own name goes along: the primary names the call by
        both, so the caller can release it at any node."""
        from node.api.service import Delivery
        rid = os.urandom(12).hex()
        poll = asyncio.ensure_future(self.call(a, "ReceiveBatch", api_pb2.ReceiveRequest(
            queue=queue, wait_seconds=wait_s, max_messages=max_n, receive_id=rid,
            caller_receive_id=receive_id), auth, False, extra_s=wait_s))
        self._polls.add(poll)
        try:
            r = await poll
        except BaseException as e:  # CancelledError too: our own caller went away, or we stop
            if not _leased_nothing(e):
                self.release_soon(a, auth, queue, rid, release_for_s)
            if (isinstance(e, asyncio.CancelledError) and self.stopping
                    and not asyncio.current_task().cancelling()):  # shut_down took the poll, not our caller
                raise errors.Unavailable("the node is shutting down", retry_after_s=0.5) from None
            raise
        finally:
            self._polls.discard(poll)
        for d in r.messages:
            _put(self._token_names, d.lease_token, (queue, rid), NAMES_MAX)
        return [Delivery(d.id, d.body, d.lease_token, d.retry_count, d.lease_expires_at, d.queue, d.lease_seconds_left)
                for d in r.messages]

    def names_of(self, tokens) -> set:
        """The (queue, name) of the forwarded receives that handed out ``tokens``."""
        return {n for t in tokens if (n := self._token_names.get(t)) is not None}

    async def release_receive(self, a, auth, queue, receive_id):
        try:
            r = await self.call(a, "ReleaseReceive", api_pb2.ReleaseReceiveRequest(
                queue=queue, receive_id=receive_id), auth, False)
        except errors.MethodNotAllowed:  # an older primary: not this caller's failure for good
            raise errors.Unavailable("the primary cannot release receives yet", retry_after_s=1.0) from None
        return r.released

    def shut_down(self) -> None:
        """A graceful stop: forwarded long polls end now (their callers get
        ``unavailable``; what the primary leased for them is given back)."""
        self.stopping = True
        for poll in list(self._polls):
            poll.cancel()

    async def drain(self, timeout_s: float) -> None:
        """Let the releases in progress finish (bounded), before the process exits."""
        if self._releases:
            await asyncio.wait(list(self._releases), timeout=timeout_s)

    def release_soon(self, a, auth, queue, receive_id, for_s: float) -> None:
        """In the background, tell primary ``a`` to give back a receive's leases, retrying
        until it answers, another primary takes over (its leases are then stale and the
        messages visible again anyway) or ``for_s`` has passed (by then the leases
        have expired, or the primary has forgotten the name). While this node knows
        no primary (it is cut off, or an election runs) the release waits: the
        primary is often still ``a`` once this node hears from it again."""
        if len(self._releases) >= self.releases_max:
            logs.throttled(log, logging.WARNING, ("releases pending",), "%d lost-answer releases already "
                           "pending: this one is dropped (its leases will expire)", len(self._releases))
            return
        t = asyncio.ensure_future(self._release(a, auth, queue, receive_id, for_s))
        self._releases.add(t)
        t.add_done_callback(self._releases.discard)

    async def _release(self, a, auth, queue, receive_id, for_s) -> None:
        key = (a, queue, receive_id)
        self.pending[key] = [auth, float("-inf")]  # [caller's key, when last sent on an ack]
        try:
            await self._release_by_call(a, auth, queue, receive_id, for_s)
        finally:
            self.pending.pop(key, None)

    async def _release_by_call(self, a, auth, queue, receive_id, for_s) -> None:
        loop = asyncio.get_running_loop()
        end, pause = loop.time() + for_s, 0.02
        while True:
            primary = self.current_primary()
            if primary is not None and primary != a:
                return  # another primary took over: the leases are stale, their messages visible again
            if primary == a:
                try:
                    n = await self.call(a, "ReleaseReceive", api_pb2.ReleaseReceiveRequest(
                        queue=queue, receive_id=receive_id), auth, False,
                        timeout_s=max(0.05, min(2.0, end - loop.time())))
                    if n.released:
                        log.info("primary gave back %d lease(s) of a receive whose answer was lost", n.released)
                    return
                except errors.SpoolerError as e:
                    if isinstance(e, _FINAL):
                        log.warning("release of a lost receive answer refused: %s", e)
                        return
            if loop.time() + pause >= end:
                log.warning("could not give back a lost receive answer's leases in time")
                return
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.5)

    async def settle(self, a, auth, items, per_item_errors):
        req = settle_request([(t if isinstance(t, str) else "", act, d) for t, act, d in items], _action_number)
        r = await self.call(a, "SettleBatch", req, auth, True)
        # (the primary's lease lengths passed on as they are: the caller measures from
        # its call's start, before the primary's answer and this hop's)
        out = settle_outcomes(r, len(req.items))
        if not per_item_errors:
            for x in out:
                if isinstance(x, errors.SpoolerError):
                    raise x
        return out

    async def create_key(self, a, auth, queue, scopes):
        r = await self.call(a, "CreateKey", api_pb2.CreateKeyRequest(queue=queue,
                                                                     scopes=scopes), auth, True)
        return {"id": r.id, "key": r.key, "queue": r.queue, "scopes": list(r.scopes)}

    async def list_keys(self, a, auth):
        r = await self.call(a, "ListKeys", api_pb2.Empty(), auth, False)
        return [{"id": k.id, "queue": k.queue, "scopes": list(k.scopes)} for k in r.keys]

    async def delete_key(self, a, auth, kid):
        await self.call(a, "DeleteKey", api_pb2.DeleteKeyRequest(id=kid), auth, True)

    async def promote(self, a, auth, node, node_address, failover_timeout_s: float = 2.0):
        # the primary may take a failover timeout to hand over, then up to two more
        # (or 5 s) to hear from the new primary: wait for that answer, not less
        r = await self.call(a, "Promote", api_pb2.PromoteRequest(node=node), auth, True,
                            extra_s=5 + 3 * failover_timeout_s, handing_to=node_address)
        return cluster_dict(r)
