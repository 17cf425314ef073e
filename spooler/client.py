"""Synchronous gRPC client (thread-safe).

``send()`` is auto-batched like the asyncio client's: sends from many threads
coalesce into SendBatch RPCs, at most ``batches_in_flight_max`` at once.

    with Client("127.0.0.1:50051", key) as c:
        c.put_queue("jobs")
        c.send("jobs", b"hello")
        for m in c.receive("jobs", wait_s=5):
            c.ack(m.token)
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import grpc

from spooler import errors
from spooler._common import (MOVE_ON, Nodes, entry_bytes, LeaseEnd, key_request, keep_renewing_after, batch_size, check_batch, check_send_types, Message, SendResult, batch_request, settle_outcomes, batch_results, call_with_retries_sync,
                             map_rpc_error, messages_of, queue_dict, renew_delay_s, resend_groups, send_outcomes, settle_after_unconfirmed,
                             settings_pb, DedupWindow, RECEIVE_DEFINITE, RELEASE_TIMEOUT_S, note_release_failure, receive_request, lease_request,
                             release_request, settle_failed, settle_request, unconfirmed_after)
from spooler.pb import api_pb2

log = logging.getLogger("spooler.client")


def _settle_futures(batch: list, result=None, error: Optional[BaseException] = None) -> None:
    for _, fut in batch:
        if fut.done() or not fut.set_running_or_notify_cancel():
            continue  # the caller cancelled it
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


class Client(Nodes):
    _grpc = grpc

    def _init_client(self) -> None:
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=self.batches_in_flight_max, thread_name_prefix="spooler-send")
        self._closed = False  # close() began: no new sends, acks or nacks, no retries
        self._shut = False    # close() has sent what it held: no calls at all
        self._settles = 0     # acks, nacks and settle_batches in progress (close waits for them)
        self._settled = threading.Condition(self._lock)  # notified as each of those ends

    def _gone(self) -> bool:
        """close() began: a failed call is not tried again (its channel is closing)."""
        return self._closed

    def close(self) -> None:
        """Sends already handed to the client still go out, and acks, nacks and
        settle_batches already called (in other threads) get their answers (within
        its timeout); then the channels close. (An ack cut off here would cost its
        message a redelivery.)"""
        with self._lock:
            self._closed = True
            self._settled.wait_for(lambda: not self._settles, timeout=self.timeout_s)
        self._pool.shutdown(wait=True)  # the sends already handed over go out
        self._shut = True
        with self._lock:  # (a failing call moves the client under this lock: _failed)
            self._channels_closed = True
        for ch in self._all_channels():
            ch.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method: str, req, *, write: bool, timeout_s: Optional[float] = None):
        if self._shut:
            raise RuntimeError("the client is closed")
        ch, stub = self._current  # one node's pair: a failure is charged to the channel it used
        rpc = getattr(stub, method)
        try:
            return rpc(req, metadata=self.md, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as e:
            raise self._failed(e, write, ch) from None
        except ValueError:  # grpc's "Cannot invoke RPC on closed channel!": close() ran meanwhile
            if self._shut:
                raise RuntimeError("the client is closed") from None
            raise

    def _retried(self, method: str, req, *, write: bool):
        """As AsyncClient._retried."""
        return call_with_retries_sync(lambda: self._call(method, req, write=write),
                                      self.retry_attempts, stop_when=self._gone)

    def _failed(self, e: grpc.RpcError, write: bool, ch) -> errors.SpoolerError:
        """The SpoolerError for a failed call on channel ``ch``; moves on to the next
        node when that one was unreachable or did not answer in time."""
        err = map_rpc_error(e, write=write)
        if e.code() in MOVE_ON and not errors.stay_on(err):
            with self._lock:
                self._next_target(ch)
        return err

    # ------------------------------------------------------------- queues
    def put_queue(self, name: str, **settings) -> dict:
        r = self._retried("PutQueue", api_pb2.PutQueueRequest(name=name, settings=settings_pb(settings)),
                       write=True)
        return {**queue_dict(r.queue), "created": r.created}

    def get_queue(self, name: str) -> dict:
        return queue_dict(self._retried("GetQueue", api_pb2.QueueRequest(name=name), write=False))

    def list_queues(self) -> list:
        return [queue_dict(q) for q in self._retried("ListQueues", api_pb2.ListQueuesRequest(),
                                                  write=False).queues]

    def delete_queue(self, name: str) -> None:
        self._retried("DeleteQueue", api_pb2.QueueRequest(name=name), write=True)

    def redrive(self, name: str) -> int:
        return self._retried("Redrive", api_pb2.QueueRequest(name=name), write=True).moved

    def purge(self, name: str) -> int:
        """Every message of the queue goes, leased ones too; -> how many it held."""
        return self._retried("Purge", api_pb2.QueueRequest(name=name), write=True).purged

    # ----------------------------------------------------------- sending
    def send(self, queue: str, body: bytes, *, delay_s: float = 0.0, dedup_key: str = "") -> SendResult:
        """Auto-batched send; blocks until durable. Retried only where safe."""
        check_send_types(queue, body, delay_s, dedup_key)
        req = api_pb2.SendRequest(queue=queue, body=body, delay_seconds=delay_s, dedup_key=dedup_key)
        t0 = time.monotonic()
        try:
            return self.send_async(req).result()
        except errors.OperationUnconfirmed as e:
            # a resend is harmless only with a key, inside the queue's dedup window
            if not dedup_key or self.retry_attempts <= 1:
                raise
            window = DedupWindow(t0, self._dedup_window_s(queue), self.timeout_s, maybe_landed=True)
            if window.used_up():
                raise
            first = e
        except errors.Unavailable as e:
            if self.retry_attempts <= 1:
                raise
            # not accepted: a resend is safe. Whether a LATER unconfirmed attempt may be
            # resent too depends, as above, on a key and the queue's dedup window.
            window = DedupWindow(t0, self._dedup_window_s(queue) if dedup_key else 0.0, self.timeout_s,
                                 maybe_landed=False)
            first = e

        def again():
            try:
                return self.send_async(req).result()
            except errors.SpoolerError as e:
                window.noting(e)
                if isinstance(e, errors.Unavailable) and window.maybe_landed:
                    raise unconfirmed_after(e) from e
                raise
        # a close() meanwhile stops the resends with the last attempt's error (as AsyncClient)
        return call_with_retries_sync(again, self.retry_attempts - 1, first_failed=first,
                                      send_with_key=window.window_s > 0,
                                      stop_when=lambda: window.used_up() or self._gone())

    def _dedup_window_s(self, queue: str) -> float:
        """As AsyncClient._dedup_window_s."""
        try:
            q = self.get_queue(queue)  # retried after unavailable
            return float(q["settings"]["dedupWindowSeconds"])
        except (errors.SpoolerError, RuntimeError):  # (RuntimeError: the client was closed meanwhile)
            return 0.0

    def send_async(self, req: api_pb2.SendRequest) -> Future:
        fut: Future = Future()
        with self._lock:  # (close() sets _closed under it, then shuts the pool down)
            if self._closed:
                raise RuntimeError("the client is closed")
            self._pending.append((req, fut))
            if self._in_flight < self.batches_in_flight_max:
                self._in_flight += 1
                try:
                    self._pool.submit(self._flush)
                except BaseException:  # (the interpreter is shutting down): this send never leaves
                    self._in_flight -= 1
                    self._pending.pop()  # (ours: appended above, under the same lock)
                    raise
        return fut

    def _flush(self) -> None:
        """Sends batches until none is pending. A flush ends only under the lock and
        only with nothing pending, so a send appended meanwhile is never left
        without one (send_async starts another while fewer than the maximum run)."""
        while True:
            with self._lock:
                if not self._pending:
                    self._in_flight -= 1
                    return
                n = batch_size(self._pending, self.batch_max,
                               lambda x: entry_bytes(x[0].queue, x[0].body, x[0].dedup_key))
                # a send whose future its caller cancelled while it waited here never leaves
                batch = [x for x in self._pending[:n] if not x[1].done()]
                del self._pending[:n]
            if not batch:
                continue
            try:
                self._send_batch_now(batch)
            except Exception:  # noqa: BLE001 - its callers were told; the next batch still goes
                log.exception("a send batch failed unexpectedly")

    def _send_batch_now(self, batch: list) -> None:
        self.send_rpcs += 1
        try:
            r = self._call("SendBatch", batch_request([(e.queue, e.body, e.delay_seconds, e.dedup_key)
                                                               for e, _ in batch], compact=False), write=True)
        except errors.SpoolerError as e:
            groups = resend_groups(e, [x.queue for x, _ in batch])
            if groups is not None:
                # refused before anything was stored (one bad entry, or one full
                # queue): sent again in parts, so only the part at fault fails
                for i, g in enumerate(groups):
                    part = [batch[j] for j in g if not batch[j][1].done()]  # (not a future cancelled meanwhile)
                    if not part:
                        continue
                    try:
                        self._send_batch_now(part)
                    except Exception:  # noqa: BLE001 - its own callers were told; the other parts still go
                        log.exception("a part of a refused send batch failed unexpectedly")
                    except BaseException:  # cut short: the rest never left, and must not wait forever
                        _settle_futures([batch[j] for h in groups[i + 1:] for j in h],
                                        error=errors.Unavailable("not sent: its batch's resend was cut short"))
                        raise
                return
            _settle_futures(batch, error=e)
            return
        except BaseException as e:  # never leave a caller waiting
            _settle_futures(batch, error=e)
            raise
        try:
            outcomes = send_outcomes(r, len(batch))
        except errors.SpoolerError as e:  # not one outcome per caller: none can be told which is theirs
            _settle_futures(batch, error=e)
            return
        for (_, fut), res in zip(batch, outcomes):
            if isinstance(res, errors.SpoolerError):
                _settle_futures([(None, fut)], error=res)
            else:
                _settle_futures([(None, fut)], result=res)

    def send_batch(self, queue: str, bodies: list, *, delay_s: float = 0.0) -> list:
        """One RPC, one log record: all stored or none. Tried again after
        ``unavailable`` only (known not stored)."""
        bodies = list(bodies)
        check_batch(queue, bodies, delay_s)
        req = batch_request([(queue, b, delay_s, "") for b in bodies], compact=False)
        return batch_results(self._retried("SendBatch", req, write=True), len(bodies))

    # --------------------------------------------------------- receiving
    def receive(self, queue: str, *, wait_s: float = 0.0, max_messages: int = 1) -> list:
        """Tried again after ``unavailable`` (each attempt a receive of its own name:
        one that may have leased something is given back first)."""
        return call_with_retries_sync(lambda: self._receive_unless(None, queue, wait_s, max_messages),
                                      self.retry_attempts, stop_when=self._gone, receive=True)

    def _receive_unless(self, stop: Optional[threading.Event], queue: str, wait_s: float,
                        max_messages: int = 1) -> list:
        """``receive``; ``stop`` (consume's) may interrupt it: the long poll is then
        cancelled (and whatever it may have leased given back) instead of being
        waited out, so that ``consume`` returns soon after ``stop`` is set."""
        req = receive_request(queue, wait_s, max_messages)  # (refuses a count below 1)
        if self._shut:
            raise RuntimeError("the client is closed")
        ch, stub = self._current  # (as in _call)
        rpc = stub.Receive if max_messages == 1 else stub.ReceiveBatch
        started = time.monotonic()  # no later than the primary granted the leases
        fut = rpc.future(req, metadata=self.md, timeout=self.timeout_s + wait_s)
        try:
            while stop is not None and not fut.done():
                if stop.wait(0.05):
                    fut.cancel()
                    self._release(req)
                    return []
            r = fut.result()
        except grpc.FutureCancelledError:
            return []
        except grpc.RpcError as e:
            err = self._failed(e, False, ch)
            if not isinstance(err, RECEIVE_DEFINITE):
                self._release(req)
            raise err from None
        return messages_of(r, started)

    def _release(self, req) -> None:
        """As AsyncClient._release: one attempt to give back a lost answer's leases."""
        ch, stub = self._current
        if self._no_release.lacks(ch):
            return
        try:
            stub.ReleaseReceive(release_request(req), metadata=self.md, timeout=RELEASE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - e.g. the channel closed meanwhile: never replace the receive's error
            note_release_failure(self, e, log, ch)

    @contextlib.contextmanager
    def _waited_for_by_close(self):
        """An ack or nack (or settle_batch) that close() lets finish; one called
        after close() began is refused."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the client is closed")
            self._settles += 1
        try:
            yield
        finally:
            with self._lock:
                self._settles -= 1
                self._settled.notify_all()

    def _settle(self, method: str, req, answer=None):
        """``method``: the stub's method name, looked up for every attempt, so that a
        retry after a move to another node goes there, not to the node that failed.
        ``answer(response, when the attempt began)``: what the caller gets."""
        state = {"maybe_landed": False}  # an earlier attempt's outcome is unknown

        def once():
            try:
                started = time.monotonic()
                r = self._call(method, req, write=True)
                return answer(r, started) if answer is not None else r
            except errors.StaleLease as e:
                if state["maybe_landed"] and method != "Renew":
                    settle_after_unconfirmed(e)  # our earlier attempt landed (returns), or may have
                    return None
                raise
            except errors.OperationUnconfirmed:
                state["maybe_landed"] = True
                raise
            except errors.Unavailable as e:
                if state["maybe_landed"]:
                    raise unconfirmed_after(e) from e
                raise

        if method == "Renew":  # close() waits for acks and nacks, not renewals (as AsyncClient)
            return call_with_retries_sync(once, self.retry_attempts, settle=True, stop_when=self._gone)
        with self._waited_for_by_close():
            return call_with_retries_sync(once, self.retry_attempts, settle=True, stop_when=self._gone)

    def ack(self, token: str) -> None:
        self._settle("Ack", lease_request(token))

    def nack(self, token: str, *, delay_s: float = 0.0) -> None:
        self._settle("Nack", lease_request(token, delay_s))

    def renew(self, token: str) -> str:
        """-> the new expiresAt (a LeaseEnd). Retried as ack and nack are (S6a: after
        an attempt whose outcome is unknown, a refused retry is operation_unconfirmed)."""
        return self._settle("Renew", lease_request(token),
                            answer=lambda r, started: LeaseEnd(r.expires_at, r.lease_seconds_left, started))

    def settle_batch(self, items: list) -> list:
        """items: [(token, "ack"|"nack"|"renew"[, delay_s])] -> per item None / expiresAt / SpoolerError."""
        req = settle_request(items)
        started = time.monotonic()
        with self._waited_for_by_close():
            r = self._retried("SettleBatch", req, write=True)  # after unavailable only: per-item answers are final
        return settle_outcomes(r, len(req.items), started)

    # --------------------------------------------------------- consuming
    def consume(self, queue: str, handler: Callable[[Message], None], *, wait_s: float = 20.0,
                nack_delay_s: float = 0.0, stop: Optional[threading.Event] = None, max_messages: int = 0) -> int:
        """Run ``handler`` for each message in this thread: the lease is renewed
        while it runs; ack when it returns, nack when it raises. Returns the
        number handled once ``stop`` is set (or ``max_messages`` were handled).
        Outages are ridden out as in ``AsyncClient.consume``: an ack or nack that
        cannot be confirmed is logged, and the message may come again."""
        stop = stop or threading.Event()
        handled = 0
        while not stop.is_set() and (not max_messages or handled < max_messages):
            try:
                msgs = self._receive_unless(stop, queue, wait_s)
            except errors.Unavailable:
                stop.wait(0.2)
                continue
            for m in msgs:
                self.handle(m, handler, nack_delay_s)
                handled += 1
        return handled

    def handle(self, m: Message, handler: Callable[[Message], None], nack_delay_s: float = 0.0) -> bool:
        """One message: renew in the background while ``handler`` runs, then settle.
        Returns whether the handler succeeded. An ack or nack that cannot be
        confirmed (stale lease, or no answer past the retries) is logged, not
        raised: the message may be delivered again."""
        done = threading.Event()

        def keep_renewing():
            expires = m.expires_at
            while not done.wait(renew_delay_s(expires)):
                try:
                    expires = self.renew(m.token)
                except errors.SpoolerError as e:
                    if done.is_set():  # the handler is over: its ack or nack speaks for the lease
                        return
                    if not keep_renewing_after(log, m, e):
                        return
                except RuntimeError:  # the client was closed under the handler
                    return

        # The renewer is not waited for once the handler is over (as AsyncClient cancels
        # its own): a renewal on its way (with its retries, through a failover) would
        # hold the ack or nack back; it is harmless beside them (the node answers it
        # stale or settled, or extends a lease that the settle then ends).
        t = threading.Thread(target=keep_renewing, daemon=True)
        t.start()
        try:
            handler(m)
            ok = True
        except Exception:
            log.exception("handler failed for message %s; nacking", m.id)
            ok = False
        except BaseException:
            # the handler was cut short (Ctrl-C, sys.exit from a signal handler): the
            # work is unfinished, so the message goes back now rather than when its
            # lease runs out; one attempt, and the interruption goes on
            done.set()
            try:
                self._call("Nack", api_pb2.LeaseRequest(token=m.token), write=True,
                           timeout_s=RELEASE_TIMEOUT_S)
            except (errors.SpoolerError, RuntimeError) as e:
                log.info("could not give back %s after its handler was interrupted: %r", m.id, e)
            raise
        finally:
            done.set()
        try:
            if ok:
                self.ack(m.token)
            else:
                self.nack(m.token, delay_s=nack_delay_s)
        except errors.SpoolerError as e:
            if not settle_failed(log, m, "ack" if ok else "nack", e):
                raise
        return ok

    # ----------------------------------------------------------- cluster
    def cluster(self) -> api_pb2.ClusterInfo:
        return self._retried("GetCluster", api_pb2.Empty(), write=False)

    def create_key(self, queue: str = "*", scopes=("send", "receive")) -> api_pb2.KeyInfo:
        return self._retried("CreateKey", key_request(queue, scopes), write=True)

    def list_keys(self) -> list:
        """The scoped keys (KeyInfo, without their secrets)."""
        return list(self._retried("ListKeys", api_pb2.Empty(), write=False).keys)

    def delete_key(self, key_id: str) -> None:
        self._retried("DeleteKey", api_pb2.DeleteKeyRequest(id=key_id), write=True)

    def promote(self, node: str) -> api_pb2.ClusterInfo:
        """Planned switchover to ``node``; the cluster as it is afterwards."""
        return self._retried("Promote", api_pb2.PromoteRequest(node=node), write=True)
