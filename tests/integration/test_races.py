"""Races and back-pressure at the edges of the service (in-process engine)."""
import asyncio

import pytest

from node.api.service import Principal, Service
from node.engine import Engine, Limits
from spooler import errors
from nodeproc import until
from spooler.http import HttpClient

ADMIN = Principal(admin=True)


def run(coro_fn, tmp_path, **limits):
    async def main():
        eng = Engine(str(tmp_path / "n"), limits=Limits(**limits) if limits else None)
        await eng.start()
        try:
            return await coro_fn(eng, Service(eng, ["k"]))
        finally:
            await eng.stop()
    return asyncio.run(main())


def test_ack_that_loses_a_race_with_redrive_is_not_a_204(tmp_path):
    async def body(eng, svc):
        await svc.put_queue(ADMIN, "q", {"maxRetries": 0})
        await svc.send(ADMIN, [("q", b"m", 0.0, "")])
        [d] = await svc.receive(ADMIN, "q", 0)
        await svc.nack(ADMIN, d.token)  # -> q.failed
        [f] = await svc.receive(ADMIN, "q.failed", 0)
        # the redrive is committed first in the same group commit: the ack finds nothing
        moved, ack = await asyncio.gather(svc.redrive(ADMIN, "q"), svc.ack(ADMIN, f.token), return_exceptions=True)
        assert moved == 1
        assert isinstance(ack, errors.StaleLease) and ack.reason == "settled"
        [again] = await svc.receive(ADMIN, "q", 0)  # the message is back, as the 409 says
        assert again.id == d.id
    run(body, tmp_path)


def test_ack_that_loses_a_race_with_its_queues_delete_is_queue_not_found(tmp_path):
    """The delete is committed first in the same group commit: the ack, fenced
    before it, finds the queue gone and says so, as an ack after the delete does
    (not stale_lease)."""
    async def body(eng, svc):
        await svc.put_queue(ADMIN, "q", {})
        await svc.send(ADMIN, [("q", b"m", 0.0, "")])
        [d] = await svc.receive(ADMIN, "q", 0)
        deleted, ack = await asyncio.gather(svc.delete_queue(ADMIN, "q"), svc.ack(ADMIN, d.token),
                                            return_exceptions=True)
        assert deleted is None or deleted is True, deleted
        assert isinstance(ack, errors.QueueNotFound), ack
        later = await asyncio.gather(svc.ack(ADMIN, d.token), return_exceptions=True)
        assert isinstance(later[0], errors.QueueNotFound), later
    run(body, tmp_path)


def test_settle_refused_for_back_pressure_leaves_the_lease_usable(tmp_path):
    async def body(eng, svc):
        await svc.put_queue(ADMIN, "q", {})
        await svc.send(ADMIN, [("q", b"m", 0.0, "")])
        [d] = await svc.receive(ADMIN, "q", 0)
        eng.limits.pending_records_max = 0
        with pytest.raises(errors.Unavailable):
            await svc.ack(ADMIN, d.token)
        eng.limits.pending_records_max = 100
        await svc.ack(ADMIN, d.token)  # still ours: the 503 was "not accepted"
        assert eng.core.stats("q", eng.now_us())["ackedTotal"] == 1
    run(body, tmp_path)


def test_lease_expiry_and_retention_do_not_stop_under_back_pressure(tmp_path):
    async def body(eng, svc):
        await svc.put_queue(ADMIN, "q", {"leaseTimeoutSeconds": 0.1, "retentionSeconds": 0.5})
        await svc.send(ADMIN, [("q", b"a", 0.0, "")])
        await svc.send(ADMIN, [("q", b"b", 0.0, "")])
        await svc.receive(ADMIN, "q", 0, 1)
        eng.limits.pending_records_max = 0  # clients are refused; the node's own records are not
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while loop.time() < deadline:
            st = eng.core.stats("q", eng.now_us())
            if st["leaseExpiredTotal"] == 1 and st["expiredTotal"] == 2:
                break
            await asyncio.sleep(0.05)
        st = eng.core.stats("q", eng.now_us())
        assert (st["leaseExpiredTotal"], st["expiredTotal"], st["leased"]) == (1, 2, 0)
    run(body, tmp_path)


