"""The Session stream (many requests on one gRPC stream) and the compact send form,
against a real node, plus the SDK's behaviour when a session breaks or is missing."""
import asyncio
import contextlib
import os
import subprocess
import sys
import time

import grpc
import pytest

from nodeproc import ADMIN_KEY, NodeProc
from spooler import AsyncClient, errors
from spooler.pb import api_pb2, api_pb2_grpc


def _md(key):
    return (("authorization", f"Bearer {key}"),)


async def _session(node, key, requests):
    """Open a raw Session, write ``requests``, close our side, return every answer by id."""
    async with grpc.aio.insecure_channel(node.grpc_target) as ch:
        call = api_pb2_grpc.SpoolerStub(ch).Session(metadata=_md(key), timeout=30)
        for r in requests:
            await call.write(r)
        await call.done_writing()
        return {a.id: a async for a in call}


def test_session_answers_every_request_by_id(node):
    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("s1")
        reqs = [
            api_pb2.SessionRequest(id=7, send_batch=api_pb2.SendBatchRequest(queue="s1", bodies=[b"a", b"b"])),
            api_pb2.SessionRequest(id=8, send_batch=api_pb2.SendBatchRequest(
                entries=[api_pb2.SendRequest(queue="s1", body=b"c")])),
            api_pb2.SessionRequest(id=9, send_batch=api_pb2.SendBatchRequest(queue="nope", bodies=[b"x"])),
            api_pb2.SessionRequest(id=10),  # names no call
        ]
        got = await _session(node, node.admin_key, reqs)
        assert set(got) == {7, 8, 9, 10}
        assert len(got[7].send_batch.run_ids) == 2 and not got[7].send_batch.results
        assert got[7].epoch >= 1
        assert len(got[8].send_batch.results) == 1 and got[8].send_batch.results[0].id
        # an error of one request is its answer; the stream went on
        assert got[9].WhichOneof("result") == "error" and got[9].error.kind == "queue_not_found"
        assert got[10].error.kind == "invalid_argument"
        # receive and settle on a session too: oldest first, the run's order kept
        got = await _session(node, node.admin_key, [api_pb2.SessionRequest(
            id=1, receive=api_pb2.ReceiveRequest(queue="s1", max_messages=10))])
        bodies = [d.body for d in got[1].receive.messages]
        assert bodies == [b"a", b"b", b"c"]
        items = [api_pb2.SettleBatchRequest.Item(token=d.lease_token, action=api_pb2.SETTLE_ACK)
                 for d in got[1].receive.messages]
        got = await _session(node, node.admin_key, [api_pb2.SessionRequest(
            id=2, settle_batch=api_pb2.SettleBatchRequest(items=items))])
        assert [r.HasField("error") for r in got[2].settle_batch.results] == [False] * 3
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            q = await c.get_queue("s1")
        assert q["stats"]["ackedTotal"] == 3 and q["stats"]["visible"] == 0

    asyncio.run(main())


def test_a_send_that_asks_for_compact_run_ids_gets_them_and_they_name_the_messages(node):
    """compact_run_ids: the run's ids come back as prefix, first counter and count
    (no run_ids); an entry before the run still has its own result; the ids the
    compact answer names are the ids the messages are delivered with. A request
    that does not ask (an older SDK) gets run_ids."""
    from spooler._common import send_outcomes

    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("s5")
        req = api_pb2.SendBatchRequest(entries=[api_pb2.SendRequest(queue="s5", body=b"e")], queue="s5",
                                       bodies=[b"r1", b"r2", b"r3"], compact_run_ids=True)
        got = await _session(node, node.admin_key, [
            api_pb2.SessionRequest(id=1, send_batch=req),
            api_pb2.SessionRequest(id=2, send_batch=api_pb2.SendBatchRequest(queue="s5", bodies=[b"old"])),
            api_pb2.SessionRequest(id=3, send_batch=api_pb2.SendBatchRequest(queue="nope", bodies=[b"x", b"y"],
                                                                              compact_run_ids=True))])
        a = got[1].send_batch
        assert (a.run_count, len(a.run_ids), len(a.results)) == (3, 0, 1)
        assert a.run_id_prefix and a.run_id_first
        sent = [r.id for r in send_outcomes(a)]
        assert sent[1:] == [f"{a.run_id_prefix}{a.run_id_first + i:08x}" for i in range(3)]
        old = got[2].send_batch
        assert (old.run_count, len(old.run_ids)) == (0, 1)
        assert got[3].error.kind == "queue_not_found"  # a run that stored nothing is no compact answer
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            msgs = await c.receive("s5", max_messages=10)
            assert [(m.id, m.body) for m in msgs] == list(zip(sent + [old.run_ids[0]], [b"e", b"r1", b"r2", b"r3",
                                                                                         b"old"]))
            # the SDK asks for the compact form and reads it
            ids = [r.id for r in await c.send_batch("s5", [b"s1", b"s2"])]
            assert ids == [m.id for m in await c.receive("s5", max_messages=10)]

    asyncio.run(main())


