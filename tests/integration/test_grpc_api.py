"""The gRPC client service and the SDK, against a real node."""
import asyncio
import os
import signal
import threading

import grpc
import pytest

from nodeproc import NodeProc, reaches, wait_until
from spooler import AsyncClient, Client, errors
from spooler.pb import api_pb2, api_pb2_grpc


@pytest.fixture
def client(node):
    with Client(node.grpc_target, node.admin_key, timeout_s=10) as c:
        yield c


def test_queue_lifecycle(client):
    q = client.put_queue("g1", leaseTimeoutSeconds=5, maxRetries=2)
    assert q["created"] is True
    assert q["settings"]["leaseTimeoutSeconds"] == 5 and q["settings"]["failureQueue"] == "g1.failed"
    assert client.put_queue("g1", maxRetries=3)["created"] is False
    assert client.get_queue("g1")["settings"]["maxRetries"] == 3
    assert [q["name"] for q in client.list_queues()] == ["g1"]
    client.send("g1", b"x")
    [m] = client.receive("g1", wait_s=1)
    client.delete_queue("g1")
    with pytest.raises(errors.QueueNotFound):
        client.get_queue("g1")
    # a lease of the deleted queue: the queue is gone, alone or in a batch
    with pytest.raises(errors.QueueNotFound):
        client.ack(m.token)
    [e] = client.settle_batch([(m.token, "nack")])
    assert isinstance(e, errors.QueueNotFound), e


def test_send_receive_ack_nack_renew(client):
    client.put_queue("g2", leaseTimeoutSeconds=30)
    sent = client.send("g2", b"hello")
    [m] = client.receive("g2", wait_s=1)
    assert (m.id, m.body, m.retry_count, m.queue) == (sent.id, b"hello", 0, "g2")
    before = m.expires_at_dt
    assert client.renew(m.token) >= m.expires_at  # RFC 3339 strings compare in time order
    client.nack(m.token)
    [m2] = client.receive("g2", wait_s=1)
    assert (m2.id, m2.retry_count) == (sent.id, 1)
    assert m2.expires_at_dt >= before
    client.ack(m2.token)
    with pytest.raises(errors.StaleLease) as e:
        client.ack(m2.token)
    assert e.value.reason == "settled"
    assert client.receive("g2") == []


def test_a_nack_delay_travels_in_every_settle_form_and_counts_come_back(node, client):
    """A nack's delay reaches the node from nack() and settle_batch(), sync and
    async: the message is delayed, not visible (and a nack without one is visible
    at once). The settle request leaves a zero delay unset; a non-zero one must
    not be left out with it."""
    client.put_queue("g9", leaseTimeoutSeconds=30)
    client.send_batch("g9", [b"a", b"b", b"c", b"d", b"e", b"f"])
    ms = client.receive("g9", wait_s=1, max_messages=6)
    assert len(ms) == 6
    client.nack(ms[0].token, delay_s=600)
    assert client.settle_batch([(ms[1].token, "nack", 600), (ms[2].token, "nack", 0)]) == [None, None]

    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.nack(ms[3].token, delay_s=600)
            assert await c.settle_batch([(ms[4].token, "nack", 600), (ms[5].token, "nack", 0.0)]) == [None, None]

    asyncio.run(main())
    st = client.get_queue("g9")["stats"]
    assert (st["delayed"], st["visible"], st["leased"]) == (4, 2, 0)
    # the two visible ones come back counted, in a batch answer (which leaves a zero count unset)
    again = client.receive("g9", max_messages=10)
    assert sorted((m.id, m.retry_count) for m in again) == sorted([(ms[2].id, 1), (ms[5].id, 1)])
    client.settle_batch([(m.token, "nack", 0) for m in again])

    async def on_session():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            return await c.receive("g9", max_messages=10)

    assert sorted((m.id, m.retry_count) for m in asyncio.run(on_session())) == \
        sorted([(ms[2].id, 2), (ms[5].id, 2)])
    # a missing token is the node's to refuse, one item at a time, as it always was
    [refused] = client.settle_batch([(None, "ack", 0)])
    assert isinstance(refused, errors.InvalidArgument)


def test_only_a_nack_has_a_delay_in_a_settle_batch_as_in_the_unary_calls(node, client):
    """An ack's or a renew's delay means nothing: it is ignored in a SettleBatch as the
    unary Ack ignores it, so the one form cannot refuse what the other takes. A nack's
    delay out of range is still refused."""
    client.put_queue("g10", leaseTimeoutSeconds=30)
    client.send_batch("g10", [b"a", b"b", b"c", b"d"])
    ms = client.receive("g10", wait_s=1, max_messages=4)
    assert len(ms) == 4
    md = (("authorization", f"Bearer {node.admin_key}"),)
    A = api_pb2.SettleBatchRequest.Item
    with grpc.insecure_channel(node.grpc_target) as ch:
        stub = api_pb2_grpc.SpoolerStub(ch)
        stub.Ack(api_pb2.LeaseRequest(token=ms[0].token, delay_seconds=-5), metadata=md)
        r = stub.SettleBatch(api_pb2.SettleBatchRequest(items=[
            A(token=ms[1].token, action=api_pb2.SETTLE_ACK, delay_seconds=-5),
            A(token=ms[2].token, action=api_pb2.SETTLE_RENEW, delay_seconds=1e12),
            A(token=ms[3].token, action=api_pb2.SETTLE_NACK, delay_seconds=-5)]), metadata=md)
    assert [x.HasField("error") for x in r.results] == [False, False, True]
    assert r.results[2].error.kind == "invalid_argument"
    st = client.get_queue("g10")["stats"]
    assert (st["ackedTotal"], st["leased"]) == (2, 2)


def test_messages_sent_in_the_compact_form_are_counted_in_metrics(node, client):
    """A batch in the compact form (one log record, its run returned by apply as
    three figures) counts every message it stored in spooler_sends_total; one sent
    to a deleted queue counts none."""
    import re
    import urllib.request

    def sends():
        with urllib.request.urlopen(node.http_url + "/metrics", timeout=10) as r:
            return float(re.search(rb"^spooler_sends_total ([0-9.e+]+)$", r.read(), re.M).group(1))

    client.put_queue("g10")
    before = sends()
    client.send_batch("g10", [b"a", b"b", b"c"])  # the sync client: entries, one per message

    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.send_batch("g10", [b"d", b"e", b"f", b"g"])  # the Session: the compact form
            with pytest.raises(errors.QueueNotFound):
                await c.send_batch("no-such-queue", [b"h", b"i"])

    asyncio.run(main())
    reaches(sends, before + 7, what="spooler_sends_total to count the 7 stored")


def test_error_kinds_travel_in_trailers(node, client):
    client.put_queue("g3")
    ch = grpc.insecure_channel(node.grpc_target)
    stub = api_pb2_grpc.SpoolerStub(ch)
    with pytest.raises(grpc.RpcError) as e:
        stub.GetQueue(api_pb2.QueueRequest(name="nope"), metadata=(("authorization", f"Bearer {node.admin_key}"),))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    md = dict(e.value.trailing_metadata())
    assert md["spooler-error-kind"] == "queue_not_found"
    status = api_pb2.Status.FromString(md["grpc-status-details-bin"])
    detail = api_pb2.ErrorDetail()
    assert status.details[0].Unpack(detail) and detail.kind == "queue_not_found"
    with pytest.raises(grpc.RpcError) as e:
        stub.GetQueue(api_pb2.QueueRequest(name="g3"))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ch.close()
    with pytest.raises(errors.InvalidArgument):
        client.put_queue("bad name")
    with pytest.raises(errors.MessageTooLarge):
        client.send("g3", b"x" * (256 * 1024 + 1))
    with pytest.raises(errors.InvalidArgument):
        client.ack("not-a-token")


