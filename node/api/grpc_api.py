"""gRPC client service (grpc.aio): mirrors every HTTP call, plus batches.

Like ``http.py`` it only translates: decisions are in ``service.Service`` and
errors become (status code, trailers) through the one table in
``spooler.errors``.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from google.protobuf import descriptor_pb2, descriptor_pool

from spooler import errors
from spooler.pb import api_pb2, api_pb2_grpc
from node.api.forward import FORWARDED
from node.api.metrics import CANCELLED, FORWARDED_API
from node.tls import from_a_member
from node.api.service import SCOPES, SETTINGS, Service
from node.engine import Reply
from node.waits import Changes
from node.waits import wait_event

log = logging.getLogger("spooler.grpc")

_SETTINGS_PB = {"leaseTimeoutSeconds": "lease_timeout_seconds", "maxRetries": "max_retries",
                "retentionSeconds": "retention_seconds", "dedupWindowSeconds": "dedup_window_seconds",
                "failureQueue": "failure_queue"}
_PB_SETTINGS = {v: k for k, v in _SETTINGS_PB.items()}
SETTINGS_TO_PB = _SETTINGS_PB
if set(_SETTINGS_PB) != set(SETTINGS):
    raise ImportError(f"the gRPC settings map {sorted(_SETTINGS_PB)} does not cover the queue settings {sorted(SETTINGS)}")

_ACTIONS = {api_pb2.SETTLE_ACK: "ack", api_pb2.SETTLE_NACK: "nack", api_pb2.SETTLE_RENEW: "renew"}


def _queue_pb(doc: dict) -> api_pb2.Queue:
    s, st = doc["settings"], doc["stats"]
    return api_pb2.Queue(
        name=doc["name"],
        settings=api_pb2.Settings(**{_SETTINGS_PB[k]: v for k, v in s.items()}),
        stats=api_pb2.QueueStats(visible=st["visible"], leased=st["leased"], delayed=st["delayed"],
                                 sent_total=st["sentTotal"], acked_total=st["ackedTotal"],
                                 failed_total=st["failedTotal"], expired_total=st["expiredTotal"],
                                 nacked_total=st["nackedTotal"], lease_expired_total=st["leaseExpiredTotal"],
                                 purged_total=st["purgedTotal"]))


def cluster_pb(d: dict) -> api_pb2.ClusterInfo:
    """GET /v1/cluster's document as a ClusterInfo (spooler._common.cluster_dict
    is the way back)."""
    nodes = []
    for n in d["nodes"]:
        pb = api_pb2.NodeInfo(id=n["id"], role=n["role"], address=n.get("address", ""), joining=n.get("joining", False),
                              lsn=n.get("lsn"), match_lsn=n.get("matchLsn"))  # (None: not set)
        if "lastContactMs" in n:
            pb.last_contact_ms = -1.0 if n["lastContactMs"] is None else n["lastContactMs"]
        if "reachable" in n:
            pb.reachable = n["reachable"]
        if "diskLow" in n:
            pb.disk_low = n["diskLow"]
        if "eager" in n:
            pb.eager = n["eager"]
        nodes.append(pb)
    return api_pb2.ClusterInfo(node_id=d["nodeId"], role=d["role"], epoch=d["epoch"], primary=d["primary"] or "",
                               commit_lsn=d.get("commitLsn"), applied_lsn=d.get("appliedLsn"),
                               cluster_id=d.get("clusterId") or "", nodes=nodes)


def _delivery_pb(d) -> api_pb2.Delivery:
    return api_pb2.Delivery(id=d.id, body=d.body, lease_token=d.token, retry_count=d.retry_count,
                            lease_expires_at=d.expires_at, queue=d.queue, lease_seconds_left=d.left_s)


# a key's scopes are a few names (repeats allowed): a request naming more is refused
# before millions of them become a list
SCOPES_IN_A_REQUEST_MAX = 64


def _at_most(svc: Service, n: int, what: str) -> None:
    """A batch's size, checked before its items are read out of the request (Service
    checks it again): a 16 MiB request of millions of empty items is refused at once
    instead of after seconds of building them into lists, with the node's loop held."""
    if n > svc.limits.batch_entries_max:
        raise errors.InvalidArgument(f"at most {svc.limits.batch_entries_max} {what} in a batch")


def _send_args(svc: Service, req) -> tuple:
    """A SendBatchRequest -> Service.send's (entries, run)."""
    _at_most(svc, len(req.entries) + len(req.bodies), "messages")
    return ([(e.queue, e.body, e.delay_seconds, e.dedup_key) for e in req.entries],
            (req.queue, req.bodies, req.delay_seconds) if req.bodies else None)


