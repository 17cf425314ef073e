"""The SDK's promises where a black-box audit found them broken: what is retried,
where a retry goes, what one bad or large send does to the others, what close()
does to sends already handed over, and how a timeout is reported."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from concurrent.futures import Future

import pytest

from grpc_fakes import answered_by
from integration.test_cluster import cluster, primary_of, until_ok  # noqa: F401  (fixture)
from nodeproc import wait_until
from spooler import errors
from spooler._common import SendResult
from spooler.aio import AsyncClient
from spooler.client import Client
from spooler.pb import api_pb2

DEAD = "127.0.0.1:9"  # nothing listens: the clients below never reach it


def _script(outcomes):
    """A stand-in for one send attempt: raises or returns the next outcome; counts attempts."""
    calls = []

    def attempt():
        calls.append(1)
        o = outcomes[len(calls) - 1]
        if isinstance(o, BaseException):
            raise o
        return o
    return attempt, calls


# first: what the first attempt meets. "unavailable": then unconfirmed, then success;
# "unconfirmed": unconfirmed at once, then success.
SEND_CASES = [
    ("unavailable", "", 0, 2, errors.OperationUnconfirmed),   # no key: the unconfirmed second attempt is final
    ("unavailable", "k", 0, 2, errors.OperationUnconfirmed),  # a key, but the queue does not deduplicate
    ("unavailable", "", 60, 2, errors.OperationUnconfirmed),  # a deduplicating queue, but no key to find
    ("unavailable", "k", 60, 3, SendResult),                  # a key on a deduplicating queue: resent, harmless
    ("unconfirmed", "", 0, 1, errors.OperationUnconfirmed),
    ("unconfirmed", "", 60, 1, errors.OperationUnconfirmed),
    ("unconfirmed", "k", 0, 1, errors.OperationUnconfirmed),
    ("unconfirmed", "k", 60, 2, SendResult),
    # the window (10 s) is shorter than a resend may take to be recorded (the 30 s
    # timeout): a resend could land after the key is forgotten, so none is made
    ("unconfirmed", "k", 10, 1, errors.OperationUnconfirmed),
    ("unavailable", "k", 10, 2, errors.OperationUnconfirmed),
]


def _send_script(first):
    if first == "unavailable":
        return _script([errors.Unavailable("no primary"), errors.OperationUnconfirmed("quorum timed out"),
                        SendResult("m1", False)])
    return _script([errors.OperationUnconfirmed("quorum timed out"), SendResult("m1", False)])


@pytest.mark.parametrize("first,dedup_key,window,attempts_made,outcome", SEND_CASES)
def test_async_send_resends_an_unconfirmed_attempt_only_with_a_key_that_dedups(first, dedup_key, window,
                                                                                attempts_made, outcome):
    async def main():
        c = AsyncClient(DEAD, "k")
        attempt, calls = _send_script(first)

        async def fake_request(sends):
            return attempt()
        c._send_request = fake_request

        async def fake_get_queue(name):
            return {"settings": {"dedupWindowSeconds": window}}
        c.get_queue = fake_get_queue

        async def batch_now(batch):
            for (_, fut) in batch:
                try:
                    r = await fake_request(None)
                    fut.set_result(r)
                except errors.SpoolerError as e:
                    fut.set_exception(e)
        c._send_batch_now = batch_now
        try:
            r = await c.send("q", b"x", dedup_key=dedup_key)
            got = type(r)
        except errors.SpoolerError as e:
            got = type(e)
        await c.close()
        return got, len(calls)
    got, n = asyncio.run(main())
    assert (got, n) == (outcome, attempts_made)


@pytest.mark.parametrize("first,dedup_key,window,attempts_made,outcome", SEND_CASES)
def test_sync_send_resends_an_unconfirmed_attempt_only_with_a_key_that_dedups(first, dedup_key, window,
                                                                               attempts_made, outcome):
    c = Client(DEAD, "k")
    try:
        attempt, calls = _send_script(first)

        c.send_async = answered_by(attempt)
        c.get_queue = lambda name: {"settings": {"dedupWindowSeconds": window}}
        try:
            got = type(c.send("q", b"x", dedup_key=dedup_key))
        except errors.SpoolerError as e:
            got = type(e)
        assert (got, len(calls)) == (outcome, attempts_made)
    finally:
        c.close()


def test_sync_ack_retried_after_a_node_died_goes_to_the_next_node(cluster):  # noqa: F811
    nodes, _ = cluster
    p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
    r = next(i for i in nodes if i != p)
    with Client(nodes[p].grpc_target, nodes[p].admin_key) as setup:
        until_ok(lambda: setup.put_queue("q"))
        until_ok(lambda: setup.send("q", b"x"))
    c = Client(f"{nodes[r].grpc_target},{nodes[p].grpc_target}", nodes[p].admin_key, timeout_s=5)
    try:
        m = until_ok(lambda: c.receive("q", wait_s=5))[0]  # through the replica, forwarded
        assert c.target_now() == nodes[r].grpc_target
        nodes[r].kill()
        c.ack(m.token)  # first attempt: the dead replica; the retry: the primary
        st = c.get_queue("q")["stats"]
        assert st["ackedTotal"] == 1 and st["leased"] == 0
    finally:
        c.close()


def test_a_send_of_the_wrong_type_fails_alone(node):
    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("ty")
            wrong = {7: "text, not bytes", 19: bytearray(b"not bytes either")}
            res = await asyncio.gather(*[c.send("ty", wrong.get(i, b"ok %d" % i)) for i in range(40)],
                                       return_exceptions=True)
            bad = [i for i, r in enumerate(res) if isinstance(r, BaseException)]
            assert bad == [7, 19] and all(isinstance(res[i], TypeError) for i in bad)
            assert (await c.get_queue("ty"))["stats"]["visible"] == 38
    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_send_whose_name_or_key_cannot_be_encoded_fails_alone(node):
    """A dedup key (or queue name) that is not valid UTF-8 text, such as a file name
    read with surrogate escapes, cannot go into a request. It failed the whole
    auto-batch it joined, every other caller's send with it
    (UnicodeEncodeError); now it is its own caller's ``invalid_argument`` before it
    joins one, as over HTTP, in both clients."""
    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("enc")
            res = await asyncio.gather(*[c.send("enc", b"ok %d" % i, dedup_key="file-\udcff" if i == 7 else "")
                                         for i in range(40)], return_exceptions=True)
            bad = [i for i, r in enumerate(res) if isinstance(r, BaseException)]
            assert bad == [7] and isinstance(res[7], errors.InvalidArgument), res[:8]
            with pytest.raises(errors.InvalidArgument):
                await c.send("enc-\ud800", b"x")
            assert (await c.get_queue("enc"))["stats"]["visible"] == 39
    asyncio.run(asyncio.wait_for(main(), 60))
    with Client(node.grpc_target, node.admin_key) as c:
        for queue, key in (("enc", "file-\udcff"), ("enc-\ud800", "")):
            with pytest.raises(errors.InvalidArgument):
                c.send(queue, b"x", dedup_key=key)


def test_a_send_whose_delay_no_request_can_carry_fails_alone(node):
    """An int delay larger than a double holds (about 1e308) cannot go into a request:
    building it raised OverflowError, and for an auto-batched send that failed every
    caller in the batch. Now it is its own caller's ``invalid_argument`` before it
    joins one, in both clients, and a nack's likewise."""
    huge = 10 ** 400

    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("dl")
            res = await asyncio.gather(*[c.send("dl", b"ok %d" % i, delay_s=huge if i == 5 else 0)
                                         for i in range(40)], return_exceptions=True)
            bad = [i for i, r in enumerate(res) if isinstance(r, BaseException)]
            assert bad == [5] and isinstance(res[5], errors.InvalidArgument), res[:6]
            assert (await c.get_queue("dl"))["stats"]["visible"] == 39
            [d] = await c.receive("dl", max_messages=1)
            with pytest.raises(errors.InvalidArgument):
                await c.nack(d.token, delay_s=huge)
            await c.ack(d.token)  # the lease was untouched
    asyncio.run(asyncio.wait_for(main(), 60))
    with Client(node.grpc_target, node.admin_key) as c:
        with pytest.raises(errors.InvalidArgument):
            c.send("dl", b"x", delay_s=huge)