def test_authorization_given_twice_is_invalid_argument_on_unary_and_session(node, client):
    """Two authorization entries in a call's metadata (even the same valid key
    twice) are ambiguous: invalid_argument, as a repeated header is over HTTP,
    with its kind trailer on a unary call, and as the answer to each request on a
    Session stream (which itself ends well: see test_session.py,
    test_a_wrong_key_is_unauthenticated_on_every_call_never_a_transport_failure);
    nothing is stored."""
    client.put_queue("g4")
    md = (("authorization", f"Bearer {node.admin_key}"),) * 2
    ch = grpc.insecure_channel(node.grpc_target)
    try:
        stub = api_pb2_grpc.SpoolerStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Send(api_pb2.SendRequest(queue="g4", body=b"x"), metadata=md, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(e.value.trailing_metadata())["spooler-error-kind"] == "invalid_argument"
        send = api_pb2.SendBatchRequest(queue="g4", bodies=[b"x"])
        call = stub.Session(iter([api_pb2.SessionRequest(id=1, send_batch=send)]), metadata=md, timeout=10)
        assert [(a.id, a.error.kind) for a in call] == [(1, "invalid_argument")]
    finally:
        ch.close()
    assert client.get_queue("g4")["stats"]["sentTotal"] == 0


def test_a_receive_wait_that_is_not_0_to_20_seconds_is_invalid_argument_in_both_clients(node, client):
    """API.md: a receive waits 0 to 20 s. A wait outside that (NaN, infinite,
    huge, negative, 21) is invalid_argument in both SDK clients, not a call that
    ends at once as a timeout (unavailable: "try again", which kept `consume`
    looping without a word); a wait that is not a number is a TypeError. And
    consume with such a wait ends with that error. The controls: 0 and 20 are
    taken (20 returns at once, a message being there)."""
    client.put_queue("w1")
    bad = (float("nan"), float("inf"), 1e308, -1.0, 21)

    def handler(m):
        raise AssertionError("nothing should be handled")
    for w in bad:
        with pytest.raises(errors.InvalidArgument):
            client.receive("w1", wait_s=w)
    with pytest.raises(TypeError):
        client.receive("w1", wait_s="1")
    with pytest.raises(errors.InvalidArgument):
        client.receive("w1", max_messages=True)
    client.send("w1", b"x")
    stop = threading.Event()
    with pytest.raises(errors.InvalidArgument):
        client.consume("w1", handler, wait_s=float("nan"), stop=stop)
    got = client.receive("w1", wait_s=20)  # taken: the message is there, so it returns at once
    assert [m.body for m in got] == [b"x"]
    assert client.receive("w1", wait_s=0) == []

    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as a:
            for w in bad:
                with pytest.raises(errors.InvalidArgument):
                    await a.receive("w1", wait_s=w)
            with pytest.raises(TypeError):
                await a.receive("w1", wait_s="1")
            with pytest.raises(errors.InvalidArgument):
                await asyncio.wait_for(a.consume("w1", lambda m: asyncio.sleep(0), wait_s=float("nan")), 30)
    asyncio.run(main())


def test_sdk_arguments_of_the_wrong_kind_say_what_is_wrong(node, client):
    """S8, in the SDK: a client with no node named is a ValueError at once (not
    an internal error on the first call); a lease token that is not a str is a
    TypeError that says so (not protobuf's "bad argument type"); maxRetries
    2.0 is 2, as over HTTP, and 2.5 is invalid_argument; settle_batch takes
    (token, action) items as well as (token, action, delay_s)."""
    for target in ("", " , "):
        with pytest.raises(ValueError, match="target"):
            Client(target, node.admin_key)
        with pytest.raises(ValueError, match="target"):
            AsyncClient(target, node.admin_key)
    for call in (client.ack, client.nack, client.renew):
        with pytest.raises(TypeError, match="lease token"):
            call(5)
    with pytest.raises(TypeError, match="lease token"):
        client.settle_batch([(5, "ack")])
    assert client.put_queue("m1", maxRetries=2.0)["settings"]["maxRetries"] == 2
    with pytest.raises(errors.InvalidArgument):
        client.put_queue("m1", maxRetries=2.5)
    client.send_batch("m1", [b"a", b"b"])
    got = client.receive("m1", max_messages=2)
    assert client.settle_batch([(got[0].token, "ack"), (got[1].token, "nack", 0)]) == [None, None]

    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as a:
            for call in (a.ack, a.nack, a.renew):
                with pytest.raises(TypeError, match="lease token"):
                    await call(5)
    asyncio.run(main())


def test_scoped_keys(node, client):
    client.put_queue("a")
    client.put_queue("b")
    k = client.create_key(queue="a", scopes=["send"])
    assert k.key.startswith("spk_") and list(k.scopes) == ["send"]
    with Client(node.grpc_target, k.key) as limited:
        limited.send("a", b"x")
        with pytest.raises(errors.Forbidden):
            limited.receive("a")
        with pytest.raises(errors.Forbidden):
            limited.send("b", b"x")
    with Client(node.grpc_target, "wrong") as bad:
        with pytest.raises(errors.Unauthenticated):
            bad.send("a", b"x")
    # the gRPC clients manage keys as HTTP does: list (no secrets), delete
    assert k.id in [x.id for x in client.list_keys()]
    assert all(not x.key for x in client.list_keys())
    client.delete_key(k.id)
    assert k.id not in [x.id for x in client.list_keys()]
    with Client(node.grpc_target, k.key) as limited:
        with pytest.raises(errors.Unauthenticated):
            limited.send("a", b"x")


def test_the_asyncio_client_lists_and_deletes_keys_and_promotes(node):
    import asyncio
    from spooler import AsyncClient

    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            k = await c.create_key("ak", ["send"])
            assert k.id in [x.id for x in await c.list_keys()]
            await c.delete_key(k.id)
            assert k.id not in [x.id for x in await c.list_keys()]
            info = await c.promote("n1")  # a lone node is the primary already: its document
            assert info.role == "primary" and info.node_id == "n1"
    asyncio.run(main())


def test_purge_in_both_clients(node, client):
    """Purge (an extension): every message goes, a leased one's lease ends
    (stale_lease, settled), purgedTotal counts them; the asyncio client's
    purge is the same call."""
    client.put_queue("purged")
    client.send_batch("purged", [b"a", b"b", b"c"])
    [m] = client.receive("purged")
    assert client.purge("purged") == 3
    with pytest.raises(errors.StaleLease) as e:
        client.ack(m.token)
    assert e.value.reason == "settled"
    st = client.get_queue("purged")["stats"]
    assert (st["visible"], st["leased"], st["purgedTotal"]) == (0, 0, 3)
    with pytest.raises(errors.QueueNotFound):
        client.purge("no-such-queue")

    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as a:
            await a.send("purged", b"d")
            return await a.purge("purged")
    assert asyncio.run(main()) == 1
    assert client.get_queue("purged")["stats"]["purgedTotal"] == 4


def test_batch_send_receive_settle(client):
    client.put_queue("g4")
    res = client.send_batch("g4", [f"m{i}".encode() for i in range(50)])
    assert len({r.id for r in res}) == 50
    msgs = client.receive("g4", max_messages=100)
    assert [m.body for m in msgs] == [f"m{i}".encode() for i in range(50)]  # oldest first
    items = [(m.token, "ack", 0) for m in msgs[:40]] + [(m.token, "nack", 0) for m in msgs[40:45]]
    items += [(msgs[45].token, "renew", 0), ("garbage-token", "ack", 0), (msgs[0].token, "ack", 0)]
    out = client.settle_batch(items)
    assert out[:45] == [None] * 45
    assert isinstance(out[45], str) and out[45].endswith("Z")
    assert isinstance(out[46], errors.InvalidArgument)
    assert isinstance(out[47], errors.StaleLease) and out[47].reason == "settled"
    st = client.get_queue("g4")["stats"]
    assert (st["ackedTotal"], st["visible"], st["leased"]) == (40, 5, 5)


def test_a_receive_answers_at_most_8_mib_of_bodies(node):
    """70 bodies of 256 KiB are 17.5 MiB, past gRPC's 16 MiB message: one receive of
    them all leases the oldest 32 (8 MiB) and leaves the others visible, untouched.
    The same after a restart, when the sizes come from the store (the 32 leased
    before it, visible again, now have rows of their own; the rest are still in
    their batches' rows)."""
    body = 256 * 1024
    with Client(node.grpc_target, node.admin_key, timeout_s=10) as client:
        client.put_queue("big")
        sent = []
        for n in (30, 30, 10):
            sent += [r.id for r in client.send_batch("big", [bytes([len(sent) + i]) * body for i in range(n)])]
        first = client.receive("big", max_messages=100)
        assert [m.id for m in first] == sent[:32]
        assert all(len(m.body) == body for m in first)
        st = client.get_queue("big")["stats"]
        assert (st["leased"], st["visible"]) == (32, 38)
    node.stop()  # graceful: the last checkpoint writes the leased ones' own rows
    node.start()
    with Client(node.grpc_target, node.admin_key, timeout_s=10) as client:
        for part in (sent[:32], sent[32:64], sent[64:]):
            got = client.receive("big", max_messages=100)
            assert [m.id for m in got] == part and {m.retry_count for m in got} == {0}
        st = client.get_queue("big")["stats"]
        assert (st["leased"], st["visible"], st.get("leaseExpiredTotal", 0)) == (70, 0, 0)


def test_batch_send_is_all_or_nothing(client):
    client.put_queue("g5")
    with pytest.raises(errors.MessageTooLarge):
        client.send_batch("g5", [b"ok", b"x" * (256 * 1024 + 1)])
    assert client.get_queue("g5")["stats"]["sentTotal"] == 0


def test_sync_auto_batching_coalesces_concurrent_sends(node, client):
    client.put_queue("g6")
    n = 400
    barrier = threading.Barrier(16)

    def worker(k):
        barrier.wait()
        return [client.send("g6", f"{k}-{i}".encode()).id for i in range(n // 16)]

    threads, out = [], []
    for k in range(16):
        t = threading.Thread(target=lambda k=k: out.extend(worker(k)))
        threads.append(t)
        t.start()
    for t in threads:
        t.join(30)
    assert len(set(out)) == n
    assert client.get_queue("g6")["stats"]["sentTotal"] == n
    assert client.send_rpcs < n  # concurrent sends shared RPCs


def test_sixty_four_senders_share_each_rpc(node):
    """The peers' harness shape: 64 coroutines, each sending again as soon as its send
    is answered. Every batch's callers are answered together and send again together,
    so each RPC carries all 64 (the benchmark's 5,000 sends take 79 RPCs). A client that
    let the first of them go out alone would need about twice as many RPCs (a defect that
    halved the 3-node benchmark once)."""
    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("g64")
            sem = asyncio.Semaphore(64)

            async def one(i):
                async with sem:
                    return await c.send("g64", b"%d" % i)

            n = 64 * 20
            rpcs0 = c.send_rpcs
            res = await asyncio.gather(*[one(i) for i in range(n)])
            assert len({r.id for r in res}) == n
            return c.send_rpcs - rpcs0, n

    rpcs, n = asyncio.run(main())
    assert rpcs <= n // 64 + 2, rpcs


def test_async_client_auto_batching_and_one_bad_entry(node):
    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("g7")
            res = await asyncio.gather(*[c.send("g7", f"m{i}".encode()) for i in range(300)])
            assert len({r.id for r in res}) == 300
            assert c.send_rpcs < 300
            # a bad entry inside a coalesced batch fails alone
            rs = await asyncio.gather(c.send("g7", b"fine"), c.send("g7", b"x" * (256 * 1024 + 1)),
                                      c.send("nope", b"y"), return_exceptions=True)
            assert not isinstance(rs[0], Exception)
            assert isinstance(rs[1], errors.MessageTooLarge)
            assert isinstance(rs[2], errors.QueueNotFound)
            return (await c.get_queue("g7"))["stats"]["sentTotal"]

    assert asyncio.run(main()) == 301


@pytest.mark.parametrize("bad", ["queue", "size"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_one_bad_send_among_a_hundred_costs_the_others_a_few_batches_not_a_hundred(node, kind, bad):
    """An auto-batch refused for one bad send is sent again by queue when the error
    is about a queue (one that does not exist), else in halves (a body too
    large): the 99 good sends are stored after at most 2 more batches, or
    1 + 2 * 7 (one at a time, as before 0.4.38, made 101 RPCs, and the good
    callers waited out a quorum commit each)."""
    n, at = 100, 37

    def send_of(i):
        if i != at:
            return "hb", b"%d" % i
        return ("nope", b"x") if bad == "queue" else ("hb", b"x" * (256 * 1024 + 1))
    if kind == "async":
        async def main():
            async with AsyncClient(node.grpc_target, node.admin_key, batches_in_flight_max=1) as c:
                await c.put_queue("hb")
                await c.send("hb", b"warm")  # the first batch goes alone; the rest queue behind it
                rpcs0 = c.send_rpcs
                rs = await asyncio.gather(*[c.send(*send_of(i)) for i in range(n)], return_exceptions=True)
                return rs, c.send_rpcs - rpcs0
        rs, rpcs = asyncio.run(main())
    else:
        with Client(node.grpc_target, node.admin_key, batches_in_flight_max=1) as c:
            c.put_queue("hb")
            rpcs0 = c.send_rpcs
            futs = [c.send_async(api_pb2.SendRequest(queue=q, body=b)) for q, b in map(send_of, range(n))]
            rs = []
            for f in futs:
                try:
                    rs.append(f.result(30))
                except errors.SpoolerError as e:
                    rs.append(e)
            rpcs = c.send_rpcs - rpcs0
    assert isinstance(rs[at], errors.QueueNotFound if bad == "queue" else errors.MessageTooLarge), rs[at]
    assert not any(isinstance(r, Exception) for i, r in enumerate(rs) if i != at)
    # (+2: the first sends may go in a batch of their own)
    assert rpcs <= (1 + 2 if bad == "queue" else 1 + 2 * 7) + 2, rpcs


def test_dedup_keyed_send(client):
    client.put_queue("g8", dedupWindowSeconds=60)
    a = client.send("g8", b"1", dedup_key="order-1")
    b = client.send("g8", b"2", dedup_key="order-1")
    assert (b.id, b.duplicate, a.duplicate) == (a.id, True, False)


def test_consumer_renews_then_acks_or_nacks(node, client):
    client.put_queue("g9", leaseTimeoutSeconds=2, maxRetries=5)
    client.send("g9", b"slow")
    client.send("g9", b"boom")
    seen = []

    def handler(m):
        seen.append((m.body, m.retry_count))
        if m.body == b"slow":
            # outlive the 2 s lease twice over: the helper must renew (each renewal
            # has a second to arrive: a loaded machine's stalls do not lose it)
            ev = threading.Event()
            ev.wait(4.5)
        else:
            raise RuntimeError("handler failed")

    stop = threading.Event()
    t = threading.Thread(target=lambda: client.consume("g9", handler, wait_s=0.2, stop=stop))
    t.start()
    try:
        wait_until(lambda: client.get_queue("g9")["stats"]["ackedTotal"] == 1
                   and (b"boom", 1) in seen, timeout_s=15, what="slow acked, boom redelivered")
    finally:
        stop.set()
        t.join(10)
    st = client.get_queue("g9")["stats"]
    assert st["leaseExpiredTotal"] == 0  # renewed, never expired
    assert st["nackedTotal"] >= 1
    assert seen.count((b"slow", 0)) == 1  # delivered once


class _ClockBehind:
    """Stands in for spooler._common's datetime: the client's wall clock a minute
    behind the node's (renewals timed by it would come 30 s late)."""
    from datetime import datetime as _dt

    @classmethod
    def now(cls, tz=None):
        from datetime import timedelta
        return cls._dt.now(tz) - timedelta(seconds=60)

    @classmethod
    def fromisoformat(cls, s):
        return cls._dt.fromisoformat(s)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_client_clock_behind_the_nodes_does_not_delay_its_renewals(node, client, monkeypatch, flavour):
    """The node says how long each lease lasts (lease_seconds_left), and the SDK times
    renewals from that on its own monotonic clock: with its wall clock a minute
    behind, a handler that outlives the 2 s lease twice over still keeps it."""
    import spooler._common as common
    q = f"skew-{flavour}"
    client.put_queue(q, leaseTimeoutSeconds=2)
    client.send(q, b"slow")
    monkeypatch.setattr(common, "datetime", _ClockBehind)
    if flavour == "sync":
        [m] = client.receive(q, wait_s=5)
        assert 1.9 < m.expires_at.left_s <= 2.0
        assert client.handle(m, lambda m: threading.Event().wait(4.5)) is True
    else:
        async def main():
            async with AsyncClient(node.grpc_target, node.admin_key) as c:
                [m] = await c.receive(q, wait_s=5)
                assert 1.9 < m.expires_at.left_s <= 2.0
                await c._handle(m, lambda m: asyncio.sleep(4.5), 0.0)
        asyncio.run(main())
    st = client.get_queue(q)["stats"]
    assert (st["ackedTotal"], st["leaseExpiredTotal"]) == (1, 0), st


def test_epoch_in_trailers_and_restart_is_primary_change(node):
    with Client(node.grpc_target, node.admin_key) as c:
        c.put_queue("ge", leaseTimeoutSeconds=60)
        c.send("ge", b"x")
        [m] = c.receive("ge")
        info = c.cluster()
        assert info.role == "primary" and info.node_id == "n1"
        assert c.promote("n1").epoch == info.epoch  # already the primary: nothing changes
        epoch = info.epoch
    node.restart()
    with Client(node.grpc_target, node.admin_key) as c:
        assert c.cluster().epoch == epoch + 1
        with pytest.raises(errors.StaleLease) as e:
            c.ack(m.token)
        assert e.value.reason == "primary_changed"
        [m2] = c.receive("ge")
        assert (m2.id, m2.retry_count) == (m.id, 0)


def test_health_service(node):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    ch = grpc.insecure_channel(node.grpc_target)
    r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert r.status == health_pb2.HealthCheckResponse.SERVING
    ch.close()


def test_server_reflection_lists_the_client_service_and_describes_its_messages(node):
    """grpcurl and other generic clients find the API without proto/: server
    reflection lists the client service (not the members-only Replication
    service) and describes its methods and messages from the same descriptors
    the node serves, and nothing of the members' schema (the replication
    service, the log's records: with reflection's default pool both were
    described when asked by name). No key is needed for it."""
    from google.protobuf import descriptor_pool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    ch = grpc.insecure_channel(node.grpc_target)
    try:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {"spooler.v1.Spooler", "grpc.health.v1.Health"} <= services, services
        assert not any("Replication" in s for s in services), services
        pool = descriptor_pool.DescriptorPool(db)
        svc = pool.FindServiceByName("spooler.v1.Spooler")
        want = api_pb2.DESCRIPTOR.services_by_name["Spooler"]
        assert {m.name for m in svc.methods} == {m.name for m in want.methods}
        send = pool.FindMessageTypeByName("spooler.v1.SendRequest")
        assert [f.name for f in send.fields] == [f.name for f in api_pb2.SendRequest.DESCRIPTOR.fields]
        # nor is the members' schema described (a symbol's file, asked by name)
        for symbol in ("spooler.v1.Replication", "spooler.v1.Record"):
            with pytest.raises(KeyError):
                db.FindFileContainingSymbol(symbol)
    finally:
        ch.close()


def test_health_watches_and_reflection_sessions_end_when_the_node_stops(tmp_path):
    """A client whose channel checks health (gRPC's client-side health checking)
    keeps a Watch stream open all the time; grpcurl keeps a reflection session
    open while it works. At a graceful stop both end ``unavailable`` (the Watch
    after saying NOT_SERVING) like the node's own calls, instead of holding the
    server's stop for its whole grace of 1 s and then being cut (an outside audit
    saw stops of 1.6 to 2 s)."""
    import queue
    import signal

    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from nodeproc import NodeProc
    n = NodeProc(str(tmp_path / "n")).start()
    ch = grpc.insecure_channel(n.grpc_target)
    try:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        asks: queue.Queue = queue.Queue()
        session = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(iter(asks.get, None))
        asks.put(reflection_pb2.ServerReflectionRequest(list_services=""))
        assert next(session).HasField("list_services_response")
        n.proc.send_signal(signal.SIGTERM)
        statuses = []
        with pytest.raises(grpc.RpcError) as e:
            for r in watch:
                statuses.append(r.status)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and e.value.details() == "the node is stopping", e.value
        assert statuses and statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING, statuses
        with pytest.raises(grpc.RpcError) as e:
            next(session)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and e.value.details() == "the node is stopping", e.value
        assert n.proc.wait(10) == 0
        asks.put(None)
    finally:
        ch.close()
        n.kill()


# ------------------------------------------------- found by an outside audit (2026-11-30)

def _stub(node):
    ch = grpc.insecure_channel(node.grpc_target)
    return ch, api_pb2_grpc.SpoolerStub(ch), (("authorization", f"Bearer {node.admin_key}"),)


def test_a_session_names_the_epoch_when_it_ends_and_when_it_refuses_a_key(node):
    ch, stub, md = _stub(node)
    try:
        stub.PutQueue(api_pb2.PutQueueRequest(name="se"), metadata=md)
        call = stub.Session(iter([api_pb2.SessionRequest(id=1, receive=api_pb2.ReceiveRequest(queue="se"))]),
                            metadata=md)
        assert [r.id for r in call] == [1]
        assert dict(call.trailing_metadata()).get("spooler-epoch", "").isdigit()
        bad = stub.Session(iter([api_pb2.SessionRequest(id=1, receive=api_pb2.ReceiveRequest(queue="se"))]),
                           timeout=30)
        answers = list(bad)  # a refused key: its request answered so, and the stream ends well
        assert [(a.id, a.error.kind) for a in answers] == [(1, "unauthenticated")] and answers[0].epoch > 0
        assert dict(bad.trailing_metadata()).get("spooler-epoch", "").isdigit()
    finally:
        ch.close()


def test_a_node_told_to_stop_ends_its_calls_as_unavailable(node):
    """SIGTERM: a long poll in progress and an open Session end with the kind
    unavailable (and the epoch), not a bare CANCELLED; the SDK calls that as
    unavailable too."""
    ch, stub, md = _stub(node)
    try:
        stub.PutQueue(api_pb2.PutQueueRequest(name="st"), metadata=md)
        poll = stub.Receive.future(api_pb2.ReceiveRequest(queue="st", wait_seconds=15), metadata=md, timeout=30)
        requests = threading.Event()

        def session_requests():
            yield api_pb2.SessionRequest(id=1, receive=api_pb2.ReceiveRequest(queue="st", wait_seconds=15))
            requests.wait(30)  # the client keeps its side open
        sess = stub.Session(session_requests(), metadata=md, timeout=30)
        wait_until(lambda: node.metric("spooler_receives_waiting") >= 2, 10, what="both long polls waiting")
        node.proc.send_signal(signal.SIGTERM)
        for what, get in (("unary", lambda: poll.result()), ("session", lambda: list(sess))):
            with pytest.raises(grpc.RpcError) as e:
                get()
            t = dict(e.value.trailing_metadata() or ())
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and t.get("spooler-error-kind") == "unavailable", \
                (what, e.value.code(), e.value.details(), t)
            assert t.get("spooler-epoch", "").isdigit(), (what, t)
        requests.set()
        assert node.proc.wait(timeout=20) == 0
    finally:
        ch.close()


def test_the_health_status_says_not_serving_once_the_node_stops(node):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    ch = grpc.insecure_channel(node.grpc_target)
    try:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        node.proc.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        ch.close()


def test_an_unknown_method_is_unimplemented_with_a_kind_and_the_epoch(node):
    """gRPC answers a method nobody serves with a bare UNIMPLEMENTED; ours carries
    the kind and the epoch like every other error, for unary and streaming calls."""
    ch = grpc.insecure_channel(node.grpc_target)
    for path, shape in (("/spooler.v1.Spooler/NoSuchCall", "unary"), ("/nobody.Here/Stream", "stream")):
        with pytest.raises(grpc.RpcError) as e:
            if shape == "unary":
                ch.unary_unary(path)(b"", timeout=5)
            else:
                next(ch.stream_stream(path)(iter([b"\x01", b"\x02"]), timeout=5))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        md = dict(e.value.trailing_metadata())
        assert md["spooler-error-kind"] == "method_not_allowed", md
        assert int(md["spooler-epoch"]) >= 1
        assert path in e.value.details()
    ch.close()
    # the services themselves still answer
    with Client(node.grpc_target, node.admin_key) as c:
        assert c.cluster().role == "primary"


def test_each_checkpoint_is_counted_and_timed_in_metrics(node, client):
    """spooler_checkpoint_seconds counts the checkpoints a node takes (about one a
    second while anything changes) and sums their time."""
    import re
    import urllib.request

    def checkpoints():
        with urllib.request.urlopen(node.http_url + "/metrics", timeout=10) as r:
            body = r.read()
        count = re.search(rb"^spooler_checkpoint_seconds_count ([0-9.e+]+)$", body, re.M)
        total = re.search(rb"^spooler_checkpoint_seconds_sum ([0-9.e+]+)$", body, re.M)
        return float(count.group(1)), float(total.group(1))

    client.put_queue("g11")
    n0, s0 = checkpoints()
    client.send("g11", b"x")  # something changed: the next checkpoint writes it
    wait_until(lambda: checkpoints()[0] > n0, timeout_s=10, what="a checkpoint counted")
    assert checkpoints()[1] > s0


def test_memory_the_bodies_took_is_handed_back_after_the_checkpoint(tmp_path):
    """After a checkpoint lets message bodies go, the node asks the C library to hand
    its free memory back to the OS (node/process.py: release_memory), and counts by
    how much its resident size fell. Without that the node stayed as large as at its
    peak after a burst of sends (docs/benchmarks-history.md)."""
    from node.process import release_memory
    from nodeproc import NodeProc

    if release_memory() is None:
        pytest.skip("no malloc_trim in this C library")
    n = NodeProc(str(tmp_path / "n"), env={"SPOOLER_RELEASE_MEMORY_INTERVAL": "0"}).start()
    try:
        async def burst():
            async with AsyncClient(n.grpc_target, n.admin_key) as c:
                await c.put_queue("mem")
                for _ in range(50):
                    await c.send_batch("mem", [b"x" * 256] * 1000)

        asyncio.run(burst())
        # 12.8 MB of bodies went through; what the parsed requests and records took comes back
        wait_until(lambda: n.metric("spooler_memory_released_bytes_total") > 4 << 20, timeout_s=20,
                   what="memory handed back after the checkpoint")
    finally:
        n.kill()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("with_key", [False, True], ids=["no key", "admin key"])
def test_refused_requests_of_millions_of_items_are_let_go_of(node, with_key):
    """An 8 MB SettleBatch of 4,000,000 empty items parses into about 200 MB. Refused
    (no key: unauthenticated; with one: over the 1,000-item cap, checked before the
    items are read out), the request must go with the call: the error's frames held
    it in a reference cycle, and each such request stayed (RSS grew by 200-900 MB a
    request) until a full collection, rare with the node's GC thresholds."""
    ch = grpc.insecure_channel(node.grpc_target, options=[("grpc.max_send_message_length", 32 << 20)])
    call = ch.unary_unary("/spooler.v1.Spooler/SettleBatch", request_serializer=lambda b: b,
                          response_deserializer=lambda b: b)
    md = (("authorization", f"Bearer {node.admin_key}"),) if with_key else ()
    want = grpc.StatusCode.INVALID_ARGUMENT if with_key else grpc.StatusCode.UNAUTHENTICATED
    after = []
    try:
        for _ in range(5):
            with pytest.raises(grpc.RpcError) as e:
                call(b"\x0a\x00" * 4_000_000, metadata=md, timeout=60)
            assert e.value.code() == want, e.value
            after.append(_rss_mib(node.pid))
    finally:
        ch.close()
    # the first request's memory stays with the allocator and is reused; four more
    # that each stayed would add some 800 MB
    assert after[-1] - after[0] < 150, after


def test_a_batch_over_the_cap_is_refused_before_its_items_are_read():
    """grpc_api checks a batch's size before building lists of its items."""
    from node.api import grpc_api
    from node.engine import Limits
    from spooler.errors import InvalidArgument

    class Items(list):
        def __len__(self):
            return 10 ** 7

        def __iter__(self):
            raise AssertionError("the items were read")

    class Req:
        items = entries = Items()
        bodies = ()

    class Svc:
        limits = Limits()

    with pytest.raises(InvalidArgument, match="at most 1000 items in a batch"):
        asyncio.run(grpc_api._settle_batch(Svc(), None, Req()))
    with pytest.raises(InvalidArgument, match="at most 1000 messages in a batch"):
        grpc_api._send_args(Svc(), Req())


def test_a_create_key_naming_too_many_scopes_is_refused_before_they_are_read(node):
    """CreateKey takes repeats of a scope (a key's scopes are a set), so only the
    count bounds what becomes a list: more than 64 names, 4 MB of empty ones
    among them, are refused as invalid_argument; 64 repeats still make a key."""
    with grpc.insecure_channel(node.grpc_target) as ch:
        stub = api_pb2_grpc.SpoolerStub(ch)
        md = (("authorization", f"Bearer {node.admin_key}"),)
        key = stub.CreateKey(api_pb2.CreateKeyRequest(queue="*", scopes=["send"] * 64), metadata=md, timeout=10)
        assert list(key.scopes) == ["send"]
        for scopes in (["send"] * 65, [""] * 2_000_000):
            with pytest.raises(grpc.RpcError) as ei:
                stub.CreateKey(api_pb2.CreateKeyRequest(queue="*", scopes=scopes), metadata=md, timeout=10)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert dict(ei.value.trailing_metadata())["spooler-error-kind"] == "invalid_argument"
            assert "at most 64" in ei.value.details()


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def test_an_open_session_lets_go_of_a_refused_request_of_millions_of_items(node):
    """A Session stream's reader held its last request while it waited for the next:
    an idle stream kept a refused 8 MB settle_batch of 4,000,000 empty items (about
    200 MB parsed) for as long as it stayed open. Four such streams, held open."""
    items = b"\x0a\x00" * 4_000_000
    settle = b"\x22" + _varint(len(items)) + items            # SessionRequest.settle_batch (field 4)
    request = b"\x08\x01" + settle                             # id 1
    ch = grpc.insecure_channel(node.grpc_target, options=[("grpc.max_send_message_length", 32 << 20)])
    session = ch.stream_stream("/spooler.v1.Spooler/Session", request_serializer=lambda b: b,
                               response_deserializer=api_pb2.SessionResponse.FromString)
    md = (("authorization", f"Bearer {node.admin_key}"),)
    hold, calls, after = threading.Event(), [], []

    def requests():
        yield request
        hold.wait(60)  # the stream stays open, idle

    try:
        for _ in range(4):
            call = session(requests(), metadata=md, timeout=60)
            calls.append(call)
            answer = next(call)
            assert answer.id == 1 and answer.error.kind == "invalid_argument", answer
            after.append(_rss_mib(node.pid))
    finally:
        hold.set()
        for call in calls:
            call.cancel()
        ch.close()
    assert after[-1] - after[0] < 150, after


def test_an_error_quoting_a_huge_argument_keeps_its_kind(client):
    """A 100 KB key id or node name was quoted into the error's message, which
    did not fit gRPC's trailers: the call failed RESOURCE_EXHAUSTED with no kind.
    Messages are cut at 1,000 characters."""
    with pytest.raises(errors.NotFound) as e:
        client.delete_key("k" * 100_000)
    assert len(e.value.message) <= errors.MESSAGE_CHARS_MAX
    with pytest.raises(errors.SpoolerError) as e:
        client.promote("n" * 100_000)
    assert e.value.kind in ("invalid_argument", "not_found"), e.value


@pytest.mark.integration
def test_a_burst_of_3000_unary_long_polls_is_served_not_cancelled(node):
    """3,000 unary Receive calls at once on one channel (long polls of 1 s on an
    empty queue). gRPC core cancels calls waiting for the Python server past its
    pending-call limits (1,000 soft, 3,000 hard, by default), before any handler
    runs: about 500 of such a burst came back CANCELLED. With the node's limits
    raised (grpc_api.server_options), every one is answered OK and empty."""
    from collections import Counter

    async def burst():
        md = (("authorization", f"Bearer {node.admin_key}"),)
        async with grpc.aio.insecure_channel(node.grpc_target) as ch:
            stub = api_pb2_grpc.SpoolerStub(ch)
            await stub.PutQueue(api_pb2.PutQueueRequest(name="burst"), metadata=md, timeout=10)

            async def poll():
                try:
                    r = await stub.Receive(api_pb2.ReceiveRequest(queue="burst", wait_seconds=1),
                                           metadata=md, timeout=60)
                    return "ok" if not r.messages else "a message?"
                except grpc.aio.AioRpcError as e:
                    return e.code().name

            return Counter(await asyncio.gather(*[poll() for _ in range(3000)]))

    outcomes = asyncio.run(burst())
    assert outcomes == {"ok": 3000}, outcomes


def _calls_figures(node) -> tuple:
    """({(api, call, outcome): calls}, {(api, call): timed calls}) from the node's /metrics."""
    counts, timed = {}, {}
    for s in node.samples("spooler_calls_total", "spooler_call_seconds_count"):
        if s.name == "spooler_calls_total":
            counts[(s.labels["api"], s.labels["call"], s.labels["outcome"])] = s.value
        else:
            timed[(s.labels["api"], s.labels["call"])] = s.value
    return counts, timed


def test_every_call_is_counted_by_api_call_and_outcome_and_timed(node, client):
    """spooler_calls_total counts each call the node answered, over HTTP, unary gRPC
    and a Session stream, by its route or method and its outcome (ok, or the
    error's kind); spooler_call_seconds times each. A queue's name is never a
    label (the route's template is), and a path that matches no route is
    "unmatched", so no client can make the node grow series."""
    import json
    import urllib.error
    import urllib.request

    def http(method, path, body=None):
        req = urllib.request.Request(node.http_url + path, data=body, method=method,
                                     headers={"Authorization": f"Bearer {node.admin_key}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    client.put_queue("counted-q")
    client.send("counted-q", b"unary")                      # the sync client: SendBatch
    with pytest.raises(errors.QueueNotFound):
        client.get_queue("missing-q")
    assert http("POST", "/v1/queues/counted-q/messages", b"h1") == 201
    assert http("POST", "/v1/queues/counted-q/messages", b"h2") == 201
    assert http("POST", "/v1/queues/missing-q/messages", b"h3") == 404
    assert http("GET", "/v2/counted-q") == 404
    import socket
    from urllib.parse import urlsplit
    where = urlsplit(node.http_url)
    for raw in (b"M123 / HTTP/1.1\r\nHost: x\r\n\r\n",  # aiohttp refuses it before any route
                b"POST /v1/queues/counted-q/messages HTTP/1.1\r\nHost: x\r\nExpect: bogus\r\n"
                b"Content-Length: 1\r\n\r\n"):
        with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
            sock.sendall(raw)
            assert sock.recv(100).split(b" ")[1] == b"400", raw

    async def session():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.send("counted-q", b"s1")                 # the Session stream
            with pytest.raises(errors.QueueNotFound):
                await c.send("missing-q", b"s2")
            got = await c.receive("counted-q", max_messages=4)
            assert len(got) == 4
            await c.ack(got[0].token)
            with pytest.raises(errors.StaleLease):  # settled already: stale_lease inside an ok settle_batch
                await c.ack(got[0].token)
    asyncio.run(session())

    counts, timed = _calls_figures(node)
    wanted = {
        ("grpc", "PutQueue", "ok"): 1,
        ("grpc", "SendBatch", "ok"): 1,
        ("grpc", "GetQueue", "queue_not_found"): 1,
        ("http", "POST /v1/queues/{queue}/messages", "ok"): 2,
        ("http", "POST /v1/queues/{queue}/messages", "queue_not_found"): 1,
        ("http", "unmatched", "not_found"): 1,
        ("http", "unmatched", "invalid_argument"): 1,
        ("http", "POST /v1/queues/{queue}/messages", "invalid_argument"): 1,
        ("grpc", "Session/send_batch", "ok"): 1,
        ("grpc", "Session/send_batch", "queue_not_found"): 1,
        ("grpc", "Session/receive", "ok"): 1,
        ("grpc", "Session/settle_batch", "ok"): 2,
    }
    assert {k: counts.get(k) for k in wanted} == wanted, json.dumps(sorted(map(list, counts.items())), default=str)
    assert timed[("http", "POST /v1/queues/{queue}/messages")] == 4
    assert node.metric('spooler_errors_total{kind="invalid_argument",reason=""}') == 2
    assert node.metric('spooler_errors_total{kind="stale_lease",reason="settled"}') == 1
    assert node.metric('spooler_errors_total{kind="queue_not_found",reason=""}') == 3
    assert node.metric('spooler_errors_total{kind="not_found",reason=""}') == 1
    from spooler import __version__
    assert node.metric(f'spooler_build_info{{version="{__version__}"}}') == 1  # (which build, in a rolling upgrade)
    assert timed[("grpc", "Session/send_batch")] == 2
    for api, call, outcome in counts:  # reads of /metrics itself are counted too: only these kinds of label
        assert "counted-q" not in call and "missing-q" not in call, call
        assert call == "unmatched" or call.startswith(("GET ", "HEAD ", "POST ", "PUT ", "DELETE ")) \
            or call[0].isupper(), call
    for (api, call), n in timed.items():
        assert n == sum(v for (a, c, _), v in counts.items() if (a, c) == (api, call)), (api, call)


def test_calls_their_callers_gave_up_on_are_counted_cancelled(node, client):
    """A call whose caller went away or whose deadline passed before the answer
    (here long polls: over HTTP, unary gRPC and a Session stream) is counted,
    outcome "cancelled"; before, only answered calls were, and an error ratio
    missed exactly the calls that timed out."""
    import socket
    import urllib.request

    client.put_queue("empty-q")
    req = urllib.request.Request(node.http_url + "/v1/queues/empty-q/receive?wait=5", data=b"", method="POST",
                                 headers={"Authorization": f"Bearer {node.admin_key}"})
    with pytest.raises((socket.timeout, TimeoutError, OSError)):
        urllib.request.urlopen(req, timeout=0.5)
    md = (("authorization", f"Bearer {node.admin_key}"),)
    with grpc.insecure_channel(node.grpc_target) as ch:
        stub = api_pb2_grpc.SpoolerStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.ReceiveBatch(api_pb2.ReceiveRequest(queue="empty-q", wait_seconds=5, max_messages=1),
                              metadata=md, timeout=0.5)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        held = threading.Event()

        def requests():
            yield api_pb2.SessionRequest(id=1, receive=api_pb2.ReceiveRequest(queue="empty-q", wait_seconds=5))
            held.wait(10)  # the stream stays open until the test cancels it

        stream = stub.Session(requests(), metadata=md)
        wait_until(lambda: node.metric("spooler_receives_waiting") == 1.0, 10, what="the Session's poll waiting")
        stream.cancel()
        held.set()
    cancelled = {("http", "POST /v1/queues/{queue}/receive", "cancelled"): 1,
                 ("grpc", "ReceiveBatch", "cancelled"): 1, ("grpc", "Session/receive", "cancelled"): 1}
    reaches(lambda: {k: _calls_figures(node)[0].get(k) for k in cancelled}, cancelled,
            what="each given-up poll counted as cancelled")
    counts, timed = _calls_figures(node)
    assert not any(outcome == "cancelled" for (_, call, outcome) in counts if "receive" not in call.lower()), counts
    assert timed[("grpc", "ReceiveBatch")] == 1


def test_calls_under_way_and_open_sessions_are_gauges(node, client):
    """spooler_calls_in_progress{api,call}: calls under way (a unary gRPC call and
    an HTTP request from start to end, a Session stream's request from being read
    to being answered), here three long polls on an empty queue, one of each;
    spooler_sessions_open{api}: Session streams open. Back to 0 once the polls
    are answered and the stream ends."""
    import urllib.request

    client.put_queue("poll-q")

    def running():
        return {(s.labels["api"], s.labels["call"]): s.value for s in node.samples("spooler_calls_in_progress")
                if s.value or "receive" in s.labels["call"].lower()}

    def sessions():
        return {s.labels["api"]: s.value for s in node.samples("spooler_sessions_open")}

    assert sessions() == {"grpc": 0, "forwarded": 0}
    req = urllib.request.Request(node.http_url + "/v1/queues/poll-q/receive?wait=10", data=b"", method="POST",
                                 headers={"Authorization": f"Bearer {node.admin_key}"})
    got = []
    http_poll = threading.Thread(target=lambda: got.append(urllib.request.urlopen(req, timeout=30).status))
    http_poll.start()
    md = (("authorization", f"Bearer {node.admin_key}"),)
    with grpc.insecure_channel(node.grpc_target) as ch:
        stub = api_pb2_grpc.SpoolerStub(ch)
        unary = stub.ReceiveBatch.future(api_pb2.ReceiveRequest(queue="poll-q", wait_seconds=10, max_messages=1),
                                         metadata=md, timeout=30)
        done = threading.Event()

        def requests():
            yield api_pb2.SessionRequest(id=1, receive=api_pb2.ReceiveRequest(queue="poll-q", wait_seconds=10))
            done.wait(30)

        stream = stub.Session(requests(), metadata=md)
        polls = {("http", "POST /v1/queues/{queue}/receive"): 1, ("grpc", "ReceiveBatch"): 1,
                 ("grpc", "Session/receive"): 1}
        # (the /metrics request reading them is under way too, as HTTP's GET /metrics)
        reaches(lambda: {k: v for k, v in running().items() if k != ("http", "GET /metrics")}, polls,
                what="three polls under way")
        assert sessions() == {"grpc": 1, "forwarded": 0}
        client.send_batch("poll-q", [b"a", b"b", b"c"])
        assert len(unary.result(30).messages) == 1
        answer = next(stream)
        assert answer.id == 1 and len(answer.receive.messages) == 1
        http_poll.join(30)
        assert got == [200]
        reaches(lambda: {k: v for k, v in running().items() if k != ("http", "GET /metrics")},
                {k: 0 for k in polls}, what="no poll under way")
        done.set()
        stream.cancel()
    reaches(sessions, {"grpc": 0, "forwarded": 0}, what="the stream closed")


def test_what_happened_to_each_queues_messages_is_counted(node, client):
    """spooler_queue_events_total{queue,event}: a queue's totals as its stats say
    them (sent, acked, nacked, lease_expired, failed, expired, purged), so that a rising
    failure count can be alerted on per queue."""
    client.put_queue("counted-events", maxRetries=1)

    def events():
        return {s.labels["event"]: s.value for s in node.samples("spooler_queue_events_total")
                if s.labels["queue"] == "counted-events"}
    assert events() == dict.fromkeys(("sent", "acked", "nacked", "lease_expired", "failed", "expired", "purged"), 0)
    client.send_batch("counted-events", [b"a", b"b", b"c"])
    [first] = client.receive("counted-events")
    client.ack(first.token)
    [second] = client.receive("counted-events")
    client.nack(second.token)                             # retried once
    for d in client.receive("counted-events", max_messages=2):
        client.nack(d.token)                                  # one past its retries: to the failure queue
    st = client.get_queue("counted-events")["stats"]
    assert events() == {"sent": st["sentTotal"], "acked": st["ackedTotal"], "nacked": st["nackedTotal"],
                        "lease_expired": st["leaseExpiredTotal"], "failed": st["failedTotal"],
                        "expired": st["expiredTotal"], "purged": st["purgedTotal"]}, st
    assert (st["sentTotal"], st["ackedTotal"], st["failedTotal"]) == (3, 1, 1), st


def test_each_refusal_is_counted_by_its_reason_and_the_disk_room_is_a_gauge(tmp_path):
    """spooler_errors_total says why an ``unavailable`` was answered (its reason,
    from a bounded set), so that a node refusing sends for its disk is told from
    one with no primary; spooler_disk_free_bytes beside spooler_disk_free_bytes_min
    shows the disk filling before it does. (A stale lease inside a batch of
    settles, counted by its reason: test_every_call_is_counted_....)"""
    import json
    import urllib.error
    import urllib.request

    n = NodeProc(str(tmp_path / "full"), extra_args=["--disk-reserve-bytes", str(1 << 60)])
    n.start()
    try:
        with Client(n.grpc_target, n.admin_key, timeout_s=5) as c:
            c.put_queue("room-q")
        assert n.metric("spooler_disk_free_bytes") < n.metric("spooler_disk_free_bytes_min") == float(1 << 60)
        req = urllib.request.Request(n.http_url + "/v1/queues/room-q/messages", data=b"x", method="POST",
                                     headers={"Authorization": f"Bearer {n.admin_key}"})
        with pytest.raises(urllib.error.HTTPError) as e:  # (over HTTP: the SDK would retry it for seconds)
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 503 and json.loads(e.value.read())["reason"] == "disk_low"
        assert n.metric('spooler_errors_total{kind="unavailable",reason="disk_low"}') == 1
    finally:
        n.kill()


def test_how_long_a_queues_first_message_has_waited_is_a_gauge(node):
    """spooler_queue_first_visible_seconds{queue}: how long the next message a receive
    would hand out has been visible (SQS's age of the oldest message, as the head of
    the line sees it): it grows while nobody receives, follows the line as messages
    leave it, and is 0 once the queue has nothing visible."""
    def waited(queue):
        return next(s.value for s in node.samples("spooler_queue_first_visible_seconds")
                    if s.labels["queue"] == queue)

    with Client(node.grpc_target, node.admin_key, timeout_s=10) as c:
        c.put_queue("waiting")
        c.put_queue("idle")
        c.send("waiting", b"first")
        c.send("waiting", b"second")
        wait_until(lambda: waited("waiting") >= 0.3, 10, what="the head's wait to grow")
        assert waited("idle") == 0
        [m] = c.receive("waiting")
        assert m.body == b"first"
        c.ack(m.token)
        assert waited("waiting") >= 0.3  # the second, sent right after the first, has waited as long
        [m] = c.receive("waiting")
        assert m.body == b"second" and waited("waiting") == 0


def test_the_node_wide_caps_are_gauges_beside_what_they_bound(tmp_path):
    """spooler_messages_held / _max, spooler_dedup_keys / _max and spooler_leases /
    _max: how near the node is to each node-wide cap, whose sends past it are
    refused (reason node_full), before any is."""
    n = NodeProc(str(tmp_path / "capped"), extra_args=["--max-messages", "5", "--max-dedup-keys", "2"]).start()
    try:
        def caps():
            return {s.name: s.value for s in n.samples(
                "spooler_messages_held", "spooler_messages_max", "spooler_dedup_keys", "spooler_dedup_keys_max",
                "spooler_leases", "spooler_leases_max")}
        with Client(n.grpc_target, n.admin_key, timeout_s=10, retry_attempts=1) as c:  # (a refusal at once)
            c.put_queue("a", dedupWindowSeconds=60)
            c.put_queue("b")
            assert caps() == {"spooler_messages_held": 0, "spooler_messages_max": 5, "spooler_dedup_keys": 0,
                              "spooler_dedup_keys_max": 2, "spooler_leases": 0, "spooler_leases_max": 1_000_000}
            c.send("a", b"1", dedup_key="k1")
            c.send("a", b"2", dedup_key="k2")
            c.send("b", b"3")
            [m] = c.receive("b")
            got = caps()
            assert (got["spooler_messages_held"], got["spooler_dedup_keys"], got["spooler_leases"]) == (3, 2, 1), got
            with pytest.raises(errors.Unavailable) as e:
                c.send("a", b"4", dedup_key="k3")
            assert e.value.reason == "node_full"
            c.ack(m.token)
            got = caps()
            assert (got["spooler_messages_held"], got["spooler_leases"]) == (2, 0), got
    finally:
        n.kill()


def test_the_write_paths_backlog_is_a_gauge(tmp_path):
    """spooler_writes_unconfirmed (records stamped and not yet applied: a commit
    under way) and spooler_writes_waiting (records behind it, waiting for the next
    group commit) beside spooler_writes_waiting_max (past it, writes are refused
    as overloaded): a disk slowed to 2 s an fsync by the test VFS holds one send in
    its commit and the next behind it; both read 0 once the disk is fast again."""
    n = NodeProc(str(tmp_path / "slow"), env={"SPOOLER_TEST_VFS": "buffered", "SPOOLER_TEST_SYNC_DELAY": "1",
                                               "SPOOLER_INLINE_COMMIT_BYTES": "0"}).start()
    try:
        def backlog():
            return {s.name: s.value for s in n.samples(
                "spooler_writes_waiting", "spooler_writes_waiting_max", "spooler_writes_unconfirmed")}
        with Client(n.grpc_target, n.admin_key, timeout_s=30) as a, Client(n.grpc_target, n.admin_key,
                                                                           timeout_s=30) as b:
            a.put_queue("q")
            assert backlog() == {"spooler_writes_waiting": 0, "spooler_writes_waiting_max": 65_536,
                                 "spooler_writes_unconfirmed": 0}
            with open(os.path.join(n.data_dir, "test-sync-delay"), "w") as f:
                f.write("2")
            first = threading.Thread(target=a.send, args=("q", b"first"))
            first.start()
            wait_until(lambda: backlog()["spooler_writes_unconfirmed"] == 1, 10, what="the first send committing")
            second = threading.Thread(target=b.send, args=("q", b"second"))
            second.start()
            wait_until(lambda: backlog()["spooler_writes_waiting"] == 1, 10, what="the second send waiting")
            os.remove(os.path.join(n.data_dir, "test-sync-delay"))
            first.join(30)
            second.join(30)
            wait_until(lambda: backlog()["spooler_writes_waiting"] == backlog()["spooler_writes_unconfirmed"] == 0,
                       10, what="no backlog")
            assert a.get_queue("q")["stats"]["visible"] == 2
    finally:
        n.kill()


def test_a_session_send_still_committing_when_its_stream_ends_is_counted_cancelled_and_stays_stored(tmp_path):
    """A Session send whose commit is still under way when its client ends the
    stream (here a disk slowed to 3 s an fsync by the test VFS) is counted once,
    outcome "cancelled", like the long poll behind it; the write itself goes on
    and the message is stored (its answer unread: to the client an unknown
    outcome, which a dedup key makes safe to resend)."""
    n = NodeProc(str(tmp_path / "slow"), env={"SPOOLER_TEST_VFS": "buffered", "SPOOLER_TEST_SYNC_DELAY": "1",
                                               "SPOOLER_INLINE_COMMIT_BYTES": "0"}).start()
    try:
        with Client(n.grpc_target, n.admin_key, timeout_s=10) as c:
            c.put_queue("q")
            c.put_queue("empty")
        with open(os.path.join(n.data_dir, "test-sync-delay"), "w") as f:
            f.write("3")
        md = (("authorization", f"Bearer {n.admin_key}"),)
        held = threading.Event()

        def requests():
            yield api_pb2.SessionRequest(id=1, send_batch=api_pb2.SendBatchRequest(queue="q", bodies=[b"slow"]))
            # read after the send (a Session reads its requests in order): once this
            # poll waits, the send is in the node, its commit held by the disk
            yield api_pb2.SessionRequest(id=2, receive=api_pb2.ReceiveRequest(queue="empty", wait_seconds=10))
            held.wait(15)

        with grpc.insecure_channel(n.grpc_target) as ch:
            stream = api_pb2_grpc.SpoolerStub(ch).Session(requests(), metadata=md)
            wait_until(lambda: n.metric("spooler_receives_waiting") == 1.0, 10, what="the poll behind the send")
            assert n.metric("spooler_messages_held") == 0  # (the send is not applied yet)
            stream.cancel()
            held.set()
        cancelled = {("grpc", "Session/send_batch", "cancelled"): 1, ("grpc", "Session/receive", "cancelled"): 1}
        reaches(lambda: {k: _calls_figures(n)[0].get(k) for k in cancelled}, cancelled, timeout_s=15,
                what="the send and the poll counted cancelled")
        os.remove(os.path.join(n.data_dir, "test-sync-delay"))
        wait_until(lambda: n.metric("spooler_messages_held") == 1.0, 15, what="the send stored")
        counts, _ = _calls_figures(n)
        assert not any(call == "Session/send_batch" and outcome != "cancelled" for (_, call, outcome) in counts), counts
    finally:
        n.kill()
