"""The caps on queues, keys and messages hold under concurrent calls and for the
queues and moves the node makes itself (in-process engine and service)."""
import asyncio
import contextlib

import pytest

from node.api.service import Principal, Service
from node.core import spool
from node.engine import Engine, Limits
from spooler import errors
from nodeproc import until

ADMIN = Principal(admin=True)


@contextlib.asynccontextmanager
async def _node(tmp_path, **limits):
    eng = Engine(str(tmp_path / "n"), limits=Limits(**limits))
    await eng.start()
    try:
        yield eng, Service(eng, ["k"])
    finally:
        await eng.stop()


async def _outcomes(calls):
    got = await asyncio.gather(*calls, return_exceptions=True)
    return [g for g in got if not isinstance(g, BaseException)], [g for g in got if isinstance(g, BaseException)]


def test_concurrent_key_creates_stop_at_the_cap(tmp_path):
    async def main():
        async with _node(tmp_path, keys_max=3) as (eng, svc):
            ok, refused = await _outcomes([svc.create_key(ADMIN, "*", ["send"]) for _ in range(10)])
            assert len(ok) == 3 and len(eng.core.keys) == 3
            assert len(refused) == 7 and all(isinstance(e, errors.InvalidArgument) for e in refused), refused
    asyncio.run(main())


def test_concurrent_queue_creates_stop_at_the_cap(tmp_path):
    async def main():
        async with _node(tmp_path, queues_max=3) as (eng, svc):
            await svc.put_queue(ADMIN, "a", {})
            # the same name twice counts once; updates of an existing queue always pass
            calls = [svc.put_queue(ADMIN, n, {}) for n in ("b", "b", "c", "d", "e", "a")]
            ok, refused = await _outcomes(calls)
            assert len(eng.core.queues) == 3, sorted(eng.core.queues)
            assert len(refused) == 2 and all(isinstance(e, errors.InvalidArgument) for e in refused), refused
            assert sorted(eng.core.queues) == ["a", "b", "c"] and len(ok) == 4
    asyncio.run(main())


def test_a_redrive_that_would_overfill_its_queue_is_refused_and_moves_nothing(tmp_path):
    async def main():
        async with _node(tmp_path, messages_per_queue_max=5) as (eng, svc):
            await _three_in_the_failure_queue(svc)
            await svc.send(ADMIN, [], ("q", [b"4", b"5", b"6"], 0.0))
            with pytest.raises(errors.Unavailable):
                await svc.redrive(ADMIN, "q")
            assert (eng.core.queues["q"].size, eng.core.queues["q.failed"].size) == (3, 3)
            got = await svc.receive(ADMIN, "q", 0, 3)
            await svc.settle(ADMIN, [(d.token, "ack", 0) for d in got[:1]])  # room for all three now
            assert await svc.redrive(ADMIN, "q") == 3
            assert (eng.core.queues["q"].size, eng.core.queues["q.failed"].size) == (5, 0)
    asyncio.run(main())


def test_no_failure_queue_is_made_past_the_queue_cap(tmp_path, monkeypatch):
    """The core makes a failure queue on demand only while there is room for one
    more queue; else the exhausted message stays in its queue, visible again."""
    monkeypatch.setattr(spool, "QUEUES_MAX", 2)

    async def main():
        async with _node(tmp_path, queues_max=2) as (eng, svc):
            await svc.put_queue(ADMIN, "a", {"maxRetries": 0})
            await svc.put_queue(ADMIN, "b", {})
            await svc.send(ADMIN, [], ("a", [b"x"], 0.0))
            [d] = await svc.receive(ADMIN, "a", 0, 1)
            await svc.settle(ADMIN, [(d.token, "nack", 0)])
            assert sorted(eng.core.queues) == ["a", "b"]
            [again] = await svc.receive(ADMIN, "a", 0, 1)
            assert (again.id, again.retry_count) == (d.id, 0)
            assert svc.queue_doc("a")["stats"]["failedTotal"] == 0  # nothing moved
    asyncio.run(main())


