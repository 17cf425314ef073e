"""asyncio gRPC client.

``send()`` is auto-batched: concurrent sends coalesce into SendBatch RPCs (up
to ``batch_max`` entries each, at most ``batches_in_flight_max`` RPCs at once).
A lone send goes out at once; while one is in flight, later sends gather for
the next batch — the same shape as the node's group commit.

    async with AsyncClient("127.0.0.1:50051", key) as c:
        await c.put_queue("jobs")
        await c.send("jobs", b"hello")
        for m in await c.receive("jobs", wait_s=5):
            await c.ack(m.token)
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Any, Awaitable, Callable, Optional

import grpc

from spooler import errors
from spooler._common import (MOVE_ON, Nodes, refused_before_it_ran, entry_bytes, LeaseEnd, key_request, Message, keep_renewing_after, batch_size, check_batch, check_send_types, SendResult, batch_request, compact_request, settle_request, settle_outcomes, batch_results, call_with_retries,
                             _has_detail, map_rpc_error, messages_of, never_sent, read_lost, queue_dict, renew_delay_s, resend_groups, send_outcomes, settle_after_unconfirmed,
                             settings_pb, DedupWindow, RECEIVE_DEFINITE, RELEASE_TIMEOUT_S, note_release_failure, receive_request, lease_request,
                             release_request, settle_failed, unconfirmed_after, Lacking)
from spooler.pb import api_pb2

log = logging.getLogger("spooler.aio")

# Long polls one client keeps on its Session stream at once; further ones are unary
# calls (a node reads 1,024 requests of a stream at a time: the rest is left room),
# at most UNARY_POLLS_MAX at once (a node takes 10,000 calls at once from all its
# clients together); one past both waits here for a turn, its wait counted from then.
SESSION_POLLS_MAX = 256
UNARY_POLLS_MAX = 1024
# How long close() waits for the node to end its idle streams, and then for its
# streams' readers (a node ends an idle stream within a round trip; a cancelled
# stream's reader ends at once).
CLOSE_READERS_TIMEOUT_S = 1.0


class _NoSession(Exception):
    """The node has no Session RPC (an older node): use the unary RPCs."""


class _Waiter:
    __slots__ = ("fut", "write", "call", "chan", "which", "on_ok")

    def __init__(self, fut, write: bool, chan, which: str = "", on_ok=None):
        self.fut = fut
        self.write = write
        # on_ok(result): called by the stream's reader itself when the answer is a
        # ``which`` result (not an error), before the requester's future is set: an
        # auto-batched send's callers get their results a turn of the loop sooner
        self.which = which
        self.on_ok = on_ok
        self.call = None  # the stream it was written to; None = not written yet
        # the channel of its stream: what its failure may move the client away
        # from (not a newer stream's, which the client may have moved to since)
        self.chan = chan


class _Session:
    """The client half of the Session stream: many requests on one gRPC stream,
    each answered by id. A message on an open stream costs a fraction of a
    unary call, which is where the SDK's latency and throughput come from.

    When a stream breaks, every request written to it and still waiting fails
    the way a unary call would at that point: a write ``operation_unconfirmed``
    (it may have landed), a read ``unavailable``, or the error the node ended
    the stream with (e.g. ``unauthenticated``). A request not yet written fails
    ``unavailable`` (safe to retry) and is never written later. When the client
    moves to another node, the old stream is closed for writing and still
    delivers the answers it owes. The next request opens a new stream."""

    def __init__(self, client: "AsyncClient"):
        self.c = client
        self.call = None
        self.stub = None
        self.chan = None            # the channel of self.call (to move on from it only once)
        self.lacking = Lacking()    # nodes without a Session (older ones): unary calls there
        self.waiting: dict = {}     # id -> _Waiter
        self.outbox: list = []      # (id, SessionRequest) for self.call, not yet written
        # streams with a writer task: one per stream, never one for all, so that a
        # stream whose write hangs (a node that accepted the connection and says
        # nothing) holds up none opened after it to another node
        self.writers: set = set()
        self.readers: set = set()   # each stream's reader task, until its stream is over
        self.next_id = 0

    @property
    def supported(self) -> bool:
        """The node the client talks to now has the Session, as far as it knows."""
        return not self.lacking.lacks(self.c.channel)

    @supported.setter
    def supported(self, yes: bool) -> None:
        self.lacking.found(self.c.channel, not yes)

    def _open(self) -> None:
        self.stub, self.chan = self.c.stub, self.c.channel
        self.call = self.stub.Session(metadata=self.c.md)
        t = asyncio.ensure_future(self._read(self.call))
        self.readers.add(t)
        t.add_done_callback(self.readers.discard)

    def _retire(self) -> None:
        """Move to a new stream; the old one stops taking requests but answers
        the ones it has."""
        old = self.call
        self._fail_unwritten(errors.Unavailable("moved to another node before the request was sent"))
        self.call = None
        if old is not None and not old.done():
            asyncio.ensure_future(_half_close(old))

    async def request(self, which: str, req, *, write: bool, timeout_s: float, on_ok=None):
        if self.c._closed:  # not grpc's UsageError from a closed channel
            raise RuntimeError("the client is closed")
        if not self.supported:
            raise _NoSession()
        if self.call is not None and self.stub is not self.c.stub:
            self._retire()
        if self.call is None:
            self._open()
        loop = asyncio.get_running_loop()
        self.next_id += 1
        rid = self.next_id
        w = _Waiter(loop.create_future(), write, self.chan, which, on_ok)
        self.waiting[rid] = w
        self.outbox.append((rid, api_pb2.SessionRequest(id=rid, **{which: req})))
        self._start_writer()
        timer = loop.call_later(timeout_s, self._expire, rid)
        try:
            resp = await w.fut
        finally:
            timer.cancel()
            self.waiting.pop(rid, None)
        kind = resp.WhichOneof("result")
        if kind is None:  # an empty answer (a receive of nothing) that names no result
            return getattr(resp, which)
        if kind == "error":
            err = errors.from_detail(resp.error)
            if isinstance(err, errors.Unavailable) and not errors.stay_on(err):
                self.c._next_target(w.chan)
            raise err
        return getattr(resp, kind)

    def _expire(self, rid: int) -> None:
        w = self.waiting.pop(rid, None)
        if w is None or w.fut.done():
            return
        self.c._next_target(w.chan)  # a node that does not answer in time must not pin the client
        if w.fut.done():
            return
        if w.call is None:  # still in the outbox: take it out, it is never sent
            self.outbox[:] = [x for x in self.outbox if x[0] != rid]
            w.fut.set_exception(errors.Unavailable("not sent within the timeout"))
        else:
            w.fut.set_exception(errors.OperationUnconfirmed("no answer within the timeout") if w.write
                                else read_lost("no answer within the timeout"))

    def _start_writer(self) -> None:
        call = self.call
        if self.outbox and call is not None and not call.done() and call not in self.writers:
            self.writers.add(call)
            asyncio.ensure_future(self._write(call))

    async def _write(self, call) -> None:
        try:
            # Nothing leaves before the stream is connected: a node that never
            # completes the connection (its host drops the handshake, or accepts it
            # and says nothing) has then been sent nothing, and what waits in the
            # outbox fails ``unavailable`` (safe to retry elsewhere), not
            # ``operation_unconfirmed``.
            await call.wait_for_connection()
            while self.outbox and call is self.call and not call.done():
                rid, msg = self.outbox.pop(0)
                w = self.waiting.get(rid)
                if w is None or w.fut.done():
                    continue  # its caller gave up (timeout): never send it
                w.call = call  # from here on its outcome is unknown if the stream breaks
                try:
                    await call.write(msg)
                except asyncio.InvalidStateError:  # the stream ended (or was closed) before it went
                    w.call = None
                    if not w.fut.done():
                        w.fut.set_exception(errors.Unavailable("session stream closed before the request was sent"))
                    raise
        except Exception:  # noqa: BLE001 - the stream is broken: its reader reports how
            call.cancel()
        finally:
            self.writers.discard(call)
            self._start_writer()  # what came for the current stream meanwhile

    async def _read(self, call) -> None:
        err: Optional[BaseException] = None
        answered = False
        try:
            async for resp in call:
                answered = True
                w = self.waiting.get(resp.id)
                if w is not None and not w.fut.done():
                    # on_ok first: the callers it answers are woken before the
                    # requester, whose own wrap-up is then off their latency
                    if w.on_ok is not None and resp.WhichOneof("result") == w.which:
                        try:
                            w.on_ok(getattr(resp, w.which))
                        except Exception:  # noqa: BLE001 - the requester still gets the answer
                            pass
                    w.fut.set_result(resp)
        except grpc.RpcError as e:
            err = e
        except asyncio.CancelledError:
            err = None
        except Exception as e:  # noqa: BLE001 - the stream is gone either way
            err = e
        self._broken(call, err, answered)

    def _fail_unwritten(self, e: BaseException) -> None:
        for rid, _ in self.outbox:
            w = self.waiting.get(rid)
            if w is not None and not w.fut.done():
                w.fut.set_exception(e)
        self.outbox.clear()

    def _broken(self, call, e: Optional[BaseException], answered: bool = True) -> None:
        """The stream ``call`` is over: fail what waits on it. ``answered``: the
        node answered something on it (so it took the stream)."""
        current = call is self.call  # (a retired stream's break does not move the client again)
        if current:
            self.call = None
            self._fail_unwritten(errors.Unavailable("session stream closed before the request was sent"))
        if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNIMPLEMENTED:
            if current:  # (a retired stream's node is not the one the client uses now)
                self.lacking.found(self.chan)
            for w in list(self.waiting.values()):
                if w.call is call and not w.fut.done():
                    w.fut.set_exception(_NoSession())
            return
        detail = None
        if isinstance(e, grpc.RpcError):
            if e.code() in MOVE_ON and current:  # as a unary call that ended so would
                self.c._next_target(self.chan)
            if _has_detail(e):  # the node said why (e.g. unauthenticated): that is the answer
                detail = map_rpc_error(e)
            elif not answered and refused_before_it_ran(e):
                # gRPC refused the stream itself (the node's cap on concurrent calls):
                # no request on it ran, so each is plainly unavailable, safe to resend
                detail = map_rpc_error(e)
        for w in list(self.waiting.values()):
            if w.call is not call or w.fut.done():
                continue
            if detail is not None:
                w.fut.set_exception(detail)
            elif isinstance(e, grpc.RpcError) and never_sent(e):  # no connection: nothing left us
                w.fut.set_exception(errors.Unavailable(f"no connection to the node: {e.details()}"))
            else:  # a transport failure after the request left: its outcome is unknown
                w.fut.set_exception(errors.OperationUnconfirmed("session stream broke") if w.write
                                    else read_lost("session stream broke"))

    async def finish(self, timeout_s: float) -> None:
        """End the streams the way the node ends a finished one: with nothing left
        waiting on them, close their sending side and wait (up to ``timeout_s``)
        for the node to end them, so that grpc has nothing of theirs still on its
        way when the caller's event loop closes (see AsyncClient.close)."""
        if self.waiting or self.outbox:
            return  # (a long poll still out: close cancels instead, at once)
        call = self.call
        if call is not None and not call.done():
            try:
                await asyncio.wait_for(call.done_writing(), timeout_s)
            except Exception:  # noqa: BLE001 - (a timeout too) close cancels it next
                return
        if self.readers:
            await asyncio.wait(list(self.readers), timeout=timeout_s)

    def close(self) -> None:
        call = self.call
        if call is not None:
            self._broken(call, None)
            call.cancel()