def _entry_errors_counter(svc: Service, p):
    """What counts a batch's failed entries in spooler_errors_total (Metrics.error),
    or None for a call another member forwarded (that member counts them)."""
    m = svc.engine.metrics
    return None if m is None or p.forwarded else m.error


def _fill_send(out: api_pb2.SendBatchResponse, n_run: int, res: list, count=None) -> api_pb2.SendBatchResponse:
    """Service.send's results into a SendBatchResponse: a run that stored every
    message answers as ``run_ids`` (a run is stored whole or not at all: one
    queue), the entries one result each."""
    per_entry = res
    if n_run:
        run = res[len(res) - n_run:]
        if run[0][2] is None:
            per_entry = res[:len(res) - n_run]
            out.run_ids.extend([mid for mid, _, _ in run])
    _fill_entries(out, per_entry, count)
    return out


def _fill_applied(out: api_pb2.SendBatchResponse, compact: bool, applied: tuple, count=None) -> None:
    """As _fill_send, straight from the core's apply result (entries, run) (the
    Session's Reply gets that): a stored run's ids are never made into Service.send's
    triples, and with ``compact`` (the request's compact_run_ids) not made at all:
    the answer names the run's prefix, first counter and count."""
    entries, run = applied
    if run is not None and run.error is None:
        if compact:
            out.run_id_prefix, out.run_id_first, out.run_count = run.prefix, run.first, run.n
        else:
            out.run_ids.extend(run.ids())
        run = None
    if entries or run is not None:  # (a run that stored nothing: one error per body)
        _fill_entries(out, Service.send_results((entries, run)), count)


def _fill_entries(out: api_pb2.SendBatchResponse, triples: list, count=None) -> None:
    """``count``: called with each entry's error (_entry_errors_counter), if given."""
    add = out.results.add
    for mid, dup, err in triples:
        r = add(id=mid, duplicate=dup)
        if err is not None:
            r.error.CopyFrom(errors.to_detail(err))
            if count is not None:
                count(err)


async def _send_batch(svc: Service, p, req, out=None) -> api_pb2.SendBatchResponse:
    """``out``: the message to fill (a Session answer's field: no copy), else a new one."""
    res = await svc.send(p, *_send_args(svc, req))
    return _fill_send(api_pb2.SendBatchResponse() if out is None else out, len(req.bodies), res,
                      _entry_errors_counter(svc, p))


async def _receive_batch(svc: Service, p, req, out=None) -> api_pb2.ReceiveResponse:
    got = await svc.receive(p, req.queue, req.wait_seconds, req.max_messages or 1, req.receive_id,
                            req.caller_receive_id)
    out = api_pb2.ReceiveResponse() if out is None else out
    add = out.messages.add
    for d in got:
        # built in place (no message built and then copied in), field by field and a
        # zero retry count left unset: about two thirds of add()'s keywords' cost
        m = add()
        m.id = d.id
        m.body = d.body
        m.lease_token = d.token
        m.lease_expires_at = d.expires_at
        m.queue = d.queue
        if d.left_s:
            m.lease_seconds_left = d.left_s
        if d.retry_count:
            m.retry_count = d.retry_count
    return out


async def _settle_batch(svc: Service, p, req, out=None) -> api_pb2.SettleBatchResponse:
    _at_most(svc, len(req.items), "items")
    items = [(it.token, _ACTIONS.get(it.action) or f"number {it.action}", it.delay_seconds) for it in req.items]
    res = await svc.settle(p, items, per_item_errors=True)
    out = api_pb2.SettleBatchResponse() if out is None else out
    add = out.results.add
    count = _entry_errors_counter(svc, p)
    for r in res:
        if isinstance(r, errors.SpoolerError):
            add(error=errors.to_detail(r))
            if count is not None:
                count(r)
        else:
            # (a forwarded renew of a faulty primary may answer no expiry: passed on as such)
            add(expires_at=r, lease_seconds_left=getattr(r, "left_s", 0.0)) if r else add()
    return out


_SESSION_CALLS = {"send_batch": _send_batch, "receive": _receive_batch, "settle_batch": _settle_batch}
# each as spooler_calls names it (metrics.Calls)
_SESSION_CALL_NAMES = {which: f"Session/{which}" for which in _SESSION_CALLS}


def _caller(context, cluster_key: str = "") -> tuple:
    """-> (Authorization, forwarded): forwarded is "" for a call from a client, else
    the forwarding node's id ("1" from a node that does not say). With a cluster
    key (--cluster-key), a call is taken for forwarded only if it carries the key:
    any other is a client's, whatever it claims. Authorization given twice is
    ambiguous: invalid_argument, as over HTTP."""
    auth, forwarded = None, ""
    md = context.invocation_metadata() or ()
    for k, v in md:
        if k == "authorization":
            if auth is not None:
                raise errors.InvalidArgument("authorization given more than once; give it once")
            auth = v
        elif k == FORWARDED:
            forwarded = v or "1"
    if forwarded and not from_a_member(md, cluster_key):
        forwarded = ""
    return auth, forwarded


