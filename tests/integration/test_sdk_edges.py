"""Both SDK clients against a stand-in node that answers what a real one rarely
does: one full queue in a mixed auto-batch, an ack whose retry meets a primary
change, a close() while a keyed send is being sent again."""
import asyncio
import threading
from concurrent import futures

import grpc
import pytest

from nodeproc import wait_until
from spooler import AsyncClient, Client, errors
from spooler.pb import api_pb2


def _unary_only(c: AsyncClient) -> AsyncClient:
    """The asyncio client as against a node without a Session: it goes straight to
    the unary calls (a stand-in's missing Session can end INTERNAL rather than
    UNIMPLEMENTED, which would make the first call's outcome unknown)."""
    c.session.supported = False
    return c


class FakeNode:
    """A sync gRPC server with the unary handlers given (method name -> fn(req, ctx));
    no Session, so both clients use the unary calls. Counts calls per method."""

    def __init__(self, port: int = 0, **handlers):
        self.calls = {name: 0 for name in handlers}
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        types = {"SendBatch": (api_pb2.SendBatchRequest, api_pb2.SendBatchResponse),
                 "GetQueue": (api_pb2.QueueRequest, api_pb2.Queue),
                 "Ack": (api_pb2.LeaseRequest, api_pb2.Empty),
                 "Renew": (api_pb2.LeaseRequest, api_pb2.RenewResponse),
                 "Receive": (api_pb2.ReceiveRequest, api_pb2.ReceiveResponse),
                 "ReleaseReceive": (api_pb2.ReleaseReceiveRequest, api_pb2.ReleaseReceiveResponse)}

        def counted(name, fn):
            def call(req, ctx):
                self.calls[name] += 1
                return fn(req, ctx, self.calls[name])
            return call

        rpcs = {name: grpc.unary_unary_rpc_method_handler(counted(name, fn), request_deserializer=types[name][0].FromString,
                                                          response_serializer=types[name][1].SerializeToString)
                for name, fn in handlers.items()}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("spooler.v1.Spooler", rpcs),))
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()
        self.target = f"127.0.0.1:{self.port}"

    def stop(self):
        self.server.stop(None)


def _refuse(ctx, e: errors.SpoolerError):
    ctx.set_trailing_metadata(errors.grpc_trailers(e))
    ctx.abort(errors.grpc_status_code(e), e.message)


@pytest.fixture
def mixed_node():
    """SendBatch refuses a whole batch that holds queue "full" (as a node does at
    a queue's message cap); its first call is slow, so later sends pile up into
    one batch behind it."""
    gate = threading.Event()

    def send_batch(req, ctx, n):
        if n == 1:
            gate.wait(10)
        if any(e.queue == "full" for e in req.entries):
            _refuse(ctx, errors.Unavailable("queue 'full' holds its maximum of messages", retry_after_s=1.0))
        return api_pb2.SendBatchResponse(results=[api_pb2.SendResponse(id=f"{e.queue}-{i}")
                                                  for i, e in enumerate(req.entries)])

    node = FakeNode(SendBatch=send_batch)
    node.gate = gate
    yield node
    gate.set()
    node.stop()


def test_one_full_queue_fails_only_its_own_sends_in_a_mixed_batch_sync(mixed_node):
    with Client(mixed_node.target, "k", retry_attempts=1, batches_in_flight_max=1, timeout_s=10) as c:
        first = c.send_async(api_pb2.SendRequest(queue="ok", body=b"0"))
        wait_until(lambda: mixed_node.calls["SendBatch"] >= 1, 10, what="the first batch on its way")
        later = [(q, c.send_async(api_pb2.SendRequest(queue=q, body=b"x"))) for q in ["ok", "full"] * 4]
        mixed_node.gate.set()
        assert first.result(10)
        for q, f in later:
            if q == "ok":
                assert f.result(10).id.startswith("ok-"), "a send to a queue with room failed for another's"
            else:
                with pytest.raises(errors.Unavailable):
                    f.result(10)


