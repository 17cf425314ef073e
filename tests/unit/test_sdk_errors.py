"""The SDK's error table and retry rules at their edges (no node needed)."""
import asyncio
import time

import grpc
import pytest

from grpc_fakes import FakeRpcError, answered_by
from spooler import errors
from spooler._common import (DedupWindow, call_with_retries, call_with_retries_sync, map_rpc_error, retryable,
                             send_outcomes, settle_outcomes, settle_request)
from spooler.pb import api_pb2


def test_a_read_whose_connection_broke_after_it_left_is_an_answer_lost():
    """The same event on every path of both clients: a receive that may have leased
    something is not silently tried again on another node (its caller hears of it)."""
    broke = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)")
    read = map_rpc_error(broke, write=False)
    assert isinstance(read, errors.Unavailable) and getattr(read, "answer_lost", False)
    assert not retryable(read, receive=True) and retryable(read)  # other reads: still retried
    assert isinstance(map_rpc_error(broke, write=True), errors.OperationUnconfirmed)
    never = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: refused")
    for write in (False, True):
        e = map_rpc_error(never, write=write)
        assert isinstance(e, errors.Unavailable) and not getattr(e, "answer_lost", False), write


def test_an_answer_with_another_number_of_outcomes_is_unconfirmed():
    r = api_pb2.SendBatchResponse(run_id_prefix="p", run_id_first=1, run_count=2)
    assert [x.id for x in send_outcomes(r, 2)] == ["p00000001", "p00000002"]
    with pytest.raises(errors.OperationUnconfirmed):
        send_outcomes(r, 3)


def test_an_answer_counting_a_huge_run_is_unconfirmed_before_its_ids_are_made():
    """A run's count is checked before its ids are made: a faulty answer naming
    4 billion of them made the SDK try to build that many ids (memory, and a caller
    waiting for ever). send_batch's answer is checked against its bodies too."""
    from spooler._common import batch_results

    r = api_pb2.SendBatchResponse(run_id_prefix="p", run_id_first=1, run_count=2 ** 32 - 1)
    t = time.monotonic()
    with pytest.raises(errors.OperationUnconfirmed):
        send_outcomes(r, 2)
    with pytest.raises(errors.OperationUnconfirmed):
        batch_results(r, 2)
    assert time.monotonic() - t < 1


def test_an_answer_that_cannot_be_read_fails_its_callers_instead_of_leaving_them_waiting(monkeypatch):
    """_deliver caught only the SDK's own errors: anything else raised from reading
    an answer ended the flush task and left the batch's callers waiting for ever."""
    from spooler import aio

    def unreadable(r, n=None):
        raise ValueError("no node of ours answers so")

    monkeypatch.setattr(aio, "send_outcomes", unreadable)

    async def main():
        loop = asyncio.get_running_loop()
        batch = [(("q", b"x", 0.0, ""), loop.create_future()) for _ in range(3)]
        aio._deliver(batch, api_pb2.SendBatchResponse())
        return [f.exception() for _, f in batch]
    for e in asyncio.run(main()):
        assert isinstance(e, errors.OperationUnconfirmed) and "could not be read" in str(e), e


def test_a_settle_answer_with_another_number_of_outcomes_is_unconfirmed():
    """Not an IndexError (which would end a consume) nor outcomes matched to the
    wrong items: the settles may have been applied, so operation_unconfirmed."""
    r = api_pb2.SettleBatchResponse()
    r.results.add()
    r.results.add().error.CopyFrom(api_pb2.ErrorDetail(kind="stale_lease", reason="settled"))
    got = settle_outcomes(r, 2)
    assert got[0] is None and isinstance(got[1], errors.StaleLease)
    for n in (0, 1, 3):
        with pytest.raises(errors.OperationUnconfirmed):
            settle_outcomes(r, n)


def test_an_unknown_settle_action_is_invalid_argument():
    for bad in ("bogus", None, ["ack"]):
        with pytest.raises(errors.InvalidArgument):
            settle_request([("t", bad, 0)])


def test_a_retry_stopped_before_it_is_made_raises_the_last_error_not_a_new_one():
    """An ack that may have landed, then the client closes during the wait before its
    retry: the caller hears operation_unconfirmed (it may have landed), not an
    unavailable that would say it was not accepted."""
    def closes_during_the_wait():
        checks = iter([False])  # not yet closed when the first attempt fails; closed after
        return lambda: next(checks, True)

    def attempt():
        raise errors.OperationUnconfirmed("transport failure")

    with pytest.raises(errors.OperationUnconfirmed):
        call_with_retries_sync(attempt, 6, stop_when=closes_during_the_wait(), settle=True)

    async def attempt_async():
        raise errors.OperationUnconfirmed("transport failure")

    with pytest.raises(errors.OperationUnconfirmed):
        asyncio.run(call_with_retries(attempt_async, 6, stop_when=closes_during_the_wait(), settle=True))