def test_session_refuses_a_bad_key_and_a_deleted_one(node):
    async def main():
        send = api_pb2.SendBatchRequest(queue="s2", bodies=[b"x"])
        got = await _session(node, "not-a-key", [api_pb2.SessionRequest(id=1, send_batch=send),
                                                 api_pb2.SessionRequest(id=2, receive=api_pb2.ReceiveRequest(
                                                     queue="s2", max_messages=1))])
        # each request is answered unauthenticated; the stream itself ends well
        assert {i: a.error.kind for i, a in got.items()} == {1: "unauthenticated", 2: "unauthenticated"}
        async with AsyncClient(node.grpc_target, node.admin_key) as admin:
            await admin.put_queue("s2")
            k = await admin.create_key("s2", ["send"])
            async with grpc.aio.insecure_channel(node.grpc_target) as ch:
                call = api_pb2_grpc.SpoolerStub(ch).Session(metadata=_md(k.key))
                send = api_pb2.SendBatchRequest(queue="s2", bodies=[b"x"])
                await call.write(api_pb2.SessionRequest(id=1, send_batch=send))
                assert (await call.read()).send_batch.run_ids
                await admin._call(admin.stub.DeleteKey, api_pb2.DeleteKeyRequest(id=k.id), write=True)
                await call.write(api_pb2.SessionRequest(id=2, send_batch=send))
                a = await call.read()  # the open stream does not outlive the key
                assert a.id == 2 and a.error.kind == "unauthenticated"
                await call.done_writing()

    asyncio.run(main())


def test_a_wrong_key_is_unauthenticated_on_every_call_never_a_transport_failure(node):
    """API.md: an unknown key is unauthenticated. Before 0.4.16 a node ended a
    Session opened with one at once, racing the client's first write on it;
    when the write lost, grpc reported the stream as INTERNAL, without the
    node's error kind, and the SDK answered operation_unconfirmed (a send that
    may have landed) or unavailable: about one call in ten. Now each request on
    such a stream is answered unauthenticated."""
    async def main():
        got: dict = {}
        for i in range(160):
            async with AsyncClient(node.grpc_target, "not-a-key", timeout_s=5) as c:
                try:
                    await (c.send("s5", b"x") if i % 2 else c.receive("s5"))
                    name = "answered"
                except errors.SpoolerError as e:
                    name = type(e).__name__
            got[name] = got.get(name, 0) + 1
        return got

    assert asyncio.run(main()) == {"Unauthenticated": 160}


def test_a_stream_whose_key_was_refused_ends_once_idle_and_a_good_one_stays(tmp_path):
    """limits.md: a Session opened with a refused key is answered request by
    request, and ended (unauthenticated) once it has been idle for
    session_refused_idle_s, so that streams nobody can use do not hold the
    node's call slots for good. The control: a stream with a good key idle as
    long stays open and answers."""
    n = NodeProc(str(tmp_path / "node"), admin_key=ADMIN_KEY, env={"SPOOLER_TEST_REFUSED_IDLE": "0.5"})
    n.start()
    try:
        async def main():
            async with grpc.aio.insecure_channel(n.grpc_target) as ch:
                stub = api_pb2_grpc.SpoolerStub(ch)
                bad = stub.Session(metadata=_md("not-a-key"), timeout=30)
                good = stub.Session(metadata=_md(ADMIN_KEY), timeout=30)
                await bad.write(api_pb2.SessionRequest(id=1, receive=api_pb2.ReceiveRequest(queue="nope")))
                first = await bad.read()
                assert first.id == 1 and first.error.kind == "unauthenticated"
                with pytest.raises(grpc.aio.AioRpcError) as e:  # idle from here: ended by the node
                    await asyncio.wait_for(bad.read(), 10)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                await asyncio.sleep(1.5)  # the good stream, as idle, and longer
                await good.write(api_pb2.SessionRequest(id=1, receive=api_pb2.ReceiveRequest(queue="nope")))
                a = await asyncio.wait_for(good.read(), 10)
                assert a.id == 1 and a.error.kind == "queue_not_found"
                await good.done_writing()
        asyncio.run(main())
    finally:
        n.kill()


def test_sdk_uses_the_session_and_the_compact_form(node):
    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("s3")
            ids = [r.id for r in await c.send_batch("s3", [b"%d" % i for i in range(50)])]
            assert len(set(ids)) == 50
            singles = await asyncio.gather(*[c.send("s3", b"single") for _ in range(20)])
            assert c.session.call is not None and c.session.supported  # all of it went over one stream
            assert len({r.id for r in singles} | set(ids)) == 70
            got = await c.receive("s3", max_messages=100)
            assert [m.id for m in got[:50]] == ids  # a batch keeps its order
            await c.ack(got[0].token)
            await c.nack(got[1].token)
            assert await c.renew(got[2].token)
            with pytest.raises(errors.StaleLease):
                await c.ack(got[0].token)
            with pytest.raises(errors.QueueNotFound):
                await c.send_batch("nope", [b"x"])

    asyncio.run(main())