def test_one_full_queue_fails_only_its_own_sends_in_a_mixed_batch_async(mixed_node):
    async def main():
        async with _unary_only(AsyncClient(mixed_node.target, "k", retry_attempts=1, batches_in_flight_max=1,
                                           timeout_s=10)) as c:
            first = asyncio.ensure_future(c.send("ok", b"0"))
            deadline = asyncio.get_running_loop().time() + 10
            while mixed_node.calls["SendBatch"] < 1:
                assert asyncio.get_running_loop().time() < deadline, "the first batch never reached the node"
                await asyncio.sleep(0.01)
            later = [(q, asyncio.ensure_future(c.send(q, b"x"))) for q in ["ok", "full"] * 4]
            deadline = asyncio.get_running_loop().time() + 10
            while len(c._pending) < len(later):  # all of them queued behind the first batch
                assert asyncio.get_running_loop().time() < deadline, "the sends were not queued"
                await asyncio.sleep(0.01)
            mixed_node.gate.set()
            await first
            for q, t in later:
                if q == "ok":
                    assert (await t).id.startswith("ok-"), "a send to a queue with room failed for another's"
                else:
                    with pytest.raises(errors.Unavailable):
                        await t

    asyncio.run(main())


@pytest.fixture
def changed_primary_node():
    """Ack: the first attempt ends with no answer (outcome unknown), the retry
    meets stale_lease/primary_changed."""
    def ack(req, ctx, n):
        if n == 1:
            ctx.abort(grpc.StatusCode.CANCELLED, "the node went away")
        _refuse(ctx, errors.StaleLease("predates a primary change", reason=errors.StaleLease.PRIMARY_CHANGED))

    node = FakeNode(Ack=ack)
    yield node
    node.stop()


def test_an_ack_whose_retry_meets_a_primary_change_is_unconfirmed_sync(changed_primary_node):
    with Client(changed_primary_node.target, "k", timeout_s=10) as c:
        with pytest.raises(errors.OperationUnconfirmed):
            c.ack("t" * 40)
    assert changed_primary_node.calls["Ack"] == 2


def test_an_ack_whose_retry_meets_a_primary_change_is_unconfirmed_async(changed_primary_node):
    async def main():
        async with _unary_only(AsyncClient(changed_primary_node.target, "k", timeout_s=10)) as c:
            with pytest.raises(errors.OperationUnconfirmed):
                await c.ack("t" * 40)

    asyncio.run(main())
    assert changed_primary_node.calls["Ack"] == 2


@pytest.fixture
def renew_unknown_then_refused_node():
    """Renew: the first attempt ends with no answer (outcome unknown: it may have
    renewed the lease), every retry is refused unavailable."""
    def renew(req, ctx, n):
        if n == 1:
            ctx.abort(grpc.StatusCode.CANCELLED, "the node went away")
        _refuse(ctx, errors.Unavailable("node is not serving", retry_after_s=0.05))

    node = FakeNode(Renew=renew)
    yield node
    node.stop()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_renew_whose_retries_end_refused_after_an_unknown_outcome_is_unconfirmed(
        renew_unknown_then_refused_node, kind):
    """S6a: the first renewal may have taken effect, so a caller must not hear
    "unavailable" (not accepted) when the retries are refused: it hears
    operation_unconfirmed, from both clients (the sync one said unavailable)."""
    node = renew_unknown_then_refused_node
    if kind == "sync":
        with Client(node.target, "k", timeout_s=10) as c:
            with pytest.raises(errors.OperationUnconfirmed):
                c.renew("t" * 40)
    else:
        async def main():
            async with _unary_only(AsyncClient(node.target, "k", timeout_s=10)) as c:
                with pytest.raises(errors.OperationUnconfirmed):
                    await c.renew("t" * 40)
        asyncio.run(main())
    assert node.calls["Renew"] >= 2


@pytest.fixture
def unconfirmed_node():
    """Every send's outcome is unknown (no answer in time); the queue has a dedup
    window, so a keyed send is sent again."""
    def send_batch(req, ctx, n):
        ctx.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer in time")

    def get_queue(req, ctx, n):
        return api_pb2.Queue(name=req.name, settings=api_pb2.Settings(dedup_window_seconds=3600))

    node = FakeNode(SendBatch=send_batch, GetQueue=get_queue)
    yield node
    node.stop()


def test_close_during_a_keyed_resend_leaves_the_unknown_outcome_sync(unconfirmed_node):
    """close() while a keyed send waits to be sent again: the caller hears
    operation_unconfirmed (its message may be stored), not 'the client is closed'."""
    c = Client(unconfirmed_node.target, "k", timeout_s=10)
    out = {}

    def send():
        try:
            c.send("q", b"x", dedup_key="k1")
        except BaseException as e:  # noqa: BLE001 - what the caller hears is the point
            out["e"] = e

    t = threading.Thread(target=send)
    t.start()
    wait_until(lambda: unconfirmed_node.calls["GetQueue"] >= 1 and unconfirmed_node.calls["SendBatch"] >= 1, 10,
               what="an attempt failed unconfirmed")
    c.close()
    t.join(30)
    assert isinstance(out.get("e"), errors.OperationUnconfirmed), repr(out.get("e"))


