"""A node's bounds on gRPC connections (node/api/grpc_api.py ``server_options``,
docs/limits.md "gRPC connections"), against a real node over raw sockets: how many
connections its gRPC port holds, and how long a new one may take to finish its
handshake."""
from __future__ import annotations

import os
import socket

import pytest

from nodeproc import NodeProc, wait_until
from spooler import Client
from spooler.errors import Unavailable

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # HTTP/2's client preface, without the SETTINGS that follow


def _node(tmp_path, *flags) -> NodeProc:
    return NodeProc(str(tmp_path / "node"), extra_args=list(flags)).start()


def _connect(node) -> socket.socket:
    host, port = node.grpc_target.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _closed_by_node(s) -> bool:
    """Whether the node has closed ``s`` (EOF or reset), without waiting."""
    s.setblocking(False)
    try:
        while True:
            if s.recv(65536) == b"":
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _open_fds(node) -> int:
    return len(os.listdir(f"/proc/{node.pid}/fd"))


def _sends(node) -> bool:
    """Whether a new client's send on a new connection is answered."""
    with Client(node.grpc_target, key=node.admin_key, timeout_s=2, retry_attempts=1) as c:
        try:
            c.put_queue("q")
            c.send("q", b"x")
            return True
        except Unavailable:
            return False


@pytest.mark.integration
def test_connections_past_the_bound_are_closed_at_accept_and_their_places_freed_when_they_go(tmp_path):
    """--grpc-max-connections 20 (and a handshake timeout long enough not to act
    here): of 60 silent connections, the node closes the 40 past its bound at once
    and holds no descriptor for them; while the 20 are held, a client cannot get a
    connection in; once they close, it can."""
    node = _node(tmp_path, "--grpc-max-connections", "20", "--grpc-handshake-timeout", "300")
    socks = []
    try:
        base = _open_fds(node)
        socks = [_connect(node) for _ in range(60)]
        wait_until(lambda: sum(_closed_by_node(s) for s in socks) >= 40, timeout_s=10,
                   what="the node to close the 40 connections past its bound")
        held = [s for s in socks if not _closed_by_node(s)]
        assert len(held) == 20, len(held)
        assert _open_fds(node) <= base + 20 + 5, (_open_fds(node), base)
        assert not _sends(node)  # every place is taken
        for s in socks:
            s.close()
        wait_until(lambda: _sends(node), timeout_s=15, what="a send once the silent connections went")
    finally:
        for s in socks:
            s.close()
        node.kill()


@pytest.mark.integration
def test_a_connection_that_does_not_finish_its_handshake_in_time_is_closed(tmp_path):
    """--grpc-handshake-timeout 0.5: connections that send nothing, or only half of
    HTTP/2's preface, are closed within seconds (gRPC core's own default holds them
    for 120 s); a client's connection that finished its handshake is not, and its
    calls go on being answered after the timeout has passed."""
    node = _node(tmp_path, "--grpc-handshake-timeout", "0.5")
    socks = []
    try:
        with Client(node.grpc_target, key=node.admin_key, timeout_s=5) as c:
            c.put_queue("q")
            c.send("q", b"before")
            socks = [_connect(node) for _ in range(10)]
            for s in socks[:5]:
                s.sendall(PREFACE[:10])
            wait_until(lambda: all(_closed_by_node(s) for s in socks), timeout_s=10,
                       what="the node to close the connections that never finished their handshake")
            c.send("q", b"after")
            assert [m.body for m in c.receive("q", max_messages=10)] == [b"before", b"after"]
    finally:
        for s in socks:
            s.close()
        node.kill()