def test_concurrent_sends_stop_at_the_message_cap(tmp_path):
    """Messages proposed but not yet applied count against their queue's cap: sends
    that arrive within one group commit cannot pass it together. Through plain
    sends (a future), runs, and a Reply as a Session stream's send uses."""
    from node.engine import Reply

    async def main():
        async with _node(tmp_path, messages_per_queue_max=5) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {})
            ok, refused = await _outcomes([svc.send(ADMIN, [("q", b"x", 0.0, "")]) for _ in range(20)])
            assert len(ok) == 5 and eng.core.queues["q"].size == 5
            assert len(refused) == 15 and all(isinstance(e, errors.Unavailable) for e in refused), refused

            await svc.put_queue(ADMIN, "r", {})
            ok, refused = await _outcomes([svc.send(ADMIN, [], ("r", [b"y"] * 2, 0.0)) for _ in range(5)])
            assert len(ok) == 2 and eng.core.queues["r"].size == 4 and len(refused) == 3

            await svc.put_queue(ADMIN, "s", {})
            answers = []
            first, second = Reply(lambda *a: answers.append(a)), Reply(lambda *a: answers.append(a))
            svc.send_begin(ADMIN, [], ("s", [b"z"] * 2, 0.0), reply=first)  # in one turn of the loop,
            svc.send_begin(ADMIN, [], ("s", [b"z"] * 2, 0.0), reply=second)  # as a stream's reader does
            second.cancel()  # its stream went away: its messages still count until applied
            with pytest.raises(errors.Unavailable):
                svc.send_begin(ADMIN, [], ("s", [b"z"] * 2, 0.0), reply=Reply(lambda *a: answers.append(a)))
            svc.send_begin(ADMIN, [("s", b"z", 0.0, "")], reply=Reply(lambda *a: answers.append(a)))
            await until(lambda: len(answers) == 2)
            assert [error for _, _, error in answers] == [None, None]  # the cancelled one is not answered
            assert eng.core.queues["s"].size == 5
            assert svc._sending == {}  # every proposal settled, the cancelled one too: nothing left counted
    asyncio.run(main())


def test_a_redrive_and_sends_on_their_way_cannot_pass_the_cap_together(tmp_path):
    async def main():
        async with _node(tmp_path, messages_per_queue_max=5) as (eng, svc):
            await _three_in_the_failure_queue(svc)
            sending = svc.send(ADMIN, [], ("q", [b"4", b"5", b"6"], 0.0))  # checked and proposed at once
            task = asyncio.ensure_future(sending)
            await asyncio.sleep(0)
            with pytest.raises(errors.Unavailable):
                await svc.redrive(ADMIN, "q")  # 3 on their way + 3 to move > 5
            await task
            got = await svc.receive(ADMIN, "q", 0, 1)
            await svc.settle(ADMIN, [(got[0].token, "ack", 0)])
            redrive = asyncio.ensure_future(svc.redrive(ADMIN, "q"))  # 2 + 3 = 5: room, and counted while on its way
            await asyncio.sleep(0)
            with pytest.raises(errors.Unavailable):
                svc.send_begin(ADMIN, [("q", b"7", 0.0, "")])
            assert await redrive == 3
            assert (eng.core.queues["q"].size, eng.core.queues["q.failed"].size) == (5, 0)
            assert svc._sending == {}
    asyncio.run(main())


def test_a_caller_that_goes_away_leaves_its_messages_counted_until_they_apply(tmp_path):
    """A send or a redrive whose caller is cancelled (a client gone, a deadline) after
    it was proposed still lands: its messages count against the cap until then.
    (The commit is held back by holding the replication lock it runs under, so the
    caller's cancellation is seen through before the record can apply.)"""
    async def main():
        async with _node(tmp_path, messages_per_queue_max=5) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {"maxRetries": 0})
            await _cancelled_then_checked(eng, lambda: svc.send(ADMIN, [], ("q", [b"x"] * 4, 0.0)),
                                          lambda: svc.send_begin(ADMIN, [], ("q", [b"y"] * 2, 0.0)))
            await until(lambda: eng.core.queues["q"].size == 4 and not svc._sending)

            got = await svc.receive(ADMIN, "q", 0, 4)
            await svc.settle(ADMIN, [(d.token, "nack", 0) for d in got[:3]] + [(got[3].token, "ack", 0)])
            assert (eng.core.queues["q"].size, eng.core.queues["q.failed"].size) == (0, 3)
            await _cancelled_then_checked(eng, lambda: svc.redrive(ADMIN, "q"),  # 3 on their way + 3 > 5
                                          lambda: svc.send_begin(ADMIN, [], ("q", [b"z"] * 3, 0.0)))
            await until(lambda: eng.core.queues["q"].size == 3 and not svc._sending)
    asyncio.run(main())


