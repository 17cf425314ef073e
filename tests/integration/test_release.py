"""Lost receive answers: ReleaseReceive gives back what a named receive leased (retry
count kept), and a forwarding node does so when the primary's answer never reaches it."""
import asyncio
import contextlib
import socket
import time

import grpc
import pytest

from node.api.forward import Forwarder
from spooler import errors
from spooler.pb import api_pb2, api_pb2_grpc
from tests.drills.proxy import FaultProxy


def _md(key):
    return (("authorization", f"Bearer {key}"),)


def _stub(node):
    ch = grpc.insecure_channel(node.grpc_target)
    return ch, api_pb2_grpc.SpoolerStub(ch)


def _setup(stub, key, queue, bodies, lease_s=60):
    stub.PutQueue(api_pb2.PutQueueRequest(name=queue, settings=api_pb2.Settings(lease_timeout_seconds=lease_s)),
                  metadata=_md(key))
    for b in bodies:
        stub.Send(api_pb2.SendRequest(queue=queue, body=b), metadata=_md(key))


def _kind(e: grpc.RpcError) -> str:
    return dict(e.trailing_metadata() or ()).get("spooler-error-kind", "")


def test_release_by_receive_id_gives_back_with_the_retry_count_kept(node):
    ch, stub = _stub(node)
    with ch:
        md = _md(node.admin_key)
        _setup(stub, node.admin_key, "rel", [b"a", b"b"])
        got = stub.ReceiveBatch(api_pb2.ReceiveRequest(queue="rel", max_messages=2, receive_id="r-1"),
                                metadata=md).messages
        assert [d.body for d in got] == [b"a", b"b"]
        # another key with the receive scope cannot release this caller's receive
        other = stub.CreateKey(api_pb2.CreateKeyRequest(queue="rel", scopes=["receive"]), metadata=md).key
        r = stub.ReleaseReceive(api_pb2.ReleaseReceiveRequest(queue="rel", receive_id="r-1"), metadata=_md(other))
        assert r.released == 0
        r = stub.ReleaseReceive(api_pb2.ReleaseReceiveRequest(queue="rel", receive_id="r-1"), metadata=md)
        assert r.released == 2
        # visible again at once (the lease timeout is 60 s), with no retry counted
        again = stub.ReceiveBatch(api_pb2.ReceiveRequest(queue="rel", max_messages=2), metadata=md).messages
        assert [(d.body, d.retry_count) for d in again] == [(b"a", 0), (b"b", 0)]
        # the old tokens are dead: an ack with one is stale
        with pytest.raises(grpc.RpcError) as ei:
            stub.Ack(api_pb2.LeaseRequest(token=got[0].lease_token), metadata=md)
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # releasing again finds nothing (the leases of `again` are not that receive's)
        r = stub.ReleaseReceive(api_pb2.ReleaseReceiveRequest(queue="rel", receive_id="r-1"), metadata=md)
        assert r.released == 0
        stub.Ack(api_pb2.LeaseRequest(token=again[0].lease_token), metadata=md)


def test_one_key_written_two_ways_is_one_caller_for_a_release(node):
    """Receive names are the caller's: the key, not how its Authorization line is spelled."""
    ch, stub = _stub(node)
    with ch:
        _setup(stub, node.admin_key, "spelt", [b"a"])
        got = stub.ReceiveBatch(api_pb2.ReceiveRequest(queue="spelt", receive_id="s-1"),
                                metadata=_md(node.admin_key)).messages
        assert [d.body for d in got] == [b"a"]
        r = stub.ReleaseReceive(api_pb2.ReleaseReceiveRequest(queue="spelt", receive_id="s-1"),
                                metadata=(("authorization", f"bearer   {node.admin_key} "),))
        assert r.released == 1


def _reuse_refused_then_next_is(stub, md, queue, name, body):
    """A receive under ``name`` again is refused; a plain receive then gets ``body``, uncounted."""
    with pytest.raises(grpc.RpcError) as ei:
        stub.Receive(api_pb2.ReceiveRequest(queue=queue, receive_id=name), metadata=md)
    assert _kind(ei.value) == "invalid_argument"
    got = stub.Receive(api_pb2.ReceiveRequest(queue=queue), metadata=md).messages
    assert [(d.body, d.retry_count) for d in got] == [(body, 0)]


def test_a_receive_name_is_for_one_call(node):
    ch, stub = _stub(node)
    with ch:
        md = _md(node.admin_key)
        _setup(stub, node.admin_key, "once", [b"a", b"b"])
        got = stub.Receive(api_pb2.ReceiveRequest(queue="once", receive_id="n-1"), metadata=md).messages
        assert [d.body for d in got] == [b"a"]
        # the refused call leased nothing: b is still there
        _reuse_refused_then_next_is(stub, md, "once", "n-1", b"b")