def test_a_dedup_window_is_used_up_once_a_resend_could_land_after_it():
    t0 = time.monotonic()
    assert not DedupWindow(t0, 60, 30, maybe_landed=True).used_up()
    assert DedupWindow(t0, 10, 30, maybe_landed=True).used_up()
    w = DedupWindow(t0, 10, 30, maybe_landed=False)
    assert not w.used_up()  # nothing may have landed: a resend is safe whatever the window
    w.noting(errors.Unavailable("no primary"))
    assert not w.used_up()
    w.noting(errors.OperationUnconfirmed("quorum timed out"))
    assert w.used_up()


def test_renewals_go_on_after_errors_that_do_not_say_the_lease_is_lost():
    import logging

    from spooler._common import keep_renewing_after

    class M:
        id = "m1"
        lease_lost = False
    log = logging.getLogger("test")
    for e in (errors.Unavailable("no primary"), errors.OperationUnconfirmed("timed out"),
              errors.Internal("transport: RST_STREAM")):
        assert keep_renewing_after(log, M, e) and not M.lease_lost, e
    for e in (errors.StaleLease("gone", reason="expired"), errors.QueueNotFound("deleted"),
              errors.Forbidden("no scope")):
        M.lease_lost = False
        assert not keep_renewing_after(log, M, e) and M.lease_lost, e   # the handler sees it


def test_an_error_answer_without_a_kind_of_ours_is_read_by_what_the_request_was():
    """A proxy's own 502 or 504, or a bare 500, says nothing of what happened behind
    it: a read may be asked again (unavailable), a write may have landed
    (operation_unconfirmed). Answers that name a kind keep it."""
    import http.server
    import threading

    from spooler.http import HttpClient

    class Proxy(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            n = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(n)
            status = int(self.path.rsplit("/", 1)[-1]) if self.path[-3:].isdigit() else 502
            body = b'{"kind": "stale_lease", "message": "m", "reason": "expired"}' if status == 409 else b"<html/>"
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_DELETE = _answer

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        c = HttpClient(f"http://127.0.0.1:{srv.server_address[1]}", "k", timeout_s=10)
        for status in (500, 502, 504):
            with pytest.raises(errors.Unavailable):
                c.request("GET", f"/v1/queues/q/{status}")
            with pytest.raises(errors.OperationUnconfirmed):
                c.request("POST", f"/v1/queues/q/messages/{status}", b"x")
        with pytest.raises(errors.Unavailable):
            c.request("POST", "/v1/queues/q/messages/503", b"x")
        with pytest.raises(errors.StaleLease) as e:
            c.request("POST", "/v1/ack/409")
        assert e.value.reason == "expired"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(10)


def test_renewing_goes_on_after_an_expiry_it_cannot_read():
    """Half the remaining lease, at least 50 ms; an unreadable expiry (a faulty
    node's empty renew answer) means again in a second, not a dead renewer."""
    from datetime import datetime, timezone

    from spooler._common import renew_delay_s

    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert renew_delay_s("2026-01-01T00:00:30Z", now) == 15.0
    assert renew_delay_s("2025-12-31T23:59:59Z", now) == 0.05
    for bad in (None, "", "soon"):
        assert renew_delay_s(bad, now) == 1.0


def test_renewals_are_timed_by_the_leases_length_on_the_clients_own_clock():
    """A node that says how long the lease lasts (LeaseEnd.left_s) times the renewal
    from the call's start on the monotonic clock: the wall clocks' difference (here
    the expiry lies an hour in the client's past, or a day in its future) is moot."""
    from datetime import datetime, timezone

    from spooler._common import LeaseEnd, renew_delay_s

    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    for at in ("2025-12-31T23:00:00Z", "2026-01-02T00:00:00Z"):
        e = LeaseEnd(at, 30.0, started=100.0)
        assert e == at and e.deadline == 130.0
        assert renew_delay_s(e, now, mono=102.0) == 14.0
        assert renew_delay_s(e, now, mono=131.0) == 0.05
    # a copy in this process keeps the deadline; one pickled (maybe for another host,
    # whose monotonic clock is another) keeps the length only
    import copy
    import pickle
    assert copy.deepcopy(e).deadline == 130.0
    p = pickle.loads(pickle.dumps(e))
    assert (p, p.left_s, p.deadline) == (e, 30.0, None)
    # an older node says nothing of the length: the wall clock it is
    old = LeaseEnd("2026-01-01T00:00:30Z", 0.0, started=100.0)
    assert old.deadline is None and renew_delay_s(old, now, mono=102.0) == 15.0


def test_resource_exhausted_is_too_large_only_when_it_is_about_size():
    """gRPC's RESOURCE_EXHAUSTED covers a message or metadata over its limits (the
    request's fault: message_too_large) and also a node's cap on concurrent calls,
    which refused the call before it ran: unavailable, retried, not a send the
    caller must give up on, nor an unknown outcome for a write."""
    big = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (20000000 vs. 16777216)")
    assert isinstance(map_rpc_error(big, write=True), errors.MessageTooLarge)
    for details in ("Concurrent RPC limit exceeded!", "Resource quota exceeded"):
        busy = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, details)
        for write in (True, False):
            e = map_rpc_error(busy, write=write)
            assert isinstance(e, errors.Unavailable) and not getattr(e, "answer_lost", False), (details, write)
            assert retryable(e)