def test_a_queue_or_key_whose_creator_went_away_counts_until_it_applies(tmp_path):
    async def main():
        async with _node(tmp_path, queues_max=2, keys_max=1) as (eng, svc):
            await svc.put_queue(ADMIN, "a", {})
            await _cancelled_then_checked(eng, lambda: svc.put_queue(ADMIN, "b", {}),
                                          lambda: svc.put_queue(ADMIN, "c", {}), errors.InvalidArgument, await_then=True)
            await until(lambda: sorted(eng.core.queues) == ["a", "b"] and not svc._queues_creating)
            await _cancelled_then_checked(eng, lambda: svc.create_key(ADMIN, "*", ["send"]),
                                          lambda: svc.create_key(ADMIN, "*", ["send"]), errors.InvalidArgument,
                                          await_then=True)
            await until(lambda: len(eng.core.keys) == 1 and svc._keys_creating == 0)
    asyncio.run(main())


def test_a_redrive_counts_what_is_on_its_way_to_the_failure_queue(tmp_path):
    async def main():
        async with _node(tmp_path, messages_per_queue_max=5) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {"maxRetries": 0})
            await svc.send(ADMIN, [], ("q", [b"1", b"2", b"3", b"4"], 0.0))
            got = await svc.receive(ADMIN, "q", 0, 3)
            await svc.settle(ADMIN, [(d.token, "nack", 0) for d in got])  # three to q.failed, one stays
            sending = asyncio.ensure_future(svc.send(ADMIN, [], ("q.failed", [b"5", b"6"], 0.0)))
            await asyncio.sleep(0)  # on its way to the failure queue: the redrive would move it too
            with pytest.raises(errors.Unavailable):
                await svc.redrive(ADMIN, "q")  # 1 + 3 + 2 > 5
            await sending
            assert (eng.core.queues["q"].size, eng.core.queues["q.failed"].size) == (1, 5)
    asyncio.run(main())


async def _cancelled_then_checked(eng, call, then, refused=errors.Unavailable, await_then=False):
    """Start ``call``, let it be checked and proposed, cancel its caller, and see
    ``then`` refused (``refused``) while the commit is held back (by holding the
    replication lock it runs under)."""
    async with eng.repl.lock:
        gone = asyncio.ensure_future(call())
        await asyncio.sleep(0)  # checked and proposed
        gone.cancel()
        for _ in range(5):  # every callback of the cancellation runs
            await asyncio.sleep(0)
        assert gone.cancelled()
        with pytest.raises(refused):
            got = then()
            if await_then:  # (bounded: were it let through, it would wait for the held-back commit)
                await asyncio.wait_for(got, 5)


async def _three_in_the_failure_queue(svc):
    """Queue q (maxRetries 0), and three of its messages moved to q.failed."""
    await svc.put_queue(ADMIN, "q", {"maxRetries": 0})
    await svc.send(ADMIN, [], ("q", [b"1", b"2", b"3"], 0.0))
    got = await svc.receive(ADMIN, "q", 0, 3)
    await svc.settle(ADMIN, [(d.token, "nack", 0) for d in got])


