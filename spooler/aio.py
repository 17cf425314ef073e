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
import logging
from typing import Awaitable, Callable, Optional

import grpc

from spooler import errors
from spooler._common import (Nodes, Message, SendResult, auth_metadata, call_with_retries,
                             is_batch_entry_error, map_rpc_error, message_of, queue_dict, renew_delay_s,
                             settings_pb)
from spooler.pb import api_pb2, api_pb2_grpc

log = logging.getLogger("spooler.aio")


def _fail_all(batch: list, e: BaseException) -> None:
    for _, fut in batch:
        if not fut.done():
            fut.set_exception(e)


class AsyncClient(Nodes):
    _grpc = grpc.aio

    def __init__(self, target: str = "127.0.0.1:50051", key: str = "", *, timeout_s: float = 30.0,
                 batch_max: int = 100, batches_in_flight_max: int = 4, retry_attempts: int = 5,
                 credentials=None):
        """credentials: grpc channel credentials for a node running mTLS
        (``grpc.ssl_channel_credentials(ca, key, cert)``); None = plaintext."""
        self._init_nodes(target, credentials)
        self.md = auth_metadata(key)
        self.timeout_s = timeout_s
        self.batch_max = batch_max
        self.batches_in_flight_max = batches_in_flight_max
        self.retry_attempts = retry_attempts
        self._pending: list = []     # (SendRequest, Future)
        self._in_flight = 0
        self.send_rpcs = 0           # SendBatch RPCs made by auto-batching (observability, tests)



    async def close(self) -> None:
        for ch in self._old_channels + [self.channel]:
            await ch.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def _call(self, rpc, req, *, write: bool, timeout_s: Optional[float] = None):
        try:
            return await rpc(req, metadata=self.md, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as e:
            err = map_rpc_error(e, write=write)
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self._next_target()
            raise err from None

    # ------------------------------------------------------------- queues
    async def put_queue(self, name: str, **settings) -> dict:
        r = await self._call(self.stub.PutQueue, api_pb2.PutQueueRequest(name=name, settings=settings_pb(settings)),
                             write=True)
        return {**queue_dict(r.queue), "created": r.created}

    async def get_queue(self, name: str) -> dict:
        return queue_dict(await self._call(self.stub.GetQueue, api_pb2.QueueRequest(name=name), write=False))

    async def list_queues(self) -> list:
        r = await self._call(self.stub.ListQueues, api_pb2.ListQueuesRequest(), write=False)
        return [queue_dict(q) for q in r.queues]

    async def delete_queue(self, name: str) -> None:
        await self._call(self.stub.DeleteQueue, api_pb2.QueueRequest(name=name), write=True)

    async def redrive(self, name: str) -> int:
        return (await self._call(self.stub.Redrive, api_pb2.QueueRequest(name=name), write=True)).moved

    # ----------------------------------------------------------- sending
    async def send(self, queue: str, body: bytes, *, delay_s: float = 0.0, dedup_key: str = "") -> SendResult:
        """Auto-batched send. Retried only where a retry is safe (see _common.retry_policy)."""
        req = api_pb2.SendRequest(queue=queue, body=body, delay_seconds=delay_s, dedup_key=dedup_key)

        def enqueue():
            fut = asyncio.get_running_loop().create_future()
            self._pending.append((req, fut))
            if self._in_flight < self.batches_in_flight_max:
                self._in_flight += 1
                asyncio.ensure_future(self._flush())
            return fut

        try:
            return await enqueue()
        except errors.OperationUnconfirmed:
            # a resend is harmless only with a key on a queue that deduplicates
            if not dedup_key or self.retry_attempts <= 1 or not await self._dedups(queue):
                raise
        except errors.Unavailable:
            if self.retry_attempts <= 1:
                raise
        return await call_with_retries(enqueue, self.retry_attempts - 1, send_with_key=True)

    async def _dedups(self, queue: str) -> bool:
        try:
            return (await self.get_queue(queue))["settings"]["dedupWindowSeconds"] > 0
        except errors.SpoolerError:
            return False

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch = self._pending[:self.batch_max]
                del self._pending[:self.batch_max]
                await self._send_batch_now(batch)
        finally:
            self._in_flight -= 1

    async def _send_batch_now(self, batch: list) -> None:
        self.send_rpcs += 1
        try:
            r = await self._call(self.stub.SendBatch, api_pb2.SendBatchRequest(entries=[b[0] for b in batch]),
                                 write=True)
        except errors.SpoolerError as e:
            if len(batch) > 1 and is_batch_entry_error(e):
                # refused before anything was stored: one bad entry fails the whole
                # batch, so send each alone and only it fails
                for one in batch:
                    await self._send_batch_now([one])
                return
            _fail_all(batch, e)
            return
        except BaseException as e:  # never leave a caller waiting (closed channel, cancellation)
            _fail_all(batch, e if isinstance(e, Exception) else errors.Unavailable("send was cancelled"))
            raise
        for (_, fut), res in zip(batch, r.results):
            if fut.done():
                continue
            if res.HasField("error"):
                fut.set_exception(errors.from_detail(res.error))
            else:
                fut.set_result(SendResult(res.id, res.duplicate))

    async def send_batch(self, queue: str, bodies: list, *, delay_s: float = 0.0) -> list:
        """One RPC, one log record: all stored or none."""
        req = api_pb2.SendBatchRequest(entries=[api_pb2.SendRequest(queue=queue, body=b, delay_seconds=delay_s)
                                                for b in bodies])
        r = await self._call(self.stub.SendBatch, req, write=True)
        return [SendResult(x.id, x.duplicate) for x in r.results]

    # --------------------------------------------------------- receiving
    async def receive(self, queue: str, *, wait_s: float = 0.0, max_messages: int = 1) -> list:
        req = api_pb2.ReceiveRequest(queue=queue, wait_seconds=wait_s, max_messages=max_messages)
        rpc = self.stub.ReceiveBatch if max_messages > 1 else self.stub.Receive
        r = await self._call(rpc, req, write=False, timeout_s=self.timeout_s + wait_s)
        return [message_of(d) for d in r.messages]

    async def _settle(self, rpc, req) -> object:
        maybe_landed = False  # an earlier attempt's outcome is unknown

        async def once():
            nonlocal maybe_landed
            try:
                return await self._call(rpc, req, write=True)
            except errors.StaleLease as e:
                if maybe_landed and e.reason == errors.StaleLease.SETTLED:
                    return None  # our earlier attempt landed
                raise
            except errors.OperationUnconfirmed:
                maybe_landed = True
                raise

        return await call_with_retries(once, self.retry_attempts, settle=True)

    async def ack(self, token: str) -> None:
        await self._settle(self.stub.Ack, api_pb2.LeaseRequest(token=token))

    async def nack(self, token: str, *, delay_s: float = 0.0) -> None:
        await self._settle(self.stub.Nack, api_pb2.LeaseRequest(token=token, delay_seconds=delay_s))

    async def renew(self, token: str) -> str:
        async def once():
            return (await self._call(self.stub.Renew, api_pb2.LeaseRequest(token=token), write=True)).expires_at

        return await call_with_retries(once, self.retry_attempts, settle=True)

    async def settle_batch(self, items: list) -> list:
        """items: [(token, "ack"|"nack"|"renew", delay_s)] -> per item None / expiresAt / SpoolerError."""
        actions = {"ack": api_pb2.SETTLE_ACK, "nack": api_pb2.SETTLE_NACK, "renew": api_pb2.SETTLE_RENEW}
        req = api_pb2.SettleBatchRequest(items=[api_pb2.SettleBatchRequest.Item(
            token=t, action=actions[a], delay_seconds=d) for t, a, d in items])
        r = await self._call(self.stub.SettleBatch, req, write=True)
        return [errors.from_detail(x.error) if x.HasField("error") else (x.expires_at or None) for x in r.results]

    # --------------------------------------------------------- consuming
    async def consume(self, queue: str, handler: Callable[[Message], Awaitable[None]], *, concurrency: int = 1,
                      wait_s: float = 20.0, nack_delay_s: float = 0.0,
                      stop: Optional[asyncio.Event] = None) -> None:
        """Run ``handler`` for each message: the lease is renewed while it runs;
        it is acked when the handler returns and nacked when it raises."""
        stop = stop or asyncio.Event()

        async def worker():
            while not stop.is_set():
                try:
                    msgs = await self.receive(queue, wait_s=wait_s)
                except errors.Unavailable:
                    await asyncio.sleep(0.2)
                    continue
                for m in msgs:
                    await self._handle(m, handler, nack_delay_s)

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def _handle(self, m: Message, handler, nack_delay_s: float) -> None:
        async def keep_renewing():
            expires = m.expires_at
            while True:
                await asyncio.sleep(renew_delay_s(expires))
                expires = await self.renew(m.token)

        renewer = asyncio.ensure_future(keep_renewing())
        try:
            await handler(m)
        except Exception:
            log.exception("handler failed for message %s; nacking", m.id)
            renewer.cancel()
            try:
                await self.nack(m.token, delay_s=nack_delay_s)
            except errors.StaleLease:
                pass
            return
        finally:
            renewer.cancel()
        try:
            await self.ack(m.token)
        except errors.StaleLease as e:
            log.warning("ack of %s came too late (%s): it will be delivered again", m.id, e.reason)

    # ----------------------------------------------------------- cluster
    async def cluster(self) -> api_pb2.ClusterInfo:
        return await self._call(self.stub.GetCluster, api_pb2.Empty(), write=False)

    async def create_key(self, queue: str = "*", scopes=("send", "receive")) -> api_pb2.KeyInfo:
        return await self._call(self.stub.CreateKey, api_pb2.CreateKeyRequest(queue=queue, scopes=list(scopes)),
                                write=True)