class Malformed:
    """A request body that does not decode: what the service's deserializers give
    instead of raising, so the answer is the error table's ``invalid_argument``
    (status and kind trailer) rather than grpc's bare UNKNOWN."""
    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why

    def error(self) -> errors.InvalidArgument:
        return errors.InvalidArgument(f"request does not decode as protobuf: {self.why}"[:300])


def _lenient(parse):
    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError, and whatever upb raises
            return Malformed(str(e) or type(e).__name__)
    return deserialize


_HANDLER = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


# Unary on the wire, served as server-streaming: the handler writes its one answer
# itself (SpoolerServicer._answer_or_give_back), so that it knows whether the write
# failed. A unary handler's answer is sent after it returns, and a failed send
# ends the call without it being cancelled: nothing could tell that the leases
# of a receive nobody got should go back. One message then the status is the
# same on the wire either way.
ANSWER_WRITTEN_BY_HANDLER = ("Receive", "ReceiveBatch")


def add_spooler_service(servicer, server) -> None:
    """The generated ``add_SpoolerServicer_to_server``, with lenient request
    deserializers (see Malformed); built from the service's descriptor."""
    desc = api_pb2.DESCRIPTOR.services_by_name["Spooler"]
    handlers = {m.name: _HANDLER[(m.client_streaming, m.server_streaming or m.name in ANSWER_WRITTEN_BY_HANDLER)](
        getattr(servicer, m.name), request_deserializer=_lenient(getattr(api_pb2, m.input_type.name).FromString),
        response_serializer=getattr(api_pb2, m.output_type.name).SerializeToString) for m in desc.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(desc.full_name, handlers),))


def _epoch_md(svc: Service) -> tuple:
    return ("spooler-epoch", str(svc.engine.known_epoch))


async def _abort(svc: Service, context, e: errors.SpoolerError) -> None:
    """End the call with ``e``: its status, its kind and details, and the epoch."""
    await context.abort(errors.grpc_status_code(e), e.message,
                        trailing_metadata=errors.grpc_trailers(e) + (_epoch_md(svc),))


def rpc(method):
    """Authenticate, call, map SpoolerError to a status with the kind in trailers."""

    name = method.__name__  # the call, as spooler_calls names it (metrics.Calls)

    @functools.wraps(method)
    async def wrapper(self, request, context):
        # the epoch trailer is read when the answer goes out (a promote's answer
        # names the epoch it made, and so does its trailer)
        began, forwarded, metrics, running = time.monotonic(), False, self.metrics, None
        try:
            auth, via = _caller(context, self.svc.cluster_key)
            forwarded = bool(via)  # (a member's call is counted as such even when its key is refused)
            running = metrics.calls.enter(FORWARDED_API if forwarded else "grpc", name)
            p = self.svc.authenticate(auth, via)
            if self.svc.unknown_here(p):
                await self.svc.verified(p)
            if isinstance(request, Malformed):
                raise request.error()
            resp = await method(self, p, request, context)
            context.set_trailing_metadata((_epoch_md(self.svc),))
            metrics.answered("grpc", name, began, forwarded=forwarded)
            return resp
        except asyncio.CancelledError:
            metrics.answered("grpc", name, began, CANCELLED, forwarded=forwarded)
            raise
        except errors.SpoolerError as e:
            metrics.answered("grpc", name, began, e, forwarded=forwarded)
            # The abort raised below carries ``e`` (its context), and with it ``e``'s
            # frames, which hold the request: a reference cycle that kept every
            # refused request (hundreds of MB for a 16 MiB one of many small items)
            # until a full collection, rare with this node's GC thresholds
            # (node/main.py). Let go of both first.
            request = None
            e.__traceback__ = None
            await _abort(self.svc, context, e)
        except Exception as e:
            if isinstance(e, grpc.aio.AbortError) or type(e).__name__ == "AbortError":
                raise
            log.exception("unexpected error in %s", method.__name__)
            request = None  # (as above)
            e.__traceback__ = None
            internal = errors.Internal("internal error")
            metrics.answered("grpc", name, began, internal, forwarded=forwarded)
            await _abort(self.svc, context, internal)
        finally:
            if running is not None:
                metrics.calls.leave(running)

    return wrapper