def test_long_polls_waiting_on_a_node_are_capped_over_every_transport(tmp_path):
    """A Session stream carries up to 1,024 polls, past the cap on gRPC calls: a
    review had 191,474 waiting on one node (about 5 KB each). Past
    ``receives_waiting_max`` a receive that would wait is 503 unavailable with
    Retry-After; one that does not wait, and the waiters, are served as before."""
    async def main():
        async with _node(tmp_path, receives_waiting_max=3) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {})
            polls = [asyncio.ensure_future(svc.receive(ADMIN, "q", 10)) for _ in range(3)]
            for _ in range(500):
                if eng.receives_waiting == 3:
                    break
                await asyncio.sleep(0.01)
            assert eng.receives_waiting == 3
            with pytest.raises(errors.Unavailable) as e:
                await svc.receive(ADMIN, "q", 1)
            assert "receives are waiting" in str(e.value) and e.value.retry_after_s == 1.0
            assert await svc.receive(ADMIN, "q", 0) == []  # no wait: answered as ever
            await svc.send(ADMIN, [("q", b"m", 0.0, "")])
            done, _ = await asyncio.wait(polls, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            assert [d.body for t in done for d in t.result()] == [b"m"]
            for t in polls:
                t.cancel()
            await asyncio.gather(*polls, return_exceptions=True)
            assert eng.receives_waiting == 0

    asyncio.run(main())


def test_sends_are_refused_while_the_disk_is_nearly_full_and_settles_go_on(tmp_path):
    """A disk filled by sends stopped the node (S9), and it stopped again on every
    start, the disk still full. Below ``disk_free_bytes_min`` free, sends are
    503 unavailable; acks (which make room) are taken; sends resume with room."""
    async def main():
        async with _node(tmp_path) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {})
            await svc.send(ADMIN, [("q", b"a", 0.0, ""), ("q", b"b", 0.0, "")])
            got = await svc.receive(ADMIN, "q", 0, 2)
            eng.limits.disk_free_bytes_min = 1 << 62  # more than any disk has free
            with pytest.raises(errors.Unavailable) as e:
                await svc.send(ADMIN, [("q", b"c", 0.0, "")])
            assert "disk" in str(e.value) and e.value.retry_after_s == 5.0
            await svc.settle(ADMIN, [(d.token, "ack", 0.0) for d in got])  # settles go on
            assert svc.core.stats("q", eng.now_us())["visible"] == 0
            eng.limits.disk_free_bytes_min = 0  # (0: never refused)
            await svc.send(ADMIN, [("q", b"c", 0.0, "")])
            assert svc.core.stats("q", eng.now_us())["visible"] == 1

    asyncio.run(main())


def test_bytes_of_sends_not_yet_stored_are_capped(tmp_path):
    """Counts alone let clients sending at once make a node hold gigabytes of
    bodies (4,000 HTTP sends of 256 KiB took 2.5 GB in a review). Past
    ``sending_bytes_max`` of bodies on their way a send is 503; one always fits
    when none is on its way; the bytes are let go of when a send is stored or
    refused."""
    async def main():
        async with _node(tmp_path, sending_bytes_max=1000) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {})
            first = asyncio.ensure_future(svc.send(ADMIN, [("q", b"x" * 800, 0.0, "")]))
            await asyncio.sleep(0)  # (proposed: its bytes are counted until it is stored)
            assert svc.sending_bytes == 800
            with pytest.raises(errors.Unavailable) as e:
                await svc.send(ADMIN, [("q", b"y" * 300, 0.0, "")])
            assert "not yet stored" in str(e.value)
            await svc.send(ADMIN, [("q", b"z" * 100, 0.0, "")])  # fits beside it
            await first
            assert svc.sending_bytes == 0
            await svc.send(ADMIN, [("q", b"w" * 5000, 0.0, "")])  # alone: always fits
            assert svc.core.stats("q", eng.now_us())["visible"] == 3

    asyncio.run(main())


def test_a_replica_forwards_at_most_so_many_long_polls_at_once(tmp_path):
    """Each long poll a replica forwards is a gRPC call held on the primary: 14,000
    HTTP polls sent to two replicas cost a review's cluster its primary. Past
    ``forwarded_polls_max`` waiting, a replica answers a poll 503 (one that does
    not wait still goes through)."""
    async def main():
        async with _node(tmp_path, forwarded_polls_max=2) as (eng, svc):
            release = asyncio.Event()
            forwarded = []

            async def fwd_receive(addr, auth, queue, wait_s, max_n, receive_id, release_for_s):
                forwarded.append(wait_s)
                if wait_s:
                    await release.wait()
                return []

            svc.forwards = lambda: True
            svc._remote = lambda p: "primary:1"
            svc.fwd.receive = fwd_receive
            polls = [asyncio.ensure_future(svc.receive(ADMIN, "q", 5)) for _ in range(2)]
            for _ in range(500):
                if svc.forwarded_polls == 2:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(errors.Unavailable) as e:
                async with asyncio.timeout(10):  # without the cap it would wait on the fake forward for ever
                    await svc.receive(ADMIN, "q", 5)
            assert "forwards 2 long polls" in str(e.value)
            assert await svc.receive(ADMIN, "q", 0) == []  # no wait: forwarded as ever
            release.set()
            assert await asyncio.gather(*polls) == [[], []]
            assert svc.forwarded_polls == 0 and forwarded == [5, 5, 0]

    asyncio.run(main())