def test_close_sends_what_it_was_handed(node):
    async def main():
        c = AsyncClient(node.grpc_target, node.admin_key)
        await c.put_queue("cl")
        sends = [asyncio.ensure_future(c.send("cl", b"m%d" % i)) for i in range(200)]
        await asyncio.sleep(0)  # the sends are queued, most not yet sent
        await c.close()
        res = await asyncio.gather(*sends, return_exceptions=True)
        assert all(isinstance(r, SendResult) for r in res), [r for r in res if not isinstance(r, SendResult)][:3]
        async with AsyncClient(node.grpc_target, node.admin_key) as c2:
            assert (await c2.get_queue("cl"))["stats"]["visible"] == 200
        with pytest.raises(RuntimeError):
            await c.send("cl", b"after close")
    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_burst_of_large_messages_goes_out_in_several_batches(node):
    body = b"L" * 250_000  # under the 256 KiB limit; 80 of them are 20 MB, over gRPC's 16 MiB

    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("big")
            rpcs0 = c.send_rpcs
            res = await asyncio.gather(*[c.send("big", body) for _ in range(80)], return_exceptions=True)
            assert all(isinstance(r, SendResult) for r in res), [r for r in res if not isinstance(r, SendResult)][:2]
            assert c.send_rpcs - rpcs0 >= 5  # at most 4 MiB of bodies per batch
            assert (await c.get_queue("big"))["stats"]["visible"] == 80
    asyncio.run(asyncio.wait_for(main(), 120))
    with Client(node.grpc_target, node.admin_key, timeout_s=60) as c:
        c.put_queue("big2")
        futs = [c.send_async(api_pb2.SendRequest(queue="big2", body=body)) for _ in range(80)]
        res = [f.exception() or f.result() for f in futs]
        assert all(isinstance(r, SendResult) for r in res), [r for r in res if not isinstance(r, SendResult)][:2]
        assert c.get_queue("big2")["stats"]["visible"] == 80


def test_a_read_that_times_out_is_unavailable_not_unconfirmed(node):
    with Client(node.grpc_target, node.admin_key) as setup:  # (a write: the default timeout)
        setup.put_queue("t")
    with Client(node.grpc_target, node.admin_key, timeout_s=1, retry_attempts=2) as c:
        c.get_queue("t")  # connected
        os.kill(node.pid, signal.SIGSTOP)
        try:
            with pytest.raises(errors.Unavailable):
                c.get_queue("t")
            with pytest.raises(errors.Unavailable):
                c.receive("t", max_messages=5)
        finally:
            os.kill(node.pid, signal.SIGCONT)


def test_sync_receive_refuses_a_count_below_one(node):
    with Client(node.grpc_target, node.admin_key) as c:
        c.put_queue("neg")
        c.send("neg", b"x")
        for n in (0, -3):
            with pytest.raises(errors.InvalidArgument):
                c.receive("neg", max_messages=n)
        assert c.get_queue("neg")["stats"]["leased"] == 0


def test_an_empty_receive_on_the_session_is_an_empty_list(node):
    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("empty")
            assert await c.receive("empty", wait_s=0.1, max_messages=10) == []
            assert await c.receive("empty") == []
    asyncio.run(asyncio.wait_for(main(), 60))


def test_async_consumer_says_when_its_lease_is_lost(node, caplog):
    """A restart is a new epoch: the running handler's lease is stale. The renewer
    says so once and stops, instead of dying with an exception nobody reads; and
    (since 0.4.41) the handler sees it: ``m.lease_lost`` turns True."""
    import logging
    seen = []

    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("lost", leaseTimeoutSeconds=1)  # renewed about every 0.5 s
            await c.send("lost", b"x")
            stop, started, restarted = asyncio.Event(), asyncio.Event(), asyncio.Event()

            async def handler(m):
                started.set()
                seen.append(m.lease_lost)
                await asyncio.wait_for(restarted.wait(), 20)
                # the handler runs on until a renewal has met the new epoch (or 20 s pass)
                deadline = asyncio.get_running_loop().time() + 20
                while not m.lease_lost and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.05)
                seen.append(m.lease_lost)
                stop.set()
            task = asyncio.ensure_future(c.consume("lost", handler, wait_s=1, stop=stop))
            await asyncio.wait_for(started.wait(), 10)
            await asyncio.to_thread(node.restart)
            restarted.set()
            await asyncio.wait_for(task, 30)
    with caplog.at_level(logging.WARNING, logger="spooler.aio"):
        asyncio.run(main())
    lost = [r for r in caplog.records if "the lease is lost" in r.getMessage()]
    assert len(lost) == 1, [r.getMessage() for r in caplog.records]
    assert seen == [False, True]