async def _fake_node(**handlers):
    """A stand-in node serving only ``handlers`` (method name -> grpc handler);
    returns (server, port). The caller stops the server."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("spooler.v1.Spooler", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _session_handler(fn):
    return grpc.stream_stream_rpc_method_handler(fn, request_deserializer=api_pb2.SessionRequest.FromString,
                                                 response_serializer=api_pb2.SessionResponse.SerializeToString)


class _NoSessionServer:
    """A node stand-in with SendBatch only (an older node): the SDK falls back to unary."""

    async def start(self):
        async def send_batch(req, ctx):
            # an older node knows only entries: the compact form must not reach it
            assert not req.bodies and not req.queue
            return api_pb2.SendBatchResponse(results=[api_pb2.SendResponse(id=f"u{i}") for i in
                                                      range(len(req.entries))])

        self.server, self.port = await _fake_node(SendBatch=grpc.unary_unary_rpc_method_handler(
            send_batch, request_deserializer=api_pb2.SendBatchRequest.FromString,
            response_serializer=api_pb2.SendBatchResponse.SerializeToString))
        return self


def test_sdk_falls_back_to_unary_without_a_session():
    async def main():
        srv = await _NoSessionServer().start()
        try:
            async with AsyncClient(f"127.0.0.1:{srv.port}", "k") as c:
                assert (await c.send("q", b"x")).id == "u0"
                assert not c.session.supported
                assert [r.id for r in await c.send_batch("q", [b"a", b"b"])] == ["u0", "u1"]
        finally:
            await srv.server.stop(None)

    asyncio.run(main())


def test_a_node_without_a_session_turns_it_off_for_that_node_only(node, monkeypatch):
    """A client that met an older node (no Session) in a rolling upgrade uses the
    unary calls with that node only: moved on to a node with a Session, it uses the
    Session there. It turned the Session off for good before. And it asks the older
    node again after a while (UNSUPPORTED_RECHECK_S): one upgraded in place keeps
    its address."""
    from spooler import _common

    async def main():
        srv = await _NoSessionServer().start()
        try:
            async with AsyncClient(f"127.0.0.1:{srv.port},{node.grpc_target}", node.admin_key) as c:
                # what its UNIMPLEMENTED does (test_sdk_falls_back_to_unary_without_a_session;
                # a stand-in's missing Session can also end INTERNAL, an unknown outcome)
                c._here()
                c.session.supported = False
                assert (await c.send("q", b"x")).id == "u0"  # at the older node, unary
                assert not c.session.supported
                c._next_target(c.channel)  # what a failed call there does
                await c.put_queue("s-mixed")
                assert c.session.supported
                r = await c.send("s-mixed", b"y")
                assert c.session.call is not None and c.session.chan is c.channel  # over the Session
                assert [m.body for m in await c.receive("s-mixed")] == [b"y"] and r.id
                c._next_target(c.channel)  # back to the older node: still unary there
                assert not c.session.supported
                assert (await c.send("q", b"z")).id == "u0"
                monkeypatch.setattr(_common, "UNSUPPORTED_RECHECK_S", 0.0)
                assert c.session.supported  # asked again once the while is over
        finally:
            await srv.server.stop(None)

    asyncio.run(main())


def test_the_unary_fallback_goes_to_the_node_the_client_moved_to():
    """While a receive or an ack tries the Session, the client moves to its next
    node (another call found the first one gone), then learns there is no Session
    to use: the unary call it falls back to goes to the node it uses now, not to
    the one it left."""
    from spooler import aio

    async def main():
        seen = {"a": [], "b": []}

        async def node(name):
            async def receive_batch(req, ctx):
                seen[name].append("ReceiveBatch")
                return api_pb2.ReceiveResponse()

            async def ack(req, ctx):
                seen[name].append("Ack")
                return api_pb2.Empty()

            return await _fake_node(
                ReceiveBatch=grpc.unary_unary_rpc_method_handler(
                    receive_batch, request_deserializer=api_pb2.ReceiveRequest.FromString,
                    response_serializer=api_pb2.ReceiveResponse.SerializeToString),
                Ack=grpc.unary_unary_rpc_method_handler(
                    ack, request_deserializer=api_pb2.LeaseRequest.FromString,
                    response_serializer=api_pb2.Empty.SerializeToString))

        (sa, pa), (sb, pb) = await node("a"), await node("b")
        try:
            async with AsyncClient(f"127.0.0.1:{pa},127.0.0.1:{pb}", "k", retry_attempts=1) as c:
                assert c.session.supported

                async def moved_then_none(*args, **kw):
                    c._next_target(c.channel)   # what a failed call elsewhere does
                    raise aio._NoSession()

                c.session.request = moved_then_none
                assert await c.receive("q") == []
                await c.ack("t")
        finally:
            await sa.stop(None)
            await sb.stop(None)
        # the receive moved the client a -> b, the ack b -> a: each went where it was sent from
        assert seen == {"a": ["Ack"], "b": ["ReceiveBatch"]}, seen

    asyncio.run(main())


class _BreakingServer:
    """Reads one Session request, then ends the stream with a bare UNAVAILABLE: the
    request left the client, so a write's outcome is unknown."""

    async def start(self):
        async def session(requests, ctx):
            async for _ in requests:
                await ctx.abort(grpc.StatusCode.UNAVAILABLE, "gone")

        self.server, self.port = await _fake_node(Session=_session_handler(session))
        return self