def test_http_sends_are_refused_before_their_bodies_are_read_past_the_byte_budget(tmp_path):
    """Sends arriving together each had their body read before any was counted: the
    budget on bytes of sends held nothing back. A send's Content-Length is held
    against it while its body is read; past it the send is 503 at once, its body
    never read, its connection closed; the others are stored."""
    import json
    import select
    import socket
    import time

    from nodeproc import NodeProc

    node = NodeProc(str(tmp_path / "n"), env={"SPOOLER_TEST_SENDING_BYTES_MAX": "1000000"}).start()
    socks = []
    try:
        assert node.get("/healthz")[0] == 200
        import urllib.request
        req = urllib.request.Request(node.http_url + "/v1/queues/q", data=b"{}", method="PUT",
                                     headers={"Authorization": f"Bearer {node.admin_key}"})
        urllib.request.urlopen(req, timeout=10).read()
        head = (b"POST /v1/queues/q/messages HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + node.admin_key.encode() + b"\r\nContent-Length: 200000\r\n\r\n")
        refused = []
        for _ in range(8):  # headers only: each waits for its body
            s = socket.create_connection(("127.0.0.1", node.http_port), timeout=10)
            s.sendall(head)
            socks.append(s)
        # five fit in 1,000,000 bytes (whichever the node reads first); the other
        # three are answered at once, their bodies never sent
        answered: list = []
        deadline = time.monotonic() + 15
        while len(answered) < 3 and time.monotonic() < deadline:
            ready, _, _ = select.select([s for s in socks if s not in answered], [], [], 0.1)
            answered.extend(ready)
        for s in answered:
            data = s.recv(65536)
            body = json.loads(data.partition(b"\r\n\r\n")[2])
            refused.append((int(data.split(b" ", 2)[1]), body["kind"], b"onnection: close" in data))
        assert refused == [(503, "unavailable", True)] * 3, refused
        for s in socks:
            if s not in answered:
                s.sendall(b"b" * 200_000)
                assert int(s.recv(65536).split(b" ", 2)[1]) == 201
        stats = json.loads(urllib.request.urlopen(urllib.request.Request(
            node.http_url + "/v1/queues/q", headers={"Authorization": f"Bearer {node.admin_key}"}),
            timeout=10).read())["stats"]
        assert stats["visible"] == 5
    finally:
        for s in socks:
            s.close()
        node.kill()


def test_heads_of_sends_a_key_may_not_make_hold_none_of_the_byte_budget(tmp_path):
    """A send's declared length was set aside before its key's scope or its queue
    was checked: a key that may only receive, from an unrelated queue, could open
    heads declaring bodies it never sent and hold the whole budget, so that every
    other send on the node was 503 for the client timeout. Such a send is now
    403 (or 404 for a queue that does not exist) at once, holding nothing, and
    the others are stored."""
    import json
    import socket
    import urllib.request

    from nodeproc import NodeProc

    node = NodeProc(str(tmp_path / "n"), env={"SPOOLER_TEST_SENDING_BYTES_MAX": "1000000"}).start()
    socks = []

    def call(method, path, body=b"", key=None):
        req = urllib.request.Request(node.http_url + path, data=body, method=method,
                                     headers={"Authorization": f"Bearer {key or node.admin_key}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    try:
        for q in ("q", "unrelated"):
            assert call("PUT", f"/v1/queues/{q}", b"{}")[0] in (200, 201)
        status, k = call("POST", "/v1/keys", json.dumps({"queue": "unrelated", "scopes": ["receive"]}).encode())
        assert status == 201, k
        answers = []
        for path, key in (("/v1/queues/q/messages", k["key"]), ("/v1/queues/unrelated/messages", k["key"]),
                          ("/v1/queues/no-such-queue/messages", node.admin_key)):
            for _ in range(4):  # 12 x 250,000 declared: three times the budget of 1,000,000, were they held
                s = socket.create_connection(("127.0.0.1", node.http_port), timeout=10)
                socks.append(s)
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                          f"Content-Length: 250000\r\n\r\n".encode())
                data = s.recv(65536)  # answered at once, its body never sent
                answers.append((int(data.split(b" ", 2)[1]), json.loads(data.partition(b"\r\n\r\n")[2])["kind"]))
        assert answers == [(403, "forbidden")] * 8 + [(404, "queue_not_found")] * 4, answers
        status, sent = call("POST", "/v1/queues/q/messages", b"b" * 250_000)
        assert status == 201, sent
    finally:
        for s in socks:
            s.close()
        node.kill()


def test_the_node_wide_message_cap_counts_every_queue_and_refuses_whole_batches(tmp_path):
    """Limits.messages_max bounds the messages of every queue together (each holds
    memory): a send that would pass it is refused whole, 503 node_full, storing
    nothing; acks make room again; sends on their way count."""
    async def main():
        async with _node(tmp_path, messages_max=10) as (eng, svc):
            for q in ("a", "b"):
                await svc.put_queue(ADMIN, q, {})
            await svc.send(ADMIN, [], ("a", [b"x"] * 6, 0.0))
            await svc.send(ADMIN, [("b", b"y", 0.0, "")] * 3)
            with pytest.raises(errors.Unavailable) as e:  # 9 held, 2 more would be 11
                await svc.send(ADMIN, [("b", b"y", 0.0, "")], ("a", [b"x"], 0.0))
            assert e.value.reason == errors.NODE_FULL and e.value.retry_after_s == 1.0
            assert errors.stay_on(e.value)  # the primary's own room: a client stays where it is
            assert (eng.core.queues["a"].size, eng.core.queues["b"].size) == (6, 3)  # nothing of it stored
            # concurrent sends of one message each: one fits
            ok, refused = await _outcomes([svc.send(ADMIN, [("b", b"z", 0.0, "")]) for _ in range(5)])
            assert len(ok) == 1 and len(refused) == 4
            assert eng.core.messages_held() == 10
            got = await svc.receive(ADMIN, "a", 0, 4)
            await svc.settle(ADMIN, [(d.token, "ack", 0) for d in got])
            # acked just now: the refusal counts the queues again before it refuses
            await svc.send(ADMIN, [], ("b", [b"w"] * 4, 0.0))
            assert eng.core.messages_held() == 10 and eng.core.queues["b"].size == 8
            with pytest.raises(errors.Unavailable):
                await svc.send(ADMIN, [("a", b"v", 0.0, "")])
    asyncio.run(main())


def test_the_node_wide_cap_counts_what_another_path_stored_since_it_last_counted(tmp_path):
    """Between two counts of every queue, the sends the node settled are added as
    they settle: a count taken before a burst cannot let the burst pass the cap."""
    async def main():
        async with _node(tmp_path, messages_max=50) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {})
            await svc.send(ADMIN, [("q", b"x", 0.0, "")])  # counted here (held 1)
            for _ in range(7):  # each settles before the next: 7 x 7 = 49 more
                await svc.send(ADMIN, [], ("q", [b"x"] * 7, 0.0))
            assert eng.core.messages_held() == 50
            with pytest.raises(errors.Unavailable) as e:
                await svc.send(ADMIN, [("q", b"x", 0.0, "")])
            assert e.value.reason == errors.NODE_FULL
    asyncio.run(main())


def test_a_node_counts_what_it_holds_before_its_first_send(tmp_path):
    """A node just started (or newly primary, or with a snapshot's core) counts
    every queue before it takes a send: what it holds came in by no send of its own."""
    async def main():
        async with _node(tmp_path, messages_max=10) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {})
            await svc.send(ADMIN, [], ("q", [b"x"] * 8, 0.0))
        async with _node(tmp_path, messages_max=10) as (eng, svc):
            assert eng.core.messages_held() == 8
            with pytest.raises(errors.Unavailable) as e:
                await svc.send(ADMIN, [], ("q", [b"x"] * 3, 0.0))
            assert e.value.reason == errors.NODE_FULL
            await svc.send(ADMIN, [], ("q", [b"x"] * 2, 0.0))
            assert eng.core.messages_held() == 10
    asyncio.run(main())