def test_close_during_a_keyed_resend_leaves_the_unknown_outcome_async(unconfirmed_node):
    async def main():
        c = _unary_only(AsyncClient(unconfirmed_node.target, "k", timeout_s=10))
        t = asyncio.ensure_future(c.send("q", b"x", dedup_key="k1"))
        deadline = asyncio.get_running_loop().time() + 10
        while unconfirmed_node.calls["GetQueue"] < 1 or unconfirmed_node.calls["SendBatch"] < 1:
            assert asyncio.get_running_loop().time() < deadline, "the keyed resend never began"
            await asyncio.sleep(0.005)
        await c.close()
        with pytest.raises(errors.OperationUnconfirmed):
            await t

    asyncio.run(main())


def test_a_part_of_a_refused_batch_that_fails_oddly_leaves_no_caller_waiting(caplog):
    """An auto-batch refused for one bad entry is sent again entry by entry; one of
    those answers cannot even be read (a garbled error detail): its caller hears
    of it, and the entries after it are still sent and answered, instead of
    their callers waiting forever."""
    gate = threading.Event()

    def send_batch(req, ctx, n):
        if n == 1:
            gate.wait(10)
        queues = [e.queue for e in req.entries]
        if "bad" in queues and len(queues) > 1:
            _refuse(ctx, errors.QueueNotFound("no queue 'bad'"))
        if queues == ["bad"]:
            ctx.set_trailing_metadata((("grpc-status-details-bin", b"\xff\xfe not a status"),))
            ctx.abort(grpc.StatusCode.NOT_FOUND, "garbled")
        return api_pb2.SendBatchResponse(results=[api_pb2.SendResponse(id=f"{q}-{i}") for i, q in enumerate(queues)])

    node = FakeNode(SendBatch=send_batch)
    try:
        with Client(node.target, "k", retry_attempts=1, batches_in_flight_max=1, timeout_s=10) as c:
            first = c.send_async(api_pb2.SendRequest(queue="ok", body=b"0"))
            wait_until(lambda: node.calls["SendBatch"] >= 1, 10, what="the first batch on its way")
            bad = c.send_async(api_pb2.SendRequest(queue="bad", body=b"x"))
            oks = [c.send_async(api_pb2.SendRequest(queue="ok", body=b"y")) for _ in range(2)]
            gate.set()
            assert first.result(10)
            with pytest.raises(errors.SpoolerError):  # (not the result's own TimeoutError: a caller left waiting)
                bad.result(10)
            assert all(f.result(10).id.startswith("ok-") for f in oks)
    finally:
        gate.set()
        node.stop()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_node_back_after_an_outage_is_reached_within_one_calls_retries(kind):
    """A client that has failed to connect for a while must reach the node within
    its own retry schedule (3.1 s) once the node is back. gRPC's default reconnect
    backoff grows by 1.6 times per failed attempt up to 120 s, and a channel
    waiting it out fails every call at once; the clients cap it at 1 s. Here a
    listener that accepts and closes every connection counts the client's
    attempts (each a failed handshake); right after the sixth, the real node
    takes the port. Uncapped, the next attempt would come 5 s or more later."""
    import socket
    import time
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    port = lsock.getsockname()[1]
    target = f"127.0.0.1:{port}"
    stop, done, attempts = threading.Event(), [], []

    def call_until_answered():
        async def calls_async():
            async with AsyncClient(target, "k", timeout_s=2.0) as c:
                while not stop.is_set():
                    try:
                        done.append((time.monotonic(), await c.get_queue("q")))
                        return
                    except errors.Unavailable:
                        pass
        if kind == "async":
            asyncio.run(calls_async())
            return
        with Client(target, "k", timeout_s=2.0) as c:
            while not stop.is_set():
                try:
                    done.append((time.monotonic(), c.get_queue("q")))
                    return
                except errors.Unavailable:
                    pass

    caller = threading.Thread(target=call_until_answered, daemon=True)
    caller.start()
    node = None
    try:
        lsock.settimeout(60)
        while len(attempts) < 6:
            conn, _ = lsock.accept()
            attempts.append(time.monotonic())
            conn.close()
        lsock.close()
        up = time.monotonic()
        node = FakeNode(port, GetQueue=lambda req, ctx, n: api_pb2.Queue(name=req.name))
        wait_until(lambda: done, 20, what="a call answered")
        assert done[0][0] - up < 3.1, f"answered {done[0][0] - up:.2f} s after the node was back"
    finally:
        stop.set()
        caller.join(timeout=30)
        if node is not None:
            node.stop()
        lsock.close()