class SpoolerServicer(api_pb2_grpc.SpoolerServicer):
    def __init__(self, svc: Service, metrics):
        self.svc = svc
        self.metrics = metrics

    def _settings(self, s: api_pb2.Settings) -> dict:
        return {_PB_SETTINGS[f.name]: v for f, v in s.ListFields()}

    @rpc
    async def PutQueue(self, p, req, ctx):
        created, doc = await self.svc.put_queue(p, req.name, self._settings(req.settings))
        return api_pb2.PutQueueResponse(created=created, queue=_queue_pb(doc))

    @rpc
    async def GetQueue(self, p, req, ctx):
        return _queue_pb(await self.svc.get_queue(p, req.name))

    @rpc
    async def ListQueues(self, p, req, ctx):
        return api_pb2.ListQueuesResponse(queues=[_queue_pb(d) for d in await self.svc.list_queues(p)])

    @rpc
    async def DeleteQueue(self, p, req, ctx):
        await self.svc.delete_queue(p, req.name)
        return api_pb2.Empty()

    @rpc
    async def Redrive(self, p, req, ctx):
        return api_pb2.RedriveResponse(moved=await self.svc.redrive(p, req.name))

    @rpc
    async def Purge(self, p, req, ctx):
        return api_pb2.PurgeResponse(purged=await self.svc.purge(p, req.name))

    @rpc
    async def Send(self, p, req, ctx):
        [(mid, dup, err)] = await self.svc.send(p, [(req.queue, req.body, req.delay_seconds, req.dedup_key)])
        if err is not None:
            raise err
        return api_pb2.SendResponse(id=mid, duplicate=dup)

    @rpc
    async def SendBatch(self, p, req, ctx):
        return await _send_batch(self.svc, p, req)

    @rpc
    async def Receive(self, p, req, ctx):
        got = await self.svc.receive(p, req.queue, req.wait_seconds, 1, req.receive_id, req.caller_receive_id)
        await self._answer_or_give_back(ctx, p, [d.token for d in got],
                                        api_pb2.ReceiveResponse(messages=[_delivery_pb(d) for d in got]))

    @rpc
    async def ReceiveBatch(self, p, req, ctx):
        out = await _receive_batch(self.svc, p, req)
        await self._answer_or_give_back(ctx, p, [d.lease_token for d in out.messages], out)

    @rpc
    async def ReleaseReceive(self, p, req, ctx):
        n = await self.svc.release_receive(p, req.queue, req.receive_id)
        return api_pb2.ReleaseReceiveResponse(released=n)

    async def _answer_or_give_back(self, ctx, p, tokens: list, resp) -> None:
        """Write a receive's answer (ANSWER_WRITTEN_BY_HANDLER). If the write fails
        (the caller's connection broke, its deadline passed while the answer was
        held up), nobody got it: its leases go back at once, as a Session's do."""
        try:
            await ctx.write(resp)
        except BaseException as e:
            if tokens:
                self.svc.give_back(tokens, p.auth)
            if not isinstance(e, Exception):
                raise  # (cancelled: the call is over)
            log.debug("a receive's answer could not be written: %r", e)

    @rpc
    async def Ack(self, p, req, ctx):
        await self.svc.ack(p, req.token)
        return api_pb2.Empty()

    @rpc
    async def Nack(self, p, req, ctx):
        await self.svc.nack(p, req.token, req.delay_seconds)
        return api_pb2.Empty()

    @rpc
    async def Renew(self, p, req, ctx):
        e = await self.svc.renew(p, req.token)
        return api_pb2.RenewResponse(expires_at=e or "", lease_seconds_left=getattr(e, "left_s", 0.0))

    @rpc
    async def SettleBatch(self, p, req, ctx):
        return await _settle_batch(self.svc, p, req)

    @rpc
    async def CreateKey(self, p, req, ctx):
        if len(req.scopes) > SCOPES_IN_A_REQUEST_MAX:  # before they are read out (as _at_most)
            raise errors.InvalidArgument(f"scopes: at most {SCOPES_IN_A_REQUEST_MAX}, each one of "
                                         + ", ".join(SCOPES))
        d = await self.svc.create_key(p, req.queue, list(req.scopes))
        return api_pb2.KeyInfo(id=d["id"], queue=d["queue"], scopes=d["scopes"], key=d["key"])

    @rpc
    async def ListKeys(self, p, req, ctx):
        return api_pb2.ListKeysResponse(keys=[api_pb2.KeyInfo(id=k["id"], queue=k["queue"], scopes=k["scopes"])
                                              for k in await self.svc.list_keys(p)])

    @rpc
    async def DeleteKey(self, p, req, ctx):
        await self.svc.delete_key(p, req.id)
        return api_pb2.Empty()

    @rpc
    async def GetCluster(self, p, req, ctx):
        return cluster_pb(await self.svc.cluster(p))

    @rpc
    async def Promote(self, p, req, ctx):
        return cluster_pb(await self.svc.promote(p, req.node))

    async def Session(self, requests, context):
        """Many requests on one stream, each answered by id as soon as it completes.

        The reader starts one task per request; answers go out in completion
        order from this coroutine (the only writer of the stream). The key is
        checked for every request, so a deleted key stops working on open
        streams too.

        A stream whose key is refused (unknown, malformed) is not ended at once:
        each of its requests is answered with that error, and the stream ends only
        once it has been idle (below). Ending it at once races the
        client's first write, and when the write loses, the client's grpc reports
        the stream as INTERNAL without this node's error kind: the SDK would read
        a send refused as unauthenticated as one that may have landed."""
        svc = self.svc
        refused = None  # an error of the call itself (its metadata), given to every request
        auth, forwarded = None, ""
        try:
            auth, forwarded = _caller(context, svc.cluster_key)
        except errors.SpoolerError as e:
            e.__traceback__ = None  # (kept for the stream's life: no cycle through this frame)
            refused = e
        # Ended once idle for session_refused_idle_s (nothing in flight: no write of
        # the client's to race), so that streams nobody can use hold no call slots
        # for good.
        refused_at_open = refused
        if refused_at_open is None:
            try:
                svc.authenticate(auth, forwarded)
            except errors.SpoolerError as e:
                e.__traceback__ = None
                refused_at_open = e
        idle_s = svc.limits.session_refused_idle_s if refused_at_open is not None else None
        if svc.stopping:
            await _abort(svc, context, errors.Unavailable("the node is shutting down", retry_after_s=0.5))
        answers: list = []
        wake = asyncio.Event()
        svc.session_wakes.add(wake)  # a shutdown wakes the writer below
        room = asyncio.Event()  # set while fewer than the limit are in flight
        room.set()
        # requests begun and not answered: their tasks (or a send's engine Reply),
        # each with what it is and when it was read (for spooler_calls)
        tasks: dict = {}
        in_flight_max = svc.limits.session_requests_in_flight_max
        reading = True

        # bytes of receive answers not yet written (SESSION_ANSWER_BYTES_MAX): in all,
        # and each answer's (by id(), while it is held), each measured once
        held, sizes = [0], {}

        metrics, via_member = self.metrics, bool(forwarded)
        count_entry_error = None if via_member else metrics.error  # (a send's failed entries)
        # (its requests under way, as spooler_calls_in_progress counts them)
        metrics.calls.sessions[id(tasks)] = (FORWARDED_API if via_member else "grpc", tasks)

        def answer(resp, which, began: float) -> None:
            """Queue ``resp`` for the writer, and count the request it answers as a
            call ("Session/<which>", from ``began``) and its errors."""
            result = resp.WhichOneof("result")
            try:
                metrics.answered("grpc", _SESSION_CALL_NAMES.get(which, "unmatched"), began,
                                 resp.error if result == "error" else None, forwarded=via_member)
            except Exception:  # counting must never cost a caller its answer
                log.exception("could not count a Session answer")
            resp.epoch = svc.engine.known_epoch
            if result == "receive":
                sizes[id(resp)] = n = resp.ByteSize()
                held[0] += n
            answers.append(resp)
            wake.set()

        memo: list = []  # this stream's key, once it passed (Service.authenticate)

        def failed(rid: int, which: str, e: BaseException) -> api_pb2.SessionResponse:
            if isinstance(e, errors.SpoolerError):  # (counted by answer(), as every answer is)
                return api_pb2.SessionResponse(id=rid, error=errors.to_detail(e))
            log.error("unexpected error in Session %s", which, exc_info=e)
            return api_pb2.SessionResponse(id=rid, error=errors.to_detail(errors.Internal("internal error")))

        async def handle(rid: int, which: str, req, began: float) -> None:
            try:
                p = svc.authenticate(auth, forwarded, memo)
                if svc.unknown_here(p):
                    await svc.verified(p)
                resp = api_pb2.SessionResponse(id=rid)
                out = getattr(resp, which)
                out.SetInParent()  # the answer names its result even when it is empty (a receive of nothing)
                await _SESSION_CALLS[which](svc, p, req, out)
            except Exception as e:
                resp = failed(rid, which, e)
            tasks.pop(asyncio.current_task(), None)  # before the answer: the writer may look at once
            answer(resp, which, began)

        def sent(rid: int, compact: bool, began: float, reply: Reply, result, error) -> None:
            """A send begun in start() is committed (or refused): answer it. Called by
            the engine where it applies the record (Reply), never after the stream
            ended (the end cancels what is left in ``tasks``)."""
            tasks.pop(reply, None)
            if error is None:
                try:
                    resp = api_pb2.SessionResponse(id=rid)
                    resp.send_batch.SetInParent()
                    _fill_applied(resp.send_batch, compact, result, count_entry_error)
                except Exception as e:
                    error = e
            if error is not None:
                resp = failed(rid, "send_batch", error)
            answer(resp, "send_batch", began)

        def start(rid: int, which: str, req, began: float) -> None:
            """A send to the primary is checked and proposed right here, and answered
            by the engine's call of ``sent``: the write path of a Session send costs
            no task. Everything else (and a send this node forwards) runs in a task."""
            if which == "send_batch" and not svc.forwards():
                reply = Reply(functools.partial(sent, rid, req.compact_run_ids, began))
                try:
                    begun = svc.send_begin(svc.authenticate(auth, forwarded, memo), *_send_args(svc, req), reply=reply)
                except Exception as e:
                    answer(failed(rid, which, e), which, began)
                    return
                if begun is not None:
                    tasks[reply] = (which, began)
                    return
            t = asyncio.ensure_future(handle(rid, which, req, began))
            tasks[t] = (which, began)
            t.add_done_callback(lambda t: tasks.pop(t, None))

        async def read() -> None:
            """Back-pressure, not errors: past the limit (requests running plus
            answers not yet written) the reader stops reading, and HTTP/2 flow
            control holds the client."""
            nonlocal reading
            try:
                # context.read(), not ``async for r in requests``: grpc's request
                # iterator holds the message it last gave while it waits for the next
                while (r := await context.read()) is not grpc.aio.EOF:
                    # (and while the receive answers it has not written yet hold that
                    # many bytes: a client that never reads pinned up to 1,024 of 8 MiB)
                    while len(tasks) + len(answers) >= in_flight_max or held[0] > SESSION_ANSWER_BYTES_MAX:
                        room.clear()
                        await room.wait()
                    dispatch(r)
                    # let go of it while the next one is awaited: an idle stream would
                    # hold its last request (a refused one of 16 MiB too) for as long
                    # as it stays open, and a cancelled reader's traceback after that
                    r = None
            finally:
                r = None
                reading = False
                wake.set()

        def dispatch(r) -> None:
            began = time.monotonic()
            if isinstance(r, Malformed):  # no id to answer by: id 0, and the stream goes on
                answer(api_pb2.SessionResponse(id=0, error=errors.to_detail(r.error())), "", began)
                return
            which = r.WhichOneof("call")
            if refused is not None:
                answer(failed(r.id, which or "session", refused), which, began)
            elif which is None:
                answer(api_pb2.SessionResponse(id=r.id, error=errors.to_detail(
                    errors.InvalidArgument("session request names no call"))), "", began)
            else:
                try:
                    start(r.id, which, getattr(r, which), began)
                except Exception as e:  # answered, logged: the reader (and the stream) go on
                    answer(failed(r.id, which, e), which, began)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                if idle_s is None:
                    await wake.wait()
                else:
                    if not await wait_event(wake, idle_s):
                        if memo:  # a request's key has passed since (a node done loading): kept
                            idle_s = None
                        elif reading and not tasks and not answers:
                            reader.cancel()
                            await _abort(svc, context, refused_at_open)  # raises: the stream ends here
                        continue
                wake.clear()
                while answers:
                    batch = answers[:]
                    answers.clear()
                    for i, resp in enumerate(batch):
                        try:
                            await context.write(resp)
                        except BaseException:
                            # what was not written goes back: the stream's end gives
                            # back the leases of receive answers nobody got
                            answers[:0] = batch[i:]
                            raise
                        held[0] -= sizes.pop(id(resp), 0)
                    room.set()
                if svc.stopping:
                    # shutting down: read nothing more; once every request read so far
                    # is answered, end the stream as unavailable (the client moves on)
                    reader.cancel()
                    if not tasks and not answers:
                        await _abort(svc, context, errors.Unavailable("the node is shutting down",
                                                                      retry_after_s=0.5))
                    continue
                if not reading and (not tasks or (not reader.cancelled() and reader.exception() is not None)):
                    context.set_trailing_metadata((_epoch_md(svc),))
                    break  # the client closed its side and everything is answered, or the stream broke
        finally:
            svc.session_wakes.discard(wake)
            metrics.calls.sessions.pop(id(tasks), None)
            reader.cancel()
            for t, (which, began) in list(tasks.items()):
                if t.cancel():  # never answered: the stream ended first
                    try:
                        metrics.answered("grpc", _SESSION_CALL_NAMES[which], began, CANCELLED, forwarded=via_member)
                    except Exception:  # (as in answer(): the cleanup below must run)
                        log.exception("could not count a Session request cut short")
            # receive answers that were never written: nobody got those messages
            lost = [d.lease_token for a in answers if a.WhichOneof("result") == "receive" for d in a.receive.messages]
            if lost:
                svc.give_back(lost, auth or "")


