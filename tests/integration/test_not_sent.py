"""A write that never left (no connection could be had) is `unavailable`, not
`operation_unconfirmed`: nothing reached a node, so the caller may retry it blindly.
A write that did leave and lost its transport stays unconfirmed
(test_session.py::test_a_broken_session_makes_writes_unconfirmed_and_reads_unavailable).
Checked on the three paths that map gRPC failures: the node's forwarder (a replica
whose primary just died), the asyncio SDK's Session stream, and its unary calls."""
import asyncio

import pytest

from nodeproc import free_ports
from node.api.forward import Forwarder
from spooler import errors
from spooler.aio import AsyncClient
from spooler.client import Client
from spooler.pb import api_pb2


def _dead_address() -> str:
    return f"127.0.0.1:{free_ports(1)[0]}"  # free: nothing listens there


def test_forwarded_write_to_a_dead_primary_is_unavailable():
    async def main():
        fwd = Forwarder(timeout_s=5, current_primary=lambda: addr)
        with pytest.raises(errors.Unavailable) as ei:
            await fwd.call(addr, "SendBatch", api_pb2.SendBatchRequest(queue="q", bodies=[b"x"]), "Bearer k", True)
        assert not isinstance(ei.value, errors.OperationUnconfirmed)
    addr = _dead_address()
    asyncio.run(main())


def test_sdk_write_to_a_dead_node_is_unavailable_on_session_and_unary():
    async def main():
        async with AsyncClient(_dead_address(), "k", retry_attempts=1, timeout_s=5) as c:
            with pytest.raises(errors.Unavailable):
                await c.send_batch("q", [b"x"])   # the Session stream
            with pytest.raises(errors.Unavailable):
                await c.put_queue("q")            # a unary call
    asyncio.run(main())


def test_a_node_name_that_does_not_resolve_is_unavailable_not_unconfirmed():
    """A name lookup that fails is a connection never had: nothing left this
    process, so a write is `unavailable` (and the client may try its next node),
    not `operation_unconfirmed`. grpcio 1.85 words it "errors resolving NAME:
    ... Domain name not found"; before 0.4.16 only older grpcio's "DNS
    resolution failed" was recognised, and the sync client called such a send
    one that may have landed."""
    target = "nosuchhost.invalid:1"  # .invalid never resolves (RFC 6761)
    with Client(target, "k", retry_attempts=1, timeout_s=5) as c:
        with pytest.raises(errors.Unavailable) as ei:
            c.send("q", b"x")
        assert not isinstance(ei.value, errors.OperationUnconfirmed), ei.value
        with pytest.raises(errors.Unavailable) as ei:
            c.put_queue("q")
        assert not isinstance(ei.value, errors.OperationUnconfirmed), ei.value

    async def main():
        async with AsyncClient(target, "k", retry_attempts=1, timeout_s=5) as a:
            with pytest.raises(errors.Unavailable) as ei:
                await a.send_batch("q", [b"x"])
            assert not isinstance(ei.value, errors.OperationUnconfirmed), ei.value
    asyncio.run(main())