def test_a_sync_handler_sees_that_its_lease_was_lost(node):
    """``m.lease_lost`` turns True once a renewal is answered ``stale_lease`` (here
    the lease was ended under the handler: another client nacked its token), so a
    long handler can stop early; the control message's lease, renewed for more
    than two lease times, stays False."""
    with Client(node.grpc_target, node.admin_key) as c, Client(node.grpc_target, node.admin_key) as other:
        c.put_queue("slost", leaseTimeoutSeconds=1)  # renewed about every 0.5 s
        c.send("slost", b"kept")
        c.send("slost", b"taken")
        seen = {}

        def handler(m):
            before = m.lease_lost
            if m.body == b"taken":
                other.nack(m.token)
            deadline = time.monotonic() + (10 if m.body == b"taken" else 2.5)
            while not m.lease_lost and time.monotonic() < deadline:
                time.sleep(0.05)
            seen[m.body] = (before, m.lease_lost)
        assert c.consume("slost", handler, wait_s=1, max_messages=2) == 2
        assert seen == {b"kept": (False, False), b"taken": (False, True)}, seen


def _note_receive(c: AsyncClient):
    """-> (an event set once a receive begins (``c._receive``, which both receive and
    consume use), a function that undoes this)."""
    called = asyncio.Event()
    receive = c._receive

    async def spy(*a, **kw):
        called.set()
        return await receive(*a, **kw)
    c._receive = spy

    def restore():
        c._receive = receive
    return called, restore


def test_async_consume_returns_soon_after_stop_during_a_long_poll(node):
    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("idle")
            stop = asyncio.Event()
            polling, restore = _note_receive(c)
            task = asyncio.ensure_future(c.consume("idle", lambda m: asyncio.sleep(0), wait_s=20, stop=stop))
            await asyncio.wait_for(polling.wait(), 5)  # the worker is in its 20 s long poll
            await _node_holds_polls(node, 1)  # ...which has reached the node
            restore()
            stop.set()
            await asyncio.wait_for(task, 5)  # not 20 s
            await c.send("idle", b"after")
            # the given-up poll is gone: the next receive gets the message (a poll still
            # waiting on the node would have taken it first)
            got = await c.receive("idle", wait_s=5)
            assert [m.body for m in got] == [b"after"]
    asyncio.run(asyncio.wait_for(main(), 60))


def test_cancelling_consume_takes_its_long_poll_with_it(node):
    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("cancelled")
            polling, restore = _note_receive(c)
            task = asyncio.ensure_future(c.consume("cancelled", lambda m: asyncio.sleep(0), wait_s=20))
            await asyncio.wait_for(polling.wait(), 5)  # inside its 20 s long poll
            await _node_holds_polls(node, 1)  # ...which has reached the node
            restore()
            task.cancel()
            await asyncio.wait({task})
            await c.send("cancelled", b"after")
            got = await c.receive("cancelled", wait_s=5)
            assert [m.body for m in got] == [b"after"]
    asyncio.run(asyncio.wait_for(main(), 60))


def test_cancelling_consume_under_a_handler_gives_the_message_back_at_once(node):
    """A consume cancelled while its handler runs: the unfinished message is nacked
    (visible again now, as after a failed handler), not left leased for its 30 s."""
    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("cut-short", leaseTimeoutSeconds=30)
            await c.send("cut-short", b"work")
            running = asyncio.Event()

            async def handler(m):
                running.set()
                await asyncio.Event().wait()  # until cancelled

            task = asyncio.ensure_future(c.consume("cut-short", handler, wait_s=5))
            await asyncio.wait_for(running.wait(), 10)
            task.cancel()
            await asyncio.wait({task})
            assert task.cancelled()
            got = await c.receive("cut-short", wait_s=5)
            assert [(m.body, m.retry_count) for m in got] == [(b"work", 1)], got
            st = (await c.get_queue("cut-short"))["stats"]
            assert (st["nackedTotal"], st["leaseExpiredTotal"]) == (1, 0), st
    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_handler_cut_short_by_sys_exit_gives_the_message_back_at_once(node):
    """The sync client: a handler interrupted (SystemExit from a signal handler, or
    Ctrl-C) nacks the unfinished message on its way out, and the exit goes on."""
    with Client(node.grpc_target, node.admin_key) as c:
        c.put_queue("interrupted", leaseTimeoutSeconds=30)
        c.send("interrupted", b"work")
        [m] = c.receive("interrupted", wait_s=5)

        def handler(m):
            raise SystemExit(0)

        with pytest.raises(SystemExit):
            c.handle(m, handler)
        got = c.receive("interrupted", wait_s=2)
        assert [(x.body, x.retry_count) for x in got] == [(b"work", 1)], got
        st = c.get_queue("interrupted")["stats"]
        assert (st["nackedTotal"], st["leaseExpiredTotal"]) == (1, 0), st


def test_retries_outlast_a_failover_timeout():
    """Six attempts, waits 0.1 .. 1.6 s: more than the default 2 s failover timeout."""
    import time

    async def main():
        c = AsyncClient(DEAD, "k")
        t = time.monotonic()
        with pytest.raises(errors.Unavailable):
            await c.send("q", b"x")
        dt, rpcs = time.monotonic() - t, c.send_rpcs
        await c.close()
        return dt, rpcs
    dt, rpcs = asyncio.run(main())
    assert rpcs == 6 and dt >= 3.0, (rpcs, dt)
    with Client(DEAD, "k") as c:
        t = time.monotonic()
        with pytest.raises(errors.Unavailable):
            c.send("q", b"x")
        assert c.send_rpcs == 6 and time.monotonic() - t >= 3.0


def _first_node_hung(node, tmp_path, queue, check, **client_kw):
    """An AsyncClient given ``node`` then a second node (both holding ``queue``),
    connected to ``node``; then ``node`` is SIGSTOPped while ``check(c, other)``
    runs, and SIGCONTed after."""
    from nodeproc import NodeProc
    other = NodeProc(str(tmp_path / "other"), node_id="n1").start()
    try:
        async def main():
            for n in (node, other):
                async with AsyncClient(n.grpc_target, n.admin_key) as c0:
                    await c0.put_queue(queue)
            c = AsyncClient(f"{node.grpc_target},{other.grpc_target}", node.admin_key,
                            timeout_s=client_kw.pop("timeout_s", 3), **client_kw)
            try:
                await c.get_queue(queue)  # connected to the first
                os.kill(node.pid, signal.SIGSTOP)
                try:
                    await check(c, other)
                finally:
                    os.kill(node.pid, signal.SIGCONT)
            finally:
                await c.close()
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        other.kill()


def test_many_calls_timing_out_together_move_the_client_once(node, tmp_path):
    """Four reads time out together on a hung node: the client moves to the next
    node once, not four times (which, with two nodes, would land it back on the hung one)."""
    async def check(c, other):
        res = await asyncio.gather(*[c.get_queue("mq") for _ in range(4)], return_exceptions=True)
        assert all(isinstance(r, errors.Unavailable) for r in res), res
        assert c.target_now() == other.grpc_target
        assert (await c.get_queue("mq"))["name"] == "mq"  # served by the other node
    # no retries: each call's own failure is what moves the client here
    _first_node_hung(node, tmp_path, "mq", check, retry_attempts=1)


