"""Garbage on the gRPC port: raw TCP junk, HTTP/1.1, a truncated HTTP/2 preface, and
malformed protobuf bodies through a raw channel. Every call must fail with a gRPC error
within its deadline (no hang), the node must stay up and serve a normal call afterwards.
"""
from __future__ import annotations

import os
import socket

import grpc
import pytest

from spooler.pb import api_pb2, api_pb2_grpc

pytestmark = pytest.mark.integration

TIMEOUT_S = 5.0


def md(node):
    return (("authorization", f"Bearer {node.admin_key}"),)


def assert_serving(node, queue="g"):
    """The node is alive and answers a normal authenticated call (and HTTP /healthz)."""
    assert node.alive(), node.read_log()
    os.kill(node.pid, 0)
    with grpc.insecure_channel(node.grpc_target) as ch:
        stub = api_pb2_grpc.SpoolerStub(ch)
        stub.PutQueue(api_pb2.PutQueueRequest(name=queue), metadata=md(node), timeout=TIMEOUT_S)
        r = stub.Send(api_pb2.SendRequest(queue=queue, body=b"ok"), metadata=md(node), timeout=TIMEOUT_S)
        assert len(r.id) > 0 and r.duplicate is False
        c = stub.GetCluster(api_pb2.Empty(), metadata=md(node), timeout=TIMEOUT_S)
        assert c.node_id == "n1" and c.role == "primary"
    import urllib.request
    with urllib.request.urlopen(node.http_url + "/healthz", timeout=TIMEOUT_S) as resp:
        assert resp.status == 200


@pytest.fixture(scope="module")
def gnode(shared_node):
    assert_serving(shared_node)
    return shared_node


def _host_port(node):
    host, _, port = node.grpc_target.rpartition(":")
    return host, int(port)


def _blast(node, payload: bytes) -> bytes:
    """Send raw bytes, half-close, read what comes back (the server may also just hang up)."""
    with socket.create_connection(_host_port(node), timeout=TIMEOUT_S) as s:
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            return b""
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
                if len(data) > 1 << 20:
                    break
        except (ConnectionResetError, socket.timeout):
            pass
        return data


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

RAW = {
    "random": os.urandom(4096),
    "zeros": b"\x00" * 10000,
    "http1": b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "http1_post": b"POST /spooler.v1.Spooler/Send HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
    "preface_truncated": PREFACE[:10],
    "preface_only": PREFACE,
    "preface_then_junk": PREFACE + os.urandom(512),
    # a SETTINGS frame header claiming a 16 MiB payload that never comes
    "preface_huge_frame": PREFACE + b"\xff\xff\xff\x04\x00\x00\x00\x00\x00",
    # HEADERS frame with a garbage HPACK block on stream 1
    "preface_bad_hpack": PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + b"\x00\x00\x08\x01\x05\x00\x00\x00\x01"
                         + b"\xff\xff\xff\xff\xff\xff\xff\xff",
    "tls_client_hello": bytes.fromhex("16030100a5010000a10303") + os.urandom(160),
}


@pytest.mark.parametrize("name", list(RAW))
def test_raw_tcp_garbage(gnode, name):
    data = _blast(gnode, RAW[name])
    if name == "http1" and data:
        # grpc answers HTTP/1.x with a 4xx/5xx or a GOAWAY, never a success
        assert not data.startswith(b"HTTP/1.1 200"), data[:200]
    assert_serving(gnode)


def test_many_half_open_connections(gnode):
    socks = []
    try:
        for _ in range(50):
            s = socket.create_connection(_host_port(gnode), timeout=TIMEOUT_S)
            s.sendall(PREFACE[:7])
            socks.append(s)
        assert_serving(gnode)  # served while 50 connections sit half-way through a preface
    finally:
        for s in socks:
            s.close()
    assert_serving(gnode)


JUNK_BODIES = {
    "random": os.urandom(64),
    "truncated_varint": b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",
    "length_past_end": b"\x0a\x7fabc",
    "bad_wire_type": b"\x0f\x01\x02",
    "invalid_utf8_string": b"\x0a\x03\xff\xfe\xfd\x12\x01x",
    "field_zero": b"\x00\x00",
    "group_start_no_end": b"\x0b\x10\x01",
    "huge_length": b"\x12\xff\xff\xff\xff\x0f",
}

