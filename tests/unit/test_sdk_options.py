"""The SDK's gRPC channel options: the ping timeout that drops a hung node."""
import pytest

from spooler._common import GRPC_OPTIONS, PING_TIMEOUT_S, grpc_options
from spooler.aio import AsyncClient
from spooler.client import Client


def test_the_ping_timeout_sets_both_of_grpcs_ping_deadlines():
    opts = dict(grpc_options(20))
    assert opts["grpc.keepalive_timeout_ms"] == opts["grpc.http2.ping_timeout_ms"] == 20_000
    assert dict(grpc_options()) == dict(GRPC_OPTIONS)
    assert dict(GRPC_OPTIONS)["grpc.http2.ping_timeout_ms"] == PING_TIMEOUT_S * 1000


@pytest.mark.parametrize("bad", [0, -1, "5", True, float("nan")])
def test_a_ping_timeout_that_is_not_a_positive_number_is_refused(bad):
    with pytest.raises(ValueError):
        Client("127.0.0.1:9", ping_timeout_s=bad)
    with pytest.raises(ValueError):
        AsyncClient("127.0.0.1:9", ping_timeout_s=bad)


def test_a_client_opens_its_channels_with_its_own_ping_timeout():
    c = Client("127.0.0.1:9", ping_timeout_s=12)
    try:
        assert dict(c._grpc_options)["grpc.http2.ping_timeout_ms"] == 12_000
    finally:
        c.close()


@pytest.mark.parametrize("option", ["batch_max", "batches_in_flight_max", "retry_attempts", "timeout_s"])
@pytest.mark.parametrize("bad", [0, -1, "4", True])
def test_a_client_option_below_one_is_refused(option, bad):
    """batch_max=0 left auto-batching spinning on empty batches and
    batches_in_flight_max=0 left every send waiting: refused at construction."""
    with pytest.raises(ValueError):
        Client("127.0.0.1:9", **{option: bad})
    with pytest.raises(ValueError):
        AsyncClient("127.0.0.1:9", **{option: bad})


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 1e10, 1e6 + 1])
def test_a_timeout_that_is_not_finite_or_past_the_cap_is_refused(bad):
    """A timeout of 1e10 s or infinity was taken, and then every unary call failed at
    once (gRPC's deadline overflowed), a send as "maybe stored" though nothing left."""
    with pytest.raises(ValueError):
        Client("127.0.0.1:9", timeout_s=bad)
    with pytest.raises(ValueError):
        AsyncClient("127.0.0.1:9", timeout_s=bad)
    Client("127.0.0.1:9", timeout_s=1e6).close()  # the cap itself is taken


def test_a_batch_over_grpcs_limit_only_with_its_framing_is_refused_before_it_is_sent():
    """167,000 bodies of 100 bytes are under the bodies' limit (16.70 MB) but over
    gRPC's 16 MiB once each body's tag and length are counted: message_too_large
    here, instead of a local gRPC refusal that breaks the Session under other calls."""
    from spooler import errors
    from spooler._common import BODIES_BYTES_MAX, check_batch, compact_request

    bodies = [b"x" * 100] * 167_000
    assert sum(map(len, bodies)) <= BODIES_BYTES_MAX < compact_request("q", bodies, 0).ByteSize()
    with pytest.raises(errors.MessageTooLarge):
        check_batch("q", bodies, 0)
    check_batch("q", [b"x" * 100] * 100_000, 0)  # well inside: passes


@pytest.mark.parametrize("char", ["n", "\U0001F600"])
@pytest.mark.parametrize("field", ["queue", "dedup_key"])
def test_a_name_or_key_too_long_for_any_node_is_refused_before_it_is_sent(field, char):
    """Counted in UTF-8 bytes, the room a request leaves them: 16,384 emoji (64 KiB)
    passed a count of characters, and with a body at the limit the request was over
    gRPC's 16 MiB and broke the Session under every other call on it."""
    from spooler import errors
    from spooler._common import NAME_BYTES_MAX, check_send_types

    fits = NAME_BYTES_MAX // len(char.encode())
    args = {"queue": "q", "dedup_key": "k", field: char * (fits + 1)}
    with pytest.raises(errors.InvalidArgument, match=f"over {NAME_BYTES_MAX} bytes"):
        check_send_types(args["queue"], b"x", 0, args["dedup_key"])
    check_send_types(*{"queue": (char * fits, b"x", 0, "k"), "dedup_key": ("q", b"x", 0, char * fits)}[field])
    check_send_types("q" * 255, b"x", 0, "k" * 128)  # a node's own limits: passed on, it answers