HUNG_NODE_LEFT_S = 15  # pings (every 2 s) unanswered for 5 s close the connection: about 7 s at most, with
# room for a slow machine; without that mechanism the calls wait out their 30 s timeout


@pytest.mark.parametrize("call", ["send", "long_poll"])
def test_calls_on_a_node_that_hangs_fail_in_seconds_not_at_their_timeout(node, tmp_path, call):
    """A node that stops answering (here SIGSTOP) fails the calls waiting on it once
    its pings go unanswered, well before their 30 s timeout, and the client moves on
    to the next node."""
    async def check(c, other):
        loop = asyncio.get_running_loop()
        t = loop.time()
        if call == "send":
            with pytest.raises(errors.OperationUnconfirmed):  # it may have landed
                await c.send("hq", b"x")
        else:
            with pytest.raises(errors.Unavailable):  # nothing was leased that anyone saw
                await c.receive("hq", wait_s=20)
        assert loop.time() - t < HUNG_NODE_LEFT_S
        assert c.target_now() == other.grpc_target
        await c.send("hq", b"y")  # served by the other node
    _first_node_hung(node, tmp_path, "hq", check, retry_attempts=1, timeout_s=30)


def test_sync_calls_on_a_node_that_hangs_fail_in_seconds_not_at_their_timeout(node, tmp_path):
    from nodeproc import NodeProc
    other = NodeProc(str(tmp_path / "other"), node_id="n1").start()
    try:
        for n in (node, other):
            with Client(n.grpc_target, n.admin_key) as c0:
                c0.put_queue("hs")
        with Client(f"{node.grpc_target},{other.grpc_target}", node.admin_key, timeout_s=30,
                    retry_attempts=1) as c:
            c.get_queue("hs")  # connected to the first
            os.kill(node.pid, signal.SIGSTOP)
            try:
                t = time.monotonic()
                with pytest.raises(errors.OperationUnconfirmed):
                    c.send("hs", b"x")
                assert time.monotonic() - t < HUNG_NODE_LEFT_S
                c.send("hs", b"y")  # served by the other node
            finally:
                os.kill(node.pid, signal.SIGCONT)
        with Client(other.grpc_target, other.admin_key) as c2:
            assert c2.get_queue("hs")["stats"]["sentTotal"] == 1
    finally:
        other.kill()


def test_sync_consume_returns_soon_after_stop_during_a_long_poll(node):
    with Client(node.grpc_target, node.admin_key) as c:
        c.put_queue("sidle")
        stop, polling = threading.Event(), threading.Event()
        receive = c._receive_unless

        def spy(*a, **kw):
            polling.set()
            return receive(*a, **kw)
        c._receive_unless = spy
        out = {}
        t = threading.Thread(target=lambda: out.update(n=c.consume("sidle", lambda m: None, wait_s=20, stop=stop)))
        t.start()
        assert polling.wait(5)  # the worker is in its 20 s long poll
        stop.set()
        t.join(5)
        assert not t.is_alive() and out == {"n": 0}  # not 20 s later
        c.send("sidle", b"after")
        got = c.receive("sidle", wait_s=5)  # no poll left waiting on the node to take it first
        assert [m.body for m in got] == [b"after"]


def test_queue_calls_are_retried_on_the_next_node_after_unavailable(node):
    """The first node in the list is down: a queue call (read or write) that finds
    it unavailable goes to the next node instead of failing (known not accepted,
    so a repeat is safe)."""
    with Client(f"{DEAD},{node.grpc_target}", node.admin_key, timeout_s=5) as c:
        assert c.put_queue("rq")["name"] == "rq"
    with Client(f"{DEAD},{node.grpc_target}", node.admin_key, timeout_s=5) as c:
        assert c.get_queue("rq")["name"] == "rq"

    async def main():
        async with AsyncClient(f"{DEAD},{node.grpc_target}", node.admin_key, timeout_s=5) as c:
            assert [q["name"] for q in await c.list_queues()] == ["rq"]
        async with AsyncClient(f"{DEAD},{node.grpc_target}", node.admin_key, timeout_s=5) as c:
            assert (await c.get_queue("rq"))["name"] == "rq"
    asyncio.run(main())


def test_a_body_too_large_for_grpc_fails_alone_and_leaves_the_session_working(node):
    """gRPC refuses to send a message over its limit. The SDK refuses such a body
    first, as message_too_large, so it never breaks the Session under the calls
    riding it (a long poll waiting there goes on), and so does an empty batch."""
    huge = b"x" * (17 << 20)

    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key, timeout_s=10) as c:
            await c.put_queue("big")
            await c.send("big", b"warm")
            [m] = await c.receive("big")
            await c.ack(m.token)
            poll = asyncio.ensure_future(c.receive("big", wait_s=15))  # ended by the send below
            deadline = asyncio.get_running_loop().time() + 10
            while node.metric("spooler_receives_waiting") < 1:  # (a quick local HTTP read)
                assert asyncio.get_running_loop().time() < deadline, "the long poll never started"
                await asyncio.sleep(0.02)
            with pytest.raises(errors.MessageTooLarge):
                await c.send("big", huge)
            with pytest.raises(errors.MessageTooLarge):
                await c.send_batch("big", [b"y" * (9 << 20), b"y" * (9 << 20)])
            with pytest.raises(errors.InvalidArgument):
                await c.send_batch("big", [])
            later = await c.send("big", b"after")
            got = await poll  # the long poll was not broken: it gets the next message
            assert [g.id for g in got] == [later.id]
    asyncio.run(main())
    with Client(node.grpc_target, node.admin_key, timeout_s=10) as c:
        with pytest.raises(errors.MessageTooLarge):
            c.send("big", huge)
        with pytest.raises(errors.MessageTooLarge):
            c.send_batch("big", [b"y" * (9 << 20), b"y" * (9 << 20)])
        with pytest.raises(errors.InvalidArgument):
            c.send_batch("big", [])
        assert c.get_queue("big")["stats"]["sentTotal"] == 2


def test_receives_and_batches_are_retried_on_the_next_node_after_unavailable(node):
    with Client(node.grpc_target, node.admin_key, timeout_s=5) as c:
        c.put_queue("rb")
    with Client(f"{DEAD},{node.grpc_target}", node.admin_key, timeout_s=5) as c:
        assert len(c.send_batch("rb", [b"a", b"b"])) == 2
    with Client(f"{DEAD},{node.grpc_target}", node.admin_key, timeout_s=5) as c:
        [m] = c.receive("rb")
    with Client(f"{DEAD},{node.grpc_target}", node.admin_key, timeout_s=5) as c:
        assert c.settle_batch([(m.token, "ack", 0)]) == [None]

    async def main():
        async with AsyncClient(f"{DEAD},{node.grpc_target}", node.admin_key, timeout_s=5) as c:
            [m2] = await c.receive("rb")
        async with AsyncClient(f"{DEAD},{node.grpc_target}", node.admin_key, timeout_s=5) as c:
            assert await c.settle_batch([(m2.token, "ack", 0)]) == [None]
        async with AsyncClient(f"{DEAD},{node.grpc_target}", node.admin_key, timeout_s=5) as c:
            assert len(await c.send_batch("rb", [b"c"])) == 1
    asyncio.run(main())