def test_a_broken_session_makes_writes_unconfirmed_and_reads_unavailable():
    async def main():
        srv = await _BreakingServer().start()
        try:
            async with AsyncClient(f"127.0.0.1:{srv.port}", "k", retry_attempts=1) as c:
                with pytest.raises(errors.OperationUnconfirmed):
                    await c.send_batch("q", [b"x"])  # may have landed: never silently retried
                with pytest.raises(errors.Unavailable):
                    await c.receive("q")
        finally:
            await srv.server.stop(None)

    asyncio.run(main())


class _EndingServer:
    """Reads one Session request, then ends the stream with ``code`` and no detail,
    the way a node on its way down ends its calls (CANCELLED) or loses them."""

    def __init__(self, code):
        self.code = code

    async def start(self):
        async def session(requests, ctx):
            async for _ in requests:
                await ctx.abort(self.code, "ending")

        self.server, self.port = await _fake_node(Session=_session_handler(session))
        return self


@pytest.mark.parametrize("code", [grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE])
def test_a_session_the_node_ends_moves_the_client_to_its_next_node(code):
    """A unary call that ends CANCELLED or UNAVAILABLE moves the client on (MOVE_ON);
    a Session stream the node ends the same way must too, at once, not only after
    the next call has failed on the same node."""
    async def main():
        a, b = await _EndingServer(code).start(), await _EndingServer(code).start()
        try:
            targets = f"127.0.0.1:{a.port},127.0.0.1:{b.port}"
            async with AsyncClient(targets, "k", retry_attempts=1) as c:
                assert c.target_now() == f"127.0.0.1:{a.port}"
                with pytest.raises(errors.OperationUnconfirmed):
                    await c.send_batch("q", [b"x"])
                assert c.target_now() == f"127.0.0.1:{b.port}"
        finally:
            await a.server.stop(None)
            await b.server.stop(None)

    asyncio.run(main())


def test_a_full_session_holds_the_client_back_instead_of_failing(tmp_path):
    """Past its in-flight limit a Session stops reading (back-pressure): every
    request is answered, none fails, and no more than the limit run at once."""
    from node.api import grpc_api
    from node.api.metrics import Metrics
    from node.api.service import Principal, Service
    from node.engine import Engine, Limits

    async def main():
        eng = Engine(str(tmp_path / "n"), limits=Limits(session_requests_in_flight_max=4))
        await eng.start()
        svc = Service(eng, ["k"])
        await svc.put_queue(Principal(admin=True), "q", {})
        running, most = 0, 0
        receive = svc.receive

        async def counted(*a, **kw):
            nonlocal running, most
            running += 1
            most = max(most, running)
            try:
                return await receive(*a, **kw)
            finally:
                running -= 1

        svc.receive = counted
        server, _, port = await grpc_api.build_server(svc, Metrics(eng), "127.0.0.1:0")
        await server.start()
        try:
            node = type("N", (), {"grpc_target": f"127.0.0.1:{port}"})
            reqs = [api_pb2.SessionRequest(id=i, receive=api_pb2.ReceiveRequest(queue="q", wait_seconds=0.2))
                    for i in range(1, 13)]
            got = await _session(node, "k", reqs)
        finally:
            await server.stop(None)
            await eng.stop()
        assert sorted(got) == list(range(1, 13))
        assert all(a.WhichOneof("result") == "receive" for a in got.values())
        assert 1 <= most <= 4

    asyncio.run(main())


def test_a_request_that_fails_oddly_as_it_starts_is_answered_and_the_stream_goes_on(tmp_path):
    """An unexpected error while a request is being started (outside any call's
    own error handling) is answered as ``internal`` for that request; the stream
    reads and answers the next ones. It used to end the reader: the stream closed
    OK with later requests never answered and nothing logged."""
    from node.api import grpc_api
    from node.api.metrics import Metrics
    from node.api.service import Principal, Service
    from node.engine import Engine

    async def main():
        eng = Engine(str(tmp_path / "n"))
        await eng.start()
        svc = Service(eng, ["k"])
        await svc.put_queue(Principal(admin=True), "q", {})
        forwards, calls = svc.forwards, []

        def odd_once():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("odd")
            return forwards()

        svc.forwards = odd_once
        server, _, port = await grpc_api.build_server(svc, Metrics(eng), "127.0.0.1:0")
        await server.start()
        try:
            node = type("N", (), {"grpc_target": f"127.0.0.1:{port}"})
            send = api_pb2.SendBatchRequest(entries=[api_pb2.SendRequest(queue="q", body=b"m")])
            got = await _session(node, "k", [api_pb2.SessionRequest(id=i, send_batch=send) for i in (1, 2)])
            stats = await svc.get_queue(Principal(admin=True), "q")
        finally:
            await server.stop(None)
            await eng.stop()
        assert sorted(got) == [1, 2]
        assert got[1].error.kind == "internal"
        assert got[2].WhichOneof("result") == "send_batch" and len(got[2].send_batch.results) == 1
        assert stats["stats"]["visible"] == 1

    asyncio.run(main())