def test_a_receive_released_before_it_answers_leases_nothing(node):
    async def main():
        async with grpc.aio.insecure_channel(node.grpc_target) as ch:
            stub = api_pb2_grpc.SpoolerStub(ch)
            md = _md(node.admin_key)
            await stub.PutQueue(api_pb2.PutQueueRequest(name="early"), metadata=md)
            # released first (the caller gave up before the call got through): the call answers empty
            await stub.ReleaseReceive(api_pb2.ReleaseReceiveRequest(queue="early", receive_id="x1"), metadata=md)
            await stub.Send(api_pb2.SendRequest(queue="early", body=b"m"), metadata=md)
            r = await stub.ReceiveBatch(api_pb2.ReceiveRequest(queue="early", receive_id="x1"), metadata=md)
            assert list(r.messages) == []
            # and leased nothing at all, not a lease given back at once
            assert await asyncio.to_thread(node.metric, "spooler_receives_total") == 0
            # released while it waits (long poll): when a message arrives it gives it back, answers empty
            first = await stub.Receive(api_pb2.ReceiveRequest(queue="early"), metadata=md)
            waiting = asyncio.ensure_future(stub.ReceiveBatch(
                api_pb2.ReceiveRequest(queue="early", wait_seconds=10, receive_id="x2"), metadata=md))
            deadline = time.monotonic() + 10
            while await asyncio.to_thread(node.metric, "spooler_receives_waiting") < 1:  # it waits on the node
                assert time.monotonic() < deadline, "the long poll never reached the node"
                await asyncio.sleep(0.02)
            assert not waiting.done()
            rel = await stub.ReleaseReceive(api_pb2.ReleaseReceiveRequest(queue="early", receive_id="x2"), metadata=md)
            assert rel.released == 0
            await stub.Nack(api_pb2.LeaseRequest(token=first.messages[0].lease_token), metadata=md)
            r = await asyncio.wait_for(waiting, 10)
            assert list(r.messages) == []
            r = await stub.Receive(api_pb2.ReceiveRequest(queue="early"), metadata=md)
            assert [(d.body, d.retry_count) for d in r.messages] == [(b"m", 1)]  # the nack's +1 only

    asyncio.run(main())


def test_release_checks_its_input_and_scope(node):
    ch, stub = _stub(node)
    with ch:
        md = _md(node.admin_key)
        _setup(stub, node.admin_key, "chk", [b"a"])
        got = stub.Receive(api_pb2.ReceiveRequest(queue="chk"), metadata=md).messages
        for bad in (api_pb2.ReleaseReceiveRequest(queue="chk", receive_id="no spaces"),
                    api_pb2.ReleaseReceiveRequest(queue="chk", receive_id="x" * 65),
                    api_pb2.ReleaseReceiveRequest(queue="chk"),
                    api_pb2.ReleaseReceiveRequest(queue="bad queue", receive_id="x")):
            with pytest.raises(grpc.RpcError) as ei:
                stub.ReleaseReceive(bad, metadata=md)
            assert _kind(ei.value) == "invalid_argument", bad
        with pytest.raises(grpc.RpcError) as ei:
            stub.ReceiveBatch(api_pb2.ReceiveRequest(queue="chk", receive_id="bad id"), metadata=md)
        assert _kind(ei.value) == "invalid_argument"
        key = stub.CreateKey(api_pb2.CreateKeyRequest(queue="chk", scopes=["send"]), metadata=md).key
        with pytest.raises(grpc.RpcError) as ei:
            stub.ReleaseReceive(api_pb2.ReleaseReceiveRequest(queue="chk", receive_id="x"), metadata=_md(key))
        assert _kind(ei.value) == "forbidden"
        # nothing was given back by the refused calls: the lease still holds
        assert stub.Receive(api_pb2.ReceiveRequest(queue="chk"), metadata=md).messages == []
        stub.Ack(api_pb2.LeaseRequest(token=got[0].lease_token), metadata=md)


@contextlib.contextmanager
def _behind_proxy(node, queue, bodies, a="fwd", b="primary"):
    """A queue on ``node`` holding ``bodies``, and a fault proxy link a -> b in front of
    the node: yields (proxy, the address to reach the node through that link)."""
    ch, stub = _stub(node)
    with ch:
        _setup(stub, node.admin_key, queue, bodies)
    host, port = node.grpc_target.rsplit(":", 1)
    with FaultProxy([a, b]) as px:
        px.set_target(b, host, int(port))
        yield px, f"127.0.0.1:{px.port(a, b)}"


def _next_is(node, queue, body):
    """A plain receive straight at the node gets ``body``, its retry count unchanged."""
    ch, stub = _stub(node)
    with ch:
        got = stub.Receive(api_pb2.ReceiveRequest(queue=queue), metadata=_md(node.admin_key)).messages
    assert [(d.body, d.retry_count) for d in got] == [(body, 0)]


async def _failing_forward(px, via, auth, queue, mode, name) -> Forwarder:
    """A forwarder whose receive (named ``name`` by its caller) fails because the link
    to the primary is in ``mode``; it has connected before, so only the fault matters."""
    f = Forwarder(timeout_s=1.0, current_primary=lambda: via)
    assert (await f.get_queue(via, auth, queue))["name"] == queue
    px.set_link("fwd", "primary", mode)
    with pytest.raises((errors.Unavailable, errors.OperationUnconfirmed)):
        await f.receive(via, auth, queue, 0.0, 1, name, release_for_s=30.0)
    return f