def test_a_receive_whose_answer_was_lost_is_not_retried(node, tmp_path):
    """A receive that reached a node and got no answer may have leased messages
    there: the caller hears unavailable (the SDK tries to give them back) instead
    of the SDK quietly leasing more on the next node."""
    async def check(c, other):
        with pytest.raises(errors.Unavailable):
            await c.receive("lost")
        assert c.target_now() == other.grpc_target  # the client did move on
        assert await c.receive("lost") == []  # and the caller's own next try goes there
    _first_node_hung(node, tmp_path, "lost", check)


def test_a_node_that_never_answers_does_not_hold_up_the_next_nodes_session(node):
    """The first node accepts the connection and says nothing (a hung process the
    kernel still completes handshakes for). Its Session never connects, so the
    send never left: ``unavailable`` (safe to retry), not ``operation_unconfirmed``.
    The client moves on, and the stream it opens to the next node must not wait
    behind the first: the next send goes through at once."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    held, done = [], threading.Event()

    def accept():
        while not done.is_set():
            try:
                held.append(srv.accept()[0])
            except socket.timeout:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    silent = f"127.0.0.1:{srv.getsockname()[1]}"

    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c0:
            await c0.put_queue("silent")
        c = AsyncClient(f"{silent},{node.grpc_target}", node.admin_key, timeout_s=3, retry_attempts=1)
        try:
            with pytest.raises(errors.Unavailable):
                await c.send("silent", b"first")
            assert c.target_now() == node.grpc_target
            r = await asyncio.wait_for(c.send("silent", b"second"), 5)
            assert r.id and not r.duplicate
        finally:
            await c.close()

    try:
        asyncio.run(main())
    finally:
        done.set()
        t.join()
        for s in held:
            s.close()
        srv.close()


def test_async_consume_rides_out_an_outage_longer_than_its_retries(node, caplog):
    """The node dies while a handler runs and stays down past the client's retries:
    the ack cannot be confirmed. consume logs it and goes on (the message may come
    again: delivery is at least once); it neither ends nor leaves workers behind,
    and once the node is back it handles that message again and new ones."""
    import logging
    caplog.set_level(logging.WARNING, logger="spooler.aio")

    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key, timeout_s=2) as c:
            await c.put_queue("ride")
            first = (await c.send("ride", b"first")).id
            seen, started, killed, stop = [], asyncio.Event(), asyncio.Event(), asyncio.Event()

            async def handler(m):
                seen.append(m.id)
                if len(seen) == 1:
                    started.set()
                    await killed.wait()  # the node is killed meanwhile

            task = asyncio.ensure_future(c.consume("ride", handler, concurrency=3, wait_s=1, stop=stop))
            await asyncio.wait_for(started.wait(), 10)
            node.kill()
            killed.set()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while "ack of" not in caplog.text and loop.time() < deadline:
                await asyncio.sleep(0.05)
            assert "not confirmed" in caplog.text, caplog.text
            assert not task.done(), task
            node.start()
            deadline = loop.time() + 20
            second = None
            while second is None and loop.time() < deadline:
                try:
                    second = (await c.send("ride", b"second")).id
                except (errors.Unavailable, errors.OperationUnconfirmed):
                    await asyncio.sleep(0.05)
            while not (seen.count(first) == 2 and second in seen) and loop.time() < deadline:
                await asyncio.sleep(0.05)
            assert seen.count(first) == 2 and second in seen, seen
            stop.set()
            await asyncio.wait_for(task, 10)  # returns, no exception
            st = (await c.get_queue("ride"))["stats"]
            assert st["ackedTotal"] == 2 and st["visible"] == st["leased"] == 0, st

    asyncio.run(main())


def test_sync_handle_logs_an_ack_it_cannot_confirm_and_goes_on(node, caplog):
    import logging
    caplog.set_level(logging.WARNING, logger="spooler.client")
    with Client(node.grpc_target, node.admin_key, timeout_s=3) as c:
        c.put_queue("sh")
        c.send("sh", b"x")
        [m] = c.receive("sh")
        assert c.handle(m, lambda _: node.kill()) is True  # the handler succeeded; no exception
    assert "ack of" in caplog.text and "not confirmed" in caplog.text, caplog.text


def test_async_close_lets_an_ack_in_progress_finish(node):
    """An ack called just before close() gets its answer: cut off, it would leave
    the lease to expire and the message to come back with its count raised."""
    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as setup:
            await setup.put_queue("closing", leaseTimeoutSeconds=3)
            await setup.send("closing", b"x")
        c = AsyncClient(node.grpc_target, node.admin_key)
        [m] = await c.receive("closing")
        ack = asyncio.ensure_future(c.ack(m.token))
        await asyncio.sleep(0)  # the ack has started: its request waits to be written
        await c.close()
        await ack  # answered, no error
        async with AsyncClient(node.grpc_target, node.admin_key) as check:
            assert await check.receive("closing", wait_s=3.5) == []  # past the lease: nothing came back
            st = (await check.get_queue("closing"))["stats"]
            assert st["ackedTotal"] == 1 and st.get("leaseExpiredTotal", 0) == 0, st

    asyncio.run(main())


def test_async_close_lets_a_settle_batch_in_progress_finish(node):
    """As for an ack: a settle_batch of acks called just before close() gets its
    answer, and none of its messages comes back."""
    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as setup:
            await setup.put_queue("closing-batch", leaseTimeoutSeconds=3)
            for body in (b"x", b"y"):
                await setup.send("closing-batch", body)
        c = AsyncClient(node.grpc_target, node.admin_key)
        ms = await c.receive("closing-batch", max_messages=2)
        assert len(ms) == 2
        settled = asyncio.ensure_future(c.settle_batch([(m.token, "ack", 0.0) for m in ms]))
        await asyncio.sleep(0)  # the batch has started: its request waits to be written
        await c.close()
        assert await settled == [None, None]  # answered, no error
        async with AsyncClient(node.grpc_target, node.admin_key) as check:
            assert await check.receive("closing-batch", wait_s=3.5) == []  # past the lease: nothing came back
            st = (await check.get_queue("closing-batch"))["stats"]
            assert st["ackedTotal"] == 2 and st.get("leaseExpiredTotal", 0) == 0, st

    asyncio.run(main())


@pytest.mark.parametrize("settle", [
    lambda c, token: c.ack(token),
    lambda c, token: c.nack(token),
    lambda c, token: c.settle_batch([(token, "ack", 0.0)]),
])
def test_async_settles_begun_after_close_began_are_refused(node, settle):
    """close() waits for the settles in progress when it begins; one called after
    that would be neither waited for nor sure of an open channel, so it is refused
    (as on the sync client), and the one in progress still gets its answer."""
    async def main():
        c = AsyncClient(node.grpc_target, node.admin_key, timeout_s=20)
        await c.put_queue("closing-late", leaseTimeoutSeconds=30)
        for body in (b"x", b"y"):
            await c.send("closing-late", body)
        first, second = await c.receive("closing-late", max_messages=2)
        os.kill(node.pid, signal.SIGSTOP)  # the first ack stays on the wire until SIGCONT
        try:
            acking = asyncio.ensure_future(c.ack(first.token))
            deadline = asyncio.get_running_loop().time() + 10
            while not any(w.call is not None for w in c.session.waiting.values()):  # written to the stream
                assert asyncio.get_running_loop().time() < deadline, "the ack was never written"
                await asyncio.sleep(0.01)
            closing = asyncio.ensure_future(c.close())
            await asyncio.sleep(0)
            assert c._closing and not closing.done()
            with pytest.raises(RuntimeError, match="the client is closed"):
                await settle(c, second.token)
        finally:
            os.kill(node.pid, signal.SIGCONT)
        await asyncio.wait_for(closing, 25)
        assert await acking is None
        async with AsyncClient(node.grpc_target, node.admin_key) as check:
            st = (await check.get_queue("closing-late"))["stats"]
            assert st["ackedTotal"] == 1 and st["leased"] == 1, st  # the refused one was never sent

    asyncio.run(main())


@pytest.mark.parametrize("rpc,settle", [
    ("Ack", lambda c, token: c.ack(token)),
    ("SettleBatch", lambda c, token: c.settle_batch([(token, "ack", 0.0)])),
])
def test_sync_close_lets_an_ack_in_progress_in_another_thread_finish(node, rpc, settle):
    """An ack on the wire in one thread when another calls close() gets its answer
    (close() waits for it); a new one after close() began is refused."""
    c = Client(node.grpc_target, node.admin_key, timeout_s=20)
    c.put_queue("closing-sync", leaseTimeoutSeconds=30)
    c.send("closing-sync", b"x")
    c.send("closing-sync", b"y")
    [m] = c.receive("closing-sync")
    real, on_wire, outcome = getattr(c.stub, rpc), threading.Event(), []

    def sent_then_answered(req, **kw):
        fut = real.future(req, **kw)
        on_wire.set()
        return fut.result()
    setattr(c.stub, rpc, sent_then_answered)

    def acker():
        try:
            outcome.append(settle(c, m.token))
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome.append(e)

    os.kill(node.pid, signal.SIGSTOP)  # no answer until SIGCONT: the ack stays on the wire
    try:
        a = threading.Thread(target=acker)
        a.start()
        assert on_wire.wait(10)
        closer = threading.Thread(target=c.close)
        closer.start()
        wait_until(lambda: c._closed, 10, what="close() began")
        closer.join(1.0)
        assert closer.is_alive(), "close() returned while an ack was still on the wire"
        with pytest.raises(RuntimeError, match="the client is closed"):
            settle(c, "A" * 40)
    finally:
        os.kill(node.pid, signal.SIGCONT)
    closer.join(25)
    a.join(25)
    assert not closer.is_alive() and not a.is_alive()
    assert outcome in ([None], [[None]]), outcome  # answered, no error
    with Client(node.grpc_target, node.admin_key) as check:
        st = check.get_queue("closing-sync")["stats"]
        assert st["ackedTotal"] == 1 and st["leased"] == 0 and st["visible"] == 1, st


def test_calls_after_close_say_the_client_is_closed(node):
    async def main():
        c = AsyncClient(node.grpc_target, node.admin_key)
        await c.put_queue("after")
        await c.close()
        for call in (c.get_queue("after"), c.receive("after"), c.ack("A" * 40), c.send("after", b"x")):
            with pytest.raises(RuntimeError, match="the client is closed"):
                await call
    asyncio.run(main())
    c = Client(node.grpc_target, node.admin_key)
    c.close()
    for call in (lambda: c.get_queue("after"), lambda: c.receive("after"), lambda: c.ack("A" * 40),
                 lambda: c.send("after", b"x")):
        with pytest.raises(RuntimeError, match="the client is closed"):
            call()


def test_sync_close_sends_a_backlog_it_holds(node):
    """Sends handed to the sync client before close() all go out, however many
    batches they take (a flush must not meet a closed client halfway)."""
    c = Client(node.grpc_target, node.admin_key, batches_in_flight_max=1, batch_max=10)
    c.put_queue("backlog")
    futs = [c.send_async(api_pb2.SendRequest(queue="backlog", body=b"%d" % i)) for i in range(300)]
    c.close()
    ids = {f.result(timeout=10).id for f in futs}
    assert len(ids) == 300
    with Client(node.grpc_target, node.admin_key) as check:
        assert check.get_queue("backlog")["stats"]["visible"] == 300


def test_async_close_does_not_wait_for_a_consumer_that_acked_and_polls_on(node):
    """close() waits for acks in progress, not for the tasks that made them: a
    consume worker that acked and went back to a long poll does not hold it."""
    async def main():
        c = AsyncClient(node.grpc_target, node.admin_key, timeout_s=30)
        await c.put_queue("poll-on")
        await c.send("poll-on", b"x")
        acked = asyncio.Event()

        async def handler(m):
            acked.set()

        task = asyncio.ensure_future(c.consume("poll-on", handler, wait_s=20))
        await asyncio.wait_for(acked.wait(), 10)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(c.close(), 10)
        assert loop.time() - t0 < 5
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_sync_send_racing_close_is_refused_whole_or_sent_whole(monkeypatch):
    """A send that begins as close() runs is either handed over (and then sent by
    close) or refused as "the client is closed", leaving nothing behind: never a
    pool error for a send that may still go out, never a send left waiting. The
    send's own first step is slowed down so close() runs in the middle of it."""
    import spooler.client as sync_client
    entered = threading.Event()
    clients: list = []

    class SlowFuture(Future):
        def __init__(self):
            super().__init__()
            if threading.current_thread().name == "racing-send":
                entered.set()
                # close() runs meanwhile: this step goes on once it has begun
                wait_until(lambda: clients[0]._closed, 10, interval_s=0.005, what="close() to begin")

    monkeypatch.setattr(sync_client, "Future", SlowFuture)
    c = Client(DEAD, "k")
    clients.append(c)
    out = {}

    def send():
        try:
            out["r"] = c.send("q", b"x")
        except Exception as e:  # noqa: BLE001 - what it raised is the point
            out["r"] = e

    t = threading.Thread(target=send, name="racing-send")
    t.start()
    assert entered.wait(10)  # the send is in its slowed first step
    c.close()
    t.join(10)
    assert not t.is_alive()
    assert isinstance(out["r"], RuntimeError) and "closed" in str(out["r"]), out
    assert c._pending == [] and c._in_flight == 0