def test_moving_to_another_node_keeps_the_old_streams_answers(node):
    """When the client moves on (another node, after an 'unavailable'), requests
    already written to the old stream still get their own answers."""
    async def main():
        async with AsyncClient(f"{node.grpc_target},{node.grpc_target}", node.admin_key) as c:
            await c.put_queue("s4")
            polling = asyncio.ensure_future(c.receive("s4", wait_s=5.0))
            # the long poll waits on the node, on the first stream
            deadline = time.monotonic() + 10
            while await asyncio.to_thread(node.metric, "spooler_receives_waiting") < 1:
                assert time.monotonic() < deadline, "the long poll never reached the node"
                await asyncio.sleep(0.02)
            first = c.session.call
            c._next_target()  # what an 'unavailable' answer does
            sent = await c.send("s4", b"after the move")  # opens a second stream
            assert c.session.call is not first
            got = await polling  # answered on the old stream, not failed
            assert [m.id for m in got] in ([], [sent.id])

    asyncio.run(main())


class _CountingBreaker:
    """Records which request ids arrive on which stream; the first stream is cut
    after its first request, later ones answer every request with an error."""

    def __init__(self):
        self.streams = []

    async def start(self):
        async def session(requests, ctx):
            seen = []
            self.streams.append(seen)
            first = len(self.streams) == 1
            async for r in requests:
                seen.append(r.id)
                if first:
                    await ctx.abort(grpc.StatusCode.UNAVAILABLE, "gone")
                yield api_pb2.SessionResponse(id=r.id, error=api_pb2.ErrorDetail(kind="queue_not_found", message="x"))

        self.server, self.port = await _fake_node(Session=_session_handler(session))
        return self


def test_requests_failed_by_a_break_are_never_sent_later():
    """A request whose caller was told it failed is never written to a later
    stream; and a break reports unknown outcomes as such, never as 'internal'."""
    async def main():
        srv = await _CountingBreaker().start()
        try:
            async with AsyncClient(f"127.0.0.1:{srv.port}", "k", retry_attempts=1) as c:
                outs = await asyncio.gather(*[c.send_batch("q", [b"x"]) for _ in range(20)],
                                            *[c.receive("q") for _ in range(5)], return_exceptions=True)
                assert all(isinstance(o, (errors.OperationUnconfirmed, errors.Unavailable)) for o in outs), outs
                with pytest.raises(errors.QueueNotFound):  # a new stream, answered normally
                    await c.send_batch("q", [b"late"])
        finally:
            await srv.server.stop(None)
        assert len(srv.streams) == 2
        assert len(srv.streams[1]) == 1, srv.streams  # only the request made after the break

    asyncio.run(main())


class _FakeContext:
    """Enough of a grpc.aio ServicerContext to call a servicer method directly.
    ``fails``: what its write of the answer raises (None: it is written)."""

    def __init__(self, key, fails=None):
        self.md = (("authorization", f"Bearer {key}"),)
        self.fails = fails
        self.written = []

    def invocation_metadata(self):
        return self.md

    def set_trailing_metadata(self, md):
        pass

    async def write(self, resp):
        if self.fails is not None:
            raise self.fails
        self.written.append(resp)


@pytest.mark.parametrize("fails", [None, ConnectionResetError("the caller went away"), asyncio.CancelledError()])
def test_a_receive_whose_answer_is_lost_gives_its_messages_back(tmp_path, fails):
    """A unary receive whose answer cannot be written (the caller's connection
    broke after the leases were granted, e.g. a forwarding replica cut off from the
    primary; or the call was cancelled) gives the messages back at once, retry
    count unchanged: nobody received them. One whose answer is written keeps its
    lease."""
    async def main():
        async with _one_message(tmp_path) as (svc, admin, servicer, mid):
            ctx = _FakeContext("k", fails)
            try:
                await servicer.ReceiveBatch(api_pb2.ReceiveRequest(queue="q", max_messages=5), ctx)
            except asyncio.CancelledError:
                assert isinstance(fails, asyncio.CancelledError)  # (re-raised: the call is over)
            if fails is None:
                assert [d.id for m in ctx.written for d in m.messages] == [mid]
                assert await svc.receive(admin, "q", 0) == []  # leased, delivered
                return
            [d] = await svc.receive(admin, "q", 0)  # back at once
            assert (d.id, d.retry_count) == (mid, 0)

    asyncio.run(main())


@contextlib.asynccontextmanager
async def _one_message(tmp_path):
    """A started engine whose queue ``q`` holds one message, and a servicer on it:
    yields (Service, an admin principal, SpoolerServicer, the message's id)."""
    from node.api import grpc_api
    from node.api.metrics import Metrics
    from node.api.service import Principal, Service
    from node.engine import Engine

    eng = Engine(str(tmp_path / "n"))
    await eng.start()
    try:
        svc = Service(eng, ["k"])
        admin = Principal(admin=True)
        await svc.put_queue(admin, "q", {})
        [(mid, _, _)] = await svc.send(admin, [("q", b"m", 0.0, "")])
        yield svc, admin, grpc_api.SpoolerServicer(svc, Metrics(eng)), mid
    finally:
        await eng.stop()


