"""A node's bounds on HTTP connections and on slow clients (node/api/http_conns.py,
docs/limits.md "HTTP connections and slow clients"), against a real node over raw
sockets: how many connections it serves, what one past the bound is told, and how
long a client may take to send a request's head or body."""
from __future__ import annotations

import json
import re
import socket
import time
import urllib.request

import pytest

from contract_client import one_response
from nodeproc import ADMIN_KEY, NodeProc, wait_until

AUTH = b"Authorization: Bearer " + ADMIN_KEY.encode() + b"\r\n"
SPARE = 256  # http_conns.SPARE_DEFAULT, as the node runs it


def _node(tmp_path, *flags):
    n = NodeProc(str(tmp_path / "node"), extra_args=list(flags)).start()
    try:
        yield n
    finally:
        n.kill()


@pytest.fixture
def bounded(tmp_path):
    yield from _node(tmp_path, "--http-max-connections", "3")


@pytest.fixture
def impatient(tmp_path):
    yield from _node(tmp_path, "--http-client-timeout", "1")


def _connect(node, timeout_s: float = 10.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", node.http_port), timeout=timeout_s)


def _response(s) -> tuple:
    """(status, lower-case head, body) of one response read from ``s``, or (0, b"", b"")
    when the node closed the connection without one."""
    data = one_response(s)
    if not data:
        return 0, b"", b""
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head.lower(), body


def _closed_within(s, seconds: float) -> bool:
    """Whether the node closes ``s`` (EOF or reset) within ``seconds``, reading and
    dropping anything it sends first."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            if s.recv(65536) == b"":
                return True
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False
    return False


def _served(node) -> tuple:
    """Status of GET /v1/queues on a new connection."""
    with _connect(node) as s:
        s.sendall(b"GET /v1/queues HTTP/1.1\r\nHost: n\r\n" + AUTH + b"\r\n")
        return _response(s)


def _metric(node, name: str, labels: str = "") -> float:
    body = urllib.request.urlopen(f"{node.http_url}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", body, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def _wait_open_connections(node, most: int) -> None:
    """Until the node counts at most ``most`` open connections besides this probe's own."""
    # (a /metrics read on a connection past the bound is served too, then closed)
    wait_until(lambda: _metric(node, "spooler_http_connections") <= most + 1, timeout_s=10,
               what=f"the node to count at most {most} connections")


@pytest.mark.integration
def test_a_connection_past_the_bound_is_told_503_too_many_connections_and_closed(bounded):
    """With --http-max-connections 3 and three connections held open (idle), the
    fourth's request is answered 503 ``unavailable`` (reason ``too_many_connections``,
    Retry-After, Spooler-Epoch) and the connection closes behind the answer;
    /healthz is still answered there. Once one of the three closes, a new
    connection is served again."""
    held = [_connect(bounded) for _ in range(3)]
    try:
        for s in held:  # each is counted once the node has accepted it
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: n\r\n\r\n")
            assert _response(s)[0] == 200
        with _connect(bounded) as s:
            s.sendall(b"GET /v1/queues HTTP/1.1\r\nHost: n\r\n" + AUTH + b"\r\n")
            status, head, body = _response(s)
            assert status == 503, (status, head, body)
            doc = json.loads(body)
            assert doc["kind"] == "unavailable" and doc["reason"] == "too_many_connections", doc
            assert doc["retryAfterSeconds"] == 1, doc
            assert b"\r\nretry-after: 1\r\n" in head + b"\r\n" and b"spooler-epoch:" in head
            # (at once: well inside the 5 s that close a silent connection past the bound)
            assert _closed_within(s, 1), "the connection stayed open after its 503"
        with _connect(bounded) as s:  # a probe's route, answered past the bound, then closed
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: n\r\n\r\n")
            assert _response(s)[0] == 200
            assert _closed_within(s, 1)
        with _connect(bounded) as s:  # a body announced with Expect is not asked for: the 503 alone
            s.sendall(b"POST /v1/queues/q/messages HTTP/1.1\r\nHost: n\r\n" + AUTH
                      + b"Expect: 100-continue\r\nContent-Length: 5\r\n\r\n")
            status, head, body = _response(s)
            assert status == 503 and json.loads(body)["reason"] == "too_many_connections", (status, head, body)
            assert _closed_within(s, 1)
        assert _metric(bounded, "spooler_http_connections_refused_total", '{how="answered"}') >= 2
        held.pop().close()
        wait_until(lambda: _served(bounded)[0] == 200, timeout_s=10, what="a connection served again")
    finally:
        for s in held:
            s.close()


@pytest.mark.integration
def test_past_the_spare_connections_are_closed_at_once_and_silent_ones_after_the_grace(bounded):
    """Past the bound, the next 256 connections are accepted so they can be told
    why; past those, a connection is closed as soon as it is accepted. A connection
    past the bound that sends nothing is closed after about 5 s. Afterwards, the
    node serves again."""
    held = [_connect(bounded) for _ in range(3)]
    over = []
    try:
        for s in held:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: n\r\n\r\n")
            assert _response(s)[0] == 200
        over = [_connect(bounded) for _ in range(SPARE)]
        t0 = time.monotonic()
        with _connect(bounded) as s:  # the 3 + 256 + 1st
            assert _closed_within(s, 4), "a connection past the spare was not closed at once"
        assert time.monotonic() - t0 < 4
        # the silent ones past the bound: closed once their grace (5 s) is over
        assert _closed_within(over[0], 15), "a silent connection past the bound stayed open"
        assert all(_closed_within(s, 5) for s in over[1:])
        assert _metric(bounded, "spooler_http_connections_refused_total", '{how="closed"}') >= SPARE + 1
        for s in held:  # the ones within the bound are still served
            s.sendall(b"GET /v1/queues HTTP/1.1\r\nHost: n\r\n" + AUTH + b"\r\n")
            assert _response(s)[0] == 200
    finally:
        for s in held + over:
            s.close()
    _wait_open_connections(bounded, 0)
    assert _served(bounded)[0] == 200


@pytest.mark.integration
def test_a_client_slow_to_send_a_head_is_closed_after_the_client_timeout(impatient):
    """--http-client-timeout 1: a connection that sends nothing, and one that sends
    half a request head, are closed after about a second; one that sent a whole
    request and then nothing, likewise after its answer."""
    t0 = time.monotonic()
    silent, halfway, answered = _connect(impatient), _connect(impatient), _connect(impatient)
    try:
        halfway.sendall(b"GET /v1/queues HTTP/1.1\r\nHost: n\r\n")
        answered.sendall(b"GET /healthz HTTP/1.1\r\nHost: n\r\n\r\n")
        assert _response(answered)[0] == 200
        for s in (silent, halfway, answered):
            assert _closed_within(s, 10), "the connection stayed open past the client timeout"
        assert time.monotonic() - t0 >= 0.9  # (the timer, not a refusal at once)
    finally:
        for s in (silent, halfway, answered):
            s.close()
    assert _served(impatient)[0] == 200


@pytest.mark.integration
def test_a_client_slow_to_send_a_body_is_told_400_and_nothing_is_stored(impatient):
    """A send whose body stops short of its Content-Length: after the client
    timeout it is answered 400 ``invalid_argument`` and its connection closes;
    nothing of it is stored, and a whole send afterwards is."""
    with _connect(impatient) as s:
        s.sendall(b"PUT /v1/queues/slow HTTP/1.1\r\nHost: n\r\n" + AUTH + b"Content-Length: 0\r\n\r\n")
        assert _response(s)[0] == 201
    with _connect(impatient) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/queues/slow/messages HTTP/1.1\r\nHost: n\r\n" + AUTH
                  + b"Content-Length: 100\r\n\r\nthe first thirty bytes of 100")
        status, head, body = _response(s)
        assert status == 400, (status, head, body)
        doc = json.loads(body)
        assert doc["kind"] == "invalid_argument" and "not received within" in doc["message"], doc
        assert time.monotonic() - t0 >= 0.9
        assert _closed_within(s, 5)
    with _connect(impatient) as s:
        s.sendall(b"GET /v1/queues/slow HTTP/1.1\r\nHost: n\r\n" + AUTH + b"\r\n")
        status, _, body = _response(s)
        assert status == 200 and json.loads(body)["stats"]["visible"] == 0, body
    with _connect(impatient) as s:
        s.sendall(b"POST /v1/queues/slow/messages HTTP/1.1\r\nHost: n\r\n" + AUTH
                  + b"Content-Length: 5\r\n\r\nwhole")
        assert _response(s)[0] == 201