def test_batch_entry_whose_queue_vanished_fails_alone(tmp_path):
    async def body(eng, svc):
        await svc.put_queue(ADMIN, "a", {})
        await svc.put_queue(ADMIN, "b", {})
        deleted, res = await asyncio.gather(svc.delete_queue(ADMIN, "b"),
                                            svc.send(ADMIN, [("a", b"1", 0.0, ""), ("b", b"2", 0.0, "")]))
        (ida, _, erra), (_, _, errb) = res
        assert erra is None and ida
        assert isinstance(errb, errors.QueueNotFound)
        assert eng.core.stats("a", eng.now_us())["sentTotal"] == 1
    run(body, tmp_path)


def test_queue_admin_cannot_reach_another_queue_through_failure_queue(node):
    admin = HttpClient(node.http_url, node.admin_key)
    admin.put_queue("victim")
    admin.send("victim", b"secret")
    admin.put_queue("attacker")
    k = admin.create_key("attacker", ["admin", "receive"])["key"]
    atk = HttpClient(node.http_url, k)
    with pytest.raises(errors.Forbidden):
        atk.put_queue("attacker", failureQueue="victim")
    admin.put_queue("attacker", failureQueue="victim")  # set by the real admin
    with pytest.raises(errors.Forbidden):
        atk.redrive("attacker")  # would empty victim into attacker
    assert admin.get_queue("victim")["stats"]["visible"] == 1


def test_sync_client_survives_a_cancelled_send(node):
    from spooler import Client
    from spooler.pb import api_pb2
    with Client(node.grpc_target, node.admin_key, batches_in_flight_max=1) as c:
        c.put_queue("cx")
        futs = [c.send_async(api_pb2.SendRequest(queue="cx", body=f"{i}".encode())) for i in range(20)]
        futs[5].cancel()
        done = [f.result(timeout=10) for i, f in enumerate(futs) if i != 5 and not f.cancelled()]
        assert len(done) >= 19
        assert c.send("cx", b"after").id  # the client is not wedged


def test_calls_waiting_for_a_primary_taking_over_are_bounded_in_number_and_bytes(tmp_path):
    """Those waits are bounded like long polls: they count against
    receives_waiting_max (past it, 503 at once), and a waiting send's bodies
    count against the bytes of sends the node holds (sending_bytes_max), as a
    forwarded send's do. Found by a review: uncounted, they were neither."""
    async def body(eng, svc):
        await svc.put_queue(ADMIN, "q", {})
        eng.ready = False
        svc.lease_hold_max_s = lambda: 5.0
        first = asyncio.ensure_future(svc.send(ADMIN, [("q", b"x" * 1000, 0.0, "")]))
        await asyncio.sleep(0.1)
        assert not first.done() and eng.receives_waiting == 1 and svc.sending_bytes == 1000
        for call in (lambda: svc.send(ADMIN, [("q", b"y", 0.0, "")]), lambda: svc.receive(ADMIN, "q", 0.0)):
            with pytest.raises(errors.Unavailable) as e:
                await asyncio.wait_for(call(), 1)  # refused at once, not held
            assert e.value.reason == errors.OVERLOADED, e.value
        eng.ready = True
        eng.readiness_changed()
        [(mid, _, error)] = await asyncio.wait_for(first, 5)
        assert mid and error is None
        assert eng.receives_waiting == 0 and svc.sending_bytes == 0
    run(body, tmp_path, receives_waiting_max=1)


def test_retention_drops_each_message_within_a_tenth_of_a_second_or_so_of_its_end(tmp_path):
    """S7: a message past its retention is counted in expiredTotal (and leaves
    `visible`) within the retention timer's tick, 0.1 s, plus a commit. Five
    queues whose messages' retention ends 0.2 s apart, over a second: with the
    tick of 1 s before 0.4.37, at least one of them was dropped 0.8 s or more
    after its end (the stats kept counting it as visible meanwhile)."""
    async def body(eng, svc):
        ends, seen = {}, {}
        for i in range(5):
            await svc.put_queue(ADMIN, f"r{i}", {"retentionSeconds": 0.3 + 0.2 * i})
        loop = asyncio.get_running_loop()
        for i in range(5):
            ends[f"r{i}"] = loop.time() + 0.3 + 0.2 * i  # (from before the send: no later than its end)
            await svc.send(ADMIN, [(f"r{i}", b"m", 0.0, "")])
        deadline = loop.time() + 10
        while len(seen) < 5 and loop.time() < deadline:
            for q in ends:
                if q not in seen and eng.core.stats(q, eng.now_us())["expiredTotal"] == 1:
                    seen[q] = loop.time()
            await asyncio.sleep(0.01)
        assert len(seen) == 5, seen
        lags = {q: round(seen[q] - ends[q], 3) for q in ends}
        assert max(lags.values()) < 0.6, lags
        for q in ends:
            st = eng.core.stats(q, eng.now_us())
            assert (st["visible"], st["expiredTotal"]) == (0, 1), (q, st)
    run(body, tmp_path)