class _SessionContextNeverWriting:
    """Enough of a grpc.aio ServicerContext to run Session directly: it reads
    ``requests``, then nothing more (the client's side stays open), and a write
    never completes (a client that stopped reading: HTTP/2 flow control holds it)."""

    def __init__(self, key, requests):
        self.md = (("authorization", f"Bearer {key}"),)
        self.requests = list(requests)
        self.writing: list = []
        self.wrote = asyncio.Event()

    def invocation_metadata(self):
        return self.md

    def set_trailing_metadata(self, md):
        pass

    async def read(self):
        if self.requests:
            return self.requests.pop(0)
        await asyncio.Event().wait()

    async def write(self, msg):
        self.writing.append(msg)
        self.wrote.set()
        await asyncio.Event().wait()


def test_a_session_that_ends_with_a_receive_answer_unwritten_gives_its_messages_back(tmp_path):
    """A Session stream that ends (its client went away: grpc cancels the call)
    while a receive's answer is still unwritten gives that receive's leases back
    at once, retry count unchanged: nobody got the messages. Without it they
    stay leased until the lease times out, and that counts a retry. (The test
    above is the unary ReceiveBatch's cancel path, not the Session's.)"""
    async def main():
        async with _one_message(tmp_path) as (svc, admin, servicer, mid):
            ctx = _SessionContextNeverWriting("k", [api_pb2.SessionRequest(
                id=1, receive=api_pb2.ReceiveRequest(queue="q", max_messages=5))])
            stream = asyncio.ensure_future(servicer.Session(None, ctx))
            await asyncio.wait_for(ctx.wrote.wait(), 10)  # the answer is on its way out, never written
            [a] = ctx.writing
            assert (a.id, [d.id for d in a.receive.messages]) == (1, [mid])
            assert await svc.receive(admin, "q", 0) == []  # leased
            stream.cancel()  # the client went away
            with pytest.raises(asyncio.CancelledError):
                await stream
            got = await svc.receive(admin, "q", 0)  # back at once (the lease runs 30 s)
            assert [(d.id, d.retry_count) for d in got] == [(mid, 0)]

    asyncio.run(main())


class _CallEndingAtWrite:
    """A Session call that ended between the writer's check and its write: grpc.aio
    refuses the write (InvalidStateError) before anything is sent."""

    def __init__(self):
        self.cancelled = False

    async def wait_for_connection(self):
        return None

    def done(self):
        return False

    async def write(self, msg):
        raise asyncio.InvalidStateError("RPC already finished.")

    def cancel(self):
        self.cancelled = True


def _one_unwritten_request(c, call):
    """Make ``call`` the client's Session stream on its current node, with one
    write request waiting in its outbox; returns that request's future."""
    from spooler.aio import _Waiter

    s = c.session
    s.call, s.stub, s.chan = call, c.stub, c.channel
    fut = asyncio.get_running_loop().create_future()
    s.waiting[1] = _Waiter(fut, True, c.channel, "send_batch")
    s.outbox.append((1, api_pb2.SessionRequest(id=1)))
    return fut


def test_a_request_the_ended_stream_refused_to_write_is_unavailable():
    """A write grpc refused was never sent: its caller hears ``unavailable`` (safe
    to retry) at once, not ``operation_unconfirmed`` from the stream's end."""
    async def main():
        async with AsyncClient("127.0.0.1:1", "k") as c:
            s, call = c.session, _CallEndingAtWrite()
            fut = _one_unwritten_request(c, call)
            await s._write(call)
            assert call.cancelled and fut.done()
            with pytest.raises(errors.Unavailable):
                fut.result()
            s.call = None

    asyncio.run(main())


async def _unary_node(send_batch=None, get_queue=None):
    """A node stand-in without Session (an older node): the SDK's unary path."""
    handlers = {}
    if send_batch:
        handlers["SendBatch"] = grpc.unary_unary_rpc_method_handler(
            send_batch, request_deserializer=api_pb2.SendBatchRequest.FromString,
            response_serializer=api_pb2.SendBatchResponse.SerializeToString)
    if get_queue:
        handlers["GetQueue"] = grpc.unary_unary_rpc_method_handler(
            get_queue, request_deserializer=api_pb2.QueueRequest.FromString,
            response_serializer=api_pb2.Queue.SerializeToString)
    return await _fake_node(**handlers)


def test_a_batch_resent_in_parts_leaves_no_caller_waiting_when_cut_short():
    """A batch refused for one entry is resent in parts (halves, down to single
    sends); when that is cut short (its flush cancelled), the sends not yet made
    fail ``unavailable`` instead of waiting for ever."""
    from spooler.errors import grpc_trailers

    async def main():
        started = asyncio.Event()

        async def send_batch(req, ctx):
            if len(req.entries) > 1:
                await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "a bad entry",
                                trailing_metadata=grpc_trailers(errors.InvalidArgument("a bad entry")))
            started.set()
            await asyncio.sleep(5)
            return api_pb2.SendBatchResponse(results=[api_pb2.SendResponse(id="u")])

        server, port = await _unary_node(send_batch=send_batch)
        try:
            c = AsyncClient(f"127.0.0.1:{port}", "k", timeout_s=10, batches_in_flight_max=1, retry_attempts=1)
            sends = [asyncio.ensure_future(c.send("q", b"%d" % i)) for i in range(6)]
            await asyncio.wait_for(started.wait(), 5)  # the first single send is on its way
            for t in list(c._flushes):
                t.cancel()
            done, pending = await asyncio.wait(sends, timeout=5)
            assert not pending
            assert isinstance(sends[0].exception(), errors.OperationUnconfirmed)  # it may have left
            assert all(isinstance(s.exception(), errors.Unavailable) for s in sends[1:])  # never sent
            await c.close()
        finally:
            await server.stop(None)

    asyncio.run(main())