def test_consume_cancelled_as_its_receive_is_answered_gives_the_message_back(node):
    """A consume cancelled in the very turn its receive's answer came (asyncio.wait_for
    running out, say) never handles that message; it gives the lease back, so the
    message is visible again at once with its retry count as it was."""
    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("cq", leaseTimeoutSeconds=60)
            await c.send("cq", b"job")
            real = c._receive

            async def answered_then_cancelled(*a, **kw):
                msgs = await real(*a, **kw)
                task.cancel()  # consume is cancelled as the answer comes in
                return msgs
            c._receive = answered_then_cancelled
            handled = []

            async def handler(m):
                handled.append(m.id)
            task = asyncio.ensure_future(c.consume("cq", handler, wait_s=1))
            with pytest.raises(asyncio.CancelledError):
                await task
            c._receive = real
            assert handled == []
            again = await c.receive("cq", wait_s=5)  # not after the 60 s lease: given back
            assert [(m.body, m.retry_count) for m in again] == [(b"job", 0)]
    asyncio.run(asyncio.wait_for(main(), 30))


def test_sync_failure_is_charged_to_the_node_the_call_went_to(node):
    """Two threads over a node change: thread A's call is paused after it began (the
    pause sits where the client checks that it is open), thread B's failure moves
    the client from the dead node to the live one, then A goes on. A's call and the
    failure it may meet belong to one node, read together: the client is not moved
    back to the dead node by a call that was made on the live one's stub or the
    other way round."""
    go_on, paused = threading.Event(), threading.Event()

    class Pausing(Client):
        @property
        def _shut(self):
            if threading.current_thread().name == "A" and not paused.is_set():
                paused.set()
                go_on.wait(10)
            return self.__dict__.get("_shut_v", False)

        @_shut.setter
        def _shut(self, v):
            self.__dict__["_shut_v"] = v

    c = Pausing(f"{DEAD},{node.grpc_target}", node.admin_key, retry_attempts=1, timeout_s=5)
    try:
        assert c.target_now() == DEAD
        out = {}

        def a():
            try:
                out["A"] = c.get_queue("q")
            except errors.SpoolerError as e:  # (queue_not_found from the live node: no move)
                out["A"] = e
        ta = threading.Thread(target=a, name="A")
        ta.start()
        assert paused.wait(10)  # A's call has begun
        with pytest.raises(errors.Unavailable):
            c.get_queue("q")  # B: fails on DEAD, moves the client to the live node
        assert c.target_now() == node.grpc_target
        go_on.set()
        ta.join(10)
        assert not ta.is_alive()
        assert c.target_now() == node.grpc_target, out  # A did not move it back to the dead node
    finally:
        go_on.set()
        c.close()