METHODS = ["Send", "PutQueue", "Receive", "Ack", "SettleBatch", "SendBatch", "CreateKey", "Promote"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("junk", list(JUNK_BODIES))
def test_malformed_protobuf_fails_with_grpc_error(gnode, method, junk):
    with grpc.insecure_channel(gnode.grpc_target) as ch:
        call = ch.unary_unary(f"/spooler.v1.Spooler/{method}", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as ei:
            call(JUNK_BODIES[junk], metadata=md(gnode), timeout=TIMEOUT_S)
        code = ei.value.code()
        # the request does not decode: the error table's invalid_argument, status and kind
        # trailer, as for any other bad input (never OK, a hang, or UNKNOWN / UNAVAILABLE)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{code}: {ei.value.details()}"
        assert dict(ei.value.trailing_metadata() or ()).get("spooler-error-kind") == "invalid_argument"
    assert gnode.alive()


def test_malformed_frame_on_a_session_is_answered_and_the_stream_goes_on(gnode):
    """A Session frame that does not decode gets an invalid_argument answer (id 0: it
    has no id to answer by); the requests after it on the same stream are served."""
    good = api_pb2.SessionRequest(id=7, send_batch=api_pb2.SendBatchRequest(queue="nope-" + "x" * 100)).SerializeToString()
    with grpc.insecure_channel(gnode.grpc_target) as ch:
        call = ch.stream_stream("/spooler.v1.Spooler/Session", request_serializer=None,
                                response_deserializer=api_pb2.SessionResponse.FromString)
        answers = list(call(iter([JUNK_BODIES["truncated_varint"], good]), metadata=md(gnode), timeout=TIMEOUT_S))
    assert [a.id for a in answers] == [0, 7], answers
    assert answers[0].error.kind == "invalid_argument"
    assert answers[1].error.kind == "invalid_argument"  # its queue name is too long: a real answer to it


def test_malformed_protobuf_without_auth_fails_too(gnode):
    with grpc.insecure_channel(gnode.grpc_target) as ch:
        call = ch.unary_unary("/spooler.v1.Spooler/Send", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as ei:
            call(b"\xff\xff\xff", timeout=TIMEOUT_S)
        assert ei.value.code() != grpc.StatusCode.DEADLINE_EXCEEDED
        assert ei.value.code() != grpc.StatusCode.OK


def test_unknown_method_is_unimplemented(gnode):
    with grpc.insecure_channel(gnode.grpc_target) as ch:
        call = ch.unary_unary("/spooler.v1.Spooler/Nope", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as ei:
            call(b"", metadata=md(gnode), timeout=TIMEOUT_S)
        assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_oversized_message_rejected(gnode):
    with grpc.insecure_channel(gnode.grpc_target) as ch:
        call = ch.unary_unary("/spooler.v1.Spooler/Send", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as ei:
            call(b"\x12" + b"\x80\x80\x80\x08" + b"x" * (16 * 1024 * 1024), metadata=md(gnode), timeout=15)
        assert ei.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
                                   grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE), ei.value.code()


def test_well_framed_but_wrong_message_type(gnode):
    """A valid protobuf of another message decodes as something; it must be rejected or
    handled, never crash the node."""
    body = api_pb2.PromoteRequest(node="n1" * 100).SerializeToString()
    with grpc.insecure_channel(gnode.grpc_target) as ch:
        call = ch.unary_unary("/spooler.v1.Spooler/Ack", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as ei:
            call(body, metadata=md(gnode), timeout=TIMEOUT_S)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # a malformed lease token
        kinds = dict(ei.value.trailing_metadata() or ())
        assert kinds.get("spooler-error-kind") == "invalid_argument"


def test_node_serves_after_all_the_garbage(gnode):
    assert_serving(gnode, queue="after")


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _hpack_literal(name: bytes, value: bytes) -> bytes:
    """A header as an HPACK literal, not indexed, new name, no Huffman (short strings only)."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def test_an_authorization_that_is_not_utf8_is_logged_once_a_minute_not_per_call(node):
    """grpc's own ERROR line, with a traceback, for every call whose metadata is not
    UTF-8 (grpc's clients never send it, so the call is written frame by frame): any
    caller without a key could fill the node's log. 30 such calls now log one line."""
    headers = b"".join(_hpack_literal(k, v) for k, v in (
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/spooler.v1.Spooler/ListQueues"),
        (b":authority", b"spooler"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
        (b"authorization", b"Bearer \xff\xfe")))
    call = (PREFACE + _h2_frame(4, 0, 0, b"") + _h2_frame(1, 4, 1, headers)
            + _h2_frame(0, 1, 1, b"\x00\x00\x00\x00\x00"))
    for _ in range(30):
        with socket.create_connection(_host_port(node), timeout=TIMEOUT_S) as s:
            s.sendall(call)
            got = b""
            while b"grpc-status" not in got and (chunk := s.recv(65536)):
                got += chunk
    assert_serving(node)
    log = node.read_log()
    assert log.count("Invalid encoding on") == 1, log[-3000:]
    assert "UnicodeDecodeError" not in log, log[-3000:]