def test_many_queues_expiring_at_once_make_one_drop_record_each_a_second_not_ten(tmp_path):
    """The retention timer ticks every 0.1 s, but while more than 100 queues
    have drops due at a tick it ticks every second: 150 queues whose 20
    messages each expire one after another over two seconds (a trickle nobody
    consumes) make about one Drop record per queue a second. At 0.1 s ticks
    they made one per message, 3,000, ten times as many records to replicate
    and commit (found by a review)."""
    async def body(eng, svc):
        queues = [f"t{i}" for i in range(150)]
        for q in queues:
            await svc.put_queue(ADMIN, q, {"retentionSeconds": 0.3})
        drops = []
        propose = eng.propose

        def counting(rec, *a, **kw):
            if rec.HasField("drop"):
                drops.append(len(rec.drop.ids))
            return propose(rec, *a, **kw)
        eng.propose = counting
        for k in range(20):  # retention counts from visibility: each message's ends 0.1 s after the last's
            await svc.send(ADMIN, [(q, b"m", 0.1 * k, "") for q in queues])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20

        def expired():  # applied, not only proposed: a Drop counts once it commits
            return sum(eng.core.stats(q, eng.now_us())["expiredTotal"] for q in queues)
        while loop.time() < deadline and expired() < 3000:
            await asyncio.sleep(0.05)
        assert expired() == 3000 and sum(drops) == 3000, (expired(), sum(drops))
        assert len(drops) < 1000, len(drops)
    run(body, tmp_path)


@pytest.mark.parametrize("how", ["lost_after_taken", "refused_at_once"])
@pytest.mark.parametrize("shape", ["one_message", "batch_in_a_segment"])
def test_drop_taken_but_never_committed_is_proposed_again(tmp_path, how, shape):
    """Retention: a Drop that the commit loop took but that did not commit (as when the
    node steps down first), or that was refused as it was proposed (the node not
    serving), must not leave its messages undropped for good: a message of its own
    goes back to the retention heap, and the messages of a batch held as a segment
    put their segment back in the segments' heap."""
    async def body(eng, svc):
        await svc.put_queue(ADMIN, "q", {"retentionSeconds": 0.2})
        if shape == "one_message":
            await svc.send(ADMIN, [("q", b"a", 0.0, "")])
            n = 1
        else:
            await svc.send(ADMIN, [], ("q", [b"a", b"b", b"c"], 0.0))
            n = 3
        real, failed = eng.propose, []

        def propose(rec, internal=False):
            if rec.WhichOneof("op") == "drop" and not failed:
                failed.append(rec)
                if how == "refused_at_once":
                    raise errors.Unavailable("node is not serving")
                fut = asyncio.get_running_loop().create_future()  # accepted, then lost: its future
                fut.set_exception(errors.Unavailable("no longer the primary"))  # fails as on a step-down
                return fut
            return real(rec, internal)
        eng.propose = propose
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 6
        while loop.time() < deadline and eng.core.stats("q", eng.now_us())["expiredTotal"] < n:
            await asyncio.sleep(0.05)
        assert failed, "the first Drop was never proposed"
        assert len(failed[0].drop.ids) == n, failed[0]
        assert eng.core.stats("q", eng.now_us())["expiredTotal"] == n
    run(body, tmp_path)