def test_leases_in_flight_are_capped_per_queue_and_on_the_node(tmp_path):
    """A receive leases no further past its queue's cap of leases in flight, or
    past the node's, every queue together: it answers what fits, then nothing,
    and the rest stay visible, untouched; a lease ended makes room again."""
    async def main():
        async with _node(tmp_path, leases_per_queue_max=3, leases_max=5) as (eng, svc):
            for q in ("a", "b"):
                await svc.put_queue(ADMIN, q, {})
                await svc.send(ADMIN, [], (q, [b"x"] * 6, 0.0))
            assert len(await svc.receive(ADMIN, "a", 0, 10)) == 3  # the queue's cap
            assert await svc.receive(ADMIN, "a", 0, 10) == []
            got_b = await svc.receive(ADMIN, "b", 0, 10)
            assert len(got_b) == 2  # the node's: 3 + 2
            assert await svc.receive(ADMIN, "b", 0, 10) == []
            assert len(eng.core.leases) == 5
            assert svc.core.stats("b", eng.now_us())["visible"] == 4  # the rest untouched, visible
            await svc.settle(ADMIN, [(got_b[0].token, "ack", 0)])
            assert len(await svc.receive(ADMIN, "b", 0, 10)) == 1
            assert len(eng.core.leases) == 5
    asyncio.run(main())


