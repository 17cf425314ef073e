"""Lost receive answers: ReleaseReceive gives back what a named receive leased (retry
count kept), and a forwarding node does so when the primary's answer never reaches it."""
import asyncio

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


def test_a_receive_name_is_for_one_call(node):
    ch, stub = _stub(node)
    with ch:
        md = _md(node.admin_key)
        _setup(stub, node.admin_key, "once", [b"a", b"b"])
        got = stub.Receive(api_pb2.ReceiveRequest(queue="once", receive_id="n-1"), metadata=md).messages
        assert [d.body for d in got] == [b"a"]
        with pytest.raises(grpc.RpcError) as ei:
            stub.Receive(api_pb2.ReceiveRequest(queue="once", receive_id="n-1"), metadata=md)
        assert _kind(ei.value) == "invalid_argument"
        # the refused call leased nothing: b is still there
        got = stub.Receive(api_pb2.ReceiveRequest(queue="once"), metadata=md).messages
        assert [(d.body, d.retry_count) for d in got] == [(b"b", 0)]


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
            # released while it waits (long poll): when a message arrives it gives it back, answers empty
            first = await stub.Receive(api_pb2.ReceiveRequest(queue="early"), metadata=md)
            waiting = asyncio.ensure_future(stub.ReceiveBatch(
                api_pb2.ReceiveRequest(queue="early", wait_seconds=10, receive_id="x2"), metadata=md))
            await asyncio.sleep(0.2)
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


def test_forwarder_gives_back_a_receive_whose_answer_was_lost(node):
    """The primary runs the forwarded receive and answers, but the answer is held on the
    way back (the link passes requests only) until the forwarder's deadline; the primary
    saw a completed call. The forwarder must then release the receive by its id, so the
    message is visible again long before its 60 s lease would expire, retry count 0."""
    ch, stub = _stub(node)
    with ch:
        _setup(stub, node.admin_key, "fw", [b"lost"])
    host, port = node.grpc_target.rsplit(":", 1)
    with FaultProxy(["fwd", "primary"]) as px:
        px.set_target("primary", host, int(port))
        via = f"127.0.0.1:{px.port('fwd', 'primary')}"

        async def main():
            f = Forwarder(timeout_s=1.0, current_primary=lambda: via)
            # connect first, so the held answer is the only thing the fault affects
            assert (await f.get_queue(via, f"Bearer {node.admin_key}", "fw"))["name"] == "fw"
            px.set_link("fwd", "primary", "one_way_reverse")
            with pytest.raises((errors.Unavailable, errors.OperationUnconfirmed)):
                await f.receive(via, f"Bearer {node.admin_key}", "fw", 0.0, 1, "caller-1", release_for_s=30.0)
            assert len(f._releases) == 1  # retrying in the background through the faulted link
            px.heal()
            await asyncio.wait_for(asyncio.gather(*f._releases), 20)

        asyncio.run(main())
    ch, stub = _stub(node)
    with ch:
        # the forwarder released a name of its own: the caller's name is untouched, so the
        # caller resending its request straight to the primary gets the message (and no
        # late release of the forwarder's can take it away)
        got = stub.Receive(api_pb2.ReceiveRequest(queue="fw", receive_id="caller-1"),
                           metadata=_md(node.admin_key)).messages
        assert [(d.body, d.retry_count) for d in got] == [(b"lost", 0)]


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

    engine = SimpleNamespace(limits=Limits(), tls=None, cluster=True, role="replica", primary_id="n1",
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


def test_async_sdk_releases_a_receive_its_caller_cancelled(node):
    """A receive cancelled by its caller (asyncio.wait_for) whose answer is on its way:
    the SDK releases it in the background; close() waits for that."""
    from spooler import AsyncClient

    ch, stub = _stub(node)
    with ch:
        _setup(stub, node.admin_key, "cancel", [])
    host, port = node.grpc_target.rsplit(":", 1)
    with FaultProxy(["sdk", "node"]) as px:
        px.set_target("node", host, int(port))
        via = f"127.0.0.1:{px.port('sdk', 'node')}"

        async def main():
            async with AsyncClient(via, node.admin_key, timeout_s=5.0, retry_attempts=1) as c:
                assert await c.receive("cancel") == []
                await c.send("cancel", b"m")
                px.set_link("sdk", "node", "one_way_reverse")  # the answer will not arrive
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(c.receive("cancel"), 0.5)
                assert len(c._releases) == 1
        asyncio.run(main())
    ch, stub = _stub(node)
    with ch:
        got = stub.Receive(api_pb2.ReceiveRequest(queue="cancel"), metadata=_md(node.admin_key)).messages
        assert [(d.body, d.retry_count) for d in got] == [(b"m", 0)]


@pytest.mark.parametrize("sdk", ["async", "sync"])
def test_sdk_gives_back_a_receive_whose_answer_was_lost(node, sdk):
    """SDK -> node through a link that passes requests only: the node leases the message
    and answers, the answer never arrives, the SDK's call fails, and the SDK releases the
    receive by its id (the release request gets through; its answer does not)."""
    from spooler import AsyncClient, Client

    ch, stub = _stub(node)
    with ch:
        _setup(stub, node.admin_key, "sdk", [])
    host, port = node.grpc_target.rsplit(":", 1)
    with FaultProxy(["sdk", "node"]) as px:
        px.set_target("node", host, int(port))
        via = f"127.0.0.1:{px.port('sdk', 'node')}"
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
    ch, stub = _stub(node)
    with ch:
        got = stub.Receive(api_pb2.ReceiveRequest(queue="sdk"), metadata=_md(node.admin_key)).messages
        assert [(d.body, d.retry_count) for d in got] == [(b"lost", 0)]


def _node_has_read(client: "socket.socket") -> bool:
    """The node's end of ``client``'s connection has nothing left unread (its kernel
    receive queue is empty, /proc/net/tcp), so the node has taken the request in."""
    lport, rport = client.getsockname()[1], client.getpeername()[1]
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            local, remote, queues = cols[1], cols[2], cols[4]
            if int(local.split(":")[1], 16) == rport and int(remote.split(":")[1], 16) == lport:
                return int(queues.split(":")[1], 16) == 0
    return False


def test_http_receive_whose_client_went_away_gives_the_message_back(node):
    """An HTTP long poll whose client disconnected while it waited: when a message
    arrives the receive leases it, sees the connection gone, and gives it back."""
    import socket

    from nodeproc import wait_until

    ch, stub = _stub(node)
    with ch:
        md = _md(node.admin_key)
        _setup(stub, node.admin_key, "gone", [])
        host, port = node.http_url[len("http://"):].rsplit(":", 1)
        s = socket.create_connection((host, int(port)))
        s.sendall(f"POST /v1/queues/gone/receive?wait=10 HTTP/1.1\r\nHost: x\r\n"
                  f"Authorization: Bearer {node.admin_key}\r\nContent-Length: 0\r\n\r\n".encode())
        wait_until(lambda: _node_has_read(s), 5, what="the node to read the request")
        s.close()
        stub.Send(api_pb2.SendRequest(queue="gone", body=b"m"), metadata=md)
        wait_until(lambda: "gave back 1 leased message" in node.read_log(), 15, what="the give-back")
        got = stub.Receive(api_pb2.ReceiveRequest(queue="gone"), metadata=md).messages
        assert [(d.body, d.retry_count) for d in got] == [(b"m", 0)]
        assert stub.GetQueue(api_pb2.QueueRequest(name="gone"), metadata=md).stats.lease_expired_total == 0