async def _node_holds_polls(node, n: int) -> None:
    """Until ``n`` long polls wait on the node (its metric), with a deadline."""
    deadline = time.monotonic() + 20
    while (waiting := await asyncio.to_thread(node.metric, "spooler_receives_waiting")) < n:
        assert time.monotonic() < deadline, f"{waiting} long polls wait on the node, not {n}"
        await asyncio.sleep(0.05)


async def _polls_waiting(c, node, queue: str, n: int, on_node: int) -> list:
    """Start ``n`` long polls of ``queue`` on client ``c``; returns their tasks once
    ``on_node`` of them wait on the node."""
    polls = [asyncio.ensure_future(c.receive(queue, wait_s=20)) for _ in range(n)]
    await _node_holds_polls(node, on_node)
    return polls


def test_more_long_polls_than_a_session_stream_holds_do_not_hold_up_sends(node):
    """A node reads at most 1,024 requests of one Session stream at once. 1,100 long
    polls on one AsyncClient: those past the SDK's share of the stream go as unary
    calls, so a send (and the ack after it) still goes through at once, not when the
    polls time out; and one of the polls gets the message."""
    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("many-polls")
            # every poll waits on the node (of one stream it would read only 1,024)
            polls = await _polls_waiting(c, node, "many-polls", 1100, 1100)
            await asyncio.wait_for(c.send("many-polls", b"through"), 10)
            done, _ = await asyncio.wait(polls, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            got = [m for t in done for m in t.result()]
            assert [m.body for m in got] == [b"through"], got
            await asyncio.wait_for(c.ack(got[0].token), 10)
            for t in polls:
                t.cancel()
            await asyncio.wait(polls)
            assert (await c.get_queue("many-polls"))["stats"]["ackedTotal"] == 1
    asyncio.run(asyncio.wait_for(main(), 90))


def test_long_polls_past_the_session_share_and_the_unary_share_wait_their_turn(node, monkeypatch):
    """With 2 long polls allowed on the stream and 2 as unary calls, 6 polls keep 4
    on the node (the node's call slots are shared by every client); the other two
    wait in the client for a turn, and still get messages once one ends."""
    import spooler.aio as aio
    monkeypatch.setattr(aio, "SESSION_POLLS_MAX", 2)
    monkeypatch.setattr(aio, "UNARY_POLLS_MAX", 2)

    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("turns")
            polls = await _polls_waiting(c, node, "turns", 6, 4)
            await asyncio.sleep(0.5)  # (a fifth would be there by now)
            assert await asyncio.to_thread(node.metric, "spooler_receives_waiting") == 4
            for i in range(6):
                await asyncio.wait_for(c.send("turns", f"m{i}".encode()), 10)
            got = await asyncio.wait_for(asyncio.gather(*polls), 30)
            assert sorted(m.body for ms in got for m in ms) == [f"m{i}".encode() for i in range(6)]
    asyncio.run(asyncio.wait_for(main(), 90))


def test_an_async_client_works_across_event_loops_one_after_the_other(node):
    """gRPC's asyncio channels work only on the loop they were made on. An
    AsyncClient made outside any loop makes them on first use; once the loop it
    was used on has ended (a second ``asyncio.run()``), it makes them afresh on
    the next (AsyncClient._here). A lease taken on one loop is acked on the next;
    a client closed on one loop stays closed on the next."""
    c = AsyncClient(node.grpc_target, node.admin_key)  # no loop runs here

    async def first():
        await c.put_queue("loops")
        await c.send("loops", b"a")
        await c.send_batch("loops", [b"b", b"c"])
        got = await c.receive("loops", max_messages=2)
        # an answer after the receive's on the same stream: the node has finished
        # writing that one (a stream cut while a receive answer is still being
        # written gives its leases back, and this run ends by cutting it)
        await c.send("loops", b"d")
        return got

    got = asyncio.run(first())
    assert [m.body for m in got] == [b"a", b"b"]

    async def second():
        await c.ack(got[0].token)
        [m] = await c.receive("loops")
        assert m.body == b"c"
        assert await c.settle_batch([(got[1].token, "ack"), (m.token, "ack")]) == [None, None]
        st = (await c.get_queue("loops"))["stats"]
        assert (st["ackedTotal"], st["visible"]) == (3, 1)
        await c.close()

    asyncio.run(second())

    async def third():
        with pytest.raises(RuntimeError, match="closed"):
            await c.send("loops", b"d")

    asyncio.run(third())


def test_an_async_client_in_use_on_a_running_loop_is_refused_on_another(node):
    """One client, one loop at a time: used from a second loop while the first
    still runs (another thread), or is stopped but not closed, it says so instead
    of failing inside gRPC."""
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        async def make():
            c = AsyncClient(node.grpc_target, node.admin_key)
            await c.put_queue("elsewhere")
            return c

        c = asyncio.run_coroutine_threadsafe(make(), loop).result(30)

        async def other():
            with pytest.raises(RuntimeError, match="another event loop, which is running"):
                await c.send("elsewhere", b"x")
            with pytest.raises(RuntimeError, match="another event loop, which is running"):
                await c.close()

        asyncio.run(other())
        # stopped but not closed: tasks of the client's own may still be waiting there
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        with pytest.raises(RuntimeError, match="another event loop, which is not closed"):
            asyncio.run(other_again(c))
        asyncio.run(c.close())  # closing it from here is allowed: it is then closed everywhere
        with pytest.raises(RuntimeError, match="closed"):
            loop.run_until_complete(other_again(c))
    finally:
        if t.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            t.join(10)
        loop.close()


async def other_again(c):
    await c.send("elsewhere", b"x")


def test_an_auto_batched_send_cancelled_before_its_batch_leaves_is_never_stored(node):
    """A caller that gives up on a send (cancelled, or ``asyncio.wait_for`` timed
    out) while the send still waits in the client for a batch hears CancelledError,
    and its message is not stored: before 0.4.38 it went out with the next batch all
    the same, and a caller that sent it again made a duplicate. One in a batch
    already on its way may still be stored (DESIGN.md, "What the SDK retries, and where")."""
    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key, batch_max=10, batches_in_flight_max=1) as c:
            await c.put_queue("cx")
            tasks = [asyncio.ensure_future(c.send("cx", b"%d" % i)) for i in range(200)]
            await asyncio.sleep(0)  # every send is queued; the first batch of 10 is on its way
            for t in tasks[100:]:
                t.cancel()
            rs = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(not isinstance(r, BaseException) for r in rs[:100]), rs[:100]
            assert all(isinstance(r, asyncio.CancelledError) for r in rs[100:])
            return (await c.get_queue("cx"))["stats"]
    stats = asyncio.run(main())
    assert stats["sentTotal"] == 100, stats
    # the sync client: a future cancelled while its send waits for a batch
    with Client(node.grpc_target, node.admin_key, batch_max=10, batches_in_flight_max=1) as c:
        c.put_queue("cx-sync")
        futs = [c.send_async(api_pb2.SendRequest(queue="cx-sync", body=b"%d" % i)) for i in range(200)]
        assert all(f.cancel() for f in futs[100:])
        assert all(f.result(30).id for f in futs[:100])
        assert c.get_queue("cx-sync")["stats"]["sentTotal"] == 100