def test_forwarder_gives_back_a_receive_whose_answer_was_lost(node):
    """The primary runs the forwarded receive and answers, but the answer is held on the
    way back (the link passes requests only) until the forwarder's deadline; the primary
    saw a completed call. The forwarder must then release the receive by its name, so the
    message is visible again long before its 60 s lease would expire, retry count 0."""
    auth = f"Bearer {node.admin_key}"
    with _behind_proxy(node, "fw", [b"lost"]) as (px, via):
        async def main():
            f = await _failing_forward(px, via, auth, "fw", "one_way_reverse", "caller-1")
            assert len(f._releases) == 1  # retrying in the background through the faulted link
            px.heal()
            await asyncio.wait_for(asyncio.gather(*f._releases), 20)

        asyncio.run(main())
    ch, stub = _stub(node)
    with ch:
        md = _md(node.admin_key)
        # the primary knows the call by the caller's name too: one call per name
        _reuse_refused_then_next_is(stub, md, "fw", "caller-1", b"lost")


def test_a_forwarders_late_release_never_takes_a_resent_calls_leases(node):
    """The forwarded call never reaches the primary (blackhole); the caller resends it
    under the same name straight to the primary and gets the message; then the link heals
    and the forwarder's release (and the held original call) arrive. The resent call's
    lease must hold: the forwarder released only its own name."""
    auth = f"Bearer {node.admin_key}"
    md = _md(node.admin_key)
    with _behind_proxy(node, "late", [b"m"]) as (px, via):
        async def main():
            f = await _failing_forward(px, via, auth, "late", "blackhole", "caller-2")
            ch2, stub2 = _stub(node)
            with ch2:
                got = stub2.Receive(api_pb2.ReceiveRequest(queue="late", receive_id="caller-2"), metadata=md).messages
            assert [(d.body, d.retry_count) for d in got] == [(b"m", 0)]
            px.heal()
            await asyncio.wait_for(asyncio.gather(*f._releases), 20)
            return got[0].lease_token

        token = asyncio.run(main())
    ch, stub = _stub(node)
    with ch:
        assert stub.Receive(api_pb2.ReceiveRequest(queue="late"), metadata=md).messages == []
        stub.Ack(api_pb2.LeaseRequest(token=token), metadata=md)  # the lease still held: the ack lands


def test_a_caller_releases_a_forwarded_receive_by_its_own_name(node):
    """Through a forwarding node the call is named by the node, but the primary also knows
    it by the caller's name: the caller's release, at any node, gives it back."""
    ch, stub = _stub(node)
    with ch:
        _setup(stub, node.admin_key, "own", [b"m"])

    async def main():
        f = Forwarder(timeout_s=5.0, current_primary=lambda: node.grpc_target)
        got = await f.receive(node.grpc_target, f"Bearer {node.admin_key}", "own", 0.0, 1, "mine-1")
        assert [d.body for d in got] == [b"m"]
    asyncio.run(main())
    ch, stub = _stub(node)
    with ch:
        md = _md(node.admin_key)
        r = stub.ReleaseReceive(api_pb2.ReleaseReceiveRequest(queue="own", receive_id="mine-1"), metadata=md)
        assert r.released == 1
        got = stub.Receive(api_pb2.ReceiveRequest(queue="own"), metadata=md).messages
        assert [(d.body, d.retry_count) for d in got] == [(b"m", 0)]


def test_forwarder_release_gives_up_on_a_final_answer_and_is_bounded():
    calls = []

    async def main():
        f = Forwarder(current_primary=lambda: "p:1", releases_max=2)

        async def refuse(*a, **kw):
            calls.append(a[1])
            raise errors.MethodNotAllowed("unknown method")  # an older primary: no ReleaseReceive
        f.call = refuse
        for i in range(3):
            f.release_soon("p:1", "Bearer k", "q", f"n{i}", 30.0)
        assert len(f._releases) == 2  # the third was dropped
        await asyncio.wait_for(asyncio.gather(*f._releases), 5)
    asyncio.run(main())
    assert calls == ["ReleaseReceive", "ReleaseReceive"]  # one call each: no retrying


def test_a_replica_releases_given_back_tokens_on_the_primary_by_its_names():
    """A receive forwarded by a replica whose own caller went away: the leases live on
    the primary, so the replica releases there the names it gave those receives."""
    from types import SimpleNamespace

    from node.api.forward import NAMES_MAX, _put
    from node.api.service import Service
    from node.engine import Limits

    engine = SimpleNamespace(limits=Limits(), tls=None, cluster=True, role="replica", primary_id="n1", node_id="n2", pending_releases={},
                             repl=SimpleNamespace(addresses={"n1": "10.0.0.1:1"}),
                             core=SimpleNamespace(queues={}))
    svc = Service(engine, ["k"])
    calls = []
    svc.fwd.release_soon = lambda *a: calls.append(a)
    for token, name in (("t1", ("a", "f1")), ("t2", ("b", "f2")), ("t3", ("a", "f1"))):
        _put(svc.fwd._token_names, token, name, NAMES_MAX)
    assert svc.give_back(["t1", "t2", "t3", "unknown"], "Bearer k") == 0
    assert sorted(c[:4] for c in calls) == [("10.0.0.1:1", "Bearer k", "a", "f1"),
                                            ("10.0.0.1:1", "Bearer k", "b", "f2")]
    calls.clear()
    assert svc.give_back(["t1"]) == 0 and calls == []  # without the caller's key: nothing to send it with