def test_a_session_stream_refused_before_it_ran_fails_what_was_written_to_it_unavailable():
    """gRPC refuses a call past the node's cap on concurrent calls before any of it
    runs. A unary call so refused was a plain, retried ``unavailable``; a Session
    stream so refused after its requests were written failed its send
    ``operation_unconfirmed`` (never resent without a key) and its receive with its
    answer counted lost, though nothing on it ran. A stream that answered
    something was taken by the node: what it leaves is still of unknown outcome."""
    from spooler.aio import _Session, _Waiter

    class Client:
        def _next_target(self, chan):
            pass

    refused = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!")

    async def broken(answered):
        loop, call = asyncio.get_running_loop(), object()
        s = _Session(Client())
        s.call = call
        s.waiting = {1: _Waiter(loop.create_future(), True, None, "send_batch"),
                     2: _Waiter(loop.create_future(), False, None, "receive")}
        for w in s.waiting.values():
            w.call = call  # written to it
        s._broken(call, refused, answered)
        return [w.fut.exception() for w in s.waiting.values()]

    send, receive = asyncio.run(broken(answered=False))
    assert type(send) is errors.Unavailable and "nothing was done" in str(send), send
    assert type(receive) is errors.Unavailable and not receive.answer_lost, receive
    send, receive = asyncio.run(broken(answered=True))
    assert isinstance(send, errors.OperationUnconfirmed), send
    assert isinstance(receive, errors.Unavailable) and receive.answer_lost, receive


def test_an_ack_retried_after_an_unknown_outcome_reads_stale_lease_by_its_reason():
    """After an attempt whose outcome is unknown: ``settled`` means it landed
    (done); ``primary_changed`` cannot say whether it did, so the unknown outcome
    stands (not a stale_lease that promises a redelivery); ``expired`` stands."""
    from spooler._common import settle_after_unconfirmed
    assert settle_after_unconfirmed(errors.StaleLease("x", reason=errors.StaleLease.SETTLED)) is None
    with pytest.raises(errors.OperationUnconfirmed):
        settle_after_unconfirmed(errors.StaleLease("x", reason=errors.StaleLease.PRIMARY_CHANGED))
    with pytest.raises(errors.StaleLease):
        settle_after_unconfirmed(errors.StaleLease("x", reason=errors.StaleLease.EXPIRED))


def test_a_refused_auto_batch_is_sent_again_in_parts_that_can_succeed():
    """An error about a queue: one batch per queue. One bad entry: in halves,
    split again as they fail. ``unavailable`` for a batch of several
    queues (one of them full): one batch per queue, in order. ``unavailable``
    for one queue, or another error: the batch fails whole."""
    from spooler._common import resend_groups
    full = errors.Unavailable("queue a holds its maximum")
    assert resend_groups(full, ["a", "b", "a", "c"]) == [[0, 2], [1], [3]]
    assert resend_groups(full, ["a", "a"]) is None
    # an error about a queue: by queue, and a batch of that one queue fails whole
    assert resend_groups(errors.QueueNotFound("x"), ["a", "b", "a"]) == [[0, 2], [1]]
    assert resend_groups(errors.QueueNotFound("x"), ["a", "a"]) is None
    assert resend_groups(errors.Forbidden("x"), ["a"] * 100) is None
    # one bad entry among many: halves, each split again as it fails
    assert resend_groups(errors.MessageTooLarge("x"), ["a"] * 5) == [[0, 1, 2], [3, 4]]
    assert resend_groups(errors.InvalidArgument("x"), ["a", "b"]) == [[0], [1]]
    assert resend_groups(errors.OperationUnconfirmed("x"), ["a", "b"]) is None
    assert resend_groups(full, ["a"]) is None