# Bytes of receive answers a Session stream holds unwritten (a client that does not
# read them) before it stops reading that stream's requests
SESSION_ANSWER_BYTES_MAX = 64 << 20

GRPC_OPTIONS = [
    # one Session stream carries many batches at once: let it have more than
    # HTTP/2's default 64 KiB in flight before flow control stalls it
    ("grpc.http2.lookahead_bytes", 8 * 1024 * 1024),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
    # a restarted peer is reached again within a second, not after gRPC's default backoff
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class _NoSuchMethod(grpc.GenericRpcHandler):
    """Asked last, for a method no service here has: UNIMPLEMENTED as gRPC itself
    would answer, plus what every other error carries (the kind, here
    ``method_not_allowed`` as for a wrong HTTP method, and the epoch)."""

    def __init__(self, svc: Service, metrics=None):
        self.svc, self.metrics = svc, metrics

    def service(self, details):
        method = details.method

        async def refuse(requests, context):  # the request bytes are never read
            e = errors.MethodNotAllowed(f"no such gRPC method: {method}"[:300])
            if self.metrics:  # counted as every other call and error is
                self.metrics.answered("grpc", "unmatched", time.monotonic(), e)
            await _abort(self.svc, context, e)

        return grpc.stream_stream_rpc_method_handler(refuse)


# Bounds on the gRPC port's connections (limits.md, "gRPC connections"), set as
# gRPC core's own server arguments: a connection past ``--grpc-max-connections``
# is closed as soon as it is accepted (core's connection quota), and one that has
# not finished its handshake (TCP, TLS when on, HTTP/2's preface and settings)
# within ``--grpc-handshake-timeout`` is closed and its place freed. Without
# them, silent connections held a descriptor each for core's default 120 s, and
# a few thousand took every descriptor the node had, HTTP's included.
CONNECTIONS_MAX_DEFAULT = 4096
CONNECTIONS_MAX_MAX = 1_000_000
HANDSHAKE_TIMEOUT_S_DEFAULT = 10.0
HANDSHAKE_TIMEOUT_S_MIN, HANDSHAKE_TIMEOUT_S_MAX = 0.1, 3600.0


def server_options(max_connections: int = CONNECTIONS_MAX_DEFAULT,
                   handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S_DEFAULT) -> list:
    """The node's gRPC server arguments: GRPC_OPTIONS (shared with its channels to
    peers) and those only a server has."""
    return GRPC_OPTIONS + [
        ("grpc.max_allowed_incoming_connections", int(max_connections)),
        ("grpc.server_handshake_timeout_ms", max(1, round(handshake_timeout_s * 1000))),
        # Calls that arrived but that the Python server has not picked up yet wait
        # in gRPC core's queue, which past 1,000 of them (its default) cancels a
        # share of new calls and past 3,000 every one, before any handler runs: a
        # burst of 3,000 unary long polls lost about 500 as CANCELLED. Room for a
        # burst of the node's whole call budget (maximum_concurrent_rpcs, 10,000) and more.
        ("grpc.server.max_pending_requests", 20_000),
        ("grpc.server.max_pending_requests_hard_limit", 40_000),
    ]


# what server reflection lists: the client service, health, and reflection itself
# (not the node-to-node Replication service: it is for members only)
REFLECTED_SERVICES = (api_pb2.DESCRIPTOR.services_by_name["Spooler"].full_name,
                      health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                      reflection.SERVICE_NAME)


def reflected_pool() -> descriptor_pool.DescriptorPool:
    """The descriptors reflection answers from: the files of the services it
    lists and what they import, nothing else. (Reflection answers a symbol's
    file from its pool whatever it lists; from the default pool it described
    the members-only Replication service and the log's records too.)"""
    pool, added = descriptor_pool.DescriptorPool(), set()

    def add(fd) -> None:
        if fd.name in added:
            return
        for dep in fd.dependencies:
            add(dep)
        proto = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(proto)
        pool.Add(proto)
        added.add(fd.name)
    for fd in (api_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR):
        add(fd)
    return pool


# The helper services' streams (a health Watch, a reflection session) end when
# the node stops, as its own calls do (Service.shut_down): left open, each held
# the server's stop for its whole grace (1 s). A client whose channel checks
# health (gRPC's client-side health checking) keeps a Watch open all the time.
STOPPING = "the node is stopping"


async def _first_or_stop(task: asyncio.Future, engine) -> bool:
    """Wait for ``task`` or the node's stop, whichever comes first: True if the
    task ended on its own; False once the node stops (the task is cancelled and
    waited for, so the caller may use the call's context)."""
    async def stopping():
        while not engine.stopping:
            await asyncio.wait({engine.readiness_changes()})  # (Service.shut_down fires it)
    stop = asyncio.ensure_future(stopping())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled (its client went away)
        task.cancel()
        raise
    finally:
        stop.cancel()
    if task.done():
        return True
    task.cancel()
    await asyncio.wait({task})
    return False


class HealthServicer(health.aio.HealthServicer):
    """grpc's health service; its Watch streams end ``unavailable`` when the
    node stops, after saying NOT_SERVING. Its own Watch loop, not a wrapper
    around grpc's: cancelling grpc's mid-write (the NOT_SERVING that the stop's
    first step sends) left the call unable to end, and the stop waited out
    its grace after all."""

    def __init__(self, engine):
        super().__init__()
        self._engine = engine
        self._changes = Changes()  # a status set (set, _set)

    async def _set(self, service, status) -> None:
        await super()._set(service, status)
        self._changes.fire()

    async def Watch(self, request, context):
        last = None
        while True:
            # the futures first, then the status: a status set while the write
            # below is under way resolves them, and is not missed
            changes = {self._changes.next(), self._engine.readiness_changes()}
            status = self._server_status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self._engine.stopping:
                if last == health_pb2.HealthCheckResponse.SERVING:
                    await context.write(health_pb2.HealthCheckResponse(
                        status=health_pb2.HealthCheckResponse.NOT_SERVING))
                await context.abort(grpc.StatusCode.UNAVAILABLE, STOPPING)
            # the next status set, or the stop (Service.shut_down fires readiness);
            # asyncio.wait neither cancels the shared futures nor leaves callbacks on them
            await asyncio.wait(changes, return_when=asyncio.FIRST_COMPLETED)


class ReflectionServicer(reflection.aio.ReflectionServicer):
    """grpc's server reflection; a session still open ends ``unavailable`` when
    the node stops."""

    def __init__(self, service_names, pool, engine):
        super().__init__(service_names, pool=pool)
        self._engine = engine

    async def ServerReflectionInfo(self, request_iterator, context):
        answers = super().ServerReflectionInfo(request_iterator, context)
        try:
            while True:
                nxt = asyncio.ensure_future(answers.__anext__())
                if not await _first_or_stop(nxt, self._engine):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, STOPPING)
                try:
                    answer = nxt.result()
                except StopAsyncIteration:
                    return
                yield answer
        finally:
            try:
                await answers.aclose()
            except RuntimeError:  # (its step still being cancelled: it ends with it)
                pass