def test_dedup_keys_remembered_on_the_node_are_capped_and_a_repeat_is_still_answered(tmp_path):
    """Limits.dedup_keys_max bounds the keys the node remembers, every queue
    together (each for up to a day): a send with a new key past it is 503
    node_full, storing nothing; a repeat of a remembered key is answered as ever
    (the first id); sends without a key, or to a queue with no window, go on;
    new keys on their way count."""
    async def main():
        async with _node(tmp_path, dedup_keys_max=3) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {"dedupWindowSeconds": 3600})
            await svc.put_queue(ADMIN, "r", {"dedupWindowSeconds": 3600})
            await svc.put_queue(ADMIN, "plain", {})
            [(first, dup, _)] = await svc.send(ADMIN, [("q", b"a", 0.0, "k1")])
            await svc.send(ADMIN, [("r", b"b", 0.0, "k2")])
            with pytest.raises(errors.Unavailable) as e:  # 2 remembered, 2 new would be 4
                await svc.send(ADMIN, [("q", b"c", 0.0, "k3"), ("r", b"d", 0.0, "k4")])
            assert e.value.reason == errors.NODE_FULL and "dedup keys" in str(e.value)
            assert eng.core.dedup_n == 2 and eng.core.messages_held() == 2  # nothing of it stored
            ok, refused = await _outcomes([svc.send(ADMIN, [("q", b"e", 0.0, f"n{i}")]) for i in range(4)])
            assert len(ok) == 1 and len(refused) == 3 and eng.core.dedup_n == 3  # on their way, they counted
            assert await svc.send(ADMIN, [("q", b"a", 0.0, "k1")]) == [(first, True, None)]  # a repeat
            await svc.send(ADMIN, [("q", b"f", 0.0, "")])  # no key
            await svc.send(ADMIN, [("plain", b"g", 0.0, "k5")])  # no window: the key is not remembered
            assert eng.core.dedup_n == 3 and eng.core.messages_held() == 5
    asyncio.run(main())


def test_keys_whose_window_ended_make_room_on_an_idle_node(tmp_path, monkeypatch):
    """At the dedup-key cap, keys whose window is over count no more, though no
    record has applied since to forget them: an idle node's keys would otherwise
    refuse every new key for ever."""
    async def main():
        async with _node(tmp_path, dedup_keys_max=2) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {"dedupWindowSeconds": 60})
            await svc.send(ADMIN, [("q", b"a", 0.0, "k1")])
            await svc.send(ADMIN, [("q", b"b", 0.0, "k2")])
            with pytest.raises(errors.Unavailable):
                await svc.send(ADMIN, [("q", b"c", 0.0, "k3")])
            later = eng.now_us() + 61 * 1_000_000
            monkeypatch.setattr(eng, "now_us", lambda: later)  # the node's clock, a minute on
            assert eng.core.dedup_n == 2  # nothing applied since: still remembered
            [(mid, dup, _)] = await svc.send(ADMIN, [("q", b"c", 0.0, "k3")])
            assert not dup and eng.core.dedup_n == 1  # its record forgot k1 and k2
    asyncio.run(main())