def test_retry_waits_are_spread_but_never_shorter_than_the_schedule():
    from spooler._common import RETRY_FIRST_WAIT_S, retry_wait_s
    waits = [retry_wait_s(1) for _ in range(200)]
    assert min(waits) >= RETRY_FIRST_WAIT_S and max(waits) <= 1.5 * RETRY_FIRST_WAIT_S
    assert len({round(w, 6) for w in waits}) > 20, "every caller waits the same: they meet again"


def test_a_refusal_for_the_primarys_load_or_room_is_waited_out_for_its_retry_after():
    from spooler._common import RETRY_AFTER_MAX_S, retry_wait_s
    full = errors.Unavailable("full", reason=errors.NODE_FULL, retry_after_s=1.0)
    assert all(1.0 <= retry_wait_s(1, full) <= 1.5 for _ in range(50))
    disk = errors.Unavailable("disk", reason=errors.DISK_LOW, retry_after_s=5.0)
    assert all(retry_wait_s(r, disk) >= 5.0 for r in range(1, 6))
    huge = errors.Unavailable("x", reason=errors.OVERLOADED, retry_after_s=3600)
    assert all(RETRY_AFTER_MAX_S <= retry_wait_s(1, huge) <= 1.5 * RETRY_AFTER_MAX_S for _ in range(50))
    # spread like the schedule: callers refused together do not come back together
    assert len({round(retry_wait_s(1, full), 6) for _ in range(50)}) > 20
    # no primary yet (a failover): the short schedule, whatever the Retry-After
    election = errors.Unavailable("no primary", retry_after_s=0.5)
    assert all(retry_wait_s(1, election) <= 0.15 for _ in range(50))
    assert all(retry_wait_s(1, errors.OperationUnconfirmed("x")) <= 0.15 for _ in range(50))


def _scripted(outcomes):
    it = iter(outcomes)

    def next_outcome():
        o = next(it)
        if isinstance(o, BaseException):
            raise o
        return o
    return next_outcome


UNKNOWN_THEN_REFUSED = [errors.OperationUnconfirmed("no answer within the timeout"),
                        errors.Unavailable("no primary"), errors.Unavailable("no primary")]
REFUSED = [errors.Unavailable("no primary")] * 3


@pytest.mark.parametrize("outcomes, heard", [(UNKNOWN_THEN_REFUSED, errors.OperationUnconfirmed),
                                             (REFUSED, errors.Unavailable)], ids=["unknown-first", "control"])
def test_a_call_whose_retries_end_refused_after_an_unknown_outcome_is_unconfirmed(monkeypatch, outcomes, heard):
    """A keyed send, and an ack, whose first attempt's outcome is unknown and whose
    retries are all refused (unavailable): the call may have taken effect with its
    first attempt, so its caller hears operation_unconfirmed, not the last
    unavailable ("not accepted"), on which a caller would send again. Refused from
    the start, it is unavailable (the control). Both clients."""
    import spooler._common as common
    from spooler import AsyncClient, Client
    monkeypatch.setattr(common, "retry_wait_s", lambda retry, after=None: 0.0)

    c = Client("127.0.0.1:9", "k", retry_attempts=3)
    try:
        monkeypatch.setattr(c, "send_async", answered_by(_scripted(outcomes)))
        monkeypatch.setattr(c, "_dedup_window_s", lambda q: 60.0)
        with pytest.raises(errors.SpoolerError) as e:
            c.send("q", b"x", dedup_key="k1")
        assert type(e.value) is heard
        settle = _scripted(outcomes)
        monkeypatch.setattr(c, "_call", lambda method, req, write=False: settle())
        with pytest.raises(errors.SpoolerError) as e:
            c.ack("token")
        assert type(e.value) is heard
    finally:
        c.close()

    async def run_async():
        a = AsyncClient("127.0.0.1:9", "k", retry_attempts=3)
        try:
            send = _scripted(outcomes)

            def start_flush():  # every send batch is answered at once, by the script
                for _, fut in a._pending:
                    try:
                        fut.set_result(send())
                    except errors.SpoolerError as e:
                        fut.set_exception(e)
                a._pending.clear()
            monkeypatch.setattr(a, "_start_flush", start_flush)

            async def window(q):
                return 60.0
            monkeypatch.setattr(a, "_dedup_window_s", window)
            with pytest.raises(errors.SpoolerError) as e:
                await a.send("q", b"x", dedup_key="k1")
            assert type(e.value) is heard
            settle = _scripted(outcomes)

            async def settle_one(action, token, delay_s=0.0):
                return settle()
            monkeypatch.setattr(a, "_settle_one", settle_one)
            with pytest.raises(errors.SpoolerError) as e:
                await a.ack("token")
            assert type(e.value) is heard
        finally:
            await a.close()
    asyncio.run(run_async())