def test_a_replica_remembers_forwarded_leases_names_up_to_a_bound_oldest_forgotten_first():
    """limits.md, "forwarded leases whose receive's name a forwarding node
    remembers": the map from a forwarded lease to its receive's name keeps at most
    NAMES_MAX entries, dropping the oldest (whose lease then just expires)."""
    from collections import OrderedDict

    from node.api.forward import NAMES_MAX, _put

    d = OrderedDict()
    for i in range(NAMES_MAX + 3):
        _put(d, f"t{i}", ("q", f"r{i}"), NAMES_MAX)
    assert len(d) == NAMES_MAX
    assert "t0" not in d and "t2" not in d and d["t3"] == ("q", "r3") and f"t{NAMES_MAX + 2}" in d
    assert next(iter(d)) == "t3"


def test_async_sdk_releases_a_receive_its_caller_cancelled(node):
    """A receive cancelled by its caller (asyncio.wait_for) whose answer is on its way:
    the SDK releases it in the background; close() waits for that."""
    from spooler import AsyncClient

    with _behind_proxy(node, "cancel", [], "sdk", "node") as (px, via):
        async def main():
            async with AsyncClient(via, node.admin_key, timeout_s=5.0, retry_attempts=1) as c:
                assert await c.receive("cancel") == []
                await c.send("cancel", b"m")
                px.set_link("sdk", "node", "one_way_reverse")  # the answer will not arrive
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(c.receive("cancel"), 0.5)
                assert len(c._releases) == 1
        asyncio.run(main())
    _next_is(node, "cancel", b"m")


@pytest.mark.parametrize("sdk", ["async", "sync"])
def test_sdk_gives_back_a_receive_whose_answer_was_lost(node, sdk):
    """SDK -> node through a link that passes requests only: the node leases the message
    and answers, the answer never arrives, the SDK's call fails, and the SDK releases the
    receive by its id (the release request gets through; its answer does not)."""
    from spooler import AsyncClient, Client

    with _behind_proxy(node, "sdk", [], "sdk", "node") as (px, via):
        if sdk == "async":
            async def main():
                async with AsyncClient(via, node.admin_key, timeout_s=1.0, retry_attempts=1) as c:
                    assert await c.receive("sdk") == []  # connected, session open
                    await c.send("sdk", b"lost")
                    px.set_link("sdk", "node", "one_way_reverse")
                    with pytest.raises(errors.SpoolerError) as ei:
                        await c.receive("sdk")
                    assert not isinstance(ei.value, errors.QueueNotFound)
            asyncio.run(main())
        else:
            with Client(via, node.admin_key, timeout_s=1.0, retry_attempts=1) as c:
                assert c.receive("sdk") == []
                c.send("sdk", b"lost")
                px.set_link("sdk", "node", "one_way_reverse")
                with pytest.raises(errors.SpoolerError):
                    c.receive("sdk")
    _next_is(node, "sdk", b"lost")


def test_http_receive_whose_client_went_away_gives_the_message_back(node):
    """An HTTP long poll whose client disconnected while it waited stops waiting
    with its connection (aiohttp's handler cancellation, node/main.py): a message
    that arrives afterwards goes to others with its retry count untouched, and
    no lease was ever taken for the gone client. Without the cancellation the
    poll would wait on for its 10 s and lease the message (then give it back,
    the next test's mechanism)."""
    from nodeproc import reaches, wait_until

    ch, stub = _stub(node)
    with ch:
        md = _md(node.admin_key)
        _setup(stub, node.admin_key, "gone", [])
        host, port = node.http_url[len("http://"):].rsplit(":", 1)
        s = socket.create_connection((host, int(port)))
        s.sendall(f"POST /v1/queues/gone/receive?wait=10 HTTP/1.1\r\nHost: x\r\n"
                  f"Authorization: Bearer {node.admin_key}\r\nContent-Length: 0\r\n\r\n".encode())
        wait_until(lambda: node.metric("spooler_receives_waiting") == 1, 5, what="the poll to wait on the node")
        s.close()
        wait_until(lambda: node.metric("spooler_receives_waiting") == 0, 5,
                   what="the poll to stop waiting once its client went away")
        stub.Send(api_pb2.SendRequest(queue="gone", body=b"m"), metadata=md)
        got = stub.Receive(api_pb2.ReceiveRequest(queue="gone"), metadata=md).messages
        assert [(d.body, d.retry_count) for d in got] == [(b"m", 0)]
        # this receive's lease only, and no expiry
        reaches(lambda: (node.metric("spooler_receives_total"), node.metric("spooler_lease_expiries_total")),
                (1, 0), what="the receive counted and no lease expiry")