@pytest.mark.integration
def test_the_node_raises_its_open_files_limit_toward_what_its_connections_need(tmp_path):
    """Started under a soft limit of 512 open files, a node with the default bounds
    (4,096 HTTP connections and 256 more, 4,096 gRPC connections, 1,024 for the
    rest) raises its own soft limit to that need, or to its hard limit where that
    is lower, and then says so in its log."""
    import resource

    need = 4096 + 256 + 4096 + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(512, soft), hard))  # the node inherits it
    n = NodeProc(str(tmp_path / "node"))
    try:
        n.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        with open(f"/proc/{n.pid}/limits") as f:
            row = next(line for line in f if line.startswith("Max open files")).split()
        node_soft = int(row[3])
        expect = need if hard == resource.RLIM_INFINITY else min(hard, need)
        assert node_soft == expect, (node_soft, expect)
        warned = "open files are limited to" in n.read_log()
        assert warned == (expect < need), n.read_log()[-2000:]
    finally:
        n.kill()


@pytest.fixture
def plain(tmp_path):
    yield from _node(tmp_path)


@pytest.mark.integration
def test_a_request_head_over_32_kib_is_told_400_and_closed_and_bodies_are_not_heads(plain):
    """aiohttp bounds each header line and their number, not their sum, and keeps
    every line of a head not yet whole: some 1 MiB a connection, from a client
    with no key. A head past HEAD_BYTES_MAX, however it is cut into writes, is
    answered 400 invalid_argument and closed. Bodies are not heads: on one
    connection a send whose 200 kB body comes with its head, a chunked one, then
    a request with a 25 kB head are all served."""
    from node.api.http_conns import HEAD_BYTES_MAX

    pad = b"".join(b"X-Pad-%02d: %s\r\n" % (i, b"p" * 990) for i in range(40))  # 40 kB, no blank line
    assert len(pad) > HEAD_BYTES_MAX
    with _connect(plain) as s:
        s.sendall(b"GET /v1/queues HTTP/1.1\r\nHost: n\r\n" + AUTH)
        for k in range(0, len(pad), 10_000):
            try:
                s.sendall(pad[k:k + 10_000])
            except OSError:  # closed under the rest: the answer is already there
                break
        status, head, body = _response(s)
        assert status == 400 and b"spooler-epoch: " in head, (status, head, body)
        doc = json.loads(body)
        assert doc["kind"] == "invalid_argument" and "request head over" in doc["message"], doc
        assert _closed_within(s, 5)
    assert _metric(plain, "spooler_http_heads_too_large_total") == 1
    with _connect(plain) as s:
        s.sendall(b"PUT /v1/queues/heads HTTP/1.1\r\nHost: n\r\n" + AUTH + b"Content-Length: 0\r\n\r\n")
        assert _response(s)[0] == 201
        s.sendall(b"POST /v1/queues/heads/messages HTTP/1.1\r\nHost: n\r\n" + AUTH
                  + b"Content-Length: 200000\r\n\r\n" + b"b" * 200_000)
        assert _response(s)[0] == 201
        chunk = b"c" * 100_000
        s.sendall(b"POST /v1/queues/heads/messages HTTP/1.1\r\nHost: n\r\n" + AUTH
                  + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(chunk) + chunk + b"\r\n0\r\n\r\n")
        assert _response(s)[0] == 201
        s.sendall(b"GET /v1/queues/heads HTTP/1.1\r\nHost: n\r\n" + AUTH + pad[:25 * 1000] + b"\r\n\r\n")
        status, _, body = _response(s)
        assert status == 200 and json.loads(body)["stats"]["visible"] == 2, body
        # after a chunked body (of a length unknown from its head) heads count again
        try:
            s.sendall(b"GET /v1/queues HTTP/1.1\r\nHost: n\r\n" + pad)
        except OSError:
            pass
        assert _response(s)[0] == 400 and _closed_within(s, 5)