def test_a_primary_that_has_not_opened_its_epoch_answers_not_now_instead_of_from_a_stale_state(tmp_path):
    """A new primary applies what its predecessor committed only once its own first
    record commits. Until then its state may lack a queue or a key that exists:
    reads and unknown keys are `unavailable` (retry), not `queue_not_found` or
    `unauthenticated`."""
    async def body(eng, svc):
        await svc.put_queue(ADMIN, "q", {})
        key = await svc.create_key(ADMIN, "q", ["send"])
        eng.ready = False  # as between the election and the first record's commit
        svc.lease_hold_max_s = lambda: 0.2  # (sends and receives wait this long for it: below)
        for call in (lambda: svc.get_queue(ADMIN, "q"), lambda: svc.get_queue(ADMIN, "missing"),
                     lambda: svc.list_queues(ADMIN), lambda: svc.list_keys(ADMIN),
                     lambda: svc.send(ADMIN, [("missing", b"x", 0.0, "")]),
                     lambda: svc.send(ADMIN, [], ("missing", [b"x"], 0.0)),
                     lambda: svc.receive(ADMIN, "missing", 0.0)):
            with pytest.raises(errors.Unavailable):
                await call()
        with pytest.raises(errors.Unavailable):
            svc.authenticate("Bearer spk_unknown_secret")
        assert svc.authenticate(f"Bearer {key['key']}").queue == "q"  # a key it holds is fine
        eng.ready = True
        assert (await svc.get_queue(ADMIN, "q"))["name"] == "q"
        with pytest.raises(errors.Unauthenticated):
            svc.authenticate("Bearer spk_unknown_secret")
    run(body, tmp_path)


def test_a_send_or_receive_asked_of_a_primary_taking_over_waits_for_its_epoch_to_open(tmp_path):
    """Between its election and its first record's commit a new primary does not
    serve (above). A send or a receive asked then waits for that commit, up to
    lease_hold_max_s, and is answered once it is in; one still not served by
    then is refused 503 (above). Without the wait a client that asked the node
    its cluster document names primary at once got 503 (the failover test
    test_a_dead_primarys_leased_message_is_handed_out_by_the_first_receive_after_it
    saw it in two runs of three)."""
    async def body(eng, svc):
        await svc.put_queue(ADMIN, "q", {})
        await svc.send(ADMIN, [("q", b"before", 0.0, "")])
        eng.ready = False
        svc.lease_hold_max_s = lambda: 5.0
        send = asyncio.ensure_future(svc.send(ADMIN, [("q", b"during", 0.0, "")]))
        receive = asyncio.ensure_future(svc.receive(ADMIN, "q", 0.0))
        await asyncio.sleep(0.2)
        assert not send.done() and not receive.done(), (send, receive)  # waiting, not refused
        eng.ready = True
        eng.readiness_changed()  # (as Engine._opened_epoch)
        [(mid, duplicate, error)] = await asyncio.wait_for(send, 5)
        assert mid and not duplicate and error is None
        [d] = await asyncio.wait_for(receive, 5)
        assert d.body == b"before"
        assert eng.core.stats("q", eng.now_us())["sentTotal"] == 2
    run(body, tmp_path)


def _hold_commits(eng):
    """Every commit from here on runs on the store's thread and waits there until
    ``go`` is set; ``fail`` makes it raise (a write or fsync error) instead."""
    import threading
    go, fail = threading.Event(), threading.Event()
    append = eng.store.append

    def held(rows):
        if not go.wait(10):
            raise RuntimeError("commit held for too long")
        if fail.is_set():
            raise OSError("injected write error")
        return append(rows)
    eng.store.append = held
    eng.small_commit = lambda rows: False  # never inline: the loop must run on meanwhile
    return go, fail


@pytest.mark.parametrize("first_commits", [True, False])
def test_a_second_settle_of_a_lease_waits_for_the_first_ones_commit(tmp_path, first_commits):
    """An ack tried again (say, after its first attempt's answer was lost) while the
    first attempt is still being committed must not be told ``settled`` before that
    commit is known: an SDK reads ``settled`` after an unknown attempt as "our ack
    landed". If the commit then fails, the message is not acked, and the second
    attempt must say its outcome is unknown, never ``settled``."""
    async def body(eng, svc):
        eng.on_fatal = lambda e: None  # (a failed commit stops a real node; here it is watched)
        await svc.put_queue(ADMIN, "q", {})
        await svc.send(ADMIN, [("q", b"m", 0.0, "")])
        [d] = await svc.receive(ADMIN, "q", 0)
        go, fail = _hold_commits(eng)
        try:
            first = asyncio.ensure_future(svc.ack(ADMIN, d.token))
            await until(lambda: eng._io_jobs > 0)  # the first ack's commit is on the store's thread, held
            second = asyncio.ensure_future(svc.ack(ADMIN, d.token))
            renew = asyncio.ensure_future(svc.renew(ADMIN, d.token))
            for _ in range(20):
                await asyncio.sleep(0.005)
            early = [t.done() for t in (second, renew)]
            if not first_commits:
                fail.set()
        finally:
            go.set()
        results = await asyncio.gather(first, second, renew, return_exceptions=True)
        assert early == [False, False], ("answered before the first ack's commit was known", results)
        if first_commits:
            assert results[0] is None
            for r in results[1:]:
                assert isinstance(r, errors.StaleLease) and r.reason == "settled", r
        else:
            assert isinstance(results[0], errors.OperationUnconfirmed), results
            for r in results[1:]:
                assert not isinstance(r, errors.StaleLease), r  # never "settled": nothing was
                assert isinstance(r, (errors.OperationUnconfirmed, errors.Unavailable)), r
    run(body, tmp_path)