def test_an_http_receive_whose_client_hangs_up_as_it_leases_gives_the_message_back(tmp_path):
    """The race the handler cancellation leaves: a client hangs up just as its
    receive leases, and the node reads the end of the connection (the transport
    closes) before aiohttp tells the handler the connection is lost and cancels
    it. The handler finds its transport closing and gives the lease back: the
    message is visible again at once, retry count 0, no lease expiry. Without
    that it stays leased for nobody until its lease times out (60 s here), then
    counts a retry. In-process, so that the hang-up can be timed to the lease."""
    from aiohttp import web

    from node.api.http import RUNNER_OPTIONS, build_app
    from node.api.metrics import Metrics
    from node.api.service import Principal, Service
    from node.engine import Engine

    async def main():
        loop = asyncio.get_running_loop()
        eng = Engine(str(tmp_path / "n"))
        await eng.start()
        runner = client = None
        try:
            svc = Service(eng, ["k"])
            metrics = Metrics(eng)
            admin = Principal(admin=True)
            await svc.put_queue(admin, "q", {"leaseTimeoutSeconds": 60})
            [(mid, _, _)] = await svc.send(admin, [("q", b"m", 0.0, "")])
            runner = web.AppRunner(build_app(svc, metrics), access_log=None, handle_signals=False,
                                   handler_cancellation=True, **RUNNER_OPTIONS)  # as node/main.py
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            receive, answered = svc.receive, asyncio.Event()

            async def hung_up_as_it_leased(*a, **kw):
                got = await receive(*a, **kw)  # leased (the message is there: no wait)
                client.shutdown(socket.SHUT_WR)  # the client hangs up
                [conn] = runner.server.connections
                deadline = loop.time() + 5
                # one turn of the loop at a time: the node reads the hang-up and its
                # transport closes; aiohttp's connection_lost (which cancels this
                # handler) runs on the turn after, behind this task's next step
                while not conn.transport.is_closing():
                    assert loop.time() < deadline, "the node never read the hang-up"
                    await asyncio.sleep(0)
                answered.set()
                return got

            svc.receive = hung_up_as_it_leased
            client = socket.create_connection(("127.0.0.1", port))
            client.setblocking(False)
            await loop.sock_sendall(client, b"POST /v1/queues/q/receive HTTP/1.1\r\nHost: x\r\n"
                                            b"Authorization: Bearer k\r\nContent-Length: 0\r\n\r\n")
            await asyncio.wait_for(answered.wait(), 10)  # (the handler's check ran with it)
            assert metrics.receives.value == 1  # it did lease
            svc.receive = receive
            got = await svc.receive(admin, "q", 0)  # back at once
            assert [(d.id, d.retry_count) for d in got] == [(mid, 0)]
            assert metrics.expiries.value == 0
        finally:
            if client is not None:
                client.close()
            if runner is not None:
                await runner.cleanup()
            await eng.stop()

    asyncio.run(main())


def test_receipts_stay_within_their_bounds_and_count_exactly():
    """The primary's memory of named receives: bounded by names, leases and age; the
    lease count it keeps matches what it holds after any mix of receipts, releases and
    trims (oldest first)."""
    import random
    from types import SimpleNamespace

    from node.api.service import Principal, Service
    from node.engine import Limits

    lim = Limits()
    lim.receipts_max, lim.receipt_tokens_max, lim.receipt_age_s_max = 50, 120, 5.0
    clock = {"us": 0}
    engine = SimpleNamespace(limits=lim, tls=None, cluster=False, role="primary", ready=True, node_id="n1", pending_releases={}, now_us=lambda: clock["us"],
                             core=SimpleNamespace(queues={}))
    svc = Service(engine, ["k"])
    svc.give_back = lambda tokens, auth=None: len(tokens)
    p = Principal(admin=True, auth="Bearer k")
    rng = random.Random(7)
    most_names = most_tokens = 0  # the largest held at once: the bounds are reached, not undercut
    for i in range(3000):
        clock["us"] += rng.randrange(0, 20_000)
        name = f"n{rng.randrange(400)}"
        if rng.random() < 0.7:
            out = [SimpleNamespace(token=f"t{i}.{j}") for j in range(rng.randrange(1, 9))]
            svc._note_receipt([(svc._caller(p), "q", name)], out)
        else:
            asyncio.run(svc.release_receive(p, "q", name))
        held = sum(len(t or ()) for t, _ in svc._receipts.values())
        assert svc._receipt_tokens == held
        assert len(svc._receipts) <= lim.receipts_max and held <= lim.receipt_tokens_max
        most_names, most_tokens = max(most_names, len(svc._receipts)), max(most_tokens, held)
        ages = [clock["us"] - at for _, at in svc._receipts.values()]
        assert max(ages) <= 5_000_000
        assert ages == sorted(ages, reverse=True)  # oldest first, so trimming drops the oldest
    assert most_names == lim.receipts_max and most_tokens > lim.receipt_tokens_max - 8  # (a receipt holds < 9)
    # the age bound on its own (the steps above are too short for it to bind before
    # the counts do): a receive older than the age, by a microsecond, is forgotten,
    # releasing it gives nothing back, and one as old as the age is still released
    clock["us"] += 10_000_000
    svc._note_receipt([(svc._caller(p), "q", "old")], [SimpleNamespace(token="t-old")])
    clock["us"] += 1
    svc._note_receipt([(svc._caller(p), "q", "young")], [SimpleNamespace(token="t-young")])
    clock["us"] += 5_000_000  # "old" is 5 s and 1 us old, "young" exactly 5 s
    svc._note_receipt([(svc._caller(p), "q", "now")], [SimpleNamespace(token="t-now")])
    assert asyncio.run(svc.release_receive(p, "q", "old")) == 0
    assert asyncio.run(svc.release_receive(p, "q", "young")) == 1