@pytest.mark.parametrize("write", [False, True])
def test_a_call_cut_off_by_close_is_an_error_of_ours_not_a_bare_cancel(write):
    """close() closes the channels under a unary call still waiting (a node without
    Session, or a queue call): its caller, who cancelled nothing, hears
    ``unavailable`` (a read) or ``operation_unconfirmed`` (a write), not
    asyncio.CancelledError."""
    async def main():
        arrived = asyncio.Event()

        async def slow(req, ctx):
            arrived.set()
            await asyncio.sleep(10)

        server, port = await _unary_node(send_batch=slow, get_queue=slow)
        try:
            c = AsyncClient(f"127.0.0.1:{port}", "k", timeout_s=30, retry_attempts=1)
            call = (c._call(c.stub.SendBatch, api_pb2.SendBatchRequest(), write=True) if write
                    else c.get_queue("q"))
            t = asyncio.ensure_future(call)
            await asyncio.wait_for(arrived.wait(), 5)
            await c.close()
            done, _ = await asyncio.wait([t], timeout=5)
            assert done and not t.cancelled()
            assert isinstance(t.exception(), errors.OperationUnconfirmed if write else errors.Unavailable)
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_an_ack_answered_with_no_outcome_is_unconfirmed_not_an_index_error():
    """A faulty node answers a Session settle with no result: the ack may have been
    applied, so operation_unconfirmed (an IndexError would end a consume)."""
    async def main():
        async def session(requests, ctx):
            async for r in requests:
                yield api_pb2.SessionResponse(id=r.id, settle_batch=api_pb2.SettleBatchResponse())

        server, port = await _fake_node(Session=_session_handler(session))
        try:
            async with AsyncClient(f"127.0.0.1:{port}", "k", retry_attempts=1) as c:
                with pytest.raises(errors.OperationUnconfirmed):
                    await c.ack("token")
                with pytest.raises(errors.OperationUnconfirmed):
                    await c.settle_batch([("a", "ack", 0), ("b", "ack", 0)])
        finally:
            await server.stop(None)

    asyncio.run(main())


class _CallThatNeverConnects:
    def __init__(self):
        self.half_closed = False

    def done(self):
        return False

    async def done_writing(self):
        self.half_closed = True


def test_moving_on_fails_what_waits_unwritten_for_the_node_left_at_once():
    """When the client moves to its next node, a request still waiting in the
    outbox for the old node's stream fails ``unavailable`` at once (its caller
    retries on the next node) instead of at its own timeout."""
    async def main():
        async with AsyncClient("127.0.0.1:1,127.0.0.1:2", "k") as c:
            s, old = c.session, _CallThatNeverConnects()
            fut = _one_unwritten_request(c, old)
            c._next_target(c.channel)
            assert c.target_now() == "127.0.0.1:2"
            assert fut.done() and isinstance(fut.exception(), errors.Unavailable)
            assert s.call is None and not s.outbox
            await asyncio.sleep(0)
            assert old.half_closed  # the old stream still delivers the answers it owes

    asyncio.run(main())