def test_a_sync_close_does_not_wait_for_a_renewal_in_flight():
    """close() waits for acks and nacks in flight (their answers say whether a
    message comes back), not for a renewal: as the asyncio client. A renewal sent
    to a node that does not answer must not hold close() for the call's timeout."""
    gate = threading.Event()

    def renew(req, ctx, n):
        gate.wait(30)
        return api_pb2.RenewResponse()

    node = FakeNode(Renew=renew)
    c = Client(node.target, "k", timeout_s=30)
    renewing = threading.Thread(target=lambda: pytest.raises(Exception, c.renew, "t" * 40), daemon=True)
    closing = threading.Thread(target=c.close, daemon=True)
    try:
        renewing.start()
        wait_until(lambda: node.calls["Renew"] == 1, 10, what="the renewal at the node")
        closing.start()
        # (the node's answer waits for the gate, set only below: close() returned without it)
        wait_until(lambda: not closing.is_alive(), 3, what="close() returned with the renewal unanswered")
    finally:
        gate.set()
        renewing.join(timeout=30)
        closing.join(timeout=30)
        node.stop()


@pytest.fixture
def bare_failure_node():
    """Every call's first attempt ends with a code and no kind of ours, the way a
    proxy's bare HTTP 500 (UNKNOWN) or a stream reset on the way back (INTERNAL)
    reaches a client after the node may have acted on the request; an ack's
    retry is answered."""
    codes = {}

    def send_batch(req, ctx, n):
        ctx.abort(codes["code"], "Received RST_STREAM with error code 2")

    def ack(req, ctx, n):
        if n == 1:
            ctx.abort(codes["code"], "Received RST_STREAM with error code 2")
        return api_pb2.Empty()

    node = FakeNode(SendBatch=send_batch, Ack=ack)
    node.codes = codes
    yield node
    node.stop()


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_write_that_ends_without_a_kind_of_ours_is_unconfirmed(bare_failure_node, kind, code):
    """A write ended by something other than the node (no kind in its trailers) may
    have been applied: a send hears operation_unconfirmed and is not resent (it
    said ``internal``, which the contract uses for "nothing was touched"), and an
    ack is tried again (it raised ``internal``, which ends a sync consume)."""
    node = bare_failure_node
    node.codes["code"] = code
    if kind == "sync":
        with Client(node.target, "k", timeout_s=10) as c:
            with pytest.raises(errors.OperationUnconfirmed):
                c.send("q", b"x")
            c.ack("t" * 40)
    else:
        async def main():
            async with _unary_only(AsyncClient(node.target, "k", timeout_s=10)) as c:
                with pytest.raises(errors.OperationUnconfirmed):
                    await c.send("q", b"x")
                await c.ack("t" * 40)
        asyncio.run(main())
    assert node.calls == {"SendBatch": 1, "Ack": 2}


def test_a_sync_consume_rides_out_a_receive_that_ends_without_a_kind_of_ours():
    """A receive whose call ended INTERNAL without a kind (a stream reset on the way
    back) may have leased: it is given back and the caller hears ``unavailable``
    with the answer lost, as when the asyncio client's Session breaks, so that
    ``consume`` rides it out. It raised ``internal`` and ended the sync consume."""
    def receive(req, ctx, n):
        if n == 1:
            ctx.abort(grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2")
        if n == 2:
            return api_pb2.ReceiveResponse(messages=[api_pb2.Delivery(
                id="m1", body=b"x", lease_token="t" * 40, lease_expires_at="2099-01-01T00:00:00Z",
                lease_seconds_left=30, queue="q")])
        return api_pb2.ReceiveResponse()

    node = FakeNode(Receive=receive, Ack=lambda req, ctx, n: api_pb2.Empty(),
                    ReleaseReceive=lambda req, ctx, n: api_pb2.ReleaseReceiveResponse())
    try:
        with Client(node.target, "k", timeout_s=10) as c:
            stop, got = threading.Event(), []

            def handler(m):
                got.append(m.id)
                stop.set()
            assert c.consume("q", handler, wait_s=0, stop=stop) == 1
        assert got == ["m1"]
        assert node.calls["Ack"] == 1 and node.calls["ReleaseReceive"] == 1, node.calls
    finally:
        node.stop()