def test_sdk_stops_releasing_at_a_node_without_release_and_keeps_the_receive_error():
    """An older node: ReceiveBatch fails (the answer counts as lost), ReleaseReceive is
    UNIMPLEMENTED. The SDK raises the receive's own error, asks once, then never again."""
    from spooler import AsyncClient

    from tests.integration.test_session import _fake_node

    calls = []

    async def main():
        async def receive_batch(req, ctx):
            calls.append(("receive", req.receive_id))
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, "going away")

        server, port = await _fake_node(ReceiveBatch=grpc.unary_unary_rpc_method_handler(
            receive_batch, request_deserializer=api_pb2.ReceiveRequest.FromString,
            response_serializer=api_pb2.ReceiveResponse.SerializeToString))
        try:
            async with AsyncClient(f"127.0.0.1:{port}", "k", retry_attempts=1) as c:
                c.session.supported = False  # unary, as against a node without Session
                for _ in range(3):
                    with pytest.raises(errors.Unavailable):
                        await c.receive("q")
                assert not c._release_supported
        finally:
            await server.stop(None)

    asyncio.run(main())
    assert [k for k, _ in calls] == ["receive"] * 3
    assert len({rid for _, rid in calls}) == 3 and all(rid for _, rid in calls)  # a fresh name each call


def test_closing_the_async_client_fails_a_waiting_receive_with_a_spooler_error(node):
    from spooler import AsyncClient

    async def main():
        c = AsyncClient(node.grpc_target, node.admin_key)
        await c.put_queue("closing")
        t = asyncio.ensure_future(c.receive("closing", wait_s=10))
        deadline = asyncio.get_running_loop().time() + 5
        while not any(w.call is not None for w in c.session.waiting.values()):  # written to the stream
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        await c.close()
        with pytest.raises(errors.SpoolerError):
            await asyncio.wait_for(t, 5)

    asyncio.run(main())


def _forwarding_setup(c, queue, lease_s, forward_timeout_s):
    """In a proxied cluster: a queue holding one message sent through a replica (so the
    replica's link to the primary is connected) -> (primary, replica, HttpClient to the
    primary, HttpClient to the replica)."""
    from nodeproc import wait_until
    from spooler.http import HttpClient

    prim = c.primary()
    rep = next(n for n in c.ids if n != prim)
    direct = HttpClient(c.url(prim), c.admin_key, timeout_s=5)

    def put() -> bool:
        try:
            direct.put_queue(queue, leaseTimeoutSeconds=lease_s)
            return True
        except errors.Unavailable:  # a new primary answers 503 until its epoch is open
            return False
    wait_until(put, 10, what="the primary to take the queue")
    forwarded = HttpClient(c.url(rep), c.admin_key, timeout_s=forward_timeout_s)
    wait_until(lambda: forwarded.send(queue, b"m"), 10, what="a send through the replica")
    c.wait_converged()
    return prim, rep, direct, forwarded


def _lost_receive_in_background(client, queue):
    """A receive whose answer will not arrive, in a thread (joined by the caller)."""
    import threading

    def run():
        try:
            client.receive(queue)
        except Exception:  # noqa: BLE001 - its answer is held: it fails, as it should
            pass
    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_lease_forwarded_by_a_node_that_lost_contact_expires_uncounted(tmp_path):
    """A replica forwards a receive; the primary leases and answers, but the replica is
    cut off (its calls reach the primary, nothing comes back, and the primary hears
    nothing from it) for longer than the lease. Its own release cannot get through, so
    at expiry the primary, seeing that the forwarding node acknowledged nothing since the
    grant, gives the lease back uncounted."""
    from nodeproc import wait_until
    from tests.drills.cluster import Cluster

    with Cluster(str(tmp_path / "c"), partitions=True) as c:
        # the client waits past the lease: one that hung up sooner would cancel the
        # forwarded call, whose release (its calls still reach the primary) would
        # give the lease back before it could expire
        prim, rep, direct, forwarded = _forwarding_setup(c, "cut", lease_s=2, forward_timeout_s=6)
        c.proxy.set_links({(rep, prim): "one_way_reverse", (prim, rep): "blackhole"})
        t = _lost_receive_in_background(forwarded, "cut")
        wait_until(lambda: "gave back 1 expired lease(s)" in c.procs[prim].read_log(), 15,
                   what="the primary to give the lease back")
        d = wait_until(lambda: direct.receive("cut"), 10, what="the message to be visible again")
        assert (d.body, d.retry_count) == (b"m", 0)
        t.join(10)
        c.proxy.heal()