async def build_server(svc: Service, metrics, address: str, tls=None,
                       max_connections: int = CONNECTIONS_MAX_DEFAULT,
                       handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S_DEFAULT) -> tuple:
    server = grpc.aio.server(options=server_options(max_connections, handshake_timeout_s),
                             maximum_concurrent_rpcs=10_000)
    add_spooler_service(SpoolerServicer(svc, metrics), server)
    from node.replication.driver import ReplicationServicer
    from spooler.pb import replication_pb2_grpc
    replication_pb2_grpc.add_ReplicationServicer_to_server(ReplicationServicer(svc.engine.repl), server)
    health_servicer = HealthServicer(svc.engine)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # Server reflection, so that grpcurl and other generic clients can list the
    # client service and its messages without proto/ at hand (no key needed: it
    # tells what proto/ says, nothing of the node's data)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        ReflectionServicer(REFLECTED_SERVICES, pool=reflected_pool(), engine=svc.engine), server)
    server.add_generic_rpc_handlers((_NoSuchMethod(svc, metrics),))  # after every service: the fallback
    try:
        port = server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)
    except RuntimeError as e:   # grpcio: "Failed to bind to address ..."
        raise ListenError(f"cannot listen for gRPC on {address}: {e} (in use by another process?)") from None
    if port == 0:
        raise ListenError(f"cannot listen for gRPC on {address} (in use by another process?)")
    return server, health_servicer, port


class ListenError(OSError):
    """An address the node was told to listen on cannot be bound: said in one
    line at start, no traceback (node/main.py)."""


async def follow_readiness(health_servicer, engine, every_s: float = 0.2) -> None:
    """Keep the gRPC health status (SERVING / NOT_SERVING) equal to readiness, so a
    gRPC load balancer routes as an HTTP one reading /readyz would."""
    last = None
    while True:
        now = engine.clients_ready()
        if now != last:
            await set_serving(health_servicer, now)
            last = now
        await asyncio.sleep(every_s)


async def set_serving(health_servicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", "spooler.v1.Spooler"):
        r = health_servicer.set(name, status)
        if hasattr(r, "__await__"):
            await r