def test_async_consume_takes_a_plain_function_and_stops_after_max_messages(node):
    """A plain (not async) handler is run and its message acked, not nacked for a
    TypeError after its work was done (before 0.4.38 it went round to the failure
    queue); and ``max_messages`` bounds what consume handles, with several
    workers too, as the sync client's does; it returns the number handled."""
    async def main():
        async with AsyncClient(node.grpc_target, node.admin_key) as c:
            await c.put_queue("plain", maxRetries=1, leaseTimeoutSeconds=30)
            await c.send_batch("plain", [b"%d" % i for i in range(10)])
            seen = []
            n = await asyncio.wait_for(c.consume("plain", lambda m: seen.append(m.retry_count), wait_s=1,
                                                 concurrency=3, max_messages=4), 30)
            assert n == 4 and seen == [0, 0, 0, 0], (n, seen)
            q = (await c.get_queue("plain"))["stats"]
            assert q["ackedTotal"] == 4 and q["visible"] == 6, q

            async def slow(m):
                await asyncio.sleep(0.05)
            n = await asyncio.wait_for(c.consume("plain", slow, wait_s=0.2, concurrency=4, max_messages=5), 30)
            assert n == 5, n
            q = (await c.get_queue("plain"))["stats"]
            assert q["ackedTotal"] == 9 and q["visible"] == 1 and q["leased"] == 0, q
    asyncio.run(main())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_refusal_for_the_primarys_room_is_retried_after_its_retry_after(tmp_path, kind):
    """A node full (``--max-messages``) answers ``unavailable``/``node_full`` with
    Retry-After 1 s: the SDK stays on that node and waits at least that long
    before each retry (before 0.4.38 it retried after 0.1 and 0.2 s, against what
    the node asked). An ``unavailable`` of another reason keeps the short schedule
    (unit: test_sdk_errors.py)."""
    from nodeproc import NodeProc
    n = NodeProc(str(tmp_path / "full"), extra_args=["--max-messages", "1"]).start()
    try:
        if kind == "sync":
            with Client(n.grpc_target, n.admin_key, retry_attempts=3) as c:
                c.put_queue("f")
                c.send("f", b"1")
                t = time.monotonic()
                with pytest.raises(errors.Unavailable) as e:
                    c.send("f", b"2")
                took = time.monotonic() - t
        else:
            async def main():
                async with AsyncClient(n.grpc_target, n.admin_key, retry_attempts=3) as c:
                    await c.put_queue("f")
                    await c.send("f", b"1")
                    t = time.monotonic()
                    with pytest.raises(errors.Unavailable) as e:
                        await c.send("f", b"2")
                    return e, time.monotonic() - t
            e, took = asyncio.run(main())
        assert e.value.reason == errors.NODE_FULL and e.value.retry_after_s == 1.0, e.value
        assert took >= 2.0, took  # two waits of at least 1 s (the schedule alone: under 0.5 s)
    finally:
        n.kill()