def test_a_stream_that_never_reads_its_answers_stops_being_read_past_a_byte_budget(tmp_path, monkeypatch):
    """A Session whose client sends receives and never reads the answers held up
    to 1,024 answers of 8 MiB each (a review pinned 460 MB with one stream, every
    message of the queue leased). Past SESSION_ANSWER_BYTES_MAX of unwritten
    receive answers the node stops reading that stream's requests."""
    from node.api import grpc_api
    from node.api.metrics import Metrics
    from node.api.service import Principal, Service
    from node.engine import Engine

    monkeypatch.setattr(grpc_api, "SESSION_ANSWER_BYTES_MAX", 1 << 20)
    body = b"b" * (64 << 10)

    async def main():
        eng = Engine(str(tmp_path / "n"))
        await eng.start()
        svc = Service(eng, ["k"])
        admin = Principal(admin=True)
        await svc.put_queue(admin, "q", {})
        for _ in range(8):
            await svc.send(admin, [], ("q", [body] * 100, 0.0))  # 800 messages, 50 MiB
        server, _, port = await grpc_api.build_server(svc, Metrics(eng), "127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = api_pb2_grpc.SpoolerStub(ch).Session(metadata=_md("k"), timeout=60)
                for i in range(1, 81):
                    await call.write(api_pb2.SessionRequest(
                        id=i, receive=api_pb2.ReceiveRequest(queue="q", max_messages=10)))
                # the node reads what it will and leases for it; then nothing moves
                last, same_since = -1, asyncio.get_running_loop().time()
                deadline = same_since + 30
                while asyncio.get_running_loop().time() < deadline:
                    leased = svc.core.stats("q", eng.now_us())["leased"]
                    if leased != last:
                        last, same_since = leased, asyncio.get_running_loop().time()
                    elif asyncio.get_running_loop().time() - same_since > 1.0:
                        break
                    await asyncio.sleep(0.05)
                call.cancel()
        finally:
            await server.stop(None)
            await eng.stop()
        # without the budget all 800 (50 MiB) are leased and held; with it, what the
        # budget and gRPC's own buffers hold
        assert 0 < last < 400, last

    asyncio.run(main())


class _RefusingServer:
    """A node stand-in whose every answer is ``err``: on the Session stream as the
    request's error, and on unary SendBatch as the call's status and trailers."""

    def __init__(self, err):
        self.err = err

    async def start(self):
        err = self.err

        async def session(requests, ctx):
            async for r in requests:
                yield api_pb2.SessionResponse(id=r.id, error=errors.to_detail(err))

        async def send_batch(req, ctx):
            await ctx.abort(errors.grpc_status_code(err), err.message, trailing_metadata=errors.grpc_trailers(err))

        self.server, self.port = await _fake_node(
            Session=_session_handler(session),
            SendBatch=grpc.unary_unary_rpc_method_handler(
                send_batch, request_deserializer=api_pb2.SendBatchRequest.FromString,
                response_serializer=api_pb2.SendBatchResponse.SerializeToString))
        return self


@pytest.mark.parametrize("reason, moves", [("overloaded", False), ("queue_full", False), ("disk_low", False),
                                           ("", True)])
def test_a_primary_refusing_for_its_own_load_keeps_the_client_where_it_is(reason, moves):
    """Every other node would forward to the same primary and hear the same 503:
    a client that moved on for it only churned between nodes. An unavailable with
    one of the primary's reasons keeps the client where it is (both clients, on
    the Session and on unary calls); any other still moves it on."""
    async def main():
        err = errors.Unavailable("busy", retry_after_s=0.1, reason=reason)
        a, b = await _RefusingServer(err).start(), await _RefusingServer(err).start()
        try:
            targets = f"127.0.0.1:{a.port},127.0.0.1:{b.port}"
            async with AsyncClient(targets, "k", retry_attempts=1) as c:
                with pytest.raises(errors.Unavailable) as e:
                    await c.send_batch("q", [b"x"])
                assert e.value.reason == reason
                assert c.target_now() == f"127.0.0.1:{(b if moves else a).port}"

            def sync_client():
                from spooler import Client
                with Client(targets, "k", retry_attempts=1) as sc:
                    with pytest.raises(errors.Unavailable):
                        sc.send_batch("q", [b"x"])
                    return sc.target_now()

            now = await asyncio.get_running_loop().run_in_executor(None, sync_client)
            assert now == f"127.0.0.1:{(b if moves else a).port}"
        finally:
            await a.server.stop(None)
            await b.server.stop(None)

    asyncio.run(main())


def test_an_ack_with_a_token_no_node_would_take_fails_alone_and_the_session_carries_on(node):
    """An ack whose token is a 17 MB string (a body passed for a token) made a
    Session request over gRPC's 16 MiB: the transport refused it, and the stream
    broke under the long poll riding it. The SDK now refuses such a token
    before sending: the ack fails alone, invalid_argument, and the long poll
    on the same stream gets the message sent meanwhile."""
    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("big-token")
            poll = asyncio.ensure_future(c.receive("big-token", wait_s=20))
            # (the poll is on the stream once the node counts it waiting)
            deadline = time.monotonic() + 10
            while await asyncio.to_thread(node.metric, "spooler_receives_waiting") != 1:
                assert time.monotonic() < deadline, "the long poll never reached the node"
                await asyncio.sleep(0.02)
            with pytest.raises(errors.InvalidArgument):
                await c.ack("t" * 17_000_000)
            await c.send("big-token", b"after")
            got = await asyncio.wait_for(poll, 20)
            assert [m.body for m in got] == [b"after"]
    asyncio.run(main())


_ROUNDS_SCRIPT = r"""
import asyncio, sys
from spooler import AsyncClient

async def one(i):
    async with AsyncClient(sys.argv[1], sys.argv[2], timeout_s=10) as c:
        await c.put_queue("rounds")
        await asyncio.gather(*[c.send("rounds", b"m%d" % j) for j in range(20)])
        for m in await c.receive("rounds", wait_s=0.2, max_messages=5):
            await c.ack(m.token)

for i in range(20):
    asyncio.run(one(i))
print("rounds done")
"""


@pytest.mark.parametrize("io", ["legacy", "default"])
def test_a_client_closed_as_its_loop_ends_leaves_grpc_nothing_to_hand_that_loop(node, io):
    """A script that runs ``asyncio.run`` more than once, each time with a client
    it closes: grpc's completion queue outlives each loop, and a completion of
    the closed client's Session stream that arrived after its loop ended (the
    cancelled stream's status) was handed to that closed loop from the next
    one: "RuntimeError: Event loop is closed" tracebacks on stderr, about one
    per round. ``close()`` ends an idle stream as the node would, and waits for
    the node to end it (``_Session.finish``) before it closes the channels."""
    env = {**os.environ, "SPOOLER_GRPC_IO": io, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, "-c", _ROUNDS_SCRIPT, node.grpc_target, node.admin_key],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and "rounds done" in p.stdout, (p.stdout, p.stderr[-3000:])
    assert "Event loop is closed" not in p.stderr, p.stderr[-3000:]