async def _half_close(call) -> None:
    try:
        await call.done_writing()
    except Exception:  # noqa: BLE001 - already broken: its reader reports it
        pass


def _deliver(batch: list, r: api_pb2.SendBatchResponse) -> None:
    """A send batch's answer to its callers (each caller's future once)."""
    try:
        outcomes = send_outcomes(r, len(batch))
    except errors.SpoolerError as e:  # not one outcome per caller: none can be told which is theirs
        _fail_all(batch, e)
        return
    except Exception as e:  # noqa: BLE001 - an answer no node of ours gives: never leave its callers waiting
        _fail_all(batch, errors.OperationUnconfirmed(f"the node's answer could not be read: {e!r}"))
        return
    for (_, fut), res in zip(batch, outcomes):
        if fut.done():
            continue
        if isinstance(res, errors.SpoolerError):
            fut.set_exception(res)
        else:
            fut.set_result(res)


def _fail_all(batch: list, e: BaseException) -> None:
    for _, fut in batch:
        if not fut.done():
            fut.set_exception(e)


class AsyncClient(Nodes):
    _grpc = grpc.aio
    # The event loop its channels, Session stream and tasks belong to (gRPC's asyncio
    # channels work on the loop they were made on only). A client made outside a
    # running loop makes them on first use; one whose loop has ended (a second
    # ``asyncio.run()``) makes them afresh on the next (_here).
    _loop: Optional[asyncio.AbstractEventLoop] = None

    def _open(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or (self._loop is not None and loop is not self._loop):
            self._current = (None, None)  # made on first use, on the loop that uses it (_here)
            self.channel = self.stub = None
            return
        self._loop = loop
        super()._open()

    def _busy_elsewhere(self) -> None:
        """Refuse to move while the loop it was used on is not over: tasks of its
        own may still run there (a flush, a release) and would meet the state
        made for the new loop."""
        old = self._loop
        if old is not None and not old.is_closed():
            raise RuntimeError("this AsyncClient was used on another event loop, which is "
                               f"{'running' if old.is_running() else 'not closed'}: make one client per event loop")

    def _here(self) -> None:
        """Called first by every public coroutine: the client works on the running
        loop. Once the loop it was used on is closed (the end of an
        ``asyncio.run()``), what it held there (its channels, its Session stream,
        sends not yet sent) is gone with it, and it starts afresh here; a client
        closed there stays closed."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        self._busy_elsewhere()
        closed, closing = self._closed, self._closing
        self._loop = loop
        self._channels, self._channels_closed = {}, closed
        self._pending, self._in_flight = [], 0
        self._init_client()
        self._closed, self._closing = closed, closing
        if not closed:
            self._open()

    def _init_client(self) -> None:
        self._flushes: set = set()   # the flush tasks running
        self.session = _Session(self)
        self._releases: set = set()   # releases of cancelled receives, still going
        self._session_polls = 0       # long polls waiting on the Session stream now
        self._unary_polls: Optional[asyncio.Semaphore] = None  # turns for the others (made on first use)
        self._settling: set = set()   # futures of acks, nacks and settle_batches in progress (close waits for them)
        self._closed = False
        self._closing = False

    def _gone(self) -> bool:
        """close() began: a failed call is not tried again (its channel is closing)."""
        return self._closing

    def _next_target(self, failed_channel=None) -> None:
        super()._next_target(failed_channel)
        s = self.session
        if s.call is not None and s.stub is not self.stub:
            # moved on: what still waits unwritten for the node just left fails
            # unavailable now (its callers retry on the next node), not at its timeout
            s._retire()

    async def close(self) -> None:
        """Sends already handed to the client still go out, and acks, nacks and
        settle_batches already called get their answers (within its timeout);
        then the channels close, and close returns once its streams have ended.
        (An ack cut off here would cost its message a redelivery.)"""
        if self._loop is not asyncio.get_running_loop():
            if self._loop is not None and self._loop.is_running():
                self._busy_elsewhere()  # raises
            # never used on this loop: nothing of it runs here, and channels made on
            # a loop that has ended or stands still cannot be closed from this one
            # (nothing is made for this loop either: closed, it stays closed)
            self._closing = self._closed = self._channels_closed = True
            self._channels, self.channel, self.stub = {}, None, None
            return
        self._closing = True  # no new sends from here on
        if self._flushes or self._settling:
            await asyncio.wait(list(self._flushes) + list(self._settling), timeout=self.timeout_s)
        _fail_all(self._pending, errors.Unavailable("the client closed before the send left"))
        self._pending.clear()
        if self._releases:  # each is one call with a short deadline
            await asyncio.wait(list(self._releases), timeout=RELEASE_TIMEOUT_S + 0.5)
        self._closed = True
        # grpc's completion queue outlives the event loop: a completion of a stream
        # still on its way when the loop closes (the end of an ``asyncio.run``) is
        # handed to that closed loop by the next one, a traceback on stderr each
        # time. A stream the node ends has none left once its reader has seen the
        # end; a cancelled one may still have its status on the way. So the
        # streams are ended, not cancelled, when nothing waits on them; what is
        # left is cancelled, and its readers are waited for all the same.
        await self.session.finish(CLOSE_READERS_TIMEOUT_S)
        self.session.close()
        self._channels_closed = True
        for ch in self._all_channels():
            await ch.close()
        if self.session.readers:
            await asyncio.wait(list(self.session.readers), timeout=CLOSE_READERS_TIMEOUT_S)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def _call(self, rpc, req, *, write: bool, timeout_s: Optional[float] = None):
        if self._closed:  # not grpc's UsageError from a closed channel
            raise RuntimeError("the client is closed")
        ch = self.channel  # the channel ``rpc`` belongs to (its stub was read just now)
        try:
            return await rpc(req, metadata=self.md, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as e:
            err = map_rpc_error(e, write=write)
            if e.code() in MOVE_ON and not errors.stay_on(err):
                self._next_target(ch)
            raise err from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our caller was cancelled: that goes on up
            # grpc.aio cancelled the call under us (close() closed its channel):
            # the caller hears what a call the node ended would say
            if write:
                raise errors.OperationUnconfirmed("the client closed while the call was in flight: "
                                                  "outcome unknown") from None
            raise read_lost("the client closed while the call was in flight") from None

    async def _retried(self, method: str, req, *, write: bool):
        """A queue, key or cluster call: tried again after ``unavailable`` (known
        not accepted, so always safe), each time on the node the client uses then."""
        return await call_with_retries(lambda: self._call(getattr(self.stub, method), req, write=write),
                                       self.retry_attempts, stop_when=self._gone)

    async def _pipe(self, which: str, method: str, req, *, write: bool, timeout_s: Optional[float] = None):
        """On the Session stream when the node has it, else the unary ``method``,
        read from the stub only then (the client may have moved to another node
        while it tried the session)."""
        t = timeout_s or self.timeout_s
        if self.session.supported:
            try:
                return await self.session.request(which, req, write=write, timeout_s=t)
            except _NoSession:
                pass
        return await self._call(getattr(self.stub, method), req, write=write, timeout_s=t)

    # ------------------------------------------------------------- queues
    async def put_queue(self, name: str, **settings) -> dict:
        self._here()
        r = await self._retried("PutQueue", api_pb2.PutQueueRequest(name=name, settings=settings_pb(settings)),
                             write=True)
        return {**queue_dict(r.queue), "created": r.created}

    async def get_queue(self, name: str) -> dict:
        self._here()
        return queue_dict(await self._retried("GetQueue", api_pb2.QueueRequest(name=name), write=False))

    async def list_queues(self) -> list:
        self._here()
        r = await self._retried("ListQueues", api_pb2.ListQueuesRequest(), write=False)
        return [queue_dict(q) for q in r.queues]

    async def delete_queue(self, name: str) -> None:
        self._here()
        await self._retried("DeleteQueue", api_pb2.QueueRequest(name=name), write=True)

    async def redrive(self, name: str) -> int:
        self._here()
        return (await self._retried("Redrive", api_pb2.QueueRequest(name=name), write=True)).moved

    async def purge(self, name: str) -> int:
        """Every message of the queue goes, leased ones too; -> how many it held."""
        self._here()
        return (await self._retried("Purge", api_pb2.QueueRequest(name=name), write=True)).purged

    # ----------------------------------------------------------- sending
    async def send(self, queue: str, body: bytes, *, delay_s: float = 0.0, dedup_key: str = "") -> SendResult:
        """Auto-batched send. Retried only where a retry is safe (see _common._policy)."""
        self._here()
        # checked here, so that a wrong type fails this caller alone, not the batch it would join
        check_send_types(queue, body, delay_s, dedup_key)
        if self._closing:
            raise RuntimeError("the client is closed")
        req = (queue, body, delay_s, dedup_key)

        def enqueue():
            if self._closing:  # a retry after close() began: it would meet a closed channel
                raise RuntimeError("the client is closed")
            fut = asyncio.get_running_loop().create_future()
            self._pending.append((req, fut))
            if self._in_flight < self.batches_in_flight_max:
                self._start_flush()
            return fut

        t0 = time.monotonic()
        try:
            return await enqueue()
        except errors.OperationUnconfirmed as e:
            # a resend is harmless only with a key, inside the queue's dedup window
            if not dedup_key or self.retry_attempts <= 1:
                raise
            window = DedupWindow(t0, await self._dedup_window_s(queue), self.timeout_s, maybe_landed=True)
            if window.used_up():
                raise
            first = e
        except errors.Unavailable as e:
            if self.retry_attempts <= 1:
                raise
            # not accepted: a resend is safe. Whether a LATER unconfirmed attempt may be
            # resent too depends, as above, on a key and the queue's dedup window.
            window = DedupWindow(t0, await self._dedup_window_s(queue) if dedup_key else 0.0, self.timeout_s,
                                 maybe_landed=False)
            first = e

        async def again():
            try:
                return await enqueue()
            except errors.SpoolerError as e:
                window.noting(e)
                if isinstance(e, errors.Unavailable) and window.maybe_landed:
                    raise unconfirmed_after(e) from e
                raise
        # a close() meanwhile stops the resends with the last attempt's error (which
        # says whether the message may have been stored), not "the client is closed"
        return await call_with_retries(again, self.retry_attempts - 1, first_failed=first,
                                       send_with_key=window.window_s > 0,
                                       stop_when=lambda: window.used_up() or self._gone())

    async def _dedup_window_s(self, queue: str) -> float:
        """``queue``'s dedup window, in seconds. A read, retried while the cluster is
        between primaries; if it cannot be known, 0 (the caller then does not resend)."""
        try:
            q = await self.get_queue(queue)  # retried after unavailable
            return float(q["settings"]["dedupWindowSeconds"])
        except (errors.SpoolerError, RuntimeError):  # (RuntimeError: the client was closed meanwhile)
            return 0.0

    def _start_flush(self) -> None:
        self._in_flight += 1
        t = asyncio.ensure_future(self._flush())
        self._flushes.add(t)
        t.add_done_callback(self._flushes.discard)

    async def _flush(self) -> None:
        try:
            while self._pending:
                n = batch_size(self._pending, self.batch_max, lambda x: entry_bytes(x[0][0], x[0][1], x[0][3]))
                # a send whose caller was cancelled while it waited here never leaves
                # (its caller heard CancelledError: it must not be stored behind its back)
                batch = [x for x in self._pending[:n] if not x[1].done()]
                del self._pending[:n]
                if batch:
                    await self._send_batch_now(batch)
        finally:
            self._in_flight -= 1
            # sends queued while this flush was ending (or after it failed) still go out
            if self._pending and self._in_flight < self.batches_in_flight_max:
                self._start_flush()

    async def _send_batch_now(self, batch: list) -> None:
        self.send_rpcs += 1
        delivered: list = []  # the stream's reader answered the callers already (on_ok)

        def on_ok(r) -> None:
            _deliver(batch, r)
            delivered.append(True)

        try:
            r = await self._send_request([b[0] for b in batch], on_ok=on_ok)
        except errors.SpoolerError as e:
            groups = resend_groups(e, [b[0][0] for b in batch])
            if groups is not None:
                # refused before anything was stored (one bad entry, or one full
                # queue): sent again in parts, so only the part at fault fails
                for i, g in enumerate(groups):
                    part = [batch[j] for j in g if not batch[j][1].done()]  # (not a caller cancelled meanwhile)
                    if not part:
                        continue
                    try:
                        await self._send_batch_now(part)
                    except BaseException:  # cut short (cancelled): the rest never left
                        _fail_all([batch[j] for h in groups[i + 1:] for j in h],
                                  errors.Unavailable("not sent: its batch's resend was cut short"))
                        raise
                return
            _fail_all(batch, e)
            return
        except asyncio.CancelledError:  # never leave a caller waiting
            # (it may have been written already: its outcome is unknown)
            _fail_all(batch, errors.OperationUnconfirmed("the send was cancelled after it may have left"))
            raise
        except Exception as e:  # noqa: BLE001 - e.g. the channel was closed under it: its callers hear of it
            _fail_all(batch, e)
            return
        if not delivered:  # a unary answer (no Session)
            _deliver(batch, r)

    async def send_batch(self, queue: str, bodies: list, *, delay_s: float = 0.0) -> list:
        """One RPC, one log record: all stored or none. Tried again after
        ``unavailable`` only (known not stored)."""
        self._here()
        bodies = list(bodies)
        check_batch(queue, bodies, delay_s)
        sends = [(queue, b, delay_s, "") for b in bodies]
        # already the compact form (one queue, one delay, bodies only): made once, not checked per attempt
        run = compact_request(queue, bodies, delay_s)
        return batch_results(await call_with_retries(lambda: self._send_request(sends, compact=run),
                                                     self.retry_attempts, stop_when=self._gone), len(bodies))

    async def _send_request(self, sends: list, on_ok=None, compact=None) -> api_pb2.SendBatchResponse:
        """One send batch: on the Session in the compact form when it fits, else
        (a node without Session) a unary SendBatch with one entry per message.
        ``on_ok``: see _Waiter (Session only). ``compact``: ``sends`` in the compact
        form, when the caller knows it fits."""
        if self.session.supported:
            try:
                return await self.session.request("send_batch", compact or batch_request(sends), write=True,
                                                  timeout_s=self.timeout_s, on_ok=on_ok)
            except _NoSession:
                pass
        return await self._call(self.stub.SendBatch, batch_request(sends, compact=False), write=True)

    # --------------------------------------------------------- receiving
    async def receive(self, queue: str, *, wait_s: float = 0.0, max_messages: int = 1) -> list:
        """Tried again after ``unavailable`` (each attempt a receive of its own name:
        one that may have leased something is given back first)."""
        self._here()
        return await self._receive(queue, wait_s, max_messages)

    async def _receive(self, queue: str, wait_s: float, max_messages: int, names: Optional[list] = None) -> list:
        """``names``: each attempt's request is appended to it (the last one's answer
        is the result), so that a caller that ends up not taking that answer can give
        its leases back (consume, cancelled in the turn the answer came)."""
        return await call_with_retries(lambda: self._receive_once(queue, wait_s, max_messages, names),
                                       self.retry_attempts, stop_when=self._gone, receive=True)

    async def _receive_once(self, queue: str, wait_s: float, max_messages: int, names: Optional[list] = None) -> list:
        req = receive_request(queue, wait_s, max_messages)
        if names is not None:
            names.append(req)
        started = time.monotonic()  # no later than the primary granted the leases
        # A node reads at most 1,024 requests of one Session stream at once (limits.md):
        # long polls past SESSION_POLLS_MAX go as unary calls, so that waiting receives
        # never hold up the sends and acks behind them on the stream.
        counted = wait_s > 0 and self._session_polls < SESSION_POLLS_MAX  # a long poll on the stream
        on_session = counted or wait_s <= 0
        self._session_polls += counted
        try:
            if on_session:
                r = await self._pipe("receive", "ReceiveBatch", req, write=False, timeout_s=self.timeout_s + wait_s)
            else:
                if self._unary_polls is None:
                    self._unary_polls = asyncio.Semaphore(UNARY_POLLS_MAX)
                async with self._unary_polls:
                    r = await self._call(self.stub.ReceiveBatch, req, write=False, timeout_s=self.timeout_s + wait_s)
        except errors.SpoolerError as e:
            if not isinstance(e, RECEIVE_DEFINITE):
                await self._release(req)
            raise
        except asyncio.CancelledError:  # our caller gave up: an answer may still come, unread
            t = asyncio.ensure_future(self._release(req))
            self._releases.add(t)
            t.add_done_callback(self._releases.discard)
            raise
        finally:
            self._session_polls -= counted
        return messages_of(r, started)

    async def _release(self, req) -> None:
        """The answer of receive ``req`` may have been lost on the way: ask the node
        to give back whatever it leased for it (retry counts kept). One attempt; if it
        fails too, those leases expire as they would have."""
        ch, stub = self._current
        if self._no_release.lacks(ch) or self._closed:
            return
        try:
            await stub.ReleaseReceive(release_request(req), metadata=self.md, timeout=RELEASE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - e.g. the channel closed meanwhile: never replace the receive's error
            note_release_failure(self, e, log, ch)

    async def _settle_one(self, action: str, token: str, delay_s: float = 0.0):
        """One ack/nack/renew: a one-item SettleBatch on the session (the unary
        Ack/Nack/Renew on a node without one); the item's error is raised."""
        started = time.monotonic()
        if self.session.supported:
            req = settle_request([(token, action, delay_s)])
            try:
                out = settle_outcomes(await self.session.request("settle_batch", req, write=True,
                                                                 timeout_s=self.timeout_s), 1, started)[0]
            except _NoSession:
                pass
            else:
                if isinstance(out, errors.SpoolerError):
                    raise out
                return out
        # the stub read now, not before the session was tried: the client may have moved since
        rpc = getattr(self.stub, {"ack": "Ack", "nack": "Nack", "renew": "Renew"}[action])
        r = await self._call(rpc, lease_request(token, delay_s), write=True)
        return LeaseEnd(r.expires_at, r.lease_seconds_left, started) if action == "renew" else None

    async def _settle(self, action: str, token: str, delay_s: float = 0.0) -> object:
        if action == "renew":
            return await self._settle_attempts(action, token, delay_s)
        return await self._waited_for_by_close(self._settle_attempts(action, token, delay_s))

    async def _waited_for_by_close(self, settling: Awaitable):
        """An ack or nack (or settle_batch) that close() lets finish: close() waits on
        a future of its own (not on the calling task, which may go on to a long poll
        after its ack)."""
        if self._closing:
            # close() took its list of settles to wait for: one begun now would be
            # neither waited for nor sure to reach an open channel (as in Client)
            settling.close()
            raise RuntimeError("the client is closed")
        done = asyncio.get_running_loop().create_future()
        self._settling.add(done)
        try:
            return await settling
        finally:
            self._settling.discard(done)
            done.set_result(None)

    async def _settle_attempts(self, action: str, token: str, delay_s: float) -> object:
        maybe_landed = False  # an earlier attempt's outcome is unknown

        async def once():
            nonlocal maybe_landed
            try:
                return await self._settle_one(action, token, delay_s)
            except errors.StaleLease as e:
                if maybe_landed and action != "renew":
                    settle_after_unconfirmed(e)  # our earlier attempt landed (returns), or may have
                    return None
                raise
            except errors.OperationUnconfirmed:
                maybe_landed = True
                raise
            except errors.Unavailable as e:
                if maybe_landed:
                    raise unconfirmed_after(e) from e
                raise

        return await call_with_retries(once, self.retry_attempts, settle=True, stop_when=self._gone)

    async def ack(self, token: str) -> None:
        self._here()
        await self._settle("ack", token)

    async def nack(self, token: str, *, delay_s: float = 0.0) -> None:
        self._here()
        if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)):
            raise TypeError(f"delay_s must be a number, not {type(delay_s).__name__}")
        await self._settle("nack", token, delay_s)

    async def renew(self, token: str) -> str:
        self._here()
        return await self._settle("renew", token)

    async def settle_batch(self, items: list) -> list:
        """items: [(token, "ack"|"nack"|"renew"[, delay_s])] -> per item None / expiresAt / SpoolerError."""
        self._here()
        req = settle_request(items)
        started = time.monotonic()
        # after unavailable only: the per-item answers are final
        r = await self._waited_for_by_close(call_with_retries(
            lambda: self._pipe("settle_batch", "SettleBatch", req, write=True),
            self.retry_attempts, stop_when=self._gone))
        return settle_outcomes(r, len(req.items), started)

    # --------------------------------------------------------- consuming
    async def consume(self, queue: str, handler: Callable[[Message], Any], *, concurrency: int = 1,
                      wait_s: float = 20.0, nack_delay_s: float = 0.0,
                      stop: Optional[asyncio.Event] = None, max_messages: int = 0) -> int:
        """Run ``handler`` for each message: the lease is renewed while it runs;
        it is acked when the handler returns and nacked when it raises. Returns
        the number handled, soon after ``stop`` is set (a receive waiting then is
        given up), or once ``max_messages`` (0: no limit) were handled, as
        ``Client.consume``; with ``concurrency`` workers never more than that.

        ``handler`` is a coroutine function, or any function whose result is
        awaited if it is awaitable; a plain function runs on the event loop (hand
        blocking work to ``asyncio.to_thread``).

        An outage is ridden out: a receive that fails is tried again, and an ack
        or nack that cannot be confirmed (the lease went stale, or the cluster
        stayed unreachable past the retries) is logged, and the message may be
        delivered again. Any other error ends consume, and all its workers."""
        self._here()
        stop = stop or asyncio.Event()
        if max_messages < 0:
            raise ValueError("max_messages must be 0 (no limit) or more")
        slots = [0, 0]  # messages being received or handled, and handled, by all workers

        async def worker():
            stopped = asyncio.ensure_future(stop.wait())
            recv = taken = None
            names: list = []  # the requests of recv's attempts
            try:
                while not stop.is_set() and (not max_messages or slots[0] < max_messages):
                    slots[0] += 1  # this worker's next message, reserved before it is leased
                    names.clear()
                    recv = asyncio.ensure_future(self._receive(queue, wait_s, 1, names))
                    await asyncio.wait({recv, stopped}, return_when=asyncio.FIRST_COMPLETED)
                    if not recv.done():
                        # stop during a long poll: give it up (a cancelled receive gives
                        # back whatever it may have leased) instead of waiting it out
                        recv.cancel()
                        await asyncio.wait({recv})
                        if recv.cancelled() or recv.exception() is not None:
                            break
                    taken = recv
                    try:
                        msgs = recv.result()
                    except errors.Unavailable:
                        slots[0] -= 1
                        await asyncio.sleep(0.2)
                        continue
                    if not msgs:
                        slots[0] -= 1
                    for m in msgs:  # leased already: handled even if stop came meanwhile
                        await self._handle(m, handler, nack_delay_s)
                        slots[1] += 1
            finally:
                stopped.cancel()
                if recv is not None and not recv.done():
                    # consume itself was cancelled mid-poll: the poll goes too (and gives
                    # back what it may have leased), instead of leasing for nobody
                    recv.cancel()
                    await asyncio.wait({recv})
                elif (recv is not None and recv is not taken and not recv.cancelled() and recv.exception() is None
                      and recv.result() and names):
                    # cancelled in the turn its answer came: leased for nobody, given back
                    await self._release(names[-1])

        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        # one worker failing (an error consume does not absorb) ends them all
        workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.wait(workers)
        return slots[1]

    async def _handle(self, m: Message, handler, nack_delay_s: float) -> None:
        async def keep_renewing():
            expires = m.expires_at
            while True:
                await asyncio.sleep(renew_delay_s(expires))
                try:
                    expires = await self.renew(m.token)
                except errors.SpoolerError as e:
                    if not keep_renewing_after(log, m, e):
                        return
                except RuntimeError:  # the client was closed under the handler
                    return

        renewer = asyncio.ensure_future(keep_renewing())
        try:
            r = handler(m)
            if inspect.isawaitable(r):
                await r
            ok = True
        except Exception:
            log.exception("handler failed for message %s; nacking", m.id)
            ok = False
        except BaseException:
            # consume was cancelled under the handler (or it raised KeyboardInterrupt or
            # SystemExit): the work is unfinished, so the message goes back now (nacked,
            # without delay, in the background: the cancelled task must not wait)
            # rather than when its lease runs out
            t = asyncio.ensure_future(self._give_back(m))
            self._releases.add(t)  # close() waits for these, briefly
            t.add_done_callback(self._releases.discard)
            raise
        finally:
            renewer.cancel()
        try:
            if ok:
                await self.ack(m.token)
            else:
                await self.nack(m.token, delay_s=nack_delay_s)
        except errors.SpoolerError as e:
            if not settle_failed(log, m, "ack" if ok else "nack", e):
                raise

    async def _give_back(self, m: Message) -> None:
        """A nack of a message whose handler was cut short (cancelled, or interrupted);
        failures are logged only (the lease then runs out as it would have)."""
        try:  # (asyncio.timeout, not wait_for, which on 3.11 can lose a cancellation: node/waits.py)
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                await self._settle_one("nack", m.token, 0.0)
        except (errors.SpoolerError, RuntimeError, TimeoutError) as e:
            log.info("could not give back %s after its handler was cancelled: %r", m.id, e)

    # ----------------------------------------------------------- cluster
    async def cluster(self) -> api_pb2.ClusterInfo:
        self._here()
        return await self._retried("GetCluster", api_pb2.Empty(), write=False)

    async def create_key(self, queue: str = "*", scopes=("send", "receive")) -> api_pb2.KeyInfo:
        self._here()
        return await self._retried("CreateKey", key_request(queue, scopes),
                                write=True)

    async def list_keys(self) -> list:
        """The scoped keys (KeyInfo, without their secrets)."""
        self._here()
        return list((await self._retried("ListKeys", api_pb2.Empty(), write=False)).keys)

    async def delete_key(self, key_id: str) -> None:
        self._here()
        await self._retried("DeleteKey", api_pb2.DeleteKeyRequest(id=key_id), write=True)

    async def promote(self, node: str) -> api_pb2.ClusterInfo:
        """Planned switchover to ``node``; the cluster as it is afterwards."""
        self._here()
        return await self._retried("Promote", api_pb2.PromoteRequest(node=node), write=True)