def test_a_forwarders_release_outlasts_a_cut_that_outlasts_the_lease(tmp_path):
    """Drill seed 10859: a replica forwards a long poll, which waits on the primary;
    then the replica is cut off (blackhole both ways). Once it knows no primary it
    gives up on the call (503 to its client) and keeps a release for it. A message
    arrives; the primary leases it to the poll nobody waits for any more, and its
    answer is held in the cut link. The cut outlasts the lease's length counted from
    the replica's giving up, then heals before the lease expires (so the replica has
    acknowledged the primary again, and the lost-contact rule does not apply). The
    release used to be dropped once the lease's length had passed since the giving
    up: the lease then expired into a retry nobody caused. Now it is still there
    when the replica hears from the primary again, and the message comes back
    uncounted."""
    import threading
    import time

    from nodeproc import wait_until
    from spooler.http import HttpClient
    from tests.drills.cluster import Cluster

    lease_s = 4.0
    with Cluster(str(tmp_path / "c"), partitions=True) as c:
        prim, rep, direct, forwarded = _forwarding_setup(c, "held", lease_s=lease_s, forward_timeout_s=30)
        direct.ack(direct.receive("held").token)  # (the setup's message: out of the way)
        poller = HttpClient(c.url(rep), c.admin_key, timeout_s=30)
        t = threading.Thread(target=lambda: _quietly(lambda: poller.receive("held", wait_s=20)))
        t.start()
        wait_until(lambda: _metric(c, prim, "spooler_receives_waiting") == 1, 10,
                   what="the forwarded long poll to wait on the primary")
        c.proxy.isolate(rep, "blackhole")
        t.join(15)
        assert not t.is_alive()  # the replica gave up on the call: it knows no primary
        gave_up_at = time.monotonic()
        wait_until(lambda: time.monotonic() > gave_up_at + 1.0, 5, what="a second after the giving up")
        direct.send("held", b"late")  # leased at once to the poll still waiting on the primary
        wait_until(lambda: direct.get_queue("held")["stats"]["leased"] == 1, 5, what="the lease")
        leased_at = time.monotonic()
        # heal once the lease's length has passed since the giving up, a second
        # before the lease expires
        wait_until(lambda: time.monotonic() > gave_up_at + lease_s + 0.2, 10, what="the old release window to end")
        assert time.monotonic() < leased_at + lease_s - 0.5, "too slow a machine for this test's timing"
        c.proxy.heal()
        log = c.procs[prim].read_log
        wait_until(lambda: "gave back 1 leased message" in log() or _metric(c, prim, "spooler_lease_expiries_total"),
                   15, what="the lease to be given back, or to expire")
        assert _metric(c, prim, "spooler_lease_expiries_total") == 0, "the lease expired into a retry"
        d = wait_until(lambda: direct.receive("held"), 10, what="the message to be visible")
        assert (d.body, d.retry_count) == (b"late", 0)


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - cut off: it fails, as it should
        pass