def test_a_resend_of_a_remembered_key_is_answered_at_every_cap(tmp_path):
    """A repeat of a key the queue remembers stores nothing, so neither the
    queue's cap nor the node's refuses it: the caller learns its first send's id."""
    async def main():
        async with _node(tmp_path, messages_max=2, messages_per_queue_max=1) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {"dedupWindowSeconds": 3600})
            await svc.put_queue(ADMIN, "r", {})
            await svc.put_queue(ADMIN, "s", {})
            [(first, _, _)] = await svc.send(ADMIN, [("q", b"a", 0.0, "k1")])  # q at its cap
            await svc.send(ADMIN, [("r", b"b", 0.0, "")])  # the node at its cap
            for queue, reason in (("q", errors.QUEUE_FULL), ("s", errors.NODE_FULL)):
                with pytest.raises(errors.Unavailable) as e:
                    await svc.send(ADMIN, [(queue, b"c", 0.0, "")])
                assert e.value.reason == reason
            assert await svc.send(ADMIN, [("q", b"a", 0.0, "k1")]) == [(first, True, None)]
            assert eng.core.messages_held() == 2
    asyncio.run(main())


def test_a_repeat_whose_key_is_forgotten_before_it_applies_stores_nothing(tmp_path):
    """A repeat is let in at no cap's cost because its key is remembered when it is
    checked. If the key's window ends before the record's time (the clock moves
    between the check and the commit), apply refuses the entry (``unavailable``,
    nothing stored) instead of storing it past the queue's cap; sent again, it
    meets the cap like any new message."""
    clock = [1_800_000_000_000_000]
    window_us = 10 * spool.US

    async def main():
        eng = Engine(str(tmp_path / "n"), limits=Limits(messages_per_queue_max=1), clock_us=lambda: clock[0])
        await eng.start()
        try:
            svc = Service(eng, ["k"])
            await svc.put_queue(ADMIN, "q", {"dedupWindowSeconds": window_us // spool.US})
            await svc.send(ADMIN, [("q", b"a", 0.0, "k1")])  # q at its cap
            sent_at = eng.last_ts
            clock[0] = sent_at + window_us - 1  # checked: the key is remembered
            fut = svc.send_begin(ADMIN, [("q", b"a", 0.0, "k1")])
            clock[0] = sent_at + window_us + 1  # stamped: its window is over
            [(mid, dup, err)] = Service.send_results(await fut)
            assert (mid, dup) == ("", False) and isinstance(err, errors.Unavailable), (mid, dup, err)
            assert eng.core.queues["q"].size == 1 and eng.core.messages_held() == 1
            assert eng.core.dedup_n == 0  # no key was made anew either
            with pytest.raises(errors.Unavailable) as e:
                await svc.send(ADMIN, [("q", b"a", 0.0, "k1")])
            assert e.value.reason == errors.QUEUE_FULL
        finally:
            await eng.stop()
    asyncio.run(main())


def test_a_message_whose_body_is_lost_stops_the_node_instead_of_failing_each_receive(tmp_path):
    """Memory holds a message the store has no body for (a broken invariant). A
    receive raised KeyError: a 500, the leases it had made left for nobody, and
    every later receive of the queue failing on the same oldest message until its
    retries ran out and a move to the failure queue dropped it on every member.
    Now the node stops (an internal failure: its members still hold the body,
    and a new primary hands it out) and the receive is answered unavailable."""
    from node.engine import INTERNAL_FAILURE

    async def main():
        async with _node(tmp_path) as (eng, svc):
            await svc.put_queue(ADMIN, "q", {})
            [(mid, _, _)] = await svc.send(ADMIN, [("q", b"lost", 0.0, "")])
            m = svc.core.queues["q"].msgs[mid]
            m.body = None  # (never checkpointed: the store holds no row for it either)
            with pytest.raises(errors.Unavailable):
                await svc.receive(ADMIN, "q", 0, 1)
            assert eng.failed is not None and eng.failed_what == INTERNAL_FAILURE

    asyncio.run(main())


def test_a_record_the_core_cannot_apply_stops_the_node_as_an_internal_failure(tmp_path):
    """A committed record the core cannot apply (here one naming no operation) is
    a broken invariant, not the disk's doing: the node stops as an internal
    failure (exit 71, which the systemd unit restarts), where it stopped as a
    storage failure (70)."""
    from node.engine import INTERNAL_FAILURE
    from spooler.pb import log_pb2

    async def main():
        async with _node(tmp_path) as (eng, svc):
            lsn = eng.core.lsn + 1
            eng.unapplied[lsn] = (log_pb2.Record(lsn=lsn, epoch=eng.core.epoch), 0, None)
            with pytest.raises(ValueError):
                eng.apply_upto(lsn)
            assert eng.failed is not None and eng.failed_what == INTERNAL_FAILURE

    asyncio.run(main())