def test_a_receive_whose_queue_name_no_request_can_carry_is_refused_before_it_is_sent():
    """A receive checked only that its queue name was a str: one of 17 MB made a
    Session request over gRPC's limit, and the stream broke under another caller's
    long poll (both unavailable, answer lost)."""
    from spooler import errors
    from spooler._common import NAME_BYTES_MAX, receive_request

    for bad in ("x" * 17_000_000, "\U0001F600" * (NAME_BYTES_MAX // 4 + 1), "\udc80"):
        with pytest.raises(errors.InvalidArgument):
            receive_request(bad, 0, 1)
    assert receive_request("q" * 255, 0, 1).queue == "q" * 255


def test_an_auto_batch_counts_names_and_keys_toward_its_size():
    """batch_size counted bodies only: 1,000 small sends each with a queue name and
    a dedup key of 16 KiB made one request of over 16 MiB, which gRPC refused and
    the Session broke under. Each entry's queue name and key now count, at 4 bytes a
    character, so the requests it makes stay under gRPC's limit."""
    from spooler._common import (BATCH_BYTES_MAX, BATCH_ITEMS_MAX, MESSAGE_BYTES_MAX, NAME_BYTES_MAX,
                                 batch_request, batch_size, check_send_types, entry_bytes)

    def size_of(send):
        return entry_bytes(send[0], send[1], send[3])

    for char in ("k", "\U0001F600"):
        name = char * (NAME_BYTES_MAX // len(char.encode()) - 1)
        pending = [(name, b"x", 0.0, name + str(i % 10)) for i in range(1000)]
        check_send_types(*pending[0])  # each send alone is one the SDK takes
        assert batch_request(pending).ByteSize() > MESSAGE_BYTES_MAX  # all at once: too large
        n = batch_size(pending, BATCH_ITEMS_MAX, size_of)
        assert 1 <= n < 1000 and batch_request(pending[:n]).ByteSize() <= BATCH_BYTES_MAX + 16 * n
    small = [("q", b"x" * 256, 0.0, "k" * 36)] * 1000
    assert batch_size(small, 100, size_of) == 100


def test_a_batch_max_over_a_nodes_entries_per_batch_is_refused():
    """batch_max=5000 was taken; a node refuses a batch of over 1,000 entries whole,
    and each of its sends then went again alone: 6,000 sends took 5,002 calls."""
    from spooler._common import BATCH_ITEMS_MAX

    for cls in (Client, AsyncClient):
        with pytest.raises(ValueError, match=f"at most {BATCH_ITEMS_MAX}"):
            cls("127.0.0.1:9", batch_max=BATCH_ITEMS_MAX + 1)
    Client("127.0.0.1:9", batch_max=BATCH_ITEMS_MAX).close()


def test_a_call_failing_because_close_closed_its_channel_opens_no_new_one():
    """A sync call in flight in another thread fails CANCELLED when close() closes
    its channel: the client neither moves to its next node nor opens a channel there
    after close."""
    import threading
    import time
    from concurrent import futures

    import grpc

    from spooler.pb import api_pb2

    arrived = threading.Event()

    def slow(req, ctx):
        arrived.set()
        time.sleep(3)
        return api_pb2.Queue(name=req.name)

    servers, ports = [], []
    for _ in range(2):
        s = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("spooler.v1.Spooler", {
            "GetQueue": grpc.unary_unary_rpc_method_handler(
                slow, request_deserializer=api_pb2.QueueRequest.FromString,
                response_serializer=api_pb2.Queue.SerializeToString)}),))
        ports.append(s.add_insecure_port("127.0.0.1:0"))
        s.start()
        servers.append(s)
    try:
        c = Client(",".join(f"127.0.0.1:{p}" for p in ports), "k", retry_attempts=1)
        got = []
        t = threading.Thread(target=lambda: got.append(_outcome(lambda: c.get_queue("q"))))
        t.start()
        assert arrived.wait(5)
        c.close()
        t.join(10)
        assert got and not isinstance(got[0], dict)  # the call failed (how is another test's)
        assert list(c._channels) == [0] and c.target_now() == f"127.0.0.1:{ports[0]}"
    finally:
        for s in servers:
            s.stop(None)


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return e


@pytest.mark.parametrize("call", ["receive", "put_queue_failure_queue", "put_queue_seconds", "nack", "create_key"])
def test_arguments_of_the_wrong_type_are_refused_saying_which_before_anything_is_sent(call):
    """Arguments that protobuf itself refused ("bad argument type for built-in
    operation") are refused by the SDK naming the argument; scopes given as one
    string are split at commas (they were taken letter by letter)."""
    import asyncio
    from spooler._common import key_request

    bad = {"receive": (lambda c: c.receive(5), "queue"),
           "put_queue_failure_queue": (lambda c: c.put_queue("q", failureQueue=5), "failureQueue"),
           "put_queue_seconds": (lambda c: c.put_queue("q", leaseTimeoutSeconds="5"), "leaseTimeoutSeconds"),
           "nack": (lambda c: c.nack("t" * 40, delay_s="1"), "delay_s"),
           "create_key": (lambda c: c.create_key(5), "queue")}[call]
    with Client("127.0.0.1:9", timeout_s=1) as c:  # (nothing listens there: a call that went out fails otherwise)
        with pytest.raises(TypeError, match=bad[1]):
            bad[0](c)

    async def main():
        async with AsyncClient("127.0.0.1:9", timeout_s=1) as c:
            with pytest.raises(TypeError, match=bad[1]):
                await bad[0](c)
    asyncio.run(main())
    assert list(key_request("q", "send, receive").scopes) == ["send", "receive"]
    assert list(key_request("q", ["admin"]).scopes) == ["admin"]


def test_a_settle_request_no_node_would_take_is_refused_before_it_is_sent():
    """A token far longer than any node's (a body passed by mistake), or more
    items than a node takes in one batch, made a settle request that gRPC could
    refuse as a whole (over 16 MiB), ending the Session stream under every call
    riding it. Both are refused invalid_argument before sending; a node's own
    limits below them are passed on for the node to answer."""
    from spooler import errors
    from spooler._common import BATCH_ITEMS_MAX, TOKEN_CHARS_MAX, lease_request, settle_request

    with pytest.raises(errors.InvalidArgument, match="malformed lease token"):
        settle_request([("t" * (TOKEN_CHARS_MAX + 1), "ack")])
    with pytest.raises(errors.InvalidArgument, match="malformed lease token"):
        lease_request("t" * 17_000_000)
    with pytest.raises(errors.InvalidArgument, match=f"at most {BATCH_ITEMS_MAX} items"):
        settle_request([("t" * 40, "ack")] * (BATCH_ITEMS_MAX + 1))
    # within both: built, and a generator of items is taken as a list is
    assert len(settle_request(("t" * TOKEN_CHARS_MAX, "ack") for _ in range(BATCH_ITEMS_MAX)).items) \
        == BATCH_ITEMS_MAX


def test_a_send_whose_flush_cannot_be_started_is_not_sent_later(monkeypatch):
    """If the sync client's pool refused to start a flush (the interpreter shutting
    down), the send raised but stayed queued, and the next flush would have sent
    it: a send its caller was told had failed, stored after all. It is taken out,
    and the flush count with it, so later sends still go."""
    from spooler.pb import api_pb2

    c = Client("127.0.0.1:9", retry_attempts=1)
    try:
        real = c._pool.submit

        def refuse(fn, *a, **kw):
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")
        monkeypatch.setattr(c._pool, "submit", refuse)
        with pytest.raises(RuntimeError, match="interpreter shutdown"):
            c.send_async(api_pb2.SendRequest(queue="q", body=b"x"))
        assert c._pending == [] and c._in_flight == 0
        monkeypatch.setattr(c._pool, "submit", real)
    finally:
        c.close()