def _metric(c, nid, name) -> float:
    import re
    import urllib.request
    body = urllib.request.urlopen(f"{c.url(nid)}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{name} (\S+)$", body, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_release_the_forwarder_cannot_call_in_rides_on_its_replication_acks(tmp_path):
    """The primary answered a forwarded receive, then the replica's calls to the primary
    started failing (reset) while the primary's replication stream to the replica kept
    working. The replica's release goes along on its acks, and the primary gives the
    message back long before its 30 s lease would expire."""
    from nodeproc import wait_until
    from tests.drills.cluster import Cluster

    with Cluster(str(tmp_path / "c"), partitions=True) as c:
        prim, rep, direct, forwarded = _forwarding_setup(c, "ride", lease_s=30, forward_timeout_s=15)
        c.proxy.set_link(rep, prim, "one_way_reverse")  # the replica's calls arrive, answers are held
        t = _lost_receive_in_background(forwarded, "ride")
        wait_until(lambda: direct.get_queue("ride")["stats"]["leased"] == 1, 10, what="the lease")
        c.proxy.set_link(rep, prim, "drop")  # the forwarded call fails; no call of the replica gets through
        wait_until(lambda: "gave back 1 leased message" in c.procs[prim].read_log(), 10,
                   what="the release to arrive on an ack")
        d = direct.receive("ride")
        assert d is not None and (d.body, d.retry_count) == (b"m", 0)
        t.join(20)
        c.proxy.heal()


def test_releases_ride_on_acks_bounded_and_each_is_done_once(monkeypatch):
    """A replica puts at most RELEASES_PER_ACK pending releases on one ack and each at most
    every RELEASE_RESEND_S; the primary acts on a repeated one only once."""
    from types import SimpleNamespace

    from node.api.service import Service
    from node.engine import Limits
    from node.replication import driver as D

    pending = {("p:1", "q", f"n{i}"): ["Bearer k", float("-inf")] for i in range(D.RELEASES_PER_ACK + 6)}
    pending[("other:2", "q", "x")] = ["Bearer k", float("-inf")]  # meant for another primary
    fake = SimpleNamespace(engine=SimpleNamespace(pending_releases=pending), addresses={"n1": "p:1"})
    clock = [1000.0]
    monkeypatch.setattr(D.time, "monotonic", lambda: clock[0])
    first = D.Driver._pending_releases(fake, "n1")
    second = D.Driver._pending_releases(fake, "n1")
    assert len(first) == D.RELEASES_PER_ACK and len(second) == 6
    assert not {r.receive_id for r in first} & {r.receive_id for r in second}
    assert D.Driver._pending_releases(fake, "n1") == []  # all sent within RELEASE_RESEND_S
    assert all(r.receive_id != "x" for r in first + second)
    clock[0] += 0.2  # (DESIGN.md: each pending release at most every 250 ms)
    assert D.Driver._pending_releases(fake, "n1") == []  # not yet again
    clock[0] += 0.1
    again = D.Driver._pending_releases(fake, "n1") + D.Driver._pending_releases(fake, "n1")
    assert {r.receive_id for r in again} == {r.receive_id for r in first + second}  # each sent again

    engine = SimpleNamespace(limits=Limits(), tls=None, cluster=True, role="primary", node_id="n1",
                             pending_releases={}, repl=SimpleNamespace(addresses={"n1": ""}))
    svc = Service(engine, ["k"])
    done = []
    svc._release_here = lambda p, q, rid: done.append(rid) or 0
    svc._release_from_peer(first[:3] + first[:3])
    svc._release_from_peer(first[:3])
    assert done == [r.receive_id for r in first[:3]]
    # what it remembers to do each once is bounded (the oldest forgotten first)
    many = [D.pb.PendingRelease(queue="q", receive_id=f"m{i}", authorization="Bearer k") for i in range(5000)]
    svc._release_from_peer(many)
    assert len(svc._peer_releases) == 4096
    assert ("q", "m4999", "Bearer k") in svc._peer_releases and ("q", "m0", "Bearer k") not in svc._peer_releases


def test_a_unary_receive_whose_answer_cannot_be_written_gives_its_leases_back(node):
    """A unary ReceiveBatch whose answer is held up on the way back (the link stops
    passing the node's bytes after 1 MB of a 4 MB answer) until the caller's
    deadline passes: nobody got the messages, and their leases go back at once,
    retry counts kept. The node gave back only a call that ended cancelled, but a
    unary answer that fails to go out ends its call without that: the leases
    stayed for their 60 s and the messages came back counting a retry. It now
    writes the answer itself and gives back when the write fails."""
    ch, stub = _stub(node)
    md = _md(node.admin_key)
    with ch:
        _setup(stub, node.admin_key, "held", [])
        stub.SendBatch(api_pb2.SendBatchRequest(queue="held", bodies=[b"x" * 200_000] * 20), metadata=md)
    host, port = node.grpc_target.rsplit(":", 1)

    async def main():
        async def link(cr, cw):
            sr, sw = await asyncio.open_connection(host, int(port))

            async def up():
                while d := await cr.read(65536):
                    sw.write(d)
                    await sw.drain()

            async def down():
                n = 0
                while n <= 1_000_000 and (d := await sr.read(65536)):
                    n += len(d)
                    cw.write(d)
                    await cw.drain()
                await asyncio.sleep(30)  # held: nothing more reaches the caller

            try:
                await asyncio.gather(up(), down(), return_exceptions=True)
            except asyncio.CancelledError:
                pass  # the test is over: ended quietly (asyncio logs a handler that ends cancelled)
            finally:
                sw.close()
                cw.close()
        srv = await asyncio.start_server(link, "127.0.0.1", 0)
        via = f"127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        try:
            async with grpc.aio.insecure_channel(via, options=[("grpc.http2.bdp_probe", 0)]) as held:
                with pytest.raises(grpc.RpcError):
                    await api_pb2_grpc.SpoolerStub(held).ReceiveBatch(
                        api_pb2.ReceiveRequest(queue="held", max_messages=20), metadata=md, timeout=2)
        finally:
            srv.close()
    asyncio.run(main())
    ch, stub = _stub(node)
    with ch:
        deadline = time.monotonic() + 10
        while (st := stub.GetQueue(api_pb2.QueueRequest(name="held"), metadata=md).stats).leased \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (st.leased, st.visible) == (0, 20), st
        got = stub.ReceiveBatch(api_pb2.ReceiveRequest(queue="held", max_messages=20), metadata=md).messages
        assert len(got) == 20 and {d.retry_count for d in got} == {0}