def test_a_second_settle_waits_for_the_commit_of_a_first_whose_caller_went_away(tmp_path):
    """The first ack's caller goes away while its commit runs (gRPC cancels the
    handler at the caller's deadline, which is when an SDK tries the ack again):
    the commit goes on and lands. The second attempt must wait for it and say
    ``settled``; cancelling the first caller's wait must not cancel the commit's
    handle the second one waits on (it then answered operation_unconfirmed at
    once, for an ack that was landing)."""
    async def body(eng, svc):
        await svc.put_queue(ADMIN, "q", {})
        await svc.send(ADMIN, [("q", b"m", 0.0, "")])
        [d] = await svc.receive(ADMIN, "q", 0)
        go, _ = _hold_commits(eng)
        try:
            first = asyncio.ensure_future(svc.ack(ADMIN, d.token))
            await until(lambda: eng._io_jobs > 0)  # the first ack's commit is on the store's thread, held
            first.cancel()  # its caller's deadline
            await asyncio.gather(first, return_exceptions=True)
            second = asyncio.ensure_future(svc.ack(ADMIN, d.token))
            for _ in range(20):
                await asyncio.sleep(0.005)
            early = second.done()
        finally:
            go.set()
        [r] = await asyncio.gather(second, return_exceptions=True)
        assert not early, ("answered before the first ack's commit was known", r)
        assert isinstance(r, errors.StaleLease) and r.reason == "settled", r
        assert (await svc.get_queue(ADMIN, "q"))["stats"]["visible"] == 0  # the ack landed
    run(body, tmp_path)


def test_a_primary_whose_leasing_window_has_closed_renews_no_lease_but_still_settles(tmp_path):
    """A renewal is lease time granted without a log record, so it passes the
    gate a receive passes: with the window in which this primary may lease
    closed (its majority's contact older than ``lease_us``; here ``lease_us`` is
    0, while the failover timeout still has it serving), a renew, alone or in a
    settle batch, is 503 ``unavailable`` and changes nothing, as a receive is
    (the third message is visible), and an ack (a write through the quorum) still commits. Once the
    window is open again the same lease renews. Without the gate in
    ``Service._renewed`` both renewals returned a new expiry."""
    async def body(eng, svc):
        await svc.put_queue(ADMIN, "q", {"leaseTimeoutSeconds": 60})
        await svc.send(ADMIN, [("q", b"a", 0.0, ""), ("q", b"b", 0.0, ""), ("q", b"c", 0.0, "")])
        a, b = await svc.receive(ADMIN, "q", 0, 2)
        core = eng.repl.core
        lease_us, core.lease_us = core.lease_us, 0
        assert eng.serving() and not eng.may_lease()
        ends = {lease.msg_id: lease.expires_at for lease in eng.core.leases.values()}
        assert set(ends) == {a.id, b.id}
        with pytest.raises(errors.Unavailable):
            await svc.renew(ADMIN, a.token)
        [refused] = await svc.settle(ADMIN, [(a.token, "renew", 0.0)], per_item_errors=True)
        assert isinstance(refused, errors.Unavailable), refused
        assert {lease.msg_id: lease.expires_at for lease in eng.core.leases.values()} == ends
        with pytest.raises(errors.Unavailable):
            await svc.receive(ADMIN, "q", 0)
        await svc.ack(ADMIN, b.token)  # still serving: writes commit
        core.lease_us = lease_us
        assert eng.may_lease()
        assert (await svc.renew(ADMIN, a.token)).left_s > 59
    run(body, tmp_path)