def test_a_keyed_send_cut_off_by_close_is_not_a_runtime_error(monkeypatch):
    """A keyed send whose outcome is unknown when close() fails it: looking up the
    queue's dedup window on the closed client must not replace its caller's
    operation_unconfirmed with a RuntimeError (the window counts as unknown: no
    resend). Both clients."""
    from spooler import AsyncClient, Client
    c = Client("127.0.0.1:9", "k", retry_attempts=3)
    c.close()
    assert c._dedup_window_s("q") == 0.0

    async def run_async():
        a = AsyncClient("127.0.0.1:9", "k", retry_attempts=3)
        await a.close()
        assert await a._dedup_window_s("q") == 0.0
    asyncio.run(run_async())


def test_an_error_detail_that_cannot_be_read_is_judged_by_its_code():
    """A garbled grpc-status-details-bin (a proxy's, a corrupted trailer) raised
    protobuf's DecodeError to the caller instead of an error of the table."""
    garbled = ((errors.DETAILS_TRAILER, b"\xff\xfe not a status"),)
    e = errors.from_grpc_trailers(grpc.StatusCode.NOT_FOUND, "garbled", garbled)
    assert isinstance(e, errors.SpoolerError) and e.message == "garbled", e
    assert isinstance(errors.from_grpc_trailers(grpc.StatusCode.UNAVAILABLE, "x", garbled), errors.Unavailable)
    # a Status that parses, whose detail inside does not
    st = api_pb2.Status(code=5, message="m")
    st.details.add().Pack(api_pb2.ErrorDetail(kind="queue_not_found"))
    st.details[0].value = b"\xff\xfe"
    e = errors.from_grpc_trailers(grpc.StatusCode.NOT_FOUND, "inner", ((errors.DETAILS_TRAILER, st.SerializeToString()),))
    assert isinstance(e, errors.SpoolerError) and e.message == "inner", e


def test_the_sync_consumer_settles_without_waiting_for_a_renewal_on_its_way(caplog):
    """The sync client's ``handle``: when the handler ends while a renewal is on its
    way (a slow node, its retries through a failover), the ack goes out at once, as
    in AsyncClient, which cancels its renewer; it used to wait for the renewal's
    end. The renewal's late failure is not logged as a lost lease: the ack speaks
    for the lease."""
    import threading

    from spooler import Client
    from spooler._common import LeaseEnd, Message

    c = Client("127.0.0.1:9")  # nothing is called on the network: the calls are stood in for
    renewing, release, renew_over, acked = threading.Event(), threading.Event(), threading.Event(), []

    def renew(token):
        renewing.set()
        try:
            release.wait(10)
            raise errors.StaleLease("lease is no longer valid: settled", reason="settled")
        finally:
            renew_over.set()

    c.renew = renew
    c.ack = lambda token: acked.append((token, renew_over.is_set()))
    m = Message("m1", b"x", "tok", 0, LeaseEnd("2026-01-01T00:00:00Z", 0.1, time.monotonic()), "q")
    before = set(threading.enumerate())
    try:
        assert c.handle(m, lambda _: renewing.wait(10)) is True  # the handler ends once the renewal is out
        assert acked == [("tok", False)]  # acked while the renewal was still on its way
    finally:
        release.set()
        c.close()
    deadline = time.monotonic() + 10
    while [t for t in threading.enumerate() if t not in before and t.is_alive()]:  # the renewer ends
        assert time.monotonic() < deadline, "the renewer did not end"
        time.sleep(0.01)
    assert not [r for r in caplog.records if "renew of" in r.getMessage()]
